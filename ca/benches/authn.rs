//! Each authenticator on its hot path: an offline-validated JWT (ES256,
//! and the same token again from the cache of verified tokens), a client
//! SVID chain (verified, and its verdict again), and TokenReview (cached, a real review over HTTPS against
//! the fake API server of the end-to-end tests, and junk refused before
//! any API call).
//! Run: `cargo bench -p meshca-ca --bench authn`.

#![allow(missing_docs, clippy::unwrap_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use meshca_ca::authn::{
    Authenticator, ClientCertAuthenticator, Credentials, JwtAuthenticator,
    TokenReviewAuthenticator, TokenReviewConfig,
};
use meshca_ca::authority::Authority;
use meshca_ca::authority::TtlPolicy;
use meshca_ca::store::load_or_create_data_dir;
use meshca_certs::profile::{SubjectKey, Validity};
use meshca_certs::token::{TokenIssuer, TokenRequest};
use meshca_certs::{KeyAlgorithm, PrivateKey, SpiffeId, TrustDomain};
use meshca_tests::fake_kube::{FakeKube, FakeUser};
use rustls_pki_types::CertificateDer;
use time::OffsetDateTime;

fn authn(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let td = TrustDomain::default();

    // Offline JWT.
    let issuer = TokenIssuer::generate().unwrap();
    let offline_authenticator = || {
        JwtAuthenticator::from_jwks(
            "local",
            issuer.issuer(),
            &issuer.jwks_json(),
            vec!["istio-ca".into()],
            td.clone(),
        )
        .unwrap()
    };
    let jwt = offline_authenticator();
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
    c.bench_function("authn/jwt_offline_es256", |b| {
        b.iter(|| jwt.validate(black_box(&token)).unwrap())
    });
    // The same token again, with --jwt-cache-ttl: its SHA-256 and a lookup.
    let cached_jwt = offline_authenticator().with_cache_ttl(Duration::from_secs(3600));
    let with_token = Credentials {
        bearer: Some(token.clone()),
        peer_chain: None,
    };
    c.bench_function("authn/jwt_offline_cached", |b| {
        b.iter(|| {
            runtime
                .block_on(cached_jwt.authenticate(black_box(&with_token)))
                .unwrap()
        })
    });

    // Client certificate (an SVID this CA issued).
    let dir = tempfile::tempdir().unwrap();
    let material = load_or_create_data_dir(
        dir.path(),
        &td,
        time::Duration::days(3650),
        OffsetDateTime::now_utc(),
    )
    .unwrap();
    let leaf_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let leaf = material
        .signing
        .issue_workload(
            &SubjectKey::of(&leaf_key).unwrap(),
            &SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap(),
            Validity::backdated(OffsetDateTime::now_utc(), time::Duration::hours(1)),
        )
        .unwrap();
    let authority = Arc::new(Authority::new(material, TtlPolicy::default()));
    let with_chain = Credentials {
        bearer: None,
        peer_chain: Some(Arc::new(vec![CertificateDer::from(leaf.der)])),
    };
    // The first request of a connection: a fresh authenticator each time,
    // so the chain is verified (making the authenticator is not measured).
    c.bench_function("authn/client_certificate", |b| {
        b.iter_batched(
            || ClientCertAuthenticator::new(authority.clone(), td.clone()),
            |client_cert| {
                runtime
                    .block_on(client_cert.authenticate(black_box(&with_chain)))
                    .unwrap()
                    .unwrap()
            },
            criterion::BatchSize::SmallInput,
        )
    });
    // The connection's later requests: the verdict on the same chain.
    let client_cert = ClientCertAuthenticator::new(authority, td.clone());
    c.bench_function("authn/client_certificate_cached", |b| {
        b.iter(|| {
            runtime
                .block_on(client_cert.authenticate(black_box(&with_chain)))
                .unwrap()
                .unwrap()
        })
    });

    // TokenReview against the fake API server.
    let kube_dir = tempfile::tempdir().unwrap();
    let (fake, client) = runtime.block_on(async {
        let fake = FakeKube::start(kube_dir.path()).await;
        let client = meshca_ca::authn::token_review::kube_client(
            Some(&fake.kubeconfig),
            Duration::from_secs(5),
        )
        .await
        .unwrap()
        .unwrap();
        (fake, client)
    });
    let reviewed = fake.add_review_token("cached", FakeUser::service_account("default", "web"));
    let config = |cache_ttl| TokenReviewConfig {
        audiences: vec!["istio-ca".into()],
        trust_domain: td.clone(),
        cache_ttl,
        refusal_cache_ttl: Duration::ZERO,
        timeout: Duration::from_secs(5),
        max_in_flight: 64,
        max_waiting: 16_384,
    };
    let cached = TokenReviewAuthenticator::new(client.clone(), config(Duration::from_secs(600)));
    let bearer = Credentials {
        bearer: Some(reviewed),
        peer_chain: None,
    };
    c.bench_function("authn/token_review_cached", |b| {
        b.iter(|| {
            runtime
                .block_on(cached.authenticate(black_box(&bearer)))
                .unwrap()
                .unwrap()
        })
    });
    let uncached = TokenReviewAuthenticator::new(client, config(Duration::ZERO));
    c.bench_function("authn/token_review_https_loopback", |b| {
        b.iter(|| {
            runtime
                .block_on(uncached.authenticate(black_box(&bearer)))
                .unwrap()
                .unwrap()
        })
    });

    // Junk that is not worth a review: refused before any API call.
    let junk = Credentials {
        bearer: Some("not-a-jwt-but-long-enough-to-be-hashed".into()),
        peer_chain: None,
    };
    c.bench_function("authn/token_review_junk_refused_locally", |b| {
        b.iter(|| {
            runtime
                .block_on(uncached.authenticate(black_box(&junk)))
                .unwrap_err()
        })
    });
    drop(fake);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = authn
}
criterion_main!(benches);
