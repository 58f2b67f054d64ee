//! Hole 10 (issue 9), the smaller leaks: what the host and the caller learn that they should
//! not, or do not learn that they should. Each test is the adversarial proof of one class, run
//! as root against the real launcher and bwrap.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentbox_tests::harness::launcher::{Launcher, Options};
use serde_json::{Value, json};

fn start_agent(l: &Launcher, tid: &str, body: Value) -> Value {
    let mut body = body;
    body["tid"] = json!(tid);
    body["model"] = json!("m1");
    body["timeout_s"] = json!(120);
    let r = l.post("/agents", &body);
    assert_eq!(r.status, 201, "{}\n{}", r.raw, l.stderr());
    r.body
}

fn wait_agent(l: &Launcher, tid: &str) -> Value {
    let r = l.get(&format!("/agents/{tid}?wait=1"));
    assert_eq!(r.status, 200, "{}", r.raw);
    r.body
}

/// Hole 10c: a sandbox bwrap cannot set up (here: the cgroup allows bwrap too few processes to
/// fork the command) is reported as such (`setup_failed`, no exit code, state `failed`), not
/// as the command exiting 1, which stays an ordinary exit.
#[test]
fn a_failed_sandbox_setup_is_not_the_command_exiting_1() {
    let broken = Launcher::start(Options {
        pids: 2,
        ..Options::default()
    });
    let v = broken.probe("setup1", "echo ran");
    assert_eq!(v["setup_failed"], true, "{v}\n{}", broken.stderr());
    assert_eq!(v["exit_code"], Value::Null, "{v}");
    assert!(!v["stdout"].as_str().unwrap().contains("ran"), "{v}");
    assert!(v["stderr"].as_str().unwrap().contains("bwrap"), "{v}");

    broken.workspace("setup2");
    let _gw = broken.gateway_socket("setup2");
    start_agent(&broken, "setup2", json!({"cmd": ["claude", "echo ran"]}));
    let v = wait_agent(&broken, "setup2");
    assert_eq!(v["state"], "failed", "{v}");
    assert_eq!(v["setup_failed"], true, "{v}");
    assert_eq!(v["exit_code"], Value::Null, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap_or("")
            .contains("could not be set up"),
        "{v}"
    );

    let fine = Launcher::start(Options::default());
    let v = fine.probe("setup3", "echo ran; exit 1");
    assert_eq!(v["setup_failed"], false, "{v}");
    assert_eq!(v["exit_code"], 1, "{v}");
    assert!(v["stdout"].as_str().unwrap().contains("ran"), "{v}");
    fine.workspace("setup4");
    let _gw = fine.gateway_socket("setup4");
    start_agent(&fine, "setup4", json!({"cmd": ["claude", "exit 1"]}));
    let v = wait_agent(&fine, "setup4");
    assert_eq!(v["state"], "exited", "{v}");
    assert_eq!(v["setup_failed"], false, "{v}");
    assert_eq!(v["exit_code"], 1, "{v}");
    assert_eq!(v["error"], Value::Null, "{v}");
}
