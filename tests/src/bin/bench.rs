//! `bench`: what our daemons add on top of talking to the model directly, measured in one run
//! against `fakellm` so the figures are differences and ratios, not absolute times.
//!
//! ```text
//! cargo run --release -p agentbox-tests --bin bench -- [bridge|gateway|proxy|server|launcher|all] [--quick]
//! cargo run --release -p agentbox-tests --bin bench -- launcher [--quick] [--ws-files N]  # N files per workspace
//! cargo run --release -p agentbox-tests --bin bench -- peers [--quick] [--only ...]  # see [`peers`]
//! cargo run --release -p agentbox-tests --bin bench -- pool [--quick]  # see [`pool`]
//! ```
//! `server` is blackbox-server itself: start to the first `/health` answer, idle RSS, and
//! RSS once registered with the real opencode running; see [`bench_server`].
//! `proxy` is blackbox-server's rollout LLM proxy (run alone as `blackbox-proxy`, a turn open):
//! chat passthrough, Anthropic → chat and Responses → chat, see [`bench_proxy`].
//! `launcher` must run as root (it starts the real launcher); see [`bench_launcher`].
//! For each case it sends the same ~100 KB Claude-Code-sized request through the daemon and,
//! alternating, the exact body the daemon forwarded straight to fakellm, and reports latency to
//! the last byte (p50/p99), the difference, throughput at concurrency 64, and the daemon's CPU
//! time per request and peak RSS. The method follows `../shared/research/peer-bench.md`:
//! c=1: 30 warm-up pairs then 300 pairs; c=64: 4 rounds of 256 requests per side.
//! Output is a Markdown table on stdout (pasted into BENCHMARKS.md).

#![forbid(unsafe_code)]

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use agentbox_api::gateway::{Budget, OpenTask};
use agentbox_api::launcher::{AgentRequest, RunState};
use agentbox_policy::id::Tid;
use agentbox_tests::harness::{
    BlackboxProcess, BlackboxProxy, BridgeProcess, FakeLlm, GatewayProcess, LauncherProcess,
    Service, live_group_members, opencode_registration, workspace_bin,
};
use agentbox_tests::workload;
use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

#[path = "bench/peers.rs"]
mod peers;
#[path = "bench/pool.rs"]
mod pool;
#[path = "bench/turns.rs"]
mod turns;

const TOKEN: &str = "bench-bridge-token";

#[derive(Debug, Clone, Copy)]
struct Plan {
    warmup: usize,
    pairs: usize,
    rounds: usize,
    round_size: usize,
    concurrency: usize,
}

const FULL: Plan = Plan {
    warmup: 30,
    pairs: 300,
    rounds: 4,
    round_size: 256,
    concurrency: 64,
};
const QUICK: Plan = Plan {
    warmup: 5,
    pairs: 40,
    rounds: 1,
    round_size: 128,
    concurrency: 64,
};

/// The TCP client, with a keep-alive pool (unix-socket targets carry their own
/// `agentbox_api::UnixClient`, pooled the same way).
#[derive(Debug, Clone)]
struct Clients {
    tcp: reqwest::Client,
}

/// One side of a comparison: a URL (or a unix socket's client and a path), headers and a body.
#[derive(Debug, Clone)]
struct Target {
    url: String,
    unix: Option<agentbox_api::UnixClient>,
    headers: Vec<(String, String)>,
    body: bytes::Bytes,
}

impl Target {
    async fn send(&self, clients: &Clients) -> Result<Duration> {
        let start = Instant::now();
        let (status, body) = match &self.unix {
            None => {
                let mut req = clients.tcp.post(&self.url).body(self.body.clone());
                for (k, v) in &self.headers {
                    req = req.header(k, v);
                }
                let resp = req.send().await?;
                let status = resp.status().as_u16();
                (status, resp.bytes().await?)
            }
            Some(unix) => {
                let headers: Vec<(&str, &str)> = self
                    .headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                let resp = unix
                    .raw("POST", &self.url, &headers, self.body.clone())
                    .await?;
                (resp.status, resp.body)
            }
        };
        let elapsed = start.elapsed();
        if !(200..300).contains(&status) {
            bail!(
                "{} answered {status}: {}",
                self.url,
                String::from_utf8_lossy(&body)
            );
        }
        Ok(elapsed)
    }
}

#[derive(Debug, Default)]
struct Row {
    case: String,
    c1_direct: (f64, f64),
    c1_through: (f64, f64),
    /// p50/p99 of through − direct over adjacent pairs: robust to load that shifts both.
    c1_paired: (f64, f64),
    c64_direct: (f64, f64),
    c64_through: (f64, f64),
    rps_direct: f64,
    rps_through: f64,
    /// The daemon's CPU over the c=1 pairs' through requests, ms per request.
    cpu_ms_per_req: f64,
    /// The same over the c=64 rounds through it: what a burst costs, page faults of fresh
    /// buffers and all.
    cpu_ms_per_req_c64: f64,
}

fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let at = |q: f64| {
        let i = ((v.len() as f64 - 1.0) * q).round() as usize;
        v.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    (at(0.50), at(0.99))
}

