//! PEM bundles and keys come from files and from CA answers.
//!
//! The body is [`meshca_fuzz::pem`] (`fuzz/src/lib.rs`), which
//! `cargo test --workspace` also runs over `fuzz/corpus/pem/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshca_fuzz::pem(data));
