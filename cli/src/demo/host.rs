//! What `agentbox demo` needs from the host, checked before anything starts: root (the
//! launcher builds the sandboxes as root), bubblewrap where the launcher runs it, user
//! namespaces, git and python3 where the launcher and the sandbox find them, and npm when
//! Claude Code still has to be installed. Each missing thing is one line saying what and how
//! to fix it. The host is read through [`HostProbe`], so every message is tested with a fake.

use std::path::Path;

/// What the checks read from the host.
pub trait HostProbe {
    /// This process's effective uid.
    fn euid(&self) -> u32;
    /// Whether `program --version` runs and exits 0.
    fn runs(&self, program: &Path) -> bool;
    /// A `/proc/sys` file, trimmed; `None` when absent.
    fn sysctl(&self, path: &str) -> Option<String>;
    /// Whether `name` is an executable file in a directory of `$PATH`.
    fn on_path(&self, name: &str) -> bool;
}

/// The real host; `path` is the `$PATH` the CLI was given.
#[derive(Debug, Clone)]
pub struct RealHost {
    /// `$PATH`.
    pub path: Option<String>,
}

impl HostProbe for RealHost {
    fn euid(&self) -> u32 {
        rustix::process::geteuid().as_raw()
    }

    fn runs(&self, program: &Path) -> bool {
        std::process::Command::new(program)
            .arg("--version")
            .env_clear()
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    fn sysctl(&self, path: &str) -> Option<String> {
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_owned())
    }

    fn on_path(&self, name: &str) -> bool {
        use std::os::unix::fs::PermissionsExt;
        self.path.as_deref().is_some_and(|p| {
            std::env::split_paths(p).any(|d| {
                std::fs::metadata(d.join(name))
                    .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            })
        })
    }
}

/// Where the launcher runs bubblewrap (`agentbox_sandbox::bwrap::BWRAP`).
pub const BWRAP: &str = "/usr/bin/bwrap";
/// Where the launcher runs git.
pub const GIT: &str = "/usr/bin/git";
/// The python3 the sandbox sees (it mounts the host's `/usr` only).
pub const PYTHON3: &str = "/usr/bin/python3";

/// One line per missing thing; empty when the demo can run. `need_npm`: Claude Code is not
/// installed yet.
pub fn problems(host: &dyn HostProbe, need_npm: bool) -> Vec<String> {
    let mut out = Vec::new();
    if host.euid() != 0 {
        out.push(
            "not running as root: the launcher builds the sandboxes as root; run the demo with sudo (`sudo scripts/demo.sh`)"
                .to_owned(),
        );
    }
    if !host.runs(Path::new(BWRAP)) {
        out.push(format!(
            "bubblewrap is missing ({BWRAP} does not run): install it (`apt install bubblewrap` or `dnf install bubblewrap`)"
        ));
    }
    if let Some(line) = user_namespaces(host) {
        out.push(line);
    }
    if !host.runs(Path::new(GIT)) {
        out.push(format!(
            "git is missing ({GIT} does not run): install it (`apt install git` or `dnf install git`)"
        ));
    }
    if !host.runs(Path::new(PYTHON3)) {
        out.push(format!(
            "python3 is missing ({PYTHON3}, what the sandbox sees, does not run): install it (`apt install python3`); the demo repository's test runs with it"
        ));
    }
    if need_npm && !host.on_path("npm") {
        out.push(
            "npm is missing from PATH: Claude Code is installed with npm on first use; install Node.js and npm (`apt install npm`), or set AGENTBOX_CLIENTS_DIR to an existing scripts/install-clients.sh install"
                .to_owned(),
        );
    }
    out
}

