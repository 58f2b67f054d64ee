//! Tool names across the 64-character limit of OpenAI function names. Anthropic allows longer
//! names (MCP tools are `mcp__<server>__<tool>`), so a longer name is sent as its first 55
//! characters, `_`, and 8 hex digits of its SHA-256, which is stable across requests (prefix
//! caches stay warm) and distinct for distinct names; the response side maps it back.

use std::borrow::Cow;
use std::collections::HashMap;

use sha2::{Digest, Sha256};

use crate::anthropic::{ContentBlock, MessageContent, MessagesRequest};

/// OpenAI's limit on function names.
pub const MAX_TOOL_NAME_LEN: usize = 64;

const KEEP: usize = 55;

/// The name to send upstream for an Anthropic tool name.
pub fn upstream_tool_name(name: &str) -> Cow<'_, str> {
    if name.len() <= MAX_TOOL_NAME_LEN {
        return Cow::Borrowed(name);
    }
    let mut cut = KEEP;
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    let digest = Sha256::digest(name.as_bytes());
    let mut short = String::with_capacity(KEEP + 9);
    short.push_str(&name[..cut]);
    short.push('_');
    for b in digest.iter().take(4) {
        short.push(char::from(HEX[usize::from(b >> 4)]));
        short.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    Cow::Owned(short)
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Shortened upstream names → the original names of one request. Empty (and free) unless the
/// request has a name over the limit.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ToolNames {
    originals: HashMap<String, String>,
}

impl ToolNames {
    /// Collects the long names of `req`'s tools and of the `tool_use` blocks in its history.
    pub fn from_request(req: &MessagesRequest) -> Self {
        let mut names = Self::default();
        for tool in req.tools.iter().flatten() {
            names.add(&tool.name);
        }
        for m in &req.messages {
            if let MessageContent::List(blocks) = &m.content {
                for b in blocks {
                    if let ContentBlock::ToolUse { name, .. } = b {
                        names.add(name);
                    }
                }
            }
        }
        names
    }

    /// Registers one original name.
    pub fn add(&mut self, original: &str) {
        if let Cow::Owned(short) = upstream_tool_name(original) {
            self.originals.insert(short, original.to_owned());
        }
    }

    /// The original name for a name the upstream used.
    pub fn original<'a>(&'a self, upstream: &'a str) -> &'a str {
        self.originals
            .get(upstream)
            .map_or(upstream, String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_names_shorten_stably_and_map_back() {
        let long = format!("mcp__{}__tool", "server".repeat(12));
        let short = upstream_tool_name(&long);
        assert_eq!(short.len(), 64);
        assert_eq!(short, upstream_tool_name(&long));
        assert_ne!(short, upstream_tool_name(&format!("{long}2")));
        let mut names = ToolNames::default();
        names.add(&long);
        names.add("Bash");
        assert_eq!(names.original(&short), long);
        assert_eq!(names.original("Bash"), "Bash");
        assert_eq!(upstream_tool_name("Bash"), "Bash");
    }
}
