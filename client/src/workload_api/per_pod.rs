//! Node mode's per-pod limits: one pod on the node (or every caller that
//! is in no pod, together) may hold at most so many of the socket's
//! connections and streams, so that a pod that opens them as fast as it can
//! cannot lock the other pods of the node out of their identities.
//!
//! Callers are told apart by the pod UID read from their cgroups when
//! their connection was accepted ([`PodKey`]). Pod mode has one pod behind
//! the socket: its only limits are the socket's own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::attest::PodUidLookup;

/// Default most connections, and most streams, one pod may hold open on
/// the node agent's socket (`--max-streams-per-pod`). A sidecar opens a
/// few (Envoy an SDS stream per secret, a SPIFFE library one or two).
pub const DEFAULT_MAX_STREAMS_PER_POD: usize = 64;

/// How often at most a refusal by a per-pod limit is logged; the ones in
/// between are counted in the next line.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Whom a per-pod limit counts a caller as.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum PodKey {
    /// A caller in the pod with this UID.
    Pod(String),
    /// Every caller that is in no pod, or whose pod could not be told
    /// (they are refused an identity, but hold connections until then).
    Unattested,
}

impl PodKey {
    /// The key of a caller whose pod lookup is `lookup`.
    pub(crate) fn of(lookup: &PodUidLookup) -> Self {
        match lookup {
            PodUidLookup::Pod { uid, .. } => PodKey::Pod(uid.clone()),
            _ => PodKey::Unattested,
        }
    }
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PodKey::Pod(uid) => write!(f, "pod {uid}"),
            PodKey::Unattested => f.write_str("callers outside any pod"),
        }
    }
}

/// At most `max` held per [`PodKey`] at once. The map has an entry only
/// for a key holding at least one, so it is no larger than what is held.
#[derive(Debug)]
pub(crate) struct PerPodLimit {
    max: usize,
    held: Mutex<HashMap<PodKey, usize>>,
    /// Refusals since the last one logged, and when that was.
    refused_unlogged: AtomicU64,
    last_logged: Mutex<Option<Instant>>,
}

/// One held place of a [`PerPodLimit`]; dropping it gives the place back.
#[derive(Debug)]
pub(crate) struct PodSlot {
    limit: Arc<PerPodLimit>,
    key: PodKey,
}

impl PerPodLimit {
    /// At most `max` (at least 1) per pod.
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            held: Mutex::new(HashMap::new()),
            refused_unlogged: AtomicU64::new(0),
            last_logged: Mutex::new(None),
        })
    }

    /// The most one pod may hold.
    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// A place for `key`, or `None` if it holds `max` already.
    pub(crate) fn try_take(self: &Arc<Self>, key: &PodKey) -> Option<PodSlot> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(key.clone()).or_insert(0);
        if *count >= self.max {
            return None;
        }
        *count += 1;
        Some(PodSlot {
            limit: self.clone(),
            key: key.clone(),
        })
    }

    /// How many `key` holds now.
    #[cfg(test)]
    pub(crate) fn held_by(&self, key: &PodKey) -> usize {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(key).copied().unwrap_or(0)
    }

    /// Pods holding at least one place.
    #[cfg(test)]
    pub(crate) fn pods(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Counts a refusal; returns how many refusals to log now (this one
    /// and those not logged since), or `None` if one was logged less than
    /// [`LOG_INTERVAL`] ago.
    pub(crate) fn refusals_to_log(&self) -> Option<u64> {
        let unlogged = self.refused_unlogged.fetch_add(1, Ordering::AcqRel) + 1;
        let mut last = self
            .last_logged
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if last.is_some_and(|at| now.saturating_duration_since(at) < LOG_INTERVAL) {
            return None;
        }
        *last = Some(now);
        self.refused_unlogged.fetch_sub(unlogged, Ordering::AcqRel);
        Some(unlogged)
    }
}

impl Drop for PodSlot {
    fn drop(&mut self) {
        let mut held = self
            .limit
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                held.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str) -> PodKey {
        PodKey::Pod(uid.to_string())
    }

    #[test]
    fn each_pod_holds_at_most_the_limit_and_gets_places_back() {
        let limit = PerPodLimit::new(2);
        let a1 = limit.try_take(&pod("a")).unwrap();
        let _a2 = limit.try_take(&pod("a")).unwrap();
        assert!(limit.try_take(&pod("a")).is_none(), "a holds its 2");
        // Another pod, and the unattested callers, are not affected.
        let b = limit.try_take(&pod("b")).unwrap();
        let outside = limit.try_take(&PodKey::Unattested).unwrap();
        assert_eq!(limit.held_by(&pod("a")), 2);
        drop(a1);
        assert!(limit.try_take(&pod("a")).is_some(), "a place given back");
        drop((b, outside));
        assert_eq!(limit.pods(), 1, "keys with nothing held are forgotten");
    }

    #[test]
    fn callers_outside_pods_share_one_key() {
        assert_eq!(PodKey::of(&PodUidLookup::NotInPod), PodKey::Unattested);
        assert_eq!(PodKey::of(&PodUidLookup::NoPid), PodKey::Unattested);
        assert_eq!(
            PodKey::of(&PodUidLookup::Unreadable("gone".into())),
            PodKey::Unattested
        );
        assert_eq!(
            PodKey::of(&PodUidLookup::Pod {
                uid: "u1".into(),
                container: "c".into()
            }),
            pod("u1")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_are_logged_at_most_once_per_interval_with_their_count() {
        let limit = PerPodLimit::new(1);
        assert_eq!(limit.refusals_to_log(), Some(1));
        assert_eq!(limit.refusals_to_log(), None);
        assert_eq!(limit.refusals_to_log(), None);
        tokio::time::advance(LOG_INTERVAL).await;
        assert_eq!(
            limit.refusals_to_log(),
            Some(3),
            "this one and the two unlogged"
        );
        assert_eq!(limit.refusals_to_log(), None);
    }
}
