//! CA key material: where the signing certificate, its key, the chain and
//! the trust bundle come from (docs/ca-material.md, "Using your own CA";
//! docs/cluster.md).
//!
//! - `load_ca_dir`: a plugged-in CA in Istio's `cacerts` layout
//!   (`ca-cert.pem`, `ca-key.pem`, `cert-chain.pem`, `root-cert.pem`) or the
//!   Kubernetes TLS-secret layout (`tls.crt`, `tls.key`, `ca.crt`), checked
//!   before use: key matches certificate, CA bits, chain links to a root,
//!   every certificate inside its validity.
//! - [`load_or_create_data_dir`]: the embedded mode's self-signed root,
//!   generated on first start and reused after; never overwritten.

use std::fs;
use std::path::{Path, PathBuf};

use meshca_certs::bundle::{self, BundleError, FileError};
use meshca_certs::cadir::{self, CaDirError};
use meshca_certs::keys::{KeyAlgorithm, PrivateKey};
use meshca_certs::profile::{self_signed_root, IssuedCert, SigningCa, SubjectName, Validity};
use meshca_certs::token::{TokenError, TokenIssuer};
use meshca_certs::verify::verify_ca_chain;
use meshca_certs::{TrustBundle, TrustDomain};
use time::OffsetDateTime;

pub(crate) use meshca_certs::cadir::{
    CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE, TLS_CA_FILE, TLS_CERT_FILE,
    TLS_KEY_FILE,
};

