//! What the CA service writes to its log under a flood of refused
//! requests: the service in process (real tokens of the local issuer, real
//! CSRs), a tracing subscriber capturing the lines at INFO and above, and
//! tokio's paused clock for the log interval.

use std::io::Write;
use std::sync::{Arc, Mutex};

use meshca_certs::{build_csr, KeyAlgorithm, PrivateKey, SpiffeId};
use meshca_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateService;
use meshca_proto::IstioCertificateRequest;
use tonic::Code;

use crate::metrics::SignErrorLabels;
use crate::rate_limit::RateLimitPolicy;
use meshca_serve::rate_limited_log::DEFAULT_LOG_INTERVAL;

use super::test_ca::{self, Ca};

/// Log lines written while it is the thread's default subscriber.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    /// Captures INFO and above until the guard is dropped.
    fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let lines = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .without_time()
            .with_writer(move || lines.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    /// The captured lines containing `needle`.
    fn matching(&self, needle: &str) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|line| line.contains(needle))
            .map(str::to_string)
            .collect()
    }
}

/// A CA with the local issuer's authenticator and no issuance rate limit.
fn ca() -> Ca {
    test_ca::ca(RateLimitPolicy {
        burst: 0,
        ..Default::default()
    })
}

fn request(token: &str, csr: String, ttl_secs: i64) -> tonic::Request<IstioCertificateRequest> {
    let mut request = tonic::Request::new(IstioCertificateRequest {
        csr,
        validity_duration: ttl_secs,
        metadata: None,
    });
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_unauthenticated_requests_writes_one_info_line_per_interval() {
    let ca = ca();
    let lines = Lines::default();
    let _capture = lines.capture();
    for _ in 0..1_000 {
        let status = ca
            .service
            .create_certificate(request("junk", String::new(), 0))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    }
    let written = lines.matching("authentication failed");
    assert_eq!(written.len(), 1, "{written:#?}");
    assert!(written[0].contains("unlogged=0"), "{}", written[0]);
    assert_eq!(ca.metrics.authentication_failure_count.get(), 1_000);

    tokio::time::advance(DEFAULT_LOG_INTERVAL).await;
    ca.service
        .create_certificate(request("junk", String::new(), 0))
        .await
        .unwrap_err();
    let written = lines.matching("authentication failed");
    assert_eq!(written.len(), 2, "{written:#?}");
    assert!(
        written[1].contains("unlogged=999"),
        "the next line counts the quiet ones: {}",
        written[1]
    );
    assert_eq!(ca.metrics.authentication_failure_count.get(), 1_001);
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_refused_signings_writes_one_line_per_interval() {
    let ca = ca();
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let csr = build_csr(
        &key,
        &SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap(),
    )
    .unwrap();
    let too_long = 91 * 86_400;
    let lines = Lines::default();
    let _capture = lines.capture();
    for _ in 0..200 {
        let status = ca
            .service
            .create_certificate(request(&ca.token, csr.clone(), too_long))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    }
    let written = lines.matching("signing refused");
    assert_eq!(written.len(), 1, "one line for 200 refusals: {written:#?}");
    let counted = ca
        .metrics
        .csr_sign_err_count
        .get_or_create(&SignErrorLabels {
            error: "ttl_too_long".into(),
        })
        .get();
    assert_eq!(counted, 200, "the counter stays exact");

    tokio::time::advance(DEFAULT_LOG_INTERVAL).await;
    ca.service
        .create_certificate(request(&ca.token, csr, too_long))
        .await
        .unwrap_err();
    let written = lines.matching("signing refused");
    assert_eq!(written.len(), 2, "{written:#?}");
    assert!(written[1].contains("unlogged=199"), "{}", written[1]);
}
