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
//! What the CA's and the agent's servers share (HTTP/2 stream activity,
//! rate-limited logs, heap trimming) is in `meshca-serve`.
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
pub mod crl;
pub mod csr;
mod der;
pub mod inspect;
pub mod keys;
#[cfg(feature = "pkcs11")]
pub mod pkcs11;
pub mod pod_certificate;
pub mod profile;
pub mod revocation;
pub mod spiffe;
pub mod token;
pub mod untrusted_text;
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

/// A time as people and scripts read it: RFC 3339 in UTC to the second,
/// `2028-12-01T02:47:56Z` (what `time`'s own Display, `2028-12-01
/// 2:47:56.0 +00:00:00`, is not). For text output and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rfc3339(pub time::OffsetDateTime);

impl std::fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.0.to_offset(time::UtcOffset::UTC);
        write!(
            f,
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        )
    }
}

/// An error and every error in its `source()` chain, joined with ": ",
/// each text once (a cause whose text the message so far already ends
/// with is left out). For wrapping a third-party error whose message
/// leaves the details to its sources (tonic, hyper, kube) into a message
/// of ours: the workspace's errors say their cause in their message and
/// do not also expose it as `source()`.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !text.is_empty() && !message.ends_with(&text) {
            message = format!("{message}: {text}");
        }
        next = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_print_as_rfc3339_utc() {
        let t = time::macros::datetime!(2028-12-01 2:47:56.5 +01:00);
        assert_eq!(Rfc3339(t).to_string(), "2028-12-01T01:47:56Z");
    }

    #[test]
    fn error_chains_print_each_cause_once() {
        let e = std::io::Error::other("disk on fire");
        assert_eq!(error_chain(&e), "disk on fire");
        let read = bundle::read_certs_file(std::path::Path::new("/nonexistent/x.pem")).unwrap_err();
        // The message says the cause once and does not hand it out again
        // as a source (anyhow's `{:#}` would print it a second time).
        let text = error_chain(&read);
        assert_eq!(text.matches("No such file").count(), 1, "{text}");
        assert_eq!(text.matches("/nonexistent/x.pem").count(), 1, "{text}");
        assert!(std::error::Error::source(&read).is_none());
    }

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
