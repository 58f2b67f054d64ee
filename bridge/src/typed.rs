//! The sanitizer's URL-source rule ([`sanitize::refuse_url_sources`]) on a typed request, for
//! the translated path, which never builds a `serde_json::Value` tree of the body. The walk
//! visits what the rule visits (every block of `system` and `messages`, nested `tool_result`
//! content, and every field we keep untyped) and reports the same paths.

use agentbox_policy::sanitize::{self, SanitizeError};
use agentbox_wire::anthropic::{
    ContentBlock, DocumentSource, Extra, ImageSource, MessagesRequest, TextOrList,
};
use agentbox_wire::translate::NoUnicodeEscapes;
use std::fmt::Write as _;

/// Refuses `req` if any block of `system` or `messages` has a source of type `"url"`.
pub fn refuse_url_sources(req: &MessagesRequest) -> Result<(), SanitizeError> {
    let mut path = String::from("system");
    if let Some(system) = &req.system {
        content(system, &mut path)?;
    }
    for (i, message) in req.messages.iter().enumerate() {
        path.clear();
        let _ = write!(path, "messages[{i}]");
        sanitize::refuse_url_sources_in(&message.extra, &mut path)?;
        path.push_str(".content");
        content(&message.content, &mut path)?;
    }
    Ok(())
}

/// Whether the body text may hold a source of type `"url"`; `false` only when it cannot. Such
/// a source is an object with a member `"type": "url"`, which JSON text without `\u` escapes
/// can only spell as `"type"`, a colon and `"url"`, with whitespace between; a body with any
/// `\u` escape is not looked into. This lets the bridge skip the typed walk (and the typed
/// request) for the bodies Claude Code sends; any other body gets the walk.
pub fn may_hold_url_source(body: &str) -> bool {
    NoUnicodeEscapes::check(body).is_none_or(may_hold_url_member)
}

/// [`may_hold_url_source`] for a body already known to hold no `\u` escape.
pub fn may_hold_url_member(body: NoUnicodeEscapes<'_>) -> bool {
    let body = body.as_str();
    // memchr's searcher, not `str::contains`: this runs over every 100 KB body, and the
    // standard two-way search costs several instructions a byte.
    memchr::memmem::find_iter(body.as_bytes(), b"\"url\"").any(|at| {
        let before = body[..at].trim_end_matches(is_json_space);
        before
            .strip_suffix(':')
            .is_some_and(|b| b.trim_end_matches(is_json_space).ends_with("\"type\""))
    })
}

fn is_json_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
}

fn content(c: &TextOrList<ContentBlock>, path: &mut String) -> Result<(), SanitizeError> {
    match c {
        TextOrList::List(blocks) => sanitize::each_indexed(blocks, path, block),
        TextOrList::Text(_) => Ok(()),
    }
}

fn url_source(path: &str) -> SanitizeError {
    SanitizeError::UrlSource {
        path: format!("{path}.source"),
    }
}

/// A source kept untyped (`Other`): the rule reads its `type`, then walks inside it.
fn other_source(map: &Extra, path: &mut String) -> Result<(), SanitizeError> {
    if map.get("type").and_then(|t| t.as_str()) == Some("url") {
        return Err(url_source(path));
    }
    let len = path.len();
    path.push_str(".source");
    sanitize::refuse_url_sources_in(map, path)?;
    path.truncate(len);
    Ok(())
}

fn block(b: &ContentBlock, path: &mut String) -> Result<(), SanitizeError> {
    let extra = match b {
        ContentBlock::Image { source, extra } => {
            match source {
                ImageSource::Url { .. } => return Err(url_source(path)),
                ImageSource::Other(map) => other_source(map, path)?,
                ImageSource::Base64 { .. } => {}
            }
            extra
        }
        ContentBlock::Document { source, extra } => {
            match source {
                DocumentSource::Url { .. } => return Err(url_source(path)),
                DocumentSource::Other(map) => other_source(map, path)?,
                DocumentSource::Base64 { .. } | DocumentSource::Text { .. } => {}
            }
            extra
        }
        ContentBlock::ToolResult {
            content: c, extra, ..
        } => {
            if let Some(c) = c {
                let len = path.len();
                path.push_str(".content");
                content(c, path)?;
                path.truncate(len);
            }
            extra
        }
        // A tool call's input is the model's own data, which the rule does not inspect.
        ContentBlock::Text { extra, .. }
        | ContentBlock::ToolUse { extra, .. }
        | ContentBlock::Thinking { extra, .. }
        | ContentBlock::RedactedThinking { extra, .. }
        | ContentBlock::Other(extra) => extra,
    };
    sanitize::refuse_url_sources_in(extra, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn url_pre_check() {
        let clear = [
            r#"{"tools":[{"input_schema":{"properties":{"url":{"type":"string"}}}}]}"#,
            r#"{"text":"a \"url\" here","type":"text"}"#,
            r#"{"type":"urls"}"#,
            // A string holding the words, not a member.
            r#"{"text":"\"type\":\"url\""}"#,
        ];
        for body in clear {
            assert!(!may_hold_url_source(body), "{body}");
        }
        let held = [
            r#"{"source":{"type":"url","url":"x"}}"#,
            "{\"source\":{\"type\" :\n \"url\"}}",
            r#"{"source":{"typ\u0065":"url"}}"#,
        ];
        for body in held {
            assert!(may_hold_url_source(body), "{body}");
        }
    }

    /// The typed walk and the sanitizer's own agree on every case, path included.
    #[test]
    fn agrees_with_the_sanitizer() {
        let url = json!({"type": "url", "url": "http://x/a.png"});
        let cases = [
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            json!({"model": "m", "system": [{"type": "text", "text": "s"}], "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "source": url}]}]}),
            json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document", "source": url}]}]}]}),
            json!({"model": "m", "messages": [{"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "n", "input": {"source": url}}]}]}),
            json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "search_result", "source": url}]}]}),
            json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url"}}]}]}),
            json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "a", "citations": [{"source": url}]}]}]}),
            json!({"model": "m", "system": [{"type": "image", "source": url}], "messages": []}),
            json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "document", "source": {"type": "content", "content": [
                    {"type": "image", "source": url}]}}]}]}),
        ];
        for v in cases {
            let typed: MessagesRequest = serde_json::from_value(v.clone()).unwrap();
            let got = refuse_url_sources(&typed).map_err(|e| e.to_string());
            let want = sanitize::refuse_url_sources(&v).map_err(|e| e.to_string());
            assert_eq!(got, want, "{v}");
            // The pre-check never clears a body the rule refuses, compact or pretty.
            if want.is_err() {
                assert!(may_hold_url_source(&v.to_string()), "{v}");
                assert!(may_hold_url_source(
                    &serde_json::to_string_pretty(&v).unwrap()
                ));
            }
        }
    }
}
