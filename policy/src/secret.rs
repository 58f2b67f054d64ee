//! Secrets (task tokens, the bridge token, provider keys): a wrapper that never prints its
//! value and compares in constant time.
//!
//! Keys must never reach logs, error bodies, `/health` or debug output, so [`Secret`] has a
//! redacting `Debug`, no `Display` and no `Serialize`; the only way to the bytes is the
//! explicitly named [`Secret::expose`].

use std::fmt;

use subtle::ConstantTimeEq;

/// A secret string.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value. Empty secrets are refused: an empty token would let an empty
    /// `Authorization` header through.
    pub fn new(value: String) -> Option<Secret> {
        (!value.is_empty()).then_some(Secret(value))
    }

    /// The secret value, for building an upstream header. Never log the result.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Compares `candidate` with the secret without leaking, through timing, how many leading
    /// bytes matched. The length may leak; it is not secret for our tokens.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        self.0.as_bytes().ct_eq(candidate).into()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// The token a client presented: `Authorization: Bearer <t>` or `x-api-key: <t>`, the two ways
/// Anthropic clients authenticate. `None` when neither is present or the header is malformed.
pub fn presented_token<'a>(
    authorization: Option<&'a [u8]>,
    x_api_key: Option<&'a [u8]>,
) -> Option<&'a [u8]> {
    if let Some(auth) = authorization {
        let (scheme, rest) = auth.split_at_checked(7)?;
        return scheme
            .eq_ignore_ascii_case(b"bearer ")
            .then_some(rest.trim_ascii());
    }
    x_api_key.map(<[u8]>::trim_ascii)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_value() {
        let s = Secret::new("sk-very-secret".into()).unwrap();
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        assert!(!format!("{:?}", Some(&s)).contains("sk-very"));
    }

    #[test]
    fn matches_exactly() {
        let s = Secret::new("tok-123".into()).unwrap();
        assert!(s.matches(b"tok-123"));
        for bad in [&b"tok-12"[..], b"tok-1234", b"TOK-123", b"", b"tok-123\n"] {
            assert!(!s.matches(bad), "{bad:?}");
        }
        assert!(Secret::new(String::new()).is_none());
    }

    #[test]
    fn presented_token_reads_both_headers() {
        assert_eq!(
            presented_token(Some(b"Bearer abc"), None),
            Some(&b"abc"[..])
        );
        assert_eq!(
            presented_token(Some(b"bearer abc"), None),
            Some(&b"abc"[..])
        );
        assert_eq!(presented_token(None, Some(b"abc")), Some(&b"abc"[..]));
        assert_eq!(presented_token(Some(b"Basic abc"), None), None);
        assert_eq!(presented_token(Some(b"Bear"), None), None);
        assert_eq!(presented_token(None, None), None);
        // A malformed Authorization header is not rescued by x-api-key: ambiguity is refused.
        assert_eq!(presented_token(Some(b"Basic abc"), Some(b"abc")), None);
    }
}
