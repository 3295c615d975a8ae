//! Writing credentials to a directory with Istio's file names:
//! `cert-chain.pem` (leaf and intermediates), `key.pem` (0600) and
//! `root-cert.pem` (the trust bundle), each atomically.

use std::path::Path;

use meshca_certs::bundle::{self, BundleError};

use crate::caclient::Svid;

/// Chain file name.
pub const CERT_CHAIN_FILE: &str = "cert-chain.pem";
/// Key file name.
pub const KEY_FILE: &str = "key.pem";
/// Root bundle file name.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";

/// Writes the credentials into `dir` (created if needed). The key is
/// written before the chain, so a reader that sees the new chain also sees
/// the new key.
pub fn write_credentials(dir: &Path, svid: &Svid) -> Result<(), BundleError> {
    std::fs::create_dir_all(dir).map_err(|source| BundleError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    // Istio's convention: the last element is the root; the rest is the chain.
    let chain_len = svid.chain_pem.len().saturating_sub(1).max(1);
    let chain: String = svid.chain_pem[..chain_len.min(svid.chain_pem.len())].concat();
    bundle::write_file_atomic(
        &dir.join(ROOT_CERT_FILE),
        svid.bundle.to_pem().as_bytes(),
        bundle::PUBLIC_FILE_MODE,
    )?;
    bundle::write_file_atomic(
        &dir.join(KEY_FILE),
        svid.key.to_pkcs8_pem().as_bytes(),
        bundle::PRIVATE_KEY_MODE,
    )?;
    bundle::write_file_atomic(
        &dir.join(CERT_CHAIN_FILE),
        chain.as_bytes(),
        bundle::PUBLIC_FILE_MODE,
    )?;
    Ok(())
}
