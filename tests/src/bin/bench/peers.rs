//! `bench peers`: our bridge side by side with what a user would pick instead (LiteLLM,
//! `@musistudio/llms`, claude-code-router), in one run, against the same fakellm on loopback.
//!
//! ```text
//! scripts/install-peers.sh          # once: pinned peers into a cache outside the repo
//! cargo run --release -p agentbox-tests --bin bench -- peers [--quick] [--only bridge,llms,ccr,litellm]
//!     [--peers-dir DIR] [--bin-dir DIR]
//! ```
//! Each tool translates the same Claude-Code-shaped Anthropic request (`workload`) to OpenAI
//! chat for fakellm, streamed and not; the method is `../shared/research/peer-bench.md`'s (and
//! the other benches'): "direct" sends fakellm the exact chat body the tool forwarded, c=1
//! alternates direct and through, c=64 runs rounds per side. Per tool: added latency (through
//! minus direct percentiles), its ratio to the bridge's in the same run, throughput at c=64,
//! CPU per request and RSS summed over the tool's processes (its process group), and startup
//! (spawn to the first successful translated request). Tools run one after the other, each
//! alone with fakellm and the load generator on the machine. A peer that is not installed
//! gets a "not installed" row, one that fails gets its error in the row: never a crash.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use agentbox_tests::harness::{
    FakeLlm, Service, live_group_members, workspace_bin, workspace_root,
};
use agentbox_tests::workload;
use anyhow::{Context, Result, bail};
use serde_json::json;

use super::{Clients, Plan, Row, Target, compare, log_len, logged_after, rss_kib};

/// The tools compared, in the order they run (ours first: the ratios are against it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Tool {
    /// `agentbox-bridge`.
    Bridge,
    /// `@musistudio/llms`, claude-code-router's translation engine, as a bare server.
    Llms,
    /// `@musistudio/claude-code-router` (`ccr start`).
    Ccr,
    /// LiteLLM's proxy (`litellm[proxy]`), one worker.
    Litellm,
}

impl Tool {
    const ALL: [Tool; 4] = [Tool::Bridge, Tool::Llms, Tool::Ccr, Tool::Litellm];

    fn label(self) -> &'static str {
        match self {
            Tool::Bridge => "agentbox-bridge (main)",
            Tool::Llms => "@musistudio/llms 1.0.53",
            Tool::Ccr => "claude-code-router 2.0.0",
            Tool::Litellm => "LiteLLM 1.108.7 (1 worker)",
        }
    }
}

/// `bench peers`' arguments.
#[derive(Debug, clap::Parser)]
#[command(name = "bench peers", about = "the bridge side by side with its peers")]
pub struct Args {
    /// Fewer requests (a smoke run; figures are not for the table).
    #[arg(long)]
    pub quick: bool,
    /// Where `scripts/install-peers.sh` put the peers (default: `$AGENTBOX_PEERS_DIR`, else
    /// the directory the script would use, asked with `--print-dir`: nothing is installed).
    #[arg(long)]
    pub peers_dir: Option<PathBuf>,
    /// Take `agentbox-bridge` and `fakellm` from this directory (e.g. another checkout's
    /// `target/release`) instead of this workspace's build.
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// The tools to run, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Tool::ALL)]
    pub only: Vec<Tool>,
}

/// The chat model fakellm is asked for by every tool (peers are configured with this name).
const UPSTREAM_MODEL: &str = "proxy-model";
/// LiteLLM refuses to start without a master key; the bridge wants its token.
const LITELLM_KEY: &str = "sk-bench-litellm-master-key-0123456789";
const BRIDGE_TOKEN: &str = "bench-bridge-token";
/// How long a tool may take from spawn to its first answer (LiteLLM needs 6–8 s).
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// A tool's measured figures, or why there are none.
#[derive(Debug)]
enum Outcome {
    NotInstalled(String),
    Failed(String),
    Measured(Box<Measured>),
}

#[derive(Debug)]
struct Measured {
    startup: Duration,
    idle_kib: u64,
    peak_kib: u64,
    processes: usize,
    /// Non-stream, then stream.
    rows: Vec<Row>,
    /// What fakellm received per case: path and body size, for the notes.
    forwarded: Vec<String>,
    load: (String, String),
}

