//! Soak: the daemons under sustained load, as separate processes on their real sockets, with
//! fakellm scripted to exact usage.
//!
//! - 64 tasks send requests concurrently through the gateway and the bridge (half to an
//!   Anthropic provider, passed through; half to an OpenAI one, translated), streamed and not,
//!   mostly small requests with every eighth the 100 KB Claude-Code-shaped one: after a
//!   warm-up each daemon's resident memory stays flat, its descriptors come back to the
//!   baseline once the load stops (after the upstream pool's idle timeout), and each task's
//!   meter equals, to the token, what fakellm served for that task.
//! - Many turns through one blackbox-server (opencode, see [`blackbox_turns`]) with retries and
//!   cancels: every turn ends as expected, the proxy's counts match fakellm's log, and no
//!   process is left after the server stops.
//!
//! CI runs the short form (40 s of load, 100 turns); `AGENTBOX_SOAK=full` runs the long form
//! (10 minutes, 1,000 turns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use agentbox_tests::harness::{
    BlackboxProcess, BridgeProcess, FakeLlm, GatewayProcess, anthropic_text, is_alive, last_text,
    open_fds, opencode_registration, settled, status_kib, unix_request, user,
};
use agentbox_tests::workload::claude_code_request;
use serde_json::{Value, json};

const TASKS: usize = 64;
const TOKEN: &str = "soak-task-token-0123456789";
const BRIDGE_TOKEN: &str = "soak-bridge-token-0123456789";

/// Whether the long form was asked for.
fn full() -> bool {
    std::env::var("AGENTBOX_SOAK").is_ok_and(|v| v == "full")
}

/// The marker fakellm tells the tasks' requests apart by (zero-padded: no marker is a prefix
/// of another).
fn marker(task: usize) -> String {
    format!("soak-task-{task:03}|")
}

/// Task `task`'s model: even tasks an Anthropic provider, odd ones an OpenAI one.
fn model(task: usize) -> &'static str {
    if task.is_multiple_of(2) {
        "claude"
    } else {
        "gpt"
    }
}

/// The usage fakellm reports for each answer to task `task`, in Anthropic terms, as the
/// gateway must meter it. OpenAI has no cache-creation count (it would fold into the prompt
/// tokens), so the translated tasks report none.
fn usage(task: usize) -> [u64; 4] {
    let t = task as u64;
    let creation = if task.is_multiple_of(2) { 3 + t % 5 } else { 0 };
    [100 + t, 7 + t % 13, 11 * (t % 4), creation]
}

/// One rule per task answering with its usage; text long enough for a few dozen stream
/// frames, a little slow so that many streams are open at once.
fn soak_script() -> Value {
    let rules: Vec<Value> = (0..TASKS)
        .map(|t| {
            let [i, o, cr, cc] = usage(t);
            json!({
                "match": {"body_contains": marker(t)},
                "text": format!("answer for {} ", marker(t)).repeat(8),
                "usage": {"input_tokens": i, "output_tokens": o,
                          "cache_read_input_tokens": cr, "cache_creation_input_tokens": cc},
                "event_delay_ms": 2
            })
        })
        .collect();
    json!({"rules": rules})
}

/// A small Claude-Code-like request, or (`big`) the 100 KB one, carrying `task`'s marker.
fn soak_request(task: usize, stream: bool, big: bool) -> Value {
    let mut body = if big {
        claude_code_request("claude-sonnet-4-5", stream)
    } else {
        json!({
            "model": "claude-sonnet-4-5",
            "max_tokens": 4096,
            "stream": stream,
            "system": [{"type": "text", "text": "You are a coding agent."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "go"}]}],
            "tools": [{"name": "Write", "input_schema": {"type": "object"}}]
        })
    };
    let first = &mut body["messages"][0]["content"];
    let n = first.as_array().map_or(0, Vec::len);
    first[n - 1]["text"] = Value::String(format!("{} please continue", marker(task)));
    body
}

