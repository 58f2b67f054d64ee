//! `execute_cmd`: one shell line run as `/bin/sh -lc` in a process group of its own (through
//! the sandbox crate's `proc`), its stdout and stderr captured up to a cap each, and the
//! whole group killed when it outlives its timeout, so a `sleep 1000 &` it left behind cannot
//! hold the answer open.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use agentbox_sandbox::proc::{self, ChildSetup, Sink};
use rustix::process::Signal;

use crate::model::{ExecuteCmdResult, Timestamp};

/// The most of each stream kept; the rest is read and dropped.
pub const OUTPUT_CAP: u64 = 8 << 20;

/// How long the group gets between SIGTERM and SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(2);

/// How long the captures may take to see their pipes close once the group is killed.
const CAPTURE_GRACE: Duration = Duration::from_secs(2);

/// Where the running command's process group is published, so abort and shutdown can kill it.
pub type GroupSlot = Arc<Mutex<Option<u32>>>;

/// Kills the group published in `slot`, if any.
pub fn kill_published(slot: &GroupSlot) {
    let pgid = *slot.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(pgid) = pgid
        && let Err(e) = proc::signal_group(pgid, Signal::KILL)
    {
        tracing::warn!(pgid, error = %e, "cannot kill execute_cmd's group");
    }
}

/// A capture target in memory.
#[derive(Debug, Default)]
struct Memory(Vec<u8>);

impl Sink for &mut Memory {
    async fn write(&mut self, chunk: &[u8]) {
        self.0.extend_from_slice(chunk);
    }
    async fn finish(&mut self) {}
}

/// Runs `cmd` with `/bin/sh -lc`, publishing its process group in `slot` while it runs.
///
/// # Errors
/// When the shell cannot be started.
pub async fn run_shell(
    cmd: &str,
    timeout: Duration,
    slot: &GroupSlot,
) -> Result<ExecuteCmdResult, proc::SpawnError> {
    let started_at = Timestamp::now();
    let started = Instant::now();
    let mut command = tokio::process::Command::new("/bin/sh");
    command
        .args(["-lc", cmd])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = ChildSetup::same_identity().new_session().spawn(command)?;
    let pgid = child.id();
    *slot.lock().unwrap_or_else(PoisonError::into_inner) = pgid;

    let (mut out, mut err) = (Memory::default(), Memory::default());
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let (status, seen, timed_out) = {
        let captures = async {
            let o = async {
                match stdout {
                    Some(p) => proc::capture(p, &mut out, Some(OUTPUT_CAP)).await,
                    None => proc::Captured::default(),
                }
            };
            let e = async {
                match stderr {
                    Some(p) => proc::capture(p, &mut err, Some(OUTPUT_CAP)).await,
                    None => proc::Captured::default(),
                }
            };
            tokio::join!(o, e)
        };
        let mut captures = std::pin::pin!(captures);
        // Like `communicate()`: done when the shell exited and both pipes closed.
        let finished = tokio::time::timeout(timeout, async {
            let (status, seen) = tokio::join!(child.wait(), captures.as_mut());
            (status.ok(), seen)
        })
        .await;
        match finished {
            Ok((status, seen)) => (status, seen, false),
            Err(_) => {
                // Members that left the group (their own session) are found while still ours.
                let tree = pgid.map(proc::descendants).unwrap_or_default();
                let status = proc::terminate_group(&mut child, TERM_GRACE).await.ok();
                // Members that ignored SIGTERM while the leader died still hold the pipes.
                if let Some(pgid) = pgid
                    && let Err(e) = proc::signal_group(pgid, Signal::KILL)
                {
                    tracing::warn!(pgid, error = %e, "cannot kill execute_cmd's group");
                }
                proc::signal_each(&tree, Signal::KILL);
                let seen = tokio::time::timeout(CAPTURE_GRACE, captures.as_mut())
                    .await
                    .unwrap_or_default();
                (status, seen, true)
            }
        }
    };
    *slot.lock().unwrap_or_else(PoisonError::into_inner) = None;
    let (so, se) = seen;
    Ok(ExecuteCmdResult {
        cmd: cmd.to_owned(),
        stdout: String::from_utf8_lossy(&out.0).into_owned(),
        stderr: String::from_utf8_lossy(&err.0).into_owned(),
        returncode: status.and_then(proc::exit_code),
        timed_out,
        duration_seconds: started.elapsed().as_secs_f64(),
        started_at,
        finished_at: Timestamp::now(),
        stdout_truncated: so.truncated,
        stderr_truncated: se.truncated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `cmd` with `timeout`; its result and the slot it ran in.
    async fn run(cmd: &str, timeout: Duration) -> (ExecuteCmdResult, GroupSlot) {
        let slot: GroupSlot = Arc::new(Mutex::new(None));
        let out = run_shell(cmd, timeout, &slot).await.unwrap();
        (out, slot)
    }

    #[tokio::test]
    async fn output_and_exit_code() {
        let (out, s) = run("echo out; echo err >&2; exit 3", Duration::from_secs(10)).await;
        assert_eq!(
            (out.stdout.as_str(), out.stderr.as_str()),
            ("out\n", "err\n")
        );
        assert_eq!(out.returncode, Some(3));
        assert!(!out.timed_out);
        assert!(s.lock().unwrap().is_none());
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_group() {
        let started = Instant::now();
        // The background sleep keeps stdout open and ignores the shell's death.
        let (out, _) = run(
            "trap '' TERM; sleep 300 & echo $!; wait",
            Duration::from_millis(500),
        )
        .await;
        assert!(out.timed_out);
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "{:?}",
            started.elapsed()
        );
        let pid: i32 = out.stdout.trim().parse().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false);
        assert!(!alive, "the background sleep survived");
    }

    #[tokio::test]
    async fn output_is_capped() {
        let (out, _) = run(
            "head -c 9000000 /dev/zero | tr '\\0' x",
            Duration::from_secs(20),
        )
        .await;
        assert_eq!(out.stdout.len() as u64, OUTPUT_CAP);
        assert!(out.stdout_truncated && !out.stderr_truncated);
        assert_eq!(out.returncode, Some(0));
    }
}
