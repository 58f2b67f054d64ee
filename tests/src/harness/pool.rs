//! The rollout-slot stack of `tests/tests/pool*.rs` and `bench pool`: fakellm as the rollout
//! router behind a `backend = "router"` model, the gateway as the service user, the launcher as
//! root on the gateway's data dir starting the real blackbox-server in slot sandboxes (the
//! server and the pinned CLIs hard-linked or copied where the slot uid can read them), and
//! `agentbox-pool` as a process (the service user) on `run/pool.sock`.
//!
//! Like [`super::launcher`] these helpers panic on failure, with every daemon's log: they are
//! assertions of the tests that call them. Timeouts are hang guards only.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::missing_panics_doc)]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use agentbox_api::launcher::SlotStatus;
use agentbox_api::pool::{AcquireRequest, Lease, LeaseRef, PoolStatus};
use agentbox_api::{ClientError, PoolClient};
use agentbox_policy::id::Tid;
use serde_json::Value;

use super::{FakeLlm, GatewayProcess, LauncherProcess, Service, clients_dir, workspace_bin};

/// The service user of the stack (no passwd entry needed).
pub const SERVICE: u32 = 64040;
/// The launcher harness's agent range.
pub const AGENT_UIDS: std::ops::Range<u32> = 64000..64010;

/// A base port with `n` free ports from it on loopback.
#[must_use]
pub fn free_port_base(n: u16) -> u16 {
    for _ in 0..100 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = l.local_addr().unwrap().port();
        drop(l);
        if base > 65535 - n {
            continue;
        }
        if (base..base + n).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()) {
            return base;
        }
    }
    panic!("no free port range");
}

