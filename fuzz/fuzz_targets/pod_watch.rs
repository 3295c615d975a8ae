//! Pods as the node-agent pod index reads them from the Kubernetes API
//! (list items and watch events: JSON from the network). Indexing any
//! sequence of them must never panic, and the index must stay consistent:
//! a pod removed is gone, a pod listed is found. The index is internal to
//! `meshca-ca`, so the checks live there (`meshca_ca::fuzz_pod_events`).
//!
//! The body is [`meshca_fuzz::pod_watch`] (`fuzz/src/lib.rs`), which
//! `cargo test --workspace` also runs over `fuzz/corpus/pod_watch/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshca_fuzz::pod_watch(data));
