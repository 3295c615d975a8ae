//! meshca against a real Kubernetes control plane (`etcd` and
//! `kube-apiserver` from `tests/controlplane`, see
//! `meshca_tests::control_plane`), as its own ServiceAccount bound only to
//! the RBAC in `deploy/kustomize/base/rbac.yaml`: real TokenReview, real
//! pod-bound tokens, OIDC discovery, pods written by their kubelet,
//! Secrets, Leases, ConfigMaps, PodCertificateRequests created as the node
//! and ClusterTrustBundles. And what only a real API server shows: a
//! restart (`410 Gone`, `403` while its RBAC caches fill), an outage, and
//! start-up before the API server is up.
//!
//! Without the control plane built (`tests/controlplane/build.sh`) these
//! tests are skipped with a note, and fail with `CI` set.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::certificates::v1beta1::{ClusterTrustBundle, PodCertificateRequest};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret, ServiceAccount};
use kube::api::{Api, PostParams};
use meshca_certs::bundle::parse_certs_pem;
use meshca_certs::inspect::CertSummary;
use meshca_certs::{KeyAlgorithm, PrivateKey, SpiffeId, TrustBundle};
use meshca_tests::control_plane::{ControlPlane, ISSUER, MESHCA_NAMESPACE};
use meshca_tests::fake_certificates::{KeyEncoding, PodRequest};
use meshca_tests::*;
use tonic::Code;

const AUDIENCE: &str = "istio-ca";
const SIGNER: &str = "meshca.io/spiffe";
const HOUR: Duration = Duration::from_secs(3600);

