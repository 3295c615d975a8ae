//! Live reload of a plugged-in CA directory (docs/ca-material.md, "Using your own CA").
//!
//! The directory is checked every `--ca-dir-check-interval`. A change is
//! taken only once the files have stopped changing (two identical readings,
//! before and after loading), so a Kubernetes Secret volume's symlink swap,
//! or an operator copying files one by one, is never read half-way. The new
//! set goes through the same checks as at start; if it passes it is swapped
//! in (requests in flight finish with the old material), otherwise it is
//! refused with a log line, `/ready` and a metric say so, and the old
//! material keeps signing.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;

use crate::authority::Authority;
use crate::metrics::Metrics;
use crate::store::{
    self, CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE, TLS_CA_FILE, TLS_CERT_FILE,
    TLS_KEY_FILE,
};

/// A digest of the CA files' contents (missing files count as empty).
pub(crate) fn fingerprint(dir: &Path) -> Vec<u8> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for name in [
        CA_CERT_FILE,
        CA_KEY_FILE,
        CERT_CHAIN_FILE,
        ROOT_CERT_FILE,
        TLS_CERT_FILE,
        TLS_KEY_FILE,
        TLS_CA_FILE,
    ] {
        let contents = std::fs::read(dir.join(name)).unwrap_or_default();
        ctx.update(name.as_bytes());
        ctx.update(&(contents.len() as u64).to_be_bytes());
        ctx.update(&contents);
    }
    ctx.finish().as_ref().to_vec()
}

/// Watches `dir` and swaps new CA material into `authority` until dropped.
pub(crate) async fn watch_ca_dir(
    dir: PathBuf,
    authority: Arc<Authority>,
    metrics: Metrics,
    interval: Duration,
) {
    let mut last = fingerprint(&dir);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        ticker.tick().await;
        let before = fingerprint(&dir);
        if before == last {
            continue;
        }
        let loaded = store::load_ca_dir(&dir, OffsetDateTime::now_utc());
        if fingerprint(&dir) != before {
            // Still being written: look again at the next tick.
            continue;
        }
        last = before;
        match loaded {
            Ok(material) => {
                let current = authority.current();
                let unchanged = current.material.signing.cert_der() == material.signing.cert_der()
                    && current.material.chain == material.chain
                    && current.material.bundle.roots() == material.bundle.roots()
                    && current.material.signing.key().public_key_spki_der()
                        == material.signing.key().public_key_spki_der();
                if unchanged {
                    authority.set_refused(None);
                    continue;
                }
                tracing::info!(
                    dir = %dir.display(),
                    not_after = %meshca_certs::Rfc3339(material.signing.validity().not_after),
                    chain = material.chain.len(),
                    roots = material.bundle.roots().len(),
                    "the CA files changed: signing with the new set"
                );
                authority.replace(material);
                metrics.reloads_ok.inc();
            }
            Err(e) => {
                tracing::error!(
                    dir = %dir.display(),
                    error = %e,
                    "the CA files changed but the new set is refused; still signing with the previous set"
                );
                authority.set_refused(Some(format!("{}: {e}", dir.display())));
                metrics.reloads_refused.inc();
            }
        }
    }
}
