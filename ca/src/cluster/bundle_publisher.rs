//! Publishes the trust bundle as the ConfigMap `istio-ca-root-cert` (key
//! `root-cert.pem`, label `istio.io/config: "true"`) in every namespace,
//! as istiod does, so that Istio's sidecars and ztunnel find it.
//!
//! Driven by watches, not polling: a new namespace gets the ConfigMap at
//! once, a ConfigMap edited or deleted by hand is set back at once, and a
//! new bundle (root rotation, `--ca-dir` reload) is written everywhere.
//! Only the leader runs this; every write is checked against the
//! resourceVersion it read. The CRL's ConfigMap `istio-ca-crl` (key
//! `ca-crl.pem`, Istio's names) goes the same places by the same code
//! ([`publish_everywhere`] with [`Published::CRL`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::runtime::watcher::{self, Event};
use meshca_kube::WatchRetry;
use tokio::sync::watch;

use crate::authority::Authority;
use crate::metrics::Metrics;

/// Name of the bundle ConfigMap (Istio's).
pub(crate) const CONFIGMAP_NAME: &str = "istio-ca-root-cert";
/// Data key of the bundle.
pub(crate) const CONFIGMAP_KEY: &str = "root-cert.pem";
/// Label put on the ConfigMap (Istio's).
pub(crate) const CONFIGMAP_LABEL: (&str, &str) = ("istio.io/config", "true");

/// How long a failed write waits before it is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(2);
/// Every ConfigMap is checked again this often even without events.
const RESYNC_PERIOD: Duration = Duration::from_secs(300);

/// Keeps the bundle ConfigMap right in every namespace not in `excluded`,
/// until dropped.
pub(crate) async fn publish_bundles(
    client: kube::Client,
    authority: Arc<Authority>,
    excluded: Vec<String>,
    metrics: Metrics,
) {
    let (tx, rx) = watch::channel(Some(Arc::new(authority.bundle().to_pem())));
    let follow = async {
        let mut generation = authority.subscribe();
        while generation.changed().await.is_ok() {
            tx.send_replace(Some(Arc::new(authority.bundle().to_pem())));
        }
    };
    let publish = publish_everywhere(
        client,
        Published::BUNDLE,
        rx,
        excluded,
        metrics.bundle_configmap_writes.clone(),
    );
    futures::pin_mut!(follow);
    futures::pin_mut!(publish);
    futures::future::select(follow, publish).await;
}

/// A ConfigMap published in every namespace: its name, its one key, the
/// label Istio looks for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Published {
    /// The ConfigMap's name.
    pub(crate) name: &'static str,
    /// Its data key.
    pub(crate) key: &'static str,
}

impl Published {
    /// The trust bundle (`istio-ca-root-cert`).
    pub(crate) const BUNDLE: Self = Self {
        name: CONFIGMAP_NAME,
        key: CONFIGMAP_KEY,
    };
    /// The CRL (`istio-ca-crl`, key `ca-crl.pem`: Istio's names).
    pub(crate) const CRL: Self = Self {
        name: meshca_certs::crl::CRL_CONFIGMAP_NAME,
        key: meshca_certs::crl::CRL_CONFIGMAP_KEY,
    };
}

