//! Chain verification: X509-SVIDs to a [`TrustBundle`] (path validation by
//! webpki plus the SPIFFE X509-SVID leaf rules), and CA chains (a signing
//! certificate up to a root, as a plugged-in CA must be).

use std::time::SystemTime;

use rustls_pki_types::{CertificateDer, UnixTime};
use time::OffsetDateTime;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::bundle::describe_x509_error;
use crate::profile::hex;
use crate::spiffe::SpiffeId;

/// Why a chain was refused. Each message names the certificate (by its
/// position, leaf = #1) and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// No certificates were given.
    #[error("the chain is empty")]
    EmptyChain,
    /// The bundle holds no roots.
    #[error("the trust bundle holds no certificates")]
    EmptyBundle,
    /// A certificate could not be parsed.
    #[error("certificate #{index}: {reason}")]
    Malformed {
        /// 1-based position in the chain.
        index: usize,
        /// What the parser said.
        reason: String,
    },
    /// Path validation to the bundle failed.
    #[error("certificate #1 does not chain to the trust bundle: {0}")]
    Untrusted(String),
    /// The leaf breaks an X509-SVID rule.
    #[error("certificate #1 is not a valid X509-SVID: {0}")]
    NotSvid(String),
    /// The leaf's SPIFFE ID is not the one expected.
    #[error("certificate #1 is for {found}, not the expected {expected}")]
    WrongIdentity {
        /// What was expected.
        expected: String,
        /// What the certificate says.
        found: String,
    },
    /// A chain presented by a TLS peer holds more certificates than
    /// [`MAX_PEER_CHAIN_CERTIFICATES`] (copies of the bundle's roots not
    /// counted); refused before any parsing or path building.
    #[error("the presented chain is too long: {presented} certificates, and at most {max} besides the trust bundle's roots (the leaf and {} intermediates) are accepted", max - 1)]
    ChainTooLong {
        /// Certificates presented.
        presented: usize,
        /// The bound.
        max: usize,
    },
    /// A CA certificate in a chain breaks a CA rule.
    #[error("certificate #{index} ({subject}): {reason}")]
    BadCa {
        /// 1-based position.
        index: usize,
        /// Its subject.
        subject: String,
        /// The rule broken.
        reason: String,
    },
}

/// A set of trusted root certificates (DER).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustBundle {
    roots: Vec<Vec<u8>>,
}

impl TrustBundle {
    /// A bundle of the given DER roots.
    pub fn new(roots: Vec<Vec<u8>>) -> Self {
        Self { roots }
    }

    /// Parses a PEM bundle.
    pub fn from_pem(text: &str) -> Result<Self, crate::bundle::BundleError> {
        Ok(Self::new(crate::bundle::parse_certs_pem(text)?))
    }

    /// The roots, DER.
    pub fn roots(&self) -> &[Vec<u8>] {
        &self.roots
    }

    /// The bundle as PEM.
    pub fn to_pem(&self) -> String {
        crate::bundle::encode_certs_pem(&self.roots)
    }

    /// Whether `der` is one of the roots.
    pub fn contains(&self, der: &[u8]) -> bool {
        self.roots.iter().any(|r| r == der)
    }
}

/// What a verified SVID says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedSvid {
    /// Its SPIFFE ID.
    pub spiffe_id: SpiffeId,
    /// Its serial, hex.
    pub serial_hex: String,
    /// notBefore.
    pub not_before: OffsetDateTime,
    /// notAfter.
    pub not_after: OffsetDateTime,
}

/// Verifies an X509-SVID chain (leaf first, then intermediates; roots may be
/// included) to `bundle` at time `now`, and the X509-SVID leaf rules:
/// exactly one URI SAN that is a valid SPIFFE ID, not a CA, keyUsage with
/// digitalSignature and without keyCertSign/cRLSign. If `expected` is
/// given, the ID must be that one.
pub fn verify_svid(
    chain: &[Vec<u8>],
    bundle: &TrustBundle,
    now: SystemTime,
    expected: Option<&SpiffeId>,
) -> Result<VerifiedSvid, VerifyError> {
    let leaf_der = chain.first().ok_or(VerifyError::EmptyChain)?;
    let svid = check_svid_leaf(leaf_der)?;
    if let Some(expected) = expected {
        if *expected != svid.spiffe_id {
            return Err(VerifyError::WrongIdentity {
                expected: expected.to_string(),
                found: svid.spiffe_id.to_string(),
            });
        }
    }
    verify_path(chain, bundle, now)?;
    Ok(svid)
}

/// Most certificates a TLS peer's chain may hold, copies of the trust
/// bundle's roots not counted: the leaf and up to three intermediates (a
/// plugged-in CA below two or three intermediates). An Istio workload
/// presents the chain its CA answered with, `[leaf, intermediates...,
/// roots]`; the roots are the bundle's and are not counted. Path building
/// tries every ordering of the intermediates offered, so its cost grows
/// with their number factorially (up to webpki's budget of 100 signature
/// checks); with three it is at most 15 paths.
pub const MAX_PEER_CHAIN_CERTIFICATES: usize = 4;

/// Refuses a chain presented by a TLS peer that is longer than
/// [`MAX_PEER_CHAIN_CERTIFICATES`] (copies of `bundle`'s roots not counted),
/// without parsing any certificate. Call it before [`verify_svid`] on a
/// chain from outside.
pub fn check_peer_chain_length(chain: &[Vec<u8>], bundle: &TrustBundle) -> Result<(), VerifyError> {
    let too_long = |presented| VerifyError::ChainTooLong {
        presented,
        max: MAX_PEER_CHAIN_CERTIFICATES,
    };
    // Also bounds the comparisons with the roots below.
    if chain.len() > MAX_PEER_CHAIN_CERTIFICATES + bundle.roots.len()
        || chain.iter().filter(|c| !bundle.contains(c)).count() > MAX_PEER_CHAIN_CERTIFICATES
    {
        return Err(too_long(chain.len()));
    }
    Ok(())
}

