//! One host, eight rollout slots, eight concurrent paddock-style episodes with the real
//! opencode: the stack of `pool.rs` (fakellm as the router behind a `backend = "router"`
//! model, gateway, launcher, pool as processes) with `slots = 8`. Eight leases are acquired
//! over `pool.sock`; each is driven at once over its lease's TCP `sandbox_url` as a paddock
//! does (`/health`, register opencode, one sync turn whose scripted tool call writes a file
//! in the slot's workspace, checked through the pool's `read_file`, abort, release). Every
//! model call reached fakellm with its episode's session, instance, turn and sticky headers
//! and `X-Dressage-Partial-Rollout: 1`, never with a slot's task token; each slot's gateway
//! task metered exactly fakellm's usage for its session; after release nothing of a lease is
//! left under the data dir and every slot is READY again at generation 2.
//!
//! The machine this runs on may be small and loaded (eight opencode servers start at once),
//! so timeouts here are generous hang guards only; nothing is timed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use agentbox_api::pool::{Lease, ReadFileRequest, SlotState};
use agentbox_tests::harness::opencode_registration;
use agentbox_tests::harness::pool::{PoolStack, by_lease, by_traj, paths_naming};
use base64::Engine as _;
use serde_json::{Value, json};

const SLOTS: u16 = 8;
/// (input, output) tokens fakellm reports for a title request, and for episode `i`'s write
/// and final answer (distinct per episode, so a call metered on the wrong slot shows).
const TITLE: (u64, u64) = (7, 3);
fn write_usage(i: usize) -> (u64, u64) {
    (100 + 10 * i as u64, 20 + i as u64)
}
fn done_usage(i: usize) -> (u64, u64) {
    (300 + 10 * i as u64, 2 + i as u64)
}

fn session(i: usize) -> String {
    format!("sess-pool-ep-{i}")
}
fn instance(i: usize) -> String {
    format!("inst-pool-ep-{i}")
}
fn turn(i: usize) -> String {
    format!("turn-pool-ep-{i}")
}
fn content(i: usize) -> String {
    format!("written by episode {i}\n")
}

/// Rules only (steps are one global sequence, and the episodes run at once): episode `i`'s
/// prompt names `task ep-{i}.` and gets a write of `/workspace/ep-{i}.txt`; the request that
/// carries that tool call's result gets the final answer.
fn script() -> Value {
    let mut rules = vec![json!({"match": {"has_tools": false}, "text": "title",
                                "usage": {"input_tokens": TITLE.0, "output_tokens": TITLE.1}})];
    for i in 0..usize::from(SLOTS) {
        let call = format!("call_pool_ep_{i}");
        let (wi, wo) = write_usage(i);
        let (di, do_) = done_usage(i);
        rules.push(json!({"match": {"has_tools": true, "body_contains": call},
                          "text": format!("episode {i} done"),
                          "usage": {"input_tokens": di, "output_tokens": do_}}));
        rules.push(
            json!({"match": {"has_tools": true, "body_contains": format!("task ep-{i}."),
                                    "body_lacks": call},
                          "tool_calls": [{"id": call, "name": "write",
                                          "input": {"filePath": format!("/workspace/ep-{i}.txt"),
                                                    "content": content(i)}}],
                          "usage": {"input_tokens": wi, "output_tokens": wo}}),
        );
    }
    json!({"rules": rules})
}

/// The usage fakellm reported for a request it served with `served_by`.
fn usage_of(served_by: &str) -> (u64, u64) {
    let n: usize = served_by
        .strip_prefix("rule ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a rule: {served_by}"));
    match n {
        0 => TITLE,
        n if n % 2 == 1 => done_usage((n - 1) / 2),
        n => write_usage((n - 2) / 2),
    }
}

