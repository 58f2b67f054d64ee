//! The agent behind the server: one trait every backend implements (start, one turn, abort,
//! health, capabilities, optional pause/resume, shutdown), its typed errors, and the factory
//! that maps a `blackbox_type` to an implementation. The server core owns the turn's proxy
//! scope, its deadline and its cancellation; a backend only drives its agent.

pub(crate) mod agent;
pub mod claude_code;
pub mod codex;
pub mod openclaw;
pub mod opencode;

use std::path::PathBuf;
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::Value;

use crate::config::{Bins, ServerConfig};
use crate::error::{ApiError, obj};
use crate::model::{AdapterResponse, BackendCapabilities, Message, Object, RuntimeSystemPrompt};
use crate::proxy::LlmProxy;

/// Backends this server runs.
pub const IMPLEMENTED_BACKENDS: &[&str] = &["opencode", "openclaw", "claude_code", "codex"];

/// Backends the protocol names (the reference runs all four).
pub const KNOWN_BACKENDS: &[&str] = &["opencode", "openclaw", "claude_code", "codex"];

/// Why a backend call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    /// The registration's `backend_options` do not fit the backend (400 at register).
    #[error("{0}")]
    InvalidOptions(String),
    /// The agent could not be reached, or answered an error.
    #[error("{0}")]
    Transport(String),
    /// The agent answered something we cannot read.
    #[error("{0}")]
    Protocol(String),
    /// The agent's process is missing, died, or could not start.
    #[error("{0}")]
    Process(String),
    /// The model's context window was exceeded.
    #[error("{message}")]
    ContextOverflow {
        /// Human text.
        message: String,
        /// `context_window`, `input_tokens`, ... as the router reported them.
        details: Object,
    },
    /// The turn made more model calls than `max_steps`.
    #[error("{message}")]
    MaxSteps {
        /// Human text.
        message: String,
        /// `max_steps`, `attempted_step`, `backend_message`, `raw_error_code`.
        details: Object,
    },
}

impl BackendError {
    /// The proxy's recorded context-overflow payload as an error (`None` if it is not one).
    #[must_use]
    pub fn from_context_overflow(payload: &Value) -> Option<BackendError> {
        let code = payload
            .get("code")
            .filter(|c| !c.is_null())
            .or_else(|| payload.get("error"))
            .and_then(Value::as_str);
        if code != Some("context_overflow") {
            return None;
        }
        let message = payload
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("Dressage proxy context window overflow.")
            .to_owned();
        let mut details = payload
            .get("details")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        details.insert("backend_message".into(), Value::String(message.clone()));
        details.insert("raw_error_code".into(), "context_overflow".into());
        Some(BackendError::ContextOverflow { message, details })
    }

    /// The proxy's recorded max-steps payload as an error (always one: a payload that is not
    /// the expected shape still means the proxy refused a step).
    #[must_use]
    pub fn from_max_steps(payload: &Value) -> BackendError {
        let given = payload
            .get("details")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        let int = |k: &str| given.get(k).and_then(Value::as_u64);
        let max_steps = int("max_steps").unwrap_or(0);
        let message = payload
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("Turn exceeded max_steps.")
            .to_owned();
        let details = obj(serde_json::json!({
            "max_steps": max_steps,
            "attempted_step": int("attempted_step").unwrap_or(max_steps),
            "backend_message": given.get("backend_message").and_then(Value::as_str)
                .unwrap_or(&message),
            "raw_error_code": given.get("raw_error_code").and_then(Value::as_str)
                .unwrap_or("max_steps_exceeded"),
        }));
        BackendError::MaxSteps { message, details }
    }
}

/// What a backend gets at start.
#[derive(Debug, Clone)]
pub struct InitContext {
    /// This registration's directory (the agent's home, logs, pid files).
    pub runtime_dir: PathBuf,
    /// The router's API path (`/v1`): the agent's base URL is the proxy's plus this.
    pub router_api_path: String,
    /// The registration's system prompt.
    pub system_prompt: Option<RuntimeSystemPrompt>,
    /// The effective settings.
    pub config: ServerConfig,
    /// The agent binaries.
    pub bins: Bins,
    /// The in-process proxy every model call goes through.
    pub proxy: LlmProxy,
    /// The registration's bound session (agents that name their session derive it).
    pub bound_session_id: String,
    /// The registration's bound instance.
    pub bound_instance_id: String,
}

/// One turn, as a backend sees it.
#[derive(Debug, Clone, Copy)]
pub struct TurnInput<'a> {
    /// The turn (the proxy's scope is already open for it).
    pub turn_id: &'a str,
    /// The input messages (validated: one user message for opencode).
    pub messages: &'a [Message],
    /// The request's metadata.
    pub metadata: &'a Object,
}

