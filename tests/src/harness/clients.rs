//! Locating the real agent CLIs: `AGENTBOX_CLIENTS_DIR` if set, else whatever
//! `scripts/install-clients.sh` prints (it installs once into a versioned cache and is quick
//! after that). A missing client is an error, never a skipped test.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use super::HarnessError;

/// The workspace root (the directory holding the root `Cargo.toml`).
#[must_use]
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The install directory of the real agent CLIs (binaries in `node_modules/.bin`).
///
/// # Errors
/// When `AGENTBOX_CLIENTS_DIR` points nowhere, or the install script fails.
pub fn clients_dir() -> Result<PathBuf, HarnessError> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(find_clients_dir)
        .clone()
        .map_err(HarnessError::Clients)
}

fn find_clients_dir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("AGENTBOX_CLIENTS_DIR") {
        let dir = PathBuf::from(dir);
        return if dir.is_dir() {
            Ok(dir)
        } else {
            Err(format!(
                "AGENTBOX_CLIENTS_DIR={} is not a directory",
                dir.display()
            ))
        };
    }
    let script = workspace_root().join("scripts/install-clients.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed with {} (set AGENTBOX_CLIENTS_DIR to an existing install to skip it)",
            script.display(),
            out.status
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dir = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| PathBuf::from(l.trim()))
        .ok_or_else(|| format!("{} printed no directory", script.display()))?;
    if dir.is_dir() {
        Ok(dir)
    } else {
        Err(format!(
            "{} printed {}, which is not a directory",
            script.display(),
            dir.display()
        ))
    }
}

/// The path of one real client binary (`claude`, `opencode`, `codex`, `openclaw`).
///
/// # Errors
/// When the clients cannot be located or this one is not installed.
pub fn client_bin(name: &str) -> Result<PathBuf, HarnessError> {
    let dir = clients_dir()?;
    let bin = dir.join("node_modules/.bin").join(name);
    if bin.exists() {
        Ok(bin)
    } else {
        Err(HarnessError::Clients(format!(
            "{} is missing; rerun scripts/install-clients.sh (or fix AGENTBOX_CLIENTS_DIR={})",
            bin.display(),
            dir.display()
        )))
    }
}
