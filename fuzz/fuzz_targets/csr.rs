//! CSRs arrive from any authenticated caller: parsing and verifying one
//! must never panic, whatever the bytes.
//!
//! The body is [`meshca_fuzz::csr`] (`fuzz/src/lib.rs`), which
//! `cargo test --workspace` also runs over `fuzz/corpus/csr/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshca_fuzz::csr(data));