/// Path validation only (webpki, client-auth usage).
fn verify_path(
    chain: &[Vec<u8>],
    bundle: &TrustBundle,
    now: SystemTime,
) -> Result<(), VerifyError> {
    if bundle.roots.is_empty() {
        return Err(VerifyError::EmptyBundle);
    }
    let leaf_der = chain.first().ok_or(VerifyError::EmptyChain)?;
    let root_ders: Vec<CertificateDer<'_>> = bundle
        .roots
        .iter()
        .map(|r| CertificateDer::from(r.as_slice()))
        .collect();
    let anchors: Vec<_> = root_ders
        .iter()
        .filter_map(|r| webpki::anchor_from_trusted_cert(r).ok())
        .collect();
    if anchors.is_empty() {
        return Err(VerifyError::EmptyBundle);
    }
    let intermediates: Vec<CertificateDer<'_>> = chain[1..]
        .iter()
        .filter(|c| !bundle.contains(c))
        .map(|c| CertificateDer::from(c.as_slice()))
        .collect();
    let leaf = CertificateDer::from(leaf_der.as_slice());
    let ee = webpki::EndEntityCert::try_from(&leaf).map_err(|e| VerifyError::Malformed {
        index: 1,
        reason: describe_webpki_error(&e),
    })?;
    let since_epoch = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let verified = ee.verify_for_usage(
        webpki::ALL_VERIFICATION_ALGS,
        &anchors,
        &intermediates,
        UnixTime::since_unix_epoch(since_epoch),
        webpki::KeyUsage::client_auth(),
        None,
        None,
    );
    match verified {
        Ok(_) => Ok(()),
        // webpki fails closed on every URI name constraint; meshca's HSM
        // intermediate carries one (the trust domain), which is checked here.
        // (Its error may also name another path it tried, e.g. through a
        // root of the same name that the answer carries during a rotation.)
        Err(e) if has_name_constraints(&chain[1..]) => {
            verify_under_uri_name_constraints(chain, bundle, now).map_err(|why| {
                VerifyError::Untrusted(format!("{} ({why})", describe_webpki_error(&e)))
            })
        }
        Err(e) => Err(VerifyError::Untrusted(describe_webpki_error(&e))),
    }
}

/// Path validation of an X509-SVID chain whose CA certificates carry URI
/// name constraints, which webpki refuses to process (rustls-webpki fails
/// closed on any name form it does not implement). The chain must be in
/// order (`chain[1]` the leaf's issuer, each signed by the next, as
/// meshca answers): the CA part is checked by [`verify_ca_chain`]
/// (signatures, cA and keyCertSign, validity, pathLen, up to a root of
/// `bundle`), the leaf by webpki under its issuer as the anchor (signature,
/// validity, extended key usage), and then every name constraint of the
/// CA certificates and the root: only URI subtrees are accepted (any other
/// form refuses the chain), and the leaf's SPIFFE ID host (its trust
/// domain) must be inside every permitted set and outside every excluded
/// one, by RFC 5280's rule for URIs (`example.org` is that host,
/// `.example.org` any host below it).
fn verify_under_uri_name_constraints(
    chain: &[Vec<u8>],
    bundle: &TrustBundle,
    now: SystemTime,
) -> Result<(), String> {
    let leaf_der = chain.first().ok_or("the chain is empty")?;
    // The CA certificates up to the first root: an answer also carries
    // roots the bundle may not hold yet (a root rotation), which webpki
    // ignores and so does this path.
    let cas: Vec<Vec<u8>> = chain[1..]
        .iter()
        .take_while(|c| !bundle.contains(c) && !is_self_issued(c))
        .cloned()
        .collect();
    let issuer_der = cas.first().ok_or("no intermediate to check")?;
    let now_odt = OffsetDateTime::from(now);
    let root = verify_ca_chain(&cas, bundle, now_odt).map_err(|e| e.to_string())?;
    let issuer = CertificateDer::from(issuer_der.as_slice());
    let mut anchor = webpki::anchor_from_trusted_cert(&issuer)
        .map_err(|e| describe_webpki_error(&e))?
        .to_owned();
    // Checked below, by the rule webpki does not implement.
    anchor.name_constraints = None;
    let leaf = CertificateDer::from(leaf_der.as_slice());
    let ee = webpki::EndEntityCert::try_from(&leaf).map_err(|e| describe_webpki_error(&e))?;
    let since_epoch = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    ee.verify_for_usage(
        webpki::ALL_VERIFICATION_ALGS,
        &[anchor],
        &[],
        UnixTime::since_unix_epoch(since_epoch),
        webpki::KeyUsage::client_auth(),
        None,
        None,
    )
    .map_err(|e| describe_webpki_error(&e))?;
    let host = check_svid_leaf(leaf_der)
        .map_err(|e| e.to_string())?
        .spiffe_id
        .trust_domain_name()
        .to_ascii_lowercase();
    for der in cas.iter().chain(std::iter::once(&root)) {
        let (_, cert) = X509Certificate::from_der(der).map_err(|e| describe_x509_error(&e))?;
        if let Some(eku) = cert.extended_key_usage().map_err(|e| e.to_string())? {
            if !eku.value.any && !eku.value.client_auth {
                return Err(format!(
                    "{}: its extended key usage does not allow client authentication",
                    cert.subject()
                ));
            }
        }
        let Some(constraints) = cert.name_constraints().map_err(|e| e.to_string())? else {
            continue;
        };
        let uris = |subtrees: &Option<Vec<x509_parser::extensions::GeneralSubtree<'_>>>| {
            subtrees
                .iter()
                .flatten()
                .map(|t| match t.base {
                    GeneralName::URI(uri) if is_uri_constraint_host(uri) => {
                        Ok(uri.to_ascii_lowercase())
                    }
                    GeneralName::URI(uri) => Err(format!(
                        "{}: a URI name constraint {:?} that is not a host or .host",
                        cert.subject(),
                        uri.chars().take(100).collect::<String>()
                    )),
                    _ => Err(format!(
                        "{}: a name constraint of a form other than URI",
                        cert.subject()
                    )),
                })
                .collect::<Result<Vec<String>, String>>()
        };
        let permitted = uris(&constraints.value.permitted_subtrees)?;
        let excluded = uris(&constraints.value.excluded_subtrees)?;
        if constraints.value.permitted_subtrees.is_some()
            && !permitted.iter().any(|c| uri_host_matches(&host, c))
        {
            return Err(format!(
                "trust domain {host} is outside the URI names {} permits",
                cert.subject()
            ));
        }
        if excluded.iter().any(|c| uri_host_matches(&host, c)) {
            return Err(format!(
                "trust domain {host} is among the URI names {} excludes",
                cert.subject()
            ));
        }
    }
    Ok(())
}

