//! Input quoted in messages stays short: an error that repeats what a caller or an
//! operator wrote quotes at most [`QUOTE_MAX`] characters of it, with an ellipsis and
//! the full length, so one 50 MB scalar cannot become a 50 MB log line or answer.

use std::borrow::Cow;
use std::fmt::Write as _;

/// The most characters of one piece of input a message quotes.
pub const QUOTE_MAX: usize = 80;

/// The most characters of one message line (after its quotes are shortened).
pub const LINE_MAX: usize = 400;

/// `text` itself when it is at most `max` characters, else its first `max`
/// characters, an ellipsis and its length in bytes.
pub fn shorten_to(text: &str, max: usize) -> Cow<'_, str> {
    match text.char_indices().nth(max) {
        None => Cow::Borrowed(text),
        Some((cut, _)) => {
            let mut out = String::with_capacity(cut + 24);
            out.push_str(&text[..cut]);
            let _ = write!(out, "… ({} bytes)", text.len());
            Cow::Owned(out)
        }
    }
}

/// [`shorten_to`] with [`QUOTE_MAX`].
///
/// # Examples
///
/// ```
/// let long = "x".repeat(1000);
/// let short = limiter_core::text::shorten(&long);
/// assert!(short.starts_with(&"x".repeat(80)));
/// assert!(short.ends_with("… (1000 bytes)"));
/// assert_eq!(limiter_core::text::shorten("acme"), "acme");
/// ```
pub fn shorten(text: &str) -> Cow<'_, str> {
    shorten_to(text, QUOTE_MAX)
}

/// A message with every quoted piece (between backticks or double quotes) cut to
/// [`QUOTE_MAX`] characters, and every line to [`LINE_MAX`].
pub fn shorten_message(message: &str) -> Cow<'_, str> {
    let mut out = String::with_capacity(message.len().min(4 * LINE_MAX));
    for (i, line) in message.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&shorten_to(&shorten_quotes(line), LINE_MAX));
    }
    if out == message { Cow::Borrowed(message) } else { Cow::Owned(out) }
}

fn shorten_quotes(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(open) = rest.find(['`', '"']) {
        let quote = rest[open..].chars().next().unwrap_or('`');
        out.push_str(&rest[..=open]);
        let after = &rest[open + 1..];
        match after.find(quote) {
            Some(close) => {
                out.push_str(&shorten(&after[..close]));
                out.push(quote);
                rest = &after[close + 1..];
            }
            None => {
                out.push_str(&shorten(after));
                return out;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_are_cut_with_their_length_and_short_text_is_kept() {
        let big = "y".repeat(5_000);
        let m = format!("tenants.a.limit.rate: expected a rate, found `{big}` (see docs)");
        let s = shorten_message(&m);
        assert!(s.len() < 200, "{s}");
        assert!(s.contains("… (5000 bytes)`"), "{s}");
        assert!(s.ends_with("(see docs)"), "{s}");
        assert_eq!(shorten_message("short `one`"), "short `one`");
        // Unquoted giant lines are cut too; multi-byte text is cut on a character.
        let wide = "é".repeat(1_000);
        let s = shorten_message(&wide);
        assert!(s.chars().count() < LINE_MAX + 30, "{s}");
        assert!(s.ends_with("(2000 bytes)"));
    }
}
