//! Child processes for tests. Each runs in its own process group so that everything it starts
//! (opencode's workers, Claude Code's shells) is killed with it, and its output is captured so a
//! failing test can print it.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process_group};

use super::HarnessError;

fn lock<T>(buf: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    buf.lock().unwrap_or_else(PoisonError::into_inner)
}

fn text(buf: &Mutex<Vec<u8>>) -> String {
    String::from_utf8_lossy(&lock(buf)).into_owned()
}

/// Where a drain thread or task collects one of a child's output streams.
type OutputBuf = Arc<Mutex<Vec<u8>>>;

/// `what` could not be started (or waited for).
fn spawn_failed(what: &str) -> impl FnOnce(std::io::Error) -> HarnessError + '_ {
    move |source| HarnessError::Spawn {
        what: what.to_owned(),
        source,
    }
}

fn signal_group(pid: u32, signal: Signal) {
    if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
        // ESRCH just means the group is already gone.
        let _ = kill_process_group(pid, signal);
    }
}

/// A long-running child (a server) that is stopped, with its process group, on drop.
#[derive(Debug)]
pub struct Service {
    what: String,
    child: Child,
    stdout: OutputBuf,
    stderr: OutputBuf,
    stopped: bool,
}

impl Service {
    /// Starts `cmd` in a new process group and waits until `ready` recognizes a stdout line,
    /// returning what `ready` extracted from it (e.g. the address it listens on).
    ///
    /// # Errors
    /// When the process cannot start, exits, or prints no ready line within `timeout`; the
    /// error carries its output so far.
    pub fn start<F>(
        what: &str,
        cmd: Command,
        timeout: Duration,
        ready: F,
    ) -> Result<(Self, String), HarnessError>
    where
        F: Fn(&str) -> Option<String> + Send + 'static,
    {
        let (mut service, rx) = Self::launch(what, cmd, ready)?;
        let reason = match rx.recv_timeout(timeout) {
            Ok(Some(v)) => return Ok((service, v)),
            Ok(None) => "it closed stdout (exited?) before printing its ready line".to_owned(),
            Err(_) => "no ready line on stdout".to_owned(),
        };
        service.stop();
        // Give the drain threads a moment to collect the last output.
        std::thread::sleep(Duration::from_millis(100));
        Err(HarnessError::NotReady {
            what: what.to_owned(),
            timeout,
            reason,
            stdout: service.stdout(),
            stderr: service.stderr(),
        })
    }

    /// Starts `cmd` in a new process group without waiting for anything: for programs that
    /// announce nothing, whose readiness the caller probes itself (the bench's peers).
    ///
    /// # Errors
    /// When the process cannot start.
    pub fn spawn(what: &str, cmd: Command) -> Result<Self, HarnessError> {
        Ok(Self::launch(what, cmd, |_| None)?.0)
    }

    /// Spawns `cmd` with its output drained; the receiver gets what `ready` extracted from the
    /// first stdout line it recognizes, or `None` when stdout closes first.
    fn launch<F>(
        what: &str,
        mut cmd: Command,
        ready: F,
    ) -> Result<(Self, mpsc::Receiver<Option<String>>), HarnessError>
    where
        F: Fn(&str) -> Option<String> + Send + 'static,
    {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(spawn_failed(what))?;
        let (stdout, stderr) = (OutputBuf::default(), OutputBuf::default());
        let (tx, rx) = mpsc::channel::<Option<String>>();
        if let Some(out) = child.stdout.take() {
            let buf = Arc::clone(&stdout);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(out);
                let mut line = Vec::new();
                let mut found = false;
                loop {
                    line.clear();
                    match reader.read_until(b'\n', &mut line) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            lock(&buf).extend_from_slice(&line);
                            let text = String::from_utf8_lossy(&line);
                            if !found && let Some(v) = ready(text.trim_end()) {
                                found = true;
                                let _ = tx.send(Some(v));
                            }
                        }
                    }
                }
                let _ = tx.send(None);
            });
        }
        if let Some(err) = child.stderr.take() {
            drain_into(err, Arc::clone(&stderr));
        }
        let service = Self {
            what: what.to_owned(),
            child,
            stdout,
            stderr,
            stopped: false,
        };
        Ok((service, rx))
    }

    /// [`Service::start`] for our own programs, which announce `<prefix><address>` on stdout
    /// once they serve; returns the address.
    ///
    /// # Errors
    /// As [`Service::start`].
    pub fn start_listening(
        what: &str,
        cmd: Command,
        timeout: Duration,
        prefix: &'static str,
    ) -> Result<(Self, String), HarnessError> {
        Self::start(what, cmd, timeout, move |l| {
            l.strip_prefix(prefix).map(str::to_owned)
        })
    }

    /// Its stdout so far.
    #[must_use]
    pub fn stdout(&self) -> String {
        text(&self.stdout)
    }

    /// Its stderr so far.
    #[must_use]
    pub fn stderr(&self) -> String {
        text(&self.stderr)
    }

    /// The process id (also its process group id).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process has exited.
    pub fn has_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Whether the process still runs.
    pub fn is_running(&mut self) -> bool {
        !self.has_exited()
    }

    /// SIGTERM to the group, then SIGKILL if it lingers past 3 s; reaps the child.
    pub fn stop(&mut self) {
        self.stop_within(Duration::from_secs(3));
    }

    /// SIGTERM to the group, then SIGKILL if it lingers past `wait`; reaps the child.
    pub fn stop_within(&mut self, wait: Duration) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let pid = self.child.id();
        signal_group(pid, Signal::TERM);
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                // The leader is gone; children that ignored TERM still share the group.
                signal_group(pid, Signal::KILL);
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        signal_group(pid, Signal::KILL);
        let _ = self.child.wait();
    }

    /// SIGKILL to the group at once (a crash, as far as the process can tell); reaps it.
    pub fn kill(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        signal_group(self.child.id(), Signal::KILL);
        let _ = self.child.wait();
    }

    /// A description for failure messages.
    #[must_use]
    pub fn describe(&self) -> String {
        format!(
            "{} (pid {})\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.what,
            self.child.id(),
            self.stdout(),
            self.stderr()
        )
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop();
    }
}