async fn call(
    http: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut req = http.request(method, url);
    if let Some(b) = body {
        req = req.json(b);
    }
    let r = req.send().await.unwrap_or_else(|e| panic!("{url}: {e}"));
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// One paddock episode on lease `l`: health, register, a sync turn that writes a file, the
/// file read back through the pool, abort, release.
async fn episode(stack: &PoolStack, i: usize, l: Lease) -> String {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()
        .unwrap();
    let url = l.sandbox_url.clone().unwrap();
    let (st, h) = call(&http, reqwest::Method::GET, &format!("{url}/health"), None).await;
    assert_eq!(st, 200, "episode {i} health: {h}\n{}", stack.describe());

    // The paddock's registration names its own router; the slot's BBS_ROUTER_URL (its
    // gateway task) decides where calls go.
    let reg = opencode_registration(
        "http://127.0.0.1:9",
        &session(i),
        &json!({"bound_instance_id": instance(i)}),
    );
    let mut registered = None;
    for _ in 0..6 {
        let r = call(
            &http,
            reqwest::Method::POST,
            &format!("{url}/v1/rollout/register"),
            Some(&reg),
        )
        .await;
        if r.0 != 503 {
            registered = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let (st, r) = registered.unwrap_or_else(|| panic!("episode {i}: register still 503"));
    assert_eq!(st, 200, "episode {i} register: {r}\n{}", stack.describe());
    assert_eq!(r["binding"]["bound_instance_id"], instance(i), "{r}");

    let body = json!({"turn_id": turn(i), "mode": "sync",
                      "messages": [{"role": "user",
                                    "content": format!("task ep-{i}. Write the file.")}],
                      "metadata": {}});
    let (st, t) = call(
        &http,
        reqwest::Method::POST,
        &format!("{url}/v1/sessions/{}/messages", session(i)),
        Some(&body),
    )
    .await;
    assert_eq!(st, 200, "episode {i} turn: {t}\n{}", stack.describe());
    let last = t["outputs"].as_array().and_then(|o| o.last()).cloned();
    assert_eq!(
        last.as_ref().and_then(|m| m["content"].as_str()),
        Some(format!("episode {i} done").as_str()),
        "episode {i}: {t}"
    );

    // The edit landed in this slot's workspace (and no other episode's file is there).
    let f = stack
        .client
        .read_file(&ReadFileRequest {
            lease: by_lease(&l.lease_id),
            path: format!("ep-{i}.txt"),
            max_bytes: None,
        })
        .await
        .unwrap_or_else(|e| panic!("episode {i} read_file: {e}\n{}", stack.describe()));
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(&f.content_base64)
        .unwrap();
    assert_eq!(String::from_utf8(bytes).unwrap(), content(i));
    let other = (i + 1) % usize::from(SLOTS);
    let e = stack
        .client
        .read_file(&ReadFileRequest {
            lease: by_traj(&format!("traj-ep-{i}")),
            path: format!("ep-{other}.txt"),
            max_bytes: None,
        })
        .await;
    assert!(
        e.is_err(),
        "episode {other}'s file is in slot {}",
        l.slot_id
    );

    let (st, a) = call(
        &http,
        reqwest::Method::POST,
        &format!("{url}/v1/sessions/{}/abort", session(i)),
        None,
    )
    .await;
    assert_eq!((st, a["state"].as_str()), (200, Some("aborted")), "{a}");
    let tid = stack
        .status()
        .await
        .slots
        .iter()
        .find(|v| v.slot_id == l.slot_id)
        .and_then(|v| v.tid.clone())
        .unwrap();
    let rel = stack
        .client
        .release(&by_traj(&format!("traj-ep-{i}")))
        .await
        .unwrap_or_else(|e| panic!("episode {i} release: {e}"));
    assert!(rel.released, "{rel:?}");
    tid
}

/// Every `BBS_ROUTER_TOKEN` in a live process's environment (the slots' task tokens).
fn slot_tokens() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for e in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        for var in env.split(|b| *b == 0) {
            if let Some(v) = var.strip_prefix(b"BBS_ROUTER_TOKEN=") {
                out.insert(String::from_utf8_lossy(v).into_owned());
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_concurrent_opencode_episodes_on_eight_slots() {
    let mut stack = PoolStack::start(SLOTS, &script());
    stack.hang_guard = Duration::from_secs(600);
    let ready = stack
        .until("all slots ready", |s| s.ready == u32::from(SLOTS))
        .await;
    assert!(ready.slots.iter().all(|v| v.generation == 1));
    let tokens = slot_tokens();
    assert!(
        tokens.len() >= usize::from(SLOTS),
        "found {} slot tokens",
        tokens.len()
    );

    let mut leases = Vec::new();
    for i in 0..usize::from(SLOTS) {
        leases.push(stack.acquire(&format!("traj-ep-{i}")).await);
    }
    let slot_ids: BTreeSet<u32> = leases.iter().map(|l| l.slot_id).collect();
    assert_eq!(slot_ids.len(), usize::from(SLOTS), "{leases:?}");

    let stack_ref = &stack;
    let tids: Vec<String> = futures_util::future::join_all(
        leases
            .into_iter()
            .enumerate()
            .map(|(i, l)| episode(stack_ref, i, l)),
    )
    .await;

    // Every model call: its episode's headers, no token.
    let requests = stack.fake.chat_requests().unwrap();
    let mut per_session: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    for req in &requests {
        let text = req.to_string();
        for t in &tokens {
            assert!(
                !text.contains(t.as_str()),
                "a task token reached the router: {req}"
            );
        }
        let h = &req["headers"];
        assert!(h.get("authorization").is_none(), "{req}");
        assert!(h.get("x-api-key").is_none(), "{req}");
        let s = h["x-session-id"]
            .as_str()
            .unwrap_or_else(|| panic!("{req}"));
        let i: usize = s
            .strip_prefix("sess-pool-ep-")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{req}"));
        assert_eq!(h["x-instance-id"], instance(i), "{req}");
        assert_eq!(h["x-turn-id"], turn(i), "{req}");
        assert_eq!(h["x-smg-routing-key"], session(i), "{req}");
        assert_eq!(h["x-dressage-partial-rollout"], "1", "{req}");
        let (inp, out) = usage_of(req["served_by"].as_str().unwrap());
        let e = per_session.entry(s.to_owned()).or_default();
        e.0 += inp;
        e.1 += out;
        e.2 += 1;
    }
    assert_eq!(per_session.len(), usize::from(SLOTS), "{per_session:?}");

    // Each slot's gateway task metered its own session's calls, to the token.
    for (i, tid) in tids.iter().enumerate() {
        let (inp, out, n) = per_session[&session(i)];
        assert!(n >= 2, "episode {i}: {n} calls");
        let view = stack.gateway.task(tid).await.unwrap();
        let u = &view["usage"];
        assert_eq!(u["input_tokens"], inp, "episode {i} task {tid}: {view}");
        assert_eq!(u["output_tokens"], out, "episode {i} task {tid}: {view}");
        assert_eq!(u["requests"], n, "episode {i} task {tid}: {view}");
    }

    // After release: every slot READY at generation 2, nothing of a lease left.
    let s = stack
        .until("every slot reset", |s| {
            s.slots
                .iter()
                .all(|v| v.status == SlotState::Ready && v.generation == 2)
        })
        .await;
    for tid in &tids {
        assert!(
            s.slots
                .iter()
                .all(|v| v.tid.as_deref() != Some(tid.as_str()))
        );
        assert_eq!(
            paths_naming(&stack.data, tid),
            Vec::<std::path::PathBuf>::new()
        );
        assert_eq!(stack.gateway.task(tid).await.unwrap()["state"], "closed");
    }
    stack.terminate_pool().await;
}
