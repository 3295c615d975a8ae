//! JWT-SVIDs: `meshca.v1.JwtSvidService` on the gRPC port beside Istio's
//! service, the signing keys and their rotation ([`keys`]), and the OIDC
//! discovery document for relying parties outside the mesh ([`oidc`]).
//!
//! A caller gets a JWT-SVID exactly as it gets an X.509-SVID: the caller
//! gate authenticates it (token or client certificate), then
//! [`CaService::authorize_issuance`] decides the identity (its own, or a
//! pod's on its node for a trusted node agent) and applies the
//! per-identity rate limit (a budget of its own per kind of SVID). Tokens
//! follow the SPIFFE JWT-SVID specification: header `alg`, `kid`, `typ`
//! only; claims `sub`, `aud`, `exp`, `iat` and, with `--jwt-svid-issuer`,
//! `iss`.

pub(crate) mod keys;
pub(crate) mod metrics;
pub(crate) mod oidc;
pub(crate) mod secret;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use bytes::Bytes;
use clap::Args;
use meshca_certs::{parse_duration, SpiffeId};
use meshca_proto::meshca::v1::jwt_svid_service_server::JwtSvidService;
use meshca_proto::meshca::v1::{
    FetchJwtBundleRequest, FetchJwtBundleResponse, MintJwtSvidRequest, MintJwtSvidResponse,
};
use tonic::{Request, Response, Status};

use crate::authn::CallerKind;
use crate::service::{CaService, Issued};
pub use keys::{JwtAlgorithm, JwtKeyError};
use keys::{KeyRecord, RotationPolicy, Signer};
pub(crate) use metrics::JwtSvidMetrics;

/// Longest `--max-jwt-svid-ttl` accepted: a JWT-SVID is a bearer token,
/// replayable by whoever holds it until it expires.
pub(crate) const MAX_MAX_JWT_SVID_TTL: Duration = Duration::from_secs(24 * 3600);
/// Most audiences of one token.
pub(crate) const MAX_AUDIENCES: usize = 16;
/// Longest audience, in bytes.
pub(crate) const MAX_AUDIENCE_BYTES: usize = 256;

/// The flags of JWT-SVIDs and the OIDC discovery endpoint.
#[derive(Debug, Clone, Args)]
pub struct JwtSvidArgs {
    /// `iss` of the JWT-SVIDs minted, and the issuer of the OIDC discovery
    /// document (an https:// URL relying parties fetch
    /// /.well-known/openid-configuration from). Without it, tokens carry no
    /// `iss`.
    #[arg(long, env = "MESHCA_JWT_SVID_ISSUER")]
    pub(crate) jwt_svid_issuer: Option<String>,

    /// Lifetime of a JWT-SVID when the request asks for none (SPIRE's
    /// default, 5 minutes, too).
    #[arg(long, env = "MESHCA_JWT_SVID_TTL", default_value = "5m", value_parser = parse_duration)]
    pub(crate) jwt_svid_ttl: Duration,

    /// Longest lifetime of a JWT-SVID (longer requests are
    /// INVALID_ARGUMENT); also how long a new signing key is published
    /// before it signs, and an old one after it stopped.
    #[arg(long, env = "MESHCA_MAX_JWT_SVID_TTL", default_value = "1h", value_parser = parse_duration)]
    pub(crate) max_jwt_svid_ttl: Duration,

    /// How long one JWT-SVID signing key signs before the next takes over.
    #[arg(long, env = "MESHCA_JWT_KEY_ROTATION", default_value = "7d", value_parser = parse_duration)]
    pub(crate) jwt_key_rotation: Duration,

    /// Signature algorithm of JWT-SVIDs: ES256 or RS256.
    #[arg(
        long,
        env = "MESHCA_JWT_SVID_ALGORITHM",
        default_value = "ES256",
        value_enum
    )]
    pub(crate) jwt_svid_algorithm: JwtAlgorithm,

    /// Serve the OIDC discovery document and the JWKS on this address
    /// (HTTP/1.1; needs --jwt-svid-issuer). Off when not given.
    #[arg(long, env = "MESHCA_OIDC_LISTEN")]
    pub(crate) oidc_listen: Option<SocketAddr>,
}

/// A JWT-SVID configuration that parsed but does not make sense.
#[derive(Debug, thiserror::Error)]
pub enum JwtSvidConfigError {
    /// A lifetime of zero, or a default above the maximum.
    #[error("--jwt-svid-ttl ({default:?}) must be more than zero and at most --max-jwt-svid-ttl ({max:?})")]
    BadTtl {
        /// --jwt-svid-ttl
        default: Duration,
        /// --max-jwt-svid-ttl
        max: Duration,
    },
    /// A maximum lifetime beyond the bound.
    #[error("--max-jwt-svid-ttl {0:?} is longer than 24h: a JWT-SVID is a bearer token")]
    MaxTtlTooLong(Duration),
    /// A rotation too fast for a key to be announced before it signs.
    #[error("--jwt-key-rotation ({rotation:?}) must be at least twice --max-jwt-svid-ttl ({max:?}): a key is published one maximum lifetime before it signs")]
    RotationTooFast {
        /// --jwt-key-rotation
        rotation: Duration,
        /// --max-jwt-svid-ttl
        max: Duration,
    },
    /// An issuer that is not an http(s) URL.
    #[error(
        "--jwt-svid-issuer {0:?} must be an https:// (or http://) URL without query or fragment"
    )]
    BadIssuer(String),
    /// The discovery document needs an issuer.
    #[error("--oidc-listen needs --jwt-svid-issuer (the discovery document's issuer and its tokens' `iss`)")]
    OidcWithoutIssuer,
}

