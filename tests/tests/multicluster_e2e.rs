//! Many clusters, one CA: the real `meshca` with a local cluster (a fake
//! API server holding Istio remote secrets) and three remote clusters
//! (fake API servers: two reviewing tokens, one publishing its keys for
//! offline checks). Each caller is authenticated against its own cluster
//! only, remote secrets take effect while serving, one cluster down
//! costs only its own callers, and a root rotation reaches every cluster's
//! bundle (ConfigMaps and ClusterTrustBundle) before the switch.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use meshca_certs::bundle::parse_certs_pem;
use meshca_certs::inspect::CertSummary;
use meshca_certs::{KeyAlgorithm, SpiffeId, TrustBundle};
use meshca_tests::fake_kube::{FakeKube, FakeUser, OIDC_ISSUER};
use meshca_tests::root_rotation::{
    ask_root_rotation, bundle_configmap, fast_rotation_flags, rotation_state,
};
use meshca_tests::*;
use tonic::Code;

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";
const NAMESPACE: &str = "istio-system";

/// Asks for an SVID of `id` with `token`, naming `cluster` in the
/// `clusterid` header (none when `None`).
async fn ask_in(
    server: &MeshcaServer,
    cluster: Option<&str>,
    token: &str,
    id: &str,
) -> Result<Vec<String>, tonic::Status> {
    let mut client = server.client().await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, id, 0);
    let mut request = with_token(request, token);
    if let Some(cluster) = cluster {
        request
            .metadata_mut()
            .insert("clusterid", cluster.parse().unwrap());
    }
    client
        .create_certificate(request)
        .await
        .map(|r| r.into_inner().cert_chain)
}

fn leaf_uri(chain: &[String]) -> String {
    let der = meshca_certs::bundle::parse_certs_pem(&chain[0]).unwrap();
    CertSummary::from_der(&der[0]).unwrap().uris[0].clone()
}

/// An Istio remote secret (what `istioctl create-remote-secret` makes):
/// labelled `istio/multiCluster: "true"`, each key a cluster ID, its
/// value a kubeconfig.
fn remote_secret(name: &str, clusters: &[(&str, &[u8])]) -> serde_json::Value {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let data: serde_json::Map<String, serde_json::Value> = clusters
        .iter()
        .map(|(id, kubeconfig)| (id.to_string(), b64.encode(kubeconfig).into()))
        .collect();
    serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {
            "name": name, "namespace": NAMESPACE,
            "labels": {"istio/multiCluster": "true"},
            "annotations": {"networking.istio.io/cluster": clusters[0].0},
        },
        "data": data,
    })
}

