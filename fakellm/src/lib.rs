//! `fakellm`: a scripted fake model server that speaks Anthropic Messages and OpenAI Chat
//! Completions, streamed and not, so real agent CLIs and our daemons can be driven through
//! multi-step tasks with exact usage numbers and injected faults.
//!
//! # Command line
//! ```text
//! fakellm --script FILE --log FILE (--listen 127.0.0.1:0 | --unix PATH)
//! ```
//! Once bound, it prints one line on stdout and flushes it: `listening on 127.0.0.1:41234`
//! for TCP (port 0 picks a free port) or `listening on unix:/path/to/sock`. It serves until
//! killed. Accepted TCP streams have `TCP_NODELAY` set.
//!
//! # Endpoints
//! - `POST /v1/messages` (any query string, e.g. `?beta=true`): Anthropic Messages. Requires
//!   `model`, `messages` (list) and `max_tokens` (integer), else 400 `invalid_request_error`.
//!   `"stream": true` gives SSE with an `event:` line on every frame: `message_start`, `ping`,
//!   per content block `content_block_start` / `content_block_delta` (`thinking_delta` +
//!   `signature_delta`, `text_delta`, `input_json_delta` with the arguments split over several
//!   deltas) / `content_block_stop`, then `message_delta` and `message_stop`.
//! - `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, N from the script's
//!   `count_tokens` or request bytes / 4 (at least 1). Does not touch the script.
//! - `POST /v1/chat/completions` and `POST /chat/completions`: OpenAI Chat Completions.
//!   Requires `model` and `messages`. Streams are `data: {chunk}` lines: a role delta first,
//!   `reasoning_content` deltas for thinking, `content` deltas, `tool_calls` deltas (id, type and
//!   name first, then the arguments in pieces), a chunk with `finish_reason`, a usage chunk
//!   (`choices: []`) when `stream_options.include_usage` is true, then `data: [DONE]`.
//! - `GET /v1/models` and `GET /models`: an OpenAI-style list `{object: "list", data: [{id,
//!   object: "model", created, owned_by}], …}` whose entries also carry Anthropic's `type:
//!   "model"`, `display_name` and `created_at`, plus Anthropic's `has_more`/`first_id`/`last_id`,
//!   so either SDK can parse it.
//! - `GET /health`: 200 `{"status": "ok"}`, without a key even when `api_key` is set (as
//!   vLLM's), so fakellm can stand in for a vLLM server under the launcher's supervision.
//! - `POST /v1/rollout/pause` and `POST /v1/rollout/resume` (also without `/v1`): a rollout
//!   router's control endpoints, as blackbox-server's proxy calls them. Pause answers
//!   `{"quiesced": true}`, resume `{}`; neither touches the script. Logged like every request
//!   (`served_by: "control"`), so a test sees the session and instance headers and the body.
//! - Anything else: 404; a known path with the wrong method: 405. Error bodies are
//!   OpenAI-shaped (`{"error":{"message","type","param","code"}}`) for paths under `/v1/chat`,
//!   `/chat`, `/v1/completions`, `/completions`, `/v1/responses`, `/responses` and
//!   `/v1/embeddings`, and Anthropic-shaped (`{"type":"error","error":{"type","message"}}`)
//!   everywhere else. A body that is not a JSON object gets 400 `invalid_request_error`.
//!
//! # Request log
//! Every request, valid or not, is appended to the `--log` file as one JSON line before the
//! reply is sent: `{"seq", "ts" (unix ms), "ts_us" (the same in µs), "method", "path" (with query), "headers" (lowercase
//! name → value, repeats joined by ", "), "body" (parsed JSON, else a string, null if empty),
//! "served_by"}`. `served_by` is `step N`, `rule N`, `fallback`, `exhausted`, `count_tokens`,
//! `models`, `health` or `error` (refused before the script was consulted). A streamed reply
//! sent whole is noted in `<log>.finished` as `{"seq", "ts_us"}` when its last
//! frame went out (what `bench turns` times the model's answers with).
//!
//! # Script
//! A JSON file, read once at start; unknown keys are errors.
//! ```json
//! {
//!   "steps":    [ENTRY, …],   // consumed in order, one per matching request
//!   "rules":    [ENTRY, …],   // side replies: checked first, never consume steps
//!   "fallback": ENTRY,        // when no rule matches and the next step doesn't (or none left)
//!   "count_tokens": 1234,     // fixed count_tokens answer (default: bytes / 4)
//!   "models": ["m1", "m2"],   // GET /v1/models (default ["fakellm"])
//!   "api_key": "sk-test"      // if set: every routed request must present it (x-api-key or
//!                             // Authorization: Bearer), else 401 authentication_error
//! }
//! ```
//! Each message request (either API) is answered by: the first rule whose `match` holds and
//! whose `times` is not used up; else the next step, if its `match` holds (the step is then
//! consumed); else `fallback`; else a 500 (`api_error` / `server_error`) with
//! `x-should-retry: false` whose message says the script is exhausted or the next step did not
//! match. Every entry renders in whichever API the request used.
//!
//! An ENTRY (all keys optional):
//! ```json
//! {
//!   "match": {                         // all given conditions must hold
//!     "api": "anthropic" | "openai",
//!     "model": "exact-model", "model_contains": "haiku",
//!     "has_tools": true,               // request has a non-empty `tools` list
//!     "stream": true,
//!     "body_contains": "text", "body_lacks": "text",   // substrings of the raw body
//!     "max_tokens_at_most": 1          // max_tokens / max_completion_tokens present and ≤ N
//!   },
//!   "times": 1,                        // rules only: how many requests it may answer
//!   "thinking": "…", "signature": "…", // thinking block first (OpenAI: reasoning_content)
//!   "text": "…",
//!   "tool_calls": [{"name": "Write", "input": {…}, "id": "optional"}],
//!   "usage": {"input_tokens": 10, "output_tokens": 5,
//!             "cache_read_input_tokens": 100, "cache_creation_input_tokens": 7},
//!   "stop_reason": "end_turn" | "tool_use" | "max_tokens" | "stop_sequence",
//!   "model": "name to report (default: the request's)",
//!   "delay_ms": 0,                     // before the response head
//!   "event_delay_ms": 0,               // between streamed frames
//!   "headers": {"retry-after": "1"},   // extra response headers
//!   "error": {"status": 429, "type": "rate_limit_error", "message": "…", "body": {…}},
//!   "disconnect_after_events": 3,      // abort the connection after N frames
//!   "error_event": {"after_events": 3, "type": "overloaded_error", "message": "…"},
//!   "heartbeats": 2,                   // streams: `: dressage-heartbeat` frames first
//!   "garbage_after_events": 3,         // streams: a non-JSON `data:` frame after N frames
//!   "huge_text_bytes": 1073741824      // the text is this many bytes of filler, made on the fly
//! }
//! ```
//! - Ids are generated from the request number: `msg_fakellm_000007` / `chatcmpl-fakellm-000007`,
//!   tool calls `toolu_fakellm_000007_0` / `call_fakellm_000007_0`.
//! - `stop_reason` defaults to `tool_use` when there are tool calls, else `end_turn`; OpenAI
//!   spells them `tool_calls` / `stop` (`max_tokens` → `length`).
//! - `usage` is in Anthropic terms. Anthropic replies report it as is (cache fields default 0);
//!   streamed, `message_start` carries the input and cache fields with `output_tokens` at most 1,
//!   and `message_delta` carries all four final numbers. OpenAI replies report `prompt_tokens =
//!   input + cache_read + cache_creation`, `completion_tokens = output`, `total_tokens`, and
//!   `prompt_tokens_details.cached_tokens = cache_read` only when `cache_read_input_tokens` is
//!   given. Without `usage`: input = request bytes / 4, output = reply bytes / 4 (each ≥ 1).
//! - `error` replaces the reply: the status with an API-shaped body (type derived from the
//!   status when not given, e.g. 429 → `rate_limit_error`, 529 → `overloaded_error`), or `body`
//!   verbatim.
//! - `disconnect_after_events` on a streamed reply sends the first N frames (Anthropic events or
//!   OpenAI `data:` lines) and then drops the connection mid-response; on a non-streamed reply it
//!   sends the head and half the JSON body, then drops.
//! - `error_event` keeps the first `after_events` frames, then sends an in-stream error
//!   (Anthropic `event: error`, OpenAI `data: {"error":{…}}`) and ends the stream (no
//!   `message_stop` / `[DONE]`).
//! - `heartbeats` on a streamed reply sends N SSE comment frames before the first frame (a
//!   pseudo-streaming router's keepalives). With `error` on a streamed request, the reply is a
//!   200 event stream instead: the heartbeats, then `data: {"error": {…, "status_code":
//!   <status>}}` (the error body's `error` object, or the whole `body`, plus the status), then
//!   `data: [DONE]`: how such a router reports a failure after committing to 200.
//! - `garbage_after_events` on a streamed reply keeps the first N frames, then sends
//!   `data: fakellm-garbage{` and ends the stream.
//! - `huge_text_bytes` replaces `text` with that many bytes of `x` (rounded up to 64 KiB),
//!   generated while the reply is sent, so fakellm's memory does not grow with it: a streamed
//!   reply sends them as text deltas of 64 KiB each, a whole one inside its JSON body. Give
//!   `usage` with it (the estimate does not count the filler).
//! - `count_tokens`, `/v1/models`, `/health`, the rollout control calls and refused requests
//!   never consume steps or rules.

#![forbid(unsafe_code)]

pub mod claude;
mod log;
pub mod render;
pub mod script;
pub mod server;

use std::path::PathBuf;

pub use script::{Entry, Script};
pub use server::{Listen, Server};

/// What can stop fakellm from starting or serving.
#[derive(Debug, thiserror::Error)]
pub enum FakeLlmError {
    /// The script file could not be read.
    #[error("cannot read script {path}: {source}")]
    ReadScript {
        /// The script path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The script file is not a valid script.
    #[error("invalid script {path}: {source}")]
    ParseScript {
        /// The script path.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The script parsed but says something impossible.
    #[error("invalid script: {0}")]
    InvalidScript(String),
    /// The log file could not be opened.
    #[error("cannot open log {path}: {source}")]
    OpenLog {
        /// The log path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The listen address could not be bound.
    #[error("cannot listen on {what}: {source}")]
    Bind {
        /// The address or socket path.
        what: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The accept loop failed.
    #[error("serving failed: {0}")]
    Serve(std::io::Error),
}
