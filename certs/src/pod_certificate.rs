//! Kubernetes pod certificates (`certificates.k8s.io/v1beta1`
//! `PodCertificateRequest`, `ClusterTrustBundle`): the rules kube-apiserver
//! applies to them, written once so that the CA's signer and the tests'
//! fake API server apply the same key rules. (The fake checks names with
//! its own copy of the API's rules, so a difference between
//! [`validate_signer_name`] and the API shows in its tests.)
//!
//! - [`validate_signer_name`]: a signer name (`example.com/path`);
//! - [`trust_bundle_name_prefix`]: the name prefix a `ClusterTrustBundle`
//!   of a signer must carry;
//! - [`read_pod_key`]: the key a kubelet asks a certificate for, from
//!   either encoding (the 1.36 `stubPKCS10Request`, or the 1.35
//!   `pkixPublicKey` + `proofOfPossession`), with the proof of possession
//!   checked as kube-apiserver checks it;
//! - `signs_key`: the key types meshca issues pod certificates for (and,
//!   as for every key the CA certifies, an RSA public exponent odd and at
//!   least 65537: `crate::keys::check_key_policy`).
//!
//! The API accepts RSA 3072 and 4096, ECDSA P-256, P-384 and P-521, and
//! Ed25519. meshca signs every one of them except ECDSA P-521, whose proof
//! of possession it cannot check (`ring` has no P-521); such a request is
//! denied with reason `UnsupportedKeyType`, as the API asks of signers.

use ring::signature;
use x509_parser::prelude::FromDer;
use x509_parser::x509::SubjectPublicKeyInfo;

use crate::csr::{CsrError, VerifiedCsr};
use crate::keys::{check_key_policy, KeyKind, KeyPolicyError};
use crate::profile::SubjectKey;

/// The key types meshca issues pod certificates for, as a person reads them
/// (the message of an `UnsupportedKeyType` denial).
pub const SUPPORTED_KEY_TYPES: &str = "ECDSA P-256, ECDSA P-384, RSA 3072, RSA 4096 or Ed25519";

/// Largest `pkixPublicKey` the API accepts, in bytes.
pub(crate) const MAX_PKIX_PUBLIC_KEY_SIZE: usize = 10 * 1024;
/// Largest `proofOfPossession` the API accepts, in bytes.
pub(crate) const MAX_PROOF_OF_POSSESSION_SIZE: usize = 10 * 1024;
/// Largest `certificateChain` the API accepts, in bytes.
pub const MAX_CERTIFICATE_CHAIN_SIZE: usize = 100 * 1024;
/// Largest `trustBundle` of a `ClusterTrustBundle`, in bytes.
pub const MAX_TRUST_BUNDLE_SIZE: usize = 1024 * 1024;
/// Shortest `maxExpirationSeconds` (and certificate lifetime) the API accepts.
pub const MIN_MAX_EXPIRATION_SECONDS: i64 = 3600;
/// Longest `maxExpirationSeconds` the API accepts for signers outside
/// `kubernetes.io` (91 days).
pub const MAX_MAX_EXPIRATION_SECONDS: i64 = 91 * 24 * 3600;
/// `maxExpirationSeconds` when the request leaves it out (24 hours).
pub const DEFAULT_MAX_EXPIRATION_SECONDS: i64 = 86400;

