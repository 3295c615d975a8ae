//! The yardstick: how many certificates one core could issue if nothing
//! but the cryptography cost anything. Per certificate that is one CSR
//! signature check, one certificate signature and (offline-JWT mode) one
//! token signature check, with the same key types as the run. Measured
//! with ring directly, in this process, on one thread. The in-process
//! signing path (PEM/DER parsing, certificate building, PEM encoding) is
//! measured too, to show what the code around the crypto costs.

use std::time::{Duration, Instant};

use meshca_ca::authority::Authority;
use meshca_ca::authority::TtlPolicy;
use meshca_ca::store::{CaMaterial, CaSource};
use meshca_certs::keys::KeyAlgorithm;
use meshca_certs::profile::SigningCa;
use meshca_certs::{PrivateKey, TrustBundle, VerifiedCsr};
use ring::signature::{self, EcdsaKeyPair, KeyPair};
use serde_json::json;
use time::OffsetDateTime;

/// The measured limits.
#[derive(Debug, Clone)]
pub(crate) struct Baseline {
    /// Certificates per second per core from the crypto alone: the mean of
    /// a measurement before the load and one after it (this shared VM's
    /// speed drifts by more than 10 % within a minute).
    pub(crate) limit_per_core: f64,
    /// The measurement before the load.
    pub(crate) limit_before: f64,
    /// The measurement after the load.
    pub(crate) limit_after: f64,
    /// With tokens: the limit without the token check (CSR verify +
    /// certificate sign), the floor for a CA that reuses a token it has
    /// verified (meshca's `--jwt-cache-ttl`) when tokens repeat.
    pub(crate) limit_without_token_per_core: Option<f64>,
    /// What one certificate's crypto is.
    pub(crate) operations: String,
    /// Certificates per second per core through meshca's in-process
    /// signing path (CSR parse + verify, certificate build + sign, PEM).
    pub(crate) in_process_path_per_core: f64,
}

impl Baseline {
    /// As JSON.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        json!({
            "limit_per_core": self.limit_per_core,
            "limit_before_load": self.limit_before,
            "limit_after_load": self.limit_after,
            "limit_without_token_check_per_core": self.limit_without_token_per_core,
            "operations": self.operations,
            "in_process_path_per_core": self.in_process_path_per_core,
        })
    }

    /// For people.
    pub(crate) fn to_text(&self) -> String {
        format!(
            "crypto limit: {:.0} certs/s on one core (mean of {:.0} before and {:.0} after the load; {}); meshca's in-process signing path: {:.0}/s ({:.0}% of it)\n",
            self.limit_per_core,
            self.limit_before,
            self.limit_after,
            self.operations,
            self.in_process_path_per_core,
            100.0 * self.in_process_path_per_core / self.limit_per_core.max(1e-9)
        )
    }
}

/// One measurement of the crypto limit, in certificates per second.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CryptoLimits {
    /// Everything a certificate needs (with the token check, if any).
    pub(crate) full: f64,
    /// Without the token check, when there is one.
    pub(crate) without_token: Option<f64>,
}

