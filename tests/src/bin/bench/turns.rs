//! `bench turns`: the time blackbox-server itself adds to a turn, per backend, with the real
//! agent CLIs against fakellm (through the server's in-process proxy).
//!
//! A turn is one sync `POST /v1/sessions/{id}/messages` whose model call fakellm answers at
//! once with a short text. Its timeline, every instant in unix microseconds from one clock:
//! - `sent`, `answered`: the bench client around the request;
//! - `agent call started` / `returned`: the server's debug lines around the backend's
//!   `send_message` (`server::turns`, tracing timestamps);
//! - `cli start` / `cli exit`: for the per-turn CLIs (claude_code, codex), a bash wrapper set
//!   as the backend's `executable` stamps `$EPOCHREALTIME` before running the real CLI and
//!   after it exits (its own start is measured apart and reported, since it lands in (a));
//! - each model call's arrival (fakellm's log, `ts_us`, matched to the turn by the proxy's
//!   `X-Turn-Id`) and the moment its streamed answer was sent whole (`<log>.finished`).
//!
//! The server's share: (a) `sent` → `agent call started` → `cli start` (for opencode, whose
//! server runs all along, up to the call only) and (b) `cli exit` → `agent call returned` →
//! `answered`. The agent's: `cli start` (or the call) → first model call, and last answer sent
//! → `cli exit` (or the call returned). The model's: the sum of its answers' durations.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agentbox_tests::harness::{
    BlackboxProcess, FakeLlm, client_bin, opencode_registration, registration, user, workspace_bin,
};
use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

/// Turns measured per backend, and warm-up turns before them.
const TURNS: usize = 20;
const QUICK_TURNS: usize = 5;
const WARMUP: usize = 2;

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// A backend as the bench registers it.
struct Backend {
    kind: &'static str,
    /// The CLI run per turn (wrapped to stamp its start and exit); `None` for the long-running
    /// agents (opencode, openclaw).
    cli: Option<&'static str>,
}

/// Registered with their defaults (as the conformance suite does), but the binary.
const BACKENDS: [Backend; 4] = [
    Backend {
        kind: "opencode",
        cli: None,
    },
    Backend {
        kind: "claude_code",
        cli: Some("claude"),
    },
    Backend {
        kind: "codex",
        cli: Some("codex"),
    },
    Backend {
        kind: "openclaw",
        cli: None,
    },
];

/// The wrapper that stamps the CLI's start and exit into `stamps`.
fn wrapper(dir: &Path, real: &Path, stamps: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let text = format!(
        "#!/bin/bash\necho \"start $EPOCHREALTIME\" >> {s}\n{r} \"$@\"\nrc=$?\necho \"exit $EPOCHREALTIME\" >> {s}\nexit $rc\n",
        s = stamps.display(),
        r = real.display()
    );
    let path = dir.join("stamped-cli");
    std::fs::write(&path, text)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    Ok(path)
}

/// `$EPOCHREALTIME` (`seconds.micros`) as microseconds.
fn epoch_us(s: &str) -> Option<i64> {
    let (sec, frac) = s.trim().split_once('.')?;
    Some(
        sec.parse::<i64>().ok()? * 1_000_000
            + format!("{frac:0<6}").get(..6)?.parse::<i64>().ok()?,
    )
}

/// The last `start` and `exit` stamps.
fn last_stamps(stamps: &Path) -> Result<(i64, i64)> {
    let text = std::fs::read_to_string(stamps)?;
    let last = |kind: &str| {
        text.lines()
            .rev()
            .find_map(|l| l.strip_prefix(kind).and_then(epoch_us))
            .with_context(|| format!("no {kind} stamp in {}", stamps.display()))
    };
    Ok((last("start ")?, last("exit ")?))
}

