//! Adoption of orphans for a supervisor (blackbox-server). A tool an agent runs can leave the
//! agent's process tree: a command's background job outlives its shell, a spawn broker's child
//! double-forks into a session of its own. Reparented to init, such a process escapes every
//! scan of the agent's descendants and survives the supervisor's stop.
//!
//! [`become_subreaper`] makes this process their new parent instead (`PR_SET_CHILD_SUBREAPER`),
//! so [`kill_adopted`] can find and end them when the agent stops. Being their parent also
//! means reaping them, and that is the delicate part: tokio's `Child` waits for its own pid,
//! and a supervisor that reaped one of those first would steal its exit status. So once
//! adoption is on, every spawn through [`crate::proc::ChildSetup::spawn`] (or `spawn_exec`)
//! records its child (pid and start time, which tells a reused pid apart) under the same lock
//! the reaper takes, and [`reap_adopted`] waits only for zombies that are not on that list. A
//! process that adopts must spawn every child through `ChildSetup::spawn` or `spawn_exec`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, WaitOptions};

use crate::proc::{self, ProcStat};

/// Whether [`become_subreaper`] succeeded: spawns record their children from then on.
static ADOPTING: AtomicBool = AtomicBool::new(false);

/// The children spawned on purpose while adopting, as (pid, start time): theirs to reap.
static SPAWNED: Mutex<Vec<(u32, u64)>> = Mutex::new(Vec::new());

fn spawned() -> MutexGuard<'static, Vec<(u32, u64)>> {
    SPAWNED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Makes this process the reaper of its descendants' orphans. Call before spawning anything:
/// a child spawned earlier is not on the list and would be reaped as an adopted orphan.
///
/// # Errors
/// When the kernel refuses `PR_SET_CHILD_SUBREAPER` (orphans then go to init as before).
pub fn become_subreaper() -> rustix::io::Result<()> {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))?;
    ADOPTING.store(true, Ordering::SeqCst);
    Ok(())
}

/// Runs `spawn` (the fork) with the list locked and records the child it returns, so a reap
/// on another thread never sees that child as an orphan, not even if it exits at once.
pub(crate) fn spawning<T, E>(
    spawn: impl FnOnce() -> Result<T, E>,
    pid_of: impl Fn(&T) -> Option<u32>,
) -> Result<T, E> {
    if !ADOPTING.load(Ordering::SeqCst) {
        return spawn();
    }
    let mut list = spawned();
    let child = spawn()?;
    // Not yet waited for by anyone, the child is at least a zombie: its stat is there.
    if let Some(pid) = pid_of(&child)
        && let Some(stat) = proc::stat_of(pid)
    {
        list.push((pid, stat.start));
    }
    Ok(child)
}

/// This process's children in `table` that it did not spawn on purpose, after dropping from
/// `list` the children that were reaped since (gone, or their pid reused).
fn adopted_in<'t>(
    table: &'t [(u32, ProcStat)],
    list: &mut Vec<(u32, u64)>,
) -> impl Iterator<Item = &'t (u32, ProcStat)> {
    let me = rustix::process::getpid()
        .as_raw_nonzero()
        .get()
        .unsigned_abs();
    list.retain(|&(pid, start)| {
        table
            .iter()
            .any(|(p, s)| *p == pid && s.start == start && s.ppid == me)
    });
    let list = list.clone();
    table
        .iter()
        .filter(move |(pid, s)| s.ppid == me && !list.contains(&(*pid, s.start)))
}

/// Reaps the adopted orphans that have exited; returns how many. Cheap when adoption is off.
pub fn reap_adopted() -> usize {
    if !ADOPTING.load(Ordering::SeqCst) {
        return 0;
    }
    let mut list = spawned();
    let table = proc::table();
    let mut reaped = 0;
    for (pid, _) in adopted_in(&table, &mut list).filter(|(_, s)| s.zombie) {
        let Some(pid) = i32::try_from(*pid).ok().and_then(Pid::from_raw) else {
            continue;
        };
        match rustix::process::waitpid(Some(pid), WaitOptions::NOHANG) {
            Ok(Some(_)) => reaped += 1,
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(pid = pid.as_raw_nonzero().get(), error = %e, "cannot reap an adopted orphan")
            }
        }
    }
    reaped
}

/// SIGKILLs every live adopted orphan and everything below it, and reaps them. A killed
/// process's own children are reparented here only once it has died, so this goes round
/// again while it finds any, for up to `wait`. Each round's `/proc` scans run on tokio's
/// blocking pool, off the caller's (possibly single-threaded) runtime. Returns how many
/// processes it signalled.
pub async fn kill_adopted(wait: Duration) -> usize {
    if !ADOPTING.load(Ordering::SeqCst) {
        return 0;
    }
    let deadline = Instant::now() + wait;
    let mut signalled: Vec<u32> = Vec::new();
    loop {
        let victims = match tokio::task::spawn_blocking(kill_round).await {
            Ok(v) => v,
            Err(e) => {
                tracing::error!(error = %e, "the orphan kill failed");
                return signalled.len();
            }
        };
        for pid in victims.iter().copied() {
            if !signalled.contains(&pid) {
                signalled.push(pid);
            }
        }
        if victims.is_empty() || Instant::now() >= deadline {
            return signalled.len();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One round of [`kill_adopted`]: the live adopted orphans and their trees SIGKILLed, what
/// has exited reaped; returns the processes signalled.
fn kill_round() -> Vec<u32> {
    let victims = {
        let mut list = spawned();
        let table = proc::table();
        let roots: Vec<u32> = adopted_in(&table, &mut list)
            .filter(|(_, s)| !s.zombie)
            .map(|(pid, _)| *pid)
            .collect();
        let mut victims = roots.clone();
        for root in roots {
            victims.extend(proc::descendants_in(&table, root));
        }
        victims
    };
    if !victims.is_empty() {
        tracing::warn!(processes = victims.len(), "killing orphans the agent left");
        proc::signal_each(&victims, Signal::KILL);
    }
    reap_adopted();
    victims
}
