//! A minimal DER writer for the certificate structures meshca issues.
//!
//! The workload and server certificates are assembled here rather than with
//! rcgen for two reasons: the issuer name must be the signing certificate's
//! subject byte for byte (rcgen re-encodes names and cannot express repeated
//! attribute types or multi-valued RDNs, which operator-made CAs have), and
//! the signing path is the CA's hot path.

use time::OffsetDateTime;

/// Universal tags used by the writer.
pub(crate) mod tag {
    pub(crate) const BOOLEAN: u8 = 0x01;
    pub(crate) const INTEGER: u8 = 0x02;
    pub(crate) const BIT_STRING: u8 = 0x03;
    pub(crate) const OCTET_STRING: u8 = 0x04;
    pub(crate) const OID: u8 = 0x06;
    pub(crate) const UTC_TIME: u8 = 0x17;
    pub(crate) const GENERALIZED_TIME: u8 = 0x18;
    pub(crate) const SEQUENCE: u8 = 0x30;
}

/// Appends a TLV with the given tag and content.
pub(crate) fn write_tlv(out: &mut Vec<u8>, tag: u8, content: &[u8]) {
    out.push(tag);
    write_len(out, content.len());
    out.extend_from_slice(content);
}

/// Appends a TLV whose content `f` appends to `out` itself: the content is
/// written in place and its length filled in afterwards (one byte reserved;
/// a longer length shifts the content up by a few bytes), so nesting costs
/// no buffer of its own — a certificate is a dozen levels of nesting, built
/// once per issuance.
pub(crate) fn write_nested(out: &mut Vec<u8>, tag: u8, f: impl FnOnce(&mut Vec<u8>)) {
    out.push(tag);
    let len_at = out.len();
    out.push(0);
    f(out);
    let len = out.len() - len_at - 1;
    let (octets, count) = len_octets(len);
    out[len_at] = octets[0];
    if count > 1 {
        out.splice(len_at + 1..len_at + 1, octets[1..count].iter().copied());
    }
}

fn write_len(out: &mut Vec<u8>, len: usize) {
    let (octets, count) = len_octets(len);
    out.extend_from_slice(&octets[..count]);
}

/// The DER length octets of `len` (short form below 0x80, else 0x80 | n
/// followed by n big-endian octets) and how many of the array they use.
fn len_octets(len: usize) -> ([u8; 9], usize) {
    let mut octets = [0u8; 9];
    if len < 0x80 {
        octets[0] = len as u8;
        return (octets, 1);
    }
    let bytes = len.to_be_bytes();
    let skip = bytes.iter().take_while(|b| **b == 0).count();
    let n = bytes.len() - skip;
    octets[0] = 0x80 | n as u8;
    octets[1..=n].copy_from_slice(&bytes[skip..]);
    (octets, n + 1)
}

/// Appends a non-negative INTEGER from big-endian magnitude bytes.
pub(crate) fn write_unsigned_integer(out: &mut Vec<u8>, magnitude: &[u8]) {
    let trimmed = {
        let skip = magnitude.iter().take_while(|b| **b == 0).count();
        &magnitude[skip.min(magnitude.len().saturating_sub(1))..]
    };
    write_nested(out, tag::INTEGER, |content| {
        if trimmed.first().is_some_and(|b| b & 0x80 != 0) || trimmed.is_empty() {
            content.push(0);
        }
        content.extend_from_slice(trimmed);
    });
}

/// Appends an X.509 Time: UTCTime through 2049, GeneralizedTime after
/// (RFC 5280 §4.1.2.5), always in UTC with seconds and no fraction.
pub(crate) fn write_time(out: &mut Vec<u8>, t: OffsetDateTime) {
    let t = t.to_offset(time::UtcOffset::UTC);
    // Digits written straight into a fixed buffer: two times per
    // certificate, and `format!` costs more instructions (docs/benchmarks-history.md,
    // "Evenly loaded loops keep their requests (a helper must have idled
    // 1 ms)", has the counts).
    let year = u32::try_from(t.year()).unwrap_or(0).min(9999);
    let mut text = [0u8; 15];
    let (tag, mut at) = if (1950..2050).contains(&year) {
        put_two_digits(&mut text[..2], year % 100);
        (tag::UTC_TIME, 2)
    } else {
        put_two_digits(&mut text[..2], year / 100);
        put_two_digits(&mut text[2..4], year % 100);
        (tag::GENERALIZED_TIME, 4)
    };
    for part in [
        u32::from(u8::from(t.month())),
        u32::from(t.day()),
        u32::from(t.hour()),
        u32::from(t.minute()),
        u32::from(t.second()),
    ] {
        put_two_digits(&mut text[at..at + 2], part);
        at += 2;
    }
    text[at] = b'Z';
    write_tlv(out, tag, &text[..=at]);
}