/// p50/p99 of paired differences in milliseconds (through − direct; may be negative).
fn paired_percentiles(mut ms: Vec<f64>) -> (f64, f64) {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| {
        ms.get(((ms.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    (at(0.50), at(0.99))
}

/// CPU time of a process so far, summed over its threads, from the scheduler's nanosecond
/// counters (`/proc/<pid>/task/*/schedstat`; `stat`'s clock ticks are too coarse per request).
fn cpu_time(pid: u32) -> Result<Duration> {
    let mut ns = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let stat = std::fs::read_to_string(task?.path().join("schedstat"))?;
        ns += stat
            .split_whitespace()
            .next()
            .context("empty schedstat")?
            .parse::<u64>()?;
    }
    Ok(Duration::from_nanos(ns))
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

async fn concurrent(client: &Clients, target: &Target, plan: Plan) -> Result<(Vec<Duration>, f64)> {
    let mut lat = Vec::new();
    let mut rps = Vec::new();
    for _ in 0..plan.rounds {
        let sem = Arc::new(Semaphore::new(plan.concurrency));
        let mut set = tokio::task::JoinSet::new();
        let start = Instant::now();
        for _ in 0..plan.round_size {
            let permit = sem.clone().acquire_owned().await?;
            let (c, t) = (client.clone(), target.clone());
            set.spawn(async move {
                let r = t.send(&c).await;
                drop(permit);
                r
            });
        }
        while let Some(r) = set.join_next().await {
            lat.push(r??);
        }
        rps.push(plan.round_size as f64 / start.elapsed().as_secs_f64());
    }
    Ok((lat, rps.iter().sum::<f64>() / rps.len() as f64))
}

/// CPU time so far of every live process in group `pgid` (a daemon and whatever it started:
/// our daemons are one process, the peers of `bench peers` may be several).
fn group_cpu_time(pgid: u32) -> Result<Duration> {
    let mut total = Duration::ZERO;
    for stat in live_group_members(pgid) {
        let pid = stat
            .split(' ')
            .next()
            .and_then(|p| p.parse().ok())
            .context("pid in /proc/<pid>/stat")?;
        // A member that exits between the listing and the read is simply not counted.
        total += cpu_time(pid).unwrap_or_default();
    }
    Ok(total)
}

/// One case: warm-up, then c=1 pairs alternating direct and through (CPU of the daemon's
/// process group `daemon_pgid` measured over them), then c=64 rounds per side.
async fn compare(
    case: &str,
    client: &Clients,
    direct: &Target,
    through: &Target,
    daemon_pgid: u32,
    plan: Plan,
) -> Result<Row> {
    eprintln!("bench: {case}");
    for _ in 0..plan.warmup {
        direct.send(client).await?;
        through.send(client).await?;
    }
    let (mut d, mut t) = (Vec::new(), Vec::new());
    let cpu0 = group_cpu_time(daemon_pgid)?;
    for i in 0..plan.pairs {
        // Alternate which side goes first so neither always meets a warmer cache.
        if i % 2 == 0 {
            d.push(direct.send(client).await?);
            t.push(through.send(client).await?);
        } else {
            t.push(through.send(client).await?);
            d.push(direct.send(client).await?);
        }
    }
    let c1_paired = paired_percentiles(
        t.iter()
            .zip(&d)
            .map(|(t, d)| (t.as_secs_f64() - d.as_secs_f64()) * 1000.0)
            .collect(),
    );
    let cpu_ms_per_req = (group_cpu_time(daemon_pgid)?.saturating_sub(cpu0)).as_secs_f64() * 1000.0
        / plan.pairs as f64;
    let (cd, rps_direct) = concurrent(client, direct, plan).await?;
    let cpu0 = group_cpu_time(daemon_pgid)?;
    let (ct, rps_through) = concurrent(client, through, plan).await?;
    let cpu_ms_per_req_c64 = (group_cpu_time(daemon_pgid)?.saturating_sub(cpu0)).as_secs_f64()
        * 1000.0
        / (plan.rounds * plan.round_size) as f64;
    Ok(Row {
        case: case.to_owned(),
        c1_direct: percentiles(d),
        c1_through: percentiles(t),
        c1_paired,
        c64_direct: percentiles(cd),
        c64_through: percentiles(ct),
        rps_direct,
        rps_through,
        cpu_ms_per_req,
        cpu_ms_per_req_c64,
    })
}

/// A proxy case's row name: what the daemon does, whether the answer streams, the body's size.
fn case_name(kind: &str, stream: bool, body_len: usize) -> String {
    let mode = if stream { "stream" } else { "non-stream" };
    format!("{kind} {mode} ({} KB in)", body_len / 1024)
}

/// The line under a proxy table: the daemon's memory (`after` says when `VmRSS` was read),
/// what it does per request (`work`, empty or a sentence ending in a space) and the plan.
fn notes(daemon: &str, pid: u32, after: &str, work: &str, plan: Plan) -> String {
    format!(
        "{daemon} RSS: {} MiB {after}, {} MiB peak. {work}Plan: c=1 {} pairs after {} warm-up; c=64 {} round(s) of {}.",
        rss_kib(pid, "VmRSS:") / 1024,
        rss_kib(pid, "VmHWM:") / 1024,
        plan.pairs,
        plan.warmup,
        plan.rounds,
        plan.round_size,
    )
}

fn print_table(title: &str, rows: &[Row], notes: &str) {
    println!("### {title}\n");
    println!(
        "| case | c=1 direct p50/p99 ms | c=1 through p50/p99 ms | **added p50/p99 ms** | paired added p50/p99 ms | c=64 direct p50/p99 ms | c=64 through p50/p99 ms | rps direct / through (c=64) | daemon CPU ms/req c=1 / c=64 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.3} / {:.3} | {:.3} / {:.3} | **{:.3} / {:.3}** | {:.3} / {:.3} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} / {:.0} | {:.3} / {:.3} |",
            r.case,
            r.c1_direct.0,
            r.c1_direct.1,
            r.c1_through.0,
            r.c1_through.1,
            r.c1_through.0 - r.c1_direct.0,
            r.c1_through.1 - r.c1_direct.1,
            r.c1_paired.0,
            r.c1_paired.1,
            r.c64_direct.0,
            r.c64_direct.1,
            r.c64_through.0,
            r.c64_through.1,
            r.rps_direct,
            r.rps_through,
            r.cpu_ms_per_req,
            r.cpu_ms_per_req_c64,
        );
    }
    println!("\n{notes}\n");
}

/// What the proxy benches' fakellm answers to every request: the same short answer.
fn fake_script() -> Value {
    // Twenty text deltas, so a stream has the shape of a short real answer.
    let reply = "All done: the file was written and the tests pass. ".repeat(4);
    json!({"fallback": {"text": reply, "usage": {"input_tokens": 25000, "output_tokens": 60}}})
}

/// The model the proxy benches talk to.
fn start_fake() -> Result<FakeLlm> {
    let fakellm = workspace_bin("agentbox-tests", "fakellm")?;
    Ok(FakeLlm::start(&fakellm, &fake_script())?)
}

async fn bench_bridge(plan: Plan) -> Result<()> {
    let fake = start_fake()?;
    let config = format!(
        r#"
[bridge]
listen = "127.0.0.1:0"
[models.gpt]
backend = "remote"
provider = "openai"
base_url = "{base}/v1"
upstream_model = "gpt-upstream"
key_env = "BENCH_KEY"
[models.claude]
backend = "remote"
provider = "anthropic"
base_url = "{base}"
upstream_model = "claude-upstream"
key_env = "BENCH_KEY"
"#,
        base = fake.base_url()
    );
    let extra = daemon_env();
    let mut env = vec![("AGENTBOX_BRIDGE_TOKEN", TOKEN), ("BENCH_KEY", "sk-bench")];
    env.extend(extra.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let bridge = BridgeProcess::start(&config, &env)?;
    let client = clients()?;

    let mut rows = Vec::new();
    for (provider, model) in [("openai", "gpt"), ("anthropic", "claude")] {
        for stream in [false, true] {
            let body = workload::claude_code_request(model, stream);
            let bytes = bytes::Bytes::from(serde_json::to_vec(&body)?);
            let through = Target {
                unix: None,
                url: format!("{}/v1/messages", bridge.base_url()),
                headers: vec![
                    ("authorization".into(), format!("Bearer {TOKEN}")),
                    ("anthropic-version".into(), "2023-06-01".into()),
                    ("content-type".into(), "application/json".into()),
                ],
                body: bytes.clone(),
            };
            // The direct side sends exactly what the bridge forwarded.
            through.send(&client).await?;
            let forwarded = fake.requests()?.pop().context("fakellm saw nothing")?;
            let path = forwarded["path"].as_str().context("path")?.to_owned();
            let headers: Vec<(String, String)> = [
                "authorization",
                "x-api-key",
                "anthropic-version",
                "content-type",
            ]
            .iter()
            .filter_map(|h| {
                forwarded["headers"][*h]
                    .as_str()
                    .map(|v| ((*h).to_owned(), v.to_owned()))
            })
            .collect();
            let direct = Target {
                unix: None,
                url: format!("{}{path}", fake.base_url()),
                headers,
                body: bytes::Bytes::from(serde_json::to_vec(&forwarded["body"])?),
            };
            let kind = if provider == "openai" {
                "translate → chat"
            } else {
                "passthrough"
            };
            let case = case_name(kind, stream, bytes.len());
            rows.push(compare(&case, &client, &direct, &through, bridge.pid(), plan).await?);
        }
    }
    let mut notes = notes("agentbox-bridge", bridge.pid(), "idle-after-run", "", plan);
    drop(bridge);
    rows.extend(relay_floors(&fake, &client, plan).await?);
    notes.push_str(
        " The floor rows send the same Claude Code request (Anthropic, to `/v1/messages`) through \
         `relay` (tests/src/bin/relay.rs), a proxy that forwards it unchanged on one event loop: \
         `tcp` copies bytes between the sockets, `http` reads and forwards the whole body with \
         the bridge's own server and client stack; daemon CPU is the relay's.",
    );
    print_table("llm-bridge vs fakellm direct", &rows, &notes);
    Ok(())
}

/// What a proxy adds before it does anything of its own: the bench's Anthropic request through
/// `relay tcp` (one extra loopback hop) and `relay http` (the bridge's HTTP stack, no parse),
/// against fakellm direct.
async fn relay_floors(fake: &FakeLlm, client: &Clients, plan: Plan) -> Result<Vec<Row>> {
    let upstream = fake
        .base_url()
        .strip_prefix("http://")
        .context("fakellm's base URL")?
        .to_owned();
    let mut rows = Vec::new();
    for (mode, kind) in [
        ("tcp", "floor: TCP relay, no HTTP"),
        ("http", "floor: hyper in, reqwest out, no parse"),
    ] {
        let mut cmd = std::process::Command::new(workspace_bin("agentbox-tests", "relay")?);
        cmd.args([mode, upstream.as_str()]).env_clear();
        let (relay, address) =
            Service::start_listening("relay", cmd, Duration::from_secs(30), "listening on ")?;
        for stream in [false, true] {
            let body = workload::claude_code_request("claude-upstream", stream);
            let body = bytes::Bytes::from(serde_json::to_vec(&body)?);
            let headers: Vec<(String, String)> = [
                ("x-api-key", "sk-bench"),
                ("anthropic-version", "2023-06-01"),
                ("content-type", "application/json"),
            ]
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
            let direct = Target {
                unix: None,
                url: format!("{}/v1/messages", fake.base_url()),
                headers: headers.clone(),
                body: body.clone(),
            };
            let through = Target {
                unix: None,
                url: format!("http://{address}/v1/messages"),
                headers,
                body: body.clone(),
            };
            let case = case_name(kind, stream, body.len());
            rows.push(compare(&case, client, &direct, &through, relay.pid(), plan).await?);
        }
    }
    Ok(rows)
}

/// Extra environment for the bridge and the gateway under test, from `BENCH_DAEMON_ENV`
/// (`K=V` pairs separated by spaces): how a lever such as `MALLOC_ARENA_MAX=2` is measured
/// without rebuilding (the harness otherwise starts the daemons in an empty environment).
fn daemon_env() -> Vec<(String, String)> {
    std::env::var("BENCH_DAEMON_ENV")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn clients() -> Result<Clients> {
    let tcp = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(256)
        .build()?;
    Ok(Clients { tcp })
}

async fn bench_gateway(plan: Plan) -> Result<()> {
    let fake = start_fake()?;
    // One task carries the whole c=64 load here (plus the client's idle pool), more than the
    // per-task connection limit an agent gets by default: lift it, the bench measures the proxy.
    // `BENCH_GATEWAY_THREADS` sets `gateway.threads` (absent: the default, one per core).
    let threads = std::env::var("BENCH_GATEWAY_THREADS")
        .map(|n| format!("threads = {n}\n"))
        .unwrap_or_default();
    let config = format!(
        "[gateway]\nollama_url = \"{}\"\nmax_connections_per_task = 1024\n{threads}[models.local]\nbackend = \"ollama\"\nupstream_model = \"qwen-upstream\"\n",
        fake.base_url()
    );
    let extra = daemon_env();
    let env: Vec<(&str, &str)> = extra
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let gw = GatewayProcess::start(&config, &env)?;
    let token = "bench-task-token-0123456789";
    gw.client()
        .open_task(&OpenTask {
            tid: "bench".into(),
            model: "local".into(),
            token: token.into(),
            budget: Budget::default(),
        })
        .await
        .context("cannot open the bench task")?;
    let client = clients()?;
    let mut rows = Vec::new();
    for stream in [false, true] {
        let body = workload::claude_code_request("claude-sonnet-4-5", stream);
        let bytes = bytes::Bytes::from(serde_json::to_vec(&body)?);
        let through = Target {
            unix: Some(agentbox_api::UnixClient::new(gw.task_socket("bench")).with_timeout(None)),
            url: "/v1/messages?beta=true".into(),
            headers: vec![
                ("authorization".into(), format!("Bearer {token}")),
                ("anthropic-version".into(), "2023-06-01".into()),
                (
                    "anthropic-beta".into(),
                    "context-management-2025-06-27".into(),
                ),
                ("content-type".into(), "application/json".into()),
            ],
            body: bytes.clone(),
        };
        through.send(&client).await?;
        let forwarded = fake.requests()?.pop().context("fakellm saw nothing")?;
        let direct = Target {
            unix: None,
            url: format!("{}/v1/messages", fake.base_url()),
            headers: vec![
                ("anthropic-version".into(), "2023-06-01".into()),
                ("content-type".into(), "application/json".into()),
            ],
            body: bytes::Bytes::from(serde_json::to_vec(&forwarded["body"])?),
        };
        let case = case_name("unix socket in, loopback out,", stream, bytes.len());
        rows.push(compare(&case, &client, &direct, &through, gw.pid(), plan).await?);
    }
    let notes = notes(
        "agentbox-gateway",
        gw.pid(),
        "after the run",
        "Every request through the gateway is authenticated, sanitized, admitted against the budget, metered and settled. ",
        plan,
    );
    print_table("gateway vs fakellm direct", &rows, &notes);
    Ok(())
}

// === blackbox proxy ===

/// The request fakellm logged after byte `mark` of its log: read from there, so the bench
/// never re-parses the gigabytes of 100 KB bodies logged before.
fn logged_after(fake: &FakeLlm, mark: u64) -> Result<Value> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(fake.log_path())?;
    f.seek(SeekFrom::Start(mark))?;
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    let line = text.lines().next().context("fakellm logged nothing")?;
    Ok(serde_json::from_str(line)?)
}

fn log_len(fake: &FakeLlm) -> Result<u64> {
    Ok(std::fs::metadata(fake.log_path()).map_or(0, |m| m.len()))
}

/// Text of a chat message's content (a string or a list of parts).
fn chat_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::Object(_) => String::new(),
    }
}

/// The same conversation as a Codex-shaped Responses request: system → `instructions`,
/// messages → message items, tool calls and results → `function_call` /
/// `function_call_output` items, chat tools → function tools.
fn responses_request(chat: &Value, stream: bool) -> Value {
    let mut instructions = Vec::new();
    let mut input = Vec::new();
    for m in chat["messages"].as_array().into_iter().flatten() {
        let text = chat_text(&m["content"]);
        match m["role"].as_str().unwrap_or("user") {
            "system" => instructions.push(text),
            "tool" => input.push(json!({"type": "function_call_output",
                "call_id": m["tool_call_id"], "output": text})),
            role => {
                let part = if role == "assistant" {
                    "output_text"
                } else {
                    "input_text"
                };
                if !text.is_empty() {
                    input.push(json!({"type": "message", "role": role,
                        "content": [{"type": part, "text": text}]}));
                }
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    input.push(json!({"type": "function_call", "call_id": c["id"],
                        "name": c["function"]["name"], "arguments": c["function"]["arguments"]}));
                }
            }
        }
    }
    let tools: Vec<Value> = chat["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            let f = &t["function"];
            json!({"type": "function", "name": f["name"], "description": f["description"],
                   "parameters": f["parameters"]})
        })
        .collect();
    json!({"model": "codex-x", "instructions": instructions.join("\n\n"), "input": input,
           "tools": tools, "max_output_tokens": chat["max_tokens"], "stream": stream,
           "store": false})
}

