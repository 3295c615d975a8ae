//! `--pkcs11 URI`: CA keys made and used inside a PKCS#11 token.

use meshca_certs::profile::CaKey;
use meshca_certs::KeyAlgorithm;

#[cfg(feature = "pkcs11")]
mod imp {
    use std::sync::Arc;

    use super::*;
    use anyhow::Context;
    use meshca_certs::pkcs11::{HsmKey, KeyProtection, Pkcs11Uri, SessionLimits};

    fn parse(flag: &str, uri: &str) -> anyhow::Result<Pkcs11Uri> {
        uri.parse::<Pkcs11Uri>().with_context(|| flag.to_string())
    }

    /// A new key inside the token the URI names, labelled by its `object`.
    pub(crate) fn generate(flag: &str, uri: &str, alg: KeyAlgorithm) -> anyhow::Result<CaKey> {
        let uri = parse(flag, uri)?;
        let key = HsmKey::generate(&uri, alg, SessionLimits::default())
            .with_context(|| format!("{flag}: generating a {alg} key in the token"))?;
        Ok(CaKey::External(Arc::new(key)))
    }

    /// The existing key the URI names.
    pub(crate) fn open(flag: &str, uri: &str) -> anyhow::Result<CaKey> {
        let uri = parse(flag, uri)?;
        let key = HsmKey::open(&uri, SessionLimits::default()).with_context(|| flag.to_string())?;
        Ok(CaKey::External(Arc::new(key)))
    }

    /// How the token protects the key, as words: `sensitive, never
    /// extractable`.
    pub(crate) fn protection(flag: &str, uri: &str) -> anyhow::Result<(Vec<u8>, String)> {
        let uri = parse(flag, uri)?;
        let key = HsmKey::open(&uri, SessionLimits::default()).with_context(|| flag.to_string())?;
        let KeyProtection {
            sensitive,
            extractable,
            always_sensitive,
            never_extractable,
        } = key.protection().with_context(|| flag.to_string())?;
        let mut words = vec![];
        words.push(if sensitive {
            "sensitive"
        } else {
            "NOT sensitive"
        });
        words.push(if extractable {
            "EXTRACTABLE"
        } else {
            "not extractable"
        });
        if always_sensitive {
            words.push("always sensitive");
        }
        if never_extractable {
            words.push("never extractable");
        }
        Ok((key.public_key_spki_der().to_vec(), words.join(", ")))
    }
}

#[cfg(not(feature = "pkcs11"))]
mod imp {
    use super::*;

    fn unsupported<T>(flag: &str) -> anyhow::Result<T> {
        anyhow::bail!("{flag}: this meshca-certs was built without PKCS#11 support (cargo feature `pkcs11` of meshca-certs)")
    }

    pub(crate) fn generate(flag: &str, _uri: &str, _alg: KeyAlgorithm) -> anyhow::Result<CaKey> {
        unsupported(flag)
    }

    pub(crate) fn open(flag: &str, _uri: &str) -> anyhow::Result<CaKey> {
        unsupported(flag)
    }

    pub(crate) fn protection(flag: &str, _uri: &str) -> anyhow::Result<(Vec<u8>, String)> {
        unsupported(flag)
    }
}

pub(crate) use imp::{generate, open, protection};