/// A tool started from its files, ready to be spawned.
struct Launch {
    cmd: Command,
    /// What the client sends to `/v1/messages` (the body is the workload for `model`).
    headers: Vec<(String, String)>,
    model: &'static str,
    /// Files the command reads (configs, the driver script), removed after the run.
    _scratch: tempfile::TempDir,
}

/// The peers' install directory: `--peers-dir`, `$AGENTBOX_PEERS_DIR`, or the one
/// `scripts/install-peers.sh --print-dir` names (which installs nothing).
fn peers_dir(args: &Args) -> Result<PathBuf> {
    if let Some(d) = &args.peers_dir {
        return Ok(d.clone());
    }
    if let Some(d) = std::env::var_os("AGENTBOX_PEERS_DIR") {
        return Ok(d.into());
    }
    let script = workspace_root().join("scripts/install-peers.sh");
    let out = Command::new(&script)
        .arg("--print-dir")
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} --print-dir failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

/// One of our binaries: from `--bin-dir`, or this workspace's build.
fn our_bin(args: &Args, bin: &str) -> Result<PathBuf> {
    match &args.bin_dir {
        Some(dir) => {
            let p = dir.join(bin);
            if !p.is_file() {
                bail!("--bin-dir {}: no {bin} there", dir.display());
            }
            Ok(p)
        }
        None => Ok(workspace_bin("agentbox-tests", bin)?),
    }
}

/// A free loopback port (bound and released: the tools want a fixed port in their config).
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn json_headers(auth: &str) -> Vec<(String, String)> {
    vec![
        ("authorization".into(), format!("Bearer {auth}")),
        ("x-api-key".into(), auth.into()),
        ("anthropic-version".into(), "2023-06-01".into()),
        ("content-type".into(), "application/json".into()),
    ]
}

/// The environment every tool starts with: nothing of ours but a PATH and a private HOME.
fn base_cmd(program: &Path, home: &Path) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", home)
        .current_dir(home);
    cmd
}

/// The file a peer's install must hold (under the peers' directory `dir`); none for ours.
fn needs(tool: Tool, dir: &Path) -> Option<PathBuf> {
    let node_modules = dir.join("node/node_modules");
    match tool {
        Tool::Bridge => None,
        Tool::Llms => Some(node_modules.join("@musistudio/llms/package.json")),
        Tool::Ccr => Some(node_modules.join("@musistudio/claude-code-router/dist/cli.js")),
        Tool::Litellm => Some(dir.join("litellm/bin/litellm")),
    }
}

