//! End-to-end tests of `meshca-agent --workload-api-socket`: the real agent
//! and the real `meshca`, read by independent clients — the `spiffe`
//! crate's `X509Source` (a SPIFFE Workload API client) and an SDS client
//! built from the `envoy-types` crate's Envoy protos — over the Unix socket.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{secret, Secret};
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use hyper_util::rt::TokioIo;
use meshca_certs::bundle::parse_certs_pem;
use meshca_certs::inspect::spki_der;
use meshca_certs::profile::{self_signed_root, SubjectName, Validity};
use meshca_certs::{KeyAlgorithm, PrivateKey, SpiffeId, TrustBundle};
use meshca_proto::spiffe_workload::spiffe_workload_api_client::SpiffeWorkloadApiClient;
use meshca_proto::spiffe_workload::{JwtsvidRequest, X509BundlesRequest, X509svidRequest};
use meshca_tests::agent_process::{check_source, set_cgroup, unix_channel, x509_source, Agent};
use meshca_tests::fake_kube::{FakeKube, FakeUser};
use meshca_tests::*;
use prost::Message;
use spiffe::X509Source;
use tokio::net::UnixStream;
use tonic::transport::Endpoint;
use tonic::Code;

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";
const DB: &str = "spiffe://cluster.local/ns/default/sa/db";
const SECRET_TYPE: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

/// A root that is not meshca's, PEM.
fn foreign_root_pem() -> String {
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    self_signed_root(
        &key,
        &SubjectName {
            common_name: Some("next root".into()),
            ..Default::default()
        },
        Validity::backdated(time::OffsetDateTime::now_utc(), time::Duration::days(30)),
    )
    .unwrap()
    .to_pem()
}

#[tokio::test]
async fn pod_mode_serves_x509_source_with_rotation_and_bundle_updates() {
    let dir = tempfile::tempdir().unwrap();
    let server = MeshcaServer::start(&dir.path().join("data"), &[]).unwrap();
    std::fs::write(dir.path().join("root-cert.pem"), server.root_pem()).unwrap();
    // The socket's directory does not exist yet: the agent makes it.
    let socket = dir.path().join("uds/agent.sock");
    let socket_arg = socket.display().to_string();
    let mut agent = Agent::start(
        &server,
        dir.path(),
        &server.token("default", "web"),
        "agent",
        &[
            "--spiffe-id",
            WEB,
            "--ttl",
            "8s",
            "--workload-api-socket",
            &socket_arg,
            "--bundle-refresh",
            "200ms",
        ],
    );
    agent.wait_for_socket(&socket).await;
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o777, "any workload may connect");

    let source = x509_source(&socket).await.expect("an X509Source syncs");
    let (first, roots) = check_source(&source, WEB);
    assert_eq!(roots, 1);

    // A rotation (8 s certificates renew at about 4 s) arrives on the open stream.
    let mut updates = source.updated();
    let rotated = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            updates.changed().await.unwrap();
            let (serial, _) = check_source(&source, WEB);
            if serial != first {
                return serial;
            }
        }
    })
    .await
    .expect("a rotation arrives within 30 s");
    assert_ne!(rotated, first);

    // A second root published in the --root-cert file (a root rotation's
    // announced phase) is pushed as a bundle update, both roots served.
    let next_root = foreign_root_pem();
    std::fs::write(
        dir.path().join("root-cert.pem"),
        format!("{}{next_root}", server.root_pem()),
    )
    .unwrap();
    let next_root_der = parse_certs_pem(&next_root).unwrap().remove(0);
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            updates.changed().await.unwrap();
            let svid = source.svid().unwrap();
            let bundle = source
                .try_bundle_for_trust_domain(svid.spiffe_id().trust_domain())
                .unwrap();
            let authorities: Vec<&[u8]> =
                bundle.authorities().iter().map(|c| c.as_bytes()).collect();
            if authorities.contains(&next_root_der.as_slice()) {
                assert_eq!(authorities.len(), 2, "both roots during the grace period");
                return;
            }
        }
    })
    .await
    .expect("the bundle update arrives");
    check_source(&source, WEB);

    // Without the security header: INVALID_ARGUMENT; JWT: UNIMPLEMENTED.
    let mut raw = SpiffeWorkloadApiClient::new(unix_channel(&socket).await);
    let status = raw
        .fetch_x509svid(X509svidRequest {})
        .await
        .expect_err("no header");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("workload.spiffe.io"),
        "{status:?}"
    );
    let mut request = tonic::Request::new(JwtsvidRequest {
        audience: vec!["x".into()],
        spiffe_id: String::new(),
    });
    request
        .metadata_mut()
        .insert("workload.spiffe.io", "true".parse().unwrap());
    // JWT-SVIDs are served too (jwt_svid_e2e.rs tests them in depth).
    let jwt = raw.fetch_jwtsvid(request).await.expect("a JWT-SVID");
    assert_eq!(jwt.get_ref().svids[0].spiffe_id, WEB);

    // A second agent on the live socket is refused; after a crash (the
    // socket file stays behind) a new agent replaces the stale file.
    let mut second = agent_on_socket(&server, dir.path(), "second", &socket_arg);
    let status = second.child.wait().unwrap();
    assert!(!status.success());
    assert!(second.log().contains("in use"), "{}", second.log());
    source.shutdown().await;
    drop(agent);
    assert!(socket.exists(), "a killed agent leaves its socket file");
    let mut third = agent_on_socket(&server, dir.path(), "third", &socket_arg);
    third.wait_for_socket(&socket).await;
    let source = x509_source(&socket).await.expect("served again");
    check_source(&source, WEB);
    source.shutdown().await;
}

fn agent_on_socket(server: &MeshcaServer, dir: &Path, name: &str, socket: &str) -> Agent {
    Agent::start(
        server,
        dir,
        &server.token("default", "web"),
        name,
        &["--spiffe-id", WEB, "--workload-api-socket", socket],
    )
}