/// Whether `c` is a URI name constraint this path understands: a host
/// (`example.org`) or a domain (`.example.org`) of letters, digits, `-`,
/// `_` and dots, without empty labels (Go's crypto/x509 refuses others).
fn is_uri_constraint_host(c: &str) -> bool {
    let host = c.strip_prefix('.').unwrap_or(c);
    !host.is_empty()
        && host.len() <= 255
        && host.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// Whether any of `certs` (DER) carries a nameConstraints extension.
fn has_name_constraints(certs: &[Vec<u8>]) -> bool {
    certs.iter().any(|der| {
        X509Certificate::from_der(der)
            .is_ok_and(|(_, c)| c.name_constraints().is_ok_and(|n| n.is_some()))
    })
}

/// Whether a certificate (DER) names itself as its issuer.
fn is_self_issued(der: &[u8]) -> bool {
    X509Certificate::from_der(der).is_ok_and(|(_, c)| c.issuer().as_raw() == c.subject().as_raw())
}

/// RFC 5280 4.2.1.10 for URIs: a constraint starting with a period matches
/// any host below it (not the host itself), otherwise exactly that host;
/// both lowercase.
fn uri_host_matches(host: &str, constraint: &str) -> bool {
    if constraint.starts_with('.') {
        host.ends_with(constraint)
    } else {
        host == constraint
    }
}

/// A webpki path-validation error in plain words, with webpki's name of it
/// in parentheses (never the raw Debug of its context, which is bytes).
/// For messages to people: `meshca-certs verify`, the CA's refusals of a
/// client certificate, the agent's report of a CA it cannot trust.
pub fn describe_webpki_error(e: &webpki::Error) -> String {
    use webpki::Error as E;
    let (plain, name) = match e {
        E::CertExpired { .. } => return "a certificate in the chain has expired".into(),
        E::CertNotValidYet { .. } => return "a certificate in the chain is not valid yet".into(),
        E::UnknownIssuer => return "no path to a root in the bundle (unknown issuer)".into(),
        E::InvalidSignatureForPublicKey => {
            return "a signature in the chain does not verify (is a root of the same name but another key in the bundle?)".into()
        }
        E::CaUsedAsEndEntity => return "the leaf is a CA certificate".into(),
        E::RequiredEkuNotFoundContext(_) => {
            return "the leaf lacks extKeyUsage clientAuth".into()
        }
        E::PathLenConstraintViolated => (
            "a CA in the chain has a basicConstraints pathLenConstraint that forbids a chain this long",
            "PathLenConstraintViolated",
        ),
        E::UnsupportedSignatureAlgorithmForPublicKeyContext(_) => (
            "a signature in the chain was not made with its issuer's key type (is a root of another key type, e.g. RSA for an ECDSA chain, in the bundle?)",
            "UnsupportedSignatureAlgorithmForPublicKey",
        ),
        E::UnsupportedSignatureAlgorithmContext(_) => (
            "a certificate in the chain is signed with an algorithm that is not supported",
            "UnsupportedSignatureAlgorithm",
        ),
        E::SignatureAlgorithmMismatch => (
            "a certificate's two signature algorithm fields disagree",
            "SignatureAlgorithmMismatch",
        ),
        E::BadDer | E::BadDerTime | E::TrailingData(_) => (
            "a certificate in the chain is not valid DER",
            "BadDer",
        ),
        E::NameConstraintViolation => (
            "a CA's name constraints forbid the leaf's names",
            "NameConstraintViolation",
        ),
        E::EndEntityUsedAsCa => (
            "an end-entity certificate is used as a CA in the chain",
            "EndEntityUsedAsCa",
        ),
        E::UnsupportedCriticalExtension => (
            "a certificate in the chain has a critical extension that is not understood",
            "UnsupportedCriticalExtension",
        ),
        E::UnsupportedCertVersion => (
            "a certificate in the chain is not X.509 version 3",
            "UnsupportedCertVersion",
        ),
        E::MaximumPathDepthExceeded
        | E::MaximumPathBuildCallsExceeded
        | E::MaximumSignatureChecksExceeded => (
            "the chain is too long or too tangled to build a path through",
            "MaximumPathDepthExceeded",
        ),
        E::CertRevoked => ("a certificate in the chain is revoked", "CertRevoked"),
        E::InvalidCertValidity => (
            "a certificate in the chain has notAfter before notBefore",
            "InvalidCertValidity",
        ),
        other => {
            // The variant's name only, never its fields.
            let debug = format!("{other:?}");
            let name: String = debug
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            return format!("path validation failed ({name})");
        }
    };
    format!("{plain} ({name})")
}

/// Checks the X509-SVID leaf rules on one certificate and returns its ID.
pub fn check_svid_leaf(der: &[u8]) -> Result<VerifiedSvid, VerifyError> {
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| VerifyError::Malformed {
        index: 1,
        reason: describe_x509_error(&e),
    })?;
    if let Some(first) = svid_leaf_violations(der).into_iter().next() {
        return Err(VerifyError::NotSvid(first));
    }
    let uri = leaf_uris(&cert).into_iter().next().unwrap_or_default();
    let spiffe_id = SpiffeId::parse(&uri)
        .map_err(|e| VerifyError::NotSvid(format!("URI SAN {uri:?} is not a SPIFFE ID: {e}")))?;
    Ok(VerifiedSvid {
        spiffe_id,
        serial_hex: hex(cert.raw_serial()),
        not_before: cert.validity().not_before.to_datetime(),
        not_after: cert.validity().not_after.to_datetime(),
    })
}

