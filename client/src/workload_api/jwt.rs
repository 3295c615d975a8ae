//! JWT-SVIDs on the socket: a cache of tokens minted by the CA, per
//! identity and audience set, renewed at half-life as SPIRE's agent does;
//! the trust domain's JWT bundle, followed at the pace the CA announces;
//! and validation of a token against that bundle.
//!
//! Bounds: at most [`MAX_CACHED_JWT_SVIDS`] tokens cached (a full cache
//! first drops expired tokens, then the one used longest ago); requests
//! for one identity and audience set share one mint (the others wait for
//! it), so a burst of callers costs the CA one request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use meshca_certs::SpiffeId;
use tokio::sync::watch;
use tonic::Status;

use crate::caclient::{CaClient, MintedJwtSvid};
use crate::issuer::ClientError;

/// Most JWT-SVIDs the agent keeps (each a few hundred bytes).
pub const MAX_CACHED_JWT_SVIDS: usize = 4096;
/// Most audiences in one request (as the CA's bound).
pub const MAX_AUDIENCES: usize = 16;
/// The algorithms a JWT-SVID may be signed with (the SPIFFE JWT-SVID
/// specification's list); anything else (`none`, `HS256`…) is refused.
pub const ALLOWED_ALGORITHMS: [&str; 9] = [
    "RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "PS256", "PS384", "PS512",
];
/// Shortest and longest wait between two fetches of the bundle.
const BUNDLE_REFRESH_BOUNDS: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(300));

/// A cached token.
#[derive(Debug, Default)]
struct Slot {
    token: Option<MintedJwtSvid>,
}

type CacheKey = (SpiffeId, Vec<String>);

/// One entry of the cache: its token behind a lock (one mint at a time).
#[derive(Debug, Clone)]
struct Entry {
    slot: Arc<tokio::sync::Mutex<Slot>>,
    last_used: std::time::Instant,
}

/// The trust domain's JWT keys, parsed once per change.
pub(crate) struct JwtBundle {
    /// The JWKS as the CA sent it (what `FetchJWTBundles` serves).
    pub(crate) jwks: Vec<u8>,
    keys: HashMap<String, DecodingKey>,
}

impl std::fmt::Debug for JwtBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtBundle")
            .field("kids", &self.keys.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl JwtBundle {
    /// Parses a JWKS; keys without a `kid` or of an unknown type are skipped.
    pub(crate) fn parse(jwks: Vec<u8>) -> Result<Self, String> {
        let set: jsonwebtoken::jwk::JwkSet =
            serde_json::from_slice(&jwks).map_err(|e| format!("the JWKS is not valid: {e}"))?;
        let keys = set
            .keys
            .iter()
            .filter_map(|jwk| {
                let kid = jwk.common.key_id.clone()?;
                DecodingKey::from_jwk(jwk).ok().map(|key| (kid, key))
            })
            .collect();
        Ok(Self { jwks, keys })
    }

    /// The key IDs.
    #[cfg(test)]
    pub(crate) fn kids(&self) -> Vec<String> {
        self.keys.keys().cloned().collect()
    }
}

/// What a validated JWT-SVID says.
#[derive(Debug, Clone)]
pub(crate) struct Validated {
    /// Its `sub`.
    pub(crate) spiffe_id: SpiffeId,
    /// Every claim.
    pub(crate) claims: prost_types::Struct,
}

/// The agent's JWT-SVIDs and JWT bundle.
#[derive(Debug)]
pub struct JwtSvids {
    client: CaClient,
    cache: Mutex<HashMap<CacheKey, Entry>>,
    bundle: watch::Sender<Option<Arc<JwtBundle>>>,
}

fn unix_now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

/// The status a workload sees for a CA failure.
fn status_of(error: &ClientError) -> Status {
    match error {
        ClientError::Rpc { code, message } => {
            Status::new(*code, format!("the CA refused: {message}"))
        }
        ClientError::Unreachable { .. } => Status::unavailable(error.to_string()),
        other => Status::unavailable(other.to_string()),
    }
}

/// Whether a failed renewal may fall back on the cached token: only when
/// the CA could not answer (unreachable, overloaded, out of time), never
/// when it refused the identity (`PERMISSION_DENIED` for a revoked
/// identity, `UNAUTHENTICATED`, …).
fn renewal_may_wait(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::Unavailable | tonic::Code::ResourceExhausted | tonic::Code::DeadlineExceeded
    )
}

impl JwtSvids {
    /// Tokens and the bundle from `client`'s CA.
    pub fn new(client: CaClient) -> Arc<Self> {
        Arc::new(Self {
            client,
            cache: Mutex::new(HashMap::new()),
            bundle: watch::channel(None).0,
        })
    }

