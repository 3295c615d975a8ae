//! Publishes the trust bundle as a `ClusterTrustBundle`
//! (`certificates.k8s.io/v1beta1`) of the pod-certificate signer, so pods
//! read meshca's roots through a `clusterTrustBundle` projected volume
//! (selected by `signerName`).
//!
//! The object is named with the signer's prefix, as the API requires
//! (`meshca.io/spiffe` → `meshca.io:spiffe:trust-bundle`), carries
//! `spec.signerName`, and holds the same roots as the `istio-ca-root-cert`
//! ConfigMaps (both roots during a rotation), labelled with the trust
//! domain ([`TRUST_DOMAIN_LABEL`], which pods' `clusterTrustBundle`
//! projections may select on). Driven by a watch: created when missing,
//! set back when edited (roots or label; other labels are kept), recreated
//! when deleted, rewritten when the bundle changes. Only the leader runs this; every update is
//! checked against the resourceVersion it read.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::certificates::v1beta1::{ClusterTrustBundle, ClusterTrustBundleSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::runtime::watcher::{self, Event};
use meshca_certs::pod_certificate::trust_bundle_name_prefix;
use meshca_kube::WatchRetry;

use crate::authority::Authority;
use crate::metrics::Metrics;

/// What follows the signer's prefix in the object's name.
pub(crate) const NAME_SUFFIX: &str = "trust-bundle";
/// Label naming the trust domain of the roots.
pub const TRUST_DOMAIN_LABEL: &str = "meshca.io/trust-domain";

/// How long a failed write waits before it is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(2);
/// The object is checked again this often even without events.
const RESYNC_PERIOD: Duration = Duration::from_secs(300);

/// The name of the signer's `ClusterTrustBundle`.
pub(crate) fn bundle_name(signer_name: &str) -> String {
    format!("{}{NAME_SUFFIX}", trust_bundle_name_prefix(signer_name))
}

/// Keeps the signer's `ClusterTrustBundle` right until dropped (leader only).
pub(crate) async fn publish_cluster_trust_bundle(
    client: kube::Client,
    authority: Arc<Authority>,
    signer_name: String,
    trust_domain: String,
    metrics: Metrics,
) {
    let name = bundle_name(&signer_name);
    let api: Api<ClusterTrustBundle> = Api::all(client);
    let events = watcher::watcher(
        api.clone(),
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    );
    let mut watch_retry = WatchRetry::new("clustertrustbundle");
    futures::pin_mut!(events);
    let mut generation = authority.subscribe();
    let mut retry = tokio::time::interval(RETRY_AFTER);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut resync = tokio::time::interval(RESYNC_PERIOD);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pending = true;
    tracing::info!(name = %name, signer = %signer_name, "publishing the trust bundle as a ClusterTrustBundle");
    loop {
        let touched = tokio::select! {
            event = events.next() => match event.inspect(|e| watch_retry.saw(e)) {
                Some(Ok(Event::Apply(ctb))) | Some(Ok(Event::InitApply(ctb))) => {
                    !is_current(&ctb, &authority.bundle().to_pem(), &signer_name, &trust_domain)
                }
                Some(Ok(Event::Delete(_))) | Some(Ok(Event::InitDone)) => true,
                Some(Ok(Event::Init)) => false,
                Some(Err(e)) => {
                    watch_retry.failed(&e).await;
                    false
                }
                None => return,
            },
            changed = generation.changed() => {
                if changed.is_err() {
                    return;
                }
                true
            }
            _ = retry.tick() => pending,
            _ = resync.tick() => true,
        };
        if !touched {
            continue;
        }
        let bundle = authority.bundle().to_pem();
        match reconcile(&api, &name, &signer_name, &trust_domain, &bundle).await {
            Ok(Written::Unchanged) => pending = false,
            Ok(written) => {
                pending = false;
                metrics.cluster_trust_bundle_writes.inc();
                tracing::info!(name = %name, action = ?written, "published the ClusterTrustBundle");
            }
            Err(e) => {
                pending = true;
                tracing::warn!(name = %name, error = %e, "writing the ClusterTrustBundle failed; retrying");
            }
        }
    }
}

