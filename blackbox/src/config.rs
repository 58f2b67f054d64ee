//! The server's configuration: `BBS_*` environment variables with the reference's defaults
//! (read only through [`HostEnv`], so tests never touch the process environment), the
//! per-registration `server_config` override, and the `--help` text that lists every variable.
//!
//! A variable that is set but does not parse, or is out of range, is a startup error naming it:
//! a typo must not silently become the default.

use std::path::PathBuf;
use std::time::Duration;

use agentbox_policy::config::HostEnv;
use agentbox_policy::secret::Secret;
use serde::{Deserialize, Serialize};

/// The environment variables, their defaults and what they mean: the source of `--help`, so
/// the list cannot drift from what [`ServerConfig::from_env`] reads.
pub const VARIABLES: &[(&str, &str, &str)] = &[
    ("BBS_HOST", "0.0.0.0", "address to listen on"),
    ("BBS_PORT", "23456", "port to listen on"),
    (
        "BBS_UNIX_SOCKET",
        "unset",
        "absolute path of a unix socket to listen on instead of BBS_HOST:BBS_PORT (created fresh, mode 0666: its directory controls access)",
    ),
    (
        "BBS_ROUTER_URL",
        "unset",
        "the router every registration's model calls go to, whatever router it names: http://host:port[/path] or unix:/abs/path.sock",
    ),
    (
        "BBS_ROUTER_TOKEN",
        "unset",
        "sent as Authorization: Bearer on every call to the router (never logged)",
    ),
    (
        "BBS_RUNTIME_ROOT",
        "/tmp/blackbox_server",
        "where each registration gets its runtime directory (agent home, logs)",
    ),
    (
        "BBS_MAX_SESSIONS",
        "1",
        "sessions tracked at once (>= 1); aborted ones are evicted first",
    ),
    (
        "BBS_MAX_TURNS",
        "200",
        "committed turns a session may take before 429",
    ),
    (
        "BBS_BACKEND_TIMEOUT",
        "960",
        "seconds one turn may take in the agent (paused time excluded) before it is unknown, 504",
    ),
    (
        "BBS_EXECUTE_CMD_TIMEOUT",
        "600",
        "default seconds for execute_cmd (> 0)",
    ),
    (
        "BBS_ROUTER_TIMEOUT",
        "600000",
        "milliseconds the agent and the proxy wait for one model call",
    ),
    (
        "BBS_SHUTDOWN_TIMEOUT",
        "30",
        "seconds SIGTERM waits for turns and requests before stopping the agent",
    ),
    (
        "BBS_RUNTIME_HEALTH_CHECK_INTERVAL",
        "10",
        "seconds between agent health checks (> 0)",
    ),
    (
        "BBS_RUNTIME_HEALTH_CHECK_RETRIES",
        "3",
        "failed checks in a row that declare the agent dead (>= 1)",
    ),
    (
        "BBS_RUNTIME_HEALTH_CHECK_RETRY_DELAY",
        "0.5",
        "seconds between those retries (>= 0)",
    ),
    ("OPENCODE_BIN", "opencode", "the opencode binary"),
    (
        "OPENCLAW_BIN",
        "openclaw",
        "the openclaw binary (run with the Node next to it, if any)",
    ),
    ("CLAUDE_CODE_BIN", "claude", "the Claude Code binary"),
    ("CODEX_BIN", "codex", "the Codex binary"),
];

/// The `--help` epilogue: every variable with its default.
#[must_use]
pub fn variables_help() -> String {
    let mut out = String::from("Environment variables (default in brackets):\n");
    for (name, default, what) in VARIABLES {
        out.push_str(&format!("  {name:<38} {what} [{default}]\n"));
    }
    out
}

/// A variable that does not hold a valid value.
#[derive(Debug, thiserror::Error)]
#[error("{name}={value:?}: {reason}")]
pub struct ConfigError {
    /// The variable.
    pub name: &'static str,
    /// What it held.
    pub value: String,
    /// Why that is refused.
    pub reason: String,
}

