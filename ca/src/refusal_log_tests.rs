//! What the CA service writes to its log under a flood of refused
//! requests: the service in process (real tokens of the local issuer, real
//! CSRs), a tracing subscriber capturing the lines at INFO and above, and
//! tokio's paused clock for the log interval.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshca_certs::token::{TokenIssuer, TokenRequest};
use meshca_certs::{build_csr, KeyAlgorithm, PrivateKey, SpiffeId, TrustDomain};
use meshca_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateService;
use meshca_proto::IstioCertificateRequest;
use time::OffsetDateTime;
use tonic::Code;

use crate::authn::{AuthenticatorChain, JwtAuthenticator};
use crate::authority::{Authority, TtlPolicy};
use crate::authz::Authorizer;
use crate::metrics::{Metrics, SignErrorLabels};
use crate::rate_limit::RateLimitPolicy;
use crate::rate_limited_log::DEFAULT_LOG_INTERVAL;
use crate::service::CaService;
use crate::store;

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

struct Ca {
    _dir: tempfile::TempDir,
    service: CaService,
    metrics: Metrics,
    token: String,
}

/// A CA with the local issuer's authenticator and no issuance rate limit.
fn ca() -> Ca {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let material =
        store::load_or_create_data_dir(&data, &Default::default(), OffsetDateTime::now_utc())
            .unwrap();
    let authority = Arc::new(Authority::new(material, TtlPolicy::default()));
    let issuer: TokenIssuer = store::load_or_create_token_issuer(&data).unwrap();
    let authn = AuthenticatorChain::new().with(Arc::new(
        JwtAuthenticator::from_jwks(
            "local-issuer",
            issuer.issuer(),
            &issuer.jwks_json(),
            vec!["istio-ca".into()],
            TrustDomain::default(),
        )
        .unwrap(),
    ));
    let token = issuer
        .mint(
            &TokenRequest {
                namespace: "default".into(),
                service_account: "web".into(),
                audiences: vec!["istio-ca".into()],
                ttl: Duration::from_secs(3600),
                pod: None,
            },
            std::time::SystemTime::now(),
        )
        .unwrap();
    let metrics = Metrics::default();
    let service = CaService::new(
        authority,
        authn,
        Authorizer::own_identity_only(),
        metrics.clone(),
        "Kubernetes".into(),
        16,
    )
    .with_rate_limit(RateLimitPolicy {
        burst: 0,
        ..Default::default()
    });
    Ca {
        _dir: dir,
        service,
        metrics,
        token,
    }
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
