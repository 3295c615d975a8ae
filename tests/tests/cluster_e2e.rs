//! End-to-end tests of meshca in a cluster: the real `meshca` against the
//! fake API server (real JSON, real watches, optimistic concurrency): the
//! root in the Secret, replicas agreeing on it, the bundle ConfigMap in
//! every namespace, leader election, root rotation, `--ca-dir` reload and
//! readiness tied to the CA's validity.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshca_certs::bundle::parse_certs_pem;
use meshca_certs::inspect::CertSummary;
use meshca_certs::{KeyAlgorithm, SpiffeId, TrustBundle};
use meshca_tests::fake_kube::{FakeKube, FakeUser};
use meshca_tests::*;
use tonic::Code;

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";

fn unb64(value: &serde_json::Value) -> String {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(value.as_str().unwrap_or_default())
        .unwrap_or_default();
    String::from_utf8(bytes).unwrap()
}

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
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn secret(kube: &FakeKube) -> Option<serde_json::Value> {
    kube.get_object("secrets", "istio-system", "istio-ca-secret")
}

fn bundle_in(kube: &FakeKube, ns: &str) -> Option<String> {
    kube.get_object("configmaps", ns, "istio-ca-root-cert")
        .and_then(|cm| cm["data"]["root-cert.pem"].as_str().map(String::from))
}

fn first_cert(pem_text: &str) -> Vec<u8> {
    parse_certs_pem(pem_text).unwrap().remove(0)
}

async fn issue(
    server: &MeshcaServer,
    trust_pem: &str,
    token: &str,
) -> Result<Vec<String>, tonic::Status> {
    let mut client = server.client_trusting(trust_pem).await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    client
        .create_certificate(with_token(request, token))
        .await
        .map(|r| r.into_inner().cert_chain)
}

