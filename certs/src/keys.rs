//! Private keys: generation ([`KeyAlgorithm`]), loading from PEM in the
//! formats operators actually have (PKCS#8, SEC1 `EC PRIVATE KEY`, PKCS#1
//! `RSA PRIVATE KEY`), and the description of a public key ([`KeyKind`]).
//!
//! Keys are held as [`rcgen::KeyPair`] (ring underneath). ring cannot make
//! RSA keys, so RSA generation uses the `rsa` crate and hands the PKCS#8
//! bytes to ring; only generation touches that crate.

use std::fmt;
use std::str::FromStr;

use pkcs8::der::{Decode, Encode};
use rcgen::{KeyPair, SignatureAlgorithm};
use x509_parser::prelude::FromDer;
use x509_parser::public_key::PublicKey;
use x509_parser::x509::SubjectPublicKeyInfo;

/// Errors from generating, loading or describing keys.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// An unknown key algorithm name was given.
    #[error("unknown key algorithm {0:?}: use one of ecdsa-p256, ecdsa-p384, rsa-2048, rsa-3072, rsa-4096")]
    UnknownAlgorithm(String),
    /// Key generation failed in the crypto library.
    #[error("generating a {algorithm} key failed: {reason}")]
    Generate {
        /// The algorithm asked for.
        algorithm: KeyAlgorithm,
        /// What the crypto library said.
        reason: String,
    },
    /// The input is not PEM or holds no private key block.
    #[error(
        "no private key found: expected a PEM block PRIVATE KEY, EC PRIVATE KEY or RSA PRIVATE KEY"
    )]
    NoPrivateKey,
    /// The PEM is encrypted; meshca needs an unencrypted key.
    #[error("the private key is encrypted; decrypt it first (e.g. openssl pkey -in key.pem -out key-plain.pem)")]
    Encrypted,
    /// The key's DER could not be parsed or its algorithm is not supported.
    #[error(
        "unsupported or malformed private key: {0} (supported: ECDSA P-256/P-384, RSA 2048-8192)"
    )]
    Unsupported(String),
}

/// A key algorithm meshca can generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KeyAlgorithm {
    /// ECDSA on P-256 with SHA-256 (the default, as in Istio and ztunnel).
    #[default]
    EcdsaP256,
    /// ECDSA on P-384 with SHA-384.
    EcdsaP384,
    /// RSA 2048 bits, PKCS#1 v1.5 with SHA-256.
    Rsa2048,
    /// RSA 3072 bits.
    Rsa3072,
    /// RSA 4096 bits.
    Rsa4096,
}

impl KeyAlgorithm {
    /// Every algorithm, in the order the CLI lists them.
    #[cfg(test)]
    pub(crate) const ALL: [KeyAlgorithm; 5] = [
        Self::EcdsaP256,
        Self::EcdsaP384,
        Self::Rsa2048,
        Self::Rsa3072,
        Self::Rsa4096,
    ];

    /// The name used on command lines (`ecdsa-p256`, `rsa-2048`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::EcdsaP256 => "ecdsa-p256",
            Self::EcdsaP384 => "ecdsa-p384",
            Self::Rsa2048 => "rsa-2048",
            Self::Rsa3072 => "rsa-3072",
            Self::Rsa4096 => "rsa-4096",
        }
    }

    fn rsa_bits(self) -> Option<usize> {
        match self {
            Self::Rsa2048 => Some(2048),
            Self::Rsa3072 => Some(3072),
            Self::Rsa4096 => Some(4096),
            _ => None,
        }
    }
}

impl fmt::Display for KeyAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KeyAlgorithm {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let normalized = s.to_ascii_lowercase().replace('_', "-");
        let alg = match normalized.as_str() {
            "ecdsa-p256" | "p256" | "ec-p256" | "ecdsa" | "ec" => Self::EcdsaP256,
            "ecdsa-p384" | "p384" | "ec-p384" => Self::EcdsaP384,
            "rsa-2048" | "rsa2048" | "rsa" => Self::Rsa2048,
            "rsa-3072" | "rsa3072" => Self::Rsa3072,
            "rsa-4096" | "rsa4096" => Self::Rsa4096,
            _ => return Err(KeyError::UnknownAlgorithm(s.to_string())),
        };
        Ok(alg)
    }
}

/// A private key with its signature algorithm. `Debug` prints no key bytes.
pub struct PrivateKey {
    key_pair: KeyPair,
    kind: KeyKind,
}