/// The sysctls that keep bubblewrap from making user namespaces, as the launcher reads them.
fn user_namespaces(host: &dyn HostProbe) -> Option<String> {
    let blocked = [
        (
            "/proc/sys/user/max_user_namespaces",
            "0",
            "user.max_user_namespaces is 0",
            "sysctl -w user.max_user_namespaces=15000",
        ),
        (
            "/proc/sys/kernel/unprivileged_userns_clone",
            "0",
            "kernel.unprivileged_userns_clone is 0",
            "sysctl -w kernel.unprivileged_userns_clone=1",
        ),
        (
            "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
            "1",
            "kernel.apparmor_restrict_unprivileged_userns is 1",
            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for bwrap",
        ),
    ];
    blocked
        .iter()
        .find(|(path, bad, _, _)| host.sysctl(path).as_deref() == Some(*bad))
        .map(|(_, _, what, fix)| {
            format!("user namespaces are disabled ({what}): bubblewrap needs them; enable them (`{fix}`)")
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[derive(Default)]
    struct Fake {
        euid: u32,
        broken: Vec<&'static str>,
        sysctls: BTreeMap<&'static str, &'static str>,
        path: Vec<&'static str>,
    }

    impl HostProbe for Fake {
        fn euid(&self) -> u32 {
            self.euid
        }
        fn runs(&self, program: &Path) -> bool {
            !self.broken.iter().any(|b| Path::new(b) == program)
        }
        fn sysctl(&self, path: &str) -> Option<String> {
            self.sysctls.get(path).map(|s| (*s).to_owned())
        }
        fn on_path(&self, name: &str) -> bool {
            self.path.contains(&name)
        }
    }

    #[test]
    fn a_ready_host_has_no_problems() {
        let host = Fake {
            path: vec!["npm"],
            ..Fake::default()
        };
        assert_eq!(problems(&host, true), Vec::<String>::new());
        assert_eq!(problems(&Fake::default(), false), Vec::<String>::new());
    }

    #[test]
    fn each_missing_thing_is_one_line_with_its_fix() {
        let cases: Vec<(Fake, bool, &str, &str)> = vec![
            (
                Fake {
                    euid: 1000,
                    ..Fake::default()
                },
                false,
                "not running as root",
                "sudo",
            ),
            (
                Fake {
                    broken: vec![BWRAP],
                    ..Fake::default()
                },
                false,
                "bubblewrap is missing (/usr/bin/bwrap",
                "apt install bubblewrap",
            ),
            (
                Fake {
                    sysctls: [("/proc/sys/user/max_user_namespaces", "0")].into(),
                    ..Fake::default()
                },
                false,
                "user namespaces are disabled (user.max_user_namespaces is 0)",
                "sysctl -w user.max_user_namespaces=15000",
            ),
            (
                Fake {
                    sysctls: [("/proc/sys/kernel/unprivileged_userns_clone", "0")].into(),
                    ..Fake::default()
                },
                false,
                "kernel.unprivileged_userns_clone is 0",
                "sysctl -w kernel.unprivileged_userns_clone=1",
            ),
            (
                Fake {
                    sysctls: [(
                        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
                        "1",
                    )]
                    .into(),
                    ..Fake::default()
                },
                false,
                "kernel.apparmor_restrict_unprivileged_userns is 1",
                "AppArmor profile",
            ),
            (
                Fake {
                    broken: vec![GIT],
                    ..Fake::default()
                },
                false,
                "git is missing",
                "apt install git",
            ),
            (
                Fake {
                    broken: vec![PYTHON3],
                    ..Fake::default()
                },
                false,
                "python3 is missing",
                "apt install python3",
            ),
            (
                Fake::default(),
                true,
                "npm is missing",
                "AGENTBOX_CLIENTS_DIR",
            ),
        ];
        for (host, need_npm, what, fix) in cases {
            let lines = problems(&host, need_npm);
            assert_eq!(lines.len(), 1, "{lines:?}");
            assert!(lines[0].contains(what), "{lines:?}");
            assert!(lines[0].contains(fix), "{lines:?}");
            assert!(!lines[0].contains('\n'), "{lines:?}");
        }
        let all = Fake {
            euid: 1000,
            broken: vec![BWRAP, GIT, PYTHON3],
            sysctls: [("/proc/sys/user/max_user_namespaces", "0")].into(),
            path: Vec::new(),
        };
        assert_eq!(problems(&all, true).len(), 6);
    }
}
