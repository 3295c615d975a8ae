//! The server's TLS: its own certificate (issued by the CA itself and
//! renewed before it expires), client certificates (optional; checked by
//! [`crate::authn::ClientCertAuthenticator`]), and the accept loop that
//! feeds TLS connections to tonic.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use meshca_certs::keys::{KeyAlgorithm, PrivateKey};
use meshca_certs::profile::SubjectKey;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use time::OffsetDateTime;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

use crate::authority::{Authority, SignError};
use crate::batched_io::BatchedWriteStream;

/// Lifetime of the server's own certificate.
pub const SERVER_CERT_TTL: Duration = Duration::from_secs(24 * 3600);
/// Time allowed for a TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Wait before retrying a failed renewal.
const RENEW_RETRY: Duration = Duration::from_secs(30);

/// Errors building the server's TLS identity.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The CA could not issue the server certificate.
    #[error("issuing the server's TLS certificate failed: {0}")]
    Issue(#[from] SignError),
    /// Key generation or conversion failed.
    #[error("the server's TLS key: {0}")]
    Key(String),
}

/// The server certificate in use, swapped on renewal.
#[derive(Debug)]
pub struct ServerCertResolver {
    current: ArcSwap<CertifiedKey>,
    not_after: ArcSwap<OffsetDateTime>,
}

impl ServerCertResolver {
    /// The notAfter of the certificate in use.
    pub fn not_after(&self) -> OffsetDateTime {
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
pub fn issue_server_identity(
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
pub fn new_resolver(
    authority: &Authority,
    dns: &[String],
) -> Result<Arc<ServerCertResolver>, TlsError> {
    let (key, not_after) = issue_server_identity(authority, dns, OffsetDateTime::now_utc())?;
    Ok(Arc::new(ServerCertResolver {
        current: ArcSwap::new(key),
        not_after: ArcSwap::from_pointee(not_after),
    }))
}

/// Renews the server certificate at half its life, and at once when the
/// CA material changes, until `shutdown` fires.
pub async fn renew_server_cert(
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
                tracing::info!(%not_after, "renewed the server's TLS certificate");
            }
            Err(e) => {
                tracing::error!(error = %e, "renewing the server's TLS certificate failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(RENEW_RETRY) => {}
                    _ = shutdown.changed() => return,
                }
            }
        }
    }
}

/// Asks for a client certificate but lets the handshake go on without one.
/// A presented certificate's handshake signature is verified here (proof of
/// possession); its chain is checked by the client-certificate
/// authenticator, so an unknown certificate gets a gRPC `UNAUTHENTICATED`
/// with a reason instead of a failed handshake.
#[derive(Debug)]
pub struct DeferredClientCertVerifier {
    algorithms: WebPkiSupportedAlgorithms,
}

impl Default for DeferredClientCertVerifier {
    fn default() -> Self {
        Self {
            algorithms: rustls::crypto::ring::default_provider().signature_verification_algorithms,
        }
    }
}

impl ClientCertVerifier for DeferredClientCertVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The rustls server configuration: TLS 1.2 and 1.3, ALPN `h2`, optional
/// client certificates, the renewing server certificate.
pub fn server_config(
    resolver: Arc<ServerCertResolver>,
) -> Result<rustls::ServerConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_client_cert_verifier(Arc::new(DeferredClientCertVerifier::default()))
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// An established connection, as the gRPC server gets it.
pub type TlsConnection = TlsStream<BatchedWriteStream<TcpStream>>;

/// Accepts TCP connections on `listener` and deals them out to `loops` in
/// turn: each connection's TLS handshake (bounded by [`HANDSHAKE_TIMEOUT`])
/// and then its whole life run on one loop. Returns one stream of
/// established connections per loop. Stops when every stream is dropped.
pub fn tls_incoming(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    loops: &[tokio::runtime::Handle],
) -> Vec<ReceiverStream<Result<TlsConnection, io::Error>>> {
    let (senders, receivers): (Vec<_>, Vec<_>) = loops.iter().map(|_| mpsc::channel(128)).unzip();
    let loops = loops.to_vec();
    tokio::spawn(async move {
        let all_closed = futures::future::join_all(senders.iter().map(|tx| tx.closed()));
        tokio::pin!(all_closed);
        let mut next = 0usize;
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = &mut all_closed => return,
            };
            let (tcp, peer) = match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off briefly.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let index = next % loops.len();
            next = next.wrapping_add(1);
            let acceptor = acceptor.clone();
            let tx = senders[index].clone();
            // The socket is registered with the reactor of the loop that
            // polls it first: move it there as a std socket.
            let tcp = match tcp.into_std() {
                Ok(tcp) => tcp,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "handing the connection to an event loop failed");
                    continue;
                }
            };
            loops[index].spawn(async move {
                let tcp = match TcpStream::from_std(tcp) {
                    Ok(tcp) => tcp,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "registering the connection failed");
                        return;
                    }
                };
                match tokio::time::timeout(
                    HANDSHAKE_TIMEOUT,
                    acceptor.accept(BatchedWriteStream::new(tcp)),
                )
                .await
                {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    receivers.into_iter().map(ReceiverStream::new).collect()
}