/// Why a pod's key was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodKeyError {
    /// The request is malformed: kube-apiserver refuses it at creation.
    #[error("{field}: {reason}")]
    Malformed {
        /// The spec field at fault (`spec.pkixPublicKey`, ...).
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The key is of a type meshca does not sign (`api_allows` tells
    /// whether kube-apiserver accepts it at all), or of a type it signs but
    /// breaking another key rule (`violates`: an RSA public exponent below
    /// 65537 or even, which kube-apiserver accepts).
    #[error("{kind} keys are not signed by this signer: {}", what_to_use(.violates.as_ref()))]
    UnsupportedKeyType {
        /// What the key is.
        kind: PodKeyKind,
        /// Whether kube-apiserver accepts this key.
        api_allows: bool,
        /// The key rule beyond type and size the key breaks, when that is
        /// why it is refused.
        violates: Option<KeyPolicyError>,
    },
    /// The signature (CSR self-signature or proof of possession) does not
    /// verify with the key.
    #[error("{field}: could not verify proof-of-possession signature")]
    BadProof {
        /// The spec field whose signature failed.
        field: &'static str,
    },
}

/// What a refusal of a pod's key tells the pod to do: the rule it breaks,
/// or the key types that are signed.
pub fn what_to_use(violates: Option<&KeyPolicyError>) -> String {
    match violates {
        Some(rule) => rule.to_string(),
        None => format!("use {SUPPORTED_KEY_TYPES}"),
    }
}

/// A pod's key type, as the API sees it (P-521 told apart from other
/// curves, which [`KeyKind`] does not do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodKeyKind {
    /// Any key type [`KeyKind`] names.
    Known(KeyKind),
    /// ECDSA on P-521.
    EcdsaP521,
}

impl std::fmt::Display for PodKeyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Known(kind) => kind.fmt(f),
            Self::EcdsaP521 => f.write_str("ECDSA P-521"),
        }
    }
}

impl PodKeyKind {
    fn of(spki: &SubjectPublicKeyInfo<'_>) -> Self {
        const OID_P521: &str = "1.3.132.0.35";
        let kind = KeyKind::from_spki(spki);
        let curve = spki
            .algorithm
            .parameters
            .as_ref()
            .and_then(|p| p.as_oid().ok())
            .map(|oid| oid.to_id_string());
        if kind == KeyKind::EcdsaOther && curve.as_deref() == Some(OID_P521) {
            return Self::EcdsaP521;
        }
        Self::Known(kind)
    }

    /// Whether kube-apiserver accepts this key type in a request.
    pub fn api_allows(self) -> bool {
        match self {
            Self::EcdsaP521 => true,
            Self::Known(KeyKind::EcdsaP256 | KeyKind::EcdsaP384 | KeyKind::Ed25519) => true,
            Self::Known(KeyKind::Rsa(bits)) => bits == 3072 || bits == 4096,
            Self::Known(_) => false,
        }
    }
}

/// Whether meshca issues pod certificates for keys of this type.
pub(crate) fn signs_key(kind: KeyKind) -> bool {
    match kind {
        KeyKind::EcdsaP256 | KeyKind::EcdsaP384 | KeyKind::Ed25519 => true,
        KeyKind::Rsa(bits) => bits == 3072 || bits == 4096,
        KeyKind::EcdsaOther | KeyKind::Other => false,
    }
}

/// Reads the key of a `PodCertificateRequest` from whichever encoding it
/// carries and checks its proof of possession:
///
/// - `stub_pkcs10_request` (Kubernetes 1.36+): a DER PKCS#10 request signed
///   by the key; its self-signature must verify. Nothing else in it is used.
/// - otherwise `pkix_public_key` (DER SubjectPublicKeyInfo) and
///   `proof_of_possession` (1.35): a signature over the ASCII pod UID —
///   Ed25519 over the raw bytes, ECDSA (ASN.1) over their SHA-256, RSA-PSS
///   with SHA-256 and any salt length (Go's `rsa.VerifyPSS` with nil
///   options).
///
/// Both present, or neither, is malformed. The key type must be one
/// `signs_key` accepts.
pub fn read_pod_key(
    stub_pkcs10_request: &[u8],
    pkix_public_key: &[u8],
    proof_of_possession: &[u8],
    pod_uid: &str,
) -> Result<SubjectKey, PodKeyError> {
    if !stub_pkcs10_request.is_empty() {
        if !pkix_public_key.is_empty() || !proof_of_possession.is_empty() {
            return Err(PodKeyError::Malformed {
                field: "spec.pkixPublicKey",
                reason: "must be empty when spec.stubPKCS10Request is set".into(),
            });
        }
        return key_from_stub_csr(stub_pkcs10_request);
    }
    key_from_proof(pkix_public_key, proof_of_possession, pod_uid)
}