/// The validated JWT-SVID configuration.
#[derive(Debug, Clone)]
pub(crate) struct JwtSvidConfig {
    /// `iss`, and the discovery document's issuer (no trailing `/`).
    pub(crate) issuer: Option<String>,
    /// Default lifetime.
    pub(crate) default_ttl: Duration,
    /// Keys: rotation period, maximum lifetime, algorithm.
    pub(crate) policy: RotationPolicy,
    /// Where the discovery document is served.
    pub(crate) oidc_listen: Option<SocketAddr>,
}

impl TryFrom<JwtSvidArgs> for JwtSvidConfig {
    type Error = JwtSvidConfigError;

    fn try_from(args: JwtSvidArgs) -> Result<Self, JwtSvidConfigError> {
        let max = args.max_jwt_svid_ttl;
        if args.jwt_svid_ttl.is_zero() || max.is_zero() || args.jwt_svid_ttl > max {
            return Err(JwtSvidConfigError::BadTtl {
                default: args.jwt_svid_ttl,
                max,
            });
        }
        if max > MAX_MAX_JWT_SVID_TTL {
            return Err(JwtSvidConfigError::MaxTtlTooLong(max));
        }
        if args.jwt_key_rotation < max * 2 {
            return Err(JwtSvidConfigError::RotationTooFast {
                rotation: args.jwt_key_rotation,
                max,
            });
        }
        let issuer = match args.jwt_svid_issuer.map(|i| i.trim().to_string()) {
            None => None,
            Some(i) if i.is_empty() => None,
            Some(i) => {
                let plausible = (i.starts_with("https://") || i.starts_with("http://"))
                    && !i.contains(['?', '#', ' '])
                    && i.len() <= 1024
                    && i.split("://").nth(1).is_some_and(|rest| !rest.is_empty());
                if !plausible {
                    return Err(JwtSvidConfigError::BadIssuer(
                        meshca_certs::untrusted_text::shortened(&i, 256),
                    ));
                }
                Some(i.trim_end_matches('/').to_string())
            }
        };
        if args.oidc_listen.is_some() && issuer.is_none() {
            return Err(JwtSvidConfigError::OidcWithoutIssuer);
        }
        Ok(Self {
            issuer,
            default_ttl: args.jwt_svid_ttl,
            policy: RotationPolicy {
                rotation: args.jwt_key_rotation,
                max_ttl: max,
                alg: args.jwt_svid_algorithm,
            },
            oidc_listen: args.oidc_listen,
        })
    }
}

/// Why a JWT-SVID was not minted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum MintError {
    /// No audience.
    #[error("a JWT-SVID needs at least one audience")]
    NoAudience,
    /// Too many audiences, or an empty or oversized one.
    #[error("audiences: {0}")]
    BadAudience(String),
    /// A lifetime above the maximum.
    #[error("lifetime {asked}s is longer than the maximum {max}s (--max-jwt-svid-ttl)")]
    TtlTooLong {
        /// Asked, seconds.
        asked: i64,
        /// The maximum, seconds.
        max: u64,
    },
    /// The client certificate the caller authenticated with expires now:
    /// a token may not outlive it.
    #[error("the client certificate this request authenticated with expires now; renew it first")]
    CallerExpires,
    /// Signing failed (never says more).
    #[error("signing the JWT-SVID failed")]
    Signing,
}

/// One key ready to sign and publish.
#[derive(Debug)]
struct ActiveKey {
    kid: String,
    signs_from: i64,
    /// `base64url(header)` followed by `.`.
    header_b64: String,
    signer: Signer,
}

/// The keys in use, replaced whole at each change.
#[derive(Debug)]
struct KeyState {
    records: Vec<KeyRecord>,
    keys: Vec<ActiveKey>,
    /// The SPIFFE bundle: every key with `use: jwt-svid`.
    spiffe_jwks: Bytes,
    /// The OIDC JWKS: every key with `use: sig` and its `alg`.
    oidc_jwks: Bytes,
    /// The algorithms of the published keys.
    algorithms: Vec<&'static str>,
}

impl KeyState {
    fn new(records: Vec<KeyRecord>, refresh_hint: Duration) -> Result<Self, String> {
        let mut keys = Vec::with_capacity(records.len());
        let mut spiffe = Vec::new();
        let mut oidc = Vec::new();
        let mut algorithms = Vec::new();
        for record in &records {
            let signer = record.signer()?;
            let header =
                serde_json::json!({"alg": record.alg.name(), "kid": record.kid, "typ": "JWT"});
            let header_b64 = format!("{}.", URL_SAFE_NO_PAD.encode(header.to_string()));
            let mut jwk = signer.public_jwk();
            jwk.insert("kid".into(), record.kid.clone().into());
            let mut spiffe_jwk = jwk.clone();
            spiffe_jwk.insert("use".into(), "jwt-svid".into());
            spiffe.push(serde_json::Value::Object(spiffe_jwk));
            jwk.insert("use".into(), "sig".into());
            jwk.insert("alg".into(), record.alg.name().into());
            oidc.push(serde_json::Value::Object(jwk));
            if !algorithms.contains(&record.alg.name()) {
                algorithms.push(record.alg.name());
            }
            keys.push(ActiveKey {
                kid: record.kid.clone(),
                signs_from: record.signs_from,
                header_b64,
                signer,
            });
        }
        let spiffe_jwks = serde_json::json!({
            "keys": spiffe,
            "spiffe_refresh_hint": refresh_hint.as_secs(),
        });
        let oidc_jwks = serde_json::json!({ "keys": oidc });
        Ok(Self {
            records,
            keys,
            spiffe_jwks: Bytes::from(spiffe_jwks.to_string()),
            oidc_jwks: Bytes::from(oidc_jwks.to_string()),
            algorithms,
        })
    }

