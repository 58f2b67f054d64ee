//! Least privilege for the daemons themselves (issue 9, hole 12), read from the kernel's view
//! of the running processes (`/proc/<pid>/task/*/status`), not from what they claim:
//! - the launcher, started as root with every capability, holds only the ones it uses, in
//!   every thread, and its bounding set is cut to the same (no program it runs as root
//!   regains more); `GET /status` reports the same names; a sandboxed command still holds none;
//! - the gateway and the bridge, started as root, hold none at all;
//! - a gateway or bridge started as a service user that was handed capabilities refuses to
//!   start (exit 77) instead of serving with them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentbox_tests::harness::launcher::{Launcher, Options};
use agentbox_tests::harness::{BridgeProcess, GatewayProcess, workspace_bin};

/// What the launcher may keep, by capability number (linux/capability.h).
const KEPT: &[(u32, &str)] = &[
    (0, "CAP_CHOWN"),
    (1, "CAP_DAC_OVERRIDE"),
    (2, "CAP_DAC_READ_SEARCH"),
    (3, "CAP_FOWNER"),
    (5, "CAP_KILL"),
    (6, "CAP_SETGID"),
    (7, "CAP_SETUID"),
    (19, "CAP_SYS_PTRACE"),
    (21, "CAP_SYS_ADMIN"),
];

fn kept_mask() -> u64 {
    KEPT.iter().fold(0, |m, (n, _)| m | (1u64 << n))
}

/// `CapInh`, `CapPrm`, `CapEff`, `CapBnd`, `CapAmb` of every thread of `pid`.
fn thread_caps(pid: u32) -> Vec<(String, [u64; 5])> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let entry = entry.unwrap();
        let Ok(text) = std::fs::read_to_string(entry.path().join("status")) else {
            continue; // the thread ended meanwhile
        };
        let field = |name: &str| {
            let line = text
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name}:")))
                .unwrap_or_else(|| panic!("no {name} in {text}"));
            u64::from_str_radix(line.trim(), 16).unwrap()
        };
        out.push((
            entry.file_name().to_string_lossy().into_owned(),
            [
                field("CapInh"),
                field("CapPrm"),
                field("CapEff"),
                field("CapBnd"),
                field("CapAmb"),
            ],
        ));
    }
    assert!(!out.is_empty(), "no threads of {pid}");
    out
}

fn assert_caps(what: &str, pid: u32, inh: u64, prm: u64, eff: u64, bnd: u64, amb: u64) {
    for (tid, caps) in thread_caps(pid) {
        assert_eq!(
            caps,
            [inh, prm, eff, bnd, amb],
            "{what} thread {tid}: [CapInh, CapPrm, CapEff, CapBnd, CapAmb] as {:x?}, expected {:x?}",
            caps,
            [inh, prm, eff, bnd, amb]
        );
    }
}

