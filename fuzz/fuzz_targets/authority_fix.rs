//! What a workload client sends the agent's socket, through the
//! `:authority` rewrite (`meshca-agent`'s `authority_fix`): any bytes after
//! the preface are an answer or an error, never a panic, its buffers
//! bounded; and the same bytes read as requests to encode (frames and
//! HPACK in, frames out) decode after the rewrite to the same headers but
//! `:authority`.
//!
//! The body is [`meshca_fuzz::authority_fix`] (`fuzz/src/lib.rs`), which
//! `cargo test --workspace` also runs over `fuzz/corpus/authority_fix/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| meshca_fuzz::authority_fix(data));
