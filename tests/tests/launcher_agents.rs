//! `POST /agents`, `GET /agents/{tid}` and `DELETE /agents/{tid}` against the real launcher,
//! with a stand-in `claude` (a script that runs its first argument with bash) so each test
//! scripts what the agent does inside the real sandbox. Restart behaviour included.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::os::unix::net::UnixStream;

use agentbox_tests::harness::launcher::{
    self as common, Launcher, Options, SERVICE_UID, eventually, owner_of, processes_with,
};
use serde_json::{Value, json};

fn start(l: &Launcher, tid: &str, script: &str, timeout_s: u64) -> common::Resp {
    l.post(
        "/agents",
        &json!({"tid": tid, "model": "m1", "cmd": ["claude", script], "env": {"MAX_THINKING_TOKENS": "77"},
                "timeout_s": timeout_s, "token": "task-token-123"}),
    )
}

fn wait(l: &Launcher, tid: &str) -> Value {
    let r = l.get(&format!("/agents/{tid}?wait=1"));
    assert_eq!(r.status, 200, "{}", r.raw);
    r.body
}

fn marker() -> String {
    format!("{}", 800_000 + std::process::id())
}

#[test]
fn agent_runs_in_its_sandbox_and_reports() {
    let l = Launcher::start(Options::default());
    let (ws, _gw) = l.prepare_task("a1");
    let r = start(
        &l,
        "a1",
        "env | grep -E '^(ANTHROPIC|MAX_THINKING|HOME|PATH)' | sort; ls -A /run/gw; \
         python3 -c 'import socket; s=socket.socket(socket.AF_UNIX); s.connect(\"/run/gw/llm.sock\"); print(\"gw-connected\")'; \
         echo made > /workspace/out.txt; echo to-stderr >&2; exit 7",
        60,
    );
    assert_eq!(r.status, 201, "{}\n{}", r.raw, l.stderr());
    assert!(
        ["running", "finishing", "exited"].contains(&r.body["state"].as_str().unwrap()),
        "{}",
        r.raw
    );
    let v = wait(&l, "a1");
    assert_eq!(v["state"], "exited", "{v}");
    assert_eq!(v["exit_code"], 7);
    assert_eq!(v["oom_killed"], false);
    assert_eq!(v["timed_out"], false);
    let out = v["stdout"].as_str().unwrap();
    for want in [
        "ANTHROPIC_AUTH_TOKEN=task-token-123",
        "ANTHROPIC_BASE_URL=http://localhost",
        "ANTHROPIC_UNIX_SOCKET=/run/gw/llm.sock",
        "MAX_THINKING_TOKENS=77",
        "HOME=/home/agent",
        "\nllm.sock\n",
        "gw-connected",
    ] {
        assert!(out.contains(want), "{want:?} missing in {out}");
    }
    assert_eq!(v["stderr"], "to-stderr\n");
    assert_eq!(
        std::fs::read_to_string(ws.join("out.txt")).unwrap(),
        "made\n"
    );
    assert_eq!(owner_of(&ws), SERVICE_UID);
    assert_eq!(owner_of(&ws.join("out.txt")), SERVICE_UID);
    assert!(l.cgroup_dirs().is_empty());
    // The token never reaches the launcher's log.
    assert!(!l.stderr().contains("task-token-123"));
    // A finished agent may be started again on the same tid.
    let r = start(&l, "a1", "exit 0", 60);
    assert_eq!(r.status, 201, "{}", r.raw);
    assert_eq!(wait(&l, "a1")["exit_code"], 0);
}

