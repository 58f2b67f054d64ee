//! `agentbox up`: the launcher, the gateway and the bridge in the foreground on one data dir,
//! for a trial without systemd. The daemon binaries are the ones beside `agentbox` (or in
//! `--bin-dir`); the launcher runs as root, the gateway and the bridge as the service uid; a
//! bridge token is made up when none is set. Ctrl-C (or SIGTERM, or any of the three exiting)
//! stops all three with SIGTERM, then SIGKILL after a grace period.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use agentbox_policy::config::{Config, HostEnv};
use tokio::process::{Child, Command};

use crate::daemons::Daemons;
use crate::error::{CliError, Daemon};

/// `agentbox up`'s options.
#[derive(Debug, clap::Args)]
pub struct UpArgs {
    /// Where agentbox-launcher, agentbox-gateway and agentbox-bridge are (default: beside
    /// this binary).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// The service uid (gateway, bridge, allowed callers); default: `service_user`'s uid from
    /// /etc/passwd.
    #[arg(long)]
    service_uid: Option<u32>,
    /// The launcher's cgroup directory name.
    #[arg(long, default_value = "agentbox")]
    cgroup_parent: String,
}

/// How long the daemons may take to answer on their sockets.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long they get between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

fn io(what: String) -> impl Fn(std::io::Error) -> CliError {
    move |e| CliError::Io {
        what: what.clone(),
        reason: e.to_string(),
    }
}

/// `name`'s uid and gid from `/etc/passwd`.
pub(crate) fn passwd_ids(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        match f.as_slice() {
            [n, _, uid, gid, ..] if *n == name => Some((uid.parse().ok()?, gid.parse().ok()?)),
            _ => None,
        }
    })
}

struct Running {
    name: &'static str,
    child: Child,
}

/// How to start the three daemons on one config.
#[derive(Debug, Clone)]
pub struct StackSpec {
    /// The config file they all read.
    pub config_path: PathBuf,
    /// That file, loaded.
    pub config: Config,
    /// Where their binaries are.
    pub bin_dir: PathBuf,
    /// The service uid and gid (gateway, bridge).
    pub service: (u32, u32),
    /// The bridge's token.
    pub token: String,
    /// The launcher's cgroup directory name.
    pub cgroup_parent: String,
    /// Extra environment for the bridge and the gateway (a provider key).
    pub env: Vec<(String, String)>,
    /// Where their output goes (`<name>.log` each); `None`: this terminal.
    pub log_dir: Option<PathBuf>,
}

/// The three daemons, running; dropping it kills them ([`Stack::stop`] stops them properly).
#[derive(Debug)]
pub struct Stack {
    running: Vec<Running>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({:?})", self.name, self.child.id())
    }
}

impl Stack {
    /// Starts the launcher, waits for its socket, then the bridge and the gateway, and waits
    /// for the gateway's; what was started is stopped again on failure.
    ///
    /// # Errors
    /// A binary that cannot start, a daemon that exits or does not answer in time.
    pub async fn start(spec: &StackSpec) -> Result<Stack, CliError> {
        let mut stack = Stack {
            running: Vec::new(),
        };
        // The launcher first: it lays out the data dir the gateway binds in.
        let started = async {
            stack.running.push(spawn(spec, "agentbox-launcher")?);
            let d = Daemons::new(spec.config.clone());
            wait_ready(&d, Daemon::Launcher, &mut stack.running).await?;
            stack.running.push(spawn(spec, "agentbox-bridge")?);
            stack.running.push(spawn(spec, "agentbox-gateway")?);
            wait_ready(&d, Daemon::Gateway, &mut stack.running).await
        }
        .await;
        match started {
            Ok(()) => Ok(stack),
            Err(e) => {
                stack.stop().await;
                Err(e)
            }
        }
    }

    /// The name of the first daemon to exit.
    pub async fn first_exit(&mut self) -> &'static str {
        first_exit(&mut self.running).await
    }

    /// SIGTERM to each, then SIGKILL to those still there after a grace period; waits for
    /// all.
    pub async fn stop(&mut self) {
        stop_all(&mut self.running).await;
    }
}

/// Starts one daemon of `spec`: the launcher as root, the others as the service uid.
fn spawn(spec: &StackSpec, name: &'static str) -> Result<Running, CliError> {
    let bin = spec.bin_dir.join(name);
    let mut cmd = Command::new(&bin);
    cmd.arg("--config")
        .arg(&spec.config_path)
        .env("AGENTBOX_DATA", &spec.config.data_dir)
        .env(&spec.config.bridge.token_env, &spec.token)
        .stdin(std::process::Stdio::null())
        // A group of its own: the terminal's Ctrl-C reaches the CLI only, which stops the
        // daemons after its own clean-up (a run's stop needs them running).
        .process_group(0)
        .kill_on_drop(true);
    if name == "agentbox-launcher" {
        cmd.arg("--service-uid")
            .arg(spec.service.0.to_string())
            .arg("--cgroup-parent")
            .arg(&spec.cgroup_parent);
    } else {
        cmd.uid(spec.service.0)
            .gid(spec.service.1)
            .envs(spec.env.iter().map(|(k, v)| (k, v)));
    }
    if let Some(dir) = &spec.log_dir {
        let path = dir.join(format!("{name}.log"));
        let log =
            std::fs::File::create(&path).map_err(io(format!("creating {}", path.display())))?;
        let err = log
            .try_clone()
            .map_err(io(format!("opening {}", path.display())))?;
        cmd.stdout(log).stderr(err);
    }
    let child = cmd
        .spawn()
        .map_err(io(format!("starting {}", bin.display())))?;
    if let Some(pid) = child.id() {
        started().push(pid);
    }
    Ok(Running { name, child })
}