    fn signing_key(&self, now: i64) -> Option<&ActiveKey> {
        self.keys
            .iter()
            .filter(|k| k.signs_from <= now)
            .max_by_key(|k| k.signs_from)
    }
}

/// A minted JWT-SVID.
#[derive(Clone)]
pub(crate) struct Minted {
    /// The token (a secret: never logged).
    pub(crate) token: String,
    /// `iat`.
    pub(crate) issued_at: i64,
    /// `exp`.
    pub(crate) expires_at: i64,
    /// The key that signed it.
    pub(crate) kid: String,
}

impl std::fmt::Debug for Minted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Minted")
            .field("kid", &self.kid)
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

/// Where the keys are kept.
#[derive(Debug)]
enum Store {
    /// `jwt-svid-keys.json` in the data directory.
    Dir(PathBuf),
    /// The cluster Secret, shared by every replica.
    Secret(Box<secret::SecretStore>),
}

/// Mints JWT-SVIDs with the current key and keeps the keys rotating.
#[derive(Debug)]
pub(crate) struct JwtIssuer {
    state: ArcSwap<KeyState>,
    config: JwtSvidConfig,
    store: Store,
    changes: tokio::sync::watch::Sender<u64>,
    /// Set once the keys are loaded: at start from the data directory; in
    /// a cluster at the first JWT request (a CA whose callers never ask
    /// for JWT-SVIDs never writes their Secret), which also starts the
    /// rotation.
    loaded: tokio::sync::OnceCell<()>,
    /// Stops the rotation.
    stop: tokio::sync::watch::Receiver<bool>,
    /// `,"iss":"…"` of every token's claims (empty without an issuer),
    /// encoded once.
    iss_claim: String,
    /// Mints by result, key changes, the signing key's age.
    metrics: JwtSvidMetrics,
}

/// Each key's `kid` and start, as the metrics count changes.
fn kid_times(records: &[KeyRecord]) -> Vec<(String, i64)> {
    records
        .iter()
        .map(|k| (k.kid.clone(), k.signs_from))
        .collect()
}

/// `,"iss":"…"` for `issuer`, empty for none.
fn iss_claim(issuer: Option<&str>) -> String {
    let mut claim = String::new();
    if let Some(issuer) = issuer {
        claim.push_str(",\"iss\":");
        push_json_string(&mut claim, issuer);
    }
    claim
}

/// Appends `s` as a JSON string (quoted, escaped as RFC 8259 requires).
fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    if !s.chars().any(|c| c == '"' || c == '\\' || c < ' ') {
        out.push_str(s);
    } else {
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if c < ' ' => {
                    use std::fmt::Write as _;
                    let _ = write!(out, "\\u{:04x}", u32::from(c));
                }
                c => out.push(c),
            }
        }
    }
    out.push('"');
}

fn unix_now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

impl JwtIssuer {
    /// Loads the keys of `dir` (making the first one, or the next one
    /// when it is due) and saves what changed.
    #[cfg(test)]
    pub(crate) fn load_or_create(
        dir: &Path,
        config: JwtSvidConfig,
        now: i64,
    ) -> Result<Self, JwtKeyError> {
        Self::load_or_create_until(
            dir,
            config,
            now,
            tokio::sync::watch::channel(false).1,
            JwtSvidMetrics::default(),
        )
    }

    /// In a cluster: the keys of the Secret in `store`, read at the first
    /// JWT request ([`JwtIssuer::ensure_ready`]); rotated until `stop`.
    pub(crate) fn in_cluster(
        store: secret::SecretStore,
        config: JwtSvidConfig,
        stop: tokio::sync::watch::Receiver<bool>,
        metrics: JwtSvidMetrics,
    ) -> Self {
        Self {
            state: ArcSwap::from_pointee(empty_state()),
            iss_claim: iss_claim(config.issuer.as_deref()),
            config,
            store: Store::Secret(Box::new(store)),
            changes: tokio::sync::watch::channel(0).0,
            loaded: tokio::sync::OnceCell::new(),
            stop,
            metrics,
        }
    }

    fn load_or_create_until(
        dir: &Path,
        config: JwtSvidConfig,
        now: i64,
        stop: tokio::sync::watch::Receiver<bool>,
        metrics: JwtSvidMetrics,
    ) -> Result<Self, JwtKeyError> {
        std::fs::create_dir_all(dir).map_err(|cause| JwtKeyError::Read {
            path: dir.to_path_buf(),
            cause,
        })?;
        let records = keys::load(dir)?;
        let plan = keys::plan(&records, now, &config.policy)?;
        if plan.changed {
            keys::save(dir, &plan.keys)?;
        }
        metrics.keys_changed(None, &kid_times(&plan.keys));
        let state = KeyState::new(plan.keys, config.policy.bundle_max_age()).map_err(|reason| {
            JwtKeyError::Invalid {
                path: dir.join(keys::KEYS_FILE),
                reason,
            }
        })?;
        Ok(Self {
            state: ArcSwap::from_pointee(state),
            iss_claim: iss_claim(config.issuer.as_deref()),
            config,
            store: Store::Dir(dir.to_path_buf()),
            changes: tokio::sync::watch::channel(0).0,
            loaded: tokio::sync::OnceCell::from(()),
            stop,
            metrics,
        })
    }