#[test]
fn duplicate_start_conflicts_and_delete_kills_everything() {
    let l = Launcher::start(Options::default());
    let (ws, _gw) = l.prepare_task("d1");
    let m = marker();
    let r = start(
        &l,
        "d1",
        &format!("setsid nohup sleep {m} >/dev/null 2>&1 & echo started; sleep 1000"),
        600,
    );
    assert_eq!(r.status, 201, "{}", r.raw);
    eventually("the survivor is running", || {
        (!processes_with(&format!("sleep {m}")).is_empty()).then_some(())
    });
    eventually("the agent printed", || {
        (l.get("/agents/d1").body["stdout"] == "started\n").then_some(())
    });
    // Meanwhile the token is not on any command line.
    for p in processes_with("/usr/bin/bwrap") {
        assert!(!p.contains("task-token-123"), "{p}");
    }
    assert_eq!(owner_of(&ws), common::AGENT_UID);
    let r = start(&l, "d1", "true", 60);
    assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.raw);
    let r = l.post(
        "/checks",
        &json!({"tid": "d1", "command": "true", "timeout_s": 5}),
    );
    assert_eq!(r.code(), "conflict", "{}", r.raw);
    let status = l.get("/status");
    assert_eq!(
        status.body["agents"],
        json!([{"tid": "d1", "state": "running"}]),
        "{}",
        status.raw
    );

    let r = l.request("DELETE", "/agents/d1", None);
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(r.body["state"], "killed", "{}", r.raw);
    assert_eq!(r.body["exit_code"], 137);
    assert_eq!(r.body["stdout"], "started\n");
    assert!(processes_with(&format!("sleep {m}")).is_empty());
    assert_eq!(owner_of(&ws), SERVICE_UID);
    assert!(l.cgroup_dirs().is_empty());
    let r = l.get("/agents/d1");
    assert_eq!((r.status, r.code()), (404, "unknown_task"));
    assert!(!l.data.join("tasks/d1/logs").exists());
}

#[test]
fn timeout_is_reported() {
    let l = Launcher::start(Options::default());
    let (_, _gw) = l.prepare_task("t1");
    let r = start(&l, "t1", "sleep 1000", 1);
    assert_eq!(r.status, 201, "{}", r.raw);
    let v = wait(&l, "t1");
    assert_eq!(v["state"], "timed_out", "{v}");
    assert_eq!(v["timed_out"], true);
    assert_eq!(v["exit_code"], 137);
}

#[test]
fn wait_is_released_when_the_client_disconnects() {
    let l = Launcher::start(Options::default());
    let (_, _gw) = l.prepare_task("w1");
    assert_eq!(start(&l, "w1", "sleep 1000", 600).status, 201);
    let waiters = |l: &Launcher| l.get("/status").body["waiters"].as_u64().unwrap();
    {
        let mut s = UnixStream::connect(&l.socket).unwrap();
        s.write_all(b"GET /agents/w1?wait=1 HTTP/1.1\r\nhost: x\r\n\r\n")
            .unwrap();
        eventually("the waiter is registered", || {
            (waiters(&l) == 1).then_some(())
        });
    }
    eventually("the waiter is released", || {
        (waiters(&l) == 0).then_some(())
    });
    let r = l.request("DELETE", "/agents/w1", None);
    assert_eq!(r.body["state"], "killed");
}

#[test]
fn finished_runs_survive_a_restart() {
    let mut l = Launcher::start(Options::default());
    let (_, _gw) = l.prepare_task("r1");
    assert_eq!(start(&l, "r1", "echo kept; exit 5", 60).status, 201);
    let before = wait(&l, "r1");
    assert_eq!(before["exit_code"], 5);
    assert_eq!(l.stop(), Some(0));
    l.spawn();
    let after = l.get("/agents/r1");
    assert_eq!(after.status, 200, "{}", after.raw);
    assert_eq!(after.body, before);
}

#[test]
fn shutdown_stops_running_agents() {
    let mut l = Launcher::start(Options::default());
    let (ws, _gw) = l.prepare_task("s1");
    let m = marker();
    assert_eq!(start(&l, "s1", &format!("sleep {m}"), 600).status, 201);
    eventually("the agent runs", || {
        (!processes_with(&format!("sleep {m}")).is_empty()).then_some(())
    });
    assert_eq!(l.stop(), Some(0));
    assert!(processes_with(&format!("sleep {m}")).is_empty());
    assert_eq!(owner_of(&ws), SERVICE_UID);
    assert!(l.cgroup_dirs().is_empty());
    l.spawn();
    assert_eq!(l.get("/agents/s1").body["state"], "killed");
}

