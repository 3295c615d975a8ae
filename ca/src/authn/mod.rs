//! Authentication (docs/authentication.md): who is calling.
//!
//! An `AuthenticatorChain` asks each [`Authenticator`] in order; the first
//! that recognises the credential decides (accepts or refuses). Authenticators:
//! - [`ClientCertAuthenticator`]: an SVID presented over mTLS that chains to
//!   this CA's trust bundle (renewal without a token); a chain of more than
//!   a leaf and three intermediates is refused unverified, and the verdict
//!   on a chain is kept (its connection presents it for every request);
//! - [`JwtAuthenticator`]: a Kubernetes-style service-account token checked
//!   offline against an issuer's keys (the local issuer of the embedded mode,
//!   or `--jwks` with `--jwt-issuer`).
//!
//! - [`TokenReviewAuthenticator`]: a service-account token checked by the
//!   Kubernetes API server (`TokenReview`), only when it is plausible
//!   ([`check_plausible`]), with short positive and negative caches.
//!
//! Time comes from a `clock::Clock` (tests drive it with paused time).
//! Tokens and keys never appear in errors or logs.

pub(crate) mod cache;
pub(crate) mod clock;
pub(crate) mod oidc;
pub mod token_review;

use cache::{RefusedTokenCache, VerifiedTokenCache};
use clock::SharedClock;
pub use token_review::{TokenReviewAuthenticator, TokenReviewConfig};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey};
use meshca_certs::token::ServiceAccountClaims;
use meshca_certs::untrusted_text::shortened;
use meshca_certs::{SpiffeId, TrustDomain};
use rustls_pki_types::CertificateDer;

use crate::authority::Authority;

/// Leeway for `nbf`/`iat` against clock skew with the token issuer. `exp`
/// gets none: an expired token is refused from its expiry second on.
pub(crate) const NOT_BEFORE_LEEWAY_SECS: u64 = 60;
/// Longest bearer token considered (Kubernetes tokens are ~1 KiB).
pub(crate) const MAX_TOKEN_LEN: usize = 16 * 1024;

/// What the caller presented.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// The bearer token from `authorization: Bearer <token>`.
    pub bearer: Option<String>,
    /// The client certificate chain from the TLS handshake (leaf first).
    pub peer_chain: Option<Arc<Vec<CertificateDer<'static>>>>,
}

/// How the caller proved who it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallerKind {
    /// A service-account token from this issuer.
    Token {
        /// The token's `iss`.
        issuer: String,
    },
    /// A client certificate (an SVID this CA's bundle trusts).
    ClientCertificate {
        /// Its serial, hex.
        serial: String,
        /// Its whole lifetime, notAfter − notBefore: a renewal gets no
        /// longer a one.
        lifetime: std::time::Duration,
        /// Its notAfter (Unix seconds): a JWT-SVID minted for the caller
        /// expires no later.
        not_after: i64,
    },
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The SPIFFE identity the caller proved.
    pub identity: SpiffeId,
    /// How it proved it.
    pub kind: CallerKind,
    /// Pod name, if the credential names one.
    pub pod_name: Option<String>,
    /// Pod UID, if the credential names one.
    pub pod_uid: Option<String>,
    /// The remote cluster the caller was authenticated against (its
    /// `clusterid`); `None`: the local cluster.
    pub cluster: Option<String>,
}

/// Why authentication failed (gRPC `UNAUTHENTICATED`, except
/// [`AuthnError::Unavailable`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthnError {
    /// Neither a token nor a client certificate was presented.
    #[error("no credentials: send \"authorization: Bearer <service-account token>\" or a client certificate issued by this CA")]
    NoCredentials,
    /// The token is not a well-formed JWT.
    #[error("the bearer token is not a well-formed JWT")]
    MalformedToken,
    /// No configured authenticator trusts the token's issuer.
    #[error("the token's issuer {0:?} is not trusted by this CA")]
    UntrustedIssuer(String),
    /// The token failed validation.
    #[error("the token is invalid: {0}")]
    InvalidToken(String),
    /// The token has expired.
    #[error("the token expired at {0} (unix seconds)")]
    Expired(u64),
    /// The token is not valid yet.
    #[error("the token is not valid before {0} (unix seconds)")]
    NotYetValid(u64),
    /// The token's audience is not one this CA accepts.
    #[error("the token's audience does not include any of {0:?}")]
    WrongAudience(Vec<String>),
    /// The token is not a service-account token.
    #[error("the token is not a Kubernetes service-account token: {0}")]
    NotServiceAccount(String),
    /// The client certificate is not acceptable.
    #[error("the client certificate is not accepted: {0}")]
    BadClientCertificate(String),
    /// An external dependency (e.g. the Kubernetes API) is unreachable
    /// (gRPC `UNAVAILABLE`). The text is for the caller: it names no host,
    /// no cluster and no error text of the dependency (those are logged).
    #[error("authentication is unavailable: {0}")]
    Unavailable(String),
    /// Too many authentications are waiting for the Kubernetes API
    /// (gRPC `RESOURCE_EXHAUSTED`): retry with backoff.
    #[error("authentication is overloaded: {0}")]
    Overloaded(String),
}

impl AuthnError {
    /// Whether this is a verdict on the credential itself (the same token
    /// will be refused again), rather than a dependency being unreachable
    /// or overloaded.
    pub(crate) fn is_refusal(&self) -> bool {
        !matches!(self, Self::Unavailable(_) | Self::Overloaded(_))
    }
}

/// One way of authenticating callers.
#[async_trait]
pub trait Authenticator: Send + Sync {
    /// A short name for logs and metrics.
    fn name(&self) -> &'static str;
    /// `Ok(None)` when the credential is not one this authenticator knows;
    /// otherwise the caller, or why it is refused.
    async fn authenticate(&self, credentials: &Credentials) -> Result<Option<Caller>, AuthnError>;
}

/// Authenticators asked in order; the first that recognises decides.
#[derive(Clone, Default)]
pub(crate) struct AuthenticatorChain {
    authenticators: Vec<Arc<dyn Authenticator>>,
}

impl std::fmt::Debug for AuthenticatorChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.authenticators.iter().map(|a| a.name()))
            .finish()
    }
}

impl AuthenticatorChain {
    /// An empty chain.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Appends an authenticator.
    pub(crate) fn with(mut self, authenticator: Arc<dyn Authenticator>) -> Self {
        self.authenticators.push(authenticator);
        self
    }

    /// Authenticates the caller.
    pub(crate) async fn authenticate(
        &self,
        credentials: &Credentials,
    ) -> Result<Caller, AuthnError> {
        if credentials.bearer.is_none() && credentials.peer_chain.is_none() {
            return Err(AuthnError::NoCredentials);
        }
        for authenticator in &self.authenticators {
            if let Some(caller) = authenticator.authenticate(credentials).await? {
                return Ok(caller);
            }
        }
        match &credentials.bearer {
            Some(token) => Err(match peek_issuer(token) {
                Ok(iss) => AuthnError::UntrustedIssuer(shortened(&iss, 128)),
                Err(e) => e,
            }),
            None => Err(AuthnError::BadClientCertificate(
                "no authenticator accepts client certificates".into(),
            )),
        }
    }
}

/// Reads `iss` from a JWT without verifying it (to name the issuer in
/// the error when no authenticator takes the token).
fn peek_issuer(token: &str) -> Result<String, AuthnError> {
    UnverifiedJwt::parse(token)?
        .issuer()
        .map(str::to_string)
        .ok_or_else(|| AuthnError::InvalidToken("it has no \"iss\" claim".into()))
}

