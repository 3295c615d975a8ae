//! Bearer tokens arrive from anyone who can open a connection: splitting,
//! decoding and checking one must never panic, never accept a token the
//! issuer did not sign, and never repeat the token in an error.
//!
//! The body is [`meshca_fuzz::token`] (`fuzz/src/lib.rs`), which
//! `cargo test --workspace` also runs over `fuzz/corpus/token/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshca_fuzz::token(data));
