//! The server's TLS: its own certificate (issued by the CA itself and
//! renewed before it expires), client certificates (optional; checked by
//! [`crate::authn::ClientCertAuthenticator`]), and the accept loop that
//! feeds TLS connections to tonic.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use meshca_certs::keys::{KeyAlgorithm, PrivateKey};
use meshca_certs::profile::SubjectKey;
use prometheus_client::metrics::gauge::Gauge;
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
use crate::metrics::Metrics;

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

/// The cipher suites the server offers, in the order it picks them.
///
/// AES-128-GCM with SHA-256 first, whatever the client lists first (rustls
/// clients, tonic's among them, list AES-256-GCM-SHA384 first): the key
/// schedule of a handshake is a few dozen HMACs, and SHA-256 runs on x86's
/// SHA extensions (SHA-NI), which have no SHA-384, so a handshake costs
/// noticeably less (16 % of the server's CPU per pod in a mass restart of
/// sidecars, each with a new connection: BENCHMARKS.md). Go's TLS server
/// (istiod's) prefers AES-128-GCM as well. Every suite of the provider
/// stays on offer.
const SERVER_SUITE_ORDER: [rustls::CipherSuite; 6] = [
    rustls::CipherSuite::TLS13_AES_128_GCM_SHA256,
    rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
    rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
    rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
    rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
    rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
];

/// The provider's suites, those named in [`SERVER_SUITE_ORDER`] first in
/// that order, the others after them as the provider lists them.
fn server_suites(
    mut suites: Vec<rustls::SupportedCipherSuite>,
) -> Vec<rustls::SupportedCipherSuite> {
    suites.sort_by_key(|suite| {
        SERVER_SUITE_ORDER
            .iter()
            .position(|&s| s == suite.suite())
            .unwrap_or(SERVER_SUITE_ORDER.len())
    });
    suites
}

/// The rustls server configuration: TLS 1.2 and 1.3, ALPN `h2`, optional
/// client certificates, the renewing server certificate, the server's own
/// order of cipher suites ([`SERVER_SUITE_ORDER`]), no TLS 1.3 session
/// tickets.
pub fn server_config(
    resolver: Arc<ServerCertResolver>,
) -> Result<rustls::ServerConfig, rustls::Error> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites = server_suites(provider.cipher_suites);
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_client_cert_verifier(Arc::new(DeferredClientCertVerifier::default()))
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec()];
    config.ignore_client_order = true;
    // No TLS 1.3 session tickets. They are for resuming a session with this
    // process, and meshca's clients do not: Istio's agents (Go) keep no
    // session cache, ztunnel holds one long-lived connection per node, a
    // restarted sidecar is a new process, and replicas do not share the
    // ticket store. Each full handshake saved issuing and storing two
    // tickets: 5 % less server CPU per pod in a mass restart with a new
    // connection per pod (BENCHMARKS.md), and the clients skip them too.
    config.send_tls13_tickets = 0;
    Ok(config)
}

/// An established connection, as the gRPC server gets it.
pub type TlsConnection = TlsStream<BatchedWriteStream<TcpStream, ConnectionSeat>>;

/// How many connections each event loop holds, to place a new one on the
/// loop with the fewest. Dealing in turn would drift after churn: agents
/// that reconnect after a restart can leave one loop with most of the
/// long-lived connections.
#[derive(Debug)]
pub struct LoopOccupancy {
    open: Box<[AtomicUsize]>,
    /// All loops together, as exported (`meshca_grpc_connections`).
    total: Gauge<i64>,
}

impl LoopOccupancy {
    /// No connections yet on any of `loops` loops (at least one); `total`
    /// follows the sum over the loops.
    pub fn new(loops: usize, total: Gauge<i64>) -> Arc<Self> {
        Arc::new(Self {
            open: (0..loops.max(1)).map(|_| AtomicUsize::new(0)).collect(),
            total,
        })
    }

