//! Every way a pool request fails, with its one exhaustive mapping to a status and the
//! `{"error":{code,message}}` envelope.
//!
//! | code | status | when |
//! |---|---|---|
//! | `bad_request` | 400 | malformed JSON, a missing selector, a bad trajectory id or timeout |
//! | `forbidden` | 403 | a caller other than root and the service user |
//! | `not_found` | 404 | no such route |
//! | `lease_not_found` | 404 | no active lease matches |
//! | `draining` | 409 | acquire while draining |
//! | `lease_lost` | 410 | the lease's slot died |
//! | `too_large` | 413 | a body over the limit |
//! | (the launcher's) | 4xx | the launcher refused a command or file operation (a bad path) |
//! | `internal` | 500 | a state-machine bug |
//! | `slot_failed` | 502 | the launcher or the gateway failed |
//! | `no_free_slot`, `shutting_down` | 503 | no READY slot; the pool is stopping |

use agentbox_api::ErrorEnvelope;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::backend::BackendError;

/// A failed pool request.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("{0}")]
    BadRequest(String),
    #[error("caller uid {0} may not use the pool's socket")]
    Forbidden(u32),
    #[error("no route {0}")]
    NotFound(String),
    #[error("no active lease for {0}")]
    LeaseNotFound(String),
    #[error("this host is draining: no new leases")]
    Draining,
    #[error("lease {0} is lost: its slot died; release it and acquire again")]
    LeaseLost(String),
    #[error("request body exceeds {0} bytes")]
    TooLarge(u64),
    #[error("{message}")]
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    #[error("internal error: {0}")]
    Internal(String),
    #[error("{0}")]
    SlotFailed(String),
    #[error("no free slot on this host")]
    NoFreeSlot,
    #[error("the pool is shutting down")]
    ShuttingDown,
}

impl From<BackendError> for PoolError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::Refused {
                status,
                code,
                message,
            } => PoolError::Refused {
                status,
                code,
                message,
            },
            BackendError::Failed(m) => PoolError::SlotFailed(m),
        }
    }
}

impl PoolError {
    /// The status and the stable code.
    pub fn status_code(&self) -> (StatusCode, &str) {
        match self {
            PoolError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            PoolError::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            PoolError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            PoolError::LeaseNotFound(_) => (StatusCode::NOT_FOUND, "lease_not_found"),
            PoolError::Draining => (StatusCode::CONFLICT, "draining"),
            PoolError::LeaseLost(_) => (StatusCode::GONE, "lease_lost"),
            PoolError::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            PoolError::Refused { status, code, .. } => (
                StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_REQUEST),
                code.as_str(),
            ),
            PoolError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            PoolError::SlotFailed(_) => (StatusCode::BAD_GATEWAY, "slot_failed"),
            PoolError::NoFreeSlot => (StatusCode::SERVICE_UNAVAILABLE, "no_free_slot"),
            PoolError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
        }
    }
}

impl IntoResponse for PoolError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_code();
        let body = ErrorEnvelope::new(code, self.to_string());
        (status, axum::Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_statuses() {
        for (e, status, code) in [
            (PoolError::LeaseNotFound("t".into()), 404, "lease_not_found"),
            (PoolError::LeaseLost("l".into()), 410, "lease_lost"),
            (PoolError::NoFreeSlot, 503, "no_free_slot"),
            (PoolError::Draining, 409, "draining"),
            (PoolError::BadRequest("x".into()), 400, "bad_request"),
            (
                PoolError::Refused {
                    status: 404,
                    code: "no_such_file".into(),
                    message: "m".into(),
                },
                404,
                "no_such_file",
            ),
        ] {
            let (s, c) = e.status_code();
            assert_eq!((s.as_u16(), c), (status, code));
        }
    }
}
