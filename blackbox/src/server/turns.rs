//! Turns and the other session routes: admission under the session lock with
//! `(turn_id, messages hash)` idempotency, the turn's execution in a tracked task (the agent
//! call outside the lock, under a deadline that excludes paused time, raced against the
//! proxy's max-steps refusal), the sync facade, the long poll, cancel, abort, the session
//! view and `execute_cmd`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::{Bound, Server};
use crate::backend::{BackendError, TurnInput, agent};
use crate::error::{ApiError, TurnError, TurnErrorCode, obj};
use crate::hashing::messages_fingerprint;
use crate::model::{
    AbortMode, AbortResponse, AdapterResponse, BackendCapabilities, BackendRef, ExecuteCmdRequest,
    ExecuteCmdResponse, Message, MessageRequest, MessageResponse, Object, Role, SessionResponse,
    SessionState, TurnCancelResponse, TurnStatus, TurnStatusResponse, TurnUsage,
};
use crate::session::{Session, Turn};

/// The longest a long poll waits.
pub const MAX_TURN_WAIT: Duration = Duration::from_secs(60);

/// How long the proxy's turn scope may take to drain after a turn that did not commit.
const FAILED_DRAIN: Duration = Duration::from_secs(2);

/// How long a cancelled agent call may take to notice.
const ABANDON_GRACE: Duration = Duration::from_secs(2);

/// An accepted (or replayed) submission.
#[derive(Debug, Clone)]
pub struct Submission {
    /// The turn.
    pub turn_id: String,
    /// Its status now.
    pub status: TurnStatus,
    /// Whether it existed already.
    pub idempotent_replay: bool,
    /// The bound instance.
    pub instance_id: Option<String>,
}

/// Why a turn's execution did not produce a result.
enum Failure {
    Backend(BackendError),
    Timeout,
    Internal(String),
}

fn invalid_id(field: &str, value: &str) -> ApiError {
    ApiError::Request {
        message: format!("{field} has invalid format."),
        details: obj(json!({field: value})),
    }
}

fn check_id(field: &str, value: &str) -> Result<(), ApiError> {
    if crate::ids::is_valid(value) {
        Ok(())
    } else {
        Err(invalid_id(field, value))
    }
}

/// The reference's input rules, in its order.
fn check_messages(
    messages: &[Message],
    caps: BackendCapabilities,
    blackbox_type: &str,
) -> Result<(), ApiError> {
    let Some(first) = messages.first() else {
        return Err(ApiError::request("messages must not be empty."));
    };
    if !caps.multi_message_input && messages.len() != 1 {
        return Err(ApiError::request(
            "Current backend accepts exactly one input message.",
        ));
    }
    if crate::backend::KNOWN_BACKENDS.contains(&blackbox_type) {
        if first.role != Role::User {
            return Err(ApiError::request(format!(
                "{blackbox_type} phase 1 only accepts a user message."
            )));
        }
        if first.content.as_deref().is_none_or(|c| c.trim().is_empty()) {
            return Err(ApiError::request(format!(
                "{blackbox_type} phase 1 requires non-empty user content."
            )));
        }
    }
    for m in messages {
        if m.role == Role::System {
            return Err(ApiError::request(
                "/messages does not support role=system in phase 1.",
            ));
        }
        let injected = match m.role {
            Role::Assistant | Role::Tool => true,
            Role::System | Role::User => false,
        };
        if !caps.history_injection && injected {
            return Err(ApiError::request(
                "Current backend does not support assistant/tool history injection.",
            ));
        }
    }
    Ok(())
}

fn turn_details(session_id: &str, turn_id: &str, extra: Option<Object>) -> Object {
    let mut d = obj(json!({"session_id": session_id, "turn_id": turn_id}));
    if let Some(extra) = extra {
        d.extend(extra);
    }
    d
}

