//! Who gets which identity: [`CallerPolicy`] (pod mode: the configured
//! identity for every caller; node mode: the caller's pod's service account)
//! and the stream limits every stream passes: the socket's, and in node
//! mode its pod's.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshca_certs::{SpiffeId, TrustDomain};
use meshca_serve::rate_limited_log::RateLimitedLog;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use tonic::{Request, Status};

use super::attest::PodUidLookup;
use super::feeds::{Feed, Feeds};
use super::node_pods::{NodePod, NodePods};
use super::per_pod::{
    Admission, BufferCharge, OverBudget, PerPodBytes, PerPodLimit, PerPodLimits, PodKey, PodSlot,
    StreamCharge, MAX_BUFFERED_BYTES_PER_POD,
};
use super::socket::CallerInfo;

/// Default of how long node mode waits for a caller's pod, and its
/// container in the pod's status, to appear in the pod watch before
/// refusing it (`--attestation-wait`). A container calls the agent as soon
/// as it starts, and the kubelet reports the container's ID a while later:
/// about a second on a quiet node, several when a node restarts all its
/// pods at once. 30 s, like SPIRE's Kubernetes workload attestor (60 polls
/// 500 ms apart).
pub const DEFAULT_ATTESTATION_WAIT: Duration = Duration::from_secs(30);
/// Node mode: the most requests waiting at once for their pod to appear in
/// the watch (each for up to its `attestation_wait`); one more is told to
/// retry (`UNAVAILABLE`). A made-up pod UID waits too, so this is bounded.
pub(crate) const MAX_POD_APPEAR_WAITERS: usize = 256;
/// Node mode: the most of those waiting requests one pod may have (every
/// caller not attested to a listed pod counting as one pod, as for the
/// per-pod limits), so that one caller whose container is never reported
/// cannot hold every place for the whole wait.
pub(crate) const MAX_POD_APPEAR_WAITERS_PER_POD: usize = 16;

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
        /// How long a caller whose pod, or container, is not in the pod
        /// watch yet waits for it ([`DEFAULT_ATTESTATION_WAIT`]).
        attestation_wait: Duration,
    },
}

/// What every service shares: the policy, the feeds and the stream limits.
#[derive(Debug)]
pub struct Callers {
    policy: CallerPolicy,
    feeds: Arc<Feeds>,
    streams: Arc<Semaphore>,
    max_streams: usize,
    /// Node mode: connections and streams per pod.
    per_pod: Option<PerPodLimits>,
    /// Node mode: requests waiting for their pod to appear, in all and
    /// per pod.
    pod_waiters: Semaphore,
    pod_waiters_per_pod: Arc<PerPodLimit>,
    /// Log lines of callers refused an identity (node mode), and of
    /// streams refused at `max_streams`: one per interval, as any local
    /// process can repeat them at will.
    identity_refusals: RateLimitedLog,
    stream_limit_refusals: RateLimitedLog,
    /// Node mode: the bytes each pod's connections hold in the agent's
    /// buffers ([`MAX_BUFFERED_BYTES_PER_POD`]).
    buffers: Option<Arc<PerPodBytes>>,
    /// Log lines (and exact counts) of connections closed for sending no
    /// request in time, and of connections and streams cut off at their
    /// pod's buffer budget.
    pub(crate) no_request_closures: RateLimitedLog,
    pub(crate) buffer_refusals: RateLimitedLog,
    /// Turns true when the agent stops: every stream ends.
    closing: watch::Sender<bool>,
}

/// A stream's hold on its identity's feed; dropping it (the stream
/// closed) lets the feed go when no other stream holds it.
#[derive(Debug)]
pub(crate) struct StreamLease {
    /// The feed of the caller's identity.
    pub(crate) feed: Arc<Feed>,
    /// Turns true when the agent stops; the stream then ends with
    /// `UNAVAILABLE`.
    pub(crate) closing: watch::Receiver<bool>,
}