impl PrivateKey {
    /// Generates a fresh key.
    pub fn generate(algorithm: KeyAlgorithm) -> Result<Self, KeyError> {
        let gen_err = |reason: String| KeyError::Generate { algorithm, reason };
        let key_pair = match algorithm {
            KeyAlgorithm::EcdsaP256 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
                .map_err(|e| gen_err(e.to_string()))?,
            KeyAlgorithm::EcdsaP384 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384)
                .map_err(|e| gen_err(e.to_string()))?,
            rsa_alg => {
                let bits = rsa_alg.rsa_bits().unwrap_or(2048);
                let mut rng = rand_core::OsRng;
                let key =
                    rsa::RsaPrivateKey::new(&mut rng, bits).map_err(|e| gen_err(e.to_string()))?;
                use rsa::pkcs8::EncodePrivateKey;
                let der = key.to_pkcs8_der().map_err(|e| gen_err(e.to_string()))?;
                KeyPair::from_pkcs8_der_and_sign_algo(
                    &der.as_bytes().into(),
                    &rcgen::PKCS_RSA_SHA256,
                )
                .map_err(|e| gen_err(e.to_string()))?
            }
        };
        Self::from_key_pair(key_pair).map_err(|e| gen_err(e.to_string()))
    }

    /// Loads a key from PEM: `PRIVATE KEY` (PKCS#8), `EC PRIVATE KEY` (SEC1)
    /// or `RSA PRIVATE KEY` (PKCS#1). Other blocks (e.g. `EC PARAMETERS`
    /// before the key, as `openssl ecparam -genkey` writes) are skipped.
    pub fn from_pem(pem_text: &str) -> Result<Self, KeyError> {
        let blocks = pem::parse_many(pem_text).map_err(|_| KeyError::NoPrivateKey)?;
        for block in blocks {
            let pkcs8 = match block.tag() {
                "PRIVATE KEY" => block.contents().to_vec(),
                "EC PRIVATE KEY" => sec1_to_pkcs8(block.contents())?,
                "RSA PRIVATE KEY" => pkcs1_to_pkcs8(block.contents())?,
                "ENCRYPTED PRIVATE KEY" => return Err(KeyError::Encrypted),
                _ => continue,
            };
            return Self::from_pkcs8_der(&pkcs8);
        }
        Err(KeyError::NoPrivateKey)
    }

    /// Loads a key from PKCS#8 DER.
    pub fn from_pkcs8_der(der: &[u8]) -> Result<Self, KeyError> {
        let alg = pkcs8_signature_algorithm(der)?;
        let key_pair = KeyPair::from_pkcs8_der_and_sign_algo(&der.into(), alg)
            .map_err(|e| KeyError::Unsupported(e.to_string()))?;
        Self::from_key_pair(key_pair)
    }

    fn from_key_pair(key_pair: KeyPair) -> Result<Self, KeyError> {
        let spki = rcgen::PublicKeyData::subject_public_key_info(&key_pair);
        let kind = KeyKind::from_spki_der(&spki)?;
        Ok(Self { key_pair, kind })
    }

    /// The key as PKCS#8 PEM (`PRIVATE KEY`). Handle with care.
    pub fn to_pkcs8_pem(&self) -> String {
        self.key_pair.serialize_pem()
    }

    /// The key as PKCS#8 DER. Handle with care.
    pub fn to_pkcs8_der(&self) -> Vec<u8> {
        self.key_pair.serialize_der()
    }

    /// The DER SubjectPublicKeyInfo of the public half.
    pub fn public_key_spki_der(&self) -> Vec<u8> {
        rcgen::PublicKeyData::subject_public_key_info(&self.key_pair)
    }

    /// What kind of key this is.
    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    /// The rcgen key pair, for signing.
    pub fn key_pair(&self) -> &KeyPair {
        &self.key_pair
    }
}

impl fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrivateKey")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

/// The rule on RSA public exponents, as refusals word it.
pub const RSA_EXPONENT_RULE: &str = "RSA public exponent must be odd and at least 65537";

