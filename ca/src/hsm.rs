//! The CA key in an HSM (`--ca-key-pkcs11 URI`, README "Keeping the CA key
//! in an HSM").
//!
//! `--ca-dir` then holds certificates only; the key is a PKCS#11 key
//! ([`meshca_certs::pkcs11::HsmKey`]). Two modes:
//! - `intermediate` (default): at start and then every
//!   `--hsm-intermediate-ttl`/2 the HSM key signs an intermediate CA for a
//!   P-256 key made here and held only in memory (pathLen 0, lifetime the
//!   TTL, never past the HSM certificate's chain, and, unless
//!   `--hsm-name-constraint false`, a critical name constraint permitting
//!   URIs of the trust domain only).
//!   Leaves are signed by it at software speed; every answer carries it
//!   in the chain. If the HSM cannot sign the next one, the current one
//!   keeps signing until `--ca-expiry-margin` before it ends, with a
//!   warning in the log and on `/ready` and `meshca_hsm_unavailable` = 1.
//! - `direct`: every certificate is signed by the HSM key, at most
//!   `--hsm-sessions` at once, `--hsm-queue` callers waiting, the rest
//!   refused `RESOURCE_EXHAUSTED`.
//!
//! The directory is watched as a plain `--ca-dir` is (new certificates are
//! taken into use without a restart), and in intermediate mode a change
//! mints a new intermediate under them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use meshca_certs::cadir::{self, LoadedCa};
use meshca_certs::parse_duration;
use meshca_certs::pkcs11::{HsmKey, Pkcs11Uri, SessionLimits};
use meshca_certs::profile::{CaKey, SigningCa, SubjectKey, SubjectName, Validity};
use meshca_certs::{KeyAlgorithm, PrivateKey, TrustDomain};
use time::OffsetDateTime;

use crate::authority::Authority;
use crate::metrics::Metrics;
use crate::store::{CaMaterial, CaSource, StoreError};

/// How the HSM key is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HsmMode {
    /// The HSM key signs a short-lived in-memory intermediate, which signs
    /// the leaves.
    Intermediate,
    /// The HSM key signs every certificate.
    Direct,
}

/// Default lifetime of the in-memory intermediate.
pub const DEFAULT_INTERMEDIATE_TTL: &str = "24h";

/// The flags of the HSM key (`meshca serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct HsmArgs {
    /// The CA key is in a PKCS#11 token: an RFC 7512 URI naming the module,
    /// the token, the key and the PIN file, e.g.
    /// `pkcs11:token=meshca;object=ca?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/etc/meshca/pin`.
    /// --ca-dir then holds the certificates only.
    #[arg(
        long = "ca-key-pkcs11",
        env = "MESHCA_CA_KEY_PKCS11",
        value_name = "URI"
    )]
    pub(crate) ca_key_pkcs11: Option<String>,

    /// How the HSM key signs: `intermediate` (it signs a short-lived
    /// in-memory intermediate that signs the leaves) or `direct` (it signs
    /// every certificate).
    #[arg(
        long,
        env = "MESHCA_HSM_MODE",
        default_value = "intermediate",
        value_enum
    )]
    pub(crate) hsm_mode: HsmMode,

    /// Lifetime of the in-memory intermediate (intermediate mode); a new
    /// one is minted every half of it.
    #[arg(long, env = "MESHCA_HSM_INTERMEDIATE_TTL", default_value = DEFAULT_INTERMEDIATE_TTL, value_parser = parse_duration)]
    pub(crate) hsm_intermediate_ttl: Duration,

    /// Whether the intermediate carries a critical name constraint
    /// permitting URIs of the trust domain only (RFC 5280; OpenSSL,
    /// BoringSSL, Go and meshca's own verifier enforce it). On by default;
    /// `false` for meshes with rustls-webpki peers (ztunnel), which refuse
    /// every chain with a URI name constraint (docs/hsm.md).
    #[arg(long, env = "MESHCA_HSM_NAME_CONSTRAINT", default_value_t = true, action = clap::ArgAction::Set)]
    pub(crate) hsm_name_constraint: bool,

    /// PKCS#11 sessions signing at once.
    #[arg(long, env = "MESHCA_HSM_SESSIONS", default_value_t = SessionLimits::DEFAULT_SESSIONS)]
    pub(crate) hsm_sessions: usize,

    /// Callers waiting for a PKCS#11 session before more are refused
    /// (direct mode: `RESOURCE_EXHAUSTED`).
    #[arg(long, env = "MESHCA_HSM_QUEUE", default_value_t = SessionLimits::DEFAULT_WAITING)]
    pub(crate) hsm_queue: usize,
}

