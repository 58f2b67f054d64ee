//! The environment a caller may pass to a sandboxed process: only operator-allowlisted keys,
//! with well-formed names and bounded values, minus a hard denylist that no configuration can
//! re-enable.
//!
//! The denylist exists because the caller of `POST /agents` is less trusted than the operator
//! who wrote `agentbox.toml`, and a handful of variables turn "set an environment variable" into
//! "run this code" or "send the model traffic and credentials elsewhere": loader and interpreter
//! hooks (`LD_PRELOAD`, `NODE_OPTIONS`, `PYTHONSTARTUP`, `BASH_ENV`...), git's environment
//! (`GIT_DIR`, `GIT_CONFIG_PARAMETERS` run arbitrary commands via config), commands that tools
//! spawn (`EDITOR`, `PAGER`, `SHELL`), proxies and CA bundles, provider endpoints and keys
//! (`ANTHROPIC_BASE_URL` would bypass the gateway and its budget), and the variables the
//! launcher itself sets for the sandbox (`PATH`, `HOME`, `TMPDIR`...). An operator who lists one
//! of these gets a config error ([`validate_allowlist`]) rather than a silent drop.
//!
//! Denylist matching ignores ASCII case: several programs read lowercase twins (`http_proxy`)
//! and nothing legitimate needs `ld_preload`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::id::shown;

/// Default bound on one value, in bytes.
pub const DEFAULT_MAX_VALUE_BYTES: usize = 32 * 1024;
/// Default bound on all kept `KEY=VALUE\0` strings together; well under the kernel's 2 MiB
/// argument-plus-environment budget, so a caller cannot make `execve` fail with `E2BIG`.
pub const DEFAULT_MAX_TOTAL_BYTES: usize = 256 * 1024;
/// Longest accepted key; real variable names are short, and a dropped key is echoed in reports.
pub const MAX_KEY_BYTES: usize = 256;

/// Exact names (compared ASCII-uppercased) that are always refused.
const DENY_EXACT: &[(&str, &str)] = &[
    ("BASH_ENV", "shell startup file"),
    ("ENV", "shell startup file"),
    ("ZDOTDIR", "shell startup directory"),
    ("SHELLOPTS", "shell behaviour"),
    ("BASHOPTS", "shell behaviour"),
    ("PROMPT_COMMAND", "shell runs it"),
    ("PS1", "shell prompt expansion runs commands"),
    ("PS2", "shell prompt expansion runs commands"),
    ("PS3", "shell prompt expansion runs commands"),
    ("PS4", "shell prompt expansion runs commands"),
    ("IFS", "shell word splitting"),
    ("CDPATH", "shell directory lookup"),
    ("GLOBIGNORE", "shell globbing"),
    ("PATH", "set by the launcher"),
    ("HOME", "set by the launcher"),
    ("USER", "set by the launcher"),
    ("LOGNAME", "set by the launcher"),
    ("SHELL", "set by the launcher; tools spawn it"),
    ("TMPDIR", "set by the launcher"),
    ("PWD", "set by the launcher"),
    ("OLDPWD", "set by the launcher"),
    ("VIRTUAL_ENV", "set by the launcher"),
    ("GCONV_PATH", "glibc loads modules from it"),
    ("GLIBC_TUNABLES", "glibc loader tunables"),
    ("LOCPATH", "glibc locale loading"),
    ("NLSPATH", "message catalogue loading"),
    ("HOSTALIASES", "name resolution"),
    ("RES_OPTIONS", "name resolution"),
    ("LOCALDOMAIN", "name resolution"),
    ("EDITOR", "tools run it"),
    ("VISUAL", "tools run it"),
    ("PAGER", "tools run it"),
    ("MANPAGER", "tools run it"),
    ("BROWSER", "tools run it"),
    ("LESSOPEN", "less runs it"),
    ("LESSCLOSE", "less runs it"),
    ("SSH_ASKPASS", "tools run it"),
    ("SUDO_ASKPASS", "tools run it"),
    ("JAVA_TOOL_OPTIONS", "jvm agent injection"),
    ("_JAVA_OPTIONS", "jvm agent injection"),
    ("JDK_JAVA_OPTIONS", "jvm agent injection"),
    ("CLASSPATH", "jvm class loading"),
    ("GOFLAGS", "go build flags (-toolexec)"),
    ("GOENV", "go configuration file"),
    ("TCLLIBPATH", "interpreter library path"),
    ("HTTP_PROXY", "reroutes network traffic"),
    ("HTTPS_PROXY", "reroutes network traffic"),
    ("ALL_PROXY", "reroutes network traffic"),
    ("NO_PROXY", "reroutes network traffic"),
    ("FTP_PROXY", "reroutes network traffic"),
    ("SSL_CERT_FILE", "replaces trusted certificates"),
    ("SSL_CERT_DIR", "replaces trusted certificates"),
    ("REQUESTS_CA_BUNDLE", "replaces trusted certificates"),
    ("CURL_CA_BUNDLE", "replaces trusted certificates"),
    ("SSLKEYLOGFILE", "writes TLS session keys"),
    (
        "CLAUDE_CONFIG_DIR",
        "relocates agent settings (hooks, apiKeyHelper)",
    ),
    ("CLAUDE_CODE_OAUTH_TOKEN", "model credentials"),
    ("CLAUDE_CODE_SHELL", "agent's shell"),
    ("CLAUDE_CODE_SHELL_PREFIX", "wraps every agent command"),
];

