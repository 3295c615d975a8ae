//! Reading what a certificate says: [`CertSummary`].

use std::net::IpAddr;

use serde::Serialize;
use time::OffsetDateTime;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::keys::KeyKind;
use crate::profile::hex;

/// The facts of one certificate, as people and scripts want them.
#[derive(Debug, Clone, Serialize)]
pub struct CertSummary {
    /// Subject DN, RFC 4514 style (empty for SVIDs).
    pub subject: String,
    /// Issuer DN.
    pub issuer: String,
    /// Serial number, lowercase hex.
    pub serial: String,
    /// URI SANs (SPIFFE IDs for SVIDs).
    pub uris: Vec<String>,
    /// DNS SANs.
    pub dns_names: Vec<String>,
    /// IP SANs.
    pub ip_addresses: Vec<IpAddr>,
    /// notBefore.
    #[serde(with = "time::serde::rfc3339")]
    pub not_before: OffsetDateTime,
    /// notAfter.
    #[serde(with = "time::serde::rfc3339")]
    pub not_after: OffsetDateTime,
    /// basicConstraints cA.
    pub is_ca: bool,
    /// basicConstraints pathLenConstraint.
    pub path_len: Option<u32>,
    /// The subject key, e.g. "ECDSA P-256".
    pub key: String,
    /// Whether issuer == subject and the signature verifies with its own key.
    pub self_signed: bool,
    /// keyUsage bits set, by RFC 5280 name.
    pub key_usage: Vec<String>,
    /// extKeyUsage purposes, by name (or OID).
    pub ext_key_usage: Vec<String>,
    /// Subject key identifier, hex.
    pub subject_key_id: Option<String>,
    /// Authority key identifier, hex.
    pub authority_key_id: Option<String>,
}

/// The error when a DER blob is not a certificate.
#[derive(Debug, thiserror::Error)]
#[error("not a valid X.509 certificate: {0}")]
pub struct InspectError(String);

impl CertSummary {
    /// Reads a DER certificate.
    pub fn from_der(der: &[u8]) -> Result<Self, InspectError> {
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|e| InspectError(crate::bundle::describe_x509_error(&e)))?;
        let mut uris = Vec::new();
        let mut dns_names = Vec::new();
        let mut ip_addresses = Vec::new();
        let mut subject_key_id = None;
        let mut authority_key_id = None;
        let mut is_ca = false;
        let mut key_usage = Vec::new();
        let mut ext_key_usage = Vec::new();
        let mut path_len = None;
        for ext in cert.extensions() {
            match ext.parsed_extension() {
                ParsedExtension::SubjectAlternativeName(san) => {
                    for name in &san.general_names {
                        match name {
                            GeneralName::URI(u) => uris.push(u.to_string()),
                            GeneralName::DNSName(d) => dns_names.push(d.to_string()),
                            GeneralName::IPAddress(bytes) => {
                                if let Ok(v4) = <[u8; 4]>::try_from(*bytes) {
                                    ip_addresses.push(IpAddr::from(v4));
                                } else if let Ok(v6) = <[u8; 16]>::try_from(*bytes) {
                                    ip_addresses.push(IpAddr::from(v6));
                                }
                            }
                            _ => {}
                        }
                    }
                }
                ParsedExtension::SubjectKeyIdentifier(k) => subject_key_id = Some(hex(k.0)),
                ParsedExtension::AuthorityKeyIdentifier(a) => {
                    authority_key_id = a.key_identifier.as_ref().map(|k| hex(k.0))
                }
                ParsedExtension::KeyUsage(ku) => {
                    let bits = [
                        (ku.digital_signature(), "digitalSignature"),
                        (ku.non_repudiation(), "contentCommitment"),
                        (ku.key_encipherment(), "keyEncipherment"),
                        (ku.data_encipherment(), "dataEncipherment"),
                        (ku.key_agreement(), "keyAgreement"),
                        (ku.key_cert_sign(), "keyCertSign"),
                        (ku.crl_sign(), "cRLSign"),
                        (ku.encipher_only(), "encipherOnly"),
                        (ku.decipher_only(), "decipherOnly"),
                    ];
                    key_usage = bits
                        .iter()
                        .filter(|(set, _)| *set)
                        .map(|(_, n)| n.to_string())
                        .collect();
                }
                ParsedExtension::ExtendedKeyUsage(eku) => {
                    let named = [
                        (eku.any, "any"),
                        (eku.server_auth, "serverAuth"),
                        (eku.client_auth, "clientAuth"),
                        (eku.code_signing, "codeSigning"),
                        (eku.email_protection, "emailProtection"),
                        (eku.time_stamping, "timeStamping"),
                        (eku.ocsp_signing, "OCSPSigning"),
                    ];
                    ext_key_usage = named
                        .iter()
                        .filter(|(set, _)| *set)
                        .map(|(_, n)| n.to_string())
                        .chain(eku.other.iter().map(|o| o.to_id_string()))
                        .collect();
                }
                ParsedExtension::BasicConstraints(bc) => {
                    is_ca = bc.ca;
                    path_len = bc.path_len_constraint;
                }
                _ => {}
            }
        }
        let self_signed = cert.subject().as_raw() == cert.issuer().as_raw()
            && cert.verify_signature(None).is_ok();
        Ok(Self {
            subject: cert.subject().to_string(),
            issuer: cert.issuer().to_string(),
            serial: hex(cert.raw_serial()),
            uris,
            dns_names,
            ip_addresses,
            not_before: cert.validity().not_before.to_datetime(),
            not_after: cert.validity().not_after.to_datetime(),
            is_ca,
            path_len,
            key: KeyKind::from_spki(cert.public_key()).to_string(),
            self_signed,
            key_usage,
            ext_key_usage,
            subject_key_id,
            authority_key_id,
        })
    }
}

/// The DER SubjectPublicKeyInfo of a DER certificate.
pub fn spki_der(cert_der: &[u8]) -> Option<Vec<u8>> {
    X509Certificate::from_der(cert_der)
        .ok()
        .map(|(_, c)| c.public_key().raw.to_vec())
}
