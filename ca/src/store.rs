//! CA key material: where the signing certificate, its key, the chain and
//! the trust bundle come from (DESIGN §4.1).
//!
//! - [`load_ca_dir`]: a plugged-in CA in Istio's `cacerts` layout
//!   (`ca-cert.pem`, `ca-key.pem`, `cert-chain.pem`, `root-cert.pem`) or the
//!   Kubernetes TLS-secret layout (`tls.crt`, `tls.key`, `ca.crt`), checked
//!   before use: key matches certificate, CA bits, chain links to a root,
//!   every certificate inside its validity.
//! - [`load_or_create_data_dir`]: the embedded mode's self-signed root,
//!   generated on first start and reused after; never overwritten.

use std::fs;
use std::path::{Path, PathBuf};

use meshca_certs::bundle::{self, BundleError, FileError};
use meshca_certs::keys::{KeyAlgorithm, KeyError, PrivateKey};
use meshca_certs::profile::{self_signed_root, ProfileError, SigningCa, SubjectName, Validity};
use meshca_certs::token::{TokenError, TokenIssuer};
use meshca_certs::verify::{verify_ca_chain, VerifyError};
use meshca_certs::{TrustBundle, TrustDomain};
use time::OffsetDateTime;

/// `cacerts` file: the signing certificate.
pub const CA_CERT_FILE: &str = "ca-cert.pem";
/// `cacerts` file: the signing key.
pub const CA_KEY_FILE: &str = "ca-key.pem";
/// `cacerts` file: signing certificate up to the root.
pub const CERT_CHAIN_FILE: &str = "cert-chain.pem";
/// `cacerts` file (and data-dir file): the trusted roots.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
/// TLS-secret file: certificate (and chain).
pub const TLS_CERT_FILE: &str = "tls.crt";
/// TLS-secret file: key.
pub const TLS_KEY_FILE: &str = "tls.key";
/// TLS-secret file: roots.
pub const TLS_CA_FILE: &str = "ca.crt";

/// Lifetime of the embedded mode's self-signed root.
pub const SELF_SIGNED_ROOT_TTL: time::Duration = time::Duration::days(3650);

