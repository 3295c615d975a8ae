//! End-to-end tests of Kubernetes authentication: the real `meshca` with
//! `--kubeconfig` pointing at a fake API server that speaks the real JSON.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use meshca_certs::inspect::CertSummary;
use meshca_certs::KeyAlgorithm;
use meshca_tests::fake_kube::{review_only_token, FakeKube, FakeUser};
use meshca_tests::*;
use tonic::Code;

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";

async fn setup(extra: &[&str]) -> (tempfile::TempDir, FakeKube, MeshcaServer) {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let kubeconfig = kube.kubeconfig.display().to_string();
    let mut args: Vec<String> = vec!["--kubeconfig".into(), kubeconfig];
    args.extend(extra.iter().map(|s| s.to_string()));
    let server = start_off_runtime(dir.path().join("data"), args).await;
    (dir, kube, server)
}

#[tokio::test]
async fn token_review_rules() {
    let (_dir, kube, server) = setup(&[]).await;
    let good = kube.add_review_token("good", FakeUser::service_account("default", "web"));
    let chain = ask(&server, &good, WEB)
        .await
        .expect("a reviewed service-account token");
    let leaf = CertSummary::from_der(&meshca_certs::bundle::parse_certs_pem(&chain[0]).unwrap()[0])
        .unwrap();
    assert_eq!(leaf.uris, vec![WEB.to_string()]);
    assert!(
        server.log().contains("web-pod"),
        "the audit line names the pod from user.extra"
    );

    // A token the API server does not know: refused, without its words
    // (they can name the cluster), and remembered: one review for five.
    let reviews = kube.reviews();
    let unknown = review_only_token("unknown", &["istio-ca".to_string()]);
    for _ in 0..5 {
        let status = ask(&server, &unknown, WEB).await.unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert!(
            !status.message().contains("token lookup failed"),
            "{status:?}"
        );
    }
    assert_eq!(
        kube.reviews() - reviews,
        1,
        "a refused token costs one review"
    );

    // Not worth a review: not a JWT, another audience, expired.
    let reviews = kube.reviews();
    let mut other_audience = FakeUser::service_account("default", "web");
    other_audience.audiences = vec!["vault".into()];
    let wrong_audience = kube.add_review_token("wrong-audience", other_audience);
    let status = ask(&server, &wrong_audience, WEB).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("audience"), "{status:?}");
    for junk in ["opaque-junk", "a.b.c", "Zm9v.YmFy.YmF6"] {
        let status = ask(&server, junk, WEB).await.unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert!(
            status.message().contains("not a well-formed JWT"),
            "{status:?}"
        );
    }
    assert_eq!(
        kube.reviews(),
        reviews,
        "refused without asking the API server"
    );

    // A flood of junk is counted, not logged line by line.
    for _ in 0..200 {
        ask(&server, "junk", WEB).await.unwrap_err();
    }
    let lines = server.log().matches("authentication failed").count();
    assert!(lines < 20, "{lines} log lines for about 210 refusals");

    let alice = kube.add_review_token(
        "alice",
        FakeUser {
            username: "alice".into(),
            groups: vec!["system:authenticated".into()],
            audiences: vec!["istio-ca".into()],
            pod: None,
        },
    );
    let status = ask(&server, &alice, WEB).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(
        status.message().contains("system:serviceaccounts"),
        "{status:?}"
    );

    // A service account may not ask for another identity.
    let status = ask(&server, &good, "spiffe://cluster.local/ns/default/sa/db")
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);

    // The local token issuer is off when a cluster is configured.
    assert!(!server.data_dir.join("token-issuer-key.pem").exists());
}

