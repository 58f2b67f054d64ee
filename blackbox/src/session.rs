//! A session and its turn ledger: the state machines (session `active → desynced | aborted`,
//! `desynced → aborted`; turn `queued → inflight → committed | failed | cancelled | unknown`)
//! with their transitions checked in one place, each turn's completion signal (sync callers
//! and long polls wait on it) and cancellation token, and the store of sessions.
//!
//! The session's data sits behind a synchronous mutex that is never held across an `await`;
//! `gate` (async) serializes turn admission with `execute_cmd`, which holds it while its
//! command runs, as the reference's session lock does.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::error::{ApiError, TurnError};
use crate::exec::GroupSlot;
use crate::model::{
    AdapterResponse, Message, SessionState, SessionStats, Timestamp, TraceEvent, TurnRecord,
    TurnStatus,
};

/// How a session names its turns: fixed by its first turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnIdMode {
    /// No turn yet.
    Unset,
    /// The first turn came without an id; this generated one is the session's only turn id.
    Single(String),
    /// Turns carry their own ids.
    Explicit,
}

/// A turn: its record (with the typed error) plus what waiters and cancellers need.
#[derive(Debug)]
pub struct Turn {
    /// Its id, input, status, result or error and times.
    pub record: TurnRecord<TurnError>,
    /// Becomes `true` when the turn reaches a terminal status.
    done: watch::Sender<bool>,
    /// Cancels its execution task.
    pub cancel: CancellationToken,
}

/// A transition the state machine does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("turn cannot go from {from:?} to {to:?}")]
pub struct InvalidTransition {
    /// Current status.
    pub from: TurnStatus,
    /// Refused status.
    pub to: TurnStatus,
}

impl Turn {
    /// A new queued turn.
    #[must_use]
    pub fn queued(turn_id: String, fingerprint: String, messages: Vec<Message>) -> Turn {
        let now = Timestamp::now();
        Turn {
            record: TurnRecord {
                turn_id,
                request_fingerprint: fingerprint,
                status: TurnStatus::Queued,
                request_messages: messages,
                response: None,
                error: None,
                created_at: now,
                updated_at: now,
            },
            done: watch::channel(false).0,
            cancel: CancellationToken::new(),
        }
    }

    fn go(&mut self, to: TurnStatus) -> Result<(), InvalidTransition> {
        let r = &mut self.record;
        if !r.status.can_become(to) {
            return Err(InvalidTransition { from: r.status, to });
        }
        r.status = to;
        r.updated_at = Timestamp::now();
        if !to.is_active() {
            self.done.send_replace(true);
        }
        Ok(())
    }

    /// `queued → inflight`.
    ///
    /// # Errors
    /// When the turn is not queued.
    pub fn start(&mut self) -> Result<(), InvalidTransition> {
        self.go(TurnStatus::Inflight)
    }

    /// `inflight → committed` with its result.
    ///
    /// # Errors
    /// When the turn is not inflight.
    pub fn commit(&mut self, response: AdapterResponse) -> Result<(), InvalidTransition> {
        self.go(TurnStatus::Committed)?;
        self.record.response = Some(response);
        Ok(())
    }

    /// Ends the turn as `to` (`failed`, `cancelled`, `unknown`) with `error`.
    ///
    /// # Errors
    /// When the turn cannot reach `to` from where it is.
    pub fn end(&mut self, to: TurnStatus, error: TurnError) -> Result<(), InvalidTransition> {
        self.go(to)?;
        self.record.error = Some(error);
        Ok(())
    }

    /// A receiver that sees `true` once the turn is terminal.
    #[must_use]
    pub fn watch_done(&self) -> watch::Receiver<bool> {
        self.done.subscribe()
    }

    /// The `include_turns` form.
    #[must_use]
    pub fn ledger_entry(&self) -> TurnRecord {
        self.record.map_error(TurnError::body)
    }
}

/// A session's mutable data.
#[derive(Debug)]
pub struct SessionData {
    /// Its state.
    pub state: SessionState,
    /// The backend type.
    pub blackbox_type: String,
    /// The agent's session id (set when a turn commits).
    pub backend_session_id: Option<String>,
    /// Every committed turn's input and outputs (after the system prompt, if any).
    pub history: Vec<Message>,
    /// Agent events.
    pub trace: Vec<TraceEvent>,
    /// Turns in submission order.
    pub turns: Vec<Turn>,
    /// Committed turns.
    pub turn_count: u64,
    /// Created.
    pub created_at: Timestamp,
    /// Last change.
    pub updated_at: Timestamp,
    /// How turns are named.
    pub turn_ids: TurnIdMode,
}

impl SessionData {
    /// Moves the session to `to` if the state machine allows it; whether it moved.
    pub fn set_state(&mut self, to: SessionState) -> bool {
        if !self.state.can_become(to) {
            return false;
        }
        self.state = to;
        self.touch();
        true
    }

    /// Marks a change.
    pub fn touch(&mut self) {
        self.updated_at = Timestamp::now();
    }