fn leaf_uris(cert: &X509Certificate<'_>) -> Vec<String> {
    cert.subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    GeneralName::URI(u) => Some(u.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Verifies a CA chain: `chain[0]` is a signing CA certificate, each
/// certificate is signed by the next, every one is a CA with keyCertSign,
/// inside its validity at `now`, and the last one is (or is signed by) a
/// root in `bundle`. Returns the root that anchors the chain.
pub fn verify_ca_chain(
    chain: &[Vec<u8>],
    bundle: &TrustBundle,
    now: OffsetDateTime,
) -> Result<Vec<u8>, VerifyError> {
    if chain.is_empty() {
        return Err(VerifyError::EmptyChain);
    }
    let parsed = parse_chain(chain)?;
    let bad = |index: usize, cert: &X509Certificate<'_>, reason: String| VerifyError::BadCa {
        index: index + 1,
        subject: cert.subject().to_string(),
        reason,
    };
    for (i, cert) in parsed.iter().enumerate() {
        check_ca_bits(cert).map_err(|r| bad(i, cert, r))?;
        check_time(cert, now).map_err(|r| bad(i, cert, r))?;
        if let Some(issuer) = parsed.get(i + 1) {
            if cert.issuer().as_raw() != issuer.subject().as_raw() {
                return Err(bad(
                    i,
                    cert,
                    format!(
                        "its issuer is not the subject of certificate #{} ({})",
                        i + 2,
                        issuer.subject()
                    ),
                ));
            }
            cert.verify_signature(Some(issuer.public_key()))
                .map_err(|_| {
                    bad(
                        i,
                        cert,
                        format!(
                            "its signature does not verify with the key of certificate #{}",
                            i + 2
                        ),
                    )
                })?;
        }
    }
    check_path_len(&parsed, 0)?;
    let last_index = parsed.len() - 1;
    let last = &parsed[last_index];
    if bundle.contains(&chain[last_index]) {
        return Ok(chain[last_index].clone());
    }
    for root_der in &bundle.roots {
        let Ok((_, root)) = X509Certificate::from_der(root_der) else {
            continue;
        };
        if root.subject().as_raw() == last.issuer().as_raw()
            && last.verify_signature(Some(root.public_key())).is_ok()
        {
            check_ca_bits(&root).map_err(|r| VerifyError::BadCa {
                index: parsed.len() + 1,
                subject: root.subject().to_string(),
                reason: r,
            })?;
            check_time(&root, now).map_err(|r| VerifyError::BadCa {
                index: parsed.len() + 1,
                subject: root.subject().to_string(),
                reason: r,
            })?;
            check_path_len_of(&root, parsed.len() + 1, parsed.len())?;
            return Ok(root_der.clone());
        }
    }
    Err(bad(
        last_index,
        last,
        "does not chain to any root in the trust bundle".to_string(),
    ))
}

/// Checks every root of `bundle` as a trust anchor: a CA (basicConstraints
/// cA; keyUsage, when present, with keyCertSign) inside its validity at
/// `now`. A leaf or an expired certificate among the roots would be handed
/// to every workload as a root. The error's index is the root's 1-based
/// place in the bundle.
pub fn check_trust_roots(bundle: &TrustBundle, now: OffsetDateTime) -> Result<(), VerifyError> {
    let parsed = parse_chain(&bundle.roots)?;
    for (i, root) in parsed.iter().enumerate() {
        check_ca_bits(root)
            .and_then(|()| check_time(root, now))
            .map_err(|reason| VerifyError::BadCa {
                index: i + 1,
                subject: root.subject().to_string(),
                reason,
            })?;
    }
    Ok(())
}

/// The subjects of the CA certificates among `certs` (DER) that carry no
/// keyUsage extension. RFC 5280 allows it (every use is then permitted),
/// but strict verifiers (`openssl verify -x509_strict`) refuse chains
/// through such a CA, so a CA loading them says so.
pub fn cas_without_key_usage(certs: &[Vec<u8>]) -> Vec<String> {
    certs
        .iter()
        .filter_map(|der| X509Certificate::from_der(der).ok().map(|(_, c)| c))
        .filter(|c| matches!(c.basic_constraints(), Ok(Some(bc)) if bc.value.ca))
        .filter(|c| matches!(c.key_usage(), Ok(None)))
        .map(|c| c.subject().to_string())
        .collect()
}

/// Parses every certificate of `chain` (DER); the first that is not one is
/// named by its place (1-based).
fn parse_chain(chain: &[Vec<u8>]) -> Result<Vec<X509Certificate<'_>>, VerifyError> {
    chain
        .iter()
        .enumerate()
        .map(|(i, der)| {
            X509Certificate::from_der(der)
                .map(|(_, c)| c)
                .map_err(|e| VerifyError::Malformed {
                    index: i + 1,
                    reason: describe_x509_error(&e),
                })
        })
        .collect()
}