fn key_from_stub_csr(der: &[u8]) -> Result<SubjectKey, PodKeyError> {
    const FIELD: &str = "spec.stubPKCS10Request";
    let parsed = x509_parser::certification_request::X509CertificationRequest::from_der(der)
        .map_err(|e| PodKeyError::Malformed {
            field: FIELD,
            reason: format!("not a DER PKCS#10 request: {e}"),
        })?;
    let kind = PodKeyKind::of(&parsed.1.certification_request_info.subject_pki);
    let verified = VerifiedCsr::from_der(der).map_err(|e| match e {
        CsrError::BadSignature => PodKeyError::BadProof { field: FIELD },
        CsrError::UnsupportedKey(_) => PodKeyError::UnsupportedKeyType {
            kind,
            api_allows: kind.api_allows(),
            violates: None,
        },
        CsrError::WeakKey(rule) => PodKeyError::UnsupportedKeyType {
            kind,
            api_allows: kind.api_allows(),
            violates: Some(rule),
        },
        other => PodKeyError::Malformed {
            field: FIELD,
            reason: other.to_string(),
        },
    })?;
    let key = verified.subject_key().clone();
    if !signs_key(key.kind()) {
        return Err(PodKeyError::UnsupportedKeyType {
            kind,
            api_allows: kind.api_allows(),
            violates: None,
        });
    }
    Ok(key)
}

fn key_from_proof(spki_der: &[u8], proof: &[u8], pod_uid: &str) -> Result<SubjectKey, PodKeyError> {
    const KEY_FIELD: &str = "spec.pkixPublicKey";
    const PROOF_FIELD: &str = "spec.proofOfPossession";
    if spki_der.len() > MAX_PKIX_PUBLIC_KEY_SIZE {
        return Err(PodKeyError::Malformed {
            field: KEY_FIELD,
            reason: format!("longer than {MAX_PKIX_PUBLIC_KEY_SIZE} bytes"),
        });
    }
    if proof.len() > MAX_PROOF_OF_POSSESSION_SIZE {
        return Err(PodKeyError::Malformed {
            field: PROOF_FIELD,
            reason: format!("longer than {MAX_PROOF_OF_POSSESSION_SIZE} bytes"),
        });
    }
    let malformed = || PodKeyError::Malformed {
        field: KEY_FIELD,
        reason: "must be a valid PKIX-serialized public key".into(),
    };
    let (rest, spki) = SubjectPublicKeyInfo::from_der(spki_der).map_err(|_| malformed())?;
    if !rest.is_empty() {
        return Err(malformed());
    }
    let kind = PodKeyKind::of(&spki);
    if !kind.api_allows() {
        return Err(PodKeyError::UnsupportedKeyType {
            kind,
            api_allows: false,
            violates: None,
        });
    }
    let PodKeyKind::Known(known) = kind else {
        return Err(PodKeyError::UnsupportedKeyType {
            kind,
            api_allows: true,
            violates: None,
        });
    };
    let key_bits = &spki.subject_public_key.data;
    let message = pod_uid.as_bytes();
    let verified = match known {
        KeyKind::Ed25519 => signature::UnparsedPublicKey::new(&signature::ED25519, key_bits)
            .verify(message, proof)
            .is_ok(),
        KeyKind::EcdsaP256 => {
            signature::UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_ASN1, key_bits)
                .verify(message, proof)
                .is_ok()
        }
        KeyKind::EcdsaP384 => {
            signature::UnparsedPublicKey::new(&signature::ECDSA_P384_SHA256_ASN1, key_bits)
                .verify(message, proof)
                .is_ok()
        }
        KeyKind::Rsa(_) => verify_rsa_pss_any_salt(spki_der, message, proof),
        KeyKind::EcdsaOther | KeyKind::Other => false,
    };
    if !verified {
        return Err(PodKeyError::BadProof { field: PROOF_FIELD });
    }
    // After the proof, as kube-apiserver sees it: it verifies a proof made
    // with an e = 3 key (and stores the request), and refuses an even
    // exponent's, which cannot sign.
    if let Err(rule) = check_key_policy(&spki) {
        return Err(PodKeyError::UnsupportedKeyType {
            kind,
            api_allows: true,
            violates: Some(rule),
        });
    }
    SubjectKey::from_spki_der(spki_der).map_err(|_| malformed())
}

