//! The rollout pause as the server sees it: whether model traffic is paused (and why, and at
//! which weights version), how long it has been paused in total, and deadlines that do not
//! count paused time: a turn that waits out a weight update is not late.

use std::future::Future;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::watch;

#[derive(Debug, Default)]
struct PauseInfo {
    paused_since: Option<Instant>,
    reason: Option<String>,
    version: Option<String>,
    total: Duration,
}

/// The pause state and clock.
#[derive(Debug)]
pub struct PauseClock {
    info: Mutex<PauseInfo>,
    /// Bumped on every pause and resume.
    changed: watch::Sender<u64>,
}

impl Default for PauseClock {
    fn default() -> Self {
        PauseClock {
            info: Mutex::default(),
            changed: watch::channel(0).0,
        }
    }
}

/// A snapshot for `pause_state`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PauseSnapshot {
    /// Paused now.
    pub paused: bool,
    /// Why.
    pub reason: Option<String>,
    /// The weights version last resumed with.
    pub version: Option<String>,
}

impl PauseClock {
    fn info(&self) -> MutexGuard<'_, PauseInfo> {
        self.info.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Pauses (again); whether it was already paused.
    pub fn pause(&self, reason: &str) -> bool {
        let already = {
            let mut i = self.info();
            let already = i.paused_since.is_some();
            i.paused_since.get_or_insert_with(Instant::now);
            i.reason = Some(reason.to_owned());
            already
        };
        self.changed.send_modify(|n| *n += 1);
        already
    }

    /// Resumes, recording `version` if given; whether it was paused.
    pub fn resume(&self, version: Option<&str>) -> bool {
        let was = {
            let mut i = self.info();
            if let Some(v) = version {
                i.version = Some(v.to_owned());
            }
            i.reason = None;
            match i.paused_since.take() {
                Some(since) => {
                    i.total += since.elapsed();
                    true
                }
                None => false,
            }
        };
        self.changed.send_modify(|n| *n += 1);
        was
    }

    /// The state now.
    #[must_use]
    pub fn snapshot(&self) -> PauseSnapshot {
        let i = self.info();
        PauseSnapshot {
            paused: i.paused_since.is_some(),
            reason: i.reason.clone(),
            version: i.version.clone(),
        }
    }

    /// Time spent paused so far, the current pause included.
    #[must_use]
    pub fn paused_total(&self) -> Duration {
        let i = self.info();
        i.total + i.paused_since.map_or(Duration::ZERO, |s| s.elapsed())
    }

    /// Returns once not paused.
    pub async fn wait_resumed(&self) {
        let mut rx = self.changed.subscribe();
        while self.snapshot().paused {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Runs `fut` for at most `budget` of unpaused time; `None` when the budget ran out (the
    /// future is dropped then).
    pub async fn within<F: Future>(&self, budget: Duration, fut: F) -> Option<F::Output> {
        let mut fut = std::pin::pin!(fut);
        let start = Instant::now();
        let paused_at_start = self.paused_total();
        let mut rx = self.changed.subscribe();
        loop {
            let paused = self.paused_total().saturating_sub(paused_at_start);
            let active = start.elapsed().saturating_sub(paused);
            let left = budget.checked_sub(active).filter(|l| !l.is_zero())?;
            // While paused the budget does not run down: wait for the resume (or the work).
            let nap = if self.snapshot().paused {
                Duration::from_secs(24 * 3600)
            } else {
                left
            };
            tokio::select! {
                out = &mut fut => return Some(out),
                () = tokio::time::sleep(nap) => {}
                changed = rx.changed() => {
                    if changed.is_err() {
                        tokio::time::sleep(left).await;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn deadlines_exclude_paused_time() {
        let clock = std::sync::Arc::new(PauseClock::default());
        // Runs out when nothing pauses it.
        let r = clock
            .within(
                Duration::from_millis(50),
                tokio::time::sleep(Duration::from_secs(5)),
            )
            .await;
        assert!(r.is_none());

        // A 300 ms job with a 200 ms budget finishes when 200 ms of it are paused.
        let c = std::sync::Arc::clone(&clock);
        let pauser = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(!c.pause("weight_update"));
            tokio::time::sleep(Duration::from_millis(250)).await;
            assert!(c.resume(Some("v2")));
        });
        let r = clock
            .within(Duration::from_millis(200), async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                7
            })
            .await;
        pauser.await.unwrap();
        assert_eq!(r, Some(7));
        let s = clock.snapshot();
        assert!(!s.paused && s.version.as_deref() == Some("v2"));
        assert!(clock.paused_total() >= Duration::from_millis(250));
    }

    #[tokio::test]
    async fn wait_resumed_holds_while_paused() {
        let clock = std::sync::Arc::new(PauseClock::default());
        clock.wait_resumed().await;
        clock.pause("x");
        let c = std::sync::Arc::clone(&clock);
        let waiter = tokio::spawn(async move { c.wait_resumed().await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        clock.resume(None);
        tokio::time::timeout(Duration::from_secs(2), waiter)
            .await
            .unwrap()
            .unwrap();
    }
}
