//! Request validation: every field of `POST /agents` and `POST /checks` checked against the
//! policy crate and the config, refused (never repaired) with its own error code. The venv
//! check is the only one that touches the filesystem, through the no-symlink resolver.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

use agentbox_policy::config::{Config, Model};
use agentbox_policy::env::{self, Allowlist};
use agentbox_policy::id::Tid;
use agentbox_policy::path::{EqualsRoot, RequestPath};
use agentbox_policy::resolve::{Kind, Root};
use agentbox_policy::secret::Secret;
use rustix::fs::{AtFlags, StatxFlags};

use crate::error::LauncherError;

/// Most arguments `cmd` may have.
pub const MAX_ARGS: usize = 1024;
/// Bound on all of `cmd` together, bytes; far below the kernel's argument budget.
pub const MAX_ARGV_BYTES: usize = 256 * 1024;
/// Bound on a check's `command`.
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;
/// Bound on the task token.
pub const MAX_TOKEN_BYTES: usize = 512;
/// Bound on an agent's `stdin` (the prompt); the request body limit is the same.
pub const MAX_STDIN_BYTES: usize = 1 << 20;

pub fn tid(input: &str) -> Result<Tid, LauncherError> {
    Tid::parse(input).map_err(|e| LauncherError::InvalidTid(e.to_string()))
}

/// A model of the catalogue; returns its id. Anything else, a malformed or path-like id
/// included, is unknown (ids are checked against the id rule before any lookup).
pub fn model<'c>(config: &'c Config, input: &str) -> Result<&'c Model, LauncherError> {
    config.model(input).ok_or_else(|| {
        let shown: String = input.chars().take(80).collect();
        LauncherError::UnknownModel(format!("{shown:?}"))
    })
}

/// `cmd[0]` must be exactly `claude`; returns the remaining arguments.
pub fn cmd(cmd: &[String]) -> Result<Vec<String>, LauncherError> {
    let Some((first, rest)) = cmd.split_first() else {
        return Err(LauncherError::InvalidCmd("cmd is empty".to_owned()));
    };
    if first != "claude" {
        let shown: String = first.chars().take(80).collect();
        return Err(LauncherError::InvalidCmd(format!(
            "cmd[0] must be \"claude\", got {shown:?}"
        )));
    }
    if cmd.len() > MAX_ARGS {
        return Err(LauncherError::InvalidCmd(format!(
            "more than {MAX_ARGS} arguments"
        )));
    }
    if cmd.iter().any(|a| a.contains('\0')) {
        return Err(LauncherError::InvalidCmd(
            "an argument contains a NUL byte".to_owned(),
        ));
    }
    let total: usize = cmd.iter().map(|a| a.len() + 1).sum();
    if total > MAX_ARGV_BYTES {
        return Err(LauncherError::InvalidCmd(format!(
            "arguments exceed {MAX_ARGV_BYTES} bytes"
        )));
    }
    Ok(rest.to_vec())
}

/// A check's shell command.
pub fn command(command: &str) -> Result<(), LauncherError> {
    if command.trim().is_empty() {
        return Err(LauncherError::InvalidCommand("command is empty".to_owned()));
    }
    if command.contains('\0') {
        return Err(LauncherError::InvalidCommand(
            "command contains a NUL byte".to_owned(),
        ));
    }
    if command.len() > MAX_COMMAND_BYTES {
        return Err(LauncherError::InvalidCommand(format!(
            "command exceeds {MAX_COMMAND_BYTES} bytes"
        )));
    }
    Ok(())
}

