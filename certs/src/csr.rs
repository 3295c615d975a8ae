//! Certificate signing requests: building them (agents) and verifying them
//! (the CA).
//!
//! Verification is strict and self-contained: the PEM must hold exactly one
//! `CERTIFICATE REQUEST`, the DER must parse with no trailing bytes, the key
//! must pass the workload key policy (ECDSA P-256/P-384, RSA 2048–8192
//! with a public exponent odd and at least 65537, Ed25519), and the self-signature must verify with that key (proof of
//! possession; SHA-1 signatures are refused). What the CA takes from a
//! [`VerifiedCsr`] is the public key and the requested URI SANs, nothing else.

use rcgen::{CertificateParams, DistinguishedName, SanType};
use ring::signature;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateSigningRequestDer;
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::oid_registry::{
    Oid, OID_PKCS1_RSASSAPSS, OID_PKCS1_SHA256WITHRSA, OID_PKCS1_SHA384WITHRSA,
    OID_PKCS1_SHA512WITHRSA, OID_SIG_ECDSA_WITH_SHA256, OID_SIG_ECDSA_WITH_SHA384, OID_SIG_ED25519,
};
use x509_parser::prelude::FromDer;

use crate::keys::{check_key_policy, KeyKind, KeyPolicyError, PrivateKey};
use crate::profile::SubjectKey;
use crate::spiffe::SpiffeId;

/// Largest PEM CSR accepted, in bytes. An RSA-8192 CSR with a few SANs is
/// about 3 KiB; anything near this limit is not a real workload CSR.
pub(crate) const MAX_CSR_PEM_LEN: usize = 32 * 1024;

const PEM_TAG: &str = "CERTIFICATE REQUEST";
const PEM_TAG_NEW: &str = "NEW CERTIFICATE REQUEST";

/// Why a CSR was refused. Every variant is the caller's fault
/// (gRPC `INVALID_ARGUMENT`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CsrError {
    /// The CSR is larger than `MAX_CSR_PEM_LEN` (32 KiB).
    #[error("CSR is {0} bytes, larger than the {MAX_CSR_PEM_LEN} allowed")]
    TooLarge(usize),
    /// The input is not PEM, or holds no `CERTIFICATE REQUEST` block.
    #[error("CSR is not PEM: expected one \"-----BEGIN CERTIFICATE REQUEST-----\" block")]
    NotPem,
    /// More than one PEM block was sent.
    #[error("CSR PEM holds {0} blocks; send exactly one CERTIFICATE REQUEST")]
    MultipleBlocks(usize),
    /// The DER inside the PEM is not a PKCS#10 request.
    #[error("CSR is not a valid PKCS#10 request: {0}")]
    Malformed(String),
    /// The CSR's key is of a type or size meshca does not issue for.
    #[error("CSR key {0} is not accepted: use ECDSA P-256 or P-384, or RSA 2048 to 8192 bits")]
    UnsupportedKey(KeyKind),
    /// The CSR's key is of an accepted type and size but breaks another key
    /// rule (an RSA public exponent below 65537 or even).
    #[error("CSR key is not accepted: {0}")]
    WeakKey(#[from] KeyPolicyError),
    /// The CSR is signed with an algorithm meshca does not accept.
    #[error("CSR signature algorithm {0} is not accepted: use ECDSA with SHA-256/384, RSA PKCS#1 or PSS with SHA-256/384/512, or Ed25519")]
    UnsupportedSignatureAlgorithm(String),
    /// The signature does not verify with the CSR's own key.
    #[error("CSR signature does not verify with the CSR's public key (no proof of possession)")]
    BadSignature,
    /// A URI SAN in the CSR is not a valid SPIFFE ID.
    #[error("CSR URI SAN {uri:?} is not a valid SPIFFE ID: {reason}")]
    BadUriSan {
        /// The URI as sent.
        uri: String,
        /// Why it is not a SPIFFE ID.
        reason: String,
    },
}