/// A public key of an accepted type and size that breaks one of meshca's
/// other key rules. The CA refuses such a key on every path that takes one
/// (CSRs to `CreateCertificate`, pod certificate requests).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyPolicyError {
    /// The RSA public exponent is even (no such key can sign) or smaller
    /// than 65537 (e = 3 keys are open to the small-exponent attacks on
    /// unpadded or badly padded messages; common policy, FIPS 186-5 and
    /// the CA/Browser Forum's, asks for at least 65537).
    #[error("{RSA_EXPONENT_RULE} (this key's is {exponent})")]
    WeakRsaExponent {
        /// The exponent as a person reads it (decimal, or its size when
        /// it does not fit in 64 bits).
        exponent: String,
    },
}

/// Checks the key rules beyond type and size ([`KeyPolicyError`]): an RSA
/// key's public exponent must be odd and at least 65537. Keys of other
/// types, and RSA keys whose parameters do not parse (which the type check
/// refuses), pass.
pub(crate) fn check_key_policy(spki: &SubjectPublicKeyInfo<'_>) -> Result<(), KeyPolicyError> {
    match spki.parsed() {
        Ok(PublicKey::RSA(rsa)) => check_rsa_exponent(rsa.exponent),
        _ => Ok(()),
    }
}

/// The RSA exponent rule on a big-endian unsigned exponent.
fn check_rsa_exponent(big_endian: &[u8]) -> Result<(), KeyPolicyError> {
    const F4: [u8; 3] = [0x01, 0x00, 0x01];
    let digits = match big_endian.iter().position(|&b| b != 0) {
        Some(first) => &big_endian[first..],
        None => &[][..],
    };
    let odd = digits.last().is_some_and(|b| b & 1 == 1);
    // Without leading zeros, a longer number is a larger one; of equal
    // length, big-endian bytes compare as the numbers do.
    let large_enough = digits.len() > F4.len() || (digits.len() == F4.len() && digits >= &F4[..]);
    if odd && large_enough {
        return Ok(());
    }
    let exponent = if digits.len() <= 8 {
        digits
            .iter()
            .fold(0u64, |n, &b| (n << 8) | u64::from(b))
            .to_string()
    } else {
        format!("an even {}-byte number", digits.len())
    };
    Err(KeyPolicyError::WeakRsaExponent { exponent })
}

/// What a public key is: algorithm and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyKind {
    /// ECDSA on P-256.
    EcdsaP256,
    /// ECDSA on P-384.
    EcdsaP384,
    /// ECDSA on another curve (e.g. P-521).
    EcdsaOther,
    /// RSA with a modulus of this many bits.
    Rsa(usize),
    /// Ed25519.
    Ed25519,
    /// Anything else (DSA, unknown OIDs).
    Other,
}

impl KeyKind {
    /// Describes the key in a DER SubjectPublicKeyInfo.
    pub(crate) fn from_spki_der(spki_der: &[u8]) -> Result<Self, KeyError> {
        let (_, spki) = SubjectPublicKeyInfo::from_der(spki_der)
            .map_err(|e| KeyError::Unsupported(format!("bad SubjectPublicKeyInfo: {e}")))?;
        Ok(Self::from_spki(&spki))
    }

    /// Describes a parsed SubjectPublicKeyInfo.
    pub(crate) fn from_spki(spki: &SubjectPublicKeyInfo<'_>) -> Self {
        use x509_parser::oid_registry::{
            OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_NIST_EC_P384, OID_PKCS1_RSAENCRYPTION,
            OID_SIG_ED25519,
        };
        let alg = &spki.algorithm.algorithm;
        if *alg == OID_KEY_TYPE_EC_PUBLIC_KEY {
            let curve = spki
                .algorithm
                .parameters
                .as_ref()
                .and_then(|p| p.as_oid().ok());
            match curve {
                Some(c) if c == OID_EC_P256 => Self::EcdsaP256,
                Some(c) if c == OID_NIST_EC_P384 => Self::EcdsaP384,
                _ => Self::EcdsaOther,
            }
        } else if *alg == OID_PKCS1_RSAENCRYPTION {
            match spki.parsed() {
                Ok(PublicKey::RSA(rsa)) => Self::Rsa(rsa.key_size()),
                _ => Self::Other,
            }
        } else if *alg == OID_SIG_ED25519 {
            Self::Ed25519
        } else {
            Self::Other
        }
    }

    /// Whether meshca accepts this key in a CSR: ECDSA P-256 or P-384, RSA
    /// 2048–8192 bits, Ed25519.
    pub(crate) fn is_acceptable_for_workload(self) -> bool {
        match self {
            Self::EcdsaP256 | Self::EcdsaP384 | Self::Ed25519 => true,
            Self::Rsa(bits) => (2048..=8192).contains(&bits),
            Self::EcdsaOther | Self::Other => false,
        }
    }