/// Writes `value` (below 100) as two ASCII digits.
fn put_two_digits(out: &mut [u8], value: u32) {
    // Both digits are below 10, so the casts cannot truncate.
    out[0] = b'0' + (value / 10 % 10) as u8;
    out[1] = b'0' + (value % 10) as u8;
}

/// Appends an Extension `SEQUENCE { extnID, critical?, extnValue }`.
pub(crate) fn write_extension(out: &mut Vec<u8>, oid_der: &[u8], critical: bool, value: &[u8]) {
    write_extension_with(out, oid_der, critical, |v| v.extend_from_slice(value));
}

/// Appends an Extension whose value (the DER inside `extnValue`) `value`
/// writes in place.
pub(crate) fn write_extension_with(
    out: &mut Vec<u8>,
    oid_der: &[u8],
    critical: bool,
    value: impl FnOnce(&mut Vec<u8>),
) {
    write_nested(out, tag::SEQUENCE, |ext| {
        write_tlv(ext, tag::OID, oid_der);
        if critical {
            write_tlv(ext, tag::BOOLEAN, &[0xff]);
        }
        write_nested(ext, tag::OCTET_STRING, value);
    });
}

/// Encoded OID contents (without tag and length).
pub(crate) mod oid {
    /// 2.5.29.14 subjectKeyIdentifier
    pub(crate) const SUBJECT_KEY_IDENTIFIER: &[u8] = &[0x55, 0x1d, 0x0e];
    /// 2.5.29.15 keyUsage
    pub(crate) const KEY_USAGE: &[u8] = &[0x55, 0x1d, 0x0f];
    /// 2.5.29.17 subjectAltName
    pub(crate) const SUBJECT_ALT_NAME: &[u8] = &[0x55, 0x1d, 0x11];
    /// 2.5.29.19 basicConstraints
    pub(crate) const BASIC_CONSTRAINTS: &[u8] = &[0x55, 0x1d, 0x13];
    /// 2.5.29.35 authorityKeyIdentifier
    pub(crate) const AUTHORITY_KEY_IDENTIFIER: &[u8] = &[0x55, 0x1d, 0x23];
    /// 2.5.29.37 extKeyUsage
    pub(crate) const EXT_KEY_USAGE: &[u8] = &[0x55, 0x1d, 0x25];
    /// id-ce-nameConstraints (2.5.29.30).
    pub(crate) const NAME_CONSTRAINTS: &[u8] = &[0x55, 0x1d, 0x1e];
    /// 1.3.6.1.5.5.7.3.1 id-kp-serverAuth
    pub(crate) const KP_SERVER_AUTH: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x01];
    /// 1.3.6.1.5.5.7.3.2 id-kp-clientAuth
    pub(crate) const KP_CLIENT_AUTH: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x02];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_and_integers() {
        let mut out = Vec::new();
        write_tlv(&mut out, tag::OCTET_STRING, &[0u8; 200]);
        assert_eq!(&out[..3], &[0x04, 0x81, 200]);
        let mut out = Vec::new();
        write_tlv(&mut out, tag::OCTET_STRING, &[0u8; 300]);
        assert_eq!(&out[..4], &[0x04, 0x82, 0x01, 0x2c]);
        let mut out = Vec::new();
        write_unsigned_integer(&mut out, &[0x00, 0x00, 0x80]);
        assert_eq!(out, [0x02, 0x02, 0x00, 0x80]);
        let mut out = Vec::new();
        write_unsigned_integer(&mut out, &[0x00, 0x7f]);
        assert_eq!(out, [0x02, 0x01, 0x7f]);
        let mut out = Vec::new();
        write_unsigned_integer(&mut out, &[0x00]);
        assert_eq!(out, [0x02, 0x01, 0x00]);
    }

    #[test]
    fn nested_content_gets_the_length_a_separate_buffer_would() {
        // Short form, the edges of one and two length octets, and nesting.
        for len in [0usize, 1, 0x7f, 0x80, 0xff, 0x100, 0xffff, 0x10000] {
            let content: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut expected = vec![0xaa];
            write_tlv(&mut expected, tag::SEQUENCE, &content);
            let mut out = vec![0xaa];
            write_nested(&mut out, tag::SEQUENCE, |c| c.extend_from_slice(&content));
            assert_eq!(out, expected, "{len} bytes");

            let mut inner = Vec::new();
            write_tlv(&mut inner, tag::OCTET_STRING, &content);
            let mut expected = Vec::new();
            write_tlv(&mut expected, 0xa3, &inner);
            let mut out = Vec::new();
            write_nested(&mut out, 0xa3, |outer| {
                write_nested(outer, tag::OCTET_STRING, |c| c.extend_from_slice(&content));
            });
            assert_eq!(out, expected, "nested, {len} bytes");
        }
    }

    #[test]
    fn times() {
        let t = OffsetDateTime::from_unix_timestamp(0).unwrap();
        let mut out = Vec::new();
        write_time(&mut out, t);
        assert_eq!(&out[2..], b"700101000000Z");
        let t = OffsetDateTime::from_unix_timestamp(2_556_144_000).unwrap(); // 2051
        let mut out = Vec::new();
        write_time(&mut out, t);
        assert_eq!(out[0], tag::GENERALIZED_TIME);
        assert_eq!(&out[2..6], b"2051");
    }

    /// The text `format!` gives, the reference the digit writer must match.
    fn reference_time_text(t: OffsetDateTime) -> (u8, String) {
        let t = t.to_offset(time::UtcOffset::UTC);
        let rest = format!(
            "{:02}{:02}{:02}{:02}{:02}Z",
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        );
        if (1950..2050).contains(&t.year()) {
            (tag::UTC_TIME, format!("{:02}{rest}", t.year() % 100))
        } else {
            (tag::GENERALIZED_TIME, format!("{:04}{rest}", t.year()))
        }
    }

    #[test]
    fn times_match_the_formatted_text_across_both_encodings() {
        use time::macros::datetime;
        let mut cases = vec![
            datetime!(1949-12-31 23:59:59 UTC),
            datetime!(1950-01-01 00:00:00 UTC),
            datetime!(1999-09-09 09:09:09 UTC),
            datetime!(2000-02-29 12:34:56 UTC),
            datetime!(2049-12-31 23:59:59 UTC),
            datetime!(2050-01-01 00:00:00 UTC),
            datetime!(9999-12-31 23:59:59 UTC),
            datetime!(0001-01-01 00:00:00 UTC),
            // Not UTC: written as the same instant in UTC.
            datetime!(2049-12-31 23:30:00 -01:00),
        ];
        // Every hour of a leap year, minutes and seconds varied along.
        let start = datetime!(2024-01-01 00:00:00 UTC);
        cases
            .extend((0..366 * 24).map(|h| start + time::Duration::seconds(h * 3600 + h % 60 * 61)));
        for t in cases {
            let mut out = Vec::new();
            write_time(&mut out, t);
            let (tag, text) = reference_time_text(t);
            assert_eq!(out[0], tag, "{t}");
            assert_eq!(usize::from(out[1]), text.len(), "{t}");
            assert_eq!(&out[2..], text.as_bytes(), "{t}");
            // And a DER reader takes it back to the same instant.
            let (rest, parsed) =
                <x509_parser::time::ASN1Time as x509_parser::prelude::FromDer<_>>::from_der(&out)
                    .map_err(|e| format!("{t}: {e}"))
                    .unwrap();
            assert!(rest.is_empty());
            assert_eq!(
                parsed.to_datetime(),
                t.to_offset(time::UtcOffset::UTC),
                "{t}"
            );
        }
    }
}