/// Whether `ctb` carries exactly `bundle` for `signer_name`, labelled
/// with `trust_domain`.
fn is_current(
    ctb: &ClusterTrustBundle,
    bundle: &str,
    signer_name: &str,
    trust_domain: &str,
) -> bool {
    ctb.spec.trust_bundle == bundle
        && ctb.spec.signer_name.as_deref() == Some(signer_name)
        && ctb
            .metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get(TRUST_DOMAIN_LABEL))
            .map(String::as_str)
            == Some(trust_domain)
}

/// What a reconcile did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    Unchanged,
    Created,
    Updated,
}

async fn reconcile(
    api: &Api<ClusterTrustBundle>,
    name: &str,
    signer_name: &str,
    trust_domain: &str,
    bundle: &str,
) -> Result<Written, kube::Error> {
    // Two rounds: a conflict (someone wrote in between) is read again once.
    let mut last_error = None;
    for _ in 0..2 {
        match api.get_opt(name).await? {
            None => {
                let ctb = ClusterTrustBundle {
                    metadata: ObjectMeta {
                        name: Some(name.into()),
                        labels: Some(BTreeMap::from([(
                            TRUST_DOMAIN_LABEL.to_string(),
                            trust_domain.to_string(),
                        )])),
                        ..Default::default()
                    },
                    spec: ClusterTrustBundleSpec {
                        signer_name: Some(signer_name.into()),
                        trust_bundle: bundle.into(),
                    },
                };
                match api.create(&PostParams::default(), &ctb).await {
                    Ok(_) => return Ok(Written::Created),
                    Err(kube::Error::Api(e)) if e.code == 409 => {
                        last_error = Some(kube::Error::Api(e))
                    }
                    Err(e) => return Err(e),
                }
            }
            Some(ctb) if is_current(&ctb, bundle, signer_name, trust_domain) => {
                return Ok(Written::Unchanged)
            }
            Some(mut ctb) => {
                ctb.metadata.managed_fields = None;
                // The label set back; labels others added are kept.
                ctb.metadata
                    .labels
                    .get_or_insert_with(BTreeMap::new)
                    .insert(TRUST_DOMAIN_LABEL.to_string(), trust_domain.to_string());
                // signerName is immutable in the API and fixed by the name's
                // prefix: only the roots are set back.
                ctb.spec.signer_name = Some(signer_name.into());
                ctb.spec.trust_bundle = bundle.into();
                match api.replace(name, &PostParams::default(), &ctb).await {
                    Ok(_) => return Ok(Written::Updated),
                    Err(kube::Error::Api(e)) if e.code == 409 => {
                        last_error = Some(kube::Error::Api(e))
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Err(last_error.unwrap_or_else(|| {
        kube::Error::Service("conflicting writes to the ClusterTrustBundle".into())
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundle(labels: Option<BTreeMap<String, String>>) -> ClusterTrustBundle {
        ClusterTrustBundle {
            metadata: ObjectMeta {
                name: Some(bundle_name("meshca.io/spiffe")),
                labels,
                ..Default::default()
            },
            spec: ClusterTrustBundleSpec {
                signer_name: Some("meshca.io/spiffe".into()),
                trust_bundle: "roots".into(),
            },
        }
    }

    #[test]
    fn current_only_with_the_trust_domain_label() {
        let label = |value: &str| {
            Some(BTreeMap::from([
                (TRUST_DOMAIN_LABEL.to_string(), value.to_string()),
                ("team".to_string(), "mesh".to_string()),
            ]))
        };
        let current = |ctb: &ClusterTrustBundle| {
            is_current(ctb, "roots", "meshca.io/spiffe", "cluster.local")
        };
        assert!(current(&bundle(label("cluster.local"))));
        assert!(!current(&bundle(None)), "label removed");
        assert!(!current(&bundle(Some(BTreeMap::new()))), "labels emptied");
        assert!(!current(&bundle(label("other.domain"))), "label edited");
        let mut other_roots = bundle(label("cluster.local"));
        other_roots.spec.trust_bundle = "other".into();
        assert!(!current(&other_roots));
    }

    #[test]
    fn named_with_the_signer_prefix() {
        assert_eq!(
            bundle_name("meshca.io/spiffe"),
            "meshca.io:spiffe:trust-bundle"
        );
    }
}