/// One task's loop: requests until `stop`, each checked whole; how many succeeded.
async fn task_loop(gw: Arc<GatewayProcess>, task: usize, stop: Arc<AtomicBool>) -> u64 {
    let sock = gw.task_socket(&format!("soak{task:03}"));
    let auth = format!("Bearer {TOKEN}");
    let want = format!("answer for {} ", marker(task)).repeat(8);
    let mut done = 0_u64;
    while !stop.load(Ordering::Relaxed) {
        let stream = (done + task as u64).is_multiple_of(2);
        let big = (done + task as u64) % 8 == 3;
        let body = soak_request(task, stream, big).to_string();
        let r = unix_request(
            &sock,
            "POST",
            "/v1/messages",
            &[
                ("content-type", "application/json"),
                ("anthropic-version", "2023-06-01"),
                ("authorization", &auth),
            ],
            body,
        )
        .await
        .unwrap_or_else(|e| panic!("task {task} request {done}: {e}"));
        assert_eq!(
            r.status,
            200,
            "task {task} request {done}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let text = anthropic_text(&String::from_utf8_lossy(&r.body));
        assert_eq!(
            text.as_deref(),
            Some(want.as_str()),
            "task {task} request {done} (stream {stream}): {}",
            String::from_utf8_lossy(&r.body)
        );
        done += 1;
    }
    done
}

/// Resident memory (KiB) of each watched process, sampled every 250 ms.
struct RssSamples {
    samples: std::sync::Mutex<Vec<(Duration, Vec<u64>)>>,
}

impl RssSamples {
    /// The largest sample of process `i` taken in `[from, to)` after the start.
    fn max_between(&self, i: usize, from: Duration, to: Duration) -> u64 {
        let s = self.samples.lock().unwrap();
        s.iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .filter_map(|(_, v)| v.get(i).copied())
            .max()
            .unwrap_or(0)
    }
}

fn sample_rss(pids: Vec<u32>, stop: Arc<AtomicBool>) -> Arc<RssSamples> {
    let out = Arc::new(RssSamples {
        samples: std::sync::Mutex::new(Vec::new()),
    });
    let samples = Arc::clone(&out);
    std::thread::spawn(move || {
        let start = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let row = pids
                .iter()
                .map(|p| status_kib(*p, "VmRSS:").unwrap_or(0))
                .collect();
            samples.samples.lock().unwrap().push((start.elapsed(), row));
            std::thread::sleep(Duration::from_millis(250));
        }
    });
    out
}