/// A closed session refuses turns and commands.
fn refuse_closed(session_id: &str, state: SessionState, what: &str) -> Result<(), ApiError> {
    let word = match state {
        SessionState::Active => return Ok(()),
        SessionState::Aborted => "has been aborted",
        SessionState::Desynced => "is desynced",
    };
    Err(ApiError::conflict(
        format!("Session {word} and cannot {what}."),
        json!({"session_id": session_id, "state": state}),
    ))
}

impl Server {
    /// The bound session, for routes that need the server ready.
    fn bound_session(&self, session_id: &str) -> Result<Arc<Session>, ApiError> {
        let bound_id = self.bound_session_id(session_id)?;
        self.session(&bound_id).ok_or_else(|| ApiError::Internal {
            message: "Bound session was not initialized.".into(),
            details: obj(json!({"session_id": bound_id})),
        })
    }

    /// The bound session's id, checked against `session_id` (409 when it is another one).
    fn bound_session_id(&self, session_id: &str) -> Result<String, ApiError> {
        self.check_bound_session(session_id)?
            .ok_or_else(|| ApiError::Internal {
                message: "Rollout binding is missing bound_session_id.".into(),
                details: Object::new(),
            })
    }

    /// The session, for routes that also answer without a binding (404 then).
    fn any_session(&self, session_id: &str) -> Result<Arc<Session>, ApiError> {
        check_id("session_id", session_id)?;
        let id = self
            .check_bound_session(session_id)?
            .unwrap_or_else(|| session_id.to_owned());
        self.session(&id)
            .ok_or_else(|| ApiError::no_session(session_id))
    }

    /// Accepts a turn (or replays an existing one) and starts its execution.
    ///
    /// # Errors
    /// As the reference: 503 not ready / agent down, 400 bad input, 409 conflicts, 429 turn
    /// limit.
    pub async fn submit(
        &self,
        session_id: &str,
        req: &MessageRequest,
    ) -> Result<Submission, ApiError> {
        self.ready()?;
        tokio::select! {
            () = self.inner.pause.wait_resumed() => {}
            () = self.inner.shutdown.cancelled() => {
                return Err(ApiError::unavailable("Server is shutting down."));
            }
        }
        let bound = self.ready()?;
        check_id("session_id", session_id)?;
        if let Some(t) = &req.turn_id {
            check_id("turn_id", t)?;
        }
        check_messages(&req.messages, bound.capabilities, &bound.info.blackbox_type)?;
        let session = self.bound_session(session_id)?;
        let instance_id = Some(bound.info.bound_instance_id.clone());
        // The gate waits for a running execute_cmd and keeps other submissions out until this
        // one is admitted.
        let _gate = Arc::clone(&session.gate).lock_owned().await;
        let (turn_id, fingerprint) = {
            let mut d = session.lock();
            refuse_closed(session_id, d.state, "accept new turns")?;
            if d.turn_count >= bound.config.max_turns {
                return Err(ApiError::TooManyTurns {
                    details: obj(json!({"session_id": session_id,
                                        "max_turns": bound.config.max_turns})),
                });
            }
            let turn_id = d.resolve_turn_id(session_id, req.turn_id.as_deref())?;
            let fingerprint = messages_fingerprint(&req.messages);
            if let Some(existing) = d.turn(&turn_id) {
                if existing.record.request_fingerprint != fingerprint {
                    return Err(ApiError::conflict(
                        "Same turn_id was already used with a different request body.",
                        json!({"session_id": session_id, "turn_id": turn_id}),
                    ));
                }
                // Committed: replay; queued/inflight: re-attach; other terminal: as is.
                return Ok(Submission {
                    turn_id,
                    status: existing.record.status,
                    idempotent_replay: true,
                    instance_id,
                });
            }
            if let Some(active) = d.active_turn() {
                return Err(ApiError::conflict(
                    "Session already has an active turn in progress.",
                    json!({"session_id": session_id, "turn_id": turn_id,
                           "active_turn_id": active.record.turn_id}),
                ));
            }
            (turn_id, fingerprint)
        };
        if !self.healthy_with_retry(&bound, "before_send_message").await {
            self.mark_backend_error("adapter_healthcheck_failed");
            return Err(ApiError::unavailable("Backend is unavailable."));
        }
        let cancel = {
            let mut d = session.lock();
            // The health check awaited: the monitor or an abort may have closed the session.
            refuse_closed(session_id, d.state, "accept new turns")?;
            let turn = Turn::queued(turn_id.clone(), fingerprint, req.messages.clone());
            let cancel = turn.cancel.clone();
            d.turns.push(turn);
            d.touch();
            cancel
        };
        let server = self.clone();
        let (sid, tid) = (session.id.clone(), turn_id.clone());
        let (messages, metadata) = (req.messages.clone(), req.metadata.clone());
        self.inner.tasks.spawn(async move {
            server
                .run_turn(bound, session, sid, tid, messages, metadata, cancel)
                .await;
        });
        Ok(Submission {
            turn_id,
            status: TurnStatus::Queued,
            idempotent_replay: false,
            instance_id,
        })
    }