/// The reference's `BlackboxServerConfig`, field for field: `/v1/status` and register answers
/// show it as `config`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServerConfig {
    /// `BBS_HOST`.
    pub host: String,
    /// `BBS_PORT`.
    pub port: u16,
    /// `BBS_RUNTIME_ROOT`.
    pub runtime_root: String,
    /// `BBS_MAX_SESSIONS`.
    pub max_sessions: u64,
    /// `BBS_MAX_TURNS`.
    pub max_turns: u64,
    /// `BBS_BACKEND_TIMEOUT`, seconds.
    pub backend_timeout: f64,
    /// `BBS_EXECUTE_CMD_TIMEOUT`, seconds.
    pub execute_cmd_timeout: f64,
    /// `BBS_ROUTER_TIMEOUT`, milliseconds.
    pub router_timeout: u64,
    /// `BBS_SHUTDOWN_TIMEOUT`, seconds.
    pub shutdown_timeout: f64,
    /// Seconds between health probes while an agent starts (not a variable in the reference).
    pub health_check_interval: f64,
    /// Seconds an agent may take to become healthy (not a variable in the reference).
    pub health_check_timeout: f64,
    /// `BBS_RUNTIME_HEALTH_CHECK_INTERVAL`, seconds.
    pub runtime_health_check_interval: f64,
    /// `BBS_RUNTIME_HEALTH_CHECK_RETRIES`.
    pub runtime_health_check_retries: u64,
    /// `BBS_RUNTIME_HEALTH_CHECK_RETRY_DELAY`, seconds.
    pub runtime_health_check_retry_delay: f64,
}

/// Where the agent binaries are (`*_BIN`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bins {
    /// `OPENCODE_BIN`.
    pub opencode: String,
    /// `OPENCLAW_BIN`.
    pub openclaw: String,
    /// `CLAUDE_CODE_BIN`.
    pub claude_code: String,
    /// `CODEX_BIN`.
    pub codex: String,
}

/// Where the router is, when `BBS_ROUTER_URL` overrides the registrations' `router`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouterUrl {
    /// `http(s)://host[:port][/path]`: `origin` is `scheme://host[:port]`; `api_path` replaces
    /// the registration's `router_api_path` when the URL has a path.
    Http {
        /// `scheme://host[:port]`.
        origin: String,
        /// The URL's path without a trailing `/`, if it had one.
        api_path: Option<String>,
    },
    /// `unix:/abs/path.sock`: HTTP over that socket, with the registration's API path.
    Unix(PathBuf),
}

/// How the server reaches its router, from `BBS_ROUTER_URL` and `BBS_ROUTER_TOKEN`; not part of
/// [`ServerConfig`] (which `/v1/status` shows) so the token is never in an answer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RouterSettings {
    /// Replaces every registration's router; `None`: the registration's.
    pub url: Option<RouterUrl>,
    /// `Authorization: Bearer` on every router call; client copies are dropped.
    pub token: Option<Secret>,
}

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// `BBS_HOST:BBS_PORT`.
    Tcp,
    /// `BBS_UNIX_SOCKET`.
    Unix(PathBuf),
}

/// Everything read from the environment at start.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The server settings.
    pub server: ServerConfig,
    /// The agent binaries.
    pub bins: Bins,
    /// Where to listen.
    pub listen: Listen,
    /// The router override and its token.
    pub router: RouterSettings,
}

/// The longest unix socket path (`sun_path` holds 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// An absolute unix socket path.
fn socket_path(s: &str) -> Result<PathBuf, String> {
    if !s.starts_with('/') {
        return Err("must be an absolute path".into());
    }
    if s.len() > MAX_SOCKET_PATH {
        return Err(format!(
            "a unix socket path is at most {MAX_SOCKET_PATH} bytes"
        ));
    }
    if s.ends_with('/') || s.split('/').any(|c| c == "." || c == "..") {
        return Err("must name a file by a normalized path".into());
    }
    Ok(PathBuf::from(s))
}

