//! The life of one sandbox run as an explicit state machine, and the registry of runs.
//!
//! ```text
//! Starting ──Spawned──► Running ──ProcessGone──► Finishing(None) ──Done──► Done(Exited)
//!    │                     │                                                 
//!    │ StartFailed         │ Stop(r)                                         
//!    ▼                     ▼                                                 
//! Done(Failed)        Stopping(r) ──ProcessGone──► Finishing(Some(r)) ──Done──► Done(TimedOut | Killed | DiskExceeded)
//! ```
//! `Finishing ──SetupFailed──► Done(Failed)`: bwrap ended without ever running the command.
//! A stop that arrives while starting is remembered (`Starting → Stopping`) and honoured as
//! soon as the process exists. The first stop reason wins. `Done` is terminal; a restarted
//! launcher that finds a run it did not finish marks it `Done(Lost)`.
//!
//! The registry is one map behind one mutex, held only to read or apply a transition; waiters
//! follow a run through a `watch` channel instead of polling the lock.

use std::collections::HashMap;
use std::fmt;

use agentbox_policy::config::ModelId;
use agentbox_policy::id::Tid;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::api::RunState;

/// Why a run is being stopped from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Timeout,
    Deleted,
    Shutdown,
    /// The disk watcher found the workspace over `launcher.limits.disk_mb`.
    DiskExceeded,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Final {
    Exited,
    TimedOut,
    Killed,
    DiskExceeded,
    Failed,
    Lost,
}

/// Where a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Starting,
    Running,
    Stopping(StopReason),
    Finishing(Option<StopReason>),
    Done(Final),
}

/// What happened to a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Spawned,
    StartFailed,
    Stop(StopReason),
    ProcessGone,
    Done,
    /// Done, but the sandbox was never set up: the command did not run.
    SetupFailed,
}

/// An event that makes no sense in the current phase (a bug in the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("event {event:?} is not valid in phase {phase:?}")]
pub struct BadTransition {
    pub phase: Phase,
    pub event: Event,
}

fn final_for(reason: Option<StopReason>) -> Final {
    match reason {
        None => Final::Exited,
        Some(StopReason::Timeout) => Final::TimedOut,
        Some(StopReason::Deleted | StopReason::Shutdown) => Final::Killed,
        Some(StopReason::DiskExceeded) => Final::DiskExceeded,
    }
}

impl Phase {
    /// The phase after `event`.
    pub fn next(self, event: Event) -> Result<Phase, BadTransition> {
        let bad = Err(BadTransition { phase: self, event });
        match (self, event) {
            (Phase::Starting, Event::Spawned) => Ok(Phase::Running),
            (Phase::Starting | Phase::Stopping(_), Event::StartFailed) => {
                Ok(Phase::Done(Final::Failed))
            }
            (Phase::Starting | Phase::Running, Event::Stop(r)) => Ok(Phase::Stopping(r)),
            (Phase::Stopping(r), Event::Spawned | Event::Stop(_)) => Ok(Phase::Stopping(r)),
            (Phase::Running, Event::ProcessGone) => Ok(Phase::Finishing(None)),
            (Phase::Stopping(r), Event::ProcessGone) => Ok(Phase::Finishing(Some(r))),
            (Phase::Finishing(r), Event::Stop(_)) => Ok(Phase::Finishing(r)),
            (Phase::Finishing(r), Event::Done) => Ok(Phase::Done(final_for(r))),
            (Phase::Finishing(_), Event::SetupFailed) => Ok(Phase::Done(Final::Failed)),
            (Phase::Done(f), Event::Stop(_)) => Ok(Phase::Done(f)),
            (Phase::Starting, Event::ProcessGone | Event::Done | Event::SetupFailed)
            | (
                Phase::Running,
                Event::Spawned | Event::StartFailed | Event::Done | Event::SetupFailed,
            )
            | (Phase::Stopping(_), Event::Done | Event::SetupFailed)
            | (Phase::Finishing(_), Event::Spawned | Event::StartFailed | Event::ProcessGone)
            | (
                Phase::Done(_),
                Event::Spawned
                | Event::StartFailed
                | Event::ProcessGone
                | Event::Done
                | Event::SetupFailed,
            ) => bad,
        }
    }