#[tokio::test]
async fn reviews_are_cached_and_shared() {
    let (_dir, kube, server) = setup(&[]).await;
    let cached = kube.add_review_token("cached", FakeUser::service_account("default", "web"));
    let client = server.client().await;
    for _ in 0..100 {
        let mut client = client.clone();
        let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
        client
            .create_certificate(with_token(request, &cached))
            .await
            .unwrap();
    }
    assert_eq!(
        kube.reviews(),
        1,
        "100 requests with one token while cached: one review"
    );

    // Concurrent first requests with a new token share one review.
    let shared = kube.add_review_token("shared", FakeUser::service_account("default", "web"));
    kube.set_latency(Duration::from_millis(300));
    let before = kube.reviews();
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let mut client = client.clone();
        let shared = shared.clone();
        tasks.push(tokio::spawn(async move {
            let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
            client
                .create_certificate(with_token(request, &shared))
                .await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(kube.reviews() - before, 1, "single flight");
}

/// The unlabelled metric `name` on `server`'s /metrics page.
fn server_metric(server: &MeshcaServer, name: &str) -> u64 {
    metric(&http_get(server.monitoring, "/metrics").unwrap().1, name)
}

#[tokio::test]
async fn reviews_waiting_for_an_api_call_are_exported() {
    let (_dir, kube, server) = setup(&["--kube-api-max-in-flight", "1"]).await;
    assert_eq!(server_metric(&server, "meshca_token_reviews_waiting"), 0);
    // Three tokens, one API call at a time: two reviews wait (each less
    // than the 2 s a review may wait).
    kube.set_latency(Duration::from_millis(700));
    let mut tasks = Vec::new();
    for name in ["first", "second", "third"] {
        let token = kube.add_review_token(name, FakeUser::service_account("default", "web"));
        let server_grpc = server.client().await;
        tasks.push(tokio::spawn(async move {
            let mut client = server_grpc;
            let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
            client.create_certificate(with_token(request, &token)).await
        }));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut most = 0;
    while most < 2 && std::time::Instant::now() < deadline {
        most = most.max(server_metric(&server, "meshca_token_reviews_waiting"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(most, 2, "two reviews wait for the one API call allowed");
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(server_metric(&server, "meshca_token_reviews_waiting"), 0);
}

#[tokio::test]
async fn requests_beyond_the_open_limit_are_refused_at_once() {
    // One API call at a time: the second review waits for the first, and
    // the gauge of waiting reviews shows when both requests are inside.
    let (_dir, kube, server) =
        setup(&["--max-open-requests", "2", "--kube-api-max-in-flight", "1"]).await;
    kube.set_latency(Duration::from_millis(1000));
    // Two requests held open by their TokenReviews, on two connections.
    let mut held = Vec::new();
    for name in ["first", "second"] {
        let token = kube.add_review_token(name, FakeUser::service_account("default", "web"));
        let mut client = server.client().await;
        held.push(tokio::spawn(async move {
            let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
            client.create_certificate(with_token(request, &token)).await
        }));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while server_metric(&server, "meshca_token_reviews_waiting") < 1 {
        assert!(std::time::Instant::now() < deadline, "both reviews started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A third is refused at once, before any review, whatever its token.
    let third = kube.add_review_token("third", FakeUser::service_account("default", "web"));
    let started = std::time::Instant::now();
    let status = ask(&server, &third, WEB).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("--max-open-requests"),
        "{status:?}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(1000),
        "refused at once"
    );
    assert_eq!(kube.reviews(), 0, "no review for the refused request");
    assert_eq!(
        server_metric(&server, "meshca_open_requests_refused_count"),
        1
    );
    // The held ones are answered, and then there is room again.
    for request in held {
        request.await.unwrap().expect("a held request is answered");
    }
    ask(&server, &third, WEB).await.expect("room again");
    assert_eq!(kube.reviews(), 3, "the refused request cost no review");
}

#[tokio::test]
async fn api_server_down_is_unavailable_and_recovers() {
    let (_dir, mut kube, server) =
        setup(&["--kube-api-timeout", "2s", "--token-review-cache-ttl", "0s"]).await;
    let t1 = kube.add_review_token("t1", FakeUser::service_account("default", "web"));
    ask(&server, &t1, WEB).await.expect("API up");

    kube.stop();
    let status = ask(&server, &t1, WEB).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("Kubernetes API"), "{status:?}");
    let (code, _) = http_get(server.monitoring, "/healthz").unwrap();
    assert_eq!(code, 200, "meshca stays up");

    kube.restart().await;
    let mut recovered = false;
    for _ in 0..50 {
        if ask(&server, &t1, WEB).await.is_ok() {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        recovered,
        "the next request after the API server is back succeeds"
    );
}

#[tokio::test]
async fn slow_api_server_is_unavailable_after_the_timeout() {
    let (_dir, kube, server) = setup(&["--kube-api-timeout", "1s"]).await;
    let slow = kube.add_review_token("slow", FakeUser::service_account("default", "web"));
    kube.set_latency(Duration::from_secs(3));
    let started = std::time::Instant::now();
    let status = ask(&server, &slow, WEB).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_millis(2900),
        "answered at the timeout, not after the API"
    );
    kube.set_latency(Duration::ZERO);
    ask(&server, &slow, WEB).await.expect("fast again");
}

#[tokio::test]
async fn unknown_cluster_id_is_unauthenticated() {
    let (_dir, kube, server) = setup(&[]).await;
    let good = kube.add_review_token("good", FakeUser::service_account("default", "web"));
    let mut client = server.client().await;
    for (cluster, ok) in [("", true), ("Kubernetes", true), ("other-cluster", false)] {
        let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
        let mut request = with_token(request, &good);
        request
            .metadata_mut()
            .insert("clusterid", cluster.parse().unwrap());
        let result = client.create_certificate(request).await;
        match (ok, result) {
            (true, Ok(_)) => {}
            (false, Err(status)) => {
                assert_eq!(status.code(), Code::Unauthenticated);
                assert!(status.message().contains("unknown cluster"), "{status:?}");
                assert!(
                    !status.message().contains("Kubernetes"),
                    "the CA's own cluster ID is not told: {status:?}"
                );
            }
            (ok, other) => panic!("clusterid {cluster:?}: expected ok={ok}, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn node_agent_impersonation_rules() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    kube.add_pod(
        "istio-system",
        "ztunnel-pod",
        "uid-ztunnel",
        "ztunnel",
        "node-a",
    );
    kube.add_pod("default", "web-1", "uid-web-1", "web", "node-a");
    kube.add_pod("default", "db-1", "uid-db-1", "db", "node-b");
    let ztunnel = kube.add_review_token(
        "ztunnel",
        FakeUser::service_account("istio-system", "ztunnel"),
    );
    let mut gone = FakeUser::service_account("istio-system", "ztunnel");
    gone.pod = Some(("ztunnel-old".into(), "uid-old".into()));
    let ztunnel_gone = kube.add_review_token("ztunnel-gone", gone);
    let web = kube.add_review_token("web", FakeUser::service_account("default", "web"));
    let kubeconfig = kube.kubeconfig.display().to_string();
    let server = start_off_runtime(
        dir.path().join("data"),
        vec![
            "--kubeconfig".into(),
            kubeconfig,
            "--trusted-node-agent".into(),
            "istio-system/ztunnel".into(),
        ],
    )
    .await;
    const DB: &str = "spiffe://cluster.local/ns/default/sa/db";

    // Allowed: web has a pod on ztunnel's node. (Retry while the pod index syncs.)
    let mut chain = None;
    for _ in 0..50 {
        match impersonate(&server, &ztunnel, WEB).await {
            Ok(c) => {
                chain = Some(c);
                break;
            }
            Err(s) if s.code() == Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(s) => panic!("{s:?}"),
        }
    }
    let chain = chain.expect("impersonation allowed once the pod index is synced");
    let leaf = CertSummary::from_der(&meshca_certs::bundle::parse_certs_pem(&chain[0]).unwrap()[0])
        .unwrap();
    assert_eq!(
        leaf.uris,
        vec![WEB.to_string()],
        "the certificate is for the target"
    );

    let status = impersonate(&server, &ztunnel, DB).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(status.message().contains("node-a"), "{status:?}");

    let status = impersonate(&server, &web, DB).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status.message().contains("not a trusted node agent"),
        "{status:?}"
    );

    let status = impersonate(&server, &ztunnel_gone, WEB).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(status.message().contains("does not exist"), "{status:?}");

    // The index follows the watch: a db pod lands on node-a, then leaves.
    kube.add_pod("default", "db-2", "uid-db-2", "db", "node-a");
    let mut allowed = false;
    for _ in 0..50 {
        if impersonate(&server, &ztunnel, DB).await.is_ok() {
            allowed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(allowed, "a new pod on the node is seen through the watch");
    kube.delete_pod("default", "db-2");
    let mut denied = false;
    for _ in 0..50 {
        if impersonate(&server, &ztunnel, DB).await.is_err() {
            denied = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(denied, "a deleted pod is seen through the watch");
}

#[tokio::test]
async fn offline_tokens_with_oidc_discovery_and_key_rotation() {
    use meshca_tests::fake_kube::OIDC_ISSUER;
    let (_dir, kube, server) = setup(&["--jwt-issuer", OIDC_ISSUER]).await;
    let token = kube.mint_token("default", "web", Some(("web-1", "uid-web-1")));
    ask(&server, &token, WEB)
        .await
        .expect("offline validation with the discovered keys");
    assert_eq!(kube.reviews(), 0, "no API call per request");

    // The cluster rotates its signing key: an unknown kid triggers a refresh.
    kube.rotate_signing_key();
    let token = kube.mint_token("default", "web", None);
    ask(&server, &token, WEB)
        .await
        .expect("keys refreshed on an unknown key ID");
    assert_eq!(kube.reviews(), 0);

    // Tokens of other issuers still go to TokenReview.
    let opaque = kube.add_review_token("opaque", FakeUser::service_account("default", "web"));
    ask(&server, &opaque, WEB)
        .await
        .expect("TokenReview for other tokens");
    assert_eq!(kube.reviews(), 1);
}