fn drain_into<R: Read + Send + 'static>(mut r: R, buf: OutputBuf) {
    std::thread::spawn(move || {
        let mut chunk = [0_u8; 8192];
        loop {
            match r.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => lock(&buf).extend_from_slice(chunk.get(..n).unwrap_or(&[])),
            }
        }
    });
}

/// The outcome of a command run to completion.
#[derive(Debug)]
pub struct Captured {
    /// Exit status.
    pub status: ExitStatus,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
    /// Wall time.
    pub elapsed: Duration,
}

impl Captured {
    /// A description for failure messages.
    #[must_use]
    pub fn describe(&self) -> String {
        format!(
            "status {} after {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.elapsed, self.stdout, self.stderr
        )
    }
}

/// Runs `cmd` (stdin from /dev/null) in its own process group, capturing its output; past
/// `timeout` the whole group is killed and the output so far is returned in the error.
///
/// # Errors
/// When the command cannot start or times out.
pub async fn run_captured(
    what: &str,
    mut cmd: tokio::process::Command,
    timeout: Duration,
) -> Result<Captured, HarnessError> {
    cmd.process_group(0)
        .kill_on_drop(true)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(spawn_failed(what))?;
    let (stdout, stderr) = (OutputBuf::default(), OutputBuf::default());
    let readers = [
        child
            .stdout
            .take()
            .map(|o| tokio_drain(o, Arc::clone(&stdout))),
        child
            .stderr
            .take()
            .map(|e| tokio_drain(e, Arc::clone(&stderr))),
    ];
    let pid = child.id();
    let waited = tokio::time::timeout(timeout, child.wait()).await;
    if waited.is_err()
        && let Some(pid) = pid
    {
        signal_group(pid, Signal::KILL);
        let _ = child.wait().await;
    } else if let Some(pid) = pid {
        // Stray grandchildren would hold our pipes open forever.
        signal_group(pid, Signal::KILL);
    }
    for reader in readers.into_iter().flatten() {
        let _ = tokio::time::timeout(Duration::from_secs(5), reader).await;
    }
    let (out, err) = (text(&stdout), text(&stderr));
    match waited {
        Ok(Ok(status)) => Ok(Captured {
            status,
            stdout: out,
            stderr: err,
            elapsed: start.elapsed(),
        }),
        Ok(Err(source)) => Err(spawn_failed(what)(source)),
        Err(_) => Err(HarnessError::Timeout {
            what: what.to_owned(),
            timeout,
            stdout: out,
            stderr: err,
        }),
    }
}

fn tokio_drain<R>(mut r: R, buf: OutputBuf) -> tokio::task::JoinHandle<()>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut chunk = vec![0_u8; 8192];
        loop {
            match r.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => lock(&buf).extend_from_slice(chunk.get(..n).unwrap_or(&[])),
            }
        }
    })
}

/// The processes of group `pgid` that are still running (zombies excluded: they are dead and
/// only wait for a reaper), as their `/proc/<pid>/stat` lines; for asserting that nothing
/// leaked.
#[must_use]
pub fn live_group_members(pgid: u32) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let pgid = pgid.to_string();
    entries
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            // The command name may contain spaces; the fields after it are fixed.
            let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
            let mut fields = rest.split(' ');
            let state = fields.next();
            let group = fields.nth(1);
            group == Some(pgid.as_str()) && state != Some("Z")
        })
        .collect()
}

/// Polls [`live_group_members`] until the group is empty or `timeout` passes (SIGKILL is
/// delivered asynchronously); returns the members still alive.
#[must_use]
pub fn wait_group_gone(pgid: u32, timeout: Duration) -> Vec<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = live_group_members(pgid);
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`), in KiB; `None` once the process
/// is gone or the field is absent.
#[must_use]
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
}

/// How many descriptors `pid` holds open (`/proc/<pid>/fd`); 0 once it is gone.
#[must_use]
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// Whether `pid` is a live process (a zombie is dead: it only waits for its reaper).
#[must_use]
pub fn is_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
}
