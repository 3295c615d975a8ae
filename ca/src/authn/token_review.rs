//! [`TokenReviewAuthenticator`]: service-account tokens checked by the
//! Kubernetes API server (`TokenReview`), as istiod does.
//!
//! - Only plausible tokens are reviewed ([`check_plausible`]): a bearer
//!   that is not a JWT, whose own `exp` has passed or whose `aud` names
//!   none of the accepted audiences is refused locally, without an API call.
//! - The review asks for the configured audiences; a result is accepted only
//!   if authenticated, the audience is echoed back, the user is in
//!   `system:serviceaccounts` and the username is
//!   `system:serviceaccount:<ns>:<sa>`. Pod name and UID come from
//!   `user.extra`.
//! - Positive results are cached for a short time, definite refusals for a
//!   few seconds, both keyed by the SHA-256 of the token (the token itself
//!   is never stored or logged), never past the token's `exp`.
//! - Concurrent requests with the same token share one review; a request
//!   cancelled while it waits (client gone, deadline) leaves nothing behind.
//! - Every API call has a timeout; at most `max_in_flight` calls run at
//!   once, and the reviews waiting for one are bounded in number and in
//!   time (`Admission`): beyond that, `RESOURCE_EXHAUSTED` at once.
//! - An unreachable or slow API server is `UNAVAILABLE`, not
//!   `UNAUTHENTICATED`. What the API server said is logged (rate limited),
//!   never returned to the caller.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::Api;
use meshca_certs::token::parse_service_account_username;
use meshca_certs::{SpiffeId, TrustDomain};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::OnceCell;

use super::cache::{RefusedTokenCache, TokenHash, VerifiedTokenCache};
use super::clock::{system_clock, SharedClock};
use super::{
    check_plausible, Authenticator, AuthnError, Caller, CallerKind, Credentials, MAX_TOKEN_LEN,
};
use crate::admission::Admission;
use meshca_serve::rate_limited_log::RateLimitedLog;

/// Group every service account is in.
pub(crate) const SERVICE_ACCOUNTS_GROUP: &str = "system:serviceaccounts";
/// `user.extra` key of the bound pod's name.
pub(crate) const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
/// `user.extra` key of the bound pod's UID.
pub(crate) const POD_UID_EXTRA: &str = "authentication.kubernetes.io/pod-uid";
/// Reviews that may wait for an API call, per call in flight, whatever
/// the API server's measured pace. A mass restart with a connection per
/// sidecar brings up to `--max-connections` (1,024) reviews at once,
/// before any pace is measured; each waits at most
/// [`crate::admission::QUEUE_WAIT`], and holds no more than its place
/// among the open requests.
pub(crate) const REVIEWS_WAITING_PER_CALL: usize = 32;
/// Most refusals remembered at once.
pub(crate) const MAX_REMEMBERED_REFUSALS: usize = 10_000;

/// Settings of the TokenReview authenticator.
#[derive(Debug, Clone)]
pub struct TokenReviewConfig {
    /// Audiences to ask for; one must be echoed back.
    pub audiences: Vec<String>,
    /// Trust domain of the identities.
    pub trust_domain: TrustDomain,
    /// How long a positive result is reused (0: no cache).
    pub cache_ttl: Duration,
    /// How long a definite refusal is remembered (0: not at all).
    pub refusal_cache_ttl: Duration,
    /// Timeout of one API call.
    pub timeout: Duration,
    /// Most API calls in flight at once.
    pub max_in_flight: usize,
    /// Most reviews waiting for an API call, at the fastest measured pace
    /// of the API server (see `Admission`); never fewer than 8 per call.
    pub max_waiting: usize,
}

type ReviewResult = Result<Caller, AuthnError>;
type SharedReview = Arc<OnceCell<ReviewResult>>;
type InFlight = Mutex<HashMap<TokenHash, SharedReview>>;

/// Authenticates bearer tokens with the Kubernetes TokenReview API.
pub struct TokenReviewAuthenticator {
    api: Api<TokenReview>,
    config: TokenReviewConfig,
    calls: Admission,
    cache: VerifiedTokenCache,
    refusals: RefusedTokenCache,
    in_flight: InFlight,
    clock: SharedClock,
    api_failure_log: RateLimitedLog,
}

impl std::fmt::Debug for TokenReviewAuthenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReviewAuthenticator")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A request's share in a review: cancelled or finished, it leaves the
/// in-flight map as it found it once no request waits for the review.
struct Flight<'a> {
    in_flight: &'a InFlight,
    hash: TokenHash,
    review: Option<SharedReview>,
}

