//! Node-agent impersonation (docs/authentication.md, "Node agents (ztunnel)"): a trusted node agent (such as
//! ztunnel) may get certificates for the workloads that run on its node.
//!
//! [`PodIndex`] is fed by a Kubernetes watch on pods (not a GET per request)
//! and indexed by namespace/name and by node. [`NodeAgentPolicy`] allows an
//! impersonation only when every rule holds, and names the rule that failed:
//! 1. the caller's namespace/service account is a trusted node agent;
//! 2. the caller's token is bound to a pod, by name and UID, and that very
//!    pod exists (a token without a pod UID is refused, as Istio does);
//! 3. the target namespace/service account has a pod on that pod's node.
//!
//! The index must be current: until its first full list, and while its
//! watch has been failing for longer than a bound
//! ([`PodIndex::with_max_watch_failure`]), impersonation is refused with
//! `UNAVAILABLE` rather than decided on stale pods.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use async_trait::async_trait;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::Api;
use meshca_certs::SpiffeId;
use meshca_kube::WatchRetry;

use super::{AuthzError, ImpersonationPolicy};
use crate::authn::Caller;

/// What the index keeps of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PodInfo {
    /// metadata.uid
    pub(crate) uid: String,
    /// spec.nodeName (unscheduled pods have none)
    pub(crate) node: Option<String>,
    /// spec.serviceAccountName
    pub(crate) service_account: String,
    /// Whether the pod has finished (Succeeded or Failed).
    pub(crate) terminated: bool,
}

type NsName = (String, String);

#[derive(Debug, Default)]
struct PodMaps {
    pods: HashMap<NsName, PodInfo>,
    /// node → (namespace, service account) → number of live pods.
    on_node: HashMap<String, HashMap<NsName, usize>>,
}

impl PodMaps {
    fn insert(&mut self, key: NsName, info: PodInfo) {
        self.remove(&key);
        if let (Some(node), false) = (&info.node, info.terminated) {
            *self
                .on_node
                .entry(node.clone())
                .or_default()
                .entry((key.0.clone(), info.service_account.clone()))
                .or_default() += 1;
        }
        self.pods.insert(key, info);
    }

    fn remove(&mut self, key: &NsName) {
        let Some(old) = self.pods.remove(key) else {
            return;
        };
        if let (Some(node), false) = (&old.node, old.terminated) {
            if let Some(workloads) = self.on_node.get_mut(node) {
                let sa_key = (key.0.clone(), old.service_account.clone());
                if let Some(count) = workloads.get_mut(&sa_key) {
                    *count = count.saturating_sub(1);
                    if *count == 0 {
                        workloads.remove(&sa_key);
                    }
                }
                if workloads.is_empty() {
                    self.on_node.remove(node);
                }
            }
        }
    }
}

fn pod_entry(pod: &Pod) -> Option<(NsName, PodInfo)> {
    let ns = pod.metadata.namespace.clone()?;
    let name = pod.metadata.name.clone()?;
    let spec = pod.spec.as_ref();
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    Some((
        (ns, name),
        PodInfo {
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            node: spec
                .and_then(|s| s.node_name.clone())
                .filter(|n| !n.is_empty()),
            service_account: spec
                .and_then(|s| s.service_account_name.clone())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "default".to_string()),
            terminated: matches!(phase, Some("Succeeded") | Some("Failed")),
        },
    ))
}

/// Default time the pod watch may fail before the index counts as stale.
pub(crate) const DEFAULT_MAX_WATCH_FAILURE: Duration = Duration::from_secs(30);

/// Whether the index may be used for a decision now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Freshness {
    /// Synced, and the watch is healthy or has been failing only briefly.
    Current,
    /// No full list loaded yet.
    NotSynced,
    /// The watch has been failing for this long (more than the bound).
    Stale(Duration),
}

/// Pods by namespace/name and by node, kept current by a watch.
#[derive(Debug)]
pub(crate) struct PodIndex {
    maps: RwLock<PodMaps>,
    synced: AtomicBool,
    /// When the watch started failing, if it is failing now.
    failing_since: Mutex<Option<Instant>>,
    max_watch_failure: Duration,
}