/// Why CA material could not be loaded or created. Each message names the
/// file and the problem.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A required file of a plugged-in CA is missing.
    #[error("{dir}: incomplete CA: {file} is missing (a plugged-in CA needs {needed})")]
    MissingFile {
        /// The CA directory.
        dir: PathBuf,
        /// The missing file.
        file: &'static str,
        /// The whole set that is needed.
        needed: &'static str,
    },
    /// The directory holds none of the CA files.
    #[error("{0}: no CA files found: expected ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem (or tls.crt, tls.key, ca.crt)")]
    NoCaFiles(PathBuf),
    /// A certificate file is unreadable or malformed.
    #[error(transparent)]
    CertFile(#[from] FileError),
    /// The key file is unreadable.
    #[error("{path}: {source}")]
    ReadKey {
        /// The key file.
        path: PathBuf,
        /// The read error.
        source: BundleError,
    },
    /// The key file holds no usable key.
    #[error("{path}: {source}")]
    Key {
        /// The key file.
        path: PathBuf,
        /// What is wrong.
        source: KeyError,
    },
    /// The certificate and key do not form a signing CA.
    #[error("{cert} with {key}: {source}")]
    NotSigningCa {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What is wrong.
        source: ProfileError,
    },
    /// The chain check failed.
    #[error("{dir}: CA chain check failed ({files}): {source}")]
    Chain {
        /// The CA directory.
        dir: PathBuf,
        /// The files the chain came from.
        files: String,
        /// What is wrong.
        source: VerifyError,
    },
    /// The data directory holds a certificate without its key or the reverse.
    #[error("{dir}: {present} exists but {missing} does not; refusing to generate a new root over a partial one (restore {missing} or move {present} aside)")]
    PartialDataDir {
        /// The data directory.
        dir: PathBuf,
        /// The file found.
        present: &'static str,
        /// The file missing.
        missing: &'static str,
    },
    /// The data directory could not be created.
    #[error("cannot create data directory {path}: {source}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Writing a file failed.
    #[error(transparent)]
    Write(#[from] BundleError),
    /// Generating the root failed.
    #[error("generating the self-signed root failed: {0}")]
    Generate(String),
    /// The local token issuer could not be loaded.
    #[error(transparent)]
    TokenIssuer(#[from] TokenError),
}

/// Where the CA material came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaSource {
    /// The embedded mode's self-signed root in this data directory.
    SelfSigned(PathBuf),
    /// A plugged-in CA directory.
    PluggedIn(PathBuf),
}

/// Everything the CA signs with, checked and ready.
#[derive(Debug)]
pub struct CaMaterial {
    /// The signing certificate and key.
    pub signing: SigningCa,
    /// The signing certificate and any intermediates above it, DER, without
    /// roots: what goes between the leaf and the root in a response.
    pub chain: Vec<Vec<u8>>,
    /// The root the chain is anchored at.
    pub anchor_root: Vec<u8>,
    /// Every trusted root (what clients should trust).
    pub bundle: TrustBundle,
    /// Where it came from.
    pub source: CaSource,
}

impl CaMaterial {
    /// The certificates after the leaf in a response, PEM, one per element:
    /// `[signing cert, intermediates..., root]`.
    pub fn response_tail_pem(&self) -> Vec<String> {
        self.chain
            .iter()
            .chain(std::iter::once(&self.anchor_root))
            .map(|der| bundle::encode_cert_pem(der))
            .collect()
    }
}

/// Loads and checks a plugged-in CA directory.
pub fn load_ca_dir(dir: &Path, now: OffsetDateTime) -> Result<CaMaterial, StoreError> {
    const ISTIO_SET: &str = "ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem";
    const TLS_SET: &str = "tls.crt, tls.key, ca.crt";
    let exists = |f: &str| dir.join(f).exists();
    let istio_files = [CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE];
    let tls_files = [TLS_CERT_FILE, TLS_KEY_FILE, TLS_CA_FILE];
    let (cert_file, key_file, chain_file, root_file) = if istio_files.iter().any(|f| exists(f)) {
        if let Some(missing) = istio_files.iter().find(|f| !exists(f)) {
            return Err(StoreError::MissingFile {
                dir: dir.to_path_buf(),
                file: missing,
                needed: ISTIO_SET,
            });
        }
        (
            CA_CERT_FILE,
            CA_KEY_FILE,
            Some(CERT_CHAIN_FILE),
            ROOT_CERT_FILE,
        )
    } else if tls_files.iter().any(|f| exists(f)) {
        if let Some(missing) = tls_files.iter().find(|f| !exists(f)) {
            return Err(StoreError::MissingFile {
                dir: dir.to_path_buf(),
                file: missing,
                needed: TLS_SET,
            });
        }
        (TLS_CERT_FILE, TLS_KEY_FILE, None, TLS_CA_FILE)
    } else {
        return Err(StoreError::NoCaFiles(dir.to_path_buf()));
    };

    let cert_path = dir.join(cert_file);
    let key_path = dir.join(key_file);
    let certs = bundle::read_certs_file(&cert_path)?;
    let key = read_key(&key_path)?;
    let roots = bundle::read_certs_file(&dir.join(root_file))?;
    let bundle = TrustBundle::new(roots);

    // The full chain: signing cert first, then whatever chain file says
    // (which usually repeats the signing cert and ends with the root).
    let mut full = vec![certs[0].clone()];
    let mut rest: Vec<Vec<u8>> = certs[1..].to_vec();
    if let Some(chain_file) = chain_file {
        let chain = bundle::read_certs_file(&dir.join(chain_file))?;
        rest.extend(chain);
    }
    for der in rest {
        if !full.contains(&der) {
            full.push(der);
        }
    }
    let files = match chain_file {
        Some(chain_file) => format!("{cert_file}, {chain_file}, {root_file}"),
        None => format!("{cert_file}, {root_file}"),
    };
    let signing =
        SigningCa::new(full[0].clone(), key).map_err(|source| StoreError::NotSigningCa {
            cert: cert_path.clone(),
            key: key_path.clone(),
            source,
        })?;
    let anchor_root = verify_ca_chain(&full, &bundle, now).map_err(|source| StoreError::Chain {
        dir: dir.to_path_buf(),
        files,
        source,
    })?;
    let chain: Vec<Vec<u8>> = full.into_iter().filter(|c| !bundle.contains(c)).collect();
    Ok(CaMaterial {
        signing,
        chain,
        anchor_root,
        bundle,
        source: CaSource::PluggedIn(dir.to_path_buf()),
    })
}

fn read_key(path: &Path) -> Result<PrivateKey, StoreError> {
    let text = bundle::read_text(path).map_err(|source| StoreError::ReadKey {
        path: path.to_path_buf(),
        source,
    })?;
    PrivateKey::from_pem(&text).map_err(|source| StoreError::Key {
        path: path.to_path_buf(),
        source,
    })
}

/// Loads the embedded mode's self-signed root from `dir`, creating the
/// directory, the root (ECDSA P-256, key 0600) and `root-cert.pem` on first
/// start. An existing root is never replaced.
pub fn load_or_create_data_dir(
    dir: &Path,
    trust_domain: &TrustDomain,
    now: OffsetDateTime,
) -> Result<CaMaterial, StoreError> {
    create_private_dir(dir)?;
    let cert_path = dir.join(CA_CERT_FILE);
    let key_path = dir.join(CA_KEY_FILE);
    match (cert_path.exists(), key_path.exists()) {
        (true, true) => {}
        (false, false) => {
            let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256)
                .map_err(|e| StoreError::Generate(e.to_string()))?;
            let name = SubjectName {
                organization: Some(trust_domain.to_string()),
                common_name: Some("meshca self-signed root CA".to_string()),
                ..Default::default()
            };
            let root =
                self_signed_root(&key, &name, Validity::backdated(now, SELF_SIGNED_ROOT_TTL))
                    .map_err(|e| StoreError::Generate(e.to_string()))?;
            // Key first: a crash between the two writes leaves a key
            // without a certificate, which the next start reports.
            bundle::write_file_atomic(
                &key_path,
                key.to_pkcs8_pem().as_bytes(),
                bundle::PRIVATE_KEY_MODE,
            )?;
            bundle::write_file_atomic(
                &cert_path,
                root.to_pem().as_bytes(),
                bundle::PUBLIC_FILE_MODE,
            )?;
            tracing::info!(
                dir = %dir.display(),
                serial = %root.serial_hex,
                not_after = %root.validity.not_after,
                "generated a new self-signed root CA"
            );
        }
        (true, false) => {
            return Err(StoreError::PartialDataDir {
                dir: dir.to_path_buf(),
                present: CA_CERT_FILE,
                missing: CA_KEY_FILE,
            })
        }
        (false, true) => {
            return Err(StoreError::PartialDataDir {
                dir: dir.to_path_buf(),
                present: CA_KEY_FILE,
                missing: CA_CERT_FILE,
            })
        }
    }
    let certs = bundle::read_certs_file(&cert_path)?;
    let key = read_key(&key_path)?;
    let root = certs[0].clone();
    let signing = SigningCa::new(root.clone(), key).map_err(|source| StoreError::NotSigningCa {
        cert: cert_path.clone(),
        key: key_path.clone(),
        source,
    })?;
    let bundle = TrustBundle::new(vec![root.clone()]);
    verify_ca_chain(std::slice::from_ref(&root), &bundle, now).map_err(|source| {
        StoreError::Chain {
            dir: dir.to_path_buf(),
            files: CA_CERT_FILE.to_string(),
            source,
        }
    })?;
    publish_bundle(dir, &bundle)?;
    Ok(CaMaterial {
        signing,
        chain: Vec::new(),
        anchor_root: root,
        bundle,
        source: CaSource::SelfSigned(dir.to_path_buf()),
    })
}

