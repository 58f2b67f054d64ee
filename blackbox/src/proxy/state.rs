//! The proxy's one piece of shared state: the single turn scope (its id, step counter, in-flight
//! model calls, usage counts and the errors recorded for the core to consume) and the pause
//! state (paused, reason, weight version, paused time). Everything is behind one mutex held for
//! a few field updates, never across an await; waiters (held calls, `drain_turn`,
//! `wait_for_max_steps_error`) sleep on a watch channel that every change bumps.
//!
//! A model call is admitted by [`Shared::admit`] and from then on is represented by a
//! [`CallGuard`]: dropping the guard (the answer was read, the stream ended, the client went
//! away, the handler was cancelled at any await) releases the call's in-flight mark exactly
//! once, so `drain_turn` can never hang on a call that is gone.
//!
//! Scopes are told apart by a generation number: a call admitted in one turn that finishes
//! after `clear_turn` (or after the next `open_turn`) touches nothing of the new scope.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::watch;
// tokio's clock: the same as std's in production, and controllable in tests.
use tokio::time::Instant;

use super::TurnCounts;

/// The turn scope: what the reference keeps in its `_TurnScope`.
#[derive(Debug)]
pub(crate) struct Turn {
    pub scope: u64,
    pub turn_id: String,
    pub backend_session_id: Option<String>,
    /// Model calls admitted in this turn (the next call's step number).
    pub steps: u64,
    pub inflight: u64,
    pub counts: TurnCounts,
    pub context_overflow: Option<Value>,
    pub rollout_invalidated: Option<Value>,
    pub max_steps_error: Option<Value>,
    pub failed_upstream: Option<Value>,
}

/// Which recorded error of the turn a `consume_*` call takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    ContextOverflow,
    RolloutInvalidated,
    FailedUpstream,
    MaxSteps,
}

impl Turn {
    fn slot(&mut self, which: Recorded) -> &mut Option<Value> {
        match which {
            Recorded::ContextOverflow => &mut self.context_overflow,
            Recorded::RolloutInvalidated => &mut self.rollout_invalidated,
            Recorded::FailedUpstream => &mut self.failed_upstream,
            Recorded::MaxSteps => &mut self.max_steps_error,
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct State {
    pub turn: Option<Turn>,
    next_scope: u64,
    pub paused: bool,
    pub pause_reason: Option<String>,
    pub version: Option<String>,
    pause_started: Option<Instant>,
    /// Paused time of the pauses that ended.
    paused_before: Duration,
    /// Shutting down: held calls are released with a refusal, new ones refused.
    pub closing: bool,
}

impl State {
    /// Paused time so far, the current pause included: deadlines extended by it never expire
    /// while the rollout is paused.
    pub fn total_paused(&self) -> Duration {
        self.paused_before + self.pause_started.map_or(Duration::ZERO, |t| t.elapsed())
    }

    fn inflight(&self) -> u64 {
        self.turn.as_ref().map_or(0, |t| t.inflight)
    }
}

/// What `pause_state` reports (the reference's dict, field for field).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PauseState {
    pub paused: bool,
    pub pause_reason: Option<String>,
    pub version: Option<String>,
    pub http_inflight_requests: u64,
    pub total_paused_seconds: f64,
}

/// Who a call is, for its headers and its recorded errors.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    pub turn_id: Option<String>,
    /// The step number of this call in its turn (0-based; the attempted step when refused).
    pub step: u64,
}

/// The result of admitting a model call.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Admitted: the guard holds its in-flight mark.
    Admitted(CallGuard),
    /// The turn is at `max_steps`: refused, and the turn's max-steps error is recorded.
    MaxSteps { snapshot: Snapshot, max_steps: u32 },
    /// The proxy is shutting down.
    Closing,
}

/// The state and its change signal.
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    changed: watch::Sender<u64>,
    max_steps: Option<u32>,
    session_id: String,
}

/// A timeout measured in unpaused time: the deadline moves out by every second spent paused.
#[derive(Debug, Clone, Copy)]
struct PauseAwareDeadline {
    start: Instant,
    paused_at_start: Duration,
    budget: Duration,
}

