//! Identifiers: the session/turn/instance id rule of the reference
//! (`^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$`), checked as given (never normalized), and the ids
//! the server makes (request ids, generated turn ids, runtime ids).

use crate::model::Timestamp;

/// Whether `id` is a valid session, turn or instance id.
#[must_use]
pub fn is_valid(id: &str) -> bool {
    let mut chars = id.chars();
    let Some(first) = chars.next() else {
        return false;
    };
    id.len() <= 128
        && first.is_ascii_alphanumeric()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'))
}

/// `bytes` random bytes as lowercase hex.
#[must_use]
pub fn hex(bytes: usize) -> String {
    let mut buf = vec![0_u8; bytes];
    if let Err(e) = getrandom::fill(&mut buf) {
        // Ids need uniqueness, not secrecy: fall back to the clock.
        tracing::warn!(error = %e, "no system randomness; using the clock for an id");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (nanos >> ((i % 16) * 8)) as u8;
        }
    }
    ::hex::encode(buf)
}

/// `req-` + 8 hex digits.
#[must_use]
pub fn request_id() -> String {
    format!("req-{}", hex(4))
}

/// `turn-` + 32 hex digits (a turn submitted without an id).
#[must_use]
pub fn turn_id() -> String {
    format!("turn-{}", hex(16))
}

/// `bbs-YYYYmmdd-HHMMSS-xxxx`.
#[must_use]
pub fn runtime_id() -> String {
    format!("bbs-{}-{}", Timestamp::now().compact(), hex(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_rule() {
        for ok in ["a", "sess-001", "A.b_c:d-e", &"x".repeat(128)] {
            assert!(is_valid(ok), "{ok}");
        }
        for bad in ["", "-a", ".a", "a/b", "a b", "é", &"x".repeat(129), "a\n"] {
            assert!(!is_valid(bad), "{bad:?}");
        }
    }

    #[test]
    fn generated_ids_have_their_shapes() {
        assert_eq!(request_id().len(), 12);
        let t = turn_id();
        assert!(t.starts_with("turn-") && t.len() == 37 && is_valid(&t));
        let r = runtime_id();
        assert!(
            r.starts_with("bbs-") && r.len() == "bbs-20261130-120000-abcd".len(),
            "{r}"
        );
    }
}