/// RSA-PSS with SHA-256 and the salt length read from the signature, as
/// Go's `rsa.VerifyPSS` with nil options does. The lengths signers use in
/// practice (Go's default, the largest that fits; the digest's length) are
/// tried first.
fn verify_rsa_pss_any_salt(spki_der: &[u8], message: &[u8], proof: &[u8]) -> bool {
    use rsa::pkcs8::DecodePublicKey;
    use rsa::sha2::{Digest, Sha256};
    use rsa::traits::PublicKeyParts;
    let Ok(key) = rsa::RsaPublicKey::from_public_key_der(spki_der) else {
        return false;
    };
    let hashed = Sha256::digest(message);
    let em_len = (key.n().bits() - 1).div_ceil(8);
    let Some(largest) = em_len.checked_sub(2 + hashed.len()) else {
        return false;
    };
    let first = [largest, hashed.len()];
    let rest = (0..largest).filter(|s| *s != hashed.len());
    first.into_iter().chain(rest).any(|salt| {
        key.verify(rsa::Pss::new_with_salt::<Sha256>(salt), &hashed, proof)
            .is_ok()
    })
}

/// Longest signer name the API accepts: a DNS-1123 subdomain (253), `/`,
/// and a path as long as a label, `.` and a subdomain (63 + 1 + 253).
pub(crate) const MAX_SIGNER_NAME_LENGTH: usize = 253 + 1 + 63 + 1 + 253;

/// Checks a signer name as kube-apiserver does (`ValidateSignerName`):
/// `DOMAIN/PATH`; the domain at most 253 characters of DNS-1123 labels,
/// with at least one dot; the path pieces between dots DNS-1123
/// subdomains (so up to 253 characters each, room for a resource name);
/// the whole name at most `MAX_SIGNER_NAME_LENGTH` (571 characters).
pub fn validate_signer_name(name: &str) -> Result<(), String> {
    let Some((domain, path)) = name.split_once('/') else {
        return Err(format!(
            "signer name {name:?} must be a fully qualified domain and path of the form 'example.com/signer-name'"
        ));
    };
    if path.contains('/') {
        return Err(format!(
            "signer name {name:?} must be a fully qualified domain and path of the form 'example.com/signer-name'"
        ));
    }
    if domain.len() > 253 {
        return Err(format!(
            "the domain of signer name {name:?} is longer than 253 characters"
        ));
    }
    let labels: Vec<&str> = domain.split('.').collect();
    if let Some(label) = labels.iter().find(|l| !is_dns1123_label(l)) {
        return Err(format!(
            "signer name {name:?}: {label:?} is not a DNS-1123 label (lower case letters, digits and '-', starting and ending with a letter or digit, at most 63)"
        ));
    }
    if labels.len() < 2 {
        return Err(format!(
            "the domain of signer name {name:?} must have at least two segments separated by dots"
        ));
    }
    if let Some(piece) = path.split('.').find(|p| !is_dns1123_subdomain(p)) {
        return Err(format!(
            "signer name {name:?}: path piece {piece:?} is not a DNS-1123 subdomain (lower case letters, digits and '-', starting and ending with a letter or digit, at most 253)"
        ));
    }
    if name.len() > MAX_SIGNER_NAME_LENGTH {
        return Err(format!(
            "signer name {name:?} is longer than {MAX_SIGNER_NAME_LENGTH} characters"
        ));
    }
    Ok(())
}

