//! How fast a PKCS#11 key signs, alone: the limit of `meshca serve
//! --hsm-mode direct` (BENCHMARKS.md, "The CA key in an HSM").
//!
//! ```text
//! cargo run --release -p meshca-certs --features pkcs11 --example hsm_sign_rate -- URI [SECONDS] [THREADS]
//! ```
//!
//! Signs a 400-byte message (the size of a leaf's to-be-signed part) in a
//! loop on THREADS threads (default 4, one session each) for SECONDS
//! (default 5) and prints the signatures per second.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshca_certs::pkcs11::{HsmKey, Pkcs11Uri, SessionLimits};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let uri: Pkcs11Uri = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: hsm_sign_rate URI [SECONDS] [THREADS]"))?
        .parse()?;
    let seconds: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(5);
    let threads: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(4);
    let key = Arc::new(HsmKey::open(
        &uri,
        SessionLimits {
            max_sessions: threads,
            max_waiting: threads,
        },
    )?);
    let message = [0x5au8; 400];
    let count = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds);
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let (key, count) = (key.clone(), count.clone());
            std::thread::spawn(move || -> anyhow::Result<()> {
                while Instant::now() < end {
                    key.sign_message(&message)?;
                    count.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    for w in workers {
        w.join()
            .map_err(|_| anyhow::anyhow!("a signing thread panicked"))??;
    }
    let secs = start.elapsed().as_secs_f64();
    let n = count.load(Ordering::Relaxed);
    println!(
        "{} key, {threads} sessions: {n} signatures in {secs:.1} s = {:.0}/s",
        key.kind(),
        n as f64 / secs
    );
    Ok(())
}