/// blackbox-server's rollout LLM proxy (`blackbox-proxy`, a turn open, `max_steps` off) in
/// front of fakellm: the 105 KB workload as an OpenAI chat body passed through, as Anthropic
/// Messages and as an OpenAI Responses request translated to chat; "direct" sends fakellm the
/// exact chat body the proxy forwarded, with the same headers.
async fn bench_proxy(plan: Plan) -> Result<()> {
    let fake = start_fake()?;
    let proxy = BlackboxProxy::start(&fake.base_url(), &["--max-steps", "0"])?;
    let (status, answer) = proxy
        .control("/turn/open", Some(&json!({"turn_id": "bench-turn"})))
        .await?;
    ensure!(
        status == 204,
        "cannot open the bench turn: {status} {answer}"
    );
    let client = clients()?;
    let json_type = ("content-type".to_owned(), "application/json".to_owned());
    // The workload as the router sees it: its Anthropic form translated by the proxy.
    let probe = Target {
        unix: None,
        url: format!("{}/v1/messages", proxy.base_url()),
        headers: vec![json_type.clone()],
        body: bytes::Bytes::from(serde_json::to_vec(&workload::claude_code_request(
            "claude-x", false,
        ))?),
    };
    let mark = log_len(&fake)?;
    probe.send(&client).await?;
    let chat_form = logged_after(&fake, mark)?["body"].clone();
    let mut rows = Vec::new();
    for (kind, path) in [
        ("chat passthrough", "/v1/chat/completions"),
        ("Anthropic → chat", "/v1/messages"),
        ("Responses → chat", "/v1/responses"),
    ] {
        for stream in [false, true] {
            let body = match path {
                "/v1/messages" => workload::claude_code_request("claude-x", stream),
                "/v1/responses" => responses_request(&chat_form, stream),
                _ => {
                    let mut b = chat_form.clone();
                    b["stream"] = json!(stream);
                    if let Some(m) = b.as_object_mut() {
                        m.remove("stream_options");
                    }
                    b
                }
            };
            let bytes = bytes::Bytes::from(serde_json::to_vec(&body)?);
            let mut headers = vec![json_type.clone()];
            if path == "/v1/messages" {
                headers.push(("anthropic-version".into(), "2023-06-01".into()));
            }
            let through = Target {
                unix: None,
                url: format!("{}{path}", proxy.base_url()),
                headers,
                body: bytes.clone(),
            };
            let mark = log_len(&fake)?;
            through.send(&client).await?;
            let forwarded = logged_after(&fake, mark)?;
            let direct_headers: Vec<(String, String)> = forwarded["headers"]
                .as_object()
                .context("headers")?
                .iter()
                .filter(|(k, _)| k.starts_with("x-") || *k == "content-type")
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
                .collect();
            let direct = Target {
                unix: None,
                url: format!(
                    "{}{}",
                    fake.base_url(),
                    forwarded["path"].as_str().context("path")?
                ),
                headers: direct_headers,
                body: bytes::Bytes::from(serde_json::to_vec(&forwarded["body"])?),
            };
            let case = case_name(kind, stream, bytes.len());
            rows.push(compare(&case, &client, &direct, &through, proxy.pid(), plan).await?);
        }
    }
    let notes = notes(
        "blackbox-proxy",
        proxy.pid(),
        "after the run",
        "Every call through the proxy is admitted in the open turn, tagged (sticky, session, \
         instance, turn, partial-rollout headers), given the sampling policy and \
         `include_usage`, and its usage counted from the upstream's chat answer. ",
        plan,
    );
    print_table("blackbox rollout proxy vs fakellm direct", &rows, &notes);
    Ok(())
}