impl<'a> Flight<'a> {
    fn join(in_flight: &'a InFlight, hash: TokenHash) -> Self {
        let review = lock(in_flight).entry(hash).or_default().clone();
        Self {
            in_flight,
            hash,
            review: Some(review),
        }
    }

    fn review(&self) -> &OnceCell<ReviewResult> {
        self.review
            .as_deref()
            .expect("the share is taken only when the flight is dropped")
    }
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        let mut in_flight = lock(self.in_flight);
        let Some(review) = self.review.take() else {
            return;
        };
        let done = review.initialized();
        let ours = in_flight
            .get(&self.hash)
            .is_some_and(|current| Arc::ptr_eq(current, &review));
        // Dropped under the lock: shares are only taken under it, so the
        // count below is exact.
        drop(review);
        if ours {
            // Finished: later requests use the caches. Unfinished and no
            // one else waiting (every request cancelled): nothing to keep.
            let unshared = in_flight
                .get(&self.hash)
                .is_some_and(|current| Arc::strong_count(current) == 1);
            if done || unshared {
                in_flight.remove(&self.hash);
            }
        }
    }
}

fn lock(in_flight: &InFlight) -> std::sync::MutexGuard<'_, HashMap<TokenHash, SharedReview>> {
    in_flight.lock().unwrap_or_else(|e| e.into_inner())
}

/// The API calls of `config`: at most `max_in_flight` at once; waiting,
/// at least [`REVIEWS_WAITING_PER_CALL`] per call, at most `max_waiting`.
fn review_calls(config: &TokenReviewConfig, waiting: Gauge<i64>) -> Admission {
    let calls = config.max_in_flight.max(1);
    Admission::new(calls, waiting)
        .with_queue_limit(config.max_waiting)
        .with_queue_floor(calls * REVIEWS_WAITING_PER_CALL)
}

impl TokenReviewAuthenticator {
    /// An authenticator using `client`.
    pub fn new(client: kube::Client, config: TokenReviewConfig) -> Self {
        let clock = system_clock();
        Self {
            api: Api::all(client),
            calls: review_calls(&config, Gauge::default()),
            cache: VerifiedTokenCache::new(config.cache_ttl).with_clock(clock.clone()),
            refusals: RefusedTokenCache::with_capacity_limit(
                config.refusal_cache_ttl,
                MAX_REMEMBERED_REFUSALS,
            )
            .with_clock(clock.clone()),
            config,
            in_flight: Mutex::new(HashMap::new()),
            clock,
            api_failure_log: RateLimitedLog::default(),
        }
    }

    /// Reads the time from `clock` (token expiry and both caches).
    #[cfg(test)]
    pub(crate) fn with_clock(mut self, clock: SharedClock) -> Self {
        self.cache = VerifiedTokenCache::new(self.config.cache_ttl).with_clock(clock.clone());
        self.refusals = RefusedTokenCache::with_capacity_limit(
            self.config.refusal_cache_ttl,
            MAX_REMEMBERED_REFUSALS,
        )
        .with_clock(clock.clone());
        self.clock = clock;
        self
    }

    /// Keeps at most `results` positive results and `refusals` refusals
    /// (defaults: [`super::cache::MAX_CACHED_TOKENS`] and
    /// [`MAX_REMEMBERED_REFUSALS`]); a remote cluster's caches are smaller.
    pub(crate) fn with_cache_capacity(mut self, results: usize, refusals: usize) -> Self {
        self.cache = VerifiedTokenCache::with_capacity_limit(self.config.cache_ttl, results)
            .with_clock(self.clock.clone());
        self.refusals =
            RefusedTokenCache::with_capacity_limit(self.config.refusal_cache_ttl, refusals)
                .with_clock(self.clock.clone());
        self
    }

    /// Counts reviews waiting for an API call on `waiting` (a metric).
    pub(crate) fn counting_waiting(mut self, waiting: Gauge<i64>) -> Self {
        self.calls = review_calls(&self.config, waiting);
        self
    }

    /// Counts cache hits on `hits` (the `meshca_token_cache_hit_count` metric).
    pub(crate) fn counting_cache_hits(mut self, hits: crate::metrics::IstioCounter) -> Self {
        self.cache = self.cache.counting_hits(hits);
        self
    }

    /// Reviews waiting for, or sharing, an API call now.
    #[cfg(test)]
    pub(crate) fn reviews_in_flight(&self) -> usize {
        lock(&self.in_flight).len()
    }

