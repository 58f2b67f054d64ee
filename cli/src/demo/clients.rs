//! The pinned Claude Code for the demo: `$AGENTBOX_CLIENTS_DIR` if set, else
//! `scripts/install-clients.sh` (built into this binary, so the pin and the cache are the
//! tests' own) with `claude`, which installs it with npm on first use into
//! `~/.cache/agentbox/clients` and answers from there afterwards.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use agentbox_policy::config::HostEnv;

use crate::error::CliError;

/// The install script, as the repository has it.
const INSTALL_SCRIPT: &str = include_str!("../../../scripts/install-clients.sh");

/// The pinned package (`@anthropic-ai/claude-code@X.Y.Z`), read from the script.
pub fn pinned() -> &'static str {
    INSTALL_SCRIPT
        .lines()
        .find_map(|l| {
            let l = l.trim().trim_matches('"');
            l.starts_with("@anthropic-ai/claude-code@").then_some(l)
        })
        .unwrap_or("@anthropic-ai/claude-code")
}

/// Runs the install script with `args` (from a file: npm would eat a script on stdin); its
/// last stdout line when it succeeds.
async fn script(args: &[&str], show: bool) -> Result<Option<PathBuf>, CliError> {
    let io = |e: std::io::Error| CliError::Io {
        what: "running the Claude Code install script".to_owned(),
        reason: e.to_string(),
    };
    let file = tempfile::Builder::new()
        .prefix("agentbox-install-clients-")
        .suffix(".sh")
        .tempfile()
        .map_err(io)?;
    std::fs::write(file.path(), INSTALL_SCRIPT).map_err(io)?;
    let mut cmd = tokio::process::Command::new("bash");
    cmd.arg(file.path())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(if show {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .kill_on_drop(true);
    let out = cmd.output().await.map_err(io)?;
    let dir = String::from_utf8_lossy(&out.stdout)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| PathBuf::from(l.trim()));
    Ok(dir.filter(|_| out.status.success()))
}

/// Where Claude Code is when it is already there (`$AGENTBOX_CLIENTS_DIR`, or the cache).
///
/// # Errors
/// When the install script cannot run.
pub async fn installed(env: &dyn HostEnv) -> Result<Option<PathBuf>, CliError> {
    if let Some(dir) = env.var("AGENTBOX_CLIENTS_DIR") {
        return Ok(Some(PathBuf::from(dir)));
    }
    script(&["--cached", "claude"], false).await
}

/// The `claude` binary under a clients directory.
///
/// # Errors
/// When it is not there.
pub fn claude_bin(dir: &Path) -> Result<PathBuf, CliError> {
    let bin = dir.join("node_modules/.bin/claude");
    std::fs::canonicalize(&bin).map_err(|e| CliError::Io {
        what: format!("finding Claude Code at {}", bin.display()),
        reason: format!(
            "{e}; rerun scripts/install-clients.sh (or fix AGENTBOX_CLIENTS_DIR={})",
            dir.display()
        ),
    })
}

/// Installs the pinned Claude Code (saying so first); its clients directory.
///
/// # Errors
/// When npm fails (no network, no npm).
pub async fn install() -> Result<PathBuf, CliError> {
    eprintln!(
        "agentbox: installing the pinned Claude Code ({}) with npm, once: later runs use the cache under ~/.cache/agentbox/clients",
        pinned()
    );
    script(&["claude"], true).await?.ok_or_else(|| CliError::Io {
        what: format!("installing {}", pinned()),
        reason: "npm failed (its messages are above); check the network and npm, or set AGENTBOX_CLIENTS_DIR to an existing install".to_owned(),
    })
}