/// `BBS_ROUTER_URL`.
pub fn router_url(s: &str) -> Result<RouterUrl, String> {
    if let Some(path) = s.strip_prefix("unix:") {
        return socket_path(path).map(RouterUrl::Unix);
    }
    let url = url::Url::parse(s)
        .map_err(|e| format!("expected http://host:port[/path] or unix:/abs/path.sock ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("expected http://host:port[/path] or unix:/abs/path.sock".into());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not carry credentials (use BBS_ROUTER_TOKEN)".into());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err("must not have a query or fragment".into());
    }
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| "has no host".to_owned())?;
    let origin = match url.port() {
        Some(p) => format!("{}://{host}:{p}", url.scheme()),
        None => format!("{}://{host}", url.scheme()),
    };
    let path = url.path().trim_end_matches('/');
    Ok(RouterUrl::Http {
        origin,
        api_path: (!path.is_empty()).then(|| path.to_owned()),
    })
}

/// An optional variable (listed as `unset`): `None` when unset, else parsed.
fn optional<T>(
    env: &dyn HostEnv,
    name: &'static str,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Option<T>, ConfigError> {
    match env.var(name) {
        None => Ok(None),
        Some(value) => parse(value.trim()).map(Some).map_err(|reason| ConfigError {
            name,
            value,
            reason,
        }),
    }
}

/// Reads one variable of [`VARIABLES`] with `parse`; unset means its listed default, parsed
/// the same way, so the default `--help` shows is the one used.
fn var<T>(
    env: &dyn HostEnv,
    name: &'static str,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<T, ConfigError> {
    let listed = VARIABLES
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, default, _)| (*default).to_owned());
    let value = env.var(name).or(listed).unwrap_or_default();
    parse(value.trim()).map_err(|reason| ConfigError {
        name,
        value,
        reason,
    })
}

fn port(s: &str) -> Result<u16, String> {
    s.parse()
        .map_err(|_| "not a port number (0-65535)".to_owned())
}

fn absolute(s: &str) -> Result<String, String> {
    if s.starts_with('/') {
        Ok(s.to_owned())
    } else {
        Err("must be an absolute path".into())
    }
}

fn int(min: u64) -> impl Fn(&str) -> Result<u64, String> {
    move |s| {
        let v: u64 = s
            .parse()
            .map_err(|_| "not a non-negative integer".to_owned())?;
        if v < min {
            return Err(format!("must be at least {min}"));
        }
        Ok(v)
    }
}

/// A finite number of seconds, `> 0` when `positive`, else `>= 0`.
fn seconds(positive: bool) -> impl Fn(&str) -> Result<f64, String> {
    move |s| {
        let v: f64 = s.parse().map_err(|_| "not a number".to_owned())?;
        check_seconds(v, positive)
    }
}

fn check_seconds(v: f64, positive: bool) -> Result<f64, String> {
    if !v.is_finite() {
        return Err("must be finite".into());
    }
    if positive && v <= 0.0 {
        return Err("must be greater than 0".into());
    }
    if v < 0.0 {
        return Err("must not be negative".into());
    }
    // Durations are built from these; keep them within what `Duration` holds.
    if v > MAX_SECONDS {
        return Err("too large".into());
    }
    Ok(v)
}

fn text(s: &str) -> Result<String, String> {
    if s.is_empty() {
        Err("must not be empty".into())
    } else {
        Ok(s.to_owned())
    }
}