impl Default for PodIndex {
    fn default() -> Self {
        Self::with_max_watch_failure(DEFAULT_MAX_WATCH_FAILURE)
    }
}

impl PodIndex {
    /// An empty index that counts as stale once its watch has been failing
    /// for longer than `max_watch_failure`.
    pub(crate) fn with_max_watch_failure(max_watch_failure: Duration) -> Self {
        Self {
            maps: RwLock::default(),
            synced: AtomicBool::new(false),
            failing_since: Mutex::new(None),
            max_watch_failure,
        }
    }

    /// Records a failed watch call (the first failure in a row starts the clock).
    pub(crate) fn watch_failed(&self) {
        self.failing_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(Instant::now);
    }

    /// Records a watch event received: the watch works again.
    pub(crate) fn watch_succeeded(&self) {
        *self.failing_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Whether the index may decide now.
    pub(crate) fn freshness(&self) -> Freshness {
        if !self.is_synced() {
            return Freshness::NotSynced;
        }
        let failing_since = *self.failing_since.lock().unwrap_or_else(|e| e.into_inner());
        match failing_since.map(|t| t.elapsed()) {
            Some(failing) if failing > self.max_watch_failure => Freshness::Stale(failing),
            _ => Freshness::Current,
        }
    }

    /// Adds or updates a pod.
    pub(crate) fn apply(&self, pod: &Pod) {
        if let Some((key, info)) = pod_entry(pod) {
            self.maps
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key, info);
        }
    }

    /// Removes a pod.
    pub(crate) fn delete(&self, pod: &Pod) {
        if let Some((key, _)) = pod_entry(pod) {
            self.maps
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
        }
    }

    /// Replaces the whole content (after a full list) and marks it synced.
    pub(crate) fn replace(&self, pods: &[Pod]) {
        let mut fresh = PodListing::default();
        for pod in pods {
            fresh.add(pod);
        }
        self.replace_with(fresh);
    }

    /// Replaces the whole content with a full list's and marks it synced.
    pub(crate) fn replace_with(&self, listing: PodListing) {
        *self.maps.write().unwrap_or_else(|e| e.into_inner()) = listing.maps;
        self.synced.store(true, Ordering::Release);
    }

    /// Whether a full list has been loaded (see [`PodIndex::freshness`]
    /// for whether it is still current).
    pub(crate) fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// A pod by namespace and name.
    pub(crate) fn pod(&self, namespace: &str, name: &str) -> Option<PodInfo> {
        self.maps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .pods
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Whether a live pod of `namespace`/`service_account` runs on `node`.
    pub(crate) fn has_workload_on_node(
        &self,
        node: &str,
        namespace: &str,
        service_account: &str,
    ) -> bool {
        self.maps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .on_node
            .get(node)
            .is_some_and(|w| w.contains_key(&(namespace.to_string(), service_account.to_string())))
    }

    /// How many pods are indexed.
    pub(crate) fn len(&self) -> usize {
        self.maps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .pods
            .len()
    }

    /// Whether no pod is indexed.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How long the API server keeps one watch of pods open
/// (`timeoutSeconds`) before the watcher opens the next, from where it
/// left off. kube's watcher also gives up a watch silent for this long
/// plus 5 s (a dead connection).
pub(crate) const POD_WATCH_TIMEOUT_SECS: u32 = 60;

/// Most time a call of the pod watch may take: a page of the list, or the
/// API server's answer to a watch request (its stream is bounded by
/// [`POD_WATCH_TIMEOUT_SECS`]). A call that takes longer fails like an
/// unreachable API server, so a hung API server or a black-holed
/// connection counts towards the failure limit instead of leaving the
/// index stale without anyone knowing.
pub(crate) const POD_WATCH_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// `client`, with every call bounded by `timeout`: the whole answer of a
/// request, and the response headers of a watch (whose stream stays open).
/// The shared client has no read timeout, so that watches can stay open.
fn with_call_timeout(client: kube::Client, timeout: Duration) -> kube::Client {
    let namespace = client.default_namespace().to_string();
    let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
        let client = client.clone();
        async move {
            let is_watch = request
                .uri()
                .query()
                .is_some_and(|q| q.split('&').any(|p| p == "watch=true"));
            let call = async {
                let response = client.send(request).await?;
                if is_watch {
                    return Ok(response);
                }
                let (parts, body) = response.into_parts();
                let body = body.collect_bytes().await?;
                Ok(http::Response::from_parts(
                    parts,
                    kube::client::Body::from(body),
                ))
            };
            tokio::time::timeout(timeout, call)
                .await
                .unwrap_or_else(|_| {
                    Err(kube::Error::Service(
                        format!("the Kubernetes API did not answer within {timeout:?}").into(),
                    ))
                })
        }
    });
    kube::Client::new(service, namespace)
}