    pub fn is_done(self) -> bool {
        matches!(self, Phase::Done(_))
    }

    /// Whether sandboxed processes may still be alive (and talking to their model): from the
    /// reservation until the supervisor has seen the sandbox die.
    pub fn sandbox_may_run(self) -> bool {
        match self {
            Phase::Starting | Phase::Running | Phase::Stopping(_) => true,
            Phase::Finishing(_) | Phase::Done(_) => false,
        }
    }

    /// The `state` of the API.
    pub fn state(self) -> RunState {
        match self {
            Phase::Starting => RunState::Starting,
            Phase::Running => RunState::Running,
            Phase::Stopping(_) => RunState::Stopping,
            Phase::Finishing(_) => RunState::Finishing,
            Phase::Done(Final::Exited) => RunState::Exited,
            Phase::Done(Final::TimedOut) => RunState::TimedOut,
            Phase::Done(Final::Killed) => RunState::Killed,
            Phase::Done(Final::DiskExceeded) => RunState::DiskExceeded,
            Phase::Done(Final::Failed) => RunState::Failed,
            Phase::Done(Final::Lost) => RunState::Lost,
        }
    }

    /// The `state` string of the API.
    pub fn as_str(self) -> &'static str {
        self.state().as_str()
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Agent runs are supervised in the background and kept until deleted; checks run within
/// their request; rollout slots run until deleted (or their timeout) and keep their directories
/// until deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    Agent,
    Check,
    Slot,
}

/// What is known about a run's outcome so far.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub exit_code: Option<i32>,
    pub oom_killed: bool,
    /// The workspace reached the disk limit (stopped by the watcher, or full under a quota).
    #[serde(default)]
    pub disk_exceeded: bool,
    /// bwrap failed to set the sandbox up; the command never ran (`exit_code` is `None`).
    #[serde(default)]
    pub setup_failed: bool,
    pub truncated: bool,
    pub result_commit: Option<String>,
    pub error: Option<String>,
}

/// One run in the registry.
#[derive(Debug)]
pub struct Entry {
    pub kind: RunKind,
    /// The model an agent was started for (`None` for checks and restored runs); a vLLM
    /// backend is busy while an agent of its model may run.
    pub model: Option<ModelId>,
    pub phase: Phase,
    pub outcome: Outcome,
    /// Cancelled to stop the run (DELETE, shutdown); the reason is in `phase`.
    pub stop: CancellationToken,
    /// Follows `phase` for waiters.
    pub watch: watch::Sender<Phase>,
    /// The gid the workspace had before it was handed over, to hand it back to.
    pub workspace_gid: u32,
    /// The run's own agent uid (`None` for restored runs, whose uid is given back).
    pub agent_uid: Option<u32>,
    /// A rollout slot's resources, once its sandbox runs.
    pub slot: Option<std::sync::Arc<crate::launcher::SlotInfo>>,
}

impl Entry {
    pub fn new(
        kind: RunKind,
        model: Option<ModelId>,
        stop: CancellationToken,
        workspace_gid: u32,
        agent_uid: u32,
    ) -> Entry {
        Entry {
            kind,
            model,
            phase: Phase::Starting,
            outcome: Outcome::default(),
            stop,
            watch: watch::Sender::new(Phase::Starting),
            workspace_gid,
            agent_uid: Some(agent_uid),
            slot: None,
        }
    }

    /// A finished run restored from disk.
    pub fn finished(kind: RunKind, fin: Final, outcome: Outcome, workspace_gid: u32) -> Entry {
        let phase = Phase::Done(fin);
        Entry {
            kind,
            model: None,
            phase,
            outcome,
            stop: CancellationToken::new(),
            watch: watch::Sender::new(phase),
            workspace_gid,
            agent_uid: None,
            slot: None,
        }
    }

    /// Applies `event`, publishing the new phase to waiters.
    pub fn apply(&mut self, event: Event) -> Result<Phase, BadTransition> {
        let next = self.phase.next(event)?;
        self.phase = next;
        self.watch.send_replace(next);
        Ok(next)
    }

