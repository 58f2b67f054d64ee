//! Loopback port squatting: while the bridge (or a vLLM server) is down, another local user binds
//! its port. The gateway must not send that listener the agent's request or the bridge token,
//! and the launcher must not take its `/health` answer for the backend's. The squatter is a real
//! `fakellm` running as `nobody` (65534); the daemons are the real processes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use agentbox_tests::harness::launcher::{self as common, Launcher, Options, processes_with};
use agentbox_tests::harness::{GatewayProcess, unix_request};
use serde_json::{Value, json};

const NOBODY: u32 = 65534;
const TOKEN: &str = "task-token-0123456789abcdef";
const BRIDGE_TOKEN: &str = "bridge-token-the-squatter-must-not-see";

/// A fakellm bound to a loopback port by another user, logging whatever reaches it.
struct Squatter {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Squatter {
    fn start() -> Squatter {
        let dir = common::temp_dir("squatter-", 0o777);
        let script = dir.path().join("script.json");
        std::fs::write(
            &script,
            json!({"fallback": {"text": "run rm -rf ~", "usage": {"input_tokens": 1, "output_tokens": 1}}})
                .to_string(),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut child = Command::new(common::fakellm_bin())
            .arg("--script")
            .arg(&script)
            .arg("--log")
            .arg(dir.path().join("requests.jsonl"))
            .arg("--listen")
            .arg("127.0.0.1:0")
            .uid(NOBODY)
            .gid(NOBODY)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("fakellm said {line:?}"));
        Squatter { child, port, dir }
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("requests.jsonl")
    }

    /// Everything the squatter received, raw.
    fn received(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }
}

impl Drop for Squatter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The bridge is down and `nobody` holds its port: the agent's request (with the bridge token)
/// never reaches the squatter, and the agent gets a 502 that names no address or secret.
#[tokio::test]
async fn the_gateway_sends_nothing_to_a_squatted_bridge_port() {
    let squatter = Squatter::start();
    let config = format!(
        r#"
[gateway]
bridge_url = "http://127.0.0.1:{port}"

[models.gpt]
backend = "remote"
provider = "openai"
base_url = "https://api.openai.invalid/v1"
upstream_model = "gpt-upstream"
key_env = "OPENAI_KEY"
"#,
        port = squatter.port
    );
    let gw = GatewayProcess::start(&config, &[("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)]).unwrap();
    let r = gw
        .control(
            "POST",
            "/tasks",
            Some(&json!({"tid": "sq", "model": "gpt", "token": TOKEN, "budget": {}})),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
    let auth = format!("Bearer {TOKEN}");
    let body = json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "the secret plan"}]
    });
    for _ in 0..3 {
        let r = unix_request(
            &gw.task_socket("sq"),
            "POST",
            "/v1/messages",
            &[
                ("content-type", "application/json"),
                ("authorization", auth.as_str()),
            ],
            body.to_string(),
        )
        .await
        .unwrap();
        let text = r.text().into_owned();
        assert_eq!(r.status, 502, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["type"], "error", "{v}");
        assert!(!text.contains(BRIDGE_TOKEN), "{text}");
        assert!(!text.contains("127.0.0.1"), "{text}");
    }
    let got = squatter.received();
    assert!(got.is_empty(), "the squatter received: {got}");
    assert!(!got.contains(BRIDGE_TOKEN));
    let log = gw.stderr();
    assert!(!log.contains(BRIDGE_TOKEN), "{log}");
    assert!(
        log.contains("65534"),
        "the refusal is logged with the owner: {log}"
    );
    let task: Value =
        serde_json::from_slice(&gw.control("GET", "/tasks/sq", None).await.unwrap().body).unwrap();
    assert_eq!(task["in_flight"], 0, "{task}");
}

/// A vLLM model's port is held by `nobody`'s server, which answers `/health` with 200, while
/// the configured command never serves: the launcher must not report the backend healthy.
#[test]
fn the_launcher_does_not_trust_a_squatted_health_port() {
    let squatter = Squatter::start();
    let marker = format!("{}", 910_000 + std::process::id());
    let model = format!(
        "[models.sq]\nbackend = \"vllm\"\nupstream_model = \"x\"\nport = {}\ncommand = [\"/bin/sleep\", \"{marker}\"]\n",
        squatter.port
    );
    let l = Launcher::start(Options {
        extra_config: model,
        backend_start_timeout_s: 2,
        ..Options::default()
    });
    let r = l.post("/backends/sq/start", &json!({}));
    assert_eq!((r.status, r.code()), (502, "backend_failed"), "{}", r.raw);
    let msg = r.message();
    assert!(msg.contains("not healthy"), "{msg}");
    let b = l.get("/status");
    let sq = b.body["backends"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["model"] == "sq"))
        .cloned()
        .unwrap_or_else(|| panic!("{}", b.raw));
    assert_eq!(sq["state"], "failed", "{sq}");
    assert!(processes_with(&format!("/bin/sleep {marker}")).is_empty());
    let got = squatter.received();
    assert!(
        !got.contains("\"served_by\":\"health\""),
        "the launcher asked the squatter for health: {got}"
    );
}
