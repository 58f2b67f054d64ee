//! `bench`: what our daemons add on top of talking to the model directly, measured in one run
//! against `fakellm` so the figures are differences and ratios, not absolute times.
//!
//! ```text
//! cargo run --release -p agentbox-tests --bin bench -- [bridge|gateway|all] [--quick]
//! ```
//! For each case it sends the same ~100 KB Claude-Code-sized request through the daemon and,
//! alternating, the exact body the daemon forwarded straight to fakellm, and reports latency to
//! the last byte (p50/p99), the difference, throughput at concurrency 64, and the daemon's CPU
//! time per request and peak RSS. The method follows `../shared/research/peer-bench.md`:
//! c=1: 30 warm-up pairs then 300 pairs; c=64: 4 rounds of 256 requests per side.
//! Output is a Markdown table on stdout (pasted into BENCHMARKS.md).

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentbox_tests::harness::{BridgeProcess, FakeLlm, GatewayProcess, workspace_bin};
use agentbox_tests::workload;
use anyhow::{Context, Result, bail};
use serde_json::json;
use tokio::sync::Semaphore;

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

/// HTTP clients for both transports, each with a keep-alive pool.
#[derive(Debug, Clone)]
struct Clients {
    tcp: reqwest::Client,
    unix: UnixClient,
}

type UnixClient = hyper_util::client::legacy::Client<
    hyperlocal::UnixConnector,
    http_body_util::Full<bytes::Bytes>,
>;

/// One side of a comparison: a URL (or a unix socket and a path), headers and a body.
#[derive(Debug, Clone)]
struct Target {
    url: String,
    socket: Option<std::path::PathBuf>,
    headers: Vec<(String, String)>,
    body: bytes::Bytes,
}

