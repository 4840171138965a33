//! Text a job or a file supplied, made harmless for a terminal.
//!
//! Process names, component, stage and span names, labels, run names and
//! command lines come from the job (or from a file someone else wrote).
//! Printed raw, an `ESC` sequence in one of them would set the terminal's
//! title, blink, or move the cursor, and a bidirectional override would
//! reorder the line a user reads. Every command's output and every log
//! line passes through one of the functions here, which write each such
//! character as a visible escape (`\u{1b}`) instead.

use std::borrow::Cow;
use std::fmt::Write;

/// Whether `c` may change what a terminal shows beyond printing a glyph:
/// C0 and C1 controls and DEL (`ESC` starts colour, cursor and title
/// sequences; `U+009B` is a one-byte `CSI` to some terminals), the
/// bidirectional marks, embeddings, overrides and isolates that reorder a
/// line, and the line and paragraph separators.
pub(crate) fn is_control(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{200e}'
                | '\u{200f}'
                | '\u{061c}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
                | '\u{2028}'
                | '\u{2029}'
        )
}

fn escape_if(s: &str, bad: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !s.chars().any(&bad) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if bad(c) {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// One name or value on one line: every control escaped, newlines and
/// tabs included.
pub(crate) fn escape(s: &str) -> Cow<'_, str> {
    escape_if(s, is_control)
}

/// Text of several lines that memtrack laid out (a report, a status
/// view, a log line): newlines and tabs stay, every other control is
/// escaped.
pub(crate) fn escape_text(s: &str) -> Cow<'_, str> {
    escape_if(s, |c| is_control(c) && c != '\n' && c != '\t')
}

/// Whatever a command writes to stdout (text or JSON): the ASCII
/// controls other than newline and tab become `\u{1b}`, as in
/// `escape`; the others (C1 controls, bidirectional overrides) become
/// `\uXXXX`. JSON writers escape the ASCII controls but print the others
/// raw, and those appear only inside strings, where `\uXXXX` is the same
/// value to a JSON reader and inert on a terminal.
pub fn escape_output(s: &str) -> Cow<'_, str> {
    let bad = |c: char| is_control(c) && c != '\n' && c != '\t';
    if !s.chars().any(bad) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if !bad(c) {
            out.push(c);
        } else if c.is_ascii() {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        } else {
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bidi_are_shown_not_obeyed() {
        assert_eq!(escape("plain name-1.x"), "plain name-1.x");
        assert_eq!(
            escape("\u{1b}]0;T\u{7}\u{1b}[5m"),
            "\\u{1b}]0;T\\u{7}\\u{1b}[5m"
        );
        assert_eq!(escape("a\u{202e}b\u{2066}c"), "a\\u{202e}b\\u{2066}c");
        assert_eq!(escape("x\u{9b}31m\u{7f}"), "x\\u{9b}31m\\u{7f}");
        assert_eq!(escape("a\nb"), "a\\u{a}b");
        assert_eq!(escape_text("a\n\tb\u{1b}c\r"), "a\n\tb\\u{1b}c\\u{d}");
        assert_eq!(escape("ünï ✓ 日本"), "ünï ✓ 日本");
    }

    #[test]
    fn json_stays_json() {
        let text =
            serde_json::to_string(&serde_json::json!({"n": "a\u{202e}b\u{9b}c\u{1b}"})).unwrap();
        let safe = escape_output(&text);
        assert!(!safe.chars().any(is_control), "{safe}");
        let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
        assert_eq!(back["n"], "a\u{202e}b\u{9b}c\u{1b}");
        assert_eq!(
            escape_output("a\u{1b}[5m\n\u{202e}"),
            "a\\u{1b}[5m\n\\u202e"
        );
    }
}