    /// Loads the keys if they are not yet (in a cluster, from the Secret,
    /// made if absent) and starts their rotation; `UNAVAILABLE` when the
    /// Kubernetes API fails (the next request tries again).
    pub(crate) async fn ensure_ready(self: &Arc<Self>) -> Result<(), Status> {
        self.loaded
            .get_or_try_init(|| async {
                self.sync_with_secret(unix_now()).await?;
                tokio::spawn(self.clone().rotate(self.stop.clone()));
                Ok::<(), JwtKeyError>(())
            })
            .await
            .map(|_| ())
            .map_err(|e| {
                tracing::warn!(error = %e, "loading the JWT-SVID keys failed");
                Status::unavailable(format!("{e}; retry shortly"))
            })
    }

    /// In a cluster: reads the Secret, makes the change the rotation
    /// calls for and writes it with the version read (another replica's
    /// write first: read again), then takes what the Secret holds into
    /// use. Returns when the rotation has something to do next.
    async fn sync_with_secret(&self, now: i64) -> Result<i64, JwtKeyError> {
        let Store::Secret(store) = &self.store else {
            return self.advance(now);
        };
        for _ in 0..5 {
            let (keys, version) = match store.read().await? {
                Some((keys, version)) => (keys, Some(version)),
                None => (Vec::new(), None),
            };
            let plan = keys::plan(&keys, now, &self.config.policy)?;
            if plan.changed {
                let written = match &version {
                    None => store.create(&plan.keys).await?,
                    Some(version) => store.replace(&plan.keys, version).await?,
                };
                if written == secret::Written::Lost {
                    tracing::debug!(
                        "another replica changed the JWT-SVID keys first; reading them"
                    );
                    continue;
                }
            }
            self.adopt(plan.keys)?;
            return Ok(plan.next_event);
        }
        Err(JwtKeyError::Secret {
            action: "writing",
            namespace: String::new(),
            name: secret::SECRET_NAME,
            cause: "other replicas wrote it five times in a row; trying again later".into(),
        })
    }

    /// Takes `keys` into use if they differ from the keys in use.
    fn adopt(&self, keys: Vec<KeyRecord>) -> Result<(), JwtKeyError> {
        let before = self.state.load();
        if before.records == keys {
            return Ok(());
        }
        let before = (!before.records.is_empty()).then(|| kid_times(&before.records));
        let after = kid_times(&keys);
        let kids: Vec<String> = keys.iter().map(|k| k.kid.clone()).collect();
        let state = KeyState::new(keys, self.config.policy.bundle_max_age()).map_err(|reason| {
            JwtKeyError::Invalid {
                path: PathBuf::from(keys::KEYS_FILE),
                reason,
            }
        })?;
        self.state.store(Arc::new(state));
        self.metrics.keys_changed(before.as_deref(), &after);
        self.changes.send_modify(|v| *v += 1);
        tracing::info!(keys = ?kids, "JWT-SVID keys changed (published: every key listed)");
        Ok(())
    }

    /// Rotates the keys until `stop` turns true: wakes when [`keys::plan`]
    /// has something to do (at least every hour, at most every second).
    pub(crate) async fn rotate(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            let now = unix_now();
            let next = match self.sync_with_secret(now).await {
                Ok(next) => next,
                Err(e) => {
                    self.metrics.rotation_failed();
                    tracing::error!(error = %e, "JWT-SVID key rotation failed; the current keys stay, retrying in 60s");
                    now + 60
                }
            };
            let mut wait = Duration::from_secs(u64::try_from(next - now).unwrap_or(1))
                .clamp(Duration::from_secs(1), Duration::from_secs(3600));
            if matches!(self.store, Store::Secret(_)) {
                // Another replica may have changed the keys.
                wait = wait.min(self.config.policy.bundle_max_age());
            }
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }

    /// One step of the rotation at `now`; returns when the next is due.
    /// (The data directory's keys; in a cluster, [`Self::sync_with_secret`].)
    pub(crate) fn advance(&self, now: i64) -> Result<i64, JwtKeyError> {
        let current = self.state.load();
        let plan = keys::plan(&current.records, now, &self.config.policy)?;
        if plan.changed {
            if let Store::Dir(dir) = &self.store {
                keys::save(dir, &plan.keys)?;
            }
            self.adopt(plan.keys)?;
        }
        Ok(plan.next_event)
    }

    /// Told on every change of the published keys.
    #[cfg(test)]
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// How long a relying party may keep the bundle.
    pub(crate) fn bundle_max_age(&self) -> Duration {
        self.config.policy.bundle_max_age()
    }

    /// The SPIFFE JWT bundle (JWKS, `use: jwt-svid`).
    pub(crate) fn spiffe_jwks(&self) -> Bytes {
        self.state.load().spiffe_jwks.clone()
    }

    /// The OIDC JWKS (`use: sig`, with `alg`).
    pub(crate) fn oidc_jwks(&self) -> Bytes {
        self.state.load().oidc_jwks.clone()
    }

