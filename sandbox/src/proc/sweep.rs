//! Killing every process on the host that holds an identity, before that identity serves again.
//!
//! A run's agent uid is reused by a later run. Its cgroup holds every process the sandbox
//! started, and is emptied at the end, but a process can hold the uid without being in it: a
//! local user who executes a setuid file the agent left in its workspace (the seccomp filter
//! refuses setuid bits in every mode it can read, but `openat2`'s lies in memory), or anything
//! that got the uid another way. Such a process would meet the next run that uid serves: read
//! and write that run's workspace, signal its agent. So before an identity is given back,
//! [`sweep_identity`] kills every process any of whose threads holds the uid or the gid as its
//! real, effective, saved or filesystem id or (the gid) as a supplementary group, and scans
//! again until a scan finds none: a process could fork meanwhile, and a thread can hold
//! credentials of its own (a raw `setresuid` changes one thread only), so every thread's
//! `status` is read, not only the leader's.
//!
//! A process in a cgroup whose top-level directory's name starts with the sandbox prefix
//! (`agentbox`, the default `--cgroup-parent`, and every test and bench launcher's) is a sandbox
//! of some launcher on this host and is left alone: only root can put a process there, and
//! two launchers sharing an identity range (the tests run many at once) must not kill each
//! other's runs. At a sweep the identity's own run has left its cgroup already.
//!
//! Each process is opened as a pidfd before its `status` is read and signalled through that
//! pidfd, so a pid reused in between is never signalled on the strength of another process's
//! credentials. Zombies hold nothing and are skipped.

use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, Signal};

/// Scans before giving up: each kills what it finds, so only a process that forks faster than
/// a scan reaches it outlives them all.
const MAX_SCANS: u32 = 50;

/// The pause between scans once something was killed: the killed are gone by the next.
const PAUSE: Duration = Duration::from_millis(2);

/// Processes holding one of the identities survived every scan.
#[derive(Debug, thiserror::Error)]
#[error(
    "processes holding a uid in {uids:?} or a gid in {gids:?} are still alive after {MAX_SCANS} scans"
)]
pub struct SweepError {
    pub uids: Range<u32>,
    pub gids: Range<u32>,
}

/// The credentials one `status` file shows.
#[derive(Debug, Default, PartialEq, Eq)]
struct Creds {
    uids: Vec<u32>,
    gids: Vec<u32>,
    groups: Vec<u32>,
    zombie: bool,
}

fn ids(line: &str) -> Vec<u32> {
    line.split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect()
}

/// The `Uid:`, `Gid:`, `Groups:` and `State:` lines of a `/proc/<pid>/task/<tid>/status`.
fn creds(status: &str) -> Creds {
    let mut c = Creds::default();
    for line in status.lines() {
        if let Some(rest) = line.strip_prefix("Uid:") {
            c.uids = ids(rest);
        } else if let Some(rest) = line.strip_prefix("Gid:") {
            c.gids = ids(rest);
        } else if let Some(rest) = line.strip_prefix("Groups:") {
            c.groups = ids(rest);
        } else if let Some(rest) = line.strip_prefix("State:") {
            c.zombie = matches!(rest.trim_start().as_bytes().first(), Some(b'Z' | b'X'));
        }
    }
    c
}

/// The identities a sweep looks for.
#[derive(Debug, Clone)]
struct Wanted {
    uids: Range<u32>,
    gids: Range<u32>,
}

/// How the top-level cgroup of every launcher's sandboxes is named (see the module header).
pub const SANDBOX_CGROUP_PREFIX: &str = "agentbox";

/// Whether a `/proc/<pid>/cgroup` text puts the process in a sandbox's cgroup in any hierarchy.
fn in_sandbox_cgroup(cgroups: &str) -> bool {
    cgroups.lines().any(|line| {
        line.splitn(3, ':')
            .nth(2)
            .and_then(|path| path.strip_prefix('/'))
            .is_some_and(|path| path.starts_with(SANDBOX_CGROUP_PREFIX))
    })
}

impl Creds {
    fn holds(&self, w: &Wanted) -> bool {
        !self.zombie
            && (self.uids.iter().any(|u| w.uids.contains(u))
                || self
                    .gids
                    .iter()
                    .chain(&self.groups)
                    .any(|g| w.gids.contains(g)))
    }
}

/// Whether any live thread of the process under `dir` (`<proc>/<pid>`) holds the identity. A
/// process that vanished holds nothing.
fn process_holds(dir: &Path, w: &Wanted) -> bool {
    let Ok(tasks) = std::fs::read_dir(dir.join("task")) else {
        return false;
    };
    tasks
        .flatten()
        .any(|t| std::fs::read_to_string(t.path().join("status")).is_ok_and(|s| creds(&s).holds(w)))
}

