//! The CRL meshca signs: an X.509 v2 certificate revocation list (RFC 5280,
//! section 5) issued by the CA that signs the workload certificates.
//!
//! [`sign_crl`] encodes it with rcgen's `CertificateRevocationListParams`:
//! version 2, the CA's subject as issuer, thisUpdate and nextUpdate, the
//! CRL number and authority key identifier extensions (both required by
//! RFC 5280, section 5.2), and per entry the serial, the revocation date and
//! a reasonCode (absent for `unspecified`, as section 5.3.1 asks). An empty
//! list is a valid CRL without `revokedCertificates`, so a client can tell
//! "nothing revoked" from "no CRL". [`ParsedCrl`] reads one back (what the
//! agent checks before it serves a CRL, and what the tests compare).

use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::revocation::{RevocationReason, Serial};

/// The PEM label of a CRL.
pub const CRL_PEM_LABEL: &str = "X509 CRL";
/// The file name of the CRL in a data or output directory (Istio's).
pub const CRL_FILE: &str = "ca-crl.pem";
/// The ConfigMap (in every namespace the root bundle goes to) and key
/// Istio reads a CRL from.
pub const CRL_CONFIGMAP_NAME: &str = "istio-ca-crl";
/// The key of [`CRL_CONFIGMAP_NAME`].
pub const CRL_CONFIGMAP_KEY: &str = "ca-crl.pem";
/// The largest CRL read back (PEM), in bytes.
pub const MAX_CRL_BYTES: usize = 16 * 1024 * 1024;

/// Errors from signing or reading a CRL.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CrlError {
    /// rcgen could not take the CA certificate as an issuer, or could not sign.
    #[error("signing the CRL failed: {0}")]
    Signing(String),
    /// The text is not one PEM CRL.
    #[error("not a PEM CRL: {0}")]
    NotPem(String),
    /// The DER is not a CRL.
    #[error("not a valid X.509 CRL: {0}")]
    Invalid(String),
    /// The CRL's signature does not verify with the CA's key, or its issuer
    /// is another CA.
    #[error("the CRL is not signed by this CA: {0}")]
    WrongIssuer(String),
    /// The CRL's nextUpdate has passed (a client must not use it).
    #[error("the CRL's nextUpdate {0} has passed")]
    Expired(crate::Rfc3339),
}

/// One revoked certificate in a CRL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RevokedCert {
    /// Its serial.
    pub serial: Serial,
    /// When it was revoked.
    pub revoked_at: OffsetDateTime,
    /// Why.
    pub reason: RevocationReason,
}

/// When a CRL is issued and which it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrlTimes {
    /// The CRL number: increases with every CRL of this issuer.
    pub number: u64,
    /// thisUpdate.
    pub this_update: OffsetDateTime,
    /// nextUpdate: by then a newer CRL is published.
    pub next_update: OffsetDateTime,
}

fn rcgen_reason(reason: RevocationReason) -> Option<rcgen::RevocationReason> {
    use rcgen::RevocationReason as R;
    Some(match reason {
        RevocationReason::Unspecified => return None,
        RevocationReason::KeyCompromise => R::KeyCompromise,
        RevocationReason::CaCompromise => R::CaCompromise,
        RevocationReason::AffiliationChanged => R::AffiliationChanged,
        RevocationReason::Superseded => R::Superseded,
        RevocationReason::CessationOfOperation => R::CessationOfOperation,
        RevocationReason::PrivilegeWithdrawn => R::PrivilegeWithdrawn,
    })
}

/// Signs a CRL listing `revoked` as the CA certificate `ca_cert_der`
/// with its key `key` (the CA's [`crate::SigningCa`] certificate and key):
/// DER.
pub fn sign_crl(
    ca_cert_der: &[u8],
    key: &impl rcgen::SigningKey,
    revoked: &[RevokedCert],
    times: CrlTimes,
) -> Result<Vec<u8>, CrlError> {
    let ca_der = rustls_pki_types::CertificateDer::from(ca_cert_der);
    let issuer = rcgen::Issuer::from_ca_cert_der(&ca_der, key)
        .map_err(|e| CrlError::Signing(e.to_string()))?;
    if key.subject_public_key_info() != ca_public_key(ca_cert_der)? {
        return Err(CrlError::Signing(
            "the key is not the CA certificate's".into(),
        ));
    }
    let params = rcgen::CertificateRevocationListParams {
        this_update: times.this_update,
        next_update: times.next_update,
        crl_number: rcgen::SerialNumber::from(times.number),
        issuing_distribution_point: None,
        revoked_certs: revoked
            .iter()
            .map(|r| rcgen::RevokedCertParams {
                serial_number: rcgen::SerialNumber::from(r.serial.to_bytes()),
                revocation_time: r.revoked_at,
                reason_code: rcgen_reason(r.reason),
                invalidity_date: None,
            })
            .collect(),
        key_identifier_method: rcgen::KeyIdMethod::PreSpecified(key_identifier(ca_cert_der)?),
    };
    let crl = params
        .signed_by(&issuer)
        .map_err(|e| CrlError::Signing(e.to_string()))?;
    Ok(crl.der().to_vec())
}

