//! Certificate profiles and the CA that signs them.
//!
//! [`SigningCa`] is a CA certificate with its private key. It issues:
//! - [`SigningCa::issue_workload`]: an X509-SVID (SPIFFE's standard) — one
//!   URI SAN, empty subject (so the SAN is critical), cA=false, keyUsage
//!   digitalSignature (+keyEncipherment for RSA), extKeyUsage
//!   serverAuth+clientAuth, SKI, AKI = the issuer's SKI, a random positive
//!   serial of more than 128 bits;
//! - [`SigningCa::issue_server`]: the same end-entity profile with DNS and IP
//!   SANs (the CA's own serving certificate);
//! - [`SigningCa::issue_ca`]: an intermediate CA (cA=true, pathLen,
//!   keyCertSign+cRLSign).
//!
//! [`self_signed_root`] makes a root. The issuer name of everything issued is
//! the signing certificate's subject, copied byte for byte.

use std::net::IpAddr;
use std::sync::Arc;

use ring::digest;
use time::{Duration, OffsetDateTime};
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::der::{self, oid, tag};
use crate::keys::{KeyKind, PrivateKey};
use crate::spiffe::SpiffeId;

/// How far back notBefore is set at most, for clock skew between CA and
/// peers (Istio uses the same two minutes).
pub const CLOCK_SKEW_BACKDATE: Duration = Duration::minutes(2);

/// Short lifetimes are backdated by at most this fraction of the lifetime
/// (1/`BACKDATE_DIVISOR`), so the certificate's half-life, where clients
/// such as ztunnel renew (notBefore + lifetime / 2), falls after it is
/// issued: a 60 s certificate is backdated 6 s and is due again 27 s after
/// issuance, not at once.
pub(crate) const BACKDATE_DIVISOR: i32 = 10;

/// Errors from building or signing certificates.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The CA certificate could not be parsed.
    #[error("the CA certificate is not valid X.509: {0}")]
    BadCaCertificate(String),
    /// The CA certificate is not a CA (basicConstraints cA=false or absent).
    #[error("the certificate is not a CA: basicConstraints cA is not true")]
    NotACa,
    /// The CA certificate's keyUsage does not allow signing certificates.
    #[error("the CA certificate's keyUsage does not include keyCertSign")]
    NoKeyCertSign,
    /// The private key is not the one the CA certificate certifies.
    #[error("the private key does not match the CA certificate's public key")]
    KeyMismatch,
    /// The CA key type cannot sign (e.g. an unsupported curve).
    #[error("the CA key ({0}) cannot be used to sign certificates")]
    UnsupportedCaKey(KeyKind),
    /// The subject public key could not be parsed.
    #[error("the subject public key is not a valid SubjectPublicKeyInfo: {0}")]
    BadSubjectKey(String),
    /// The requested validity is empty or inverted.
    #[error("notAfter ({}) is not after notBefore ({})", crate::Rfc3339(*not_after), crate::Rfc3339(*not_before))]
    EmptyValidity {
        /// Requested notBefore.
        not_before: OffsetDateTime,
        /// Requested notAfter.
        not_after: OffsetDateTime,
    },
    /// The signature operation failed.
    #[error("signing failed: {0}")]
    Signing(String),
    /// The random number generator failed.
    #[error("the system random number generator failed")]
    Random,
    /// The external key (an HSM) is busy: every session signing and its
    /// queue full. Worth retrying later.
    #[error("the CA key is busy: {0}")]
    KeyBusy(String),
    /// The external key (an HSM) could not sign: unreachable, token gone.
    #[error("{0}")]
    KeyUnavailable(String),
}

/// A signing key that lives outside this process (an HSM): meshca holds
/// its public half and asks it for signatures.
pub trait ExternalKey: Send + Sync + std::fmt::Debug {
    /// The public key, DER SubjectPublicKeyInfo.
    fn public_key_spki_der(&self) -> &[u8];
    /// What kind of key it is (sets the signature algorithm).
    fn kind(&self) -> KeyKind;
    /// A signature of `message` in X.509's encoding for [`Self::kind`]
    /// (ECDSA: DER `ECDSA-Sig-Value` over SHA-256 for P-256, SHA-384 for
    /// P-384; RSA: PKCS#1 v1.5 with SHA-256).
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, ProfileError>;
    /// What the key is called (its URI), for messages and logs.
    fn name(&self) -> &str;
}

/// The key a CA signs with: in memory, or outside the process.
#[derive(Clone)]
pub enum CaKey {
    /// A key held in memory.
    Software(Arc<PrivateKey>),
    /// A key in an HSM or another external signer.
    External(Arc<dyn ExternalKey>),
}

impl CaKey {
    /// The public key, DER SubjectPublicKeyInfo.
    pub fn public_key_spki_der(&self) -> Vec<u8> {
        match self {
            Self::Software(k) => k.public_key_spki_der(),
            Self::External(k) => k.public_key_spki_der().to_vec(),
        }
    }