/// Checks that a CA chain (`chain[0]` the signing certificate, then up
/// towards the root) leaves room, under every basicConstraints
/// pathLenConstraint in it, for the signing certificate to issue a CA
/// certificate of its own: what `meshca-certs intermediate-ca` is about to
/// do with it. [`verify_ca_chain`] makes the same check for issuing end
/// entities only.
pub fn check_room_for_sub_ca(chain: &[Vec<u8>]) -> Result<(), VerifyError> {
    let parsed = parse_chain(chain)?;
    check_path_len(&parsed, 1)
}

/// Checks basicConstraints pathLenConstraint along `chain` (signing
/// certificate first), with `below` more CA certificates to come under
/// `chain[0]`. Certificate #i (1-based) has `i - 1 + below` CA
/// certificates under it before the end entity, and its pathLen must allow
/// that many. Self-issued certificates are counted like the others, as
/// webpki (rustls) counts them, so what passes here verifies in every
/// client.
fn check_path_len(chain: &[X509Certificate<'_>], below: usize) -> Result<(), VerifyError> {
    for (i, cert) in chain.iter().enumerate() {
        check_path_len_of(cert, i + 1, i + below)?;
    }
    Ok(())
}

/// [`check_path_len`] for one certificate at 1-based position `index`
/// with `cas_below` CA certificates under it.
fn check_path_len_of(
    cert: &X509Certificate<'_>,
    index: usize,
    cas_below: usize,
) -> Result<(), VerifyError> {
    let Ok(Some(bc)) = cert.basic_constraints() else {
        return Ok(());
    };
    let Some(max) = bc.value.path_len_constraint else {
        return Ok(());
    };
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    if cas_below <= max {
        return Ok(());
    }
    let allowed = match max {
        0 => "no CA certificate under it (it may sign only end-entity certificates)".to_string(),
        1 => "1 CA certificate under it".to_string(),
        n => format!("{n} CA certificates under it"),
    };
    Err(VerifyError::BadCa {
        index,
        subject: cert.subject().to_string(),
        reason: format!(
            "its basicConstraints pathLenConstraint is {max}, which allows {allowed}, but this chain puts {cas_below} under it; every certificate issued below it would fail path validation"
        ),
    })
}

/// One problem found by [`audit_svid_chain`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based position of the certificate in the chain (leaf = 1).
    pub index: usize,
    /// How the certificate is named in messages (SPIFFE ID or subject).
    pub name: String,
    /// The rule broken.
    pub rule: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "certificate #{} ({}): {}",
            self.index, self.name, self.rule
        )
    }
}

/// Every problem of an X509-SVID chain, not just the first: the X509-SVID
/// leaf rules, the expected ID, each certificate's validity at `now`, and
/// path validation to `bundle`. Empty means the chain is good.
pub fn audit_svid_chain(
    chain: &[Vec<u8>],
    bundle: &TrustBundle,
    now: SystemTime,
    expected: Option<&SpiffeId>,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    let Some(leaf_der) = chain.first() else {
        problems.push(Problem {
            index: 0,
            name: "chain".into(),
            rule: "the chain holds no certificate".into(),
        });
        return problems;
    };
    let now_dt = OffsetDateTime::from(now);
    let mut names = Vec::new();
    for (i, der) in chain.iter().enumerate() {
        match X509Certificate::from_der(der) {
            Ok((_, cert)) => {
                let uris = leaf_uris(&cert);
                let name = match (i, uris.first()) {
                    (0, Some(u)) => u.clone(),
                    _ if cert.subject().as_raw() == [0x30, 0x00] => "empty subject".to_string(),
                    _ => cert.subject().to_string(),
                };
                if let Err(rule) = check_time(&cert, now_dt) {
                    problems.push(Problem {
                        index: i + 1,
                        name: name.clone(),
                        rule,
                    });
                }
                names.push(name);
            }
            Err(e) => {
                problems.push(Problem {
                    index: i + 1,
                    name: "unparsable".into(),
                    rule: describe_x509_error(&e),
                });
                return problems;
            }
        }
    }
    let leaf_name = names.first().cloned().unwrap_or_default();
    for rule in svid_leaf_violations(leaf_der) {
        problems.push(Problem {
            index: 1,
            name: leaf_name.clone(),
            rule,
        });
    }
    if let (Some(expected), Ok(svid)) = (expected, check_svid_leaf(leaf_der)) {
        if svid.spiffe_id != *expected {
            problems.push(Problem {
                index: 1,
                name: leaf_name.clone(),
                rule: format!(
                    "its SPIFFE ID is {}, not the expected {expected}",
                    svid.spiffe_id
                ),
            });
        }
    }
    let time_problem = problems
        .iter()
        .any(|p| p.rule.contains("expired") || p.rule.contains("not valid before"));
    if let Err(e) = verify_path(chain, bundle, now) {
        let rule = match e {
            VerifyError::Untrusted(reason) => reason,
            other => other.to_string(),
        };
        // Expiry is already reported per certificate.
        if !(time_problem && (rule.contains("expired") || rule.contains("not valid yet"))) {
            problems.push(Problem {
                index: 1,
                name: leaf_name,
                rule: format!("path validation to the bundle failed: {rule}"),
            });
        }
    }
    problems
}