#[test]
fn a_crashed_launcher_leaves_nothing_running_after_restart() {
    let mut l = Launcher::start(Options::default());
    let (ws, _gw) = l.prepare_task("c1");
    let m = marker();
    let script = format!("setsid nohup sleep {m}1 >/dev/null 2>&1 & sleep {m}2");
    assert_eq!(start(&l, "c1", &script, 600).status, 201);
    eventually("the agent runs", || {
        (processes_with(&format!("sleep {m}")).len() >= 2).then_some(())
    });
    l.crash();
    l.spawn();
    let v = l.get("/agents/c1");
    assert_eq!(v.body["state"], "lost", "{}", v.raw);
    assert!(
        v.body["error"]
            .as_str()
            .unwrap()
            .contains("launcher stopped"),
        "{}",
        v.raw
    );
    assert!(
        processes_with(&format!("sleep {m}")).is_empty(),
        "{:?}",
        processes_with(&format!("sleep {m}"))
    );
    assert!(l.cgroup_dirs().is_empty());
    assert_eq!(owner_of(&ws), SERVICE_UID);
}

#[test]
fn orphaned_cgroups_are_killed_at_startup() {
    let mut l = Launcher::start(Options::default());
    l.stop();
    // A process left in one of our cgroups by some earlier launcher.
    let m = marker();
    let mut child = std::process::Command::new("sleep")
        .arg(format!("{m}7"))
        .spawn()
        .unwrap();
    for ctrl in ["memory", "pids", "cpu", "freezer"] {
        let dir = std::path::Path::new("/sys/fs/cgroup")
            .join(ctrl)
            .join(&l.cgroup_parent)
            .join("orphan");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).unwrap();
    }
    l.spawn();
    // The launcher killed it before it started listening; reap it here (bounded: a failing
    // launcher must not hang the test).
    let status = (0..12_000).find_map(|_| {
        let done = child.try_wait().unwrap();
        if done.is_none() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        done
    });
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the orphan survived the restart");
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9));
    assert!(l.cgroup_dirs().is_empty(), "{:?}", l.cgroup_dirs());
}

#[test]
fn a_start_survives_its_client_going_away() {
    let l = Launcher::start(Options::default());
    let (ws, _gw) = l.prepare_task("g1");
    // Enough entries that handing the workspace over takes a while, so the client is gone
    // while the launch is still under way.
    for d in 0..50 {
        let dir = ws.join(format!("d{d}"));
        std::fs::create_dir(&dir).unwrap();
        for f in 0..400 {
            std::fs::write(dir.join(f.to_string()), "").unwrap();
        }
    }
    common::chown_tree(&ws, SERVICE_UID);
    {
        let body =
            json!({"tid": "g1", "model": "m1", "cmd": ["claude", "echo ran"], "timeout_s": 60})
                .to_string();
        let mut s = UnixStream::connect(&l.socket).unwrap();
        write!(
            s,
            "POST /agents HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        // The hand-over has begun (the top is handed over first): the launch is under way.
        eventually("the hand-over starts", || {
            (owner_of(&ws) == common::AGENT_UID).then_some(())
        });
        // Dropped here: the server sees the connection close in the middle of the launch.
    }
    let v = eventually("the run finishes", || {
        let v = l.get("/agents/g1").body;
        (v["state"] == "exited").then_some(v)
    });
    assert_eq!(v["stdout"], "ran\n", "{v}");
    assert_eq!(owner_of(&ws), SERVICE_UID);
    assert_eq!(owner_of(&ws.join("d7/123")), SERVICE_UID);
}