    /// The sync facade: submits, waits for the turn to settle, answers its result or its
    /// stored error (with the status a sync caller always gets for it).
    ///
    /// # Errors
    /// As [`Server::submit`], or the turn's error.
    pub async fn send_message(
        &self,
        session_id: &str,
        req: &MessageRequest,
    ) -> Result<MessageResponse, ApiError> {
        let sub = self.submit(session_id, req).await?;
        let session = self.bound_session(session_id)?;
        let done = session.lock().turn(&sub.turn_id).map(Turn::watch_done);
        if let Some(mut done) = done {
            // The turn's task always ends it (shutdown included), so this returns.
            let _ = done.wait_for(|d| *d).await;
        }
        let blackbox_type = self.binding_type();
        let d = session.lock();
        let turn = d.turn(&sub.turn_id).ok_or_else(|| ApiError::Internal {
            message: "Turn record disappeared before completion.".into(),
            details: obj(json!({"session_id": session_id, "turn_id": sub.turn_id})),
        })?;
        match (&turn.record.status, &turn.record.response) {
            (TurnStatus::Committed, Some(resp)) => Ok(MessageResponse {
                request_id: String::new(),
                session_id: session_id.to_owned(),
                instance_id: sub.instance_id,
                turn_id: turn.record.turn_id.clone(),
                state: d.state,
                idempotent_replay: sub.idempotent_replay,
                outputs: resp.outputs.clone(),
                backend: BackendRef {
                    kind: blackbox_type,
                    backend_session_id: Some(resp.backend_session_id.clone()),
                },
                usage: resp.usage,
            }),
            _ => Err(ApiError::Turn(turn.record.error.clone().unwrap_or_else(
                || TurnError {
                    code: TurnErrorCode::BackendError,
                    message: "Turn failed.".into(),
                    details: turn_details(session_id, &turn.record.turn_id, None),
                },
            ))),
        }
    }

    fn binding_type(&self) -> String {
        self.core()
            .bound
            .as_ref()
            .map(|b| b.info.blackbox_type.clone())
            .unwrap_or_default()
    }

