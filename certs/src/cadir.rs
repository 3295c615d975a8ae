//! CA directories on disk: Istio's `cacerts` layout (`ca-cert.pem`,
//! `ca-key.pem`, `cert-chain.pem`, `root-cert.pem`), the Kubernetes
//! TLS-secret layout (`tls.crt`, `tls.key`, `ca.crt`), and the root layout
//! that `meshca-certs root-ca` writes (`root-cert.pem`, `root-key.pem`).
//!
//! [`load_ca_dir`] loads one and checks it before anything signs with it:
//! every file present, key matches certificate, every certificate a CA with
//! keyCertSign inside its validity, chain linked up to a root of the bundle.

use std::path::{Path, PathBuf};

use time::OffsetDateTime;

use crate::bundle::{self, BundleError, FileError};
use crate::keys::{KeyError, PrivateKey};
use crate::profile::{CaKey, ProfileError, SigningCa};
use crate::verify::{
    cas_without_key_usage, check_trust_roots, verify_ca_chain, TrustBundle, VerifyError,
};

/// `cacerts` file: the signing certificate.
pub const CA_CERT_FILE: &str = "ca-cert.pem";
/// `cacerts` file: the signing key.
pub const CA_KEY_FILE: &str = "ca-key.pem";
/// `cacerts` file: signing certificate up to the root.
pub const CERT_CHAIN_FILE: &str = "cert-chain.pem";
/// `cacerts` file: the trusted roots.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
/// Root layout: the root's key.
pub const ROOT_KEY_FILE: &str = "root-key.pem";
/// TLS-secret file: certificate (and chain).
pub const TLS_CERT_FILE: &str = "tls.crt";
/// TLS-secret file: key.
pub const TLS_KEY_FILE: &str = "tls.key";
/// TLS-secret file: roots.
pub const TLS_CA_FILE: &str = "ca.crt";