/// meshca's flags for the control plane, as its own ServiceAccount.
async fn meshca_args(plane: &ControlPlane, extra: &[&str]) -> Vec<String> {
    let kubeconfig = plane.meshca_kubeconfig().await;
    let mut args = vec![
        "--kubeconfig".to_string(),
        kubeconfig.display().to_string(),
        "--namespace".into(),
        MESHCA_NAMESPACE.into(),
        "--leader-lease-duration".into(),
        "4s".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// The SPIFFE ID of the leaf of an answer, after checking the chain
/// verifies to the server's roots.
fn identity_of(server: &MeshcaServer, chain: &[String]) -> String {
    let certs: Vec<Vec<u8>> = chain
        .iter()
        .flat_map(|pem| parse_certs_pem(pem).unwrap())
        .collect();
    let summary = CertSummary::from_der(&certs[0]).unwrap();
    assert!(!summary.is_ca);
    let bundle = TrustBundle::from_pem(&server.root_pem()).unwrap();
    let id = SpiffeId::parse(&summary.uris[0]).unwrap();
    meshca_certs::verify::verify_svid(&certs, &bundle, std::time::SystemTime::now(), Some(&id))
        .unwrap_or_else(|e| panic!("the chain verifies to the roots: {e}"));
    summary.uris[0].clone()
}

async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut done: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !done().await {
        assert!(
            started.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

fn lines_at(log: &str, level: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains(&format!(" {level} ")))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_reviewed_by_the_api_server_with_only_meshcas_own_rbac() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let web = plane.running_pod("default", "web-1", "web", "node-a").await;
    let server = start_off_runtime(dir.path().join("data"), meshca_args(&plane, &[]).await).await;

    // A pod-bound token of the pod's service account, audience istio-ca.
    let token = plane
        .token("default", "web", Some(&web), &[AUDIENCE], HOUR)
        .await;
    let chain = ask(&server, &token, "spiffe://cluster.local/ns/default/sa/web")
        .await
        .unwrap();
    assert_eq!(
        identity_of(&server, &chain),
        "spiffe://cluster.local/ns/default/sa/web"
    );
    // Another identity than the token's.
    let refused = ask(&server, &token, "spiffe://cluster.local/ns/default/sa/db")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    // A token for the API server's audience, not istio-ca.
    let wrong_audience = plane.token("default", "web", None, &[], HOUR).await;
    let refused = ask(
        &server,
        &wrong_audience,
        "spiffe://cluster.local/ns/default/sa/web",
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    // The pod is deleted: its token is no longer valid (TokenReview checks
    // the bound object).
    plane.delete_pod("default", "web-1").await;
    wait_for(
        "the deleted pod's token refused",
        Duration::from_secs(40),
        || {
            let (server, token) = (&server, &token);
            async move {
                match ask(server, token, "spiffe://cluster.local/ns/default/sa/web").await {
                    Err(status) => status.code() == Code::Unauthenticated,
                    Ok(_) => false,
                }
            }
        },
    )
    .await;
    let log = server.log();
    assert!(!log.contains(&token), "a token in the log");
    assert!(lines_at(&log, "ERROR").is_empty(), "no ERROR lines:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_tokens_are_checked_with_the_api_servers_oidc_keys() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let web = plane.running_pod("default", "web-1", "web", "node-a").await;
    let args = meshca_args(&plane, &["--jwt-issuer", ISSUER]).await;
    let server = start_off_runtime(dir.path().join("data"), args).await;
    let token = plane
        .token("default", "web", Some(&web), &[AUDIENCE], HOUR)
        .await;
    let chain = ask(&server, &token, "spiffe://cluster.local/ns/default/sa/web")
        .await
        .unwrap();
    assert_eq!(
        identity_of(&server, &chain),
        "spiffe://cluster.local/ns/default/sa/web"
    );
    // Offline validation cannot see deletions (docs/authentication.md, "Offline
    // with the cluster's keys"): a token of a deleted service account is still accepted
    // until it expires, as one of a deleted pod is.
    let api: Api<ServiceAccount> = Api::namespaced(plane.admin().await, "default");
    api.delete("web", &Default::default()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let chain = ask(&server, &token, "spiffe://cluster.local/ns/default/sa/web").await;
    assert!(
        chain.is_ok(),
        "documented: offline mode accepts it ({chain:?})"
    );
    let forged = meshca_certs::token::TokenIssuer::generate()
        .unwrap()
        .with_issuer(ISSUER)
        .mint(
            &meshca_certs::token::TokenRequest {
                namespace: "default".into(),
                service_account: "web".into(),
                audiences: vec![AUDIENCE.into()],
                ttl: HOUR,
                pod: None,
            },
            std::time::SystemTime::now(),
        )
        .unwrap();
    let refused = ask(&server, &forged, "spiffe://cluster.local/ns/default/sa/web")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_agent_gets_the_identities_of_pods_on_its_node_only() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ztunnel = plane
        .running_pod(MESHCA_NAMESPACE, "ztunnel-a", "ztunnel", "node-a")
        .await;
    plane.running_pod("default", "web-1", "web", "node-a").await;
    plane.running_pod("default", "db-1", "db", "node-b").await;
    let args = meshca_args(&plane, &["--trusted-node-agent", "istio-system/ztunnel"]).await;
    let server = start_off_runtime(dir.path().join("data"), args).await;
    let token = plane
        .token(
            MESHCA_NAMESPACE,
            "ztunnel",
            Some(&ztunnel),
            &[AUDIENCE],
            HOUR,
        )
        .await;
    let web = "spiffe://cluster.local/ns/default/sa/web";
    let chain = wait_for_impersonation(&server, &token, web, Duration::from_secs(20)).await;
    assert_eq!(identity_of(&server, &chain), web);
    let refused = impersonate(&server, &token, "spiffe://cluster.local/ns/default/sa/db")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    // A pod that moves onto the node (a new pod) is seen by the watch.
    plane.running_pod("default", "db-2", "db", "node-a").await;
    wait_for_impersonation(
        &server,
        &token,
        "spiffe://cluster.local/ns/default/sa/db",
        Duration::from_secs(10),
    )
    .await;
}

/// Impersonates until it works (the pod index catches up), or panics.
async fn wait_for_impersonation(
    server: &MeshcaServer,
    token: &str,
    target: &str,
    timeout: Duration,
) -> Vec<String> {
    let started = Instant::now();
    loop {
        match impersonate(server, token, target).await {
            Ok(chain) => return chain,
            Err(status) => assert!(
                started.elapsed() < timeout,
                "impersonating {target}: {status:?}\n{}",
                server.log()
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// D1, D2: meshca started before the API server waits (monitoring up,
/// not ready, saying why), then serves once the API server is up, through
/// the 403s of its first seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_waits_for_the_api_server_instead_of_exiting() {
    let Some(mut plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ztunnel = plane
        .running_pod(MESHCA_NAMESPACE, "ztunnel-a", "ztunnel", "node-a")
        .await;
    plane.running_pod("default", "web-1", "web", "node-a").await;
    let token = plane
        .token(
            MESHCA_NAMESPACE,
            "ztunnel",
            Some(&ztunnel),
            &[AUDIENCE],
            HOUR,
        )
        .await;
    let args = meshca_args(
        &plane,
        &[
            "--trusted-node-agent",
            "istio-system/ztunnel",
            "--jwt-issuer",
            ISSUER,
        ],
    )
    .await;
    plane.stop_apiserver();
    let data = dir.path().join("data");
    let server = {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        MeshcaServer::start_unready(&data, &args, &[]).unwrap()
    };
    // Waiting, not exiting: /healthz answers, /ready says why it is not.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(server.pid() != 0, "still running");
    let (code, body) = http_get(server.monitoring, "/ready").unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("waiting for the Kubernetes API"), "{body}");
    assert_eq!(http_get(server.monitoring, "/healthz").unwrap().0, 200);
    assert!(!server.serves_grpc());
    assert!(
        !data.join("ca-key.pem").exists(),
        "no root of its own while the Secret cannot be read"
    );

    plane.start_apiserver().await;
    let back = Instant::now();
    wait_for("meshca ready", Duration::from_secs(30), || async {
        http_get(server.monitoring, "/ready").is_ok_and(|(code, _)| code == 200)
    })
    .await;
    wait_for_impersonation(
        &server,
        &token,
        "spiffe://cluster.local/ns/default/sa/web",
        Duration::from_secs(10),
    )
    .await;
    let served_after = back.elapsed();
    eprintln!("API server ready -> impersonation served: {served_after:?}");
    assert!(served_after < Duration::from_secs(10), "{served_after:?}");
    let api: Api<Secret> = Api::namespaced(plane.admin().await, MESHCA_NAMESPACE);
    assert!(
        api.get_opt("istio-ca-secret").await.unwrap().is_some(),
        "the root is in the Secret"
    );
    let log = server.log();
    assert!(lines_at(&log, "ERROR").is_empty(), "no ERROR lines:\n{log}");
}

/// D3, D7: after an API server outage the pod index, the
/// PodCertificateRequest watch and the bundle publisher are back within
/// 5 s of the API server; meshca logs no ERROR and few WARN lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_watch_is_back_within_seconds_of_an_api_server_outage() {
    let Some(mut plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ztunnel = plane
        .running_pod(MESHCA_NAMESPACE, "ztunnel-a", "ztunnel", "node-a")
        .await;
    let token = plane
        .token(
            MESHCA_NAMESPACE,
            "ztunnel",
            Some(&ztunnel),
            &[AUDIENCE],
            4 * HOUR,
        )
        .await;
    let args = meshca_args(
        &plane,
        &[
            "--trusted-node-agent",
            "istio-system/ztunnel",
            "--jwt-issuer",
            ISSUER,
            "--pod-certificate-signer",
            SIGNER,
        ],
    )
    .await;
    let server = start_off_runtime(dir.path().join("data"), args).await;
    let mut measured = Vec::new();
    for outage in 0..3 {
        let sa = format!("app{outage}");
        plane.stop_apiserver();
        // Long enough for a doubling backoff to reach its cap several times.
        tokio::time::sleep(Duration::from_secs(20)).await;
        plane.start_apiserver().await;
        let back = Instant::now();
        // The pod index: a pod created after the restart.
        plane
            .running_pod("default", &format!("{sa}-pod"), &sa, "node-a")
            .await;
        let target = format!("spiffe://cluster.local/ns/default/sa/{sa}");
        wait_for_impersonation(&server, &token, &target, Duration::from_secs(30)).await;
        let pods = back.elapsed();
        // The bundle publisher: a namespace created after the restart.
        let namespace = format!("team-{outage}");
        plane.ensure_namespace(&namespace).await;
        let configmaps: Api<ConfigMap> = Api::namespaced(plane.admin().await, &namespace);
        wait_for("the bundle ConfigMap", Duration::from_secs(30), || {
            let configmaps = configmaps.clone();
            async move {
                configmaps
                    .get_opt("istio-ca-root-cert")
                    .await
                    .ok()
                    .flatten()
                    .is_some()
            }
        })
        .await;
        let bundles = back.elapsed();
        // The PodCertificateRequest watch: a request created after the restart.
        let name = format!("pcr-{outage}");
        create_pod_certificate_request(&plane, &name, &format!("{sa}-pod"), KeyEncoding::StubCsr)
            .await;
        let requests: Api<PodCertificateRequest> = Api::namespaced(plane.admin().await, "default");
        wait_for(
            "the PodCertificateRequest answered",
            Duration::from_secs(30),
            || {
                let (requests, name) = (requests.clone(), name.clone());
                async move { condition_of(&requests.get(&name).await.unwrap()).is_some() }
            },
        )
        .await;
        let requests_at = back.elapsed();
        eprintln!(
            "outage {outage}: API server ready -> impersonation {pods:?}, bundle ConfigMap {bundles:?}, pod certificate {requests_at:?} (API server start {:?})",
            plane.last_start
        );
        measured.push((pods, bundles, requests_at));
    }
    for (pods, bundles, requests) in &measured {
        assert!(*pods < Duration::from_secs(5), "{measured:?}");
        assert!(*bundles < Duration::from_secs(5), "{measured:?}");
        assert!(*requests < Duration::from_secs(5), "{measured:?}");
    }
    let log = server.log();
    assert!(lines_at(&log, "ERROR").is_empty(), "no ERROR lines:\n{log}");
    let warnings = lines_at(&log, "WARN");
    // Each watch logs its failure once, then once per 30 s while it lasts
    // (meshca_kube::WatchRetry): the bound grows with the watches. Eleven
    // since issue 39 added four (the revocation ConfigMap, the replicas'
    // revoked serials, the CRL ConfigMaps and their namespaces), at most
    // about four lines each per outage here (an outage lasts over 30 s
    // when the API server must be killed).
    assert!(
        warnings.len() <= 11 * 3 * 4 + 18,
        "{} WARN lines over three outages:\n{}",
        warnings.len(),
        warnings.join("\n")
    );
}

/// D5: a namespace that does not exist is an error (waited for, then the
/// start fails), never a root of this replica's own. With meshca's own
/// RBAC the API server answers 403 (the Role is in its namespace); with
/// cluster-wide rights (here the administrator's) it answers 404
/// `namespaces "…" not found`, which meshca used to take for "Secrets not
/// served" and fall back to a root in its data directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_namespace_is_an_error_never_a_root_of_its_own() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--kubeconfig".to_string(),
        plane.admin_kubeconfig.display().to_string(),
        "--namespace".into(),
        "no-such-namespace".into(),
        "--kube-api-startup-timeout".into(),
        "4s".into(),
    ];
    let data = dir.path().join("data");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let failure = MeshcaServer::start(&data, &args).unwrap_err();
    assert!(failure.status.is_some_and(|s| !s.success()), "{failure:?}");
    assert!(
        failure.stderr.contains("no-such-namespace") && failure.stderr.contains("not found"),
        "{}",
        failure.stderr
    );
    assert!(
        failure.stderr.contains("--kube-api-startup-timeout"),
        "{}",
        failure.stderr
    );
    assert!(!data.join("ca-key.pem").exists(), "no root of its own");
}

/// D6: `--pod-certificate-signer` on an API server that does not serve
/// PodCertificateRequests is one clear error at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unserved_pod_certificate_api_is_one_clear_error_at_start() {
    let Some(plane) = ControlPlane::start_with(meshca_tests::control_plane::Options {
        pod_certificates: false,
        ..Default::default()
    })
    .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let args = meshca_args(&plane, &["--pod-certificate-signer", SIGNER]).await;
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let started = Instant::now();
    let failure = MeshcaServer::start(&dir.path().join("data"), &args).unwrap_err();
    assert!(failure.status.is_some_and(|s| !s.success()), "{failure:?}");
    assert!(
        failure.stderr.contains("--pod-certificate-signer")
            && failure.stderr.contains("podcertificaterequests")
            && failure.stderr.contains("certificates.k8s.io/v1beta1"),
        "{}",
        failure.stderr
    );
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// Two replicas: one Lease holder at a time, one root in the Secret, the
/// bundle ConfigMap in every namespace; the leader killed, the other takes
/// over and keeps publishing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_root_and_one_leader_at_a_time() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    plane.ensure_namespace("team-a").await;
    let args = meshca_args(&plane, &[]).await;
    let (a, b) = tokio::join!(
        start_off_runtime(dir.path().join("a"), args.clone()),
        start_off_runtime(dir.path().join("b"), args.clone())
    );
    assert_eq!(a.root_pem(), b.root_pem(), "one root for both replicas");
    let secrets: Api<Secret> = Api::namespaced(plane.admin().await, MESHCA_NAMESPACE);
    let secret = secrets.get("istio-ca-secret").await.unwrap();
    let secret_root = String::from_utf8(secret.data.unwrap()["ca-cert.pem"].0.clone()).unwrap();
    assert_eq!(
        parse_certs_pem(&secret_root).unwrap(),
        parse_certs_pem(&a.root_pem()).unwrap()
    );
    let leases: Api<Lease> = Api::namespaced(plane.admin().await, MESHCA_NAMESPACE);
    let holder = || {
        let leases = leases.clone();
        async move {
            leases
                .get_opt("meshca-leader")
                .await
                .ok()
                .flatten()
                .and_then(|l| l.spec?.holder_identity)
        }
    };
    wait_for("a leader", Duration::from_secs(20), || async {
        holder().await.is_some()
    })
    .await;
    let leader = holder().await.unwrap();
    let leaders: Vec<bool> = [&a, &b]
        .iter()
        .map(|s| {
            metric(
                &http_get(s.monitoring, "/metrics").unwrap().1,
                "meshca_leader",
            ) == 1
        })
        .collect();
    assert_eq!(
        leaders.iter().filter(|l| **l).count(),
        1,
        "one leader: {leaders:?}"
    );
    for namespace in ["default", "team-a", MESHCA_NAMESPACE] {
        let api: Api<ConfigMap> = Api::namespaced(plane.admin().await, namespace);
        wait_for("the bundle ConfigMap", Duration::from_secs(20), || {
            let api = api.clone();
            async move {
                api.get_opt("istio-ca-root-cert")
                    .await
                    .ok()
                    .flatten()
                    .is_some()
            }
        })
        .await;
        let cm = api.get("istio-ca-root-cert").await.unwrap();
        let pem = cm.data.unwrap()["root-cert.pem"].clone();
        assert_eq!(
            parse_certs_pem(&pem).unwrap(),
            parse_certs_pem(&a.root_pem()).unwrap(),
            "{namespace}"
        );
    }
    // Kill the leader (no Lease released): the other takes over after the
    // Lease expires, and publishes to a new namespace.
    // From here on, both replicas' `meshca_leader` is sampled every 20 ms:
    // never two at once.
    let sampler = LeaderSampler::start(vec![a.monitoring, b.monitoring]);
    let (mut leader_server, follower) = if leaders[0] { (a, b) } else { (b, a) };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(leader_server.pid() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _ = leader_server.terminate();
    let took = wait_for(
        "the other replica leads",
        Duration::from_secs(30),
        || async {
            holder().await.is_some_and(|h| h != leader)
                && metric(
                    &http_get(follower.monitoring, "/metrics").unwrap().1,
                    "meshca_leader",
                ) == 1
        },
    )
    .await;
    eprintln!("leader killed -> new leader: {took:?}");
    plane.ensure_namespace("team-b").await;
    let api: Api<ConfigMap> = Api::namespaced(plane.admin().await, "team-b");
    wait_for("the new leader publishes", Duration::from_secs(20), || {
        let api = api.clone();
        async move {
            api.get_opt("istio-ca-root-cert")
                .await
                .ok()
                .flatten()
                .is_some()
        }
    })
    .await;
    // The killed replica comes back: it follows, the leader stays.
    let back = start_off_runtime(dir.path().join("a-again"), args).await;
    let sampler = sampler.with(back.monitoring);
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        metric(
            &http_get(back.monitoring, "/metrics").unwrap().1,
            "meshca_leader"
        ),
        0,
        "the replica back follows"
    );
    let (samples, overlaps) = sampler.finish();
    assert!(samples > 200, "sampled {samples} times");
    assert_eq!(
        overlaps, 0,
        "two leaders at once in {overlaps} of {samples} samples"
    );
}

/// Reads `meshca_leader` of every replica every 20 ms on a thread of its
/// own, counting the samples where more than one leads.
struct LeaderSampler {
    addrs: std::sync::Arc<std::sync::Mutex<Vec<std::net::SocketAddr>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(u64, u64)>,
}

impl LeaderSampler {
    fn start(addrs: Vec<std::net::SocketAddr>) -> Self {
        use std::sync::atomic::Ordering;
        let addrs = std::sync::Arc::new(std::sync::Mutex::new(addrs));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let (addrs, stop) = (addrs.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut samples, mut overlaps) = (0, 0);
                while !stop.load(Ordering::SeqCst) {
                    let now: Vec<_> = addrs.lock().unwrap().clone();
                    let leading = now
                        .iter()
                        .filter(|addr| {
                            http_get(**addr, "/metrics")
                                .is_ok_and(|(_, body)| metric(&body, "meshca_leader") == 1)
                        })
                        .count();
                    samples += 1;
                    if leading > 1 {
                        overlaps += 1;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                (samples, overlaps)
            })
        };
        Self {
            addrs,
            stop,
            thread,
        }
    }

    /// Samples `addr` too from now on.
    fn with(self, addr: std::net::SocketAddr) -> Self {
        self.addrs.lock().unwrap().push(addr);
        self
    }

    /// Stops sampling: (samples, samples with two leaders or more).
    fn finish(self) -> (u64, u64) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

/// A PodCertificateRequest for `pod` (in `default`) as its kubelet
/// writes it: the pod's, its service account's and its node's real UIDs,
/// `key` in `encoding`, an hour asked for.
async fn pod_certificate_request(
    plane: &ControlPlane,
    name: &str,
    pod: &str,
    key: &PrivateKey,
    encoding: KeyEncoding,
) -> serde_json::Value {
    let admin = plane.admin().await;
    let pod: Pod = Api::namespaced(admin.clone(), "default")
        .get(pod)
        .await
        .unwrap();
    let spec = pod.spec.clone().unwrap();
    let (node, account) = (
        spec.node_name.clone().unwrap(),
        spec.service_account_name.clone().unwrap(),
    );
    let node_uid = Api::<Node>::all(admin.clone())
        .get(&node)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let account_uid = Api::<ServiceAccount>::namespaced(admin, "default")
        .get(&account)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let pod_name = pod.metadata.name.clone().unwrap();
    let pod_uid = pod.metadata.uid.clone().unwrap();
    let mut object = PodRequest {
        namespace: "default",
        name,
        signer: SIGNER,
        pod: (&pod_name, &pod_uid, &account, &node),
        max_expiration_seconds: Some(3600),
    }
    .to_json(key, encoding);
    object["spec"]["serviceAccountUID"] = serde_json::json!(account_uid);
    object["spec"]["nodeUID"] = serde_json::json!(node_uid);
    object
}

/// Creates `object` (a PodCertificateRequest in `default`) with `client`.
async fn create_request(
    client: kube::Client,
    object: serde_json::Value,
) -> Result<PodCertificateRequest, kube::Error> {
    let request: PodCertificateRequest = serde_json::from_value(object).unwrap();
    Api::namespaced(client, "default")
        .create(&PostParams::default(), &request)
        .await
}

/// Creates a PodCertificateRequest for `pod` (in `default`, on its node)
/// as the pod's kubelet does: with the node's own credentials, the real
/// UIDs, and a fresh P-256 key.
async fn create_pod_certificate_request(
    plane: &ControlPlane,
    name: &str,
    pod: &str,
    encoding: KeyEncoding,
) -> PrivateKey {
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let object = pod_certificate_request(plane, name, pod, &key, encoding).await;
    let node = object["spec"]["nodeName"].as_str().unwrap().to_string();
    create_request(plane.node(&node).await, object)
        .await
        .unwrap_or_else(|e| panic!("the kubelet of {node} creates {name}: {e}"));
    key
}

/// The type and reason of an answered request's condition.
fn condition_of(request: &PodCertificateRequest) -> Option<(String, String)> {
    let condition = request
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .first()?
        .clone();
    Some((condition.type_, condition.reason))
}

/// Pod certificates: requests created by the kubelet, in both key
/// encodings, issued to the pod's identity and verifying to the
/// ClusterTrustBundle; one for a pod of another node is refused by the
/// API server itself (NodeRestriction); one for a deleted pod is denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_certificate_requests_of_a_kubelet_are_issued_and_verify_to_the_cluster_trust_bundle() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    plane.running_pod("default", "web-1", "web", "node-a").await;
    let args = meshca_args(&plane, &["--pod-certificate-signer", SIGNER]).await;
    let server = start_off_runtime(dir.path().join("data"), args).await;
    // Every key type the API and meshca accept, in both encodings (the
    // API server checks each proof of possession itself).
    let ed25519 = || {
        PrivateKey::from_pkcs8_der(
            &rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)
                .unwrap()
                .serialize_der(),
        )
        .unwrap()
    };
    let mut keys = Vec::new();
    for (kind, key) in [
        (
            "p256",
            PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap(),
        ),
        (
            "p384",
            PrivateKey::generate(KeyAlgorithm::EcdsaP384).unwrap(),
        ),
        (
            "rsa3072",
            PrivateKey::generate(KeyAlgorithm::Rsa3072).unwrap(),
        ),
        ("ed25519", ed25519()),
    ] {
        for (encoding, how) in [
            (KeyEncoding::StubCsr, "stub"),
            (KeyEncoding::ProofOfPossession, "proof"),
        ] {
            let name = format!("{kind}-{how}");
            let object = pod_certificate_request(&plane, &name, "web-1", &key, encoding).await;
            create_request(plane.node("node-a").await, object)
                .await
                .unwrap_or_else(|e| panic!("the kubelet creates {name}: {e}"));
            keys.push((name, key.public_key_spki_der()));
        }
    }
    let requests: Api<PodCertificateRequest> = Api::namespaced(plane.admin().await, "default");
    for (name, _) in &keys {
        let name = name.as_str();
        wait_for("the request answered", Duration::from_secs(30), || {
            let requests = requests.clone();
            async move { condition_of(&requests.get(name).await.unwrap()).is_some() }
        })
        .await;
    }
    let bundles: Api<ClusterTrustBundle> = Api::all(plane.admin().await);
    wait_for("the ClusterTrustBundle", Duration::from_secs(20), || {
        let bundles = bundles.clone();
        async move {
            bundles
                .get_opt("meshca.io:spiffe:trust-bundle")
                .await
                .ok()
                .flatten()
                .is_some()
        }
    })
    .await;
    let ctb = bundles.get("meshca.io:spiffe:trust-bundle").await.unwrap();
    assert_eq!(ctb.spec.signer_name.as_deref(), Some(SIGNER));
    let bundle = TrustBundle::from_pem(&ctb.spec.trust_bundle).unwrap();
    assert_eq!(
        parse_certs_pem(&ctb.spec.trust_bundle).unwrap(),
        parse_certs_pem(&server.root_pem()).unwrap()
    );
    for (name, key) in &keys {
        let request = requests.get(name).await.unwrap();
        assert_eq!(
            condition_of(&request),
            Some(("Issued".into(), "Issued".into())),
            "{name}"
        );
        let status = request.status.unwrap();
        let chain = parse_certs_pem(&status.certificate_chain.unwrap()).unwrap();
        let (_, leaf) =
            <x509_parser::certificate::X509Certificate as x509_parser::prelude::FromDer<
                x509_parser::error::X509Error,
            >>::from_der(&chain[0])
            .unwrap();
        assert_eq!(
            leaf.public_key().raw,
            key.as_slice(),
            "{name}: issued to the pod's key"
        );
        let id = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap();
        meshca_certs::verify::verify_svid(&chain, &bundle, std::time::SystemTime::now(), Some(&id))
            .unwrap_or_else(|e| panic!("{name}: verifies to the ClusterTrustBundle: {e}"));
        let summary = CertSummary::from_der(&chain[0]).unwrap();
        assert_eq!(
            (summary.not_after - summary.not_before).whole_seconds(),
            3600
        );
    }
    // The kubelet of node-b cannot ask for a pod of node-a: the API
    // server's NodeRestriction refuses it before meshca sees it.
    plane.ensure_node("node-b").await;
    let pod: Pod = Api::namespaced(plane.admin().await, "default")
        .get("web-1")
        .await
        .unwrap();
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let object = PodRequest {
        namespace: "default",
        name: "foreign",
        signer: SIGNER,
        pod: (
            "web-1",
            pod.metadata.uid.as_deref().unwrap(),
            "web",
            "node-a",
        ),
        max_expiration_seconds: None,
    }
    .to_json(&key, KeyEncoding::StubCsr);
    let foreign: PodCertificateRequest = serde_json::from_value(object).unwrap();
    let node_b: Api<PodCertificateRequest> = Api::namespaced(plane.node("node-b").await, "default");
    let refused = node_b.create(&PostParams::default(), &foreign).await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422),
        "{refused:?}"
    );
    let log = server.log();
    assert!(lines_at(&log, "ERROR").is_empty(), "no ERROR lines:\n{log}");
}

/// The deploy/ RBAC is enough and nothing more is used: every start above
/// runs with it alone. This test checks the converse on the real
/// authorizer: meshca's account may not read Secrets outside its
/// namespace, nor write pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meshcas_account_can_do_what_the_rbac_says_and_nothing_more() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let kubeconfig = plane.meshca_kubeconfig().await;
    let client = meshca_tests::control_plane::client_for(&kubeconfig).await;
    let own: Api<Secret> = Api::namespaced(client.clone(), MESHCA_NAMESPACE);
    own.list(&Default::default()).await.unwrap();
    let other: Api<Secret> = Api::namespaced(client.clone(), "default");
    let refused = other.list(&Default::default()).await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(e)) if e.code == 403),
        "{refused:?}"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.list(&Default::default()).await.unwrap();
    let refused = pods.delete("anything", &Default::default()).await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(e)) if e.code == 403),
        "{refused:?}"
    );
    // The non-resource URLs meshca reads come from the default bindings
    // (docs/cluster.md, "RBAC"): /version, OIDC discovery and the JWKS.
    for path in [
        "/version",
        "/.well-known/openid-configuration",
        "/openid/v1/jwks",
    ] {
        let request = http::Request::get(path).body(Vec::new()).unwrap();
        client
            .request_text(request)
            .await
            .unwrap_or_else(|e| panic!("GET {path} as meshca: {e}"));
    }
}

