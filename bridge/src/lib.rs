//! The llm-bridge (`agentbox-bridge`, `127.0.0.1:8790`): the only holder of provider keys;
//! passes Anthropic requests through or translates them to OpenAI chat completions.
//!
//! Empty until issue 3 lands it.
