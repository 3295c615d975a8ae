//! Who gets which identity: [`CallerPolicy`] (pod mode: the configured
//! identity for every caller; node mode: the caller's pod's service account)
//! and the stream limits every stream passes: the socket's, and in node
//! mode its pod's.

use std::sync::Arc;
use std::time::Duration;

use meshca_certs::{SpiffeId, TrustDomain};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tonic::{Request, Status};

use super::attest::PodUidLookup;
use super::feeds::{Feed, Feeds};
use super::node_pods::NodePods;
use super::per_pod::{PerPodLimit, PodSlot};
use super::socket::CallerInfo;

/// How long node mode waits for a caller's pod to appear in the watch
/// before refusing it (a container may call before its pod's event).
pub(crate) const POD_APPEAR_WAIT: Duration = Duration::from_secs(2);

/// Which identity a caller gets.
#[derive(Debug, Clone)]
pub enum CallerPolicy {
    /// Pod mode: every caller on the socket gets this identity.
    Pod(SpiffeId),
    /// Node mode: each caller gets its pod's service-account identity.
    Node {
        /// The trust domain of the identities.
        trust_domain: TrustDomain,
        /// This node's pods.
        pods: Arc<NodePods>,
    },
}

/// What every service shares: the policy, the feeds and the stream limits.
#[derive(Debug)]
pub struct Callers {
    policy: CallerPolicy,
    feeds: Arc<Feeds>,
    streams: Arc<Semaphore>,
    max_streams: usize,
    /// Node mode: streams per pod.
    per_pod: Option<Arc<PerPodLimit>>,
    /// Turns true when the agent stops: every stream ends.
    closing: watch::Sender<bool>,
}

/// A stream's hold on its identity's feed and on a stream slot; dropping
/// it (the stream closed) frees both.
#[derive(Debug)]
pub(crate) struct StreamLease {
    /// The feed of the caller's identity.
    pub(crate) feed: Arc<Feed>,
    /// Turns true when the agent stops; the stream then ends with
    /// `UNAVAILABLE`.
    pub(crate) closing: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
    _pod_slot: Option<PodSlot>,
}

/// The status a stream ends with when the agent stops.
pub(crate) fn shutting_down() -> Status {
    Status::unavailable("meshca-agent is shutting down; reconnect to its successor")
}

impl StreamLease {
    /// Completes when the agent stops.
    pub(crate) async fn stopped(&mut self) {
        // A dropped sender (the callers are gone) is a stop too.
        let _ = self.closing.wait_for(|stop| *stop).await;
    }
}

impl Callers {
    /// Serves `policy`'s identities from `feeds`, at most `max_streams`
    /// streams at once and, in node mode, at most `max_streams_per_pod`
    /// of them for one pod (pod mode has one pod: `max_streams` is its
    /// limit).
    pub fn new(
        policy: CallerPolicy,
        feeds: Arc<Feeds>,
        max_streams: usize,
        max_streams_per_pod: usize,
    ) -> Arc<Self> {
        let per_pod = match policy {
            CallerPolicy::Node { .. } => Some(PerPodLimit::new(max_streams_per_pod)),
            CallerPolicy::Pod(_) => None,
        };
        Arc::new(Self {
            policy,
            feeds,
            streams: Arc::new(Semaphore::new(max_streams)),
            max_streams,
            per_pod,
            closing: watch::Sender::new(false),
        })
    }

    /// Ends every open stream (`UNAVAILABLE`) and refuses new ones: the
    /// agent is stopping.
    pub(crate) fn close(&self) {
        self.closing.send_replace(true);
    }

    /// The identity of the caller of `request`: `PERMISSION_DENIED` for a
    /// caller with none, `UNAVAILABLE` while node mode has not listed the
    /// node's pods yet.
    pub(crate) async fn identity_of<T>(&self, request: &Request<T>) -> Result<SpiffeId, Status> {
        let caller = request.extensions().get::<CallerInfo>();
        match &self.policy {
            CallerPolicy::Pod(identity) => Ok(identity.clone()),
            CallerPolicy::Node { trust_domain, pods } => {
                let caller = caller.ok_or_else(|| {
                    Status::permission_denied("the caller's process could not be identified")
                })?;
                let pid = caller.pid.unwrap_or_default();
                let lookup = caller.pod_uid.as_deref().unwrap_or(&PodUidLookup::NoPid);
                let uid = match lookup {
                    PodUidLookup::Pod { uid, .. } => uid,
                    PodUidLookup::NotInPod => {
                        tracing::info!(pid, "refused a caller that is not in a pod");
                        return Err(Status::permission_denied(format!(
                            "process {pid} does not run in a Kubernetes pod"
                        )));
                    }
                    PodUidLookup::NoPid => {
                        return Err(Status::permission_denied(
                            "the socket's peer credentials carry no process ID",
                        ))
                    }
                    PodUidLookup::Ambiguous(why) | PodUidLookup::Unreadable(why) => {
                        tracing::info!(pid, reason = %why, "refused a caller whose pod is unclear");
                        return Err(Status::permission_denied(format!(
                            "cannot tell the pod of process {pid}: {why}"
                        )));
                    }
                };
                if !pods.is_synced() {
                    return Err(Status::unavailable(
                        "this node's pods are not listed from the Kubernetes API yet; retry shortly",
                    ));
                }
                let pod = pods.wait_for(uid, POD_APPEAR_WAIT).await.ok_or_else(|| {
                    tracing::info!(pid, pod_uid = %uid, node = %pods.node(), "refused a caller whose pod is unknown");
                    Status::permission_denied(format!(
                        "pod {uid} of process {pid} is not a pod of node {}",
                        pods.node()
                    ))
                })?;
                SpiffeId::for_workload(trust_domain, &pod.namespace, &pod.service_account).map_err(
                    |e| {
                        Status::permission_denied(format!(
                            "pod {}/{}: no SPIFFE ID for its service account: {e}",
                            pod.namespace, pod.name
                        ))
                    },
                )
            }
        }
    }