/// An agent.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// What it supports.
    fn capabilities(&self) -> BackendCapabilities;

    /// Starts the agent and waits until it is healthy.
    fn initialize<'a>(&'a self, ctx: &'a InitContext) -> BoxFuture<'a, Result<(), BackendError>>;

    /// Runs one turn to its end. Dropping the future abandons the turn on our side; the
    /// caller then calls [`Backend::abort_session`].
    fn send_message<'a>(
        &'a self,
        turn: TurnInput<'a>,
    ) -> BoxFuture<'a, Result<AdapterResponse, BackendError>>;

    /// Stops the agent's current work (best effort); whether the agent confirmed.
    fn abort_session(&self) -> BoxFuture<'_, bool>;

    /// Whether the agent is alive and answering.
    fn health(&self) -> BoxFuture<'_, bool>;

    /// The agent's own session id, once it has one.
    fn backend_session_id(&self) -> Option<String>;

    /// Pauses the agent's own model traffic, beyond the proxy's hold (default: nothing to do).
    fn pause(&self, _reason: &str) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    /// Undoes [`Backend::pause`].
    fn resume(&self, _reason: &str) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    /// Stops the agent and everything it started, within about `grace`.
    fn shutdown(&self, grace: Duration) -> BoxFuture<'_, ()>;
}

/// The backend for `blackbox_type`, its options checked now (before anything starts).
///
/// # Errors
/// 400 for an unknown or unimplemented type, or options that do not fit.
pub fn create(blackbox_type: &str, backend_options: &Object) -> Result<Box<dyn Backend>, ApiError> {
    fn boxed<B: Backend + 'static>(
        b: Result<B, BackendError>,
    ) -> Result<Box<dyn Backend>, BackendError> {
        b.map(|b| Box::new(b) as Box<dyn Backend>)
    }
    let backend = match blackbox_type {
        "opencode" => boxed(opencode::Opencode::new(backend_options)),
        "openclaw" => boxed(openclaw::OpenClaw::new(backend_options)),
        "claude_code" => {
            boxed(claude_code::Options::parse(backend_options).map(claude_code::ClaudeCode::new))
        }
        "codex" => boxed(codex::Options::parse(backend_options).map(codex::Codex::new)),
        other => {
            let why = if KNOWN_BACKENDS.contains(&other) {
                format!("blackbox_type {other} is not implemented by this server")
            } else {
                format!("Unsupported blackbox_type: {other}")
            };
            Err(BackendError::InvalidOptions(format!(
                "{why} (implemented: {}).",
                IMPLEMENTED_BACKENDS.join(", ")
            )))
        }
    };
    backend.map_err(|e| ApiError::Request {
        message: e.to_string(),
        details: obj(serde_json::json!({"blackbox_type": blackbox_type})),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn proxy_payloads_become_typed_errors() {
        let e = BackendError::from_context_overflow(&json!({
            "error": "context_overflow", "message": "too long",
            "details": {"context_window": 32768, "input_tokens": 40000}
        }))
        .unwrap();
        let BackendError::ContextOverflow { details, .. } = e else {
            panic!("{e:?}")
        };
        assert_eq!(details["context_window"], 32768);
        assert!(BackendError::from_context_overflow(&json!({"error": "other"})).is_none());

        let e = BackendError::from_max_steps(&json!({
            "error": "max_steps_exceeded", "message": "Turn exceeded max_steps.",
            "details": {"max_steps": 2, "attempted_step": 3,
                        "backend_message": "429 Turn exceeded max_steps.",
                        "raw_error_code": "rate_limit_error"}
        }));
        let BackendError::MaxSteps { details, message } = e else {
            panic!("{e:?}")
        };
        assert_eq!(message, "Turn exceeded max_steps.");
        assert_eq!(
            (
                details["max_steps"].as_u64(),
                details["attempted_step"].as_u64()
            ),
            (Some(2), Some(3))
        );
        assert_eq!(details["raw_error_code"], "rate_limit_error");
    }

    #[test]
    fn unknown_types_are_request_errors_naming_the_implemented_ones() {
        let err = create("nope", &Object::new()).unwrap_err();
        let (status, body) = err.render("r");
        assert_eq!(status.as_u16(), 400);
        assert_eq!(body.details["blackbox_type"], "nope");
        for t in IMPLEMENTED_BACKENDS {
            assert!(body.message.contains(t), "{}", body.message);
        }
        assert_eq!(KNOWN_BACKENDS.len(), IMPLEMENTED_BACKENDS.len());
    }
}
