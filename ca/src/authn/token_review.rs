//! [`TokenReviewAuthenticator`]: service-account tokens checked by the
//! Kubernetes API server (`TokenReview`), as istiod does.
//!
//! - The review asks for the configured audiences; a result is accepted only
//!   if authenticated, the audience is echoed back, the user is in
//!   `system:serviceaccounts` and the username is
//!   `system:serviceaccount:<ns>:<sa>`. Pod name and UID come from
//!   `user.extra`.
//! - Positive results are cached for a short time keyed by the SHA-256 of
//!   the token (the token itself is never stored or logged), never past the
//!   token's `exp`. Concurrent requests with the same token share one review.
//! - Every API call has a timeout and the calls in flight are bounded. An
//!   unreachable or slow API server is `UNAVAILABLE`, not `UNAUTHENTICATED`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::Api;
use meshca_certs::token::parse_service_account_username;
use meshca_certs::{SpiffeId, TrustDomain};
use tokio::sync::{OnceCell, Semaphore};

use super::cache::{TokenHash, VerifiedTokenCache};
use super::{Authenticator, AuthnError, Caller, CallerKind, Credentials, MAX_TOKEN_LEN};

/// Group every service account is in.
pub const SERVICE_ACCOUNTS_GROUP: &str = "system:serviceaccounts";
/// `user.extra` key of the bound pod's name.
pub const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
/// `user.extra` key of the bound pod's UID.
pub const POD_UID_EXTRA: &str = "authentication.kubernetes.io/pod-uid";

/// Settings of the TokenReview authenticator.
#[derive(Debug, Clone)]
pub struct TokenReviewConfig {
    /// Audiences to ask for; one must be echoed back.
    pub audiences: Vec<String>,
    /// Trust domain of the identities.
    pub trust_domain: TrustDomain,
    /// How long a positive result is reused (0: no cache).
    pub cache_ttl: Duration,
    /// Timeout of one API call.
    pub timeout: Duration,
    /// Most API calls in flight at once.
    pub max_in_flight: usize,
}

type ReviewResult = Result<Caller, AuthnError>;

/// Authenticates bearer tokens with the Kubernetes TokenReview API.
pub struct TokenReviewAuthenticator {
    api: Api<TokenReview>,
    config: TokenReviewConfig,
    limiter: Semaphore,
    cache: VerifiedTokenCache,
    in_flight: Mutex<HashMap<TokenHash, Arc<OnceCell<ReviewResult>>>>,
}