    /// The turn `turn_id`.
    #[must_use]
    pub fn turn(&self, turn_id: &str) -> Option<&Turn> {
        self.turns.iter().find(|t| t.record.turn_id == turn_id)
    }

    /// The turn `turn_id`, mutable.
    pub fn turn_mut(&mut self, turn_id: &str) -> Option<&mut Turn> {
        self.turns.iter_mut().find(|t| t.record.turn_id == turn_id)
    }

    /// The queued or inflight turn, if any (at most one).
    #[must_use]
    pub fn active_turn(&self) -> Option<&Turn> {
        self.turns.iter().find(|t| t.record.status.is_active())
    }

    /// Whether `execute_cmd` may run although the session is desynced: its latest turn stopped
    /// for a known, non-retryable reason (context overflow, max steps).
    #[must_use]
    pub fn allows_post_agent_commands(&self) -> bool {
        if self.state != SessionState::Desynced {
            return false;
        }
        let latest = self.turns.iter().max_by(|a, b| {
            (a.record.updated_at, a.record.created_at, &a.record.turn_id).cmp(&(
                b.record.updated_at,
                b.record.created_at,
                &b.record.turn_id,
            ))
        });
        latest.is_some_and(|t| {
            t.record.status == TurnStatus::Unknown
                && t.record
                    .error
                    .as_ref()
                    .is_some_and(|e| e.code.allows_post_agent_commands())
        })
    }

    /// The turn id a request resolves to: its own, or (in single-turn mode) the generated
    /// one. The first turn fixes the mode.
    ///
    /// # Errors
    /// 400 for a missing id in explicit mode, 409 for a new id in single-turn mode.
    pub fn resolve_turn_id(
        &mut self,
        session_id: &str,
        requested: Option<&str>,
    ) -> Result<String, ApiError> {
        match (&self.turn_ids, requested) {
            (TurnIdMode::Explicit, None) => Err(ApiError::Request {
                message: "turn_id is required after this session has used explicit turn ids."
                    .into(),
                details: crate::error::obj(serde_json::json!({"session_id": session_id})),
            }),
            (TurnIdMode::Single(id), None) => Ok(id.clone()),
            (TurnIdMode::Unset, None) => {
                let id = crate::ids::turn_id();
                self.turn_ids = TurnIdMode::Single(id.clone());
                Ok(id)
            }
            (TurnIdMode::Single(id), Some(given)) if id == given => Ok(id.clone()),
            (TurnIdMode::Single(id), Some(given)) => Err(ApiError::conflict(
                "This session uses a generated single-turn id and cannot accept a new turn_id.",
                serde_json::json!({"session_id": session_id, "expected_turn_id": id,
                                   "actual_turn_id": given}),
            )),
            (TurnIdMode::Unset, Some(given)) => {
                self.turn_ids = TurnIdMode::Explicit;
                Ok(given.to_owned())
            }
            (TurnIdMode::Explicit, Some(given)) => Ok(given.to_owned()),
        }
    }
}

/// A session.
#[derive(Debug)]
pub struct Session {
    /// Its id.
    pub id: String,
    data: Mutex<SessionData>,
    /// Held by `execute_cmd` while its command runs, and by turn admission.
    pub gate: Arc<tokio::sync::Mutex<()>>,
    /// The running command's process group.
    pub cmd: GroupSlot,
}

impl Session {
    /// A new active session.
    #[must_use]
    pub fn new(
        id: String,
        blackbox_type: String,
        history: Vec<Message>,
        trace: Vec<TraceEvent>,
    ) -> Session {
        let now = Timestamp::now();
        Session {
            id,
            data: Mutex::new(SessionData {
                state: SessionState::Active,
                blackbox_type,
                backend_session_id: None,
                history,
                trace,
                turns: Vec::new(),
                turn_count: 0,
                created_at: now,
                updated_at: now,
                turn_ids: TurnIdMode::Unset,
            }),
            gate: Arc::default(),
            cmd: GroupSlot::default(),
        }
    }

    /// Its data; never hold the guard across an `await`.
    pub fn lock(&self) -> MutexGuard<'_, SessionData> {
        self.data.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The sessions the server tracks (one in practice: the bound one).
#[derive(Debug, Default)]
pub struct SessionStore {
    sessions: Vec<Arc<Session>>,
}

/// The store is full of sessions that are not aborted.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("session capacity reached")]
pub struct CapacityError;

impl SessionStore {
    /// The session `id`.
    #[must_use]
    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.sessions.iter().find(|s| s.id == id).cloned()
    }