    /// A turn's execution (its own task; never holds the session lock across the agent call).
    #[allow(clippy::too_many_arguments)]
    async fn run_turn(
        self,
        bound: Arc<Bound>,
        session: Arc<Session>,
        session_id: String,
        turn_id: String,
        messages: Vec<Message>,
        metadata: Object,
        cancel: tokio_util::sync::CancellationToken,
    ) {
        {
            let mut d = session.lock();
            match d.turn_mut(&turn_id) {
                Some(t) if t.record.status == TurnStatus::Queued => {
                    if let Err(e) = t.start() {
                        tracing::error!(error = %e, "turn start");
                        return;
                    }
                }
                // Cancelled (or aborted) while queued.
                Some(_) | None => return,
            }
        }
        let mut outcome = tokio::select! {
            biased;
            () = cancel.cancelled() => None,
            r = self.drive(&bound, &turn_id, &messages, &metadata) => Some(r),
        };
        // A turn that ran to its end waits for its model calls still in flight (a tool may
        // have started one that outlives the agent), so its counts are whole; for at most
        // the backend_timeout a turn has (of unpaused time), and a cancel still ends it.
        if matches!(outcome, Some(Ok(_))) {
            let limit = Some(bound.config.backend_timeout());
            outcome = tokio::select! {
                biased;
                () = cancel.cancelled() => None,
                drained = bound.proxy.try_drain_turn(limit) => {
                    if drained { outcome } else { Some(Err(Failure::Timeout)) }
                }
            };
            // A call that ended meanwhile may have been refused by the router.
            if matches!(outcome, Some(Ok(_)))
                && let Err(e) = agent::proxy_errors(&bound.proxy).await
            {
                outcome = Some(Err(Failure::Backend(e)));
            }
        }
        let committed = matches!(outcome, Some(Ok(_)));
        // Whatever happened, the proxy's scope for this turn closes here.
        if !committed {
            bound.proxy.drain_turn(Some(FAILED_DRAIN)).await;
        }
        let counts = bound.proxy.clear_turn().await;
        match outcome {
            None => self.finish_interrupted(&session, &session_id, &turn_id),
            Some(Ok(mut resp)) => {
                if let Some(c) = counts {
                    resp.usage = TurnUsage {
                        total_tokens: c.total_tokens,
                        input_tokens: c.input_tokens,
                        output_tokens: c.output_tokens,
                        reasoning_tokens: c.reasoning_tokens,
                        steps: c.steps,
                        tool_calls: c.tool_calls,
                    };
                }
                let mut d = session.lock();
                let Some(t) = d
                    .turn_mut(&turn_id)
                    .filter(|t| t.record.status == TurnStatus::Inflight)
                else {
                    // Aborted while in flight: the result is not committed.
                    return;
                };
                let outputs = resp.outputs.clone();
                let trace = resp.trace_events.clone();
                let agent_session = resp.backend_session_id.clone();
                if let Err(e) = t.commit(resp) {
                    tracing::error!(error = %e, "turn commit");
                    return;
                }
                d.backend_session_id = Some(agent_session);
                d.history.extend(messages);
                d.history.extend(outputs);
                d.trace.extend(trace);
                d.turn_count += 1;
                d.touch();
            }
            Some(Err(failure)) => {
                self.finish_unknown(&bound, &session, &session_id, &turn_id, failure)
                    .await;
            }
        }
    }

    /// Runs the turn in the agent: open the proxy scope, call the backend within the
    /// deadline, stop early when the proxy refuses a step for max_steps.
    async fn drive(
        &self,
        bound: &Bound,
        turn_id: &str,
        messages: &[Message],
        metadata: &Object,
    ) -> Result<AdapterResponse, Failure> {
        let agent_session = bound.backend.backend_session_id();
        bound
            .proxy
            .open_turn(turn_id, agent_session.as_deref())
            .await
            .map_err(|e| Failure::Internal(format!("cannot open the proxy's turn: {e}")))?;
        let input = TurnInput {
            turn_id,
            messages,
            metadata,
        };
        let work = async {
            // These two lines (their log timestamps) are what `bench turns` splits a turn's
            // time with: before them and after them is the server's, between is the agent's.
            tracing::debug!(turn = turn_id, "agent call started");
            let mut send = std::pin::pin!(bound.backend.send_message(input));
            let max_steps = async {
                match bound.proxy.wait_for_max_steps_error(None).await {
                    Some(p) => p,
                    None => std::future::pending().await,
                }
            };
            let result = tokio::select! {
                r = &mut send => r,
                payload = max_steps => {
                    // The agent would retry the 429 forever: stop it, then stop waiting.
                    bound.backend.abort_session().await;
                    let _ = tokio::time::timeout(ABANDON_GRACE, &mut send).await;
                    return Err(BackendError::from_max_steps(&payload));
                }
            };
            tracing::debug!(turn = turn_id, ok = result.is_ok(), "agent call returned");
            // What the router refused explains the turn's end, whatever the agent made of it:
            // Claude Code takes the proxy's empty answer to a preempted generation as the
            // end of its turn and exits 0, and an overflow as an error of its own.
            agent::proxy_errors(&bound.proxy).await?;
            let resp = result?;
            if let Some(p) = bound.proxy.consume_max_steps_error().await {
                return Err(BackendError::from_max_steps(&p));
            }
            Ok(resp)
        };
        match self
            .inner
            .pause
            .within(bound.config.backend_timeout(), work)
            .await
        {
            None => Err(Failure::Timeout),
            Some(Ok(r)) => Ok(r),
            Some(Err(e)) => Err(Failure::Backend(e)),
        }
    }

