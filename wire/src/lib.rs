//! LLM wire formats shared by the gateway, the bridge and the blackbox proxy.
//!
//! # Layout
//! - [`anthropic`], [`chat`], [`responses`]: typed bodies of the Anthropic Messages, OpenAI Chat
//!   Completions and OpenAI Responses APIs. Unknown fields and unknown variants survive a parse
//!   and re-serialize, so a proxy can edit one field without dropping another.
//! - [`sse`]: an incremental server-sent-events decoder (any chunking, `\r\n`/`\r`/`\n`,
//!   comments, multi-line data, `event`/`id`/`retry`) and encoder.
//! - [`usage`]: [`usage::UsageMeter`], which meters an Anthropic response (streamed or not) from
//!   its raw bytes as they are forwarded.
//! - [`translate`]: Anthropic request → chat request, chat response and chat stream → Anthropic
//!   response and stream; the same for OpenAI Responses ([`translate::responses`]), which Codex
//!   speaks.
//! - [`error`]: HTTP status and upstream error bodies → Anthropic error bodies and events.
//! - [`normalize`]: Anthropic → Anthropic fixes for local backends (Claude Code's billing header,
//!   mid-conversation system messages).

#![forbid(unsafe_code)]

pub mod anthropic;
pub mod chat;
pub mod error;
pub mod normalize;
pub mod responses;
mod serde_util;
pub mod sse;
pub mod translate;
pub mod usage;

pub use serde_util::FastValue;

pub use serde_util::TextOrList;
