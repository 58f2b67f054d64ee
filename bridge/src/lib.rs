//! The llm-bridge (`agentbox-bridge`, `127.0.0.1:8790`): the only process that holds provider
//! keys. It takes Anthropic Messages requests whose `model` is an agentbox model id, sanitizes
//! them again, and either passes them to an Anthropic provider or translates them to OpenAI
//! chat completions and the answer back, streaming chunk by chunk.
//!
//! # Layout
//! - [`Bridge`] (this file): the catalogue of remote models with their keys, the upstream
//!   engine, limits; built once from the config and the environment.
//! - `routes`: the axum router: auth, `/health`, `/check/{model}`, `/v1/messages` (key
//!   injection, sanitizing, model lookup; the call itself is `agentbox-llm`'s).
//! - `check`: the `/check` probe.
//! - the accept loop, timeouts and body limits come from `agentbox-http`; calling providers,
//!   translating, streaming and mapping their errors from `agentbox-llm`.
//! - [`error`]: every failure and its one mapping to a status and an Anthropic error body.
//!
//! Keys live in [`Secret`]s: no `Debug`, log line, error body or `/health` output shows them.

#![forbid(unsafe_code)]

mod check;
pub mod error;
mod routes;
mod typed;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use agentbox_llm::{ClientError, ClientOptions, Upstream, Url};
use agentbox_policy::config::{Backend, Config, HostEnv, Provider, Reasoning};
use agentbox_policy::secret::Secret;

pub use error::BridgeError;
pub use routes::router;

/// Why the bridge cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The bridge's own token variable is unset or empty.
    #[error("${0} is not set: the bridge refuses to run without its token")]
    NoToken(String),
    /// The upstream client could not be built (TLS backend failure).
    #[error(transparent)]
    Client(#[from] ClientError),
    /// A model's endpoint (its `base_url` and the provider's path) is not a usable URL.
    #[error("models.{model}.base_url: {reason}")]
    Endpoint {
        /// The model id.
        model: String,
        /// What the URL parser said.
        reason: String,
    },
}

/// One remote model the bridge serves.
#[derive(Debug)]
pub struct RemoteModel {
    /// The agentbox model id.
    pub id: String,
    /// The provider's wire format.
    pub provider: Provider,
    /// The provider's base URL, without a trailing `/`.
    pub base_url: String,
    /// Where its requests go (`<base_url>/chat/completions` or `<base_url>/v1/messages`, by
    /// provider), parsed once at start.
    pub endpoint: Url,
    /// The model name sent upstream.
    pub upstream_model: String,
    /// Cap for `max_tokens`, when configured.
    pub max_output_tokens: Option<u64>,
    /// Whether media with URL sources may pass (`allow_url_sources`).
    pub allow_url_sources: bool,
    /// Where a translated request's `thinking` goes (`reasoning`).
    pub reasoning: Reasoning,
    /// Whether the client's `metadata.user_id` reaches the provider (`forward_user_id`).
    pub forward_user_id: bool,
    /// The variable the key comes from (a name, not a secret: shown in errors).
    pub key_env: String,
    /// The key, when the variable is set.
    pub key: Option<Secret>,
}

/// The bridge's state, shared by every request.
#[derive(Debug)]
pub struct Bridge {
    token: Secret,
    models: BTreeMap<String, RemoteModel>,
    upstream: Upstream,
    max_body_bytes: u64,
    body_timeout: Duration,
}

impl Bridge {
    /// Builds the bridge from the config, reading its token and the provider keys from `env`.
    /// A missing provider key is not fatal (that model answers "no key configured"); a missing
    /// bridge token is.
    pub fn from_config(config: &Config, env: &dyn HostEnv) -> Result<Arc<Bridge>, StartError> {
        let token = env
            .var(&config.bridge.token_env)
            .and_then(Secret::new)
            .ok_or_else(|| StartError::NoToken(config.bridge.token_env.clone()))?;
        let mut models = BTreeMap::new();
        for m in config.models.values() {
            let Backend::Remote {
                upstream_model,
                provider,
                base_url,
                key_env,
            } = &m.backend
            else {
                continue;
            };
            let base_url = base_url.as_str().trim_end_matches('/').to_owned();
            let path = match provider {
                Provider::Openai => "/chat/completions",
                Provider::Anthropic => "/v1/messages",
            };
            let endpoint =
                Url::parse(&format!("{base_url}{path}")).map_err(|e| StartError::Endpoint {
                    model: m.id.to_string(),
                    reason: e.to_string(),
                })?;
            models.insert(
                m.id.to_string(),
                RemoteModel {
                    id: m.id.to_string(),
                    provider: *provider,
                    base_url,
                    endpoint,
                    upstream_model: upstream_model.clone(),
                    max_output_tokens: m.max_output_tokens,
                    allow_url_sources: m.allow_url_sources,
                    reasoning: m.reasoning,
                    forward_user_id: m.forward_user_id,
                    key_env: key_env.clone(),
                    key: env.var(key_env).and_then(Secret::new),
                },
            );
        }
        let upstream = Upstream::new(&ClientOptions::default())?;
        Ok(Arc::new(Bridge {
            token,
            models,
            upstream,
            max_body_bytes: config.bridge.max_body_bytes,
            body_timeout: config.bridge.body_timeout,
        }))
    }

    /// The remote models, by agentbox id.
    pub fn models(&self) -> &BTreeMap<String, RemoteModel> {
        &self.models
    }
}