    /// Takes a seat on the loop with the fewest open connections; among
    /// equals the first at or after `start` (the caller rotates it, so
    /// loops with equal counts take turns). The seat is given back when
    /// the returned value is dropped.
    pub fn seat(self: &Arc<Self>, start: usize) -> ConnectionSeat {
        let n = self.open.len();
        let index = (0..n)
            .map(|k| (start.wrapping_add(k)) % n)
            .min_by_key(|&i| self.open[i].load(Ordering::Relaxed))
            .unwrap_or(0);
        self.open[index].fetch_add(1, Ordering::Relaxed);
        self.total.inc();
        ConnectionSeat {
            occupancy: self.clone(),
            index,
        }
    }

    /// Open connections on loop `index` (0 for a loop that does not exist).
    pub fn open_on(&self, index: usize) -> usize {
        self.open
            .get(index)
            .map_or(0, |open| open.load(Ordering::Relaxed))
    }
}

/// One connection's place on a loop; counted until dropped.
#[derive(Debug)]
pub struct ConnectionSeat {
    occupancy: Arc<LoopOccupancy>,
    index: usize,
}

impl ConnectionSeat {
    /// The loop this connection runs on.
    pub fn loop_index(&self) -> usize {
        self.index
    }
}

impl Drop for ConnectionSeat {
    fn drop(&mut self) {
        self.occupancy.open[self.index].fetch_sub(1, Ordering::Relaxed);
        self.occupancy.total.dec();
    }
}

