//! Running the `fakellm` binary as a child process for a test: script and log in a temp dir,
//! TCP port 0 or a unix socket, killed on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use super::{HarnessError, Service};

deref_to_service!(FakeLlm);

/// The script of an agent's two turns that edit a file: the first calls `tool` (named
/// `name`, with `input`) as call `call` and ends with `done` once the call's result comes back;
/// a request naming "second question" ends with `second turn done`. Requests without tools
/// (titles) get `title`.
#[must_use]
pub fn two_turn_write_script(title: &str, call: &str, name: &str, input: &Value) -> Value {
    serde_json::json!({
        "rules": [{"match": {"has_tools": false}, "text": title}],
        "steps": [
            {"match": {"has_tools": true},
             "tool_calls": [{"id": call, "name": name, "input": input}],
             "usage": {"input_tokens": 100, "output_tokens": 20}},
            {"match": {"has_tools": true, "body_contains": call}, "text": "done",
             "usage": {"input_tokens": 130, "output_tokens": 2}},
            {"match": {"has_tools": true, "body_contains": "second question"},
             "text": "second turn done"}
        ]
    })
}

/// A running fakellm.
#[derive(Debug)]
pub struct FakeLlm {
    service: Service,
    address: String,
    log: PathBuf,
    socket: Option<PathBuf>,
    // Declared last so the process is gone before its files are removed.
    _dir: tempfile::TempDir,
}

impl FakeLlm {
    /// Starts `bin` (pass `env!("CARGO_BIN_EXE_fakellm")`) on `127.0.0.1:0` with `script`.
    ///
    /// # Errors
    /// When fakellm cannot start or refuses the script.
    pub fn start(bin: &Path, script: &Value) -> Result<Self, HarnessError> {
        Self::start_inner(bin, script, false)
    }

    /// [`FakeLlm::start`] with this workspace's fakellm binary.
    ///
    /// # Errors
    /// When fakellm cannot be built or started, or refuses the script.
    pub fn scripted(script: &Value) -> Result<Self, HarnessError> {
        Self::start_inner(
            &super::workspace_bin("agentbox-tests", "fakellm")?,
            script,
            false,
        )
    }

    /// Like [`FakeLlm::start`] but listening on a unix socket in its temp dir.
    ///
    /// # Errors
    /// When fakellm cannot start or refuses the script.
    pub fn start_unix(bin: &Path, script: &Value) -> Result<Self, HarnessError> {
        Self::start_inner(bin, script, true)
    }

    fn start_inner(bin: &Path, script: &Value, unix: bool) -> Result<Self, HarnessError> {
        let (dir, script_path) = super::temp_file("fakellm-", "script.json", &script.to_string())?;
        let log = dir.path().join("requests.jsonl");
        let mut cmd = Command::new(bin);
        cmd.arg("--script").arg(&script_path).arg("--log").arg(&log);
        let socket = unix.then(|| dir.path().join("llm.sock"));
        match &socket {
            Some(s) => cmd.arg("--unix").arg(s),
            None => cmd.arg("--listen").arg("127.0.0.1:0"),
        };
        let (service, address) =
            Service::start_listening("fakellm", cmd, Duration::from_secs(20), "listening on ")?;
        Ok(Self {
            service,
            address,
            log,
            socket,
            _dir: dir,
        })
    }

    /// A catalogue (TOML) of two remote models on this fakellm, as the bridge and the gateway
    /// read it: `claude` (provider `anthropic`, key in `$anthropic_key_env`, passed through)
    /// and `gpt` (provider `openai`, key in `$openai_key_env`, translated).
    #[must_use]
    pub fn remote_models(&self, anthropic_key_env: &str, openai_key_env: &str) -> String {
        format!(
            "[models.claude]\nbackend = \"remote\"\nprovider = \"anthropic\"\nbase_url = \"{base}\"\n\
             upstream_model = \"claude-upstream\"\nkey_env = \"{anthropic_key_env}\"\n\n\
             [models.gpt]\nbackend = \"remote\"\nprovider = \"openai\"\nbase_url = \"{base}/v1\"\n\
             upstream_model = \"gpt-upstream\"\nkey_env = \"{openai_key_env}\"\n",
            base = self.base_url()
        )
    }

    /// `127.0.0.1:PORT`, or `unix:PATH`.
    #[must_use]
    pub fn address(&self) -> &str {
        &self.address
    }

    /// `http://127.0.0.1:PORT` (no trailing slash, no `/v1`).
    #[must_use]
    pub fn base_url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The gateway's `[models.rollout]`: a `backend = "router"` model with this fakellm as the
    /// RL router.
    #[must_use]
    pub fn router_model(&self) -> String {
        format!(
            "[models.rollout]\nbackend = \"router\"\nbase_url = \"{}/v1\"\n",
            self.base_url()
        )
    }

    /// A gateway config whose one model is [`FakeLlm::router_model`] and whose Ollama is a
    /// dead port (nothing may reach it).
    #[must_use]
    pub fn router_gateway_config(&self) -> String {
        format!(
            "[gateway]\nollama_url = \"http://127.0.0.1:9\"\n\n{}",
            self.router_model()
        )
    }

    /// The unix socket, when started with [`FakeLlm::start_unix`].
    #[must_use]
    pub fn socket(&self) -> Option<&Path> {
        self.socket.as_deref()
    }

    /// The JSONL request log.
    #[must_use]
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Every request logged so far, in arrival order.
    ///
    /// # Errors
    /// When the log cannot be read or a line is not JSON.
    pub fn requests(&self) -> Result<Vec<Value>, HarnessError> {
        let text = match std::fs::read_to_string(&self.log) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(source) => {
                return Err(HarnessError::Io {
                    path: self.log.clone(),
                    source,
                });
            }
        };
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str(l).map_err(|source| HarnessError::Json {
                    what: self.log.display().to_string(),
                    source,
                })
            })
            .collect()
    }

    /// The chat-completion requests logged so far.
    ///
    /// # Errors
    /// As [`FakeLlm::requests`].
    pub fn chat_requests(&self) -> Result<Vec<Value>, HarnessError> {
        Ok(self
            .requests()?
            .into_iter()
            .filter(|r| {
                r["path"]
                    .as_str()
                    .is_some_and(|p| p.contains("/chat/completions"))
            })
            .collect())
    }

    /// The responses clients abandoned mid-way (`<log>.disconnects`): `{seq, frames_sent,
    /// frames_total}` each.
    ///
    /// # Errors
    /// When the file exists but cannot be read or parsed.
    pub fn disconnects(&self) -> Result<Vec<Value>, HarnessError> {
        let mut p = self.log.as_os_str().to_owned();
        p.push(".disconnects");
        let path = PathBuf::from(p);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(HarnessError::Io { path, source }),
        };
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str(l).map_err(|source| HarnessError::Json {
                    what: path.display().to_string(),
                    source,
                })
            })
            .collect()
    }
}