/// The daemons started and not yet stopped: a second Ctrl-C exits at once, past every
/// destructor (`kill_on_drop` included), and their own process groups keep the terminal's
/// signal from them, so [`terminate_started`] stops them first.
fn started() -> std::sync::MutexGuard<'static, Vec<u32>> {
    static STARTED: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());
    STARTED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// SIGTERM to every daemon started and not yet stopped (each stops what it runs).
pub(crate) fn terminate_started() {
    for pid in started().drain(..) {
        if let Some(pid) = i32::try_from(pid)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
    }
}

/// Runs the three daemons until interrupted; see the module docs.
///
/// # Errors
/// A bad config, a missing binary, no service uid, or a daemon that does not come up.
pub async fn up(
    args: &UpArgs,
    config_path: &Path,
    env: &dyn HostEnv,
) -> Result<ExitCode, CliError> {
    let config = Config::load(config_path, env)?;
    let bin_dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => bin_dir()?,
    };
    let service = match args.service_uid {
        Some(u) => (u, u),
        None => passwd_ids(&config.service_user).ok_or_else(|| {
            CliError::Usage(format!(
                "service_user {:?} has no passwd entry; create it or pass --service-uid",
                config.service_user
            ))
        })?,
    };
    let token = match env.var(&config.bridge.token_env) {
        Some(t) if !t.is_empty() => t,
        Some(_) | None => crate::run::fresh_token()?,
    };
    std::fs::create_dir_all(&config.data_dir)
        .map_err(io(format!("creating {}", config.data_dir.display())))?;
    let cancel = crate::interrupt_token()?;
    let data_dir = config.data_dir.clone();
    let spec = StackSpec {
        config_path: config_path.to_path_buf(),
        config,
        bin_dir,
        service,
        token,
        cgroup_parent: args.cgroup_parent.clone(),
        env: Vec::new(),
        log_dir: None,
    };
    let mut stack = Stack::start(&spec).await?;
    eprintln!(
        "agentbox is up on {} (launcher, gateway, bridge); Ctrl-C stops all three",
        data_dir.display()
    );
    let exited = tokio::select! {
        () = cancel.cancelled() => None,
        name = stack.first_exit() => Some(name),
    };
    stack.stop().await;
    match exited {
        None => {
            eprintln!("agentbox: stopped the launcher, the gateway and the bridge");
            Ok(ExitCode::SUCCESS)
        }
        Some(name) => Err(CliError::Io {
            what: format!("{name} exited on its own"),
            reason: "the others were stopped; its messages are above".to_owned(),
        }),
    }
}

/// The directory of this binary (where the daemons' binaries are built and installed beside
/// it).
///
/// # Errors
/// When the kernel cannot say where this binary is.
pub fn bin_dir() -> Result<PathBuf, CliError> {
    Ok(std::env::current_exe()
        .map_err(io("locating this binary".to_owned()))?
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default())
}

/// Waits until `daemon` answers on its socket, failing early if a started daemon exits.
async fn wait_ready(d: &Daemons, daemon: Daemon, running: &mut [Running]) -> Result<(), CliError> {
    let start = Instant::now();
    loop {
        if d.probe(daemon).await.is_ok() {
            return Ok(());
        }
        for r in running.iter_mut() {
            if let Ok(Some(status)) = r.child.try_wait() {
                return Err(CliError::Io {
                    what: format!("starting {}", r.name),
                    reason: format!("it exited with {status}; its messages are above"),
                });
            }
        }
        if start.elapsed() > READY_TIMEOUT {
            return Err(CliError::DaemonDown {
                daemon,
                socket: d.socket(daemon).to_path_buf(),
                reason: format!("not answering after {READY_TIMEOUT:?}"),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The name of the first daemon to exit.
async fn first_exit(running: &mut [Running]) -> &'static str {
    loop {
        for r in running.iter_mut() {
            if let Ok(Some(_)) = r.child.try_wait() {
                return r.name;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// SIGTERM to each, then SIGKILL to those still there after [`STOP_GRACE`]; waits for all.
async fn stop_all(running: &mut [Running]) {
    for r in running.iter() {
        let pid = r.child.id().and_then(|p| i32::try_from(p).ok());
        if let Some(pid) = pid.and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
    }
    for r in running.iter_mut() {
        let pid = r.child.id();
        if tokio::time::timeout(STOP_GRACE, r.child.wait())
            .await
            .is_err()
        {
            let _ = r.child.kill().await;
        }
        started().retain(|p| Some(*p) != pid);
    }
}
