//! The signing path, step by step: CSR parse + verify, certificate build +
//! sign, PEM encode, and the whole `Authority::sign_workload`, next to the
//! bare crypto (one ECDSA P-256 verify, one sign) they are built on.
//! Run: `cargo bench -p meshca-ca --bench signing`.

#![allow(missing_docs, clippy::unwrap_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use meshca_ca::authority::Authority;
use meshca_ca::authority::TtlPolicy;
use meshca_ca::store::{CaMaterial, CaSource};
use meshca_certs::profile::{SigningCa, Validity};
use meshca_certs::{build_csr, KeyAlgorithm, PrivateKey, SpiffeId, TrustBundle, VerifiedCsr};
use time::OffsetDateTime;

fn ca() -> (SigningCa, Vec<u8>) {
    let (key, root) = meshca_ca::store::generate_self_signed_root(
        &Default::default(),
        time::Duration::days(30),
        OffsetDateTime::now_utc(),
    )
    .unwrap();
    (SigningCa::new(root.der.clone(), key).unwrap(), root.der)
}

fn signing(c: &mut Criterion) {
    let id = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap();
    let (signing_ca, root) = ca();
    let now = OffsetDateTime::now_utc();
    let validity = Validity::backdated(now, time::Duration::hours(24));
    for alg in [
        KeyAlgorithm::EcdsaP256,
        KeyAlgorithm::EcdsaP384,
        KeyAlgorithm::Rsa2048,
    ] {
        let key = PrivateKey::generate(alg).unwrap();
        let csr = build_csr(&key, &id).unwrap();
        c.bench_function(&format!("csr_parse_verify/{}", alg.name()), |b| {
            b.iter(|| VerifiedCsr::from_pem(black_box(&csr)).unwrap())
        });
    }
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let csr = VerifiedCsr::from_pem(&build_csr(&key, &id).unwrap()).unwrap();
    c.bench_function("certificate_build_sign/p256_ca", |b| {
        b.iter(|| {
            signing_ca
                .issue_workload(black_box(csr.subject_key()), &id, validity)
                .unwrap()
        })
    });
    let issued = signing_ca
        .issue_workload(csr.subject_key(), &id, validity)
        .unwrap();
    c.bench_function("pem_encode/leaf", |b| {
        b.iter(|| black_box(&issued).to_pem())
    });

    let authority = Authority::new(
        CaMaterial {
            signing: signing_ca,
            chain: Vec::new(),
            anchor_root: root.clone(),
            bundle: TrustBundle::new(vec![root]),
            source: CaSource::PluggedIn("bench".into()),
        },
        TtlPolicy::default(),
    );
    let pem = build_csr(&key, &id).unwrap();
    c.bench_function("sign_workload/parse_verify_build_sign_pem", |b| {
        b.iter(|| {
            let csr = VerifiedCsr::from_pem(black_box(&pem)).unwrap();
            authority
                .sign_workload(csr.subject_key(), &id, 0, now)
                .unwrap()
        })
    });

    // The floor: the crypto alone.
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
        &rng,
    )
    .unwrap();
    let pair = ring::signature::EcdsaKeyPair::from_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
        pkcs8.as_ref(),
        &rng,
    )
    .unwrap();
    let msg = vec![7u8; 480];
    let sig = pair.sign(&rng, &msg).unwrap();
    let public = ring::signature::KeyPair::public_key(&pair)
        .as_ref()
        .to_vec();
    c.bench_function("crypto/p256_sign", |b| {
        b.iter(|| pair.sign(&rng, black_box(&msg)).unwrap())
    });
    c.bench_function("crypto/p256_verify", |b| {
        b.iter(|| {
            ring::signature::UnparsedPublicKey::new(
                &ring::signature::ECDSA_P256_SHA256_ASN1,
                &public,
            )
            .verify(black_box(&msg), sig.as_ref())
            .unwrap()
        })
    });
}

criterion_group!(benches, signing);
criterion_main!(benches);