/// How much a daemon's resident memory may grow between the window right after the warm-up
/// and the last one. Allocator arenas settle during the warm-up; a leak of even a few hundred
/// bytes per request (tens of thousands of requests in the long form) exceeds it.
const RSS_GROWTH_KIB: u64 = 8 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_tasks_through_gateway_and_bridge_stay_flat_and_meter_exactly() {
    let load = if full() {
        Duration::from_secs(600)
    } else {
        Duration::from_secs(40)
    };
    let fake = FakeLlm::scripted(&soak_script()).unwrap();
    let keys = [
        ("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN),
        ("SOAK_ANTHROPIC_KEY", "sk-ant-soak"),
        ("SOAK_OPENAI_KEY", "sk-openai-soak"),
    ];
    let bridge = BridgeProcess::start(
        &format!(
            "[bridge]\nlisten = \"127.0.0.1:0\"\n{}",
            fake.remote_models("SOAK_ANTHROPIC_KEY", "SOAK_OPENAI_KEY")
        ),
        &keys,
    )
    .unwrap();
    let gw = GatewayProcess::start(
        &format!(
            "[gateway]\nbridge_url = \"{}\"\n{}",
            bridge.base_url(),
            fake.remote_models("SOAK_ANTHROPIC_KEY", "SOAK_OPENAI_KEY")
        ),
        &[("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)],
    )
    .unwrap();
    for t in 0..TASKS {
        let r = gw
            .open_task(&format!("soak{t:03}"), model(t), TOKEN, json!({}))
            .await
            .unwrap();
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let daemons = [("gateway", gw.pid()), ("bridge", bridge.pid())];
    let fds_before: Vec<usize> = daemons.iter().map(|(_, p)| open_fds(*p)).collect();

    let gw = Arc::new(gw);
    let stop = Arc::new(AtomicBool::new(false));
    let sampling = Arc::new(AtomicBool::new(false));
    let rss = sample_rss(
        daemons.iter().map(|(_, p)| *p).collect(),
        Arc::clone(&sampling),
    );
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| tokio::spawn(task_loop(Arc::clone(&gw), t, Arc::clone(&stop))))
        .collect();
    tokio::time::sleep(load).await;
    stop.store(true, Ordering::Relaxed);
    let mut sent = Vec::with_capacity(TASKS);
    for t in tasks {
        sent.push(t.await.unwrap());
    }
    let elapsed = started.elapsed();
    sampling.store(true, Ordering::Relaxed);

    // Meters equal fakellm's totals, per task and to the token.
    let log = fake.requests().unwrap();
    let mut served = [0_u64; TASKS];
    for r in &log {
        let body = r["body"].to_string();
        let t = (0..TASKS)
            .find(|t| body.contains(&marker(*t)))
            .unwrap_or_else(|| panic!("a request no task sent: {}", r["path"]));
        assert!(
            r["served_by"].as_str().unwrap().starts_with("rule"),
            "{}",
            r["served_by"]
        );
        served[t] += 1;
    }
    let total: u64 = sent.iter().sum();
    eprintln!(
        "soak: {total} requests by {TASKS} tasks in {elapsed:?}; fakellm served {}",
        log.len()
    );
    for (t, (&n, &asked)) in served.iter().zip(&sent).enumerate() {
        assert_eq!(n, asked, "task {t}: fakellm served what it sent");
        let view = gw.task(&format!("soak{t:03}")).await.unwrap();
        let [i, o, cr, cc] = usage(t).map(|u| u * n);
        let expected = json!({
            "input_tokens": i, "output_tokens": o,
            "cache_read_input_tokens": cr, "cache_creation_input_tokens": cc,
            "total_tokens": i + o + cr + cc, "requests": n, "cost_usd": 0.0
        });
        assert_eq!(view["usage"], expected, "task {t}");
        assert_eq!(view["in_flight"], 0, "task {t}");
    }

    // Flat memory after the warm-up: the first fifth of the load.
    let warm = load / 5;
    for (i, (name, _)) in daemons.iter().enumerate() {
        let after_warmup = rss.max_between(i, warm, warm * 2);
        let last = rss.max_between(i, elapsed - warm, elapsed);
        eprintln!("soak: {name} RSS after warm-up {after_warmup} KiB, at the end {last} KiB");
        assert!(after_warmup > 0 && last > 0, "{name}: no RSS samples");
        assert!(
            last <= after_warmup + RSS_GROWTH_KIB,
            "{name}: RSS grew from {after_warmup} KiB after the warm-up to {last} KiB"
        );
    }

    // Descriptors back to the baseline once the pooled upstream connections idle out (the
    // engine keeps them 60 s; hyper reaps them on its next idle sweep).
    let deadline = Instant::now() + Duration::from_secs(180);
    for (i, (name, pid)) in daemons.iter().enumerate() {
        loop {
            let now = open_fds(*pid);
            if now <= fds_before[i] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{name}: {now} descriptors open, {} before the load",
                fds_before[i]
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    drop(bridge);
}

/// Turns per session of the blackbox soak: a fresh session (a rebind, which restarts opencode)
/// after this many, so the agent's history, and each model call, stays small.
const SESSION_TURNS: usize = 50;

/// The usage fakellm reports for every answer of the blackbox soak.
const TURN_USAGE: (u64, u64) = (11, 3);

/// What the soak does with turn `k`: every tenth is cancelled in flight, every seventh of the
/// others is submitted again with the same id and messages (a retry, answered from the ledger).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum TurnKind {
    Plain,
    Retried,
    Cancelled,
}

fn turn_kind(k: usize) -> TurnKind {
    if k % 10 == 9 {
        TurnKind::Cancelled
    } else if k % 7 == 3 {
        TurnKind::Retried
    } else {
        TurnKind::Plain
    }
}

/// A marker for turn `k`'s user message (zero-padded: none is a prefix of another).
fn turn_marker(k: usize) -> String {
    format!("soak-turn-{k:05}|")
}

/// Many turns through one blackbox-server with the real opencode: plain turns, retries (same
/// turn_id and messages: replayed from the ledger, no model call) and cancels (a model call
/// held by fakellm, then `cancel`). Opencode because it is the cheapest real backend per turn:
/// one long-running server, so a turn is an HTTP exchange with no process start (Claude Code
/// and Codex start a CLI per turn, seconds each under load); a stand-in CLI would not soak the
/// real agent's session handling.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blackbox_turns_with_retries_and_cancels_keep_a_consistent_ledger() {
    let turns = if full() { 1000 } else { 100 };
    let usage = json!({"input_tokens": TURN_USAGE.0, "output_tokens": TURN_USAGE.1});
    // Cancelled turns' model calls are held (once each: the marker stays in later histories).
    let mut rules: Vec<Value> = (0..turns)
        .filter(|k| turn_kind(*k) == TurnKind::Cancelled)
        .map(|k| {
            json!({"match": {"body_contains": turn_marker(k), "has_tools": true}, "times": 1,
                   "text": "too late", "usage": usage, "delay_ms": 600_000})
        })
        .collect();
    rules.push(json!({"match": {"has_tools": false}, "text": "title", "usage": usage}));
    let fake = FakeLlm::scripted(&json!({
        "rules": rules,
        "fallback": {"text": "ok", "usage": usage}
    }))
    .unwrap();
    let mut bb = BlackboxProcess::start(&[]).unwrap();
    let started = Instant::now();
    let mut expected: Vec<(String, String, TurnKind)> = Vec::new();
    for k in 0..turns {
        let session = format!("soak-s{:03}", k / SESSION_TURNS);
        if k % SESSION_TURNS == 0 {
            if k > 0 {
                let prev = format!("soak-s{:03}", k / SESSION_TURNS - 1);
                check_ledger(&bb, &fake, &prev, &expected).await;
                let r = bb.post_empty(&format!("/v1/sessions/{prev}/abort")).await;
                assert_eq!(r.status, 200, "{r}");
            }
            let reg = opencode_registration(&fake.base_url(), &session, &json!({}));
            let r = bb.post("/v1/rollout/register", &reg).await;
            assert_eq!(r.status, 200, "{r}\n{}", bb.diag(&fake));
        }
        let turn_id = format!("turn-{k:05}");
        let kind = turn_kind(k);
        let body = json!({"turn_id": turn_id, "messages": user(&turn_marker(k))});
        match kind {
            TurnKind::Plain | TurnKind::Retried => {
                let r = bb.turn(&session, &body).await;
                assert_eq!(r.status, 200, "turn {k}: {r}\n{}", bb.diag(&fake));
                assert_eq!(last_text(&r.body["outputs"]), "ok", "turn {k}: {r}");
                if kind == TurnKind::Retried {
                    let path = format!("/v1/sessions/{session}/messages");
                    bb.assert_replay(&fake, &path, &body, &r.body).await;
                }
            }
            TurnKind::Cancelled => {
                let mut submit = body.clone();
                submit["mode"] = json!("async");
                let r = bb.turn(&session, &submit).await;
                assert_eq!(r.status, 202, "turn {k}: {r}");
                let marker = turn_marker(k);
                bb.wait_for(
                    "the held call never came",
                    &fake,
                    Duration::from_secs(120),
                    || {
                        fake.chat_requests().unwrap().iter().any(|r| {
                            r["headers"]["x-turn-id"] == turn_id.as_str()
                                && r["body"].to_string().contains(&marker)
                        })
                    },
                )
                .await;
                let c = bb
                    .post_empty(&format!("/v1/sessions/{session}/turns/{turn_id}/cancel"))
                    .await;
                assert_eq!(c.status, 200, "turn {k}: {c}");
                let ended = bb.poll_turn(&session, &turn_id, 5, settled).await;
                assert_eq!(ended["status"], "cancelled", "turn {k}: {ended}");
            }
        }
        expected.push((session, turn_id, kind));
    }
    let last = expected.last().map(|(s, _, _)| s.clone()).unwrap();
    check_ledger(&bb, &fake, &last, &expected).await;
    eprintln!("soak: {turns} blackbox turns in {:?}", started.elapsed());

    // Stopped, the server leaves no process behind: none of its descendants, no opencode.
    let descendants = agentbox_sandbox::proc::descendants(bb.pid());
    assert!(!descendants.is_empty(), "opencode runs under the server");
    bb.terminate(Duration::from_secs(60)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left: Vec<u32> = descendants
            .iter()
            .copied()
            .filter(|p| is_alive(*p))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left after the server stopped: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Session `session`'s ledger against what the soak did and what fakellm saw: every turn in
/// it, in the state its kind calls for; a completed turn's steps and tokens equal the model
/// calls fakellm logged for it (a retry added none).
async fn check_ledger(
    bb: &BlackboxProcess,
    fake: &FakeLlm,
    session: &str,
    expected: &[(String, String, TurnKind)],
) {
    let r = bb
        .get(&format!("/v1/sessions/{session}?include_turns=true"))
        .await;
    assert_eq!(r.status, 200, "{r}");
    let ledger = r.body["turn_ledger"].as_object().unwrap();
    let mine: Vec<_> = expected.iter().filter(|(s, _, _)| s == session).collect();
    assert_eq!(ledger.len(), mine.len(), "{session}: {:?}", ledger.keys());
    let calls = fake.chat_requests().unwrap();
    let completed = mine
        .iter()
        .filter(|(_, _, k)| *k != TurnKind::Cancelled)
        .count();
    assert_eq!(r.body["turn_count"], completed as u64, "{session}");
    for (_, turn_id, kind) in mine {
        let rec = &ledger[turn_id.as_str()];
        let logged = calls
            .iter()
            .filter(|c| {
                c["headers"]["x-session-id"] == session
                    && c["headers"]["x-turn-id"] == turn_id.as_str()
            })
            .count() as u64;
        match kind {
            TurnKind::Cancelled => {
                assert_eq!(rec["status"], "cancelled", "{turn_id}: {rec}");
                assert!(logged >= 1, "{turn_id}: its model call");
            }
            TurnKind::Plain | TurnKind::Retried => {
                assert_eq!(rec["status"], "committed", "{turn_id}: {rec}");
                let u = &rec["response"]["usage"];
                assert_eq!(u["steps"], logged, "{turn_id}: steps vs fakellm: {rec}");
                assert_eq!(u["input_tokens"], logged * TURN_USAGE.0, "{turn_id}: {rec}");
                assert_eq!(
                    u["output_tokens"],
                    logged * TURN_USAGE.1,
                    "{turn_id}: {rec}"
                );
            }
        }
    }
}