/// Writes `root-cert.pem` in `dir` if it differs from `bundle`.
pub fn publish_bundle(dir: &Path, bundle: &TrustBundle) -> Result<(), StoreError> {
    let path = dir.join(ROOT_CERT_FILE);
    let pem = bundle.to_pem();
    if fs::read_to_string(&path).ok().as_deref() != Some(pem.as_str()) {
        bundle::write_file_atomic(&path, pem.as_bytes(), bundle::PUBLIC_FILE_MODE)?;
    }
    Ok(())
}

/// Loads the local token issuer from the data directory, creating it on
/// first start.
pub fn load_or_create_token_issuer(dir: &Path) -> Result<TokenIssuer, StoreError> {
    create_private_dir(dir)?;
    let key_path = dir.join(meshca_certs::token::ISSUER_KEY_FILE);
    if key_path.exists() {
        let issuer = TokenIssuer::load(dir)?;
        // Re-publish the JWKS in case it was removed.
        let jwks_path = dir.join(meshca_certs::token::ISSUER_JWKS_FILE);
        if !jwks_path.exists() {
            issuer.save(dir)?;
        }
        return Ok(issuer);
    }
    let issuer = TokenIssuer::generate().map_err(|e| StoreError::Generate(e.to_string()))?;
    issuer.save(dir)?;
    tracing::info!(dir = %dir.display(), kid = issuer.kid(), "generated the local token issuer key");
    Ok(issuer)
}