    /// Authenticates one token: from the cache, refused locally when it is
    /// not plausible or was refused moments ago, by joining a review
    /// already in flight for it, or by a new review.
    pub(crate) async fn review(&self, token: &str) -> ReviewResult {
        if token.len() > MAX_TOKEN_LEN {
            return Err(AuthnError::MalformedToken);
        }
        let hash = VerifiedTokenCache::key(token);
        if let Some(caller) = self.cache.get(&hash) {
            return Ok(caller);
        }
        let claims = check_plausible(token, &self.config.audiences, self.clock.unix_seconds())?;
        if let Some(refusal) = self.refusals.get(&hash) {
            return Err(refusal);
        }
        let flight = Flight::join(&self.in_flight, hash);
        flight
            .review()
            .get_or_init(|| async {
                let result = self.call_api(token).await;
                match &result {
                    Ok(caller) => self.cache.insert(hash, caller.clone(), claims.expires_at),
                    Err(refusal) if refusal.is_refusal() => {
                        self.refusals
                            .insert(hash, refusal.clone(), claims.expires_at)
                    }
                    Err(_) => {}
                }
                result
            })
            .await
            .clone()
    }

    async fn call_api(&self, token: &str) -> ReviewResult {
        let Some(_call) = self.calls.admit().await else {
            return Err(AuthnError::Overloaded(
                "too many token reviews are waiting for the Kubernetes API".into(),
            ));
        };
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
            Ok(Ok(reviewed)) => reviewed,
            Err(_) => {
                if let Some(unlogged) = self.api_failure_log.record() {
                    tracing::warn!(
                        timeout = ?self.config.timeout,
                        unlogged,
                        "the Kubernetes API did not answer a TokenReview in time"
                    );
                }
                return Err(AuthnError::Unavailable(
                    "the Kubernetes API did not answer in time; retry later".into(),
                ));
            }
            Ok(Err(e)) => {
                if let Some(unlogged) = self.api_failure_log.record() {
                    tracing::warn!(error = %describe_api_failure(&e), unlogged, "a TokenReview failed");
                }
                return Err(AuthnError::Unavailable(match e {
                    kube::Error::Api(_) => {
                        "the Kubernetes API refused to review the token; retry later".into()
                    }
                    _ => "the Kubernetes API is unreachable; retry later".into(),
                }));
            }
        };
        caller_from_review(&self.config, reviewed)
    }
}

/// What a failed API call means, for the log: only a 403 is blamed on
/// meshca's RBAC.
fn describe_api_failure(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) if status.code == 403 => format!(
            "the Kubernetes API forbids meshca to create TokenReviews (403 {}): check meshca's RBAC (tokenreviews: create)",
            status.reason
        ),
        kube::Error::Api(status) if status.code == 401 => format!(
            "the Kubernetes API does not accept meshca's own credentials (401 {}): check its kubeconfig or service-account token",
            status.reason
        ),
        kube::Error::Api(status) => format!(
            "the Kubernetes API answered {} {}: {}",
            status.code,
            status.reason,
            status.message.chars().take(200).collect::<String>()
        ),
        other => format!(
            "the Kubernetes API is unreachable: {}",
            describe_kube_error(other)
        ),
    }
}

