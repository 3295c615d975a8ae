//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's
//! `LeaseLock` algorithm (the one istiod and every Kubernetes controller
//! use), so `kubectl get lease` shows meshca's leader like any other.
//!
//! - The holder renews `spec.renewTime` every `retry_period`; every write
//!   is a compare-and-swap on `resourceVersion`, so two candidates can never
//!   both take the Lease.
//! - A candidate takes the Lease only when the record it observed has not
//!   changed for `lease_duration`, measured on its own clock (client-go's
//!   observedTime rule, so clock skew between nodes does not matter).
//! - A leader that cannot renew within `renew_deadline` steps down at once:
//!   its leader-only work is cancelled before another replica can take over.
//! - On shutdown the leader releases the Lease, so another replica takes
//!   over without waiting for it to expire.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;

/// Name of meshca's leader-election Lease.
pub(crate) const LEASE_NAME: &str = "meshca-leader";

/// Timing of the election, derived from the lease duration as client-go's
/// defaults are (15 s / 10 s / 2 s).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaderTiming {
    /// How long a Lease is valid after its last renewal.
    pub(crate) lease_duration: Duration,
    /// A leader that has not renewed for this long steps down.
    pub(crate) renew_deadline: Duration,
    /// Time between attempts.
    pub(crate) retry_period: Duration,
}

impl LeaderTiming {
    /// Timing for a lease duration (renew deadline 2/3 of it, retry 2/15).
    pub(crate) fn for_lease(lease_duration: Duration) -> Self {
        Self {
            lease_duration,
            renew_deadline: lease_duration * 2 / 3,
            retry_period: (lease_duration * 2 / 15).max(Duration::from_millis(200)),
        }
    }
}

/// One candidate in the election.
pub(crate) struct LeaderElector {
    api: Api<Lease>,
    identity: String,
    timing: LeaderTiming,
    observed: Option<(Option<String>, Option<String>)>,
    observed_at: Instant,
    last_renew: Option<Instant>,
}

impl std::fmt::Debug for LeaderElector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderElector")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// This replica's identity in the election: the pod name (`POD_NAME`, or the
/// hostname) plus a random suffix, so a restarted process is a new candidate.
pub(crate) fn candidate_identity() -> String {
    let base = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "meshca".to_string());
    let mut suffix = [0u8; 4];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut suffix);
    format!("{base}_{}", meshca_certs::profile::hex(&suffix))
}

impl LeaderElector {
    /// A candidate for the Lease [`LEASE_NAME`] in `namespace`.
    pub(crate) fn new(
        client: kube::Client,
        namespace: &str,
        identity: String,
        timing: LeaderTiming,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            identity,
            timing,
            observed: None,
            observed_at: Instant::now(),
            last_renew: None,
        }
    }

    /// This candidate's identity.
    pub(crate) fn identity(&self) -> &str {
        &self.identity
    }

    /// Runs the election until `stop` fires, publishing leadership on
    /// `leader`. Releases the Lease on the way out if held.
    pub(crate) async fn run(
        mut self,
        leader: watch::Sender<bool>,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            let now = Instant::now();
            match self.try_acquire_or_renew().await {
                Ok(true) => {
                    self.last_renew = Some(now);
                    if !*leader.borrow() {
                        tracing::info!(identity = %self.identity, lease = LEASE_NAME, "became the leader");
                    }
                    leader.send_if_modified(|l| !std::mem::replace(l, true));
                }
                Ok(false) => {
                    self.step_down(&leader, "another replica holds the lease");
                }
                Err(e) => {
                    let overdue = self
                        .last_renew
                        .is_none_or(|t| now.duration_since(t) >= self.timing.renew_deadline);
                    if *leader.borrow() && overdue {
                        self.step_down(&leader, "the lease could not be renewed in time");
                    }
                    tracing::warn!(error = %e, lease = LEASE_NAME, "leader election: Kubernetes API call failed");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(self.timing.retry_period) => {}
                _ = stop.changed() => break,
            }
        }
        if *leader.borrow() {
            leader.send_replace(false);
            if let Err(e) = self.release().await {
                tracing::warn!(error = %e, "releasing the leader lease failed; it expires by itself");
            } else {
                tracing::info!(identity = %self.identity, "released the leader lease");
            }
        }
    }

    fn step_down(&mut self, leader: &watch::Sender<bool>, why: &str) {
        if leader.send_if_modified(|l| std::mem::replace(l, false)) {
            tracing::warn!(identity = %self.identity, reason = why, "lost leadership; stopped leader-only work");
        }
        self.last_renew = None;
    }

    /// One round of client-go's `tryAcquireOrRenew`: `Ok(true)` when this
    /// candidate holds the Lease afterwards.
    pub(crate) async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let duration_secs = self.timing.lease_duration.as_secs().max(1) as i32;
        let Some(current) = self.api.get_opt(LEASE_NAME).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(LEASE_NAME.into()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(duration_secs),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = current.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let record = (
            holder.clone(),
            spec.renew_time.as_ref().map(|t| t.0.to_string()),
        );
        if self.observed.as_ref() != Some(&record) {
            self.observed = Some(record);
            self.observed_at = Instant::now();
        }
        let held_by_us = holder.as_deref() == Some(self.identity.as_str());
        let lease_secs = spec
            .lease_duration_seconds
            .map(|s| Duration::from_secs(s.max(0) as u64))
            .unwrap_or(self.timing.lease_duration);
        if holder.is_some() && !held_by_us && self.observed_at.elapsed() < lease_secs {
            return Ok(false);
        }
        let mut lease = current;
        lease.metadata.managed_fields = None;
        let transitions = spec.lease_transitions.unwrap_or(0);
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(duration_secs),
            acquire_time: if held_by_us {
                spec.acquire_time.clone()
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if held_by_us || holder.is_none() && transitions == 0 {
                transitions
            } else {
                transitions + 1
            }),
            ..spec
        });
        match self
            .api
            .replace(LEASE_NAME, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Gives the Lease up (empty holder, 1 s duration), as client-go's
    /// `ReleaseOnCancel`.
    async fn release(&mut self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(LEASE_NAME).await? else {
            return Ok(());
        };
        let spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        lease.metadata.managed_fields = None;
        lease.spec = Some(LeaseSpec {
            holder_identity: None,
            lease_duration_seconds: Some(1),
            ..spec
        });
        self.api
            .replace(LEASE_NAME, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    }
}

/// Runs `work` whenever `leader` is true, and drops it (cancelling every
/// await point inside) the moment leadership is lost.
pub(crate) async fn while_leader<F, Fut>(mut leader: watch::Receiver<bool>, mut work: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        tokio::select! {
            _ = work() => {}
            lost = leader.wait_for(|l| !*l) => {
                if lost.is_err() {
                    return;
                }
            }
        }
    }
}