/// Accepts TCP connections on `listener` and places each on the loop of
/// `loops` that holds the fewest open connections ([`LoopOccupancy`]):
/// its TLS handshake (bounded by [`HANDSHAKE_TIMEOUT`]) and then its whole
/// life run there. Returns one stream of established connections per loop.
/// Stops when every stream is dropped.
pub fn tls_incoming(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    loops: &[tokio::runtime::Handle],
    metrics: &Metrics,
) -> Vec<ReceiverStream<Result<TlsConnection, io::Error>>> {
    let (senders, receivers): (Vec<_>, Vec<_>) = loops.iter().map(|_| mpsc::channel(128)).unzip();
    let loops = loops.to_vec();
    let occupancy = LoopOccupancy::new(loops.len(), metrics.grpc_connections.clone());
    let handshake_failures = metrics.tls_handshake_failures.clone();
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
            let seat = occupancy.seat(next);
            next = next.wrapping_add(1);
            let index = seat.loop_index();
            let acceptor = acceptor.clone();
            let handshake_failures = handshake_failures.clone();
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
                    acceptor.accept(BatchedWriteStream::with_guard(tcp, seat)),
                )
                .await
                {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => {
                        handshake_failures.inc();
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    }
                    Err(_) => {
                        handshake_failures.inc();
                        tracing::debug!(%peer, "TLS handshake timed out");
                    }
                }
            });
        }
    });
    receivers.into_iter().map(ReceiverStream::new).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_goes_to_the_loop_with_the_fewest() {
        let total = Gauge::<i64>::default();
        let occupancy = LoopOccupancy::new(2, total.clone());
        let first: Vec<_> = (0..4).map(|k| occupancy.seat(k)).collect();
        // Equal counts: the loops take turns.
        let placed: Vec<_> = first.iter().map(ConnectionSeat::loop_index).collect();
        assert_eq!(placed, [0, 1, 0, 1]);
        assert_eq!((occupancy.open_on(0), occupancy.open_on(1)), (2, 2));
        assert_eq!(total.get(), 4, "the exported gauge is the sum");

        // Both connections of loop 0 close: the next two go there, whatever
        // the rotation says.
        let mut first = first.into_iter();
        let (a, b, c, d) = (first.next(), first.next(), first.next(), first.next());
        drop((a, c));
        assert_eq!((occupancy.open_on(0), occupancy.open_on(1)), (0, 2));
        let e = occupancy.seat(5);
        let f = occupancy.seat(7);
        assert_eq!((e.loop_index(), f.loop_index()), (0, 0));
        assert_eq!((occupancy.open_on(0), occupancy.open_on(1)), (2, 2));
        assert_eq!(total.get(), 4);
        drop((b, d, e, f));
        assert_eq!((occupancy.open_on(0), occupancy.open_on(1)), (0, 0));
        assert_eq!(total.get(), 0);
        assert_eq!(occupancy.open_on(2), 0);
    }

    /// Completes a handshake between `server_config` and a rustls client
    /// offering `suites` (the provider's, in the client's order), returns
    /// the suite both sides agreed on.
    async fn negotiated_suite(
        client_suites: Vec<rustls::SupportedCipherSuite>,
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> rustls::CipherSuite {
        let dir = tempfile::tempdir().unwrap();
        let material = crate::store::load_or_create_data_dir(
            dir.path(),
            &Default::default(),
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        let root = material.signing.cert_der().to_vec();
        let authority = Authority::new(material, Default::default());
        let resolver = new_resolver(&authority, &["istiod.istio-system.svc".into()]).unwrap();
        let server = server_config(resolver).unwrap();
        assert_eq!(server.send_tls13_tickets, 0, "no session tickets");
        let acceptor = TlsAcceptor::from(Arc::new(server));

        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from(root)).unwrap();
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites = client_suites;
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
        let name = rustls_pki_types::ServerName::try_from("istiod.istio-system.svc").unwrap();

        let (near, far) = tokio::io::duplex(1 << 16);
        let (server, client) = tokio::join!(acceptor.accept(near), connector.connect(name, far));
        let (server, client) = (server.unwrap(), client.unwrap());
        let agreed = server
            .get_ref()
            .1
            .negotiated_cipher_suite()
            .unwrap()
            .suite();
        assert_eq!(
            Some(agreed),
            client
                .get_ref()
                .1
                .negotiated_cipher_suite()
                .map(|s| s.suite())
        );
        agreed
    }

    #[tokio::test]
    async fn the_server_picks_aes_128_gcm_sha256_whatever_the_client_lists_first() {
        use rustls::CipherSuite::*;
        let provided = rustls::crypto::ring::default_provider().cipher_suites;
        // rustls clients (tonic's, meshca-bench's) list AES-256-GCM-SHA384 first.
        assert_eq!(provided[0].suite(), TLS13_AES_256_GCM_SHA384);
        let tls13 = [&rustls::version::TLS13];
        assert_eq!(
            negotiated_suite(provided.clone(), &tls13).await,
            TLS13_AES_128_GCM_SHA256
        );
        // A client without AES-128-GCM still gets what it offers.
        let without: Vec<_> = provided
            .iter()
            .filter(|s| s.suite() != TLS13_AES_128_GCM_SHA256)
            .cloned()
            .collect();
        assert_eq!(
            negotiated_suite(without, &tls13).await,
            TLS13_AES_256_GCM_SHA384
        );
        // TLS 1.2 clients: ECDHE-ECDSA with AES-128-GCM (the CA's key is P-256).
        assert_eq!(
            negotiated_suite(provided.clone(), &[&rustls::version::TLS12]).await,
            TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
        );
        // Reordered, not filtered: every suite of the provider is on offer.
        let offered = server_suites(provided.clone());
        assert_eq!(offered.len(), provided.len());
        for suite in &provided {
            assert!(offered.iter().any(|s| s.suite() == suite.suite()));
        }
    }

    #[tokio::test]
    async fn a_connection_frees_its_seat_when_dropped() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let occupancy = LoopOccupancy::new(3, Gauge::default());
        let (near, mut far) = tokio::io::duplex(64);
        let seat = occupancy.seat(1);
        assert_eq!(seat.loop_index(), 1);
        let mut stream = BatchedWriteStream::with_guard(near, seat);
        stream.write_all(b"ping").await.unwrap();
        stream.flush().await.unwrap();
        let mut got = [0u8; 4];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        far.write_all(b"pong").await.unwrap();
        stream.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        assert_eq!(occupancy.open_on(1), 1);
        drop(stream);
        assert_eq!(occupancy.open_on(1), 0);
    }
}