/// Days since 1970-01-01 of a civil date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A tracing timestamp (`2026-12-01T01:30:00.123456Z`) as unix microseconds.
fn rfc3339_us(ts: &str) -> Option<i64> {
    let ts = ts.strip_suffix('Z')?;
    let (date, time) = ts.split_once('T')?;
    let mut d = date.split('-').map(str::parse::<i64>);
    let (y, mo, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(str::parse::<i64>);
    let (h, mi, s) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let micros = format!("{frac:0<6}").get(..6)?.parse::<i64>().ok()?;
    let secs = days_from_civil(y, mo, day) * 86_400 + h * 3600 + mi * 60 + s;
    Some(secs * 1_000_000 + micros)
}

/// `text` without ANSI colour sequences.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The timestamp of the server's `message` line for `turn`, waiting a little for stderr.
async fn server_stamp(bb: &BlackboxProcess, message: &str, turn: &str) -> Result<i64> {
    for _ in 0..50 {
        let log = strip_ansi(&bb.stderr());
        let found = log
            .lines()
            .rev()
            .find(|l| l.contains(message) && l.contains(&format!("\"{turn}\"")))
            .and_then(|l| l.split_whitespace().next())
            .and_then(rfc3339_us);
        if let Some(t) = found {
            return Ok(t);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("no {message:?} line for {turn} in the server's log")
}

/// The model calls of `turn`: (arrival, answer sent whole), in arrival order.
fn model_calls(fake: &FakeLlm, turn: &str) -> Result<Vec<(i64, i64)>> {
    let finished_path = format!("{}.finished", fake.log_path().display());
    let finished: Vec<Value> = std::fs::read_to_string(&finished_path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let mut calls = Vec::new();
    for r in fake.chat_requests()? {
        if r["headers"]["x-turn-id"] != turn {
            continue;
        }
        let at = r["ts_us"].as_i64().context("no ts_us in fakellm's log")?;
        let done = finished
            .iter()
            .find(|f| f["seq"] == r["seq"])
            .and_then(|f| f["ts_us"].as_i64())
            .with_context(|| format!("model call {} of {turn} never finished", r["seq"]))?;
        calls.push((at, done));
    }
    ensure!(!calls.is_empty(), "{turn} made no model call");
    Ok(calls)
}

/// One turn's segments, in microseconds.
#[derive(Debug, Clone, Copy, Default)]
struct Split {
    /// (a) request → agent started (the CLI running, or the call made).
    ours_before: i64,
    /// Agent started → first model call.
    agent_before: i64,
    /// Sum of the model's answers.
    model: i64,
    /// Between the model's answers (agent and proxy).
    between: i64,
    /// Last answer → agent done (CLI exit, or the call returned).
    agent_after: i64,
    /// (b) agent done → response received.
    ours_after: i64,
    total: i64,
}

async fn one_turn(
    bb: &BlackboxProcess,
    fake: &FakeLlm,
    stamps: Option<&Path>,
    turn: &str,
) -> Result<Split> {
    let body = json!({"turn_id": turn, "messages": user("Say ok.")});
    let sent = now_us();
    let r = bb.post("/v1/sessions/bench/messages", &body).await;
    let answered = now_us();
    ensure!(r.status == 200, "{turn}: {r}");
    let started = server_stamp(bb, "agent call started", turn).await?;
    let returned = server_stamp(bb, "agent call returned", turn).await?;
    let (agent_start, agent_done) = match stamps {
        Some(s) => last_stamps(s)?,
        None => (started, returned),
    };
    let calls = model_calls(fake, turn)?;
    let (first, _) = calls[0];
    let last_done = calls.iter().map(|c| c.1).max().unwrap_or(first);
    let model: i64 = calls.iter().map(|(a, d)| d - a).sum();
    Ok(Split {
        ours_before: agent_start - sent,
        agent_before: first - agent_start,
        model,
        between: last_done - first - model,
        agent_after: agent_done - last_done,
        ours_after: answered - agent_done,
        total: answered - sent,
    })
}

/// How long the stamping wrapper takes to its first stamp: spawned from here, around `true`.
fn wrapper_start_cost(runs: usize) -> Result<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    let stamps = dir.path().join("stamps");
    let w = wrapper(dir.path(), Path::new("/bin/true"), &stamps)?;
    let mut costs = Vec::new();
    for _ in 0..runs {
        let before = now_us();
        let status = std::process::Command::new(&w).status()?;
        ensure!(status.success(), "the wrapper failed");
        costs.push(last_stamps(&stamps)?.0 - before);
    }
    Ok(p50_p99(costs))
}

fn p50_p99(mut v: Vec<i64>) -> (f64, f64) {
    v.sort_unstable();
    let at = |q: f64| {
        let i = ((v.len() as f64 - 1.0) * q).round() as usize;
        v.get(i).map_or(0.0, |us| *us as f64 / 1000.0)
    };
    (at(0.50), at(0.99))
}

/// opencode's health answer time, timed from here: the server asks it before every turn, so
/// it is inside (a) for opencode.
async fn opencode_health(runtime_dir: &str, runs: usize) -> Result<(f64, f64)> {
    let port = std::fs::read_to_string(Path::new(runtime_dir).join("run/opencode.port"))?;
    let url = format!("http://127.0.0.1:{}/global/health", port.trim());
    let http = reqwest::Client::new();
    let mut took = Vec::new();
    for _ in 0..runs {
        let before = now_us();
        let r = http.get(&url).send().await?;
        ensure!(r.status().is_success(), "opencode health: {}", r.status());
        r.bytes().await?;
        took.push(now_us() - before);
    }
    Ok(p50_p99(took))
}

/// The turns' splits, and for opencode its health answer time.
async fn bench_backend(b: &Backend, turns: usize) -> Result<(Vec<Split>, Option<(f64, f64)>)> {
    let fake = FakeLlm::scripted(&json!({
        "fallback": {"text": "ok", "usage": {"input_tokens": 100, "output_tokens": 1}}
    }))?;
    let bb = BlackboxProcess::start(&[("RUST_LOG", "warn,agentbox_blackbox::server=debug")])?;
    let dir = tempfile::tempdir()?;
    let stamps = dir.path().join("stamps");
    let mut options = json!({});
    if let Some(cli) = b.cli {
        options["executable"] = json!(wrapper(dir.path(), &client_bin(cli)?, &stamps)?);
    }
    let reg = match b.kind {
        "opencode" => opencode_registration(&fake.base_url(), "bench", &json!({})),
        kind => registration(kind, options, &fake.base_url(), "bench", &json!({})),
    };
    let r = bb.post("/v1/rollout/register", &reg).await;
    ensure!(
        r.status == 200,
        "register {}: {r}\n{}",
        b.kind,
        bb.describe()
    );
    let stamps = b.cli.map(|_| stamps.as_path());
    let mut splits = Vec::new();
    for i in 0..WARMUP + turns {
        let turn = format!("bench-turn-{i:04}");
        let s = one_turn(&bb, &fake, stamps, &turn)
            .await
            .with_context(|| format!("{} {turn}", b.kind))?;
        if i >= WARMUP {
            splits.push(s);
        }
    }
    let health = match b.kind {
        "opencode" => {
            let dir = r.body["binding"]["runtime_dir"]
                .as_str()
                .context("no runtime_dir")?;
            Some(opencode_health(dir, turns).await?)
        }
        _ => None,
    };
    Ok((splits, health))
}

fn cell(splits: &[Split], f: fn(&Split) -> i64) -> String {
    let (p50, p99) = p50_p99(splits.iter().map(f).collect());
    format!("{p50:.1} / {p99:.1}")
}

/// Runs `bench turns` (`quick`: fewer turns).
pub async fn bench_turns(quick: bool) -> Result<()> {
    // Build before timing anything.
    workspace_bin("agentbox-blackbox", "blackbox-server")?;
    let turns = if quick { QUICK_TURNS } else { TURNS };
    let (w50, w99) = wrapper_start_cost(20)?;
    println!("\n### Turn latency per backend ({turns} turns each after {WARMUP} warm-up)\n");
    println!(
        "p50 / p99 in ms. (a) and (b) are the server's; the agent and model columns are theirs.\n"
    );
    println!(
        "| backend | (a) request → agent started | agent start → 1st model call | model: 1st call → last answer sent | agent: last answer → done | (b) agent done → response | whole turn |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut notes = Vec::new();
    for b in &BACKENDS {
        let (splits, health) = bench_backend(b, turns).await?;
        if let Some((h50, h99)) = health {
            notes.push(format!(
                "{}'s `GET /global/health`, which the server awaits before every turn, answers in \
                 {h50:.1} / {h99:.1} ms (timed from the bench): that much of its (a) is the agent's \
                 answer time.",
                b.kind
            ));
        }
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            b.kind,
            cell(&splits, |s| s.ours_before),
            cell(&splits, |s| s.agent_before),
            cell(&splits, |s| s.model + s.between),
            cell(&splits, |s| s.agent_after),
            cell(&splits, |s| s.ours_after),
            cell(&splits, |s| s.total),
        );
    }
    println!(
        "\nThe stamping wrapper's own start (bash, spawn → first stamp) is {w50:.1} / {w99:.1} ms; \
         it is inside (a) for claude_code and codex."
    );
    for n in notes {
        println!("{n}");
    }
    Ok(())
}