fn verify_against(chain_pem: &[String], bundle_pem: &str) -> Result<(), String> {
    let chain: Vec<Vec<u8>> = chain_pem.iter().map(|c| first_cert(c)).collect();
    let bundle = TrustBundle::from_pem(bundle_pem).map_err(|e| e.to_string())?;
    meshca_certs::verify::verify_svid(
        &chain,
        &bundle,
        std::time::SystemTime::now(),
        Some(&SpiffeId::parse(WEB).unwrap()),
    )
    .map(|_| ())
    .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_is_kept_in_the_secret_and_reused_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let good = kube.add_review_token("good", FakeUser::service_account("default", "web"));
    let data = dir.path().join("data");
    let mut server = start_off_runtime(data.clone(), args(&kube, &[])).await;

    let stored = secret(&kube).expect("istio-system/istio-ca-secret created");
    assert_eq!(stored["type"], "istio.io/ca-root");
    for key in ["ca-cert.pem", "ca-key.pem", "root-cert.pem"] {
        assert!(
            !unb64(&stored["data"][key]).is_empty(),
            "{key} in the Secret"
        );
    }
    let root = first_cert(&unb64(&stored["data"]["ca-cert.pem"]));
    let summary = CertSummary::from_der(&root).unwrap();
    assert!(summary.is_ca && summary.self_signed);
    // The CA signs with that root, and the data dir publishes it too.
    assert_eq!(first_cert(&server.root_pem()), root);
    let chain = issue(&server, &server.root_pem(), &good).await.unwrap();
    assert_eq!(first_cert(chain.last().unwrap()), root);
    assert!(!server.log().contains("PRIVATE KEY"), "no key in the log");
    assert_eq!(server.terminate().map(|s| s.success()), Some(true));

    // A restart (even with a fresh data dir) reuses the Secret: no new create.
    let creates = kube.calls("secrets", "create");
    let server = start_off_runtime(dir.path().join("data2"), args(&kube, &[])).await;
    assert_eq!(kube.calls("secrets", "create"), creates);
    assert_eq!(first_cert(&server.root_pem()), root);
    let chain = issue(&server, &server.root_pem(), &good).await.unwrap();
    assert_eq!(first_cert(chain.last().unwrap()), root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_secret_is_written_back_with_the_same_root() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let server = start_off_runtime(dir.path().join("data"), args(&kube, &[])).await;
    let root = first_cert(&server.root_pem());
    wait_until("leadership", Duration::from_secs(20), || {
        http_get(server.monitoring, "/metrics")
            .unwrap()
            .1
            .contains("\nmeshca_leader 1\n")
    })
    .await;
    kube.delete_object("secrets", "istio-system", "istio-ca-secret");
    wait_until("the Secret written back", Duration::from_secs(30), || {
        secret(&kube).is_some()
    })
    .await;
    let stored = secret(&kube).unwrap();
    assert_eq!(first_cert(&unb64(&stored["data"]["ca-cert.pem"])), root);
    assert_eq!(stored["type"], "istio.io/ca-root");
    assert!(server
        .log()
        .contains("wrote it back from the root in memory"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_started_together_agree_on_one_root() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let good = kube.add_review_token("good", FakeUser::service_account("default", "web"));
    // Both creates are held until both have been sent: a real race.
    kube.gate_creates("secrets", 2);
    let a = start_off_runtime(dir.path().join("a"), args(&kube, &[]));
    let b = start_off_runtime(dir.path().join("b"), args(&kube, &[]));
    let (a, b) = tokio::join!(a, b);
    assert_eq!(
        kube.calls("secrets", "create"),
        2,
        "both replicas tried to create"
    );
    let stored = first_cert(&unb64(&secret(&kube).unwrap()["data"]["ca-cert.pem"]));
    assert_eq!(first_cert(&a.root_pem()), stored);
    assert_eq!(first_cert(&b.root_pem()), stored);
    for server in [&a, &b] {
        let chain = issue(server, &server.root_pem(), &good).await.unwrap();
        assert_eq!(first_cert(chain.last().unwrap()), stored);
    }
    let loser = [&a, &b]
        .iter()
        .filter(|s| s.log().contains("another replica created the Secret first"))
        .count();
    assert_eq!(
        loser, 1,
        "exactly one replica lost the race and adopted the winner's root"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bundle_configmap_in_every_namespace_kept_right() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let server = start_off_runtime(dir.path().join("data"), args(&kube, &[])).await;
    let root = server.root_pem();
    let wait = Duration::from_secs(20);
    for ns in ["default", "istio-system"] {
        wait_until(&format!("the bundle in {ns}"), wait, || {
            bundle_in(&kube, ns).as_deref() == Some(root.as_str())
        })
        .await;
        let cm = kube
            .get_object("configmaps", ns, "istio-ca-root-cert")
            .unwrap();
        assert_eq!(cm["metadata"]["labels"]["istio.io/config"], "true");
    }
    assert!(
        bundle_in(&kube, "kube-system").is_none(),
        "kube-system is excluded by default"
    );

    // A namespace created later gets it at once.
    kube.add_namespace("late");
    wait_until("the bundle in a new namespace", wait, || {
        bundle_in(&kube, "late").as_deref() == Some(root.as_str())
    })
    .await;

    // A hand edit is set back; a deletion is undone.
    let mut edited = kube
        .get_object("configmaps", "default", "istio-ca-root-cert")
        .unwrap();
    edited["data"]["root-cert.pem"] = serde_json::json!("not a certificate");
    kube.put_object("configmaps", edited);
    wait_until("the hand edit to be set back", wait, || {
        bundle_in(&kube, "default").as_deref() == Some(root.as_str())
    })
    .await;
    kube.delete_object("configmaps", "late", "istio-ca-root-cert");
    wait_until("the deleted ConfigMap to come back", wait, || {
        bundle_in(&kube, "late").as_deref() == Some(root.as_str())
    })
    .await;
    let metrics = http_get(server.monitoring, "/metrics").unwrap().1;
    assert!(metrics.contains("\nmeshca_leader 1\n"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_publishes_and_another_takes_over() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let a = start_off_runtime(dir.path().join("a"), args(&kube, &[])).await;
    let b = start_off_runtime(dir.path().join("b"), args(&kube, &[])).await;
    let wait = Duration::from_secs(20);
    wait_until("a leader", wait, || {
        kube.get_object("leases", "istio-system", "meshca-leader")
            .is_some_and(|l| {
                l["spec"]["holderIdentity"]
                    .as_str()
                    .is_some_and(|h| !h.is_empty())
            })
    })
    .await;
    let leaders = |a: &MeshcaServer, b: &MeshcaServer| {
        [a, b]
            .iter()
            .filter(|s| {
                http_get(s.monitoring, "/metrics")
                    .unwrap()
                    .1
                    .contains("\nmeshca_leader 1\n")
            })
            .count()
    };
    let deadline = Instant::now() + wait;
    while leaders(&a, &b) != 1 {
        assert!(
            Instant::now() < deadline,
            "one replica reports leadership, not {}\nA:\n{}\nB:\n{}\nlease: {:?}",
            leaders(&a, &b),
            a.log(),
            b.log(),
            kube.get_object("leases", "istio-system", "meshca-leader")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The Lease renewed twice since: the follower, trying every retry
    // period, has had its chances to take it; at no sample two leaders.
    let renew_time = || {
        kube.get_object("leases", "istio-system", "meshca-leader")
            .and_then(|l| l["spec"]["renewTime"].as_str().map(String::from))
    };
    let (mut last_renewal, mut renewals) = (renew_time(), 0);
    let deadline = Instant::now() + wait;
    while renewals < 2 {
        assert!(
            Instant::now() < deadline,
            "the Lease renewed {renewals} times in {wait:?}: {:?}",
            kube.get_object("leases", "istio-system", "meshca-leader")
        );
        assert!(leaders(&a, &b) <= 1, "never two leaders");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let renewal = renew_time();
        if renewal != last_renewal {
            (last_renewal, renewals) = (renewal, renewals + 1);
        }
    }
    assert_eq!(leaders(&a, &b), 1, "never two leaders");

    kube.add_namespace("first");
    wait_until("the bundle in namespace first", wait, || {
        bundle_in(&kube, "first").is_some()
    })
    .await;

    // Stop the leader: the other replica takes over and publishes.
    let (mut leader, follower) = if http_get(a.monitoring, "/metrics")
        .unwrap()
        .1
        .contains("\nmeshca_leader 1\n")
    {
        (a, b)
    } else {
        (b, a)
    };
    assert_eq!(leader.terminate().map(|s| s.success()), Some(true));
    assert!(
        leader.log().contains("released the leader lease"),
        "{}",
        leader.log()
    );
    kube.add_namespace("second");
    wait_until(
        "the new leader to publish in namespace second",
        wait,
        || bundle_in(&kube, "second").is_some(),
    )
    .await;
    assert!(http_get(follower.monitoring, "/metrics")
        .unwrap()
        .1
        .contains("\nmeshca_leader 1\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_rotation_goes_through_every_phase_without_a_failed_verification() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let good = kube.add_review_token("good", FakeUser::service_account("default", "web"));
    // Roots live 60 s (backdated 2 min: 180 s in all) and rotate at 70 %
    // of that, ~6 s after they are made; both roots are published 3 s
    // before the switch; leaves live 5 s, so the old root leaves the
    // bundle 8 s after the switch.
    let server = start_off_runtime(
        dir.path().join("data"),
        args(
            &kube,
            &[
                "--self-signed-root-ttl",
                "60s",
                "--root-rotation-at",
                "0.7",
                "--root-rotation-grace",
                "3s",
                "--workload-cert-ttl",
                "5s",
                "--max-workload-cert-ttl",
                "5s",
                "--ca-expiry-margin",
                "1s",
            ],
        ),
    )
    .await;
    let first_root = first_cert(&server.root_pem());
    let mut phases: Vec<String> = Vec::new();
    let mut max_roots = 0;
    let mut issued = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let phase = secret(&kube)
            .and_then(|s| {
                s["metadata"]["annotations"]["meshca.io/root-rotation-phase"]
                    .as_str()
                    .map(String::from)
            })
            .unwrap_or_default();
        if phases.last() != Some(&phase) {
            phases.push(phase.clone());
        }
        // What a client sees: the published bundle, and a certificate.
        if let Some(bundle) = bundle_in(&kube, "default") {
            max_roots = max_roots.max(parse_certs_pem(&bundle).unwrap().len());
            match issue(&server, &bundle, &good).await {
                Ok(chain) => {
                    if let Err(e) = verify_against(&chain, &bundle) {
                        // The bundle may have moved on between reading it
                        // and the answer: judge against the bundle now.
                        let now_bundle = bundle_in(&kube, "default").unwrap();
                        verify_against(&chain, &now_bundle)
                            .unwrap_or_else(|e2| panic!("certificate does not verify against the published bundle in phase {phase}: {e}; {e2}"));
                    }
                    issued += 1;
                }
                Err(status) => panic!("issuance failed in phase {phase}: {status:?}"),
            }
        }
        let seen = phases.join(",");
        // After the switch, the old root leaves the published bundle
        // (phase stable; with these short lifetimes the next rotation may
        // start at once, so the stable phase can be too short to see).
        let first_root_gone = bundle_in(&kube, "default")
            .is_some_and(|b| !parse_certs_pem(&b).unwrap().contains(&first_root));
        if seen.contains("announced,switched") && first_root_gone {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "phases seen: {seen}\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        max_roots, 2,
        "both roots were published during the rotation"
    );
    assert!(issued > 20, "{issued} certificates");
    let now_root = first_cert(&unb64(&secret(&kube).unwrap()["data"]["ca-cert.pem"]));
    assert_ne!(now_root, first_root, "a new root with a new key signs now");
    assert_ne!(
        CertSummary::from_der(&now_root).unwrap().subject_key_id,
        CertSummary::from_der(&first_root).unwrap().subject_key_id,
        "a new key"
    );
    let metrics = http_get(server.monitoring, "/metrics").unwrap().1;
    assert!(
        metrics.contains("meshca_root_rotation_phase{phase="),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_can_ask_for_a_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let _server = start_off_runtime(
        dir.path().join("data"),
        args(&kube, &["--root-rotation-grace", "1h"]),
    )
    .await;
    let mut stored = secret(&kube).unwrap();
    stored["metadata"]["annotations"]["meshca.io/rotate-root"] = serde_json::json!("now");
    kube.put_object("secrets", stored);
    wait_until("the announced phase", Duration::from_secs(20), || {
        secret(&kube).is_some_and(|s| {
            s["metadata"]["annotations"]["meshca.io/root-rotation-phase"] == "announced"
        })
    })
    .await;
    let stored = secret(&kube).unwrap();
    assert!(
        stored["metadata"]["annotations"]["meshca.io/rotate-root"].is_null(),
        "the request is consumed"
    );
    let bundle = unb64(&stored["data"]["root-cert.pem"]);
    assert_eq!(parse_certs_pem(&bundle).unwrap().len(), 2);
    wait_until(
        "both roots in the ConfigMaps",
        Duration::from_secs(20),
        || bundle_in(&kube, "default").as_deref() == Some(bundle.as_str()),
    )
    .await;
}

/// A CA directory laid out as a mounted Kubernetes Secret: files are
/// symlinks into `..data`, itself a symlink to a timestamped directory
/// swapped atomically on update.
struct MountedSecret {
    dir: PathBuf,
    version: usize,
}

impl MountedSecret {
    fn new(dir: &Path, source: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mut mounted = Self {
            dir: dir.to_path_buf(),
            version: 0,
        };
        mounted.swap_to(source);
        for name in [
            "ca-cert.pem",
            "ca-key.pem",
            "cert-chain.pem",
            "root-cert.pem",
        ] {
            std::os::unix::fs::symlink(format!("..data/{name}"), dir.join(name)).unwrap();
        }
        mounted
    }

    fn swap_to(&mut self, source: &Path) {
        self.version += 1;
        let target = format!("..v{}", self.version);
        std::fs::create_dir(self.dir.join(&target)).unwrap();
        for name in [
            "ca-cert.pem",
            "ca-key.pem",
            "cert-chain.pem",
            "root-cert.pem",
        ] {
            std::fs::copy(source.join(name), self.dir.join(&target).join(name)).unwrap();
        }
        let tmp = self.dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&target, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_dir_swap_under_load_loses_nothing_and_a_bad_set_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let root = pki.join("root");
    certs_cli(&["root-ca", "--out", root.to_str().unwrap()]);
    for cluster in ["one", "two"] {
        intermediate_ca(&pki, &root, cluster, &[]);
    }
    // A bad set: cluster two's certificate with cluster one's key.
    let bad = pki.join("bad");
    std::fs::create_dir(&bad).unwrap();
    for name in ["ca-cert.pem", "cert-chain.pem", "root-cert.pem"] {
        std::fs::copy(pki.join("two").join(name), bad.join(name)).unwrap();
    }
    std::fs::copy(pki.join("one/ca-key.pem"), bad.join("ca-key.pem")).unwrap();

    let mounted_dir = dir.path().join("cacerts");
    let mut mounted = MountedSecret::new(&mounted_dir, &pki.join("one"));
    let server = start_off_runtime(
        dir.path().join("data"),
        vec![
            "--ca-dir".into(),
            mounted_dir.display().to_string(),
            "--ca-dir-check-interval".into(),
            "200ms".into(),
        ],
    )
    .await;
    let root_pem = std::fs::read_to_string(root.join("root-cert.pem")).unwrap();
    let one = first_cert(&std::fs::read_to_string(pki.join("one/ca-cert.pem")).unwrap());
    let two = first_cert(&std::fs::read_to_string(pki.join("two/ca-cert.pem")).unwrap());
    let token = server.token("default", "web");

    // Clients keep asking, over a few connections, while the files change.
    let server = Arc::new(server);
    let failures = Arc::new(AtomicUsize::new(0));
    let successes = Arc::new(AtomicUsize::new(0));
    let signed_by_two = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..4 {
        let (server, failures, successes, signed_by_two, stop, token, root_pem, two) = (
            server.clone(),
            failures.clone(),
            successes.clone(),
            signed_by_two.clone(),
            stop.clone(),
            token.clone(),
            root_pem.clone(),
            two.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut client = server.client_trusting(&root_pem).await;
            while !stop.load(Ordering::Relaxed) {
                let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
                match client.create_certificate(with_token(request, &token)).await {
                    Ok(r) => {
                        let chain = r.into_inner().cert_chain;
                        if verify_against(&chain, &root_pem).is_err() {
                            failures.fetch_add(1, Ordering::Relaxed);
                        }
                        if first_cert(&chain[1]) == two {
                            signed_by_two.fetch_add(1, Ordering::Relaxed);
                        }
                        successes.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    wait_until(
        "certificates from the first set",
        Duration::from_secs(20),
        || successes.load(Ordering::Relaxed) > 10,
    )
    .await;
    mounted.swap_to(&pki.join("two"));
    wait_until(
        "certificates signed by the new intermediate",
        Duration::from_secs(20),
        || signed_by_two.load(Ordering::Relaxed) > 10,
    )
    .await;
    // A bad set is refused and the good one keeps signing.
    mounted.swap_to(&bad);
    wait_until("the refusal", Duration::from_secs(20), || {
        server.log().contains("the new set is refused")
    })
    .await;
    let before = signed_by_two.load(Ordering::Relaxed);
    wait_until(
        "certificates from the good set after the refusal",
        Duration::from_secs(20),
        || signed_by_two.load(Ordering::Relaxed) > before + 10,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    assert!(
        signed_by_two.load(Ordering::Relaxed) > before,
        "still signing with the good set"
    );
    assert_eq!(
        failures.load(Ordering::Relaxed),
        0,
        "no request failed across the swaps"
    );
    assert!(successes.load(Ordering::Relaxed) > 20);
    let (code, body) = http_get(server.monitoring, "/ready").unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("refused"), "{body}");
    let metrics = http_get(server.monitoring, "/metrics").unwrap().1;
    assert!(
        metrics.contains("\nmeshca_ca_reload_refused 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("\nmeshca_ca_reload_count 1\n"),
        "{metrics}"
    );
    // The chain the CA now serves still ends at the same root, one level down from two.
    let mut client = server.client_trusting(&root_pem).await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    let chain = client
        .create_certificate(with_token(request, &token))
        .await
        .unwrap()
        .into_inner()
        .cert_chain;
    assert_eq!(first_cert(&chain[1]), two);
    assert_ne!(one, two);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_fails_and_signing_stops_inside_the_expiry_margin() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let root = pki.join("root");
    certs_cli(&["root-ca", "--out", root.to_str().unwrap()]);
    intermediate_ca(&pki, &root, "c1", &["--days", "1"]);
    let server = MeshcaServer::start(
        &dir.path().join("data"),
        &[
            "--ca-dir",
            pki.join("c1").to_str().unwrap(),
            "--ca-expiry-margin",
            "2d",
        ],
    )
    .unwrap();
    let (code, body) = http_get(server.monitoring, "/ready").unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("signing stops"), "{body}");
    let metrics = http_get(server.monitoring, "/metrics").unwrap().1;
    assert!(metrics.contains("\nmeshca_ready 0\n"), "{metrics}");
    assert!(
        metrics.contains("citadel_server_cert_chain_expiry_seconds"),
        "{metrics}"
    );
    let root_pem = std::fs::read_to_string(root.join("root-cert.pem")).unwrap();
    let token = server.token("default", "web");
    // The server still has its own TLS certificate (the CA is inside its
    // validity), but it signs no workload.
    let status = async {
        let mut client = server.client_trusting(&root_pem).await;
        let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
        client
            .create_certificate(with_token(request, &token))
            .await
            .unwrap_err()
    }
    .await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("signing stops"), "{status:?}");
}