    /// What kind of key it is.
    pub fn kind(&self) -> KeyKind {
        match self {
            Self::Software(k) => k.kind(),
            Self::External(k) => k.kind(),
        }
    }

    /// The key in memory, if it is one.
    pub fn software(&self) -> Option<&PrivateKey> {
        match self {
            Self::Software(k) => Some(k),
            Self::External(_) => None,
        }
    }

    /// The external key's name (its URI), if it is one.
    pub fn external_name(&self) -> Option<&str> {
        match self {
            Self::Software(_) => None,
            Self::External(k) => Some(k.name()),
        }
    }

    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, ProfileError> {
        match self {
            Self::Software(k) => rcgen::SigningKey::sign(k.key_pair(), message)
                .map_err(|e| ProfileError::Signing(e.to_string())),
            Self::External(k) => k.sign(message),
        }
    }
}

impl std::fmt::Debug for CaKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Software(k) => k.fmt(f),
            Self::External(k) => write!(f, "External({})", k.name()),
        }
    }
}

impl From<PrivateKey> for CaKey {
    fn from(key: PrivateKey) -> Self {
        Self::Software(Arc::new(key))
    }
}

/// A certificate's validity window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// notBefore.
    pub not_before: OffsetDateTime,
    /// notAfter.
    pub not_after: OffsetDateTime,
}

impl Validity {
    /// The latest time a certificate can carry: GeneralizedTime
    /// 99991231235959Z (RFC 5280 §4.1.2.5, "no well-defined expiration
    /// date"). Lifetimes that would end later end here instead.
    pub const LATEST: OffsetDateTime = time::macros::datetime!(9999-12-31 23:59:59 UTC);

    /// A window from `now - backdate(ttl)` to `now + ttl`, truncated to
    /// whole seconds (X.509 times have no fractions). The arithmetic
    /// saturates: a `ttl` that would end after [`Validity::LATEST`] ends
    /// there (callers then cap it at the issuer's notAfter with
    /// [`Validity::capped_at`]), so no input makes this panic.
    pub fn backdated(now: OffsetDateTime, ttl: Duration) -> Self {
        let now = truncate_to_seconds(now);
        Self {
            not_before: now.checked_sub(Self::backdate(ttl)).unwrap_or(now),
            not_after: saturating_add(now, ttl),
        }
    }

    /// How far before issuance notBefore is set for a lifetime of `ttl`:
    /// [`CLOCK_SKEW_BACKDATE`], or a tenth of `ttl` when that is shorter
    /// (whole seconds, never negative).
    pub(crate) fn backdate(ttl: Duration) -> Duration {
        let proportional = Duration::seconds((ttl / BACKDATE_DIVISOR).whole_seconds().max(0));
        proportional.min(CLOCK_SKEW_BACKDATE)
    }

    /// The window's length, notAfter − notBefore.
    pub fn lifetime(&self) -> Duration {
        self.not_after - self.not_before
    }

    /// The same window, notAfter moved earlier if needed so the whole
    /// lifetime is at most `max` (notBefore stays).
    pub fn with_lifetime_at_most(self, max: Duration) -> Self {
        Self {
            not_before: self.not_before,
            not_after: self.not_after.min(saturating_add(self.not_before, max)),
        }
    }

    /// The same window with notAfter no later than `limit`.
    pub fn capped_at(self, limit: OffsetDateTime) -> Self {
        Self {
            not_before: self.not_before,
            not_after: self.not_after.min(truncate_to_seconds(limit)),
        }
    }
}

/// `t + d`, but never past [`Validity::LATEST`] (nor before the earliest
/// time `time` represents, for a negative `d`).
fn saturating_add(t: OffsetDateTime, d: Duration) -> OffsetDateTime {
    match t.checked_add(d) {
        Some(sum) => sum.min(Validity::LATEST),
        None if d.is_negative() => OffsetDateTime::UNIX_EPOCH.min(t),
        None => Validity::LATEST,
    }
}

fn truncate_to_seconds(t: OffsetDateTime) -> OffsetDateTime {
    t.replace_nanosecond(0).unwrap_or(t)
}

/// The subject's public key, as DER SubjectPublicKeyInfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectKey {
    spki_der: Vec<u8>,
    kind: KeyKind,
    key_identifier: Vec<u8>,
}

impl SubjectKey {
    /// Parses a DER SubjectPublicKeyInfo.
    pub fn from_spki_der(spki_der: &[u8]) -> Result<Self, ProfileError> {
        let (rest, spki) = x509_parser::x509::SubjectPublicKeyInfo::from_der(spki_der)
            .map_err(|e| ProfileError::BadSubjectKey(e.to_string()))?;
        if !rest.is_empty() {
            return Err(ProfileError::BadSubjectKey("trailing bytes".into()));
        }
        Ok(Self::from_parsed(&spki))
    }

    pub(crate) fn from_parsed(spki: &x509_parser::x509::SubjectPublicKeyInfo<'_>) -> Self {
        Self {
            spki_der: spki.raw.to_vec(),
            kind: KeyKind::from_spki(spki),
            key_identifier: key_identifier(&spki.subject_public_key.data),
        }
    }