    /// A turn whose task was cancelled: `cancelled` (by a client), or `unknown` with the
    /// session desynced when the server is shutting down.
    fn finish_interrupted(&self, session: &Session, session_id: &str, turn_id: &str) {
        let shutting = self
            .inner
            .shutdown_started
            .load(std::sync::atomic::Ordering::SeqCst);
        let mut d = session.lock();
        let Some(t) = d.turn_mut(turn_id).filter(|t| t.record.status.is_active()) else {
            return;
        };
        let details = turn_details(session_id, turn_id, None);
        let ended = if shutting {
            t.end(
                TurnStatus::Unknown,
                TurnError {
                    code: TurnErrorCode::ServerShutdown,
                    message: "Server shut down while the turn was in flight.".into(),
                    details,
                },
            )
        } else {
            t.end(
                TurnStatus::Cancelled,
                TurnError {
                    code: TurnErrorCode::Cancelled,
                    message: "Turn cancelled while in flight.".into(),
                    details,
                },
            )
        };
        if let Err(e) = ended {
            tracing::error!(error = %e, "turn end");
        }
        if shutting {
            d.set_state(SessionState::Desynced);
        }
        d.touch();
    }

    /// A turn that failed: `unknown`, the session desynced, the agent told to stop; if the
    /// agent is then unhealthy (or its process failed) the server is in error.
    async fn finish_unknown(
        &self,
        bound: &Bound,
        session: &Session,
        session_id: &str,
        turn_id: &str,
        failure: Failure,
    ) {
        let (code, message, extra, process) = match failure {
            Failure::Timeout => (
                TurnErrorCode::BackendTimeout,
                "Backend call exceeded backend_timeout.".to_owned(),
                None,
                false,
            ),
            Failure::Internal(m) => (
                TurnErrorCode::InternalError,
                format!("Unexpected backend failure: {m}"),
                None,
                false,
            ),
            Failure::Backend(BackendError::ContextOverflow { message, details }) => (
                TurnErrorCode::ContextOverflow,
                message,
                Some(details),
                false,
            ),
            Failure::Backend(BackendError::MaxSteps { message, details }) => (
                TurnErrorCode::MaxStepsExceeded,
                message,
                Some(details),
                false,
            ),
            Failure::Backend(e @ BackendError::Process(_)) => (
                TurnErrorCode::BackendError,
                format!("Backend request failed: {e}"),
                None,
                true,
            ),
            Failure::Backend(
                e @ (BackendError::Transport(_)
                | BackendError::Protocol(_)
                | BackendError::InvalidOptions(_)),
            ) => (
                TurnErrorCode::BackendError,
                format!("Backend request failed: {e}"),
                None,
                false,
            ),
        };
        tracing::warn!(turn_id, code = code.as_str(), %message, "turn ended unknown");
        {
            let mut d = session.lock();
            let Some(t) = d
                .turn_mut(turn_id)
                .filter(|t| t.record.status == TurnStatus::Inflight)
            else {
                return;
            };
            let error = TurnError {
                code,
                message,
                details: turn_details(session_id, turn_id, extra),
            };
            if let Err(e) = t.end(TurnStatus::Unknown, error) {
                tracing::error!(error = %e, "turn end");
            }
            d.set_state(SessionState::Desynced);
            d.touch();
        }
        bound.backend.abort_session().await;
        if !self.healthy_with_retry(bound, "unknown_turn").await {
            self.mark_backend_error(code.as_str());
        }
        if process {
            self.mark_backend_error("backend_process_error");
        }
    }

