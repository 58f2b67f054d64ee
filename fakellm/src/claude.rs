//! Scripts that play the model for the real Claude Code (`claude -p`): a task as a list of
//! turns, each a tool call or the final words, with the usage the model reports. The tests
//! and `agentbox demo` build their scripts here, so the matching rules that keep Claude Code's
//! side requests from spending steps live in one place.
//!
//! Claude Code sends side requests without tools (a title, a quota probe) besides its turns;
//! [`turns`] answers those with "ok" from a rule. Its turns carry the tool list; every turn
//! after the first also carries the previous tool's result, which is how a step knows it is
//! not answering a retry of the first request.

use serde_json::{Value, json};

/// The API fakellm sees the turns in, which decides how a tool result looks in the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// Anthropic Messages (fakellm in the gateway's place): `tool_result` blocks.
    Messages,
    /// OpenAI Chat Completions (fakellm behind the bridge, a `remote` `openai` model):
    /// `tool` messages with a `tool_call_id`.
    Chat,
}

impl Api {
    /// A substring every request carrying a tool result has.
    pub fn tool_result_marker(self) -> &'static str {
        match self {
            Api::Messages => "tool_result",
            Api::Chat => "tool_call_id",
        }
    }
}

/// The usage a turn reports, in Anthropic terms (fakellm converts for OpenAI).
pub fn usage(input: u64, output: u64, cache_read: u64) -> Value {
    json!({"input_tokens": input, "output_tokens": output, "cache_read_input_tokens": cache_read})
}

/// A turn that calls one tool (`Bash`, `Read`, `Edit`, `Write`, ...) with `input`.
pub fn tool(name: &str, input: Value, usage: Value) -> Value {
    json!({"tool_calls": [{"name": name, "input": input}], "usage": usage})
}

/// The final turn: words, no tool.
pub fn say(text: &str, usage: Value) -> Value {
    json!({"text": text, "usage": usage})
}

/// A script playing `turns` in order (see the module docs for the matching); side requests
/// without tools get "ok" and spend no step.
pub fn turns(api: Api, turns: Vec<Value>) -> Value {
    let steps: Vec<Value> = turns
        .into_iter()
        .enumerate()
        .map(|(i, mut turn)| {
            let when = if i == 0 {
                json!({"has_tools": true})
            } else {
                json!({"has_tools": true, "body_contains": api.tool_result_marker()})
            };
            if let Some(t) = turn.as_object_mut() {
                t.insert("match".to_owned(), when);
            }
            turn
        })
        .collect();
    json!({"rules": [{"match": {"has_tools": false}, "text": "ok"}], "steps": steps})
}

/// Claude Code behind the bridge writes `content` to `/workspace/<file>` with a shell command,
/// then says "done" after `done_delay_ms` (a long delay keeps the run busy for a test).
pub fn write_file(file: &str, content: &str, done_delay_ms: u64) -> Value {
    let mut done = say("done", usage(1100, 5, 200));
    if let Some(d) = done.as_object_mut() {
        d.insert("delay_ms".to_owned(), json!(done_delay_ms));
    }
    turns(
        Api::Chat,
        vec![
            tool(
                "Bash",
                json!({"command": format!("printf '{content}' > /workspace/{file} && echo wrote"),
                       "description": "write the file"}),
                json!({"input_tokens": 1000, "output_tokens": 20}),
            ),
            done,
        ],
    )
}

/// One script whose steps are those of `scripts` in order (for runs one after the other),
/// with the first one's rules.
pub fn chain(scripts: &[Value]) -> Value {
    let steps: Vec<Value> = scripts
        .iter()
        .flat_map(|s| s["steps"].as_array().cloned().unwrap_or_default())
        .collect();
    let rules = scripts.first().map_or(Value::Null, |s| s["rules"].clone());
    json!({"rules": rules, "steps": steps})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Script;

    #[test]
    fn turns_parse_as_a_script_and_only_the_first_matches_without_a_result() {
        let s = turns(
            Api::Chat,
            vec![
                tool(
                    "Read",
                    json!({"file_path": "/workspace/a"}),
                    usage(10, 1, 0),
                ),
                say("done", usage(20, 2, 5)),
            ],
        );
        assert!(serde_json::from_value::<Script>(s.clone()).is_ok(), "{s}");
        assert_eq!(s["steps"][0]["match"], json!({"has_tools": true}));
        assert_eq!(s["steps"][1]["match"]["body_contains"], "tool_call_id");
        let both = chain(&[s.clone(), write_file("f", "x", 5)]);
        assert_eq!(both["steps"].as_array().map(Vec::len), Some(4));
        assert_eq!(both["rules"], s["rules"]);
        assert_eq!(both["steps"][3]["delay_ms"], 5);
    }
}
