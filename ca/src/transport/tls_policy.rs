//! The listener's rustls policy: TLS 1.2 and 1.3, ALPN `h2`, the server's
//! own order of cipher suites, no session tickets, and client certificates
//! asked for but checked later, by
//! [`crate::authn::ClientCertAuthenticator`] (an unknown certificate gets a
//! gRPC `UNAUTHENTICATED` with a reason, not a failed handshake).

use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::ResolvesServerCert;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

/// Asks for a client certificate but lets the handshake go on without one.
/// A presented certificate's handshake signature is verified here (proof of
/// possession); its chain is checked by the client-certificate
/// authenticator, so an unknown certificate gets a gRPC `UNAUTHENTICATED`
/// with a reason instead of a failed handshake.
#[derive(Debug)]
pub(crate) struct DeferredClientCertVerifier {
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
/// noticeably less (docs/benchmarks-history.md, "A connection per sidecar"). Go's TLS server
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
pub(crate) fn server_config(
    resolver: Arc<dyn ResolvesServerCert>,
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
    // ticket store. Each full handshake saves issuing and storing two
    // tickets (docs/benchmarks-history.md, "No session tickets"), and the clients skip
    // them too.
    config.send_tls13_tickets = 0;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::OffsetDateTime;
    use tokio_rustls::TlsAcceptor;

    use crate::authority::Authority;
    use crate::server_identity::new_resolver;

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
            time::Duration::days(3650),
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
}
