//! The server's own TLS identity: a certificate the CA issues to itself
//! (a fresh P-256 key, the `--server-dns` names and the loopback
//! addresses), held in a resolver the listener's rustls configuration asks
//! on every handshake, and renewed at half its life or at once when the CA
//! material changes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use meshca_certs::keys::{KeyAlgorithm, PrivateKey};
use meshca_certs::profile::{ProfileError, SubjectKey};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use time::OffsetDateTime;

use crate::authority::{Authority, SignError};

/// Lifetime of the server's own certificate.
pub(crate) const SERVER_CERT_TTL: Duration = Duration::from_secs(24 * 3600);
/// Wait before retrying a failed renewal.
const RENEW_RETRY: Duration = Duration::from_secs(30);

/// Errors building the server's TLS identity.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The CA could not issue the server certificate.
    #[error("issuing the server's TLS certificate failed: {0}")]
    Issue(SignError),
    /// Key generation or conversion failed.
    #[error("the server's TLS key: {0}")]
    Key(String),
}

impl From<SignError> for TlsError {
    fn from(e: SignError) -> Self {
        Self::Issue(e)
    }
}

/// The server certificate in use, swapped on renewal.
#[derive(Debug)]
pub(crate) struct ServerCertResolver {
    current: ArcSwap<CertifiedKey>,
    not_after: ArcSwap<OffsetDateTime>,
}

impl ServerCertResolver {
    /// The notAfter of the certificate in use.
    pub(crate) fn not_after(&self) -> OffsetDateTime {
        **self.not_after.load()
    }

    fn store(&self, key: Arc<CertifiedKey>, not_after: OffsetDateTime) {
        self.current.store(key);
        self.not_after.store(Arc::new(not_after));
    }
}

impl ResolvesServerCert for ServerCertResolver {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// Issues the server's certificate (fresh P-256 key) for `dns` names and
/// the loopback addresses.
pub(crate) fn issue_server_identity(
    authority: &Authority,
    dns: &[String],
    now: OffsetDateTime,
) -> Result<(Arc<CertifiedKey>, OffsetDateTime), TlsError> {
    let key =
        PrivateKey::generate(KeyAlgorithm::EcdsaP256).map_err(|e| TlsError::Key(e.to_string()))?;
    let subject = SubjectKey::of(&key).map_err(|e| TlsError::Key(e.to_string()))?;
    let ips = [
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ];
    let (chain, not_after) =
        authority.issue_server_cert(&subject, dns, &ips, SERVER_CERT_TTL, now)?;
    let certs: Vec<CertificateDer<'static>> = chain.into_iter().map(CertificateDer::from).collect();
    let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.to_pkcs8_der()));
    let signing_key = rustls::crypto::ring::sign::any_supported_type(&key_der)
        .map_err(|e| TlsError::Key(e.to_string()))?;
    Ok((Arc::new(CertifiedKey::new(certs, signing_key)), not_after))
}

/// A resolver holding a freshly issued server certificate.
pub(crate) fn new_resolver(
    authority: &Authority,
    dns: &[String],
) -> Result<Arc<ServerCertResolver>, TlsError> {
    // An HSM key in direct mode may be busy for a moment at start (the
    // CRL is signed at the same time): waited for, a little.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (key, not_after) = loop {
        match issue_server_identity(authority, dns, OffsetDateTime::now_utc()) {
            Err(TlsError::Issue(SignError::Signing(ProfileError::KeyBusy(_))))
                if std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            issued => break issued?,
        }
    };
    Ok(Arc::new(ServerCertResolver {
        current: ArcSwap::new(key),
        not_after: ArcSwap::from_pointee(not_after),
    }))
}

/// Renews the server certificate at half its life, and at once when the
/// CA material changes, until `shutdown` fires.
pub(crate) async fn renew_server_cert(
    resolver: Arc<ServerCertResolver>,
    authority: Arc<Authority>,
    dns: Vec<String>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut material = authority.subscribe();
    loop {
        let now = OffsetDateTime::now_utc();
        let left: time::Duration = resolver.not_after() - now;
        let half: time::Duration = left / 2i32;
        let wait = half.max(time::Duration::seconds(1));
        let wait = Duration::try_from(wait).unwrap_or(RENEW_RETRY);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            // New CA material: a certificate from the new signer at once.
            changed = material.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = shutdown.changed() => return,
        }
        match issue_server_identity(&authority, &dns, OffsetDateTime::now_utc()) {
            Ok((key, not_after)) => {
                resolver.store(key, not_after);
                tracing::info!(not_after = %meshca_certs::Rfc3339(not_after), "renewed the server's TLS certificate");
            }
            Err(e) => {
                tracing::error!(error = %e, "renewing the server's TLS certificate failed; retrying");
                // Again after RENEW_RETRY, or at once when new CA material
                // can sign (e.g. the HSM is back with a new intermediate).
                tokio::select! {
                    _ = tokio::time::sleep(RENEW_RETRY) => {}
                    changed = material.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                    _ = shutdown.changed() => return,
                }
            }
        }
    }
}