impl Config {
    /// Reads every variable of [`VARIABLES`].
    ///
    /// # Errors
    /// The first variable that is set to something invalid.
    pub fn from_env(env: &dyn HostEnv) -> Result<Config, ConfigError> {
        let server = ServerConfig {
            host: var(env, "BBS_HOST", text)?,
            port: var(env, "BBS_PORT", port)?,
            runtime_root: var(env, "BBS_RUNTIME_ROOT", absolute)?,
            max_sessions: var(env, "BBS_MAX_SESSIONS", int(1))?,
            max_turns: var(env, "BBS_MAX_TURNS", int(0))?,
            backend_timeout: var(env, "BBS_BACKEND_TIMEOUT", seconds(true))?,
            execute_cmd_timeout: var(env, "BBS_EXECUTE_CMD_TIMEOUT", seconds(true))?,
            router_timeout: var(env, "BBS_ROUTER_TIMEOUT", int(1))?,
            shutdown_timeout: var(env, "BBS_SHUTDOWN_TIMEOUT", seconds(false))?,
            health_check_interval: 2.0,
            health_check_timeout: 60.0,
            runtime_health_check_interval: var(
                env,
                "BBS_RUNTIME_HEALTH_CHECK_INTERVAL",
                seconds(true),
            )?,
            runtime_health_check_retries: var(env, "BBS_RUNTIME_HEALTH_CHECK_RETRIES", int(1))?,
            runtime_health_check_retry_delay: var(
                env,
                "BBS_RUNTIME_HEALTH_CHECK_RETRY_DELAY",
                seconds(false),
            )?,
        };
        let bins = Bins {
            opencode: var(env, "OPENCODE_BIN", text)?,
            openclaw: var(env, "OPENCLAW_BIN", text)?,
            claude_code: var(env, "CLAUDE_CODE_BIN", text)?,
            codex: var(env, "CODEX_BIN", text)?,
        };
        let listen = match optional(env, "BBS_UNIX_SOCKET", socket_path)? {
            Some(p) => Listen::Unix(p),
            None => Listen::Tcp,
        };
        let token = match env.var("BBS_ROUTER_TOKEN") {
            None => None,
            Some(t) => {
                let bad = |reason: &str| ConfigError {
                    name: "BBS_ROUTER_TOKEN",
                    // The value is a secret: never echoed.
                    value: "<redacted>".into(),
                    reason: reason.into(),
                };
                if t.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
                    return Err(bad("must be printable ASCII without spaces"));
                }
                Some(Secret::new(t).ok_or_else(|| bad("must not be empty"))?)
            }
        };
        let router = RouterSettings {
            url: optional(env, "BBS_ROUTER_URL", router_url)?,
            token,
        };
        Ok(Config {
            server,
            bins,
            listen,
            router,
        })
    }
}

/// Seconds as a `Duration` (the values were checked finite; a negative one is zero).
#[must_use]
pub fn secs(v: f64) -> Duration {
    // A request's huge timeout means "as long as it takes", never "at once": capped at
    // MAX_SECONDS (31 years), which deadlines computed from it (`Instant + Duration`) hold.
    Duration::try_from_secs_f64(v.min(MAX_SECONDS)).unwrap_or(Duration::ZERO)
}

/// The longest duration a setting or a request's timeout stands for.
const MAX_SECONDS: f64 = 1e9;

impl ServerConfig {
    /// `backend_timeout` as a duration.
    #[must_use]
    pub fn backend_timeout(&self) -> Duration {
        secs(self.backend_timeout)
    }

    /// `router_timeout` (milliseconds) as a duration.
    #[must_use]
    pub fn router_timeout(&self) -> Duration {
        Duration::from_millis(self.router_timeout)
    }
}

/// The register request's `server_config`: any subset of the tunable settings, applied over the
/// environment's for that registration only. Unknown keys are ignored, as pydantic does.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerConfigOverride {
    /// See [`ServerConfig::runtime_root`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_root: Option<String>,
    /// `>= 1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sessions: Option<u64>,
    /// See [`ServerConfig::max_turns`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_turns: Option<u64>,
    /// Seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_timeout: Option<f64>,
    /// Seconds, `> 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execute_cmd_timeout: Option<f64>,
    /// Milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_timeout: Option<u64>,
    /// Seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_health_check_interval: Option<f64>,
    /// `>= 1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_health_check_retries: Option<u64>,
    /// Seconds, `>= 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_health_check_retry_delay: Option<f64>,
}

/// `field` replaced by `with`, when given.
fn set<T: Clone>(field: &mut T, with: &Option<T>) {
    if let Some(v) = with {
        field.clone_from(v);
    }
}

impl ServerConfigOverride {
    /// The range checks of the reference's model, as `(field, message)` pairs.
    #[must_use]
    pub fn violations(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if self.max_sessions == Some(0) {
            out.push((
                "max_sessions",
                "Input should be greater than or equal to 1".into(),
            ));
        }
        if self.runtime_health_check_retries == Some(0) {
            out.push((
                "runtime_health_check_retries",
                "Input should be greater than or equal to 1".into(),
            ));
        }
        let floats = [
            ("backend_timeout", self.backend_timeout, true),
            ("execute_cmd_timeout", self.execute_cmd_timeout, true),
            (
                "runtime_health_check_interval",
                self.runtime_health_check_interval,
                true,
            ),
            (
                "runtime_health_check_retry_delay",
                self.runtime_health_check_retry_delay,
                false,
            ),
        ];
        for (name, value, positive) in floats {
            if let Some(v) = value
                && let Err(reason) = check_seconds(v, positive)
            {
                out.push((name, format!("Input {reason}")));
            }
        }
        if let Some(root) = &self.runtime_root
            && !root.starts_with('/')
        {
            out.push(("runtime_root", "Input must be an absolute path".into()));
        }
        out
    }