    /// The session `id`, created with `make` if missing (evicting the oldest aborted session
    /// when at `max`); whether it was created.
    ///
    /// # Errors
    /// When at `max` with no aborted session to evict.
    pub fn get_or_create(
        &mut self,
        id: &str,
        max: u64,
        make: impl FnOnce() -> Session,
    ) -> Result<(Arc<Session>, bool), CapacityError> {
        if let Some(s) = self.get(id) {
            return Ok((s, false));
        }
        if self.sessions.len() as u64 >= max {
            let oldest = self
                .sessions
                .iter()
                .enumerate()
                .filter_map(|(i, s)| {
                    let d = s.lock();
                    (d.state == SessionState::Aborted)
                        .then(|| (d.updated_at, d.created_at, s.id.clone(), i))
                })
                .min();
            if let Some((_, _, _, i)) = oldest {
                self.sessions.remove(i);
            }
        }
        if self.sessions.len() as u64 >= max {
            return Err(CapacityError);
        }
        let s = Arc::new(make());
        self.sessions.push(Arc::clone(&s));
        Ok((s, true))
    }

    /// Counts by state.
    #[must_use]
    pub fn stats(&self, max_sessions: u64) -> SessionStats {
        let mut stats = SessionStats {
            max_sessions,
            total_count: self.sessions.len() as u64,
            ..SessionStats::default()
        };
        for s in &self.sessions {
            match s.lock().state {
                SessionState::Active => stats.active_count += 1,
                SessionState::Desynced => stats.desynced_count += 1,
                SessionState::Aborted => stats.aborted_count += 1,
            }
        }
        stats
    }

    /// Whether any session is active or desynced (a rebind must wait for them).
    #[must_use]
    pub fn has_open(&self) -> bool {
        self.sessions
            .iter()
            .any(|s| s.lock().state != SessionState::Aborted)
    }

    /// Every session.
    #[must_use]
    pub fn all(&self) -> Vec<Arc<Session>> {
        self.sessions.clone()
    }

    /// Forgets every session.
    pub fn clear(&mut self) {
        self.sessions.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TurnErrorCode;
    use crate::model::Role;

    fn error(code: TurnErrorCode) -> TurnError {
        TurnError {
            code,
            message: String::new(),
            details: crate::model::Object::new(),
        }
    }

    #[test]
    fn turn_transitions_are_checked_and_signal_completion() {
        let mut t = Turn::queued("t".into(), "fp".into(), vec![]);
        let done = t.watch_done();
        assert!(
            t.commit(AdapterResponse {
                outputs: vec![],
                trace_events: vec![],
                usage: crate::model::TurnUsage::default(),
                backend_session_id: "s".into(),
            })
            .is_err()
        );
        t.start().unwrap();
        assert!(!*done.borrow());
        t.end(TurnStatus::Unknown, error(TurnErrorCode::BackendTimeout))
            .unwrap();
        assert!(*done.borrow());
        assert!(
            t.end(TurnStatus::Cancelled, error(TurnErrorCode::Cancelled))
                .is_err()
        );
        assert_eq!(t.ledger_entry().error.unwrap().http_status, 504);
    }

    #[test]
    fn turn_id_modes() {
        let s = Session::new("s".into(), "opencode".into(), vec![], vec![]);
        let mut d = s.lock();
        let generated = d.resolve_turn_id("s", None).unwrap();
        assert_eq!(d.resolve_turn_id("s", None).unwrap(), generated);
        assert_eq!(d.resolve_turn_id("s", Some(&generated)).unwrap(), generated);
        assert!(matches!(
            d.resolve_turn_id("s", Some("other")),
            Err(ApiError::Conflict { .. })
        ));
        d.turn_ids = TurnIdMode::Unset;
        assert_eq!(d.resolve_turn_id("s", Some("t1")).unwrap(), "t1");
        assert!(matches!(
            d.resolve_turn_id("s", None),
            Err(ApiError::Request { .. })
        ));
    }

    #[test]
    fn post_agent_commands_follow_the_latest_turn() {
        let s = Session::new(
            "s".into(),
            "opencode".into(),
            vec![Message::text(Role::System, None)],
            vec![],
        );
        let mut d = s.lock();
        let mut t = Turn::queued("t".into(), "fp".into(), vec![]);
        t.start().unwrap();
        t.end(TurnStatus::Unknown, error(TurnErrorCode::MaxStepsExceeded))
            .unwrap();
        d.turns.push(t);
        assert!(!d.allows_post_agent_commands(), "still active");
        assert!(d.set_state(SessionState::Desynced));
        assert!(d.allows_post_agent_commands());
        assert!(!d.set_state(SessionState::Active));
        assert!(d.set_state(SessionState::Aborted));
        assert!(!d.allows_post_agent_commands());
    }

    #[test]
    fn store_evicts_aborted_sessions_only() {
        let mut store = SessionStore::default();
        let make = |id: &str| {
            let id = id.to_owned();
            move || Session::new(id, "opencode".into(), vec![], vec![])
        };
        let (a, created) = store.get_or_create("a", 1, make("a")).unwrap();
        assert!(created);
        assert!(store.get_or_create("b", 1, make("b")).is_err());
        a.lock().set_state(SessionState::Aborted);
        let (_, created) = store.get_or_create("b", 1, make("b")).unwrap();
        assert!(created && store.get("a").is_none());
        assert_eq!(store.stats(1).active_count, 1);
    }
}
