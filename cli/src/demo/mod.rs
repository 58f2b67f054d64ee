//! `agentbox demo`: the whole `agentbox run` path on a throwaway setup, with nothing configured
//! and no API key. It checks the host ([`host`]), finds or installs the pinned Claude Code
//! ([`clients`]), makes a temp dir holding a data dir, a config, and a small git repository
//! whose test fails ([`project`]), serves the built-in scripted model (fakellm's engine, in
//! this process on a loopback port) as a `remote` `openai` model behind the bridge, starts
//! the launcher, gateway and bridge there ([`crate::up::Stack`]), runs Claude Code on the
//! repository through [`crate::run::run`], and shows the delivered branch, its diff and the
//! budget spent. The daemons are stopped and the temp dir removed on the way out, Ctrl-C
//! included (`--keep` keeps the dir). `--model ID` uses a model of the normal config instead
//! (its provider key from this environment).

pub mod clients;
pub mod host;
pub mod project;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use agentbox_api::gateway::Budget;
use agentbox_fakellm::{Listen, Script, Server};
use agentbox_policy::config::{Config, HostEnv};
use tokio_util::sync::CancellationToken;

use crate::daemons::Daemons;
use crate::error::CliError;
use crate::run::{self, RunOptions, RunSummary};
use crate::up::{Stack, StackSpec};

/// `agentbox demo`'s options.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Use this model of the config (--config, $AGENTBOX_CONFIG, /etc/agentbox/agentbox.toml)
    /// instead of the built-in scripted one; its provider key comes from this environment.
    #[arg(long)]
    model: Option<String>,
    /// Keep the temp dir (data dir, repository, daemon logs) instead of removing it.
    #[arg(long, env = "AGENTBOX_DEMO_KEEP", value_parser = clap::builder::BoolishValueParser::new())]
    keep: bool,
    /// The run's token budget.
    #[arg(long, default_value_t = 200_000)]
    budget_tokens: u64,
    /// The run's cost budget in USD (default: $0.50 for the built-in model, none otherwise).
    #[arg(long)]
    budget_usd: Option<f64>,
    /// Seconds before the agent is killed.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
}

/// The service uid the gateway and the bridge run as (no passwd entry needed).
const SERVICE_UID: u32 = 64090;
/// The demo's agent uids (one run needs one): the top of the example config's range, away
/// from the ranges the tests use.
const AGENT_UID: u32 = 64980;
const AGENT_UIDS: u32 = 10;
/// The built-in model's id and the variable its (made-up) key is passed in.
const BUILTIN: &str = "demo-scripted";
const KEY_ENV: &str = "AGENTBOX_DEMO_KEY";

fn io(what: impl Into<String>) -> impl Fn(std::io::Error) -> CliError {
    let what = what.into();
    move |e| CliError::Io {
        what: what.clone(),
        reason: e.to_string(),
    }
}

/// Runs the demo; see the module docs.
///
/// # Errors
/// An unfit host (every problem, one line each), an unknown `--model`, a failed install, a
/// daemon that does not come up, or a run that cannot start.
pub async fn demo(
    args: &DemoArgs,
    config_path: &Path,
    env: &dyn HostEnv,
) -> Result<ExitCode, CliError> {
    let cancel = crate::interrupt_token()?;
    // A bad --model fails before anything is installed or started.
    let real = match &args.model {
        Some(id) => Some(configured_model(config_path, env, id)?),
        None => None,
    };
    let installed = clients::installed(env).await?;
    let problems = host::problems(
        &host::RealHost {
            path: env.var("PATH"),
        },
        installed.is_none(),
    );
    if !problems.is_empty() {
        return Err(CliError::HostUnfit(problems));
    }
    let dir = match installed {
        Some(d) => d,
        None => clients::install().await?,
    };
    let claude = clients::claude_bin(&dir)?;
    let tmp = tempfile::Builder::new()
        .prefix("agentbox-demo-")
        .tempdir()
        .map_err(io("creating the demo's temp dir"))?;
    let result = demo_in(tmp.path(), args, real, &claude, env, &cancel).await;
    if args.keep {
        let kept = tmp.keep();
        eprintln!(
            "agentbox: kept {} (repos/calc, data/, logs/)",
            kept.display()
        );
    } else {
        let path = tmp.path().to_path_buf();
        tmp.close()
            .map_err(io(format!("removing {}", path.display())))?;
    }
    result
}