/// Every X509-SVID leaf rule `der` breaks.
fn svid_leaf_violations(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return vec!["not valid X.509".into()];
    };
    let mut out = Vec::new();
    let uris = leaf_uris(&cert);
    let mut saw_ku = false;
    for ext in cert.extensions() {
        match ext.parsed_extension() {
            ParsedExtension::BasicConstraints(bc) if bc.ca => {
                out.push("basicConstraints cA is true (a leaf SVID must not be a CA)".to_string())
            }
            ParsedExtension::KeyUsage(ku) => {
                saw_ku = true;
                if !ku.digital_signature() {
                    out.push("keyUsage lacks digitalSignature".to_string());
                }
                if ku.key_cert_sign() || ku.crl_sign() {
                    out.push("keyUsage has keyCertSign or cRLSign".to_string());
                }
            }
            _ => {}
        }
    }
    if !saw_ku {
        out.push("no keyUsage extension".to_string());
    }
    match uris.as_slice() {
        [] => out.push("no URI SAN (an X509-SVID has exactly one, its SPIFFE ID)".to_string()),
        [one] => match SpiffeId::parse(one) {
            Ok(id) if id.path().is_empty() => out.push(
                "the SPIFFE ID has no path (a trust domain ID is not a workload ID)".to_string(),
            ),
            Ok(_) => {}
            Err(e) => out.push(format!("URI SAN {one:?} is not a SPIFFE ID: {e}")),
        },
        many => out.push(format!(
            "{} URI SANs; an X509-SVID has exactly one",
            many.len()
        )),
    }
    out
}

fn check_ca_bits(cert: &X509Certificate<'_>) -> Result<(), String> {
    match cert.basic_constraints() {
        Ok(Some(bc)) if bc.value.ca => {}
        Ok(_) => return Err("not a CA: basicConstraints cA is not true".into()),
        Err(e) => return Err(format!("bad basicConstraints: {e}")),
    }
    match cert.key_usage() {
        Ok(Some(ku)) if !ku.value.key_cert_sign() => {
            Err("keyUsage does not include keyCertSign".into())
        }
        Ok(_) => Ok(()),
        Err(e) => Err(format!("bad keyUsage: {e}")),
    }
}

