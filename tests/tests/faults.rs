//! Faults: the model misbehaving (through the gateway and the bridge, as processes on their
//! real sockets) and our daemons killed with SIGKILL in the middle of streams.
//!
//! - Every fakellm fault (5xx, 429 with `retry-after`, a disconnect mid-stream, a slow drip,
//!   garbage SSE, a 1 GiB answer streamed and whole) gets its documented answer
//!   (`llm/src/error.rs`, `llm/src/body.rs`, `gateway/src/account.rs`), billed as documented,
//!   while another task's request is served meanwhile.
//! - The gateway killed mid-stream: what was settled and written survives, the streams in
//!   flight are not billed twice (nor at all: see `gateway/src/store.rs`), budgets still hold,
//!   every task answers again on its old socket.
//! - The gateway stopped (SIGTERM) with a stream outliving the drain's grace: that stream is
//!   ended and billed in the last save.
//! - The bridge killed mid-stream: the gateway ends the streams with an error event, bills each
//!   once for what it metered, and serves again once the bridge is back.
//! - blackbox-server killed mid-turn: no process of its agent (opencode, its tools) is left.
//!
//! The launcher killed with its sandboxes running is `launcher_agents.rs`
//! (`a_crashed_launcher_leaves_nothing_running_after_restart`: SIGKILL to the launcher alone,
//! the restart kills the sandbox and reports the run `lost`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use agentbox_tests::harness::{
    BlackboxProcess, BridgeProcess, FakeLlm, GatewayProcess, HarnessError, UnixResponse,
    anthropic_text, is_alive, opencode_registration, parse_sse, processes_with, status_kib,
    unix_request, user,
};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "faults-task-token-0123456789";
const BRIDGE_TOKEN: &str = "faults-bridge-token-0123456789";

