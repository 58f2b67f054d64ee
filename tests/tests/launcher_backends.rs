//! vLLM backends against the real launcher, with `fakellm` (its `GET /health` answers 200) as
//! the server: start → healthy → status, idempotent start, switching stops the idle other, 409
//! while an agent of a backend runs, stop-all, a command that never becomes healthy, one that
//! exits at once, validation, and shutdown and crash recovery (attack catalogue §10 item 33).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use agentbox_tests::harness::launcher::{
    self as common, Launcher, Options, SERVICE_UID, chown, eventually, processes_with,
};
use serde_json::{Value, json};

/// A fakellm to be run by the launcher as a backend on its own port, with its script and
/// request log in a directory the service user can write.
struct Fake {
    dir: tempfile::TempDir,
    port: u16,
}

impl Fake {
    fn new() -> Fake {
        let dir = common::temp_dir("backend-it-", 0o755);
        chown(dir.path(), SERVICE_UID);
        std::fs::write(
            dir.path().join("script.json"),
            json!({"fallback": {"text": "hi"}}).to_string(),
        )
        .unwrap();
        Fake {
            dir,
            port: common::free_port(),
        }
    }

    fn script(&self) -> PathBuf {
        self.dir.path().join("script.json")
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("requests.jsonl")
    }

    /// The fakellm argv, listening on the backend's port.
    fn command(&self) -> Vec<String> {
        vec![
            common::fakellm_bin().display().to_string(),
            "--script".into(),
            self.script().display().to_string(),
            "--log".into(),
            self.log().display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{}", self.port),
        ]
    }

    /// What this fakellm's command line starts with, for [`processes_with`].
    fn marker(&self) -> String {
        format!(
            "{} --script {}",
            common::fakellm_bin().display(),
            self.script().display()
        )
    }

    fn health_probes(&self) -> usize {
        std::fs::read_to_string(self.log())
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"served_by\":\"health\""))
            .count()
    }

    fn running(&self) -> bool {
        !processes_with(&self.marker()).is_empty()
    }
}

fn model_toml(model: &str, port: u16, command: &[String]) -> String {
    let argv: Vec<String> = command.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "[models.{model}]\nbackend = \"vllm\"\nupstream_model = \"x\"\nport = {port}\ncommand = [{}]\n",
        argv.join(", ")
    )
}

fn launcher(models: &[(&str, u16, Vec<String>)], start_timeout_s: u64) -> Launcher {
    let extra: String = models
        .iter()
        .map(|(m, port, cmd)| model_toml(m, *port, cmd))
        .collect();
    Launcher::start(Options {
        extra_config: extra,
        backend_start_timeout_s: start_timeout_s,
        ..Options::default()
    })
}

/// Two fakellm backends, `va` and `vb`, on a launcher that waits up to 120 s for health.
fn two_backends() -> (Fake, Fake, Launcher) {
    let a = Fake::new();
    let b = Fake::new();
    let l = launcher(
        &[("va", a.port, a.command()), ("vb", b.port, b.command())],
        120,
    );
    (a, b, l)
}

/// Starts agent `tid` of `model` sleeping in its sandbox; keep the returned gateway listener
/// alive while it runs.
fn sleeping_agent(l: &Launcher, tid: &str, model: &str) -> std::os::unix::net::UnixListener {
    let (_, gw) = l.prepare_task(tid);
    let r = l.post(
        "/agents",
        &json!({"tid": tid, "model": model, "cmd": ["claude", "sleep 1000"], "timeout_s": 600}),
    );
    assert_eq!(r.status, 201, "{}", r.raw);
    gw
}

fn start(l: &Launcher, model: &str) -> common::Resp {
    l.post(&format!("/backends/{model}/start"), &json!({}))
}

fn stop_all(l: &Launcher) -> common::Resp {
    l.post("/backends/vllm/stop", &json!({}))
}

fn backend(l: &Launcher, model: &str) -> Value {
    let r = l.get("/status");
    assert_eq!(r.status, 200, "{}", r.raw);
    r.body["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["model"] == model)
        .cloned()
        .unwrap_or_else(|| panic!("no backend {model} in {}", r.raw))
}

fn proc_status_field(pid: u64, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_owned()))
        .unwrap()
}