    /// The public half of a private key.
    pub fn of(key: &PrivateKey) -> Result<Self, ProfileError> {
        Self::from_spki_der(&key.public_key_spki_der())
    }

    /// The key's kind.
    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    /// The DER SubjectPublicKeyInfo.
    pub fn spki_der(&self) -> &[u8] {
        &self.spki_der
    }
}

/// RFC 5280 §4.2.1.2 method 1: SHA-1 of the subjectPublicKey bits.
fn key_identifier(subject_public_key: &[u8]) -> Vec<u8> {
    digest::digest(&digest::SHA1_FOR_LEGACY_USE_ONLY, subject_public_key)
        .as_ref()
        .to_vec()
}

/// A freshly issued certificate.
#[derive(Debug, Clone)]
pub struct IssuedCert {
    /// DER of the certificate.
    pub der: Vec<u8>,
    /// The serial number, as lowercase hex (for logs).
    pub serial_hex: String,
    /// The validity window written into the certificate.
    pub validity: Validity,
}

impl IssuedCert {
    /// The certificate as PEM.
    pub fn to_pem(&self) -> String {
        crate::bundle::encode_cert_pem(&self.der)
    }
}

/// A subject distinguished name built from the usual attributes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubjectName {
    /// O=
    pub organization: Option<String>,
    /// OU=
    pub organizational_unit: Option<String>,
    /// L=
    pub locality: Option<String>,
    /// CN=
    pub common_name: Option<String>,
}

impl SubjectName {
    /// DER encoding of the Name (UTF8String values, in the order O, OU, L, CN).
    pub fn to_der(&self) -> Vec<u8> {
        let attrs: [(&[u8], &Option<String>); 4] = [
            (&[0x55, 0x04, 0x0a], &self.organization),
            (&[0x55, 0x04, 0x0b], &self.organizational_unit),
            (&[0x55, 0x04, 0x07], &self.locality),
            (&[0x55, 0x04, 0x03], &self.common_name),
        ];
        let mut out = Vec::new();
        der::write_nested(&mut out, tag::SEQUENCE, |name| {
            for (attr_oid, value) in attrs {
                if let Some(value) = value {
                    der::write_nested(name, 0x31, |rdn| {
                        der::write_nested(rdn, tag::SEQUENCE, |atv| {
                            der::write_tlv(atv, tag::OID, attr_oid);
                            der::write_tlv(atv, 0x0c, value.as_bytes());
                        });
                    });
                }
            }
        });
        out
    }
}

/// What kind of certificate to build.
enum Profile<'a> {
    EndEntity {
        uris: &'a [&'a str],
        dns: &'a [String],
        ips: &'a [IpAddr],
    },
    Ca {
        path_len: Option<u8>,
        /// Hosts permitted for URI names below (a critical nameConstraints).
        permitted_uri_hosts: &'a [&'a str],
    },
}

/// A CA certificate and its key: the thing that signs.
pub struct SigningCa {
    key: CaKey,
    cert_der: Vec<u8>,
    subject_der: Vec<u8>,
    key_identifier: Vec<u8>,
    signature_algorithm: &'static [u8],
    validity: Validity,
}

impl std::fmt::Debug for SigningCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningCa")
            .field("key", &self.key)
            .field("validity", &self.validity)
            .finish_non_exhaustive()
    }
}

impl SigningCa {
    /// Pairs a CA certificate (DER) with its key, checking that the
    /// certificate is a CA allowed to sign certificates and that the key is
    /// the one it certifies. Validity in time is not checked here.
    pub fn new(cert_der: Vec<u8>, key: PrivateKey) -> Result<Self, ProfileError> {
        Self::with_key(cert_der, CaKey::from(key))
    }

    /// [`SigningCa::new`] for a key in memory or outside the process.
    pub fn with_key(cert_der: Vec<u8>, key: CaKey) -> Result<Self, ProfileError> {
        let (_, cert) = X509Certificate::from_der(&cert_der)
            .map_err(|e| ProfileError::BadCaCertificate(e.to_string()))?;
        let bc = cert
            .basic_constraints()
            .map_err(|e| ProfileError::BadCaCertificate(e.to_string()))?;
        if !bc.is_some_and(|bc| bc.value.ca) {
            return Err(ProfileError::NotACa);
        }
        let ku = cert
            .key_usage()
            .map_err(|e| ProfileError::BadCaCertificate(e.to_string()))?;
        if ku.is_some_and(|ku| !ku.value.key_cert_sign()) {
            return Err(ProfileError::NoKeyCertSign);
        }
        if cert.public_key().raw != key.public_key_spki_der().as_slice() {
            return Err(ProfileError::KeyMismatch);
        }
        let signature_algorithm = signature_algorithm_der(key.kind())?;
        let key_identifier = cert
            .extensions()
            .iter()
            .find_map(|ext| match ext.parsed_extension() {
                x509_parser::extensions::ParsedExtension::SubjectKeyIdentifier(ski) => {
                    Some(ski.0.to_vec())
                }
                _ => None,
            })
            .unwrap_or_else(|| key_identifier(&cert.public_key().subject_public_key.data));
        let validity = Validity {
            not_before: cert.validity().not_before.to_datetime(),
            not_after: cert.validity().not_after.to_datetime(),
        };
        let subject_der = cert.subject().as_raw().to_vec();
        Ok(Self {
            key,
            cert_der,
            subject_der,
            key_identifier,
            signature_algorithm,
            validity,
        })
    }

