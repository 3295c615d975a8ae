//! Node mode's per-pod limits: one pod on the node (or every caller that
//! is in no pod, together) may hold at most so many of the socket's
//! connections and streams, so that a pod that opens them as fast as it can
//! cannot lock the other pods of the node out of their identities.
//!
//! Callers are told apart by the pod UID read from their cgroups when
//! their connection was accepted, if that is a pod of this node as the
//! pod watch knows it; every other caller (outside any pod, its pod not
//! told, or a pod this node does not have) counts as one more pod
//! ([`PodKey`]). Pod mode has one pod behind the socket: its only limits
//! are the socket's own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use meshca_certs::rate_limited_log::RateLimitedLog;

/// Default most connections, and most streams, one pod may hold open on
/// the node agent's socket (`--max-streams-per-pod`). A sidecar opens a
/// few (Envoy an SDS stream per secret, a SPIFFE library one or two).
pub const DEFAULT_MAX_STREAMS_PER_POD: usize = 64;

/// Whom a per-pod limit counts a caller as.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum PodKey {
    /// A caller in the pod with this UID.
    Pod(String),
    /// Every caller not attested to a pod of this node: outside any pod,
    /// its pod not told, or a pod UID the watch does not list for this
    /// node (they are refused an identity, or wait for their pod to
    /// appear, and hold connections meanwhile).
    Unattested,
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PodKey::Pod(uid) => write!(f, "pod {uid}"),
            PodKey::Unattested => f.write_str("callers not attested to a pod of this node"),
        }
    }
}

/// At most `max` held per [`PodKey`] at once. The map has an entry only
/// for a key holding at least one, so it is no larger than what is held.
#[derive(Debug)]
pub(crate) struct PerPodLimit {
    max: usize,
    held: Mutex<HashMap<PodKey, usize>>,
    /// The refusals' log lines (one per interval, of any pod).
    pub(crate) refusals: RateLimitedLog,
}

/// Node mode's two per-pod limits, of one size.
#[derive(Debug)]
pub(crate) struct PerPodLimits {
    /// Connections per pod.
    pub(crate) connections: Arc<PerPodLimit>,
    /// Streams per pod.
    pub(crate) streams: Arc<PerPodLimit>,
}

impl PerPodLimits {
    /// At most `max` connections and `max` streams per pod.
    pub(crate) fn new(max: usize) -> Self {
        Self {
            connections: PerPodLimit::new(max),
            streams: PerPodLimit::new(max),
        }
    }
}

/// What the per-pod limit says of a new connection.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Taken; the connection holds its pod's place (none in pod mode) for
    /// its life.
    Admitted(Option<PodSlot>),
    /// Its pod holds its most connections already: tell the caller
    /// `reason` (an HTTP/2 GOAWAY) and close it.
    Refused {
        /// Why, for the caller: names the pod and the flag.
        reason: String,
    },
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
            refusals: RateLimitedLog::default(),
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
}

impl PodSlot {
    /// Whom the place counts for.
    pub(crate) fn key(&self) -> &PodKey {
        &self.key
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
}