fn create_private_dir(dir: &Path) -> Result<(), StoreError> {
    if dir.is_dir() {
        return Ok(());
    }
    let mut builder = fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder.create(dir).map_err(|source| StoreError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshca_certs::profile::SubjectKey;

    fn now() -> OffsetDateTime {
        OffsetDateTime::now_utc()
    }

    #[test]
    fn data_dir_is_created_once_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let td = TrustDomain::default();
        let first = load_or_create_data_dir(&data, &td, now()).unwrap();
        let second = load_or_create_data_dir(&data, &td, now()).unwrap();
        assert_eq!(first.anchor_root, second.anchor_root);
        assert!(first.chain.is_empty());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(data.join(CA_KEY_FILE))
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, 0o600);
        }
        let published = fs::read_to_string(data.join(ROOT_CERT_FILE)).unwrap();
        assert_eq!(published, first.bundle.to_pem());
    }

    #[test]
    fn data_dir_with_only_a_certificate_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let td = TrustDomain::default();
        load_or_create_data_dir(dir.path(), &td, now()).unwrap();
        fs::remove_file(dir.path().join(CA_KEY_FILE)).unwrap();
        let err = load_or_create_data_dir(dir.path(), &td, now()).unwrap_err();
        assert!(err.to_string().contains("ca-key.pem"), "{err}");
        // And nothing was overwritten.
        assert!(dir.path().join(CA_CERT_FILE).exists());
        assert!(!dir.path().join(CA_KEY_FILE).exists());
    }

    fn write_cacerts(dir: &Path) -> (Vec<u8>, Vec<u8>) {
        let root_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let root_name = SubjectName {
            common_name: Some("Root".into()),
            ..Default::default()
        };
        let root = self_signed_root(
            &root_key,
            &root_name,
            Validity::backdated(now(), time::Duration::days(10)),
        )
        .unwrap();
        let root_ca = SigningCa::new(root.der.clone(), root_key).unwrap();
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let int = root_ca
            .issue_ca(
                &SubjectKey::of(&key).unwrap(),
                &SubjectName {
                    common_name: Some("Int".into()),
                    ..Default::default()
                },
                Some(0),
                Validity::backdated(now(), time::Duration::days(5)),
            )
            .unwrap();
        fs::write(dir.join(CA_CERT_FILE), int.to_pem()).unwrap();
        fs::write(dir.join(CA_KEY_FILE), key.to_pkcs8_pem()).unwrap();
        fs::write(
            dir.join(CERT_CHAIN_FILE),
            format!("{}{}", int.to_pem(), root.to_pem()),
        )
        .unwrap();
        fs::write(dir.join(ROOT_CERT_FILE), root.to_pem()).unwrap();
        (int.der, root.der)
    }

    #[test]
    fn plugged_in_ca_loads_with_chain_and_root() {
        let dir = tempfile::tempdir().unwrap();
        let (int, root) = write_cacerts(dir.path());
        let m = load_ca_dir(dir.path(), now()).unwrap();
        assert_eq!(m.chain, vec![int]);
        assert_eq!(m.anchor_root, root);
        assert_eq!(m.response_tail_pem().len(), 2);
    }

    #[test]
    fn plugged_in_ca_problems_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        write_cacerts(dir.path());
        fs::remove_file(dir.path().join(CERT_CHAIN_FILE)).unwrap();
        let err = load_ca_dir(dir.path(), now()).unwrap_err().to_string();
        assert!(err.contains("cert-chain.pem is missing"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        write_cacerts(dir.path());
        fs::write(
            dir.path().join(CA_KEY_FILE),
            PrivateKey::generate(KeyAlgorithm::EcdsaP256)
                .unwrap()
                .to_pkcs8_pem(),
        )
        .unwrap();
        let err = load_ca_dir(dir.path(), now()).unwrap_err().to_string();
        assert!(
            err.contains("ca-key.pem") && err.contains("does not match"),
            "{err}"
        );

        let dir = tempfile::tempdir().unwrap();
        write_cacerts(dir.path());
        fs::write(dir.path().join(CA_CERT_FILE), "garbage").unwrap();
        let err = load_ca_dir(dir.path(), now()).unwrap_err().to_string();
        assert!(err.contains("ca-cert.pem"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        write_cacerts(dir.path());
        let later = now() + time::Duration::days(6);
        let err = load_ca_dir(dir.path(), later).unwrap_err().to_string();
        assert!(err.contains("expired"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let err = load_ca_dir(dir.path(), now()).unwrap_err().to_string();
        assert!(err.contains("no CA files"), "{err}");
    }
}