    /// Whether this run occupies its workspace.
    pub fn is_active(&self) -> bool {
        !self.phase.is_done()
    }
}

/// Every known run, by tid. Agents and checks share the map because they share the workspace:
/// a tid runs one thing at a time.
#[derive(Debug, Default)]
pub struct Registry {
    pub runs: HashMap<Tid, Entry>,
}

impl Registry {
    /// Reserves `tid` for a new run unless something is active there. A finished entry is
    /// replaced.
    /// An ended rollout slot is not replaced either: it holds its directories and uid until
    /// `DELETE`.
    pub fn reserve(&mut self, tid: &Tid, entry: Entry) -> Result<(), Phase> {
        if let Some(existing) = self.runs.get(tid)
            && (existing.is_active() || existing.slot.is_some())
        {
            return Err(existing.phase);
        }
        self.runs.insert(tid.clone(), entry);
        Ok(())
    }

    pub fn active(&self) -> impl Iterator<Item = (&Tid, &Entry)> {
        self.runs.iter().filter(|(_, e)| e.is_active())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_life() {
        let mut p = Phase::Starting;
        for e in [Event::Spawned, Event::ProcessGone, Event::Done] {
            p = p.next(e).unwrap();
        }
        assert_eq!(p, Phase::Done(Final::Exited));
        assert_eq!(p.as_str(), "exited");
    }

    #[test]
    fn stops() {
        let p = Phase::Running
            .next(Event::Stop(StopReason::Timeout))
            .unwrap();
        let p = p.next(Event::Stop(StopReason::Deleted)).unwrap();
        assert_eq!(p, Phase::Stopping(StopReason::Timeout), "first reason wins");
        let p = p
            .next(Event::ProcessGone)
            .unwrap()
            .next(Event::Done)
            .unwrap();
        assert_eq!(p.as_str(), "timed_out");
        let p = Phase::Starting
            .next(Event::Stop(StopReason::Deleted))
            .unwrap();
        let p = p.next(Event::Spawned).unwrap();
        assert_eq!(p, Phase::Stopping(StopReason::Deleted));
        let p = p
            .next(Event::ProcessGone)
            .unwrap()
            .next(Event::Done)
            .unwrap();
        assert_eq!(p, Phase::Done(Final::Killed));
        assert_eq!(p.next(Event::Stop(StopReason::Shutdown)).unwrap(), p);
    }

    #[test]
    fn invalid_transitions() {
        assert!(Phase::Starting.next(Event::Done).is_err());
        assert!(Phase::Running.next(Event::Spawned).is_err());
        assert!(Phase::Done(Final::Exited).next(Event::ProcessGone).is_err());
        assert!(Phase::Finishing(None).next(Event::ProcessGone).is_err());
        assert_eq!(
            Phase::Starting.next(Event::StartFailed).unwrap(),
            Phase::Done(Final::Failed)
        );
        assert_eq!(
            Phase::Finishing(None).next(Event::SetupFailed).unwrap(),
            Phase::Done(Final::Failed)
        );
        assert!(Phase::Running.next(Event::SetupFailed).is_err());
    }

    #[test]
    fn registry_reserve() {
        let mut r = Registry::default();
        let tid = Tid::parse("a").unwrap();
        r.reserve(
            &tid,
            Entry::new(RunKind::Agent, None, CancellationToken::new(), 0, 64000),
        )
        .unwrap();
        assert_eq!(
            r.reserve(
                &tid,
                Entry::new(RunKind::Check, None, CancellationToken::new(), 0, 64000)
            )
            .unwrap_err(),
            Phase::Starting
        );
        let e = r.runs.get_mut(&tid).unwrap();
        let mut rx = e.watch.subscribe();
        e.apply(Event::StartFailed).unwrap();
        assert!(rx.borrow_and_update().is_done());
        r.reserve(
            &tid,
            Entry::new(RunKind::Check, None, CancellationToken::new(), 0, 64000),
        )
        .unwrap();
        assert_eq!(r.active().count(), 1);
    }
}