fn proc_pgrp(pid: u64) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(") ").unwrap();
    rest.split_whitespace().nth(2).unwrap().parse().unwrap()
}

fn record(l: &Launcher, model: &str) -> PathBuf {
    l.data.join("state/backends").join(format!("{model}.json"))
}

#[test]
fn start_is_healthy_idempotent_supervised_and_stoppable() {
    let fake = Fake::new();
    let other = Fake::new();
    let l = launcher(
        &[
            ("v1", fake.port, fake.command()),
            ("v2", other.port, other.command()),
        ],
        120,
    );
    assert_eq!(backend(&l, "v1")["state"], "stopped");
    let r = start(&l, "v1");
    assert_eq!(r.status, 200, "{}\n{}", r.raw, l.stderr());
    assert_eq!(r.body["model"], "v1");
    assert_eq!(r.body["state"], "healthy");
    assert_eq!(r.body["port"], fake.port);
    assert_eq!(r.body["stopped"], json!([]));
    let pid = r.body["pid"].as_u64().unwrap();
    assert!(
        fake.health_probes() >= 1,
        "the launcher never probed /health"
    );

    // Supervised as promised: the service user, its own process group, its own cgroup.
    let uid = SERVICE_UID.to_string();
    assert_eq!(proc_status_field(pid, "Uid:"), [uid.as_str(); 4].join("\t"));
    assert_eq!(proc_status_field(pid, "Groups:"), "");
    assert_eq!(proc_status_field(pid, "CapEff:"), "0000000000000000");
    assert_eq!(proc_pgrp(pid), pid);
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(
        cgroups.contains(&format!("/{}/backend.v1\n", l.cgroup_parent)),
        "{cgroups}"
    );
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let env = String::from_utf8_lossy(&env).replace('\0', "\n");
    assert!(
        !env.contains("RUST_LOG"),
        "the launcher's environment leaked: {env}"
    );
    assert!(
        env.contains(&format!(
            "HOME={}",
            l.data.join("backends/v1/home").display()
        )),
        "{env}"
    );
    for log in ["stdout", "stderr"] {
        assert_eq!(common::owner_of(&l.data.join("backends/v1").join(log)), 0);
    }
    assert!(record(&l, "v1").exists());

    let status = l.get("/status");
    assert_eq!(
        status.body["backends"],
        json!([
            {"model": "v1", "state": "healthy", "pid": pid, "port": fake.port, "agents": 0, "error": null},
            {"model": "v2", "state": "stopped", "pid": null, "port": other.port, "agents": 0, "error": null},
        ]),
        "{}",
        status.raw
    );

    // Idempotent: the same process, still healthy.
    let again = start(&l, "v1");
    assert_eq!(again.status, 200, "{}", again.raw);
    assert_eq!(again.body["pid"], pid);
    assert_eq!(again.body["state"], "healthy");

    let r = stop_all(&l);
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(r.body["stopped"], json!(["v1"]));
    assert!(!fake.running());
    assert_eq!(backend(&l, "v1")["state"], "stopped");
    assert_eq!(backend(&l, "v1")["pid"], Value::Null);
    assert!(!record(&l, "v1").exists());
    assert!(l.cgroup_dirs().is_empty(), "{:?}", l.cgroup_dirs());
    let r = stop_all(&l);
    assert_eq!((r.status, r.body["stopped"].clone()), (200, json!([])));
}

#[test]
fn starting_another_model_stops_the_idle_one() {
    let (a, b, l) = two_backends();
    assert_eq!(start(&l, "va").status, 200);
    assert!(a.running());
    let r = start(&l, "vb");
    assert_eq!(r.status, 200, "{}\n{}", r.raw, l.stderr());
    assert_eq!(r.body["state"], "healthy");
    assert_eq!(r.body["stopped"], json!(["va"]));
    assert!(!a.running(), "the idle backend still runs");
    assert!(b.running());
    assert_eq!(backend(&l, "va")["state"], "stopped");
    assert_eq!(backend(&l, "vb")["state"], "healthy");
    // And back.
    let r = start(&l, "va");
    assert_eq!(r.body["stopped"], json!(["vb"]), "{}", r.raw);
    assert!(!b.running());
    assert_eq!(stop_all(&l).body["stopped"], json!(["va"]));
}

