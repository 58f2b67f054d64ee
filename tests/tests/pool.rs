//! `agentbox-pool` with every part real but the model: fakellm as the rollout router behind a
//! `backend = "router"` model, the gateway as the service user, the launcher as root on the
//! gateway's data dir starting the real blackbox-server in slot sandboxes, and the pool as a
//! process (the service user) on `run/pool.sock`. Three slots: a lease's `sandbox_url` answers
//! `/health` over TCP; acquiring again returns the same lease; a release resets the slot (new
//! generation, new tid, nothing of the old one left under the data dir); commands and files
//! reach the lease's workspace; a server killed from outside loses its lease (410) and the
//! trajectory gets another slot; drain refuses new leases (409); SIGTERM leaves no slot, no
//! agent process and no open gateway task. `agentbox pool status` reads it (and 77 for a user
//! the socket refuses). A pool killed outright leaves slots running; the next one removes
//! them (and closes their tasks) before it starts its own.
//!
//! Needs the launcher's slot routes and blackbox-server's `BBS_UNIX_SOCKET`. Timeouts here are
//! hang guards only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cli_common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use agentbox_api::pool::{
    Command as PoolCommand, LeaseStatus, PoolStatus, ReadFileRequest, RunCommandRequest, SlotState,
    WriteFileRequest,
};
use agentbox_policy::id::Tid;
use agentbox_tests::harness::pool::{
    AGENT_UIDS, PoolStack, acquire, by_lease, by_traj, paths_naming,
};
use cli_common::{agent_processes, cli_with};
use serde_json::json;

const SLOTS: u16 = 3;

fn start() -> PoolStack {
    PoolStack::start(SLOTS, &json!({"rules": [{"text": "ok"}]}))
}

fn shell(t: &str, cmd: &str) -> RunCommandRequest {
    RunCommandRequest {
        lease: by_traj(t),
        command: PoolCommand::Shell(cmd.into()),
        cwd: None,
        env: BTreeMap::new(),
        timeout: Some(60.0),
        stdin: None,
    }
}

fn tid_of(s: &PoolStatus, slot: u32) -> String {
    s.slots
        .iter()
        .find(|v| v.slot_id == slot)
        .and_then(|v| v.tid.clone())
        .unwrap()
}

async fn health_over_tcp(url: &str) -> Result<u16, reqwest::Error> {
    let r = reqwest::Client::new()
        .get(format!("{url}/health"))
        .timeout(Duration::from_secs(10))
        .send()
        .await?;
    Ok(r.status().as_u16())
}

