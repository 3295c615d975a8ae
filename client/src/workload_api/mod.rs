//! The agent's Unix socket: the SPIFFE Workload API and Envoy SDS, the
//! socket SPIRE's agent serves and that Istio's agent uses when it finds
//! one at `/var/run/secrets/workload-spiffe-uds/socket`.
//!
//! - `socket`: binding the socket ([`bind`]), accepting connections with
//!   the caller's peer credentials;
//! - `attest`: node mode's cgroup reading (PID to pod UID);
//! - `node_pods`: node mode's watch of this node's pods ([`NodePods`],
//!   [`watch_node_pods`]);
//! - `callers`: who gets which identity ([`Callers`], [`CallerPolicy`]),
//!   and the stream limit;
//! - `feeds`: one [`Feed`] of `credentials::Credentials` per identity over
//!   the [`CertManager`](crate::CertManager) ([`Feeds`]);
//! - `spiffe_api` and `sds`: the two gRPC services.
//!
//! The submodules are private: the agent uses only what is re-exported here.
//!
//! Every stream holds a stream slot (at most [`WorkloadApiConfig::max_streams`])
//! and its identity's feed; it sends the current credentials as soon as
//! there are any and again on each change, holding at most one response
//! while the client reads (HTTP/2 flow control bounds the rest). Closing a
//! stream frees its slot, and the last stream of an identity frees its
//! feed. Connections are bounded by the same number.

mod attest;
mod callers;
mod credentials;
mod feeds;
mod node_pods;
mod sds;
mod socket;
mod spiffe_api;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::SecretDiscoveryServiceServer;
use meshca_certs::TrustBundle;
use meshca_proto::spiffe_workload::spiffe_workload_api_server::SpiffeWorkloadApiServer;
use tokio::net::UnixListener;
use tokio::sync::watch;

use crate::caclient::CaClient;
pub use callers::{CallerPolicy, Callers};
pub use feeds::{Feed, Feeds};
pub use node_pods::{watch_node_pods, NodePods};
pub use socket::{bind, SocketError};

/// Default most streams open at once (and most connections).
pub const DEFAULT_MAX_STREAMS: usize = 4096;
/// Default interval between checks of the `--root-cert` file for a new
/// bundle, as the agent's `--bundle-refresh` flag reads it.
pub const DEFAULT_BUNDLE_REFRESH: &str = "10s";
/// HTTP/2 streams per connection (a SPIFFE library or Envoy opens a few).
pub(crate) const MAX_STREAMS_PER_CONNECTION: u32 = 128;

/// How the socket serves.
#[derive(Debug, Clone)]
pub struct WorkloadApiConfig {
    /// The socket path.
    pub socket: PathBuf,
    /// Most streams open at once; also the most connections.
    pub max_streams: usize,
    /// Node mode: where `<pid>/cgroup` files are (normally `/proc`).
    pub proc_root: Option<PathBuf>,
}

/// Errors of the socket server.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadApiError {
    /// The socket could not be set up.
    #[error(transparent)]
    Socket(#[from] SocketError),
    /// The gRPC server failed.
    #[error("serving the Workload API socket: {}", meshca_certs::error_chain(.0))]
    Serve(tonic::transport::Error),
}

impl From<tonic::transport::Error> for WorkloadApiError {
    fn from(e: tonic::transport::Error) -> Self {
        Self::Serve(e)
    }
}

/// Serves both APIs on `listener` (from [`bind`]) until `shutdown`
/// completes.
pub async fn serve(
    listener: UnixListener,
    config: &WorkloadApiConfig,
    callers: Arc<Callers>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), WorkloadApiError> {
    let incoming = socket::accept_callers(listener, config.max_streams, config.proc_root.clone());
    tonic::transport::Server::builder()
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .http2_keepalive_interval(Some(Duration::from_secs(60)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(SpiffeWorkloadApiServer::new(
            spiffe_api::WorkloadApiService::new(callers.clone()),
        ))
        .add_service(SecretDiscoveryServiceServer::new(sds::SdsService::new(
            callers,
        )))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

/// The `--root-cert` file's bundle, re-read every `interval` (the client
/// re-reads it when its modification time or size changed); the receiver
/// sees each new bundle.
pub fn watch_root_file(client: CaClient, interval: Duration) -> watch::Receiver<TrustBundle> {
    let (tx, rx) = watch::channel(client.bundle());
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = tx.closed() => return,
            }
            let bundle = client.bundle();
            tx.send_if_modified(|current| {
                if *current == bundle {
                    return false;
                }
                tracing::info!(
                    roots = bundle.roots().len(),
                    "the --root-cert bundle changed"
                );
                *current = bundle;
                true
            });
        }
    });
    rx
}