    /// The CA certificate, DER.
    pub fn cert_der(&self) -> &[u8] {
        &self.cert_der
    }

    /// The CA certificate's validity.
    pub fn validity(&self) -> Validity {
        self.validity
    }

    /// The CA's key.
    pub fn key(&self) -> &CaKey {
        &self.key
    }

    /// Issues an X509-SVID for `identity` to `subject`.
    pub fn issue_workload(
        &self,
        subject: &SubjectKey,
        identity: &SpiffeId,
        validity: Validity,
    ) -> Result<IssuedCert, ProfileError> {
        self.issue(
            subject,
            &[0x30, 0x00],
            Profile::EndEntity {
                uris: &[identity.as_str()],
                dns: &[],
                ips: &[],
            },
            validity,
        )
    }

    /// Issues a TLS server certificate for DNS names and IP addresses (also
    /// good for client auth), with an empty subject.
    pub fn issue_server(
        &self,
        subject: &SubjectKey,
        dns: &[String],
        ips: &[IpAddr],
        validity: Validity,
    ) -> Result<IssuedCert, ProfileError> {
        self.issue(
            subject,
            &[0x30, 0x00],
            Profile::EndEntity {
                uris: &[],
                dns,
                ips,
            },
            validity,
        )
    }

    /// Issues an intermediate CA certificate.
    pub fn issue_ca(
        &self,
        subject: &SubjectKey,
        name: &SubjectName,
        path_len: Option<u8>,
        validity: Validity,
    ) -> Result<IssuedCert, ProfileError> {
        self.issue(
            subject,
            &name.to_der(),
            Profile::Ca {
                path_len,
                permitted_uri_hosts: &[],
            },
            validity,
        )
    }

    /// Issues an intermediate CA certificate whose URI names are
    /// constrained to `permitted_uri_hosts` (RFC 5280 nameConstraints,
    /// critical, permittedSubtrees of uniformResourceIdentifier: a URI is
    /// allowed when its host is one of them).
    pub fn issue_constrained_ca(
        &self,
        subject: &SubjectKey,
        name: &SubjectName,
        path_len: Option<u8>,
        permitted_uri_hosts: &[&str],
        validity: Validity,
    ) -> Result<IssuedCert, ProfileError> {
        self.issue(
            subject,
            &name.to_der(),
            Profile::Ca {
                path_len,
                permitted_uri_hosts,
            },
            validity,
        )
    }

    fn issue(
        &self,
        subject: &SubjectKey,
        subject_name_der: &[u8],
        profile: Profile<'_>,
        validity: Validity,
    ) -> Result<IssuedCert, ProfileError> {
        build_and_sign(
            &|tbs: &[u8]| self.key.sign(tbs),
            self.signature_algorithm,
            &self.subject_der,
            Some(&self.key_identifier),
            subject,
            subject_name_der,
            profile,
            validity,
        )
    }
}

/// Makes a self-signed root CA certificate for `key`.
pub fn self_signed_root(
    key: &PrivateKey,
    name: &SubjectName,
    validity: Validity,
) -> Result<IssuedCert, ProfileError> {
    let subject = SubjectKey::of(key)?;
    let name_der = name.to_der();
    build_and_sign(
        &|tbs: &[u8]| {
            rcgen::SigningKey::sign(key.key_pair(), tbs)
                .map_err(|e| ProfileError::Signing(e.to_string()))
        },
        signature_algorithm_der(key.kind())?,
        &name_der,
        None,
        &subject,
        &name_der,
        Profile::Ca {
            path_len: None,
            permitted_uri_hosts: &[],
        },
        validity,
    )
}

/// [`self_signed_root`] for a key in memory or outside the process (an
/// HSM key's own root).
pub fn self_signed_root_with(
    key: &CaKey,
    name: &SubjectName,
    validity: Validity,
) -> Result<IssuedCert, ProfileError> {
    let subject = SubjectKey::from_spki_der(&key.public_key_spki_der())?;
    let name_der = name.to_der();
    build_and_sign(
        &|tbs: &[u8]| key.sign(tbs),
        signature_algorithm_der(key.kind())?,
        &name_der,
        None,
        &subject,
        &name_der,
        Profile::Ca {
            path_len: None,
            permitted_uri_hosts: &[],
        },
        validity,
    )
}