/// A compact JWT split into its parts and decoded once; nothing in it is
/// verified yet.
struct UnverifiedJwt<'a> {
    header: jsonwebtoken::Header,
    /// The claims, or why they are not a service-account token's.
    claims: Result<ServiceAccountClaims, String>,
    /// `iss` when the claims did not parse (to route the token anyway).
    loose_issuer: Option<String>,
    /// `base64url(header) "." base64url(payload)`: what the signature covers.
    signing_input: &'a str,
    /// The signature, base64url.
    signature: &'a str,
}

impl<'a> UnverifiedJwt<'a> {
    fn parse(token: &'a str) -> Result<Self, AuthnError> {
        #[derive(serde::Deserialize)]
        struct Iss {
            iss: Option<String>,
        }
        if token.len() > MAX_TOKEN_LEN {
            return Err(AuthnError::MalformedToken);
        }
        let (signing_input, signature) =
            token.rsplit_once('.').ok_or(AuthnError::MalformedToken)?;
        let (header_b64, payload_b64) = signing_input
            .split_once('.')
            .ok_or(AuthnError::MalformedToken)?;
        if payload_b64.contains('.') {
            return Err(AuthnError::MalformedToken);
        }
        let decode = |part: &str| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(part.trim_end_matches('='))
                .map_err(|_| AuthnError::MalformedToken)
        };
        let header: jsonwebtoken::Header =
            serde_json::from_slice(&decode(header_b64)?).map_err(|_| AuthnError::MalformedToken)?;
        let payload = decode(payload_b64)?;
        let (claims, loose_issuer) = match serde_json::from_slice::<ServiceAccountClaims>(&payload)
        {
            Ok(claims) => (Ok(claims), None),
            Err(e) => {
                let iss: Iss =
                    serde_json::from_slice(&payload).map_err(|_| AuthnError::MalformedToken)?;
                (Err(e.to_string()), iss.iss)
            }
        };
        Ok(Self {
            header,
            claims,
            loose_issuer,
            signing_input,
            signature,
        })
    }

    fn issuer(&self) -> Option<&str> {
        match &self.claims {
            Ok(claims) => Some(claims.iss.as_str()),
            Err(_) => self.loose_issuer.as_deref(),
        }
    }
}

/// What a token claims, read without verifying anything: enough to tell
/// whether it is worth asking the Kubernetes API server about it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UnverifiedClaims {
    /// `iss`, if a string.
    pub(crate) issuer: Option<String>,
    /// `aud` (a string or a list of strings).
    pub audiences: Vec<String>,
    /// `exp` in Unix seconds, if present.
    pub expires_at: Option<u64>,
}

impl UnverifiedClaims {
    /// Splits and decodes a compact JWT: three non-empty base64url parts,
    /// a JSON header naming a signing algorithm (not `none`) and JSON
    /// claims whose `aud` is a string or a list of strings and whose `exp`
    /// (if any) is a number. Anything else is [`AuthnError::MalformedToken`].
    pub fn parse(token: &str) -> Result<Self, AuthnError> {
        #[derive(serde::Deserialize)]
        struct Header {
            alg: String,
        }
        #[derive(serde::Deserialize)]
        struct Claims {
            #[serde(default)]
            iss: Option<serde_json::Value>,
            #[serde(default)]
            aud: Option<meshca_certs::token::Audiences>,
            #[serde(default)]
            exp: Option<serde_json::Number>,
        }
        if token.len() > MAX_TOKEN_LEN {
            return Err(AuthnError::MalformedToken);
        }
        let mut parts = token.split('.');
        let (Some(header), Some(claims), Some(signature), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(AuthnError::MalformedToken);
        };
        if header.is_empty() || claims.is_empty() || signature.is_empty() {
            return Err(AuthnError::MalformedToken);
        }
        let decode = |part: &str| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(part.trim_end_matches('='))
                .map_err(|_| AuthnError::MalformedToken)
        };
        decode(signature)?;
        let header: Header =
            serde_json::from_slice(&decode(header)?).map_err(|_| AuthnError::MalformedToken)?;
        if header.alg.is_empty() || header.alg.eq_ignore_ascii_case("none") {
            return Err(AuthnError::MalformedToken);
        }
        let claims: Claims =
            serde_json::from_slice(&decode(claims)?).map_err(|_| AuthnError::MalformedToken)?;
        let expires_at = claims.exp.map(|exp| match (exp.as_u64(), exp.as_f64()) {
            (Some(secs), _) => secs,
            // A fraction (allowed by the JWT spec): its whole second.
            (None, Some(secs)) if secs.is_finite() && secs >= 0.0 => secs as u64,
            _ => 0,
        });
        let audiences = match claims.aud {
            None => Vec::new(),
            Some(meshca_certs::token::Audiences::One(one)) => vec![one],
            Some(meshca_certs::token::Audiences::Many(many)) => many,
        };
        Ok(Self {
            issuer: match claims.iss {
                Some(serde_json::Value::String(iss)) => Some(iss),
                _ => None,
            },
            audiences,
            expires_at,
        })
    }
}

/// Whether a bearer token is worth a TokenReview: a well-formed JWT
/// ([`UnverifiedClaims::parse`]), not expired at `now_unix` by its own
/// `exp`, and naming one of `audiences` in its `aud`. Every token the
/// Kubernetes API server issues passes; what fails would be refused by it
/// anyway, so it is refused here without the API call. Nothing is verified.
pub fn check_plausible(
    token: &str,
    audiences: &[String],
    now_unix: u64,
) -> Result<UnverifiedClaims, AuthnError> {
    let claims = UnverifiedClaims::parse(token)?;
    if let Some(exp) = claims.expires_at {
        if now_unix >= exp {
            return Err(AuthnError::Expired(exp));
        }
    }
    if !claims.audiences.iter().any(|a| audiences.contains(a)) {
        return Err(AuthnError::WrongAudience(audiences.to_vec()));
    }
    Ok(claims)
}

/// Errors loading a JWKS.
#[derive(Debug, thiserror::Error)]
pub enum JwksError {
    /// The JWKS is not valid JSON of the JWKS shape.
    #[error("not a valid JWKS document: {0}")]
    Parse(String),
    /// The JWKS holds no usable key.
    #[error("the JWKS holds no usable RS256/ES256 key")]
    NoKeys,
}

struct JwtKey {
    kid: Option<String>,
    algorithm: Algorithm,
    key: DecodingKey,
}

/// Offline validation of service-account tokens from one issuer.
pub struct JwtAuthenticator {
    name: &'static str,
    issuer: String,
    keys: std::sync::RwLock<Arc<Vec<JwtKey>>>,
    audiences: Vec<String>,
    trust_domain: TrustDomain,
    refresher: Option<Arc<dyn JwksFetcher>>,
    fetch_timeout: Duration,
    /// Held by the refresh that is fetching; others wait for it and use
    /// its keys instead of fetching again (single flight).
    refreshing: tokio::sync::Mutex<()>,
    /// Fetches finished, to tell whether one ran while a caller waited.
    fetches: AtomicU64,
    last_refresh: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// A fetch whose refresh was cancelled (its request reset): it runs
    /// on in its own task, and the next refresh takes its keys instead of
    /// fetching again.
    orphaned_fetch: std::sync::Mutex<Option<JwksFetch>>,
    /// SHA-256 of the JWKS document the keys came from, when fetched.
    jwks_digest: std::sync::Mutex<Option<[u8; 32]>>,
    cache: VerifiedTokenCache,
    clock: SharedClock,
}

/// A JWKS fetch running in its own task, and when it was started.
struct JwksFetch {
    handle: tokio::task::JoinHandle<Result<String, String>>,
    started: tokio::time::Instant,
}

/// A refresh's fetch while the refresh awaits it: if the refresh is
/// dropped first, the fetch is left in `orphans` for the next one.
struct FetchAwaited<'a> {
    fetch: Option<JwksFetch>,
    orphans: &'a std::sync::Mutex<Option<JwksFetch>>,
}