/// Prefixes (compared ASCII-uppercased) that are always refused.
const DENY_PREFIX: &[(&str, &str)] = &[
    ("LD_", "dynamic loader control"),
    ("DYLD_", "dynamic loader control"),
    ("BASH_", "bash internals and exported functions"),
    (
        "GIT_",
        "git environment runs commands and redirects repositories",
    ),
    ("PYTHON", "python interpreter hooks"),
    ("PERL", "perl interpreter hooks"),
    ("RUBY", "ruby interpreter hooks"),
    ("GEM_", "ruby library path"),
    ("NODE_", "node interpreter hooks"),
    ("NPM_CONFIG_", "npm runs configured scripts"),
    ("LUA_", "lua interpreter hooks"),
    ("CORECLR_", ".net profiler injection"),
    ("DOTNET_", ".net runtime hooks"),
    ("COMPLUS_", ".net runtime hooks"),
    ("CARGO_", "cargo configuration runs commands"),
    ("RUSTC", "cargo runs RUSTC_WRAPPER and friends"),
    ("XDG_", "relocates every tool's configuration"),
    ("SSH_", "ssh agent and commands"),
    ("AGENTBOX_", "agentbox's own configuration"),
    (
        "ANTHROPIC_",
        "model endpoint and credentials; the gateway decides these",
    ),
    ("OPENAI_", "model endpoint and credentials"),
    ("AWS_", "cloud credentials and endpoints"),
    ("GOOGLE_", "cloud credentials and endpoints"),
    ("VERTEX_", "cloud model endpoint"),
    ("AZURE_", "cloud credentials and endpoints"),
    (
        "CLAUDE_CODE_USE_",
        "switches the agent to another model provider",
    ),
    ("CLAUDE_CODE_SKIP_", "skips provider authentication"),
];

/// Why a key was refused by the hard denylist, or `None` if it is not on it.
pub fn denied(key: &str) -> Option<&'static str> {
    let upper = key.to_ascii_uppercase();
    DENY_EXACT
        .iter()
        .find(|(name, _)| *name == upper)
        .or_else(|| {
            DENY_PREFIX
                .iter()
                .find(|(prefix, _)| upper.starts_with(prefix))
        })
        .map(|(_, why)| *why)
}

/// Whether `key` is a portable environment variable name: `[A-Za-z_][A-Za-z0-9_]*`, at most
/// [`MAX_KEY_BYTES`] bytes. This also rules out `=` (which would split `KEY=VALUE` elsewhere)
/// and NUL.
pub fn valid_name(key: &str) -> bool {
    let bytes = key.as_bytes();
    match bytes.split_first() {
        None => false,
        Some((first, rest)) => {
            bytes.len() <= MAX_KEY_BYTES
                && (first.is_ascii_alphabetic() || *first == b'_')
                && rest.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'_')
        }
    }
}

/// A refused allowlist entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("env allowlist entry {shown} is not a valid variable name")]
    InvalidName { shown: String },
    #[error("env allowlist entry {key} is on the hard denylist ({why})")]
    Denied { key: String, why: &'static str },
}

/// Checks an operator's allowlist; config loading calls this so a denied or malformed key is a
/// startup error naming the key, not a silent drop at request time.
pub fn validate_allowlist<I, S>(keys: I) -> Result<(), EnvError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    for key in keys {
        let key = key.as_ref();
        if !valid_name(key) {
            return Err(EnvError::InvalidName { shown: shown(key) });
        }
        if let Some(why) = denied(key) {
            return Err(EnvError::Denied {
                key: key.to_owned(),
                why,
            });
        }
    }
    Ok(())
}