impl std::fmt::Debug for TokenReviewAuthenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReviewAuthenticator")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl TokenReviewAuthenticator {
    /// An authenticator using `client`.
    pub fn new(client: kube::Client, config: TokenReviewConfig) -> Self {
        Self {
            api: Api::all(client),
            limiter: Semaphore::new(config.max_in_flight.max(1)),
            cache: VerifiedTokenCache::new(config.cache_ttl),
            config,
            in_flight: Mutex::new(HashMap::new()),
        }
    }

    /// Counts cache hits on `hits` (the `meshca_token_cache_hit_count` metric).
    pub(crate) fn counting_cache_hits(mut self, hits: crate::metrics::IstioCounter) -> Self {
        self.cache = self.cache.counting_hits(hits);
        self
    }

    /// Authenticates one token: from the cache, by joining a review already
    /// in flight for it, or by a new review.
    pub async fn review(&self, token: &str) -> ReviewResult {
        if token.len() > MAX_TOKEN_LEN {
            return Err(AuthnError::MalformedToken);
        }
        let hash = VerifiedTokenCache::key(token);
        if let Some(caller) = self.cache.get(&hash) {
            return Ok(caller);
        }
        let cell = {
            let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            in_flight.entry(hash).or_default().clone()
        };
        let result = cell
            .get_or_init(|| async {
                let result = self.call_api(token).await;
                if let Ok(caller) = &result {
                    self.cache.insert(hash, caller.clone(), token_expiry(token));
                }
                result
            })
            .await
            .clone();
        // The first to finish removes the shared cell; later requests use
        // the cache (or review again after a failure).
        self.in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&hash);
        result
    }

    async fn call_api(&self, token: &str) -> ReviewResult {
        let _permit = self.limiter.acquire().await.map_err(|_| {
            AuthnError::Unavailable("the Kubernetes API client is shutting down".into())
        })?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: Some(self.config.audiences.clone()),
            },
            ..Default::default()
        };
        let reviewed = match tokio::time::timeout(
            self.config.timeout,
            self.api.create(&PostParams::default(), &review),
        )
        .await
        {
            Err(_) => {
                return Err(AuthnError::Unavailable(format!(
                    "the Kubernetes API did not answer the TokenReview within {:?}",
                    self.config.timeout
                )))
            }
            Ok(Err(kube::Error::Api(status))) => {
                return Err(AuthnError::Unavailable(format!(
                    "the Kubernetes API refused the TokenReview ({} {}): check meshca's RBAC (tokenreviews: create)",
                    status.code, status.reason
                )))
            }
            Ok(Err(e)) => {
                return Err(AuthnError::Unavailable(format!(
                    "the Kubernetes API is unreachable: {}",
                    describe_kube_error(&e)
                )))
            }
            Ok(Ok(reviewed)) => reviewed,
        };
        self.caller_from_review(reviewed)
    }

    fn caller_from_review(&self, review: TokenReview) -> ReviewResult {
        let status = review.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            let reason = status
                .error
                .filter(|e| !e.is_empty())
                .map(|e| e.chars().take(200).collect::<String>())
                .unwrap_or_else(|| "not authenticated".into());
            return Err(AuthnError::InvalidToken(format!(
                "the Kubernetes API says: {reason}"
            )));
        }
        let echoed = status.audiences.unwrap_or_default();
        if !echoed.iter().any(|a| self.config.audiences.contains(a)) {
            return Err(AuthnError::WrongAudience(self.config.audiences.clone()));
        }
        let user = status.user.unwrap_or_default();
        let username = user.username.unwrap_or_default();
        let groups = user.groups.unwrap_or_default();
        if !groups.iter().any(|g| g == SERVICE_ACCOUNTS_GROUP) {
            return Err(AuthnError::NotServiceAccount(format!(
                "user {username:?} is not in the group {SERVICE_ACCOUNTS_GROUP}"
            )));
        }
        let (ns, sa) = parse_service_account_username(&username).ok_or_else(|| {
            AuthnError::NotServiceAccount(format!(
                "username {username:?} is not system:serviceaccount:<namespace>:<name>"
            ))
        })?;
        let identity = SpiffeId::for_workload(&self.config.trust_domain, ns, sa)
            .map_err(|e| AuthnError::NotServiceAccount(format!("{username:?}: {e}")))?;
        let extra = user.extra.unwrap_or_default();
        let first = |key: &str| {
            extra
                .get(key)
                .and_then(|v| v.first())
                .cloned()
                .filter(|v| !v.is_empty())
        };
        Ok(Caller {
            identity,
            kind: CallerKind::Token {
                issuer: "kubernetes-tokenreview".into(),
            },
            pod_name: first(POD_NAME_EXTRA),
            pod_uid: first(POD_UID_EXTRA),
        })
    }
}

fn describe_kube_error(e: &kube::Error) -> String {
    // Walk the source chain for the useful part (connection refused,
    // certificate problems), without echoing request bodies.
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message = format!("{message}: {s}");
        source = s.source();
    }
    message.chars().take(300).collect()
}

/// The `exp` of a JWT, read without verification (the API server verified it).
fn token_expiry(token: &str) -> Option<u64> {
    #[derive(serde::Deserialize)]
    struct Exp {
        exp: Option<u64>,
    }
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice::<Exp>(&bytes).ok()?.exp
}

#[async_trait]
impl Authenticator for TokenReviewAuthenticator {
    fn name(&self) -> &'static str {
        "kubernetes-tokenreview"
    }

    async fn authenticate(&self, credentials: &Credentials) -> Result<Option<Caller>, AuthnError> {
        match &credentials.bearer {
            Some(token) => self.review(token).await.map(Some),
            None => Ok(None),
        }
    }
}

/// Connects to the Kubernetes API: `kubeconfig` if given, else the
/// in-cluster service account when running in a pod. `None` when neither.
pub async fn kube_client(
    kubeconfig: Option<&std::path::Path>,
    timeout: Duration,
) -> Result<Option<kube::Client>, String> {
    let mut config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("--kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| format!("--kubeconfig {}: {e}", path.display()))?
        }
        None if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() => kube::Config::incluster()
            .map_err(|e| format!("in-cluster Kubernetes configuration: {e}"))?,
        None => return Ok(None),
    };
    // No read timeout: watches stay open for minutes. Each request/response
    // call is bounded by its own timeout (TokenReview, OIDC).
    config.connect_timeout = Some(timeout);
    config.write_timeout = Some(timeout);
    kube::Client::try_from(config)
        .map(Some)
        .map_err(|e| format!("Kubernetes client: {e}"))
}