/// A bridge (an Anthropic provider passed through, an OpenAI one translated) in front of
/// fakellm, and a gateway in front of the bridge.
fn chain(fake: &FakeLlm) -> (BridgeProcess, GatewayProcess) {
    let models = fake.remote_models("FAULTS_ANTHROPIC_KEY", "FAULTS_OPENAI_KEY");
    let bridge = BridgeProcess::start(
        &format!("[bridge]\nlisten = \"127.0.0.1:0\"\n{models}"),
        &[
            ("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN),
            ("FAULTS_ANTHROPIC_KEY", "sk-ant-faults"),
            ("FAULTS_OPENAI_KEY", "sk-openai-faults"),
        ],
    )
    .unwrap();
    let gw = GatewayProcess::start(
        &format!(
            "[gateway]\nbridge_url = \"{}\"\n{models}",
            bridge.base_url()
        ),
        &[("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)],
    )
    .unwrap();
    (bridge, gw)
}

async fn open(gw: &GatewayProcess, tid: &str, model: &str, budget: Value) {
    let r = gw.open_task(tid, model, TOKEN, budget).await.unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
}

/// A small Claude-Code-like request whose user text is `marker` (what fakellm's rules match).
fn request(marker: &str, stream: bool) -> String {
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 1000,
        "stream": stream,
        "system": [{"type": "text", "text": "You are a coding agent."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": marker}]}],
        "tools": [{"name": "Write", "input_schema": {"type": "object"}}]
    })
    .to_string()
}

const HEADERS: [(&str, &str); 3] = [
    ("content-type", "application/json"),
    ("anthropic-version", "2023-06-01"),
    ("authorization", "Bearer faults-task-token-0123456789"),
];

/// One request on task `tid`'s socket, read whole.
async fn send(gw: &GatewayProcess, tid: &str, marker: &str, stream: bool) -> UnixResponse {
    unix_request(
        &gw.task_socket(tid),
        "POST",
        "/v1/messages",
        &HEADERS,
        request(marker, stream),
    )
    .await
    .unwrap_or_else(|e| panic!("{tid} {marker}: {e}"))
}

/// The `event:` names of a streamed answer.
fn events(r: &UnixResponse) -> Vec<String> {
    parse_sse(&r.text())
        .into_iter()
        .filter_map(|f| f.event)
        .collect()
}

fn error_type(r: &UnixResponse) -> String {
    let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    v["error"]["type"].as_str().unwrap_or("").to_owned()
}

/// The healthy task's answer: a complete message with the scripted text.
async fn healthy(gw: &GatewayProcess, n: usize) {
    let r = send(gw, "ok", &format!("healthy-{n}"), n.is_multiple_of(2)).await;
    assert_eq!(r.status, 200, "healthy {n}: {}", r.text());
    assert_eq!(
        anthropic_text(&r.text()).as_deref(),
        Some("all is well"),
        "healthy {n}: {}",
        r.text()
    );
}

/// A streamed request read as it arrives and thrown away (a 1 GiB answer must not be held by
/// the test either): the status line, how many body bytes came, and the last 4 KiB.
async fn send_discarding(sock: &Path, body: &str) -> (String, u64, String) {
    let mut s = tokio::net::UnixStream::connect(sock).await.unwrap();
    let mut head = format!(
        "POST /v1/messages HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in HEADERS {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    let mut buf = vec![0_u8; 1 << 16];
    let mut first = Vec::new();
    let mut tail: Vec<u8> = Vec::new();
    let mut total = 0_u64;
    loop {
        let n = s.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        total += n as u64;
        if first.len() < 256 {
            first.extend_from_slice(chunk);
        }
        tail.extend_from_slice(chunk);
        if tail.len() > 8192 {
            tail.drain(..tail.len() - 4096);
        }
    }
    let first = String::from_utf8_lossy(&first);
    let status = first.lines().next().unwrap_or("").to_owned();
    (status, total, String::from_utf8_lossy(&tail).into_owned())
}

/// Each model fault, on both providers, gives the documented answer and bill while another
/// task is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn model_faults_get_the_documented_answers_while_other_tasks_are_served() {
    const GIB: u64 = 1 << 30;
    let usage = json!({"input_tokens": 70, "output_tokens": 40});
    let fake = FakeLlm::scripted(&json!({"rules": [
        {"match": {"body_contains": "healthy-"}, "text": "all is well", "usage": {"input_tokens": 5, "output_tokens": 2}},
        {"match": {"body_contains": "fault-5xx"}, "error": {"status": 503}},
        {"match": {"body_contains": "fault-429"}, "error": {"status": 429}, "headers": {"retry-after": "7"}},
        {"match": {"body_contains": "fault-disconnect"}, "text": "cut short by the model",
         "usage": usage, "disconnect_after_events": 4},
        {"match": {"body_contains": "fault-drip"}, "text": "one drop at a time, slowly",
         "usage": usage, "event_delay_ms": 700},
        {"match": {"body_contains": "fault-garbage"}, "text": "then nonsense",
         "usage": usage, "garbage_after_events": 4},
        {"match": {"body_contains": "fault-huge"}, "huge_text_bytes": GIB, "usage": usage}
    ]}))
    .unwrap();
    let (bridge, gw) = chain(&fake);
    open(&gw, "ok", "claude", json!({})).await;
    let mut n = 0;
    for model in ["claude", "gpt"] {
        let tid = format!("f-{model}");
        open(&gw, &tid, model, json!({})).await;
        let usage_of = async |gw: &GatewayProcess| gw.task(&tid).await.unwrap()["usage"].clone();

        // Upstream errors: no bill. 5xx: Anthropic-shaped keeps its status, else 502.
        for (marker, stream, status, kind) in [
            (
                "fault-5xx",
                false,
                if model == "claude" { 503 } else { 502 },
                "api_error",
            ),
            (
                "fault-5xx",
                true,
                if model == "claude" { 503 } else { 502 },
                "api_error",
            ),
            ("fault-429", true, 429, "rate_limit_error"),
        ] {
            let (r, ()) = tokio::join!(send(&gw, &tid, marker, stream), healthy(&gw, n));
            n += 1;
            assert_eq!(r.status, status, "{model} {marker}: {}", r.text());
            assert_eq!(error_type(&r), kind, "{model} {marker}: {}", r.text());
            if marker == "fault-429" {
                assert_eq!(r.headers.get("retry-after").map(String::as_str), Some("7"));
            }
            assert_eq!(usage_of(&gw).await["total_tokens"], 0, "{model} {marker}");
        }

        // A stream broken by the model (cut, or garbage): a 200 ending in an `error` event,
        // never a `message_stop`; billed once, for what was metered.
        for marker in ["fault-disconnect", "fault-garbage"] {
            let before = usage_of(&gw).await;
            let (r, ()) = tokio::join!(send(&gw, &tid, marker, true), healthy(&gw, n));
            n += 1;
            assert_eq!(r.status, 200, "{model} {marker}");
            let ev = events(&r);
            assert_eq!(
                ev.last().map(String::as_str),
                Some("error"),
                "{model} {marker}: {ev:?}"
            );
            assert!(
                !ev.iter().any(|e| e == "message_stop"),
                "{model} {marker}: {ev:?}"
            );
            let after = usage_of(&gw).await;
            let requests =
                after["requests"].as_u64().unwrap() - before["requests"].as_u64().unwrap();
            assert_eq!(requests, 1, "{model} {marker}: billed once");
            let input =
                after["input_tokens"].as_u64().unwrap() - before["input_tokens"].as_u64().unwrap();
            if model == "claude" {
                assert_eq!(
                    input, 70,
                    "{model} {marker}: message_start's input is billed"
                );
            } else {
                assert!(input >= 1, "{model} {marker}: the input estimate is billed");
            }
            let output = after["output_tokens"].as_u64().unwrap()
                - before["output_tokens"].as_u64().unwrap();
            assert!(
                (1..=40).contains(&output),
                "{model} {marker}: output {output}"
            );
        }

        // A slow drip is a good answer, delivered whole; meanwhile other tasks are served.
        let before = usage_of(&gw).await["total_tokens"].as_u64().unwrap();
        let drip = send(&gw, &tid, "fault-drip", true);
        let others = async {
            for _ in 0..3 {
                healthy(&gw, n).await;
            }
            Instant::now()
        };
        let (r, others_done) = tokio::join!(
            async {
                let r = drip.await;
                (r, Instant::now())
            },
            others
        );
        let (r, drip_done) = r;
        assert_eq!(r.status, 200);
        assert_eq!(
            events(&r).last().map(String::as_str),
            Some("message_stop"),
            "{model} drip"
        );
        assert!(
            others_done < drip_done,
            "{model}: the others waited for the drip"
        );
        let after = usage_of(&gw).await["total_tokens"].as_u64().unwrap();
        assert_eq!(after - before, 110, "{model} drip: billed exactly");

        // 1 GiB streamed: passed through to the end (a model may talk long), billed exactly,
        // and no daemon holds it: their peak memory stays far below it.
        let before = usage_of(&gw).await["total_tokens"].as_u64().unwrap();
        let sock = gw.task_socket(&tid);
        let huge = request("fault-huge", true);
        let (got, ()) = tokio::join!(send_discarding(&sock, &huge), healthy(&gw, n));
        n += 1;
        let (status, bytes, tail) = got;
        assert!(status.contains(" 200 "), "{model} huge stream: {status}");
        assert!(bytes > GIB, "{model} huge stream: {bytes} bytes");
        assert!(
            tail.contains("message_stop"),
            "{model} huge stream ends: {tail}"
        );
        let after = usage_of(&gw).await["total_tokens"].as_u64().unwrap();
        assert_eq!(after - before, 110, "{model} huge stream: billed exactly");
        // 1 GiB whole. Passed through (claude), it is streamed on as it comes, never held
        // (the meter copies at most `UsageMeter::MAX_JSON_BYTES`); translated (gpt), the
        // engine reads at most `MAX_ANSWER_BODY` and fails it. Either way the daemons' memory
        // stays far below it and the request settles.
        let whole = request("fault-huge", false);
        let (got, ()) = tokio::join!(send_discarding(&sock, &whole), healthy(&gw, n));
        n += 1;
        let (status, bytes, tail) = got;
        eprintln!(
            "{model} huge whole: {status}, {bytes} bytes, ends {}",
            &tail[tail.len().saturating_sub(300)..]
        );
        if model == "claude" {
            assert!(status.contains(" 200 "), "{model} huge whole: {status}");
            assert!(bytes > GIB, "{model} huge whole: {bytes} bytes");
        } else {
            assert!(bytes < GIB, "{model} huge whole: {bytes} bytes passed");
        }
        for (name, pid) in [("gateway", gw.pid()), ("bridge", bridge.pid())] {
            let peak = status_kib(pid, "VmHWM:").unwrap();
            assert!(
                peak < 256 << 10,
                "{name}: peak RSS {peak} KiB after 1 GiB answers"
            );
        }
        assert_eq!(gw.task(&tid).await.unwrap()["in_flight"], 0);
    }
    healthy(&gw, n).await;
}

/// fakellm answering `slow-` requests a frame a second (streams to be cut), the rest at once.
fn slow_script() -> Value {
    json!({"rules": [
        {"match": {"body_contains": "slow-"}, "text": "a long answer, word by word, that will be cut",
         "usage": {"input_tokens": 300, "output_tokens": 30}, "event_delay_ms": 1000},
        {"text": "quick", "usage": {"input_tokens": 20, "output_tokens": 3}}
    ]})
}

/// A slow stream on each of `tids`' sockets, in the background; returns once fakellm has
/// them all, so they are in flight.
async fn slow_streams(
    gw: &GatewayProcess,
    fake: &FakeLlm,
    tids: &[&str],
) -> Vec<tokio::task::JoinHandle<Result<UnixResponse, HarnessError>>> {
    let streams = tids
        .iter()
        .enumerate()
        .map(|(i, tid)| {
            let sock = gw.task_socket(tid);
            let body = request(&format!("slow-{i}"), true);
            tokio::spawn(async move {
                unix_request(&sock, "POST", "/v1/messages", &HEADERS, body).await
            })
        })
        .collect();
    wait_logged(fake, "slow-", tids.len()).await;
    streams
}

/// Waits until fakellm has logged `n` requests whose body contains `marker`.
async fn wait_logged(fake: &FakeLlm, marker: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let seen = fake
            .requests()
            .unwrap()
            .iter()
            .filter(|r| r["body"].to_string().contains(marker))
            .count();
        if seen >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{seen} of {n} {marker} requests reached fakellm"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn tokens(view: &Value) -> u64 {
    view["usage"]["total_tokens"].as_u64().unwrap()
}

/// The gateway killed with streams in flight: what was settled and written is kept exactly,
/// nothing is counted twice, a spent budget still refuses, every task answers again on its old
/// socket and is billed exactly from there on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gateway_killed_mid_stream_keeps_what_was_settled_and_enforces_budgets() {
    let fake = FakeLlm::scripted(&slow_script()).unwrap();
    let (_bridge, mut gw) = chain(&fake);
    open(&gw, "done", "claude", json!({})).await;
    open(&gw, "busy", "gpt", json!({})).await;
    open(&gw, "poor", "claude", json!({"tokens": 40})).await;
    for i in 0..3 {
        assert_eq!(
            send(&gw, "done", &format!("q{i}"), i % 2 == 0).await.status,
            200
        );
    }
    // 23 of 40 spent: one more request is admitted (nothing in flight), then none.
    assert_eq!(send(&gw, "poor", "q", true).await.status, 200);
    assert_eq!(send(&gw, "poor", "q", false).await.status, 200);
    assert_eq!(send(&gw, "poor", "q", false).await.status, 403);
    // Wait for the state writer to have the settled usage on disk (it runs after each
    // settlement); a crash before that loses it, as `gateway/src/store.rs` says.
    gw.saved_state_when("the settled usage of both tasks", |s| {
        s["tasks"]["done"]["spent"]["requests"] == 3 && s["tasks"]["poor"]["spent"]["requests"] == 2
    })
    .await
    .unwrap();
    let before_done = gw.task("done").await.unwrap();
    let before_poor = gw.task("poor").await.unwrap();

    // Streams in flight on "busy" when the gateway dies.
    let streams = slow_streams(&gw, &fake, &["busy"; 4]).await;
    gw.crash_and_restart().unwrap();
    for s in streams {
        // The connection died with the gateway: an error, or a cut 200 without message_stop.
        if let Ok(r) = s.await.unwrap() {
            assert!(
                !r.text().contains("message_stop"),
                "a stream outlived the gateway: {}",
                r.text()
            );
        }
    }

    // Settled and written: kept exactly. In flight: not billed (never twice).
    assert_eq!(
        gw.task("done").await.unwrap()["usage"],
        before_done["usage"]
    );
    assert_eq!(
        gw.task("poor").await.unwrap()["usage"],
        before_poor["usage"]
    );
    let busy = gw.task("busy").await.unwrap();
    assert!(
        tokens(&busy) <= 4 * 330,
        "busy billed more than was served: {busy}"
    );
    assert_eq!(busy["in_flight"], 0);
    // The budget still holds; the tasks answer on their old sockets, billed exactly.
    let r = send(&gw, "poor", "q", false).await;
    assert_eq!(r.status, 403, "{}", r.text());
    for tid in ["done", "busy"] {
        let before = tokens(&gw.task(tid).await.unwrap());
        let r = send(&gw, tid, "after", true).await;
        assert_eq!(r.status, 200, "{tid}: {}", r.text());
        assert_eq!(tokens(&gw.task(tid).await.unwrap()) - before, 23, "{tid}");
    }
}

/// SIGTERM with a stream still running when the drain's grace (10 s) is over: the gateway
/// ends it as it stops its event loops, and what that stream metered is in the state it saves
/// last. (The final save used to come before the event loops stopped, so such a stream,
/// billed by the upstream, was billed nowhere.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_outliving_the_stop_grace_is_billed_in_the_saved_state() {
    let fake = FakeLlm::scripted(&json!({"rules": [
        {"match": {"body_contains": "drain-"}, "text": "an answer that outlives the drain",
         "usage": {"input_tokens": 300, "output_tokens": 30}, "event_delay_ms": 3000}
    ]}))
    .unwrap();
    let (_bridge, mut gw) = chain(&fake);
    open(&gw, "long", "claude", json!({})).await;
    let sock = gw.task_socket("long");
    let stream = tokio::spawn(async move {
        unix_request(
            &sock,
            "POST",
            "/v1/messages",
            &HEADERS,
            request("drain-0", true),
        )
        .await
    });
    wait_logged(&fake, "drain-", 1).await;
    // Its `message_start` (the input's usage) has reached the meter.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(gw.task("long").await.unwrap()["in_flight"], 1);
    gw.restart_within(Duration::from_secs(60)).unwrap();
    if let Ok(r) = stream.await.unwrap() {
        assert!(
            !r.text().contains("message_stop"),
            "the stream was to outlive the grace: {}",
            r.text()
        );
    }
    let view = gw.task("long").await.unwrap();
    assert_eq!(view["usage"]["requests"], 1, "{view}");
    assert_eq!(view["usage"]["input_tokens"], 300, "{view}");
    assert!(
        view["usage"]["output_tokens"].as_u64().unwrap() >= 1,
        "{view}"
    );
    assert_eq!(view["in_flight"], 0, "{view}");
}

/// The bridge killed with streams in flight: the gateway ends each with an `error` event and
/// bills it once for what it metered; once the bridge is back (same address), requests pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bridge_killed_mid_stream_ends_streams_cleanly_and_serves_after_restart() {
    let fake = FakeLlm::scripted(&slow_script()).unwrap();
    let (mut bridge, gw) = chain(&fake);
    open(&gw, "ant", "claude", json!({})).await;
    open(&gw, "oai", "gpt", json!({})).await;
    let streams = slow_streams(&gw, &fake, &["ant", "oai", "ant", "oai"]).await;
    bridge.crash_and_restart().unwrap();
    for s in streams {
        let r = s.await.unwrap().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let ev = events(&r);
        assert_eq!(
            ev.last().map(String::as_str),
            Some("error"),
            "{ev:?}: {}",
            r.text()
        );
        assert!(!ev.iter().any(|e| e == "message_stop"), "{ev:?}");
    }
    for tid in ["ant", "oai"] {
        let v = gw.task(tid).await.unwrap();
        assert_eq!(v["in_flight"], 0, "{v}");
        assert_eq!(
            v["usage"]["requests"], 2,
            "each cut stream billed once: {v}"
        );
        assert!(tokens(&v) >= 2, "the cut streams are billed: {v}");
        assert!(v["usage"]["output_tokens"].as_u64().unwrap() <= 60, "{v}");
    }
    for tid in ["ant", "oai"] {
        let before = tokens(&gw.task(tid).await.unwrap());
        let r = send(&gw, tid, "after", true).await;
        assert_eq!(r.status, 200, "{tid}: {}", r.text());
        assert!(
            events(&r).iter().any(|e| e == "message_stop"),
            "{}",
            r.text()
        );
        assert_eq!(tokens(&gw.task(tid).await.unwrap()) - before, 23, "{tid}");
    }
}

