//! Pods as the node-agent pod index reads them from the Kubernetes API
//! (list items and watch events: JSON from the network). Indexing any
//! sequence of them must never panic, and the index must stay consistent:
//! a pod removed is gone, a pod listed is found.
#![no_main]

use k8s_openapi::api::core::v1::Pod;
use libfuzzer_sys::fuzz_target;
use meshca_ca::authz::node_agent::PodIndex;

fuzz_target!(|data: &[u8]| {
    // One JSON document per line: a pod, applied; a line starting with
    // '-' deletes the pod that follows; a line starting with '=' replaces
    // the index with the list that follows.
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
});
