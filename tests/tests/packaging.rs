//! `packaging/install.sh` into a temp root: the binaries, units, users and data dir land with
//! the owners and modes the daemons expect; systemd accepts the units; the installed CLI
//! accepts the installed config; a second install keeps the operator's files.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output};

use agentbox_tests::harness::{workspace_bin, workspace_root};

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

fn owner(p: &Path) -> (u32, u32) {
    let m = std::fs::metadata(p).unwrap();
    (m.uid(), m.gid())
}

/// Runs `cmd` and fails the test with its stdout and stderr unless it exits 0.
fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn install_into_a_root_then_verify() {
    let bins = [
        ("agentbox-cli", "agentbox"),
        ("agentbox-launcher", "agentbox-launcher"),
        ("agentbox-gateway", "agentbox-gateway"),
        ("agentbox-bridge", "agentbox-bridge"),
        ("agentbox-pool", "agentbox-pool"),
        ("agentbox-blackbox", "blackbox-server"),
    ];
    let bin_dir = bins
        .iter()
        .map(|(pkg, bin)| workspace_bin(pkg, bin).unwrap())
        .next_back()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let install = || {
        run_ok(
            Command::new(workspace_root().join("packaging/install.sh"))
                .arg("--destdir")
                .arg(r)
                .arg("--bin-dir")
                .arg(&bin_dir),
        );
    };
    install();

    for (_, bin) in bins {
        assert_eq!(mode(&r.join("usr/local/bin").join(bin)), 0o755, "{bin}");
    }
    let passwd = std::fs::read_to_string(r.join("etc/passwd")).unwrap();
    let service: Vec<&str> = passwd
        .lines()
        .find(|l| l.starts_with("agentbox:"))
        .unwrap()
        .split(':')
        .collect();
    let (su, sg): (u32, u32) = (service[2].parse().unwrap(), service[3].parse().unwrap());
    assert!(passwd.contains("agentbox-agent:x:64000:64000:"), "{passwd}");

    let data = r.join("var/lib/agentbox");
    assert_eq!((owner(&data), mode(&data)), ((0, 0), 0o711));
    assert_eq!(
        (owner(&data.join("run")), mode(&data.join("run"))),
        ((0, sg), 0o1770)
    );
    assert_eq!(
        (owner(&data.join("state")), mode(&data.join("state"))),
        ((0, 0), 0o711)
    );
    assert_eq!(
        (
            owner(&data.join("state/gateway")),
            mode(&data.join("state/gateway"))
        ),
        ((su, sg), 0o700)
    );
    for d in ["tasks", "sockets"] {
        assert_eq!(
            (owner(&data.join(d)), mode(&data.join(d))),
            ((su, sg), 0o711),
            "{d}"
        );
    }
    assert_eq!(mode(&r.join("etc/agentbox/bridge.env")), 0o600);
    assert_eq!(
        std::fs::read_to_string(r.join("etc/agentbox/agentbox.toml")).unwrap(),
        std::fs::read_to_string(workspace_root().join("packaging/agentbox.example.toml")).unwrap()
    );

    // systemd accepts the units (pointed at the binaries in the temp root).
    let units = tempfile::tempdir().unwrap();
    let mut paths = Vec::new();
    for u in [
        "agentbox-launcher.service",
        "agentbox-gateway.service",
        "agentbox-bridge.service",
        "agentbox-pool.service",
    ] {
        let text = std::fs::read_to_string(r.join("etc/systemd/system").join(u)).unwrap();
        let rewritten = text.replace(
            "/usr/local/bin/",
            &format!("{}/usr/local/bin/", r.display()),
        );
        let p = units.path().join(u);
        std::fs::write(&p, rewritten).unwrap();
        paths.push(p);
    }
    let out = run_ok(Command::new("systemd-analyze").arg("verify").args(&paths));
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The installed CLI accepts the installed config.
    run_ok(
        Command::new(r.join("usr/local/bin/agentbox"))
            .args(["config", "check", "--config"])
            .arg(r.join("etc/agentbox/agentbox.toml"))
            .env_remove("AGENTBOX_DATA"),
    );

    // A second install keeps what the operator edited.
    let edited = [
        (
            "etc/agentbox/agentbox.toml",
            "data_dir = \"/srv/agentbox\"\n",
        ),
        ("etc/agentbox/bridge.env", "AGENTBOX_BRIDGE_TOKEN=kept\n"),
    ];
    for (file, text) in edited {
        std::fs::write(r.join(file), text).unwrap();
    }
    install();
    for (file, text) in edited {
        assert_eq!(
            std::fs::read_to_string(r.join(file)).unwrap(),
            text,
            "{file}"
        );
    }
}