    /// Follows the bundle: fetched now, then again after the CA's refresh
    /// hint (1 s to 5 min); failures are retried after 1 s doubling to a
    /// minute, the last bundle kept meanwhile. Runs until the task is
    /// dropped.
    pub async fn follow_bundle(self: Arc<Self>) {
        let mut backoff = Duration::from_secs(1);
        let mut last_error: Option<String> = None;
        loop {
            let wait = match self.client.fetch_jwt_bundle().await {
                Ok(answer) => {
                    backoff = Duration::from_secs(1);
                    if last_error.take().is_some() {
                        tracing::info!("JWT bundle fetched again");
                    }
                    let same = self
                        .bundle
                        .borrow()
                        .as_ref()
                        .is_some_and(|b| b.jwks == answer.jwks);
                    if !same {
                        match JwtBundle::parse(answer.jwks) {
                            Ok(bundle) => {
                                tracing::info!(kids = ?bundle.keys.keys().collect::<Vec<_>>(), "JWT bundle changed");
                                self.bundle.send_replace(Some(Arc::new(bundle)));
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "the CA's JWT bundle is unusable; keeping the last one")
                            }
                        }
                    }
                    answer
                        .refresh_hint
                        .clamp(BUNDLE_REFRESH_BOUNDS.0, BUNDLE_REFRESH_BOUNDS.1)
                }
                Err(e) => {
                    let text = e.to_string();
                    if last_error.as_deref() != Some(text.as_str()) {
                        tracing::warn!(error = %text, "fetching the JWT bundle failed; retrying");
                        last_error = Some(text);
                    }
                    let wait = backoff;
                    backoff = (backoff * 2).min(Duration::from_secs(60));
                    wait
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Told of every new bundle.
    pub(crate) fn bundle(&self) -> watch::Receiver<Option<Arc<JwtBundle>>> {
        self.bundle.subscribe()
    }

    /// A JWT-SVID of `identity` for `audiences`: the cached one while it
    /// has more than half of its life left, else a new one from the CA
    /// (a failed renewal serves the cached token while it is valid).
    pub(crate) async fn fetch(
        &self,
        identity: &SpiffeId,
        audiences: &[String],
    ) -> Result<MintedJwtSvid, Status> {
        let mut audiences: Vec<String> = audiences.iter().map(|a| a.trim().to_string()).collect();
        audiences.sort();
        audiences.dedup();
        if audiences.iter().any(String::is_empty) || audiences.is_empty() {
            return Err(Status::invalid_argument(
                "FetchJWTSVID needs at least one audience, none empty",
            ));
        }
        if audiences.len() > MAX_AUDIENCES {
            return Err(Status::invalid_argument(format!(
                "{} audiences, at most {MAX_AUDIENCES}",
                audiences.len()
            )));
        }
        let slot = self.entry((identity.clone(), audiences.clone()));
        let mut slot = slot.lock().await;
        let now = unix_now();
        if let Some(token) = &slot.token {
            let half_life = token.issued_at + (token.expires_at - token.issued_at) / 2;
            if now < half_life {
                return Ok(token.clone());
            }
        }
        match self.client.mint_jwt_svid(identity, &audiences, None).await {
            Ok(token) => {
                tracing::debug!(identity = %identity, exp = token.expires_at, "JWT-SVID minted");
                slot.token = Some(token.clone());
                Ok(token)
            }
            Err(e) => {
                let status = status_of(&e);
                match &slot.token {
                    // The CA could not answer now: the token it gave is
                    // still good until its exp.
                    Some(token) if now < token.expires_at && renewal_may_wait(status.code()) => {
                        tracing::warn!(identity = %identity, error = %e, "renewing a JWT-SVID failed; serving the cached one");
                        Ok(token.clone())
                    }
                    // The CA refused (revoked, no longer authorized): the
                    // cached token is dropped, not served on.
                    _ => {
                        slot.token = None;
                        Err(status)
                    }
                }
            }
        }
    }

    /// The cache entry of `key`, made if absent; a full cache first drops
    /// expired tokens, then the entry used longest ago.
    fn entry(&self, key: CacheKey) -> Arc<tokio::sync::Mutex<Slot>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        if let Some(entry) = cache.get_mut(&key) {
            entry.last_used = now;
            return entry.slot.clone();
        }
        if cache.len() >= MAX_CACHED_JWT_SVIDS {
            let unix = unix_now();
            cache.retain(|_, entry| match entry.slot.try_lock() {
                Ok(slot) => slot.token.as_ref().is_some_and(|t| t.expires_at > unix),
                Err(_) => true,
            });
            if cache.len() >= MAX_CACHED_JWT_SVIDS {
                if let Some(oldest) = cache
                    .iter()
                    .min_by_key(|(_, e)| e.last_used)
                    .map(|(k, _)| k.clone())
                {
                    cache.remove(&oldest);
                }
            }
        }
        let slot = Arc::new(tokio::sync::Mutex::new(Slot::default()));
        cache.insert(
            key,
            Entry {
                slot: slot.clone(),
                last_used: now,
            },
        );
        slot
    }

    /// Validates `token` for `audience` against the current bundle.
    pub(crate) fn validate(&self, token: &str, audience: &str) -> Result<Validated, Status> {
        let bundle = self.bundle.borrow().clone();
        let Some(bundle) = bundle else {
            return Err(Status::unavailable(
                "no JWT bundle from the CA yet; retry shortly",
            ));
        };
        validate(&bundle, token, audience).map_err(Status::invalid_argument)
    }
}

/// Validates `token` for `audience` against `bundle`: the header's `alg`
/// on the specification's list, its `kid` in the bundle, the signature,
/// `aud`, `exp` (no leeway) and `nbf`, and `sub` a SPIFFE ID. The error
/// names what failed.
pub(crate) fn validate(
    bundle: &JwtBundle,
    token: &str,
    audience: &str,
) -> Result<Validated, String> {
    if audience.trim().is_empty() {
        return Err("ValidateJWTSVID needs the audience of the validating party".into());
    }
    let mut parts = token.split('.');
    let (Some(header), Some(_), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("the token is not a JWS in compact form (three parts)".into());
    };
    let header: serde_json::Value = URL_SAFE_NO_PAD
        .decode(header)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .ok_or("the token's header is not base64url JSON")?;
    let alg = header.get("alg").and_then(|a| a.as_str()).unwrap_or("");
    if !ALLOWED_ALGORITHMS.contains(&alg) {
        return Err(format!(
            "the token's algorithm {:?} is not allowed for JWT-SVIDs (allowed: {})",
            meshca_certs::untrusted_text::shortened(alg, 32),
            ALLOWED_ALGORITHMS.join(", ")
        ));
    }
    if let Some(typ) = header.get("typ").and_then(|t| t.as_str()) {
        if typ != "JWT" && typ != "JOSE" {
            return Err(format!(
                "the token's typ {:?} is not JWT or JOSE",
                meshca_certs::untrusted_text::shortened(typ, 32)
            ));
        }
    }
    let algorithm: Algorithm = alg
        .parse()
        .map_err(|_| format!("the algorithm {alg} is not supported by this agent"))?;
    let kid = header
        .get("kid")
        .and_then(|k| k.as_str())
        .ok_or("the token's header has no kid")?;
    let key = bundle.keys.get(kid).ok_or_else(|| {
        format!(
            "the token's key {:?} is not in the trust domain's JWT bundle (a retired or foreign key)",
            meshca_certs::untrusted_text::shortened(kid, 64)
        )
    })?;
    let mut validation = Validation::new(algorithm);
    validation.leeway = 0;
    validation.validate_nbf = true;
    validation.set_audience(&[audience]);
    validation.set_required_spec_claims(&["exp", "aud", "sub"]);
    let data =
        jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(token, key, &validation)
            .map_err(|e| {
                use jsonwebtoken::errors::ErrorKind;
                match e.kind() {
                    ErrorKind::ExpiredSignature => "the token has expired".to_string(),
                    ErrorKind::InvalidAudience => format!(
                        "the token's aud does not name {:?}",
                        meshca_certs::untrusted_text::shortened(audience, 256)
                    ),
                    ErrorKind::InvalidSignature => {
                        "the token's signature does not verify".to_string()
                    }
                    ErrorKind::ImmatureSignature => "the token is not valid yet (nbf)".to_string(),
                    ErrorKind::MissingRequiredClaim(claim) => {
                        format!("the token has no {claim} claim")
                    }
                    ErrorKind::InvalidAlgorithm => {
                        "the token's algorithm does not fit its key".to_string()
                    }
                    _ => format!("the token is invalid: {e}"),
                }
            })?;
    let sub = data
        .claims
        .get("sub")
        .and_then(|s| s.as_str())
        .ok_or("the token's sub is not a string")?;
    let spiffe_id =
        SpiffeId::parse(sub).map_err(|e| format!("the token's sub is not a SPIFFE ID: {e}"))?;
    let claims = prost_types::Struct {
        fields: data
            .claims
            .into_iter()
            .map(|(k, v)| (k, to_prost(v)))
            .collect(),
    };
    Ok(Validated { spiffe_id, claims })
}

fn to_prost(value: serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match value {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        serde_json::Value::String(s) => Kind::StringValue(s),
        serde_json::Value::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.into_iter().map(to_prost).collect(),
        }),
        serde_json::Value::Object(o) => Kind::StructValue(prost_types::Struct {
            fields: o.into_iter().map(|(k, v)| (k, to_prost(v))).collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ring::rand::SystemRandom;
    use ring::signature::{EcdsaKeyPair, KeyPair as _, ECDSA_P256_SHA256_FIXED_SIGNING};

    struct Key {
        pair: EcdsaKeyPair,
        kid: String,
    }

    fn key(kid: &str) -> Key {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        Key {
            pair: EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
                .unwrap(),
            kid: kid.into(),
        }
    }

    fn jwks(keys: &[&Key]) -> JwtBundle {
        let keys: Vec<_> = keys
            .iter()
            .map(|k| {
                let point = k.pair.public_key().as_ref();
                serde_json::json!({"kty": "EC", "crv": "P-256", "kid": k.kid, "use": "jwt-svid",
                    "x": URL_SAFE_NO_PAD.encode(&point[1..33]), "y": URL_SAFE_NO_PAD.encode(&point[33..])})
            })
            .collect();
        JwtBundle::parse(serde_json::json!({ "keys": keys }).to_string().into_bytes()).unwrap()
    }

    fn token(key: &Key, header: serde_json::Value, claims: serde_json::Value) -> String {
        let signing_input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let signature = key
            .pair
            .sign(&SystemRandom::new(), signing_input.as_bytes())
            .unwrap();
        format!(
            "{signing_input}.{}",
            URL_SAFE_NO_PAD.encode(signature.as_ref())
        )
    }

    fn claims(aud: &str, exp: i64) -> serde_json::Value {
        serde_json::json!({"sub": "spiffe://cluster.local/ns/default/sa/web", "aud": aud, "exp": exp, "iat": unix_now()})
    }

    fn header(kid: &str) -> serde_json::Value {
        serde_json::json!({"alg": "ES256", "kid": kid, "typ": "JWT"})
    }

    #[test]
    fn a_good_token_answers_its_spiffe_id_and_claims() {
        let k = key("k1");
        let bundle = jwks(&[&k]);
        assert_eq!(bundle.kids(), vec!["k1".to_string()]);
        let t = token(&k, header("k1"), claims("vault", unix_now() + 60));
        let v = validate(&bundle, &t, "vault").unwrap();
        assert_eq!(
            v.spiffe_id.to_string(),
            "spiffe://cluster.local/ns/default/sa/web"
        );
        assert!(v.claims.fields.contains_key("exp"));
    }

    #[test]
    fn each_failure_is_named() {
        let k = key("k1");
        let retired = key("old");
        let bundle = jwks(&[&k]);
        let now = unix_now();
        let cases = [
            (
                token(&k, header("k1"), claims("other", now + 60)),
                "aud does not name",
            ),
            (token(&k, header("k1"), claims("vault", now - 1)), "expired"),
            (
                token(&retired, header("old"), claims("vault", now + 60)),
                "not in the trust domain's JWT bundle",
            ),
            (
                token(
                    &k,
                    serde_json::json!({"alg": "ES256", "typ": "JWT"}),
                    claims("vault", now + 60),
                ),
                "no kid",
            ),
            (
                token(
                    &k,
                    serde_json::json!({"alg": "ES256", "kid": "k1", "typ": "x"}),
                    claims("vault", now + 60),
                ),
                "typ",
            ),
            ("a.b".to_string(), "three parts"),
        ];
        for (t, expected) in cases {
            let e = validate(&bundle, &t, "vault").unwrap_err();
            assert!(e.contains(expected), "{expected}: {e}");
        }
        // alg none and HS256, whatever their signature.
        let body = URL_SAFE_NO_PAD.encode(claims("vault", now + 60).to_string());
        for alg in ["none", "HS256"] {
            let h =
                URL_SAFE_NO_PAD.encode(serde_json::json!({"alg": alg, "kid": "k1"}).to_string());
            let e = validate(&bundle, &format!("{h}.{body}."), "vault").unwrap_err();
            assert!(
                e.contains(&format!("algorithm \"{alg}\" is not allowed")),
                "{e}"
            );
        }
        // A signature of another key under a known kid.
        let forged = token(&retired, header("k1"), claims("vault", now + 60));
        let e = validate(&bundle, &forged, "vault").unwrap_err();
        assert!(e.contains("signature does not verify"), "{e}");
    }

    #[test]
    fn only_a_ca_that_could_not_answer_lets_the_cached_token_be_served() {
        use tonic::Code;
        for code in [
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
        ] {
            assert!(super::renewal_may_wait(code), "{code:?}");
        }
        for code in [
            Code::PermissionDenied,
            Code::Unauthenticated,
            Code::InvalidArgument,
            Code::Internal,
        ] {
            assert!(!super::renewal_may_wait(code), "{code:?}");
        }
    }
}
