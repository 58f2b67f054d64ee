//! Every control type round-trips through JSON unchanged, answers keep the exact shapes the
//! daemons answered with before these types existed, and requests refuse unknown fields.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::fmt::Debug;

use agentbox_api::error::ErrorEnvelope;
use agentbox_api::gateway::{
    Budget, GatewayStatus, OpenTask, Remaining, Reserved, TaskState, TaskUsage, TaskView,
};
use agentbox_api::launcher::{
    AgentRequest, AgentStatus, BackendStartResult, BackendState, BackendStatus, BackendStopResult,
    CheckRequest, CheckResult, DeleteBranchRequest, DeleteBranchResult, DeliverRequest,
    DeliverResult, DiskMode, DiskStatus, HostCheck, HostStatus, LauncherStatus, RunState,
    RunSummary, SnapshotRequest, SnapshotResult,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// `value` → JSON → back is `value`, and the JSON is `expected`.
fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T, expected: &Value) {
    let json = serde_json::to_value(value).unwrap();
    assert_eq!(&json, expected);
    let back: T = serde_json::from_value(json).unwrap();
    assert_eq!(&back, value);
}

/// `with` (an object) plus an `extra` key is refused, naming the key.
fn refuses_unknown<T: DeserializeOwned + Debug>(with: &Value) {
    let mut v = with.clone();
    v.as_object_mut().unwrap().insert("extra".into(), json!(1));
    let err = serde_json::from_value::<T>(v).unwrap_err();
    assert!(err.to_string().contains("unknown field `extra`"), "{err}");
    serde_json::from_value::<T>(with.clone()).unwrap();
}

/// A strict type's contract (requests, the error envelope): [`round_trip`] and
/// [`refuses_unknown`] on the same JSON.
fn strict_round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T, wire: &Value) {
    round_trip(value, wire);
    refuses_unknown::<T>(wire);
}

const RUN_STATES: [(RunState, &str); 10] = [
    (RunState::Starting, "starting"),
    (RunState::Running, "running"),
    (RunState::Stopping, "stopping"),
    (RunState::Finishing, "finishing"),
    (RunState::Exited, "exited"),
    (RunState::TimedOut, "timed_out"),
    (RunState::Killed, "killed"),
    (RunState::DiskExceeded, "disk_exceeded"),
    (RunState::Failed, "failed"),
    (RunState::Lost, "lost"),
];

#[test]
fn states_are_the_wire_strings() {
    for (s, text) in RUN_STATES {
        round_trip(&s, &json!(text));
        assert_eq!(s.as_str(), text);
        assert_eq!(s.to_string(), text);
    }
    for (s, text) in [
        (BackendState::Stopped, "stopped"),
        (BackendState::Starting, "starting"),
        (BackendState::Healthy, "healthy"),
        (BackendState::Stopping, "stopping"),
        (BackendState::Failed, "failed"),
    ] {
        round_trip(&s, &json!(text));
        assert_eq!(s.as_str(), text);
    }
    round_trip(&TaskState::Open, &json!("open"));
    round_trip(&TaskState::Closed, &json!("closed"));
    assert!(serde_json::from_value::<RunState>(json!("Exited")).is_err());
    let done: Vec<&str> = RUN_STATES
        .iter()
        .filter(|(s, _)| s.is_done())
        .map(|(_, t)| *t)
        .collect();
    assert_eq!(
        done,
        [
            "exited",
            "timed_out",
            "killed",
            "disk_exceeded",
            "failed",
            "lost"
        ]
    );
}