/// Size bounds applied while filtering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_value_bytes: usize,
    /// Sum over kept entries of `key.len() + value.len() + 2` (`=` and the NUL), as `execve`
    /// counts them.
    pub max_total_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_value_bytes: DEFAULT_MAX_VALUE_BYTES,
            max_total_bytes: DEFAULT_MAX_TOTAL_BYTES,
        }
    }
}

/// The keys an operator allows, validated, plus the size bounds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Allowlist {
    keys: BTreeSet<String>,
    limits: Limits,
}

impl Allowlist {
    /// Builds an allowlist, refusing it like [`validate_allowlist`] does.
    pub fn new<I, S>(keys: I) -> Result<Allowlist, EnvError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let keys: Vec<String> = keys.into_iter().map(|k| k.as_ref().to_owned()).collect();
        validate_allowlist(&keys)?;
        Ok(Allowlist {
            keys: keys.into_iter().collect(),
            limits: Limits::default(),
        })
    }

    pub fn with_limits(mut self, limits: Limits) -> Allowlist {
        self.limits = limits;
        self
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn contains(&self, key: &str) -> bool {
        self.keys.contains(key)
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(String::as_str)
    }
}

/// Why one entry was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    InvalidName,
    /// On the hard denylist; wins over the allowlist.
    Denied {
        why: &'static str,
    },
    NotAllowlisted,
    NulInValue,
    ValueTooLong {
        len: usize,
        max: usize,
    },
    /// Keeping it would push the environment over the total bound. Entries are considered in
    /// key order, so which ones are dropped does not depend on the caller's ordering.
    TotalTooLarge {
        max: usize,
    },
    /// The same key appeared more than once in the input; the first occurrence counts.
    Duplicate,
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DropReason::InvalidName => f.write_str("not a valid variable name"),
            DropReason::Denied { why } => write!(f, "on the hard denylist ({why})"),
            DropReason::NotAllowlisted => f.write_str("not in the allowlist"),
            DropReason::NulInValue => f.write_str("value contains a NUL byte"),
            DropReason::ValueTooLong { len, max } => {
                write!(f, "value is {len} bytes, at most {max} allowed")
            }
            DropReason::TotalTooLarge { max } => {
                write!(f, "environment would exceed {max} bytes")
            }
            DropReason::Duplicate => f.write_str("duplicate key"),
        }
    }
}

/// A dropped entry. `key` is shown escaped and shortened (it is untrusted and goes to logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    pub key: String,
    pub reason: DropReason,
}

impl fmt::Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.reason)
    }
}

/// The outcome of [`filter`]: what the sandboxed process gets and what was dropped, in key
/// order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Filtered {
    pub kept: BTreeMap<String, String>,
    pub dropped: Vec<Dropped>,
}

