//! [`TokenCache`]: authentication results reused for a short time, keyed
//! by the SHA-256 of the token.
//!
//! - [`VerifiedTokenCache`] keeps successes. Used by the TokenReview
//!   authenticator (saves an API round trip) and by offline JWT validation
//!   (saves a signature check: one node agent such as ztunnel presents the
//!   same token for every pod of its node, and agents retry with the same
//!   token after `RESOURCE_EXHAUSTED`). The Kubernetes API server does the
//!   same for its own token authenticators (10 s by default).
//! - [`RefusedTokenCache`] keeps definite refusals of the TokenReview
//!   authenticator for a few seconds, so one junk token repeated costs one
//!   review, not one per request (the API server caches failures too).
//!
//! Rules:
//! - The token itself is never stored, only its hash.
//! - An entry lives for the configured TTL, never past the token's `exp`.
//! - The cache is bounded ([`MAX_CACHED_TOKENS`] by default); a full cache
//!   evicts in O(1) amortised time (`quick_cache`'s S3-FIFO), never by
//!   scanning its entries.
//! - [`TokenCache::clear`] starts a new generation: a result computed
//!   before the clear (say, with a key a concurrent refresh withdrew) and
//!   inserted after it is never returned.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::clock::{system_clock, SharedClock};
use super::{AuthnError, Caller};
use crate::metrics::IstioCounter;

/// The SHA-256 of a token: the cache key.
pub(crate) type TokenHash = [u8; 32];

/// Most entries a cache holds by default (about 250 bytes each).
pub(crate) const MAX_CACHED_TOKENS: usize = 50_000;

/// Successful authentications.
pub(crate) type VerifiedTokenCache = TokenCache<Caller>;

/// Definite refusals (not "the API server is unreachable").
pub(crate) type RefusedTokenCache = TokenCache<AuthnError>;

#[derive(Clone)]
struct Entry<V> {
    value: V,
    until: Instant,
    generation: u64,
}

/// Authentication results by token hash, reused for a short time.
pub(crate) struct TokenCache<V> {
    ttl: Duration,
    max_entries: usize,
    entries: Option<quick_cache::sync::Cache<TokenHash, Entry<V>>>,
    generation: AtomicU64,
    clock: SharedClock,
    hits: IstioCounter,
}

impl<V: Clone> std::fmt::Debug for TokenCache<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCache")
            .field("ttl", &self.ttl)
            .field("max_entries", &self.max_entries)
            .field("entries", &self.entries.as_ref().map_or(0, |e| e.len()))
            .finish_non_exhaustive()
    }
}

impl<V: Clone> TokenCache<V> {
    /// A cache keeping results for `ttl` (zero: a cache that keeps nothing).
    pub(crate) fn new(ttl: Duration) -> Self {
        Self::with_capacity_limit(ttl, MAX_CACHED_TOKENS)
    }

    /// A cache of at most about `max_entries` results.
    pub(crate) fn with_capacity_limit(ttl: Duration, max_entries: usize) -> Self {
        let enabled = !ttl.is_zero() && max_entries > 0;
        Self {
            ttl,
            max_entries,
            entries: enabled.then(|| quick_cache::sync::Cache::new(max_entries)),
            generation: AtomicU64::new(0),
            clock: system_clock(),
            hits: IstioCounter::default(),
        }
    }

    /// Reads the time from `clock` (tests: a clock driven by paused time).
    pub(crate) fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Counts every hit on `hits` (e.g. a metric shared by several caches).
    pub(crate) fn counting_hits(mut self, hits: IstioCounter) -> Self {
        self.hits = hits;
        self
    }

    #[cfg(test)]
    /// Hits so far.
    pub(crate) fn hits(&self) -> u64 {
        self.hits.get()
    }

    /// Whether results are kept at all.
    pub(crate) fn is_enabled(&self) -> bool {
        self.entries.is_some()
    }

    /// The cache key of `token`.
    pub(crate) fn key(token: &str) -> TokenHash {
        let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
        let mut out = [0u8; 32];
        out.copy_from_slice(digest.as_ref());
        out
    }

    /// The value cached for `key`, if its entry is live and of the
    /// current generation.
    pub(crate) fn get(&self, key: &TokenHash) -> Option<V> {
        let entries = self.entries.as_ref()?;
        let entry = entries.get(key)?;
        if entry.until > self.clock.instant()
            && entry.generation == self.generation.load(Ordering::SeqCst)
        {
            self.hits.inc();
            Some(entry.value)
        } else {
            entries.remove(key);
            None
        }
    }

    /// The current generation: read it *before* computing a result that
    /// depends on state [`TokenCache::clear`] invalidates (keys), and
    /// pass it to [`TokenCache::insert_computed_in`].
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Remembers `value` for the token hashed to `key`; `expires_at` is the
    /// token's `exp` (Unix seconds), if it has one.
    pub(crate) fn insert(&self, key: TokenHash, value: V, expires_at: Option<u64>) {
        self.insert_computed_in(key, value, expires_at, self.generation());
    }