#[test]
fn a_busy_backend_is_neither_switched_away_nor_stopped() {
    let (a, b, l) = two_backends();
    assert_eq!(start(&l, "va").status, 200);
    let pid = backend(&l, "va")["pid"].clone();
    let _gw = sleeping_agent(&l, "ag1", "va");
    assert_eq!(backend(&l, "va")["agents"], 1);

    let r = start(&l, "vb");
    assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.raw);
    assert!(r.message().contains("va (1 running agent(s))"), "{}", r.raw);
    assert!(!b.running(), "the other backend was started anyway");
    let r = stop_all(&l);
    assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.raw);
    let va = backend(&l, "va");
    assert_eq!(
        (va["state"].clone(), va["pid"].clone()),
        (json!("healthy"), pid)
    );
    assert!(a.running());
    // Starting the busy backend's own model is fine: it is already healthy.
    assert_eq!(start(&l, "va").status, 200);

    assert_eq!(l.request("DELETE", "/agents/ag1", None).status, 200);
    assert_eq!(backend(&l, "va")["agents"], 0);
    let r = stop_all(&l);
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(r.body["stopped"], json!(["va"]));
    assert!(!a.running());
}

#[test]
fn stop_all_is_refused_while_any_vllm_agent_runs_even_without_its_backend() {
    let a = Fake::new();
    let l = launcher(&[("va", a.port, a.command())], 120);
    let _gw = sleeping_agent(&l, "ag2", "va");
    let r = stop_all(&l);
    assert_eq!((r.status, r.code()), (409, "conflict"), "{}", r.raw);
    // An agent of a non-vLLM model does not block anything.
    assert_eq!(l.request("DELETE", "/agents/ag2", None).status, 200);
    let _gw3 = sleeping_agent(&l, "ag3", "m1");
    assert_eq!(stop_all(&l).status, 200);
    assert_eq!(start(&l, "va").status, 200);
    assert_eq!(stop_all(&l).body["stopped"], json!(["va"]));
}

#[test]
fn a_backend_that_never_becomes_healthy_is_killed_and_failed() {
    let marker = format!("{}", 900_000 + std::process::id());
    let port = common::free_port();
    let cmd = vec!["/bin/sleep".to_owned(), marker.clone()];
    let l = launcher(&[("slow", port, cmd)], 2);
    let r = start(&l, "slow");
    assert_eq!((r.status, r.code()), (502, "backend_failed"), "{}", r.raw);
    let msg = r.message();
    assert!(msg.contains("not healthy within 2s"), "{msg}");
    assert!(msg.contains("killed"), "{msg}");
    assert!(processes_with(&format!("/bin/sleep {marker}")).is_empty());
    let b = backend(&l, "slow");
    assert_eq!(b["state"], "failed", "{b}");
    assert_eq!(b["pid"], Value::Null);
    assert!(b["error"].as_str().unwrap().contains("not healthy"), "{b}");
    assert!(!record(&l, "slow").exists());
    assert!(l.cgroup_dirs().is_empty(), "{:?}", l.cgroup_dirs());
}

#[test]
fn a_backend_that_exits_at_once_fails_with_its_reason() {
    let port = common::free_port();
    let cmd = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        "echo starting; echo 'cannot load the model' >&2; exit 3".to_owned(),
    ];
    let l = launcher(
        &[
            ("quits", port, cmd),
            (
                "absent",
                common::free_port(),
                vec!["/nonexistent/vllm".to_owned()],
            ),
        ],
        120,
    );
    let r = start(&l, "quits");
    assert_eq!((r.status, r.code()), (502, "backend_failed"), "{}", r.raw);
    let msg = r.message();
    assert!(msg.contains("exited before becoming healthy"), "{msg}");
    assert!(msg.contains("exit status: 3"), "{msg}");
    assert!(msg.contains("cannot load the model"), "{msg}");
    assert_eq!(backend(&l, "quits")["state"], "failed");
    assert_eq!(
        std::fs::read_to_string(l.data.join("backends/quits/stdout")).unwrap(),
        "starting\n"
    );
    // A failed backend can be started again (and fails again, with fresh logs).
    let r = start(&l, "quits");
    assert_eq!(r.code(), "backend_failed", "{}", r.raw);
    assert_eq!(
        std::fs::read_to_string(l.data.join("backends/quits/stdout.1")).unwrap(),
        "starting\n"
    );

    let r = start(&l, "absent");
    assert_eq!((r.status, r.code()), (502, "backend_failed"), "{}", r.raw);
    assert!(
        r.message().contains("cannot start \"/nonexistent/vllm\""),
        "{}",
        r.raw
    );
    assert_eq!(backend(&l, "absent")["state"], "failed");
    assert!(l.cgroup_dirs().is_empty(), "{:?}", l.cgroup_dirs());
}

