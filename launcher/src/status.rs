//! Host readiness for `GET /status`: can this machine run our sandboxes, and if not, exactly
//! what is missing (the anchors' users most often hit a missing or too old bwrap, user
//! namespaces disabled by a sysctl or AppArmor, and absent cgroup controllers; research §4, §9).
//!
//! The probes read through [`HostProbe`] so the verdict logic is unit-tested with canned
//! answers.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::api::{HostCheck as Check, HostStatus};
use agentbox_sandbox::cgroup::Cgroups;

/// What the verdict needs from the host.
pub trait HostProbe {
    /// `bwrap --version` and `bwrap --help` output, or why they could not run.
    fn bwrap(&self) -> Result<(String, String), String>;
    /// The contents of a `/proc/sys` file, trimmed; `None` if absent.
    fn sysctl(&self, path: &str) -> Option<String>;
}

/// The real host.
#[derive(Debug, Clone)]
pub struct RealProbe {
    pub bwrap: PathBuf,
}

impl HostProbe for RealProbe {
    fn bwrap(&self) -> Result<(String, String), String> {
        let run = |arg: &str| -> Result<String, String> {
            let out = std::process::Command::new(&self.bwrap)
                .arg(arg)
                .env_clear()
                .stdin(std::process::Stdio::null())
                .output()
                .map_err(|e| format!("cannot run {}: {e}", self.bwrap.display()))?;
            Ok(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        };
        Ok((run("--version")?, run("--help")?))
    }

    fn sysctl(&self, path: &str) -> Option<String> {
        std::fs::read_to_string(Path::new(path))
            .ok()
            .map(|s| s.trim().to_owned())
    }
}

fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let v = text
        .split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()))?;
    let mut it = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((
        it.next()??,
        it.next().flatten().unwrap_or(0),
        it.next().flatten().unwrap_or(0),
    ))
}

/// Flags our argument list depends on, with the bwrap version that introduced each.
const NEEDED_FLAGS: &[(&str, &str)] = &[
    ("--bind-fd", "0.10.0 (or a distribution backport)"),
    ("--disable-userns", "0.8.0"),
    ("--size", "0.7.0"),
    ("--add-seccomp-fd", "0.6.0"),
    ("--clearenv", "0.5.0"),
];

/// Builds the verdict.
pub fn host_status(probe: &dyn HostProbe, cgroups: &Result<Cgroups, String>) -> HostStatus {
    let bwrap = match probe.bwrap() {
        Err(e) => Check {
            ok: false,
            detail: e,
        },
        Ok((version, help)) => {
            let missing: Vec<String> = NEEDED_FLAGS
                .iter()
                .filter(|(flag, _)| !help.contains(flag))
                .map(|(flag, since)| format!("{flag} (bubblewrap {since})"))
                .collect();
            let shown = version.trim().to_owned();
            match parse_version(&version) {
                None => Check {
                    ok: false,
                    detail: format!("cannot parse bwrap version {shown:?}"),
                },
                Some(_) if !missing.is_empty() => Check {
                    ok: false,
                    detail: format!("{shown} lacks {}", missing.join(", ")),
                },
                Some(_) => Check {
                    ok: true,
                    detail: shown,
                },
            }
        }
    };
    let user_namespaces = {
        let max = probe.sysctl("/proc/sys/user/max_user_namespaces");
        let debian = probe.sysctl("/proc/sys/kernel/unprivileged_userns_clone");
        let apparmor = probe.sysctl("/proc/sys/kernel/apparmor_restrict_unprivileged_userns");
        if max.as_deref() == Some("0") {
            Check {
                ok: false,
                detail: "user.max_user_namespaces is 0".to_owned(),
            }
        } else if debian.as_deref() == Some("0") {
            Check {
                ok: false,
                detail: "kernel.unprivileged_userns_clone is 0".to_owned(),
            }
        } else if apparmor.as_deref() == Some("1") {
            Check {
                ok: false,
                detail: "kernel.apparmor_restrict_unprivileged_userns is 1: bwrap needs an AppArmor profile allowing userns"
                    .to_owned(),
            }
        } else {
            Check {
                ok: true,
                detail: format!(
                    "max_user_namespaces {}",
                    max.unwrap_or_else(|| "unknown".to_owned())
                ),
            }
        }
    };
    let cgroups = match cgroups {
        Ok(cg) => {
            let controllers = cg.controllers();
            let missing: Vec<&str> = ["memory", "pids", "cpu"]
                .into_iter()
                .filter(|c| {
                    !controllers
                        .iter()
                        .any(|have| have.trim_start_matches('+') == *c)
                })
                .collect();
            if missing.is_empty() {
                Check {
                    ok: true,
                    detail: format!("cgroup {} with {}", cg.version(), controllers.join(" ")),
                }
            } else {
                Check {
                    ok: false,
                    detail: format!("cgroup {} lacks {}", cg.version(), missing.join(", ")),
                }
            }
        }
        Err(e) => Check {
            ok: false,
            detail: e.clone(),
        },
    };
    let reasons: Vec<String> = [
        ("bwrap", &bwrap),
        ("user namespaces", &user_namespaces),
        ("cgroups", &cgroups),
    ]
    .iter()
    .filter(|(_, c)| !c.ok)
    .map(|(what, c)| format!("{what}: {}", c.detail))
    .collect();
    HostStatus {
        ready: reasons.is_empty(),
        reasons,
        bwrap,
        user_namespaces,
        cgroups,
    }
}

