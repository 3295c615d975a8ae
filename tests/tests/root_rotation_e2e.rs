//! End-to-end: a root rotation that Istio's own clients survive.
//!
//! ztunnel and istio-agent take their trust roots for workload traffic from
//! the last element of each CreateCertificate answer, and learn new roots
//! only when they renew. Two real `meshca` replicas (one leader, one
//! follower) run against the fake Kubernetes API; workloads of four kinds
//! renew at different moments while the root goes stable → announced →
//! switched → retired, and at every moment each one verifies every other's
//! chain with its own trust:
//!
//! - two ztunnel-style peers, trusting exactly the roots of their own last
//!   answer (one served by each replica);
//! - a workload trusting only the bundle ConfigMap `istio-ca-root-cert`;
//! - the agent library: a `CaClient` whose only trust, for the CA's TLS and
//!   for peers, is the `root-cert.pem` it writes itself from its answers.
//!
//! And a plugged-in `--ca-dir` whose `root-cert.pem` holds two roots
//! answers both.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use meshca_certs::answer::ChainAnswer;
use meshca_certs::bundle::{encode_cert_pem, parse_certs_pem};
use meshca_certs::{KeyAlgorithm, SpiffeId, TrustBundle};
use meshca_client::{output, CaClient, CaClientConfig, RequestOptions};
use meshca_tests::fake_kube::{FakeKube, FakeUser};
use meshca_tests::root_rotation::{
    ask_root_rotation, bundle_configmap, fast_rotation_flags, rotation_state,
    UNSAFE_GRACE_WARNING as WARNING,
};
use meshca_tests::*;

/// The rotation phase and the signing root, as the Secret says now.
fn secret_state(kube: &FakeKube) -> (String, Vec<u8>) {
    let state = rotation_state(kube).unwrap();
    (state.phase, state.signing_root)
}

fn configmap_bundle(kube: &FakeKube) -> Option<String> {
    bundle_configmap(kube, "default")
}

/// Where a workload's trust comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trust {
    /// The roots of its own last answer (ztunnel, istio-agent).
    OwnAnswer,
    /// The bundle ConfigMap, as it is now.
    ConfigMap,
    /// The `root-cert.pem` the agent library wrote.
    AgentFile,
}

/// A workload: who it is, where it gets certificates, when it renews.
struct Workload {
    name: &'static str,
    identity: SpiffeId,
    token: &'static str,
    replica: usize,
    trust: Trust,
    renew_every: Duration,
    next_renewal: Instant,
    /// When it last renewed (the start of that round of the test's loop).
    last_renewal: Option<Instant>,
    /// The agent library and its output directory (for `Trust::AgentFile`).
    agent: Option<(CaClient, PathBuf)>,
    /// Leaf and intermediates it presents, DER.
    presented: Vec<Vec<u8>>,
    /// Roots of its last answer.
    answer_roots: TrustBundle,
}

impl Workload {
    fn trust_now(&self, kube: &FakeKube) -> TrustBundle {
        match self.trust {
            Trust::OwnAnswer => self.answer_roots.clone(),
            Trust::ConfigMap => TrustBundle::from_pem(&configmap_bundle(kube).unwrap()).unwrap(),
            Trust::AgentFile => {
                let (_, out) = self.agent.as_ref().unwrap();
                let pem = std::fs::read_to_string(out.join(output::ROOT_CERT_FILE)).unwrap();
                TrustBundle::from_pem(&pem).unwrap()
            }
        }
    }
}

/// What the test saw, for the assertions at the end.
#[derive(Default)]
struct Seen {
    phases: Vec<String>,
    /// Answers per replica that carried two roots.
    two_root_answers: [usize; 2],
    /// Moments at which one workload's leaf chained to the old root and
    /// another's to the new one.
    mixed_moments: usize,
    /// Pairwise verifications done.
    checks: usize,
    /// Times the agent wrote two roots to its `root-cert.pem`.
    agent_two_roots: usize,
}