    /// `base` with the given fields replaced.
    #[must_use]
    pub fn apply(&self, base: &ServerConfig) -> ServerConfig {
        let mut c = base.clone();
        set(&mut c.runtime_root, &self.runtime_root);
        set(&mut c.max_sessions, &self.max_sessions);
        set(&mut c.max_turns, &self.max_turns);
        set(&mut c.backend_timeout, &self.backend_timeout);
        set(&mut c.execute_cmd_timeout, &self.execute_cmd_timeout);
        set(&mut c.router_timeout, &self.router_timeout);
        set(
            &mut c.runtime_health_check_interval,
            &self.runtime_health_check_interval,
        );
        set(
            &mut c.runtime_health_check_retries,
            &self.runtime_health_check_retries,
        );
        set(
            &mut c.runtime_health_check_retry_delay,
            &self.runtime_health_check_retry_delay,
        );
        c
    }
}

#[cfg(test)]
mod tests {
    use agentbox_policy::config::FixedEnv;

    use super::*;

    #[test]
    fn a_huge_timeout_is_long_not_zero() {
        assert_eq!(secs(1e20), Duration::from_secs(1_000_000_000));
        assert_eq!(secs(2.5), Duration::from_millis(2500));
        assert_eq!(secs(-1.0), Duration::ZERO);
    }

    fn env(vars: &[(&str, &str)]) -> FixedEnv {
        FixedEnv {
            vars: vars
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            euid: 0,
        }
    }

    #[test]
    fn defaults_are_the_reference_ones() {
        let c = Config::from_env(&env(&[])).unwrap_or_else(|e| panic!("{e}"));
        let s = &c.server;
        assert_eq!(s.host, "0.0.0.0");
        assert_eq!(s.port, 23456);
        assert_eq!(s.runtime_root, "/tmp/blackbox_server");
        assert_eq!((s.max_sessions, s.max_turns), (1, 200));
        assert_eq!(s.backend_timeout, 960.0);
        assert_eq!(s.execute_cmd_timeout, 600.0);
        assert_eq!(s.router_timeout, 600_000);
        assert_eq!(s.shutdown_timeout, 30.0);
        assert_eq!(s.runtime_health_check_interval, 10.0);
        assert_eq!(s.runtime_health_check_retries, 3);
        assert_eq!(s.runtime_health_check_retry_delay, 0.5);
        assert_eq!(c.bins.opencode, "opencode");
        assert_eq!(c.bins.claude_code, "claude");
    }