/// Keeps the ConfigMap `what` equal to the latest value of `value` in every
/// namespace not in `excluded`, until dropped or `value`'s sender is gone.
/// Nothing is written while the value is `None` at first; a value that
/// becomes `None` after one was published is withdrawn: `what`'s key is
/// removed from every ConfigMap (a CRL past its nextUpdate is never
/// served). `writes` counts the creates and updates.
pub(crate) async fn publish_everywhere(
    client: kube::Client,
    what: Published,
    mut value: watch::Receiver<Option<Arc<String>>>,
    excluded: Vec<String>,
    writes: crate::metrics::IstioCounter,
) {
    let excluded: BTreeSet<String> = excluded.into_iter().collect();
    let namespaces_api: Api<Namespace> = Api::all(client.clone());
    let configmaps_all: Api<ConfigMap> = Api::all(client.clone());
    let namespace_events = watcher::watcher(namespaces_api, watcher::Config::default());
    let configmap_events = watcher::watcher(
        configmaps_all,
        watcher::Config::default().fields(&format!("metadata.name={}", what.name)),
    );
    let mut namespaces_retry = WatchRetry::new("namespaces");
    let mut configmaps_retry = WatchRetry::new(if what.name == CONFIGMAP_NAME {
        "bundle configmaps"
    } else {
        "crl configmaps"
    });
    futures::pin_mut!(namespace_events);
    futures::pin_mut!(configmap_events);
    let mut namespaces: BTreeSet<String> = BTreeSet::new();
    let mut listing: BTreeSet<String> = BTreeSet::new();
    let mut pending: BTreeSet<String> = BTreeSet::new();
    let mut published_once = false;
    let mut retry = tokio::time::interval(RETRY_AFTER);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut resync = tokio::time::interval(RESYNC_PERIOD);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tracing::info!(configmap = what.name, excluded = ?excluded, "publishing to every namespace");
    loop {
        let mut touched: BTreeSet<String> = BTreeSet::new();
        tokio::select! {
            event = namespace_events.next() => match event.inspect(|e| namespaces_retry.saw(e)) {
                Some(Ok(Event::Init)) => listing.clear(),
                Some(Ok(Event::InitApply(ns))) => {
                    if let Some(name) = active_namespace(&ns) {
                        listing.insert(name);
                    }
                }
                Some(Ok(Event::InitDone)) => {
                    namespaces = std::mem::take(&mut listing);
                    touched.extend(namespaces.iter().cloned());
                }
                Some(Ok(Event::Apply(ns))) => match active_namespace(&ns) {
                    Some(name) => {
                        if namespaces.insert(name.clone()) {
                            touched.insert(name);
                        }
                    }
                    None => {
                        if let Some(name) = ns.metadata.name.as_ref() {
                            namespaces.remove(name);
                        }
                    }
                },
                Some(Ok(Event::Delete(ns))) => {
                    if let Some(name) = ns.metadata.name.as_ref() {
                        namespaces.remove(name);
                        pending.remove(name);
                    }
                }
                Some(Err(e)) => namespaces_retry.failed(&e).await,
                None => return,
            },
            event = configmap_events.next() => match event.inspect(|e| configmaps_retry.saw(e)) {
                Some(Ok(Event::Apply(cm))) | Some(Ok(Event::InitApply(cm))) => {
                    let current = value.borrow().clone();
                    if let (Some(ns), Some(current)) = (cm.metadata.namespace.as_ref(), current) {
                        if namespaces.contains(ns) && !is_current(&cm, what, &current) {
                            touched.insert(ns.clone());
                        }
                    }
                }
                Some(Ok(Event::Delete(cm))) => {
                    if let Some(ns) = cm.metadata.namespace.as_ref() {
                        if namespaces.contains(ns) {
                            touched.insert(ns.clone());
                        }
                    }
                }
                Some(Ok(_)) => {}
                // Backoff and rate-limited logging as for every watch.
                Some(Err(e)) => configmaps_retry.failed(&e).await,
                None => return,
            },
            changed = value.changed() => {
                if changed.is_err() {
                    return;
                }
                touched.extend(namespaces.iter().cloned());
            }
            _ = retry.tick() => {
                touched.extend(std::mem::take(&mut pending));
            }
            _ = resync.tick() => {
                touched.extend(namespaces.iter().cloned());
            }
        }
        if touched.is_empty() {
            continue;
        }
        let Some(current) = value.borrow_and_update().clone() else {
            if published_once {
                for ns in touched {
                    if excluded.contains(&ns) || !namespaces.contains(&ns) {
                        continue;
                    }
                    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
                    match withdraw(&api, what).await {
                        Ok(Written::Unchanged) => {}
                        Ok(_) => {
                            writes.inc();
                            tracing::warn!(namespace = %ns, configmap = what.name, "withdrew the ConfigMap's value");
                        }
                        Err(e) => {
                            tracing::warn!(namespace = %ns, configmap = what.name, error = %e, "withdrawing the ConfigMap's value failed; retrying");
                            pending.insert(ns);
                        }
                    }
                }
            }
            continue;
        };
        published_once = true;
        for ns in touched {
            if excluded.contains(&ns) || !namespaces.contains(&ns) {
                continue;
            }
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
            match reconcile(&api, &ns, what, &current).await {
                Ok(Written::Unchanged) => {}
                Ok(written) => {
                    writes.inc();
                    tracing::info!(namespace = %ns, configmap = what.name, action = ?written, "published the ConfigMap");
                }
                Err(e) => {
                    tracing::warn!(namespace = %ns, configmap = what.name, error = %e, "writing the ConfigMap failed; retrying");
                    pending.insert(ns);
                }
            }
        }
    }
}

