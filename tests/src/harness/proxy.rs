//! `blackbox-proxy` (blackbox-server's rollout LLM proxy, run alone) as a child process for the
//! proxy's integration tests and the bench: its agent-facing address and its control API.

use serde_json::Value;

use super::{HarnessError, Service};

deref_to_service!(BlackboxProxy);

/// A running `blackbox-proxy`.
#[derive(Debug)]
pub struct BlackboxProxy {
    service: Service,
    address: String,
    control: String,
}

impl BlackboxProxy {
    /// Starts the proxy in front of `upstream` (a router origin such as fakellm's base URL)
    /// with extra command-line `args` (`--max-steps 2`, `--default-temperature 0.7`, ...).
    ///
    /// # Errors
    /// When the binary cannot be built or the proxy does not come up.
    pub fn start(upstream: &str, args: &[&str]) -> Result<Self, HarnessError> {
        let (service, line) = super::blackbox::start_bin("blackbox-proxy", |cmd| {
            cmd.arg("--upstream")
                .arg(upstream)
                .args(args)
                .env_clear()
                .env("RUST_LOG", "info");
        })?;
        let (address, control) = line
            .split_once(" control ")
            .map(|(a, c)| (a.to_owned(), c.to_owned()))
            .ok_or_else(|| HarnessError::Build(format!("unexpected ready line {line:?}")))?;
        Ok(Self {
            service,
            address,
            control,
        })
    }

    /// `http://127.0.0.1:PORT`: where agents connect.
    #[must_use]
    pub fn base_url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// `http://127.0.0.1:PORT` of the control API.
    #[must_use]
    pub fn control_url(&self) -> String {
        format!("http://{}", self.control)
    }

    /// One control call (`GET` when `body` is `None`, else `POST` it as JSON): its status and
    /// JSON answer (`null` when empty).
    ///
    /// # Errors
    /// When the exchange fails or the answer is not JSON.
    pub async fn control(
        &self,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), HarnessError> {
        let client = reqwest::Client::new();
        let url = format!("{}{path}", self.control_url());
        let req = match body {
            Some(b) => client.post(&url).json(b),
            None => client.get(&url),
        };
        let fail = |e: reqwest::Error| HarnessError::Build(format!("control {path}: {e}"));
        let resp = req.send().await.map_err(fail)?;
        let status = resp.status().as_u16();
        let text = resp.text().await.map_err(fail)?;
        let value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).map_err(|source| HarnessError::Json {
                what: format!("control {path}"),
                source,
            })?
        };
        Ok((status, value))
    }
}
