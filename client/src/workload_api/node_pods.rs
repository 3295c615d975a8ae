//! Node mode: the pods of this node, by UID, from a watch on the
//! Kubernetes API (`spec.nodeName=<node>`: list once, then events).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::Api;
use meshca_kube::WatchRetry;
use tokio::sync::watch;

/// What the agent needs of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodePod {
    /// Namespace.
    pub(crate) namespace: String,
    /// Name.
    pub(crate) name: String,
    /// Service account (`default` when the spec names none).
    pub(crate) service_account: String,
    /// The IDs of its containers that have one in the pod's status (app,
    /// init and ephemeral containers), without the runtime's `name://`.
    pub(crate) containers: Vec<String>,
}

impl NodePod {
    /// Whether the pod's status lists the container with this ID.
    pub(crate) fn has_container(&self, id: &str) -> bool {
        self.containers.iter().any(|c| c == id)
    }
}

/// The pods of one node by UID, kept current by [`watch_node_pods`].
#[derive(Debug)]
pub struct NodePods {
    node: String,
    by_uid: RwLock<HashMap<String, NodePod>>,
    /// Bumped on every change; `None` until the first list has arrived.
    version: watch::Sender<Option<u64>>,
}

impl NodePods {
    /// An empty, not yet synced index of `node`'s pods.
    pub fn new(node: impl Into<String>) -> Arc<Self> {
        Arc::new(Self {
            node: node.into(),
            by_uid: RwLock::new(HashMap::new()),
            version: watch::channel(None).0,
        })
    }

    /// The node whose pods are indexed.
    pub(crate) fn node(&self) -> &str {
        &self.node
    }

    /// The pod with this UID, if it is on this node.
    pub(crate) fn get(&self, uid: &str) -> Option<NodePod> {
        self.by_uid
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(uid)
            .cloned()
    }

    /// Whether the pod with this UID is on this node.
    pub(crate) fn contains(&self, uid: &str) -> bool {
        self.by_uid
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(uid)
    }

    /// Whether the first list has arrived.
    pub(crate) fn is_synced(&self) -> bool {
        self.version.borrow().is_some()
    }

    /// Waits up to `wait` for the pod `uid` to appear with `ready` true of
    /// it (a container may call before the watch has delivered its pod, or
    /// the pod's status its container); `None` if it does not.
    pub(crate) async fn wait_for(
        &self,
        uid: &str,
        wait: Duration,
        ready: impl Fn(&NodePod) -> bool,
    ) -> Option<NodePod> {
        let mut changes = self.version.subscribe();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if changes.borrow_and_update().is_some() {
                if let Some(pod) = self.get(uid).filter(|pod| ready(pod)) {
                    return Some(pod);
                }
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                _ => return None,
            }
        }
    }

    fn bump(&self) {
        self.version
            .send_modify(|v| *v = Some(v.map_or(0, |n| n.wrapping_add(1))));
    }

    /// Tests: a synced index of `node` holding these pods (UID, namespace,
    /// service account), each with one container, `containerd://c`.
    #[cfg(test)]
    pub(crate) fn synced_with(node: &str, pods: &[(&str, &str, &str)]) -> Arc<Self> {
        let index = Self::new(node);
        let pods: Vec<Pod> = pods
            .iter()
            .map(|(uid, namespace, service_account)| test_pod(uid, namespace, service_account))
            .collect();
        index.replace(&pods);
        index
    }

    /// Tests: the watch reports one more pod (as [`NodePods::synced_with`]).
    #[cfg(test)]
    pub(crate) fn add_pod(&self, uid: &str, namespace: &str, service_account: &str) {
        self.apply(&test_pod(uid, namespace, service_account));
    }

    /// Tests: the kubelet reports one more container of pod `uid`.
    #[cfg(test)]
    pub(crate) fn add_container(&self, uid: &str, container: &str) {
        if let Some(pod) = self
            .by_uid
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(uid)
        {
            pod.containers.push(container.to_string());
        }
        self.bump();
    }

    fn replace(&self, pods: &[Pod]) {
        let map = pods.iter().filter_map(entry).collect();
        *self.by_uid.write().unwrap_or_else(|e| e.into_inner()) = map;
        self.bump();
    }

    /// A pod added or changed; one that has finished is forgotten, as a
    /// new listing would (its containers are gone, its UID attests
    /// nothing any more).
    fn apply(&self, pod: &Pod) {
        match entry(pod) {
            Some((uid, info)) => {
                self.by_uid
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(uid, info);
                self.bump();
            }
            None => self.delete(pod),
        }
    }

    fn delete(&self, pod: &Pod) {
        if let Some(uid) = pod.metadata.uid.as_ref() {
            self.by_uid
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .remove(uid);
            self.bump();
        }
    }
}

