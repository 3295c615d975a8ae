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

use meshca_serve::rate_limited_log::RateLimitedLog;

/// Default most connections, and most streams, one pod may hold open on
/// the node agent's socket (`--max-streams-per-pod`). A sidecar opens a
/// few (Envoy an SDS stream per secret, a SPIFFE library one or two).
pub const DEFAULT_MAX_STREAMS_PER_POD: usize = 64;

/// The most bytes one pod's connections may hold in buffers the agent
/// keeps for them (node mode; every caller not attested to a pod of this
/// node together counting as one pod): header blocks parked until their
/// END_HEADERS (`authority_fix`) and request messages received in part
/// (`server`). Envoy's first SDS request on a stream carries its node
/// description, tens of KiB; a pod that asks for more gets its
/// connection closed (a parked block) or its stream ended
/// (`RESOURCE_EXHAUSTED`, a message).
pub const MAX_BUFFERED_BYTES_PER_POD: usize = 1024 * 1024;

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

/// Bytes held per [`PodKey`], at most `max` each (node mode's buffer
/// budget, [`MAX_BUFFERED_BYTES_PER_POD`]). The map has an entry only for
/// a key holding some.
#[derive(Debug)]
pub(crate) struct PerPodBytes {
    max: usize,
    held: Mutex<HashMap<PodKey, usize>>,
}

impl PerPodBytes {
    /// At most `max` bytes per pod.
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// A charge of nothing yet for `key`, to be set as its holder's
    /// buffers grow and shrink.
    pub(crate) fn charge(self: &Arc<Self>, key: PodKey) -> BufferCharge {
        BufferCharge {
            budget: self.clone(),
            key,
            charged: 0,
        }
    }

    /// Bytes `key` holds now.
    #[cfg(test)]
    pub(crate) fn held_by(&self, key: &PodKey) -> usize {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(key).copied().unwrap_or(0)
    }
}

/// What one holder (a connection's buffers, a stream's message) has
/// charged to its pod's [`PerPodBytes`]; dropping it gives the bytes back.
#[derive(Debug)]
pub(crate) struct BufferCharge {
    budget: Arc<PerPodBytes>,
    key: PodKey,
    charged: usize,
}

/// The pod's buffer budget would be exceeded.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{key} holds {held} bytes in buffers of the agent, the most one pod may ({max})")]
pub(crate) struct OverBudget {
    /// Whose budget.
    pub(crate) key: PodKey,
    /// What the pod holds (this holder's old charge included).
    pub(crate) held: usize,
    /// The budget.
    pub(crate) max: usize,
}

impl OverBudget {
    /// The status a stream cut off at the budget ends with.
    pub(crate) fn status(&self) -> tonic::Status {
        tonic::Status::resource_exhausted(format!(
            "{} holds {} bytes of request messages and header blocks in this agent, the most one pod may; finish or close some streams",
            self.key, self.max
        ))
    }
}

impl BufferCharge {
    /// Makes this holder's charge `bytes`; refused (the charge stays as it
    /// was) if that would take its pod past the budget. Shrinking always
    /// succeeds.
    pub(crate) fn set(&mut self, bytes: usize) -> Result<(), OverBudget> {
        if bytes == self.charged {
            return Ok(());
        }
        let mut held = self
            .budget
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let total = held.entry(self.key.clone()).or_insert(0);
        let others = total.saturating_sub(self.charged);
        if bytes > self.charged && others + bytes > self.budget.max {
            let held_now = *total;
            if held_now == 0 {
                held.remove(&self.key);
            }
            return Err(OverBudget {
                key: self.key.clone(),
                held: held_now,
                max: self.budget.max,
            });
        }
        *total = others + bytes;
        if *total == 0 {
            held.remove(&self.key);
        }
        self.charged = bytes;
        Ok(())
    }

