//! `agentbox-llm`: the LLM proxy engine every model-facing daemon wraps (the gateway and the
//! bridge today, blackbox-server's in-process proxy next). The daemons keep their policy (auth,
//! keys, sanitizing, budgets); everything about talking to a model upstream is here, once.
//!
//! # Layout
//! - [`client`]: the one upstream client ([`Upstream`], [`ClientOptions`]), [`Auth`], capped
//!   reads of error bodies and answers, [`Parts`] (a request body sent as its pieces).
//! - [`adapter`]: Anthropic passthrough and Anthropic → OpenAI chat → Anthropic; the caller
//!   gives URL, auth and options.
//! - [`body`]: [`LlmBody`], the streaming transformer (decode, translate (chat → Anthropic,
//!   chat → Responses), meter with a settle
//!   callback that fires exactly once, end a broken stream with the protocol's error frame,
//!   cancel upstream on drop), and [`Answer`].
//! - [`error`]: [`LlmError`] and its one mapping to what a client sees ([`ErrorReply`]) in
//!   the client's [`Protocol`]; generic words for every 5xx.

#![forbid(unsafe_code)]

pub mod adapter;
pub mod body;
pub mod client;
pub mod error;

pub use adapter::{AnthropicTarget, ChatPassTarget, ChatTarget};
pub use body::{Answer, ChatToAnthropic, ChatToResponses, LlmBody, StreamTranslator};
pub use client::{Auth, ClientError, ClientOptions, Parts, Upstream, upstream_url};
pub use error::{ErrorReply, LlmError, Protocol, RAN_HEADER};
pub use reqwest::Url;