    /// Like [`TokenCache::insert`], for a value computed in `generation`:
    /// dropped if the cache was cleared since.
    pub(crate) fn insert_computed_in(
        &self,
        key: TokenHash,
        value: V,
        expires_at: Option<u64>,
        generation: u64,
    ) {
        let Some(entries) = &self.entries else {
            return;
        };
        let mut ttl = self.ttl;
        if let Some(exp) = expires_at {
            // To the sub-second: a token is dead from the start of its `exp` second.
            ttl = ttl.min(Duration::from_secs(exp).saturating_sub(self.clock.since_epoch()));
        }
        if ttl.is_zero() || generation != self.generation() {
            return;
        }
        entries.insert(
            key,
            Entry {
                value,
                until: self.clock.instant() + ttl,
                generation,
            },
        );
    }

    /// Forgets everything (e.g. after the signing keys changed), including
    /// results computed before now and inserted later.
    pub(crate) fn clear(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        if let Some(entries) = &self.entries {
            entries.clear();
        }
    }

    #[cfg(test)]
    /// Entries held, live or not yet dropped.
    pub(crate) fn len(&self) -> usize {
        self.entries.as_ref().map_or(0, |e| e.len())
    }

    #[cfg(test)]
    /// Whether no entry is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authn::clock::{Clock, TokioClock};
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
            cluster: None,
        }
    }

    fn paused_cache(ttl: Duration) -> (TokioClock, VerifiedTokenCache) {
        let clock = TokioClock::new();
        let cache = VerifiedTokenCache::new(ttl).with_clock(clock.clone().shared());
        (clock, cache)
    }

    #[tokio::test(start_paused = true)]
    async fn a_stored_result_is_found_by_the_same_token_only() {
        let (clock, cache) = paused_cache(Duration::from_secs(10));
        let key = VerifiedTokenCache::key("token-a");
        cache.insert(key, caller("a"), Some(clock.unix_seconds() + 3600));
        let hit = cache.get(&key).expect("cached");
        assert_eq!(cache.hits(), 1);
        assert_eq!(
            hit.identity.to_string(),
            "spiffe://cluster.local/ns/default/sa/a"
        );
        assert!(cache.get(&VerifiedTokenCache::key("token-b")).is_none());
        assert!(cache.get(&VerifiedTokenCache::key("token-a ")).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn an_entry_never_outlives_the_ttl_or_the_token() {
        let (clock, cache) = paused_cache(Duration::from_millis(30));
        let key = VerifiedTokenCache::key("short-ttl");
        cache.insert(key, caller("a"), None);
        tokio::time::advance(Duration::from_millis(29)).await;
        assert!(cache.get(&key).is_some());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(cache.get(&key).is_none(), "past the TTL");
        assert!(cache.is_empty(), "an expired entry is dropped when seen");

        let cache =
            VerifiedTokenCache::new(Duration::from_secs(3600)).with_clock(clock.clone().shared());
        let expired = VerifiedTokenCache::key("expired");
        let now = clock.unix_seconds();
        cache.insert(expired, caller("a"), Some(now.saturating_sub(1)));
        assert!(
            cache.get(&expired).is_none(),
            "an expired token is not kept"
        );
        // A token whose `exp` is 2 s away is kept until then, not for the hour.
        let soon = VerifiedTokenCache::key("soon");
        cache.insert(soon, caller("a"), Some(now + 2));
        assert!(cache.get(&soon).is_some());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(cache.get(&soon).is_none(), "dead at its exp");
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_ttl_keeps_nothing_and_clear_forgets() {
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

    #[tokio::test(start_paused = true)]
    async fn a_result_computed_before_a_clear_is_not_kept_after_it() {
        let (_clock, cache) = paused_cache(Duration::from_secs(10));
        let key = VerifiedTokenCache::key("verified-with-an-old-key");
        // A validation starts (reads the generation, then the keys) …
        let generation = cache.generation();
        // … a refresh withdraws its key and clears the cache …
        cache.clear();
        // … then the validation finishes and inserts its result.
        cache.insert_computed_in(key, caller("a"), None, generation);
        assert!(cache.get(&key).is_none());
        assert!(cache.is_empty(), "not even stored");
        // Results of the new generation are kept.
        cache.insert_computed_in(key, caller("a"), None, cache.generation());
        assert!(cache.get(&key).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_cache_stays_bounded() {
        let cache = VerifiedTokenCache::with_capacity_limit(Duration::from_secs(60), 1_000);
        for i in 0..20_000 {
            cache.insert(VerifiedTokenCache::key(&i.to_string()), caller("a"), None);
        }
        assert!(cache.len() <= 1_000, "{} entries", cache.len());
        assert!(cache.len() >= 500, "{} entries", cache.len());
        // Eviction makes room: the newest is kept, not refused.
        assert!(cache.get(&VerifiedTokenCache::key("19999")).is_some());
    }
}