#[test]
fn launcher_requests() {
    let agent = AgentRequest {
        tid: "t1".into(),
        model: "m1".into(),
        cmd: vec!["claude".into(), "-p".into()],
        env: BTreeMap::from([("MAX_THINKING_TOKENS".into(), "1".into())]),
        venv: Some("/v/x".into()),
        timeout_s: 60,
        token: Some("tok".into()),
        stdin: Some("Fix the tests".into()),
    };
    let full = json!({"tid": "t1", "model": "m1", "cmd": ["claude", "-p"],
        "env": {"MAX_THINKING_TOKENS": "1"}, "venv": "/v/x", "timeout_s": 60, "token": "tok",
        "stdin": "Fix the tests"});
    strict_round_trip(&agent, &full);
    // The seed's minimal form: env, venv and token default.
    let minimal: AgentRequest = serde_json::from_value(
        json!({"tid": "t1", "model": "m1", "cmd": ["claude"], "timeout_s": 1}),
    )
    .unwrap();
    assert_eq!(
        (
            minimal.env.len(),
            minimal.venv,
            minimal.token,
            minimal.stdin
        ),
        (0, None, None, None)
    );
    let check = CheckRequest {
        tid: "t1".into(),
        command: "true".into(),
        venv: None,
        timeout_s: 5,
    };
    let v = json!({"tid": "t1", "command": "true", "timeout_s": 5});
    strict_round_trip(&check, &v);
    for bad in [json!(1.5), json!(-1), json!("1")] {
        let v = json!({"tid": "a", "command": "true", "timeout_s": bad});
        assert!(serde_json::from_value::<CheckRequest>(v).is_err());
    }
    strict_round_trip(
        &SnapshotRequest {
            tid: "t1".into(),
            path: "/r".into(),
            git_ref: Some("main".into()),
        },
        &json!({"tid": "t1", "path": "/r", "ref": "main"}),
    );
    strict_round_trip(
        &DeliverRequest {
            tid: "t1".into(),
            path: "/r".into(),
            branch: "agent/t1".into(),
        },
        &json!({"tid": "t1", "path": "/r", "branch": "agent/t1"}),
    );
    strict_round_trip(
        &DeleteBranchRequest {
            path: "/r".into(),
            branch: "agent/t1".into(),
        },
        &json!({"path": "/r", "branch": "agent/t1"}),
    );
}

fn backend() -> (BackendStatus, Value) {
    (
        BackendStatus {
            model: "q".into(),
            state: BackendState::Healthy,
            pid: Some(42),
            port: 8001,
            agents: 2,
            error: None,
        },
        json!({"model": "q", "state": "healthy", "pid": 42, "port": 8001, "agents": 2, "error": null}),
    )
}

#[test]
fn launcher_answers() {
    let status = AgentStatus {
        tid: "t1".into(),
        state: RunState::TimedOut,
        exit_code: Some(137),
        oom_killed: false,
        timed_out: true,
        disk_exceeded: false,
        setup_failed: false,
        stdout: "out".into(),
        stderr: String::new(),
        truncated: false,
        result_commit: None,
        error: Some("e".into()),
    };
    round_trip(
        &status,
        &json!({"tid": "t1", "state": "timed_out", "exit_code": 137, "oom_killed": false,
            "timed_out": true, "disk_exceeded": false, "setup_failed": false, "stdout": "out", "stderr": "", "truncated": false,
            "result_commit": null, "error": "e"}),
    );
    round_trip(
        &CheckResult {
            tid: "c".into(),
            exit_code: None,
            oom_killed: true,
            timed_out: false,
            disk_exceeded: true,
            setup_failed: true,
            stdout: String::new(),
            stderr: "x".into(),
            truncated: true,
        },
        &json!({"tid": "c", "exit_code": null, "oom_killed": true, "timed_out": false,
            "disk_exceeded": true, "setup_failed": true, "stdout": "", "stderr": "x", "truncated": true}),
    );
    round_trip(
        &SnapshotResult {
            repo: "/r".into(),
            sha: "abc".into(),
        },
        &json!({"repo": "/r", "sha": "abc"}),
    );
    round_trip(
        &DeliverResult {
            repo: "/r".into(),
            branch: "agent/t".into(),
            sha: "abc".into(),
        },
        &json!({"repo": "/r", "branch": "agent/t", "sha": "abc"}),
    );
    round_trip(
        &DeleteBranchResult {
            repo: "/r".into(),
            branch: "agent/t".into(),
            sha: "abc".into(),
        },
        &json!({"repo": "/r", "branch": "agent/t", "sha": "abc"}),
    );
    let (b, bv) = backend();
    round_trip(&b, &bv);
    let mut flat = bv.clone();
    flat.as_object_mut()
        .unwrap()
        .insert("stopped".into(), json!(["old"]));
    round_trip(
        &BackendStartResult {
            backend: b.clone(),
            stopped: vec!["old".into()],
        },
        &flat,
    );
    round_trip(
        &BackendStopResult {
            stopped: vec!["q".into()],
        },
        &json!({"stopped": ["q"]}),
    );
    let check = |ok, d: &str| HostCheck {
        ok,
        detail: d.into(),
    };
    round_trip(
        &LauncherStatus {
            agents: vec![RunSummary {
                tid: "a".into(),
                state: RunState::Running,
            }],
            checks: vec![],
            slots: vec![],
            finished: 3,
            waiters: 1,
            backends: vec![b],
            ready: false,
            host: HostStatus {
                ready: false,
                reasons: vec!["cgroups: none".into()],
                bwrap: check(true, "bubblewrap 0.11.0"),
                user_namespaces: check(true, "max 10"),
                cgroups: check(false, "none"),
            },
            capabilities: Some(agentbox_api::caps::Capabilities {
                effective: vec!["CAP_KILL".into()],
                permitted: vec!["CAP_KILL".into()],
                inheritable: vec![],
                ambient: vec![],
                bounding: vec!["CAP_KILL".into()],
            }),
            disk: Some(DiskStatus {
                mode: DiskMode::Watcher,
                limit_mb: 10240,
                detail: "no project quota".into(),
            }),
        },
        &json!({"agents": [{"tid": "a", "state": "running"}], "checks": [], "slots": [], "finished": 3,
            "waiters": 1, "backends": [bv], "ready": false,
            "host": {"ready": false, "reasons": ["cgroups: none"],
                "bwrap": {"ok": true, "detail": "bubblewrap 0.11.0"},
                "user_namespaces": {"ok": true, "detail": "max 10"},
                "cgroups": {"ok": false, "detail": "none"}},
            "capabilities": {"effective": ["CAP_KILL"], "permitted": ["CAP_KILL"],
                "inheritable": [], "ambient": [], "bounding": ["CAP_KILL"]},
            "disk": {"mode": "watcher", "limit_mb": 10240, "detail": "no project quota"}}),
    );
}

