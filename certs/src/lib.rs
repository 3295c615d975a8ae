//! # meshca-certs
//!
//! The X.509 and SPIFFE toolkit that the meshca CA (`meshca-ca`) and agent
//! library (`meshca-client`) are built on, and the `meshca-certs` CLI.
//!
//! - [`spiffe`]: [`TrustDomain`] and [`SpiffeId`], validated by the SPIFFE rules;
//! - [`keys`]: key generation (ECDSA P-256/P-384, RSA 2048/3072/4096) and loading;
//! - [`csr`]: building CSRs and verifying them (proof of possession, key policy);
//! - [`profile`]: the workload (X509-SVID), server and CA certificate profiles,
//!   and [`SigningCa`], which issues them;
//! - [`verify`]: SVID chain verification to a [`TrustBundle`], CA chain checks;
//! - [`bundle`]: PEM bundles and atomic file writes;
//! - [`answer`]: the shape of a CA answer's chain, `[leaf, intermediates…, roots]`;
//! - [`cadir`]: CA directories (Istio's `cacerts` layout and others), loaded and checked;
//! - [`inspect`]: what a certificate says;
//! - [`pod_certificate`]: Kubernetes pod certificates: signer names, the
//!   pod's key and its proof of possession, as kube-apiserver checks them;
//! - [`token`]: Kubernetes-style service-account tokens and the local issuer.
//!
//! Public is only what other crates use (`meshca-ca`, `meshca-client`, the
//! `meshca-certs` CLI, the benchmarks, tests and fuzz targets) and the types
//! their signatures name; the helpers behind them are `pub(crate)`.
//!
//! ```
//! use meshca_certs::{build_csr, KeyAlgorithm, PrivateKey, SpiffeId, VerifiedCsr};
//!
//! let id = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web")?;
//! let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256)?;
//! let csr = VerifiedCsr::from_pem(&build_csr(&key, &id)?)?;
//! assert_eq!(csr.uri_sans(), &[id]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod answer;
pub mod bundle;
pub mod cadir;
pub mod csr;
mod der;
pub mod inspect;
pub mod keys;
pub mod pod_certificate;
pub mod profile;
pub mod spiffe;
pub mod token;
pub mod verify;

pub use csr::{build_csr, CsrError, VerifiedCsr};
pub use keys::{KeyAlgorithm, KeyKind, PrivateKey};
pub use profile::{IssuedCert, SigningCa, SubjectKey, SubjectName, Validity};
pub use spiffe::{SpiffeId, SpiffeIdError, TrustDomain};
pub use verify::{TrustBundle, VerifiedSvid, VerifyError};

/// The longest duration [`parse_duration`] accepts: 100 years (of 365.25
/// days, as humantime counts `100y`). Longer values are certainly typos,
/// and every time computed from a flag stays far inside what X.509 and
/// `time` can represent.
pub const MAX_DURATION: std::time::Duration = std::time::Duration::from_secs(36_525 * 86_400);

/// Parses a duration written like `30s`, `15m`, `24h`, `90d` (also `1h30m`),
/// at most [`MAX_DURATION`] (100 years). Used as a clap value parser, so
/// clap's message names the flag.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|e| format!("invalid duration {text:?}: {e} (write e.g. 30s, 15m, 24h, 90d)"))?;
    if d > MAX_DURATION {
        return Err(format!(
            "duration {text:?} is too long: at most 100 years (36525d)"
        ));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_over_a_hundred_years_are_refused() {
        assert_eq!(
            parse_duration("90d"),
            Ok(std::time::Duration::from_secs(90 * 86_400))
        );
        assert_eq!(parse_duration("100y"), Ok(MAX_DURATION));
        let err = parse_duration("10000y").unwrap_err();
        assert!(err.contains("10000y") && err.contains("too long"), "{err}");
        assert!(parse_duration("36526d").is_err());
    }
}