/// Unpacks an SDS response: (name, secret) pairs.
fn secrets(response: &DiscoveryResponse) -> Vec<Secret> {
    assert_eq!(response.type_url, SECRET_TYPE);
    response
        .resources
        .iter()
        .map(|any| {
            assert_eq!(any.type_url, SECRET_TYPE);
            Secret::decode(any.value.as_slice()).unwrap()
        })
        .collect()
}

fn inline_bytes(source: &Option<envoy_types::pb::envoy::config::core::v3::DataSource>) -> String {
    use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
    match source.as_ref().and_then(|s| s.specifier.as_ref()) {
        Some(Specifier::InlineBytes(bytes)) => String::from_utf8(bytes.clone()).unwrap(),
        other => panic!("expected inline bytes, got {other:?}"),
    }
}

/// What a client holds at one moment: the chain it presents (leaf first)
/// and the roots it trusts, DER.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    chain: Vec<Vec<u8>>,
    roots: Vec<Vec<u8>>,
}

impl Held {
    /// Whether the chain verifies to `root` alone.
    fn chains_to(&self, root: &[u8]) -> bool {
        meshca_certs::verify::verify_svid(
            &self.chain,
            &TrustBundle::new(vec![root.to_vec()]),
            SystemTime::now(),
            None,
        )
        .is_ok()
    }
}

/// Checks an SDS answer holding `default` and `ROOTCA`: the key is the
/// leaf's, the roots verify the chain. Returns what it holds.
fn sds_held(response: &DiscoveryResponse, expected: &str) -> Held {
    let secrets = secrets(response);
    let names: Vec<&str> = secrets.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["default", "ROOTCA"]);
    let (chain, key) = match &secrets[0].r#type {
        Some(secret::Type::TlsCertificate(tls)) => (
            parse_certs_pem(&inline_bytes(&tls.certificate_chain)).unwrap(),
            PrivateKey::from_pem(&inline_bytes(&tls.private_key)).unwrap(),
        ),
        other => panic!("default is a tls_certificate, got {other:?}"),
    };
    let roots = match &secrets[1].r#type {
        Some(secret::Type::ValidationContext(context)) => {
            parse_certs_pem(&inline_bytes(&context.trusted_ca)).unwrap()
        }
        other => panic!("ROOTCA is a validation_context, got {other:?}"),
    };
    assert_eq!(spki_der(&chain[0]).unwrap(), key.public_key_spki_der());
    meshca_certs::verify::verify_svid(
        &chain,
        &TrustBundle::new(roots.clone()),
        SystemTime::now(),
        Some(&SpiffeId::parse(expected).unwrap()),
    )
    .expect("ROOTCA verifies the chain");
    Held { chain, roots }
}

/// [`sds_held`], returning the leaf's serial.
fn check_sds(response: &DiscoveryResponse, expected: &str) -> String {
    let held = sds_held(response, expected);
    meshca_certs::verify::check_svid_leaf(&held.chain[0])
        .unwrap()
        .serial_hex
}