/// A model of the operator's config: its id and its TOML table as the file has it (the file
/// read once, validated and taken apart from the same text).
fn configured_model(
    config_path: &Path,
    env: &dyn HostEnv,
    id: &str,
) -> Result<(String, toml::Table), CliError> {
    let text = std::fs::read_to_string(config_path).map_err(|source| {
        CliError::Config(agentbox_policy::config::ConfigError::Read {
            path: config_path.to_path_buf(),
            source,
        })
    })?;
    let config = Config::from_toml_str(&text, &config_path.display().to_string(), env)?;
    if config.model(id).is_none() {
        return Err(CliError::UnknownModel {
            model: id.to_owned(),
            known: config.models.keys().map(ToString::to_string).collect(),
        });
    }
    let table = text
        .parse::<toml::Table>()
        .ok()
        .and_then(|t| t.get("models")?.get(id)?.as_table().cloned())
        .ok_or_else(|| CliError::Usage(format!("model {id:?}: no [models.{id}] table")))?;
    Ok((id.to_owned(), table))
}

/// A path as a TOML string (the demo's paths are made here, under a UTF-8 temp dir).
fn toml_path(p: &Path) -> Result<toml::Value, CliError> {
    p.to_str()
        .map(toml::Value::from)
        .ok_or_else(|| CliError::Usage(format!("{} is not UTF-8", p.display())))
}