    /// `GET /v1/sessions/{id}/turns/{turn_id}?wait=`: the turn's snapshot, after waiting up
    /// to `wait` (clamped to 60 s) for an active turn to settle; never a timeout error.
    ///
    /// # Errors
    /// 400 bad ids, 409 another session, 404 unknown session or turn.
    pub async fn get_turn(
        &self,
        session_id: &str,
        turn_id: &str,
        wait: Duration,
    ) -> Result<TurnStatusResponse, ApiError> {
        check_id("session_id", session_id)?;
        check_id("turn_id", turn_id)?;
        let session = self.any_session(session_id)?;
        let done = {
            let d = session.lock();
            let t = d
                .turn(turn_id)
                .ok_or_else(|| ApiError::no_turn(session_id, turn_id))?;
            t.record.status.is_active().then(|| t.watch_done())
        };
        if let Some(mut done) = done.filter(|_| !wait.is_zero()) {
            let wait = wait.min(MAX_TURN_WAIT);
            tokio::select! {
                _ = tokio::time::timeout(wait, done.wait_for(|d| *d)) => {}
                () = self.inner.shutdown.cancelled() => {}
            }
        }
        let blackbox_type = self.binding_type();
        let instance_id = self.instance_id();
        let d = session.lock();
        let t = d
            .turn(turn_id)
            .ok_or_else(|| ApiError::no_turn(session_id, turn_id))?;
        let committed = t.record.status == TurnStatus::Committed;
        let resp = t.record.response.as_ref().filter(|_| committed);
        Ok(TurnStatusResponse {
            request_id: String::new(),
            session_id: session_id.to_owned(),
            instance_id,
            turn_id: t.record.turn_id.clone(),
            status: t.record.status,
            state: d.state,
            outputs: resp.map(|r| r.outputs.clone()),
            usage: resp.map(|r| r.usage),
            backend: resp.map(|r| BackendRef {
                kind: blackbox_type,
                backend_session_id: Some(r.backend_session_id.clone()),
            }),
            error: if t.record.status.is_active() || committed {
                None
            } else {
                t.record.error.as_ref().map(TurnError::body)
            },
            created_at: t.record.created_at,
            updated_at: t.record.updated_at,
        })
    }

    /// `POST .../turns/{turn_id}/cancel`: a queued turn is cancelled at once, an inflight one
    /// is cancelled best effort (`cancel_requested`), a terminal one answers its status.
    ///
    /// # Errors
    /// 400 bad ids, 409 another session, 404 unknown session or turn.
    pub async fn cancel_turn(
        &self,
        session_id: &str,
        turn_id: &str,
    ) -> Result<TurnCancelResponse, ApiError> {
        check_id("session_id", session_id)?;
        check_id("turn_id", turn_id)?;
        let session = self.any_session(session_id)?;
        let (status, state, inflight) = {
            let mut d = session.lock();
            let t = d
                .turn_mut(turn_id)
                .ok_or_else(|| ApiError::no_turn(session_id, turn_id))?;
            let (status, inflight) = match t.record.status {
                TurnStatus::Queued => {
                    let error = TurnError {
                        code: TurnErrorCode::Cancelled,
                        message: "Turn cancelled before execution.".into(),
                        details: turn_details(session_id, turn_id, None),
                    };
                    if let Err(e) = t.end(TurnStatus::Cancelled, error) {
                        tracing::error!(error = %e, "turn cancel");
                    }
                    t.cancel.cancel();
                    ("cancelled".to_owned(), false)
                }
                TurnStatus::Inflight => {
                    t.cancel.cancel();
                    ("cancel_requested".to_owned(), true)
                }
                s @ (TurnStatus::Committed
                | TurnStatus::Failed
                | TurnStatus::Cancelled
                | TurnStatus::Unknown) => (s.as_str().to_owned(), false),
            };
            if !inflight {
                d.touch();
            }
            (status, d.state, inflight)
        };
        if inflight {
            self.abort_agent().await;
        }
        Ok(TurnCancelResponse {
            request_id: String::new(),
            session_id: session_id.to_owned(),
            instance_id: self.instance_id(),
            turn_id: turn_id.to_owned(),
            status,
            state,
        })
    }