fn sds_request(names: &[&str], version: &str, nonce: &str, nack: bool) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: version.to_string(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        type_url: SECRET_TYPE.to_string(),
        response_nonce: nonce.to_string(),
        error_detail: nack.then(|| RpcStatus {
            code: Code::InvalidArgument as i32,
            message: "test NACK".into(),
            details: Vec::new(),
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn pod_mode_serves_envoy_sds_with_ack_nack_and_pushes() {
    let dir = tempfile::tempdir().unwrap();
    let server = MeshcaServer::start(&dir.path().join("data"), &[]).unwrap();
    std::fs::write(dir.path().join("root-cert.pem"), server.root_pem()).unwrap();
    let socket = dir.path().join("agent.sock");
    let socket_arg = socket.display().to_string();
    let mut agent = Agent::start(
        &server,
        dir.path(),
        &server.token("default", "web"),
        "agent",
        &[
            "--spiffe-id",
            WEB,
            "--ttl",
            "20s",
            "--workload-api-socket",
            &socket_arg,
        ],
    );
    agent.wait_for_socket(&socket).await;
    let mut client = SecretDiscoveryServiceClient::new(unix_channel(&socket).await);

    // Unary fetch.
    let fetched = client
        .fetch_secrets(sds_request(&["default", "ROOTCA"], "", "", false))
        .await
        .unwrap()
        .into_inner();
    check_sds(&fetched, WEB);

    // A stream: the first answer.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(sds_request(&["default", "ROOTCA"], "", "", false))
        .await
        .unwrap();
    let mut responses = client
        .stream_secrets(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let first = responses.message().await.unwrap().unwrap();
    let first_serial = check_sds(&first, WEB);
    assert!(!first.version_info.is_empty() && !first.nonce.is_empty());

    // NACK it, then ask for other names: the stream still answers, with a
    // new version and nonce.
    tx.send(sds_request(&["default", "ROOTCA"], "", &first.nonce, true))
        .await
        .unwrap();
    tx.send(sds_request(&["ROOTCA"], "", &first.nonce, false))
        .await
        .unwrap();
    let roots_only = responses.message().await.unwrap().unwrap();
    let names: Vec<String> = secrets(&roots_only).into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["ROOTCA"], "the names asked for");
    assert_ne!(roots_only.nonce, first.nonce);
    assert_ne!(roots_only.version_info, first.version_info);

    // Back to the real names, ACK, and wait for the rotation push.
    tx.send(sds_request(
        &["default", "ROOTCA"],
        &roots_only.version_info,
        &roots_only.nonce,
        false,
    ))
    .await
    .unwrap();
    let again = responses.message().await.unwrap().unwrap();
    assert_eq!(check_sds(&again, WEB), first_serial, "same certificate");
    // A request naming an older nonce is stale and ignored, even with other
    // names: otherwise the next answer would be a ROOTCA-only one, not the
    // rotation push checked below.
    tx.send(sds_request(&["ROOTCA"], "", &first.nonce, false))
        .await
        .unwrap();
    tx.send(sds_request(
        &["default", "ROOTCA"],
        &again.version_info,
        &again.nonce,
        false,
    ))
    .await
    .unwrap();
    let pushed = tokio::time::timeout(Duration::from_secs(40), responses.message())
        .await
        .expect("a rotation push within 40 s (20 s certificates renew at about 10 s)")
        .unwrap()
        .unwrap();
    assert_ne!(
        check_sds(&pushed, WEB),
        first_serial,
        "the rotated certificate"
    );
    assert_ne!(pushed.nonce, again.nonce);

    // A name the agent does not serve is answered empty: left out of the
    // answer, on a stream (which goes on) and in a fetch.
    let (bad_tx, bad_rx) = tokio::sync::mpsc::channel(1);
    bad_tx
        .send(sds_request(&["default", "no-such-secret"], "", "", false))
        .await
        .unwrap();
    let answer = client
        .stream_secrets(tokio_stream::wrappers::ReceiverStream::new(bad_rx))
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .expect("answered without the unknown name")
        .expect("an answer");
    assert_eq!(answer.resources.len(), 1, "default alone: {answer:?}");
    let answer = client
        .fetch_secrets(sds_request(&["no-such-secret"], "", "", false))
        .await
        .expect("an empty answer")
        .into_inner();
    assert!(answer.resources.is_empty(), "{answer:?}");
    drop(bad_tx);

    // Incremental SDS is not implemented.
    let (_delta_tx, delta_rx) = tokio::sync::mpsc::channel(1);
    let status = client
        .delta_secrets(tokio_stream::wrappers::ReceiverStream::new(delta_rx))
        .await
        .expect_err("delta");
    assert_eq!(status.code(), Code::Unimplemented);
    assert!(
        agent.log().contains("NACK"),
        "the NACK is logged:\n{}",
        agent.log()
    );
}

/// Waits up to `limit` for the agent to exit; its status and how long it took.
async fn wait_for_exit(agent: &mut Agent, limit: Duration) -> (std::process::ExitStatus, Duration) {
    let started = Instant::now();
    loop {
        if let Some(status) = agent.child.try_wait().unwrap() {
            return (status, started.elapsed());
        }
        assert!(
            started.elapsed() < limit,
            "the agent is still running {limit:?} after the signal:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_signal_stops_the_agent_promptly_with_streams_open() {
    let dir = tempfile::tempdir().unwrap();
    let server = MeshcaServer::start(&dir.path().join("data"), &[]).unwrap();
    std::fs::write(dir.path().join("root-cert.pem"), server.root_pem()).unwrap();
    for signal in [
        nix::sys::signal::Signal::SIGTERM,
        nix::sys::signal::Signal::SIGINT,
    ] {
        let socket = dir.path().join(format!("{signal}.sock"));
        let name = format!("agent-{signal}");
        let mut agent = agent_on_socket(&server, dir.path(), &name, &socket.display().to_string());
        agent.wait_for_socket(&socket).await;
        // The streams every real client keeps open: a Workload API one and
        // an SDS one, each with its first answer read.
        let channel = unix_channel(&socket).await;
        let mut request = tonic::Request::new(X509svidRequest {});
        request
            .metadata_mut()
            .insert("workload.spiffe.io", "true".parse().unwrap());
        let mut svids = SpiffeWorkloadApiClient::new(channel.clone())
            .fetch_x509svid(request)
            .await
            .unwrap()
            .into_inner();
        assert!(svids.message().await.unwrap().is_some());
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tx.send(sds_request(&["default"], "", "", false))
            .await
            .unwrap();
        let mut secrets = SecretDiscoveryServiceClient::new(channel)
            .stream_secrets(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        assert!(secrets.message().await.unwrap().is_some());
        // And a connection that sends nothing.
        let _silent = UnixStream::connect(&socket).await.unwrap();

        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(agent.child.id()).unwrap()),
            signal,
        )
        .unwrap();
        for status in [
            svids.message().await.expect_err("the stream ends"),
            secrets.message().await.expect_err("the stream ends"),
        ] {
            assert_eq!(status.code(), Code::Unavailable, "{signal}: {status:?}");
            assert!(status.message().contains("shutting down"), "{status:?}");
        }
        // Within the grace (CLOSE_GRACE, 2 s) and some start-up slack.
        let (status, took) = wait_for_exit(&mut agent, Duration::from_secs(10)).await;
        assert!(status.success(), "{signal}: {status}\n{}", agent.log());
        assert!(
            took < meshca_client::workload_api::CLOSE_GRACE + Duration::from_secs(3),
            "{signal}: {took:?}"
        );
        assert!(!socket.exists(), "{signal}: the socket file is removed");
        drop(tx);
    }
}

/// What an `X509Source` holds, after [`check_source`]'s checks.
fn source_held(source: &X509Source, expected: &str) -> Held {
    check_source(source, expected);
    let svid = source.svid().unwrap();
    let bundle = source
        .try_bundle_for_trust_domain(svid.spiffe_id().trust_domain())
        .unwrap();
    Held {
        chain: svid
            .cert_chain()
            .iter()
            .map(|c| c.as_bytes().to_vec())
            .collect(),
        roots: bundle
            .authorities()
            .iter()
            .map(|c| c.as_bytes().to_vec())
            .collect(),
    }
}

/// The certificates of a Workload API bundle (DER, concatenated).
fn split_der(mut bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut certs = Vec::new();
    while !bytes.is_empty() {
        let (rest, _) = x509_parser::parse_x509_certificate(bytes).unwrap();
        certs.push(bytes[..bytes.len() - rest.len()].to_vec());
        bytes = rest;
    }
    certs
}

/// The moments of a root rotation one client has been seen in.
#[derive(Debug, Default)]
struct RotationSeen {
    /// A leaf of the old root, both roots trusted (announced).
    announced: bool,
    /// A leaf of the new root, both roots trusted (switched).
    switched: bool,
    /// A leaf of the new root, only the new root trusted (retired).
    retired: bool,
}

impl RotationSeen {
    /// Records what `held` shows; the new root is the one that is not `old`.
    /// Returns the new root once `held` names it.
    fn record(&mut self, held: &Held, old: &[u8]) -> Option<Vec<u8>> {
        let new = held.roots.iter().find(|r| r.as_slice() != old)?.clone();
        let both = held.roots.len() == 2 && held.roots.iter().any(|r| r == old);
        if both && held.chains_to(old) {
            self.announced = true;
        }
        if both && held.chains_to(&new) && !held.chains_to(old) {
            self.switched = true;
        }
        if held.roots == [new.clone()] && held.chains_to(&new) {
            self.retired = true;
        }
        Some(new)
    }

    fn done(&self) -> bool {
        self.announced && self.switched && self.retired
    }
}

/// Writes `contents` to `path` as the kubelet updates a projected
/// ConfigMap: at once (a new file renamed over the old).
fn replace_file(path: &Path, contents: &str) {
    let fresh = path.with_extension("new");
    std::fs::write(&fresh, contents).unwrap();
    std::fs::rename(&fresh, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_rotation_reaches_open_streams_as_bundle_updates() {
    use meshca_tests::root_rotation::{ask_root_rotation, bundle_configmap, rotation_state};

    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let token = kube.add_review_token("web", FakeUser::service_account("default", "web"));
    let server = start_off_runtime(
        dir.path().join("data"),
        meshca_tests::root_rotation::fast_rotation_flags(&kube),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let (first_bundle, old_root) = loop {
        if let (Some(bundle), Some(state)) =
            (bundle_configmap(&kube, "default"), rotation_state(&kube))
        {
            break (bundle, state.signing_root);
        }
        assert!(Instant::now() < deadline, "no root:\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // The agent's --root-cert is the pod's projection of the bundle
    // ConfigMap; this test is its kubelet.
    let root_file = dir.path().join("root-cert.pem");
    std::fs::write(&root_file, &first_bundle).unwrap();
    let socket = dir.path().join("agent.sock");
    let mut agent = Agent::start(
        &server,
        dir.path(),
        &token,
        "agent",
        &[
            "--spiffe-id",
            WEB,
            "--ttl",
            "4s",
            "--workload-api-socket",
            &socket.display().to_string(),
            "--bundle-refresh",
            "200ms",
        ],
    );
    agent.wait_for_socket(&socket).await;
    let source = x509_source(&socket).await.expect("an X509Source syncs");
    let start = source_held(&source, WEB);
    assert_eq!(start.roots, std::slice::from_ref(&old_root));

    // Envoy's view: an SDS stream that ACKs every answer.
    let mut sds = SecretDiscoveryServiceClient::new(unix_channel(&socket).await);
    let (requests, request_rx) = tokio::sync::mpsc::channel(4);
    requests
        .send(sds_request(&["default", "ROOTCA"], "", "", false))
        .await
        .unwrap();
    let mut responses = sds
        .stream_secrets(tokio_stream::wrappers::ReceiverStream::new(request_rx))
        .await
        .unwrap()
        .into_inner();
    let (answers, mut sds_answers) = tokio::sync::mpsc::unbounded_channel();
    let sds_reader = tokio::spawn(async move {
        while let Ok(Some(response)) = responses.message().await {
            let ack = sds_request(
                &["default", "ROOTCA"],
                &response.version_info,
                &response.nonce,
                false,
            );
            if answers.send(response).is_err() || requests.send(ack).await.is_err() {
                return;
            }
        }
    });

    // A FetchX509Bundles stream: a message per bundle change only.
    let mut bundle_request = tonic::Request::new(X509BundlesRequest {});
    bundle_request
        .metadata_mut()
        .insert("workload.spiffe.io", "true".parse().unwrap());
    let mut bundle_stream = SpiffeWorkloadApiClient::new(unix_channel(&socket).await)
        .fetch_x509_bundles(bundle_request)
        .await
        .unwrap()
        .into_inner();
    let (bundle_tx, mut bundle_rx) = tokio::sync::mpsc::unbounded_channel();
    let bundle_reader = tokio::spawn(async move {
        while let Ok(Some(message)) = bundle_stream.message().await {
            if bundle_tx.send(message).is_err() {
                return;
            }
        }
    });
    let mut bundles: Vec<Vec<Vec<u8>>> = Vec::new();

    assert!(ask_root_rotation(&kube));
    let mut phases: Vec<String> = Vec::new();
    let (mut by_source, mut by_sds) = (RotationSeen::default(), RotationSeen::default());
    let mut sds_updates = 0;
    let mut projecting = false;
    let mut new_root: Option<Vec<u8>> = None;
    // What the test saw so far, for a failure's message.
    macro_rules! report {
        () => {
            format!(
                "phases {phases:?}; X509Source saw {by_source:?}, SDS saw {by_sds:?} \
                 ({sds_updates} answers), bundle stream roots {:?}\n--- agent:\n{}\n--- meshca:\n{}",
                bundles.iter().map(Vec::len).collect::<Vec<_>>(),
                agent.log(),
                server.log()
            )
        };
    }
    loop {
        let label = rotation_state(&kube).unwrap().label(&old_root);
        if phases.last() != Some(&label) {
            phases.push(label.clone());
        }
        if let Err(e) = source.svid() {
            panic!("the X509Source holds no SVID ({e}): {}", report!());
        }
        // At every moment the SVID verifies with the bundle the client
        // holds (asserted by source_held and sds_held).
        let held = source_held(&source, WEB);
        if let Some(new) = by_source.record(&held, &old_root) {
            new_root.get_or_insert(new);
        }
        while let Ok(response) = sds_answers.try_recv() {
            sds_updates += 1;
            by_sds.record(&sds_held(&response, WEB), &old_root);
        }
        while let Ok(message) = bundle_rx.try_recv() {
            let domains: Vec<&String> = message.bundles.keys().collect();
            assert_eq!(domains, ["spiffe://cluster.local"]);
            bundles.push(split_der(&message.bundles["spiffe://cluster.local"]));
        }
        if by_source.announced && !projecting {
            // The new root reached the source during the grace period, from
            // the CA's answers alone: the kubelet has not projected the new
            // bundle yet.
            assert_eq!(label, "announced", "both roots before the switch");
            assert_eq!(
                parse_certs_pem(&std::fs::read_to_string(&root_file).unwrap())
                    .unwrap()
                    .len(),
                1
            );
            projecting = true;
        }
        if projecting {
            let published = bundle_configmap(&kube, "default").unwrap();
            if std::fs::read_to_string(&root_file).unwrap() != published {
                replace_file(&root_file, &published);
            }
        }
        let bundle_done = bundles
            .last()
            .is_some_and(|b| b.len() == 1 && b[0] != old_root);
        if label == "retired" && by_source.done() && by_sds.done() && bundle_done {
            break;
        }
        assert!(Instant::now() < deadline, "{}", report!());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let phases = phases.join(",");
    assert!(
        phases.starts_with("stable,announced,switched,retired"),
        "{phases}"
    );
    assert_eq!(
        new_root.as_ref(),
        Some(&rotation_state(&kube).unwrap().signing_root),
        "the root both clients were given is the one that signs now"
    );
    // The bundle stream sent the old root, both, then the new one alone,
    // and nothing that was not a change (leaf rotations are not sent).
    let new_root = new_root.unwrap();
    assert_eq!(bundles[0], std::slice::from_ref(&old_root));
    assert!(
        bundles
            .iter()
            .any(|b| b.len() == 2 && b.contains(&old_root) && b.contains(&new_root)),
        "{bundles:?}"
    );
    assert_eq!(bundles.last().unwrap(), &[new_root]);
    for pair in bundles.windows(2) {
        assert_ne!(pair[0], pair[1], "a message per change only");
    }
    bundle_reader.abort();
    sds_reader.abort();
    source.shutdown().await;
}

/// `--max-streams-per-pod` of the node-mode test.
const MAX_PER_POD: usize = 3;
const WEB_POD_UID: &str = "0f0e0d0c-1111-4222-8333-444455556666";
const DB_POD_UID: &str = "7a7b7c7d-aaaa-4bbb-8ccc-dddddddddddd";
const CONTAINER: &str = "3b1ad5e2c0f4a8b9c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4";
const OTHER_CONTAINER: &str = "abababababababababababababababababababababababababababababababab";
/// A pod whose container the kubelet reports after the container called.
const LATE_POD_UID: &str = "5e5e5e5e-2222-4333-8444-555566667777";
/// `--attestation-wait` of the node-mode test: the probes refused after
/// it end sooner than with the default, and it is longer than the late
/// container's delay.
const ATTESTATION_WAIT_SECONDS: u64 = 6;

/// Where a caller process finds its instructions (see [`caller_process`]).
const CALLER_SOCKET_ENV: &str = "MESHCA_TEST_CALLER_SOCKET";
/// `source` (an `X509Source` held open) or `probe` (one raw request).
const CALLER_MODE_ENV: &str = "MESHCA_TEST_CALLER_MODE";

/// Another process on the node's socket: node mode tells callers apart by
/// their PID's cgroups, so each pod is a process of its own (a process's
/// cgroup does not change while it runs, and the `spiffe` crate's
/// `X509Source` reconnects after its first answer, so one process cannot
/// stand for two pods). It is this test binary re-run as the ignored test
/// [`caller_process`]; the cgroup file of its PID is written before it is
/// told to connect.
struct CallerProcess {
    child: Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl CallerProcess {
    fn start(socket: &Path, mode: &str, proc_root: &Path, cgroup: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["caller_process", "--exact", "--ignored", "--nocapture"])
            .env(CALLER_SOCKET_ENV, socket)
            .env(CALLER_MODE_ENV, mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        set_cgroup(proc_root, child.id(), cgroup);
        use std::io::Write;
        writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
        let lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
        Self { child, lines }
    }

    /// The next `CALLER ` line the process printed.
    fn next(&mut self) -> String {
        for line in self.lines.by_ref() {
            if let Some(said) = line.unwrap().strip_prefix("CALLER ") {
                return said.to_string();
            }
        }
        panic!("the caller process ended without an answer");
    }

    /// Closes its stdin (it re-checks its source and exits) and returns
    /// its last line.
    fn finish(mut self) -> String {
        drop(self.child.stdin.take());
        let last = self.next();
        assert!(self.child.wait().unwrap().success());
        last
    }
}

impl Drop for CallerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Not a test on its own: the other process of
/// `node_mode_serves_each_pod_its_identity`. Waits for `go` on stdin, then
/// either holds an `X509Source` (prints `CALLER SVID <id>`, again when
/// stdin closes) or makes one raw request (prints `CALLER SVID <id>` or
/// `CALLER DENIED <code> <message>`).
#[ignore = "a helper process started by node_mode_serves_each_pod_its_identity"]
#[tokio::test]
async fn caller_process() {
    let (Some(socket), Some(mode)) = (
        std::env::var_os(CALLER_SOCKET_ENV),
        std::env::var(CALLER_MODE_ENV).ok(),
    ) else {
        panic!("run by node_mode_serves_each_pod_its_identity only");
    };
    let socket = PathBuf::from(socket);
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).unwrap();
    if mode == "source" {
        let source = x509_source(&socket).await.expect("an X509Source");
        println!("CALLER SVID {}", source.svid().unwrap().spiffe_id());
        // Until the parent closes stdin.
        let mut rest = String::new();
        let _ = tokio::task::spawn_blocking(move || std::io::stdin().read_line(&mut rest)).await;
        let id = source.svid().unwrap().spiffe_id().to_string();
        source.shutdown().await;
        println!("CALLER SVID {id}");
        return;
    }
    let mut raw = SpiffeWorkloadApiClient::new(unix_channel(&socket).await);
    let mut request = tonic::Request::new(X509svidRequest {});
    request
        .metadata_mut()
        .insert("workload.spiffe.io", "true".parse().unwrap());
    let first = match raw.fetch_x509svid(request).await {
        Err(status) => Err(status),
        Ok(mut stream) => stream.get_mut().message().await,
    };
    match first {
        Ok(Some(answer)) => println!("CALLER SVID {}", answer.svids[0].spiffe_id),
        Ok(None) => println!("CALLER ENDED"),
        Err(status) => println!("CALLER DENIED {:?} {}", status.code(), status.message()),
    }
}

#[tokio::test]
async fn node_mode_serves_each_pod_its_identity() {
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    kube.add_pod(
        "istio-system",
        "meshca-agent-pod",
        "uid-meshca-agent",
        "meshca-agent",
        "node-a",
    );
    kube.add_pod_with_containers(
        "default",
        "web-1",
        WEB_POD_UID,
        "web",
        "node-a",
        &[CONTAINER],
    );
    kube.add_pod_with_containers("default", "db-1", DB_POD_UID, "db", "node-a", &[CONTAINER]);
    let agent_token = kube.add_review_token(
        "agent-token",
        FakeUser::service_account("istio-system", "meshca-agent"),
    );
    let server = start_off_runtime(
        dir.path().join("data"),
        vec![
            "--kubeconfig".into(),
            kube.kubeconfig.display().to_string(),
            "--trusted-node-agent".into(),
            "istio-system/meshca-agent".into(),
        ],
    )
    .await;
    std::fs::write(dir.path().join("root-cert.pem"), server.root_pem()).unwrap();
    let proc_root = dir.path().join("proc");
    // This test process is the web pod's container (cgroup v2, cgroupfs
    // driver) for the whole test.
    set_cgroup(
        &proc_root,
        std::process::id(),
        &format!("0::/kubepods/burstable/pod{WEB_POD_UID}/{CONTAINER}\n"),
    );
    let socket = dir.path().join("node/agent.sock");
    let mut agent = Agent::start(
        &server,
        dir.path(),
        &agent_token,
        "agent",
        &[
            "--node-agent",
            "--node-name",
            "node-a",
            "--kubeconfig",
            &kube.kubeconfig.display().to_string(),
            "--proc-root",
            &proc_root.display().to_string(),
            "--workload-api-socket",
            &socket.display().to_string(),
            "--max-streams-per-pod",
            &MAX_PER_POD.to_string(),
            "--attestation-wait",
            &format!("{ATTESTATION_WAIT_SECONDS}s"),
        ],
    );
    agent.wait_for_socket(&socket).await;
    let web = x509_source(&socket).await.expect("the web pod's source");
    check_source(&web, WEB);

    // JWT-SVIDs in node mode: the attested pod's identity, which the agent
    // gets from the CA by impersonation, under the pod-on-node rule.
    let mut raw = SpiffeWorkloadApiClient::new(unix_channel(&socket).await);
    let mut request = tonic::Request::new(JwtsvidRequest {
        audience: vec!["vault".into()],
        spiffe_id: String::new(),
    });
    request
        .metadata_mut()
        .insert("workload.spiffe.io", "true".parse().unwrap());
    let jwt = raw
        .fetch_jwtsvid(request)
        .await
        .unwrap_or_else(|e| panic!("a JWT-SVID for the web pod: {e:?}\n{}", agent.log()));
    assert_eq!(jwt.get_ref().svids[0].spiffe_id, WEB);
    let audit = server.log();
    assert!(
        audit.lines().any(|l| l.contains("issued JWT-SVID")
            && l.contains("caller=spiffe://cluster.local/ns/istio-system/sa/meshca-agent")
            && l.contains(&format!("identity={WEB}"))),
        "{audit}"
    );

    // The db pod's process, in the systemd driver's form (cgroup v1 lines),
    // holding its own source while the web pod holds its one.
    let systemd_uid = DB_POD_UID.replace('-', "_");
    let db_cgroup = format!(
        "12:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{systemd_uid}.slice/cri-containerd-{CONTAINER}.scope\n\
         1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{systemd_uid}.slice/cri-containerd-{CONTAINER}.scope\n"
    );
    let db = tokio::task::spawn_blocking({
        let (socket, proc_root, db_cgroup) = (socket.clone(), proc_root.clone(), db_cgroup.clone());
        move || {
            let mut db = CallerProcess::start(&socket, "source", &proc_root, &db_cgroup);
            let first = db.next();
            (db, first)
        }
    })
    .await
    .unwrap();
    assert_eq!(db.1, format!("SVID {DB}"), "{}", agent.log());
    check_source(&web, WEB);

    // A container that calls before the kubelet reports it (its pod is
    // listed, its ID not yet) waits, and gets its identity once reported:
    // here 3 s later.
    kube.add_pod_with_containers("default", "late-1", LATE_POD_UID, "late", "node-a", &[]);
    let late = tokio::task::spawn_blocking({
        let (socket, proc_root) = (socket.clone(), proc_root.clone());
        move || {
            let cgroup = format!("0::/kubepods/pod{LATE_POD_UID}/{CONTAINER}\n");
            CallerProcess::start(&socket, "probe", &proc_root, &cgroup).finish()
        }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !late.is_finished(),
        "the late container waits for its status"
    );
    kube.add_pod_with_containers(
        "default",
        "late-1",
        LATE_POD_UID,
        "late",
        "node-a",
        &[CONTAINER],
    );
    assert_eq!(
        late.await.unwrap(),
        "SVID spiffe://cluster.local/ns/default/sa/late",
        "{}",
        agent.log()
    );

    // A caller that is not in a pod, one whose pod is not on this node, and
    // one in a cgroup named after the web pod but with a container the
    // pod's status does not list.
    for (cgroup, needle) in [
        (
            format!("0::/kubepods/burstable/pod{WEB_POD_UID}/{OTHER_CONTAINER}\n"),
            "is not a container of pod default/web-1",
        ),
        (
            "0::/user.slice/user-1000.slice/session-1.scope\n".to_string(),
            "not run in a Kubernetes pod",
        ),
        (
            format!("0::/kubepods/pod99999999-9999-4999-8999-999999999999/{CONTAINER}\n"),
            "is not a pod of node node-a",
        ),
    ] {
        let (socket, proc_root) = (socket.clone(), proc_root.clone());
        let answer = tokio::task::spawn_blocking(move || {
            CallerProcess::start(&socket, "probe", &proc_root, &cgroup).finish()
        })
        .await
        .unwrap();
        assert!(
            answer.starts_with("DENIED PermissionDenied") && answer.contains(needle),
            "{answer}"
        );
    }
    // Both pods' sources still hold their own identities.
    check_source(&web, WEB);

    // The web pod opens streams until its per-pod limit refuses one.
    let raw = unix_channel(&socket).await;
    let mut held = Vec::new();
    let refused = loop {
        // The source holds one or two streams of the pod's, or none for
        // a moment between them: at most MAX_PER_POD more are taken.
        assert!(
            held.len() <= MAX_PER_POD,
            "no per-pod limit: {} streams",
            held.len()
        );
        let mut request = tonic::Request::new(X509svidRequest {});
        request
            .metadata_mut()
            .insert("workload.spiffe.io", "true".parse().unwrap());
        match SpiffeWorkloadApiClient::new(raw.clone())
            .fetch_x509svid(request)
            .await
        {
            Ok(mut stream) => match stream.get_mut().message().await {
                Ok(_) => held.push(stream),
                Err(status) => break status,
            },
            Err(status) => break status,
        }
    };
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains(WEB_POD_UID)
            && refused.message().contains("--max-streams-per-pod"),
        "{refused:?}"
    );
    // Its connections too: it holds two or three (`raw`, the source's,
    // and maybe an earlier one of the source's, until its idle timeout);
    // of two more, the second is closed at once whatever the count.
    let _third = UnixStream::connect(&socket).await.unwrap();
    let mut fourth = UnixStream::connect(&socket).await.unwrap();
    // It is told why (an HTTP/2 GOAWAY, ENHANCE_YOUR_CALM, whose debug
    // text names the pod and the flag), then closed.
    let mut told = Vec::new();
    let read = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::io::AsyncReadExt::read_to_end(&mut fourth, &mut told),
    )
    .await
    .expect("the pod's extra connection is closed");
    assert!(read.is_ok(), "{read:?}");
    let told = String::from_utf8_lossy(&told);
    assert!(
        told.contains(WEB_POD_UID) && told.contains("--max-streams-per-pod"),
        "{told:?}"
    );
    // A gRPC client refused so (it sends its preface at once, unread by the
    // agent) fails its call at once instead of hanging (tonic reports the
    // closed connection; the GOAWAY's text is for clients that log it).
    let outcome = tokio::time::timeout(Duration::from_secs(20), async {
        let socket = socket.clone();
        let channel =
            Endpoint::from_static("http://localhost")
                .connect_with_connector(tower::service_fn(move |_| {
                    let socket = socket.clone();
                    async move {
                        Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?))
                    }
                }))
                .await
                .map_err(|e| format!("connect: {e:?}"))?;
        let mut request = tonic::Request::new(X509svidRequest {});
        request
            .metadata_mut()
            .insert("workload.spiffe.io", "true".parse().unwrap());
        SpiffeWorkloadApiClient::new(channel)
            .fetch_x509svid(request)
            .await
            .map(|_| ())
            .map_err(|status| format!("{status:?}"))
    })
    .await;
    assert!(
        matches!(outcome, Ok(Err(_))),
        "the refused client's call: {outcome:?}"
    );
    // Another pod of the node is not locked out meanwhile.
    let db_probe = {
        let (socket, proc_root, cgroup) = (socket.clone(), proc_root.clone(), db_cgroup.clone());
        tokio::task::spawn_blocking(move || {
            CallerProcess::start(&socket, "probe", &proc_root, &cgroup).finish()
        })
        .await
        .unwrap()
    };
    assert_eq!(db_probe, format!("SVID {DB}"), "{}", agent.log());
    assert!(
        agent.log().contains("the pod holds its most"),
        "{}",
        agent.log()
    );
    drop(held);

    let last = tokio::task::spawn_blocking(move || db.0.finish())
        .await
        .unwrap();
    assert_eq!(last, format!("SVID {DB}"));
    web.shutdown().await;
    assert!(
        server.log().contains("meshca-agent"),
        "the CA issued to the node agent:\n{}",
        server.log()
    );
}

#[test]
fn agent_manifests_name_real_flags() {
    let help = Command::new(&binaries().meshca_agent)
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kustomize");
    let mut checked = 0;
    for dir in ["agent-pod", "agent-node"] {
        for entry in std::fs::read_dir(deploy.join(dir)).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            for line in text.lines() {
                let Some(name) = line.trim().strip_prefix("- name: MESHCA_") else {
                    continue;
                };
                let env = format!("MESHCA_{name}");
                assert!(
                    help.contains(&format!("[env: {env}=")),
                    "{dir}: {env} is not a flag of meshca-agent"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "{checked} variables checked");
}

/// The resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// An HTTP/2 frame.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut out = vec![len[1], len[2], len[3], kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// A hostile pod on a node agent, at its limits: 64 connections each
/// parking a header block of about 48 KiB (a socket path as `:authority`,
/// as Python's grpcio sends, and CONTINUATION frames without END_HEADERS),
/// then 64 connections that send nothing. The pod's buffer budget closes
/// the connections past it, the agent's memory stays bounded, a
/// well-behaved pod gets its SVID meanwhile, each kind of refusal is one
/// log line with an exact total, and the memory is given back after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_pod_at_its_limits_costs_the_node_agent_a_bounded_amount() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    kube.add_pod(
        "istio-system",
        "meshca-agent-pod",
        "uid-meshca-agent",
        "meshca-agent",
        "node-a",
    );
    kube.add_pod_with_containers(
        "default",
        "web-1",
        WEB_POD_UID,
        "web",
        "node-a",
        &[CONTAINER],
    );
    kube.add_pod_with_containers("default", "db-1", DB_POD_UID, "db", "node-a", &[CONTAINER]);
    let agent_token = kube.add_review_token(
        "agent-token",
        FakeUser::service_account("istio-system", "meshca-agent"),
    );
    let server = start_off_runtime(
        dir.path().join("data"),
        vec![
            "--kubeconfig".into(),
            kube.kubeconfig.display().to_string(),
            "--trusted-node-agent".into(),
            "istio-system/meshca-agent".into(),
        ],
    )
    .await;
    std::fs::write(dir.path().join("root-cert.pem"), server.root_pem()).unwrap();
    let proc_root = dir.path().join("proc");
    // This test process is the hostile web pod.
    set_cgroup(
        &proc_root,
        std::process::id(),
        &format!("0::/kubepods/pod{WEB_POD_UID}/{CONTAINER}\n"),
    );
    let socket = dir.path().join("node/agent.sock");
    let mut agent = Agent::start(
        &server,
        dir.path(),
        &agent_token,
        "agent",
        &[
            "--node-agent",
            "--node-name",
            "node-a",
            "--kubeconfig",
            &kube.kubeconfig.display().to_string(),
            "--proc-root",
            &proc_root.display().to_string(),
            "--workload-api-socket",
            &socket.display().to_string(),
        ],
    );
    agent.wait_for_socket(&socket).await;
    let db_cgroup = format!("0::/kubepods/pod{DB_POD_UID}/{CONTAINER}\n");
    let probe = |socket: PathBuf, proc_root: PathBuf, cgroup: String| {
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let said = CallerProcess::start(&socket, "probe", &proc_root, &cgroup).finish();
            (said, started.elapsed())
        })
    };
    let (said, _) = probe(socket.clone(), proc_root.clone(), db_cgroup.clone())
        .await
        .unwrap();
    assert_eq!(said, format!("SVID {DB}"));
    let pid = agent.child.id();
    let start_kib = rss_kib(pid);

    // A parked block: HEADERS and two CONTINUATIONs of 16 KiB, no END_HEADERS.
    let mut block = vec![0x00, 10];
    block.extend_from_slice(b":authority");
    block.extend_from_slice(&[16]);
    block.extend_from_slice(b"tmp%2Fagent.sock");
    let mut parked = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    parked.extend(h2_frame(0x4, 0, 0, &[]));
    parked.extend(h2_frame(0x1, 0, 1, &block));
    for _ in 0..3 {
        // Literal values that never end: what follows is the value.
        parked.extend(h2_frame(0x9, 0, 1, &[0x40; 16 * 1024]));
    }
    let mut hostile = Vec::new();
    for _ in 0..64 {
        let mut c = UnixStream::connect(&socket).await.unwrap();
        // A connection closed at once may refuse the write: that is a refusal too.
        let _ = c.write_all(&parked).await;
        hostile.push(c);
    }
    // Each connection either is closed (its pod's budget is full) or holds
    // its block: wait until every one answered or parked (read the
    // server's SETTINGS first; a closed one reads to its end).
    let mut closed = 0;
    for c in &mut hostile {
        let mut buf = vec![0u8; 64 * 1024];
        // The agent's SETTINGS (and WINDOW_UPDATE) come first in any case.
        let _ = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf)).await;
    }
    // Ask the agent for the cut-off lines once the burst is through.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !agent
        .log()
        .contains("holds its most bytes in the agent's buffers")
    {
        assert!(
            Instant::now() < deadline,
            "no budget refusal:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for c in &mut hostile {
        let mut buf = [0u8; 4096];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(200), c.read(&mut buf)).await
        {
            closed += 1;
        }
    }
    let attacked_kib = rss_kib(pid);
    eprintln!("agent RSS: {start_kib} KiB before, {attacked_kib} KiB with 64 parked blocks; {closed} of 64 closed");
    // The budget (1 MiB) parks about 21 blocks of 48 KiB; the rest are closed.
    assert!(closed >= 30, "{closed} of 64 parked connections closed");
    assert!(
        attacked_kib < start_kib + 8 * 1024,
        "RSS {start_kib} KiB before, {attacked_kib} KiB with the pod at its limits"
    );
    // The well-behaved pod is served meanwhile, promptly.
    let (said, took) = probe(socket.clone(), proc_root.clone(), db_cgroup.clone())
        .await
        .unwrap();
    assert_eq!(said, format!("SVID {DB}"), "{}", agent.log());
    assert!(took < Duration::from_secs(5), "{took:?}");
    eprintln!("the well-behaved pod's SVID during the attack: {took:?} (a process started and its request)");

    // Silent connections: closed after the first-request timeout, one
    // line for all of them, with the exact total.
    drop(hostile);
    let mut silent = Vec::new();
    for _ in 0..64 {
        silent.push(UnixStream::connect(&socket).await.unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut open = 0;
        for c in &mut silent {
            let mut buf = [0u8; 1024];
            match tokio::time::timeout(Duration::from_millis(10), c.read(&mut buf)).await {
                Ok(Ok(0) | Err(_)) => {}
                _ => open += 1,
            }
        }
        if open == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{open} silent connections still open"
        );
    }
    drop(silent);
    let log = agent.log();
    let no_request_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("sent no request in time"))
        .collect();
    assert_eq!(no_request_lines.len(), 1, "{log}");
    let budget_lines = log
        .lines()
        .filter(|l| l.contains("holds its most bytes in the agent's buffers"))
        .count();
    assert_eq!(budget_lines, 1, "one line per 10 s:\n{log}");

    // The memory of the burst is given back (the heap is trimmed within
    // 5 s of the burst's end).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now_kib = rss_kib(pid);
        if now_kib <= start_kib + 8 * 1024 {
            eprintln!("agent RSS after the attack: {now_kib} KiB");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "RSS {start_kib} KiB before, {now_kib} KiB after the attack"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