/// Every entry must pass the allowlist: a dropped key refuses the request, naming each key and
/// why, instead of starting an agent without what the caller thought it set.
pub fn env(
    config: &Config,
    input: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, LauncherError> {
    let allow = Allowlist::new(&config.launcher.env_allowlist)?;
    let filtered = env::filter(input, &allow);
    if filtered.dropped.is_empty() {
        Ok(filtered.kept)
    } else {
        let reasons: Vec<String> = filtered.dropped.iter().map(ToString::to_string).collect();
        Err(LauncherError::InvalidEnv(reasons.join("; ")))
    }
}

/// An agent's `stdin`: any text up to [`MAX_STDIN_BYTES`].
pub fn stdin(input: Option<&str>) -> Result<Option<&str>, LauncherError> {
    match input {
        Some(s) if s.len() > MAX_STDIN_BYTES => Err(LauncherError::InvalidStdin(format!(
            "exceeds {MAX_STDIN_BYTES} bytes"
        ))),
        other => Ok(other),
    }
}

/// The task token: printable ASCII without whitespace (it becomes an HTTP header value).
pub fn token(input: Option<&str>) -> Result<Option<Secret>, LauncherError> {
    let Some(t) = input else {
        return Ok(None);
    };
    if t.len() > MAX_TOKEN_BYTES {
        return Err(LauncherError::InvalidToken(format!(
            "longer than {MAX_TOKEN_BYTES} bytes"
        )));
    }
    if !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(LauncherError::InvalidToken(
            "must be printable ASCII without whitespace".to_owned(),
        ));
    }
    Secret::new(t.to_owned())
        .map(Some)
        .ok_or_else(|| LauncherError::InvalidToken("empty".to_owned()))
}

pub fn timeout(got: u64, max: u64) -> Result<std::time::Duration, LauncherError> {
    if got == 0 || got > max {
        return Err(LauncherError::InvalidTimeout { got, max });
    }
    Ok(std::time::Duration::from_secs(got))
}