impl Drop for FetchAwaited<'_> {
    fn drop(&mut self) {
        if let Some(fetch) = self.fetch.take() {
            *self.orphans.lock().unwrap_or_else(|e| e.into_inner()) = Some(fetch);
        }
    }
}

/// Where fresh keys of an issuer come from (e.g. the Kubernetes API's
/// OIDC discovery), for refreshes on a schedule and on an unknown key ID.
#[async_trait]
pub(crate) trait JwksFetcher: Send + Sync {
    /// The current JWKS document.
    async fn fetch_jwks(&self) -> Result<String, String>;
}

/// Shortest time between two refreshes triggered by unknown key IDs.
pub(crate) const MIN_JWKS_REFRESH_INTERVAL: Duration = Duration::from_secs(10);

/// Longest a JWKS fetch (discovery and keys) may take before the refresh
/// gives up and keeps the old keys.
pub(crate) const DEFAULT_JWKS_FETCH_TIMEOUT: Duration = Duration::from_secs(10);

fn parse_jwks(jwks_json: &str) -> Result<Vec<JwtKey>, JwksError> {
    let set: jsonwebtoken::jwk::JwkSet =
        serde_json::from_str(jwks_json).map_err(|e| JwksError::Parse(e.to_string()))?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve};
        let algorithm = match &jwk.algorithm {
            AlgorithmParameters::EllipticCurve(ec) if ec.curve == EllipticCurve::P256 => {
                Algorithm::ES256
            }
            AlgorithmParameters::EllipticCurve(ec) if ec.curve == EllipticCurve::P384 => {
                Algorithm::ES384
            }
            AlgorithmParameters::RSA(_) => match jwk.common.key_algorithm {
                Some(jsonwebtoken::jwk::KeyAlgorithm::RS384) => Algorithm::RS384,
                Some(jsonwebtoken::jwk::KeyAlgorithm::RS512) => Algorithm::RS512,
                _ => Algorithm::RS256,
            },
            _ => continue,
        };
        let Ok(key) = DecodingKey::from_jwk(jwk) else {
            continue;
        };
        keys.push(JwtKey {
            kid: jwk.common.key_id.clone(),
            algorithm,
            key,
        });
    }
    if keys.is_empty() {
        return Err(JwksError::NoKeys);
    }
    Ok(keys)
}

impl std::fmt::Debug for JwtAuthenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtAuthenticator")
            .field("name", &self.name)
            .field("issuer", &self.issuer)
            .field("keys", &self.key_snapshot().len())
            .finish_non_exhaustive()
    }
}

impl JwtAuthenticator {
    /// An authenticator for tokens with `iss == issuer`, signed by a key of
    /// the JWKS document `jwks_json`, with one of `audiences`.
    pub fn from_jwks(
        name: &'static str,
        issuer: &str,
        jwks_json: &str,
        audiences: Vec<String>,
        trust_domain: TrustDomain,
    ) -> Result<Self, JwksError> {
        let keys = parse_jwks(jwks_json)?;
        Ok(Self {
            name,
            issuer: issuer.to_string(),
            keys: std::sync::RwLock::new(Arc::new(keys)),
            audiences,
            trust_domain,
            refresher: None,
            fetch_timeout: DEFAULT_JWKS_FETCH_TIMEOUT,
            refreshing: tokio::sync::Mutex::new(()),
            fetches: AtomicU64::new(0),
            last_refresh: std::sync::Mutex::new(None),
            orphaned_fetch: std::sync::Mutex::new(None),
            jwks_digest: std::sync::Mutex::new(Some(VerifiedTokenCache::key(jwks_json))),
            cache: VerifiedTokenCache::new(Duration::ZERO),
            clock: clock::system_clock(),
        })
    }

    /// Reads the time from `clock` (token times and the cache).
    #[cfg(test)]
    pub(crate) fn with_clock(mut self, clock: SharedClock) -> Self {
        self.cache = self.cache.with_clock(clock.clone());
        self.clock = clock;
        self
    }

    /// Gives up a key fetch after `timeout` (default
    /// [`DEFAULT_JWKS_FETCH_TIMEOUT`]), keeping the old keys.
    pub(crate) fn with_fetch_timeout(mut self, timeout: Duration) -> Self {
        self.fetch_timeout = timeout;
        self
    }

    /// Refreshes keys from `fetcher` when a token names an unknown key ID
    /// (at most every [`MIN_JWKS_REFRESH_INTERVAL`]) and whenever
    /// [`JwtAuthenticator::refresh`] is called.
    pub(crate) fn with_refresher(mut self, fetcher: Arc<dyn JwksFetcher>) -> Self {
        self.refresher = Some(fetcher);
        self
    }

    /// Reuses a successful validation of the same token for up to `ttl`
    /// (never past its `exp`; zero, the default, checks every time). Saves
    /// the signature check when one caller presents one token many times: a
    /// node agent asking for every pod of its node, retries after backoff.
    /// Forgotten whenever the keys are refreshed.
    pub fn with_cache_ttl(mut self, ttl: Duration) -> Self {
        self.cache = VerifiedTokenCache::new(ttl).with_clock(self.clock.clone());
        self
    }

    /// [`JwtAuthenticator::with_cache_ttl`] holding at most about
    /// `max_entries` validations (a remote cluster's share of the budget).
    pub(crate) fn with_cache(mut self, ttl: Duration, max_entries: usize) -> Self {
        self.cache = VerifiedTokenCache::with_capacity_limit(ttl, max_entries)
            .with_clock(self.clock.clone());
        self
    }

    /// Counts cache hits on `hits` (the `meshca_token_cache_hit_count` metric).
    pub(crate) fn counting_cache_hits(mut self, hits: crate::metrics::IstioCounter) -> Self {
        self.cache = self.cache.counting_hits(hits);
        self
    }

    /// Fetches the keys again (keeps the old ones if that fails or takes
    /// longer than the fetch timeout). Single flight: a call made while
    /// another is fetching waits for it and takes its keys; the number of
    /// keys held is returned.
    pub(crate) async fn refresh(&self) -> Result<usize, String> {
        let seen = self.fetches.load(Ordering::SeqCst);
        self.refresh_with(seen, true).await
    }

    /// [`JwtAuthenticator::refresh`] when fetches finished were `seen`;
    /// with `start_new` false it only waits for a fetch under way (or
    /// takes one a cancelled caller left) and never starts one.
    async fn refresh_with(&self, seen: u64, start_new: bool) -> Result<usize, String> {
        let Some(fetcher) = &self.refresher else {
            return Ok(self.key_snapshot().len());
        };
        let _fetching = self.refreshing.lock().await;
        if self.fetches.load(Ordering::SeqCst) != seen {
            return Ok(self.key_snapshot().len());
        }
        // The fetch runs in a task of its own, so that a caller that goes
        // away (a reset stream) does not cancel it: the fetch is then left
        // for the next refresh to take, instead of started again.
        let orphaned = self
            .orphaned_fetch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        // One left too long ago is stale for a refresh that is due.
        let orphaned = orphaned.filter(|orphan| {
            let fresh = !start_new
                || self.clock.instant().duration_since(orphan.started) < MIN_JWKS_REFRESH_INTERVAL;
            if !fresh {
                orphan.handle.abort();
            }
            fresh
        });
        let fetch = match orphaned {
            Some(orphan) => orphan,
            None if !start_new => return Ok(self.key_snapshot().len()),
            None => {
                let started = self.clock.instant();
                *self.last_refresh.lock().unwrap_or_else(|e| e.into_inner()) = Some(started);
                let (fetcher, timeout) = (fetcher.clone(), self.fetch_timeout);
                let handle = tokio::spawn(async move {
                    tokio::time::timeout(timeout, fetcher.fetch_jwks())
                        .await
                        .map_err(|_| {
                            format!("fetching the issuer's keys took longer than {timeout:?}")
                        })?
                });
                JwksFetch { handle, started }
            }
        };
        let mut awaited = FetchAwaited {
            fetch: Some(fetch),
            orphans: &self.orphaned_fetch,
        };
        let fetched = match awaited.fetch.as_mut() {
            Some(fetch) => (&mut fetch.handle).await,
            None => return Ok(self.key_snapshot().len()),
        };
        awaited.fetch = None;
        self.fetches.fetch_add(1, Ordering::SeqCst);
        let text = fetched.map_err(|e| format!("fetching the issuer's keys failed: {e}"))??;
        let keys = parse_jwks(&text).map_err(|e| e.to_string())?;
        let n = keys.len();
        let digest = VerifiedTokenCache::key(&text);
        let changed = {
            let mut last = self.jwks_digest.lock().unwrap_or_else(|e| e.into_inner());
            last.replace(digest) != Some(digest)
        };
        if changed {
            *self.keys.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(keys);
            // A key may have been withdrawn: nothing validated with it is reused.
            self.cache.clear();
        }
        Ok(n)
    }