    /// Whether this is an RSA key (workload certs then also get keyEncipherment).
    pub(crate) fn is_rsa(self) -> bool {
        matches!(self, Self::Rsa(_))
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EcdsaP256 => f.write_str("ECDSA P-256"),
            Self::EcdsaP384 => f.write_str("ECDSA P-384"),
            Self::EcdsaOther => f.write_str("ECDSA (unsupported curve)"),
            Self::Rsa(bits) => write!(f, "RSA {bits}"),
            Self::Ed25519 => f.write_str("Ed25519"),
            Self::Other => f.write_str("unknown key type"),
        }
    }
}

/// The signature algorithm rcgen should use for a PKCS#8 key.
fn pkcs8_signature_algorithm(der: &[u8]) -> Result<&'static SignatureAlgorithm, KeyError> {
    let info = pkcs8::PrivateKeyInfo::from_der(der)
        .map_err(|e| KeyError::Unsupported(format!("bad PKCS#8: {e}")))?;
    let oid = info.algorithm.oid.to_string();
    match oid.as_str() {
        // id-ecPublicKey
        "1.2.840.10045.2.1" => {
            let curve = info
                .algorithm
                .parameters_oid()
                .map_err(|_| KeyError::Unsupported("EC key without a named curve".into()))?
                .to_string();
            match curve.as_str() {
                "1.2.840.10045.3.1.7" => Ok(&rcgen::PKCS_ECDSA_P256_SHA256),
                "1.3.132.0.34" => Ok(&rcgen::PKCS_ECDSA_P384_SHA384),
                other => Err(KeyError::Unsupported(format!("EC curve {other}"))),
            }
        }
        // rsaEncryption
        "1.2.840.113549.1.1.1" => Ok(&rcgen::PKCS_RSA_SHA256),
        // id-Ed25519
        "1.3.101.112" => Ok(&rcgen::PKCS_ED25519),
        other => Err(KeyError::Unsupported(format!("key algorithm {other}"))),
    }
}

/// Wraps a SEC1 `ECPrivateKey` in PKCS#8, which is what ring reads.
fn sec1_to_pkcs8(sec1_der: &[u8]) -> Result<Vec<u8>, KeyError> {
    let ec = sec1::EcPrivateKey::from_der(sec1_der)
        .map_err(|e| KeyError::Unsupported(format!("bad EC PRIVATE KEY: {e}")))?;
    // The curve is normally in the key's parameters; keys taken out of a
    // PKCS#8 wrapper may lack them, and then the scalar length tells.
    let curve = match ec.parameters.and_then(|p| p.named_curve()) {
        Some(curve) => curve,
        None => match ec.private_key.len() {
            32 => pkcs8::ObjectIdentifier::new_unwrap("1.2.840.10045.3.1.7"),
            48 => pkcs8::ObjectIdentifier::new_unwrap("1.3.132.0.34"),
            _ => {
                return Err(KeyError::Unsupported(
                    "EC PRIVATE KEY without a named curve".into(),
                ))
            }
        },
    };
    if ec.public_key.is_none() {
        return Err(KeyError::Unsupported(
            "EC PRIVATE KEY without its public key (re-export it with openssl pkey)".into(),
        ));
    }
    let info = pkcs8::PrivateKeyInfo {
        algorithm: pkcs8::AlgorithmIdentifierRef {
            oid: pkcs8::ObjectIdentifier::new_unwrap("1.2.840.10045.2.1"),
            parameters: Some(pkcs8::der::asn1::AnyRef::from(&curve)),
        },
        private_key: sec1_der,
        public_key: None,
    };
    info.to_der()
        .map_err(|e| KeyError::Unsupported(format!("re-encoding EC key: {e}")))
}

/// Converts a PKCS#1 `RSAPrivateKey` to PKCS#8.
fn pkcs1_to_pkcs8(pkcs1_der: &[u8]) -> Result<Vec<u8>, KeyError> {
    use rsa::pkcs1::DecodeRsaPrivateKey;
    use rsa::pkcs8::EncodePrivateKey;
    let key = rsa::RsaPrivateKey::from_pkcs1_der(pkcs1_der)
        .map_err(|e| KeyError::Unsupported(format!("bad RSA PRIVATE KEY: {e}")))?;
    Ok(key
        .to_pkcs8_der()
        .map_err(|e| KeyError::Unsupported(format!("re-encoding RSA key: {e}")))?
        .as_bytes()
        .to_vec())
}