/// Gets a new certificate for `w` and checks the answer's shape.
async fn renew(
    w: &mut Workload,
    servers: &[MeshcaServer; 2],
    kube: &FakeKube,
    phase: &str,
    settled: bool,
    seen: &mut Seen,
) {
    let server = &servers[w.replica];
    let chain_pem = if let Some((client, out)) = &w.agent {
        let svid = client.fetch_default(&w.identity).await.unwrap_or_else(|e| {
            panic!("{}: the agent library failed in phase {phase}: {e}", w.name)
        });
        output::write_credentials(out, &svid).unwrap();
        let written = std::fs::read_to_string(out.join(output::ROOT_CERT_FILE)).unwrap();
        assert_eq!(
            written,
            svid.chain_pem[svid.chain_pem.len() - 1],
            "{}: root-cert.pem holds every root of the answer's last element",
            w.name
        );
        if parse_certs_pem(&written).unwrap().len() == 2 {
            seen.agent_two_roots += 1;
        }
        let presented = std::fs::read_to_string(out.join(output::CERT_CHAIN_FILE)).unwrap();
        w.presented = parse_certs_pem(&presented).unwrap();
        svid.chain_pem
    } else {
        // A ztunnel reaches the CA trusting the mounted bundle ConfigMap.
        let ca_trust = configmap_bundle(kube).unwrap();
        let mut client = server.client_trusting(&ca_trust).await;
        let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, w.identity.as_str(), 0);
        client
            .create_certificate(with_token(request, w.token))
            .await
            .unwrap_or_else(|s| panic!("{}: issuance failed in phase {phase}: {s:?}", w.name))
            .into_inner()
            .cert_chain
    };
    // The shape: [leaf, roots]; the leaf alone in its element; the last
    // element every root, the one the leaf chains to first.
    assert_eq!(chain_pem.len(), 2, "{}: {chain_pem:?}", w.name);
    assert_eq!(parse_certs_pem(&chain_pem[0]).unwrap().len(), 1);
    let answer = ChainAnswer::parse(&chain_pem).unwrap();
    let anchor = TrustBundle::new(vec![answer.roots.roots()[0].clone()]);
    meshca_certs::verify::verify_svid(&answer.presented_chain(), &anchor, SystemTime::now(), None)
        .unwrap_or_else(|e| panic!("{}: the first root is not the leaf's: {e}", w.name));
    let roots = answer.roots.roots().len();
    if settled {
        let expected = match phase {
            "announced" | "switched" => 2,
            _ => 1,
        };
        assert_eq!(
            roots, expected,
            "{} (replica {}): roots in the last element in phase {phase}",
            w.name, w.replica
        );
    }
    if roots == 2 {
        seen.two_root_answers[w.replica] += 1;
    }
    if w.agent.is_none() {
        w.presented = answer.presented_chain();
    }
    w.answer_roots = answer.roots;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workloads_that_trust_their_answers_survive_a_root_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    // JWT-shaped tokens that the fake API server reviews (meshca refuses
    // anything else before a TokenReview).
    let token_of: std::collections::HashMap<&str, &'static str> = ["web", "db", "cm", "agent"]
        .into_iter()
        .map(|sa| {
            let token = kube.add_review_token(sa, FakeUser::service_account("default", sa));
            (sa, &*Box::leak(token.into_boxed_str()))
        })
        .collect();
    let flags = fast_rotation_flags(&kube);
    // Whichever becomes the leader, the other follows the Secret.
    let a = start_off_runtime(dir.path().join("a"), flags.clone()).await;
    let b = start_off_runtime(dir.path().join("b"), flags).await;
    let servers = [a, b];
    let deadline = Instant::now() + Duration::from_secs(90);
    for server in &servers {
        while !server.log().contains(WARNING) {
            assert!(Instant::now() < deadline, "no warning: {}", server.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            server.log().contains("--root-rotation-grace 6s"),
            "the warning names the flag: {}",
            server.log()
        );
    }
    while configmap_bundle(&kube).is_none() {
        assert!(Instant::now() < deadline, "no bundle ConfigMap");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, first_root) = secret_state(&kube);

    // The agent's trust starts as the bundle and then is only what it writes.
    let agent_out = dir.path().join("agent");
    std::fs::create_dir_all(&agent_out).unwrap();
    std::fs::write(
        agent_out.join(output::ROOT_CERT_FILE),
        configmap_bundle(&kube).unwrap(),
    )
    .unwrap();
    let token_file = dir.path().join("agent-token");
    std::fs::write(&token_file, token_of["agent"]).unwrap();
    let agent_client = CaClient::new(CaClientConfig {
        ca_addr: format!("https://{}", servers[1].grpc),
        root_cert: agent_out.join(output::ROOT_CERT_FILE),
        server_name: Some("istiod.istio-system.svc".into()),
        token_file: Some(token_file),
        cluster_id: None,
        timeout: Duration::from_secs(5),
        request: RequestOptions::default(),
    })
    .unwrap();

    let start = Instant::now();
    let workload = |name, sa: &str, token, replica, trust, every_ms, offset_ms| Workload {
        name,
        identity: SpiffeId::parse(&format!("spiffe://cluster.local/ns/default/sa/{sa}")).unwrap(),
        token,
        replica,
        trust,
        renew_every: Duration::from_millis(every_ms),
        next_renewal: start + Duration::from_millis(offset_ms),
        last_renewal: None,
        agent: None,
        presented: Vec::new(),
        answer_roots: TrustBundle::default(),
    };
    let mut workloads = vec![
        workload(
            "ztunnel-a",
            "web",
            token_of["web"],
            0,
            Trust::OwnAnswer,
            2000,
            0,
        ),
        workload(
            "ztunnel-b",
            "db",
            token_of["db"],
            1,
            Trust::OwnAnswer,
            1300,
            0,
        ),
        workload(
            "configmap",
            "cm",
            token_of["cm"],
            0,
            Trust::ConfigMap,
            1700,
            0,
        ),
        workload(
            "agent",
            "agent",
            token_of["agent"],
            1,
            Trust::AgentFile,
            1100,
            0,
        ),
    ];
    workloads[3].agent = Some((agent_client, agent_out));

    let mut seen = Seen::default();
    let mut rotation_asked = false;
    let mut phase_since = Instant::now();
    let old_root_only = TrustBundle::new(vec![first_root.clone()]);
    loop {
        let now = Instant::now();
        assert!(
            now < deadline,
            "phases seen: {:?}\n--- replica 0:\n{}\n--- replica 1:\n{}",
            seen.phases,
            servers[0].log(),
            servers[1].log()
        );
        let (phase, signing) = secret_state(&kube);
        let label = if phase == "stable" && signing != first_root {
            "retired".to_string()
        } else {
            phase.clone()
        };
        if seen.phases.last() != Some(&label) {
            seen.phases.push(label.clone());
            phase_since = now;
        }
        // Replicas follow the Secret within moments; judge the number of
        // roots only once a phase has lasted a little.
        let settle = Duration::from_millis(700);
        let settled = now.duration_since(phase_since) > settle;
        for w in workloads.iter_mut() {
            if w.next_renewal <= now {
                renew(w, &servers, &kube, &label, settled, &mut seen).await;
                w.next_renewal = now + w.renew_every;
                w.last_renewal = Some(now);
            }
        }
        // Whether every workload has renewed in this phase once it settled.
        let all_renewed_settled = workloads
            .iter()
            .all(|w| w.last_renewal > Some(phase_since + settle));
        // Every workload verifies every other's chain with its own trust.
        let mut signed_by_old = 0;
        for q in &workloads {
            if meshca_certs::verify::verify_svid(
                &q.presented,
                &old_root_only,
                SystemTime::now(),
                None,
            )
            .is_ok()
            {
                signed_by_old += 1;
            }
            for p in &workloads {
                if p.name == q.name {
                    continue;
                }
                let trust = p.trust_now(&kube);
                meshca_certs::verify::verify_svid(
                    &q.presented,
                    &trust,
                    SystemTime::now(),
                    Some(&q.identity),
                )
                .unwrap_or_else(|e| {
                    panic!(
                        "phase {label}: {} (trusting {} roots) cannot verify {}: {e}",
                        p.name,
                        trust.roots().len(),
                        q.name
                    )
                });
                seen.checks += 1;
            }
        }
        if signed_by_old > 0 && signed_by_old < workloads.len() {
            seen.mixed_moments += 1;
        }
        if !rotation_asked && label == "stable" && all_renewed_settled {
            // Every workload holds a certificate of the stable phase.
            assert!(ask_root_rotation(&kube));
            rotation_asked = true;
        }
        if label == "retired" && all_renewed_settled {
            // Every workload has renewed after the old root left the
            // bundle, and still verifies every other.
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let phases = seen.phases.join(",");
    assert!(
        phases.starts_with("stable,announced,switched,retired"),
        "{phases}"
    );
    assert!(
        seen.two_root_answers.iter().all(|&n| n >= 2),
        "both replicas, leader and follower, answered both roots: {:?}",
        seen.two_root_answers
    );
    assert!(
        seen.mixed_moments > 0,
        "some moment had one workload on the old root and another on the new"
    );
    assert!(seen.agent_two_roots > 0, "the agent wrote both roots");
    assert!(seen.checks > 300, "{} checks", seen.checks);
}

fn first_cert_in(path: &Path) -> Vec<u8> {
    parse_certs_pem(&std::fs::read_to_string(path).unwrap())
        .unwrap()
        .remove(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugged_in_root_cert_with_two_roots_is_answered_whole() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let (old, new) = (pki.join("old"), pki.join("new"));
    certs_cli(&["root-ca", "--out", old.to_str().unwrap()]);
    certs_cli(&["root-ca", "--out", new.to_str().unwrap()]);
    let east = intermediate_ca(&pki, &old, "east", &[]);
    // An operator's own rotation: the new root listed first, beside the old.
    let old_root = first_cert_in(&old.join("root-cert.pem"));
    let new_root = first_cert_in(&new.join("root-cert.pem"));
    std::fs::write(
        east.join("root-cert.pem"),
        format!(
            "{}{}",
            encode_cert_pem(&new_root),
            encode_cert_pem(&old_root)
        ),
    )
    .unwrap();
    let server = MeshcaServer::start(
        &dir.path().join("data"),
        &["--ca-dir", east.to_str().unwrap()],
    )
    .unwrap();
    assert!(
        !server.log().contains(WARNING),
        "no rotation of its own, no warning: {}",
        server.log()
    );
    let token = server.token("default", "web");
    let trust = std::fs::read_to_string(east.join("root-cert.pem")).unwrap();
    let mut client = server.client_trusting(&trust).await;
    let (_, request) = csr_request(
        KeyAlgorithm::EcdsaP256,
        "spiffe://cluster.local/ns/default/sa/web",
        0,
    );
    let chain = client
        .create_certificate(with_token(request, &token))
        .await
        .unwrap()
        .into_inner()
        .cert_chain;
    assert_eq!(chain.len(), 3, "[leaf, intermediate, roots]: {chain:?}");
    for element in &chain[..2] {
        assert_eq!(parse_certs_pem(element).unwrap().len(), 1);
    }
    assert_eq!(
        parse_certs_pem(&chain[1]).unwrap()[0],
        first_cert_in(&east.join("ca-cert.pem"))
    );
    assert_eq!(
        parse_certs_pem(&chain[2]).unwrap(),
        vec![old_root, new_root],
        "both roots, the one the chain is anchored at first"
    );
    // The data directory's root-cert.pem publishes both too.
    assert_eq!(parse_certs_pem(&server.root_pem()).unwrap().len(), 2);
}
