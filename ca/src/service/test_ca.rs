//! The CA service in process for the service's tests: a fresh data
//! directory, the local issuer's authenticator, and a token of
//! `default/web`.

use std::sync::Arc;
use std::time::Duration;

use meshca_certs::token::{TokenIssuer, TokenRequest};
use meshca_certs::TrustDomain;
use time::OffsetDateTime;

use crate::authn::{AuthenticatorChain, JwtAuthenticator};
use crate::authority::{Authority, TtlPolicy};
use crate::authz::Authorizer;
use crate::metrics::Metrics;
use crate::rate_limit::RateLimitPolicy;
use crate::service::CaService;
use crate::store;

/// A CA service and what its tests look at.
pub(super) struct Ca {
    pub(super) _dir: tempfile::TempDir,
    pub(super) service: CaService,
    pub(super) metrics: Metrics,
    /// A token of `default/web` from the local issuer.
    pub(super) token: String,
}

/// A CA with the local issuer's authenticator, 16 signing slots and
/// `rate_limit`.
pub(super) fn ca(rate_limit: RateLimitPolicy) -> Ca {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let material = store::load_or_create_data_dir(
        &data,
        &Default::default(),
        time::Duration::days(3650),
        OffsetDateTime::now_utc(),
    )
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
    .with_rate_limit(rate_limit);
    Ca {
        _dir: dir,
        service,
        metrics,
        token,
    }
}
