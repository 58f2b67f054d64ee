//! Anthropic → Anthropic request normalizations for backends that choke on what Claude Code
//! sends, usable by the gateway (Ollama, vLLM destinations) and applied by the chat
//! translation.
//!
//! - Claude Code ≥2.1.36 puts `x-anthropic-billing-header: ...; cch=<per-request hash>;` as the
//!   first system block. It changes on every request, so any backend with prefix caching
//!   re-prefills the whole prompt each turn. [`strip_billing_header`] removes it.
//! - Claude Code ≥2.1.154 appends `role: "system"` messages mid-conversation. Many chat
//!   templates reject them or render them badly, and hoisting them into the leading system
//!   prompt would change the head of the prompt every turn (again defeating prefix caching).
//!   [`fold_inline_system`] folds their text into a neighbouring user turn instead, changing
//!   only the end of the conversation, so each request still renders as an extension of the
//!   previous one. It never places text between an assistant's `tool_use` and the
//!   `tool_result` answering it, never adds a user turn after tool results, and keeps
//!   `tool_result` blocks first in their message as the API requires.

use crate::anthropic::{ContentBlock, Extra, Message, MessageContent, MessagesRequest, Role};

/// The prefix of Claude Code's attribution block.
pub const BILLING_HEADER_PREFIX: &str = "x-anthropic-billing-header";

fn is_billing_header(text: &str) -> bool {
    text.starts_with(BILLING_HEADER_PREFIX)
}

/// Removes Claude Code's billing-header text block from `system` and from system-role
/// messages. Returns whether anything was removed.
pub fn strip_billing_header(req: &mut MessagesRequest) -> bool {
    let mut removed = false;
    if let Some(system) = &mut req.system {
        removed |= strip_from_content(system);
        if matches!(system, MessageContent::List(b) if b.is_empty()) {
            req.system = None;
        }
    }
    for m in &mut req.messages {
        if m.role == Role::System {
            removed |= strip_from_content(&mut m.content);
        }
    }
    removed
}

fn strip_from_content(content: &mut MessageContent) -> bool {
    match content {
        MessageContent::Text(t) => {
            if is_billing_header(t) {
                t.clear();
                return true;
            }
            false
        }
        MessageContent::List(blocks) => {
            let before = blocks.len();
            blocks.retain(
                |b| !matches!(b, ContentBlock::Text { text, .. } if is_billing_header(text)),
            );
            blocks.len() != before
        }
    }
}

/// The text of a system prompt or system message: its non-empty text blocks joined by
/// `separator`. Non-text blocks are ignored (a system prompt can only hold text).
pub fn system_text(content: &MessageContent, separator: &str) -> String {
    match content {
        MessageContent::Text(t) => t.clone(),
        MessageContent::List(blocks) => {
            let mut out = String::new();
            for b in blocks {
                if let ContentBlock::Text { text, .. } = b
                    && !text.is_empty()
                {
                    if !out.is_empty() {
                        out.push_str(separator);
                    }
                    out.push_str(text);
                }
            }
            out
        }
    }
}

fn join(parts: &[&str]) -> String {
    let mut out = String::new();
    for p in parts.iter().filter(|p| !p.is_empty()) {
        if !out.is_empty() {
            out.push_str("\n\n");
        }
        out.push_str(p);
    }
    out
}

/// Folds every `role: "system"` message of `req` as described in the module docs: system
/// messages leading the conversation join the top-level `system` prompt (they are its head
/// anyway); later ones join the adjacent user turn. Returns whether anything moved.
pub fn fold_inline_system(req: &mut MessagesRequest) -> bool {
    let messages = std::mem::take(&mut req.messages);
    let (leading, folded, changed) = fold_messages(messages);
    req.messages = folded;
    if !leading.is_empty() {
        match &mut req.system {
            None => req.system = Some(MessageContent::Text(leading)),
            Some(MessageContent::Text(t)) => *t = join(&[t, &leading]),
            Some(MessageContent::List(blocks)) => blocks.push(ContentBlock::text(leading)),
        }
    }
    changed
}

/// The message-level part of [`fold_inline_system`]: returns the text of leading system
/// messages (for the caller's system prompt), the folded messages, and whether anything
/// changed.
pub(crate) fn fold_messages(messages: Vec<Message>) -> (String, Vec<Message>, bool) {
    if messages.iter().all(|m| m.role != Role::System) {
        return (String::new(), messages, false);
    }
    let mut iter = messages.into_iter().peekable();
    let mut leading = Vec::new();
    while let Some(m) = iter.next_if(|m| m.role == Role::System) {
        leading.push(system_text(&m.content, "\n\n"));
    }
    let leading_refs: Vec<&str> = leading.iter().map(String::as_str).collect();
    let leading = join(&leading_refs);

    let rest = move_out_of_tool_runs(iter);
    let mut out: Vec<Message> = Vec::with_capacity(rest.len());
    let mut pending: Vec<String> = Vec::new();
    for mut m in rest {
        if m.role == Role::System {
            let text = system_text(&m.content, "\n\n");
            if text.is_empty() {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.role == Role::User && pending.is_empty() => {
                    append_to_user(last, &text);
                }
                Some(_) | None => pending.push(text),
            }
            continue;
        }
        if !pending.is_empty() {
            let refs: Vec<&str> = pending.iter().map(String::as_str).collect();
            let text = join(&refs);
            pending.clear();
            if m.role == Role::User {
                prepend_to_user(&mut m, &text);
            } else {
                out.push(Message::new(Role::User, text));
            }
        }
        out.push(m);
    }
    if !pending.is_empty() {
        let refs: Vec<&str> = pending.iter().map(String::as_str).collect();
        out.push(Message::new(Role::User, join(&refs)));
    }
    (leading, out, true)
}