impl Drop for StreamLease {
    fn drop(&mut self) {
        self.feed.linger();
    }
}

/// A request's place among the socket's streams (`--max-streams`) and, in
/// node mode, its pod's (`--max-streams-per-pod`), from its HEADERS until
/// its answer ends; dropping it frees both. Taken before the request's
/// message is read, so the requests whose messages are being read are
/// bounded too.
#[derive(Debug)]
pub(crate) struct StreamSlot {
    _slot: OwnedSemaphorePermit,
    pod_place: PodPlace,
}

impl StreamSlot {
    /// The stream's pod place, for the request's extensions: the request
    /// handler moves it to the caller's pod once the caller is attested.
    pub(crate) fn pod_place(&self) -> PodPlace {
        self.pod_place.clone()
    }
}

/// A stream's place among its pod's (node mode; `None` in pod mode),
/// shared between the stream's [`StreamSlot`] and its request.
#[derive(Debug, Clone)]
pub(crate) struct PodPlace(Arc<Mutex<Option<PodSlot>>>);

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
    /// connections and as many streams for one pod (pod mode has one pod:
    /// `max_streams` is its limit, and `max_streams_per_pod` is unused).
    pub fn new(
        policy: CallerPolicy,
        feeds: Arc<Feeds>,
        max_streams: usize,
        max_streams_per_pod: usize,
    ) -> Arc<Self> {
        let per_pod = match policy {
            CallerPolicy::Node { .. } => Some(PerPodLimits::new(max_streams_per_pod)),
            CallerPolicy::Pod(_) => None,
        };
        let buffers = per_pod
            .is_some()
            .then(|| PerPodBytes::new(MAX_BUFFERED_BYTES_PER_POD));
        Arc::new(Self {
            policy,
            feeds,
            streams: Arc::new(Semaphore::new(max_streams)),
            max_streams,
            per_pod,
            pod_waiters: Semaphore::new(MAX_POD_APPEAR_WAITERS),
            pod_waiters_per_pod: PerPodLimit::new(MAX_POD_APPEAR_WAITERS_PER_POD),
            identity_refusals: RateLimitedLog::default(),
            stream_limit_refusals: RateLimitedLog::default(),
            buffers,
            no_request_closures: RateLimitedLog::default(),
            buffer_refusals: RateLimitedLog::default(),
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
            CallerPolicy::Node {
                trust_domain,
                pods,
                attestation_wait,
            } => {
                let caller = caller.ok_or_else(|| {
                    Status::permission_denied("the caller's process could not be identified")
                })?;
                let pid = caller.pid.unwrap_or_default();
                let lookup = caller.pod_uid.as_deref().unwrap_or(&PodUidLookup::NoPid);
                let (uid, container) = match lookup {
                    PodUidLookup::Pod { uid, container } => (uid, container),
                    PodUidLookup::NotInPod => {
                        if let Some(unlogged) = self.identity_refusals.record() {
                            tracing::info!(pid, unlogged, "refused a caller that is not in a pod");
                        }
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
                        if let Some(unlogged) = self.identity_refusals.record() {
                            tracing::info!(pid, reason = %why, unlogged, "refused a caller whose pod is unclear");
                        }
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
                // The pod must be this node's, and its status must list the
                // caller's container (a cgroup named after a pod's UID by
                // someone else has another container ID).
                let ready = |pod: &NodePod| pod.has_container(container);
                let pod = match pods.get(uid).filter(|pod| ready(pod)) {
                    Some(pod) => Some(pod),
                    None => {
                        let key = self.pod_key(caller).unwrap_or(PodKey::Unattested);
                        let _pod_waiting =
                            self.pod_waiters_per_pod.try_take(&key).ok_or_else(|| {
                                Status::unavailable(format!(
                                    "{key} has {MAX_POD_APPEAR_WAITERS_PER_POD} callers waiting to appear in this node's pod watch, the most one pod may; retry shortly"
                                ))
                            })?;
                        let _waiting = self.pod_waiters.try_acquire().map_err(|_| {
                            Status::unavailable(
                                "too many callers wait for their pods to appear in this node's pod watch; retry shortly",
                            )
                        })?;
                        pods.wait_for(uid, *attestation_wait, ready).await
                    }
                };
                let pod = match (pod, pods.get(uid)) {
                    (Some(pod), _) => pod,
                    (None, Some(other)) => {
                        if let Some(unlogged) = self.identity_refusals.record() {
                            tracing::info!(pid, pod_uid = %uid, container = %container, unlogged, "refused a caller whose container is not its pod's");
                        }
                        return Err(Status::permission_denied(format!(
                            "container {container} of process {pid} is not a container of pod {}/{} in its status",
                            other.namespace, other.name
                        )));
                    }
                    (None, None) => {
                        if let Some(unlogged) = self.identity_refusals.record() {
                            tracing::info!(pid, pod_uid = %uid, node = %pods.node(), unlogged, "refused a caller whose pod is unknown");
                        }
                        return Err(Status::permission_denied(format!(
                            "pod {uid} of process {pid} is not a pod of node {}",
                            pods.node()
                        )));
                    }
                };
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

    /// Node mode: whom the per-pod limits count `caller` as: its pod if
    /// that is one of this node's pods as the watch lists them now,
    /// otherwise every unattested caller together. `None` in pod mode.
    fn pod_key(&self, caller: &CallerInfo) -> Option<PodKey> {
        let CallerPolicy::Node { pods, .. } = &self.policy else {
            return None;
        };
        Some(match caller.pod_uid.as_deref() {
            Some(PodUidLookup::Pod { uid, .. }) if pods.contains(uid) => PodKey::Pod(uid.clone()),
            _ => PodKey::Unattested,
        })
    }

    /// Node mode: a charge against the buffer budget of `caller`'s pod
    /// (as the per-pod limits count it), for one connection's or one
    /// stream's buffers; `None` in pod mode.
    pub(crate) fn buffer_charge(&self, caller: &CallerInfo) -> Option<BufferCharge> {
        let budget = self.buffers.as_ref()?;
        Some(budget.charge(self.pod_key(caller)?))
    }

    /// Logs (one line per interval) and counts a connection or a stream
    /// cut off at its pod's buffer budget.
    pub(crate) fn refused_for_buffers(&self, caller: &CallerInfo, over: &OverBudget) {
        if let Some(unlogged) = self.buffer_refusals.record() {
            tracing::warn!(
                pid = ?caller.pid,
                caller = %over.key,
                held = over.held,
                max_buffered_bytes_per_pod = over.max,
                unlogged,
                total = self.buffer_refusals.total(),
                "cut off a workload connection or stream: its pod holds its most bytes in the agent's buffers (unlogged: of any pod since the last line)"
            );
        }
    }

    /// Logs (one line per interval) and counts a connection closed for
    /// sending no request within `timeout`.
    pub(crate) fn closed_for_no_request(&self, caller: &CallerInfo, timeout: Duration) {
        if let Some(unlogged) = self.no_request_closures.record() {
            tracing::info!(
                pid = ?caller.pid,
                timeout = ?timeout,
                unlogged,
                total = self.no_request_closures.total(),
                "closed a workload connection that sent no request in time (unlogged: such closes since the last line)"
            );
        }
    }

    /// A new connection from `caller`: in node mode it takes a place of
    /// its pod's, or is refused when the pod holds its most.
    pub(crate) fn admit_connection(&self, caller: &CallerInfo) -> Admission {
        let (Some(per_pod), Some(key)) = (&self.per_pod, self.pod_key(caller)) else {
            return Admission::Admitted(None);
        };
        let connections = &per_pod.connections;
        match connections.try_take(&key) {
            Some(slot) => Admission::Admitted(Some(slot)),
            None => {
                if let Some(unlogged) = connections.refusals.record() {
                    tracing::warn!(
                        pid = ?caller.pid,
                        caller = %key,
                        max_connections_per_pod = connections.max(),
                        unlogged,
                        "closed a workload connection: the pod holds its most connections, --max-streams-per-pod (unlogged: refusals of any pod since the last line)"
                    );
                }
                Admission::Refused {
                    reason: format!(
                        "{key} has {} connections open, the most one pod may have on this agent (--max-streams-per-pod); close some",
                        connections.max()
                    ),
                }
            }
        }
    }

    /// A stream slot, and in node mode one of the caller's pod, for a
    /// request from `caller`, taken at its HEADERS (before its message
    /// is read) and held until its answer ends; `RESOURCE_EXHAUSTED` when
    /// `max_streams` streams are open, or the caller's pod holds its most.
    pub(crate) fn admit_stream(&self, caller: &CallerInfo) -> Result<StreamSlot, Status> {
        let pod_slot = match (&self.per_pod, self.pod_key(caller)) {
            (Some(_), Some(key)) => Some(self.pod_stream_place(caller, &key)?),
            _ => None,
        };
        let slot = self.streams.clone().try_acquire_owned().map_err(|_| {
            if let Some(unlogged) = self.stream_limit_refusals.record() {
                tracing::warn!(pid = ?caller.pid, max_streams = self.max_streams, unlogged, "refused a stream: the stream limit is reached");
            }
            Status::resource_exhausted(format!(
                "{} streams are open, the most this agent serves (--max-streams)",
                self.max_streams
            ))
        })?;
        Ok(StreamSlot {
            _slot: slot,
            pod_place: PodPlace(Arc::new(Mutex::new(pod_slot))),
        })
    }

    /// One of `key`'s stream places (node mode), or `RESOURCE_EXHAUSTED`
    /// naming the pod.
    fn pod_stream_place(&self, caller: &CallerInfo, key: &PodKey) -> Result<PodSlot, Status> {
        let Some(per_pod) = &self.per_pod else {
            return Err(Status::internal("no per-pod limits in pod mode"));
        };
        let streams = &per_pod.streams;
        streams.try_take(key).ok_or_else(|| {
            if let Some(unlogged) = streams.refusals.record() {
                tracing::warn!(pid = ?caller.pid, caller = %key, max_streams_per_pod = streams.max(), unlogged, "refused a stream: the pod holds its most streams (unlogged: refusals of any pod since the last line)");
            }
            Status::resource_exhausted(format!(
                "{key} has {} streams open, the most one pod may have on this agent (--max-streams-per-pod); close some",
                streams.max()
            ))
        })
    }

    /// The feed of `identity` for the stream `request` opens (its place
    /// was taken at its HEADERS, [`Callers::admit_stream`]), or
    /// `UNAVAILABLE` when the agent is stopping. A stream whose pod was
    /// not listed yet at its HEADERS (it waited for it in
    /// [`Callers::identity_of`]) moves its place from the callers not
    /// attested to a pod to its pod's (`RESOURCE_EXHAUSTED` if its pod
    /// holds its most).
    pub(crate) fn lease<T>(
        &self,
        request: &Request<T>,
        identity: &SpiffeId,
    ) -> Result<StreamLease, Status> {
        if *self.closing.borrow() {
            return Err(shutting_down());
        }
        let caller = request.extensions().get::<CallerInfo>();
        let place = request.extensions().get::<PodPlace>();
        if let (Some(caller), Some(place), Some(key)) =
            (caller, place, caller.and_then(|c| self.pod_key(c)))
        {
            let mut held = place.0.lock().unwrap_or_else(|e| e.into_inner());
            if held.as_ref().is_some_and(|slot| *slot.key() != key) {
                *held = Some(self.pod_stream_place(caller, &key)?);
            }
            // The bytes its request holds go along.
            if let Some(charge) = request.extensions().get::<StreamCharge>() {
                charge.move_to(key.clone()).map_err(|over| {
                    self.refused_for_buffers(caller, &over);
                    over.status()
                })?;
            }
        }
        Ok(StreamLease {
            feed: self.feeds.get(identity),
            closing: self.closing.subscribe(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tonic::Code;

    use super::super::feeds::tests::{id, setup};
    use super::*;

    /// A request from a caller whose pod lookup found `lookup`.
    fn request_from(lookup: PodUidLookup) -> Request<()> {
        let mut request = Request::new(());
        request.extensions_mut().insert(caller(lookup));
        request
    }

    fn caller(lookup: PodUidLookup) -> CallerInfo {
        CallerInfo {
            pid: Some(7),
            uid: Some(1000),
            pod_uid: Some(Arc::new(lookup)),
        }
    }

    fn in_pod(uid: &str) -> PodUidLookup {
        PodUidLookup::Pod {
            uid: uid.to_string(),
            container: "c".to_string(),
        }
    }

    /// Node mode on node-a, whose pods are `a` and `b` (service account
    /// `web`), at most `per_pod` connections and streams per pod.
    fn node_callers(per_pod: usize) -> Arc<Callers> {
        let (_issuer, feeds, _bundle) = setup(Duration::from_secs(3600));
        let policy = CallerPolicy::Node {
            trust_domain: TrustDomain::new("cluster.local").unwrap(),
            pods: NodePods::synced_with("node-a", &[("a", "test", "web"), ("b", "test", "web")]),
            attestation_wait: DEFAULT_ATTESTATION_WAIT,
        };
        Callers::new(policy, feeds, 16, per_pod)
    }

    fn admitted(admission: Admission) -> Option<PodSlot> {
        match admission {
            Admission::Admitted(slot) => slot,
            Admission::Refused { .. } => panic!("refused"),
        }
    }

    #[tokio::test]
    async fn a_stream_whose_pod_appears_late_moves_to_its_pods_places() {
        let (_issuer, feeds, _bundle) = setup(Duration::from_secs(3600));
        let pods = NodePods::synced_with("node-a", &[("a", "test", "web")]);
        let policy = CallerPolicy::Node {
            trust_domain: TrustDomain::new("cluster.local").unwrap(),
            pods: pods.clone(),
            attestation_wait: DEFAULT_ATTESTATION_WAIT,
        };
        let callers = Callers::new(policy, feeds, 16, 2);
        let streams = &callers.per_pod.as_ref().unwrap().streams;
        // At its HEADERS pod c is not listed yet: an unattested place.
        let slot = callers.admit_stream(&caller(in_pod("c"))).unwrap();
        assert_eq!(streams.held_by(&PodKey::Unattested), 1);
        // What its request message holds is charged to the unattested too.
        let charge = StreamCharge::new(callers.buffer_charge(&caller(in_pod("c"))).unwrap());
        charge.set(5000).unwrap();
        let buffers = callers.buffers.as_ref().unwrap();
        assert_eq!(buffers.held_by(&PodKey::Unattested), 5000);
        // The pod appears; attested, the stream moves to its pod's places,
        // its bytes with it.
        pods.add_pod("c", "test", "web");
        let mut request = request_from(in_pod("c"));
        request.extensions_mut().insert(slot.pod_place());
        request.extensions_mut().insert(charge.clone());
        let lease = callers.lease(&request, &id("web")).unwrap();
        assert_eq!(streams.held_by(&PodKey::Unattested), 0);
        assert_eq!(streams.held_by(&PodKey::Pod("c".into())), 1);
        assert_eq!(buffers.held_by(&PodKey::Unattested), 0);
        assert_eq!(buffers.held_by(&PodKey::Pod("c".into())), 5000);
        assert_eq!(charge.key(), PodKey::Pod("c".into()));
        // The place is shared by the stream's body and its request.
        drop((lease, slot, request, charge));
        assert_eq!(streams.held_by(&PodKey::Pod("c".into())), 0);
        assert_eq!(buffers.held_by(&PodKey::Pod("c".into())), 0);
    }

    #[tokio::test]
    async fn in_node_mode_one_pod_holds_at_most_its_streams() {
        let callers = node_callers(2);
        let first = callers.admit_stream(&caller(in_pod("a"))).unwrap();
        let _second = callers.admit_stream(&caller(in_pod("a"))).unwrap();
        let refused = callers.admit_stream(&caller(in_pod("a"))).unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted);
        assert!(
            refused.message().contains("pod a")
                && refused.message().contains("--max-streams-per-pod"),
            "{refused:?}"
        );
        // Another pod of the node still gets its streams.
        let _other = callers.admit_stream(&caller(in_pod("b"))).unwrap();
        // A stream closed gives the pod its place back.
        drop(first);
        assert!(callers.admit_stream(&caller(in_pod("a"))).is_ok());
    }

    #[tokio::test]
    async fn connections_count_by_the_nodes_pods_and_every_other_caller_together() {
        let callers = node_callers(2);
        let a: Vec<_> = (0..2)
            .map(|_| admitted(callers.admit_connection(&caller(in_pod("a")))))
            .collect();
        assert!(a.iter().all(Option::is_some));
        assert!(matches!(
            callers.admit_connection(&caller(in_pod("a"))),
            Admission::Refused { .. }
        ));
        // Made-up pod UIDs get no budget of their own: with a process
        // outside any pod they share one, and pod b keeps its own.
        let _made_up = admitted(callers.admit_connection(&caller(in_pod("made-up-1"))));
        let _outside = admitted(callers.admit_connection(&caller(PodUidLookup::NotInPod)));
        for lookup in [
            in_pod("made-up-2"),
            PodUidLookup::NotInPod,
            PodUidLookup::Unreadable("gone".into()),
        ] {
            assert!(matches!(
                callers.admit_connection(&caller(lookup)),
                Admission::Refused { .. }
            ));
        }
        assert!(admitted(callers.admit_connection(&caller(in_pod("b")))).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn callers_waiting_for_their_pods_to_appear_are_bounded() {
        // As many listed pods as it takes to fill the node's places, each
        // with a container the kubelet has not reported yet.
        let pods = MAX_POD_APPEAR_WAITERS / MAX_POD_APPEAR_WAITERS_PER_POD + 1;
        let uids: Vec<String> = (0..pods).map(|i| format!("p{i}")).collect();
        let listed: Vec<(&str, &str, &str)> = uids
            .iter()
            .map(|uid| (uid.as_str(), "test", "web"))
            .collect();
        let (_issuer, feeds, _bundle) = setup(Duration::from_secs(3600));
        let policy = CallerPolicy::Node {
            trust_domain: TrustDomain::new("cluster.local").unwrap(),
            pods: NodePods::synced_with("node-a", &listed),
            attestation_wait: DEFAULT_ATTESTATION_WAIT,
        };
        let callers = Callers::new(policy, feeds, 16, 2);
        let unreported = |uid: &str| {
            request_from(PodUidLookup::Pod {
                uid: uid.into(),
                container: "unreported".into(),
            })
        };
        // One pod fills its share; its next caller is refused, naming it,
        // while another pod's callers still wait.
        let p0 = unreported("p0");
        let made_up = request_from(in_pod("made-up"));
        let others: Vec<_> = uids[1..].iter().map(|uid| unreported(uid)).collect();
        let mut waiting: Vec<_> = (0..MAX_POD_APPEAR_WAITERS_PER_POD)
            .map(|_| Box::pin(callers.identity_of(&p0)))
            .collect();
        for waiter in &mut waiting {
            assert!(futures::poll!(waiter.as_mut()).is_pending());
        }
        let status = callers.identity_of(&p0).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            status.message().contains("pod p0") && status.message().contains("callers waiting"),
            "{status:?}"
        );
        // Every caller not attested to a listed pod shares one share.
        let mut made_up_waiting: Vec<_> = (0..MAX_POD_APPEAR_WAITERS_PER_POD)
            .map(|_| Box::pin(callers.identity_of(&made_up)))
            .collect();
        for waiter in &mut made_up_waiting {
            assert!(futures::poll!(waiter.as_mut()).is_pending());
        }
        let status = callers
            .identity_of(&request_from(in_pod("made-up-2")))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        // The other pods fill the node's places; one more is refused.
        let mut others_waiting = Vec::new();
        'fill: for request in &others {
            for _ in 0..MAX_POD_APPEAR_WAITERS_PER_POD {
                if waiting.len() + made_up_waiting.len() + others_waiting.len()
                    == MAX_POD_APPEAR_WAITERS
                {
                    break 'fill;
                }
                let mut waiter = Box::pin(callers.identity_of(request));
                assert!(futures::poll!(waiter.as_mut()).is_pending());
                others_waiting.push(waiter);
            }
        }
        let last = others.last().unwrap();
        let status = callers.identity_of(last).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            status.message().contains("too many callers wait"),
            "{status:?}"
        );
        // A caller whose pod and container are listed does not wait.
        assert_eq!(
            callers
                .identity_of(&request_from(in_pod("p1")))
                .await
                .unwrap(),
            id("web")
        );
        // Each waiter is refused after its wait, and frees its place.
        for waiter in waiting
            .into_iter()
            .chain(made_up_waiting)
            .chain(others_waiting)
        {
            let status = waiter.await.unwrap_err();
            assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        }
        let status = callers.identity_of(&p0).await.unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_pods_uid_with_another_container_gets_no_identity() {
        let callers = node_callers(2);
        let impostor = request_from(PodUidLookup::Pod {
            uid: "a".into(),
            container: "made-up".into(),
        });
        let status = callers.identity_of(&impostor).await.unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert!(
            status.message().contains("container made-up")
                && status
                    .message()
                    .contains("not a container of pod test/pod-a"),
            "{status:?}"
        );
        // The pod's own container gets it.
        assert_eq!(
            callers
                .identity_of(&request_from(in_pod("a")))
                .await
                .unwrap(),
            id("web")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_container_the_kubelet_reports_late_gets_its_identity_once_reported() {
        let callers = node_callers(2);
        let CallerPolicy::Node { pods, .. } = &callers.policy else {
            unreachable!("node mode")
        };
        let late = request_from(PodUidLookup::Pod {
            uid: "a".into(),
            container: "late".into(),
        });
        let mut waiting = Box::pin(callers.identity_of(&late));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        // The kubelet reports it 20 s after it started: still in time.
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        pods.add_container("a", "late");
        assert_eq!(waiting.await.unwrap(), id("web"));
        // A container never reported is refused after the whole wait.
        let start = tokio::time::Instant::now();
        let never = request_from(PodUidLookup::Pod {
            uid: "a".into(),
            container: "never".into(),
        });
        let status = callers.identity_of(&never).await.unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert_eq!(start.elapsed(), DEFAULT_ATTESTATION_WAIT);
    }

    #[tokio::test]
    async fn in_pod_mode_only_the_socket_limit_counts() {
        let (_issuer, feeds, _bundle) = setup(Duration::from_secs(3600));
        let callers = Callers::new(CallerPolicy::Pod(id("web")), feeds, 3, 1);
        assert!(admitted(callers.admit_connection(&caller(in_pod("a")))).is_none());
        let slots: Vec<_> = (0..3)
            .map(|_| callers.admit_stream(&caller(in_pod("a"))))
            .collect();
        assert!(slots.iter().all(Result::is_ok), "one pod: --max-streams");
        let refused = callers.admit_stream(&caller(in_pod("a"))).unwrap_err();
        assert!(refused.message().contains("--max-streams)"), "{refused:?}");
    }
}
