//! The demo's work: a tiny Python project whose test fails, the prompt, and the built-in
//! scripted model that fixes it through Claude Code's own tools (run the test, read the
//! source, edit it, run the test again, report). The model commits nothing: delivery makes
//! the commit and the branch.

use agentbox_fakellm::claude::{self, Api, say, tool, usage};
use serde_json::{Value, json};

/// The files of the demo repository, committed as its first commit.
pub const FILES: &[(&str, &str)] = &[
    (
        "README.md",
        "# calc\n\nA tiny calculator. Run the tests with `python3 -m unittest -v`.\n",
    ),
    (".gitignore", "__pycache__/\n"),
    (
        "calc.py",
        "\"\"\"A tiny calculator.\"\"\"\n\n\ndef add(a, b):\n    \"\"\"The sum of a and b.\"\"\"\n    return a - b\n",
    ),
    (
        "test_calc.py",
        "import unittest\n\nfrom calc import add\n\n\nclass AddTest(unittest.TestCase):\n    def test_adds_two_numbers(self):\n        self.assertEqual(add(2, 3), 5)\n\n\nif __name__ == \"__main__\":\n    unittest.main()\n",
    ),
];

/// What the agent is asked.
pub const PROMPT: &str = "The test in test_calc.py fails. Find the bug, fix it in the source (not in the test), \
     and run `python3 -m unittest -v` to check.";

/// The line with the bug, and what fixes it.
pub const BUG: (&str, &str) = ("    return a - b", "    return a + b");

/// The test command, as the model (and then the demo, to show the result) runs it.
pub const TEST: &str = "python3 -m unittest -v";

/// The built-in model's script for Claude Code behind the bridge (chat mode). Usage numbers
/// are what a real model reports for these turns: Claude Code's ~18k-token system prompt and
/// tools on the first, then mostly cache reads as the conversation grows.
pub fn script() -> Value {
    claude::turns(
        Api::Chat,
        vec![
            tool(
                "Bash",
                json!({"command": TEST, "description": "Run the failing test"}),
                usage(18_432, 61, 0),
            ),
            tool(
                "Read",
                json!({"file_path": "/workspace/calc.py"}),
                usage(412, 58, 18_300),
            ),
            tool(
                "Edit",
                json!({"file_path": "/workspace/calc.py", "old_string": BUG.0, "new_string": BUG.1}),
                usage(530, 124, 18_700),
            ),
            tool(
                "Bash",
                json!({"command": TEST, "description": "Run the test again"}),
                usage(389, 57, 19_230),
            ),
            say(
                "Fixed: `add` in calc.py subtracted instead of adding (`a - b`); it now returns \
                 `a + b`, and `python3 -m unittest -v` passes.",
                usage(352, 48, 19_620),
            ),
        ],
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_script_is_valid_and_fixes_the_bug_in_the_file() {
        let s: agentbox_fakellm::Script = serde_json::from_value(script()).unwrap();
        assert_eq!(s.steps.len(), 5);
        let calc = FILES.iter().find(|(n, _)| *n == "calc.py").unwrap().1;
        assert_eq!(
            calc.matches(BUG.0).count(),
            1,
            "Edit needs a unique old_string"
        );
    }
}