/// RSA keys of any public exponent for tests (ring loads no RSA private key
/// with an exponent below 65537, so [`PrivateKey`] cannot hold them).
#[cfg(test)]
pub(crate) mod test_rsa {
    /// An RSA key from the `rsa` crate, usable as an rcgen signer.
    pub(crate) struct RsaTestKey {
        pub(crate) key: rsa::RsaPrivateKey,
        pkcs1_public: Vec<u8>,
    }

    impl RsaTestKey {
        /// A fresh key of `bits` with public exponent `exponent`.
        pub(crate) fn generate(bits: usize, exponent: u32) -> Self {
            use rsa::pkcs1::EncodeRsaPublicKey;
            let key = rsa::RsaPrivateKey::new_with_exp(
                &mut rand_core::OsRng,
                bits,
                &rsa::BigUint::from(exponent),
            )
            .unwrap();
            let pkcs1_public = key.to_public_key().to_pkcs1_der().unwrap().into_vec();
            Self { key, pkcs1_public }
        }

        /// The DER SubjectPublicKeyInfo.
        pub(crate) fn spki_der(&self) -> Vec<u8> {
            use rsa::pkcs8::EncodePublicKey;
            self.key
                .to_public_key()
                .to_public_key_der()
                .unwrap()
                .into_vec()
        }