    fn key_snapshot(&self) -> Arc<Vec<JwtKey>> {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn knows_key_of(&self, header: &jsonwebtoken::Header) -> bool {
        self.key_snapshot().iter().any(|k| {
            k.algorithm == header.alg
                && match (&header.kid, &k.kid) {
                    (Some(want), Some(have)) => want == have,
                    _ => true,
                }
        })
    }

    /// Validates a token of this issuer and returns the caller.
    pub fn validate(&self, token: &str) -> Result<Caller, AuthnError> {
        let jwt = UnverifiedJwt::parse(token)?;
        self.validate_parsed(&jwt)
    }

    /// The checks after parsing: key, signature, issuer, audience, times.
    /// Each part of the token was decoded once, by [`UnverifiedJwt::parse`].
    fn validate_parsed(&self, jwt: &UnverifiedJwt<'_>) -> Result<Caller, AuthnError> {
        let keys = self.key_snapshot();
        let mut candidates = keys
            .iter()
            .filter(|k| k.algorithm == jwt.header.alg)
            .filter(|k| match (&jwt.header.kid, &k.kid) {
                (Some(want), Some(have)) => want == have,
                _ => true,
            })
            .peekable();
        if candidates.peek().is_none() {
            return Err(AuthnError::InvalidToken(format!(
                "no key of issuer {:?} matches its key ID and algorithm {:?}",
                self.issuer, jwt.header.alg
            )));
        }
        // The signature first: nothing in an unverified token is trusted.
        let verified = candidates.any(|candidate| {
            jsonwebtoken::crypto::verify(
                jwt.signature,
                jwt.signing_input.as_bytes(),
                &candidate.key,
                candidate.algorithm,
            )
            .unwrap_or(false)
        });
        if !verified {
            return Err(AuthnError::InvalidToken(
                "its signature does not verify".into(),
            ));
        }
        let claims = jwt.claims.as_ref().map_err(|e| {
            AuthnError::InvalidToken(format!(
                "its claims are not those of a service-account token: {e}"
            ))
        })?;
        if claims.iss != self.issuer {
            return Err(AuthnError::UntrustedIssuer(shortened(&claims.iss, 128)));
        }
        if !self.audiences.iter().any(|a| claims.aud.contains(a)) {
            return Err(AuthnError::WrongAudience(self.audiences.clone()));
        }
        self.caller_from_claims(claims)
    }

    fn caller_from_claims(&self, claims: &ServiceAccountClaims) -> Result<Caller, AuthnError> {
        let now = self.clock.unix_seconds();
        if now >= claims.exp {
            return Err(AuthnError::Expired(claims.exp));
        }
        if let Some(nbf) = claims.nbf {
            if nbf > now + NOT_BEFORE_LEEWAY_SECS {
                return Err(AuthnError::NotYetValid(nbf));
            }
        }
        let (ns, sa) = claims.service_account().ok_or_else(|| {
            AuthnError::NotServiceAccount(
                "no kubernetes.io claim and \"sub\" is not system:serviceaccount:<namespace>:<name>".into(),
            )
        })?;
        let identity = SpiffeId::for_workload(&self.trust_domain, ns, sa).map_err(|e| {
            AuthnError::NotServiceAccount(format!(
                "namespace/service account do not form a SPIFFE ID: {e}"
            ))
        })?;
        let pod = claims.kubernetes.as_ref().and_then(|k| k.pod.clone());
        Ok(Caller {
            identity,
            kind: CallerKind::Token {
                issuer: claims.iss.clone(),
            },
            pod_name: pod.as_ref().map(|p| p.name.clone()),
            pod_uid: pod.map(|p| p.uid).filter(|u| !u.is_empty()),
            cluster: None,
        })
    }
}

#[async_trait]
impl Authenticator for JwtAuthenticator {
    fn name(&self) -> &'static str {
        self.name
    }

    async fn authenticate(&self, credentials: &Credentials) -> Result<Option<Caller>, AuthnError> {
        let Some(token) = &credentials.bearer else {
            return Ok(None);
        };
        let cache_key = self
            .cache
            .is_enabled()
            .then(|| VerifiedTokenCache::key(token));
        if let Some(caller) = cache_key.as_ref().and_then(|key| self.cache.get(key)) {
            return Ok(Some(caller));
        }
        // Not a JWT, or another issuer's: not this authenticator's to decide.
        let Ok(jwt) = UnverifiedJwt::parse(token) else {
            return Ok(None);
        };
        if jwt.issuer() != Some(self.issuer.as_str()) {
            return Ok(None);
        }
        if self.refresher.is_some() && !self.knows_key_of(&jwt.header) {
            // An unknown key ID costs a discovery and a key fetch: only for
            // a token that could pass the audience and expiry checks after
            // its signature. Anything else is refused here, as it would be
            // with the keys fetched.
            check_plausible(token, &self.audiences, self.clock.unix_seconds())?;
            let now = self.clock.instant();
            let due = self
                .last_refresh
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_none_or(|t| now.duration_since(t) >= MIN_JWKS_REFRESH_INTERVAL);
            // A fetch under way (or left by a cancelled caller) is waited
            // for: its keys may be the ones this token needs. Only a due
            // refresh starts a fetch.
            let seen = self.fetches.load(Ordering::SeqCst);
            let fetching = self.refreshing.try_lock().is_err()
                || self
                    .orphaned_fetch
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_some();
            if due || fetching {
                match self.refresh_with(seen, due).await {
                    Ok(n) => {
                        tracing::info!(issuer = %self.issuer, keys = n, "refreshed the issuer's keys for an unknown key ID")
                    }
                    Err(e) => {
                        tracing::warn!(issuer = %self.issuer, error = %e, "refreshing the issuer's keys failed")
                    }
                }
            }
        }
        // Read before the keys: a refresh that withdraws a key after this
        // point also moves the generation, and this result is not kept.
        let generation = self.cache.generation();
        let caller = self.validate_parsed(&jwt)?;
        if let (Some(key), Ok(claims)) = (cache_key, &jwt.claims) {
            self.cache
                .insert_computed_in(key, caller.clone(), Some(claims.exp), generation);
        }
        Ok(Some(caller))
    }
}

/// How long an accepted client certificate chain is accepted again without
/// verifying it, at most (never past the earliest notAfter in the chain).
pub const CLIENT_CHAIN_ACCEPTED_TTL: Duration = Duration::from_secs(600);
/// How long a refused client certificate chain is refused again without
/// verifying it.
pub const CLIENT_CHAIN_REFUSED_TTL: Duration = Duration::from_secs(5);
/// Most verdicts on client certificate chains kept, in each of the two
/// caches (accepted, refused); a few hundred bytes each.
pub const MAX_CACHED_CLIENT_CHAINS: usize = 4_096;