/// Operations of `op` per second on this thread, counted for `window`.
pub(crate) fn per_second(window: Duration, mut op: impl FnMut()) -> f64 {
    // Warm up, then count whole operations for `window`.
    for _ in 0..50 {
        op();
    }
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < window {
        for _ in 0..20 {
            op();
        }
        n += 20;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// The operations of the yardstick, ready to run: keys made, signatures
/// to check made, so that only the cryptography is timed.
pub(crate) struct Yardstick {
    csr_key: KeyAlgorithm,
    with_token: bool,
    rng: ring::rand::SystemRandom,
    ca_key: EcdsaKeyPair,
    tbs: Vec<u8>,
    csr_sig: Vec<u8>,
    csr_public: Vec<u8>,
    token_sig: Vec<u8>,
    token_public: Vec<u8>,
}

/// How long each measurement runs.
const WINDOW: Duration = Duration::from_secs(2);

impl Yardstick {
    /// The limit for CSRs of `csr_key` signed by a P-256 CA, with a token
    /// check if `with_token`.
    pub(crate) fn new(csr_key: KeyAlgorithm, with_token: bool) -> anyhow::Result<Self> {
        let rng = ring::rand::SystemRandom::new();
        // The CA's signature: ECDSA P-256 over a TBSCertificate-sized message.
        let ca_pkcs8 =
            EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_ASN1_SIGNING, &rng)
                .map_err(|_| anyhow::anyhow!("generating a P-256 key"))?;
        let ca_key = EcdsaKeyPair::from_pkcs8(
            &signature::ECDSA_P256_SHA256_ASN1_SIGNING,
            ca_pkcs8.as_ref(),
            &rng,
        )
        .map_err(|_| anyhow::anyhow!("loading a P-256 key"))?;
        let tbs = vec![0x5au8; 480];
        // The CSR's signature check, with the run's key type.
        let csr_signer = PrivateKey::generate(csr_key)?;
        let csr_sig = rcgen::SigningKey::sign(csr_signer.key_pair(), &tbs)
            .map_err(|e| anyhow::anyhow!("signing: {e}"))?;
        let csr_public = csr_signer.key_pair().public_key_raw().to_vec();
        // The token's signature (ES256, as the local issuer and Kubernetes' EC keys).
        let token_sig = ca_key
            .sign(&rng, &tbs[..200])
            .map_err(|_| anyhow::anyhow!("signing"))?
            .as_ref()
            .to_vec();
        let token_public = ca_key.public_key().as_ref().to_vec();
        Ok(Self {
            csr_key,
            with_token,
            rng,
            ca_key,
            tbs,
            csr_sig,
            csr_public,
            token_sig,
            token_public,
        })
    }

    fn csr_algorithm(&self) -> &'static dyn signature::VerificationAlgorithm {
        match self.csr_key {
            KeyAlgorithm::EcdsaP256 => &signature::ECDSA_P256_SHA256_ASN1,
            KeyAlgorithm::EcdsaP384 => &signature::ECDSA_P384_SHA384_ASN1,
            _ => &signature::RSA_PKCS1_2048_8192_SHA256,
        }
    }

    fn verify_token(&self) -> bool {
        signature::UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_ASN1, &self.token_public)
            .verify(&self.tbs[..200], &self.token_sig)
            .is_ok()
    }

    /// Certificates per second on this thread from the cryptography alone:
    /// with the token check if the run sends tokens, and without it.
    pub(crate) fn limits_per_core(&self) -> CryptoLimits {
        let csr_alg = self.csr_algorithm();
        let window = if self.with_token { WINDOW / 2 } else { WINDOW };
        let pair = per_second(window, || {
            let ok = signature::UnparsedPublicKey::new(csr_alg, &self.csr_public)
                .verify(&self.tbs, &self.csr_sig)
                .is_ok();
            let sig = self.ca_key.sign(&self.rng, &self.tbs);
            std::hint::black_box((ok, sig.is_ok()));
        });
        if !self.with_token {
            return CryptoLimits {
                full: pair,
                without_token: None,
            };
        }
        let token = per_second(window, || {
            std::hint::black_box(self.verify_token());
        });
        CryptoLimits {
            // The time of one pair plus the time of one token check.
            full: 1.0 / (1.0 / pair + 1.0 / token),
            without_token: Some(pair),
        }
    }

    /// Certificates per second on this thread through meshca's in-process
    /// signing path (`csrs` are PEM CSRs of the run), plus the token check.
    pub(crate) fn in_process_path_per_core(&self, csrs: &[String]) -> anyhow::Result<f64> {
        let now = OffsetDateTime::now_utc();
        let (key, root) = meshca_ca::store::generate_self_signed_root(
            &meshca_certs::TrustDomain::default(),
            time::Duration::days(1),
            now,
        )?;
        let material = CaMaterial {
            signing: SigningCa::new(root.der.clone(), key)?,
            chain: Vec::new(),
            anchor_root: root.der.clone(),
            bundle: TrustBundle::new(vec![root.der]),
            source: CaSource::PluggedIn("bench".into()),
        };
        let authority = Authority::new(material, TtlPolicy::default());
        let mut i = 0usize;
        let mut failed = None;
        let per_core = per_second(WINDOW, || {
            let pem = &csrs[i % csrs.len()];
            i += 1;
            match VerifiedCsr::from_pem(pem) {
                Ok(csr) => {
                    let id = &csr.uri_sans()[0];
                    if let Err(e) = authority.sign_workload(csr.subject_key(), id, 0, now) {
                        failed = Some(e.to_string());
                    }
                }
                Err(e) => failed = Some(e.to_string()),
            }
            if self.with_token {
                std::hint::black_box(self.verify_token());
            }
        });
        if let Some(e) = failed {
            anyhow::bail!("the in-process signing path failed: {e}");
        }
        Ok(per_core)
    }

    /// What one certificate's cryptography is, in words.
    pub(crate) fn operations(&self) -> String {
        let mut operations = format!(
            "{} CSR verify + P-256 certificate sign",
            self.csr_key.name()
        );
        if self.with_token {
            operations += " + ES256 token verify";
        }
        operations
    }
}
