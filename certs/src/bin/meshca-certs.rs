//! `meshca-certs`: CA material and test credentials for meshca and Istio.
//!
//! Istio's `tools/certs` flow in one binary: a root, per-cluster
//! intermediates in the `cacerts` layout, offline workload SVIDs, tokens for
//! the embedded issuer, and inspection and verification of chains.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use meshca_certs::bundle::{self, read_certs_file};
use meshca_certs::cadir::{
    self, CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE, ROOT_KEY_FILE,
};
use meshca_certs::inspect::CertSummary;
use meshca_certs::profile::{
    self_signed_root, self_signed_root_with, SubjectKey, SubjectName, Validity,
};
use meshca_certs::token::{TokenIssuer, TokenRequest, DEFAULT_AUDIENCE};
use meshca_certs::verify::audit_svid_chain;
use meshca_certs::{parse_duration, KeyAlgorithm, PrivateKey, Rfc3339, SpiffeId, TrustBundle};
use time::OffsetDateTime;

#[path = "meshca-certs/hsm.rs"]
mod hsm;
#[path = "meshca-certs/revoke.rs"]
mod revoke;

/// CA material and test credentials for meshca and Istio.
#[derive(Parser)]
#[command(name = "meshca-certs", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Make a self-signed root CA: DIR/root-cert.pem and DIR/root-key.pem (0600).
    RootCa {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Key algorithm: ecdsa-p256, ecdsa-p384, rsa-2048, rsa-3072, rsa-4096.
        #[arg(long, default_value = "ecdsa-p256")]
        key: KeyAlgorithm,
        /// Lifetime in days.
        #[arg(long, default_value_t = 3650, value_parser = clap::value_parser!(u32).range(1..=36500))]
        days: u32,
        /// Organization (O=), 1 to 64 characters.
        #[arg(long, default_value = "Istio", value_parser = subject_attribute)]
        org: String,
        /// Common name (CN=), 1 to 64 characters.
        #[arg(long, default_value = "Root CA", value_parser = subject_attribute)]
        common_name: String,
        /// Make the key inside this PKCS#11 token (RFC 7512 URI, e.g.
        /// `pkcs11:token=meshca;object=root?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/etc/meshca/pin`):
        /// sensitive, not extractable, labelled by `object`; only
        /// root-cert.pem is written.
        #[arg(long, value_name = "URI")]
        pkcs11: Option<String>,
        /// Overwrite existing files, including the key.
        #[arg(long)]
        force: bool,
    },
    /// Make an intermediate CA for one cluster, in Istio's cacerts layout:
    /// OUT/CLUSTER/{ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem}.
    IntermediateCa {
        /// Directory of the root (root-cert.pem, root-key.pem).
        #[arg(long)]
        root: PathBuf,
        /// Cluster name (a directory under --out, and L= in the subject).
        #[arg(long)]
        cluster: String,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Key algorithm.
        #[arg(long, default_value = "ecdsa-p256")]
        key: KeyAlgorithm,
        /// Lifetime in days (never past the root's own expiry).
        #[arg(long, default_value_t = 730, value_parser = clap::value_parser!(u32).range(1..=36500))]
        days: u32,
        /// Organization (O=), 1 to 64 characters.
        #[arg(long, default_value = "Istio", value_parser = subject_attribute)]
        org: String,
        /// Make the intermediate's key inside this PKCS#11 token (RFC 7512
        /// URI); ca-key.pem is then not written.
        #[arg(long, value_name = "URI")]
        pkcs11: Option<String>,
        /// The root's key is in this PKCS#11 token (--root then holds
        /// root-cert.pem alone).
        #[arg(long, value_name = "URI")]
        root_pkcs11: Option<String>,
        /// Overwrite existing files, including the key.
        #[arg(long)]
        force: bool,
    },
    /// Issue a workload SVID offline: OUT/{cert-chain.pem, key.pem, root-cert.pem}.
    Workload {
        /// CA directory (cacerts layout, tls.crt/tls.key/ca.crt, or a root-ca directory).
        #[arg(long)]
        ca: PathBuf,
        /// The SPIFFE ID.
        #[arg(long)]
        spiffe_id: SpiffeId,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Key algorithm.
        #[arg(long, default_value = "ecdsa-p256")]
        key: KeyAlgorithm,
        /// Lifetime.
        #[arg(long, default_value = "24h", value_parser = parse_duration)]
        ttl: Duration,
        /// Overwrite existing files, including the key.
        #[arg(long)]
        force: bool,
    },
    /// Print a service-account token that `meshca serve` (embedded mode) accepts.
    Token {
        /// meshca's data directory (holds the local token issuer key).
        #[arg(long, default_value = "./meshca-data")]
        data_dir: PathBuf,
        /// Namespace of the service account.
        #[arg(long)]
        namespace: String,
        /// Name of the service account.
        #[arg(long)]
        service_account: String,
        /// Audience; repeatable.
        #[arg(long = "audience", default_value = DEFAULT_AUDIENCE)]
        audiences: Vec<String>,
        /// Lifetime, e.g. 10m, 1h.
        #[arg(long, default_value = "1h", value_parser = parse_duration)]
        ttl: Duration,
        /// Bind the token to a pod name (optional).
        #[arg(long)]
        pod_name: Option<String>,
        /// The bound pod's UID (optional).
        #[arg(long, default_value = "")]
        pod_uid: String,
    },
    /// Show every certificate in a PEM file: names, SPIFFE IDs, key, validity, CA bits.
    Inspect {
        /// PEM file (a chain or a bundle).
        file: PathBuf,
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
        /// Also show which certificate's key is this PKCS#11 key (RFC
        /// 7512 URI) and how the token protects it.
        #[arg(long, value_name = "URI")]
        pkcs11: Option<String>,
    },
    /// Verify an X509-SVID chain against a bundle under the SPIFFE rules.
    Verify {
        /// PEM bundle of trusted roots.
        #[arg(long)]
        bundle: PathBuf,
        /// PEM chain, leaf first.
        chain_file: PathBuf,
        /// The SPIFFE ID the leaf must carry.
        #[arg(long)]
        spiffe_id: Option<SpiffeId>,
    },
    /// Revoke a serial, a SPIFFE ID, a service account, a node or an
    /// intermediate: meshca refuses new certificates for it and lists its
    /// serials in its CRL.
    Revoke(revoke::RevokeArgs),
    /// The revocation list.
    Revocations {
        #[command(subcommand)]
        command: RevocationsCommand,
    },
}

