//! Text that came from a caller, made fit for a log line or an error
//! message: cut to a bound, so that a caller cannot make the service write
//! megabytes on its behalf.

/// `text` cut to at most `max_bytes` bytes at a character boundary, with
/// `...` appended when something was cut.
///
/// ```
/// use meshca_certs::untrusted_text::shortened;
/// assert_eq!(shortened("spiffe://td/ns/a", 64), "spiffe://td/ns/a");
/// assert_eq!(shortened("aé", 2), "a...");
/// ```
pub fn shortened(text: &str, max_bytes: usize) -> String {
    if text.len() <= max_bytes {
        return text.to_string();
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_cut_at_a_character_boundary() {
        assert_eq!(shortened("", 0), "");
        assert_eq!(shortened("abc", 3), "abc");
        assert_eq!(shortened("abcd", 3), "abc...");
        // The bound falls inside the two bytes of "é": cut before it.
        assert_eq!(shortened("abé", 3), "ab...");
        assert_eq!(shortened("éé", 1), "...");
    }
}