/// Signs a CRL as [`sign_crl`] does, with the CA's key wherever it is
/// held: in memory, or outside the process (an HSM: one signature per CRL).
pub fn sign_crl_with_ca_key(
    ca_cert_der: &[u8],
    key: &crate::profile::CaKey,
    revoked: &[RevokedCert],
    times: CrlTimes,
) -> Result<Vec<u8>, CrlError> {
    match key {
        crate::profile::CaKey::Software(key) => {
            sign_crl(ca_cert_der, key.key_pair(), revoked, times)
        }
        crate::profile::CaKey::External(key) => {
            let signer = ExternalSigner::new(key.as_ref())?;
            sign_crl(ca_cert_der, &signer, revoked, times)
        }
    }
}

/// An external key ([`crate::profile::ExternalKey`]) as rcgen signs with.
struct ExternalSigner<'k> {
    key: &'k dyn crate::profile::ExternalKey,
    /// The public key's bits (the SubjectPublicKeyInfo's BIT STRING).
    public_key: Vec<u8>,
    algorithm: &'static rcgen::SignatureAlgorithm,
}

impl<'k> ExternalSigner<'k> {
    fn new(key: &'k dyn crate::profile::ExternalKey) -> Result<Self, CrlError> {
        use crate::keys::KeyKind;
        let algorithm = match key.kind() {
            KeyKind::EcdsaP256 => &rcgen::PKCS_ECDSA_P256_SHA256,
            KeyKind::EcdsaP384 => &rcgen::PKCS_ECDSA_P384_SHA384,
            KeyKind::Rsa(_) => &rcgen::PKCS_RSA_SHA256,
            other => {
                return Err(CrlError::Signing(format!(
                    "{} is a {other:?} key, which CRLs are not signed with",
                    key.name()
                )))
            }
        };
        let (_, spki) =
            x509_parser::x509::SubjectPublicKeyInfo::from_der(key.public_key_spki_der())
                .map_err(|e| CrlError::Signing(format!("{}: {e}", key.name())))?;
        Ok(Self {
            key,
            public_key: spki.subject_public_key.data.to_vec(),
            algorithm,
        })
    }
}

impl rcgen::PublicKeyData for ExternalSigner<'_> {
    fn der_bytes(&self) -> &[u8] {
        &self.public_key
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        self.algorithm
    }
}

impl rcgen::SigningKey for ExternalSigner<'_> {
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        self.key.sign(msg).map_err(|_| rcgen::Error::RemoteKeyError)
    }
}

fn ca_public_key(ca_der: &[u8]) -> Result<Vec<u8>, CrlError> {
    let (_, cert) =
        X509Certificate::from_der(ca_der).map_err(|e| CrlError::Signing(e.to_string()))?;
    Ok(cert.public_key().raw.to_vec())
}

/// The CA's subjectKeyIdentifier (what its certificates' AKI names), or
/// the SHA-1 of its key as RFC 5280 suggests when it has none.
fn key_identifier(ca_der: &[u8]) -> Result<Vec<u8>, CrlError> {
    let (_, cert) =
        X509Certificate::from_der(ca_der).map_err(|e| CrlError::Signing(e.to_string()))?;
    Ok(cert
        .extensions()
        .iter()
        .find_map(|ext| match ext.parsed_extension() {
            x509_parser::extensions::ParsedExtension::SubjectKeyIdentifier(ski) => {
                Some(ski.0.to_vec())
            }
            _ => None,
        })
        .unwrap_or_else(|| {
            ring::digest::digest(
                &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
                &cert.public_key().subject_public_key.data,
            )
            .as_ref()
            .to_vec()
        }))
}

