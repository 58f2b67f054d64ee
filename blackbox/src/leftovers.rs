//! Agents a previous server left running. A server killed outright (SIGKILL, the OOM killer)
//! cannot stop its agents: the parent-death signal ends each agent's leader, but what the
//! agent started lives on, in the agent's process group or in groups of its own (opencode's
//! tool shells; `timeout` moves itself to a new group). What they all keep is the environment
//! the server gave the agent, whose `HOME` (or state dir) lies in the run's runtime directory.
//!
//! So a server starting on a runtime root, before it serves, kills every process whose
//! environment names a runtime directory under that root, unless that run's agent leader
//! (`<runtime dir>/run/<agent>.pid`) still lives: that run belongs to another live server
//! sharing the root. Like the launcher's restart, it stops leftovers and never re-adopts them:
//! their pipes died with the old server.

use std::io::Read;
use std::path::{Path, PathBuf};

use rustix::process::{Pid, Signal};

/// How many sweeps a run gets: a leftover may fork between the scan and the kill.
const SWEEPS: usize = 5;

/// Kills what the runs under `runtime_root` left behind; how many processes it killed.
pub fn kill(runtime_root: &Path) -> usize {
    if !runtime_root.exists() {
        return 0;
    }
    // What is under a root another user could fill (pid files, run names) decides what gets
    // killed: such a root is left alone here, and registration refuses it too.
    if let Err(e) = crate::runtime_dir::check(runtime_root) {
        tracing::warn!(error = %e, "not scanning the runtime root for leftovers");
        return 0;
    }
    let Ok(runs) = std::fs::read_dir(runtime_root) else {
        return 0;
    };
    let mut killed = 0;
    for run in runs.flatten() {
        let dir = run.path();
        let needle = needle(&dir);
        if leaders(&dir)
            .iter()
            .any(|p| environ_names(*p, needle.as_os_str().as_encoded_bytes()))
        {
            continue;
        }
        for _ in 0..SWEEPS {
            let left = named_by(needle.as_os_str().as_encoded_bytes());
            if left.is_empty() {
                break;
            }
            tracing::warn!(run = %dir.display(), pids = ?left, "killing what a previous server left running");
            for pid in left {
                let Some(p) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
                    continue;
                };
                match rustix::process::kill_process(p, Signal::KILL) {
                    Ok(()) => killed += 1,
                    Err(e) => tracing::error!(pid, error = %e, "cannot kill a leftover"),
                }
            }
        }
    }
    killed
}

/// `dir` with a trailing slash, so `rt-ab` does not match `rt-abc`.
fn needle(dir: &Path) -> PathBuf {
    let mut s = dir.as_os_str().to_owned();
    s.push("/");
    PathBuf::from(s)
}

/// The agent leaders recorded in `<dir>/run/*.pid`: regular files only (never a FIFO the
/// agent, which runs as our user, left there), a pid's worth of bytes each.
fn leaders(dir: &Path) -> Vec<u32> {
    let Ok(files) = std::fs::read_dir(dir.join("run")) else {
        return Vec::new();
    };
    files
        .flatten()
        .filter(|f| f.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|f| {
            let mut text = String::new();
            std::fs::File::open(f.path())
                .and_then(|file| file.take(32).read_to_string(&mut text))
                .ok()?;
            text.trim().parse().ok()
        })
        .collect()
}

/// Whether live process `pid` has `needle` in its environment.
fn environ_names(pid: u32, needle: &[u8]) -> bool {
    let live = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')));
    live && std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.windows(needle.len()).any(|w| w == needle))
}

/// Every live process but this one whose environment contains `needle`.
fn named_by(needle: &[u8]) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id();
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|pid| *pid != me && environ_names(*pid, needle))
        .collect()
}