    /// `POST /v1/sessions/{id}/abort`: kills a running command, cancels the active turn
    /// (recorded unknown, `aborted`), tells the agent to stop, and ends the session.
    ///
    /// # Errors
    /// 400 bad id, 409 another session, 404 unknown session.
    pub async fn abort(&self, session_id: &str) -> Result<AbortResponse, ApiError> {
        let session = self.any_session(session_id)?;
        crate::exec::kill_published(&session.cmd);
        let (state, mode) = {
            let mut d = session.lock();
            if d.state == SessionState::Aborted {
                (d.state, AbortMode::Noop)
            } else {
                d.set_state(SessionState::Aborted);
                for t in d.turns.iter_mut().filter(|t| t.record.status.is_active()) {
                    t.cancel.cancel();
                    let error = TurnError {
                        code: TurnErrorCode::Aborted,
                        message: "Session was aborted while turn was in flight.".into(),
                        details: turn_details(session_id, &t.record.turn_id, None),
                    };
                    if let Err(e) = t.end(TurnStatus::Unknown, error) {
                        tracing::error!(error = %e, "turn abort");
                    }
                }
                (d.state, AbortMode::BestEffort)
            }
        };
        if mode == AbortMode::BestEffort {
            self.abort_agent().await;
        }
        Ok(AbortResponse {
            request_id: String::new(),
            session_id: session_id.to_owned(),
            instance_id: self.instance_id(),
            action: "abort",
            state,
            mode,
        })
    }

    /// Tells the bound agent to stop its current work (best effort).
    async fn abort_agent(&self) {
        let bound = self.core().bound.clone();
        if let Some(b) = bound {
            b.backend.abort_session().await;
        }
    }

    /// `GET /v1/sessions/{id}`.
    ///
    /// # Errors
    /// 400 bad id, 409 another session, 404 unknown session.
    pub fn get_session(
        &self,
        session_id: &str,
        history: bool,
        trace: bool,
        turns: bool,
    ) -> Result<SessionResponse, ApiError> {
        let session = self.any_session(session_id)?;
        let instance_id = self.instance_id();
        let d = session.lock();
        Ok(SessionResponse {
            request_id: String::new(),
            session_id: session.id.clone(),
            instance_id,
            state: d.state,
            blackbox_type: d.blackbox_type.clone(),
            backend_session_id: d.backend_session_id.clone(),
            message_count: d.history.len(),
            turn_count: d.turn_count,
            created_at: d.created_at,
            updated_at: d.updated_at,
            conversation_history: history.then(|| d.history.clone()),
            trace_events: trace.then(|| d.trace.clone()),
            turn_ledger: turns.then(|| {
                d.turns
                    .iter()
                    .map(|t| {
                        (
                            t.record.turn_id.clone(),
                            serde_json::to_value(t.ledger_entry()).unwrap_or(Value::Null),
                        )
                    })
                    .collect()
            }),
        })
    }

