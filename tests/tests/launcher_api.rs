//! The launcher's HTTP surface against the real binary: startup and config errors, caller
//! authorization by SO_PEERCRED, request validation (attack catalogue §10 items 1, 2, 7-11),
//! error bodies, and `GET /status`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::symlink;
use std::process::Command;

use agentbox_tests::harness::launcher::{self as common, Launcher, Options, SERVICE_UID, chown};
use agentbox_tests::harness::workspace_bin;
use serde_json::{Value, json};

fn agent_body(tid: &str) -> Value {
    json!({"tid": tid, "model": "m1", "cmd": ["claude", "true"], "env": {}, "timeout_s": 60})
}

#[test]
fn bad_config_exits_78_and_socket_is_guarded() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("bad.toml");
    std::fs::write(&cfg, "[launcher]\nnot_a_key = 1\n").unwrap();
    let out = Command::new(workspace_bin("agentbox-launcher", "agentbox-launcher").unwrap())
        .arg("--config")
        .arg(&cfg)
        .arg("--service-uid")
        .arg("64010")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(78),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("launcher.not_a_key"));

    let l = Launcher::start(Options::default());
    let meta = std::fs::metadata(&l.socket).unwrap();
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!((meta.uid(), meta.gid()), (0, SERVICE_UID));
}

/// curl as another identity, so the kernel reports that uid through SO_PEERCRED.
fn curl_as(l: &Launcher, uid: u32, gid: u32) -> (Option<i32>, String) {
    use std::os::unix::process::CommandExt;
    let out = Command::new("curl")
        .args(["-s", "-o", "-", "-w", "\n%{http_code}", "--unix-socket"])
        .arg(&l.socket)
        .arg("http://localhost/status")
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn only_root_and_the_service_uid_are_served() {
    let l = Launcher::start(Options::default());
    // In the socket's group but not the service uid: reaches the socket, refused by peer uid.
    let (rc, out) = curl_as(&l, 65010, SERVICE_UID);
    assert_eq!(rc, Some(0));
    assert!(out.ends_with("\n403"), "{out}");
    assert!(out.contains("\"forbidden\""), "{out}");
    // Not in the group: the socket's mode already keeps it out.
    let (rc, _) = curl_as(&l, 65011, 65011);
    assert_ne!(rc, Some(0));
    // The service uid itself is served.
    let (rc, out) = curl_as(&l, SERVICE_UID, SERVICE_UID);
    assert_eq!(rc, Some(0));
    assert!(out.ends_with("\n200"), "{out}");
}

#[test]
fn validation_errors_have_codes() {
    let l = Launcher::start(Options::default());
    let (_, _gw) = l.prepare_task("ok");
    let cases: Vec<(Value, u16, &str)> = vec![
        (
            json!({"tid": "", "model": "m1", "cmd": ["claude"], "timeout_s": 1}),
            400,
            "invalid_tid",
        ),
        (
            json!({"tid": "A", "model": "m1", "cmd": ["claude"], "timeout_s": 1}),
            400,
            "invalid_tid",
        ),
        (
            json!({"tid": "-x", "model": "m1", "cmd": ["claude"], "timeout_s": 1}),
            400,
            "invalid_tid",
        ),
        (
            json!({"tid": "x/y", "model": "m1", "cmd": ["claude"], "timeout_s": 1}),
            400,
            "invalid_tid",
        ),
        (
            json!({"tid": "..", "model": "m1", "cmd": ["claude"], "timeout_s": 1}),
            400,
            "invalid_tid",
        ),
        (
            json!({"tid": "a\n", "model": "m1", "cmd": ["claude"], "timeout_s": 1}),
            400,
            "invalid_tid",
        ),
        (
            json!({"tid": "a".repeat(65), "model": "m1", "cmd": ["claude"], "timeout_s": 1}),
            400,
            "invalid_tid",
        ),
        (
            json!({"tid": "ok", "model": "nope", "cmd": ["claude"], "timeout_s": 1}),
            400,
            "unknown_model",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["/usr/bin/claude"], "timeout_s": 1}),
            400,
            "invalid_cmd",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude;sh"], "timeout_s": 1}),
            400,
            "invalid_cmd",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude "], "timeout_s": 1}),
            400,
            "invalid_cmd",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": [], "timeout_s": 1}),
            400,
            "invalid_cmd",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "env": {"LD_PRELOAD": "/tmp/x.so"}, "timeout_s": 1}),
            400,
            "invalid_env",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "env": {"ANTHROPIC_BASE_URL": "http://evil"}, "timeout_s": 1}),
            400,
            "invalid_env",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "env": {"GIT_DIR": "/"}, "timeout_s": 1}),
            400,
            "invalid_env",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "timeout_s": 0}),
            400,
            "invalid_timeout",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "timeout_s": 601}),
            400,
            "invalid_timeout",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "timeout_s": 1.5}),
            400,
            "bad_request",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "timeout_s": -1}),
            400,
            "bad_request",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "timeout_s": 1, "extra": true}),
            400,
            "bad_request",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "timeout_s": 1, "venv": "/usr"}),
            400,
            "invalid_venv",
        ),
        (
            json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "timeout_s": 1, "token": "a b"}),
            400,
            "invalid_token",
        ),
        (
            json!({"tid": "nows", "model": "m1", "cmd": ["claude"], "timeout_s": 1}),
            404,
            "not_found",
        ),
    ];
    for (body, status, code) in cases {
        let r = l.post("/agents", &body);
        assert_eq!((r.status, r.code()), (status, code), "{body}: {}", r.raw);
        let msg = r.message();
        assert!(!msg.contains('\n'), "unescaped input in {msg:?}");
    }
    let venv = l.venvs.join("v1");
    std::fs::create_dir_all(venv.join("bin")).unwrap();
    let v = venv.display().to_string();
    for bad in [format!("{v}/../v1"), format!("{v}/"), v.clone()] {
        let r = l.post(
            "/agents",
            &json!({"tid": "ok", "model": "m1", "cmd": ["claude"], "timeout_s": 1, "venv": bad}),
        );
        assert_eq!(r.code(), "invalid_venv", "{bad}: {}", r.raw);
    }
    // Bad JSON, oversized bodies, unknown routes and methods all answer in the same shape.
    let big = json!({"tid": "ok", "command": "x".repeat(2 << 20), "timeout_s": 1});
    for (case, method, path, body, status, code) in [
        (
            "bad JSON",
            "POST",
            "/agents",
            Some(json!("not an object")),
            400,
            "bad_request",
        ),
        (
            "oversized body",
            "POST",
            "/checks",
            Some(big),
            413,
            "body_too_large",
        ),
        ("unknown route", "GET", "/nope", None, 404, "no_route"),
        (
            "unknown method",
            "PUT",
            "/agents",
            None,
            405,
            "method_not_allowed",
        ),
        (
            "unknown task",
            "GET",
            "/agents/unknown",
            None,
            404,
            "unknown_task",
        ),
        (
            "not a vLLM model",
            "POST",
            "/backends/m1/start",
            Some(json!({})),
            400,
            "not_vllm",
        ),
    ] {
        let r = l.request(method, path, body.as_ref());
        assert_eq!((r.status, r.code()), (status, code), "{case}: {}", r.raw);
    }
    // Nothing above started anything.
    assert!(l.cgroup_dirs().is_empty());
}