#[test]
fn launcher_keeps_only_the_capabilities_it_uses() {
    let l = Launcher::start(Options::default());
    let mask = kept_mask();
    assert_caps("launcher", l.pid(), 0, mask, mask, mask, 0);

    let rt = tokio::runtime::Runtime::new().unwrap();
    let status = rt.block_on(l.client().status()).unwrap();
    let reported = status.capabilities.expect("/status reports capabilities");
    let names: Vec<String> = {
        let mut v: Vec<String> = KEPT.iter().map(|(_, n)| (*n).to_owned()).collect();
        v.sort();
        v
    };
    assert_eq!(reported.effective, names);
    assert_eq!(reported.permitted, names);
    assert_eq!(reported.bounding, names);
    assert!(reported.inheritable.is_empty() && reported.ambient.is_empty());

    // Still able to do its work with that set, and a sandboxed command holds nothing.
    let v = l.probe(
        "caps1",
        "grep -E '^(CapInh|CapPrm|CapEff|CapAmb):' /proc/self/status; touch /workspace/made",
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    let text = v["stdout"].as_str().unwrap();
    for cap in ["CapInh", "CapPrm", "CapEff", "CapAmb"] {
        assert!(
            text.contains(&format!("{cap}:\t0000000000000000")),
            "{cap} in {text}"
        );
    }
}

/// The packaged units bound the daemons to the same sets: the launcher's to exactly what it
/// keeps, the gateway's and bridge's to nothing.
#[test]
fn units_bound_the_same_capabilities() {
    let dir = agentbox_tests::harness::workspace_root().join("packaging/systemd");
    let bounding = |unit: &str| -> Vec<String> {
        let text = std::fs::read_to_string(dir.join(unit)).unwrap();
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
            .unwrap_or_else(|| panic!("{unit} has no CapabilityBoundingSet="));
        let mut v: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
        v.sort();
        v
    };
    let mut kept: Vec<String> = KEPT.iter().map(|(_, n)| (*n).to_owned()).collect();
    kept.sort();
    assert_eq!(bounding("agentbox-launcher.service"), kept);
    assert!(bounding("agentbox-gateway.service").is_empty());
    assert!(bounding("agentbox-bridge.service").is_empty());
}

/// The gateway's and the bridge's configs: their own section and one local model.
macro_rules! with_local_model {
    ($daemon:literal) => {
        concat!(
            $daemon,
            "\n\n[models.local]\nbackend = \"ollama\"\nupstream_model = \"qwen\"\n"
        )
    };
}
const GATEWAY_CONFIG: &str = with_local_model!("[gateway]\nollama_url = \"http://127.0.0.1:9\"");
const BRIDGE_CONFIG: &str = with_local_model!("[bridge]\nlisten = \"127.0.0.1:0\"");

const BRIDGE_TOKEN: &str = "bridge-token-0123456789";

#[test]
fn gateway_and_bridge_run_as_root_hold_no_capabilities() {
    let gw = GatewayProcess::start(GATEWAY_CONFIG, &[]).unwrap();
    assert_caps("gateway", gw.pid(), 0, 0, 0, 0, 0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let status = rt.block_on(gw.client().status()).unwrap();
    let caps = status.capabilities.expect("/status reports capabilities");
    assert_eq!(caps, agentbox_api::caps::Capabilities::default());

    let bridge =
        BridgeProcess::start(BRIDGE_CONFIG, &[("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)]).unwrap();
    assert_caps("bridge", bridge.pid(), 0, 0, 0, 0, 0);
}

/// Runs `bin` as an unprivileged uid that was handed `CAP_NET_BIND_SERVICE` as an ambient
/// capability (as a unit with `AmbientCapabilities=` would), and returns how it ended within
/// 20 s (`None`: still running, which is the failure).
fn run_with_a_capability(bin: &str, config: &str) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let cfg = dir.path().join("agentbox.toml");
    std::fs::write(&cfg, config).unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::os::unix::fs::chown(&data, Some(64_990), Some(64_990)).unwrap();
    let mut child = Command::new("setpriv")
        .args([
            "--reuid=64990",
            "--regid=64990",
            "--clear-groups",
            "--inh-caps=+net_bind_service",
            "--ambient-caps=+net_bind_service",
            "--",
        ])
        .arg(workspace_bin(bin, bin).unwrap())
        .arg("--config")
        .arg(&cfg)
        .env_clear()
        .env("AGENTBOX_DATA", &data)
        .env("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    (code, err)
}

#[test]
fn gateway_and_bridge_refuse_to_start_with_capabilities() {
    for (bin, config) in [
        ("agentbox-gateway", GATEWAY_CONFIG),
        ("agentbox-bridge", BRIDGE_CONFIG),
    ] {
        let (code, err) = run_with_a_capability(bin, config);
        assert_eq!(code, Some(77), "{bin} must refuse to start: {err}");
        assert!(err.contains("CAP_NET_BIND_SERVICE"), "{bin}: {err}");
    }
}
