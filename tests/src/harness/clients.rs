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

/// The real `name` CLI hard-linked (or copied) to `dir/name`, mode 0755: the agent uid must be
/// able to read it inside a sandbox, and the clients cache lives under `/root`.
///
/// # Errors
/// When the client is missing or cannot be placed.
pub fn readable_client(name: &str, dir: &Path) -> Result<PathBuf, HarnessError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| HarnessError::Io { path, source }
    };
    let bin = client_bin(name)?;
    let real = std::fs::canonicalize(&bin).map_err(io(&bin))?;
    let target = dir.join(name);
    if std::fs::hard_link(&real, &target).is_err() {
        std::fs::copy(&real, &target).map_err(io(&target))?;
    }
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))
        .map_err(io(&target))?;
    Ok(target)
}

/// The real Claude Code headless on the host: `claude -p PROMPT` with stream-json output and
/// `model`, in `workdir`, against `base_url` with `token`, in a clean environment whose HOME,
/// config and temp dirs are `home`, `home/.claude` and `tmp`, without telemetry or updates.
/// The caller adds its own flags (permission mode, MCP config) and environment.
///
/// # Errors
/// When the client is not installed.
pub fn claude_headless(
    workdir: &Path,
    home: &Path,
    tmp: &Path,
    base_url: &str,
    token: &str,
    model: &str,
    prompt: &str,
) -> Result<tokio::process::Command, HarnessError> {
    let mut cmd = tokio::process::Command::new(client_bin("claude")?);
    cmd.current_dir(workdir)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", home)
        .env("CLAUDE_CONFIG_DIR", home.join(".claude"))
        .env("TMPDIR", tmp)
        .env("ANTHROPIC_BASE_URL", base_url)
        .env("ANTHROPIC_AUTH_TOKEN", token)
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        // bypassPermissions refuses to run as root unless told it is sandboxed; tests run
        // as root on CI and their temp dirs are all it may touch.
        .env("IS_SANDBOX", "1")
        .args(["-p", prompt])
        .args(["--output-format", "stream-json", "--verbose"])
        .args(["--model", model]);
    Ok(cmd)
}

/// The `cmd` of a one-shot Claude Code agent ([`agentbox_api::launcher::claude_print_cmd`])
/// with the model fakellm scripts answer.
#[must_use]
pub fn claude_print_cmd() -> Vec<String> {
    agentbox_api::launcher::claude_print_cmd("claude-sonnet-4-5")
}

/// The `{"type":"result"}` event of Claude Code's stream-json output.
#[must_use]
pub fn stream_json_result(stdout: &str) -> Option<serde_json::Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|e| e["type"] == "result")
}
