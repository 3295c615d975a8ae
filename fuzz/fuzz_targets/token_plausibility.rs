//! The check every bearer token passes before it may cost a TokenReview
//! (`check_plausible`, `UnverifiedClaims::parse`): anyone who can open a
//! connection reaches it. It must never panic, never call a token
//! plausible whose own claims say otherwise, and never repeat the token
//! in its error.
//!
//! The body is [`meshca_fuzz::token_plausibility`] (`fuzz/src/lib.rs`), which
//! `cargo test --workspace` also runs over `fuzz/corpus/token_plausibility/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshca_fuzz::token_plausibility(data));