/// The entries of a full list of pods as it arrives, before it replaces
/// the index's content: one small entry per pod (as in the index), never
/// the pods themselves.
#[derive(Debug, Default)]
pub(crate) struct PodListing {
    maps: PodMaps,
    /// Pods listed, with or without an entry.
    listed: usize,
}

impl PodListing {
    /// Adds `pod`'s entry.
    pub(crate) fn add(&mut self, pod: &Pod) {
        self.listed += 1;
        if let Some((key, info)) = pod_entry(pod) {
            self.maps.insert(key, info);
        }
    }
}

/// Keeps `index` current from a watch on all pods until the task is dropped.
/// Errors (API down, watch expired, a call not answered within
/// [`POD_WATCH_CALL_TIMEOUT`]) are retried with backoff.
pub(crate) async fn watch_pods(client: kube::Client, index: Arc<PodIndex>) {
    let api: Api<Pod> = Api::all(with_call_timeout(client, POD_WATCH_CALL_TIMEOUT));
    let config = watcher::Config::default().timeout(POD_WATCH_TIMEOUT_SECS);
    let stream = watcher::watcher(api, config);
    futures::pin_mut!(stream);
    let mut retry = WatchRetry::new("pods");
    // A listing in progress keeps each pod's small entry, not the pod:
    // the whole cluster's pods at full size would not fit the memory limit.
    let mut listing = PodListing::default();
    while let Some(event) = stream.next().await {
        if meshca_kube::answered(&event) {
            index.watch_succeeded();
            retry.succeeded();
        }
        match event {
            Ok(Event::Init) => listing = PodListing::default(),
            Ok(Event::InitApply(pod)) => listing.add(&pod),
            Ok(Event::InitDone) => {
                let listed = std::mem::take(&mut listing);
                tracing::info!(pods = listed.listed, "pod index synced");
                index.replace_with(listed);
            }
            Ok(Event::Apply(pod)) => index.apply(&pod),
            Ok(Event::Delete(pod)) => index.delete(&pod),
            Err(e) => {
                index.watch_failed();
                retry.failed(&e).await;
            }
        }
    }
}

/// The impersonation rules for trusted node agents.
#[derive(Debug)]
pub(crate) struct NodeAgentPolicy {
    trusted: HashSet<NsName>,
    pods: Arc<PodIndex>,
}

impl NodeAgentPolicy {
    /// Trusts `trusted` (namespace, service account) pairs, checking pods in `pods`.
    pub(crate) fn new(
        trusted: impl IntoIterator<Item = (String, String)>,
        pods: Arc<PodIndex>,
    ) -> Self {
        Self {
            trusted: trusted.into_iter().collect(),
            pods,
        }
    }
}

#[async_trait]
impl ImpersonationPolicy for NodeAgentPolicy {
    fn node_of(&self, caller: &Caller) -> Option<String> {
        let (ns, _) = caller.identity.kubernetes_workload().ok()?;
        let pod = self.pods.pod(ns, caller.pod_name.as_deref()?)?;
        // Only the pod the token is bound to: a name alone may be reused.
        (Some(pod.uid.as_str()) == caller.pod_uid.as_deref())
            .then_some(pod.node)
            .flatten()
    }

