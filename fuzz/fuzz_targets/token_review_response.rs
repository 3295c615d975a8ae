//! The Kubernetes API server's answer to a TokenReview, as meshca reads
//! it (`caller_from_review`): JSON from the network. Reading it must never
//! panic, and an identity comes out only for an authenticated service
//! account whose answer echoes an accepted audience.
#![no_main]

use k8s_openapi::api::authentication::v1::TokenReview;
use libfuzzer_sys::fuzz_target;
use meshca_ca::authn::token_review::{caller_from_review, TokenReviewConfig};
use meshca_certs::TrustDomain;
use std::time::Duration;

fuzz_target!(|data: &[u8]| {
    let Ok(review) = serde_json::from_slice::<TokenReview>(data) else {
        return;
    };
    let config = TokenReviewConfig {
        audiences: vec!["istio-ca".into()],
        trust_domain: TrustDomain::default(),
        cache_ttl: Duration::ZERO,
        refusal_cache_ttl: Duration::ZERO,
        timeout: Duration::from_secs(1),
        max_in_flight: 1,
        max_waiting: 0,
    };
    let status = review.status.clone().unwrap_or_default();
    if let Ok(caller) = caller_from_review(&config, review) {
        assert_eq!(status.authenticated, Some(true));
        assert!(status
            .audiences
            .unwrap_or_default()
            .iter()
            .any(|a| a == "istio-ca"));
        let user = status.user.unwrap_or_default();
        assert!(user
            .groups
            .unwrap_or_default()
            .iter()
            .any(|g| g == "system:serviceaccounts"));
        let username = user.username.unwrap_or_default();
        let (ns, sa) = username
            .strip_prefix("system:serviceaccount:")
            .and_then(|rest| rest.split_once(':'))
            .expect("a service-account username");
        assert_eq!(
            caller.identity.as_str(),
            format!("spiffe://cluster.local/ns/{ns}/sa/{sa}")
        );
    }
});