// === launcher ===

/// The service uid the benchmark's launcher is given (`--service-uid`).
const BENCH_SERVICE_UID: u32 = 64010;
/// The floor's sandboxes run as this uid.
const AGENT_UID: u32 = 64000;
/// The first of the launcher's agent uids (one per concurrent run).
const LAUNCHER_AGENT_UID: u32 = 64100;

#[derive(Debug, Clone, Copy)]
struct StartPlan {
    warmup: usize,
    rounds: usize,
    burst: usize,
    burst_rounds: usize,
    /// Files in each workspace (`--ws-files N`; 0: only the stamp), in directories of 100, so
    /// the hand-over walk has a repository's worth of entries to cover.
    ws_files: usize,
}

const START_FULL: StartPlan = StartPlan {
    warmup: 5,
    rounds: 100,
    burst: 32,
    burst_rounds: 6,
    ws_files: 0,
};
/// Pause before each c=1 start.
const SETTLE: Duration = Duration::from_millis(50);
/// Pause before each burst.
const BURST_SETTLE: Duration = Duration::from_millis(500);

const START_QUICK: StartPlan = StartPlan {
    warmup: 2,
    rounds: 20,
    burst: 32,
    burst_rounds: 1,
    ws_files: 0,
};

/// `CLOCK_MONOTONIC` in nanoseconds: the clock `agent-stamp` writes inside the sandbox (no
/// time namespace is unshared, so both sides read the same clock).
fn monotonic_ns() -> i128 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    i128::from(t.tv_sec) * 1_000_000_000 + i128::from(t.tv_nsec)
}