/// Whether a signer name is reserved for the Kubernetes project
/// (`kubernetes.io/...` or a domain under `.kubernetes.io`).
pub fn is_kubernetes_signer(name: &str) -> bool {
    let domain = name.split('/').next().unwrap_or_default();
    domain == "kubernetes.io" || domain.ends_with(".kubernetes.io")
}

/// The prefix every `ClusterTrustBundle` of `signer_name` is named with:
/// the signer name with `/` turned into `:`, then `:`.
pub fn trust_bundle_name_prefix(signer_name: &str) -> String {
    format!("{}:", signer_name.replace('/', ":"))
}

/// Lower case letters, digits and '-', starting and ending with a letter
/// or digit (no length limit of its own).
fn is_dns1123_piece(piece: &str) -> bool {
    let bytes = piece.as_bytes();
    !bytes.is_empty()
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
}

fn is_dns1123_label(label: &str) -> bool {
    label.len() <= 63 && is_dns1123_piece(label)
}

/// Whether `name` is a DNS-1123 subdomain (the rule for object names):
/// at most 253 characters, pieces separated by dots. As in the API's
/// `IsDNS1123Subdomain`, a piece has no length limit of its own.
pub(crate) fn is_dns1123_subdomain(name: &str) -> bool {
    name.len() <= 253 && name.split('.').all(is_dns1123_piece)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{KeyAlgorithm, PrivateKey};

    fn stub_csr(key: &PrivateKey) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .serialize_request(key.key_pair())
            .unwrap()
            .der()
            .to_vec()
    }

    #[test]
    fn stub_csr_keys_of_every_signed_type_are_read() {
        for alg in [KeyAlgorithm::EcdsaP256, KeyAlgorithm::EcdsaP384] {
            let key = PrivateKey::generate(alg).unwrap();
            let read = read_pod_key(&stub_csr(&key), &[], &[], "uid").unwrap();
            assert_eq!(read.spki_der(), key.public_key_spki_der().as_slice());
        }
        let ed = PrivateKey::from_pkcs8_der(
            &rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)
                .unwrap()
                .serialize_der(),
        )
        .unwrap();
        let read = read_pod_key(&stub_csr(&ed), &[], &[], "uid").unwrap();
        assert_eq!(read.kind(), KeyKind::Ed25519);
    }

    #[test]
    fn rsa_2048_is_not_a_pod_key() {
        let key = PrivateKey::generate(KeyAlgorithm::Rsa2048).unwrap();
        let err = read_pod_key(&stub_csr(&key), &[], &[], "uid").unwrap_err();
        assert_eq!(
            err,
            PodKeyError::UnsupportedKeyType {
                kind: PodKeyKind::Known(KeyKind::Rsa(2048)),
                api_allows: false,
                violates: None,
            }
        );
    }

    #[test]
    fn a_tampered_stub_csr_is_a_bad_proof() {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let mut der = stub_csr(&key);
        let last = der.len() - 1;
        der[last] ^= 1;
        let err = read_pod_key(&der, &[], &[], "uid").unwrap_err();
        assert!(
            matches!(
                err,
                PodKeyError::BadProof { .. } | PodKeyError::Malformed { .. }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn proof_of_possession_over_the_pod_uid() {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let spki = key.public_key_spki_der();
        let proof = rcgen::SigningKey::sign(key.key_pair(), b"pod-uid-1").unwrap();
        assert!(read_pod_key(&[], &spki, &proof, "pod-uid-1").is_ok());
        // Signed over another pod's UID: refused.
        assert_eq!(
            read_pod_key(&[], &spki, &proof, "pod-uid-2").unwrap_err(),
            PodKeyError::BadProof {
                field: "spec.proofOfPossession"
            }
        );
        // Both encodings at once: malformed.
        assert!(matches!(
            read_pod_key(&stub_csr(&key), &spki, &proof, "pod-uid-1"),
            Err(PodKeyError::Malformed { .. })
        ));
        // Neither: malformed.
        assert!(matches!(
            read_pod_key(&[], &[], &[], "pod-uid-1"),
            Err(PodKeyError::Malformed { .. })
        ));
    }

    /// ECDSA P-384 over SHA-256 of the UID (what Go's `ecdsa.SignASN1`
    /// over `sha256.Sum256(uid)` makes), DER.
    fn p384_proof(key: &PrivateKey, uid: &str) -> Vec<u8> {
        use p384::ecdsa::signature::hazmat::PrehashSigner;
        use p384::pkcs8::DecodePrivateKey;
        use rsa::sha2::{Digest, Sha256};
        let signing = p384::ecdsa::SigningKey::from_pkcs8_der(&key.to_pkcs8_der()).unwrap();
        let signature: p384::ecdsa::Signature = signing
            .sign_prehash(&Sha256::digest(uid.as_bytes()))
            .unwrap();
        signature.to_der().as_bytes().to_vec()
    }

    #[test]
    fn p384_proof_of_possession_is_ecdsa_over_sha256_of_the_uid() {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP384).unwrap();
        let spki = key.public_key_spki_der();
        let proof = p384_proof(&key, "pod-uid-1");
        let read = read_pod_key(&[], &spki, &proof, "pod-uid-1").unwrap();
        assert_eq!(read.kind(), KeyKind::EcdsaP384);
        assert_eq!(read.spki_der(), spki.as_slice());
        assert_eq!(
            read_pod_key(&[], &spki, &proof, "pod-uid-2").unwrap_err(),
            PodKeyError::BadProof {
                field: "spec.proofOfPossession"
            }
        );
        // SHA-384 (the curve's usual hash) is not what the API checks.
        let sha384 = rcgen::SigningKey::sign(key.key_pair(), b"pod-uid-1").unwrap();
        assert_eq!(
            read_pod_key(&[], &spki, &sha384, "pod-uid-1").unwrap_err(),
            PodKeyError::BadProof {
                field: "spec.proofOfPossession"
            }
        );
    }

    #[test]
    fn rsa_pss_proofs_with_any_salt_length_verify() {
        use rsa::pkcs8::DecodePrivateKey;
        use rsa::sha2::{Digest, Sha256};
        let key = PrivateKey::generate(KeyAlgorithm::Rsa3072).unwrap();
        let private = rsa::RsaPrivateKey::from_pkcs8_der(&key.to_pkcs8_der()).unwrap();
        let spki = key.public_key_spki_der();
        let hashed = Sha256::digest(b"uid-7");
        // Go's default (largest salt), the digest length, and another.
        for salt in [384 - 2 - 32, 32, 7] {
            let proof = private
                .sign_with_rng(
                    &mut rand_core::OsRng,
                    rsa::Pss::new_with_salt::<Sha256>(salt),
                    &hashed,
                )
                .unwrap();
            assert!(read_pod_key(&[], &spki, &proof, "uid-7").is_ok(), "{salt}");
            assert!(read_pod_key(&[], &spki, &proof, "uid-8").is_err(), "{salt}");
        }
    }

    /// RSA-PSS SHA-256 over `uid` with Go's default salt length.
    fn rsa_pss_proof(key: &rsa::RsaPrivateKey, uid: &str) -> Vec<u8> {
        use rsa::sha2::{Digest, Sha256};
        use rsa::traits::PublicKeyParts;
        let salt = (key.n().bits() - 1).div_ceil(8) - 2 - 32;
        key.sign_with_rng(
            &mut rand_core::OsRng,
            rsa::Pss::new_with_salt::<Sha256>(salt),
            &Sha256::digest(uid.as_bytes()),
        )
        .unwrap()
    }

    #[test]
    fn rsa_keys_with_a_small_exponent_are_refused_naming_the_rule() {
        use crate::keys::test_rsa::RsaTestKey;
        let rule = "RSA public exponent must be odd and at least 65537 (this key's is 3)";
        let e3 = RsaTestKey::generate(3072, 3);
        let spki = e3.spki_der();
        let proof = rsa_pss_proof(&e3.key, "uid-1");
        for (encoding, got) in [
            (
                "stub CSR",
                read_pod_key(&e3.csr_der(None), &[], &[], "uid-1"),
            ),
            ("proof", read_pod_key(&[], &spki, &proof, "uid-1")),
        ] {
            let err = got.unwrap_err();
            assert_eq!(
                err,
                PodKeyError::UnsupportedKeyType {
                    kind: PodKeyKind::Known(KeyKind::Rsa(3072)),
                    api_allows: true,
                    violates: Some(KeyPolicyError::WeakRsaExponent {
                        exponent: "3".into()
                    }),
                },
                "{encoding}"
            );
            assert_eq!(
                err.to_string(),
                format!("RSA 3072 keys are not signed by this signer: {rule}"),
                "{encoding}"
            );
        }
        // A proof over another UID is still a bad proof first.
        assert_eq!(
            read_pod_key(&[], &spki, &proof, "uid-2").unwrap_err(),
            PodKeyError::BadProof {
                field: "spec.proofOfPossession"
            }
        );
        // The same size with e = 65537, both encodings: read.
        let f4 = RsaTestKey::generate(3072, 65537);
        let read = read_pod_key(&f4.csr_der(None), &[], &[], "uid-1").unwrap();
        assert_eq!(read.spki_der(), f4.spki_der().as_slice());
        let proof = rsa_pss_proof(&f4.key, "uid-1");
        let read = read_pod_key(&[], &f4.spki_der(), &proof, "uid-1").unwrap();
        assert_eq!(read.kind(), KeyKind::Rsa(3072));
    }

    #[test]
    fn signer_names_follow_the_api_rules() {
        assert!(validate_signer_name("meshca.io/spiffe").is_ok());
        assert!(validate_signer_name("example.com/a.b").is_ok());
        // Path pieces are subdomains, as in the API: longer than a label
        // (63), up to 253.
        let long_piece = "a".repeat(200);
        assert!(validate_signer_name(&format!("example.com/ns.{long_piece}")).is_ok());
        assert!(validate_signer_name(&format!("example.com/{}", "a".repeat(253))).is_ok());
        assert!(validate_signer_name(&format!("example.com/{}", "a".repeat(254))).is_err());
        // The length limit is on the whole name.
        let domain = format!(
            "{}.{}.{}.example.com",
            "d".repeat(63),
            "e".repeat(63),
            "f".repeat(63)
        );
        let at_limit = format!(
            "{domain}/{}.{}",
            "p".repeat(253),
            "q".repeat(MAX_SIGNER_NAME_LENGTH - domain.len() - 1 - 253 - 1)
        );
        assert_eq!(at_limit.len(), MAX_SIGNER_NAME_LENGTH);
        assert!(validate_signer_name(&at_limit).is_ok());
        assert!(validate_signer_name(&format!("{at_limit}q")).is_err());
        for bad in [
            "spiffe",
            "meshca/spiffe",
            "meshca.io/",
            "meshca.io/a/b",
            "Meshca.io/spiffe",
            "meshca.io/-x",
            "meshca.io/a..b",
            "meshca.io/A",
        ] {
            assert!(validate_signer_name(bad).is_err(), "{bad}");
        }
        assert!(is_kubernetes_signer(
            "kubernetes.io/kube-apiserver-client-pod"
        ));
        assert!(is_kubernetes_signer("x.kubernetes.io/a"));
        assert!(!is_kubernetes_signer("meshca.io/spiffe"));
        assert_eq!(
            trust_bundle_name_prefix("meshca.io/spiffe"),
            "meshca.io:spiffe:"
        );
    }
}