/// Why a CA directory could not be used. Each message names the file and
/// says the cause, which is therefore not also a `source()`.
#[derive(Debug, thiserror::Error)]
pub enum CaDirError {
    /// A required file is missing.
    #[error("{dir}: incomplete CA: {file} is missing (needed: {needed})")]
    MissingFile {
        /// The directory.
        dir: PathBuf,
        /// The missing file.
        file: &'static str,
        /// The whole set that is needed.
        needed: &'static str,
    },
    /// The directory does not exist, or is not a directory.
    #[error("{}: {problem}", dir.display())]
    NotADirectory {
        /// The path given.
        dir: PathBuf,
        /// "does not exist" or "is a file, not a directory".
        problem: &'static str,
    },
    /// A CA file is a symbolic link to nothing (a broken Secret mount).
    #[error("{} is a dangling symbolic link (to {}, which does not exist)", path.display(), target.display())]
    DanglingSymlink {
        /// The link.
        path: PathBuf,
        /// Where it points.
        target: PathBuf,
    },
    /// The directory holds none of the CA files.
    #[error("{0}: no CA files found: expected ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem (or tls.crt, tls.key, ca.crt; or root-cert.pem, root-key.pem)")]
    NoCaFiles(PathBuf),
    /// A certificate file is unreadable or malformed.
    #[error(transparent)]
    CertFile(#[from] FileError),
    /// The key file is unreadable (the read error names the file).
    #[error("{cause}")]
    ReadKey {
        /// The key file.
        path: PathBuf,
        /// The read error.
        cause: BundleError,
    },
    /// The key file holds no usable key.
    #[error("{}: {cause}", path.display())]
    Key {
        /// The key file.
        path: PathBuf,
        /// What is wrong.
        cause: KeyError,
    },
    /// The certificate and key do not form a signing CA.
    #[error("{} with {}: {cause}", cert.display(), key.display())]
    NotSigningCa {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What is wrong.
        cause: ProfileError,
    },
    /// A certificate of the roots file cannot be a trusted root.
    #[error("{}: {cause}: it cannot be a trusted root", path.display())]
    TrustRoot {
        /// The roots file.
        path: PathBuf,
        /// What is wrong, with the certificate's place in the file.
        cause: VerifyError,
    },
    /// A key file lies in a directory whose key is in an HSM.
    #[error("{}: the CA key is {key}, so this directory must hold certificates only: remove the key file (a copy of a key defeats keeping it in an HSM)", path.display())]
    KeyFileBesideHsmKey {
        /// The key file found.
        path: PathBuf,
        /// The HSM key's URI.
        key: String,
    },
    /// The chain check failed.
    #[error("{}: CA chain check failed ({files}): {cause}", dir.display())]
    Chain {
        /// The directory.
        dir: PathBuf,
        /// The files the chain came from.
        files: String,
        /// What is wrong.
        cause: VerifyError,
    },
}

/// A checked CA directory.
#[derive(Debug)]
pub struct LoadedCa {
    /// The signing certificate and key.
    pub signing: SigningCa,
    /// The signing certificate and intermediates above it (DER), no roots.
    pub chain: Vec<Vec<u8>>,
    /// The root the chain is anchored at.
    pub anchor_root: Vec<u8>,
    /// Every trusted root.
    pub bundle: TrustBundle,
    /// The file the signing certificate was read from.
    pub cert_file: PathBuf,
    /// Subjects of the CA certificates (chain and roots) without a keyUsage
    /// extension: accepted, and worth a warning
    /// ([`crate::verify::cas_without_key_usage`]).
    pub without_key_usage: Vec<String>,
}

/// Loads and checks a CA directory in any of the three layouts.
pub fn load_ca_dir(dir: &Path, now: OffsetDateTime) -> Result<LoadedCa, CaDirError> {
    load(dir, now, None)
}

/// Loads and checks a CA directory of certificates only, whose key is
/// `key` (in an HSM): Istio's layout without `ca-key.pem`
/// (`ca-cert.pem`, `cert-chain.pem`, `root-cert.pem`), the TLS layout
/// without `tls.key`, or `root-cert.pem` alone (the root's key is `key`;
/// with several roots, the one whose public key is `key`'s signs). A key
/// file in the directory is refused: it would be a second, copyable key.
/// `key_name` (the key's URI) stands for the key file in messages.
pub fn load_ca_dir_with_key(
    dir: &Path,
    now: OffsetDateTime,
    key: CaKey,
    key_name: &str,
) -> Result<LoadedCa, CaDirError> {
    load(dir, now, Some((key, key_name)))
}

fn load(
    dir: &Path,
    now: OffsetDateTime,
    given_key: Option<(CaKey, &str)>,
) -> Result<LoadedCa, CaDirError> {
    const ISTIO_SET: &str = "ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem";
    const TLS_SET: &str = "tls.crt, tls.key, ca.crt";
    const ROOT_SET: &str = "root-cert.pem, root-key.pem";
    const ISTIO_CERTS: &str = "ca-cert.pem, cert-chain.pem, root-cert.pem (the key in the HSM)";
    const TLS_CERTS: &str = "tls.crt, ca.crt (the key in the HSM)";
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(CaDirError::NotADirectory {
                dir: dir.to_path_buf(),
                problem: "is a file, not a directory",
            })
        }
        Err(_) => {
            return Err(CaDirError::NotADirectory {
                dir: dir.to_path_buf(),
                problem: "no such directory",
            })
        }
    }
    // A link to nothing counts as present, so that reading it says what it is.
    let exists = |f: &str| dir.join(f).symlink_metadata().is_ok();
    let require = |files: &[&'static str], needed: &'static str| -> Result<(), CaDirError> {
        for f in files {
            let path = dir.join(f);
            if path.symlink_metadata().is_ok() && !path.exists() {
                if let Ok(target) = std::fs::read_link(&path) {
                    return Err(CaDirError::DanglingSymlink { path, target });
                }
            }
        }
        match files.iter().find(|f| !exists(f)) {
            Some(missing) => Err(CaDirError::MissingFile {
                dir: dir.to_path_buf(),
                file: missing,
                needed,
            }),
            None => Ok(()),
        }
    };
    let istio_files = [CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE];
    let tls_files = [TLS_CERT_FILE, TLS_KEY_FILE, TLS_CA_FILE];
    if let Some((_, key_name)) = &given_key {
        if let Some(file) = [CA_KEY_FILE, TLS_KEY_FILE, ROOT_KEY_FILE]
            .into_iter()
            .find(|f| exists(f))
        {
            return Err(CaDirError::KeyFileBesideHsmKey {
                path: dir.join(file),
                key: key_name.to_string(),
            });
        }
    }
    let (cert_file, key_file, chain_file, root_file) = if given_key.is_some() {
        if exists(CA_CERT_FILE) || exists(CERT_CHAIN_FILE) {
            require(
                &[CA_CERT_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE],
                ISTIO_CERTS,
            )?;
            (CA_CERT_FILE, "", Some(CERT_CHAIN_FILE), ROOT_CERT_FILE)
        } else if exists(TLS_CERT_FILE) || exists(TLS_CA_FILE) {
            require(&[TLS_CERT_FILE, TLS_CA_FILE], TLS_CERTS)?;
            (TLS_CERT_FILE, "", None, TLS_CA_FILE)
        } else if exists(ROOT_CERT_FILE) {
            (ROOT_CERT_FILE, "", None, ROOT_CERT_FILE)
        } else {
            return Err(CaDirError::NoCaFiles(dir.to_path_buf()));
        }
    } else if istio_files.iter().any(|f| exists(f)) {
        require(
            &[CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE],
            ISTIO_SET,
        )?;
        (
            CA_CERT_FILE,
            CA_KEY_FILE,
            Some(CERT_CHAIN_FILE),
            ROOT_CERT_FILE,
        )
    } else if tls_files.iter().any(|f| exists(f)) {
        require(&tls_files, TLS_SET)?;
        (TLS_CERT_FILE, TLS_KEY_FILE, None, TLS_CA_FILE)
    } else if exists(ROOT_KEY_FILE) {
        require(&[ROOT_CERT_FILE, ROOT_KEY_FILE], ROOT_SET)?;
        (ROOT_CERT_FILE, ROOT_KEY_FILE, None, ROOT_CERT_FILE)
    } else {
        return Err(CaDirError::NoCaFiles(dir.to_path_buf()));
    };

    let cert_path = dir.join(cert_file);
    let (key, key_path) = match given_key {
        Some((key, name)) => (key, PathBuf::from(name)),
        None => {
            let key_path = dir.join(key_file);
            (CaKey::from(read_key(&key_path)?), key_path)
        }
    };
    let certs = bundle::read_certs_file(&cert_path)?;
    let roots = bundle::read_certs_file(&dir.join(root_file))?;
    // In the root layout the certificate file is the roots file. With
    // several roots in it (an operator's rotation), the root the key
    // belongs to signs, and the others are only trusted.
    let certs = if cert_file == root_file {
        let spki = key.public_key_spki_der();
        let own = certs.iter().find(|der| {
            x509_parser::parse_x509_certificate(der)
                .is_ok_and(|(_, cert)| cert.public_key().raw == spki.as_slice())
        });
        match own {
            Some(own) => vec![own.clone()],
            // None is the key's: the first is named in the mismatch error.
            None => certs,
        }
    } else {
        certs
    };
    let bundle = TrustBundle::new(roots);

    // The full chain: signing cert first, then whatever the chain file says
    // (which usually repeats the signing cert and ends with the root).
    // Which file each certificate of `full` came from, for messages.
    let mut full = vec![certs[0].clone()];
    let mut origin = vec![cert_file];
    let mut rest: Vec<(Vec<u8>, &str)> =
        certs[1..].iter().map(|c| (c.clone(), cert_file)).collect();
    if let Some(chain_file) = chain_file {
        rest.extend(
            bundle::read_certs_file(&dir.join(chain_file))?
                .into_iter()
                .map(|c| (c, chain_file)),
        );
    }
    for (der, file) in rest {
        if !full.contains(&der) {
            full.push(der);
            origin.push(file);
        }
    }
    let all_files = match chain_file {
        Some(chain_file) => format!("{cert_file}, {chain_file}, {root_file}"),
        None => format!("{cert_file}, {root_file}"),
    };
    // A rule broken by one certificate names the file it is in (a root
    // found only in the bundle is in the roots file).
    let files_for = |e: &VerifyError| match e {
        VerifyError::BadCa { index, .. } => origin
            .get(index.saturating_sub(1))
            .map_or(root_file.to_string(), |f| f.to_string()),
        _ => all_files.clone(),
    };
    let signing =
        SigningCa::with_key(full[0].clone(), key).map_err(|cause| CaDirError::NotSigningCa {
            cert: cert_path.clone(),
            key: key_path.clone(),
            cause,
        })?;
    let anchor_root = verify_ca_chain(&full, &bundle, now).map_err(|cause| CaDirError::Chain {
        dir: dir.to_path_buf(),
        files: files_for(&cause),
        cause,
    })?;
    check_trust_roots(&bundle, now).map_err(|cause| CaDirError::TrustRoot {
        path: dir.join(root_file),
        cause,
    })?;
    let mut without_key_usage = cas_without_key_usage(&full);
    for subject in cas_without_key_usage(bundle.roots()) {
        if !without_key_usage.contains(&subject) {
            without_key_usage.push(subject);
        }
    }
    let chain: Vec<Vec<u8>> = full.into_iter().filter(|c| !bundle.contains(c)).collect();
    Ok(LoadedCa {
        signing,
        chain,
        anchor_root,
        bundle,
        cert_file: cert_path,
        without_key_usage,
    })
}