fn read_stamp(ws: &Path) -> Result<i128> {
    let path = ws.join("started");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    Ok(text.trim().parse()?)
}

fn remove_stamp(ws: &Path) -> Result<()> {
    match std::fs::remove_file(ws.join("started")) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// `n` files of 1 KiB in directories of 100 under `ws`, owned by `uid`; done once per
/// workspace (a later call finds `d0` and returns).
fn populate(ws: &Path, n: usize, uid: u32) -> Result<()> {
    if n == 0 || ws.join("d0").exists() {
        return Ok(());
    }
    let body = [b'x'; 1024];
    for i in 0..n {
        let dir = ws.join(format!("d{}", i / 100));
        if i % 100 == 0 {
            std::fs::create_dir(&dir)?;
            std::os::unix::fs::chown(&dir, Some(uid), Some(uid))?;
        }
        let file = dir.join(format!("f{}", i % 100));
        std::fs::write(&file, body)?;
        std::os::unix::fs::chown(&file, Some(uid), Some(uid))?;
    }
    Ok(())
}

fn nanos(ns: i128) -> Duration {
    Duration::from_nanos(u64::try_from(ns).unwrap_or(0))
}

fn open_dir(p: &Path) -> Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    Ok(rustix::fs::open(
        p,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// The floor: the launcher's own sandbox plan for an agent, started straight from this
/// process; optionally inside a fresh cgroup with the launcher's limits, which isolates what
/// the kernel charges for creating and joining a cgroup.
struct Floor {
    plan: agentbox_sandbox::bwrap::Plan,
    gateway: OwnedFd,
    cgroups: agentbox_sandbox::cgroup::Cgroups,
    limits: agentbox_sandbox::cgroup::CgroupLimits,
    next: AtomicUsize,
}

impl Floor {
    /// One sandbox. Returns (t0, stamp).
    async fn once(&self, ws: &Path, with_cgroup: bool) -> Result<(i128, i128)> {
        use agentbox_sandbox::bwrap::{self as sandbox, Mounts, RunAs};
        remove_stamp(ws)?;
        let mounts = Mounts {
            workspace: open_dir(ws)?,
            gateway: Some(self.gateway.try_clone()?),
            venv: None,
            home: None,
            tmp: None,
            server_dir: None,
            clients: None,
            attach: None,
        };
        let run_as = RunAs {
            uid: AGENT_UID,
            gid: AGENT_UID,
        };
        let t0 = monotonic_ns();
        let cgroup = if with_cgroup {
            let name = format!("f{}", self.next.fetch_add(1, Ordering::SeqCst));
            Some(self.cgroups.create(&name, self.limits).await?)
        } else {
            None
        };
        let procs = cgroup.as_ref().map(|c| c.join_files()).unwrap_or_default();
        let sandbox = sandbox::spawn(
            &self.plan,
            &mounts,
            &procs,
            run_as,
            Path::new(sandbox::BWRAP),
            None,
            sandbox::Start::Now,
        )?;
        // The status pipe's read end stays open until bwrap is gone: bwrap writes its records
        // there, and a closed pipe would kill it with SIGPIPE (as the launcher keeps it).
        let (child, status) = (sandbox.child, sandbox.status);
        let out = child.wait_with_output().await?;
        drop(status);
        if let Some(cg) = cgroup {
            cg.kill_all().await?;
            cg.remove()?;
        }
        if !out.status.success() {
            bail!(
                "bare bwrap failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok((t0, read_stamp(ws)?))
    }
}

/// One agent through the launcher: `POST /agents`, wait for it to exit, read its stamp,
/// `DELETE`. Returns (t0, stamp).
async fn launcher_once(l: &LauncherProcess, tid: &str, ws: &Path) -> Result<(i128, i128)> {
    remove_stamp(ws)?;
    let client = l.client();
    let req = AgentRequest {
        tid: tid.into(),
        model: "m".into(),
        cmd: vec!["claude".into()],
        env: Default::default(),
        venv: None,
        timeout_s: 60,
        token: None,
        stdin: None,
    };
    let tid = Tid::parse(tid)?;
    let t0 = monotonic_ns();
    client.start_agent(&req).await.context("POST /agents")?;
    let done = client.wait_agent(&tid).await?;
    if done.state != RunState::Exited || done.exit_code != Some(0) {
        bail!("the agent did not run cleanly: {done:?}");
    }
    let stamp = read_stamp(ws)?;
    client.delete_agent(&tid).await?;
    Ok((t0, stamp))
}

/// The three ways a sandbox is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Floor,
    FloorInCgroup,
    Launcher,
}

const SIDES: [Side; 3] = [Side::Floor, Side::FloorInCgroup, Side::Launcher];

/// Per side: (latencies, walls).
type Samples = [(Vec<Duration>, Vec<Duration>); 3];

fn side_index(side: Side) -> usize {
    match side {
        Side::Floor => 0,
        Side::FloorInCgroup => 1,
        Side::Launcher => 2,
    }
}

/// `POST /agents` to the agent's first instruction, against bwrap started directly with the
/// same arguments (the floor) and against the floor inside a fresh cgroup, in one run: c=1
/// rounds (the order of the three rotating), then `burst` sandboxes at once per side. The
/// agent is `agent-stamp` in place of claude; the bench must run as root.
async fn bench_launcher(plan: StartPlan) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if !rustix::process::geteuid().is_root() {
        bail!("the launcher benchmark must run as root, as the launcher does");
    }
    // The agent uid must read the binary: copy it out of the build tree into a 0755 dir.
    let bin_dir = tempfile::Builder::new().prefix("bench-bin-").tempdir()?;
    std::fs::set_permissions(bin_dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let stamp = bin_dir.path().join("agent-stamp");
    std::fs::copy(workspace_bin("agentbox-tests", "agent-stamp")?, &stamp)?;
    std::fs::set_permissions(&stamp, std::fs::Permissions::from_mode(0o755))?;
    // One agent uid per run of the burst (each run takes its own), clear of the service uid and
    // of the floor's uid.
    let config = format!(
        "agent_uid = {LAUNCHER_AGENT_UID}\nagent_gid = {LAUNCHER_AGENT_UID}\nagent_uid_count = {n}\n\
         [launcher]\nclaude_bin = {stamp:?}\nvenv_root = \"/nonexistent/venvs\"\n\
         [models.m]\nbackend = \"ollama\"\nupstream_model = \"x\"\n",
        n = plan.burst.max(1)
    );
    let l = Arc::new(LauncherProcess::start(&config, BENCH_SERVICE_UID)?);
    // The limits and tmpfs sizes the launcher applies under this config.
    let limits = agentbox_policy::config::Config::from_toml_str(
        &config,
        "bench",
        &agentbox_policy::config::FixedEnv::default(),
    )?
    .launcher
    .limits;

    let floor_dir = bin_dir.path().join("floor");
    let gw_dir = floor_dir.join("gw");
    std::fs::create_dir_all(&gw_dir)?;
    drop(std::os::unix::net::UnixListener::bind(
        gw_dir.join("llm.sock"),
    )?);
    let cgroups = agentbox_sandbox::cgroup::Cgroups::detect(
        Path::new("/sys/fs/cgroup"),
        &format!("agentbox-bench-{}", std::process::id()),
        Arc::new(agentbox_sandbox::cgroup::RealSignaller),
    )?;
    cgroups.prepare()?;
    let floor = Arc::new(Floor {
        plan: agentbox_sandbox::bwrap::Plan {
            program: agentbox_sandbox::bwrap::Program::Claude { args: Vec::new() },
            env: agentbox_sandbox::bwrap::environment(
                &std::collections::BTreeMap::new(),
                false,
                None,
                true,
            ),
            with_venv: false,
            with_gateway: true,
            tmp_bytes: limits.tmp_mb << 20,
            home_bytes: limits.home_mb << 20,
            file_bytes: limits.disk_mb << 20,
            claude_bin: stamp.clone(),
        },
        gateway: open_dir(&gw_dir)?,
        cgroups: cgroups.clone(),
        limits: agentbox_sandbox::cgroup::CgroupLimits {
            memory_bytes: limits.memory_mb << 20,
            pids: limits.pids,
            cpus: limits.cpus,
        },
        next: AtomicUsize::new(0),
    });
    let result = run_launcher_bench(plan, &l, &floor, &floor_dir).await;
    // Our cgroup parents (the per-sandbox ones are gone already).
    let parents: Vec<PathBuf> = match cgroups.hierarchy() {
        agentbox_sandbox::cgroup::Hierarchy::V1(dirs) => dirs.all(),
        agentbox_sandbox::cgroup::Hierarchy::V2 { parent, .. } => vec![parent.clone()],
    };
    for p in parents {
        let _ = std::fs::remove_dir(p);
    }
    result
}

async fn run_launcher_bench(
    plan: StartPlan,
    l: &Arc<LauncherProcess>,
    floor: &Arc<Floor>,
    floor_dir: &Path,
) -> Result<()> {
    let floor_ws = |i: usize| -> Result<PathBuf> {
        let ws = floor_dir.join(format!("ws{i}"));
        std::fs::create_dir_all(&ws)?;
        std::os::unix::fs::chown(&ws, Some(AGENT_UID), Some(AGENT_UID))?;
        populate(&ws, plan.ws_files, AGENT_UID)?;
        Ok(ws)
    };
    let launcher_ws = |i: usize| -> Result<(String, PathBuf)> {
        let tid = format!("b{i}");
        let ws = l.workspace(&tid)?;
        populate(&ws, plan.ws_files, BENCH_SERVICE_UID)?;
        l.gateway_socket(&tid)?;
        Ok((tid, ws))
    };
    let one = |side: Side, i: usize| {
        let (l, floor) = (Arc::clone(l), Arc::clone(floor));
        let fws = floor_ws(i);
        let lws = launcher_ws(i);
        async move {
            match side {
                Side::Floor => floor.once(&fws?, false).await,
                Side::FloorInCgroup => floor.once(&fws?, true).await,
                Side::Launcher => {
                    let (tid, ws) = lws?;
                    launcher_once(&l, &tid, &ws).await
                }
            }
        }
    };

    eprintln!("bench: launcher c=1");
    for _ in 0..plan.warmup {
        for side in SIDES {
            one(side, 0).await?;
        }
    }
    let mut c1: Samples = Default::default();
    let mut paired = Vec::new();
    let cpu0 = cpu_time(l.pid())?;
    for round in 0..plan.rounds {
        let mut got = [0_f64; 3];
        // Rotate the order so no side always meets a warmer cache.
        for k in 0..SIDES.len() {
            let side = SIDES[(round + k) % SIDES.len()];
            // Starts in production are far apart: let the previous one's after-effects (kernel
            // RCU state, deferred work) settle so no start rides on another's.
            tokio::time::sleep(SETTLE).await;
            let (t0, stamp) = one(side, 0).await?;
            let d = nanos(stamp - t0);
            c1[side_index(side)].0.push(d);
            got[side_index(side)] = d.as_secs_f64() * 1000.0;
        }
        paired.push(got[2] - got[0]);
    }
    let cpu_ms =
        cpu_time(l.pid())?.saturating_sub(cpu0).as_secs_f64() * 1000.0 / plan.rounds as f64;
    let c1_paired = paired_percentiles(paired);

    eprintln!("bench: launcher {} at once", plan.burst);
    let mut burst: Samples = Default::default();
    for round in 0..plan.burst_rounds {
        // As at c=1, the order rotates: a burst leaves work behind it (cgroups and mount
        // namespaces freed by the kernel's workers, the launcher's spares topped up), and a
        // fixed order would hand it to the same side every round. The pause lets it finish.
        for k in 0..SIDES.len() {
            let side = SIDES[(round + k) % SIDES.len()];
            tokio::time::sleep(BURST_SETTLE).await;
            let mut set = tokio::task::JoinSet::new();
            for i in 0..plan.burst {
                set.spawn(one(side, 100 + i));
            }
            let runs = set
                .join_all()
                .await
                .into_iter()
                .collect::<Result<Vec<_>>>()?;
            let first = runs.iter().map(|r| r.0).min().unwrap_or(0);
            let last = runs.iter().map(|r| r.1).max().unwrap_or(0);
            let slot = &mut burst[side_index(side)];
            slot.0.extend(runs.iter().map(|(t0, s)| nanos(s - t0)));
            slot.1.push(nanos(last - first));
        }
    }

    let p = |v: &[Duration]| percentiles(v.to_vec());
    let median_ms = |v: &[Duration]| {
        let mut v = v.to_vec();
        v.sort();
        v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    println!("### launcher: `POST /agents` to the agent's first instruction vs bare bwrap\n");
    if plan.ws_files > 0 {
        println!(
            "Each workspace holds {} files of 1 KiB in directories of 100.\n",
            plan.ws_files
        );
    }
    println!(
        "| case | floor: bare bwrap, same mounts p50/p99 ms | floor + fresh cgroup p50/p99 ms | through the launcher p50/p99 ms | **added vs floor p50/p99 ms** | paired added p50/p99 ms | **ratio p50 vs floor** (target ≤ 2) | ratio p50 vs floor + cgroup | wall until all stamps: floor / + cgroup / launcher ms | launcher CPU ms/start |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (case, s, paired, cpu) in [
        ("c=1".to_owned(), &c1, Some(c1_paired), Some(cpu_ms)),
        (format!("{} at once", plan.burst), &burst, None, None),
    ] {
        let (f, fc, t) = (p(&s[0].0), p(&s[1].0), p(&s[2].0));
        let walls = if s[0].1.is_empty() {
            "—".to_owned()
        } else {
            format!(
                "{:.1} / {:.1} / {:.1}",
                median_ms(&s[0].1),
                median_ms(&s[1].1),
                median_ms(&s[2].1)
            )
        };
        println!(
            "| {case} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | **{:.2} / {:.2}** | {} | **{:.2}** | {:.2} | {walls} | {} |",
            f.0,
            f.1,
            fc.0,
            fc.1,
            t.0,
            t.1,
            t.0 - f.0,
            t.1 - f.1,
            paired.map_or("—".to_owned(), |(a, b)| format!("{a:.2} / {b:.2}")),
            t.0 / f.0,
            t.0 / fc.0,
            cpu.map_or("—".to_owned(), |c| format!("{c:.2}")),
        );
    }
    println!(
        "\nTime is CLOCK_MONOTONIC from just before the request (or the spawn) to the stamp the \
         agent (`agent-stamp`, in place of claude) writes to /workspace as its first act. Floor: \
         `agentbox_sandbox::bwrap::spawn` called directly, i.e. bwrap with the launcher's own \
         arguments (seccomp filters, synthetic /etc files, tmpfs sizes, workspace and /run/gw \
         bound by descriptor) as uid {AGENT_UID}. Floor + fresh cgroup: the same inside a \
         cgroup created for it with the launcher's limits (what the kernel charges for creating \
         and joining one). Through the launcher: HTTP over launcher.sock, validation, the \
         workspace hand-over walk, staging mounts, the task cgroup, the spawn. \"{n} at once\": \
         {n} requests (or spawns) fired together; per-sandbox latency, and the wall time from \
         the first request to the last stamp (median of {r} round(s), the order of the three \
         rotating, {burst_settle} ms pause before each). Plan: c=1 {c} rounds \
         of the three (order rotating, {settle} ms pause before each start) after {w} warm-up. \
         Launcher CPU excludes its children.\n",
        n = plan.burst,
        r = plan.burst_rounds,
        c = plan.rounds,
        w = plan.warmup,
        settle = SETTLE.as_millis(),
        burst_settle = BURST_SETTLE.as_millis(),
    );
    Ok(())
}

/// blackbox-server alone: `runs` starts, each timed from spawn to the first 200 from
/// `/health` (the Python reference: 0.63–0.95 s), the idle RSS a second later (reference: 55
/// MiB), and the server's RSS once a registration started opencode behind it (opencode's own
/// shown apart: it is the agent, not the server).
///
/// `BENCH_BLACKBOX_BIN` measures another build of the server instead of the workspace's, e.g.
/// the static one packaging installs (`scripts/build-blackbox-static.sh` prints its path).
async fn bench_server(runs: usize) -> Result<()> {
    use std::io::BufRead;
    let bin = match std::env::var_os("BENCH_BLACKBOX_BIN") {
        Some(path) => PathBuf::from(path),
        None => workspace_bin("agentbox-blackbox", "blackbox-server")?,
    };
    eprintln!("bench: server binary {}", bin.display());
    let runtime = tempfile::tempdir()?;
    let http = reqwest::Client::new();
    let mut starts = Vec::new();
    let mut idle = Vec::new();
    let mut anon = Vec::new();
    for _ in 0..runs {
        let began = Instant::now();
        let mut child = std::process::Command::new(&bin)
            .env_clear()
            .env("BBS_HOST", "127.0.0.1")
            .env("BBS_PORT", "0")
            .env("BBS_RUNTIME_ROOT", runtime.path())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().context("no stdout")?).read_line(&mut line)?;
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .with_context(|| format!("unexpected first line {line:?}"))?
            .to_owned();
        loop {
            if let Ok(r) = http.get(format!("http://{addr}/health")).send().await
                && r.status().is_success()
            {
                break;
            }
            ensure!(
                began.elapsed() < Duration::from_secs(10),
                "no /health answer"
            );
        }
        starts.push(began.elapsed());
        tokio::time::sleep(Duration::from_secs(1)).await;
        idle.push(rss_kib(child.id(), "VmRSS:"));
        anon.push(rss_kib(child.id(), "RssAnon:"));
        child.kill()?;
        child.wait()?;
    }
    starts.sort();
    idle.sort_unstable();
    anon.sort_unstable();
    let fake = start_fake()?;
    let bb = BlackboxProcess::start(&[("RUST_LOG", "warn")])?;
    let reg = bb
        .post(
            "/v1/rollout/register",
            &opencode_registration(&fake.base_url(), "bench", &json!({})),
        )
        .await;
    ensure!(reg.status == 200, "register: {reg}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let opencode = reg.body["binding"]["runtime_dir"]
        .as_str()
        .and_then(BlackboxProcess::opencode_pid)
        .context("no opencode pid")?;
    println!("\n### blackbox-server ({runs} starts)\n");
    println!("| measure | p50 | max |\n|---|---|---|");
    println!(
        "| start → first `/health` 200 | {:.1} ms | {:.1} ms |",
        starts[starts.len() / 2].as_secs_f64() * 1000.0,
        starts.last().context("no runs")?.as_secs_f64() * 1000.0
    );
    println!(
        "| idle RSS, nothing registered | {:.1} MiB | {:.1} MiB |",
        idle[idle.len() / 2] as f64 / 1024.0,
        *idle.last().context("no runs")? as f64 / 1024.0
    );
    println!(
        "| of which anonymous (private) | {:.1} MiB | {:.1} MiB |",
        anon[anon.len() / 2] as f64 / 1024.0,
        *anon.last().context("no runs")? as f64 / 1024.0
    );
    println!(
        "\nRegistered (opencode running, proxy listening): server RSS {:.1} MiB; opencode's own {:.1} MiB.",
        rss_kib(bb.pid(), "VmRSS:") as f64 / 1024.0,
        rss_kib(opencode, "VmRSS:") as f64 / 1024.0
    );
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let plan = if quick { QUICK } else { FULL };
    let mut start_plan = if quick { START_QUICK } else { START_FULL };
    if let Some(n) = args
        .iter()
        .position(|a| a == "--ws-files")
        .and_then(|i| args.get(i + 1))
    {
        start_plan.ws_files = n.parse().context("--ws-files takes a number")?;
    }
    let what = args
        .iter()
        .find(|a| !a.starts_with("--") && a.parse::<usize>().is_err())
        .map_or("bridge", String::as_str);
    let rt = tokio::runtime::Runtime::new()?;
    match what {
        "bridge" => rt.block_on(bench_bridge(plan)),
        "gateway" => rt.block_on(bench_gateway(plan)),
        "proxy" => rt.block_on(bench_proxy(plan)),
        "server" => rt.block_on(bench_server(if quick { 5 } else { 30 })),
        "launcher" => rt.block_on(bench_launcher(start_plan)),
        "turns" => rt.block_on(turns::bench_turns(quick)),
        "pool" => rt.block_on(pool::bench_pool(quick)),
        "peers" => {
            let parsed = match peers::parse(&args) {
                Ok(a) => a,
                // Usage errors and --help print as clap formats them (exit 2, or 0 for help).
                Err(e) => e.exit(),
            };
            rt.block_on(peers::bench_peers(parsed))
        }
        "all" => rt.block_on(async {
            bench_bridge(plan).await?;
            bench_gateway(plan).await?;
            bench_proxy(plan).await?;
            bench_server(if quick { 5 } else { 30 }).await?;
            bench_launcher(start_plan).await
        }),
        other => {
            bail!(
                "unknown benchmark {other:?}; known: bridge, gateway, proxy, server, launcher, turns, peers, pool, all"
            )
        }
    }
}
