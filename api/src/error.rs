//! The error envelope every control route answers a failure with:
//! `{"error": {"code": "<stable snake_case code>", "message": "<human readable>"}}`.
//! Callers branch on `code`; `message` is for people and may change.

use serde::{Deserialize, Serialize};

/// The body of every failed control request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorEnvelope {
    pub error: ApiError,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiError {
    /// Stable, snake_case; each daemon documents its codes next to its error type.
    pub code: String,
    /// For people; untrusted input in it is escaped and shortened by the daemon.
    pub message: String,
}

impl ErrorEnvelope {
    /// The envelope for `code` and `message`.
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        ErrorEnvelope {
            error: ApiError {
                code: code.into(),
                message: message.into(),
            },
        }
    }
}