    /// The algorithms of the published keys.
    pub(crate) fn algorithms(&self) -> Vec<&'static str> {
        self.state.load().algorithms.clone()
    }

    /// The configured issuer, if any.
    pub(crate) fn issuer(&self) -> Option<&str> {
        self.config.issuer.as_deref()
    }

    /// A JWT-SVID for `identity` and `audiences`, living `lifetime`
    /// seconds (0 or less: the default), signed at `now`.
    #[cfg(test)]
    pub(crate) fn mint(
        &self,
        identity: &SpiffeId,
        audiences: &[String],
        lifetime: i64,
        now: i64,
    ) -> Result<Minted, MintError> {
        self.mint_until(identity, audiences, lifetime, now, None)
    }

    /// As [`Self::mint`], expiring at `not_after` (Unix seconds) at the
    /// latest: the notAfter of the client certificate the caller
    /// authenticated with, which a token may not outlive.
    pub(crate) fn mint_until(
        &self,
        identity: &SpiffeId,
        audiences: &[String],
        lifetime: i64,
        now: i64,
        not_after: Option<i64>,
    ) -> Result<Minted, MintError> {
        check_audiences(audiences)?;
        let max = self.config.policy.max_ttl.as_secs();
        let lifetime = if lifetime <= 0 {
            i64::try_from(self.config.default_ttl.as_secs()).unwrap_or(300)
        } else if u64::try_from(lifetime).unwrap_or(u64::MAX) > max {
            return Err(MintError::TtlTooLong {
                asked: lifetime,
                max,
            });
        } else {
            lifetime
        };
        let mut expires_at = now.saturating_add(lifetime);
        if let Some(not_after) = not_after {
            if not_after <= now {
                return Err(MintError::CallerExpires);
            }
            expires_at = expires_at.min(not_after);
        }
        let state = self.state.load();
        let key = state.signing_key(now).ok_or(MintError::Signing)?;
        // The claims written directly (no JSON tree per token): sub, aud
        // (a string for one audience, else an array), exp, iat, iss.
        let mut claims = String::with_capacity(
            96 + identity.as_str().len()
                + audiences.iter().map(|a| a.len() + 3).sum::<usize>()
                + self.iss_claim.len(),
        );
        claims.push_str("{\"sub\":");
        push_json_string(&mut claims, identity.as_str());
        claims.push_str(",\"aud\":");
        match audiences {
            [one] => push_json_string(&mut claims, one),
            many => {
                claims.push('[');
                for (i, audience) in many.iter().enumerate() {
                    if i > 0 {
                        claims.push(',');
                    }
                    push_json_string(&mut claims, audience);
                }
                claims.push(']');
            }
        }
        {
            use std::fmt::Write as _;
            let _ = write!(claims, ",\"exp\":{expires_at},\"iat\":{now}");
        }
        claims.push_str(&self.iss_claim);
        claims.push('}');
        let mut token = String::with_capacity(key.header_b64.len() + claims.len() * 4 / 3 + 100);
        token.push_str(&key.header_b64);
        URL_SAFE_NO_PAD.encode_string(claims.as_bytes(), &mut token);
        let signature = key
            .signer
            .sign(token.as_bytes())
            .map_err(|_| MintError::Signing)?;
        token.push('.');
        URL_SAFE_NO_PAD.encode_string(signature, &mut token);
        Ok(Minted {
            token,
            issued_at: now,
            expires_at,
            kid: key.kid.clone(),
        })
    }
}

fn check_audiences(audiences: &[String]) -> Result<(), MintError> {
    if audiences.is_empty() {
        return Err(MintError::NoAudience);
    }
    if audiences.len() > MAX_AUDIENCES {
        return Err(MintError::BadAudience(format!(
            "{} given, at most {MAX_AUDIENCES}",
            audiences.len()
        )));
    }
    for audience in audiences {
        if audience.trim().is_empty() {
            return Err(MintError::BadAudience("an audience is empty".into()));
        }
        if audience.len() > MAX_AUDIENCE_BYTES {
            return Err(MintError::BadAudience(format!(
                "an audience is {} bytes, at most {MAX_AUDIENCE_BYTES}",
                audience.len()
            )));
        }
    }
    Ok(())
}

/// The gRPC service `meshca.v1.JwtSvidService`.
#[derive(Debug, Clone)]
pub(crate) struct JwtSvidGrpc {
    ca: CaService,
    issuer: Option<Arc<JwtIssuer>>,
}

impl JwtSvidGrpc {
    /// Mints with `issuer` (`None`: every call is `FAILED_PRECONDITION`),
    /// authenticating and authorizing as `ca` does.
    pub(crate) fn new(ca: CaService, issuer: Option<Arc<JwtIssuer>>) -> Self {
        Self { ca, issuer }
    }

    fn issuer(&self) -> Result<&Arc<JwtIssuer>, Status> {
        self.issuer
            .as_ref()
            .ok_or_else(|| Status::failed_precondition("JWT-SVIDs are not served by this CA"))
    }
}