/// Why the HSM flags cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum HsmConfigError {
    /// The URI is not usable.
    #[error("--ca-key-pkcs11: {0}")]
    Uri(#[from] meshca_certs::pkcs11::UriError),
    /// The intermediate is renewed too late for the expiry margin.
    #[error("--hsm-intermediate-ttl ({ttl:?}) must be more than twice --ca-expiry-margin ({margin:?}): the intermediate is renewed at half its lifetime, which must come before signing stops")]
    TtlWithinMargin {
        /// --hsm-intermediate-ttl
        ttl: Duration,
        /// --ca-expiry-margin
        margin: Duration,
    },
    /// Zero sessions.
    #[error("--hsm-sessions must be at least 1")]
    ZeroSessions,
}

/// The HSM key's configuration, checked.
#[derive(Debug, Clone)]
pub(crate) struct HsmConfig {
    pub(crate) uri: Pkcs11Uri,
    pub(crate) mode: HsmMode,
    pub(crate) intermediate_ttl: Duration,
    pub(crate) name_constraint: bool,
    pub(crate) limits: SessionLimits,
    /// The key, once opened at start (the signing material and the task
    /// that renews it share it).
    opened: Arc<std::sync::Mutex<Option<Arc<HsmCa>>>>,
}

impl HsmConfig {
    /// The key with its certificates in `dir`, opened on the first call.
    pub(crate) fn open(
        &self,
        dir: &Path,
        trust_domain: &TrustDomain,
    ) -> Result<Arc<HsmCa>, StoreError> {
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ca) = opened.as_ref() {
            return Ok(ca.clone());
        }
        let ca = Arc::new(HsmCa::open(self, dir, trust_domain)?);
        *opened = Some(ca.clone());
        Ok(ca)
    }

    /// The embedded mode with the key in the HSM (`--ca-key-pkcs11`
    /// without `--ca-dir`, no cluster): the data directory `dir` holds the
    /// root certificate only, `root-cert.pem`. On first start (no
    /// `root-cert.pem`), the key the URI names self-signs a root valid for
    /// `root_ttl`; a key that is not in the token yet is made there first
    /// (ECDSA P-256, sensitive, not extractable, labelled by the URI's
    /// `object`). An existing root is never replaced, and never rotated
    /// automatically (README: "Keeping the CA key in an HSM").
    pub(crate) fn ensure_data_dir_root(
        &self,
        dir: &Path,
        trust_domain: &TrustDomain,
        root_ttl: time::Duration,
        now: OffsetDateTime,
    ) -> Result<(), StoreError> {
        crate::store::create_private_dir(dir)?;
        let cert_path = dir.join(crate::store::ROOT_CERT_FILE);
        if cert_path.exists() || dir.join(crate::store::CA_KEY_FILE).exists() {
            // Loaded (or refused, beside a key file) by HsmCa::open.
            return Ok(());
        }
        let key = match HsmKey::open(&self.uri, self.limits) {
            Ok(key) => key,
            Err(meshca_certs::pkcs11::Pkcs11Error::NoKey { .. }) => {
                let key = HsmKey::generate(&self.uri, KeyAlgorithm::EcdsaP256, self.limits)
                    .map_err(StoreError::Hsm)?;
                tracing::info!(uri = %self.uri, "made the root CA key in the token");
                key
            }
            Err(e) => return Err(StoreError::Hsm(e)),
        };
        let key = CaKey::External(Arc::new(key));
        let root = meshca_certs::profile::self_signed_root_with(
            &key,
            &crate::store::self_signed_root_name(trust_domain),
            Validity::backdated(now, root_ttl),
        )
        .map_err(|e| StoreError::HsmSigning {
            uri: self.uri.to_string(),
            cause: format!("{}: self-signing the root: {e}", self.uri),
        })?;
        meshca_certs::bundle::write_file_atomic(
            &cert_path,
            root.to_pem().as_bytes(),
            meshca_certs::bundle::PUBLIC_FILE_MODE,
        )?;
        tracing::info!(
            dir = %dir.display(),
            uri = %self.uri,
            serial = %root.serial_hex,
            not_after = %meshca_certs::Rfc3339(root.validity.not_after),
            "generated a new self-signed root CA with the HSM key"
        );
        Ok(())
    }

    /// The key, if [`HsmConfig::open`] opened it.
    pub(crate) fn opened(&self) -> Option<Arc<HsmCa>> {
        self.opened
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl HsmArgs {
    /// The checked configuration, or None without `--ca-key-pkcs11`.
    pub(crate) fn into_config(
        self,
        expiry_margin: Duration,
    ) -> Result<Option<HsmConfig>, HsmConfigError> {
        let Some(text) = self.ca_key_pkcs11.filter(|t| !t.trim().is_empty()) else {
            return Ok(None);
        };
        let uri: Pkcs11Uri = text.trim().parse()?;
        if self.hsm_mode == HsmMode::Intermediate
            && self.hsm_intermediate_ttl <= expiry_margin.saturating_mul(2)
        {
            return Err(HsmConfigError::TtlWithinMargin {
                ttl: self.hsm_intermediate_ttl,
                margin: expiry_margin,
            });
        }
        if self.hsm_sessions == 0 {
            return Err(HsmConfigError::ZeroSessions);
        }
        Ok(Some(HsmConfig {
            uri,
            mode: self.hsm_mode,
            intermediate_ttl: self.hsm_intermediate_ttl,
            name_constraint: self.hsm_name_constraint,
            limits: SessionLimits {
                max_sessions: self.hsm_sessions,
                max_waiting: self.hsm_queue,
            },
            opened: Default::default(),
        }))
    }
}

/// The HSM key and the directory of its certificates.
#[derive(Debug)]
pub(crate) struct HsmCa {
    key: Arc<HsmKey>,
    dir: PathBuf,
    config: HsmConfig,
    trust_domain: TrustDomain,
}

impl HsmCa {
    /// Opens the key (a wrong PIN, a missing token or key is an error
    /// naming the URI).
    pub(crate) fn open(
        config: &HsmConfig,
        dir: &Path,
        trust_domain: &TrustDomain,
    ) -> Result<Self, StoreError> {
        let key = HsmKey::open(&config.uri, config.limits).map_err(StoreError::Hsm)?;
        tracing::info!(
            uri = %config.uri,
            key = %key.kind(),
            mode = ?config.mode,
            "the CA key is in the HSM"
        );
        Ok(Self {
            key: Arc::new(key),
            dir: dir.to_path_buf(),
            config: config.clone(),
            trust_domain: trust_domain.clone(),
        })
    }

    /// The mode.
    pub(crate) fn mode(&self) -> HsmMode {
        self.config.mode
    }

    /// The directory's certificates with the HSM key, checked.
    fn load_dir(&self, now: OffsetDateTime) -> Result<LoadedCa, StoreError> {
        let key = CaKey::External(self.key.clone());
        Ok(cadir::load_ca_dir_with_key(
            &self.dir,
            now,
            key,
            self.config.uri.as_str(),
        )?)
    }

    /// The material to sign with: the HSM key's own (direct), or a new
    /// intermediate the HSM key signed just now (intermediate).
    pub(crate) fn material(&self, now: OffsetDateTime) -> Result<CaMaterial, StoreError> {
        let loaded = self.load_dir(now)?;
        match self.config.mode {
            HsmMode::Direct => Ok(CaMaterial {
                signing: loaded.signing,
                chain: loaded.chain,
                anchor_root: loaded.anchor_root,
                bundle: loaded.bundle,
                source: CaSource::PluggedIn(self.dir.clone()),
            }),
            HsmMode::Intermediate => self.mint(loaded, now),
        }
    }

    /// A new in-memory intermediate under the HSM key.
    fn mint(&self, loaded: LoadedCa, now: OffsetDateTime) -> Result<CaMaterial, StoreError> {
        let gen_err = |e: String| StoreError::Generate(format!("the in-memory intermediate: {e}"));
        let key =
            PrivateKey::generate(KeyAlgorithm::EcdsaP256).map_err(|e| gen_err(e.to_string()))?;
        let subject = SubjectKey::of(&key).map_err(|e| gen_err(e.to_string()))?;
        // No certificate outlives the chain above it.
        let chain_end = loaded
            .chain
            .iter()
            .chain(std::iter::once(&loaded.anchor_root))
            .filter_map(|der| meshca_certs::inspect::CertSummary::from_der(der).ok())
            .map(|s| s.not_after)
            .fold(loaded.signing.validity().not_after, OffsetDateTime::min);
        let ttl =
            time::Duration::try_from(self.config.intermediate_ttl).unwrap_or(time::Duration::MAX);
        let validity = Validity::backdated(now, ttl).capped_at(chain_end);
        let name = SubjectName {
            organization: Some(self.trust_domain.as_str().to_string()),
            common_name: Some("meshca in-memory intermediate".to_string()),
            ..Default::default()
        };
        let host = self.trust_domain.as_str();
        let hosts: &[&str] = if self.config.name_constraint {
            std::slice::from_ref(&host)
        } else {
            &[]
        };
        let cert = loaded
            .signing
            .issue_constrained_ca(&subject, &name, Some(0), hosts, validity)
            .map_err(|e| StoreError::HsmSigning {
                uri: self.config.uri.to_string(),
                cause: e.to_string(),
            })?;
        let signing = SigningCa::new(cert.der.clone(), key).map_err(|e| gen_err(e.to_string()))?;
        let mut chain = vec![cert.der];
        chain.extend(loaded.chain);
        tracing::info!(
            uri = %self.config.uri,
            serial = %cert.serial_hex,
            not_after = %meshca_certs::Rfc3339(validity.not_after),
            name_constraint = self.config.name_constraint,
            "the HSM key signed a new in-memory intermediate"
        );
        Ok(CaMaterial {
            signing,
            chain,
            anchor_root: loaded.anchor_root,
            bundle: loaded.bundle,
            source: CaSource::PluggedIn(self.dir.clone()),
        })
    }
}

/// When the current intermediate is due for renewal: half its lifetime.
fn renewal_due(authority: &Authority) -> OffsetDateTime {
    let v = authority.current().material.signing.validity();
    v.not_before + (v.not_after - v.not_before) / 2
}

/// Keeps the material fresh until dropped: a new intermediate at half the
/// current one's lifetime (intermediate mode), and new certificates of
/// the directory taken into use (both modes). Checked every `interval`.
pub(crate) async fn keep_fresh(
    ca: Arc<HsmCa>,
    authority: Arc<Authority>,
    metrics: Metrics,
    interval: Duration,
) {
    let mut last_files = crate::reload::fingerprint(&ca.dir);
    let mut failing = false;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        ticker.tick().await;
        let files = crate::reload::fingerprint(&ca.dir);
        let files_changed = files != last_files;
        let due = ca.mode() == HsmMode::Intermediate
            && OffsetDateTime::now_utc() >= renewal_due(&authority);
        if !files_changed && !due {
            continue;
        }
        let worker = ca.clone();
        let made =
            tokio::task::spawn_blocking(move || worker.material(OffsetDateTime::now_utc())).await;
        let made = match made {
            Ok(made) => made,
            Err(e) => Err(StoreError::Generate(format!(
                "the signing task failed: {e}"
            ))),
        };
        match made {
            Ok(material) => {
                last_files = files;
                if files_changed {
                    tracing::info!(dir = %ca.dir.display(), "the CA certificates changed: signing under the new set");
                    metrics.reloads_ok.inc();
                }
                if failing {
                    tracing::info!(uri = %ca.config.uri, "the HSM signs again");
                }
                failing = false;
                authority.replace(material);
                metrics.hsm_unavailable.set(0);
            }
            Err(e) => {
                if files_changed && !matches!(e, StoreError::Hsm(_) | StoreError::HsmSigning { .. })
                {
                    // The new files are refused, as a plain --ca-dir's are.
                    last_files = files;
                    tracing::error!(dir = %ca.dir.display(), error = %e, "the CA certificates changed but the new set is refused; still signing with the previous set");
                    authority.set_refused(Some(format!("{}: {e}", ca.dir.display())));
                    metrics.reloads_refused.inc();
                    continue;
                }
                metrics.hsm_renewal_failures.inc();
                metrics.hsm_unavailable.set(1);
                let until = authority.current().material.signing.validity().not_after;
                if !failing {
                    tracing::warn!(
                        uri = %ca.config.uri,
                        error = %e,
                        current_not_after = %meshca_certs::Rfc3339(until),
                        "the HSM could not sign a new intermediate; the current one signs on until --ca-expiry-margin before it ends; retrying every check interval"
                    );
                }
                failing = true;
                authority.set_refused(Some(format!(
                    "the HSM key cannot sign a new intermediate: {e}; the current one signs until --ca-expiry-margin before {}",
                    meshca_certs::Rfc3339(until)
                )));
            }
        }
    }
}