    async fn may_impersonate(&self, caller: &Caller, target: &SpiffeId) -> Result<(), AuthzError> {
        let deny = |reason: String| AuthzError::ImpersonationDenied {
            caller: caller.identity.to_string(),
            target: target.to_string(),
            reason,
        };
        let (caller_ns, caller_sa) = caller
            .identity
            .kubernetes_workload()
            .map_err(|_| deny("the caller is not a Kubernetes service account".into()))?;
        if !self
            .trusted
            .contains(&(caller_ns.to_string(), caller_sa.to_string()))
        {
            return Err(deny(format!(
                "{caller_ns}/{caller_sa} is not a trusted node agent (--trusted-node-agent)"
            )));
        }
        if target.trust_domain_name() != caller.identity.trust_domain_name() {
            return Err(deny("the target is in another trust domain".into()));
        }
        let (target_ns, target_sa) = target
            .kubernetes_workload()
            .map_err(|_| deny("the target is not a Kubernetes workload identity".into()))?;
        match self.pods.freshness() {
            Freshness::Current => {}
            Freshness::NotSynced => {
                return Err(AuthzError::Unavailable(
                    "the pod index is not synced with the Kubernetes API yet; retry shortly"
                        .into(),
                ))
            }
            Freshness::Stale(failing) => {
                return Err(AuthzError::Unavailable(format!(
                    "the pod index is stale: watching pods has failed for {}s; impersonation resumes when the Kubernetes API answers again",
                    failing.as_secs()
                )))
            }
        }
        let pod_name = caller
            .pod_name
            .as_deref()
            .ok_or_else(|| deny("the caller's token is not bound to a pod (no pod name)".into()))?;
        let pod = self.pods.pod(caller_ns, pod_name).ok_or_else(|| {
            deny(format!(
                "the caller's pod {caller_ns}/{pod_name} does not exist"
            ))
        })?;
        // Istio requires the UID too: a name alone would let a token of a
        // deleted pod act for a new pod that reuses the name.
        let uid = caller.pod_uid.as_deref().ok_or_else(|| {
            deny("the caller's token is not bound to a pod UID (a bound service-account token carries it)".into())
        })?;
        if pod.uid != uid {
            return Err(deny(format!(
                "the caller's pod {caller_ns}/{pod_name} has UID {}, not the token's {uid} (it was replaced)",
                pod.uid
            )));
        }
        let node = pod.node.ok_or_else(|| {
            deny(format!(
                "the caller's pod {caller_ns}/{pod_name} is not scheduled on a node"
            ))
        })?;
        if !self.pods.has_workload_on_node(&node, target_ns, target_sa) {
            return Err(deny(format!(
                "no running pod of {target_ns}/{target_sa} is on the caller's node {node}"
            )));
        }
        Ok(())
    }
}