    /// Moves this holder's charge to `key`'s budget (a stream whose pod
    /// was listed only after its HEADERS, see `Callers::lease`); refused,
    /// the charge staying where it was, if that would take `key` past the
    /// budget.
    pub(crate) fn move_to(&mut self, key: PodKey) -> Result<(), OverBudget> {
        if key == self.key {
            return Ok(());
        }
        let mut held = self
            .budget
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let theirs = held.get(&key).copied().unwrap_or(0);
        if self.charged > 0 && theirs + self.charged > self.budget.max {
            return Err(OverBudget {
                key,
                held: theirs,
                max: self.budget.max,
            });
        }
        if let Some(ours) = held.get_mut(&self.key) {
            *ours = ours.saturating_sub(self.charged);
            if *ours == 0 {
                held.remove(&self.key);
            }
        }
        if self.charged > 0 {
            *held.entry(key.clone()).or_insert(0) += self.charged;
        }
        self.key = key;
        Ok(())
    }

    /// Whose budget this holder charges.
    #[cfg(test)]
    pub(crate) fn key(&self) -> &PodKey {
        &self.key
    }

    /// What this holder has charged.
    #[cfg(test)]
    pub(crate) fn charged(&self) -> usize {
        self.charged
    }
}

/// A stream's [`BufferCharge`], shared by its request body (which sets
/// it as the message comes) and the request's extensions (where
/// `Callers::lease` finds it to move it to the caller's pod).
#[derive(Debug, Clone)]
pub(crate) struct StreamCharge(Arc<Mutex<BufferCharge>>);

impl StreamCharge {
    /// Shares `charge`.
    pub(crate) fn new(charge: BufferCharge) -> Self {
        Self(Arc::new(Mutex::new(charge)))
    }

    /// [`BufferCharge::set`].
    pub(crate) fn set(&self, bytes: usize) -> Result<(), OverBudget> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set(bytes)
    }

    /// [`BufferCharge::move_to`].
    pub(crate) fn move_to(&self, key: PodKey) -> Result<(), OverBudget> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .move_to(key)
    }

    /// Whose budget the stream charges.
    #[cfg(test)]
    pub(crate) fn key(&self) -> PodKey {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .key()
            .clone()
    }
}

impl Drop for BufferCharge {
    fn drop(&mut self) {
        let _ = self.set(0);
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

    #[test]
    fn a_charge_moved_to_another_pod_takes_its_bytes_along_within_that_pods_budget() {
        let budget = PerPodBytes::new(1000);
        let mut stream = budget.charge(PodKey::Unattested);
        stream.set(600).unwrap();
        let mut other = budget.charge(pod("b"));
        other.set(500).unwrap();
        // b cannot take 600 more: the charge stays with the unattested.
        let refused = stream.move_to(pod("b")).unwrap_err();
        assert_eq!((refused.held, refused.max), (500, 1000));
        assert_eq!(budget.held_by(&PodKey::Unattested), 600);
        stream.move_to(pod("a")).unwrap();
        assert_eq!(budget.held_by(&PodKey::Unattested), 0);
        assert_eq!(budget.held_by(&pod("a")), 600);
        assert_eq!(stream.key(), &pod("a"));
        stream.set(700).unwrap();
        assert_eq!(budget.held_by(&pod("a")), 700);
        drop(stream);
        assert_eq!(budget.held_by(&pod("a")), 0);
        assert_eq!(budget.held_by(&pod("b")), 500);
    }

    #[test]
    fn buffer_charges_stay_within_the_pods_budget_and_are_given_back() {
        let budget = PerPodBytes::new(1000);
        let mut one = budget.charge(pod("a"));
        let mut two = budget.charge(pod("a"));
        one.set(600).unwrap();
        let over = two.set(401).unwrap_err();
        assert_eq!((over.held, over.max), (600, 1000));
        assert_eq!(two.charged(), 0, "a refused charge leaves it as it was");
        two.set(400).unwrap();
        // Another pod and the unattested callers have budgets of their own.
        let mut other = budget.charge(PodKey::Unattested);
        other.set(1000).unwrap();
        // Growing within one's own charge after the others shrank.
        one.set(100).unwrap();
        two.set(900).unwrap();
        assert_eq!(budget.held_by(&pod("a")), 1000);
        drop(two);
        assert_eq!(budget.held_by(&pod("a")), 100);
        drop(one);
        drop(other);
        assert!(
            budget.held.lock().unwrap().is_empty(),
            "nothing left for gone holders"
        );
    }
}