/// blackbox-server killed with SIGKILL (the server alone, not its group) while opencode runs a
/// tool, then started again on the same runtime root: neither opencode nor the tool outlives
/// that, and the new server serves a new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blackbox_server_killed_mid_turn_leaves_no_process() {
    let marker = format!("timeout 4242.{} tail -f /dev/null", std::process::id());
    let fake = FakeLlm::scripted(&json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [{"match": {"has_tools": true},
                   "tool_calls": [{"id": "call_kill", "name": "bash",
                                   "input": {"command": marker, "description": "wait"}}]}],
        "fallback": {"text": "done"}
    }))
    .unwrap();
    let mut bb = BlackboxProcess::start(&[]).unwrap();
    let reg = opencode_registration(&fake.base_url(), "sess-kill", &json!({}));
    let r = bb.post("/v1/rollout/register", &reg).await;
    assert_eq!(r.status, 200, "{r}");
    let runtime = r.body["binding"]["runtime_dir"]
        .as_str()
        .unwrap()
        .to_owned();
    let submit = json!({"turn_id": "t1", "mode": "async", "messages": user("wait")});
    assert_eq!(bb.turn("sess-kill", &submit).await.status, 202);
    bb.wait_for(
        "the tool never ran",
        &fake,
        Duration::from_secs(120),
        || !processes_with(&marker).is_empty(),
    )
    .await;
    let agent = BlackboxProcess::opencode_pid(&runtime).expect("opencode pid");
    // The parent-death signal ends opencode; its tool is stopped by the restarted server
    // (blackbox/src/leftovers.rs).
    bb.crash_and_restart().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while is_alive(agent) || !processes_with(&marker).is_empty() {
        assert!(
            Instant::now() < deadline,
            "left after the server was killed and restarted: opencode {agent} alive: {}, its tool: {:?}\n{}",
            is_alive(agent),
            processes_with(&marker),
            bb.describe()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The restarted server serves a new session.
    let reg = opencode_registration(&fake.base_url(), "sess-next", &json!({}));
    let r = bb.post("/v1/rollout/register", &reg).await;
    assert_eq!(r.status, 200, "{r}");
    let r = bb
        .turn(
            "sess-next",
            &json!({"turn_id": "t1", "messages": user("hi")}),
        )
        .await;
    assert_eq!(r.status, 200, "{r}");
}
