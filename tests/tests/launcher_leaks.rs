//! Hole 10 (issue 9), the smaller leaks: what the host and the caller learn that they should
//! not, or do not learn that they should. Each test is the adversarial proof of one class, run
//! as root against the real launcher and bwrap.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentbox_tests::harness::launcher::{Launcher, Options, cmdlines_containing};
use serde_json::{Value, json};

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

    let v = broken.run_agent("setup2", json!({"cmd": ["claude", "echo ran"]}));
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
    let v = fine.run_agent("setup4", json!({"cmd": ["claude", "exit 1"]}));
    assert_eq!(v["state"], "exited", "{v}");
    assert_eq!(v["setup_failed"], false, "{v}");
    assert_eq!(v["exit_code"], 1, "{v}");
    assert_eq!(v["error"], Value::Null, "{v}");
}

/// Hole 10a: the prompt travels in the request's `stdin`, never in an argument list: while the
/// agent runs, no process on the host has it in its `/proc/<pid>/cmdline`, and the agent
/// reads it on its standard input.
#[test]
fn the_prompt_is_in_no_host_visible_command_line() {
    let l = Launcher::start(Options::default());
    let ws = l.workspace("prompt1");
    let _gw = l.gateway_socket("prompt1");
    let prompt = "Fix the tests; the secret plan is prompt-marker-19c4.\nSecond line.";
    // The stand-in claude runs its argument as a script: it saves its stdin, then waits long
    // enough to be looked at.
    l.start_agent(
        "prompt1",
        json!({"cmd": ["claude", "cat > got-prompt; sleep 2.5"], "stdin": prompt}),
    );
    let mut seen = Vec::new();
    for _ in 0..40 {
        seen.extend(cmdlines_containing("prompt-marker-19c4"));
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let v = l.wait_agent("prompt1");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert!(seen.is_empty(), "the prompt in a command line: {seen:?}");
    assert_eq!(
        std::fs::read_to_string(ws.join("got-prompt")).unwrap(),
        prompt
    );

    // Without `stdin` the agent reads an empty stdin, as before.
    let v = l.run_agent("prompt2", json!({"cmd": ["claude", "wc -c"]}));
    assert_eq!(v["stdout"].as_str().unwrap().trim(), "0", "{v}");
    // The sealed stdin cannot be written through, even by reopening it.
    let r = l.post(
        "/agents",
        &json!({"tid": "prompt2", "model": "m1", "timeout_s": 60, "stdin": "x",
                "cmd": ["claude", "echo y >> /proc/self/fd/0 && echo wrote || echo refused"]}),
    );
    assert_eq!(r.status, 201, "{}", r.raw);
    let v = l.wait_agent("prompt2");
    assert!(v["stdout"].as_str().unwrap().contains("refused"), "{v}");
    let r = l.post(
        "/agents",
        &json!({"tid": "prompt3", "model": "m1", "timeout_s": 60, "cmd": ["claude"],
                "stdin": "x".repeat((1 << 20) + 1)}),
    );
    // Over the bound: refused (by the body limit first).
    assert!(r.status == 400 || r.status == 413, "{}", r.raw);
}

/// Hole 10b: the sandbox's `/proc/self/mountinfo` names no host path but the roots of the binds
/// that cannot have another: the kernel shows a bind mount's root as the bound directory's path
/// *relative to the root of its filesystem*, whatever path it was mounted through (the staging
/// mounts under `mnt/<tid>/` do not appear), so `/workspace`, `/run/gw`, `/opt/venv` and the
/// claude binary show where they live on the host. Everything else is a fresh filesystem, a
/// system directory bound to the same path, or one of bwrap's own neutral files; the data dir
/// appears in the workspace and gateway lines only.
#[test]
fn mountinfo_names_no_host_path_but_the_unavoidable_bind_roots() {
    let l = Launcher::start(Options::default());
    let venv = l.venv("v1");
    let v = l.run_agent(
        "mi1",
        json!({"cmd": ["claude", "cat /proc/self/mountinfo"], "venv": venv.to_str().unwrap()}),
    );
    let ws = l.data.join("tasks/mi1/workspace");
    assert_eq!(v["exit_code"], 0, "{v}");
    let text = v["stdout"].as_str().unwrap();
    let data = l.data.to_str().unwrap();
    let claude = l.base.join("fake-claude");
    let gateway = l.data.join("sockets/mi1");
    // Mount point -> the host path its root must be (the binds that cannot be renamed).
    let documented = [
        ("/workspace", ws.to_str().unwrap()),
        ("/run/gw", gateway.to_str().unwrap()),
        ("/opt/venv", venv.to_str().unwrap()),
        ("/opt/agentbox/bin/claude", claude.to_str().unwrap()),
    ];
    let mut bad = Vec::new();
    let mut seen = 0;
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let (root, point) = (f[3], f[4]);
        let ok = if let Some((_, host)) = documented.iter().find(|(p, _)| *p == point) {
            seen += 1;
            root == *host
        } else {
            root == "/"
                || root == point
                || root.starts_with("/newroot")
                || root.starts_with("/bindfile")
                || format!("/dev{root}") == point
        };
        let names_data = line.contains(data) && point != "/workspace" && point != "/run/gw";
        if !ok || names_data || line.contains("/mnt/mi1") {
            bad.push(line.to_owned());
        }
    }
    assert_eq!(seen, documented.len(), "{text}");
    assert!(
        bad.is_empty(),
        "host paths in the sandbox's mountinfo: {bad:#?}"
    );
}