#[test]
fn symlinked_or_foreign_workspaces_are_refused_untouched() {
    let l = Launcher::start(Options::default());
    let _gw = l.gateway_socket("t1");
    let _gw2 = l.gateway_socket("t2");
    let _gw3 = l.gateway_socket("t3");
    // tasks/t1 is a symlink to a directory holding a service-owned "workspace".
    let elsewhere = l.base.join("elsewhere");
    std::fs::create_dir_all(elsewhere.join("workspace")).unwrap();
    chown(&elsewhere.join("workspace"), SERVICE_UID);
    symlink(&elsewhere, l.data.join("tasks/t1")).unwrap();
    let r = l.post("/agents", &agent_body("t1"));
    assert_eq!((r.status, r.code()), (400, "unsafe_path"), "{}", r.raw);
    assert_eq!(common::owner_of(&elsewhere.join("workspace")), SERVICE_UID);
    // The workspace itself is a symlink to /etc.
    std::fs::create_dir_all(l.data.join("tasks/t2")).unwrap();
    symlink("/etc", l.data.join("tasks/t2/workspace")).unwrap();
    let r = l.post("/agents", &agent_body("t2"));
    assert_eq!(r.code(), "unsafe_path", "{}", r.raw);
    assert_eq!(common::owner_of(std::path::Path::new("/etc")), 0);
    // Owned by root rather than the service uid.
    std::fs::create_dir_all(l.data.join("tasks/t3/workspace")).unwrap();
    let r = l.post("/agents", &agent_body("t3"));
    assert_eq!(r.code(), "unsafe_path", "{}", r.raw);
    assert!(r.message().contains("owned by uid 0"));
    // A hard link to a host file inside the workspace: refused before anything changes hands.
    let (ws, _gw4) = l.prepare_task("t4");
    let host_file = l.base.join("host-file");
    std::fs::write(&host_file, "x").unwrap();
    std::fs::write(ws.join("a"), "x").unwrap();
    chown(&ws.join("a"), SERVICE_UID);
    std::fs::hard_link(&host_file, ws.join("zz")).unwrap();
    let r = l.post("/agents", &agent_body("t4"));
    assert_eq!(r.code(), "unsafe_path", "{}", r.raw);
    assert_eq!(common::owner_of(&host_file), 0);
    assert_eq!(common::owner_of(&ws), SERVICE_UID);
    assert_eq!(common::owner_of(&ws.join("a")), SERVICE_UID);
    // No gateway socket for the task.
    l.workspace("t5");
    let r = l.post("/agents", &agent_body("t5"));
    assert_eq!((r.status, r.code()), (404, "not_found"), "{}", r.raw);
    assert!(l.cgroup_dirs().is_empty());
}

#[test]
fn status_reports_host_readiness() {
    let l = Launcher::start(Options::default());
    let r = l.get("/status");
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(r.body["ready"], true, "{}", r.raw);
    assert!(
        r.body["host"]["bwrap"]["detail"]
            .as_str()
            .unwrap()
            .contains("bubblewrap")
    );
    assert!(
        r.body["host"]["cgroups"]["detail"]
            .as_str()
            .unwrap()
            .contains("memory")
    );
    assert_eq!(r.body["agents"], json!([]));
    assert_eq!(r.body["waiters"], 0);
}