#[derive(Subcommand)]
enum RevocationsCommand {
    /// Show the entries (and any that meshca cannot use).
    List(revoke::ListArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("meshca-certs: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let now = OffsetDateTime::now_utc();
    match cli.command {
        Command::RootCa {
            out,
            key,
            days,
            org,
            common_name,
            pkcs11,
            force,
        } => {
            check_out_dir("--out", &out)?;
            let cert_path = out.join(ROOT_CERT_FILE);
            let key_path = out.join(ROOT_KEY_FILE);
            refuse_overwrite(&[&key_path, &cert_path], force)?;
            let name = SubjectName {
                organization: Some(org),
                common_name: Some(common_name),
                ..Default::default()
            };
            let validity = Validity::backdated(now, time::Duration::days(days.into()));
            let Some(uri) = pkcs11 else {
                let key = PrivateKey::generate(key).context("generating the root key")?;
                let root = self_signed_root(&key, &name, validity)
                    .context("making the root certificate")?;
                create_dir(&out)?;
                write_key(&key_path, &key)?;
                write_public(&cert_path, &root.to_pem())?;
                remove_old_crl(&out)?;
                println!(
                    "wrote {} and {} (serial {}, valid until {})",
                    cert_path.display(),
                    key_path.display(),
                    root.serial_hex,
                    Rfc3339(root.validity.not_after)
                );
                return Ok(ExitCode::SUCCESS);
            };
            // A key file left from before would be a second key.
            if key_path.exists() {
                bail!(
                    "{} exists; the new root's key is to be in the token: remove the file or choose another --out",
                    key_path.display()
                );
            }
            let hsm_key = hsm::generate("--pkcs11", &uri, key)?;
            let root = self_signed_root_with(&hsm_key, &name, validity)
                .with_context(|| format!("making the root certificate with {uri}"))?;
            create_dir(&out)?;
            write_public(&cert_path, &root.to_pem())?;
            remove_old_crl(&out)?;
            println!(
                "wrote {} (serial {}, valid until {}); the key is in the token: {uri}",
                cert_path.display(),
                root.serial_hex,
                Rfc3339(root.validity.not_after)
            );
        }
        Command::IntermediateCa {
            root,
            cluster,
            out,
            key,
            days,
            org,
            pkcs11,
            root_pkcs11,
            force,
        } => {
            if cluster.is_empty()
                || cluster.contains(['/', '\\'])
                || cluster == "."
                || cluster == ".."
            {
                bail!("--cluster {cluster:?} must be a plain name (it becomes a directory under --out)");
            }
            // L= has an upper bound of 128 (RFC 5280 ub-locality-name).
            if cluster.chars().count() > 128 {
                bail!("--cluster is {} characters; it becomes L= in the subject, which RFC 5280 limits to 128", cluster.chars().count());
            }
            let root_ca = match &root_pkcs11 {
                None => load_signing(&root)?,
                Some(uri) => {
                    let key = hsm::open("--root-pkcs11", uri)?;
                    cadir::load_ca_dir_with_key(&root, now, key, uri)?
                }
            };
            // The new CA goes under the signing certificate: every
            // pathLenConstraint above must leave room for one more CA.
            let mut path = root_ca.chain.clone();
            if path.first().map(Vec::as_slice) != Some(root_ca.signing.cert_der()) {
                path.insert(0, root_ca.signing.cert_der().to_vec());
            }
            if !path.contains(&root_ca.anchor_root) {
                path.push(root_ca.anchor_root.clone());
            }
            if let Err(e) = meshca_certs::verify::check_room_for_sub_ca(&path) {
                bail!(
                    "--root {}: {} cannot sign an intermediate CA: {e} (use a root-ca directory, or a CA without pathlen:0, as --root)",
                    root.display(),
                    root_ca.cert_file.display()
                );
            }
            check_out_dir("--out", &out)?;
            let dir = out.join(&cluster);
            check_out_dir("--out", &dir)?;
            let paths =
                [CA_KEY_FILE, CA_CERT_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE].map(|f| dir.join(f));
            refuse_overwrite(&paths.iter().collect::<Vec<_>>(), force)?;
            if pkcs11.is_some() && paths[0].exists() {
                bail!(
                    "{} exists; the new intermediate's key is to be in the token: remove the file or choose another --out",
                    paths[0].display()
                );
            }
            let (key, subject) = match &pkcs11 {
                None => {
                    let key =
                        PrivateKey::generate(key).context("generating the intermediate key")?;
                    let subject = SubjectKey::of(&key).context("the intermediate key")?;
                    (Some(key), subject)
                }
                Some(uri) => {
                    let hsm_key = hsm::generate("--pkcs11", uri, key)?;
                    let subject = SubjectKey::from_spki_der(&hsm_key.public_key_spki_der())
                        .context("the intermediate key")?;
                    (None, subject)
                }
            };
            let name = SubjectName {
                organization: Some(org),
                locality: Some(cluster.clone()),
                common_name: Some("Intermediate CA".to_string()),
                ..Default::default()
            };
            let validity = Validity::backdated(now, time::Duration::days(days.into()))
                .capped_at(root_ca.signing.validity().not_after);
            let cert = root_ca
                .signing
                .issue_ca(&subject, &name, Some(0), validity)
                .context("signing the intermediate certificate")?;
            let mut chain = vec![cert.der.clone()];
            chain.extend(root_ca.chain.iter().cloned());
            chain.push(root_ca.anchor_root.clone());
            create_dir(&dir)?;
            if let Some(key) = &key {
                write_key(&paths[0], key)?;
            }
            write_public(&paths[1], &cert.to_pem())?;
            write_public(&paths[2], &bundle::encode_certs_pem(&chain))?;
            write_public(&paths[3], &root_ca.bundle.to_pem())?;
            remove_old_crl(&dir)?;
            let files = match &pkcs11 {
                None => "ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem".to_string(),
                Some(uri) => format!(
                    "ca-cert.pem, cert-chain.pem, root-cert.pem; the key is in the token: {uri}"
                ),
            };
            println!(
                "wrote {} ({files}; serial {}, valid until {})",
                dir.display(),
                cert.serial_hex,
                Rfc3339(cert.validity.not_after)
            );
        }
        Command::Workload {
            ca,
            spiffe_id,
            out,
            key,
            ttl,
            force,
        } => {
            if spiffe_id.path().is_empty() {
                bail!("--spiffe-id {spiffe_id} has no path; a workload ID looks like spiffe://cluster.local/ns/NS/sa/SA");
            }
            if ttl.is_zero() {
                bail!("--ttl must be more than zero");
            }
            let ca_loaded = load_signing(&ca)?;
            check_out_dir("--out", &out)?;
            let paths = ["key.pem", "cert-chain.pem", "root-cert.pem"].map(|f| out.join(f));
            refuse_overwrite(&paths.iter().collect::<Vec<_>>(), force)?;
            let key = PrivateKey::generate(key).context("generating the workload key")?;
            let ttl = time::Duration::try_from(ttl).context("--ttl is too long")?;
            let validity =
                Validity::backdated(now, ttl).capped_at(ca_loaded.signing.validity().not_after);
            let subject = SubjectKey::of(&key).context("the workload key")?;
            let cert = ca_loaded
                .signing
                .issue_workload(&subject, &spiffe_id, validity)
                .context("signing the workload certificate")?;
            let mut chain = vec![cert.der.clone()];
            chain.extend(ca_loaded.chain.iter().cloned());
            create_dir(&out)?;
            write_key(&paths[0], &key)?;
            write_public(&paths[1], &bundle::encode_certs_pem(&chain))?;
            write_public(&paths[2], &ca_loaded.bundle.to_pem())?;
            println!(
                "wrote {} (identity {spiffe_id}, serial {}, valid until {})",
                out.display(),
                cert.serial_hex,
                Rfc3339(cert.validity.not_after)
            );
        }
        Command::Token {
            data_dir,
            namespace,
            service_account,
            audiences,
            ttl,
            pod_name,
            pod_uid,
        } => {
            SpiffeId::for_workload(&Default::default(), &namespace, &service_account)
                .with_context(|| {
                    format!("--namespace {namespace:?} / --service-account {service_account:?}")
                })?;
            if ttl.is_zero() {
                bail!("--ttl must be more than zero");
            }
            let issuer = TokenIssuer::load(&data_dir).with_context(|| {
                // The advice helps only when the key is not there yet: a
                // key file that is there but unusable stops `meshca serve`
                // too.
                let missing = !data_dir.join(meshca_certs::token::ISSUER_KEY_FILE).exists();
                format!(
                    "loading the local token issuer from --data-dir {}{}",
                    data_dir.display(),
                    if missing {
                        format!(
                            " (start `meshca serve --data-dir {}` once to create it)",
                            data_dir.display()
                        )
                    } else {
                        String::new()
                    }
                )
            })?;
            let token = issuer.mint(
                &TokenRequest {
                    namespace,
                    service_account,
                    audiences,
                    ttl,
                    pod: pod_name.map(|name| meshca_certs::token::ObjectRef { name, uid: pod_uid }),
                },
                SystemTime::now(),
            )?;
            println!("{token}");
        }
        Command::Inspect { file, json, pkcs11 } => {
            let certs = read_certs_file(&file)?;
            let summaries: Vec<CertSummary> = certs
                .iter()
                .enumerate()
                .map(|(i, der)| {
                    CertSummary::from_der(der)
                        .with_context(|| format!("{}: certificate #{}", file.display(), i + 1))
                })
                .collect::<Result<_, _>>()?;
            // Which certificate (1-based) the token's key belongs to.
            let hsm = match &pkcs11 {
                None => None,
                Some(uri) => {
                    let (spki, protection) = hsm::protection("--pkcs11", uri)?;
                    let index = certs.iter().position(|der| {
                        x509_parser::parse_x509_certificate(der)
                            .is_ok_and(|(_, c)| c.public_key().raw == spki.as_slice())
                    });
                    Some((uri.clone(), index, protection))
                }
            };
            if json {
                let mut items: Vec<serde_json::Value> =
                    summaries.iter().map(|s| summary_json(s, now)).collect();
                if let Some((uri, Some(index), protection)) = &hsm {
                    if let Some(item) = items.get_mut(*index) {
                        item["key_pkcs11_uri"] = serde_json::json!(uri);
                        item["key_protection"] = serde_json::json!(protection);
                    }
                }
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({ "certificates": items }))?
                );
            } else {
                for (i, s) in summaries.iter().enumerate() {
                    print_summary(i + 1, s, now);
                    if let Some((uri, Some(index), protection)) = &hsm {
                        if *index == i {
                            println!("  key in HSM:   {uri} ({protection})");
                        }
                    }
                }
                if let Some((uri, None, _)) = &hsm {
                    println!("no certificate of {} has the key {uri}", file.display());
                }
            }
        }
        Command::Revoke(args) => revoke::revoke(args)?,
        Command::Revocations {
            command: RevocationsCommand::List(args),
        } => revoke::list(args)?,
        Command::Verify {
            bundle: bundle_file,
            chain_file,
            spiffe_id,
        } => {
            let roots = read_certs_file(&bundle_file)?;
            let chain = read_certs_file(&chain_file)?;
            let problems = audit_svid_chain(
                &chain,
                &TrustBundle::new(roots),
                SystemTime::now(),
                spiffe_id.as_ref(),
            );
            if problems.is_empty() {
                let leaf = CertSummary::from_der(&chain[0])?;
                println!(
                    "OK: {} is a valid X509-SVID for {} until {}",
                    chain_file.display(),
                    leaf.uris.first().map(String::as_str).unwrap_or("?"),
                    Rfc3339(leaf.not_after)
                );
            } else {
                for p in &problems {
                    println!("{}: {p}", chain_file.display());
                }
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn load_signing(dir: &Path) -> anyhow::Result<cadir::LoadedCa> {
    // The loader says whether the directory is missing or a file.
    Ok(cadir::load_ca_dir(dir, OffsetDateTime::now_utc())?)
}

/// RFC 5280's upper bound for CN= and O= (ub-common-name,
/// ub-organization-name).
const MAX_SUBJECT_ATTRIBUTE_CHARS: usize = 64;

/// Value parser of --org and --common-name: X.509 DirectoryStrings are
/// 1..64 characters for these (RFC 5280 appendix A); clap names the flag.
fn subject_attribute(text: &str) -> Result<String, String> {
    let chars = text.chars().count();
    if text.trim().is_empty() {
        return Err("must not be empty (X.509 subject attributes are at least 1 character)".into());
    }
    if chars > MAX_SUBJECT_ATTRIBUTE_CHARS {
        return Err(format!(
            "is {chars} characters; RFC 5280 allows at most {MAX_SUBJECT_ATTRIBUTE_CHARS}"
        ));
    }
    Ok(text.to_string())
}

/// Refuses an output path that exists but is not a directory, before any
/// key is made.
fn check_out_dir(flag: &str, dir: &Path) -> anyhow::Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => bail!("{flag} {} is a file, not a directory", dir.display()),
        _ => Ok(()),
    }
}

fn refuse_overwrite(paths: &[&PathBuf], force: bool) -> anyhow::Result<()> {
    if force {
        return Ok(());
    }
    if let Some(existing) = paths.iter().find(|p| p.exists()) {
        bail!(
            "{} already exists; refusing to overwrite CA material (pass --force to replace it)",
            existing.display()
        );
    }
    Ok(())
}

/// Removes a `ca-crl.pem` left in `dir` by the CA the new material
/// replaces (with `--force`): it is signed by that CA, and Istio (a
/// `cacerts` directory) or meshca (a data directory, until it signs its
/// own at start) would hand it on with the new CA.
fn remove_old_crl(dir: &Path) -> anyhow::Result<()> {
    let path = dir.join(meshca_certs::crl::CRL_FILE);
    match std::fs::remove_file(&path) {
        Ok(()) => {
            eprintln!(
                "removed {}: it was signed by the CA this replaces (meshca signs a new one when it starts with this material)",
                path.display()
            );
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing the old CA's {}", path.display())),
    }
}

fn create_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

fn write_key(path: &Path, key: &PrivateKey) -> anyhow::Result<()> {
    bundle::write_file_atomic(
        path,
        key.to_pkcs8_pem().as_bytes(),
        bundle::PRIVATE_KEY_MODE,
    )?;
    Ok(())
}

fn write_public(path: &Path, text: &str) -> anyhow::Result<()> {
    bundle::write_file_atomic(path, text.as_bytes(), bundle::PUBLIC_FILE_MODE)?;
    Ok(())
}

fn time_left(s: &CertSummary, now: OffsetDateTime) -> (i64, String) {
    let left = (s.not_after - now).whole_seconds();
    let text = if left <= 0 {
        format!("EXPIRED {} ago", rough_duration(left.unsigned_abs()))
    } else if now < s.not_before {
        format!(
            "NOT YET VALID, starts in {}",
            rough_duration((s.not_before - now).whole_seconds().unsigned_abs())
        )
    } else {
        format!("{} left", rough_duration(left.unsigned_abs()))
    };
    (left, text)
}

/// A duration as a person reads it: "3d 4h", "5h 12m", "42s".
fn rough_duration(secs: u64) -> String {
    let (d, h, m, s) = (
        secs / 86400,
        secs % 86400 / 3600,
        secs % 3600 / 60,
        secs % 60,
    );
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

fn summary_json(s: &CertSummary, now: OffsetDateTime) -> serde_json::Value {
    let (left, _) = time_left(s, now);
    let mut v = serde_json::to_value(s).unwrap_or_default();
    if let Some(obj) = v.as_object_mut() {
        obj.insert("spiffe_ids".into(), serde_json::json!(spiffe_ids(s)));
        obj.insert("seconds_left".into(), serde_json::json!(left));
        obj.insert("expired".into(), serde_json::json!(left <= 0));
    }
    v
}

fn spiffe_ids(s: &CertSummary) -> Vec<String> {
    s.uris
        .iter()
        .filter(|u| u.starts_with("spiffe://"))
        .cloned()
        .collect()
}

fn print_summary(index: usize, s: &CertSummary, now: OffsetDateTime) {
    let (_, left) = time_left(s, now);
    let or_none = |v: &[String]| {
        if v.is_empty() {
            "-".to_string()
        } else {
            v.join(", ")
        }
    };
    println!("Certificate #{index}");
    println!(
        "  Subject:        {}",
        if s.subject.is_empty() {
            "(empty)"
        } else {
            &s.subject
        }
    );
    println!("  Issuer:         {}", s.issuer);
    println!("  Serial:         {}", s.serial);
    println!("  SPIFFE IDs:     {}", or_none(&spiffe_ids(s)));
    let other_uris: Vec<String> = s
        .uris
        .iter()
        .filter(|u| !u.starts_with("spiffe://"))
        .cloned()
        .collect();
    if !other_uris.is_empty() {
        println!("  Other URIs:     {}", other_uris.join(", "));
    }
    println!("  DNS names:      {}", or_none(&s.dns_names));
    let ips: Vec<String> = s.ip_addresses.iter().map(|i| i.to_string()).collect();
    println!("  IP addresses:   {}", or_none(&ips));
    println!("  Key:            {}", s.key);
    println!("  Not before:     {}", Rfc3339(s.not_before));
    println!("  Not after:      {} ({left})", Rfc3339(s.not_after));
    let ca = match (s.is_ca, s.path_len) {
        (false, _) => "no".to_string(),
        (true, Some(n)) => format!("yes, path length {n}"),
        (true, None) => "yes".to_string(),
    };
    println!(
        "  CA:             {ca}{}",
        if s.self_signed { " (self-signed)" } else { "" }
    );
    println!("  Key usage:      {}", or_none(&s.key_usage));
    println!("  Ext key usage:  {}", or_none(&s.ext_key_usage));
    println!(
        "  Subject key ID: {}",
        s.subject_key_id.as_deref().unwrap_or("-")
    );
    println!(
        "  Auth. key ID:   {}",
        s.authority_key_id.as_deref().unwrap_or("-")
    );
}