/// Callers that present an SVID chaining to this CA's trust bundle.
///
/// A chain longer than [`meshca_certs::verify::MAX_PEER_CHAIN_CERTIFICATES`]
/// is refused before any path building. A connection presents one chain
/// for all its requests, so the verdict on a chain is kept, keyed by the
/// SHA-256 of its certificates and the CA material's generation (a new
/// trust bundle is a new generation: nothing verified with the old one is
/// reused): an acceptance for [`CLIENT_CHAIN_ACCEPTED_TTL`] and never past
/// the earliest notAfter in the chain, a refusal for
/// [`CLIENT_CHAIN_REFUSED_TTL`]; at most [`MAX_CACHED_CLIENT_CHAINS`] of
/// each.
pub struct ClientCertAuthenticator {
    authority: Arc<Authority>,
    trust_domain: TrustDomain,
    clock: SharedClock,
    accepted: VerifiedTokenCache,
    refused: RefusedTokenCache,
}

impl ClientCertAuthenticator {
    /// Trusts SVIDs of `trust_domain` that chain to `authority`'s bundle.
    pub fn new(authority: Arc<Authority>, trust_domain: TrustDomain) -> Self {
        Self {
            authority,
            trust_domain,
            clock: clock::system_clock(),
            accepted: VerifiedTokenCache::with_capacity_limit(
                CLIENT_CHAIN_ACCEPTED_TTL,
                MAX_CACHED_CLIENT_CHAINS,
            ),
            refused: RefusedTokenCache::with_capacity_limit(
                CLIENT_CHAIN_REFUSED_TTL,
                MAX_CACHED_CLIENT_CHAINS,
            ),
        }
    }

    /// Reads the time from `clock` (certificate times and the caches).
    #[cfg(test)]
    pub(crate) fn with_clock(mut self, clock: SharedClock) -> Self {
        self.accepted = VerifiedTokenCache::with_capacity_limit(
            CLIENT_CHAIN_ACCEPTED_TTL,
            MAX_CACHED_CLIENT_CHAINS,
        )
        .with_clock(clock.clone());
        self.refused = RefusedTokenCache::with_capacity_limit(
            CLIENT_CHAIN_REFUSED_TTL,
            MAX_CACHED_CLIENT_CHAINS,
        )
        .with_clock(clock.clone());
        self.clock = clock;
        self
    }