/// The `pod_watch` fuzz target (`fuzz/`): applies `data` to a fresh
/// index, one JSON document per line — a pod, applied; a line starting
/// with `-` deletes the pod that follows; one starting with `=` replaces
/// the index with the list that follows — and checks after each step that
/// the index agrees with what it was told. Panics on a disagreement.
/// Built in every build (not only with `--cfg fuzzing`), so the main
/// workspace's tests replay the committed corpus through it
/// (`ca/tests/fuzz_corpus.rs`).
pub fn fuzz_pod_events(data: &[u8]) {
    let index = PodIndex::default();
    for line in data.split(|b| *b == b'\n') {
        let (op, json) = match line.first() {
            Some(b'-') | Some(b'=') => (line[0], &line[1..]),
            _ => (b'+', line),
        };
        match op {
            b'=' => {
                let Ok(pods) = serde_json::from_slice::<Vec<Pod>>(json) else {
                    continue;
                };
                index.replace(&pods);
                assert!(index.is_synced());
                assert!(index.len() <= pods.len());
            }
            _ => {
                let Ok(pod) = serde_json::from_slice::<Pod>(json) else {
                    continue;
                };
                if op == b'-' {
                    index.delete(&pod);
                } else {
                    index.apply(&pod);
                }
                if let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) {
                    let found = index.pod(ns, name);
                    if op == b'-' {
                        assert!(found.is_none(), "a deleted pod is gone");
                    } else {
                        let found = found.expect("an applied pod is found");
                        if let (Some(node), false) = (&found.node, found.terminated) {
                            assert!(
                                index.has_workload_on_node(node, ns, &found.service_account),
                                "a running pod counts on its node"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authn::CallerKind;

    fn pod(ns: &str, name: &str, uid: &str, sa: &str, node: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": ns, "name": name, "uid": uid},
            "spec": {"serviceAccountName": sa, "nodeName": node, "containers": []},
            "status": {"phase": "Running"}
        }))
        .unwrap()
    }

    fn caller(pod_name: Option<&str>, uid: Option<&str>) -> Caller {
        Caller {
            identity: SpiffeId::parse("spiffe://cluster.local/ns/istio-system/sa/ztunnel").unwrap(),
            kind: CallerKind::Token { issuer: "k".into() },
            pod_name: pod_name.map(String::from),
            pod_uid: uid.map(String::from),
            cluster: None,
        }
    }

    fn policy() -> NodeAgentPolicy {
        let index = Arc::new(PodIndex::default());
        index.replace(&[
            pod("istio-system", "ztunnel-a", "uid-z", "ztunnel", "node-a"),
            pod("default", "web-1", "uid-w", "web", "node-a"),
            pod("default", "db-1", "uid-d", "db", "node-b"),
        ]);
        NodeAgentPolicy::new([("istio-system".to_string(), "ztunnel".to_string())], index)
    }

    fn target(sa: &str) -> SpiffeId {
        SpiffeId::parse(&format!("spiffe://cluster.local/ns/default/sa/{sa}")).unwrap()
    }

    #[tokio::test]
    async fn rules() {
        let p = policy();
        let z = caller(Some("ztunnel-a"), Some("uid-z"));
        p.may_impersonate(&z, &target("web")).await.unwrap();
        let err = p
            .may_impersonate(&z, &target("db"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("node-a"), "{err}");
        let err = p
            .may_impersonate(&caller(Some("ztunnel-gone"), None), &target("web"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not exist"), "{err}");
        let err = p
            .may_impersonate(&caller(Some("ztunnel-a"), Some("old-uid")), &target("web"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("UID"), "{err}");
        let err = p
            .may_impersonate(&caller(None, None), &target("web"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("not bound to a pod"), "{err}");
        // A token naming the pod but no UID is refused, as Istio does.
        let err = p
            .may_impersonate(&caller(Some("ztunnel-a"), None), &target("web"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("not bound to a pod UID"), "{err}");
        let mut web = caller(Some("web-1"), None);
        web.identity = target("web");
        let err = p
            .may_impersonate(&web, &target("db"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a trusted node agent"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_watch_makes_the_index_stale_after_the_bound() {
        let p = policy();
        let z = caller(Some("ztunnel-a"), Some("uid-z"));
        p.pods.watch_failed();
        tokio::time::advance(Duration::from_secs(29)).await;
        // A watch that failed briefly (the API restarting) is tolerated.
        p.pods.watch_failed();
        assert_eq!(p.pods.freshness(), Freshness::Current);
        p.may_impersonate(&z, &target("web")).await.unwrap();
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            p.pods.freshness(),
            Freshness::Stale(Duration::from_secs(31))
        );
        let err = p.may_impersonate(&z, &target("web")).await.unwrap_err();
        assert!(matches!(err, AuthzError::Unavailable(_)), "{err}");
        assert!(err.to_string().contains("failed for 31s"), "{err}");
        // The watch answers again: decisions resume.
        p.pods.watch_succeeded();
        p.may_impersonate(&z, &target("web")).await.unwrap();
        // Not synced yet is UNAVAILABLE too.
        let fresh = NodeAgentPolicy::new(
            [("istio-system".to_string(), "ztunnel".to_string())],
            Arc::new(PodIndex::default()),
        );
        assert!(matches!(
            fresh.may_impersonate(&z, &target("web")).await,
            Err(AuthzError::Unavailable(_))
        ));
    }

    /// A fake pods API for the watch: the list answers with `pods`; a
    /// watch request hangs while `answer_watches` is false, and otherwise
    /// streams an ADDED event for each of `pods` and stays open.
    fn fake_pods_api(
        pods: Vec<Pod>,
        answer_watches: tokio::sync::watch::Receiver<bool>,
    ) -> kube::Client {
        let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
            let pods = pods.clone();
            let mut answer_watches = answer_watches.clone();
            async move {
                assert_eq!(request.uri().path(), "/api/v1/pods");
                let query = request.uri().query().unwrap_or_default().to_string();
                let body = if query.split('&').any(|p| p == "watch=true") {
                    let _ = answer_watches.wait_for(|answer| *answer).await;
                    let events: Vec<Result<axum::body::Bytes, std::convert::Infallible>> = pods
                        .iter()
                        .map(|pod| {
                            let mut pod = serde_json::to_value(pod).unwrap();
                            pod["metadata"]["resourceVersion"] = "2".into();
                            let event = serde_json::json!({"type": "ADDED", "object": pod});
                            Ok(format!("{event}\n").into())
                        })
                        .collect();
                    axum::body::Body::from_stream(
                        futures::stream::iter(events).chain(futures::stream::pending()),
                    )
                } else {
                    let list = serde_json::json!({
                        "apiVersion": "v1", "kind": "PodList",
                        "metadata": {"resourceVersion": "1"},
                        "items": pods,
                    });
                    axum::body::Body::from(list.to_string())
                };
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder()
                        .status(200)
                        .header("content-type", "application/json")
                        .body(body)
                        .unwrap(),
                )
            }
        });
        kube::Client::new(service, "default")
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_watch_makes_impersonation_unavailable_after_the_call_timeout_and_the_limit() {
        let (answer_watches, answering) = tokio::sync::watch::channel(false);
        let client = fake_pods_api(
            vec![
                pod("istio-system", "ztunnel-a", "uid-z", "ztunnel", "node-a"),
                pod("default", "web-1", "uid-w", "web", "node-a"),
            ],
            answering,
        );
        let limit = Duration::from_secs(30);
        let index = Arc::new(PodIndex::with_max_watch_failure(limit));
        let watching = tokio::spawn(watch_pods(client, index.clone()));
        let policy = NodeAgentPolicy::new(
            [("istio-system".to_string(), "ztunnel".to_string())],
            index.clone(),
        );
        let z = caller(Some("ztunnel-a"), Some("uid-z"));
        while !index.is_synced() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let synced_at = Instant::now();
        policy.may_impersonate(&z, &target("web")).await.unwrap();

        // The list answered; the watch request after it never does. The
        // call times out, and the watch counts as failing from then on.
        let unavailable_at = synced_at + POD_WATCH_CALL_TIMEOUT + limit;
        tokio::time::sleep_until(unavailable_at - Duration::from_secs(1)).await;
        policy.may_impersonate(&z, &target("web")).await.unwrap();
        tokio::time::sleep_until(unavailable_at + Duration::from_secs(1)).await;
        let err = policy
            .may_impersonate(&z, &target("web"))
            .await
            .unwrap_err();
        assert!(matches!(err, AuthzError::Unavailable(_)), "{err}");
        assert!(err.to_string().contains("stale"), "{err}");

        // The API server answers watches again: decisions resume.
        answer_watches.send_replace(true);
        let resumed = tokio::time::timeout(POD_WATCH_CALL_TIMEOUT * 2, async {
            while index.freshness() != Freshness::Current {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        assert!(resumed.is_ok(), "the watch did not recover");
        policy.may_impersonate(&z, &target("web")).await.unwrap();
        watching.abort();
    }

    #[test]
    fn index_follows_updates_and_deletes() {
        let index = PodIndex::default();
        index.replace(&[]);
        let p = pod("default", "web-1", "u1", "web", "node-a");
        index.apply(&p);
        assert!(index.has_workload_on_node("node-a", "default", "web"));
        index.apply(&pod("default", "web-1", "u1", "web", "node-b"));
        assert!(!index.has_workload_on_node("node-a", "default", "web"));
        assert!(index.has_workload_on_node("node-b", "default", "web"));
        index.delete(&p);
        assert!(!index.has_workload_on_node("node-b", "default", "web"));
        assert!(index.is_empty());
    }
}