/// Evaluates `check` (an expression that may `.await`) every 100 ms
/// until it is true; panics after `within`.
macro_rules! eventually {
    ($within:expr, $what:expr, $check:expr) => {{
        let within: Duration = $within;
        let deadline = Instant::now() + within;
        while !$check {
            assert!(
                Instant::now() < deadline,
                "not within {within:?}: {}",
                $what
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }};
}

/// The value of `name{cluster="ID"}` in a /metrics page, if present.
fn cluster_metric(body: &str, name: &str, cluster: &str) -> Option<u64> {
    body.lines().find_map(|l| {
        l.strip_prefix(&format!("{name}{{cluster=\"{cluster}\"}} "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map(|v| v as u64)
    })
}

fn metrics(server: &MeshcaServer) -> String {
    http_get(server.monitoring, "/metrics").unwrap().1
}

#[tokio::test]
async fn each_token_is_checked_against_its_own_cluster() {
    let dirs: Vec<tempfile::TempDir> = (0..5).map(|_| tempfile::tempdir().unwrap()).collect();
    let local = FakeKube::start(dirs[0].path()).await;
    let west = FakeKube::start(dirs[1].path()).await;
    let mut east = FakeKube::start(dirs[2].path()).await;
    let central = FakeKube::start(dirs[3].path()).await;
    let kubeconfig = |kube: &FakeKube| std::fs::read(&kube.kubeconfig).unwrap();

    // central comes from a remote secret present at start; east from a flag.
    local.put_object(
        "secrets",
        remote_secret(
            "istio-remote-secret-central",
            &[("central", &kubeconfig(&central))],
        ),
    );
    let server = start_off_runtime(
        dirs[4].path().join("data"),
        vec![
            "--kubeconfig".into(),
            local.kubeconfig.display().to_string(),
            "--namespace".into(),
            NAMESPACE.into(),
            "--remote-cluster".into(),
            format!("east={}", east.kubeconfig.display()),
            "--remote-cluster-jwt-issuer".into(),
            format!("central={OIDC_ISSUER}"),
            "--kube-api-timeout".into(),
            "2s".into(),
            "--trusted-node-agent".into(),
            "istio-system/ztunnel".into(),
            "--pod-watch-failure-limit".into(),
            "2s".into(),
            // Node agents' reviews outlive east's outage below.
            "--token-review-cache-ttl".into(),
            "10m".into(),
        ],
    )
    .await;

    let local_token = local.add_review_token("local", FakeUser::service_account("default", "web"));
    let east_token = east.add_review_token("east", FakeUser::service_account("default", "web"));
    let west_token = west.add_review_token("west", FakeUser::service_account("default", "web"));
    let reviews = || {
        (
            local.reviews(),
            west.reviews(),
            east.reviews(),
            central.reviews(),
        )
    };

    // The local cluster: no clusterid, or --cluster-id's default.
    for cluster in [None, Some(""), Some("Kubernetes")] {
        let chain = ask_in(&server, cluster, &local_token, WEB).await.unwrap();
        assert_eq!(leaf_uri(&chain), WEB);
    }
    assert_eq!(reviews(), (1, 0, 0, 0), "one review, on the local cluster");

    // A remote cluster from a flag: its own API server reviews its token.
    let chain = ask_in(&server, Some("east"), &east_token, WEB)
        .await
        .unwrap();
    assert_eq!(leaf_uri(&chain), WEB, "one trust domain for every cluster");
    assert_eq!(reviews(), (1, 0, 1, 0));
    assert!(
        server
            .log()
            .lines()
            .any(|l| l.contains("issued certificate") && l.contains("cluster=east")),
        "the audit line names the cluster:\n{}",
        server.log()
    );

    // A node agent of a remote cluster gets the certificates of the pods on
    // its node in its own cluster, judged on that cluster's pods only.
    east.add_pod(
        "istio-system",
        "ztunnel-pod",
        "uid-ztunnel",
        "ztunnel",
        "node-1",
    );
    east.add_pod("default", "web-pod", "uid-web-east", "web", "node-1");
    local.add_pod("default", "db-pod", "uid-db-local", "db", "node-1");
    let ztunnel = east.add_review_token(
        "ztunnel",
        FakeUser::service_account("istio-system", "ztunnel"),
    );
    let as_node_agent = |target: &str| {
        let (_, mut request) = csr_request(KeyAlgorithm::EcdsaP256, target, 0);
        request.metadata = Some(prost_types::Struct {
            fields: [(
                "ImpersonatedIdentity".to_string(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(target.to_string())),
                },
            )]
            .into(),
        });
        let mut request = with_token(request, &ztunnel);
        request
            .metadata_mut()
            .insert("clusterid", "east".parse().unwrap());
        request
    };
    let mut client = server.client().await;
    eventually!(
        Duration::from_secs(10),
        "east's pods indexed",
        client.create_certificate(as_node_agent(WEB)).await.is_ok()
    );
    let chain = client
        .create_certificate(as_node_agent(WEB))
        .await
        .unwrap()
        .into_inner()
        .cert_chain;
    assert_eq!(leaf_uri(&chain), WEB);
    // db runs on a node-1 too, but of the local cluster: not east's.
    let status = client
        .create_certificate(as_node_agent("spiffe://cluster.local/ns/default/sa/db"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("node"), "{status:?}");
    let east_reviews = east.reviews();

    // A token of one cluster naming another is refused by that other,
    // even while the first has it cached.
    for (cluster, token) in [("east", &local_token), ("Kubernetes", &east_token)] {
        let status = ask_in(&server, Some(cluster), token, WEB)
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{cluster}: {status:?}"
        );
    }
    assert_eq!(
        reviews(),
        (2, 0, east_reviews + 1, 0),
        "each refusal asked its own cluster"
    );

    // A clusterid naming no known cluster: refused without an API call.
    for cluster in ["west", "nowhere", "KUBERNETES"] {
        let status = ask_in(&server, Some(cluster), &east_token, WEB)
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert!(status.message().contains("unknown cluster"), "{status:?}");
    }
    assert_eq!(
        reviews(),
        (2, 0, east_reviews + 1, 0),
        "no API call for an unknown cluster"
    );

    // central, from the remote secret, checks its tokens offline with the
    // keys its API server publishes: no review at all.
    let central_token = central.mint_token("default", "web", Some(("web-1", "uid-1")));
    eventually!(
        Duration::from_secs(15),
        "central's keys discovered",
        ask_in(&server, Some("central"), &central_token, WEB)
            .await
            .is_ok()
    );
    let before = central.reviews();
    for n in 0..3 {
        let token = central.mint_token("default", "web", Some((&format!("web-{n}"), "uid")));
        ask_in(&server, Some("central"), &token, WEB).await.unwrap();
    }
    assert_eq!(central.reviews(), before, "offline: no TokenReview");
    // Another cluster's token with the same issuer name: not central's key.
    let foreign = local.mint_token("default", "web", Some(("web-1", "uid-1")));
    let status = ask_in(&server, Some("central"), &foreign, WEB)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // A remote secret added while serving: west within seconds.
    local.put_object(
        "secrets",
        remote_secret("istio-remote-secret-west", &[("west", &kubeconfig(&west))]),
    );
    eventually!(
        Duration::from_secs(10),
        "west added",
        ask_in(&server, Some("west"), &west_token, WEB)
            .await
            .is_ok()
    );
    assert_eq!(west.reviews(), 1);

    // The leader publishes the bundle into every namespace of every remote
    // cluster, as into the local one.
    let root = server.root_pem();
    for (name, kube) in [("local", &local), ("east", &east), ("west", &west)] {
        eventually!(
            Duration::from_secs(10),
            format!("the bundle in {name}"),
            ["default", "istio-system"].iter().all(|ns| kube
                .get_object("configmaps", ns, "istio-ca-root-cert")
                .is_some_and(|cm| cm["data"]["root-cert.pem"].as_str() == Some(root.as_str())))
        );
    }
    assert!(
        east.get_object("configmaps", "kube-system", "istio-ca-root-cert")
            .is_none(),
        "--bundle-exclude-namespace applies in remote clusters"
    );
    let status = ask_in(&server, Some("west"), &east_token, WEB)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // Changed: west's key now points at east's API server; nothing of the
    // old west (its cache included) answers for it.
    local.put_object(
        "secrets",
        remote_secret("istio-remote-secret-west", &[("west", &kubeconfig(&east))]),
    );
    eventually!(
        Duration::from_secs(10),
        "west changed",
        ask_in(&server, Some("west"), &east_token, WEB)
            .await
            .is_ok()
    );
    let status = ask_in(&server, Some("west"), &west_token, WEB)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // Malformed remote secrets: logged by Secret and key, counted, and the
    // other clusters keep working.
    let exec_kubeconfig = String::from_utf8(kubeconfig(&west)).unwrap().replace(
        "    token: meshca-service-account-token\n",
        "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/false\n",
    );
    local.put_object(
        "secrets",
        remote_secret(
            "istio-remote-secret-bad",
            &[
                ("garbage", b"{not: a kubeconfig: ["),
                ("exec-plugin", exec_kubeconfig.as_bytes()),
                ("Kubernetes", &kubeconfig(&west)),
                ("bad key!", &kubeconfig(&west)),
            ],
        ),
    );
    eventually!(
        Duration::from_secs(10),
        "the bad secret counted",
        metric(
            &metrics(&server),
            "meshca_remote_cluster_config_errors_count"
        ) >= 4
    );
    let log = server.log();
    for key in ["garbage", "exec-plugin", "Kubernetes"] {
        assert!(
            log.lines()
                .any(|l| l.contains("istio-remote-secret-bad") && l.contains(key)),
            "no log line names the Secret and key {key}:\n{log}"
        );
    }
    assert!(
        !log.contains("meshca-service-account-token"),
        "a credential was logged"
    );
    for cluster in ["garbage", "exec-plugin"] {
        let status = ask_in(&server, Some(cluster), &west_token, WEB)
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    }
    ask_in(&server, Some("east"), &east_token, WEB)
        .await
        .unwrap();
    ask_in(&server, Some("west"), &east_token, WEB)
        .await
        .unwrap();
    ask_in(&server, None, &local_token, WEB).await.unwrap();

    // Deleted: west is unknown again, refused without an API call.
    local.delete_object("secrets", NAMESPACE, "istio-remote-secret-west");
    eventually!(
        Duration::from_secs(10),
        "west removed",
        ask_in(&server, Some("west"), &east_token, WEB)
            .await
            .is_err_and(|s| s.message().contains("unknown cluster"))
    );

    let page = metrics(&server);
    assert_eq!(
        metric(&page, "meshca_remote_clusters"),
        2,
        "east and central"
    );
    assert_eq!(
        cluster_metric(&page, "meshca_remote_cluster_up", "east"),
        Some(1)
    );
    assert_eq!(
        cluster_metric(&page, "meshca_remote_cluster_up", "west"),
        None
    );

    // east's API server black-holed: its new callers wait at most
    // --kube-api-timeout and get UNAVAILABLE; every other cluster is
    // served at its normal pace meanwhile, and /ready stays 200.
    east.set_latency(Duration::from_secs(60));
    let east_new = east.add_review_token("east-new", FakeUser::service_account("default", "web"));
    let stuck = {
        let mut client = server.client().await;
        let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
        let mut request = with_token(request, &east_new);
        request
            .metadata_mut()
            .insert("clusterid", "east".parse().unwrap());
        tokio::spawn(async move {
            let started = Instant::now();
            (client.create_certificate(request).await, started.elapsed())
        })
    };
    let local_fresh =
        local.add_review_token("local-2", FakeUser::service_account("default", "web"));
    for (cluster, token) in [
        (None, local_fresh),
        (Some("central"), central_token.clone()),
    ] {
        let started = Instant::now();
        ask_in(&server, cluster, &token, WEB).await.unwrap();
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "{cluster:?} took {:?} while east hangs",
            started.elapsed()
        );
    }
    let (answer, took) = stuck.await.unwrap();
    assert_eq!(answer.unwrap_err().code(), Code::Unavailable);
    assert!(
        took < Duration::from_secs(4),
        "east's caller waited {took:?}"
    );
    assert_eq!(http_get(server.monitoring, "/ready").unwrap().0, 200);
    eventually!(
        Duration::from_secs(25),
        "east reported down",
        cluster_metric(&metrics(&server), "meshca_remote_cluster_up", "east") == Some(0)
    );
    assert_eq!(http_get(server.monitoring, "/ready").unwrap().0, 200);
    assert!(
        cluster_metric(
            &metrics(&server),
            "meshca_remote_cluster_authentication_failure_count",
            "east"
        )
        .is_some_and(|n| n >= 2),
        "east's refusals counted by cluster"
    );

    // east's API server gone: its pod watch fails, and past
    // --pod-watch-failure-limit east's node agent gets UNAVAILABLE (its
    // token still reviewed, from the cache); the local cluster's node
    // agent is served from the local pod index all along.
    local.add_pod(
        "istio-system",
        "ztunnel-local",
        "uid-ztunnel-local",
        "ztunnel",
        "node-9",
    );
    local.add_pod("default", "web-local", "uid-web-local", "web", "node-9");
    let mut local_agent = FakeUser::service_account("istio-system", "ztunnel");
    local_agent.pod = Some(("ztunnel-local".into(), "uid-ztunnel-local".into()));
    let local_ztunnel = local.add_review_token("ztunnel-local", local_agent);
    eventually!(
        Duration::from_secs(10),
        "the local node agent served",
        impersonate(&server, &local_ztunnel, WEB).await.is_ok()
    );
    east.stop();
    eventually!(
        Duration::from_secs(20),
        "east's impersonation unavailable",
        client
            .create_certificate(as_node_agent(WEB))
            .await
            .is_err_and(
                |s| s.code() == Code::Unavailable && s.message().contains("pod index is stale")
            )
    );
    let chain = impersonate(&server, &local_ztunnel, WEB).await.unwrap();
    assert_eq!(
        leaf_uri(&chain),
        WEB,
        "the local cluster's node agent unaffected"
    );
}

/// The roots (DER) of the bundle `kube` holds: every `istio-ca-root-cert`
/// of `NAMESPACES` and the signer's ClusterTrustBundle, when all of them
/// hold the same; `None` while they differ or one is missing.
fn published_roots(kube: &FakeKube) -> Option<Vec<Vec<u8>>> {
    let mut bundles: Vec<String> = ["default", "istio-system"]
        .iter()
        .map(|ns| bundle_configmap(kube, ns))
        .collect::<Option<_>>()?;
    let ctb = kube.get_object("clustertrustbundles", "", CLUSTER_TRUST_BUNDLE)?;
    assert_eq!(ctb["spec"]["signerName"], SIGNER, "{ctb}");
    assert_eq!(
        ctb["metadata"]["labels"]["meshca.io/trust-domain"], "cluster.local",
        "{ctb}"
    );
    bundles.push(ctb["spec"]["trustBundle"].as_str()?.to_string());
    let first = parse_certs_pem(&bundles[0]).ok()?;
    bundles
        .iter()
        .all(|b| parse_certs_pem(b).ok().as_ref() == Some(&first))
        .then_some(first)
}

const SIGNER: &str = "meshca.io/spiffe";
const CLUSTER_TRUST_BUNDLE: &str = "meshca.io:spiffe:trust-bundle";

#[tokio::test]
async fn a_root_rotation_reaches_every_remote_cluster_before_the_switch() {
    // The leader publishes istio-ca-root-cert and, with
    // --pod-certificate-signer, the signer's ClusterTrustBundle into the
    // local cluster and every remote one (east from a flag, west from a
    // remote secret). A rotation announces the new root for
    // --root-rotation-grace (6 s here) before it signs: within that grace
    // every cluster must hold both roots, so that a workload trusting its
    // own cluster's bundle verifies the leaves signed after the switch.
    let dirs: Vec<tempfile::TempDir> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let local = FakeKube::start(dirs[0].path()).await;
    let east = FakeKube::start(dirs[1].path()).await;
    let west = FakeKube::start(dirs[2].path()).await;
    local.put_object(
        "secrets",
        remote_secret(
            "istio-remote-secret-west",
            &[("west", &std::fs::read(&west.kubeconfig).unwrap())],
        ),
    );
    let mut flags = fast_rotation_flags(&local);
    // Pod certificates live at least an hour: the longest lifetime allowed
    // must be that (the workloads here still get 4 s, and the switch
    // comes after the grace whatever it is).
    let max_ttl = flags
        .iter()
        .position(|f| f == "--max-workload-cert-ttl")
        .unwrap();
    flags[max_ttl + 1] = "1h".into();
    flags.extend([
        "--namespace".into(),
        NAMESPACE.into(),
        "--remote-cluster".into(),
        format!("east={}", east.kubeconfig.display()),
        "--pod-certificate-signer".into(),
        SIGNER.into(),
    ]);
    let server = start_off_runtime(dirs[3].path().join("data"), flags).await;
    let clusters = [("local", &local), ("east", &east), ("west", &west)];

    // Stable: one root, the same in every cluster.
    eventually!(
        Duration::from_secs(20),
        format!("one root published in every cluster:\n{}", server.log()),
        rotation_state(&local).is_some_and(|state| clusters
            .iter()
            .all(|(_, kube)| published_roots(kube) == Some(vec![state.signing_root.clone()])))
    );
    let old_root = rotation_state(&local).unwrap().signing_root;
    assert!(
        server
            .log()
            .lines()
            .any(|l| l.contains("published the ClusterTrustBundle") && l.contains("cluster=east")),
        "the remote publisher's log lines name the cluster:\n{}",
        server.log()
    );

    // Rotate. Each round reads the clusters first and the phase after: a
    // cluster seen with both roots while the phase is not yet `switched`
    // had them before the switch.
    assert!(ask_root_rotation(&local));
    let asked = Instant::now();
    let mut both_roots: [Option<Duration>; 3] = [None; 3];
    let mut announced_root = None;
    loop {
        let seen: Vec<Option<Vec<Vec<u8>>>> = clusters
            .iter()
            .map(|(_, kube)| published_roots(kube))
            .collect();
        let state = rotation_state(&local).unwrap();
        if state.phase == "switched" {
            assert_ne!(state.signing_root, old_root);
            assert_eq!(announced_root.as_ref(), Some(&state.signing_root));
            break;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(60),
            "no switch: {state:?}\n{}",
            server.log()
        );
        for (k, roots) in seen.iter().enumerate() {
            let Some(roots) = roots else { continue };
            if roots.len() == 2 && roots.contains(&old_root) {
                let new = roots.iter().find(|r| **r != old_root).unwrap();
                assert_eq!(announced_root.get_or_insert(new.clone()), new);
                both_roots[k].get_or_insert(asked.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "both roots published (local, east, west) after {both_roots:?}; switched after {:?}",
        asked.elapsed()
    );
    for ((name, _), seen) in clusters.iter().zip(both_roots) {
        assert!(
            seen.is_some(),
            "{name} did not hold both roots before the switch ({both_roots:?})"
        );
    }

    // Signed by the new root now, and verified by a workload of east
    // trusting nothing but east's bundle ConfigMap.
    let token = east.add_review_token("east-web", FakeUser::service_account("default", "web"));
    let chain = ask_in(&server, Some("east"), &token, WEB).await.unwrap();
    let presented: Vec<Vec<u8>> = chain[..chain.len() - 1]
        .iter()
        .flat_map(|pem| parse_certs_pem(pem).unwrap())
        .collect();
    let trust = TrustBundle::from_pem(&bundle_configmap(&east, "default").unwrap()).unwrap();
    meshca_certs::verify::verify_svid(
        &presented,
        &trust,
        std::time::SystemTime::now(),
        Some(&SpiffeId::parse(WEB).unwrap()),
    )
    .unwrap();
    let last = parse_certs_pem(chain.last().unwrap()).unwrap();
    assert!(
        last.contains(&old_root) && last.len() == 2,
        "both roots in the answer"
    );
}

#[test]
fn bad_remote_cluster_flags_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    MeshcaServer::refuses_to_start(
        &data,
        &["--remote-cluster", "Kubernetes=/nonexistent"],
        "names the local cluster",
    );
    MeshcaServer::refuses_to_start(
        &data,
        &["--remote-cluster", "east=/nonexistent/kubeconfig"],
        "--remote-cluster east=/nonexistent/kubeconfig",
    );
    MeshcaServer::refuses_to_start(
        &data,
        &[
            "--remote-cluster",
            "a=/x,b=/y",
            "--max-remote-clusters",
            "1",
        ],
        "more than --max-remote-clusters 1",
    );
}
