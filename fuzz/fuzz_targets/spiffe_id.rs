//! SPIFFE IDs arrive in CSR SANs and in request metadata.
//!
//! The body is [`meshca_fuzz::spiffe_id`] (`fuzz/src/lib.rs`), which
//! `cargo test --workspace` also runs over `fuzz/corpus/spiffe_id/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshca_fuzz::spiffe_id(data));
