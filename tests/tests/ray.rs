//! Ray, for real (issue 14): two "hosts" on this machine, each a real gateway (service user),
//! launcher (root) and `agentbox-pool` (service user) on its own data dir, with fakellm as the
//! rollout router; then `integrations/ray/tests/test_two_nodes.py`, in the venv
//! `scripts/install-ray.sh` builds, starts a local two-node Ray cluster whose raylets each name
//! one of the pools (`AGENTBOX_POOL_SOCKET`), spreads 8 leases over both, stops pool A (SIGTERM
//! to `AGENTBOX_RAY_TEST_POOL_A_PID`) and checks its leases become LOST and new acquires land
//! on B. The Python test skips without the pools; here a skip is a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use agentbox_tests::harness::{
    FakeLlm, GatewayProcess, LauncherProcess, Service, clients_dir, workspace_bin, workspace_root,
};
use serde_json::json;

/// The service user's uid/gid for this test (no passwd entry needed: `--service-uid`).
const SERVICE: u32 = 64031;
const SLOTS: u32 = 4;
/// Slot cold starts (a blackbox-server each) happen before the pool is asked anything; the
/// pool prints its ready line as soon as its socket is bound.
const POOL_READY: Duration = Duration::from_secs(120);

/// One host: its daemons, stopped in reverse order on drop (pool first).
struct Host {
    pool: Service,
    socket: PathBuf,
    _launcher: LauncherProcess,
    _gateway: GatewayProcess,
}

/// A copy of `src` in `dir` (0755) that the agent uids can read and run.
fn readable_copy(src: &Path, dir: &Path) -> PathBuf {
    let dst = dir.join(src.file_name().unwrap());
    std::fs::copy(src, &dst).unwrap();
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755)).unwrap();
    dst
}

fn start_host(name: &str, fake: &FakeLlm, bins: &Path, port_base: u16) -> Host {
    let models = fake.router_model();
    let gateway = GatewayProcess::start_as(
        &format!("[gateway]\n{models}"),
        &[],
        Some((SERVICE, SERVICE)),
    )
    .unwrap();
    let data = gateway.data_dir();
    let bbs = bins.join("blackbox-server");
    let clients = clients_dir().unwrap_or_else(|e| panic!("{e}"));
    let launcher_toml = format!(
        "[launcher]\nblackbox_bin = {bbs:?}\nclients_dir = {clients:?}\nrepo_roots = []\nvenv_root = \"/nonexistent/venvs\"\n"
    );
    let launcher =
        LauncherProcess::start_on(Some(&data), &format!("{launcher_toml}{models}"), SERVICE)
            .unwrap();
    let config = bins.join(format!("pool-{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "data_dir = {data:?}\n{launcher_toml}{models}\n[pool]\nslots = {SLOTS}\nmodel = \"rollout\"\nlisten_host = \"127.0.0.1\"\nadvertise_host = \"127.0.0.1\"\nport_base = {port_base}\nnode_id = \"{name}\"\nhealth_interval_s = 1\nlease_ttl_s = 0\n"
        ),
    )
    .unwrap();
    let mut cmd = Command::new(workspace_bin("agentbox-pool", "agentbox-pool").unwrap());
    cmd.arg("--config")
        .arg(&config)
        .env_clear()
        .env("RUST_LOG", "info")
        .env("AGENTBOX_DATA", &data);
    {
        use std::os::unix::process::CommandExt;
        cmd.uid(SERVICE).gid(SERVICE);
    }
    let (pool, socket) =
        Service::start_listening("agentbox-pool", cmd, POOL_READY, "listening on unix:")
            .unwrap_or_else(|e| panic!("{e}\n{}\n{}", launcher.describe(), gateway.describe()));
    Host {
        pool,
        socket: PathBuf::from(socket.trim()),
        _launcher: launcher,
        _gateway: gateway,
    }
}

/// The venv with the pinned ray, pytest and this checkout's `integrations/ray`.
fn ray_venv() -> PathBuf {
    if let Some(dir) = std::env::var_os("AGENTBOX_RAY_VENV") {
        return PathBuf::from(dir);
    }
    let out = Command::new(workspace_root().join("scripts/install-ray.sh"))
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "install-ray.sh failed");
    let stdout = String::from_utf8(out.stdout).unwrap();
    PathBuf::from(stdout.lines().last().unwrap().trim())
}

#[test]
fn two_ray_nodes_two_pools_leases_spread_and_a_lost_pool() {
    let venv = ray_venv();
    let fake = FakeLlm::start(
        env!("CARGO_BIN_EXE_fakellm").as_ref(),
        &json!({"rules": [{"match": {}, "text": "ok"}]}),
    )
    .unwrap();
    let bins = tempfile::Builder::new()
        .prefix("ray-bins-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(bins.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    readable_copy(
        &workspace_bin("agentbox-blackbox", "blackbox-server").unwrap(),
        bins.path(),
    );
    let mut a = start_host("node-a", &fake, bins.path(), 31400);
    let mut b = start_host("node-b", &fake, bins.path(), 31500);

    let out = Command::new(venv.join("bin/python"))
        .current_dir(workspace_root().join("integrations/ray"))
        .args([
            "-m",
            "pytest",
            "tests/test_two_nodes.py",
            "-q",
            "-s",
            "-rs",
            "-p",
            "no:cacheprovider",
        ])
        .env("AGENTBOX_RAY_TEST_POOL_A", &a.socket)
        .env("AGENTBOX_RAY_TEST_POOL_B", &b.socket)
        .env("AGENTBOX_RAY_TEST_POOL_A_PID", a.pool.pid().to_string())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed") && !text.contains("skipped"),
        "{text}\n--- pool A ---\n{}\n--- pool B ---\n{}",
        a.pool.describe(),
        b.pool.describe()
    );
    // Pool A was stopped by the test (and shut down cleanly); pool B still serves.
    assert!(a.pool.has_exited(), "pool A still running");
    assert!(b.pool.is_running(), "pool B died\n{}", b.pool.describe());
}