/// A venv: an absolute, normalized path strictly inside `launcher.venv_root`, reached without
/// any symlink, containing `bin/python`. `bin/python` itself may be a symlink (venvs link to
/// the system interpreter): it is only ever resolved inside the sandbox, where the venv is
/// read-only and the host's `/etc` does not exist. Returns an `O_PATH` handle to mount.
pub fn venv(config: &Config, input: &str) -> Result<OwnedFd, LauncherError> {
    let bad = |m: String| LauncherError::InvalidVenv(m);
    let path = RequestPath::parse(input).map_err(|e| bad(e.to_string()))?;
    let roots = [config.launcher.venv_root.clone()];
    let within = path
        .within(&roots, EqualsRoot::Refuse)
        .map_err(|e| bad(e.to_string()))?;
    let root = Root::open(within.root.as_path()).map_err(|e| bad(format!("venv root: {e}")))?;
    let dir = root
        .resolve_dir(&within.rel)
        .map_err(|e| bad(e.to_string()))?;
    let bin_rel = within.rel.join("bin").map_err(|e| bad(e.to_string()))?;
    let bin = root.resolve_dir(&bin_rel).map_err(|e| bad(e.to_string()))?;
    let stx = rustix::fs::statx(&bin, "python", AtFlags::SYMLINK_NOFOLLOW, StatxFlags::TYPE)
        .map_err(|e| bad(format!("{input}/bin/python: {e}")))?;
    let kind = rustix::fs::FileType::from_raw_mode(u32::from(stx.stx_mode));
    match kind {
        rustix::fs::FileType::RegularFile | rustix::fs::FileType::Symlink => {}
        other @ (rustix::fs::FileType::Directory
        | rustix::fs::FileType::Fifo
        | rustix::fs::FileType::Socket
        | rustix::fs::FileType::CharacterDevice
        | rustix::fs::FileType::BlockDevice
        | rustix::fs::FileType::Unknown) => {
            return Err(bad(format!(
                "{input}/bin/python is a {other:?}, not a file"
            )));
        }
    }
    dir.expect(Kind::Dir).map_err(|e| bad(e.to_string()))?;
    Ok(dir.into_fd())
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentbox_policy::config::FixedEnv;

    fn config(venv_root: &str) -> Config {
        let text = format!(
            "[launcher]\nvenv_root = \"{venv_root}\"\nenv_allowlist = [\"MAX_THINKING_TOKENS\"]\n\
             [models.m]\nbackend = \"ollama\"\nupstream_model = \"x\"\n"
        );
        Config::from_toml_str(&text, "test", &FixedEnv::default()).unwrap()
    }

    #[test]
    fn cmd_rules() {
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        assert_eq!(cmd(&s(&["claude", "-p", "hi"])).unwrap(), s(&["-p", "hi"]));
        for bad in [
            &[][..],
            &["/usr/bin/claude"],
            &["./claude"],
            &["claude "],
            &["claude;sh"],
            &["sh"],
            &["Claude"],
        ] {
            assert!(
                matches!(cmd(&s(bad)).unwrap_err(), LauncherError::InvalidCmd(_)),
                "{bad:?}"
            );
        }
        assert!(cmd(&s(&["claude", "a\0b"])).is_err());
        assert!(cmd(&vec!["claude".to_owned(); MAX_ARGS + 1]).is_err());
    }

    #[test]
    fn env_rules() {
        let c = config("/opt/venvs");
        let ok = BTreeMap::from([("MAX_THINKING_TOKENS".to_owned(), "1".to_owned())]);
        assert_eq!(env(&c, &ok).unwrap(), ok);
        for key in [
            "LD_PRELOAD",
            "PATH",
            "ANTHROPIC_BASE_URL",
            "OTHER",
            "BASH_ENV",
        ] {
            let bad = BTreeMap::from([(key.to_owned(), "x".to_owned())]);
            let err = env(&c, &bad).unwrap_err();
            assert!(err.to_string().contains(key), "{err}");
        }
        let nul = BTreeMap::from([("MAX_THINKING_TOKENS".to_owned(), "a\0".to_owned())]);
        assert!(env(&c, &nul).is_err());
    }

    #[test]
    fn stdin_rule() {
        assert_eq!(stdin(None).unwrap(), None);
        assert_eq!(stdin(Some("a\0b")).unwrap(), Some("a\0b"));
        let big = "x".repeat(MAX_STDIN_BYTES + 1);
        assert!(matches!(
            stdin(Some(&big)),
            Err(LauncherError::InvalidStdin(_))
        ));
    }

    #[test]
    fn token_and_timeout_rules() {
        assert!(token(None).unwrap().is_none());
        assert!(token(Some("abc-123._~")).unwrap().is_some());
        for bad in ["", "a b", "a\n", "é", &"x".repeat(513)] {
            assert!(token(Some(bad)).is_err(), "{bad:?}");
        }
        assert!(timeout(0, 10).is_err());
        assert!(timeout(11, 10).is_err());
        assert_eq!(timeout(10, 10).unwrap().as_secs(), 10);
    }

    #[test]
    fn venv_rules() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("venvs");
        std::fs::create_dir_all(root.join("good/bin")).unwrap();
        std::os::unix::fs::symlink("/usr/bin/python3", root.join("good/bin/python")).unwrap();
        std::fs::create_dir_all(root.join("nopython/bin")).unwrap();
        std::fs::create_dir_all(root.join("dirpython/bin/python")).unwrap();
        std::os::unix::fs::symlink(root.join("good"), root.join("linked")).unwrap();
        let c = config(root.to_str().unwrap());
        let r = root.to_str().unwrap();
        venv(&c, &format!("{r}/good")).unwrap();
        for bad in [
            format!("{r}/nopython"),
            format!("{r}/dirpython"),
            format!("{r}/linked"),
            format!("{r}/missing"),
            format!("{r}/good/"),
            format!("{r}/../venvs/good"),
            r.to_owned(),
            "/usr".to_owned(),
            "relative".to_owned(),
        ] {
            assert!(
                matches!(venv(&c, &bad).unwrap_err(), LauncherError::InvalidVenv(_)),
                "{bad}"
            );
        }
    }
}