/// Everything after the checks, in `base` (removed by the caller).
async fn demo_in(
    base: &Path,
    args: &DemoArgs,
    real: Option<(String, toml::Table)>,
    claude: &Path,
    env: &dyn HostEnv,
    cancel: &CancellationToken,
) -> Result<ExitCode, CliError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(base, std::fs::Permissions::from_mode(0o755))
        .map_err(io(format!("opening up {}", base.display())))?;
    let logs = base.join("logs");
    let repos = base.join("repos");
    for d in [&logs, &repos, &base.join("bin")] {
        std::fs::create_dir_all(d).map_err(io(format!("creating {}", d.display())))?;
    }
    let claude_bin = readable_copy(claude, &base.join("bin/claude"))?;

    // The model: the built-in script in this process, or the configured one.
    let mut model_env = Vec::new();
    let mut server_task = None;
    let (model, table, budget_usd) = match real {
        Some((id, table)) => (id, table, args.budget_usd),
        None => {
            let script: Script = serde_json::from_value(project::script())
                .map_err(|e| CliError::Usage(format!("the built-in script: {e}")))?;
            let listen = Listen::Tcp(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
            let server = Server::bind(script, &logs.join("model.jsonl"), &listen)
                .await
                .map_err(|e| CliError::Io {
                    what: "serving the built-in model".to_owned(),
                    reason: e.to_string(),
                })?;
            let mut table = toml::Table::new();
            for (k, v) in [
                ("backend", "remote".into()),
                ("provider", "openai".into()),
                ("base_url", format!("http://{}/v1", server.address()).into()),
                ("upstream_model", "agentbox-demo-scripted".into()),
                ("key_env", KEY_ENV.into()),
                ("max_output_tokens", 8192.into()),
                // A mid-size hosted model's prices, so the cost means something.
                ("price_input_per_mtok", 3.0.into()),
                ("price_output_per_mtok", 15.0.into()),
                ("price_cache_read_per_mtok", 0.3.into()),
            ] {
                table.insert(k.to_owned(), v);
            }
            server_task = Some(tokio::spawn(server.serve()));
            model_env.push((KEY_ENV.to_owned(), "sk-demo-no-key-needed".to_owned()));
            (
                BUILTIN.to_owned(),
                table,
                Some(args.budget_usd.unwrap_or(0.5)),
            )
        }
    };
    let bridge = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map_err(io("finding a free port for the bridge"))?;
    let data = base.join("data");
    let config_path = base.join("agentbox.toml");
    // Built as TOML values, not text: a model id may contain `.`, which an unquoted table
    // header would split into nested tables.
    let table_of = |pairs: Vec<(&str, toml::Value)>| -> toml::Value {
        toml::Value::Table(pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    };
    let mut models = toml::Table::new();
    models.insert(model.clone(), toml::Value::Table(table));
    let config = table_of(vec![
        ("data_dir", toml_path(&data)?),
        ("agent_uid", AGENT_UID.into()),
        ("agent_gid", AGENT_UID.into()),
        ("agent_uid_count", AGENT_UIDS.into()),
        (
            "launcher",
            table_of(vec![
                ("claude_bin", toml_path(&claude_bin)?),
                ("repo_roots", toml::Value::Array(vec![toml_path(&repos)?])),
                ("venv_root", toml_path(&base.join("venvs"))?),
            ]),
        ),
        (
            "gateway",
            table_of(vec![("bridge_url", format!("http://{bridge}").into())]),
        ),
        (
            "bridge",
            table_of(vec![("listen", bridge.to_string().into())]),
        ),
        ("models", toml::Value::Table(models)),
    ]);
    let config_text =
        toml::to_string(&config).map_err(|e| CliError::Usage(format!("the demo's config: {e}")))?;
    std::fs::write(&config_path, config_text)
        .map_err(io(format!("writing {}", config_path.display())))?;
    let config = Config::load(&config_path, env)?;
    let repo = repos.join("calc");
    let base_sha = make_repo(&repo).await?;
    chown_tree(&repos, SERVICE_UID)?;
    std::fs::create_dir_all(&data).map_err(io(format!("creating {}", data.display())))?;

    let spec = StackSpec {
        config_path,
        config: config.clone(),
        bin_dir: crate::up::bin_dir()?,
        service: (SERVICE_UID, SERVICE_UID),
        token: run::fresh_token()?,
        cgroup_parent: format!("agentbox-demo-{}", std::process::id()),
        env: model_env,
        log_dir: Some(logs.clone()),
    };
    eprintln!(
        "agentbox demo: starting the launcher, gateway and bridge on {} (logs in {})",
        data.display(),
        logs.display()
    );
    let started = tokio::select! {
        s = Stack::start(&spec) => s,
        () = cancel.cancelled() => Err(CliError::Interrupted),
    };
    let mut stack = match started {
        Ok(s) => s,
        Err(e) => {
            remove_cgroup(&spec.cgroup_parent);
            return Err(e);
        }
    };
    let which = if model == BUILTIN {
        "the built-in scripted model".to_owned()
    } else {
        format!("model {model}")
    };
    eprintln!(
        "agentbox demo: Claude Code fixes the failing test in {} with {which}",
        repo.display()
    );
    let opts = RunOptions {
        repo: repo.clone(),
        git_ref: None,
        model,
        prompt: project::PROMPT.to_owned(),
        tid: None,
        budget: Budget {
            tokens: Some(args.budget_tokens),
            usd: budget_usd,
        },
        timeout_s: args.timeout,
        venv: None,
        env: BTreeMap::new(),
        keep: false,
        claude_model: "claude-sonnet-4-5".to_owned(),
        poll: Duration::from_millis(500),
    };
    let mut progress = crate::render::Terminal::stderr();
    let d = Daemons::new(config);
    let summary = run::run(&d, &opts, &mut progress, cancel).await;
    let check = match &summary {
        Ok(s) if s.branch.is_some() => Some(test_on_work(&d, &s.tid).await),
        Ok(_) | Err(_) => None,
    };
    stack.stop().await;
    remove_cgroup(&spec.cgroup_parent);
    if let Some(t) = server_task {
        t.abort();
    }
    let summary = summary?;
    show(&summary, &base_sha).await;
    if let Some(line) = check {
        println!("{line}");
    }
    if let Some(advice) = summary.outcome.advice() {
        eprintln!("agentbox: {advice}");
    }
    Ok(ExitCode::from(summary.outcome.exit_code()))
}

/// The project's test run by the launcher in a sandbox (no network, no model) on the task's
/// workspace, as the agent left it: never the agent's code on this host.
async fn test_on_work(d: &Daemons, tid: &str) -> String {
    let checked = match crate::args::tid(tid) {
        Ok(tid) => crate::verbs::check(d, &tid, 120, None, &[project::TEST.to_owned()]).await,
        Err(e) => Err(e),
    };
    let verdict = match checked {
        Ok(c) if c.exit_code == 0 => "passes".to_owned(),
        Ok(c) => format!(
            "FAILS (exit {}): {}",
            c.check
                .exit_code
                .map_or_else(|| "none".to_owned(), |code| code.to_string()),
            c.problem.as_deref().unwrap_or_else(|| c
                .check
                .stderr
                .lines()
                .last()
                .unwrap_or_default())
        ),
        Err(e) => format!("could not run: {e}"),
    };
    format!(
        "test      `{}` in a sandbox on the agent's work: {verdict}",
        project::TEST
    )
}

/// The summary, then the delivered branch's diff.
async fn show(summary: &RunSummary, base_sha: &str) {
    print!("{}", crate::render::summary_text(summary));
    if let Some(branch) = &summary.branch {
        let diff = run::git(&summary.repo, &["diff", base_sha, branch])
            .await
            .unwrap_or_default();
        println!("diff of {branch}:\n{}", diff.trim_end());
    }
}

/// The demo repository: [`project::FILES`] in one commit on `main`; its sha.
async fn make_repo(repo: &Path) -> Result<String, CliError> {
    std::fs::create_dir_all(repo).map_err(io(format!("creating {}", repo.display())))?;
    for (name, text) in project::FILES {
        let path = repo.join(name);
        std::fs::write(&path, text).map_err(io(format!("writing {}", path.display())))?;
    }
    let who = [
        "-c",
        "user.name=agentbox demo",
        "-c",
        "user.email=demo@agentbox.invalid",
    ];
    for args in [
        &["init", "--quiet", "--initial-branch=main"][..],
        &["add", "--all"],
        &[
            who[0],
            who[1],
            who[2],
            who[3],
            "commit",
            "--quiet",
            "-m",
            "calc: add, with its test",
        ],
    ] {
        run::git_checked(repo, args)
            .await
            .map_err(|reason| CliError::Io {
                what: format!("git {} in {}", args.join(" "), repo.display()),
                reason,
            })?;
    }
    run::git_checked(repo, &["rev-parse", "HEAD"])
        .await
        .map(|out| out.trim().to_owned())
        .map_err(|reason| CliError::Io {
            what: format!("git rev-parse HEAD in {}", repo.display()),
            reason,
        })
}

/// Hands `dir` and everything under it to `uid` (the launcher snapshots repositories its
/// service user owns). Children first: until the walk is done every directory on it is still
/// root's, so nothing can swap a path under root's `lchown`.
fn chown_tree(dir: &Path, uid: u32) -> Result<(), CliError> {
    let meta = std::fs::symlink_metadata(dir).map_err(io(format!("reading {}", dir.display())))?;
    if meta.is_dir() {
        for entry in std::fs::read_dir(dir).map_err(io(format!("reading {}", dir.display())))? {
            let entry = entry.map_err(io(format!("reading {}", dir.display())))?;
            chown_tree(&entry.path(), uid)?;
        }
    }
    std::os::unix::fs::lchown(dir, Some(uid), Some(uid))
        .map_err(io(format!("chown {}", dir.display())))
}

/// `from` at `to`, readable and executable by every uid: the agent uid runs it inside the
/// sandbox, and the clients cache may be under a private home. Root opens `from` without
/// following a symlink and links or copies exactly the file it opened, so whoever owns the
/// cache cannot point it at another file. A file already open to all (as npm installs it) is
/// hard-linked to that inode (no copy of a few hundred MB); otherwise, or across file
/// systems, it is copied into a new 0755 file.
fn readable_copy(from: &Path, to: &Path) -> Result<PathBuf, CliError> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let nofollow = i32::try_from(rustix::fs::OFlags::NOFOLLOW.bits()).unwrap_or(0);
    let mut src = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nofollow)
        .open(from)
        .map_err(io(format!("opening {}", from.display())))?;
    let meta = src
        .metadata()
        .map_err(io(format!("reading {}", from.display())))?;
    if !meta.is_file() {
        return Err(CliError::Usage(format!(
            "{} is not a regular file",
            from.display()
        )));
    }
    let open_to_all = meta.mode() & 0o005 == 0o005;
    if open_to_all
        && rustix::fs::linkat(
            &src,
            "",
            rustix::fs::CWD,
            to,
            rustix::fs::AtFlags::EMPTY_PATH,
        )
        .is_ok()
    {
        return Ok(to.to_path_buf());
    }
    let mut dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .open(to)
        .map_err(io(format!("creating {}", to.display())))?;
    std::io::copy(&mut src, &mut dst).map_err(io(format!("copying {}", from.display())))?;
    dst.set_permissions(std::fs::Permissions::from_mode(0o755))
        .map_err(io(format!("chmod {}", to.display())))?;
    Ok(to.to_path_buf())
}

/// The launcher's cgroup directory, once it is gone (v2, and v1's controllers).
fn remove_cgroup(name: &str) {
    for c in ["", "memory", "pids", "cpu", "freezer"] {
        let _ = std::fs::remove_dir(Path::new("/sys/fs/cgroup").join(c).join(name));
    }
}