/// The DER of `pem_text` when it is exactly one `CERTIFICATE REQUEST`
/// block with nothing but whitespace around it and canonical base64 inside
/// (what every agent sends); `None` for anything else, which the callers'
/// slower readers then decide. The body is decoded with the `base64`
/// crate's engine rather than rustls' PEM reader: a CSR is public, so the
/// constant-time decoder rustls uses for private keys buys nothing here and
/// costs instructions on every certificate (docs/benchmarks-history.md, "Fewer
/// instructions around the crypto, message-sized buffers").
fn single_block_der(pem_text: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    let text = pem_text.trim_ascii();
    let (label, rest) = text.strip_prefix("-----BEGIN ")?.split_once("-----")?;
    if label != PEM_TAG && label != PEM_TAG_NEW {
        return None;
    }
    let (body, end_label) = rest.strip_suffix("-----")?.rsplit_once("-----END ")?;
    if end_label != label {
        return None;
    }
    let mut base64_text = Vec::with_capacity(body.len());
    base64_text.extend(body.bytes().filter(|b| !b.is_ascii_whitespace()));
    // A second block, a header or any other character fails here.
    base64::engine::general_purpose::STANDARD
        .decode(&base64_text)
        .ok()
}

/// A CSR whose self-signature and key have been checked.
#[derive(Debug, Clone)]
pub struct VerifiedCsr {
    subject_key: SubjectKey,
    uri_sans: Vec<SpiffeId>,
}

impl VerifiedCsr {
    /// Parses and verifies a PEM CSR.
    pub fn from_pem(pem_text: &str) -> Result<Self, CsrError> {
        if pem_text.len() > MAX_CSR_PEM_LEN {
            return Err(CsrError::TooLarge(pem_text.len()));
        }
        // The common case, one well-formed `CERTIFICATE REQUEST` block and
        // nothing else, takes the cheapest road (see `single_block_der`);
        // then one block with text around it, with rustls' PEM reader
        // (about a tenth of the `pem` crate's cost). Anything else takes the
        // lenient path below, which also words the errors, so what is
        // accepted and how refusals read do not depend on the road taken.
        if let Some(der) = single_block_der(pem_text) {
            return Self::from_der(&der);
        }
        if pem_text.matches("-----BEGIN ").take(2).count() == 1 {
            if let Ok(der) = CertificateSigningRequestDer::from_pem_slice(pem_text.as_bytes()) {
                return Self::from_der(der.as_ref());
            }
        }
        let blocks = pem::parse_many(pem_text).map_err(|_| CsrError::NotPem)?;
        match blocks.as_slice() {
            [] => Err(CsrError::NotPem),
            [one] if one.tag() == PEM_TAG || one.tag() == PEM_TAG_NEW => {
                Self::from_der(one.contents())
            }
            [_] => Err(CsrError::NotPem),
            many => Err(CsrError::MultipleBlocks(many.len())),
        }
    }

    /// Parses and verifies a DER CSR.
    pub fn from_der(der: &[u8]) -> Result<Self, CsrError> {
        let (rest, csr) = X509CertificationRequest::from_der(der)
            .map_err(|e| CsrError::Malformed(e.to_string()))?;
        if !rest.is_empty() {
            return Err(CsrError::Malformed(format!(
                "{} trailing bytes after the request",
                rest.len()
            )));
        }
        let info = &csr.certification_request_info;
        let spki = &info.subject_pki;
        let key_kind = KeyKind::from_spki(spki);
        if !key_kind.is_acceptable_for_workload() {
            return Err(CsrError::UnsupportedKey(key_kind));
        }
        // Before the signature: cheap, and an even exponent (which cannot
        // sign) is then refused by the rule rather than as a bad signature.
        check_key_policy(spki)?;
        let alg = verification_algorithm(&csr, key_kind)?;
        let key = signature::UnparsedPublicKey::new(alg, &spki.subject_public_key.data);
        key.verify(info.raw, &csr.signature_value.data)
            .map_err(|_| CsrError::BadSignature)?;

        let mut uri_sans = Vec::new();
        if let Some(extensions) = csr.requested_extensions() {
            for ext in extensions {
                if let ParsedExtension::SubjectAlternativeName(san) = ext {
                    for name in &san.general_names {
                        if let GeneralName::URI(uri) = name {
                            let id = SpiffeId::parse(uri).map_err(|e| CsrError::BadUriSan {
                                uri: crate::untrusted_text::shortened(uri, 256),
                                reason: e.to_string(),
                            })?;
                            uri_sans.push(id);
                        }
                    }
                }
            }
        }
        Ok(Self {
            subject_key: SubjectKey::from_parsed(spki),
            uri_sans,
        })
    }

    /// The public key to certify.
    pub fn subject_key(&self) -> &SubjectKey {
        &self.subject_key
    }

    /// What kind of key the CSR carries.
    #[cfg(test)]
    pub(crate) fn key_kind(&self) -> KeyKind {
        self.subject_key.kind()
    }

    /// The SPIFFE IDs the CSR asks for in URI SANs (possibly none).
    pub fn uri_sans(&self) -> &[SpiffeId] {
        &self.uri_sans
    }
}