/// PEM of a DER CRL.
pub fn encode_crl_pem(der: &[u8]) -> String {
    pem::encode_config(
        &pem::Pem::new(CRL_PEM_LABEL, der.to_vec()),
        pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF),
    )
}

/// A CRL read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCrl {
    /// The DER.
    pub der: Vec<u8>,
    /// The CRL number.
    pub number: Option<u64>,
    /// thisUpdate.
    pub this_update: OffsetDateTime,
    /// nextUpdate.
    pub next_update: Option<OffsetDateTime>,
    /// The revoked serials, in order.
    pub revoked: Vec<Serial>,
    /// The issuer's name, DER (the serials are that issuer's).
    pub issuer_der: Vec<u8>,
}

impl ParsedCrl {
    /// Parses one PEM CRL.
    pub fn from_pem(text: &str) -> Result<Self, CrlError> {
        if text.len() > MAX_CRL_BYTES {
            return Err(CrlError::NotPem(format!(
                "{} bytes, more than {MAX_CRL_BYTES}",
                text.len()
            )));
        }
        let block = pem::parse(text).map_err(|e| CrlError::NotPem(e.to_string()))?;
        if block.tag() != CRL_PEM_LABEL {
            return Err(CrlError::NotPem(format!(
                "the PEM block is {:?}, not {CRL_PEM_LABEL:?}",
                crate::untrusted_text::shortened(block.tag(), 40)
            )));
        }
        Self::from_der(block.contents())
    }

