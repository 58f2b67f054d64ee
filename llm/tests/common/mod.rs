//! What the engine's integration tests share.

use agentbox_llm::{Answer, AnthropicTarget, Auth, LlmError, Upstream};

/// `body` sent to `url` as an Anthropic call with no auth, through the engine's client.
pub async fn anthropic_call(up: &Upstream, url: &str, body: &[u8]) -> Result<Answer, LlmError> {
    let url = agentbox_llm::upstream_url(url)?;
    let target = AnthropicTarget {
        url: &url,
        auth: Auth::None,
        version: "2023-06-01",
        size_hint: 0,
    };
    up.anthropic_bytes(target, body.to_vec()).await
}
