//! An SDS nonce/NACK storm against a real `meshca-agent`: one stream has
//! at most `MAX_SDS_REQUESTS_PER_SECOND` requests read a second, the rest
//! wait (on the stream's flow-control window) for the next second, so a
//! storming client is not served on the node's CPU; another stream of the
//! same agent is answered meanwhile.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use meshca_client::workload_api::MAX_SDS_REQUESTS_PER_SECOND;
use meshca_tests::agent_process::{unix_channel, Agent};
use meshca_tests::*;

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";
const SECRET_TYPE: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

fn request(names: &[&str], nonce: &str, nack: bool) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: String::new(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        type_url: SECRET_TYPE.to_string(),
        response_nonce: nonce.to_string(),
        error_detail: nack.then(|| RpcStatus {
            code: tonic::Code::InvalidArgument as i32,
            message: "storm".into(),
            details: Vec::new(),
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_storming_sds_stream_is_read_at_its_rate_and_another_is_served() {
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
        &["--spiffe-id", WEB, "--workload-api-socket", &socket_arg],
    );
    agent.wait_for_socket(&socket).await;
    let mut client = SecretDiscoveryServiceClient::new(unix_channel(&socket).await);
    // The agent holds its certificate (a unary fetch answers), so the
    // storming stream's first answer is not a wait for the CA.
    let fetched = client
        .fetch_secrets(request(&["default"], "", false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fetched.resources.len(), 1);

    // The storming stream: its first answer, then three seconds' worth of
    // stale nonces and NACKs, then a change of names.
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    tx.send(request(&["default"], "", false)).await.unwrap();
    let mut answers = client
        .stream_secrets(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let first = answers.message().await.unwrap().unwrap();
    let storm = 3 * MAX_SDS_REQUESTS_PER_SECOND;
    let started = Instant::now();
    for n in 0..storm {
        let r = if n.is_multiple_of(2) {
            request(&["default"], &format!("stale-{n}"), false)
        } else {
            request(&["default"], &first.nonce, true)
        };
        tx.send(r).await.unwrap();
    }
    tx.send(request(&["default", "ROOTCA"], &first.nonce, false))
        .await
        .unwrap();

    // Meanwhile another stream of the same agent is answered at once
    // (well before the storm's requests are read).
    let (other_tx, other_rx) = tokio::sync::mpsc::channel(4);
    other_tx
        .send(request(&["default"], "", false))
        .await
        .unwrap();
    let mut other = client
        .stream_secrets(tokio_stream::wrappers::ReceiverStream::new(other_rx))
        .await
        .unwrap()
        .into_inner();
    let other_first = other.message().await.unwrap().unwrap();
    assert_eq!(other_first.resources.len(), 1);
    let other_took = started.elapsed();

    // The change of names is answered only once the storm before it has
    // been read: with the first request, `storm` + 2 requests at
    // `MAX_SDS_REQUESTS_PER_SECOND` a second need at least two full
    // seconds of waiting.
    let changed = answers.message().await.unwrap().unwrap();
    let took = started.elapsed();
    assert_eq!(changed.resources.len(), 2, "default and ROOTCA");
    assert!(
        took >= Duration::from_secs(2),
        "{storm} storm requests read in {took:?}:\n{}",
        agent.log()
    );
    assert!(
        other_took < took,
        "the other stream waited for the storm: {other_took:?} vs {took:?}"
    );
    // Nothing else was answered on the storming stream: stale nonces and
    // NACKs of the same names are not answers.
    assert_ne!(changed.nonce, first.nonce);
    drop(tx);
    drop(other_tx);
}
