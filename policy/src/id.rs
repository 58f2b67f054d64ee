//! Task ids (`tid`) and the `agent/<tid>` branch names the git helpers may touch.
//!
//! A tid becomes a path component (`tasks/<tid>`, `sockets/<tid>`), a cgroup name, a log field
//! and part of a git ref, so it is held to the narrowest alphabet that works for all of them:
//! `^[0-9a-z][0-9a-z-]{0,63}$`. The first character may not be `-` so a tid can never be read as
//! a command-line option, and the alphabet rules out `/`, `.`, whitespace, NUL, uppercase (case-
//! insensitive filesystems) and every non-ASCII look-alike.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::newtype::validated_string;

/// Longest accepted tid, in bytes (all accepted characters are one byte).
pub const TID_MAX_LEN: usize = 64;

/// The only branch prefix the git helpers deliver to or delete.
const BRANCH_PREFIX: &str = "agent/";

/// Why a tid or branch name was refused. Offending input is shown escaped and shortened, so a
/// hostile value can neither forge log lines nor blow up an error body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("task id is empty")]
    Empty,
    #[error("task id is {len} bytes long, at most {TID_MAX_LEN} allowed")]
    TooLong { len: usize },
    #[error("task id {shown} has a character outside [0-9a-z-] at byte {index}")]
    BadChar { shown: String, index: usize },
    #[error("task id {shown} must start with [0-9a-z]")]
    BadStart { shown: String },
    #[error("branch {shown} is not of the form agent/<tid>")]
    NotAgentBranch { shown: String },
    #[error("branch {shown} has an invalid task id: {source}")]
    BadBranchTid {
        shown: String,
        #[source]
        source: Box<IdError>,
    },
}

/// Renders untrusted input for an error message: Rust-escaped (newlines, NUL and control
/// characters become visible escapes) and cut to a bounded length.
pub(crate) fn shown(input: &str) -> String {
    const MAX_CHARS: usize = 80;
    let mut cut: String = input.chars().take(MAX_CHARS).collect();
    if cut.len() < input.len() {
        cut.push('…');
    }
    format!("{cut:?}")
}

/// A validated task id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Tid(String);

