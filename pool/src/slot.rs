//! The life of one pool slot as an explicit state machine (pure: no I/O, no clock).
//!
//! ```text
//! Empty ──Start──► Starting ──Started──► Ready ──Lease──► Leased ──Release──► Releasing
//!                    │  ▲                  │                 │                   │
//!          StartFailed  │ Start           Died              Died               Stopped
//!                    ▼  │                  ▼                 ▼                   ▼
//!                  Failed               Dead ──Reset──► Restarting ◄──Stopped── (next generation:
//!                                                          │                     Starting)
//!                                                       Stopped ──► Starting
//! Lost ◄──Died── Leased;  Lost ──Release──► Releasing
//! ```
//!
//! `Releasing` and `Restarting` both mean "the old generation is being stopped"; `Releasing`
//! still carries the lease (so a second release says `already_releasing`), `Restarting` does
//! not. `Stopped` moves either to `Starting` of the next generation. A dead ready slot is reset
//! at once (`Dead`), a dead leased one waits as `Lost` until its lease is released or expires,
//! and a `Failed` start is retried (`Start` again) after a backoff. `Shutdown` empties any slot
//! that is not starting (a start in flight ends as `Failed` first); a `Releasing` or
//! `Restarting` slot is emptied by its reset task, after it stopped the old generation,
//! instead of starting a new one.

use agentbox_api::pool::SlotState;

/// What happened to a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A new generation's start begins.
    Start,
    /// Its server answers `/health`.
    Started,
    /// The start failed (gateway, launcher or health wait).
    StartFailed,
    /// Given to a trajectory.
    Lease,
    /// Its lease is released (by the caller or the TTL).
    Release,
    /// Its server was found dead by the health loop.
    Died,
    /// A dead ready slot is being stopped to be replaced.
    Reset,
    /// The old generation is stopped (sandbox deleted, gateway task closed).
    Stopped,
    /// The pool shuts down (the slot's sandbox is stopped).
    Shutdown,
}

/// An event that makes no sense in the current state (a bug in the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("event {event:?} is not valid in state {state:?}")]
pub struct BadTransition {
    pub state: SlotState,
    pub event: Event,
}

/// The state after `event` in `state`.
///
/// # Errors
/// [`BadTransition`] for an event the state does not accept.
pub fn next(state: SlotState, event: Event) -> Result<SlotState, BadTransition> {
    use Event as E;
    use SlotState as S;
    let bad = Err(BadTransition { state, event });
    match (state, event) {
        (S::Empty | S::Failed, E::Start) => Ok(S::Starting),
        (S::Starting, E::Started) => Ok(S::Ready),
        (S::Starting, E::StartFailed) => Ok(S::Failed),
        (S::Ready, E::Lease) => Ok(S::Leased),
        (S::Leased | S::Lost, E::Release) => Ok(S::Releasing),
        (S::Ready, E::Died) => Ok(S::Dead),
        (S::Leased, E::Died) => Ok(S::Lost),
        (S::Dead, E::Reset) => Ok(S::Restarting),
        (S::Releasing | S::Restarting, E::Stopped) => Ok(S::Starting),
        (
            S::Empty
            | S::Ready
            | S::Leased
            | S::Lost
            | S::Failed
            | S::Dead
            | S::Releasing
            | S::Restarting,
            E::Shutdown,
        ) => Ok(S::Empty),
        (S::Empty, E::Started | E::StartFailed | E::Lease | E::Release | E::Died)
        | (S::Empty | S::Ready | S::Leased | S::Lost | S::Failed | S::Dead, E::Stopped)
        | (S::Empty | S::Ready | S::Leased | S::Lost | S::Failed | S::Starting, E::Reset)
        | (S::Starting, E::Start | E::Lease | E::Release | E::Died | E::Stopped | E::Shutdown)
        | (S::Ready, E::Start | E::Started | E::StartFailed | E::Release)
        | (S::Leased, E::Start | E::Started | E::StartFailed | E::Lease)
        | (S::Lost, E::Start | E::Started | E::StartFailed | E::Lease | E::Died)
        | (
            S::Releasing | S::Restarting,
            E::Start | E::Started | E::StartFailed | E::Lease | E::Release | E::Died | E::Reset,
        )
        | (S::Failed, E::Started | E::StartFailed | E::Lease | E::Release | E::Died)
        | (S::Dead, E::Start | E::Started | E::StartFailed | E::Lease | E::Release | E::Died) => {
            bad
        }
    }
}