#[tokio::test]
async fn leases_resets_commands_loss_drain_and_shutdown() {
    let mut stack = start();
    let ready = stack
        .until("all slots ready", |s| s.ready == u32::from(SLOTS))
        .await;
    assert_eq!(ready.capacity, u32::from(SLOTS));
    assert_eq!(
        (ready.node_id.as_str(), ready.node_ip.as_str()),
        ("node-test-abcdefgh", "127.0.0.1")
    );
    assert!(ready.slots.iter().all(|v| v.generation == 1));
    let mut tids: BTreeSet<String> = ready.slots.iter().filter_map(|v| v.tid.clone()).collect();
    assert_eq!(tids.len(), usize::from(SLOTS));
    for t in &tids {
        assert!(Tid::parse(t).is_ok() && t.starts_with("pool-"), "{t}");
        // One gateway task per generation, open.
        assert_eq!(stack.gateway.task(t).await.unwrap()["state"], "open");
    }

    // The CLI shows it; a user the socket refuses gets 77.
    let out = cli_with(&stack.config, &["pool", "status"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("3 slots: 3 ready") && text.contains("READY"),
        "{text}"
    );
    let out = cli_with(&stack.config, &["pool", "status", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["capacity"], 3);
    let out = cli_with(&stack.config, &["pool", "status"])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(77), "{err}");
    assert!(
        err.contains("permission denied") && err.contains("pool.sock"),
        "{err}"
    );

    // Acquire: the lowest slot, exposed over TCP; again: the same lease.
    let a = stack.acquire("traj-a").await;
    assert_eq!(
        (a.slot_id, a.generation, a.status),
        (0, 1, LeaseStatus::Active)
    );
    assert!(
        a.lease_id
            .starts_with("lease-node-test-ab-0000-gen1-traj-a-"),
        "{}",
        a.lease_id
    );
    let url = a.sandbox_url.clone().unwrap();
    assert_eq!(url, format!("http://127.0.0.1:{}", a.port));
    assert_eq!(
        health_over_tcp(&url).await.unwrap(),
        200,
        "{}",
        stack.describe()
    );
    assert_eq!(stack.acquire("traj-a").await, a);

    // Files and commands in the lease's workspace.
    let w = stack
        .client
        .write_file(&WriteFileRequest {
            lease: by_traj("traj-a"),
            path: "notes/hello.txt".into(),
            content_base64: "aGVsbG8K".into(),
            append: false,
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", stack.describe()));
    assert_eq!((w.bytes, w.lease_id.as_str()), (6, a.lease_id.as_str()));
    let out = stack
        .client
        .run_command(&shell("traj-a", "cat notes/hello.txt && pwd && id -u"))
        .await
        .unwrap();
    assert_eq!(out.returncode, Some(0), "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(&lines[..2], ["hello", "/workspace"], "{out:?}");
    assert!(
        AGENT_UIDS.contains(&lines[2].parse::<u32>().unwrap()),
        "{out:?}"
    );
    assert_eq!(
        (out.slot_id, out.lease_id.as_str()),
        (0, a.lease_id.as_str())
    );
    let mut argv = shell("traj-a", "");
    argv.command = PoolCommand::Argv(vec!["ls".into(), "-1".into()]);
    argv.cwd = Some("notes".into());
    let out = stack.client.run_command(&argv).await.unwrap();
    assert_eq!(
        (out.cmd.as_str(), out.stdout.as_str()),
        ("ls -1", "hello.txt\n")
    );
    let f = stack
        .client
        .read_file(&ReadFileRequest {
            lease: by_lease(&a.lease_id),
            path: "/workspace/notes/hello.txt".into(),
            max_bytes: None,
        })
        .await
        .unwrap();
    assert_eq!((f.content_base64.as_str(), f.size), ("aGVsbG8K", 6));
    let missing = stack
        .client
        .run_command(&shell("nobody", "true"))
        .await
        .unwrap_err();
    assert_eq!(
        (missing.status(), missing.code()),
        (Some(404), Some("lease_not_found"))
    );

    // Release: queued, then releasing or released; the slot comes back as a new generation.
    let old_tid = tid_of(&stack.status().await, 0);
    let r = stack.client.release(&by_traj("traj-a")).await.unwrap();
    assert!(r.released && r.release_queued && !r.already_releasing && !r.already_released);
    assert_eq!(
        (r.slot_id, r.generation, r.slot_reusable),
        (Some(0), Some(1), false)
    );
    let r = stack.client.release(&by_traj("traj-a")).await.unwrap();
    assert!(
        r.released && (r.already_releasing || r.already_released),
        "{r:?}"
    );
    let s = stack
        .until("slot 0 reset", |s| {
            s.slots[0].status == SlotState::Ready && s.slots[0].generation == 2
        })
        .await;
    let new_tid = tid_of(&s, 0);
    assert_ne!(new_tid, old_tid);
    tids.insert(new_tid.clone());
    let r = stack.client.release(&by_traj("traj-a")).await.unwrap();
    assert!(
        r.released && r.already_released && !r.release_queued,
        "{r:?}"
    );
    assert_eq!(paths_naming(&stack.data, &old_tid), Vec::<PathBuf>::new());
    assert!(std::net::TcpStream::connect(("127.0.0.1", a.port)).is_err());
    assert_eq!(
        stack.gateway.task(&old_tid).await.unwrap()["state"],
        "closed"
    );
    // Nothing of the old lease in the new generation.
    let b = stack.acquire("traj-b").await;
    assert_eq!((b.slot_id, b.generation), (0, 2));
    let out = stack
        .client
        .run_command(&shell("traj-b", "ls -A /workspace; ls -A /tmp"))
        .await
        .unwrap();
    assert_eq!(out.stdout, "", "{out:?}");

    // A server killed from outside: its lease is lost, commands 410, a new slot on re-acquire.
    let pid = stack.slot(&new_tid).await.unwrap().pid.unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    stack
        .until("the lease lost", |s| s.slots[0].status == SlotState::Lost)
        .await;
    let lost = stack
        .client
        .run_command(&shell("traj-b", "true"))
        .await
        .unwrap_err();
    assert_eq!(
        (lost.status(), lost.code()),
        (Some(410), Some("lease_lost"))
    );
    let c = stack.acquire("traj-b").await;
    assert_ne!(c.slot_id, 0);
    assert_eq!(c.status, LeaseStatus::Active);
    assert_eq!(
        health_over_tcp(c.sandbox_url.as_deref().unwrap())
            .await
            .unwrap(),
        200
    );
    let s = stack
        .until("the lost slot reset", |s| {
            s.slots[0].status == SlotState::Ready && s.slots[0].generation == 3
        })
        .await;
    tids.insert(tid_of(&s, 0));

    // Drain: no new leases, the holder keeps its own.
    assert!(stack.client.drain().await.unwrap().draining);
    let refused = stack.client.acquire(&acquire("traj-d")).await.unwrap_err();
    assert_eq!(
        (refused.status(), refused.code()),
        (Some(409), Some("draining"))
    );
    assert_eq!(stack.acquire("traj-b").await, c);
    assert!(!stack.client.undrain().await.unwrap().draining);
    let bad = stack.client.acquire(&acquire("")).await.unwrap_err();
    assert_eq!((bad.status(), bad.code()), (Some(400), Some("bad_request")));

    // SIGTERM: no slot, no agent process, every gateway task closed.
    let final_tids: Vec<String> = stack
        .status()
        .await
        .slots
        .iter()
        .filter_map(|v| v.tid.clone())
        .collect();
    tids.extend(final_tids);
    stack.terminate_pool().await;
    assert!(!stack.data.join("run/pool.sock").exists());
    for t in &tids {
        stack.assert_generation_gone(t).await;
        assert_eq!(paths_naming(&stack.data, t), Vec::<PathBuf>::new());
    }
    let deadline = Instant::now() + stack.hang_guard;
    loop {
        let left = agent_processes(AGENT_UIDS);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "agent processes left: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let base = c.port - u16::try_from(c.slot_id).unwrap();
    for p in base..base + SLOTS {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", p)).is_err(),
            "port {p}"
        );
    }
}

#[tokio::test]
async fn a_pool_that_crashed_leaves_nothing_once_restarted() {
    let mut stack = start();
    let s = stack
        .until("all slots ready", |s| s.ready == u32::from(SLOTS))
        .await;
    let old: Vec<String> = s.slots.iter().filter_map(|v| v.tid.clone()).collect();
    stack.pool.kill();
    // Its slots outlive it until the next pool starts.
    for t in &old {
        let st = stack.slot(t).await.unwrap();
        assert_eq!(st.state, agentbox_api::launcher::RunState::Running, "{t}");
    }
    stack.pool = PoolStack::spawn_pool(&stack.config).0;
    let s = stack
        .until("all slots ready again", |s| s.ready == u32::from(SLOTS))
        .await;
    for t in &old {
        stack.assert_generation_gone(t).await;
        assert!(s.slots.iter().all(|v| v.tid.as_deref() != Some(t.as_str())));
    }
    stack.terminate_pool().await;
}