/// A namespace's name, unless it is being deleted.
fn active_namespace(ns: &Namespace) -> Option<String> {
    let terminating = ns.metadata.deletion_timestamp.is_some()
        || ns
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| p == "Terminating");
    if terminating {
        return None;
    }
    ns.metadata.name.clone()
}

/// Whether `cm` carries exactly `value` under `what`'s key, and the label.
fn is_current(cm: &ConfigMap, what: Published, value: &str) -> bool {
    let data_ok = cm
        .data
        .as_ref()
        .and_then(|d| d.get(what.key))
        .is_some_and(|v| v == value);
    let label_ok = cm
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CONFIGMAP_LABEL.0))
        .is_some_and(|v| v == CONFIGMAP_LABEL.1);
    data_ok && label_ok
}

/// What a reconcile did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    Unchanged,
    Created,
    Updated,
}

/// Removes `what`'s key from the ConfigMap in `api`'s namespace, if it
/// holds it (the ConfigMap itself stays: meshca never deletes one).
async fn withdraw(api: &Api<ConfigMap>, what: Published) -> Result<Written, kube::Error> {
    let mut last_error = None;
    for _ in 0..2 {
        let Some(mut cm) = api.get_opt(what.name).await? else {
            return Ok(Written::Unchanged);
        };
        if !cm.data.as_ref().is_some_and(|d| d.contains_key(what.key)) {
            return Ok(Written::Unchanged);
        }
        cm.metadata.managed_fields = None;
        if let Some(data) = cm.data.as_mut() {
            data.remove(what.key);
        }
        match api.replace(what.name, &PostParams::default(), &cm).await {
            Ok(_) => return Ok(Written::Updated),
            Err(kube::Error::Api(e)) if e.code == 409 => last_error = Some(kube::Error::Api(e)),
            Err(e) => return Err(e),
        }
    }
    Err(last_error
        .unwrap_or_else(|| kube::Error::Service("conflicting writes to the ConfigMap".into())))
}

async fn reconcile(
    api: &Api<ConfigMap>,
    ns: &str,
    what: Published,
    bundle: &str,
) -> Result<Written, kube::Error> {
    // Two rounds: a conflict (someone wrote in between) is read again once.
    let mut last_error = None;
    for _ in 0..2 {
        match api.get_opt(what.name).await? {
            None => {
                let cm = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(what.name.into()),
                        namespace: Some(ns.into()),
                        labels: Some(BTreeMap::from([(
                            CONFIGMAP_LABEL.0.to_string(),
                            CONFIGMAP_LABEL.1.to_string(),
                        )])),
                        ..Default::default()
                    },
                    data: Some(BTreeMap::from([(what.key.to_string(), bundle.to_string())])),
                    ..Default::default()
                };
                match api.create(&PostParams::default(), &cm).await {
                    Ok(_) => return Ok(Written::Created),
                    Err(kube::Error::Api(e)) if e.code == 409 => {
                        last_error = Some(kube::Error::Api(e))
                    }
                    Err(e) => return Err(e),
                }
            }
            Some(cm) if is_current(&cm, what, bundle) => return Ok(Written::Unchanged),
            Some(mut cm) => {
                cm.metadata.managed_fields = None;
                cm.metadata
                    .labels
                    .get_or_insert_with(BTreeMap::new)
                    .insert(CONFIGMAP_LABEL.0.into(), CONFIGMAP_LABEL.1.into());
                cm.data
                    .get_or_insert_with(BTreeMap::new)
                    .insert(what.key.into(), bundle.into());
                match api.replace(what.name, &PostParams::default(), &cm).await {
                    Ok(_) => return Ok(Written::Updated),
                    Err(kube::Error::Api(e)) if e.code == 409 => {
                        last_error = Some(kube::Error::Api(e))
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Err(last_error
        .unwrap_or_else(|| kube::Error::Service("conflicting writes to the ConfigMap".into())))
}