#[test]
fn unknown_path_like_and_non_vllm_models_are_refused() {
    let a = Fake::new();
    let l = launcher(&[("va", a.port, a.command())], 120);
    for (path, status, code) in [
        ("/backends/nope/start", 400, "unknown_model"),
        ("/backends/..%2F..%2Fetc/start", 400, "unknown_model"),
        ("/backends/a%0Ab/start", 400, "unknown_model"),
        ("/backends/.hidden/start", 400, "unknown_model"),
        ("/backends/m1/start", 400, "not_vllm"),
        ("/backends/va/stop", 404, "no_route"),
    ] {
        // No body: the fallback route answers without reading one.
        let r = l.request("POST", path, None);
        assert_eq!((r.status, r.code()), (status, code), "{path}: {}", r.raw);
        let msg = r.message();
        assert!(!msg.contains('\n'), "{path}: unescaped input in {msg:?}");
    }
    let r = l.get("/backends/va/start");
    assert_eq!((r.status, r.code()), (405, "method_not_allowed"));
    let r = l.post("/backends/va/start", &json!({"model": "vb"}));
    assert_eq!((r.status, r.code()), (400, "bad_request"), "{}", r.raw);
    assert!(!a.running());
    assert_eq!(backend(&l, "va")["state"], "stopped");
}

#[test]
fn backends_stop_with_the_launcher_and_leftovers_die_after_a_crash() {
    let a = Fake::new();
    let b = Fake::new();
    // `vb` runs fakellm as a child of a shell, so the server itself does not get the
    // parent-death signal when the launcher dies: a leftover for the restart to find.
    let mut wrapped = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        "\"$0\" \"$@\"; exit $?".to_owned(),
    ];
    wrapped.extend(b.command());
    let mut l = launcher(&[("va", a.port, a.command()), ("vb", b.port, wrapped)], 120);

    assert_eq!(start(&l, "va").status, 200);
    assert_eq!(l.stop(), Some(0));
    assert!(!a.running(), "SIGTERM left the backend running");
    assert!(!record(&l, "va").exists());
    l.spawn();
    assert_eq!(backend(&l, "va")["state"], "stopped");

    let r = start(&l, "vb");
    assert_eq!(r.status, 200, "{}\n{}", r.raw, l.stderr());
    l.crash();
    assert!(
        b.running(),
        "the server died with the launcher; nothing left to find"
    );
    assert!(record(&l, "vb").exists());
    l.spawn();
    assert!(!b.running(), "a leftover backend survived the restart");
    assert!(!record(&l, "vb").exists());
    assert_eq!(backend(&l, "vb")["state"], "stopped");
    assert!(l.cgroup_dirs().is_empty(), "{:?}", l.cgroup_dirs());
    // The port is free again: the backend starts anew.
    let r = start(&l, "vb");
    assert_eq!(r.status, 200, "{}", r.raw);
    eventually("the new backend runs", || b.running().then_some(()));
}

/// The data directory is shared with the service user; a backend's directory swapped for a
/// link must not make the launcher write logs elsewhere.
#[test]
fn a_planted_backend_directory_is_refused() {
    let a = Fake::new();
    let l = launcher(&[("va", a.port, a.command())], 120);
    let elsewhere = l.base.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    // `backends/` is root-only, so only root could plant this; the resolver still refuses it.
    std::os::unix::fs::symlink(&elsewhere, l.data.join("backends/va")).unwrap();
    let r = start(&l, "va");
    assert_eq!((r.status, r.code()), (400, "unsafe_path"), "{}", r.raw);
    assert!(
        std::fs::read_dir(&elsewhere).unwrap().next().is_none(),
        "the launcher wrote through the link"
    );
    assert!(!a.running());
    // Refused before anything started: the backend never left `stopped`.
    assert_eq!(backend(&l, "va")["state"], "stopped");
}