/// How to start `tool` (installed: see [`needs`]) on `port` against `upstream`
/// (`http://127.0.0.1:P`).
fn launch(tool: Tool, args: &Args, dir: &Path, port: u16, upstream: &str) -> Result<Launch> {
    let scratch = tempfile::Builder::new().prefix("bench-peer-").tempdir()?;
    let home = scratch.path();
    // What `needs` names: the package's manifest (llms), the CLI (ccr), the binary (LiteLLM).
    let installed = || needs(tool, dir).context("a peer without an install path");
    let chat_url = format!("{upstream}/v1/chat/completions");
    // Per tool: the command, the key the client presents, the model it asks for.
    let (cmd, auth, model) = match tool {
        Tool::Bridge => {
            let config = home.join("agentbox.toml");
            std::fs::write(
                &config,
                format!(
                    "[bridge]\nlisten = \"127.0.0.1:{port}\"\n[models.gpt]\nbackend = \"remote\"\n\
                     provider = \"openai\"\nbase_url = \"{upstream}/v1\"\n\
                     upstream_model = \"{UPSTREAM_MODEL}\"\nkey_env = \"BENCH_KEY\"\n"
                ),
            )?;
            let mut cmd = base_cmd(&our_bin(args, "agentbox-bridge")?, home);
            // As the other benches run it (the daemon's default log level).
            cmd.arg("--config")
                .arg(&config)
                .env("RUST_LOG", "info")
                .env("AGENTBOX_DATA", home)
                .env("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)
                .env("BENCH_KEY", "sk-fake");
            (cmd, BRIDGE_TOKEN, "gpt")
        }
        Tool::Llms => {
            let manifest = installed()?;
            let pkg = manifest.parent().context("llms package dir")?;
            // Its translation server as peer-bench.md ran it: one provider, every request
            // routed to it by a pre-handler (what claude-code-router's router does).
            let driver = home.join("llms-server.cjs");
            std::fs::write(
                &driver,
                format!(
                    r#"const mod = require({pkg:?});
const Server = mod.default || mod.Server || mod;
const server = new Server({{ logger: false, initialConfig: {{ HOST: "127.0.0.1", PORT: {port},
  providers: [{{ name: "fake", api_base_url: {chat_url:?}, api_key: "sk-fake", models: [{UPSTREAM_MODEL:?}] }}] }} }});
server.addHook("preHandler", async (req) => {{
  if (req.body && typeof req.body === "object" && req.body.model) req.body.model = "fake,{UPSTREAM_MODEL}";
}});
server.start();
"#,
                    pkg = pkg.display().to_string(),
                ),
            )?;
            let mut cmd = base_cmd(Path::new("node"), home);
            cmd.arg(&driver);
            (cmd, "sk-none", "claude-sonnet-4-5")
        }
        Tool::Ccr => {
            let cli = installed()?;
            let conf_dir = home.join(".claude-code-router");
            std::fs::create_dir_all(&conf_dir)?;
            std::fs::write(
                conf_dir.join("config.json"),
                json!({"HOST": "127.0.0.1", "PORT": port, "LOG": false,
                       "Providers": [{"name": "fake", "api_base_url": chat_url,
                                      "api_key": "sk-fake", "models": [UPSTREAM_MODEL]}],
                       "Router": {"default": format!("fake,{UPSTREAM_MODEL}")}})
                .to_string(),
            )?;
            let mut cmd = base_cmd(Path::new("node"), home);
            cmd.arg(&cli).arg("start");
            (cmd, "sk-none", "claude-sonnet-4-5")
        }
        Tool::Litellm => {
            let bin = installed()?;
            let config = home.join("config.yaml");
            std::fs::write(
                &config,
                format!(
                    "model_list:\n  - model_name: anthropic-test\n    litellm_params: {{model: openai/{UPSTREAM_MODEL}, api_base: \"{upstream}/v1\", api_key: sk-fake}}\n    model_info: {{supports_reasoning: false}}\n\
                     litellm_settings: {{telemetry: false, drop_params: true}}\n\
                     general_settings: {{master_key: {LITELLM_KEY}}}\n"
                ),
            )?;
            let mut cmd = base_cmd(&bin, home);
            // Without the first, `openai/*` models' /v1/messages go to the Responses API.
            cmd.env(
                "LITELLM_USE_CHAT_COMPLETIONS_URL_FOR_ANTHROPIC_MESSAGES",
                "true",
            )
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            .env("LITELLM_TELEMETRY", "False")
            .arg("--config")
            .arg(&config)
            .arg("--host")
            .arg("127.0.0.1")
            .arg("--port")
            .arg(port.to_string());
            (cmd, LITELLM_KEY, "anthropic-test")
        }
    };
    Ok(Launch {
        cmd,
        headers: json_headers(auth),
        model,
        _scratch: scratch,
    })
}

/// The pids of `pgid`'s live processes (the tool and whatever it started).
fn group_pids(pgid: u32) -> Vec<u32> {
    live_group_members(pgid)
        .iter()
        .filter_map(|stat| stat.split(' ').next()?.parse().ok())
        .collect()
}

/// `field` (`VmRSS:`, `VmHWM:`) summed over the tool's processes, in KiB.
fn group_kib(pgid: u32, field: &str) -> u64 {
    group_pids(pgid).iter().map(|p| rss_kib(*p, field)).sum()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split(' ').take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Spawn → first 2xx to a small translated request; the tool's output on failure.
async fn wait_ready(
    service: &mut Service,
    client: &Clients,
    target: &Target,
    began: Instant,
) -> Result<Duration> {
    loop {
        if target.send(client).await.is_ok() {
            return Ok(began.elapsed());
        }
        if service.has_exited() || began.elapsed() > START_TIMEOUT {
            bail!(
                "did not answer within {START_TIMEOUT:?}: {}",
                tail(&service.describe(), 1500)
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The last `n` bytes of `s` (at a char boundary).
fn tail(s: &str, n: usize) -> &str {
    let mut i = s.len().saturating_sub(n);
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

/// Starts one tool, measures it streamed and not, stops it.
async fn measure(
    tool: Tool,
    launch: Launch,
    port: u16,
    fake: &FakeLlm,
    client: &Clients,
    plan: Plan,
) -> Result<Measured> {
    let load_before = loadavg();
    let base = format!("http://127.0.0.1:{port}/v1/messages");
    let small = Target {
        url: base.clone(),
        unix: None,
        headers: launch.headers.clone(),
        body: bytes::Bytes::from(
            json!({"model": launch.model, "max_tokens": 64,
                   "messages": [{"role": "user", "content": "hello"}]})
            .to_string(),
        ),
    };
    let began = Instant::now();
    let mut service = Service::spawn(tool.label(), launch.cmd)?;
    let pgid = service.pid();
    let startup = wait_ready(&mut service, client, &small, began).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle_kib = group_kib(pgid, "VmRSS:");
    let mut rows = Vec::new();
    let mut forwarded_to = Vec::new();
    for stream in [false, true] {
        let body = workload::claude_code_request(launch.model, stream);
        let bytes = bytes::Bytes::from(serde_json::to_vec(&body)?);
        let through = Target {
            url: base.clone(),
            unix: None,
            headers: launch.headers.clone(),
            body: bytes.clone(),
        };
        // The direct side sends exactly what the tool forwarded.
        let mark = log_len(fake)?;
        // Once more if the pooled connection from the readiness probe was dropped meanwhile
        // (a reset, not a measurement: uvicorn closes idle keep-alive connections).
        if let Err(e) = through.send(client).await {
            eprintln!(
                "bench peers: {}: first request failed ({e:#}), once more",
                tool.label()
            );
            through
                .send(client)
                .await
                .context("the first full request")?;
        }
        let forwarded = logged_after(fake, mark)?;
        let path = forwarded["path"].as_str().context("path")?.to_owned();
        let direct = Target {
            url: format!("{}{path}", fake.base_url()),
            unix: None,
            headers: vec![
                ("authorization".into(), "Bearer sk-fake".into()),
                ("content-type".into(), "application/json".into()),
            ],
            body: bytes::Bytes::from(serde_json::to_vec(&forwarded["body"])?),
        };
        forwarded_to.push(format!("{path} {} KB", direct.body.len() / 1024));
        let case = super::case_name("Anthropic → chat", stream, bytes.len());
        rows.push(
            compare(&case, client, &direct, &through, pgid, plan)
                .await
                .with_context(|| case.clone())?,
        );
    }
    let processes = group_pids(pgid).len();
    let peak_kib = group_kib(pgid, "VmHWM:");
    service.stop();
    Ok(Measured {
        startup,
        idle_kib,
        peak_kib,
        processes,
        rows,
        forwarded: forwarded_to,
        load: (load_before, loadavg()),
    })
}

pub async fn bench_peers(args: Args) -> Result<()> {
    let plan = if args.quick {
        super::QUICK
    } else {
        super::FULL
    };
    let dir = peers_dir(&args)?;
    eprintln!("bench peers: peers from {}", dir.display());
    let mut fake: Option<FakeLlm> = None;
    let client = Clients {
        tcp: reqwest::Client::builder()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(256)
            // A peer that hangs fails its row instead of stalling the run.
            .timeout(Duration::from_secs(120))
            .build()?,
    };
    let mut results = Vec::new();
    for tool in Tool::ALL.into_iter().filter(|t| args.only.contains(t)) {
        if let Some(file) = needs(tool, &dir).filter(|f| !f.is_file()) {
            let why = format!("{} missing; run scripts/install-peers.sh", file.display());
            eprintln!("bench peers: {} not installed: {why}", tool.label());
            results.push((tool, Outcome::NotInstalled(why)));
            continue;
        }
        // fakellm only starts once a tool is there to measure.
        let upstream = match &fake {
            Some(f) => f.base_url(),
            None => {
                let f = FakeLlm::start(&our_bin(&args, "fakellm")?, &super::fake_script())?;
                let url = f.base_url();
                fake = Some(f);
                url
            }
        };
        let f = fake.as_ref().context("fakellm")?;
        eprintln!("bench peers: {}", tool.label());
        let port = free_port()?;
        let measured = match launch(tool, &args, &dir, port, &upstream) {
            Ok(l) => measure(tool, l, port, f, &client, plan).await,
            Err(e) => Err(e),
        };
        let outcome = match measured {
            Ok(m) => Outcome::Measured(Box::new(m)),
            Err(e) => {
                eprintln!("bench peers: {} failed: {e:#}", tool.label());
                Outcome::Failed(format!("{e:#}"))
            }
        };
        results.push((tool, outcome));
    }
    print_peers(&results, plan);
    Ok(())
}

/// One line of text for a table cell: no pipes or newlines from an error message.
fn cell(s: &str) -> String {
    let one: String = s
        .chars()
        .map(|c| if c == '|' || c == '\n' { ' ' } else { c })
        .collect();
    tail(&one, 300).to_owned()
}

fn print_peers(results: &[(Tool, Outcome)], plan: Plan) {
    let ours = results.iter().find_map(|(t, o)| match (t, o) {
        (Tool::Bridge, Outcome::Measured(m)) => Some(m),
        _ => None,
    });
    println!("### the bridge and its peers: Anthropic → OpenAI chat, same fakellm, one run\n");
    println!(
        "| tool | case | c=1 added p50 / p99 ms | **added p50 ÷ ours** | paired added p50 ms | c=64 added p50 / p99 ms | rps at c=64 (direct / through) | CPU ms/req | RSS idle → peak MiB | startup ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (tool, outcome) in results {
        let m = match outcome {
            Outcome::NotInstalled(why) | Outcome::Failed(why) => {
                let what = if matches!(outcome, Outcome::NotInstalled(_)) {
                    "not installed"
                } else {
                    "failed"
                };
                println!(
                    "| {} | **{what}**: {} | | | | | | | | |",
                    tool.label(),
                    cell(why)
                );
                continue;
            }
            Outcome::Measured(m) => m,
        };
        for (i, r) in m.rows.iter().enumerate() {
            let added = r.c1_through.0 - r.c1_direct.0;
            let ratio = ours
                .and_then(|o| o.rows.get(i))
                .map(|o| o.c1_through.0 - o.c1_direct.0)
                .filter(|o| *o > 0.0)
                .map_or("—".to_owned(), |o| format!("{:.1}×", added / o));
            let (mem, start) = if i == 0 {
                (
                    format!(
                        "{:.1} → {:.1}",
                        m.idle_kib as f64 / 1024.0,
                        m.peak_kib as f64 / 1024.0
                    ),
                    format!("{:.0}", m.startup.as_secs_f64() * 1000.0),
                )
            } else {
                (String::new(), String::new())
            };
            println!(
                "| {} | {} | {:.3} / {:.3} | **{ratio}** | {:.3} | {:.2} / {:.2} | {:.0} / {:.0} | {:.3} | {mem} | {start} |",
                tool.label(),
                r.case,
                added,
                r.c1_through.1 - r.c1_direct.1,
                r.c1_paired.0,
                r.c64_through.0 - r.c64_direct.0,
                r.c64_through.1 - r.c64_direct.1,
                r.rps_direct,
                r.rps_through,
                r.cpu_ms_per_req,
            );
        }
    }
    println!();
    for (tool, outcome) in results {
        if let Outcome::Measured(m) = outcome {
            let d: Vec<String> = m
                .rows
                .iter()
                .map(|r| format!("{:.3} / {:.3}", r.c1_direct.0, r.c1_direct.1))
                .collect();
            println!(
                "- {}: {} process(es); forwarded {} (non-stream, stream); direct c=1 p50/p99 during its run {} ms; load average {} before, {} after.",
                tool.label(),
                m.processes,
                m.forwarded.join(", "),
                d.join(", "),
                m.load.0,
                m.load.1,
            );
        }
    }
    println!(
        "\nPlan: c=1 {} pairs after {} warm-up; c=64 {} round(s) of {}. RSS and CPU are summed over the tool's process group; peak is the sum of each process's VmHWM.\n",
        plan.pairs, plan.warmup, plan.rounds, plan.round_size
    );
}

/// `bench peers`' arguments parsed from the bench's (the word `peers` itself skipped).
pub fn parse(args: &[String]) -> std::result::Result<Args, clap::Error> {
    use clap::Parser;
    let rest = args.iter().filter(|a| a.as_str() != "peers");
    Args::try_parse_from(std::iter::once(&"bench peers".to_owned()).chain(rest))
}