impl JwtSvidGrpc {
    /// `MintJwtSvid`, counted by the caller by its result.
    async fn mint(
        &self,
        issuer: &Arc<JwtIssuer>,
        request: Request<MintJwtSvidRequest>,
    ) -> Result<MintJwtSvidResponse, Status> {
        let caller = self.ca.caller_of(&request).await?;
        issuer.ensure_ready().await?;
        let _slot = self.ca.admit("JWT-SVID").await?;
        let request = request.into_inner();
        // Cheap checks first: a bad request costs no authorization.
        check_audiences(&request.audiences).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let impersonated =
            Some(request.impersonated_identity.as_str()).filter(|s| !s.trim().is_empty());
        let identity = self
            .ca
            .authorize_issuance(&caller, impersonated, &[], Issued::JwtSvid)
            .await?;
        // A token never outlives the client certificate that asked for it.
        let not_after = match &caller.kind {
            CallerKind::ClientCertificate { not_after, .. } => Some(*not_after),
            CallerKind::Token { .. } => None,
        };
        let minted = issuer
            .mint_until(
                &identity,
                &request.audiences,
                request.lifetime_seconds,
                unix_now(),
                not_after,
            )
            .map_err(|e| match e {
                MintError::Signing => {
                    tracing::warn!(identity = %identity, "signing a JWT-SVID failed");
                    Status::internal(e.to_string())
                }
                MintError::CallerExpires => Status::unauthenticated(e.to_string()),
                _ => Status::invalid_argument(e.to_string()),
            })?;
        tracing::info!(
            target: "meshca::audit",
            caller = %caller.identity,
            pod = caller.pod_name.as_deref().unwrap_or(""),
            identity = %identity,
            audiences = request.audiences.len(),
            kid = %minted.kid,
            exp = minted.expires_at,
            "issued JWT-SVID"
        );
        Ok(MintJwtSvidResponse {
            token: minted.token,
            spiffe_id: identity.to_string(),
            issued_at: minted.issued_at,
            expires_at: minted.expires_at,
        })
    }
}

#[tonic::async_trait]
impl JwtSvidService for JwtSvidGrpc {
    async fn mint_jwt_svid(
        &self,
        request: Request<MintJwtSvidRequest>,
    ) -> Result<Response<MintJwtSvidResponse>, Status> {
        let issuer = self.issuer()?;
        let answer = self.mint(issuer, request).await;
        issuer
            .metrics
            .minted(answer.as_ref().map(|_| ()).map_err(|s| s.code()));
        answer.map(Response::new)
    }

    async fn fetch_jwt_bundle(
        &self,
        request: Request<FetchJwtBundleRequest>,
    ) -> Result<Response<FetchJwtBundleResponse>, Status> {
        let caller = self.ca.caller_of(&request).await?;
        let issuer = self.issuer()?;
        issuer.ensure_ready().await?;
        Ok(Response::new(FetchJwtBundleResponse {
            trust_domain: caller.identity.trust_domain().as_str().to_string(),
            jwks: issuer.spiffe_jwks().to_vec(),
            refresh_hint_seconds: i64::try_from(issuer.bundle_max_age().as_secs()).unwrap_or(300),
        }))
    }
}

/// Start-up step: the JWT-SVID issuer over the data directory's keys,
/// rotating in `background` until `stop`; in a cluster (`cluster`: the
/// client and meshca's namespace), over the keys' Secret, read at the
/// first JWT request. It counts into `metrics`. With the CA key in an
/// HSM (`ca_key_in_hsm`) it says where the JWT-SVID keys are instead:
/// they never are in the HSM (docs/jwt-svid.md).
// One argument per start-up product it uses, as the other steps take them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start_in(
    config: &JwtSvidConfig,
    data_dir: &Path,
    cluster: Option<(kube::Client, String)>,
    ca_key_in_hsm: bool,
    metrics: &JwtSvidMetrics,
    stop: tokio::sync::watch::Receiver<bool>,
    background: &mut tokio::task::JoinSet<()>,
) -> Result<Arc<JwtIssuer>, JwtKeyError> {
    if ca_key_in_hsm {
        let kept_in = match &cluster {
            Some((_, namespace)) => format!("the Secret {namespace}/{}", secret::SECRET_NAME),
            None => data_dir.join(keys::KEYS_FILE).display().to_string(),
        };
        tracing::info!(
            keys = %kept_in,
            "the CA key is in the HSM; the JWT-SVID signing keys are not (they sign every token, and rotate): they are kept in the place named"
        );
    }
    if let Some((client, namespace)) = cluster {
        let store = secret::SecretStore::new(client, &namespace);
        return Ok(Arc::new(JwtIssuer::in_cluster(
            store,
            config.clone(),
            stop,
            metrics.clone(),
        )));
    }
    let issuer = Arc::new(JwtIssuer::load_or_create_until(
        data_dir,
        config.clone(),
        unix_now(),
        stop.clone(),
        metrics.clone(),
    )?);
    background.spawn(issuer.clone().rotate(stop));
    Ok(issuer)
}

/// The minting path alone (no authentication, no gRPC, no rotation),
/// over the keys of a directory with the default flags: for benchmarks
/// (meshca-bench's in-process JWT-SVID path).
#[doc(hidden)]
#[derive(Debug)]
pub struct StandaloneJwtIssuer(JwtIssuer);

impl StandaloneJwtIssuer {
    /// Loads (or makes) the keys of `dir` (ES256).
    pub fn open(dir: &Path) -> Result<Self, JwtKeyError> {
        let config = JwtSvidConfig {
            issuer: None,
            default_ttl: Duration::from_secs(300),
            policy: RotationPolicy {
                rotation: Duration::from_secs(7 * 24 * 3600),
                max_ttl: Duration::from_secs(3600),
                alg: JwtAlgorithm::Es256,
            },
            oidc_listen: None,
        };
        JwtIssuer::load_or_create_until(
            dir,
            config,
            unix_now(),
            tokio::sync::watch::channel(false).1,
            JwtSvidMetrics::default(),
        )
        .map(Self)
    }