        /// A DER CSR signed by this key, with `uri` as URI SAN if given.
        pub(crate) fn csr_der(&self, uri: Option<&str>) -> Vec<u8> {
            let mut params = rcgen::CertificateParams::default();
            params.distinguished_name = rcgen::DistinguishedName::new();
            if let Some(uri) = uri {
                params.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into().unwrap())];
            }
            params.serialize_request(self).unwrap().der().to_vec()
        }
    }

    impl rcgen::PublicKeyData for RsaTestKey {
        fn der_bytes(&self) -> &[u8] {
            &self.pkcs1_public
        }
        fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
            &rcgen::PKCS_RSA_SHA256
        }
    }

    impl rcgen::SigningKey for RsaTestKey {
        fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
            use rsa::signature::{SignatureEncoding, Signer};
            let signer = rsa::pkcs1v15::SigningKey::<rsa::sha2::Sha256>::new(self.key.clone());
            Ok(signer.sign(msg).to_vec())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_each_algorithm_and_round_trips_pem() {
        for alg in [
            KeyAlgorithm::EcdsaP256,
            KeyAlgorithm::EcdsaP384,
            KeyAlgorithm::Rsa2048,
        ] {
            let key = PrivateKey::generate(alg).unwrap();
            let expected = match alg {
                KeyAlgorithm::EcdsaP256 => KeyKind::EcdsaP256,
                KeyAlgorithm::EcdsaP384 => KeyKind::EcdsaP384,
                _ => KeyKind::Rsa(2048),
            };
            assert_eq!(key.kind(), expected);
            let again = PrivateKey::from_pem(&key.to_pkcs8_pem()).unwrap();
            assert_eq!(again.public_key_spki_der(), key.public_key_spki_der());
            assert!(!format!("{key:?}").contains("BEGIN"));
        }
    }

    #[test]
    fn loads_sec1_ec_keys() {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let der = key.to_pkcs8_der();
        let info = pkcs8::PrivateKeyInfo::from_der(&der).unwrap();
        let sec1_pem = pem::encode(&pem::Pem::new("EC PRIVATE KEY", info.private_key.to_vec()));
        let text = format!("-----BEGIN EC PARAMETERS-----\nBggqhkjOPQMBBw==\n-----END EC PARAMETERS-----\n{sec1_pem}");
        let loaded = PrivateKey::from_pem(&text).unwrap();
        assert_eq!(loaded.public_key_spki_der(), key.public_key_spki_der());
    }

    #[test]
    fn loads_pkcs1_rsa_keys() {
        use rsa::pkcs1::EncodeRsaPrivateKey;
        let key = rsa::RsaPrivateKey::new(&mut rand_core::OsRng, 2048).unwrap();
        let pem_text = key.to_pkcs1_pem(Default::default()).unwrap();
        let loaded = PrivateKey::from_pem(&pem_text).unwrap();
        assert_eq!(loaded.kind(), KeyKind::Rsa(2048));
    }

    #[test]
    fn rejects_garbage_and_encrypted() {
        assert!(matches!(
            PrivateKey::from_pem("hello"),
            Err(KeyError::NoPrivateKey)
        ));
        let enc = pem::encode(&pem::Pem::new("ENCRYPTED PRIVATE KEY", vec![1, 2, 3]));
        assert!(matches!(
            PrivateKey::from_pem(&enc),
            Err(KeyError::Encrypted)
        ));
        let bad = pem::encode(&pem::Pem::new("PRIVATE KEY", vec![1, 2, 3]));
        assert!(matches!(
            PrivateKey::from_pem(&bad),
            Err(KeyError::Unsupported(_))
        ));
    }

    #[test]
    fn key_algorithm_names() {
        for alg in KeyAlgorithm::ALL {
            assert_eq!(alg.name().parse::<KeyAlgorithm>().unwrap(), alg);
        }
        assert!("dsa-1024".parse::<KeyAlgorithm>().is_err());
    }

    fn policy_of(spki_der: &[u8]) -> Result<(), KeyPolicyError> {
        let (_, spki) = SubjectPublicKeyInfo::from_der(spki_der).unwrap();
        check_key_policy(&spki)
    }

    #[test]
    fn rsa_exponent_rule_on_real_keys() {
        use test_rsa::RsaTestKey;
        let f4 = RsaTestKey::generate(2048, 65537);
        assert_eq!(policy_of(&f4.spki_der()), Ok(()));
        let e3 = RsaTestKey::generate(2048, 3);
        let refused = policy_of(&e3.spki_der()).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "RSA public exponent must be odd and at least 65537 (this key's is 3)"
        );
        // An even exponent makes no working key, but its public half can be
        // written down: the modulus of a real key with e = 65538.
        let even = rsa::RsaPublicKey::new_unchecked(
            rsa::traits::PublicKeyParts::n(&f4.key).clone(),
            rsa::BigUint::from(65538u32),
        );
        let even_der = {
            use rsa::pkcs8::EncodePublicKey;
            even.to_public_key_der().unwrap().as_bytes().to_vec()
        };
        let refused = policy_of(&even_der).unwrap_err();
        assert!(
            refused.to_string().contains("this key's is 65538"),
            "{refused}"
        );
        // Other key types are not affected.
        let p256 = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        assert_eq!(policy_of(&p256.public_key_spki_der()), Ok(()));
    }

    #[test]
    fn rsa_exponent_rule_on_the_numbers() {
        let ok = |e: &[u8]| check_rsa_exponent(e).is_ok();
        assert!(ok(&[0x01, 0x00, 0x01]));
        assert!(
            ok(&[0x00, 0x01, 0x00, 0x01]),
            "a leading zero changes nothing"
        );
        assert!(ok(&[0x01, 0x00, 0x03]));
        assert!(ok(&[0x01, 0x00, 0x00, 0x01]));
        assert!(ok(&[0xff; 40]), "large odd exponents are allowed");
        assert!(!ok(&[0x03]));
        assert!(!ok(&[0x00, 0xff, 0xff]), "65535 is below 65537");
        assert!(!ok(&[0x01, 0x00, 0x00]), "65536 is even");
        assert!(!ok(&[0x01, 0x00, 0x00, 0x00]), "large but even");
        assert!(!ok(&[]), "zero");
        assert!(!ok(&[0x00, 0x00]), "zero with leading zeros");
        let big_even = check_rsa_exponent(&[0x02; 12]).unwrap_err();
        assert!(
            big_even.to_string().contains("an even 12-byte number"),
            "{big_even}"
        );
    }

    #[test]
    fn workload_key_policy() {
        assert!(KeyKind::EcdsaP256.is_acceptable_for_workload());
        assert!(KeyKind::Rsa(2048).is_acceptable_for_workload());
        assert!(KeyKind::Rsa(8192).is_acceptable_for_workload());
        assert!(!KeyKind::Rsa(1024).is_acceptable_for_workload());
        assert!(!KeyKind::Rsa(16384).is_acceptable_for_workload());
        assert!(!KeyKind::EcdsaOther.is_acceptable_for_workload());
        assert!(!KeyKind::Other.is_acceptable_for_workload());
    }
}
