//! Pods as the node-agent pod index reads them from the Kubernetes API
//! (list items and watch events: JSON from the network). Indexing any
//! sequence of them must never panic, and the index must stay consistent:
//! a pod removed is gone, a pod listed is found. The index is internal to
//! `meshca-ca`; the target's body lives there, built with `--cfg fuzzing`
//! (as cargo-fuzz builds).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    meshca_ca::fuzz_pod_events(data);
});
