//! [`VerifiedTokenCache`]: positive authentication results reused for a
//! short time, keyed by the SHA-256 of the token.
//!
//! Used by the TokenReview authenticator (saves an API round trip) and by
//! offline JWT validation (saves a signature check: one node agent such as
//! ztunnel presents the same token for every pod of its node, and agents
//! retry with the same token after `RESOURCE_EXHAUSTED`). The Kubernetes API
//! server does the same for its own token authenticators (10 s by default).
//!
//! - Only successes are stored; a failure is always decided afresh.
//! - The token itself is never stored, only its hash.
//! - An entry lives for the configured TTL, never past the token's `exp`.
//! - The cache is bounded: when full, expired entries are dropped and, if
//!   it is still full, new results are simply not cached.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::Caller;
use crate::metrics::IstioCounter;

/// The SHA-256 of a token: the cache key.
pub(crate) type TokenHash = [u8; 32];

/// Most entries a cache holds (about 250 bytes each).
pub(crate) const MAX_CACHED_TOKENS: usize = 50_000;

struct CachedCaller {
    caller: Caller,
    until: Instant,
}

/// Successful authentications, reused for a short time.
pub(crate) struct VerifiedTokenCache {
    ttl: Duration,
    max_entries: usize,
    entries: Mutex<HashMap<TokenHash, CachedCaller>>,
    hits: IstioCounter,
}

impl std::fmt::Debug for VerifiedTokenCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifiedTokenCache")
            .field("ttl", &self.ttl)
            .field("entries", &self.len())
            .finish_non_exhaustive()
    }
}

impl VerifiedTokenCache {
    /// A cache keeping results for `ttl` (zero: a cache that keeps nothing).
    pub(crate) fn new(ttl: Duration) -> Self {
        Self::with_capacity_limit(ttl, MAX_CACHED_TOKENS)
    }

    /// A cache of at most `max_entries` results.
    pub(crate) fn with_capacity_limit(ttl: Duration, max_entries: usize) -> Self {
        Self {
            ttl,
            max_entries,
            entries: Mutex::new(HashMap::new()),
            hits: IstioCounter::default(),
        }
    }

    /// Counts every hit on `hits` (e.g. a metric shared by several caches).
    pub(crate) fn counting_hits(mut self, hits: IstioCounter) -> Self {
        self.hits = hits;
        self
    }

    /// Hits so far.
    #[cfg(test)]
    pub(crate) fn hits(&self) -> u64 {
        self.hits.get()
    }

    /// Whether results are kept at all.
    pub(crate) fn is_enabled(&self) -> bool {
        !self.ttl.is_zero() && self.max_entries > 0
    }

    /// The cache key of `token`.
    pub(crate) fn key(token: &str) -> TokenHash {
        let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
        let mut out = [0u8; 32];
        out.copy_from_slice(digest.as_ref());
        out
    }

    /// The caller cached for `key`, if its entry is still live.
    pub(crate) fn get(&self, key: &TokenHash) -> Option<Caller> {
        if !self.is_enabled() {
            return None;
        }
        let mut entries = self.lock();
        match entries.get(key) {
            Some(entry) if entry.until > Instant::now() => {
                self.hits.inc();
                Some(entry.caller.clone())
            }
            Some(_) => {
                entries.remove(key);
                None
            }
            None => None,
        }
    }

    /// Remembers that the token hashed to `key` authenticated as `caller`;
    /// `expires_at` is the token's `exp` (Unix seconds), if it has one.
    pub(crate) fn insert(&self, key: TokenHash, caller: Caller, expires_at: Option<u64>) {
        if !self.is_enabled() {
            return;
        }
        let mut ttl = self.ttl;
        if let Some(exp) = expires_at {
            // To the sub-second: a token is dead from the start of its `exp` second.
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            ttl = ttl.min(Duration::from_secs(exp).saturating_sub(now));
        }
        if ttl.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut entries = self.lock();
        if entries.len() >= self.max_entries && !entries.contains_key(&key) {
            entries.retain(|_, e| e.until > now);
            if entries.len() >= self.max_entries {
                return;
            }
        }
        entries.insert(
            key,
            CachedCaller {
                caller,
                until: now + ttl,
            },
        );
    }

