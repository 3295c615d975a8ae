//! What each fuzz target does with one input: the bodies of
//! `fuzz_targets/*.rs`, here so the main workspace runs the same code.
//!
//! `ca/tests/fuzz_corpus.rs` includes this file as a module and replays
//! every committed input of `fuzz/corpus/<target>/` through [`TARGETS`]
//! under `cargo test --workspace`, without cargo-fuzz. So a seed that once
//! crashed a target (or broke one of its properties) stays checked on
//! every run, and a target whose code stops compiling fails the main
//! build, not only a fuzzing run.
//!
//! Every function panics on a defect (a panic in the code under test, or
//! a property that does not hold) and on nothing else.

use std::sync::OnceLock;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::TokenReview;
use meshca_ca::authn::token_review::{caller_from_review, TokenReviewConfig};
use meshca_ca::authn::{check_plausible, AuthnError, JwtAuthenticator, UnverifiedClaims};
use meshca_certs::token::TokenIssuer;
use meshca_certs::{TrustDomain, VerifiedCsr};

/// What a target does with one input.
pub type Body = fn(&[u8]);

/// Every target by its name in `fuzz/Cargo.toml` (and its corpus
/// directory `fuzz/corpus/<name>/`).
pub const TARGETS: &[(&str, Body)] = &[
    ("csr", csr),
    ("pem", pem),
    ("spiffe_id", spiffe_id),
    ("certificate", certificate),
    ("token", token),
    ("token_plausibility", token_plausibility),
    ("token_review_response", token_review_response),
    ("pod_watch", pod_watch),
    ("authority_fix", authority_fix),
];

/// What a workload client sends `meshca-agent`'s socket, through its
/// `:authority` rewrite: never a panic, and a rewritten stream decodes to
/// the same headers but `:authority`
/// (`meshca_client::workload_api::fuzz_authority_fix`).
pub fn authority_fix(data: &[u8]) {
    meshca_client::workload_api::fuzz_authority_fix(data);
}

/// CSRs arrive from any authenticated caller: parsing and verifying one
/// must never panic, whatever the bytes.
pub fn csr(data: &[u8]) {
    let _ = VerifiedCsr::from_der(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = VerifiedCsr::from_pem(text);
    }
}

/// PEM bundles and keys come from files and from CA answers.
pub fn pem(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = meshca_certs::bundle::parse_certs_pem(text);
        let _ = meshca_certs::PrivateKey::from_pem(text);
        let _ = meshca_certs::TrustBundle::from_pem(text);
    }
}

/// SPIFFE IDs arrive in CSR SANs and in request metadata: a parsed ID
/// round-trips and its accessors hold.
pub fn spiffe_id(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(id) = meshca_certs::SpiffeId::parse(text) {
            assert_eq!(id.as_str(), text);
            let _ = id.kubernetes_workload();
            assert!(id.as_str().starts_with("spiffe://"));
        }
    }
}

/// Certificates arrive as client certificates and in CA answers: the SVID
/// checks and inspection must never panic.
pub fn certificate(data: &[u8]) {
    let _ = meshca_certs::verify::check_svid_leaf(data);
    let _ = meshca_certs::inspect::CertSummary::from_der(data);
    let bundle = meshca_certs::TrustBundle::new(vec![data.to_vec()]);
    let _ = meshca_certs::verify::audit_svid_chain(
        &[data.to_vec()],
        &bundle,
        std::time::SystemTime::now(),
        None,
    );
}

fn authenticator() -> &'static JwtAuthenticator {
    static AUTHN: OnceLock<JwtAuthenticator> = OnceLock::new();
    AUTHN.get_or_init(|| {
        let issuer = TokenIssuer::generate().expect("a P-256 key");
        JwtAuthenticator::from_jwks(
            "fuzz",
            issuer.issuer(),
            &issuer.jwks_json(),
            vec!["istio-ca".into()],
            TrustDomain::default(),
        )
        .expect("the issuer's own JWKS")
    })
}

/// Bearer tokens arrive from anyone who can open a connection: splitting,
/// decoding and checking one must never panic, never accept a token the
/// issuer did not sign, and never repeat the token in an error.
pub fn token(data: &[u8]) {
    let Ok(token) = std::str::from_utf8(data) else {
        return;
    };
    // The key was made in this process and never signed anything: nothing
    // the fuzzer writes can verify.
    match authenticator().validate(token) {
        Ok(caller) => panic!("a token nobody signed was accepted: {caller:?}"),
        Err(e) => {
            if token.len() >= 16 && e.to_string().contains(token) {
                // Unless the token is a piece of the fixed wording (the
                // fuzzer finds those): then another token's refusal has it too.
                let other = authenticator()
                    .validate(&"#".repeat(token.len()))
                    .expect_err("not a JWT");
                assert!(
                    other.to_string().contains(token),
                    "the error repeats the token"
                );
            }
        }
    }
}

/// The moment the plausibility checks run at (fixed, so runs are
/// reproducible).
const NOW: u64 = 1_800_000_000;

/// The check every bearer token passes before it may cost a TokenReview
/// (`check_plausible`, `UnverifiedClaims::parse`): anyone who can open a
/// connection reaches it. It must never panic, never call a token
/// plausible whose own claims say otherwise, and never repeat the token
/// in its error.
pub fn token_plausibility(data: &[u8]) {
    let Ok(token) = std::str::from_utf8(data) else {
        return;
    };
    let audiences = vec!["istio-ca".to_string()];
    let parsed = UnverifiedClaims::parse(token);
    match check_plausible(token, &audiences, NOW) {
        Ok(claims) => {
            assert_eq!(
                parsed.as_ref(),
                Ok(&claims),
                "the check reads what parse reads"
            );
            assert!(claims.audiences.iter().any(|a| a == "istio-ca"));
            assert!(claims.expires_at.is_none_or(|exp| exp > NOW));
            assert_eq!(token.split('.').count(), 3);
        }
        Err(e) => {
            match (&e, &parsed) {
                (AuthnError::MalformedToken, Err(AuthnError::MalformedToken)) => {}
                (AuthnError::Expired(exp), Ok(claims)) => {
                    assert_eq!(claims.expires_at, Some(*exp));
                    assert!(*exp <= NOW);
                }
                (AuthnError::WrongAudience(_), Ok(claims)) => {
                    assert!(!claims.audiences.iter().any(|a| a == "istio-ca"));
                }
                other => panic!("unexpected refusal: {other:?}"),
            }
            if token.len() >= 16 && e.to_string().contains(token) {
                // Unless the token is a piece of the fixed wording (the
                // fuzzer finds those): then another token's refusal has it too.
                let other = check_plausible(&"#".repeat(token.len()), &audiences, NOW)
                    .expect_err("not a JWT");
                assert!(
                    other.to_string().contains(token),
                    "the error repeats the token"
                );
            }
        }
    }
}

/// The Kubernetes API server's answer to a TokenReview, as meshca reads
/// it (`caller_from_review`): JSON from the network. Reading it must never
/// panic, and an identity comes out only for an authenticated service
/// account whose answer echoes an accepted audience.
pub fn token_review_response(data: &[u8]) {
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
}

/// Pods as the node-agent pod index reads them from the Kubernetes API
/// (list items and watch events: JSON from the network). Indexing any
/// sequence of them must never panic, and the index must stay consistent:
/// a pod removed is gone, a pod listed is found. The index is internal to
/// `meshca-ca`, so the body lives there ([`meshca_ca::fuzz_pod_events`]).
pub fn pod_watch(data: &[u8]) {
    meshca_ca::fuzz_pod_events(data);
}