fn verification_algorithm(
    csr: &X509CertificationRequest<'_>,
    key: KeyKind,
) -> Result<&'static dyn signature::VerificationAlgorithm, CsrError> {
    let oid = &csr.signature_algorithm.algorithm;
    let unsupported = || CsrError::UnsupportedSignatureAlgorithm(describe_oid(oid));
    let alg: &'static dyn signature::VerificationAlgorithm = match key {
        KeyKind::EcdsaP256 if *oid == OID_SIG_ECDSA_WITH_SHA256 => {
            &signature::ECDSA_P256_SHA256_ASN1
        }
        KeyKind::EcdsaP256 if *oid == OID_SIG_ECDSA_WITH_SHA384 => {
            &signature::ECDSA_P256_SHA384_ASN1
        }
        KeyKind::EcdsaP384 if *oid == OID_SIG_ECDSA_WITH_SHA384 => {
            &signature::ECDSA_P384_SHA384_ASN1
        }
        KeyKind::EcdsaP384 if *oid == OID_SIG_ECDSA_WITH_SHA256 => {
            &signature::ECDSA_P384_SHA256_ASN1
        }
        KeyKind::Rsa(_) if *oid == OID_PKCS1_SHA256WITHRSA => {
            &signature::RSA_PKCS1_2048_8192_SHA256
        }
        KeyKind::Rsa(_) if *oid == OID_PKCS1_SHA384WITHRSA => {
            &signature::RSA_PKCS1_2048_8192_SHA384
        }
        KeyKind::Rsa(_) if *oid == OID_PKCS1_SHA512WITHRSA => {
            &signature::RSA_PKCS1_2048_8192_SHA512
        }
        KeyKind::Rsa(_) if *oid == OID_PKCS1_RSASSAPSS => {
            rsa_pss_algorithm(csr).ok_or_else(unsupported)?
        }
        KeyKind::Ed25519 if *oid == OID_SIG_ED25519 => &signature::ED25519,
        _ => return Err(unsupported()),
    };
    Ok(alg)
}

fn rsa_pss_algorithm(
    csr: &X509CertificationRequest<'_>,
) -> Option<&'static dyn signature::VerificationAlgorithm> {
    use x509_parser::oid_registry::{
        OID_NIST_HASH_SHA256, OID_NIST_HASH_SHA384, OID_NIST_HASH_SHA512,
    };
    use x509_parser::signature_algorithm::RsaSsaPssParams;
    let params = csr.signature_algorithm.parameters.as_ref()?;
    let params = RsaSsaPssParams::try_from(params).ok()?;
    let hash = params.hash_algorithm_oid();
    if *hash == OID_NIST_HASH_SHA256 {
        Some(&signature::RSA_PSS_2048_8192_SHA256)
    } else if *hash == OID_NIST_HASH_SHA384 {
        Some(&signature::RSA_PSS_2048_8192_SHA384)
    } else if *hash == OID_NIST_HASH_SHA512 {
        Some(&signature::RSA_PSS_2048_8192_SHA512)
    } else {
        None
    }
}

fn describe_oid(oid: &Oid<'_>) -> String {
    x509_parser::oid_registry::OidRegistry::default()
        .with_crypto()
        .with_x509()
        .get(oid)
        .map(|e| e.sn().to_string())
        .unwrap_or_else(|| oid.to_id_string())
}

/// Errors from building a CSR.
#[derive(Debug, thiserror::Error)]
#[error("building the CSR failed: {0}")]
pub struct CsrBuildError(String);