#[test]
fn gateway_types() {
    let open = OpenTask {
        tid: "t1".into(),
        model: "local".into(),
        token: "tok".into(),
        budget: Budget {
            tokens: Some(1000),
            usd: None,
        },
    };
    let v = json!({"tid": "t1", "model": "local", "token": "tok", "budget": {"tokens": 1000}});
    strict_round_trip(&open, &v);
    refuses_unknown::<Budget>(&json!({"usd": 1.5}));
    let no_budget: OpenTask =
        serde_json::from_value(json!({"tid": "t", "model": "m", "token": "x"})).unwrap();
    assert_eq!(no_budget.budget, Budget::default());
    let view = TaskView {
        tid: "t1".into(),
        model: "local".into(),
        state: TaskState::Open,
        socket: Some("/d/sockets/t1/llm.sock".into()),
        usage: TaskUsage {
            input_tokens: 10,
            output_tokens: 5,
            cache_read_input_tokens: 2,
            cache_creation_input_tokens: 1,
            total_tokens: 18,
            requests: 1,
            cost_usd: 0.5,
        },
        budget: Budget {
            tokens: Some(1000),
            usd: Some(2.0),
        },
        remaining: Remaining {
            tokens: Some(982),
            usd: None,
        },
        reserved: Reserved {
            tokens: 0,
            usd: 0.0,
        },
        in_flight: 0,
    };
    let vv = json!({"tid": "t1", "model": "local", "state": "open",
        "socket": "/d/sockets/t1/llm.sock",
        "usage": {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 2,
            "cache_creation_input_tokens": 1, "total_tokens": 18, "requests": 1, "cost_usd": 0.5},
        "budget": {"tokens": 1000, "usd": 2.0},
        "remaining": {"tokens": 982, "usd": null},
        "reserved": {"tokens": 0, "usd": 0.0}, "in_flight": 0});
    round_trip(&view, &vv);
    round_trip(
        &GatewayStatus {
            ok: true,
            open_tasks: 1,
            tasks: vec![view],
            bridge_token: false,
            models: vec!["local".into()],
            capabilities: Some(agentbox_api::caps::Capabilities::default()),
            event_loops: vec![1, 0],
        },
        &json!({"ok": true, "open_tasks": 1, "tasks": [vv], "bridge_token": false,
            "models": ["local"], "capabilities": {"effective": [], "permitted": [],
                "inheritable": [], "ambient": [], "bounding": []},
            "event_loops": [1, 0]}),
    );
}

#[test]
fn error_envelope() {
    let e = ErrorEnvelope::new("invalid_tid", "bad tid");
    let v = json!({"error": {"code": "invalid_tid", "message": "bad tid"}});
    strict_round_trip(&e, &v);
}