impl Shared {
    pub fn new(max_steps: Option<u32>, session_id: String) -> Self {
        Shared {
            state: Mutex::new(State::default()),
            changed: watch::channel(0).0,
            max_steps: max_steps.filter(|&n| n > 0),
            session_id,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock leaves plain data behind (counters, options): carry
        // on with it rather than poison every later call.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes every waiter; call after any change a waiter may be waiting for.
    pub fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub fn open_turn(&self, turn_id: &str, backend_session_id: Option<&str>) -> Result<(), String> {
        let mut st = self.lock();
        if let Some(t) = &st.turn {
            return Err(t.turn_id.clone());
        }
        st.next_scope += 1;
        st.turn = Some(Turn {
            scope: st.next_scope,
            turn_id: turn_id.to_owned(),
            backend_session_id: backend_session_id.map(str::to_owned),
            steps: 0,
            inflight: 0,
            counts: TurnCounts::default(),
            context_overflow: None,
            rollout_invalidated: None,
            max_steps_error: None,
            failed_upstream: None,
        });
        drop(st);
        self.notify();
        Ok(())
    }

    pub fn update_backend_session(&self, backend_session_id: &str) {
        if let Some(t) = self.lock().turn.as_mut() {
            t.backend_session_id = Some(backend_session_id.to_owned());
        }
    }

    pub fn clear_turn(&self) -> Option<TurnCounts> {
        let turn = self.lock().turn.take();
        self.notify();
        turn.map(|t| TurnCounts {
            steps: t.steps,
            ..t.counts
        })
    }

    pub fn turn_counts(&self) -> Option<TurnCounts> {
        self.lock().turn.as_ref().map(|t| TurnCounts {
            steps: t.steps,
            ..t.counts
        })
    }

    pub fn pause_state(&self) -> PauseState {
        let st = self.lock();
        PauseState {
            paused: st.paused,
            pause_reason: st.pause_reason.clone(),
            version: st.version.clone(),
            http_inflight_requests: st.inflight(),
            total_paused_seconds: st.total_paused().as_secs_f64(),
        }
    }

    pub fn inflight(&self) -> u64 {
        self.lock().inflight()
    }

    /// Marks the proxy paused; returns whether it already was.
    pub fn begin_pause(&self, reason: &str) -> bool {
        let mut st = self.lock();
        let already = st.paused;
        st.paused = true;
        st.pause_reason = Some(reason.to_owned());
        if st.pause_started.is_none() {
            st.pause_started = Some(Instant::now());
        }
        drop(st);
        self.notify();
        already
    }

    /// Ends the pause (held calls go on); returns whether the proxy was paused and the
    /// version now current.
    pub fn end_pause(&self, version: Option<&str>) -> (bool, Option<String>) {
        let mut st = self.lock();
        if let Some(v) = version {
            st.version = Some(v.to_owned());
        }
        if let Some(t) = st.pause_started.take() {
            st.paused_before += t.elapsed();
        }
        let was = st.paused;
        st.paused = false;
        st.pause_reason = None;
        let current = st.version.clone();
        drop(st);
        self.notify();
        (was, current)
    }

    pub fn close(&self) {
        self.lock().closing = true;
        self.notify();
    }

    /// Admits a model call: waits while paused, then takes the next step of the open turn (or
    /// none: calls outside a turn are forwarded untagged), or refuses it past `max_steps`.
    pub async fn admit(self: &Arc<Self>) -> Admission {
        let mut rx = self.changed.subscribe();
        loop {
            {
                let mut st = self.lock();
                if st.closing {
                    return Admission::Closing;
                }
                if !st.paused {
                    let max_steps = self.max_steps;
                    let Some(turn) = st.turn.as_mut() else {
                        return Admission::Admitted(CallGuard {
                            shared: self.clone(),
                            scope: None,
                            snapshot: Snapshot {
                                turn_id: None,
                                step: 0,
                            },
                        });
                    };
                    let snapshot = Snapshot {
                        turn_id: Some(turn.turn_id.clone()),
                        step: turn.steps,
                    };
                    if let Some(max) = max_steps
                        && turn.steps >= u64::from(max)
                    {
                        turn.max_steps_error =
                            Some(max_steps_payload(&self.session_id, &snapshot, max));
                        drop(st);
                        self.notify();
                        return Admission::MaxSteps {
                            snapshot,
                            max_steps: max,
                        };
                    }
                    turn.steps += 1;
                    turn.inflight += 1;
                    let scope = Some(turn.scope);
                    return Admission::Admitted(CallGuard {
                        shared: self.clone(),
                        scope,
                        snapshot,
                    });
                }
            }
            // Paused: wait for any change (resume, shutdown) and look again.
            if rx.changed().await.is_err() {
                return Admission::Closing;
            }
        }
    }

    /// Takes (or, for `peek`, copies) a recorded error of the open turn.
    pub fn take_recorded(&self, which: Recorded) -> Option<Value> {
        self.lock().turn.as_mut().and_then(|t| t.slot(which).take())
    }

    /// Records an error for the turn a call belongs to (if that turn is still open).
    pub fn record(&self, scope: Option<u64>, which: Recorded, payload: Value) {
        let mut st = self.lock();
        if let Some(t) = st.turn.as_mut()
            && Some(t.scope) == scope
        {
            *t.slot(which) = Some(payload);
        }
    }

    /// Waits for every in-flight call of the open turn to finish, at most `timeout` of
    /// unpaused time. `true` when drained (or no turn is open).
    pub async fn drain(&self, timeout: Option<Duration>) -> bool {
        let mut rx = self.changed.subscribe();
        let scope = match self.lock().turn.as_ref() {
            None => return true,
            Some(t) => t.scope,
        };
        let deadline = timeout.map(|budget| PauseAwareDeadline {
            start: Instant::now(),
            paused_at_start: self.lock().total_paused(),
            budget,
        });
        loop {
            let paused = {
                let st = self.lock();
                match st.turn.as_ref() {
                    Some(t) if t.scope == scope && t.inflight > 0 => {}
                    Some(_) | None => return true,
                }
                st.paused
            };
            match deadline {
                None => {
                    if rx.changed().await.is_err() {
                        return false;
                    }
                }
                Some(d) => {
                    let due = d.due(self.lock().total_paused());
                    if !paused && Instant::now() >= due {
                        return false;
                    }
                    if paused {
                        // The deadline moves while paused; the pause's end is a change.
                        if rx.changed().await.is_err() {
                            return false;
                        }
                    } else {
                        tokio::select! {
                            r = rx.changed() => if r.is_err() { return false },
                            () = tokio::time::sleep_until(due) => {}
                        }
                    }
                }
            }
        }
    }

    /// Waits until the open turn has a max-steps error (a copy of it), the turn ends (`None`)
    /// or `timeout` passes (`None`).
    pub async fn wait_for_max_steps(&self, timeout: Option<Duration>) -> Option<Value> {
        let mut rx = self.changed.subscribe();
        let scope = {
            let st = self.lock();
            let t = st.turn.as_ref()?;
            if let Some(e) = &t.max_steps_error {
                return Some(e.clone());
            }
            t.scope
        };
        let wait = async {
            loop {
                if rx.changed().await.is_err() {
                    return None;
                }
                let st = self.lock();
                match st.turn.as_ref() {
                    Some(t) if t.scope == scope => {
                        if let Some(e) = &t.max_steps_error {
                            return Some(e.clone());
                        }
                    }
                    Some(_) | None => return None,
                }
            }
        };
        match timeout {
            None => wait.await,
            Some(t) => tokio::time::timeout(t, wait).await.ok().flatten(),
        }
    }
}

impl PauseAwareDeadline {
    fn due(&self, paused_now: Duration) -> Instant {
        self.start + self.budget + paused_now.saturating_sub(self.paused_at_start)
    }
}

/// The turn's max-steps error, as the reference records it for the core.
fn max_steps_payload(session_id: &str, snapshot: &Snapshot, max_steps: u32) -> Value {
    json!({
        "error": "max_steps_exceeded",
        "message": "Turn exceeded max_steps.",
        "details": {
            "session_id": session_id,
            "turn_id": snapshot.turn_id,
            "max_steps": max_steps,
            "attempted_step": snapshot.step,
            "backend_message": "429 Turn exceeded max_steps.",
            "raw_error_code": "rate_limit_error",
        },
    })
}

/// One admitted model call. Dropping it releases the call's in-flight mark.
#[derive(Debug)]
pub(crate) struct CallGuard {
    shared: Arc<Shared>,
    /// The scope the call was admitted to; `None` outside a turn.
    scope: Option<u64>,
    snapshot: Snapshot,
}

impl CallGuard {
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    pub fn scope(&self) -> Option<u64> {
        self.scope
    }

    /// Adds one answer's usage to the call's turn.
    pub fn add_counts(&self, c: &TurnCounts) {
        let mut st = self.shared.lock();
        if let Some(t) = st.turn.as_mut()
            && Some(t.scope) == self.scope
        {
            let n = &mut t.counts;
            n.input_tokens = n.input_tokens.saturating_add(c.input_tokens);
            n.output_tokens = n.output_tokens.saturating_add(c.output_tokens);
            n.reasoning_tokens = n.reasoning_tokens.saturating_add(c.reasoning_tokens);
            n.total_tokens = n.total_tokens.saturating_add(c.total_tokens);
            n.tool_calls = n.tool_calls.saturating_add(c.tool_calls);
        }
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        let Some(scope) = self.scope else { return };
        let mut st = self.shared.lock();
        let drained = match st.turn.as_mut() {
            Some(t) if t.scope == scope => {
                t.inflight = t.inflight.saturating_sub(1);
                t.inflight == 0
            }
            Some(_) | None => false,
        };
        drop(st);
        if drained {
            self.shared.notify();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::wildcard_enum_match_arm
    )]

    use super::*;

    fn shared(max: Option<u32>) -> Arc<Shared> {
        Arc::new(Shared::new(max, "sess-001".into()))
    }

    async fn admitted(s: &Arc<Shared>) -> CallGuard {
        match s.admit().await {
            Admission::Admitted(g) => g,
            other => panic!("not admitted: {other:?}"),
        }
    }

    #[tokio::test]
    async fn steps_count_per_turn_and_max_steps_refuses_and_records() {
        let s = shared(Some(2));
        s.open_turn("t1", Some("b1")).unwrap();
        assert_eq!(s.open_turn("t2", None), Err("t1".to_owned()));
        let a = admitted(&s).await;
        assert_eq!(a.snapshot().step, 0);
        let b = admitted(&s).await;
        assert_eq!(b.snapshot().step, 1);
        assert_eq!(s.inflight(), 2);
        match s.admit().await {
            Admission::MaxSteps {
                snapshot,
                max_steps,
            } => {
                assert_eq!((snapshot.step, max_steps), (2, 2));
            }
            other => panic!("{other:?}"),
        }
        drop((a, b));
        assert_eq!(s.inflight(), 0, "refused calls hold no in-flight mark");
        let e = s.wait_for_max_steps(Some(Duration::ZERO)).await.unwrap();
        assert_eq!(e["details"]["attempted_step"], 2);
        assert_eq!(e["details"]["turn_id"], "t1");
        assert_eq!(e["details"]["session_id"], "sess-001");
        assert!(s.take_recorded(Recorded::MaxSteps).is_some());
        assert!(
            s.take_recorded(Recorded::MaxSteps).is_none(),
            "consumed once"
        );
        assert_eq!(s.clear_turn().unwrap().steps, 2);
        // The next turn starts from zero.
        s.open_turn("t2", None).unwrap();
        assert_eq!(admitted(&s).await.snapshot().step, 0);
    }

    #[tokio::test]
    async fn zero_or_none_disables_max_steps() {
        for max in [None, Some(0)] {
            let s = shared(max);
            s.open_turn("t", None).unwrap();
            for _ in 0..150 {
                drop(admitted(&s).await);
            }
            assert_eq!(s.turn_counts().unwrap().steps, 150);
        }
    }

    #[tokio::test]
    async fn calls_outside_a_turn_are_untagged_and_untracked() {
        let s = shared(Some(1));
        let g = admitted(&s).await;
        assert!(g.snapshot().turn_id.is_none() && g.scope().is_none());
        drop(admitted(&s).await);
        assert!(s.turn_counts().is_none());
    }

    #[tokio::test]
    async fn a_late_call_of_an_old_turn_touches_nothing_of_the_new_one() {
        let s = shared(None);
        s.open_turn("t1", None).unwrap();
        let old = admitted(&s).await;
        s.clear_turn();
        s.open_turn("t2", None).unwrap();
        let new = admitted(&s).await;
        old.add_counts(&TurnCounts {
            input_tokens: 5,
            ..TurnCounts::default()
        });
        drop(old);
        assert_eq!(s.inflight(), 1);
        assert_eq!(s.turn_counts().unwrap().input_tokens, 0);
        drop(new);
        assert_eq!(s.inflight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn pause_holds_new_calls_until_resume() {
        let s = shared(None);
        s.open_turn("t", None).unwrap();
        s.begin_pause("weight_update");
        let s2 = s.clone();
        let held = tokio::spawn(async move { admitted(&s2).await.snapshot().step });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!held.is_finished());
        assert!(s.pause_state().paused);
        let (was, _) = s.end_pause(Some("v2"));
        assert!(was);
        assert_eq!(held.await.unwrap(), 0);
        let st = s.pause_state();
        assert_eq!(st.version.as_deref(), Some("v2"));
        assert!(st.total_paused_seconds >= 5.0, "{st:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn drain_waits_for_inflight_calls_and_excludes_paused_time() {
        let s = shared(None);
        s.open_turn("t", None).unwrap();
        assert!(s.drain(Some(Duration::ZERO)).await, "nothing in flight");
        let g = admitted(&s).await;
        assert!(!s.drain(Some(Duration::from_secs(1))).await, "times out");
        // Paused for longer than the timeout: the deadline moves with the pause.
        s.begin_pause("x");
        let s2 = s.clone();
        let drain = tokio::spawn(async move { s2.drain(Some(Duration::from_secs(2))).await });
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!drain.is_finished(), "paused time does not count");
        s.end_pause(None);
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(g);
        assert!(drain.await.unwrap());
    }

    #[tokio::test]
    async fn closing_releases_held_calls() {
        let s = shared(None);
        s.begin_pause("x");
        let s2 = s.clone();
        let held = tokio::spawn(async move { matches!(s2.admit().await, Admission::Closing) });
        tokio::task::yield_now().await;
        s.close();
        assert!(held.await.unwrap());
    }
}