    /// Parses a DER CRL.
    pub fn from_der(der: &[u8]) -> Result<Self, CrlError> {
        let (rest, crl) = x509_parser::revocation_list::CertificateRevocationList::from_der(der)
            .map_err(|e| CrlError::Invalid(e.to_string()))?;
        if !rest.is_empty() {
            return Err(CrlError::Invalid("trailing bytes after the CRL".into()));
        }
        let number = crl.crl_number().and_then(|n| {
            let bytes = n.to_bytes_be();
            (bytes.len() <= 8).then(|| bytes.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
        });
        Ok(Self {
            der: der.to_vec(),
            number,
            this_update: crl.last_update().to_datetime(),
            next_update: crl.next_update().map(|t| t.to_datetime()),
            revoked: crl
                .iter_revoked_certificates()
                .map(|r| Serial::from_bytes(r.raw_serial()))
                .collect(),
            issuer_der: crl.issuer().as_raw().to_vec(),
        })
    }

    /// The serial of the certificate `cert_der` when this CRL lists it:
    /// its issuer is the CRL's issuer and its serial is on the list (a
    /// serial means something only with its issuer). `None` when it is not
    /// listed or not a certificate. The signature is not checked here:
    /// [`ParsedCrl::verify`] first.
    pub fn lists(&self, cert_der: &[u8]) -> Option<Serial> {
        let (_, cert) = X509Certificate::from_der(cert_der).ok()?;
        if cert.issuer().as_raw() != self.issuer_der.as_slice() {
            return None;
        }
        let serial = Serial::from_bytes(cert.raw_serial());
        self.revoked.contains(&serial).then_some(serial)
    }

    /// Checks that `ca_der` signed this CRL (signature and issuer name) and
    /// that its nextUpdate has not passed at `now`.
    pub fn verify(&self, ca_der: &[u8], now: OffsetDateTime) -> Result<(), CrlError> {
        let (_, ca) =
            X509Certificate::from_der(ca_der).map_err(|e| CrlError::WrongIssuer(e.to_string()))?;
        let (_, crl) = x509_parser::revocation_list::CertificateRevocationList::from_der(&self.der)
            .map_err(|e| CrlError::Invalid(e.to_string()))?;
        if crl.issuer().as_raw() != ca.subject().as_raw() && crl.issuer() != ca.subject() {
            return Err(CrlError::WrongIssuer(format!(
                "issuer {} is not the CA's subject {}",
                crl.issuer(),
                ca.subject()
            )));
        }
        crl.verify_signature(ca.public_key())
            .map_err(|e| CrlError::WrongIssuer(e.to_string()))?;
        if let Some(next) = self.next_update {
            if next <= now {
                return Err(CrlError::Expired(crate::Rfc3339(next)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{KeyAlgorithm, PrivateKey};
    use crate::profile::{self_signed_root, SubjectName, Validity};
    use time::Duration;

    /// A root's DER and key.
    fn ca(alg: KeyAlgorithm) -> (Vec<u8>, PrivateKey) {
        let key = PrivateKey::generate(alg).unwrap();
        let name = SubjectName {
            organization: Some("Test".into()),
            common_name: Some("Root CA".into()),
            ..Default::default()
        };
        let now = OffsetDateTime::now_utc();
        let cert =
            self_signed_root(&key, &name, Validity::backdated(now, Duration::days(30))).unwrap();
        (cert.der, key)
    }

    fn times(number: u64) -> CrlTimes {
        let now = OffsetDateTime::now_utc().replace_nanosecond(0).unwrap();
        CrlTimes {
            number,
            this_update: now,
            next_update: now + Duration::hours(2),
        }
    }

    /// A software key seen only through [`crate::profile::ExternalKey`], as
    /// an HSM key is.
    #[derive(Debug)]
    struct OutsideKey {
        key: PrivateKey,
        spki: Vec<u8>,
    }

    impl crate::profile::ExternalKey for OutsideKey {
        fn public_key_spki_der(&self) -> &[u8] {
            &self.spki
        }
        fn kind(&self) -> crate::keys::KeyKind {
            self.key.kind()
        }
        fn sign(&self, message: &[u8]) -> Result<Vec<u8>, crate::profile::ProfileError> {
            rcgen::SigningKey::sign(self.key.key_pair(), message)
                .map_err(|e| crate::profile::ProfileError::Signing(e.to_string()))
        }
        fn name(&self) -> &str {
            "pkcs11:object=test"
        }
    }

    #[test]
    fn a_key_held_outside_the_process_signs_a_crl_that_verifies() {
        for alg in [
            KeyAlgorithm::EcdsaP256,
            KeyAlgorithm::EcdsaP384,
            KeyAlgorithm::Rsa2048,
        ] {
            let (ca, key) = ca(alg);
            let spki = key.public_key_spki_der();
            let outside =
                crate::profile::CaKey::External(std::sync::Arc::new(OutsideKey { key, spki }));
            let der = sign_crl_with_ca_key(&ca, &outside, &[], times(3)).unwrap();
            let parsed = ParsedCrl::from_der(&der).unwrap();
            parsed.verify(&ca, OffsetDateTime::now_utc()).unwrap();
            assert_eq!(parsed.number, Some(3));
        }
    }

    #[test]
    fn a_crl_lists_a_certificate_only_under_its_own_issuer() {
        use crate::profile::{SigningCa, SubjectKey};
        let (root_der, root_key) = ca(KeyAlgorithm::EcdsaP256);
        let root = SigningCa::new(root_der.clone(), root_key).unwrap();
        let now = OffsetDateTime::now_utc();
        let mid_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let mid_name = SubjectName {
            common_name: Some("Intermediate CA".into()),
            ..Default::default()
        };
        let mid_cert = root
            .issue_ca(
                &SubjectKey::of(&mid_key).unwrap(),
                &mid_name,
                Some(0),
                Validity::backdated(now, Duration::days(1)),
            )
            .unwrap();
        let mid = SigningCa::new(mid_cert.der.clone(), mid_key).unwrap();
        let leaf_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let id = crate::SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap();
        let leaf = mid
            .issue_workload(
                &SubjectKey::of(&leaf_key).unwrap(),
                &id,
                Validity::backdated(now, Duration::hours(1)),
            )
            .unwrap();
        let entry = |hex: &str| RevokedCert {
            serial: Serial::parse(hex).unwrap(),
            revoked_at: times(0).this_update,
            reason: RevocationReason::KeyCompromise,
        };
        // The intermediate's CRL lists its leaf.
        let by_mid = ParsedCrl::from_der(
            &sign_crl_with_ca_key(
                mid.cert_der(),
                mid.key(),
                &[entry(&leaf.serial_hex)],
                times(1),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            by_mid.lists(&leaf.der),
            Some(Serial::parse(&leaf.serial_hex).unwrap())
        );
        assert_eq!(by_mid.lists(&mid_cert.der), None);
        // The root's CRL with the same serials: the leaf is not the root's
        // to list, the intermediate is.
        let by_root = ParsedCrl::from_der(
            &sign_crl_with_ca_key(
                &root_der,
                root.key(),
                &[entry(&leaf.serial_hex), entry(&mid_cert.serial_hex)],
                times(2),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(by_root.lists(&leaf.der), None);
        assert_eq!(
            by_root.lists(&mid_cert.der),
            Some(Serial::parse(&mid_cert.serial_hex).unwrap())
        );
        assert_eq!(by_root.lists(b"not a certificate"), None);
    }

    #[test]
    fn an_empty_crl_is_valid_and_verifies() {
        let (ca, key) = ca(KeyAlgorithm::EcdsaP256);
        let der = sign_crl(&ca, key.key_pair(), &[], times(7)).unwrap();
        let parsed = ParsedCrl::from_pem(&encode_crl_pem(&der)).unwrap();
        assert_eq!(parsed.number, Some(7));
        assert!(parsed.revoked.is_empty());
        parsed.verify(&ca, OffsetDateTime::now_utc()).unwrap();
        // Another CA's key does not verify it, nor signs for this CA;
        // past nextUpdate it is refused.
        let (other, other_key) = self::ca(KeyAlgorithm::EcdsaP256);
        assert!(parsed.verify(&other, OffsetDateTime::now_utc()).is_err());
        assert!(sign_crl(&ca, other_key.key_pair(), &[], times(8)).is_err());
        assert!(matches!(
            parsed.verify(&ca, OffsetDateTime::now_utc() + Duration::hours(3)),
            Err(CrlError::Expired(_))
        ));
    }

    #[test]
    fn revoked_serials_reasons_and_extensions_are_encoded() {
        for alg in [KeyAlgorithm::EcdsaP256, KeyAlgorithm::EcdsaP384] {
            let (ca, key) = ca(alg);
            let revoked: Vec<RevokedCert> = ["3f0a1b", "ff00000000000000000000000000000001", "1"]
                .iter()
                .zip([
                    RevocationReason::KeyCompromise,
                    RevocationReason::Unspecified,
                    RevocationReason::Superseded,
                ])
                .map(|(s, reason)| RevokedCert {
                    serial: Serial::parse(s).unwrap(),
                    revoked_at: times(0).this_update,
                    reason,
                })
                .collect();
            let der = sign_crl(&ca, key.key_pair(), &revoked, times(42)).unwrap();
            let parsed = ParsedCrl::from_der(&der).unwrap();
            parsed.verify(&ca, OffsetDateTime::now_utc()).unwrap();
            assert_eq!(
                parsed.revoked,
                revoked.iter().map(|r| r.serial.clone()).collect::<Vec<_>>()
            );
            let (_, crl) =
                x509_parser::revocation_list::CertificateRevocationList::from_der(&der).unwrap();
            assert_eq!(crl.version().map(|v| v.0), Some(1), "v2");
            let reasons: Vec<Option<u8>> = crl
                .iter_revoked_certificates()
                .map(|r| r.reason_code().map(|(_, c)| c.0))
                .collect();
            assert_eq!(reasons, [Some(1), None, Some(4)]);
            let (_, cacert) = X509Certificate::from_der(&ca).unwrap();
            assert_eq!(crl.issuer().as_raw(), cacert.subject().as_raw());
            let aki = crl
                .extensions()
                .iter()
                .find_map(|e| match e.parsed_extension() {
                    x509_parser::extensions::ParsedExtension::AuthorityKeyIdentifier(a) => {
                        a.key_identifier.as_ref().map(|k| k.0.to_vec())
                    }
                    _ => None,
                })
                .unwrap();
            assert_eq!(aki, key_identifier(&ca).unwrap());
        }
    }

    /// A tool of the machine, or None (with a line) when it is missing
    /// outside CI; in CI (`CI` set, as `.ci/run` does) a missing tool fails.
    fn tool_available(check: &mut std::process::Command, what: &str) -> bool {
        let present = check.output().is_ok_and(|o| o.status.success());
        if !present {
            assert!(std::env::var_os("CI").is_none(), "{what} is needed in CI");
            eprintln!("SKIPPED: {what} is not installed");
        }
        present
    }

    /// The encoding as two independent parsers read it: `openssl crl`
    /// (signature verified against the CA) and Python's `cryptography`.
    #[test]
    fn openssl_and_cryptography_read_and_verify_the_crl() {
        let (ca_der, key) = ca(KeyAlgorithm::EcdsaP256);
        let revoked: Vec<RevokedCert> = [
            ("3f0a1b", RevocationReason::KeyCompromise),
            ("01", RevocationReason::Superseded),
        ]
        .iter()
        .map(|(s, reason)| RevokedCert {
            serial: Serial::parse(s).unwrap(),
            revoked_at: times(0).this_update,
            reason: *reason,
        })
        .collect();
        let der = sign_crl(&ca_der, key.key_pair(), &revoked, times(42)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let crl_pem = dir.path().join("ca-crl.pem");
        let ca_pem = dir.path().join("root-cert.pem");
        std::fs::write(&crl_pem, encode_crl_pem(&der)).unwrap();
        std::fs::write(
            &ca_pem,
            pem::encode(&pem::Pem::new("CERTIFICATE", ca_der.clone())),
        )
        .unwrap();
        if tool_available(
            std::process::Command::new("openssl").arg("version"),
            "openssl",
        ) {
            let out = std::process::Command::new("openssl")
                .args(["crl", "-noout", "-text", "-in"])
                .arg(&crl_pem)
                .arg("-CAfile")
                .arg(&ca_pem)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{err}");
            assert!(
                err.contains("verify OK") || text.contains("verify OK"),
                "{err}{text}"
            );
            for needed in [
                "Version 2",
                "X509v3 CRL Number",
                "42",
                "X509v3 Authority Key Identifier",
                "Next Update",
                "3F0A1B",
                "Key Compromise",
                "Superseded",
            ] {
                assert!(text.contains(needed), "no {needed:?} in:\n{text}");
            }
        }
        let python = || {
            let mut c = std::process::Command::new("python3");
            c.args(["-c", "import cryptography"]);
            c
        };
        if tool_available(&mut python(), "python3 with cryptography") {
            let script = r#"
import sys
from cryptography import x509
crl = x509.load_pem_x509_crl(open(sys.argv[1], "rb").read())
ca = x509.load_pem_x509_certificate(open(sys.argv[2], "rb").read())
assert crl.is_signature_valid(ca.public_key()), "signature"
number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
aki = crl.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier
serials = sorted(format(r.serial_number, "x") for r in crl)
reasons = sorted(r.extensions.get_extension_for_class(x509.CRLReason).value.reason.name for r in crl)
print(number, aki.hex(), ",".join(serials), ",".join(reasons), crl.next_update_utc is not None)
"#;
            let out = std::process::Command::new("python3")
                .args(["-c", script])
                .arg(&crl_pem)
                .arg(&ca_pem)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let line = String::from_utf8_lossy(&out.stdout);
            let aki = key_identifier(&ca_der).unwrap();
            let aki_hex: String = aki.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(
                line.trim(),
                format!("42 {aki_hex} 1,3f0a1b key_compromise,superseded True")
            );
        }
    }

    /// The sizes and times in BENCHMARKS.md ("Revocation"): `cargo test -p
    /// meshca-certs --lib crl::tests::size_and_time -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement: run by hand"]
    fn size_and_time_for_1000_and_10000_serials() {
        let (ca, key) = ca(KeyAlgorithm::EcdsaP256);
        for n in [0usize, 1_000, 10_000] {
            let revoked: Vec<RevokedCert> = (0..n)
                .map(|i| RevokedCert {
                    // meshca's serials: 17 random bytes, the first below 0x80.
                    serial: Serial::from_bytes(
                        &ring::digest::digest(&ring::digest::SHA256, &i.to_be_bytes()).as_ref()
                            [..17]
                            .iter()
                            .enumerate()
                            .map(|(j, b)| if j == 0 { b & 0x7f | 0x01 } else { *b })
                            .collect::<Vec<u8>>(),
                    ),
                    revoked_at: times(0).this_update,
                    reason: RevocationReason::KeyCompromise,
                })
                .collect();
            let started = std::time::Instant::now();
            let rounds = 5;
            let mut der = Vec::new();
            for _ in 0..rounds {
                der = sign_crl(&ca, key.key_pair(), &revoked, times(1)).unwrap();
            }
            let took = started.elapsed() / rounds;
            let pem = encode_crl_pem(&der);
            let started = std::time::Instant::now();
            let parsed = ParsedCrl::from_pem(&pem).unwrap();
            parsed.verify(&ca, OffsetDateTime::now_utc()).unwrap();
            let read = started.elapsed();
            assert_eq!(parsed.revoked.len(), n);
            println!(
                "{n} serials: DER {} bytes, PEM {} bytes, signed in {:.2} ms, parsed and verified in {:.2} ms",
                der.len(),
                pem.len(),
                took.as_secs_f64() * 1e3,
                read.as_secs_f64() * 1e3
            );
        }
    }
}
