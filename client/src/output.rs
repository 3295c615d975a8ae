//! Writing credentials to a directory with Istio's file names:
//! `cert-chain.pem` (leaf and intermediates), `key.pem` (0600) and
//! `root-cert.pem` (every root of the CA answer's last element: both roots
//! during a root rotation), each atomically.

use std::path::Path;

use meshca_certs::bundle::{self, BundleError};

use crate::issuer::Svid;

/// Chain file name.
pub const CERT_CHAIN_FILE: &str = "cert-chain.pem";
/// Key file name.
pub(crate) const KEY_FILE: &str = "key.pem";
/// Root bundle file name.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";

/// Writes the credentials into `dir` (created if needed). All three files
/// are written and synced first, then renamed into place back to back
/// (root, key, chain), so no reader sees half a file and the window in
/// which key and chain differ is two renames.
pub fn write_credentials(dir: &Path, svid: &Svid) -> Result<(), BundleError> {
    std::fs::create_dir_all(dir).map_err(|cause| BundleError::Write {
        path: dir.to_path_buf(),
        cause,
    })?;
    let root = bundle::stage_file(
        &dir.join(ROOT_CERT_FILE),
        svid.bundle.to_pem().as_bytes(),
        bundle::PUBLIC_FILE_MODE,
    )?;
    let key = bundle::stage_file(
        &dir.join(KEY_FILE),
        svid.key.to_pkcs8_pem().as_bytes(),
        bundle::PRIVATE_KEY_MODE,
    )?;
    let chain = bundle::stage_file(
        &dir.join(CERT_CHAIN_FILE),
        chain_pem(svid).as_bytes(),
        bundle::PUBLIC_FILE_MODE,
    )?;
    bundle::commit_all(vec![root, key, chain])
}

/// `cert-chain.pem`: every element of the CA's answer but the last (the
/// roots), as Istio's agent writes it; the leaf alone if that is all there is.
pub fn chain_pem(svid: &Svid) -> String {
    let n = svid.chain_pem.len();
    let keep = if n > 1 { n - 1 } else { n };
    svid.chain_pem[..keep].concat()
}
