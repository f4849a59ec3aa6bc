//! The HTTP rate-limit header fields a gateway sends with an answer: the IETF draft's
//! structured `RateLimit-Policy` and `RateLimit`, and `Retry-After`. Shared by the
//! server (Envoy's `response_headers_to_add`) and the agent's tower layer.

use crate::clock::{NANOS_PER_SEC, Nanos};

/// The header carrying our stable reason on a rejection.
pub const REASON_HEADER: &str = "x-ratelimit-reason";

/// A Structured Field string: printable ASCII, quotes and backslashes escaped, other
/// characters replaced by `_`.
///
/// # Examples
///
/// ```
/// assert_eq!(limiter_core::headers::sf_string("a\"b"), r#""a\"b""#);
/// ```
pub fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
    out
}

/// Whole seconds, rounded up.
pub fn seconds_ceil(n: Nanos) -> u64 {
    n.div_ceil(NANOS_PER_SEC)
}

/// One `RateLimit-Policy` item: `"name";q=QUOTA;w=WINDOW_SECONDS`.
pub fn policy_item(name: &str, quota: u64, window: Nanos) -> String {
    format!("{};q={quota};w={}", sf_string(name), seconds_ceil(window).max(1))
}

/// One `RateLimit` item: `"name";r=REMAINING;t=SECONDS_TO_RESET`.
pub fn limit_item(name: &str, remaining: u64, reset: Nanos) -> String {
    format!("{};r={remaining};t={}", sf_string(name), seconds_ceil(reset))
}

/// `Retry-After` in whole seconds, at least 1.
pub fn retry_after(wait: Nanos) -> String {
    seconds_ceil(wait).max(1).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_and_escapes() {
        assert_eq!(sf_string(r#"a"b\c é"#), r#""a\"b\\c _""#);
        assert_eq!(policy_item("x", 10, 1_500_000_000), r#""x";q=10;w=2"#);
        assert_eq!(limit_item("x", 3, 0), r#""x";r=3;t=0"#);
        assert_eq!(retry_after(1), "1");
        assert_eq!(retry_after(2_000_000_001), "3");
    }
}