/// Runs a Go tool of the control plane (`kubectl`, `helm`) with `stdin`:
/// its standard output, or a panic with its error output.
fn run_tool(tool: &str, args: &[&str], stdin: &str) -> String {
    use std::io::Write;
    let path = meshca_tests::control_plane::tool(tool)
        .unwrap_or_else(|| panic!("{tool} is not built: run tests/controlplane/build.sh"));
    let mut child = std::process::Command::new(&path)
        .args(args)
        .env(
            "HELM_CACHE_HOME",
            std::env::temp_dir().join("meshca-tests-helm"),
        )
        .env(
            "HELM_CONFIG_HOME",
            std::env::temp_dir().join("meshca-tests-helm"),
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// (kind, name) of every object of a rendered YAML stream.
fn objects_of(yaml: &str) -> Vec<(String, String)> {
    serde_saphyr::from_multiple::<serde_json::Value>(yaml)
        .unwrap()
        .into_iter()
        .filter(|d| !d.is_null())
        .map(|d| {
            (
                d["kind"].as_str().unwrap().to_string(),
                d["metadata"]["name"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The Helm chart (every variant) and the kustomize overlays, applied to
/// the real API server with server-side apply (its validation and
/// defaulting), and read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_helm_chart_and_the_kustomize_overlays_are_accepted_by_the_api_server() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let chart = repo.join("deploy/helm/meshca");
    let kubeconfig = plane.admin_kubeconfig.display().to_string();
    let mut rendered: Vec<(String, String)> = Vec::new();
    for variant in [
        "self-signed",
        "plugged-in",
        "pod-certificates",
        "node-agent",
        "agent-node",
    ] {
        let values = chart.join(format!("ci/{variant}-values.yaml"));
        let yaml = run_tool(
            "helm",
            &[
                "template",
                "meshca",
                chart.to_str().unwrap(),
                "--namespace",
                MESHCA_NAMESPACE,
                "-f",
                values.to_str().unwrap(),
            ],
            "",
        );
        rendered.push((format!("helm {variant}"), yaml));
    }
    for overlay in [
        "overlays/self-signed",
        "overlays/plugged-in",
        "overlays/pod-certificates",
        "overlays/node-agent",
        "agent-node",
        "agent-pod",
    ] {
        let dir = repo.join("deploy/kustomize").join(overlay);
        let yaml = run_tool("kubectl", &["kustomize", dir.to_str().unwrap()], "");
        rendered.push((format!("kustomize {overlay}"), yaml));
    }
    for (what, yaml) in &rendered {
        let objects = objects_of(yaml);
        assert!(
            objects.len() >= 4 || what.contains("agent-pod"),
            "{what}: {objects:?}"
        );
        let applied = run_tool(
            "kubectl",
            &[
                "--kubeconfig",
                &kubeconfig,
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=meshca-tests",
                "-f",
                "-",
            ],
            yaml,
        );
        assert_eq!(
            applied.lines().count(),
            objects.len(),
            "{what}: one line per object applied:\n{applied}"
        );
        // Read back: every object exists as rendered (kind and name), the
        // Deployment with the container arguments and env rendered.
        let read = run_tool(
            "kubectl",
            &["--kubeconfig", &kubeconfig, "get", "-f", "-", "-o", "json"],
            yaml,
        );
        let read: serde_json::Value = serde_json::from_str(&read).unwrap();
        let items = read["items"]
            .as_array()
            .cloned()
            .unwrap_or_else(|| vec![read.clone()]);
        let mut back: Vec<(String, String)> = items
            .iter()
            .map(|o| {
                (
                    o["kind"].as_str().unwrap().to_string(),
                    o["metadata"]["name"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let mut expected = objects.clone();
        back.sort();
        expected.sort();
        assert_eq!(back, expected, "{what}");
        let docs = serde_saphyr::from_multiple::<serde_json::Value>(yaml).unwrap();
        for doc in docs.iter().filter(|d| d["kind"] == "Deployment") {
            let stored = items
                .iter()
                .find(|o| {
                    o["kind"] == "Deployment" && o["metadata"]["name"] == doc["metadata"]["name"]
                })
                .unwrap();
            let container =
                |o: &serde_json::Value| o["spec"]["template"]["spec"]["containers"][0].clone();
            assert_eq!(container(stored)["args"], container(doc)["args"], "{what}");
            // The server defaults `fieldRef.apiVersion`: names, values and
            // field paths are compared.
            let env = |o: &serde_json::Value| -> Vec<(String, String)> {
                container(o)["env"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| {
                        let value = e["value"]
                            .as_str()
                            .or(e["valueFrom"]["fieldRef"]["fieldPath"].as_str())
                            .unwrap_or_default();
                        (e["name"].as_str().unwrap().to_string(), value.to_string())
                    })
                    .collect()
            };
            assert_eq!(env(stored), env(doc), "{what}");
        }
    }
}

/// The bundle a workload reads: the ConfigMap `istio-ca-root-cert` of
/// `default`, if published.
async fn published_bundle(plane: &ControlPlane) -> Option<String> {
    let api: Api<ConfigMap> = Api::namespaced(plane.admin().await, "default");
    api.get_opt("istio-ca-root-cert")
        .await
        .ok()
        .flatten()
        .and_then(|cm| cm.data?.remove("root-cert.pem"))
}

/// The rotation phase annotation of the Secret.
async fn rotation_phase(plane: &ControlPlane) -> String {
    let api: Api<Secret> = Api::namespaced(plane.admin().await, MESHCA_NAMESPACE);
    api.get_opt("istio-ca-secret")
        .await
        .ok()
        .flatten()
        .and_then(|s| {
            s.metadata
                .annotations?
                .remove("meshca.io/root-rotation-phase")
        })
        .unwrap_or_default()
}

/// A whole root rotation through the real Secret with two replicas: every
/// certificate either replica issues verifies against the bundle the
/// workloads read at that moment, both roots are published before the
/// switch, and a new root with a new key signs at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_rotation_through_the_real_secret_never_fails_a_verification() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let web = plane.running_pod("default", "web-1", "web", "node-a").await;
    let token = plane
        .token("default", "web", Some(&web), &[AUDIENCE], HOUR)
        .await;
    // Roots live 60 s (backdated 2 min) and rotate at 70 % of that; both
    // roots are published 3 s before the switch; leaves live 5 s.
    let args = meshca_args(
        &plane,
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
    )
    .await;
    let (a, b) = tokio::join!(
        start_off_runtime(dir.path().join("a"), args.clone()),
        start_off_runtime(dir.path().join("b"), args.clone())
    );
    let first_root = parse_certs_pem(&a.root_pem()).unwrap().remove(0);
    let web_id = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap();
    let (mut phases, mut max_roots, mut issued) = (Vec::<String>::new(), 0, 0);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let phase = rotation_phase(&plane).await;
        if phases.last() != Some(&phase) {
            phases.push(phase.clone());
        }
        if let Some(bundle) = published_bundle(&plane).await {
            max_roots = max_roots.max(parse_certs_pem(&bundle).unwrap().len());
            for server in [&a, &b] {
                let mut client = server.client_trusting(&bundle).await;
                let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, web_id.as_str(), 0);
                let chain = client
                    .create_certificate(with_token(request, &token))
                    .await
                    .unwrap_or_else(|s| panic!("issuance failed in phase {phase}: {s:?}"))
                    .into_inner()
                    .cert_chain;
                let chain: Vec<Vec<u8>> = chain
                    .iter()
                    .map(|c| parse_certs_pem(c).unwrap().remove(0))
                    .collect();
                let verifies = |pem: &str| {
                    meshca_certs::verify::verify_svid(
                        &chain,
                        &TrustBundle::from_pem(pem).unwrap(),
                        std::time::SystemTime::now(),
                        Some(&web_id),
                    )
                    .is_ok()
                };
                // The bundle may have moved on between reading it and the
                // answer: then the answer verifies against the bundle now.
                if !verifies(&bundle) {
                    let now = published_bundle(&plane).await.unwrap();
                    assert!(
                        verifies(&now),
                        "phase {phase}: does not verify to the published bundle"
                    );
                }
                issued += 1;
            }
        }
        let seen = phases.join(",");
        let first_root_gone = published_bundle(&plane)
            .await
            .is_some_and(|b| !parse_certs_pem(&b).unwrap().contains(&first_root));
        if seen.contains("announced,switched") && first_root_gone {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "phases seen: {seen}\n{}",
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        max_roots, 2,
        "both roots were published during the rotation"
    );
    assert!(issued > 20, "{issued} certificates");
    let secrets: Api<Secret> = Api::namespaced(plane.admin().await, MESHCA_NAMESPACE);
    let secret = secrets.get("istio-ca-secret").await.unwrap();
    let now_root = String::from_utf8(secret.data.unwrap()["ca-cert.pem"].0.clone()).unwrap();
    let now_root = parse_certs_pem(&now_root).unwrap().remove(0);
    assert_ne!(now_root, first_root, "a new root signs now");
    assert_ne!(
        CertSummary::from_der(&now_root).unwrap().subject_key_id,
        CertSummary::from_der(&first_root).unwrap().subject_key_id,
        "with a new key"
    );
    for server in [&a, &b] {
        let log = server.log();
        assert!(lines_at(&log, "ERROR").is_empty(), "no ERROR lines:\n{log}");
    }
}

/// D4: an API server's graceful hand-over (a new kube-apiserver on the same
/// address, the old one serving what is connected to it for its shutdown
/// delay): the pod watch keeps up through the overlap and after the old
/// one exits; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_api_server_hand_over_loses_no_pod() {
    let Some(mut plane) = ControlPlane::start_with(meshca_tests::control_plane::Options {
        shutdown_delay: Duration::from_secs(8),
        ..Default::default()
    })
    .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ztunnel = plane
        .running_pod(MESHCA_NAMESPACE, "ztunnel-a", "ztunnel", "node-a")
        .await;
    let token = plane
        .token(
            MESHCA_NAMESPACE,
            "ztunnel",
            Some(&ztunnel),
            &[AUDIENCE],
            HOUR,
        )
        .await;
    let args = meshca_args(&plane, &["--trusted-node-agent", "istio-system/ztunnel"]).await;
    let server = start_off_runtime(dir.path().join("data"), args).await;
    plane
        .running_pod("default", "before", "before", "node-a")
        .await;
    wait_for_impersonation(
        &server,
        &token,
        "spiffe://cluster.local/ns/default/sa/before",
        Duration::from_secs(20),
    )
    .await;
    plane.hand_over_apiserver().await;
    // During the overlap: the old server still holds meshca's watch.
    assert!(
        !plane.retiring_exited(),
        "the old API server is still draining"
    );
    plane
        .running_pod("default", "during", "during", "node-a")
        .await;
    let during = Instant::now();
    wait_for_impersonation(
        &server,
        &token,
        "spiffe://cluster.local/ns/default/sa/during",
        Duration::from_secs(5),
    )
    .await;
    let seen_during = during.elapsed();
    wait_for("the old API server exits", Duration::from_secs(90), || {
        let exited = plane.retiring_exited();
        async move { exited }
    })
    .await;
    plane
        .running_pod("default", "after", "after", "node-a")
        .await;
    let after = Instant::now();
    wait_for_impersonation(
        &server,
        &token,
        "spiffe://cluster.local/ns/default/sa/after",
        Duration::from_secs(5),
    )
    .await;
    eprintln!(
        "hand-over: a pod made during the overlap served after {seen_during:?}, one made after the old server exited after {:?}",
        after.elapsed()
    );
    let log = server.log();
    assert!(lines_at(&log, "ERROR").is_empty(), "no ERROR lines:\n{log}");
}

/// TokenReview results are cached and concurrent first requests share one
/// review, counted by the API server itself (`apiserver_request_total`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_reviews_are_cached_and_shared_as_the_api_server_counts_them() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let web = plane.running_pod("default", "web-1", "web", "node-a").await;
    let server = start_off_runtime(dir.path().join("data"), meshca_args(&plane, &[]).await).await;
    let id = "spiffe://cluster.local/ns/default/sa/web";
    let reviews = || plane.api_calls("POST", "tokenreviews");
    let before = reviews().await;
    let cached = plane
        .token("default", "web", Some(&web), &[AUDIENCE], HOUR)
        .await;
    for _ in 0..50 {
        ask(&server, &cached, id).await.unwrap();
    }
    assert_eq!(
        reviews().await - before,
        1,
        "50 requests, one token: one review"
    );

    let shared = plane
        .token("default", "web", Some(&web), &[AUDIENCE], HOUR)
        .await;
    let before = reviews().await;
    let client = server.client().await;
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (mut client, shared) = (client.clone(), shared.clone());
            tokio::spawn(async move {
                let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, id, 0);
                client
                    .create_certificate(with_token(request, &shared))
                    .await
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(
        reviews().await - before,
        1,
        "20 concurrent first requests with a new token: one review"
    );
}

/// The cluster rotates its service-account signing key (a new key signs,
/// the old one still verifies): offline validation fetches the new key on
/// the first token that names it, keeps accepting the old key's tokens,
/// and never calls TokenReview.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_validation_follows_a_rotated_service_account_key() {
    let Some(mut plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let web = plane.running_pod("default", "web-1", "web", "node-a").await;
    let args = meshca_args(&plane, &["--jwt-issuer", ISSUER]).await;
    let server = start_off_runtime(dir.path().join("data"), args).await;
    let id = "spiffe://cluster.local/ns/default/sa/web";
    let old = plane
        .token("default", "web", Some(&web), &[AUDIENCE], HOUR)
        .await;
    ask(&server, &old, id).await.unwrap();

    plane.rotate_service_account_key().await;
    let new = plane
        .token("default", "web", Some(&web), &[AUDIENCE], HOUR)
        .await;
    let kid = |token: &str| {
        use base64::Engine as _;
        let header = token.split('.').next().unwrap();
        let header = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(header)
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&header).unwrap()["kid"].clone()
    };
    assert_ne!(kid(&old), kid(&new), "the new key signs");
    // meshca refreshes keys for an unknown key ID at most every 10 s; a
    // client retries as Istio's agents do.
    let took = wait_for(
        "the new key's token accepted",
        Duration::from_secs(20),
        || async { ask(&server, &new, id).await.is_ok() },
    )
    .await;
    eprintln!("new signing key accepted after {took:?}");
    ask(&server, &old, id)
        .await
        .expect("the old key's tokens still verify");
    assert_eq!(
        plane.api_calls("POST", "tokenreviews").await,
        0,
        "offline: no TokenReview since the restart"
    );
    assert!(server
        .log()
        .contains("refreshed the issuer's keys for an unknown key ID"));
}

/// What meshca keeps in the cluster is set back when someone else changes
/// it: the root Secret deleted is written back with the same root; a bundle
/// ConfigMap edited or deleted is set back, one in a new namespace
/// appears, `kube-system` gets none; the ClusterTrustBundle edited or
/// deleted is set back. All through meshca's own RBAC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_meshca_keeps_in_the_cluster_is_set_back() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let args = meshca_args(&plane, &["--pod-certificate-signer", SIGNER]).await;
    let server = start_off_runtime(dir.path().join("data"), args).await;
    let root = parse_certs_pem(&server.root_pem()).unwrap();
    let admin = plane.admin().await;
    let wait = Duration::from_secs(20);

    // The root Secret, deleted once meshca leads.
    wait_for("leadership", wait, || async {
        metric(
            &http_get(server.monitoring, "/metrics").unwrap().1,
            "meshca_leader",
        ) == 1
    })
    .await;
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), MESHCA_NAMESPACE);
    secrets
        .delete("istio-ca-secret", &Default::default())
        .await
        .unwrap();
    let stored = |secrets: Api<Secret>| async move {
        let secret = secrets.get_opt("istio-ca-secret").await.ok().flatten()?;
        let data = secret.data?;
        Some((
            parse_certs_pem(std::str::from_utf8(&data.get("ca-cert.pem")?.0).ok()?).ok()?,
            secret.type_,
        ))
    };
    wait_for("the Secret written back", Duration::from_secs(30), || {
        let secrets = secrets.clone();
        async move { stored(secrets).await.is_some() }
    })
    .await;
    let (written, kind) = stored(secrets.clone()).await.unwrap();
    assert_eq!(written, root, "the same root");
    assert_eq!(kind.as_deref(), Some("istio.io/ca-root"));

    // Bundle ConfigMaps.
    let bundle_in = |namespace: &str| {
        let api: Api<ConfigMap> = Api::namespaced(admin.clone(), namespace);
        async move {
            let cm = api.get_opt("istio-ca-root-cert").await.ok().flatten()?;
            parse_certs_pem(cm.data?.get("root-cert.pem")?).ok()
        }
    };
    wait_for("the bundle in default", wait, || async {
        bundle_in("default").await.as_ref() == Some(&root)
    })
    .await;
    plane.ensure_namespace("late").await;
    wait_for("the bundle in a new namespace", wait, || async {
        bundle_in("late").await.as_ref() == Some(&root)
    })
    .await;
    let configmaps: Api<ConfigMap> = Api::namespaced(admin.clone(), "default");
    let mut edited = configmaps.get("istio-ca-root-cert").await.unwrap();
    edited.data = Some([("root-cert.pem".to_string(), "not a certificate".to_string())].into());
    configmaps
        .replace("istio-ca-root-cert", &PostParams::default(), &edited)
        .await
        .unwrap();
    wait_for("the hand edit set back", wait, || async {
        bundle_in("default").await.as_ref() == Some(&root)
    })
    .await;
    Api::<ConfigMap>::namespaced(admin.clone(), "late")
        .delete("istio-ca-root-cert", &Default::default())
        .await
        .unwrap();
    wait_for("the deleted ConfigMap back", wait, || async {
        bundle_in("late").await.as_ref() == Some(&root)
    })
    .await;
    assert!(
        bundle_in("kube-system").await.is_none(),
        "kube-system is excluded by default"
    );

    // The ClusterTrustBundle.
    let bundles: Api<ClusterTrustBundle> = Api::all(admin.clone());
    let ctb_name = "meshca.io:spiffe:trust-bundle";
    let ctb_root = |bundles: Api<ClusterTrustBundle>| async move {
        let ctb = bundles.get_opt(ctb_name).await.ok().flatten()?;
        let label = ctb.metadata.labels?.get("meshca.io/trust-domain").cloned();
        (label.as_deref() == Some("cluster.local"))
            .then(|| parse_certs_pem(&ctb.spec.trust_bundle).ok())
            .flatten()
    };
    wait_for("the ClusterTrustBundle", wait, || {
        let bundles = bundles.clone();
        let root = root.clone();
        async move { ctb_root(bundles).await == Some(root) }
    })
    .await;
    let mut edited = bundles.get(ctb_name).await.unwrap();
    let other = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    edited.spec.trust_bundle = meshca_certs::profile::self_signed_root(
        &other,
        &meshca_certs::SubjectName {
            common_name: Some("another CA".into()),
            ..Default::default()
        },
        meshca_certs::Validity::backdated(time::OffsetDateTime::now_utc(), time::Duration::days(1)),
    )
    .unwrap()
    .to_pem();
    edited
        .metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("team".into(), "mesh".into());
    bundles
        .replace(ctb_name, &PostParams::default(), &edited)
        .await
        .unwrap();
    wait_for("the ClusterTrustBundle set back", wait, || {
        let bundles = bundles.clone();
        let root = root.clone();
        async move { ctb_root(bundles).await == Some(root) }
    })
    .await;
    let labels = bundles
        .get(ctb_name)
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap();
    assert_eq!(
        labels.get("team").map(String::as_str),
        Some("mesh"),
        "another label is kept"
    );
    bundles.delete(ctb_name, &Default::default()).await.unwrap();
    wait_for("the ClusterTrustBundle recreated", wait, || {
        let bundles = bundles.clone();
        let root = root.clone();
        async move { ctb_root(bundles).await == Some(root) }
    })
    .await;
    let log = server.log();
    assert!(
        log.contains("wrote it back from the root in memory"),
        "{log}"
    );
    assert!(lines_at(&log, "ERROR").is_empty(), "no ERROR lines:\n{log}");
}

/// Every PodCertificateRequest meshca must not sign, against the real API
/// server: what NodeRestriction and validation refuse before meshca sees
/// it (a kubelet asking for another node's pod or another service account,
/// a proof over another pod's UID, an RSA 2048 key), and what meshca denies
/// with the reason (a pod gone or recreated since the kubelet asked,
/// unknown user annotations too many to quote, a P-521 key, and, written
/// past NodeRestriction by an administrator, a request naming the wrong
/// node or service account). All are created before meshca starts, so
/// meshca's start-up list finds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_certificate_requests_that_must_not_be_signed_are_refused_or_denied() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for (pod, account, node) in [
        ("pod-gone", "web", "node-a"),
        ("pod-recreated", "web", "node-a"),
        ("pod-annotated", "web", "node-a"),
        ("pod-p521", "web", "node-a"),
        ("pod-db", "db", "node-a"),
        ("pod-b", "web", "node-b"),
    ] {
        plane.running_pod("default", pod, account, node).await;
    }
    let kubelet = plane.node("node-a").await;
    let admin = plane.admin().await;
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let request = |name: &'static str, pod: &'static str| {
        pod_certificate_request(&plane, name, pod, &key, KeyEncoding::StubCsr)
    };

    // Refused by the API server itself.
    let refused = |result: Result<PodCertificateRequest, kube::Error>, what: &str| match result {
        Err(kube::Error::Api(e)) => (e.code, e.message),
        other => panic!("{what}: the API server refuses it, got {other:?}"),
    };
    let mut elsewhere = request("elsewhere", "pod-b").await;
    let node_a_uid = request("uid-of-node-a", "pod-db").await["spec"]["nodeUID"].clone();
    elsewhere["spec"]["nodeName"] = serde_json::json!("node-a");
    elsewhere["spec"]["nodeUID"] = node_a_uid;
    let (code, message) = refused(
        create_request(kubelet.clone(), elsewhere.clone()).await,
        "another node's pod",
    );
    assert!(
        code == 403 && message.contains("not running on node"),
        "{code} {message}"
    );
    let mut other_sa = request("other-sa", "pod-db").await;
    other_sa["spec"]["serviceAccountName"] = serde_json::json!("web");
    let (code, message) = refused(
        create_request(kubelet.clone(), other_sa.clone()).await,
        "another service account",
    );
    assert!(
        code == 403 && message.contains("serviceAccountName"),
        "{code} {message}"
    );
    let mut forged = pod_certificate_request(
        &plane,
        "forged",
        "pod-gone",
        &key,
        KeyEncoding::ProofOfPossession,
    )
    .await;
    let proof = meshca_tests::fake_certificates::proof_of_possession(&key, "uid-other").unwrap();
    forged["spec"]["proofOfPossession"] = serde_json::json!(b64(&proof));
    let (code, message) = refused(
        create_request(kubelet.clone(), forged).await,
        "a proof over another UID",
    );
    assert!(code == 422 && message.contains("proof"), "{code} {message}");
    let rsa = PrivateKey::generate(KeyAlgorithm::Rsa2048).unwrap();
    let (code, message) = refused(
        create_request(
            kubelet.clone(),
            pod_certificate_request(&plane, "rsa2048", "pod-gone", &rsa, KeyEncoding::StubCsr)
                .await,
        )
        .await,
        "an RSA 2048 key",
    );
    assert!(
        code == 422 && message.contains("RSA keys must have modulus size 3072 or 4096"),
        "{code} {message}"
    );

    // Accepted by the API server, to be denied by meshca.
    create_request(kubelet.clone(), request("pod-gone", "pod-gone").await)
        .await
        .unwrap();
    plane.delete_pod("default", "pod-gone").await;
    create_request(kubelet.clone(), request("recreated", "pod-recreated").await)
        .await
        .unwrap();
    let old_uid = {
        let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
        pods.get("pod-recreated")
            .await
            .unwrap()
            .metadata
            .uid
            .unwrap()
    };
    plane.delete_pod("default", "pod-recreated").await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    wait_for("pod-recreated gone", Duration::from_secs(20), || {
        let pods = pods.clone();
        async move { pods.get_opt("pod-recreated").await.unwrap().is_none() }
    })
    .await;
    let new_uid = plane
        .running_pod("default", "pod-recreated", "web", "node-a")
        .await
        .metadata
        .uid
        .unwrap();
    // Unknown user annotations, more than a condition's message may
    // quote (150 keys of 267 characters: 40 KB).
    let mut annotated = request("annotated", "pod-annotated").await;
    let labels = format!("{}.{}.example.com", "b".repeat(63), "c".repeat(63));
    let annotations: serde_json::Map<String, serde_json::Value> = (0..150)
        .map(|i| {
            let key = format!("{i:03}{}.{labels}/{}", "a".repeat(60), "n".repeat(63));
            (key, "v".into())
        })
        .collect();
    annotated["spec"]["unverifiedUserAnnotations"] = serde_json::Value::Object(annotations);
    create_request(kubelet.clone(), annotated).await.unwrap();
    // A P-521 key (a fixture stub CSR, see pod_certificates_e2e.rs): the
    // API accepts it, meshca does not sign it.
    let mut p521 = request("p521", "pod-p521").await;
    p521["spec"]["stubPKCS10Request"] =
        serde_json::json!(b64(include_bytes!("../data/p521-stub-csr.der")));
    create_request(kubelet.clone(), p521).await.unwrap();
    // An RSA 3072 key with public exponent 3: kube-apiserver accepts it,
    // meshca denies it naming the rule.
    plane
        .running_pod("default", "pod-rsa-e3", "web", "node-a")
        .await;
    let e3 = RsaTestKey::with_exponent(3072, 3);
    let mut rsa_e3 = request("rsa-e3", "pod-rsa-e3").await;
    rsa_e3["spec"]["stubPKCS10Request"] = serde_json::json!(b64(&e3.stub_csr_der()));
    create_request(kubelet.clone(), rsa_e3).await.unwrap();
    // Past NodeRestriction (an administrator): the wrong node, the wrong
    // service account.
    elsewhere["metadata"]["name"] = serde_json::json!("elsewhere");
    create_request(admin.clone(), elsewhere).await.unwrap();
    create_request(admin.clone(), other_sa).await.unwrap();

    let args = meshca_args(&plane, &["--pod-certificate-signer", SIGNER]).await;
    let server = start_off_runtime(dir.path().join("data"), args).await;
    let expected = [
        ("pod-gone", "PodNotFound"),
        ("recreated", "PodNotFound"),
        ("annotated", "UnknownUserAnnotation"),
        ("p521", "UnsupportedKeyType"),
        ("rsa-e3", "UnsupportedKeyType"),
        ("elsewhere", "PodMismatch"),
        ("other-sa", "PodMismatch"),
    ];
    let requests: Api<PodCertificateRequest> = Api::namespaced(admin.clone(), "default");
    for (name, _) in expected {
        wait_for(&format!("{name} answered"), Duration::from_secs(30), || {
            let requests = requests.clone();
            async move { condition_of(&requests.get(name).await.unwrap()).is_some() }
        })
        .await;
    }
    for (name, reason) in expected {
        let request = requests.get(name).await.unwrap();
        assert_eq!(
            condition_of(&request),
            Some(("Denied".into(), reason.into())),
            "{name}: {:?}",
            request.status
        );
        let status = request.status.unwrap();
        assert!(
            status.certificate_chain.is_none(),
            "{name}: only the condition"
        );
        let message = &status.conditions.unwrap()[0].message;
        match name {
            "recreated" => assert!(
                message.contains(&format!("has UID {new_uid}, not {old_uid}")),
                "{message}"
            ),
            "other-sa" => assert!(
                message.contains("service account \"db\", not \"web\""),
                "{message}"
            ),
            "p521" => assert!(
                message.contains("ECDSA P-521") && message.contains("ECDSA P-256"),
                "{message}"
            ),
            "rsa-e3" => assert!(
                message.contains("RSA public exponent must be odd and at least 65537"),
                "{message}"
            ),
            _ => {}
        }
    }
    let log = server.log();
    for (name, _) in expected {
        assert!(
            log.lines()
                .any(|l| l.contains("denied pod certificate")
                    && l.contains(&format!("request={name} "))),
            "denial of {name} audited:\n{log}"
        );
    }
    let metrics = http_get(server.monitoring, "/metrics").unwrap().1;
    assert!(
        metrics.contains(
            "meshca_pod_certificate_request_count{result=\"Denied\",reason=\"PodNotFound\"} 2"
        ),
        "{metrics}"
    );
    assert!(lines_at(&log, "ERROR").is_empty(), "no ERROR lines:\n{log}");
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The first answer of `FetchX509SVID` on a Workload API socket, or its
/// status.
async fn first_x509_answer(
    socket: &Path,
) -> Result<meshca_proto::spiffe_workload::X509svidResponse, tonic::Status> {
    use meshca_proto::spiffe_workload::spiffe_workload_api_client::SpiffeWorkloadApiClient;
    let channel = meshca_tests::agent_process::unix_channel(socket).await;
    let mut request = tonic::Request::new(meshca_proto::spiffe_workload::X509svidRequest {});
    request
        .metadata_mut()
        .insert("workload.spiffe.io", "true".parse().unwrap());
    let mut stream = SpiffeWorkloadApiClient::new(channel)
        .fetch_x509svid(request)
        .await?
        .into_inner();
    stream
        .message()
        .await?
        .ok_or_else(|| tonic::Status::unknown("the stream ended without an answer"))
}

/// A node agent (`meshca-agent --node-agent`) with only its own RBAC
/// (`deploy/kustomize/agent-node/rbac.yaml`) and a token bound to its own
/// pod, beside a CA that trusts it (`--trusted-node-agent`): each local
/// process gets the identity of the pod its cgroup names, learnt from the
/// real pod watch; a process of another node's pod gets nothing, and a
/// deleted pod stops being served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_agent_with_its_own_rbac_serves_each_pod_of_its_node() {
    use meshca_tests::agent_process::{check_source, set_cgroup, x509_source, Agent};
    const WEB_CONTAINER: &str = "3b1ad5e2c0f4a8b9c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4";
    const DB_CONTAINER: &str = "7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c7c";
    const FAR_CONTAINER: &str = "abababababababababababababababababababababababababababababababab";
    let Some(mut plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let agent_pod = plane
        .running_pod(MESHCA_NAMESPACE, "meshca-agent-a", "meshca-agent", "node-a")
        .await;
    let mut uids = std::collections::BTreeMap::new();
    for (pod, account, node, container) in [
        ("web-1", "web", "node-a", WEB_CONTAINER),
        ("db-1", "db", "node-a", DB_CONTAINER),
        ("web-far", "web", "node-b", FAR_CONTAINER),
    ] {
        let pod = plane
            .running_pod_with_containers("default", pod, account, node, &[container])
            .await;
        uids.insert(container, pod.metadata.uid.unwrap());
    }
    plane
        .apply_rbac(
            &std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../deploy/kustomize/agent-node/rbac.yaml"),
            )
            .unwrap(),
        )
        .await;
    let args = meshca_args(
        &plane,
        &["--trusted-node-agent", "istio-system/meshca-agent"],
    )
    .await;
    let server = start_off_runtime(dir.path().join("data"), args).await;
    std::fs::write(dir.path().join("root-cert.pem"), server.root_pem()).unwrap();
    let ca_token = plane
        .token(
            MESHCA_NAMESPACE,
            "meshca-agent",
            Some(&agent_pod),
            &[AUDIENCE],
            HOUR,
        )
        .await;
    let api_token = plane
        .token(
            MESHCA_NAMESPACE,
            "meshca-agent",
            Some(&agent_pod),
            &[],
            HOUR,
        )
        .await;
    let kubeconfig = plane.kubeconfig_with_token("meshca-agent", &api_token, MESHCA_NAMESPACE);
    let proc_root = dir.path().join("proc");
    // This test process is, in turn, a container of each pod.
    let be = |uids: &std::collections::BTreeMap<&str, String>, container: &str| {
        set_cgroup(
            &proc_root,
            std::process::id(),
            &format!(
                "0::/kubepods/burstable/pod{}/{container}\n",
                uids[container]
            ),
        )
    };
    be(&uids, WEB_CONTAINER);
    let socket = dir.path().join("node/agent.sock");
    let mut agent = Agent::start(
        &server,
        dir.path(),
        &ca_token,
        "agent",
        &[
            "--node-agent",
            "--node-name",
            "node-a",
            "--kubeconfig",
            &kubeconfig.display().to_string(),
            "--proc-root",
            &proc_root.display().to_string(),
            "--workload-api-socket",
            &socket.display().to_string(),
            "--attestation-wait",
            "2s",
        ],
    );
    agent.wait_for_socket(&socket).await;
    let web = x509_source(&socket).await.expect("the web pod's source");
    check_source(&web, "spiffe://cluster.local/ns/default/sa/web");
    web.shutdown().await;
    be(&uids, DB_CONTAINER);
    let db = x509_source(&socket).await.expect("the db pod's source");
    check_source(&db, "spiffe://cluster.local/ns/default/sa/db");
    db.shutdown().await;

    // A pod of node-b: the agent of node-a does not know it.
    be(&uids, FAR_CONTAINER);
    let refused = first_x509_answer(&socket).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains("is not a pod of node node-a"),
        "{refused:?}"
    );

    // The web pod deleted: the watch tells the agent, which stops serving it.
    plane.delete_pod("default", "web-1").await;
    be(&uids, WEB_CONTAINER);
    wait_for(
        "the deleted pod refused",
        Duration::from_secs(20),
        || async {
            first_x509_answer(&socket)
                .await
                .is_err_and(|s| s.code() == Code::PermissionDenied)
        },
    )
    .await;

    // An API server restart: the agent's pod watch is back within
    // seconds (a 410 re-lists at once), so a pod started after it is
    // served.
    const LATE_CONTAINER: &str = "5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d5d";
    plane.stop_apiserver();
    plane.start_apiserver().await;
    let back = Instant::now();
    let late = plane
        .running_pod_with_containers("default", "db-2", "db", "node-a", &[LATE_CONTAINER])
        .await;
    uids.insert(LATE_CONTAINER, late.metadata.uid.unwrap());
    be(&uids, LATE_CONTAINER);
    wait_for(
        "the pod started after the restart served",
        Duration::from_secs(30),
        || async { first_x509_answer(&socket).await.is_ok() },
    )
    .await;
    let took = back.elapsed();
    eprintln!("API server ready -> a new pod served by the node agent: {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}:\n{}", agent.log());
    let log = server.log();
    assert!(lines_at(&log, "ERROR").is_empty(), "no ERROR lines:\n{log}");
    let agent_log = agent.log();
    assert!(
        lines_at(&agent_log, "ERROR").is_empty(),
        "no ERROR lines:\n{agent_log}"
    );
}