/// The caller a TokenReview's answer names, or why it is refused. What the
/// API server says about a refused token is logged at debug level, never
/// returned (it can name the cluster's configuration).
pub fn caller_from_review(config: &TokenReviewConfig, review: TokenReview) -> ReviewResult {
    let status = review.status.unwrap_or_default();
    if status.authenticated != Some(true) {
        if let Some(reason) = status.error.filter(|e| !e.is_empty()) {
            tracing::debug!(
                reason = %reason.chars().take(200).collect::<String>(),
                "the Kubernetes API did not authenticate a token"
            );
        }
        return Err(AuthnError::InvalidToken(
            "the Kubernetes API did not authenticate it".into(),
        ));
    }
    let echoed = status.audiences.unwrap_or_default();
    if !echoed.iter().any(|a| config.audiences.contains(a)) {
        return Err(AuthnError::WrongAudience(config.audiences.clone()));
    }
    let user = status.user.unwrap_or_default();
    let username = user.username.unwrap_or_default();
    let groups = user.groups.unwrap_or_default();
    if !groups.iter().any(|g| g == SERVICE_ACCOUNTS_GROUP) {
        return Err(AuthnError::NotServiceAccount(format!(
            "user {:?} is not in the group {SERVICE_ACCOUNTS_GROUP}",
            username.chars().take(128).collect::<String>()
        )));
    }
    let (ns, sa) = parse_service_account_username(&username).ok_or_else(|| {
        AuthnError::NotServiceAccount(format!(
            "username {:?} is not system:serviceaccount:<namespace>:<name>",
            username.chars().take(128).collect::<String>()
        ))
    })?;
    let identity = SpiffeId::for_workload(&config.trust_domain, ns, sa).map_err(|e| {
        AuthnError::NotServiceAccount(format!(
            "{:?}: {e}",
            username.chars().take(128).collect::<String>()
        ))
    })?;
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
        cluster: None,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authn::clock::{Clock, TokioClock};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// What the scripted API server does with every TokenReview.
    #[derive(Clone, Copy)]
    enum Api {
        /// Never answers.
        Hang,
        /// `authenticated: false`, with an error text.
        Refuse,
        /// Authenticates `system:serviceaccount:default:web`.
        Accept,
        /// Answers with an error status of this code.
        Fail(u16),
    }

    /// A `kube::Client` whose API server is `api`, counting the calls.
    fn client(api: Api, calls: Arc<AtomicUsize>) -> kube::Client {
        let service = tower::service_fn(move |_: http::Request<kube::client::Body>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                let (code, body) = match api {
                    Api::Hang => std::future::pending().await,
                    Api::Refuse => (
                        200,
                        serde_json::json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                            "status": {"authenticated": false, "error": "[invalid bearer token, cluster prod-eu-7: token lookup failed]"}}),
                    ),
                    Api::Accept => (
                        200,
                        serde_json::json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                            "status": {"authenticated": true, "audiences": ["istio-ca"],
                                "user": {"username": "system:serviceaccount:default:web",
                                    "groups": ["system:serviceaccounts", "system:authenticated"],
                                    "extra": {POD_NAME_EXTRA: ["web-1"], POD_UID_EXTRA: ["uid-1"]}}}}),
                    ),
                    Api::Fail(code) => (
                        code,
                        serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "message": "internal detail of cluster prod-eu-7", "reason": "Whatever", "code": code}),
                    ),
                };
                let mut response = http::Response::new(body.to_string());
                *response.status_mut() = http::StatusCode::from_u16(code).unwrap();
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        kube::Client::new(service, "default")
    }

    fn config() -> TokenReviewConfig {
        TokenReviewConfig {
            audiences: vec!["istio-ca".into()],
            trust_domain: TrustDomain::default(),
            cache_ttl: Duration::from_secs(30),
            refusal_cache_ttl: Duration::from_secs(5),
            timeout: Duration::from_secs(5),
            max_in_flight: 4,
            max_waiting: 0,
        }
    }

    fn authenticator(
        api: Api,
        config: TokenReviewConfig,
    ) -> (Arc<AtomicUsize>, TokenReviewAuthenticator) {
        let calls = Arc::new(AtomicUsize::new(0));
        let authn = TokenReviewAuthenticator::new(client(api, calls.clone()), config)
            .with_clock(TokioClock::new().shared());
        (calls, authn)
    }

    /// A JWT-shaped token (unsigned: only the API server can tell) for
    /// `aud`, expiring in an hour; `n` makes it distinct.
    fn token(n: usize, aud: &str) -> String {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let exp = TokioClock::new().unix_seconds() + 3600;
        format!(
            "{}.{}.{}",
            b64.encode(r#"{"alg":"RS256","kid":"k"}"#),
            b64.encode(format!(r#"{{"aud":["{aud}"],"exp":{exp},"jti":"{n}"}}"#)),
            b64.encode("signature")
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_review_leaves_nothing_behind() {
        let (calls, authn) = authenticator(Api::Hang, config());
        for n in 0..100 {
            let token = token(n, "istio-ca");
            let mut review = Box::pin(authn.review(&token));
            for _ in 0..4 {
                // Polled again after the client's worker ran: the call is out.
                assert!(futures::poll!(review.as_mut()).is_pending());
                tokio::task::yield_now().await;
            }
            assert_eq!(authn.reviews_in_flight(), 1);
            // The client goes away (deadline, RST_STREAM): the future is dropped.
            drop(review);
            assert_eq!(
                authn.reviews_in_flight(),
                0,
                "request {n} left its review behind"
            );
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            100,
            "the reviews did reach the API"
        );

        // Two requests share one review; the first cancelled, the second
        // keeps it, then goes too.
        let shared = token(1_000, "istio-ca");
        let mut first = Box::pin(authn.review(&shared));
        let mut second = Box::pin(authn.review(&shared));
        assert!(futures::poll!(first.as_mut()).is_pending());
        assert!(futures::poll!(second.as_mut()).is_pending());
        drop(first);
        assert_eq!(authn.reviews_in_flight(), 1, "still wanted by the second");
        assert!(futures::poll!(second.as_mut()).is_pending());
        drop(second);
        assert_eq!(authn.reviews_in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_requests_share_one_review_and_finish_clean() {
        let (calls, authn) = authenticator(Api::Accept, config());
        let shared = token(1, "istio-ca");
        let results = futures::future::join_all((0..20).map(|_| authn.review(&shared))).await;
        for result in results {
            let caller = result.unwrap();
            assert_eq!(
                caller.identity.as_str(),
                "spiffe://cluster.local/ns/default/sa/web"
            );
            assert_eq!(caller.pod_uid.as_deref(), Some("uid-1"));
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "single flight");
        assert_eq!(authn.reviews_in_flight(), 0);
        authn.review(&shared).await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1, "then from the cache");
    }

    #[tokio::test(start_paused = true)]
    async fn implausible_tokens_cost_no_api_call() {
        let (calls, authn) = authenticator(Api::Accept, config());
        let b64 = |s: &str| {
            use base64::Engine;
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
        };
        let expired = format!(
            "{}.{}.c2ln",
            b64(r#"{"alg":"RS256"}"#),
            b64(r#"{"aud":"istio-ca","exp":1000}"#)
        );
        for (junk, want) in [
            ("random-junk-token".to_string(), AuthnError::MalformedToken),
            ("a.b.c".to_string(), AuthnError::MalformedToken),
            (
                token(1, "vault"),
                AuthnError::WrongAudience(vec!["istio-ca".into()]),
            ),
            (expired, AuthnError::Expired(1000)),
        ] {
            for _ in 0..3 {
                assert_eq!(authn.review(&junk).await.unwrap_err(), want);
            }
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0, "refused locally");
        authn.review(&token(2, "istio-ca")).await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_token_is_refused_again_from_memory_for_a_few_seconds() {
        let (calls, authn) = authenticator(Api::Refuse, config());
        let junk = token(1, "istio-ca");
        for _ in 0..10 {
            let err = authn.review(&junk).await.unwrap_err();
            assert!(matches!(err, AuthnError::InvalidToken(_)), "{err}");
            // The API server's own words (naming the cluster) stay in the log.
            assert!(!err.to_string().contains("prod-eu-7"), "{err}");
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "one review for ten requests"
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        authn.review(&junk).await.unwrap_err();
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "forgotten after the refusal TTL"
        );

        // An unreachable API is not a verdict: not remembered.
        let (calls, authn) = authenticator(Api::Fail(500), config());
        for _ in 0..3 {
            let err = authn.review(&junk).await.unwrap_err();
            assert!(matches!(err, AuthnError::Unavailable(_)), "{err}");
            assert!(!err.to_string().contains("prod-eu-7"), "{err}");
            assert!(!err.to_string().contains("RBAC"), "{err}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn only_a_403_is_blamed_on_rbac() {
        let status = |code: u16| {
            kube::Error::Api(
                kube::core::Status::failure("detail", "Reason")
                    .with_code(code)
                    .boxed(),
            )
        };
        assert!(describe_api_failure(&status(403)).contains("RBAC"));
        for code in [401, 429, 500, 503] {
            let text = describe_api_failure(&status(code));
            assert!(!text.contains("RBAC"), "{code}: {text}");
            assert!(text.contains(&code.to_string()), "{code}: {text}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn reviews_waiting_for_the_api_are_bounded() {
        // One call at a time, 8 may wait (the floor): the 10th distinct
        // token is refused at once, the waiting ones after QUEUE_WAIT.
        let (calls, authn) = authenticator(
            Api::Hang,
            TokenReviewConfig {
                max_in_flight: 1,
                timeout: Duration::from_secs(60),
                ..config()
            },
        );
        let tokens: Vec<String> = (0..10).map(|n| token(n, "istio-ca")).collect();
        let mut pending: Vec<_> = tokens.iter().map(|t| Box::pin(authn.review(t))).collect();
        let last = pending.pop().unwrap();
        for review in &mut pending {
            assert!(futures::poll!(review.as_mut()).is_pending());
        }
        assert!(
            matches!(last.await, Err(AuthnError::Overloaded(_))),
            "refused at once"
        );
        let started = tokio::time::Instant::now();
        let waiting = pending.split_off(1);
        for review in waiting {
            assert!(matches!(review.await, Err(AuthnError::Overloaded(_))));
        }
        assert_eq!(started.elapsed(), crate::admission::QUEUE_WAIT);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "one call in flight at a time"
        );
        drop(pending);
        assert_eq!(authn.reviews_in_flight(), 0);
    }
}