/// Runs the real probe off the async threads (it spawns bwrap), bounded in time.
pub async fn probe_host(bwrap: PathBuf, cgroups: Result<Cgroups, String>) -> HostStatus {
    let task = tokio::task::spawn_blocking(move || host_status(&RealProbe { bwrap }, &cgroups));
    match tokio::time::timeout(Duration::from_secs(20), task).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => failed(format!("probe failed: {e}")),
        Err(_) => failed("probe timed out".to_owned()),
    }
}

fn failed(reason: String) -> HostStatus {
    let c = Check {
        ok: false,
        detail: reason.clone(),
    };
    HostStatus {
        ready: false,
        reasons: vec![reason],
        bwrap: c.clone(),
        user_namespaces: c.clone(),
        cgroups: c,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Fake {
        bwrap: Result<(String, String), String>,
        sysctl: HashMap<&'static str, &'static str>,
    }

    impl HostProbe for Fake {
        fn bwrap(&self) -> Result<(String, String), String> {
            self.bwrap.clone()
        }
        fn sysctl(&self, path: &str) -> Option<String> {
            self.sysctl.get(path).map(|s| (*s).to_owned())
        }
    }

    fn full_help() -> String {
        NEEDED_FLAGS
            .iter()
            .map(|(f, _)| *f)
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn verdicts() {
        let no_cg: Result<Cgroups, String> = Err("no cgroup v1 memory hierarchy".to_owned());
        let fake = Fake {
            bwrap: Ok(("bubblewrap 0.8.0\n".to_owned(), full_help())),
            sysctl: HashMap::from([("/proc/sys/user/max_user_namespaces", "100")]),
        };
        let s = host_status(&fake, &no_cg);
        assert!(s.bwrap.ok && s.user_namespaces.ok);
        assert!(!s.ready);
        assert_eq!(
            s.reasons,
            vec!["cgroups: no cgroup v1 memory hierarchy".to_owned()]
        );

        let fake = Fake {
            bwrap: Ok((
                "bubblewrap 0.8.0".to_owned(),
                "--size\n--clearenv".to_owned(),
            )),
            sysctl: HashMap::from([(
                "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
                "1",
            )]),
        };
        let s = host_status(&fake, &no_cg);
        assert!(s.bwrap.detail.contains("--bind-fd"), "{}", s.bwrap.detail);
        assert!(s.user_namespaces.detail.contains("AppArmor"));
        assert_eq!(s.reasons.len(), 3);

        let fake = Fake {
            bwrap: Err("cannot run /usr/bin/bwrap: not found".to_owned()),
            sysctl: HashMap::new(),
        };
        let s = host_status(&fake, &no_cg);
        assert!(s.reasons[0].contains("not found"));
    }

    #[test]
    fn versions() {
        assert_eq!(parse_version("bubblewrap 0.8.0\n"), Some((0, 8, 0)));
        assert_eq!(parse_version("bubblewrap 0.11"), Some((0, 11, 0)));
        assert_eq!(parse_version("garbage"), None);
    }
}