    /// `POST /v1/sessions/{id}/execute_cmd`: a shell line in the sandbox, refused while a
    /// turn is queued or inflight. The command runs in a tracked task, so a client that hangs
    /// up does not leave it half-supervised.
    ///
    /// # Errors
    /// 503 not ready, 400 bad input, 409 closed session / active turn, 502 cannot start.
    pub async fn execute_cmd(
        &self,
        session_id: &str,
        req: &ExecuteCmdRequest,
    ) -> Result<ExecuteCmdResponse, ApiError> {
        let bound = self.ready()?;
        check_id("session_id", session_id)?;
        let cmd = req.cmd.trim().to_owned();
        if cmd.is_empty() {
            return Err(ApiError::request("cmd must not be empty."));
        }
        if cmd.contains(['\n', '\r', '\0']) {
            return Err(ApiError::request("cmd must be a single-line command."));
        }
        let timeout = crate::config::secs(req.timeout.unwrap_or(bound.config.execute_cmd_timeout));
        let bound_id = self.bound_session_id(session_id)?;
        let session = self
            .session(&bound_id)
            .ok_or_else(|| ApiError::no_session(&bound_id))?;
        let gate = Arc::clone(&session.gate).lock_owned().await;
        {
            let d = session.lock();
            match d.state {
                SessionState::Aborted => {
                    refuse_closed(session_id, d.state, "execute commands")?;
                }
                SessionState::Desynced if !d.allows_post_agent_commands() => {
                    refuse_closed(session_id, d.state, "execute commands")?;
                }
                SessionState::Desynced | SessionState::Active => {}
            }
            if let Some(active) = d.active_turn() {
                return Err(ApiError::conflict(
                    "Session has an active turn in progress and cannot execute commands.",
                    json!({"session_id": session_id, "active_turn_id": active.record.turn_id}),
                ));
            }
        }
        let slot = session.cmd.clone();
        let task_session = Arc::clone(&session);
        let line = cmd.clone();
        let run = self.inner.tasks.spawn(async move {
            let out = crate::exec::run_shell(&line, timeout, &slot).await;
            task_session.lock().touch();
            drop(gate);
            out
        });
        let out = run
            .await
            .map_err(|e| ApiError::Internal {
                message: format!("execute_cmd task failed: {e}"),
                details: Object::new(),
            })?
            .map_err(|e| ApiError::Backend {
                message: format!("execute_cmd failed: Failed to start execute_cmd process: {e}"),
                details: obj(json!({"session_id": session_id})),
            })?;
        Ok(ExecuteCmdResponse {
            request_id: String::new(),
            session_id: session_id.to_owned(),
            instance_id: self.instance_id(),
            result: out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> BackendCapabilities {
        crate::backend::opencode::CAPABILITIES
    }

    fn msg(role: Role, content: &str) -> Message {
        Message::text(role, Some(content.into()))
    }

    #[test]
    fn input_rules_in_the_reference_order() {
        let err = |m: &[Message]| match check_messages(m, caps(), "opencode") {
            Err(ApiError::Request { message, .. }) => message,
            other => panic!("{other:?}"),
        };
        assert_eq!(err(&[]), "messages must not be empty.");
        assert_eq!(
            err(&[msg(Role::User, "a"), msg(Role::User, "b")]),
            "Current backend accepts exactly one input message."
        );
        assert_eq!(
            err(&[msg(Role::System, "be nice")]),
            "opencode phase 1 only accepts a user message."
        );
        assert_eq!(
            err(&[msg(Role::User, "  ")]),
            "opencode phase 1 requires non-empty user content."
        );
        assert!(check_messages(&[msg(Role::User, "hi")], caps(), "opencode").is_ok());
        let multi = BackendCapabilities {
            multi_message_input: true,
            ..caps()
        };
        let Err(ApiError::Request { message, .. }) = check_messages(
            &[msg(Role::User, "hi"), msg(Role::System, "x")],
            multi,
            "opencode",
        ) else {
            panic!()
        };
        assert_eq!(
            message,
            "/messages does not support role=system in phase 1."
        );
    }
}
