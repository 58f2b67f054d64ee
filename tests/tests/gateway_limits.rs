//! One sandbox must not exhaust the gateway for the others: a task that opens thousands of
//! connections or floods its socket with large bodies is answered 429/503 itself, while
//! another task's requests keep succeeding, and the gateway's memory stays within what its
//! body budget allows. The real gateway process, the real unix sockets.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use agentbox_tests::harness::{GatewayProcess, UnixResponse, unix_request};
use bytes::Bytes;
use serde_json::{Value, json};

const TOKEN: &str = "task-token-0123456789abcdef";

fn start(limits: &str) -> GatewayProcess {
    let config = format!(
        r#"
[gateway]
ollama_url = "http://127.0.0.1:9"
{limits}

[models.local]
backend = "ollama"
upstream_model = "qwen-upstream"
"#
    );
    GatewayProcess::start(&config, &[]).unwrap()
}

async fn open(gw: &GatewayProcess, tid: &str) {
    let r = gw.open_task(tid, "local", TOKEN, json!({})).await.unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
}

async fn count_tokens(sock: &Path, body: impl Into<Bytes>) -> Result<UnixResponse, String> {
    let auth = format!("Bearer {TOKEN}");
    unix_request(
        sock,
        "POST",
        "/v1/messages/count_tokens",
        &[
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
        ],
        body,
    )
    .await
    .map_err(|e| e.to_string())
}

fn small_request() -> String {
    json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).to_string()
}

/// B's small request, which must succeed within a generous deadline whatever A is doing.
async fn b_succeeds(sock: &Path, what: &str) {
    let r = tokio::time::timeout(Duration::from_secs(15), count_tokens(sock, small_request()))
        .await
        .unwrap_or_else(|_| panic!("task B's request timed out {what}"))
        .unwrap_or_else(|e| panic!("task B's request failed {what}: {e}"));
    assert_eq!(r.status, 200, "task B {what}: {}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert!(v["input_tokens"].as_u64().unwrap() > 0, "{v}");
}

fn status_kib(pid: u32, field: &str) -> u64 {
    agentbox_tests::harness::status_kib(pid, field).unwrap()
}

/// Task A opens 2,000 idle connections, far more than its limit and more than the gateway's
/// descriptor limit (lowered to 1,024 here, as a unit's `LimitNOFILE` would set it): task B's
/// requests still succeed, and A gets its socket back once it lets go.
#[tokio::test]
async fn idle_connections_from_one_task_do_not_starve_another() {
    const ATTACK: usize = 2000;
    let gw = start("max_connections_per_task = 16");
    open(&gw, "task-a").await;
    open(&gw, "task-b").await;
    let (a, b) = (gw.task_socket("task-a"), gw.task_socket("task-b"));
    b_succeeds(&b, "before the attack").await;

    let limit = rustix::process::Rlimit {
        current: Some(1024),
        maximum: Some(1024),
    };
    let pid = rustix::process::Pid::from_raw(i32::try_from(gw.pid()).unwrap()).unwrap();
    rustix::process::prlimit(Some(pid), rustix::process::Resource::Nofile, limit).unwrap();

    let mut idle = Vec::with_capacity(ATTACK);
    let mut failed_in_a_row = 0;
    while idle.len() < ATTACK && failed_in_a_row < 50 {
        match tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::UnixStream::connect(&a),
        )
        .await
        {
            Ok(Ok(s)) => {
                idle.push(s);
                failed_in_a_row = 0;
            }
            Ok(Err(_)) | Err(_) => failed_in_a_row += 1,
        }
    }
    // Let the gateway accept (or refuse) what is queued.
    tokio::time::sleep(Duration::from_millis(500)).await;

    b_succeeds(&b, "while task A holds 2,000 connections").await;
    b_succeeds(&b, "a second time").await;
    // A itself is over its limit: it is refused (429, or its connection closed), not served.
    match tokio::time::timeout(Duration::from_secs(15), count_tokens(&a, small_request())).await {
        Ok(Ok(r)) => assert_eq!(r.status, 429, "{}", r.text()),
        Ok(Err(_)) => {}
        Err(_) => panic!("task A's request hung instead of being refused"),
    }

    drop(idle);
    let mut recovered = false;
    for _ in 0..100 {
        if let Ok(r) = count_tokens(&a, small_request()).await
            && r.status == 200
        {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(recovered, "task A never got its socket back");
    assert!(
        status_kib(gw.pid(), "VmRSS:") > 0,
        "the gateway died: {}",
        gw.stderr()
    );
}

/// 100 concurrent 6 MiB `count_tokens` bodies on task A: the gateway's peak memory stays
/// within a bound derived from its body budget (32 MiB), A gets 429 for the excess, and task
/// B's requests all succeed meanwhile.
#[tokio::test]
async fn large_bodies_from_one_task_are_bounded_by_the_body_budget() {
    const BUDGET_MIB: u64 = 32;
    let gw = start(&format!(
        "max_body_mb = 8\nmax_inflight_body_mb_per_task = 16\nbody_memory_mb = {BUDGET_MIB}"
    ));
    open(&gw, "task-a").await;
    open(&gw, "task-b").await;
    let (a, b) = (gw.task_socket("task-a"), gw.task_socket("task-b"));
    // Warm up both paths, then measure what the flood adds.
    b_succeeds(&b, "before the flood").await;
    let big: Bytes = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "x".repeat(6 << 20)}]
    })
    .to_string()
    .into();
    let r = count_tokens(&a, big.clone()).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let before = status_kib(gw.pid(), "VmHWM:") << 10;

    let flood: Vec<_> = (0..100)
        .map(|_| {
            let (a, big) = (a.clone(), big.clone());
            tokio::spawn(async move { count_tokens(&a, big).await })
        })
        .collect();
    let bystander = {
        let b = b.clone();
        tokio::spawn(async move {
            for i in 0..20 {
                b_succeeds(&b, &format!("during the flood (request {i})")).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let (mut ok, mut refused) = (0, 0);
    for f in flood {
        let r = f.await.unwrap().unwrap();
        match r.status {
            200 => ok += 1,
            429 | 503 => {
                refused += 1;
                let v: Value = serde_json::from_slice(&r.body).unwrap();
                assert_eq!(v["type"], "error", "{v}");
            }
            s => panic!("unexpected {s}: {}", r.text()),
        }
    }
    bystander.await.unwrap();

    let grown = (status_kib(gw.pid(), "VmHWM:") << 10).saturating_sub(before);
    // What the budget admits, once as bytes and once parsed, plus room for connection buffers.
    let bound = (2 * BUDGET_MIB + 64) << 20;
    assert!(
        grown < bound,
        "peak memory grew by {} MiB for 100 bodies under a {BUDGET_MIB} MiB budget (bound {} MiB)",
        grown >> 20,
        bound >> 20
    );
    assert!(ok > 0, "no large body was served at all");
    assert!(refused > 0, "no body was refused: {ok} served");
}