fn signature_algorithm_der(kind: KeyKind) -> Result<&'static [u8], ProfileError> {
    Ok(match kind {
        // ecdsa-with-SHA256
        KeyKind::EcdsaP256 => &[
            0x30, 0x0a, 0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x02,
        ],
        // ecdsa-with-SHA384
        KeyKind::EcdsaP384 => &[
            0x30, 0x0a, 0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x03,
        ],
        // sha256WithRSAEncryption, NULL parameters
        KeyKind::Rsa(_) => &[
            0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0b, 0x05,
            0x00,
        ],
        // id-Ed25519
        KeyKind::Ed25519 => &[0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70],
        other => return Err(ProfileError::UnsupportedCaKey(other)),
    })
}

/// Bytes of a serial number.
const SERIAL_LEN: usize = 17;

/// Serials drawn from one read of the operating system's random generator.
const SERIALS_PER_FILL: usize = 64;

/// Random bytes from the operating system, read for [`SERIALS_PER_FILL`]
/// serials at a time: one `getrandom` call per 64 certificates instead of
/// one per certificate. Every byte is handed out once and wiped from the
/// pool as it is taken.
struct SerialRandomPool {
    bytes: [u8; SERIAL_LEN * SERIALS_PER_FILL],
    next: usize,
}

impl SerialRandomPool {
    const EMPTY: Self = Self {
        bytes: [0; SERIAL_LEN * SERIALS_PER_FILL],
        next: SERIAL_LEN * SERIALS_PER_FILL,
    };

    fn take(&mut self) -> Result<[u8; SERIAL_LEN], ProfileError> {
        use ring::rand::SecureRandom;
        if self.next == self.bytes.len() {
            ring::rand::SystemRandom::new()
                .fill(&mut self.bytes)
                .map_err(|_| ProfileError::Random)?;
            self.next = 0;
        }
        let taken = &mut self.bytes[self.next..self.next + SERIAL_LEN];
        let mut serial = [0u8; SERIAL_LEN];
        serial.copy_from_slice(taken);
        taken.fill(0);
        self.next += SERIAL_LEN;
        Ok(serial)
    }
}

thread_local! {
    static SERIAL_RANDOM: std::cell::RefCell<SerialRandomPool> =
        const { std::cell::RefCell::new(SerialRandomPool::EMPTY) };
}

/// A random positive serial: 17 bytes, first byte in 1..=0x7f, so at least
/// 128 random bits, never zero, always encoded in 17 bytes. The bytes come
/// from the operating system's generator (through a per-thread pool).
fn random_serial() -> Result<[u8; SERIAL_LEN], ProfileError> {
    let mut serial = SERIAL_RANDOM.with(|pool| pool.borrow_mut().take())?;
    serial[0] &= 0x7f;
    if serial[0] == 0 {
        serial[0] = 1;
    }
    Ok(serial)
}

fn key_usage_bits(bits: &[u8]) -> [u8; 4] {
    // bits are bit positions 0..=7 (digitalSignature = 0, ...).
    let byte = bits.iter().fold(0u8, |acc, b| acc | (0x80 >> b));
    let unused = byte.trailing_zeros().min(7) as u8;
    // BIT STRING, two content octets: the unused-bit count, then the bits.
    [tag::BIT_STRING, 2, unused, byte]
}

const KU_DIGITAL_SIGNATURE: u8 = 0;
const KU_KEY_ENCIPHERMENT: u8 = 2;
const KU_KEY_CERT_SIGN: u8 = 5;
const KU_CRL_SIGN: u8 = 6;