/// Keeps the allowlisted, well-formed, bounded entries of `input` and reports the rest.
/// Accepts a `&BTreeMap<String, String>`, a `&HashMap`, or any iterator of string pairs.
pub fn filter<I, K, V>(input: I, allow: &Allowlist) -> Filtered
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    let mut pairs: Vec<(K, V)> = input.into_iter().collect();
    // Stable: among duplicates, the caller's first occurrence stays first.
    pairs.sort_by(|a, b| a.0.as_ref().cmp(b.0.as_ref()));
    let limits = allow.limits;
    let mut out = Filtered::default();
    let mut total = 0usize;
    let mut previous: Option<&str> = None;
    for (key, value) in &pairs {
        let (key, value) = (key.as_ref(), value.as_ref());
        let duplicate = previous == Some(key);
        previous = Some(key);
        let reason = if duplicate {
            Some(DropReason::Duplicate)
        } else if !valid_name(key) {
            Some(DropReason::InvalidName)
        } else if let Some(why) = denied(key) {
            Some(DropReason::Denied { why })
        } else if !allow.contains(key) {
            Some(DropReason::NotAllowlisted)
        } else if value.contains('\0') {
            Some(DropReason::NulInValue)
        } else if value.len() > limits.max_value_bytes {
            Some(DropReason::ValueTooLong {
                len: value.len(),
                max: limits.max_value_bytes,
            })
        } else {
            let size = key.len() + value.len() + 2;
            if total + size > limits.max_total_bytes {
                Some(DropReason::TotalTooLarge {
                    max: limits.max_total_bytes,
                })
            } else {
                total += size;
                None
            }
        };
        match reason {
            None => {
                out.kept.insert(key.to_owned(), value.to_owned());
            }
            Some(reason) => out.dropped.push(Dropped {
                key: shown(key),
                reason,
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn allow(keys: &[&str]) -> Allowlist {
        Allowlist::new(keys.iter().copied()).unwrap()
    }

    #[test]
    fn keeps_only_allowlisted() {
        let a = allow(&["MAX_THINKING_TOKENS", "AGENT_NO_GUIDE"]);
        let input = BTreeMap::from([
            ("MAX_THINKING_TOKENS".to_owned(), "1024".to_owned()),
            ("OTHER".to_owned(), "x".to_owned()),
            ("LD_PRELOAD".to_owned(), "/tmp/x.so".to_owned()),
        ]);
        let f = filter(&input, &a);
        assert_eq!(f.kept.len(), 1);
        assert_eq!(f.kept["MAX_THINKING_TOKENS"], "1024");
        let reasons: Vec<_> = f.dropped.iter().map(|d| d.reason).collect();
        assert!(matches!(reasons[0], DropReason::Denied { .. }));
        assert_eq!(reasons[1], DropReason::NotAllowlisted);
    }

    #[test]
    fn allowlist_refuses_denied_and_malformed() {
        for bad in [
            "LD_PRELOAD",
            "ld_preload",
            "GIT_DIR",
            "PATH",
            "NODE_OPTIONS",
            "ANTHROPIC_BASE_URL",
            "http_proxy",
            "PYTHONPATH",
        ] {
            let err = validate_allowlist([bad]).unwrap_err();
            assert!(matches!(err, EnvError::Denied { .. }), "{bad}");
            assert!(err.to_string().contains(bad), "{err}");
        }
        for bad in ["", "A=B", "1A", "A-B", "A\0", "É"] {
            assert!(matches!(
                validate_allowlist([bad]).unwrap_err(),
                EnvError::InvalidName { .. }
            ));
        }
        validate_allowlist([
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS",
            "MAX_THINKING_TOKENS",
            "AGENT_NO_GUIDE",
        ])
        .unwrap();
    }

    #[test]
    fn bounds() {
        let a = allow(&["A", "B", "C"]).with_limits(Limits {
            max_value_bytes: 10,
            max_total_bytes: 12,
        });
        let f = filter([("C", "12345"), ("A", "12345"), ("B", "12345678901")], &a);
        assert_eq!(f.kept.keys().collect::<Vec<_>>(), ["A"]);
        assert_eq!(
            f.dropped[0].reason,
            DropReason::ValueTooLong { len: 11, max: 10 }
        );
        assert_eq!(f.dropped[1].reason, DropReason::TotalTooLarge { max: 12 });
    }

    #[test]
    fn duplicates_keep_first() {
        let a = allow(&["A"]);
        let f = filter([("A", "1"), ("A", "2")], &a);
        assert_eq!(f.kept["A"], "1");
        assert_eq!(f.dropped[0].reason, DropReason::Duplicate);
    }

    #[test]
    fn dropped_keys_are_escaped() {
        let a = allow(&["A"]);
        let f = filter([("A\nB", "1")], &a);
        assert_eq!(f.dropped[0].key, "\"A\\nB\"");
        assert_eq!(f.dropped[0].reason, DropReason::InvalidName);
    }

    proptest! {
        #[test]
        fn kept_is_subset_of_allowlist(
            input in proptest::collection::btree_map("[A-Za-z_=\0]{0,6}", "\\PC{0,8}", 0..20),
            keys in proptest::collection::btree_set("[A-Z][A-Z_]{0,5}", 0..8),
        ) {
            let keys: Vec<_> = keys.into_iter().filter(|k| denied(k).is_none()).collect();
            let a = Allowlist::new(&keys).unwrap();
            let f = filter(&input, &a);
            prop_assert_eq!(f.kept.len() + f.dropped.len(), input.len());
            for (k, v) in &f.kept {
                prop_assert!(a.contains(k));
                prop_assert!(valid_name(k));
                prop_assert!(denied(k).is_none());
                prop_assert!(!v.contains('\0'));
                prop_assert_eq!(input.get(k), Some(v));
            }
        }
    }
}