/// Why CA material could not be loaded or created. Each message names the
/// file and the problem.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The CA directory (or the data directory's root) is unusable.
    #[error(transparent)]
    CaDir(#[from] CaDirError),
    /// The HSM key (`--ca-key-pkcs11`) cannot be used: the message names
    /// the URI, never the PIN.
    #[error(transparent)]
    Hsm(meshca_certs::pkcs11::Pkcs11Error),
    /// The HSM key could not sign.
    #[error("{cause}")]
    HsmSigning {
        /// The key's URI.
        uri: String,
        /// What went wrong.
        cause: String,
    },
    /// A certificate file is unreadable or malformed.
    #[error(transparent)]
    CertFile(#[from] FileError),
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
    #[error("cannot create data directory {path}: {cause}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
    /// Writing a file failed.
    #[error(transparent)]
    Write(#[from] BundleError),
    /// Generating the root failed.
    #[error("generating the self-signed root failed: {0}")]
    Generate(String),
    /// The data directory holds only `root-cert.pem` (its key in an HSM)
    /// and no `--ca-key-pkcs11` was given.
    #[error("{}: holds root-cert.pem but no ca-key.pem: its root's key is in an HSM; start with --ca-key-pkcs11 URI (or move root-cert.pem aside to make a new root, which every workload must then trust)", dir.display())]
    HsmDataDir {
        /// The data directory.
        dir: PathBuf,
    },
    /// `--ca-key-pkcs11` in cluster mode without `--ca-dir`.
    #[error("--ca-key-pkcs11 in a cluster needs --ca-dir DIR holding the CA's certificates only (e.g. a Secret or ConfigMap with root-cert.pem, mounted there, made by meshca-certs root-ca --pkcs11): the CA Secret meshca creates holds a key made in memory, and its automatic root rotation would make another one outside the HSM")]
    HsmInClusterNeedsCaDir,
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
    /// A self-signed root kept in a Kubernetes Secret.
    Secret {
        /// The Secret's namespace.
        namespace: String,
        /// The Secret's name.
        name: String,
    },
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
    /// The elements after the leaf in a response, PEM: one per certificate
    /// of the chain (`signing cert, intermediates...`), then one element
    /// holding every root of the bundle, the anchor first (see
    /// [`meshca_certs::answer`]: Istio's clients trust only that element).
    pub(crate) fn response_tail_pem(&self) -> Vec<String> {
        meshca_certs::answer::encode_tail(&self.chain, &self.anchor_root, &self.bundle)
    }
}

/// Loads and checks a plugged-in CA directory.
pub(crate) fn load_ca_dir(dir: &Path, now: OffsetDateTime) -> Result<CaMaterial, StoreError> {
    let loaded = cadir::load_ca_dir(dir, now)?;
    for subject in &loaded.without_key_usage {
        tracing::warn!(
            dir = %dir.display(),
            certificate = %subject,
            "a CA certificate has no keyUsage extension: accepted (RFC 5280 allows it), \
             but strict verifiers such as `openssl verify -x509_strict` refuse the chains it signs"
        );
    }
    Ok(CaMaterial {
        signing: loaded.signing,
        chain: loaded.chain,
        anchor_root: loaded.anchor_root,
        bundle: loaded.bundle,
        source: CaSource::PluggedIn(dir.to_path_buf()),
    })
}

/// Makes a new self-signed root CA (ECDSA P-256, `O=<trust domain>`),
/// valid from `now` (backdated) for `ttl`.
pub fn generate_self_signed_root(
    trust_domain: &TrustDomain,
    ttl: time::Duration,
    now: OffsetDateTime,
) -> Result<(PrivateKey, IssuedCert), StoreError> {
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256)
        .map_err(|e| StoreError::Generate(e.to_string()))?;
    let root = self_signed_root_of(&key, trust_domain, ttl, now)?;
    Ok((key, root))
}

/// The self-signed root certificate of `key` (see
/// [`generate_self_signed_root`]).
fn self_signed_root_of(
    key: &PrivateKey,
    trust_domain: &TrustDomain,
    ttl: time::Duration,
    now: OffsetDateTime,
) -> Result<IssuedCert, StoreError> {
    self_signed_root(
        key,
        &self_signed_root_name(trust_domain),
        Validity::backdated(now, ttl),
    )
    .map_err(|e| StoreError::Generate(e.to_string()))
}

/// The subject of a self-signed root meshca makes: `O=<trust domain>,
/// CN=meshca self-signed root CA`.
pub(crate) fn self_signed_root_name(trust_domain: &TrustDomain) -> SubjectName {
    SubjectName {
        organization: Some(trust_domain.to_string()),
        common_name: Some("meshca self-signed root CA".to_string()),
        ..Default::default()
    }
}

/// Loads the embedded mode's self-signed root from `dir`, creating the
/// directory, the root (ECDSA P-256, key 0600, valid for `root_ttl`:
/// `--self-signed-root-ttl`) and `root-cert.pem` on first start. An
/// existing root is never replaced.
pub fn load_or_create_data_dir(
    dir: &Path,
    trust_domain: &TrustDomain,
    root_ttl: time::Duration,
    now: OffsetDateTime,
) -> Result<CaMaterial, StoreError> {
    create_private_dir(dir)?;
    let cert_path = dir.join(CA_CERT_FILE);
    let key_path = dir.join(CA_KEY_FILE);
    match (cert_path.exists(), key_path.exists()) {
        (true, true) => {}
        // root-cert.pem alone: the layout of a data directory whose root
        // key is in an HSM (`--ca-key-pkcs11`). A root of a file key made
        // over it would change the trust of every workload.
        (false, false) if dir.join(ROOT_CERT_FILE).exists() => {
            return Err(StoreError::HsmDataDir {
                dir: dir.to_path_buf(),
            })
        }
        (false, false) => {
            let (key, root) = generate_self_signed_root(trust_domain, root_ttl, now)?;
            // Key first: a crash between the two writes leaves a key
            // without a certificate, and the next start finishes with it.
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
                not_after = %meshca_certs::Rfc3339(root.validity.not_after),
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
        // A key and nothing published: a first start interrupted between
        // its two writes. The key never signed anything and nobody trusts
        // it yet; the start is finished with it (the key is kept).
        (false, true) if !dir.join(ROOT_CERT_FILE).exists() => {
            let key = cadir::read_key(&key_path)?;
            let root = self_signed_root_of(&key, trust_domain, root_ttl, now)?;
            bundle::write_file_atomic(
                &cert_path,
                root.to_pem().as_bytes(),
                bundle::PUBLIC_FILE_MODE,
            )?;
            tracing::warn!(
                dir = %dir.display(),
                serial = %root.serial_hex,
                "finished an interrupted first start: made the root certificate of the key it left"
            );
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
    let key = cadir::read_key(&key_path)?;
    let root = certs[0].clone();
    let signing = SigningCa::new(root.clone(), key).map_err(|cause| CaDirError::NotSigningCa {
        cert: cert_path.clone(),
        key: key_path.clone(),
        cause,
    })?;
    let bundle = TrustBundle::new(vec![root.clone()]);
    verify_ca_chain(std::slice::from_ref(&root), &bundle, now).map_err(|cause| {
        CaDirError::Chain {
            dir: dir.to_path_buf(),
            files: CA_CERT_FILE.to_string(),
            cause,
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
pub(crate) fn publish_bundle(dir: &Path, bundle: &TrustBundle) -> Result<(), StoreError> {
    let path = dir.join(ROOT_CERT_FILE);
    let pem = bundle.to_pem();
    if fs::read_to_string(&path).ok().as_deref() != Some(pem.as_str()) {
        bundle::write_file_atomic(&path, pem.as_bytes(), bundle::PUBLIC_FILE_MODE)?;
    }
    Ok(())
}

/// Loads the local token issuer from the data directory, creating it on
/// first start.
pub(crate) fn load_or_create_token_issuer(dir: &Path) -> Result<TokenIssuer, StoreError> {
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

/// Creates `dir` (mode 0700) unless it exists.
pub(crate) fn create_private_dir(dir: &Path) -> Result<(), StoreError> {
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
    builder.create(dir).map_err(|cause| StoreError::CreateDir {
        path: dir.to_path_buf(),
        cause,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshca_certs::profile::SubjectKey;

    const TEN_YEARS: time::Duration = time::Duration::days(3650);

    fn now() -> OffsetDateTime {
        OffsetDateTime::now_utc()
    }

    #[test]
    fn a_new_root_lives_the_lifetime_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let start = now();
        let material = load_or_create_data_dir(
            &dir.path().join("data"),
            &TrustDomain::default(),
            time::Duration::days(30),
            start,
        )
        .unwrap();
        let lives = material.signing.validity().not_after - start;
        assert!(
            (time::Duration::days(30) - lives).abs() < time::Duration::minutes(1),
            "{lives}"
        );
    }

    #[test]
    fn data_dir_is_created_once_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let td = TrustDomain::default();
        let first = load_or_create_data_dir(&data, &td, TEN_YEARS, now()).unwrap();
        let second = load_or_create_data_dir(&data, &td, TEN_YEARS, now()).unwrap();
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
        load_or_create_data_dir(dir.path(), &td, TEN_YEARS, now()).unwrap();
        fs::remove_file(dir.path().join(CA_KEY_FILE)).unwrap();
        let err = load_or_create_data_dir(dir.path(), &td, TEN_YEARS, now()).unwrap_err();
        assert!(err.to_string().contains("ca-key.pem"), "{err}");
        // And nothing was overwritten.
        assert!(dir.path().join(CA_CERT_FILE).exists());
        assert!(!dir.path().join(CA_KEY_FILE).exists());
    }

    #[test]
    fn a_data_dir_of_an_hsm_root_is_not_taken_over_by_a_file_key() {
        let dir = tempfile::tempdir().unwrap();
        let td = TrustDomain::default();
        fs::write(dir.path().join(ROOT_CERT_FILE), "the HSM key's root").unwrap();
        let err = load_or_create_data_dir(dir.path(), &td, TEN_YEARS, now()).unwrap_err();
        assert!(err.to_string().contains("--ca-key-pkcs11"), "{err}");
        assert!(!dir.path().join(CA_KEY_FILE).exists());
        assert_eq!(
            fs::read_to_string(dir.path().join(ROOT_CERT_FILE)).unwrap(),
            "the HSM key's root"
        );
    }

    #[test]
    fn an_interrupted_first_start_is_finished_with_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let td = TrustDomain::default();
        // The first start wrote its key and no more.
        let (key, _) = generate_self_signed_root(&td, TEN_YEARS, now()).unwrap();
        fs::write(dir.path().join(CA_KEY_FILE), key.to_pkcs8_pem()).unwrap();
        let material = load_or_create_data_dir(dir.path(), &td, TEN_YEARS, now()).unwrap();
        let kept = fs::read_to_string(dir.path().join(CA_KEY_FILE)).unwrap();
        assert_eq!(kept, key.to_pkcs8_pem().as_str(), "the key is kept");
        assert!(dir.path().join(ROOT_CERT_FILE).exists(), "and published");
        let again = load_or_create_data_dir(dir.path(), &td, TEN_YEARS, now()).unwrap();
        assert_eq!(again.anchor_root, material.anchor_root, "one root");
        // With a root already published, a missing certificate is refused.
        fs::remove_file(dir.path().join(CA_CERT_FILE)).unwrap();
        let err = load_or_create_data_dir(dir.path(), &td, TEN_YEARS, now()).unwrap_err();
        assert!(err.to_string().contains("ca-cert.pem"), "{err}");
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
    fn plugged_in_root_cert_with_several_roots_is_answered_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (int, root) = write_cacerts(dir.path());
        // An operator's own rotation: another root listed before ours.
        let other =
            generate_self_signed_root(&TrustDomain::default(), time::Duration::days(10), now())
                .unwrap()
                .1;
        fs::write(
            dir.path().join(ROOT_CERT_FILE),
            format!("{}{}", other.to_pem(), bundle::encode_cert_pem(&root)),
        )
        .unwrap();
        let m = load_ca_dir(dir.path(), now()).unwrap();
        let tail = m.response_tail_pem();
        assert_eq!(tail.len(), 2, "intermediate, then one element of roots");
        assert_eq!(bundle::parse_certs_pem(&tail[0]).unwrap(), vec![int]);
        assert_eq!(
            bundle::parse_certs_pem(&tail[1]).unwrap(),
            vec![root, other.der],
            "every root, the anchor first"
        );
    }

    #[test]
    fn a_root_layout_with_several_roots_signs_with_the_keys_root() {
        let td = TrustDomain::default();
        let (key, ours) = generate_self_signed_root(&td, time::Duration::days(10), now()).unwrap();
        let other = generate_self_signed_root(&td, time::Duration::days(10), now())
            .unwrap()
            .1;
        // Either order in root-cert.pem: the key's root signs.
        for (first, second) in [(&ours, &other), (&other, &ours)] {
            let dir = tempfile::tempdir().unwrap();
            fs::write(
                dir.path().join(ROOT_CERT_FILE),
                format!("{}{}", first.to_pem(), second.to_pem()),
            )
            .unwrap();
            fs::write(
                dir.path().join(meshca_certs::cadir::ROOT_KEY_FILE),
                key.to_pkcs8_pem(),
            )
            .unwrap();
            let m = load_ca_dir(dir.path(), now()).unwrap();
            assert_eq!(m.anchor_root, ours.der);
            assert!(m.chain.is_empty(), "a root signs: no chain above it");
            let tail = m.response_tail_pem();
            assert_eq!(tail.len(), 1, "one element: every root");
            assert_eq!(
                bundle::parse_certs_pem(&tail[0]).unwrap(),
                vec![ours.der.clone(), other.der.clone()],
                "every root, the signing one first"
            );
        }
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