/// fakellm, gateway, launcher and pool, started together; dropped together.
pub struct PoolStack {
    /// The router every slot's model calls reach.
    pub fake: FakeLlm,
    pub gateway: GatewayProcess,
    pub launcher: LauncherProcess,
    pub pool: Service,
    /// The pool's (and the CLI's) config file.
    pub config: PathBuf,
    /// The gateway's data dir, which launcher and pool share.
    pub data: PathBuf,
    pub client: PoolClient,
    pub slots: u16,
    pub hang_guard: Duration,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for PoolStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolStack")
            .field("data", &self.data)
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl PoolStack {
    /// The stack with `slots` slots, fakellm answering with `script`.
    #[must_use]
    pub fn start(slots: u16, script: &Value) -> PoolStack {
        let fake = FakeLlm::scripted(script).unwrap();
        let models = fake.router_model();
        let gateway = GatewayProcess::start_as(&models, &[], Some((SERVICE, SERVICE))).unwrap();
        let data = gateway.data_dir();
        let dir = tempfile::Builder::new()
            .prefix("pool-it-")
            .tempdir()
            .unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        // The server binary where the slot's uid can read it.
        let bbs = dir.path().join("blackbox-server");
        std::fs::copy(
            workspace_bin("agentbox-blackbox", "blackbox-server").unwrap(),
            &bbs,
        )
        .unwrap();
        std::fs::set_permissions(&bbs, std::fs::Permissions::from_mode(0o755)).unwrap();
        // The pinned CLIs, hard-linked where the slot's uid can reach them (the cache lives
        // under /root).
        let clients = dir.path().join("clients");
        let st = Command::new("cp")
            .arg("-al")
            .arg(clients_dir().unwrap_or_else(|e| panic!("{e}")))
            .arg(&clients)
            .status()
            .unwrap();
        assert!(st.success());
        let repos = dir.path().join("repos");
        std::fs::create_dir_all(&repos).unwrap();
        let launcher_toml = format!(
            "[launcher]\nrepo_roots = [{repos:?}]\nvenv_root = \"/nonexistent/venvs\"\nblackbox_bin = {bbs:?}\nclients_dir = {clients:?}\n"
        );
        let launcher =
            LauncherProcess::start_on(Some(&data), &format!("{launcher_toml}{models}"), SERVICE)
                .unwrap();
        let config = dir.path().join("agentbox.toml");
        std::fs::write(
            &config,
            format!(
                "data_dir = {data:?}\nagent_uid_count = 10\n{launcher_toml}{models}[pool]\nslots = {slots}\nmodel = \"rollout\"\nlisten_host = \"127.0.0.1\"\nadvertise_host = \"127.0.0.1\"\nport_base = {}\nnode_id = \"node-test-abcdefgh\"\nhealth_interval_s = 1\nlease_ttl_s = 0\nbudget_tokens = 100000\n",
                free_port_base(slots)
            ),
        )
        .unwrap();
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
        let (pool, socket) = Self::spawn_pool(&config);
        assert_eq!(Path::new(&socket), data.join("run/pool.sock"));
        let client = PoolClient::new(&socket);
        PoolStack {
            fake,
            gateway,
            launcher,
            pool,
            config,
            data,
            client,
            slots,
            hang_guard: Duration::from_secs(180),
            _dir: dir,
        }
    }

    /// An `agentbox-pool` process on `config`, as the service user; (it, its socket).
    #[must_use]
    pub fn spawn_pool(config: &Path) -> (Service, String) {
        let mut cmd = Command::new(workspace_bin("agentbox-pool", "agentbox-pool").unwrap());
        cmd.arg("--config")
            .arg(config)
            .env_clear()
            .env("RUST_LOG", "info")
            .uid(SERVICE)
            .gid(SERVICE);
        Service::start_listening(
            "agentbox-pool",
            cmd,
            Duration::from_secs(60),
            "listening on unix:",
        )
        .unwrap()
    }

    /// Every daemon's log.
    #[must_use]
    pub fn describe(&self) -> String {
        format!(
            "{}\n{}\n{}",
            self.pool.describe(),
            self.launcher.describe(),
            self.gateway.describe()
        )
    }

    pub async fn status(&self) -> PoolStatus {
        self.client
            .status()
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.describe()))
    }

    /// Polls the status until `ok` holds.
    pub async fn until(&self, what: &str, ok: impl Fn(&PoolStatus) -> bool) -> PoolStatus {
        let deadline = Instant::now() + self.hang_guard;
        loop {
            let s = self.status().await;
            if ok(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {s:#?}\n{}",
                self.describe()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// SIGTERM, as systemd stops it, and waits until it has exited.
    pub async fn terminate_pool(&mut self) {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(i32::try_from(self.pool.pid()).unwrap()).unwrap(),
            rustix::process::Signal::TERM,
        )
        .unwrap();
        let deadline = Instant::now() + self.hang_guard;
        while !self.pool.has_exited() {
            assert!(
                Instant::now() < deadline,
                "pool did not stop\n{}",
                self.describe()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The launcher's view of slot `tid` (a generation's tid, as the pool status names it).
    ///
    /// # Errors
    /// The launcher's refusal (404 once the slot is deleted).
    pub async fn slot(&self, tid: &str) -> Result<SlotStatus, ClientError> {
        let tid = Tid::parse(tid).unwrap_or_else(|e| panic!("slot tid {tid:?}: {e}"));
        self.launcher.client().slot(&tid).await
    }

    /// Asserts that generation `tid` is gone: the launcher has no slot of it and its gateway
    /// task is closed.
    pub async fn assert_generation_gone(&self, tid: &str) {
        let gone = self.slot(tid).await.unwrap_err();
        assert_eq!(gone.status(), Some(404), "slot {tid}: {gone}");
        assert_eq!(
            self.gateway.task(tid).await.unwrap()["state"],
            "closed",
            "task {tid}"
        );
    }

    pub async fn acquire(&self, t: &str) -> Lease {
        self.client
            .acquire(&acquire(t))
            .await
            .unwrap_or_else(|e| panic!("acquire {t}: {e}\n{}", self.describe()))
    }
}

/// An acquire of a blackbox slot for trajectory `t`.
#[must_use]
pub fn acquire(t: &str) -> AcquireRequest {
    AcquireRequest {
        trajectory_id: t.into(),
        env_type: Some("blackbox".into()),
        env_args: None,
    }
}

/// The lease of trajectory `t`.
#[must_use]
pub fn by_traj(t: &str) -> LeaseRef {
    LeaseRef {
        trajectory_id: Some(t.into()),
        lease_id: None,
        reason: None,
    }
}

/// The lease `id`, by its id alone.
#[must_use]
pub fn by_lease(id: &str) -> LeaseRef {
    LeaseRef {
        trajectory_id: None,
        lease_id: Some(id.into()),
        reason: None,
    }
}

/// Every path under `root` whose name contains `needle`.
#[must_use]
pub fn paths_naming(root: &Path, needle: &str) -> Vec<PathBuf> {
    walkdir::WalkDir::new(root)
        .into_iter()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains(needle))
        .map(|e| e.path().to_path_buf())
        .collect()
}
