//! How often a client that renews like ztunnel comes back, and what a
//! client in a loop gets: the CA service in process (real CSRs, real
//! tokens of the local issuer, real signing), tokio's paused clock for the
//! client's timers and the rate limit.

use std::time::Duration;

use meshca_certs::bundle::parse_certs_pem;
use meshca_certs::inspect::CertSummary;
use meshca_certs::{build_csr, KeyAlgorithm, PrivateKey, SpiffeId};
use meshca_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateService;
use meshca_proto::IstioCertificateRequest;
use time::OffsetDateTime;
use tonic::Code;

use crate::rate_limit::RateLimitPolicy;
use crate::service::RETRY_PUSHBACK_HEADER;

use super::test_ca::{ca, Ca};

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";

/// One renewal: the leaf's (notBefore, notAfter) and the wall clock when
/// the answer came.
async fn renew(
    ca: &Ca,
    ttl_secs: i64,
) -> Result<(OffsetDateTime, OffsetDateTime, OffsetDateTime), tonic::Status> {
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let csr = build_csr(&key, &SpiffeId::parse(WEB).unwrap()).unwrap();
    let mut request = tonic::Request::new(IstioCertificateRequest {
        csr,
        validity_duration: ttl_secs,
        metadata: None,
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", ca.token).parse().unwrap(),
    );
    let response = ca.service.create_certificate(request).await?.into_inner();
    let received = OffsetDateTime::now_utc();
    let der = parse_certs_pem(&response.cert_chain[0]).unwrap();
    let leaf = CertSummary::from_der(&der[0]).unwrap();
    Ok((leaf.not_before, leaf.not_after, received))
}

/// ztunnel's rule (`src/tls/certificate.rs`, `refresh_at`): renew at
/// notBefore + (notAfter − notBefore) / 2.
fn ztunnel_refresh_in(
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
    now: OffsetDateTime,
) -> Duration {
    let refresh_at = not_before + (not_after - not_before) / 2;
    Duration::try_from(refresh_at - now).unwrap_or(Duration::ZERO)
}

#[tokio::test(start_paused = true)]
async fn a_ztunnel_like_client_with_a_60s_ttl_settles_to_one_certificate_per_half_life() {
    let ca = ca(RateLimitPolicy::default());
    let window = Duration::from_secs(600);
    let started = tokio::time::Instant::now();
    let mut requests = 0u32;
    // Before proportional backdating a 60 s certificate was due at once
    // (notBefore 2 min back): this loop asked without pause.
    while started.elapsed() < window && requests < 1000 {
        requests += 1;
        let (not_before, not_after, received) = renew(&ca, 60).await.unwrap();
        assert!(
            not_after - not_before <= time::Duration::seconds(66),
            "a 60 s certificate is backdated at most 6 s"
        );
        tokio::time::sleep(ztunnel_refresh_in(not_before, not_after, received)).await;
    }
    // 600 s / 27 s (half of 66 s, minus the 6 s of backdating) = 22.2.
    assert!(
        (20..=24).contains(&requests),
        "{requests} certificates in {window:?}: expected about one per 30 s"
    );
    assert_eq!(ca.metrics.issuance_throttled.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_client_in_a_loop_gets_its_burst_then_resource_exhausted_with_a_retry_hint() {
    let ca = ca(RateLimitPolicy {
        burst: 5,
        interval: Duration::from_secs(2),
        max_keys: 100,
    });
    for _ in 0..5 {
        renew(&ca, 3600).await.unwrap();
    }
    let status = renew(&ca, 3600).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("retry in 2.0s"), "{status:?}");
    let pushback: u64 = status
        .metadata()
        .get(RETRY_PUSHBACK_HEADER)
        .expect("grpc-retry-pushback-ms")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(pushback, 2000);
    assert_eq!(ca.metrics.issuance_throttled.get(), 1);

    // Following the hint works; a loop that ignores it gets one per interval.
    tokio::time::sleep(Duration::from_millis(pushback)).await;
    renew(&ca, 3600).await.unwrap();
    let mut issued = 0;
    for _ in 0..200 {
        if renew(&ca, 3600).await.is_ok() {
            issued += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // 20 s of looping at 10 a second: one per 2 s.
    assert!((9..=11).contains(&issued), "{issued} issued in 20 s");
    assert_eq!(ca.metrics.issuance_throttled.get(), 1 + 200 - issued);
}