impl Target {
    async fn send(&self, clients: &Clients) -> Result<Duration> {
        use http_body_util::BodyExt;
        let start = Instant::now();
        let (status, body) = match &self.socket {
            None => {
                let mut req = clients.tcp.post(&self.url).body(self.body.clone());
                for (k, v) in &self.headers {
                    req = req.header(k, v);
                }
                let resp = req.send().await?;
                let status = resp.status().as_u16();
                (status, resp.bytes().await?)
            }
            Some(sock) => {
                let uri: hyper::Uri = hyperlocal::Uri::new(sock, &self.url).into();
                let mut req = hyper::Request::post(uri);
                for (k, v) in &self.headers {
                    req = req.header(k, v);
                }
                let resp = clients
                    .unix
                    .request(req.body(http_body_util::Full::new(self.body.clone()))?)
                    .await?;
                let status = resp.status().as_u16();
                (status, resp.into_body().collect().await?.to_bytes())
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
    cpu_ms_per_req: f64,
}

fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let at = |q: f64| {
        let i = ((v.len() as f64 - 1.0) * q).round() as usize;
        v.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
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

async fn compare(
    case: &str,
    client: &Clients,
    direct: &Target,
    through: &Target,
    daemon_pid: u32,
    plan: Plan,
) -> Result<Row> {
    for _ in 0..plan.warmup {
        direct.send(client).await?;
        through.send(client).await?;
    }
    let (mut d, mut t) = (Vec::new(), Vec::new());
    let cpu0 = cpu_time(daemon_pid)?;
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
    let mut paired: Vec<f64> = t
        .iter()
        .zip(&d)
        .map(|(t, d)| (t.as_secs_f64() - d.as_secs_f64()) * 1000.0)
        .collect();
    paired.sort_by(f64::total_cmp);
    let at = |q: f64| {
        paired
            .get(((paired.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let c1_paired = (at(0.50), at(0.99));
    let cpu_ms_per_req =
        (cpu_time(daemon_pid)?.saturating_sub(cpu0)).as_secs_f64() * 1000.0 / plan.pairs as f64;
    let (cd, rps_direct) = concurrent(client, direct, plan).await?;
    let (ct, rps_through) = concurrent(client, through, plan).await?;
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
    })
}

fn print_table(title: &str, rows: &[Row], notes: &str) {
    println!("### {title}\n");
    println!(
        "| case | c=1 direct p50/p99 ms | c=1 through p50/p99 ms | **added p50/p99 ms** | paired added p50/p99 ms | c=64 direct p50/p99 ms | c=64 through p50/p99 ms | rps direct / through (c=64) | daemon CPU ms/req |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.3} / {:.3} | {:.3} / {:.3} | **{:.3} / {:.3}** | {:.3} / {:.3} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} / {:.0} | {:.3} |",
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
        );
    }
    println!("\n{notes}\n");
}

async fn bench_bridge(plan: Plan) -> Result<()> {
    let fakellm = workspace_bin("agentbox-tests", "fakellm")?;
    // Twenty text deltas, so a stream has the shape of a short real answer.
    let reply = "All done: the file was written and the tests pass. ".repeat(4);
    let fake = FakeLlm::start(
        &fakellm,
        &json!({"fallback": {"text": reply, "usage": {"input_tokens": 25000, "output_tokens": 60}}}),
    )?;
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
    let bridge = BridgeProcess::start(
        &config,
        &[("AGENTBOX_BRIDGE_TOKEN", TOKEN), ("BENCH_KEY", "sk-bench")],
    )?;
    let client = clients()?;

    let mut rows = Vec::new();
    for (provider, model) in [("openai", "gpt"), ("anthropic", "claude")] {
        for stream in [false, true] {
            let body = workload::claude_code_request(model, stream);
            let bytes = bytes::Bytes::from(serde_json::to_vec(&body)?);
            let through = Target {
                socket: None,
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
                socket: None,
                url: format!("{}{path}", fake.base_url()),
                headers,
                body: bytes::Bytes::from(serde_json::to_vec(&forwarded["body"])?),
            };
            let case = format!(
                "{} {} ({} KB in)",
                if provider == "openai" {
                    "translate → chat"
                } else {
                    "passthrough"
                },
                if stream { "stream" } else { "non-stream" },
                bytes.len() / 1024
            );
            eprintln!("bench: {case}");
            rows.push(compare(&case, &client, &direct, &through, bridge.pid(), plan).await?);
        }
    }
    let notes = format!(
        "agentbox-bridge RSS: {} MiB idle-after-run, {} MiB peak. Plan: c=1 {} pairs after {} warm-up; c=64 {} round(s) of {}.",
        rss_kib(bridge.pid(), "VmRSS:") / 1024,
        rss_kib(bridge.pid(), "VmHWM:") / 1024,
        plan.pairs,
        plan.warmup,
        plan.rounds,
        plan.round_size,
    );
    print_table("llm-bridge vs fakellm direct", &rows, &notes);
    Ok(())
}

fn clients() -> Result<Clients> {
    let tcp = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(256)
        .build()?;
    let unix = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build(hyperlocal::UnixConnector);
    Ok(Clients { tcp, unix })
}

async fn bench_gateway(plan: Plan) -> Result<()> {
    let fakellm = workspace_bin("agentbox-tests", "fakellm")?;
    let reply = "All done: the file was written and the tests pass. ".repeat(4);
    let fake = FakeLlm::start(
        &fakellm,
        &json!({"fallback": {"text": reply, "usage": {"input_tokens": 25000, "output_tokens": 60}}}),
    )?;
    let config = format!(
        "[gateway]\nollama_url = \"{}\"\n[models.local]\nbackend = \"ollama\"\nupstream_model = \"qwen-upstream\"\n",
        fake.base_url()
    );
    let gw = GatewayProcess::start(&config, &[])?;
    let token = "bench-task-token-0123456789";
    let r = gw
        .control(
            "POST",
            "/tasks",
            Some(&json!({"tid": "bench", "model": "local", "token": token})),
        )
        .await?;
    if r.status != 201 {
        bail!(
            "cannot open the bench task: {}",
            String::from_utf8_lossy(&r.body)
        );
    }
    let client = clients()?;
    let mut rows = Vec::new();
    for stream in [false, true] {
        let body = workload::claude_code_request("claude-sonnet-4-5", stream);
        let bytes = bytes::Bytes::from(serde_json::to_vec(&body)?);
        let through = Target {
            socket: Some(gw.task_socket("bench")),
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
            socket: None,
            url: format!("{}/v1/messages", fake.base_url()),
            headers: vec![
                ("anthropic-version".into(), "2023-06-01".into()),
                ("content-type".into(), "application/json".into()),
            ],
            body: bytes::Bytes::from(serde_json::to_vec(&forwarded["body"])?),
        };
        let case = format!(
            "unix socket in, loopback out, {} ({} KB in)",
            if stream { "stream" } else { "non-stream" },
            bytes.len() / 1024
        );
        eprintln!("bench: {case}");
        rows.push(compare(&case, &client, &direct, &through, gw.pid(), plan).await?);
    }
    let notes = format!(
        "agentbox-gateway RSS: {} MiB after the run, {} MiB peak. Every request through the gateway is authenticated, sanitized, admitted against the budget, metered and settled. Plan: c=1 {} pairs after {} warm-up; c=64 {} round(s) of {}.",
        rss_kib(gw.pid(), "VmRSS:") / 1024,
        rss_kib(gw.pid(), "VmHWM:") / 1024,
        plan.pairs,
        plan.warmup,
        plan.rounds,
        plan.round_size,
    );
    print_table("gateway vs fakellm direct", &rows, &notes);
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let plan = if args.iter().any(|a| a == "--quick") {
        QUICK
    } else {
        FULL
    };
    let what = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map_or("bridge", String::as_str);
    let rt = tokio::runtime::Runtime::new()?;
    match what {
        "bridge" => rt.block_on(bench_bridge(plan)),
        "gateway" => rt.block_on(bench_gateway(plan)),
        "all" => rt.block_on(async {
            bench_bridge(plan).await?;
            bench_gateway(plan).await
        }),
        other => bail!("unknown benchmark {other:?}; known: bridge, gateway, all"),
    }
}