/// Tests: a running pod with one container, `containerd://c`.
#[cfg(test)]
fn test_pod(uid: &str, namespace: &str, service_account: &str) -> Pod {
    let mut pod = Pod::default();
    pod.metadata.uid = Some(uid.to_string());
    pod.metadata.namespace = Some(namespace.to_string());
    pod.metadata.name = Some(format!("pod-{uid}"));
    pod.spec = Some(k8s_openapi::api::core::v1::PodSpec {
        service_account_name: Some(service_account.to_string()),
        ..Default::default()
    });
    pod.status = Some(k8s_openapi::api::core::v1::PodStatus {
        container_statuses: Some(vec![k8s_openapi::api::core::v1::ContainerStatus {
            name: "app".into(),
            container_id: Some("containerd://c".into()),
            ..Default::default()
        }]),
        ..Default::default()
    });
    pod
}

/// A pod's UID and what the agent keeps of it; `None` for pods without a
/// UID or namespace, or that have finished.
fn entry(pod: &Pod) -> Option<(String, NodePod)> {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded") | Some("Failed")) {
        return None;
    }
    let uid = pod.metadata.uid.clone()?;
    let service_account = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".to_string());
    let containers = pod
        .status
        .iter()
        .flat_map(|status| {
            [
                &status.container_statuses,
                &status.init_container_statuses,
                &status.ephemeral_container_statuses,
            ]
        })
        .flatten()
        .flatten()
        .filter_map(|c| c.container_id.as_deref())
        .map(|id| id.split_once("://").map_or(id, |(_, id)| id).to_string())
        .collect();
    Some((
        uid,
        NodePod {
            namespace: pod.metadata.namespace.clone()?,
            name: pod.metadata.name.clone().unwrap_or_default(),
            service_account,
            containers,
        },
    ))
}

/// Keeps `pods` current from a watch of its node's pods until dropped.
/// Failures (API down, watch expired) are retried as the CA retries its
/// watches ([`WatchRetry`]: 100 ms doubling to 2 s, a `410` re-listed at
/// once, one WARN line per 30 s), so the index is back within seconds of
/// the API server.
pub async fn watch_node_pods(client: kube::Client, pods: Arc<NodePods>) {
    let api: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={}", pods.node()));
    let stream = watcher::watcher(api, config);
    futures::pin_mut!(stream);
    let mut buffer: Vec<Pod> = Vec::new();
    let mut retry = WatchRetry::new("node pods");
    while let Some(event) = stream.next().await {
        retry.saw(&event);
        match event {
            Ok(Event::Init) => buffer.clear(),
            Ok(Event::InitApply(pod)) => buffer.push(pod),
            Ok(Event::InitDone) => {
                pods.replace(&buffer);
                tracing::info!(node = %pods.node(), pods = buffer.len(), "node pod index synced");
                buffer = Vec::new();
            }
            Ok(Event::Apply(pod)) => pods.apply(&pod),
            Ok(Event::Delete(pod)) => pods.delete(&pod),
            Err(e) => retry.failed(&e).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ContainerStatus, PodStatus};

    use super::*;

    fn status(name: &str, id: Option<&str>) -> ContainerStatus {
        ContainerStatus {
            name: name.into(),
            container_id: id.map(String::from),
            ..Default::default()
        }
    }

    #[test]
    fn a_pods_containers_are_every_kind_in_its_status_without_the_runtime() {
        let mut pod = Pod::default();
        pod.metadata.uid = Some("u1".into());
        pod.metadata.namespace = Some("ns".into());
        pod.status = Some(PodStatus {
            container_statuses: Some(vec![
                status("app", Some("containerd://abc")),
                status("starting", None),
            ]),
            init_container_statuses: Some(vec![status("init", Some("cri-o://def"))]),
            ephemeral_container_statuses: Some(vec![status("debug", Some("docker://123"))]),
            ..Default::default()
        });
        let (uid, pod) = entry(&pod).unwrap();
        assert_eq!(uid, "u1");
        assert_eq!(pod.containers, ["abc", "def", "123"]);
        assert!(pod.has_container("abc"));
        assert!(!pod.has_container("containerd://abc"));
        assert_eq!(pod.service_account, "default");
    }

    #[test]
    fn a_pod_that_finishes_is_forgotten() {
        let pods = NodePods::new("node-a");
        let mut pod = Pod::default();
        pod.metadata.uid = Some("u1".into());
        pod.metadata.namespace = Some("ns".into());
        pod.status = Some(PodStatus {
            phase: Some("Running".into()),
            ..Default::default()
        });
        pods.apply(&pod);
        assert!(pods.contains("u1"));
        if let Some(status) = pod.status.as_mut() {
            status.phase = Some("Succeeded".into());
        }
        pods.apply(&pod);
        assert!(!pods.contains("u1"), "its UID attests nothing any more");
    }
}