    /// The verdict on `chain`: from the caches when they hold one for it
    /// under the current CA material, else verified and remembered.
    fn verify_cached(&self, chain: &[CertificateDer<'static>]) -> Result<Caller, AuthnError> {
        // Read before the bundle (see Authority::generation).
        let key = chain_key(self.authority.generation(), chain);
        if let Some(caller) = self.accepted.get(&key) {
            return Ok(caller);
        }
        if let Some(refusal) = self.refused.get(&key) {
            return Err(refusal);
        }
        match self.verify(chain) {
            Ok((caller, valid_until)) => {
                self.accepted.insert(key, caller.clone(), Some(valid_until));
                Ok(caller)
            }
            Err(e) => {
                tracing::debug!(certificates = chain.len(), error = %e, "client certificate chain refused");
                self.refused.insert(key, e.clone(), None);
                Err(e)
            }
        }
    }

    /// Verifies `chain`: the caller, and until when (Unix seconds) the
    /// verdict holds, the earliest notAfter in the chain (0 when a
    /// certificate's validity cannot be read: the verdict is not kept).
    fn verify(&self, chain: &[CertificateDer<'static>]) -> Result<(Caller, u64), AuthnError> {
        let bundle = self.authority.bundle();
        let refused =
            |e: meshca_certs::VerifyError| AuthnError::BadClientCertificate(e.to_string());
        let ders: Vec<Vec<u8>> = chain.iter().map(|c| c.to_vec()).collect();
        meshca_certs::verify::check_peer_chain_length(&ders, &bundle).map_err(refused)?;
        let svid = meshca_certs::verify::verify_svid(&ders, &bundle, self.clock.now(), None)
            .map_err(refused)?;
        if svid.spiffe_id.trust_domain_name() != self.trust_domain.as_str() {
            return Err(AuthnError::BadClientCertificate(format!(
                "its trust domain {:?} is not this CA's {:?}",
                svid.spiffe_id.trust_domain_name(),
                self.trust_domain.as_str()
            )));
        }
        let valid_until = ders
            .iter()
            .map(|der| {
                meshca_certs::inspect::CertSummary::from_der(der)
                    .map(|c| u64::try_from(c.not_after.unix_timestamp()).unwrap_or(0))
                    .unwrap_or(0)
            })
            .min()
            .unwrap_or(0);
        let caller = Caller {
            identity: svid.spiffe_id,
            kind: CallerKind::ClientCertificate {
                serial: svid.serial_hex,
                lifetime: std::time::Duration::try_from(svid.not_after - svid.not_before)
                    .unwrap_or_default(),
                not_after: svid.not_after.unix_timestamp(),
            },
            pod_name: None,
            pod_uid: None,
            cluster: None,
        };
        Ok((caller, valid_until))
    }
}

/// The cache key of a presented chain under CA material `generation`:
/// SHA-256 over the generation and each certificate, length-prefixed.
fn chain_key(generation: u64, chain: &[CertificateDer<'_>]) -> cache::TokenHash {
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    digest.update(&generation.to_be_bytes());
    for cert in chain {
        digest.update(&(cert.len() as u64).to_be_bytes());
        digest.update(cert);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.finish().as_ref());
    out
}

#[async_trait]
impl Authenticator for ClientCertAuthenticator {
    fn name(&self) -> &'static str {
        "client-certificate"
    }

    async fn authenticate(&self, credentials: &Credentials) -> Result<Option<Caller>, AuthnError> {
        let Some(chain) = &credentials.peer_chain else {
            return Ok(None);
        };
        match self.verify_cached(chain) {
            Ok(caller) => Ok(Some(caller)),
            // A token is there too: let the token decide.
            Err(_) if credentials.bearer.is_some() => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clock::{Clock, TokioClock};
    use meshca_certs::token::{TokenIssuer, TokenRequest};
    use std::time::SystemTime;

    fn issuer_and_authn(audiences: &[&str]) -> (TokenIssuer, JwtAuthenticator) {
        let issuer = TokenIssuer::generate().unwrap();
        let authn = JwtAuthenticator::from_jwks(
            "local",
            issuer.issuer(),
            &issuer.jwks_json(),
            audiences.iter().map(|s| s.to_string()).collect(),
            TrustDomain::default(),
        )
        .unwrap();
        (issuer, authn)
    }

    fn mint(issuer: &TokenIssuer, aud: &str, ttl: u64, at: SystemTime) -> String {
        issuer
            .mint(
                &TokenRequest {
                    namespace: "default".into(),
                    service_account: "web".into(),
                    audiences: vec![aud.into()],
                    ttl: Duration::from_secs(ttl),
                    pod: None,
                },
                at,
            )
            .unwrap()
    }

    /// A bearer token and no client certificate.
    fn creds(token: String) -> Credentials {
        Credentials {
            bearer: Some(token),
            peer_chain: None,
        }
    }

    #[tokio::test]
    async fn accepts_a_good_token_and_refuses_bad_ones() {
        let (issuer, authn) = issuer_and_authn(&["istio-ca"]);
        let chain = AuthenticatorChain::new().with(Arc::new(authn));
        let caller = chain
            .authenticate(&creds(mint(&issuer, "istio-ca", 600, SystemTime::now())))
            .await
            .unwrap();
        assert_eq!(
            caller.identity.as_str(),
            "spiffe://cluster.local/ns/default/sa/web"
        );

        let err = chain
            .authenticate(&creds(mint(&issuer, "other", 600, SystemTime::now())))
            .await
            .unwrap_err();
        assert!(matches!(err, AuthnError::WrongAudience(_)), "{err}");

        let past = SystemTime::now() - Duration::from_secs(3600);
        let err = chain
            .authenticate(&creds(mint(&issuer, "istio-ca", 60, past)))
            .await
            .unwrap_err();
        assert!(matches!(err, AuthnError::Expired(_)), "{err}");

        let (foreign, _) = issuer_and_authn(&["istio-ca"]);
        // Same issuer name, different key: signature does not verify.
        let err = chain
            .authenticate(&creds(mint(&foreign, "istio-ca", 600, SystemTime::now())))
            .await
            .unwrap_err();
        assert!(matches!(err, AuthnError::InvalidToken(_)), "{err}");

        let err = chain
            .authenticate(&creds("garbage".into()))
            .await
            .unwrap_err();
        assert_eq!(err, AuthnError::MalformedToken);
        let err = chain
            .authenticate(&Credentials::default())
            .await
            .unwrap_err();
        assert_eq!(err, AuthnError::NoCredentials);
    }

    /// A JWKS source whose document a test can swap.
    struct SwitchableJwks(std::sync::Mutex<String>);

    #[async_trait]
    impl JwksFetcher for SwitchableJwks {
        async fn fetch_jwks(&self) -> Result<String, String> {
            Ok(self.0.lock().unwrap().clone())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_cached_token_is_reused_only_while_its_key_and_expiry_hold() {
        let clock = TokioClock::new();
        let issuer = TokenIssuer::generate().unwrap();
        let jwks = Arc::new(SwitchableJwks(std::sync::Mutex::new(issuer.jwks_json())));
        let authn = JwtAuthenticator::from_jwks(
            "local",
            issuer.issuer(),
            &issuer.jwks_json(),
            vec!["istio-ca".into()],
            TrustDomain::default(),
        )
        .unwrap()
        .with_clock(clock.clone().shared())
        .with_refresher(jwks.clone())
        .with_cache_ttl(Duration::from_secs(3600));

        let good = mint(&issuer, "istio-ca", 600, clock.now());
        for _ in 0..2 {
            let caller = authn.authenticate(&creds(good.clone())).await.unwrap();
            assert_eq!(
                caller.unwrap().identity.as_str(),
                "spiffe://cluster.local/ns/default/sa/web"
            );
        }
        assert_eq!(authn.cache.len(), 1, "one entry per token");

        // After a good token is cached, no single-byte change of it passes.
        let bytes = good.as_bytes();
        for i in (0..bytes.len()).step_by(3) {
            let mut changed = bytes.to_vec();
            changed[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
            let text = String::from_utf8(changed).unwrap();
            if text
                .split('.')
                .zip(good.split('.'))
                .all(|(a, b)| decode_part(a) == decode_part(b))
            {
                continue;
            }
            assert!(
                !matches!(authn.authenticate(&creds(text)).await, Ok(Some(_))),
                "byte {i} changed was accepted"
            );
        }
        // (Changed key IDs made it fetch the keys again: the same document,
        // so the cache stays.)
        assert_eq!(authn.cache.len(), 1, "failures are not cached");

        // The issuer's key is withdrawn: the refresh forgets what it vouched for.
        let replacement = TokenIssuer::generate().unwrap();
        *jwks.0.lock().unwrap() = replacement.jwks_json();
        authn.refresh().await.unwrap();
        assert!(authn.cache.is_empty());
        let err = authn.authenticate(&creds(good)).await.unwrap_err();
        assert!(matches!(err, AuthnError::InvalidToken(_)), "{err}");

        // A cached token still dies at its `exp` (whole seconds: 2 s from
        // now leaves at least 1 s to use it; paused time gets there at once).
        let short = mint(&replacement, "istio-ca", 2, clock.now());
        assert!(authn.authenticate(&creds(short.clone())).await.is_ok());
        assert_eq!(authn.cache.len(), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        let err = authn.authenticate(&creds(short)).await.unwrap_err();
        assert!(matches!(err, AuthnError::Expired(_)), "{err}");
    }

    /// A JWKS source that counts fetches, answers after `delay`, or never.
    struct SlowJwks {
        document: String,
        delay: Option<Duration>,
        fetches: AtomicU64,
    }

    #[async_trait]
    impl JwksFetcher for SlowJwks {
        async fn fetch_jwks(&self) -> Result<String, String> {
            self.fetches.fetch_add(1, Ordering::SeqCst);
            match self.delay {
                Some(delay) => tokio::time::sleep(delay).await,
                None => std::future::pending::<()>().await,
            }
            Ok(self.document.clone())
        }
    }

    fn refreshing_authn(delay: Option<Duration>) -> (Arc<SlowJwks>, JwtAuthenticator) {
        let issuer = TokenIssuer::generate().unwrap();
        let fetcher = Arc::new(SlowJwks {
            document: TokenIssuer::generate().unwrap().jwks_json(),
            delay,
            fetches: AtomicU64::new(0),
        });
        let authn = JwtAuthenticator::from_jwks(
            "oidc",
            issuer.issuer(),
            &issuer.jwks_json(),
            vec!["istio-ca".into()],
            TrustDomain::default(),
        )
        .unwrap()
        .with_refresher(fetcher.clone());
        (fetcher, authn)
    }

    /// The issuer rotated its key: the CA holds the old one, a fetch
    /// (1 s) brings the new one, and the token is signed with it.
    fn after_a_key_rotation() -> (Arc<SlowJwks>, JwtAuthenticator, String) {
        let original = TokenIssuer::generate().unwrap();
        let rotated = TokenIssuer::generate()
            .unwrap()
            .with_issuer(original.issuer().to_string());
        let fetcher = Arc::new(SlowJwks {
            document: rotated.jwks_json(),
            delay: Some(Duration::from_secs(1)),
            fetches: AtomicU64::new(0),
        });
        let authn = JwtAuthenticator::from_jwks(
            "oidc",
            original.issuer(),
            &original.jwks_json(),
            vec!["istio-ca".into()],
            TrustDomain::default(),
        )
        .unwrap()
        .with_refresher(fetcher.clone());
        let token = mint(&rotated, "istio-ca", 600, SystemTime::now());
        (fetcher, authn, token)
    }

    #[tokio::test(start_paused = true)]
    async fn a_refresh_cancelled_by_its_caller_leaves_its_keys_to_the_next() {
        let (fetcher, authn, token) = after_a_key_rotation();
        // The first caller resets its stream 10 ms into the fetch.
        let first = tokio::time::timeout(
            Duration::from_millis(10),
            authn.authenticate(&creds(token.clone())),
        )
        .await;
        assert!(first.is_err(), "still fetching when its caller left");
        // The next caller, within the 10 s between refreshes, waits for
        // that fetch and is accepted with its keys.
        tokio::time::advance(Duration::from_millis(40)).await;
        let second = authn.authenticate(&creds(token)).await;
        assert!(matches!(second, Ok(Some(_))), "{second:?}");
        assert_eq!(fetcher.fetches.load(Ordering::SeqCst), 1, "one fetch");
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_arriving_during_a_refresh_waits_for_its_keys() {
        let (fetcher, authn, token) = after_a_key_rotation();
        let late = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            authn.authenticate(&creds(token.clone())).await
        };
        let first_creds = creds(token.clone());
        let (first, second) = tokio::join!(authn.authenticate(&first_creds), late);
        assert!(matches!(first, Ok(Some(_))), "{first:?}");
        assert!(matches!(second, Ok(Some(_))), "{second:?}");
        assert_eq!(fetcher.fetches.load(Ordering::SeqCst), 1, "one fetch");
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_unknown_key_ids_fetches_at_most_once_per_interval() {
        let (fetcher, authn) = refreshing_authn(Some(Duration::from_secs(1)));
        // Plausible tokens of the trusted issuer, signed by a key that no
        // fetch will ever list.
        let stranger = TokenIssuer::generate()
            .unwrap()
            .with_issuer(authn.issuer.clone());
        let token = mint(&stranger, "istio-ca", 600, SystemTime::now());
        // Twenty callers, 60 ms apart: before, during and after the fetch
        // the first one starts.
        let callers = (0..20u64).map(|i| {
            let credentials = creds(token.clone());
            let authn = &authn;
            async move {
                tokio::time::sleep(Duration::from_millis(60 * i)).await;
                authn.authenticate(&credentials).await
            }
        });
        for result in futures::future::join_all(callers).await {
            assert!(result.is_err(), "an unknown key is refused");
        }
        assert_eq!(fetcher.fetches.load(Ordering::SeqCst), 1, "one fetch");
        // After the interval, the next such token may fetch again.
        tokio::time::advance(MIN_JWKS_REFRESH_INTERVAL).await;
        assert!(authn.authenticate(&creds(token)).await.is_err());
        assert_eq!(fetcher.fetches.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_refreshes_share_one_fetch() {
        let (fetcher, authn) = refreshing_authn(Some(Duration::from_secs(1)));
        let results = futures::future::join_all((0..10).map(|_| authn.refresh())).await;
        for result in results {
            assert_eq!(result, Ok(1));
        }
        assert_eq!(fetcher.fetches.load(Ordering::SeqCst), 1, "single flight");
        // A later refresh fetches again.
        authn.refresh().await.unwrap();
        assert_eq!(fetcher.fetches.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_implausible_token_with_an_unknown_key_id_fetches_no_keys() {
        let (fetcher, authn) = refreshing_authn(Some(Duration::from_secs(1)));
        // Tokens naming the trusted issuer, signed by a key it does not list.
        let stranger = TokenIssuer::generate()
            .unwrap()
            .with_issuer(authn.issuer.clone());
        let past = SystemTime::now() - Duration::from_secs(3600);
        for (token, what) in [
            (
                mint(&stranger, "other", 600, SystemTime::now()),
                "wrong audience",
            ),
            (mint(&stranger, "istio-ca", 60, past), "expired"),
        ] {
            let err = authn.authenticate(&creds(token)).await.unwrap_err();
            assert!(
                matches!(err, AuthnError::WrongAudience(_) | AuthnError::Expired(_)),
                "{what}: {err}"
            );
        }
        assert_eq!(
            fetcher.fetches.load(Ordering::SeqCst),
            0,
            "no key fetch for a token refused anyway"
        );
        // A plausible one still makes the authenticator look for its key.
        let err = authn
            .authenticate(&creds(mint(&stranger, "istio-ca", 600, SystemTime::now())))
            .await
            .unwrap_err();
        assert!(matches!(err, AuthnError::InvalidToken(_)), "{err}");
        assert_eq!(fetcher.fetches.load(Ordering::SeqCst), 1);
    }

    /// An authority with fresh CA material in `dir`.
    fn authority_in(dir: &std::path::Path) -> Arc<Authority> {
        Arc::new(Authority::new(
            material_in(dir),
            crate::authority::TtlPolicy::default(),
        ))
    }

    fn material_in(dir: &std::path::Path) -> crate::store::CaMaterial {
        crate::store::load_or_create_data_dir(
            dir,
            &TrustDomain::default(),
            time::Duration::days(3650),
            time::OffsetDateTime::now_utc(),
        )
        .unwrap()
    }

    /// The chain a workload presents with an SVID of `authority` living
    /// `ttl_secs` from now.
    fn presented_svid(authority: &Authority, ttl_secs: i64) -> Credentials {
        presented_svid_issued_at(authority, ttl_secs, time::OffsetDateTime::now_utc())
    }

    /// As [`presented_svid`], issued at `issued_at` (a test clock's time).
    fn presented_svid_issued_at(
        authority: &Authority,
        ttl_secs: i64,
        issued_at: time::OffsetDateTime,
    ) -> Credentials {
        let key =
            meshca_certs::PrivateKey::generate(meshca_certs::KeyAlgorithm::EcdsaP256).unwrap();
        let issued = authority
            .sign_workload(
                &meshca_certs::SubjectKey::of(&key).unwrap(),
                &SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap(),
                ttl_secs,
                issued_at,
            )
            .unwrap();
        let answer = meshca_certs::answer::ChainAnswer::parse(&issued.chain_pem).unwrap();
        chain_credentials(answer.presented_chain())
    }

    fn chain_credentials(ders: Vec<Vec<u8>>) -> Credentials {
        Credentials {
            bearer: None,
            peer_chain: Some(Arc::new(
                ders.into_iter().map(CertificateDer::from).collect(),
            )),
        }
    }

    #[tokio::test]
    async fn a_long_client_chain_is_refused_as_too_long() {
        let dir = tempfile::tempdir().unwrap();
        let authority = authority_in(dir.path());
        let authn = ClientCertAuthenticator::new(authority.clone(), TrustDomain::default());
        let good = presented_svid(&authority, 3600);
        let leaf = good.peer_chain.as_ref().unwrap()[0].to_vec();
        // The real leaf and 19 "intermediates" that are not even X.509:
        // refused for the length, not for what the certificates hold.
        let mut chain = vec![leaf];
        chain.extend(std::iter::repeat_n(b"junk".to_vec(), 19));
        let err = authn
            .authenticate(&chain_credentials(chain))
            .await
            .unwrap_err();
        assert!(matches!(err, AuthnError::BadClientCertificate(_)), "{err}");
        assert!(
            err.to_string().contains("too long: 20 certificates"),
            "{err}"
        );
        assert!(authn.authenticate(&good).await.unwrap().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_chain_verdict_is_kept_only_under_the_same_bundle_and_until_not_after() {
        let clock = TokioClock::new().shared();
        let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let authority = authority_in(dir_a.path());
        let other = authority_in(dir_b.path());
        let authn = ClientCertAuthenticator::new(authority.clone(), TrustDomain::default())
            .with_clock(clock.clone());

        // One connection's requests: verified once, then from the cache.
        let svid_a = presented_svid(&authority, 60);
        for _ in 0..3 {
            assert!(authn.authenticate(&svid_a).await.unwrap().is_some());
        }
        assert_eq!(authn.accepted.hits(), 2);
        // A chain of another CA: refused once, then from the cache.
        let svid_b = presented_svid(&other, 3600);
        for _ in 0..3 {
            let err = authn.authenticate(&svid_b).await.unwrap_err();
            assert!(matches!(err, AuthnError::BadClientCertificate(_)), "{err}");
        }
        assert_eq!(authn.refused.hits(), 2);

        // The trust bundle changes (the other CA's material): neither
        // verdict is reused.
        authority.replace(material_in(dir_b.path()));
        let err = authn.authenticate(&svid_a).await.unwrap_err();
        assert!(err.to_string().contains("does not chain"), "{err}");
        assert!(authn.authenticate(&svid_b).await.unwrap().is_some());
        assert_eq!((authn.accepted.hits(), authn.refused.hits()), (2, 2));

        // Back to the first material: an acceptance lasts until notAfter.
        authority.replace(material_in(dir_a.path()));
        // Issued on the test clock: its notAfter is 60 s of that clock
        // from now, however long the real work above took.
        let svid_short =
            presented_svid_issued_at(&authority, 60, time::OffsetDateTime::from(clock.now()));
        assert!(authn.authenticate(&svid_short).await.unwrap().is_some());
        tokio::time::advance(Duration::from_secs(58)).await;
        assert!(authn.authenticate(&svid_short).await.unwrap().is_some());
        assert_eq!(authn.accepted.hits(), 3, "reused before notAfter");
        tokio::time::advance(Duration::from_secs(3)).await;
        let err = authn.authenticate(&svid_short).await.unwrap_err();
        assert!(err.to_string().contains("expired"), "{err}");
        assert_eq!(authn.accepted.hits(), 3, "not reused after notAfter");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_fetch_times_out_and_keeps_the_old_keys() {
        let (_fetcher, authn) = refreshing_authn(None);
        let authn = authn.with_fetch_timeout(Duration::from_secs(3));
        let started = tokio::time::Instant::now();
        let err = authn.refresh().await.unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(3));
        assert!(err.contains("longer than 3s"), "{err}");
        assert_eq!(authn.key_snapshot().len(), 1, "the old key stays");
        // The next refresh is not blocked by the hung one.
        assert!(authn.refresh().await.is_err());
    }

    fn jwt(header: &str, claims: &str, signature: &str) -> String {
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        format!(
            "{}.{}.{}",
            b64.encode(header),
            b64.encode(claims),
            b64.encode(signature)
        )
    }

    #[test]
    fn only_well_formed_unexpired_tokens_for_our_audience_are_plausible() {
        let audiences = vec!["istio-ca".to_string()];
        let now = 1_000_000;
        let header = r#"{"alg":"RS256","kid":"k1"}"#;
        let ok = |claims: &str| check_plausible(&jwt(header, claims, "sig"), &audiences, now);
        assert_eq!(
            ok(
                r#"{"iss":"https://kubernetes.default.svc","aud":["api","istio-ca"],"exp":1000001}"#
            ),
            Ok(UnverifiedClaims {
                issuer: Some("https://kubernetes.default.svc".into()),
                audiences: vec!["api".into(), "istio-ca".into()],
                expires_at: Some(1_000_001),
            })
        );
        assert!(ok(r#"{"aud":"istio-ca"}"#).is_ok(), "one audience, no exp");
        assert_eq!(
            ok(r#"{"aud":"istio-ca","exp":1000000}"#),
            Err(AuthnError::Expired(1_000_000))
        );
        assert_eq!(
            ok(r#"{"aud":"istio-ca","exp":999999.5}"#),
            Err(AuthnError::Expired(999_999))
        );
        for wrong in [r#"{"aud":"vault","exp":2000000}"#, r#"{"exp":2000000}"#] {
            assert_eq!(ok(wrong), Err(AuthnError::WrongAudience(audiences.clone())));
        }
        for malformed in [
            "not-a-jwt".to_string(),
            "a.b".to_string(),
            format!("{}.extra", jwt(header, r#"{"aud":"istio-ca"}"#, "sig")),
            jwt(header, r#"{"aud":"istio-ca"}"#, ""),
            jwt(r#"{"alg":"none"}"#, r#"{"aud":"istio-ca"}"#, "sig"),
            jwt(r#"{"kid":"k1"}"#, r#"{"aud":"istio-ca"}"#, "sig"),
            jwt(header, "not json", "sig"),
            jwt(header, r#"{"aud":7}"#, "sig"),
            jwt(header, r#"{"aud":"istio-ca","exp":"tomorrow"}"#, "sig"),
            "!!.e30.sig".to_string(),
            format!("e30.{}.c2ln", "A".repeat(MAX_TOKEN_LEN)),
        ] {
            assert_eq!(
                check_plausible(&malformed, &audiences, now),
                Err(AuthnError::MalformedToken),
                "{malformed}"
            );
        }
    }

    #[tokio::test]
    async fn without_a_cache_ttl_nothing_is_kept() {
        let (issuer, authn) = issuer_and_authn(&["istio-ca"]);
        let good = mint(&issuer, "istio-ca", 600, SystemTime::now());
        assert!(authn.authenticate(&creds(good)).await.unwrap().is_some());
        assert!(authn.cache.is_empty());
    }

    /// The token with its payload's JSON edited (its signature no longer fits).
    fn with_payload(token: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let parts: Vec<&str> = token.split('.').collect();
        let mut payload: serde_json::Value =
            serde_json::from_slice(&b64.decode(parts[1]).unwrap()).unwrap();
        edit(&mut payload);
        let payload = b64.encode(serde_json::to_vec(&payload).unwrap());
        format!("{}.{}.{}", parts[0], payload, parts[2])
    }

    #[tokio::test]
    async fn tokens_are_routed_by_issuer_and_trusted_only_once_verified() {
        let (issuer, authn) = issuer_and_authn(&["istio-ca"]);
        let chain = AuthenticatorChain::new().with(Arc::new(authn));
        let good = mint(&issuer, "istio-ca", 600, SystemTime::now());
        // Another issuer's token is not this authenticator's: the chain
        // names the issuer nobody trusts.
        let foreign = with_payload(&good, |p| p["iss"] = "https://elsewhere".into());
        assert_eq!(
            chain.authenticate(&creds(foreign)).await.unwrap_err(),
            AuthnError::UntrustedIssuer("https://elsewhere".into())
        );
        // Our issuer, edited claims: the signature fails before any claim
        // is believed (here: another service account, or no expiry).
        for edited in [
            with_payload(&good, |p| {
                p["sub"] = "system:serviceaccount:kube-system:admin".into()
            }),
            with_payload(&good, |p| {
                p.as_object_mut().unwrap().remove("exp");
            }),
        ] {
            let err = chain.authenticate(&creds(edited)).await.unwrap_err();
            assert_eq!(
                err,
                AuthnError::InvalidToken("its signature does not verify".into())
            );
        }
        // Not three parts, or parts that are not base64 JSON.
        for bad in [
            format!("{good}.extra"),
            "a.b".to_string(),
            "e30.e30.".to_string(),
            "!!.e30.sig".to_string(),
        ] {
            let err = chain.authenticate(&creds(bad.clone())).await.unwrap_err();
            assert!(matches!(err, AuthnError::MalformedToken), "{bad}: {err}");
        }
    }

    #[test]
    fn no_single_byte_change_of_a_good_token_is_accepted() {
        let (issuer, authn) = issuer_and_authn(&["istio-ca"]);
        let good = mint(&issuer, "istio-ca", 600, SystemTime::now());
        assert!(authn.validate(&good).is_ok());
        let bytes = good.as_bytes();
        // Every position, a few replacement bytes each (a deterministic
        // stand-in for the `token` fuzz target).
        for i in 0..bytes.len() {
            for replacement in [b'A', b'_', b'.', b'=', 0xff] {
                if bytes[i] == replacement {
                    continue;
                }
                let mut changed = bytes.to_vec();
                changed[i] = replacement;
                let Ok(text) = String::from_utf8(changed) else {
                    continue;
                };
                // base64url has spare bits in the last character of a
                // part: a change there can decode to the same bytes.
                let same_bytes = text.split('.').count() == 3
                    && text
                        .split('.')
                        .zip(good.split('.'))
                        .all(|(a, b)| decode_part(a) == decode_part(b));
                if !same_bytes {
                    assert!(
                        authn.validate(&text).is_err(),
                        "byte {i} set to {replacement:#x} was accepted"
                    );
                }
            }
        }
    }

    fn decode_part(part: &str) -> Option<Vec<u8>> {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(part.trim_end_matches('='))
            .ok()
    }

    #[test]
    fn errors_never_contain_the_token() {
        let (issuer, authn) = issuer_and_authn(&["istio-ca"]);
        let token = mint(&issuer, "other", 600, SystemTime::now());
        let err = authn.validate(&token).unwrap_err().to_string();
        assert!(!err.contains(&token[..20]));
    }
}