/// Appends the extensions of `profile`, each written in place.
fn write_extensions(
    out: &mut Vec<u8>,
    profile: &Profile<'_>,
    subject: &SubjectKey,
    subject_is_empty: bool,
    issuer_key_identifier: Option<&[u8]>,
) {
    match profile {
        Profile::EndEntity { uris, dns, ips } => {
            der::write_extension_with(out, oid::SUBJECT_ALT_NAME, subject_is_empty, |san| {
                der::write_nested(san, tag::SEQUENCE, |names| {
                    for uri in uris.iter() {
                        der::write_tlv(names, 0x86, uri.as_bytes());
                    }
                    for name in dns.iter() {
                        der::write_tlv(names, 0x82, name.as_bytes());
                    }
                    for ip in ips.iter() {
                        match ip {
                            IpAddr::V4(v4) => der::write_tlv(names, 0x87, &v4.octets()),
                            IpAddr::V6(v6) => der::write_tlv(names, 0x87, &v6.octets()),
                        }
                    }
                });
            });
            der::write_extension(out, oid::BASIC_CONSTRAINTS, true, &[0x30, 0x00]);
            let ku = if subject.kind().is_rsa() {
                key_usage_bits(&[KU_DIGITAL_SIGNATURE, KU_KEY_ENCIPHERMENT])
            } else {
                key_usage_bits(&[KU_DIGITAL_SIGNATURE])
            };
            der::write_extension(out, oid::KEY_USAGE, true, &ku);
            der::write_extension_with(out, oid::EXT_KEY_USAGE, false, |eku| {
                der::write_nested(eku, tag::SEQUENCE, |seq| {
                    der::write_tlv(seq, tag::OID, oid::KP_SERVER_AUTH);
                    der::write_tlv(seq, tag::OID, oid::KP_CLIENT_AUTH);
                });
            });
        }
        Profile::Ca {
            path_len,
            permitted_uri_hosts,
        } => {
            der::write_extension_with(out, oid::BASIC_CONSTRAINTS, true, |bc| {
                der::write_nested(bc, tag::SEQUENCE, |seq| {
                    der::write_tlv(seq, tag::BOOLEAN, &[0xff]);
                    if let Some(len) = path_len {
                        der::write_unsigned_integer(seq, &[*len]);
                    }
                });
            });
            let ku = key_usage_bits(&[KU_KEY_CERT_SIGN, KU_CRL_SIGN]);
            der::write_extension(out, oid::KEY_USAGE, true, &ku);
            if !permitted_uri_hosts.is_empty() {
                der::write_extension_with(out, oid::NAME_CONSTRAINTS, true, |nc| {
                    der::write_nested(nc, tag::SEQUENCE, |seq| {
                        // [0] permittedSubtrees: GeneralSubtree { base
                        // uniformResourceIdentifier [6] }, no min/max.
                        der::write_nested(seq, 0xa0, |permitted| {
                            for host in permitted_uri_hosts.iter() {
                                der::write_nested(permitted, tag::SEQUENCE, |subtree| {
                                    der::write_tlv(subtree, 0x86, host.as_bytes());
                                });
                            }
                        });
                    });
                });
            }
        }
    }
    der::write_extension_with(out, oid::SUBJECT_KEY_IDENTIFIER, false, |ski| {
        der::write_tlv(ski, tag::OCTET_STRING, &subject.key_identifier);
    });
    if let Some(aki_id) = issuer_key_identifier {
        der::write_extension_with(out, oid::AUTHORITY_KEY_IDENTIFIER, false, |aki| {
            der::write_nested(aki, tag::SEQUENCE, |seq| {
                der::write_tlv(seq, 0x80, aki_id);
            });
        });
    }
}

/// What makes the signature of a to-be-signed certificate.
type Signer<'a> = dyn Fn(&[u8]) -> Result<Vec<u8>, ProfileError> + 'a;

#[allow(clippy::too_many_arguments)]
fn build_and_sign(
    sign: &Signer<'_>,
    signature_algorithm: &[u8],
    issuer_name_der: &[u8],
    issuer_key_identifier: Option<&[u8]>,
    subject: &SubjectKey,
    subject_name_der: &[u8],
    profile: Profile<'_>,
    validity: Validity,
) -> Result<IssuedCert, ProfileError> {
    if validity.not_after <= validity.not_before {
        return Err(ProfileError::EmptyValidity {
            not_before: validity.not_before,
            not_after: validity.not_after,
        });
    }
    let serial = random_serial()?;
    let subject_is_empty = subject_name_der == [0x30, 0x00];

    let mut tbs = Vec::with_capacity(512 + subject.spki_der.len());
    der::write_nested(&mut tbs, tag::SEQUENCE, |tbs| {
        der::write_tlv(tbs, 0xa0, &[0x02, 0x01, 0x02]); // version v3
        der::write_unsigned_integer(tbs, &serial);
        tbs.extend_from_slice(signature_algorithm);
        tbs.extend_from_slice(issuer_name_der);
        der::write_nested(tbs, tag::SEQUENCE, |v| {
            der::write_time(v, validity.not_before);
            der::write_time(v, validity.not_after);
        });
        tbs.extend_from_slice(subject_name_der);
        tbs.extend_from_slice(&subject.spki_der);
        der::write_nested(tbs, 0xa3, |exts| {
            der::write_nested(exts, tag::SEQUENCE, |seq| {
                write_extensions(
                    seq,
                    &profile,
                    subject,
                    subject_is_empty,
                    issuer_key_identifier,
                );
            });
        });
    });

    let signature = sign(&tbs)?;
    let mut cert = Vec::with_capacity(tbs.len() + signature.len() + 32);
    der::write_nested(&mut cert, tag::SEQUENCE, |c| {
        c.extend_from_slice(&tbs);
        c.extend_from_slice(signature_algorithm);
        der::write_nested(c, tag::BIT_STRING, |bits| {
            bits.push(0); // no unused bits
            bits.extend_from_slice(&signature);
        });
    });
    Ok(IssuedCert {
        der: cert,
        serial_hex: hex(&serial),
        validity,
    })
}

