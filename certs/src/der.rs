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

/// Appends a TLV whose content is produced by `f`.
pub(crate) fn write_nested(out: &mut Vec<u8>, tag: u8, f: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::with_capacity(128);
    f(&mut inner);
    write_tlv(out, tag, &inner);
}

fn write_len(out: &mut Vec<u8>, len: usize) {
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes = len.to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        out.push(0x80 | (bytes.len() - skip) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
}

/// Appends a non-negative INTEGER from big-endian magnitude bytes.
pub(crate) fn write_unsigned_integer(out: &mut Vec<u8>, magnitude: &[u8]) {
    let trimmed = {
        let skip = magnitude.iter().take_while(|b| **b == 0).count();
        &magnitude[skip.min(magnitude.len().saturating_sub(1))..]
    };
    let mut content = Vec::with_capacity(trimmed.len() + 1);
    if trimmed.first().is_some_and(|b| b & 0x80 != 0) || trimmed.is_empty() {
        content.push(0);
    }
    content.extend_from_slice(trimmed);
    write_tlv(out, tag::INTEGER, &content);
}

/// Appends an X.509 Time: UTCTime through 2049, GeneralizedTime after.
pub(crate) fn write_time(out: &mut Vec<u8>, t: OffsetDateTime) {
    let t = t.to_offset(time::UtcOffset::UTC);
    let year = t.year();
    if (1950..2050).contains(&year) {
        let s = format!(
            "{:02}{:02}{:02}{:02}{:02}{:02}Z",
            year % 100,
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        );
        write_tlv(out, tag::UTC_TIME, s.as_bytes());
    } else {
        let s = format!(
            "{:04}{:02}{:02}{:02}{:02}{:02}Z",
            year,
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        );
        write_tlv(out, tag::GENERALIZED_TIME, s.as_bytes());
    }
}

/// Appends an Extension `SEQUENCE { extnID, critical?, extnValue }`.
pub(crate) fn write_extension(out: &mut Vec<u8>, oid_der: &[u8], critical: bool, value: &[u8]) {
    write_nested(out, tag::SEQUENCE, |ext| {
        write_tlv(ext, tag::OID, oid_der);
        if critical {
            write_tlv(ext, tag::BOOLEAN, &[0xff]);
        }
        write_tlv(ext, tag::OCTET_STRING, value);
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
}