    /// Forgets everything (e.g. after the signing keys changed).
    pub(crate) fn clear(&self) {
        self.lock().clear();
    }

    /// Entries held, live or not yet dropped.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no entry is held.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TokenHash, CachedCaller>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authn::CallerKind;
    use meshca_certs::{SpiffeId, TrustDomain};

    fn caller(sa: &str) -> Caller {
        let td = TrustDomain::new("cluster.local").unwrap();
        Caller {
            identity: SpiffeId::for_workload(&td, "default", sa).unwrap(),
            kind: CallerKind::Token {
                issuer: "https://issuer".into(),
            },
            pod_name: None,
            pod_uid: None,
        }
    }

    fn now_unix() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    #[test]
    fn a_stored_result_is_found_by_the_same_token_only() {
        let cache = VerifiedTokenCache::new(Duration::from_secs(10));
        let key = VerifiedTokenCache::key("token-a");
        cache.insert(key, caller("a"), Some(now_unix() + 3600));
        let hit = cache.get(&key).expect("cached");
        assert_eq!(cache.hits(), 1);
        assert_eq!(
            hit.identity.to_string(),
            "spiffe://cluster.local/ns/default/sa/a"
        );
        assert!(cache.get(&VerifiedTokenCache::key("token-b")).is_none());
        assert!(cache.get(&VerifiedTokenCache::key("token-a ")).is_none());
    }

    #[test]
    fn an_entry_never_outlives_the_ttl_or_the_token() {
        let cache = VerifiedTokenCache::new(Duration::from_millis(30));
        let key = VerifiedTokenCache::key("short-ttl");
        cache.insert(key, caller("a"), None);
        assert!(cache.get(&key).is_some());
        std::thread::sleep(Duration::from_millis(60));
        assert!(cache.get(&key).is_none(), "past the TTL");
        assert!(cache.is_empty(), "an expired entry is dropped when seen");

        let cache = VerifiedTokenCache::new(Duration::from_secs(3600));
        let expired = VerifiedTokenCache::key("expired");
        cache.insert(expired, caller("a"), Some(now_unix().saturating_sub(1)));
        assert!(
            cache.get(&expired).is_none(),
            "an expired token is not kept"
        );
        let ends_now = VerifiedTokenCache::key("ends-now");
        cache.insert(ends_now, caller("a"), Some(now_unix()));
        assert!(cache.get(&ends_now).is_none());
    }

    #[test]
    fn a_zero_ttl_keeps_nothing_and_clear_forgets() {
        let off = VerifiedTokenCache::new(Duration::ZERO);
        let key = VerifiedTokenCache::key("t");
        off.insert(key, caller("a"), None);
        assert!(off.get(&key).is_none());
        assert!(!off.is_enabled());

        let on = VerifiedTokenCache::new(Duration::from_secs(10));
        on.insert(key, caller("a"), None);
        on.clear();
        assert!(on.get(&key).is_none());
    }

    #[test]
    fn a_full_cache_drops_expired_entries_and_otherwise_stops_growing() {
        let cache = VerifiedTokenCache::with_capacity_limit(Duration::from_millis(40), 2);
        cache.insert(VerifiedTokenCache::key("1"), caller("a"), None);
        cache.insert(VerifiedTokenCache::key("2"), caller("b"), None);
        cache.insert(VerifiedTokenCache::key("3"), caller("c"), None);
        assert_eq!(cache.len(), 2);
        assert!(cache.get(&VerifiedTokenCache::key("3")).is_none());
        std::thread::sleep(Duration::from_millis(60));
        cache.insert(VerifiedTokenCache::key("4"), caller("d"), None);
        assert_eq!(cache.len(), 1, "the expired ones made room");
        assert!(cache.get(&VerifiedTokenCache::key("4")).is_some());
    }
}