/// Lowercase hex of bytes, for serials and key identifiers in logs.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        hex.push(char::from(DIGITS[usize::from(byte >> 4)]));
        hex.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    hex
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::KeyAlgorithm;
    use x509_parser::extensions::{GeneralName, ParsedExtension};

    #[test]
    fn hex_is_lowercase_two_digits_per_byte() {
        assert_eq!(hex(&[]), "");
        assert_eq!(hex(&[0x00, 0x0f, 0xa0, 0xff, 0x7e]), "000fa0ff7e");
        let all: Vec<u8> = (0..=255).collect();
        let expected: String = all.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex(&all), expected);
    }

    fn now() -> OffsetDateTime {
        OffsetDateTime::now_utc()
    }

    fn root(alg: KeyAlgorithm) -> SigningCa {
        let key = PrivateKey::generate(alg).unwrap();
        let name = SubjectName {
            organization: Some("Test".into()),
            common_name: Some("Root CA".into()),
            ..Default::default()
        };
        let cert =
            self_signed_root(&key, &name, Validity::backdated(now(), Duration::days(365))).unwrap();
        SigningCa::new(cert.der, key).unwrap()
    }

    fn id() -> SpiffeId {
        SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap()
    }

    #[test]
    fn short_lifetimes_are_backdated_in_proportion() {
        let t = now();
        for (ttl_secs, backdate_secs) in [(86_400, 120), (1_200, 120), (600, 60), (60, 6), (5, 0)] {
            let v = Validity::backdated(t, Duration::seconds(ttl_secs));
            assert_eq!(
                (v.not_after - v.not_before).whole_seconds(),
                ttl_secs + backdate_secs,
                "ttl {ttl_secs}s"
            );
            // Half-life (where ztunnel renews) is after issuance.
            let half_life = v.not_before + v.lifetime() / 2;
            assert!(half_life > t, "ttl {ttl_secs}s: due at issuance");
        }
        let capped =
            Validity::backdated(t, Duration::hours(1)).with_lifetime_at_most(Duration::minutes(30));
        assert_eq!(capped.lifetime(), Duration::minutes(30));
    }

    #[test]
    fn huge_lifetimes_saturate_instead_of_panicking() {
        let t = now();
        // 10000 years, and the largest Duration: both used to panic with
        // "resulting value is out of range" in `now + ttl`.
        for ttl in [Duration::days(10_000 * 366), Duration::MAX] {
            let v = Validity::backdated(t, ttl);
            assert_eq!(v.not_after, Validity::LATEST);
            assert!(v.not_before < t);
            let ca = root(KeyAlgorithm::EcdsaP256);
            let capped = v.capped_at(ca.validity().not_after);
            assert_eq!(capped.not_after, ca.validity().not_after);
            let bounded =
                Validity::backdated(t, Duration::hours(1)).with_lifetime_at_most(Duration::MAX);
            assert_eq!(
                bounded.lifetime(),
                Duration::hours(1) + Duration::minutes(2)
            );
            // The window is signable once capped.
            let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
            ca.issue_workload(&SubjectKey::of(&key).unwrap(), &id(), capped)
                .unwrap();
        }
    }

    #[test]
    fn workload_certificate_follows_the_svid_profile() {
        let ca = root(KeyAlgorithm::EcdsaP256);
        for (alg, rsa) in [
            (KeyAlgorithm::EcdsaP256, false),
            (KeyAlgorithm::Rsa2048, true),
        ] {
            let leaf_key = PrivateKey::generate(alg).unwrap();
            let subject = SubjectKey::of(&leaf_key).unwrap();
            let validity = Validity::backdated(now(), Duration::hours(24));
            let issued = ca.issue_workload(&subject, &id(), validity).unwrap();
            let (rest, cert) = X509Certificate::from_der(&issued.der).unwrap();
            assert!(rest.is_empty());
            assert_eq!(cert.version(), x509_parser::x509::X509Version::V3);
            // Empty subject, so SAN is critical; exactly one URI SAN.
            assert!(cert.subject().as_raw() == [0x30, 0x00]);
            let san = cert.subject_alternative_name().unwrap().unwrap();
            assert!(san.critical);
            assert_eq!(
                san.value.general_names,
                vec![GeneralName::URI(id().as_str())]
            );
            let bc = cert.basic_constraints().unwrap().unwrap();
            assert!(bc.critical && !bc.value.ca);
            let ku = cert.key_usage().unwrap().unwrap();
            assert!(ku.critical);
            assert!(ku.value.digital_signature());
            assert_eq!(ku.value.key_encipherment(), rsa);
            assert!(!ku.value.key_cert_sign() && !ku.value.crl_sign());
            let eku = cert.extended_key_usage().unwrap().unwrap();
            assert!(eku.value.server_auth && eku.value.client_auth);
            let ski = cert
                .extensions()
                .iter()
                .find_map(|e| match e.parsed_extension() {
                    ParsedExtension::SubjectKeyIdentifier(k) => Some(k.0.to_vec()),
                    _ => None,
                });
            assert!(ski.is_some());
            let aki = cert
                .extensions()
                .iter()
                .find_map(|e| match e.parsed_extension() {
                    ParsedExtension::AuthorityKeyIdentifier(a) => {
                        a.key_identifier.as_ref().map(|k| k.0.to_vec())
                    }
                    _ => None,
                });
            assert_eq!(aki.as_deref(), Some(ca.key_identifier.as_slice()));
            // Positive serial with at least 128 bits.
            let serial = cert.raw_serial();
            assert!(serial.len() >= 17 && serial[0] != 0 && serial[0] & 0x80 == 0);
            assert_eq!(
                cert.public_key().raw,
                leaf_key.public_key_spki_der().as_slice()
            );
            assert_eq!(
                cert.validity().not_after.timestamp(),
                validity.not_after.unix_timestamp()
            );
            assert_eq!(
                cert.validity().not_before.timestamp(),
                validity.not_before.unix_timestamp()
            );
            // Signed by the CA.
            let (_, ca_cert) = X509Certificate::from_der(ca.cert_der()).unwrap();
            cert.verify_signature(Some(ca_cert.public_key())).unwrap();
            assert_eq!(cert.issuer().as_raw(), ca_cert.subject().as_raw());
        }
    }

    #[test]
    fn root_and_intermediate_follow_the_ca_profile() {
        for alg in [
            KeyAlgorithm::EcdsaP256,
            KeyAlgorithm::EcdsaP384,
            KeyAlgorithm::Rsa2048,
        ] {
            let root = root(alg);
            let (_, cert) = X509Certificate::from_der(root.cert_der()).unwrap();
            cert.verify_signature(None).unwrap();
            let bc = cert.basic_constraints().unwrap().unwrap();
            assert!(bc.critical && bc.value.ca && bc.value.path_len_constraint.is_none());
            let ku = cert.key_usage().unwrap().unwrap();
            assert!(ku.critical && ku.value.key_cert_sign() && ku.value.crl_sign());
            assert!(!ku.value.digital_signature());

            let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
            let name = SubjectName {
                organization: Some("Test".into()),
                locality: Some("cluster-1".into()),
                common_name: Some("Intermediate CA".into()),
                ..Default::default()
            };
            let issued = root
                .issue_ca(
                    &SubjectKey::of(&key).unwrap(),
                    &name,
                    Some(0),
                    Validity::backdated(now(), Duration::days(30)),
                )
                .unwrap();
            let (_, int) = X509Certificate::from_der(&issued.der).unwrap();
            int.verify_signature(Some(cert.public_key())).unwrap();
            let bc = int.basic_constraints().unwrap().unwrap();
            assert!(bc.value.ca && bc.value.path_len_constraint == Some(0));
            assert!(SigningCa::new(issued.der.clone(), key).is_ok());
        }
    }

    #[test]
    fn signing_ca_checks_key_and_ca_bits() {
        let ca = root(KeyAlgorithm::EcdsaP256);
        let other = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        assert!(matches!(
            SigningCa::new(ca.cert_der().to_vec(), other),
            Err(ProfileError::KeyMismatch)
        ));
        let leaf_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let leaf = ca
            .issue_workload(
                &SubjectKey::of(&leaf_key).unwrap(),
                &id(),
                Validity::backdated(now(), Duration::hours(1)),
            )
            .unwrap();
        assert!(matches!(
            SigningCa::new(leaf.der, leaf_key),
            Err(ProfileError::NotACa)
        ));
        assert!(matches!(
            SigningCa::new(
                vec![1, 2, 3],
                PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap()
            ),
            Err(ProfileError::BadCaCertificate(_))
        ));
    }

    #[test]
    fn serials_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            assert!(seen.insert(random_serial().unwrap()));
        }
    }

    #[test]
    fn the_serial_pool_hands_out_each_byte_once_and_refills() {
        let mut pool = SerialRandomPool::EMPTY;
        let mut seen = std::collections::HashSet::new();
        // Three fills' worth: every serial distinct, and each one wiped
        // from the pool as it is taken.
        for i in 0..3 * SERIALS_PER_FILL {
            let serial = pool.take().unwrap();
            assert!(seen.insert(serial), "serial {i} repeated");
            let taken_at = pool.next - SERIAL_LEN;
            assert!(pool.bytes[taken_at..pool.next].iter().all(|b| *b == 0));
        }
        assert_eq!(pool.next, pool.bytes.len());
        // Serials differ between threads, which have pools of their own.
        let other = std::thread::spawn(|| random_serial().unwrap())
            .join()
            .unwrap();
        assert!(!seen.contains(&other));
    }

    #[test]
    fn server_certificate_has_dns_and_ip() {
        let ca = root(KeyAlgorithm::EcdsaP256);
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let issued = ca
            .issue_server(
                &SubjectKey::of(&key).unwrap(),
                &["localhost".to_string()],
                &["127.0.0.1".parse().unwrap()],
                Validity::backdated(now(), Duration::hours(1)),
            )
            .unwrap();
        let (_, cert) = X509Certificate::from_der(&issued.der).unwrap();
        let san = cert.subject_alternative_name().unwrap().unwrap();
        assert_eq!(
            san.value.general_names,
            vec![
                GeneralName::DNSName("localhost"),
                GeneralName::IPAddress(&[127, 0, 0, 1])
            ]
        );
    }

    #[test]
    fn empty_validity_is_refused() {
        let ca = root(KeyAlgorithm::EcdsaP256);
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let t = now();
        let v = Validity {
            not_before: t,
            not_after: t,
        };
        assert!(matches!(
            ca.issue_workload(&SubjectKey::of(&key).unwrap(), &id(), v),
            Err(ProfileError::EmptyValidity { .. })
        ));
    }
}