/// One scan of `proc_root`: kills what holds the identity; returns how many it signalled.
fn scan(proc_root: &Path, w: &Wanted) -> u64 {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return 0;
    };
    let mut killed = 0;
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|&p| p != me)
        else {
            continue;
        };
        let Some(raw) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
            continue;
        };
        // Opened first: whatever `status` then says is about this process, whatever pid reuse
        // happens after.
        let Ok(pidfd) = rustix::process::pidfd_open(raw, PidfdFlags::empty()) else {
            continue;
        };
        if process_holds(&entry.path(), w)
            && !std::fs::read_to_string(entry.path().join("cgroup"))
                .is_ok_and(|c| in_sandbox_cgroup(&c))
        {
            match rustix::process::pidfd_send_signal(&pidfd, Signal::KILL) {
                Ok(()) => killed += 1,
                Err(Errno::SRCH) => {}
                Err(e) => {
                    tracing::warn!(pid, error = %e, "cannot kill a process holding an agent identity")
                }
            }
        }
    }
    killed
}

/// Kills every process holding a uid in `uids` or a gid in `gids` (see the module header) and
/// returns how many were killed; an error if some still live after [`MAX_SCANS`] scans.
/// `proc_root` is `/proc` (a test may point it elsewhere). Blocking: call from a blocking
/// thread.
pub fn sweep_identity(
    proc_root: &Path,
    uids: Range<u32>,
    gids: Range<u32>,
) -> Result<u64, SweepError> {
    let w = Wanted { uids, gids };
    let mut total = 0;
    for _ in 0..MAX_SCANS {
        let killed = scan(proc_root, &w);
        if killed == 0 {
            return Ok(total);
        }
        total += killed;
        std::thread::sleep(PAUSE);
    }
    Err(SweepError {
        uids: w.uids,
        gids: w.gids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(uid: u32, gid: u32) -> Wanted {
        Wanted {
            uids: uid..uid + 1,
            gids: gid..gid + 1,
        }
    }

    #[test]
    fn sandboxes_are_told_by_their_top_level_cgroup() {
        assert!(in_sandbox_cgroup("4:memory:/agentbox/t1\n1:cpu:/\n"));
        assert!(in_sandbox_cgroup("0::/agentbox-it-12-3/t1\n"));
        assert!(!in_sandbox_cgroup(
            "0::/user.slice/user-1000.slice/agentbox\n"
        ));
        assert!(!in_sandbox_cgroup("4:memory:/process_api/x\n0::/\n"));
        assert!(!in_sandbox_cgroup(""));
    }

    #[test]
    fn reads_every_id_a_status_shows() {
        let status = "Name:\tsleep\nState:\tS (sleeping)\nUid:\t0\t64001\t64001\t64001\nGid:\t0\t0\t0\t0\nGroups:\t10 64002 \n";
        let c = creds(status);
        assert_eq!(c.uids, vec![0, 64001, 64001, 64001]);
        assert_eq!(c.groups, vec![10, 64002]);
        assert!(c.holds(&want(64001, 1)));
        assert!(c.holds(&want(5, 64002)), "a supplementary group");
        assert!(!c.holds(&want(5, 6)));
        assert!(c.holds(&Wanted {
            uids: 64000..64100,
            gids: 1..2,
        }));
        let zombie = creds("State:\tZ (zombie)\nUid:\t64001\t64001\t64001\t64001\n");
        assert!(!zombie.holds(&want(64001, 1)));
    }

    /// A process that drops to another identity on one thread only is still found and killed.
    #[test]
    fn kills_a_process_holding_the_uid_on_any_thread() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        const UID: u32 = 64_917;
        // Python: a thread drops its own credentials with raw setresuid (glibc would change
        // every thread), the main thread keeps root's.
        let script = format!(
            "import ctypes, threading, time\n\
             libc = ctypes.CDLL(None, use_errno=True)\n\
             def drop():\n    libc.syscall({nr}, {UID}, {UID}, {UID})\n    time.sleep(600)\n\
             threading.Thread(target=drop, daemon=True).start()\n\
             time.sleep(600)\n",
            nr = libc::SYS_setresuid
        );
        let mut child = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .spawn()
            .unwrap();
        let dir = Path::new("/proc").join(child.id().to_string());
        let w = want(UID, UID);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !process_holds(&dir, &w) {
            assert!(
                std::time::Instant::now() < deadline,
                "the thread never dropped"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let leader = std::fs::read_to_string(dir.join("status")).unwrap();
        assert!(!creds(&leader).holds(&w), "only one thread holds it");
        let sweep = || sweep_identity(Path::new("/proc"), UID..UID + 1, UID..UID + 1).unwrap();
        assert!(sweep() >= 1);
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
        assert_eq!(sweep(), 0);
    }
}
