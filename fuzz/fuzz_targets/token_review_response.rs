//! The Kubernetes API server's answer to a TokenReview, as meshca reads
//! it (`caller_from_review`): JSON from the network. Reading it must never
//! panic, and an identity comes out only for an authenticated service
//! account whose answer echoes an accepted audience.
//!
//! The body is [`meshca_fuzz::token_review_response`] (`fuzz/src/lib.rs`), which
//! `cargo test --workspace` also runs over `fuzz/corpus/token_review_response/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshca_fuzz::token_review_response(data));
