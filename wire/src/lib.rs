//! LLM wire formats shared by the gateway, the bridge and the blackbox proxy: typed Anthropic
//! Messages, OpenAI Chat Completions and OpenAI Responses, the SSE codec, translations and
//! usage accounting.
//!
//! Empty until issue 3 lands it; the crate exists now so the workspace layout is fixed.
