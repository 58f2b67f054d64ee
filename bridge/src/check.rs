//! `/check/{model}`: whether a model can be used right now, told apart as "no key configured",
//! "upstream unreachable" and "auth refused" with the cheapest authenticated call both
//! provider APIs have (the model list).

use std::time::Duration;

use agentbox_llm::adapter::DEFAULT_ANTHROPIC_VERSION;
use agentbox_policy::config::Provider;
use axum::http::StatusCode;

use crate::RemoteModel;

/// Why a model cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The key variable is unset.
    #[error("no key configured (${0} is not set)")]
    NoKey(String),
    /// Connecting or talking to the provider failed.
    #[error("upstream unreachable: {0}")]
    Unreachable(String),
    /// The provider refused the key.
    #[error("auth refused: upstream answered {0}")]
    AuthRefused(u16),
    /// The provider answered with another error status.
    #[error("upstream error: status {0}")]
    Status(u16),
}

impl CheckError {
    /// A stable machine-readable reason.
    pub fn reason(&self) -> &'static str {
        match self {
            CheckError::NoKey(_) => "no_key",
            CheckError::Unreachable(_) => "unreachable",
            CheckError::AuthRefused(_) => "auth_refused",
            CheckError::Status(_) => "upstream_error",
        }
    }
}

/// Probes the provider's model list with the model's key.
pub async fn check(client: &reqwest::Client, model: &RemoteModel) -> Result<(), CheckError> {
    let key = model
        .key
        .as_ref()
        .ok_or_else(|| CheckError::NoKey(model.key_env.clone()))?;
    let req = match model.provider {
        Provider::Openai => client
            .get(format!("{}/models", model.base_url))
            .bearer_auth(key.expose()),
        Provider::Anthropic => client
            .get(format!("{}/v1/models", model.base_url))
            .header("x-api-key", key.expose())
            .header("anthropic-version", DEFAULT_ANTHROPIC_VERSION),
    };
    let resp = req
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| CheckError::Unreachable(agentbox_http::error_chain(&e)))?;
    let status = resp.status();
    if status.is_success() {
        Ok(())
    } else if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
        Err(CheckError::AuthRefused(status.as_u16()))
    } else {
        Err(CheckError::Status(status.as_u16()))
    }
}