    /// A stream slot (and in node mode one of the caller's pod) and the
    /// feed of `identity` for the stream `request` opens, or
    /// `RESOURCE_EXHAUSTED` when `max_streams` streams are open, or the
    /// caller's pod holds its most.
    pub(crate) fn lease<T>(
        &self,
        request: &Request<T>,
        identity: &SpiffeId,
    ) -> Result<StreamLease, Status> {
        if *self.closing.borrow() {
            return Err(shutting_down());
        }
        let pod_slot = match (&self.per_pod, caller_key(request)) {
            (Some(per_pod), Some(key)) => Some(per_pod.try_take(&key).ok_or_else(|| {
                if let Some(refused) = per_pod.refusals_to_log() {
                    tracing::warn!(identity = %identity, caller = %key, max_streams_per_pod = per_pod.max(), refused, "refused streams: the pod holds its most streams");
                }
                Status::resource_exhausted(format!(
                    "{key} has {} streams open, the most one pod may have on this agent (--max-streams-per-pod); close some",
                    per_pod.max()
                ))
            })?),
            _ => None,
        };
        let slot = self.streams.clone().try_acquire_owned().map_err(|_| {
            tracing::warn!(identity = %identity, max_streams = self.max_streams, "refused a stream: the stream limit is reached");
            Status::resource_exhausted(format!(
                "{} streams are open, the most this agent serves (--max-streams)",
                self.max_streams
            ))
        })?;
        Ok(StreamLease {
            feed: self.feeds.get(identity),
            closing: self.closing.subscribe(),
            _slot: slot,
            _pod_slot: pod_slot,
        })
    }
}

/// Whom the per-pod limits count the caller of `request` as.
fn caller_key<T>(request: &Request<T>) -> Option<super::per_pod::PodKey> {
    request.extensions().get::<CallerInfo>()?.pod_key()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::feeds::tests::{id, setup};
    use super::*;

    /// A request from a caller whose pod lookup found `lookup`.
    fn request_from(lookup: PodUidLookup) -> Request<()> {
        let mut request = Request::new(());
        request.extensions_mut().insert(CallerInfo {
            pid: Some(7),
            uid: Some(1000),
            pod_uid: Some(Arc::new(lookup)),
        });
        request
    }

    fn in_pod(uid: &str) -> PodUidLookup {
        PodUidLookup::Pod {
            uid: uid.to_string(),
            container: "c".to_string(),
        }
    }

    #[tokio::test]
    async fn in_node_mode_one_pod_holds_at_most_its_streams() {
        let (_issuer, feeds, _bundle) = setup(Duration::from_secs(3600));
        let policy = CallerPolicy::Node {
            trust_domain: TrustDomain::new("cluster.local").unwrap(),
            pods: NodePods::new("node-a"),
        };
        let callers = Callers::new(policy, feeds, 16, 2);
        let web = id("web");
        let first = callers.lease(&request_from(in_pod("a")), &web).unwrap();
        let _second = callers.lease(&request_from(in_pod("a")), &web).unwrap();
        let refused = callers.lease(&request_from(in_pod("a")), &web).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(
            refused.message().contains("pod a")
                && refused.message().contains("--max-streams-per-pod"),
            "{refused:?}"
        );
        // Another pod of the node still gets its streams.
        let _other = callers.lease(&request_from(in_pod("b")), &web).unwrap();
        // A stream closed gives the pod its place back.
        drop(first);
        assert!(callers.lease(&request_from(in_pod("a")), &web).is_ok());
    }

    #[tokio::test]
    async fn in_pod_mode_only_the_socket_limit_counts() {
        let (_issuer, feeds, _bundle) = setup(Duration::from_secs(3600));
        let callers = Callers::new(CallerPolicy::Pod(id("web")), feeds, 3, 1);
        let leases: Vec<_> = (0..3)
            .map(|_| callers.lease(&request_from(in_pod("a")), &id("web")))
            .collect();
        assert!(leases.iter().all(Result::is_ok), "one pod: --max-streams");
        let refused = callers
            .lease(&request_from(in_pod("a")), &id("web"))
            .unwrap_err();
        assert!(refused.message().contains("--max-streams)"), "{refused:?}");
    }
}
