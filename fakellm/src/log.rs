//! The request log: one JSON object per received request, appended to a JSONL file and flushed
//! before the reply goes out, so a test that got its response can read the entry at once.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::Value;

use super::FakeLlmError;

/// One line of the log.
#[derive(Debug, Serialize)]
pub struct LogRecord<'a> {
    /// 1-based arrival number.
    pub seq: u64,
    /// Unix time in milliseconds.
    pub ts: u64,
    /// Unix time in microseconds (the same instant; `bench turns` needs the precision).
    pub ts_us: u64,
    /// HTTP method.
    pub method: &'a str,
    /// Path including the query string.
    pub path: &'a str,
    /// Header names (lowercase) to values; repeated headers joined with `", "`.
    pub headers: BTreeMap<String, String>,
    /// The body as JSON if it parsed, else as a string (`null` when empty).
    pub body: Value,
    /// What answered: `step N`, `rule N`, `fallback`, `exhausted`, `count_tokens`, `models`, or
    /// `error` for a request refused before the script was consulted.
    pub served_by: String,
}

/// Unix time in milliseconds.
#[must_use]
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Unix time in microseconds.
#[must_use]
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Headers in the log's map form: the api client's, so a logged request and a read answer
/// compare directly.
pub use agentbox_api::client::header_map;

/// The append-only JSONL file.
#[derive(Debug)]
pub struct RequestLog {
    path: PathBuf,
    file: Mutex<File>,
}

impl RequestLog {
    /// Opens (creating, appending) the log at `path`.
    ///
    /// # Errors
    /// When the file cannot be opened.
    pub fn open(path: &Path) -> Result<Self, FakeLlmError> {
        let file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| FakeLlmError::OpenLog {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self {
            path: path.to_path_buf(),
            file: Mutex::new(file),
        })
    }

    /// Appends one record as a single write. A failure is reported on stderr rather than
    /// failing the request: the reply is still what the test scripted.
    pub fn append(&self, record: &LogRecord<'_>) {
        let mut line = match serde_json::to_vec(record) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("fakellm: cannot serialize log record: {e}");
                return;
            }
        };
        line.push(b'\n');
        let mut file = match self.file.lock() {
            Ok(f) => f,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Err(e) = file.write_all(&line).and_then(|()| file.flush()) {
            eprintln!("fakellm: cannot write {}: {e}", self.path.display());
        }
    }
}