    #[test]
    fn every_variable_is_read_and_listed() {
        let c = Config::from_env(&env(&[
            ("BBS_PORT", "8081"),
            ("BBS_BACKEND_TIMEOUT", "1.5"),
            ("BBS_RUNTIME_HEALTH_CHECK_RETRY_DELAY", "0"),
            ("OPENCODE_BIN", "/opt/oc"),
        ]))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.server.port, 8081);
        assert_eq!(c.server.backend_timeout, 1.5);
        assert_eq!(c.server.runtime_health_check_retry_delay, 0.0);
        assert_eq!(c.bins.opencode, "/opt/oc");
        let help = variables_help();
        for (name, _, _) in VARIABLES {
            assert!(help.contains(name), "{name} missing from help");
        }
    }

    #[test]
    fn a_bad_value_names_the_variable() {
        for (name, value) in [
            ("BBS_PORT", "70000"),
            ("BBS_PORT", "abc"),
            ("BBS_MAX_SESSIONS", "0"),
            ("BBS_BACKEND_TIMEOUT", "-1"),
            ("BBS_BACKEND_TIMEOUT", "nan"),
            ("BBS_EXECUTE_CMD_TIMEOUT", "0"),
            ("BBS_RUNTIME_HEALTH_CHECK_RETRIES", "0"),
            ("BBS_RUNTIME_ROOT", "relative/dir"),
            ("BBS_HOST", ""),
        ] {
            let err = Config::from_env(&env(&[(name, value)])).expect_err(name);
            assert_eq!(err.name, name);
            assert!(err.to_string().starts_with(name), "{err}");
        }
    }

    #[test]
    fn unix_socket_and_router_variables() {
        let c = Config::from_env(&env(&[])).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.listen, Listen::Tcp);
        assert_eq!(c.router, RouterSettings::default());
        let c = Config::from_env(&env(&[
            ("BBS_UNIX_SOCKET", "/run/bbs/server.sock"),
            ("BBS_ROUTER_URL", "unix:/run/gw/llm.sock"),
            ("BBS_ROUTER_TOKEN", "tok-123"),
        ]))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.listen, Listen::Unix("/run/bbs/server.sock".into()));
        assert_eq!(
            c.router.url,
            Some(RouterUrl::Unix("/run/gw/llm.sock".into()))
        );
        assert_eq!(c.router.token.as_ref().map(Secret::expose), Some("tok-123"));
        assert!(
            !format!("{c:?}").contains("tok-123"),
            "the token is redacted"
        );
        assert_eq!(
            router_url("http://10.0.0.2:8000/v1/").unwrap_or_else(|e| panic!("{e}")),
            RouterUrl::Http {
                origin: "http://10.0.0.2:8000".into(),
                api_path: Some("/v1".into())
            }
        );
        assert_eq!(
            router_url("http://r:8000").unwrap_or_else(|e| panic!("{e}")),
            RouterUrl::Http {
                origin: "http://r:8000".into(),
                api_path: None
            }
        );
    }

    #[test]
    fn bad_unix_socket_and_router_values_name_the_variable() {
        let long = format!("/{}", "a".repeat(120));
        for (name, value) in [
            ("BBS_UNIX_SOCKET", "relative.sock"),
            ("BBS_UNIX_SOCKET", ""),
            ("BBS_UNIX_SOCKET", "/run/../etc/x.sock"),
            ("BBS_UNIX_SOCKET", "/run/dir/"),
            ("BBS_UNIX_SOCKET", long.as_str()),
            ("BBS_ROUTER_URL", "unix:relative.sock"),
            ("BBS_ROUTER_URL", "ftp://h/x"),
            ("BBS_ROUTER_URL", "not a url"),
            ("BBS_ROUTER_URL", "http://user:pw@h:1/v1"),
            ("BBS_ROUTER_URL", "http://h:1/v1?x=1"),
            ("BBS_ROUTER_TOKEN", ""),
            ("BBS_ROUTER_TOKEN", "two words"),
        ] {
            let err = Config::from_env(&env(&[(name, value)])).expect_err(value);
            assert_eq!(err.name, name, "{value}");
            assert!(err.to_string().starts_with(name), "{err}");
        }
        let err = Config::from_env(&env(&[("BBS_ROUTER_TOKEN", "bad token")])).expect_err("token");
        assert!(!err.to_string().contains("bad token"), "{err}");
    }

    #[test]
    fn override_applies_only_given_fields_and_checks_ranges() {
        let base = Config::from_env(&env(&[])).unwrap_or_else(|e| panic!("{e}"));
        let o: ServerConfigOverride =
            serde_json::from_str(r#"{"backend_timeout": 0.5, "unknown": 1}"#)
                .unwrap_or_else(|e| panic!("{e}"));
        let c = o.apply(&base.server);
        assert_eq!(c.backend_timeout, 0.5);
        assert_eq!(c.max_turns, 200);
        assert!(o.violations().is_empty());
        let bad: ServerConfigOverride =
            serde_json::from_str(r#"{"execute_cmd_timeout": 0, "max_sessions": 0}"#)
                .unwrap_or_else(|e| panic!("{e}"));
        let fields: Vec<_> = bad.violations().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["max_sessions", "execute_cmd_timeout"]);
    }
}