/// Whether a sandbox of the current generation may exist (so shutdown must stop it).
pub fn may_run(state: SlotState) -> bool {
    match state {
        SlotState::Ready
        | SlotState::Leased
        | SlotState::Lost
        | SlotState::Dead
        | SlotState::Starting
        | SlotState::Releasing
        | SlotState::Restarting => true,
        SlotState::Empty | SlotState::Failed => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SlotState as S;

    const STATES: [S; 9] = [
        S::Empty,
        S::Starting,
        S::Ready,
        S::Leased,
        S::Releasing,
        S::Restarting,
        S::Failed,
        S::Dead,
        S::Lost,
    ];
    const EVENTS: [Event; 9] = [
        Event::Start,
        Event::Started,
        Event::StartFailed,
        Event::Lease,
        Event::Release,
        Event::Died,
        Event::Reset,
        Event::Stopped,
        Event::Shutdown,
    ];

    fn run(mut s: S, events: &[Event]) -> Result<S, BadTransition> {
        for e in events {
            s = next(s, *e)?;
        }
        Ok(s)
    }

    #[test]
    fn lease_release_and_reset_return_to_ready() {
        let s = run(
            S::Empty,
            &[
                Event::Start,
                Event::Started,
                Event::Lease,
                Event::Release,
                Event::Stopped,
                Event::Started,
            ],
        );
        assert_eq!(s, Ok(S::Ready));
    }

    #[test]
    fn a_dead_ready_slot_is_reset_and_a_dead_leased_one_is_lost() {
        assert_eq!(
            run(S::Ready, &[Event::Died, Event::Reset, Event::Stopped]),
            Ok(S::Starting)
        );
        assert_eq!(run(S::Leased, &[Event::Died]), Ok(S::Lost));
        assert_eq!(
            run(S::Lost, &[Event::Release, Event::Stopped]),
            Ok(S::Starting)
        );
    }

    #[test]
    fn failed_starts_are_retried() {
        assert_eq!(
            run(
                S::Empty,
                &[
                    Event::Start,
                    Event::StartFailed,
                    Event::Start,
                    Event::Started
                ]
            ),
            Ok(S::Ready)
        );
    }

    #[test]
    fn invalid_transitions_are_refused() {
        for (s, e) in [
            (S::Ready, Event::Release),
            (S::Leased, Event::Lease),
            (S::Releasing, Event::Release),
            (S::Lost, Event::Died),
            (S::Starting, Event::Lease),
            (S::Empty, Event::Lease),
            (S::Dead, Event::Lease),
            (S::Starting, Event::Shutdown),
        ] {
            assert_eq!(next(s, e), Err(BadTransition { state: s, event: e }));
        }
    }

    #[test]
    fn only_ready_slots_can_be_leased_and_starting_ones_not_shut_down() {
        for s in STATES {
            assert_eq!(next(s, Event::Lease).is_ok(), s == S::Ready, "{s:?}");
            assert_eq!(next(s, Event::Shutdown).is_ok(), s != S::Starting, "{s:?}");
        }
    }

    #[test]
    fn every_pair_is_decided_and_shutdown_leaves_nothing_running() {
        let mut valid = 0;
        for s in STATES {
            for e in EVENTS {
                if let Ok(n) = next(s, e) {
                    valid += 1;
                    if e == Event::Shutdown {
                        assert!(!may_run(n));
                    }
                }
            }
        }
        assert_eq!(valid, 20);
    }
}
