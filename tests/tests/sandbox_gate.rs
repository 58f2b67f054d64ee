//! The start gate of a sandbox (`bwrap::Start::Gated`), with real bwrap as root: the command
//! runs only once the gate opens; a gate closed after the kill, or dropped unopened, never lets
//! it run. The launcher builds its sandbox behind the gate while the workspace is handed over,
//! so this is what keeps an agent from running in a workspace that was not (or could not be)
//! handed over.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use agentbox_sandbox::bwrap::{self, Mounts, Plan, Program, RunAs, Start};

/// Clear of the uids the launcher tests and the bench use.
const GATE_UID: u32 = 64900;

fn workspace() -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix("gate-").tempdir().unwrap();
    std::os::unix::fs::chown(dir.path(), Some(GATE_UID), Some(GATE_UID)).unwrap();
    dir
}

fn open_dir(p: &Path) -> OwnedFd {
    use rustix::fs::{Mode, OFlags};
    rustix::fs::open(
        p,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .unwrap()
}

fn spawn(ws: &Path, start: Start) -> bwrap::Sandbox {
    spawn_in(ws, start, &[])
}

/// bash in the sandbox writes `ran` into the workspace; bwrap joins the cgroup of `join`.
fn spawn_in(ws: &Path, start: Start, join: &[PathBuf]) -> bwrap::Sandbox {
    let plan = Plan {
        program: Program::Bash {
            command: "echo yes > /workspace/ran".into(),
        },
        env: bwrap::environment(&BTreeMap::new(), false, None, false),
        with_venv: false,
        with_gateway: false,
        tmp_bytes: 1 << 20,
        home_bytes: 1 << 20,
        file_bytes: 1 << 20,
        claude_bin: PathBuf::from("/nonexistent"),
    };
    let mounts = Mounts {
        workspace: open_dir(ws),
        venv: None,
        gateway: None,
        home: None,
        tmp: None,
        server_dir: None,
        clients: None,
        attach: None,
    };
    let run_as = RunAs {
        uid: GATE_UID,
        gid: GATE_UID,
    };
    bwrap::spawn(
        &plan,
        &mounts,
        join,
        run_as,
        Path::new(bwrap::BWRAP),
        None,
        start,
    )
    .unwrap()
}

/// Long enough for bwrap to have built the sandbox (a few ms) many times over.
const HELD: Duration = Duration::from_millis(500);

/// bwrap is alive and the command has not run.
async fn held_back(sandbox: &mut bwrap::Sandbox, ws: &Path) {
    tokio::time::sleep(HELD).await;
    assert!(
        sandbox.child.try_wait().unwrap().is_none(),
        "bwrap ended while its gate was shut"
    );
    assert!(
        !ws.join("ran").exists(),
        "the command ran behind a shut gate"
    );
}

/// A cgroup of its own under a parent of its own, both removed on drop (the sandbox in it
/// killed first).
struct TestCgroup {
    cgroups: agentbox_sandbox::cgroup::Cgroups,
    cgroup: agentbox_sandbox::cgroup::TaskCgroup,
}

impl TestCgroup {
    async fn new(name: &str) -> TestCgroup {
        let cgroups = agentbox_sandbox::cgroup::Cgroups::detect(
            Path::new("/sys/fs/cgroup"),
            &format!("agentbox-gate-test-{}-{name}", std::process::id()),
            Arc::new(agentbox_sandbox::cgroup::RealSignaller),
        )
        .unwrap();
        cgroups.prepare().unwrap();
        let cgroup = cgroups.create_unlimited(name).await.unwrap();
        TestCgroup { cgroups, cgroup }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = self.cgroup.remove();
        let parents: Vec<PathBuf> = match self.cgroups.hierarchy() {
            agentbox_sandbox::cgroup::Hierarchy::V1(dirs) => dirs.all(),
            agentbox_sandbox::cgroup::Hierarchy::V2 { parent, .. } => vec![parent.clone()],
        };
        for p in parents {
            let _ = std::fs::remove_dir(p);
        }
    }
}

fn require_root() -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    eprintln!("skipped: starting bwrap as the agent uid needs root");
    false
}

#[tokio::test]
async fn the_command_runs_once_the_gate_opens() {
    if !require_root() {
        return;
    }
    let ws = workspace();
    let mut sandbox = spawn(ws.path(), Start::Gated);
    held_back(&mut sandbox, ws.path()).await;
    sandbox.gate.take().unwrap().open().unwrap();
    let status = sandbox.child.wait().await.unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("ran")).unwrap(),
        "yes\n"
    );
    assert_eq!(sandbox.status.read().exit_code, Some(0));
}

#[tokio::test]
async fn a_start_called_off_never_runs_its_command() {
    if !require_root() {
        return;
    }
    let ws = workspace();
    // As the launcher calls a start off: everything in the sandbox's cgroup killed, then the
    // gate closed. Killing bwrap alone does not do (this test failed that way): the sandbox's
    // init, blocked on the gate, outlives it and runs the command at end of file.
    let cg = TestCgroup::new("called-off").await;
    let mut sandbox = spawn_in(ws.path(), Start::Gated, &cg.cgroup.join_files());
    held_back(&mut sandbox, ws.path()).await;
    cg.cgroup.kill_all().await.unwrap();
    sandbox.child.wait().await.unwrap();
    sandbox.gate.take().unwrap().close_after_kill();
    tokio::time::sleep(HELD).await;
    assert!(
        !ws.path().join("ran").exists(),
        "the command ran after the kill"
    );
    assert_eq!(sandbox.status.read().exit_code, None);
}

#[tokio::test]
async fn a_gate_dropped_unopened_stays_shut() {
    if !require_root() {
        return;
    }
    let ws = workspace();
    let cg = TestCgroup::new("dropped").await;
    let mut sandbox = spawn_in(ws.path(), Start::Gated, &cg.cgroup.join_files());
    // Dropped without open or close_after_kill: the descriptor is kept, not closed (a closed
    // pipe would read as end of file, and bwrap goes on at end of file).
    drop(sandbox.gate.take());
    held_back(&mut sandbox, ws.path()).await;
    // The sandbox's init would wait on the leaked descriptor for as long as this process lives.
    cg.cgroup.kill_all().await.unwrap();
    sandbox.child.wait().await.unwrap();
}

#[tokio::test]
async fn an_ungated_start_runs_at_once() {
    if !require_root() {
        return;
    }
    let ws = workspace();
    let mut sandbox = spawn(ws.path(), Start::Now);
    assert!(sandbox.gate.is_none());
    let status = sandbox.child.wait().await.unwrap();
    assert!(status.success(), "{status}");
    assert!(ws.path().join("ran").exists());
}