    /// A JWT-SVID for `identity` and `audiences` with the default
    /// lifetime, or why not.
    pub fn mint(&self, identity: &SpiffeId, audiences: &[String]) -> Result<String, String> {
        self.0
            .mint_until(identity, audiences, 0, unix_now(), None)
            .map(|m| m.token)
            .map_err(|e| e.to_string())
    }
}

/// The state before the keys are loaded: nothing to sign with or publish.
fn empty_state() -> KeyState {
    KeyState {
        records: Vec::new(),
        keys: Vec::new(),
        spiffe_jwks: Bytes::from_static(b"{\"keys\":[]}"),
        oidc_jwks: Bytes::from_static(b"{\"keys\":[]}"),
        algorithms: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: JwtSvidArgs,
    }

    fn config(flags: &[&str]) -> Result<JwtSvidConfig, JwtSvidConfigError> {
        JwtSvidConfig::try_from(
            Cli::parse_from(std::iter::once("meshca").chain(flags.iter().copied())).args,
        )
    }

    fn id() -> SpiffeId {
        SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap()
    }

    fn decode(part: &str) -> serde_json::Value {
        serde_json::from_slice(&URL_SAFE_NO_PAD.decode(part).unwrap()).unwrap()
    }

    /// The token verified by jsonwebtoken against the published JWKS.
    fn verify(issuer: &JwtIssuer, token: &str, audience: &str) -> serde_json::Value {
        let header = jsonwebtoken::decode_header(token).unwrap();
        let jwks: jsonwebtoken::jwk::JwkSet = serde_json::from_slice(&issuer.oidc_jwks()).unwrap();
        let jwk = jwks.find(header.kid.as_deref().unwrap()).unwrap();
        let key = jsonwebtoken::DecodingKey::from_jwk(jwk).unwrap();
        let mut validation = jsonwebtoken::Validation::new(header.alg);
        validation.set_audience(&[audience]);
        validation.set_required_spec_claims(&["exp", "aud", "sub"]);
        jsonwebtoken::decode::<serde_json::Value>(token, &key, &validation)
            .unwrap()
            .claims
    }

    #[test]
    fn tokens_follow_the_spiffe_jwt_svid_profile_and_verify_against_the_jwks() {
        for alg in ["ES256", "RS256"] {
            let dir = tempfile::tempdir().unwrap();
            let config = config(&[
                "--jwt-svid-algorithm",
                alg,
                "--jwt-svid-issuer",
                "https://oidc.example.com/",
            ])
            .unwrap();
            let issuer = JwtIssuer::load_or_create(dir.path(), config, unix_now()).unwrap();
            let now = unix_now();
            let minted = issuer
                .mint(&id(), &["sts.amazonaws.com".into()], 0, now)
                .unwrap();
            let parts: Vec<&str> = minted.token.split('.').collect();
            assert_eq!(parts.len(), 3);
            let header = decode(parts[0]);
            let header = header.as_object().unwrap();
            assert_eq!(header.len(), 3, "alg, kid, typ only: {header:?}");
            assert_eq!(header["alg"], alg);
            assert_eq!(header["typ"], "JWT");
            assert_eq!(header["kid"], minted.kid.as_str());
            let claims = verify(&issuer, &minted.token, "sts.amazonaws.com");
            assert_eq!(claims["sub"], "spiffe://cluster.local/ns/default/sa/web");
            assert_eq!(claims["aud"], "sts.amazonaws.com");
            assert_eq!(claims["iat"], now);
            assert_eq!(
                claims["exp"],
                now + 300,
                "the default lifetime is 5 minutes"
            );
            assert_eq!(
                claims["iss"], "https://oidc.example.com",
                "no trailing slash"
            );
            // The SPIFFE bundle marks keys jwt-svid; the OIDC one sig.
            let spiffe: serde_json::Value = serde_json::from_slice(&issuer.spiffe_jwks()).unwrap();
            assert_eq!(spiffe["keys"][0]["use"], "jwt-svid");
            assert_eq!(spiffe["keys"][0]["kid"], minted.kid.as_str());
        }
    }

    #[test]
    fn several_audiences_an_array_and_lifetimes_within_the_maximum() {
        let dir = tempfile::tempdir().unwrap();
        let issuer =
            JwtIssuer::load_or_create(dir.path(), config(&[]).unwrap(), unix_now()).unwrap();
        let now = unix_now();
        let minted = issuer
            .mint(&id(), &["a".into(), "b".into()], 3600, now)
            .unwrap();
        let claims = verify(&issuer, &minted.token, "b");
        assert_eq!(claims["aud"], serde_json::json!(["a", "b"]));
        assert_eq!(claims["exp"], now + 3600);
        assert!(claims.get("iss").is_none(), "no issuer configured: no iss");
        assert_eq!(
            issuer.mint(&id(), &["a".into()], 3601, now).unwrap_err(),
            MintError::TtlTooLong {
                asked: 3601,
                max: 3600
            }
        );
        assert_eq!(
            issuer.mint(&id(), &[], 0, now).unwrap_err(),
            MintError::NoAudience
        );
        assert!(matches!(
            issuer.mint(&id(), &[" ".into()], 0, now).unwrap_err(),
            MintError::BadAudience(_)
        ));
        assert!(matches!(
            issuer
                .mint(&id(), &vec!["a".to_string(); 17], 0, now)
                .unwrap_err(),
            MintError::BadAudience(_)
        ));
        assert!(!format!("{minted:?}").contains(&minted.token));
    }

    #[test]
    fn a_token_expires_with_the_client_certificate_of_its_caller() {
        let dir = tempfile::tempdir().unwrap();
        let issuer =
            JwtIssuer::load_or_create(dir.path(), config(&[]).unwrap(), unix_now()).unwrap();
        let now = unix_now();
        // The certificate ends before the token would: the token ends with it.
        for lifetime in [0, 3600] {
            let minted = issuer
                .mint_until(&id(), &["x".into()], lifetime, now, Some(now + 100))
                .unwrap();
            assert_eq!(minted.expires_at, now + 100);
            assert_eq!(verify(&issuer, &minted.token, "x")["exp"], now + 100);
        }
        // It ends after: the lifetime asked for.
        let minted = issuer
            .mint_until(&id(), &["x".into()], 60, now, Some(now + 100))
            .unwrap();
        assert_eq!(minted.expires_at, now + 60);
        // It ends now: nothing is minted.
        assert_eq!(
            issuer
                .mint_until(&id(), &["x".into()], 0, now, Some(now))
                .unwrap_err(),
            MintError::CallerExpires
        );
    }

    #[test]
    fn claims_are_json_whatever_the_audience_or_issuer_holds() {
        let dir = tempfile::tempdir().unwrap();
        // The issuer flag refuses only `?`, `#` and spaces: a quote passes.
        let issuer = JwtIssuer::load_or_create(
            dir.path(),
            config(&["--jwt-svid-issuer", "https://oidc.example.com/a\"b"]).unwrap(),
            unix_now(),
        )
        .unwrap();
        let odd = "q\"uote \\ back\u{1} \u{e9}\n".to_string();
        let now = unix_now();
        let minted = issuer
            .mint(&id(), &[odd.clone(), "plain".into()], 0, now)
            .unwrap();
        let claims = decode(minted.token.split('.').nth(1).unwrap());
        assert_eq!(claims["aud"], serde_json::json!([odd, "plain"]));
        assert_eq!(claims["iss"], "https://oidc.example.com/a\"b");
        assert_eq!(claims["sub"], "spiffe://cluster.local/ns/default/sa/web");
        assert_eq!(claims.as_object().unwrap().len(), 5, "{claims}");
        verify(&issuer, &minted.token, "plain");
    }

    #[test]
    fn a_restart_signs_with_the_same_key() {
        let dir = tempfile::tempdir().unwrap();
        let now = unix_now();
        let first = JwtIssuer::load_or_create(dir.path(), config(&[]).unwrap(), now).unwrap();
        let second = JwtIssuer::load_or_create(dir.path(), config(&[]).unwrap(), now + 10).unwrap();
        let a = first.mint(&id(), &["x".into()], 0, now).unwrap();
        let b = second.mint(&id(), &["x".into()], 0, now + 10).unwrap();
        assert_eq!(a.kid, b.kid);
        verify(&second, &a.token, "x");
    }

    #[test]
    fn rotation_announces_before_signing_and_keeps_the_old_key_for_its_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let config = config(&[
            "--max-jwt-svid-ttl",
            "10s",
            "--jwt-svid-ttl",
            "10s",
            "--jwt-key-rotation",
            "20s",
        ])
        .unwrap();
        let t0 = unix_now();
        let issuer = JwtIssuer::load_or_create(dir.path(), config, t0).unwrap();
        let mut changes = issuer.subscribe();
        let old = issuer.mint(&id(), &["x".into()], 0, t0).unwrap();
        // At rotation − max TTL the next key is published, not yet signing.
        assert_eq!(issuer.advance(t0 + 10).unwrap(), t0 + 20);
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        let jwks: serde_json::Value = serde_json::from_slice(&issuer.spiffe_jwks()).unwrap();
        assert_eq!(jwks["keys"].as_array().unwrap().len(), 2);
        assert_eq!(
            issuer.mint(&id(), &["x".into()], 0, t0 + 19).unwrap().kid,
            old.kid
        );
        let new = issuer.mint(&id(), &["x".into()], 0, t0 + 20).unwrap();
        assert_ne!(new.kid, old.kid);
        // The old key stays until its last token (signed at t0+19) expired,
        // plus the clock skew (here the max TTL, 10 s).
        issuer.advance(t0 + 29).unwrap();
        assert!(!changes.has_changed().unwrap());
        issuer
            .advance(t0 + 30 + keys::CLOCK_SKEW.as_secs() as i64)
            .unwrap();
        assert!(changes.has_changed().unwrap());
        let jwks: serde_json::Value = serde_json::from_slice(&issuer.oidc_jwks()).unwrap();
        let kids: Vec<&str> = jwks["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["kid"].as_str().unwrap())
            .collect();
        assert!(!kids.contains(&old.kid.as_str()), "retired: {kids:?}");
        assert!(kids.contains(&new.kid.as_str()));
    }

    #[test]
    fn bad_flags_are_refused_naming_the_flag() {
        for (flags, expected) in [
            (&["--jwt-svid-ttl", "2h"][..], "--jwt-svid-ttl"),
            (
                &["--max-jwt-svid-ttl", "48h", "--jwt-key-rotation", "30d"][..],
                "longer than 24h",
            ),
            (&["--jwt-key-rotation", "90m"][..], "at least twice"),
            (
                &["--jwt-svid-issuer", "oidc.example.com"][..],
                "--jwt-svid-issuer",
            ),
            (
                &["--oidc-listen", "127.0.0.1:0"][..],
                "--oidc-listen needs --jwt-svid-issuer",
            ),
        ] {
            let error = config(flags).unwrap_err().to_string();
            assert!(error.contains(expected), "{flags:?}: {error}");
        }
    }
}