/// Reads a private key file; errors name the file.
pub fn read_key(path: &Path) -> Result<PrivateKey, CaDirError> {
    let text = bundle::read_text(path).map_err(|cause| CaDirError::ReadKey {
        path: path.to_path_buf(),
        cause,
    })?;
    PrivateKey::from_pem(&text).map_err(|cause| CaDirError::Key {
        path: path.to_path_buf(),
        cause,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::KeyAlgorithm;
    use crate::profile::{self_signed_root, IssuedCert, SubjectKey, SubjectName, Validity};

    fn name(cn: &str) -> SubjectName {
        SubjectName {
            common_name: Some(cn.into()),
            ..Default::default()
        }
    }

    #[test]
    fn a_missing_directory_or_a_file_is_named_as_such() {
        let now = OffsetDateTime::now_utc();
        let err = load_ca_dir(Path::new("/nonexistent-dir"), now)
            .unwrap_err()
            .to_string();
        assert_eq!(err, "/nonexistent-dir: no such directory");
        let file = tempfile::NamedTempFile::new().unwrap();
        let err = load_ca_dir(file.path(), now).unwrap_err().to_string();
        assert!(err.ends_with("is a file, not a directory"), "{err}");
        #[cfg(unix)]
        {
            let dir = tempfile::tempdir().unwrap();
            for f in [CA_CERT_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE] {
                std::fs::write(dir.path().join(f), "").unwrap();
            }
            std::os::unix::fs::symlink(
                dir.path().join("..data/ca-key.pem"),
                dir.path().join(CA_KEY_FILE),
            )
            .unwrap();
            let err = load_ca_dir(dir.path(), now).unwrap_err().to_string();
            assert!(
                err.contains("ca-key.pem is a dangling symbolic link"),
                "{err}"
            );
        }
    }

    /// A CA under a pathLen:0 intermediate, in the cacerts layout.
    #[test]
    fn a_ca_its_chain_forbids_is_refused_naming_the_file_and_the_constraint() {
        let now = OffsetDateTime::now_utc();
        let validity = Validity::backdated(now, time::Duration::days(30));
        let (_, root_cert, int_key, int_cert) = root_and_intermediate(now, Some(0));
        let int = SigningCa::new(int_cert.der.clone(), int_key).unwrap();
        let sub_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let sub_cert = int
            .issue_ca(
                &SubjectKey::of(&sub_key).unwrap(),
                &name("Sub"),
                Some(0),
                validity,
            )
            .unwrap();

        let dir = tempfile::tempdir().unwrap();
        let write = |file: &str, text: String| std::fs::write(dir.path().join(file), text).unwrap();
        write(CA_CERT_FILE, sub_cert.to_pem());
        write(CA_KEY_FILE, sub_key.to_pkcs8_pem().to_string());
        write(
            CERT_CHAIN_FILE,
            bundle::encode_certs_pem(&[&sub_cert.der, &int_cert.der, &root_cert.der]),
        );
        write(ROOT_CERT_FILE, root_cert.to_pem());
        let err = load_ca_dir(dir.path(), now).unwrap_err();
        assert!(matches!(err, CaDirError::Chain { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("(cert-chain.pem)")
                && text.contains("CN=Int")
                && text.contains("pathLenConstraint is 0"),
            "{text}"
        );

        // The intermediate itself loads, and has no room for a sub-CA.
        write(CA_CERT_FILE, int_cert.to_pem());
        write(CA_KEY_FILE, int.key().software().unwrap().to_pkcs8_pem());
        write(
            CERT_CHAIN_FILE,
            bundle::encode_certs_pem(&[&int_cert.der, &root_cert.der]),
        );
        let loaded = load_ca_dir(dir.path(), now).unwrap();
        assert_eq!(loaded.cert_file, dir.path().join(CA_CERT_FILE));
        assert!(crate::verify::check_room_for_sub_ca(&loaded.chain).is_err());
    }

    /// A root ("Root") and an intermediate ("Int", `path_len`) under it,
    /// both valid for 30 days from `now`: the root, its certificate, the
    /// intermediate's key and certificate.
    fn root_and_intermediate(
        now: OffsetDateTime,
        path_len: Option<u8>,
    ) -> (SigningCa, IssuedCert, PrivateKey, IssuedCert) {
        let validity = Validity::backdated(now, time::Duration::days(30));
        let root_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let root_cert = self_signed_root(&root_key, &name("Root"), validity).unwrap();
        let root = SigningCa::new(root_cert.der.clone(), root_key).unwrap();
        let int_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let int_cert = root
            .issue_ca(
                &SubjectKey::of(&int_key).unwrap(),
                &name("Int"),
                path_len,
                validity,
            )
            .unwrap();
        (root, root_cert, int_key, int_cert)
    }

    /// A root set and its intermediate in the cacerts layout, in `dir`.
    fn write_istio_set(dir: &Path, now: OffsetDateTime) -> (SigningCa, IssuedCert) {
        let (root, root_cert, int_key, int_cert) = root_and_intermediate(now, None);
        let write = |file: &str, text: String| std::fs::write(dir.join(file), text).unwrap();
        write(CA_CERT_FILE, int_cert.to_pem());
        write(CA_KEY_FILE, int_key.to_pkcs8_pem().to_string());
        write(
            CERT_CHAIN_FILE,
            bundle::encode_certs_pem(&[&int_cert.der, &root_cert.der]),
        );
        write(ROOT_CERT_FILE, root_cert.to_pem());
        (root, root_cert)
    }

    #[test]
    fn a_leaf_or_an_expired_certificate_among_the_roots_is_refused_naming_the_roots_file() {
        let now = OffsetDateTime::now_utc();
        let dir = tempfile::tempdir().unwrap();
        let (root, root_cert) = write_istio_set(dir.path(), now);
        assert!(load_ca_dir(dir.path(), now).is_ok(), "the set itself loads");

        // A workload's certificate appended to root-cert.pem.
        let leaf_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let leaf = root
            .issue_workload(
                &SubjectKey::of(&leaf_key).unwrap(),
                &crate::spiffe::SpiffeId::parse("spiffe://cluster.local/ns/a/sa/b").unwrap(),
                Validity::backdated(now, time::Duration::hours(1)),
            )
            .unwrap();
        let roots_file = dir.path().join(ROOT_CERT_FILE);
        std::fs::write(
            &roots_file,
            bundle::encode_certs_pem(&[&root_cert.der, &leaf.der]),
        )
        .unwrap();
        let err = load_ca_dir(dir.path(), now).unwrap_err();
        assert!(matches!(err, CaDirError::TrustRoot { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.starts_with(&roots_file.display().to_string())
                && text.contains("certificate #2")
                && text.contains("not a CA")
                && text.ends_with("it cannot be a trusted root"),
            "{text}"
        );

        // An old root that has expired.
        let old_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let expired = Validity {
            not_before: now - time::Duration::days(30),
            not_after: now - time::Duration::days(1),
        };
        let old_root = self_signed_root(&old_key, &name("Old root"), expired).unwrap();
        std::fs::write(
            &roots_file,
            bundle::encode_certs_pem(&[&root_cert.der, &old_root.der]),
        )
        .unwrap();
        let text = load_ca_dir(dir.path(), now).unwrap_err().to_string();
        assert!(
            text.contains("certificate #2 (CN=Old root)") && text.contains("expired at"),
            "{text}"
        );
    }

    #[test]
    fn a_ca_without_key_usage_loads_and_is_named_for_a_warning() {
        let now = OffsetDateTime::now_utc();
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "No key usage");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.not_before = now - time::Duration::days(1);
        params.not_after = now + time::Duration::days(30);
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = params.self_signed(&key).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(ROOT_CERT_FILE), cert.pem()).unwrap();
        std::fs::write(dir.path().join(ROOT_KEY_FILE), key.serialize_pem()).unwrap();
        let loaded = load_ca_dir(dir.path(), now).unwrap();
        assert_eq!(
            loaded.without_key_usage,
            vec!["CN=No key usage".to_string()]
        );

        // Istio's own layout, made here, carries keyUsage: nothing to say.
        let dir = tempfile::tempdir().unwrap();
        write_istio_set(dir.path(), now);
        assert!(load_ca_dir(dir.path(), now)
            .unwrap()
            .without_key_usage
            .is_empty());
    }
}