fn has_tool_use(m: &Message) -> bool {
    matches!(&m.content, MessageContent::List(b) if b.iter().any(|b| matches!(b, ContentBlock::ToolUse { .. })))
}

/// Moves system messages that sit between an assistant `tool_use` and the user turn answering
/// it to just after that user turn.
fn move_out_of_tool_runs(messages: impl Iterator<Item = Message>) -> Vec<Message> {
    let mut out = Vec::new();
    let mut held = Vec::new();
    let mut awaiting_results = false;
    for m in messages {
        match m.role {
            Role::System => {
                if awaiting_results {
                    held.push(m);
                } else {
                    out.push(m);
                }
                continue;
            }
            Role::Assistant => {
                out.append(&mut held);
                awaiting_results = has_tool_use(&m);
                out.push(m);
            }
            Role::User => {
                awaiting_results = false;
                out.push(m);
                out.append(&mut held);
            }
        }
    }
    out.append(&mut held);
    out
}

fn is_tool_result(b: &ContentBlock) -> bool {
    matches!(b, ContentBlock::ToolResult { .. })
}

/// Appends to the user's own text or, when the turn is only tool results, to the last result.
fn append_to_user(m: &mut Message, text: &str) {
    match &mut m.content {
        MessageContent::Text(t) => *t = join(&[t, text]),
        MessageContent::List(blocks) => {
            if !blocks.is_empty() && blocks.iter().all(is_tool_result) {
                if let Some(ContentBlock::ToolResult { content, .. }) = blocks.last_mut() {
                    match content {
                        None => *content = Some(MessageContent::Text(text.to_owned())),
                        Some(MessageContent::Text(t)) => *t = join(&[t, text]),
                        Some(MessageContent::List(inner)) => append_text_block(inner, text),
                    }
                }
                return;
            }
            append_text_block(blocks, text);
        }
    }
}

fn append_text_block(blocks: &mut Vec<ContentBlock>, text: &str) {
    match blocks.last_mut() {
        Some(ContentBlock::Text { text: t, .. }) => *t = join(&[t, text]),
        Some(_) | None => blocks.push(ContentBlock::Text {
            text: text.to_owned(),
            extra: Extra::new(),
        }),
    }
}

/// Prepends to the user's own text, after any leading `tool_result` blocks.
fn prepend_to_user(m: &mut Message, text: &str) {
    match &mut m.content {
        MessageContent::Text(t) => *t = join(&[text, t]),
        MessageContent::List(blocks) => {
            let at = blocks.iter().take_while(|b| is_tool_result(b)).count();
            match blocks.get_mut(at) {
                Some(ContentBlock::Text { text: t, .. }) => *t = join(&[text, t]),
                Some(_) | None => blocks.insert(at, ContentBlock::text(text)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn req(v: serde_json::Value) -> MessagesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn billing_header_is_removed() {
        let mut r = req(json!({"model":"m","messages":[],"system":[
            {"type":"text","text":"x-anthropic-billing-header: cc_version=2.1; cch=abc;"},
            {"type":"text","text":"You are Claude Code."}]}));
        assert!(strip_billing_header(&mut r));
        assert_eq!(
            serde_json::to_value(&r.system).unwrap(),
            json!([{"type":"text","text":"You are Claude Code."}])
        );
        assert!(!strip_billing_header(&mut r));
    }

    #[test]
    fn system_after_user_is_appended_to_it() {
        let mut r = req(json!({"model":"m","messages":[
            {"role":"user","content":"hi"},
            {"role":"system","content":"be brief"},
            {"role":"assistant","content":"ok"},
            {"role":"system","content":"note"},
            {"role":"user","content":[{"type":"text","text":"next"}]}
        ]}));
        assert!(fold_inline_system(&mut r));
        assert_eq!(
            serde_json::to_value(&r.messages).unwrap(),
            json!([
                {"role":"user","content":"hi\n\nbe brief"},
                {"role":"assistant","content":"ok"},
                {"role":"user","content":[{"type":"text","text":"note\n\nnext"}]}
            ])
        );
    }

    #[test]
    fn system_inside_a_tool_run_moves_after_the_results() {
        let mut r = req(json!({"model":"m","system":"S","messages":[
            {"role":"system","content":"lead"},
            {"role":"user","content":"go"},
            {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"Bash","input":{}}]},
            {"role":"system","content":"reminder"},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"out"}]}
        ]}));
        fold_inline_system(&mut r);
        assert_eq!(serde_json::to_value(&r.system).unwrap(), json!("S\n\nlead"));
        assert_eq!(
            serde_json::to_value(&r.messages).unwrap(),
            json!([
                {"role":"user","content":"go"},
                {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"Bash","input":{}}]},
                {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"out\n\nreminder"}]}
            ])
        );
    }

    #[test]
    fn trailing_system_after_assistant_becomes_a_user_turn() {
        let mut r = req(json!({"model":"m","messages":[
            {"role":"user","content":"a"},
            {"role":"assistant","content":"b"},
            {"role":"system","content":"c"}
        ]}));
        fold_inline_system(&mut r);
        assert_eq!(
            serde_json::to_value(&r.messages).unwrap(),
            json!([
                {"role":"user","content":"a"},
                {"role":"assistant","content":"b"},
                {"role":"user","content":"c"}
            ])
        );
    }
}