fn check_time(cert: &X509Certificate<'_>, now: OffsetDateTime) -> Result<(), String> {
    let v = cert.validity();
    if now < v.not_before.to_datetime() {
        return Err(format!(
            "not valid before {}",
            crate::Rfc3339(v.not_before.to_datetime())
        ));
    }
    if now > v.not_after.to_datetime() {
        return Err(format!(
            "expired at {}",
            crate::Rfc3339(v.not_after.to_datetime())
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csr::{build_csr, VerifiedCsr};
    use crate::keys::{KeyAlgorithm, PrivateKey};
    use crate::profile::{self_signed_root, SigningCa, SubjectKey, SubjectName, Validity};
    use time::Duration;

    fn root() -> SigningCa {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let name = SubjectName {
            common_name: Some("Root".into()),
            ..Default::default()
        };
        let cert = self_signed_root(
            &key,
            &name,
            Validity::backdated(OffsetDateTime::now_utc(), Duration::days(10)),
        )
        .unwrap();
        SigningCa::new(cert.der, key).unwrap()
    }

    fn id() -> SpiffeId {
        SpiffeId::parse("spiffe://cluster.local/ns/a/sa/b").unwrap()
    }

    fn leaf(ca: &SigningCa, validity: Validity) -> Vec<u8> {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let csr = VerifiedCsr::from_pem(&build_csr(&key, &id()).unwrap()).unwrap();
        ca.issue_workload(csr.subject_key(), &id(), validity)
            .unwrap()
            .der
    }

    /// A leaf of `spiffe_id` under an intermediate constrained to
    /// `hosts` (as meshca's HSM intermediate is), signed by `root`.
    fn constrained_chain(root: &SigningCa, hosts: &[&str], spiffe_id: &str) -> Vec<Vec<u8>> {
        let validity = Validity::backdated(OffsetDateTime::now_utc(), Duration::hours(1));
        let int_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let int = root
            .issue_constrained_ca(
                &SubjectKey::of(&int_key).unwrap(),
                &SubjectName {
                    common_name: Some("int".into()),
                    ..Default::default()
                },
                Some(0),
                hosts,
                validity,
            )
            .unwrap();
        let int_ca = SigningCa::new(int.der.clone(), int_key).unwrap();
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let leaf = int_ca
            .issue_workload(
                &SubjectKey::of(&key).unwrap(),
                &SpiffeId::parse(spiffe_id).unwrap(),
                validity,
            )
            .unwrap();
        vec![leaf.der, int.der, root.cert_der().to_vec()]
    }

    #[test]
    fn uri_name_constraints_that_webpki_refuses_are_checked_by_rfc_5280s_rule() {
        let ca = root();
        let bundle = TrustBundle::new(vec![ca.cert_der().to_vec()]);
        let now = SystemTime::now();
        let inside = constrained_chain(&ca, &["cluster.local"], "spiffe://cluster.local/ns/a/sa/b");
        let svid = verify_svid(&inside, &bundle, now, None).unwrap();
        assert_eq!(
            svid.spiffe_id.to_string(),
            "spiffe://cluster.local/ns/a/sa/b"
        );
        // Another trust domain, a subdomain of a host constraint, a
        // foreign root: refused.
        for (hosts, id) in [
            (&["cluster.local"][..], "spiffe://evil.example/ns/a/sa/b"),
            (&["cluster.local"][..], "spiffe://x.cluster.local/ns/a/sa/b"),
            (&[".cluster.local"][..], "spiffe://cluster.local/ns/a/sa/b"),
        ] {
            let chain = constrained_chain(&ca, hosts, id);
            let err = verify_svid(&chain, &bundle, now, None).unwrap_err();
            assert!(
                err.to_string().contains("outside the URI names"),
                "{hosts:?} {id}: {err}"
            );
        }
        let below = constrained_chain(
            &ca,
            &[".cluster.local"],
            "spiffe://x.cluster.local/ns/a/sa/b",
        );
        verify_svid(&below, &bundle, now, None).unwrap();
        let other = root();
        let foreign = constrained_chain(
            &other,
            &["cluster.local"],
            "spiffe://cluster.local/ns/a/sa/b",
        );
        let err = verify_svid(&foreign, &bundle, now, None).unwrap_err();
        assert!(matches!(err, VerifyError::Untrusted(_)), "{err}");
        // A leaf whose signature is not the intermediate's.
        let mut forged = inside.clone();
        forged[0] = constrained_chain(
            &other,
            &["cluster.local"],
            "spiffe://cluster.local/ns/a/sa/b",
        )[0]
        .clone();
        assert!(verify_svid(&forged, &bundle, now, None).is_err());
        // An expired constrained chain.
        let later = now + std::time::Duration::from_secs(2 * 3600);
        assert!(verify_svid(&inside, &bundle, later, None).is_err());
        // A root the bundle does not hold yet at the end (a root rotation's
        // answer): ignored, as webpki ignores it.
        let mut with_next_root = inside.clone();
        with_next_root.push(other.cert_der().to_vec());
        verify_svid(&with_next_root, &bundle, now, None).unwrap();
        // A URI constraint that is no host: refused, permitted or not.
        let odd = constrained_chain(
            &ca,
            &["spiffe://cluster.local"],
            "spiffe://cluster.local/ns/a/sa/b",
        );
        let err = verify_svid(&odd, &bundle, now, None).unwrap_err();
        assert!(err.to_string().contains("not a host"), "{err}");
    }

    #[test]
    fn verifies_a_good_chain_and_refuses_a_foreign_root() {
        let ca = root();
        let der = leaf(
            &ca,
            Validity::backdated(OffsetDateTime::now_utc(), Duration::hours(1)),
        );
        let bundle = TrustBundle::new(vec![ca.cert_der().to_vec()]);
        let svid = verify_svid(
            &[der.clone(), ca.cert_der().to_vec()],
            &bundle,
            SystemTime::now(),
            Some(&id()),
        )
        .unwrap();
        assert_eq!(svid.spiffe_id, id());
        let other = root();
        let foreign = TrustBundle::new(vec![other.cert_der().to_vec()]);
        assert!(matches!(
            verify_svid(
                std::slice::from_ref(&der),
                &foreign,
                SystemTime::now(),
                None
            ),
            Err(VerifyError::Untrusted(_))
        ));
        let wrong = SpiffeId::parse("spiffe://cluster.local/ns/a/sa/c").unwrap();
        assert!(matches!(
            verify_svid(&[der], &bundle, SystemTime::now(), Some(&wrong)),
            Err(VerifyError::WrongIdentity { .. })
        ));
    }

    #[test]
    fn refuses_an_expired_leaf() {
        let ca = root();
        let past = OffsetDateTime::now_utc() - Duration::days(2);
        let der = leaf(&ca, Validity::backdated(past, Duration::hours(1)));
        let bundle = TrustBundle::new(vec![ca.cert_der().to_vec()]);
        let err = verify_svid(&[der], &bundle, SystemTime::now(), None).unwrap_err();
        assert!(err.to_string().contains("expired"), "{err}");
    }

    #[test]
    fn refuses_a_ca_as_leaf() {
        let ca = root();
        let bundle = TrustBundle::new(vec![ca.cert_der().to_vec()]);
        assert!(matches!(
            verify_svid(&[ca.cert_der().to_vec()], &bundle, SystemTime::now(), None),
            Err(VerifyError::NotSvid(_))
        ));
    }

    /// `depth` intermediates below `root`, the one that signs last first,
    /// and the CA that signs leaves (`None`: the root).
    fn intermediates(root: &SigningCa, depth: usize) -> (Option<SigningCa>, Vec<Vec<u8>>) {
        let mut signer: Option<SigningCa> = None;
        let mut ders = Vec::new();
        for i in 0..depth {
            let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
            let int = signer
                .as_ref()
                .unwrap_or(root)
                .issue_ca(
                    &SubjectKey::of(&key).unwrap(),
                    &SubjectName {
                        common_name: Some(format!("Int {i}")),
                        ..Default::default()
                    },
                    None,
                    Validity::backdated(OffsetDateTime::now_utc(), Duration::days(1)),
                )
                .unwrap();
            ders.insert(0, int.der.clone());
            signer = Some(SigningCa::new(int.der, key).unwrap());
        }
        (signer, ders)
    }

    #[test]
    fn a_long_peer_chain_is_refused_before_anything_is_parsed() {
        let ca = root();
        let bundle = TrustBundle::new(vec![ca.cert_der().to_vec()]);
        // Twenty "certificates" that are not even X.509: refused for their
        // number, so nothing was parsed and no path was built.
        let junk = vec![b"not a certificate".to_vec(); 20];
        let err = check_peer_chain_length(&junk, &bundle).unwrap_err();
        assert_eq!(
            err,
            VerifyError::ChainTooLong {
                presented: 20,
                max: MAX_PEER_CHAIN_CERTIFICATES
            }
        );
        assert!(err.to_string().contains("too long"), "{err}");
        // Up to the bound, the same junk goes on to be parsed (and refused).
        assert!(check_peer_chain_length(&junk[..4], &bundle).is_ok());
        assert!(matches!(
            verify_svid(&junk[..4], &bundle, SystemTime::now(), None),
            Err(VerifyError::Malformed { .. })
        ));
        // Copies of the bundle's roots are not counted, up to one per root.
        let mut with_root = junk[..4].to_vec();
        with_root.push(ca.cert_der().to_vec());
        assert!(check_peer_chain_length(&with_root, &bundle).is_ok());
        with_root.push(ca.cert_der().to_vec());
        assert!(check_peer_chain_length(&with_root, &bundle).is_err());
    }

    #[test]
    fn a_peer_chain_through_three_intermediates_is_accepted_and_four_are_too_many() {
        let ca = root();
        let bundle = TrustBundle::new(vec![ca.cert_der().to_vec()]);
        let now = SystemTime::now();
        for depth in 0..=4 {
            let (signer, ints) = intermediates(&ca, depth);
            let mut chain = vec![leaf(
                signer.as_ref().unwrap_or(&ca),
                Validity::backdated(OffsetDateTime::now_utc(), Duration::hours(1)),
            )];
            chain.extend(ints);
            // As an Istio workload presents it: the root at the end.
            chain.push(ca.cert_der().to_vec());
            let checked = check_peer_chain_length(&chain, &bundle)
                .and_then(|()| verify_svid(&chain, &bundle, now, Some(&id())));
            if depth <= 3 {
                assert!(checked.is_ok(), "{depth} intermediates: {checked:?}");
            } else {
                assert!(
                    matches!(
                        checked,
                        Err(VerifyError::ChainTooLong {
                            presented: 6,
                            max: 4
                        })
                    ),
                    "{depth} intermediates: {checked:?}"
                );
            }
        }
    }

    #[test]
    fn ca_chain_checks() {
        let ca = root();
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let int = ca
            .issue_ca(
                &SubjectKey::of(&key).unwrap(),
                &SubjectName {
                    common_name: Some("Int".into()),
                    ..Default::default()
                },
                Some(0),
                Validity::backdated(OffsetDateTime::now_utc(), Duration::days(1)),
            )
            .unwrap();
        let bundle = TrustBundle::new(vec![ca.cert_der().to_vec()]);
        let now = OffsetDateTime::now_utc();
        assert_eq!(
            verify_ca_chain(std::slice::from_ref(&int.der), &bundle, now).unwrap(),
            ca.cert_der()
        );
        assert!(verify_ca_chain(&[int.der.clone(), ca.cert_der().to_vec()], &bundle, now).is_ok());
        let foreign = TrustBundle::new(vec![root().cert_der().to_vec()]);
        assert!(verify_ca_chain(std::slice::from_ref(&int.der), &foreign, now).is_err());
        let later = now + Duration::days(3);
        let err = verify_ca_chain(&[int.der], &bundle, later).unwrap_err();
        assert!(err.to_string().contains("expired"), "{err}");
        let l = leaf(&ca, Validity::backdated(now, Duration::hours(1)));
        assert!(verify_ca_chain(&[l], &bundle, now)
            .unwrap_err()
            .to_string()
            .contains("not a CA"));
    }

    #[test]
    fn webpki_and_parser_errors_are_plain_words_not_debug() {
        let pathlen = describe_webpki_error(&webpki::Error::PathLenConstraintViolated);
        assert!(pathlen.starts_with("a CA in the chain has a basicConstraints pathLenConstraint"));
        assert!(
            pathlen.ends_with("(PathLenConstraintViolated)"),
            "{pathlen}"
        );
        // A chain under an ECDSA root checked against an RSA root of the
        // same name used to print the error's Debug, OID bytes and all.
        let other = describe_webpki_error(&webpki::Error::UnsupportedCrlVersion);
        assert_eq!(other, "path validation failed (UnsupportedCrlVersion)");
        let not_cert = crate::bundle::parse_certs_pem(&crate::bundle::encode_cert_pem(&[
            0xa0, 0x03, 0x02, 0x01, 0x02,
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            not_cert.contains("not a DER-encoded X.509 certificate") && !not_cert.contains("Tag("),
            "{not_cert}"
        );
    }

    #[test]
    fn a_ca_below_a_path_len_zero_ca_is_refused() {
        let ca = root();
        let now = OffsetDateTime::now_utc();
        let name = |cn: &str| SubjectName {
            common_name: Some(cn.into()),
            ..Default::default()
        };
        let int_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let int = ca
            .issue_ca(
                &SubjectKey::of(&int_key).unwrap(),
                &name("Int"),
                Some(0),
                Validity::backdated(now, Duration::days(1)),
            )
            .unwrap();
        let int_ca = SigningCa::new(int.der.clone(), int_key).unwrap();
        let sub_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let sub = int_ca
            .issue_ca(
                &SubjectKey::of(&sub_key).unwrap(),
                &name("Sub"),
                Some(0),
                Validity::backdated(now, Duration::days(1)),
            )
            .unwrap();
        let bundle = TrustBundle::new(vec![ca.cert_der().to_vec()]);
        // The chain used to pass; every leaf of Sub then failed path
        // validation (PathLenConstraintViolated).
        let err = verify_ca_chain(&[sub.der.clone(), int.der.clone()], &bundle, now).unwrap_err();
        assert!(
            matches!(err, VerifyError::BadCa { index: 2, .. }),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("CN=Int") && text.contains("pathLenConstraint is 0"),
            "{text}"
        );
        // With the root in the chain, too.
        assert!(verify_ca_chain(
            &[sub.der.clone(), int.der.clone(), ca.cert_der().to_vec()],
            &bundle,
            now
        )
        .is_err());
        // Room for a sub-CA: none under Int, some under the root.
        assert!(check_room_for_sub_ca(&[int.der.clone(), ca.cert_der().to_vec()]).is_err());
        assert!(check_room_for_sub_ca(&[ca.cert_der().to_vec()]).is_ok());
        // Int itself still signs leaves.
        assert!(verify_ca_chain(&[int.der], &bundle, now).is_ok());
    }
}
