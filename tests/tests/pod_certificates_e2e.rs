//! End-to-end tests of `meshca serve --pod-certificate-signer`: the real
//! binary against the fake API server, which serves
//! `PodCertificateRequest`s (status subresource, field selectors) and
//! `ClusterTrustBundle`s with kube-apiserver's own validation, so a status
//! the real API server would refuse fails these tests.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use meshca_certs::bundle::parse_certs_pem;
use meshca_certs::inspect::CertSummary;
use meshca_certs::{KeyAlgorithm, PrivateKey, SpiffeId, TrustBundle};
use meshca_tests::fake_certificates::{rsa_pss_proof, KeyEncoding, PodRequest};
use meshca_tests::fake_kube::FakeKube;
use meshca_tests::*;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, X509Certificate};

const SIGNER: &str = "meshca.io/spiffe";
const BUNDLE_NAME: &str = "meshca.io:spiffe:trust-bundle";
const NODE: &str = "node-a";

async fn wait_until<F: FnMut() -> bool>(what: &str, timeout: Duration, mut done: F) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn args(kube: &FakeKube, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "--kubeconfig".to_string(),
        kube.kubeconfig.display().to_string(),
        "--leader-lease-duration".into(),
        "3s".into(),
        "--pod-certificate-signer".into(),
        SIGNER.into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn request(kube: &FakeKube, name: &str) -> serde_json::Value {
    kube.get_object("podcertificaterequests", "default", name)
        .unwrap_or_else(|| panic!("request {name} exists"))
}

/// The condition `(type, reason, message)` of an answered request.
fn answer(kube: &FakeKube, name: &str) -> Option<(String, String, String)> {
    let r = request(kube, name);
    let c = r["status"]["conditions"].as_array()?.first()?.clone();
    Some((
        c["type"].as_str()?.to_string(),
        c["reason"].as_str()?.to_string(),
        c["message"].as_str().unwrap_or_default().to_string(),
    ))
}

fn time_of(value: &serde_json::Value) -> OffsetDateTime {
    OffsetDateTime::parse(value.as_str().unwrap(), &Rfc3339).unwrap()
}

fn cluster_trust_bundle(kube: &FakeKube) -> Option<serde_json::Value> {
    kube.get_object("clustertrustbundles", "", BUNDLE_NAME)
}

/// Creates a pod and a request for it, as the kubelet does.
fn create_for_pod(
    kube: &FakeKube,
    name: &str,
    service_account: &str,
    key: &PrivateKey,
    encoding: KeyEncoding,
    max_expiration_seconds: Option<i64>,
) {
    let pod = format!("pod-{name}");
    let uid = format!("uid-{name}");
    kube.add_pod("default", &pod, &uid, service_account, NODE);
    let object = PodRequest {
        namespace: "default",
        name,
        signer: SIGNER,
        pod: (&pod, &uid, service_account, NODE),
        max_expiration_seconds,
    }
    .to_json(key, encoding);
    kube.create_object("podcertificaterequests", object)
        .unwrap_or_else(|e| panic!("the API accepts {name}: {e}"));
}

/// Checks an issued request the way a pod would use it: chain to the
/// ClusterTrustBundle, identity, key, and the status fields.
fn check_issued(
    kube: &FakeKube,
    name: &str,
    key: &PrivateKey,
    service_account: &str,
    lifetime: i64,
) {
    let r = request(kube, name);
    let status = &r["status"];
    let chain_pem = status["certificateChain"].as_str().unwrap();
    let chain = parse_certs_pem(chain_pem).unwrap();
    let (_, leaf) = X509Certificate::from_der(&chain[0]).unwrap();
    assert_eq!(
        leaf.public_key().raw,
        key.public_key_spki_der().as_slice(),
        "{name}: issued to the pod's key"
    );
    let summary = CertSummary::from_der(&chain[0]).unwrap();
    let id = format!("spiffe://cluster.local/ns/default/sa/{service_account}");
    assert_eq!(summary.uris, vec![id.clone()]);
    assert!(!summary.is_ca);
    assert_eq!(time_of(&status["notBefore"]), summary.not_before);
    assert_eq!(time_of(&status["notAfter"]), summary.not_after);
    assert_eq!(
        (summary.not_after - summary.not_before).whole_seconds(),
        lifetime,
        "{name}: lifetime"
    );
    let refresh = time_of(&status["beginRefreshAt"]);
    let half: OffsetDateTime = summary.not_before + (summary.not_after - summary.not_before) / 2;
    assert!(
        (refresh - half).abs() <= (summary.not_after - summary.not_before) / 20,
        "{name}: refresh {refresh} near half-life {half}"
    );
    // No root in the chain: the pod trusts the ClusterTrustBundle.
    let ctb = cluster_trust_bundle(kube).unwrap();
    let bundle = TrustBundle::from_pem(ctb["spec"]["trustBundle"].as_str().unwrap()).unwrap();
    for cert in &chain {
        let s = CertSummary::from_der(cert).unwrap();
        assert!(!s.self_signed, "{name}: the root is not in the chain");
    }
    meshca_certs::verify::verify_svid(
        &chain,
        &bundle,
        std::time::SystemTime::now(),
        Some(&SpiffeId::parse(&id).unwrap()),
    )
    .unwrap_or_else(|e| panic!("{name}: chain verifies to the ClusterTrustBundle: {e}"));
    let (kind, reason, _) = answer(kube, name).unwrap();
    assert_eq!((kind.as_str(), reason.as_str()), ("Issued", "Issued"));
}

/// An ECDSA P-521 stub PKCS#10 request (DER), signed by its key.
const P521_STUB_CSR: &[u8] = include_bytes!("../data/p521-stub-csr.der");

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn ed25519() -> PrivateKey {
    PrivateKey::from_pkcs8_der(
        &rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)
            .unwrap()
            .serialize_der(),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_type_in_both_encodings_is_issued_and_verifies_to_the_cluster_trust_bundle() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let server = start_off_runtime(dir.path().join("data"), args(&kube, &[])).await;

    let p256 = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let p384 = PrivateKey::generate(KeyAlgorithm::EcdsaP384).unwrap();
    let rsa3072 = PrivateKey::generate(KeyAlgorithm::Rsa3072).unwrap();
    let ed = ed25519();
    let cases: Vec<(&str, &PrivateKey, KeyEncoding)> = vec![
        ("p256-stub", &p256, KeyEncoding::StubCsr),
        ("p256-proof", &p256, KeyEncoding::ProofOfPossession),
        ("p384-stub", &p384, KeyEncoding::StubCsr),
        ("p384-proof", &p384, KeyEncoding::ProofOfPossession),
        ("rsa3072-stub", &rsa3072, KeyEncoding::StubCsr),
        ("rsa3072-proof", &rsa3072, KeyEncoding::ProofOfPossession),
        ("ed25519-stub", &ed, KeyEncoding::StubCsr),
        ("ed25519-proof", &ed, KeyEncoding::ProofOfPossession),
    ];
    for (name, key, encoding) in &cases {
        create_for_pod(&kube, name, "web", key, *encoding, None);
    }
    // One hour asked: exactly one hour, backdating included.
    create_for_pod(
        &kube,
        "one-hour",
        "web",
        &p256,
        KeyEncoding::StubCsr,
        Some(3600),
    );
    // Another signer's request: left alone.
    let other = PodRequest {
        namespace: "default",
        name: "other-signer",
        signer: "example.com/other",
        pod: ("pod-p256-stub", "uid-p256-stub", "web", NODE),
        max_expiration_seconds: None,
    }
    .to_json(&p256, KeyEncoding::StubCsr);
    kube.create_object("podcertificaterequests", other).unwrap();

    let names: Vec<&str> = cases.iter().map(|c| c.0).chain(["one-hour"]).collect();
    wait_until("every request answered", Duration::from_secs(30), || {
        names.iter().all(|n| answer(&kube, n).is_some())
    })
    .await;
    wait_until("the ClusterTrustBundle", Duration::from_secs(10), || {
        cluster_trust_bundle(&kube).is_some()
    })
    .await;
    for (name, key, _) in &cases {
        check_issued(&kube, name, key, "web", 86400);
    }
    check_issued(&kube, "one-hour", &p256, "web", 3600);

    let ctb = cluster_trust_bundle(&kube).unwrap();
    assert_eq!(ctb["spec"]["signerName"], SIGNER);
    let configmap = kube
        .get_object("configmaps", "default", "istio-ca-root-cert")
        .unwrap();
    assert_eq!(
        ctb["spec"]["trustBundle"], configmap["data"]["root-cert.pem"],
        "the same roots as the istio-ca-root-cert ConfigMaps"
    );
    assert_eq!(
        parse_certs_pem(ctb["spec"]["trustBundle"].as_str().unwrap()).unwrap(),
        parse_certs_pem(&server.root_pem()).unwrap()
    );

    assert!(
        request(&kube, "other-signer")["status"].is_null(),
        "another signer's request is untouched"
    );
    assert_eq!(
        kube.calls("podcertificaterequests/status", "update"),
        names.len(),
        "one status write per request"
    );
    let log = server.log();
    for name in &names {
        let serial = CertSummary::from_der(
            &parse_certs_pem(
                request(&kube, name)["status"]["certificateChain"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap()[0],
        )
        .unwrap()
        .serial;
        assert!(
            log.lines().any(|l| l.contains("issued pod certificate")
                && l.contains(&serial)
                && l.contains(&format!("pod-{name}"))
                && l.contains(NODE)
                && l.contains("spiffe://cluster.local/ns/default/sa/web")),
            "audit line for {name}:\n{log}"
        );
    }
    let metrics = http_get(server.monitoring, "/metrics").unwrap().1;
    assert!(
        metrics.contains(&format!(
            "meshca_pod_certificate_request_count{{result=\"Issued\",reason=\"Issued\"}} {}",
            names.len()
        )),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_must_not_be_signed_are_denied_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let server = start_off_runtime(dir.path().join("data"), args(&kube, &[])).await;
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();

    // The pod is gone before meshca gets to it.
    kube.add_pod("default", "pod-pod-gone", "uid-pod-gone", "web", NODE);
    kube.delete_pod("default", "pod-pod-gone");
    let gone = PodRequest {
        namespace: "default",
        name: "pod-gone",
        signer: SIGNER,
        pod: ("pod-pod-gone", "uid-pod-gone", "web", NODE),
        max_expiration_seconds: None,
    };
    kube.create_object(
        "podcertificaterequests",
        gone.to_json(&key, KeyEncoding::StubCsr),
    )
    .unwrap();
    // The pod runs on another node than the request says.
    kube.add_pod("default", "pod-elsewhere", "uid-elsewhere", "web", "node-b");
    let elsewhere = PodRequest {
        namespace: "default",
        name: "elsewhere",
        signer: SIGNER,
        pod: ("pod-elsewhere", "uid-elsewhere", "web", NODE),
        max_expiration_seconds: None,
    };
    kube.create_object(
        "podcertificaterequests",
        elsewhere.to_json(&key, KeyEncoding::StubCsr),
    )
    .unwrap();
    // The pod runs as another service account than the request says.
    kube.add_pod("default", "pod-other-sa", "uid-other-sa", "db", NODE);
    let other_sa = PodRequest {
        name: "other-sa",
        pod: ("pod-other-sa", "uid-other-sa", "web", NODE),
        ..elsewhere.clone()
    };
    kube.create_object(
        "podcertificaterequests",
        other_sa.to_json(&key, KeyEncoding::StubCsr),
    )
    .unwrap();
    // The pod was deleted and created again under the same name: the
    // request's pod (the old UID) is gone.
    kube.add_pod("default", "pod-recreated", "uid-recreated-new", "web", NODE);
    let recreated = PodRequest {
        name: "recreated",
        pod: ("pod-recreated", "uid-recreated-old", "web", NODE),
        ..elsewhere.clone()
    };
    kube.create_object(
        "podcertificaterequests",
        recreated.to_json(&key, KeyEncoding::StubCsr),
    )
    .unwrap();
    // unverifiedUserAnnotations meshca does not know: 150 keys of 250
    // characters (37 KiB of names, more than the API lets a condition's
    // message hold: the denial must still be written).
    kube.add_pod("default", "pod-annotated", "uid-annotated", "web", NODE);
    let mut annotated = PodRequest {
        name: "annotated",
        pod: ("pod-annotated", "uid-annotated", "web", NODE),
        ..elsewhere.clone()
    }
    .to_json(&key, KeyEncoding::StubCsr);
    let keys: serde_json::Map<String, serde_json::Value> = (0..150)
        .map(|i| (format!("example.com/{i:03}{}", "k".repeat(234)), "v".into()))
        .collect();
    annotated["spec"]["unverifiedUserAnnotations"] = serde_json::Value::Object(keys);
    kube.create_object("podcertificaterequests", annotated)
        .unwrap();
    // A proof of possession over another pod's UID: kube-apiserver refuses
    // it at creation; written past the API (as by an older or broken API
    // server), meshca refuses it too.
    kube.add_pod("default", "pod-forged", "uid-forged", "web", NODE);
    let mut forged = PodRequest {
        name: "forged",
        pod: ("pod-forged", "uid-forged", "web", NODE),
        ..elsewhere.clone()
    }
    .to_json(&key, KeyEncoding::ProofOfPossession);
    let other_proof =
        meshca_tests::fake_certificates::proof_of_possession(&key, "uid-other").unwrap();
    forged["spec"]["proofOfPossession"] = serde_json::json!(b64(&other_proof));
    let refused = kube
        .create_object("podcertificaterequests", forged.clone())
        .unwrap_err();
    assert!(refused.contains("proof-of-possession"), "{refused}");
    kube.put_object("podcertificaterequests", forged);

    let expected: BTreeMap<&str, (&str, &str)> = BTreeMap::from([
        ("pod-gone", ("Denied", "PodNotFound")),
        ("elsewhere", ("Denied", "PodMismatch")),
        ("other-sa", ("Denied", "PodMismatch")),
        ("recreated", ("Denied", "PodNotFound")),
        ("annotated", ("Denied", "UnknownUserAnnotation")),
        ("forged", ("Denied", "InvalidProofOfPossession")),
        ("p521", ("Denied", "UnsupportedKeyType")),
        ("rsa-e3-stub", ("Denied", "UnsupportedKeyType")),
        ("rsa-e3-proof", ("Denied", "UnsupportedKeyType")),
    ]);

    // An RSA 3072 key with public exponent 3, in either encoding: the API
    // accepts it (Go verifies its signatures), meshca denies it naming the
    // rule. ring loads no such private key, so the `rsa` crate signs.
    let e3 = RsaTestKey::with_exponent(3072, 3);
    kube.add_pod("default", "pod-rsa-e3-stub", "uid-rsa-e3-stub", "web", NODE);
    let mut e3_stub = PodRequest {
        name: "rsa-e3-stub",
        pod: ("pod-rsa-e3-stub", "uid-rsa-e3-stub", "web", NODE),
        ..elsewhere.clone()
    }
    .to_json(&key, KeyEncoding::StubCsr);
    e3_stub["spec"]["stubPKCS10Request"] = serde_json::json!(b64(&e3.stub_csr_der()));
    kube.create_object("podcertificaterequests", e3_stub)
        .unwrap();
    kube.add_pod(
        "default",
        "pod-rsa-e3-proof",
        "uid-rsa-e3-proof",
        "web",
        NODE,
    );
    let mut e3_proof = PodRequest {
        name: "rsa-e3-proof",
        pod: ("pod-rsa-e3-proof", "uid-rsa-e3-proof", "web", NODE),
        ..elsewhere.clone()
    }
    .to_json(&key, KeyEncoding::ProofOfPossession);
    e3_proof["spec"]["pkixPublicKey"] = serde_json::json!(b64(&e3.spki_der()));
    e3_proof["spec"]["proofOfPossession"] =
        serde_json::json!(b64(&rsa_pss_proof(e3.private(), "uid-rsa-e3-proof")));
    kube.create_object("podcertificaterequests", e3_proof)
        .unwrap();

    // A P-521 key: the API accepts it, meshca does not sign it. The stub
    // CSR is a fixture (made once with `openssl genpkey -algorithm EC
    // -pkeyopt ec_paramgen_curve:P-521` and `openssl req -new -subj /
    // -outform DER`; the key was thrown away), so this runs everywhere.
    kube.add_pod("default", "pod-p521", "uid-p521", "web", NODE);
    let mut p521 = PodRequest {
        name: "p521",
        pod: ("pod-p521", "uid-p521", "web", NODE),
        ..elsewhere.clone()
    }
    .to_json(&key, KeyEncoding::StubCsr);
    p521["spec"]["stubPKCS10Request"] = serde_json::json!(b64(P521_STUB_CSR));
    kube.create_object("podcertificaterequests", p521).unwrap();
    // An RSA 2048 key never reaches a signer: the API refuses it.
    let rsa2048 = PrivateKey::generate(KeyAlgorithm::Rsa2048).unwrap();
    let refused = kube
        .create_object(
            "podcertificaterequests",
            PodRequest {
                name: "rsa2048",
                ..elsewhere.clone()
            }
            .to_json(&rsa2048, KeyEncoding::StubCsr),
        )
        .unwrap_err();
    assert!(
        refused.contains("RSA keys must have modulus size 3072 or 4096"),
        "{refused}"
    );

    wait_until("every request answered", Duration::from_secs(30), || {
        expected.keys().all(|n| answer(&kube, n).is_some())
    })
    .await;
    for (name, (kind, reason)) in &expected {
        let (got_kind, got_reason, message) = answer(&kube, name).unwrap();
        assert_eq!(
            (got_kind.as_str(), got_reason.as_str()),
            (*kind, *reason),
            "{name}: {message}"
        );
        let status = &request(&kube, name)["status"];
        assert!(
            status["certificateChain"].is_null(),
            "{name}: only the condition"
        );
        if *name == "p521" {
            assert!(
                message.contains("ECDSA P-521") && message.contains("ECDSA P-256"),
                "names the key and a supported type: {message}"
            );
        }
        if name.starts_with("rsa-e3") {
            assert!(
                message.contains("RSA 3072")
                    && message.contains(
                        "RSA public exponent must be odd and at least 65537 (this key's is 3)"
                    ),
                "names the key and the rule: {message}"
            );
        }
    }
    let (_, _, message) = answer(&kube, "other-sa").unwrap();
    assert!(
        message.contains("service account \"db\", not \"web\""),
        "{message}"
    );
    let (_, _, message) = answer(&kube, "recreated").unwrap();
    assert!(
        message.contains("has UID uid-recreated-new, not uid-recreated-old"),
        "{message}"
    );
    // Every denial is audited with the identity the request claimed.
    let log = server.log();
    for name in expected.keys() {
        assert!(
            log.lines().any(|l| l.contains("denied pod certificate")
                && l.contains(&format!("request={name} "))
                && l.contains("identity=spiffe://cluster.local/ns/default/sa/web ")),
            "denial of {name} audited with the claimed identity:\n{log}"
        );
    }
    let metrics = http_get(server.monitoring, "/metrics").unwrap().1;
    assert!(
        metrics.contains(
            "meshca_pod_certificate_request_count{result=\"Denied\",reason=\"PodNotFound\"} 2"
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_trust_bundle_is_set_back_and_recreated() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let server = start_off_runtime(dir.path().join("data"), args(&kube, &[])).await;
    let root = server.root_pem();
    let is_right = |kube: &FakeKube| {
        cluster_trust_bundle(kube).is_some_and(|ctb| {
            ctb["spec"]["signerName"] == SIGNER
                && ctb["metadata"]["labels"]["meshca.io/trust-domain"] == "cluster.local"
                && ctb["spec"]["trustBundle"]
                    .as_str()
                    .map(parse_certs_pem)
                    .and_then(Result::ok)
                    == parse_certs_pem(&root).ok()
        })
    };
    wait_until("the ClusterTrustBundle", Duration::from_secs(20), || {
        is_right(&kube)
    })
    .await;

    // Edited by hand (another CA's root): set back.
    let mut edited = cluster_trust_bundle(&kube).unwrap();
    let other = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let other_root = meshca_certs::profile::self_signed_root(
        &other,
        &meshca_certs::SubjectName {
            common_name: Some("other".into()),
            ..Default::default()
        },
        meshca_certs::Validity::backdated(OffsetDateTime::now_utc(), time::Duration::days(1)),
    )
    .unwrap();
    edited["spec"]["trustBundle"] = serde_json::json!(other_root.to_pem());
    kube.put_object("clustertrustbundles", edited);
    assert!(!is_right(&kube));
    wait_until("the edit set back", Duration::from_secs(20), || {
        is_right(&kube)
    })
    .await;

    // The trust-domain label removed (pods' projections may select on
    // it), another label added: the label set back, the other kept.
    let mut unlabelled = cluster_trust_bundle(&kube).unwrap();
    unlabelled["metadata"]["labels"] = serde_json::json!({"team": "mesh"});
    kube.put_object("clustertrustbundles", unlabelled);
    assert!(!is_right(&kube));
    wait_until("the label set back", Duration::from_secs(20), || {
        is_right(&kube)
    })
    .await;
    assert_eq!(
        cluster_trust_bundle(&kube).unwrap()["metadata"]["labels"]["team"],
        "mesh",
        "another label is kept"
    );
    // The label edited to another trust domain: set back.
    let mut relabelled = cluster_trust_bundle(&kube).unwrap();
    relabelled["metadata"]["labels"]["meshca.io/trust-domain"] = serde_json::json!("other.domain");
    kube.put_object("clustertrustbundles", relabelled);
    assert!(!is_right(&kube));
    wait_until("the label edit set back", Duration::from_secs(20), || {
        is_right(&kube)
    })
    .await;

    // Deleted: recreated.
    kube.delete_object("clustertrustbundles", "", BUNDLE_NAME);
    wait_until(
        "the ClusterTrustBundle recreated",
        Duration::from_secs(20),
        || is_right(&kube),
    )
    .await;
    assert!(kube.calls("clustertrustbundles", "create") >= 2);
}

fn metrics_of(server: &MeshcaServer) -> String {
    http_get(server.monitoring, "/metrics").unwrap().1
}

fn log_lines_with(log: &str, parts: &[&str]) -> usize {
    log.lines()
        .filter(|l| parts.iter().all(|p| l.contains(p)))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_writers_answer_stands_and_meshcas_is_discarded() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let server = start_off_runtime(dir.path().join("data"), args(&kube, &[])).await;
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    // Another writer (an operator, another signer) denies the request just
    // before meshca's status update lands: meshca's update carries a stale
    // resourceVersion and gets 409 Conflict.
    let now = OffsetDateTime::now_utc().format(&Rfc3339).unwrap();
    kube.answer_before_next_status_update(
        "default",
        "contested",
        serde_json::json!({"conditions": [{
            "type": "Denied", "status": "True", "reason": "DeniedByPolicy",
            "message": "denied by another writer", "lastTransitionTime": now,
        }]}),
    );
    create_for_pod(&kube, "contested", "web", &key, KeyEncoding::StubCsr, None);
    wait_until(
        "the discarded answer logged",
        Duration::from_secs(30),
        || server.log().contains("pod certificate answer discarded"),
    )
    .await;

    // The other writer's answer stands, untouched.
    let (kind, reason, message) = answer(&kube, "contested").unwrap();
    assert_eq!(
        (kind.as_str(), reason.as_str(), message.as_str()),
        ("Denied", "DeniedByPolicy", "denied by another writer")
    );
    assert!(request(&kube, "contested")["status"]["certificateChain"].is_null());
    assert_eq!(
        kube.calls("podcertificaterequests/status", "update"),
        1,
        "meshca's one update (refused with 409), never written again"
    );
    // One discarded line, with the certificate that reached nobody and the
    // identity it was for.
    let log = server.log();
    assert_eq!(
        log_lines_with(&log, &["pod certificate answer discarded"]),
        1,
        "{log}"
    );
    assert_eq!(
        log_lines_with(
            &log,
            &[
                "pod certificate answer discarded",
                "request=contested ",
                "identity=spiffe://cluster.local/ns/default/sa/web ",
                "reason=\"Issued\"",
                "answered by another writer",
            ]
        ),
        1,
        "{log}"
    );
    let metrics = metrics_of(&server);
    assert!(
        !metrics.contains("meshca_pod_certificate_request_count{result=\"Issued\""),
        "nothing counted Issued: {metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_api_calls_failed_is_signed_once_the_api_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let server = start_off_runtime(dir.path().join("data"), args(&kube, &[])).await;
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    // Every read of a pod fails: the request cannot be checked.
    kube.fail_calls("pods", "get");
    create_for_pod(&kube, "patient", "web", &key, KeyEncoding::StubCsr, None);
    let gave_up =
        "meshca_pod_certificate_request_count{result=\"GaveUp\",reason=\"RetriesExhausted\"} 1";
    wait_until(
        "a whole round of attempts failed",
        Duration::from_secs(60),
        || metrics_of(&server).contains(gave_up),
    )
    .await;
    assert!(kube.failed_calls() >= 6, "{} failed", kube.failed_calls());
    assert!(answer(&kube, "patient").is_none());
    // The API recovers; the same leader (no new listing, no leader
    // change) signs the request in its next round.
    kube.stop_failing();
    wait_until(
        "issued after the API recovered",
        Duration::from_secs(60),
        || answer(&kube, "patient").is_some(),
    )
    .await;
    check_issued(&kube, "patient", &key, "web", 86400);
    let metrics = metrics_of(&server);
    for line in [
        gave_up,
        "meshca_pod_certificate_request_count{result=\"Issued\",reason=\"Issued\"} 1",
        "meshca_pod_certificate_requests_waiting 0",
        "\nmeshca_leader 1\n",
    ] {
        assert!(metrics.contains(line), "{line}: {metrics}");
    }
    assert_eq!(
        kube.calls("podcertificaterequests", "list"),
        1,
        "no new listing"
    );
    // Parked between its rounds, with the reason logged.
    assert!(
        server
            .log()
            .contains("PodCertificateRequest still unanswered; trying again later"),
        "{}",
        server.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_watch_event_of_an_answered_request_signs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let server = start_off_runtime(dir.path().join("data"), args(&kube, &[])).await;
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    kube.add_pod("default", "pod-stale", "uid-stale", "web", NODE);
    let unanswered = kube
        .create_object(
            "podcertificaterequests",
            PodRequest {
                namespace: "default",
                name: "stale",
                signer: SIGNER,
                pod: ("pod-stale", "uid-stale", "web", NODE),
                max_expiration_seconds: None,
            }
            .to_json(&key, KeyEncoding::StubCsr),
        )
        .unwrap();
    wait_until("issued", Duration::from_secs(30), || {
        answer(&kube, "stale").is_some()
    })
    .await;
    check_issued(&kube, "stale", &key, "web", 86400);
    // The watch delivers the request's older, unanswered version again.
    kube.send_stale_event("podcertificaterequests", &unanswered);
    let skipped =
        "meshca_pod_certificate_request_count{result=\"Skipped\",reason=\"AlreadyAnswered\"} 1";
    wait_until("the stale event skipped", Duration::from_secs(30), || {
        metrics_of(&server).contains(skipped)
    })
    .await;
    let log = server.log();
    assert_eq!(
        log_lines_with(&log, &["issued pod certificate", "request=stale "]),
        1,
        "signed once: {log}"
    );
    assert!(!log.contains("discarded"), "{log}");
    assert_eq!(kube.calls("podcertificaterequests/status", "update"), 1);
}

fn certs_in(path: &std::path::Path) -> Vec<Vec<u8>> {
    parse_certs_pem(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn bundle_roots(kube: &FakeKube) -> BTreeSet<Vec<u8>> {
    cluster_trust_bundle(kube)
        .and_then(|ctb| parse_certs_pem(ctb["spec"]["trustBundle"].as_str()?).ok())
        .unwrap_or_default()
        .into_iter()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugged_in_intermediate_is_the_chain_after_the_leaf() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let root = pki.join("root");
    certs_cli(&["root-ca", "--out", root.to_str().unwrap()]);
    let east = intermediate_ca(&pki, &root, "east", &[]);
    let kube = FakeKube::start(dir.path()).await;
    let _server = start_off_runtime(
        dir.path().join("data"),
        args(&kube, &["--ca-dir", east.to_str().unwrap()]),
    )
    .await;
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP384).unwrap();
    create_for_pod(
        &kube,
        "via-intermediate",
        "web",
        &key,
        KeyEncoding::ProofOfPossession,
        None,
    );
    wait_until("issued", Duration::from_secs(30), || {
        answer(&kube, "via-intermediate").is_some() && cluster_trust_bundle(&kube).is_some()
    })
    .await;
    // Verified to the ClusterTrustBundle, no root in the chain.
    check_issued(&kube, "via-intermediate", &key, "web", 86400);
    let chain = parse_certs_pem(
        request(&kube, "via-intermediate")["status"]["certificateChain"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let intermediate = certs_in(&east.join("ca-cert.pem")).remove(0);
    assert_eq!(chain.len(), 2, "[leaf, intermediate]");
    assert_eq!(chain[1], intermediate);
    assert!(CertSummary::from_der(&chain[1]).unwrap().is_ca);
    let roots: BTreeSet<Vec<u8>> = certs_in(&east.join("root-cert.pem")).into_iter().collect();
    assert_eq!(
        bundle_roots(&kube),
        roots,
        "the ClusterTrustBundle holds the root"
    );
    assert!(!roots.contains(&intermediate));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_trust_bundle_holds_both_roots_during_a_root_rotation() {
    use meshca_tests::root_rotation::{ask_root_rotation, bundle_configmap, rotation_state};
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let _server = start_off_runtime(
        dir.path().join("data"),
        args(&kube, &["--root-rotation-grace", "6s"]),
    )
    .await;
    let configmap_roots = |kube: &FakeKube| -> BTreeSet<Vec<u8>> {
        bundle_configmap(kube, "default")
            .and_then(|pem| parse_certs_pem(&pem).ok())
            .unwrap_or_default()
            .into_iter()
            .collect()
    };
    wait_until("the ClusterTrustBundle", Duration::from_secs(20), || {
        rotation_state(&kube).is_some() && bundle_roots(&kube).len() == 1
    })
    .await;
    let old_root = rotation_state(&kube).unwrap().signing_root;
    assert_eq!(bundle_roots(&kube), BTreeSet::from([old_root.clone()]));

    assert!(ask_root_rotation(&kube));
    wait_until(
        "both roots in the ClusterTrustBundle, as in the ConfigMap",
        Duration::from_secs(30),
        || bundle_roots(&kube).len() == 2 && bundle_roots(&kube) == configmap_roots(&kube),
    )
    .await;
    assert!(bundle_roots(&kube).contains(&old_root));
    // Switched: the new root signs; the old one stays in the bundle.
    wait_until("the new root signing", Duration::from_secs(30), || {
        rotation_state(&kube).is_some_and(|s| s.phase == "switched")
    })
    .await;
    let new_root = rotation_state(&kube).unwrap().signing_root;
    assert_ne!(new_root, old_root);
    assert_eq!(
        bundle_roots(&kube),
        BTreeSet::from([old_root.clone(), new_root.clone()])
    );
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    create_for_pod(
        &kube,
        "after-switch",
        "web",
        &key,
        KeyEncoding::StubCsr,
        None,
    );
    wait_until("issued", Duration::from_secs(30), || {
        answer(&kube, "after-switch").is_some()
    })
    .await;
    check_issued(&kube, "after-switch", &key, "web", 86400);
    // Signed under the new root: a pod trusting only the old root would
    // not verify it, which is why both stay in the bundle.
    let chain = parse_certs_pem(
        request(&kube, "after-switch")["status"]["certificateChain"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let only =
        |root: &[u8]| TrustBundle::from_pem(&meshca_certs::bundle::encode_cert_pem(root)).unwrap();
    let id = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap();
    let now = std::time::SystemTime::now();
    assert!(meshca_certs::verify::verify_svid(&chain, &only(&new_root), now, Some(&id)).is_ok());
    assert!(meshca_certs::verify::verify_svid(&chain, &only(&old_root), now, Some(&id)).is_err());
}

/// Creates `count` pods and one request each, all at once.
fn burst(kube: &FakeKube, count: usize) -> Vec<String> {
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let object = |i: usize| {
        let (name, pod, uid) = (
            format!("burst-{i}"),
            format!("pod-burst-{i}"),
            format!("uid-burst-{i}"),
        );
        kube.add_pod("default", &pod, &uid, "web", NODE);
        PodRequest {
            namespace: "default",
            name: &name,
            signer: SIGNER,
            pod: (&pod, &uid, "web", NODE),
            max_expiration_seconds: None,
        }
        .to_json(&key, KeyEncoding::StubCsr)
    };
    let objects: Vec<serde_json::Value> = (0..count).map(object).collect();
    objects
        .into_iter()
        .map(|o| {
            let name = o["metadata"]["name"].as_str().unwrap().to_string();
            kube.create_object("podcertificaterequests", o).unwrap();
            name
        })
        .collect()
}

fn issued_serials(kube: &FakeKube, names: &[String]) -> BTreeSet<String> {
    names
        .iter()
        .filter_map(|n| {
            let r = request(kube, n);
            let chain = r["status"]["certificateChain"].as_str()?.to_string();
            Some(
                CertSummary::from_der(&parse_certs_pem(&chain).ok()?[0])
                    .ok()?
                    .serial,
            )
        })
        .collect()
}

fn audited_serials(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("issued pod certificate"))
        .filter_map(|l| {
            let at = l.find("serial=")? + "serial=".len();
            Some(
                l[at..]
                    .split_whitespace()
                    .next()?
                    .trim_matches('"')
                    .to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_requests_at_once_are_each_issued_once() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let server = start_off_runtime(dir.path().join("data"), args(&kube, &[])).await;
    let names = burst(&kube, 1000);
    // Generous: the machine may be shared; this is not a timing test
    // (meshca-bench pod-certificates measures the pace).
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let answered = names.iter().filter(|n| answer(&kube, n).is_some()).count();
        if answered == names.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{answered} of 1,000 answered\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for name in &names {
        assert_eq!(answer(&kube, name).unwrap().0, "Issued", "{name}");
    }
    let serials = issued_serials(&kube, &names);
    assert_eq!(serials.len(), 1000, "1,000 distinct certificates");
    assert_eq!(kube.calls("podcertificaterequests/status", "update"), 1000);
    let log = server.log();
    let audited = audited_serials(&log);
    assert_eq!(audited.len(), 1000);
    assert_eq!(audited.into_iter().collect::<BTreeSet<_>>(), serials);
    assert!(!log.contains("discarded"), "one writer: nothing discarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_other_replica_finishes_a_burst_when_the_leader_stops() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let a = start_off_runtime(dir.path().join("a"), args(&kube, &[])).await;
    let b = start_off_runtime(dir.path().join("b"), args(&kube, &[])).await;
    let is_leader = |s: &MeshcaServer| {
        http_get(s.monitoring, "/metrics").is_ok_and(|(_, m)| m.contains("\nmeshca_leader 1\n"))
    };
    wait_until("a leader", Duration::from_secs(20), || {
        is_leader(&a) || is_leader(&b)
    })
    .await;
    let (mut leader, follower) = if is_leader(&a) { (a, b) } else { (b, a) };
    // Slow answers, so the burst is still running when the leader stops.
    kube.set_latency(Duration::from_millis(40));
    let names = burst(&kube, 1000);
    let answered = |kube: &FakeKube| names.iter().filter(|n| answer(kube, n).is_some()).count();
    wait_until("the burst under way", Duration::from_secs(60), || {
        answered(&kube) >= 100
    })
    .await;
    assert_eq!(leader.terminate().map(|s| s.success()), Some(true));
    let by_old_leader = answered(&kube);
    assert!(
        by_old_leader < 1000,
        "the leader stopped mid-burst ({by_old_leader} answered)"
    );
    wait_until("all 1,000 answered", Duration::from_secs(180), || {
        answered(&kube) == 1000
    })
    .await;
    for name in &names {
        assert_eq!(answer(&kube, name).unwrap().0, "Issued", "{name}");
    }
    // Each request answered once (kube-apiserver's validation, in the fake,
    // refuses any change of an answered status), and every certificate in
    // a status is in one replica's audit log. A certificate the stopped
    // leader signed but never wrote is audited too, so the logs may name
    // more serials than the statuses; never fewer.
    let serials = issued_serials(&kube, &names);
    assert_eq!(serials.len(), 1000);
    let mut audited = audited_serials(&leader.log());
    let from_follower = audited_serials(&follower.log());
    assert!(!from_follower.is_empty(), "the other replica took over");
    audited.extend(from_follower);
    let audited: BTreeSet<String> = audited.into_iter().collect();
    let unaudited: Vec<&String> = serials.difference(&audited).collect();
    assert!(
        unaudited.is_empty(),
        "certificates without an audit line: {unaudited:?}"
    );
    for log in [leader.log(), follower.log()] {
        assert!(!log.contains("refused the issued status"), "{log}");
    }
}

#[test]
fn a_signer_name_the_api_would_refuse_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    for (name, expected) in [
        ("spiffe", "--pod-certificate-signer \"spiffe\""),
        ("kubernetes.io/spiffe", "reserved for Kubernetes"),
    ] {
        MeshcaServer::refuses_to_start(
            &dir.path().join("data"),
            &["--pod-certificate-signer", name],
            expected,
        );
    }
    // No Kubernetes API: nothing to sign from, refused rather than off.
    MeshcaServer::refuses_to_start(
        &dir.path().join("data"),
        &["--pod-certificate-signer", SIGNER],
        "--pod-certificate-signer needs the Kubernetes API",
    );
    MeshcaServer::refuses_to_start(
        &dir.path().join("data"),
        &[
            "--pod-certificate-signer",
            SIGNER,
            "--workload-cert-ttl",
            "30m",
            "--max-workload-cert-ttl",
            "30m",
        ],
        "at least 1h",
    );
}