impl Tid {
    /// Accepts exactly `\A[0-9a-z][0-9a-z-]{0,63}\z`.
    pub fn parse(input: &str) -> Result<Tid, IdError> {
        let bytes = input.as_bytes();
        let Some(&first) = bytes.first() else {
            return Err(IdError::Empty);
        };
        // Checked byte by byte rather than with a regex so there is no doubt about anchoring or
        // about a trailing newline sneaking past `$`.
        if let Some(index) = bytes.iter().position(|&b| !is_tid_byte(b)) {
            return Err(IdError::BadChar {
                shown: shown(input),
                index,
            });
        }
        if bytes.len() > TID_MAX_LEN {
            return Err(IdError::TooLong { len: bytes.len() });
        }
        if first == b'-' {
            return Err(IdError::BadStart {
                shown: shown(input),
            });
        }
        Ok(Tid(input.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn is_tid_byte(b: u8) -> bool {
    b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'-'
}

impl AsRef<str> for Tid {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

validated_string!(Tid, IdError, Tid::parse; display);

/// A branch the git helpers may write or delete: exactly `agent/<tid>`, a short name (never a
/// full ref, never with `+`, `:` or a leading `-`), so it cannot be turned into a refspec that
/// touches another branch or into a git option.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AgentBranch(Tid);

impl AgentBranch {
    pub fn parse(input: &str) -> Result<AgentBranch, IdError> {
        let Some(rest) = input.strip_prefix(BRANCH_PREFIX) else {
            return Err(IdError::NotAgentBranch {
                shown: shown(input),
            });
        };
        Tid::parse(rest)
            .map(AgentBranch)
            .map_err(|source| IdError::BadBranchTid {
                shown: shown(input),
                source: Box::new(source),
            })
    }

    pub fn for_tid(tid: &Tid) -> AgentBranch {
        AgentBranch(tid.clone())
    }

    pub fn tid(&self) -> &Tid {
        &self.0
    }

    /// The full ref, `refs/heads/agent/<tid>`, for plumbing commands that want one.
    pub fn refname(&self) -> String {
        format!("refs/heads/{BRANCH_PREFIX}{}", self.0)
    }
}

impl fmt::Display for AgentBranch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{BRANCH_PREFIX}{}", self.0)
    }
}

validated_string!(AgentBranch, IdError, AgentBranch::parse);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_simple_ids() {
        for ok in ["a", "0", "task-1", "a-", "0123456789", &"a".repeat(64)] {
            assert_eq!(Tid::parse(ok).unwrap().as_str(), ok);
        }
    }

    #[test]
    fn refuses_bad_ids() {
        let long = "a".repeat(65);
        for bad in [
            "", "-a", "A", "aB", "a\n", "a\0", "a b", "a/b", "..", "a.b", "а", "１", &long, "a_b",
        ] {
            assert!(Tid::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn error_messages_escape_input() {
        let err = Tid::parse("x\ny").unwrap_err().to_string();
        assert!(!err.contains('\n'), "{err}");
        assert!(err.contains("\\n"), "{err}");
        let err = Tid::parse(&"é".repeat(10_000)).unwrap_err().to_string();
        assert!(err.len() < 400, "{}", err.len());
    }

    #[test]
    fn serde_goes_through_parse() {
        let tid: Tid = serde_json::from_str("\"t-1\"").unwrap();
        assert_eq!(serde_json::to_string(&tid).unwrap(), "\"t-1\"");
        assert!(serde_json::from_str::<Tid>("\"T\"").is_err());
        assert!(serde_json::from_str::<Tid>("\"a\\n\"").is_err());
        let b: AgentBranch = serde_json::from_str("\"agent/t-1\"").unwrap();
        assert_eq!(serde_json::to_string(&b).unwrap(), "\"agent/t-1\"");
        assert!(serde_json::from_str::<AgentBranch>("\"main\"").is_err());
    }

    #[test]
    fn branch_round_trip() {
        let tid = Tid::parse("abc").unwrap();
        let b = AgentBranch::for_tid(&tid);
        assert_eq!(b.to_string(), "agent/abc");
        assert_eq!(b.refname(), "refs/heads/agent/abc");
        assert_eq!(b.tid(), &tid);
        assert_eq!(AgentBranch::parse("agent/abc").unwrap(), b);
    }

    #[test]
    fn refuses_bad_branches() {
        for bad in [
            "main",
            "refs/heads/agent/x",
            "+agent/x",
            "agent/x:refs/heads/main",
            "--upload-pack=touch /tmp/x",
            "agent/",
            "agent/X",
            "agent/a/b",
            "agent/-x",
            "Agent/x",
            "agent//x",
            "agent/x\n",
            " agent/x",
        ] {
            assert!(AgentBranch::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    proptest! {
        #[test]
        fn regex_matches_parse(s in "[0-9a-z][0-9a-z-]{0,63}") {
            let tid = Tid::parse(&s).unwrap();
            prop_assert_eq!(tid.to_string(), s.clone());
            let json = serde_json::to_string(&tid).unwrap();
            prop_assert_eq!(serde_json::from_str::<Tid>(&json).unwrap(), tid.clone());
            let branch = AgentBranch::for_tid(&tid);
            prop_assert_eq!(AgentBranch::parse(&branch.to_string()).unwrap(), branch);
        }

        #[test]
        fn foreign_char_refused(
            prefix in "[0-9a-z][0-9a-z-]{0,20}",
            bad in any::<char>().prop_filter("outside the tid set", |c| {
                !(c.is_ascii_digit() || c.is_ascii_lowercase() || *c == '-')
            }),
            suffix in "[0-9a-z-]{0,20}",
        ) {
            let s = format!("{prefix}{bad}{suffix}");
            prop_assert!(Tid::parse(&s).is_err());
            let branch = format!("agent/{s}");
            prop_assert!(AgentBranch::parse(&branch).is_err());
        }

        #[test]
        fn agrees_with_anchored_regex(s in "\\PC{0,70}|[0-9a-z-]{0,70}\n?") {
            let re = regex::Regex::new(r"\A[0-9a-z][0-9a-z-]{0,63}\z").unwrap();
            prop_assert_eq!(Tid::parse(&s).is_ok(), re.is_match(&s));
        }
    }
}
