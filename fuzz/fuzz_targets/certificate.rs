//! Certificates arrive as client certificates and in CA answers: the SVID
//! checks and inspection must never panic.
//!
//! The body is [`meshca_fuzz::certificate`] (`fuzz/src/lib.rs`), which
//! `cargo test --workspace` also runs over `fuzz/corpus/certificate/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshca_fuzz::certificate(data));