/// Builds a PEM CSR for `key` asking for `identity` as its only URI SAN,
/// with an empty subject (as Istio agents do).
pub fn build_csr(key: &PrivateKey, identity: &SpiffeId) -> Result<String, CsrBuildError> {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = vec![SanType::URI(
        identity
            .as_str()
            .try_into()
            .map_err(|e: rcgen::Error| CsrBuildError(e.to_string()))?,
    )];
    let csr = params
        .serialize_request(key.key_pair())
        .map_err(|e| CsrBuildError(e.to_string()))?;
    csr.pem().map_err(|e| CsrBuildError(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::KeyAlgorithm;

    fn id() -> SpiffeId {
        SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap()
    }

    #[test]
    fn verifies_csrs_of_each_key_type() {
        for (alg, kind) in [
            (KeyAlgorithm::EcdsaP256, KeyKind::EcdsaP256),
            (KeyAlgorithm::EcdsaP384, KeyKind::EcdsaP384),
            (KeyAlgorithm::Rsa2048, KeyKind::Rsa(2048)),
        ] {
            let key = PrivateKey::generate(alg).unwrap();
            let csr = VerifiedCsr::from_pem(&build_csr(&key, &id()).unwrap()).unwrap();
            assert_eq!(csr.key_kind(), kind);
            assert_eq!(csr.uri_sans(), &[id()]);
            assert_eq!(
                csr.subject_key().spki_der(),
                key.public_key_spki_der(),
                "{alg}"
            );
        }
    }

    #[test]
    fn rsa_public_exponent_must_be_odd_and_at_least_65537() {
        use crate::keys::test_rsa::RsaTestKey;
        let uri = "spiffe://cluster.local/ns/default/sa/web";
        let e3 = RsaTestKey::generate(2048, 3);
        let err = VerifiedCsr::from_der(&e3.csr_der(Some(uri))).unwrap_err();
        assert_eq!(
            err.to_string(),
            "CSR key is not accepted: RSA public exponent must be odd and at least 65537 \
             (this key's is 3)"
        );
        let f4 = RsaTestKey::generate(2048, 65537);
        let csr = VerifiedCsr::from_der(&f4.csr_der(Some(uri))).unwrap();
        assert_eq!(csr.key_kind(), KeyKind::Rsa(2048));
        assert_eq!(csr.subject_key().spki_der(), f4.spki_der().as_slice());
        // An even exponent: the CSR's key swapped for one with e = 65538
        // (its signature cannot verify; the rule is what is reported).
        let mut der = f4.csr_der(Some(uri));
        let e_f4 = [0x02, 0x03, 0x01, 0x00, 0x01];
        let at = der.windows(5).rposition(|w| w == e_f4).unwrap();
        der[at + 4] = 0x02;
        let err = VerifiedCsr::from_der(&der).unwrap_err();
        assert!(
            matches!(&err, CsrError::WeakKey(KeyPolicyError::WeakRsaExponent { exponent }) if exponent == "65538"),
            "{err}"
        );
    }

    #[test]
    fn rejects_a_forged_signature() {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let pem_text = build_csr(&key, &id()).unwrap();
        let mut der = pem::parse(&pem_text).unwrap().into_contents();
        let last = der.len() - 1;
        der[last] ^= 0x01;
        let err = VerifiedCsr::from_der(&der).unwrap_err();
        assert!(
            matches!(err, CsrError::BadSignature | CsrError::Malformed(_)),
            "{err}"
        );
    }

    #[test]
    fn rejects_a_csr_whose_key_was_swapped() {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let other = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let der = pem::parse(build_csr(&key, &id()).unwrap())
            .unwrap()
            .into_contents();
        // Both SPKIs have the same length: splice the other key in.
        let mine = key.public_key_spki_der();
        let theirs = other.public_key_spki_der();
        let pos = der.windows(mine.len()).position(|w| w == mine).unwrap();
        let mut forged = der.clone();
        forged[pos..pos + mine.len()].copy_from_slice(&theirs);
        assert_eq!(
            VerifiedCsr::from_der(&forged).unwrap_err(),
            CsrError::BadSignature
        );
    }

    #[test]
    fn rejects_garbage_and_wrong_pem() {
        assert_eq!(
            VerifiedCsr::from_pem("garbage").unwrap_err(),
            CsrError::NotPem
        );
        assert_eq!(VerifiedCsr::from_pem("").unwrap_err(), CsrError::NotPem);
        let cert = pem::encode(&pem::Pem::new("CERTIFICATE", vec![0x30, 0x00]));
        assert_eq!(VerifiedCsr::from_pem(&cert).unwrap_err(), CsrError::NotPem);
        let junk = pem::encode(&pem::Pem::new(PEM_TAG, vec![0x30, 0x03, 1, 2, 3]));
        assert!(matches!(
            VerifiedCsr::from_pem(&junk).unwrap_err(),
            CsrError::Malformed(_)
        ));
        let big = "A".repeat(MAX_CSR_PEM_LEN + 1);
        assert!(matches!(
            VerifiedCsr::from_pem(&big).unwrap_err(),
            CsrError::TooLarge(_)
        ));
    }

    /// A P-256 key, its CSR for `id()` as PEM, the CSR's DER, and the same
    /// CSR with 76-column base64 lines (as some PEM writers wrap).
    fn agent_csr() -> (PrivateKey, String, Vec<u8>, String) {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let plain = build_csr(&key, &id()).unwrap();
        let der = pem::parse(&plain).unwrap().into_contents();
        let wrapped_76 = pem::encode_config(
            &pem::Pem::new(PEM_TAG, der.clone()),
            pem::EncodeConfig::new().set_line_wrap(76),
        );
        (key, plain, der, wrapped_76)
    }

    #[test]
    fn accepts_the_pem_variants_agents_send() {
        let (key, plain, _, wrapped_76) = agent_csr();
        let variants = [
            plain.clone(),
            plain.replace('\n', "\r\n"),
            format!("a comment before\n{plain}and after\n"),
            plain.replace(PEM_TAG, PEM_TAG_NEW),
            wrapped_76,
            plain.trim_end().to_string(),
        ];
        for text in variants {
            let csr =
                VerifiedCsr::from_pem(&text).unwrap_or_else(|e| panic!("{text:?} refused: {e}"));
            assert_eq!(csr.uri_sans(), &[id()], "{text:?}");
            assert_eq!(
                csr.subject_key().spki_der(),
                key.public_key_spki_der().as_slice()
            );
        }
        // A CSR followed by a block of another kind is still two blocks.
        let cert = pem::encode(&pem::Pem::new("CERTIFICATE", vec![0x30, 0x00]));
        assert_eq!(
            VerifiedCsr::from_pem(&format!("{plain}{cert}")).unwrap_err(),
            CsrError::MultipleBlocks(2)
        );
        // Corrupt base64 inside the one block: refused as not PEM, as before.
        let corrupt = plain.replacen("MII", "M*I", 1);
        assert_eq!(
            VerifiedCsr::from_pem(&corrupt).unwrap_err(),
            CsrError::NotPem
        );
    }

    #[test]
    fn the_one_block_road_reads_what_the_pem_crate_reads_and_nothing_more() {
        let (_, plain, der, wrapped_76) = agent_csr();
        for text in [
            plain.clone(),
            plain.replace('\n', "\r\n"),
            plain.replace(PEM_TAG, PEM_TAG_NEW),
            wrapped_76,
            plain.trim_end().to_string(),
            format!("\n  {plain}\n\n"),
        ] {
            assert_eq!(single_block_der(&text).as_ref(), Some(&der), "{text:?}");
        }
        // Every length of body (padding, line breaks) decodes as the pem crate does.
        for len in 0..=150usize {
            let body: Vec<u8> = (0..len).map(|i| (i * 31 + len) as u8).collect();
            let text = pem::encode(&pem::Pem::new(PEM_TAG, body.clone()));
            assert_eq!(single_block_der(&text), Some(body), "{len} bytes");
        }
        // Anything else is left to the other readers (which word the errors).
        let cert = pem::encode(&pem::Pem::new("CERTIFICATE", der.clone()));
        let one_byte = |b64: &str| {
            format!(
                "-----BEGIN CERTIFICATE REQUEST-----\n{b64}\n-----END CERTIFICATE REQUEST-----\n"
            )
        };
        assert_eq!(single_block_der(&one_byte("AQ==")), Some(vec![1]));
        // Low bits set under the padding, or the padding left out.
        assert_eq!(single_block_der(&one_byte("AR==")), None);
        assert_eq!(single_block_der(&one_byte("AQ")), None);
        for text in [
            format!("a comment before\n{plain}"),
            format!("{plain}and after\n"),
            format!("{plain}{plain}"),
            format!("{plain}{cert}"),
            cert,
            plain.replacen("MII", "M*I", 1),
            plain.replace(
                "-----END CERTIFICATE REQUEST",
                "-----END NEW CERTIFICATE REQUEST",
            ),
            plain.replacen("-----\n", "-----\nProc-Type: 4,ENCRYPTED\n\n", 1),
            String::new(),
            "-----BEGIN CERTIFICATE REQUEST-----".to_string(),
        ] {
            assert_eq!(single_block_der(&text), None, "{text:?}");
        }
    }

    #[test]
    fn rejects_two_blocks() {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let one = build_csr(&key, &id()).unwrap();
        let two = format!("{one}{one}");
        assert_eq!(
            VerifiedCsr::from_pem(&two).unwrap_err(),
            CsrError::MultipleBlocks(2)
        );
    }

    #[test]
    fn rejects_non_spiffe_uri_sans() {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![SanType::URI("https://example.com/x".try_into().unwrap())];
        let pem_text = params
            .serialize_request(key.key_pair())
            .unwrap()
            .pem()
            .unwrap();
        assert!(matches!(
            VerifiedCsr::from_pem(&pem_text).unwrap_err(),
            CsrError::BadUriSan { .. }
        ));
    }
}
