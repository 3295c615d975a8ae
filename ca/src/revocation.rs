//! Revocation in the CA: the operator's list (README, "Revoking an
//! identity"), enforced at issuance, and the CRL meshca signs.
//!
//! - [`Revocations`] holds the list in use, merged from its sources (the
//!   data directory's `revocations.yaml`, checked every
//!   [`FILE_CHECK_INTERVAL`]; in a cluster the ConfigMap
//!   `meshca-revocations`, watched). A source whose new document is not a
//!   list at all keeps its last good list; a malformed entry is logged,
//!   counted (`meshca_revocation_entries_rejected{source,entry}`) and left
//!   out, the others apply.
//! - [`Revocations::check`] is what `service` asks before it signs: the
//!   identity, its service account, the node of its pod (or of the node
//!   agent), the presented certificate's serial (renewal), the signing CA.
//!   The answer names the entry, never its reason.
//! - [`IssuedRecord`] remembers what this replica issued (serial, identity,
//!   node, notAfter), at most `--issued-record-size` unexpired
//!   certificates, so an identity-level entry lists every serial it covers.
//! - [`maintain_crl`] signs the CRL on every change and at least every
//!   `--crl-refresh` (nextUpdate = 2× that), writes `ca-crl.pem` in the
//!   data directory and hands the PEM to the ConfigMap publisher. Serials
//!   once in the CRL are kept in `revoked-serials.json` beside it until
//!   they expire, so a restart never takes a revoked serial back.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use meshca_certs::crl::{self, CrlTimes, RevokedCert};
use meshca_certs::revocation::{
    IssuanceQuery, IssuedSummary, RevocationList, RevocationReason, Serial, CONFIGMAP_KEY,
    CONFIGMAP_NAME, REVOCATIONS_FILE,
};
use meshca_certs::SpiffeId;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio::sync::watch;

use crate::authority::Authority;

/// How often the data directory's `revocations.yaml` is checked.
pub(crate) const FILE_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Default of `--issued-record-size`: unexpired certificates remembered
/// (about 200 bytes each: 20 MB at the default).
pub(crate) const DEFAULT_ISSUED_RECORD_SIZE: usize = 100_000;
/// The file keeping the serials once listed, in the data directory.
pub(crate) const REVOKED_SERIALS_FILE: &str = "revoked-serials.json";
/// Rejected entries labelled one by one in the metric; beyond these they
/// are counted under `entry="more"`.
const MAX_LABELLED_REJECTIONS: usize = 100;
/// A burst of changes (an operator revoking many in a row) is signed
/// once: the CRL waits this long after a change for the next one.
const CRL_DEBOUNCE: Duration = Duration::from_millis(100);

/// Labels of `meshca_revocation_entries_rejected`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RejectedLabels {
    /// `file` or `configmap`.
    pub(crate) source: String,
    /// The entry's place in the list, from 1 (or `more`).
    pub(crate) entry: String,
}

/// The revocation metrics.
#[derive(Debug, Clone, Default)]
pub(crate) struct RevocationMetrics {
    /// Entries in use.
    pub(crate) entries: Gauge,
    /// Malformed entries, one series per entry (1 while it is there).
    pub(crate) rejected: Family<RejectedLabels, Gauge>,
    /// Requests refused because of an entry.
    pub(crate) refused: crate::metrics::IstioCounter,
    /// Serials in the CRL published last.
    pub(crate) crl_serials: Gauge,
    /// The CRL's nextUpdate (unix seconds).
    pub(crate) crl_next_update: Gauge,
    /// Certificates in the issued record.
    pub(crate) issued_record: Gauge,
    /// Unexpired certificates dropped from a full issued record.
    pub(crate) issued_record_dropped: crate::metrics::IstioCounter,
    /// `istio-ca-crl` ConfigMaps created or updated.
    pub(crate) crl_configmap_writes: crate::metrics::IstioCounter,
}

impl RevocationMetrics {
    /// Adds these metrics to `registry`.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "meshca_revocation_entries",
            "Revocation entries in use (file and ConfigMap)",
            self.entries.clone(),
        );
        registry.register(
            "meshca_revocation_entries_rejected",
            "Malformed revocation entries left out, by source and place (1 while present)",
            self.rejected.clone(),
        );
        registry.register(
            "meshca_revocation_refused_count",
            "Certificate requests refused because of a revocation entry",
            self.refused.clone(),
        );
        registry.register(
            "meshca_crl_revoked_serials",
            "Serials in the CRL published last",
            self.crl_serials.clone(),
        );
        registry.register(
            "meshca_crl_next_update_timestamp",
            "nextUpdate of the CRL published last (unix seconds)",
            self.crl_next_update.clone(),
        );
        registry.register(
            "meshca_issued_record_certificates",
            "Unexpired certificates in the issued record",
            self.issued_record.clone(),
        );
        registry.register(
            "meshca_crl_configmap_writes_count",
            "istio-ca-crl ConfigMaps created or updated (leader)",
            self.crl_configmap_writes.clone(),
        );
        registry.register(
            "meshca_issued_record_dropped_count",
            "Unexpired certificates dropped from a full issued record (--issued-record-size)",
            self.issued_record_dropped.clone(),
        );
    }
}

/// Where a list came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Source {
    /// The data directory's `revocations.yaml`.
    File,
    /// The ConfigMap `meshca-revocations`.
    ConfigMap,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::ConfigMap => "configmap",
        }
    }
}

/// A certificate this replica issued.
#[derive(Debug, Clone)]
struct Issued {
    serial: Serial,
    identity: SpiffeId,
    node: Option<Arc<str>>,
    issuer_key_id: Arc<str>,
    /// The key identifiers of the CAs above the issuer when it was issued
    /// (shared by every certificate of that material: one Arc clone each).
    upper_key_ids: Arc<Vec<Arc<str>>>,
    issued_at: OffsetDateTime,
    not_after: OffsetDateTime,
}

/// What this replica issued and has not expired: a bounded queue in
/// issuance order. Pushing costs a lock and an append; expired
/// certificates leave from the front as new ones come.
#[derive(Debug)]
pub(crate) struct IssuedRecord {
    entries: Mutex<VecDeque<Issued>>,
    capacity: usize,
}

impl IssuedRecord {
    fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(VecDeque::with_capacity(capacity.min(4096))),
            capacity,
        }
    }

    fn push(&self, issued: Issued, metrics: &RevocationMetrics) {
        if self.capacity == 0 {
            return;
        }
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let now = issued.issued_at;
        while entries.front().is_some_and(|e| e.not_after <= now) {
            entries.pop_front();
        }
        if entries.len() >= self.capacity {
            entries.pop_front();
            metrics.issued_record_dropped.inc();
        }
        entries.push_back(issued);
        metrics.issued_record.set(entries.len() as i64);
    }

    fn snapshot(&self) -> Vec<Issued> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

/// A revoked serial as kept between restarts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct KeptSerial {
    serial: String,
    reason: RevocationReason,
    #[serde(with = "time::serde::rfc3339")]
    revoked_at: OffsetDateTime,
    /// The certificate's notAfter, when known: it leaves the CRL then.
    #[serde(default, with = "time::serde::rfc3339::option")]
    not_after: Option<OffsetDateTime>,
}

/// The revocation state of one replica.
#[derive(Debug)]
pub(crate) struct Revocations {
    sources: Mutex<BTreeMap<Source, Arc<RevocationList>>>,
    merged: ArcSwap<RevocationList>,
    changes: watch::Sender<u64>,
    record: IssuedRecord,
    metrics: RevocationMetrics,
    /// The signing CA's key identifier (hex), set as the material changes.
    signing_key_id: ArcSwap<Arc<str>>,
    /// The key identifiers (hex) of the CA certificates above the signing
    /// one up to the root (e.g. the HSM-held CA above its in-memory
    /// intermediate): revoking one of them stops issuance too.
    upper_key_ids: ArcSwap<Vec<Arc<str>>>,
    /// In a cluster: the revoked serials other replicas issued, by the
    /// name of the ConfigMap each shares them in.
    peers: Mutex<BTreeMap<String, Vec<KeptSerial>>>,
    /// The revoked serials of this replica's own record, for the others.
    own_covered: watch::Sender<Vec<KeptSerial>>,
}

/// A request refused by an entry: what the caller is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Revoked {
    /// The entry's name (target and time, not the reason).
    pub(crate) entry: String,
}

impl Revocations {
    /// An empty state remembering at most `record_size` issued certificates.
    pub(crate) fn new(record_size: usize, metrics: RevocationMetrics) -> Self {
        Self {
            sources: Mutex::default(),
            merged: ArcSwap::from_pointee(RevocationList::new()),
            changes: watch::channel(0).0,
            record: IssuedRecord::new(record_size),
            metrics,
            signing_key_id: ArcSwap::from_pointee(Arc::from("")),
            upper_key_ids: ArcSwap::from_pointee(Vec::new()),
            peers: Mutex::default(),
            own_covered: watch::channel(Vec::new()).0,
        }
    }

    /// Follows the signing CA of `authority` (its key identifier), until
    /// dropped.
    pub(crate) async fn follow_signing_ca(self: Arc<Self>, authority: Arc<Authority>) {
        let mut changes = authority.subscribe();
        loop {
            let state = authority.current();
            let key_id = meshca_certs::revocation::IntermediateRef::from_der(
                state.material.signing.cert_der(),
            )
            .map(|r| r.key_id)
            .unwrap_or_default();
            self.signing_key_id
                .store(Arc::new(Arc::from(key_id.as_str())));
            // The chain holds the signing certificate first, then the CAs
            // above it (roots are not in it: the anchor is kept apart).
            let upper: Vec<Arc<str>> = state
                .material
                .chain
                .iter()
                .skip(1)
                .chain(std::iter::once(&state.material.anchor_root))
                .filter_map(|der| meshca_certs::revocation::IntermediateRef::from_der(der).ok())
                .map(|r| Arc::from(r.key_id.as_str()))
                .filter(|k: &Arc<str>| !k.is_empty() && **k != *key_id)
                .collect();
            self.upper_key_ids.store(Arc::new(upper));
            if changes.changed().await.is_err() {
                return;
            }
        }
    }

    /// The service's check: `PERMISSION_DENIED` naming the entry when one
    /// revokes `identity`, its service account, the node, the certificate
    /// the caller renews with, or the signing CA.
    pub(crate) fn refuse_revoked(
        &self,
        caller: &crate::authn::Caller,
        identity: &SpiffeId,
        node: Option<&str>,
    ) -> Result<(), tonic::Status> {
        let presented = match &caller.kind {
            crate::authn::CallerKind::ClientCertificate { serial, .. } => Some(serial.as_str()),
            crate::authn::CallerKind::Token { .. } => None,
        };
        let key_id: Arc<str> = Arc::clone(&self.signing_key_id.load());
        let key_id = Some(&*key_id).filter(|k| !k.is_empty());
        // The caller's own identity too: a revoked node agent impersonates no one.
        let checks = [
            Some(identity),
            (caller.identity != *identity).then_some(&caller.identity),
        ];
        let upper = self.upper_key_ids.load();
        let cas = std::iter::once(key_id).chain(upper.iter().map(|k| Some(&**k)));
        for (id, ca) in checks
            .into_iter()
            .flatten()
            .flat_map(|id| cas.clone().map(move |ca| (id, ca)))
        {
            if let Err(revoked) = self.check(id, presented, node, ca, OffsetDateTime::now_utc()) {
                tracing::info!(caller = %caller.identity, identity = %identity, entry = %revoked.entry, "certificate refused: revoked");
                return Err(tonic::Status::permission_denied(format!(
                    "{identity} may not get a certificate: revoked by the entry {}",
                    revoked.entry
                )));
            }
        }
        Ok(())
    }

    /// Records a certificate the service issued.
    pub(crate) fn record(
        &self,
        issued: &crate::authority::IssuedChain,
        identity: &SpiffeId,
        node: Option<&str>,
    ) {
        let key_id: Arc<str> = Arc::clone(&self.signing_key_id.load());
        self.record_issued(
            &issued.serial_hex,
            identity,
            node,
            (&key_id, self.upper_key_ids.load_full()),
            OffsetDateTime::now_utc(),
            issued.not_after,
        );
    }

    /// Told on every change of the list.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// The list in use.
    #[cfg(test)]
    pub(crate) fn list(&self) -> Arc<RevocationList> {
        self.merged.load_full()
    }

    /// Takes `list` as the new content of `source`: logs and counts its
    /// rejected entries, and tells the subscribers when the list in use
    /// changed.
    pub(crate) fn set(&self, source: Source, list: RevocationList, source_name: &str) {
        let mut sources = self.sources.lock().unwrap_or_else(|e| e.into_inner());
        if sources.get(&source).is_some_and(|old| **old == list) {
            return;
        }
        for rejected in list.rejected() {
            tracing::warn!(source = %source_name, entry = rejected.index, error = %rejected.error, "revocation entry refused; the other entries apply");
        }
        // One series per rejected entry of this source.
        let labels = |entry: String| RejectedLabels {
            source: source.name().into(),
            entry,
        };
        if let Some(old) = sources.get(&source) {
            for r in old.rejected().iter().take(MAX_LABELLED_REJECTIONS) {
                self.metrics.rejected.remove(&labels(r.index.to_string()));
            }
            self.metrics.rejected.remove(&labels("more".into()));
        }
        for r in list.rejected().iter().take(MAX_LABELLED_REJECTIONS) {
            self.metrics
                .rejected
                .get_or_create(&labels(r.index.to_string()))
                .set(1);
        }
        if list.rejected().len() > MAX_LABELLED_REJECTIONS {
            self.metrics
                .rejected
                .get_or_create(&labels("more".into()))
                .set((list.rejected().len() - MAX_LABELLED_REJECTIONS) as i64);
        }
        tracing::info!(source = %source_name, entries = list.entries().len(), rejected = list.rejected().len(), "revocation list taken");
        sources.insert(source, Arc::new(list));
        let mut merged = RevocationList::new();
        let now = OffsetDateTime::now_utc();
        for list in sources.values() {
            for entry in list.entries() {
                // Both sources may name a target: the first wins, both are kept.
                let _ = merged.add(entry.clone(), now);
            }
        }
        self.metrics.entries.set(merged.entries().len() as i64);
        self.merged.store(Arc::new(merged));
        self.changes.send_modify(|g| *g += 1);
    }

    /// Refuses a certificate for `identity` when an entry covers it, its
    /// service account, `node` (the pod's) or `caller_node` (the node
    /// agent's), the certificate presented (`presented_serial`, hex) or the
    /// signing CA (`signing_key_id`).
    pub(crate) fn check(
        &self,
        identity: &SpiffeId,
        presented_serial: Option<&str>,
        node: Option<&str>,
        signing_key_id: Option<&str>,
        now: OffsetDateTime,
    ) -> Result<(), Revoked> {
        let list = self.merged.load();
        if list.entries().is_empty() {
            return Ok(());
        }
        let presented = presented_serial.and_then(|s| Serial::parse(s).ok());
        let query = IssuanceQuery {
            identity: Some(identity),
            presented_serial: presented.as_ref(),
            node,
            caller_node: None,
            signing_key_id,
        };
        match list.refusal(&query, now) {
            None => Ok(()),
            Some(entry) => {
                self.metrics.refused.inc();
                Err(Revoked {
                    entry: entry.name(),
                })
            }
        }
    }

    /// Remembers a certificate just issued by the CA `issuer` (its key
    /// identifier, and those of the CAs above it).
    pub(crate) fn record_issued(
        &self,
        serial_hex: &str,
        identity: &SpiffeId,
        node: Option<&str>,
        issuer: (&Arc<str>, Arc<Vec<Arc<str>>>),
        issued_at: OffsetDateTime,
        not_after: OffsetDateTime,
    ) {
        let (issuer_key_id, upper_key_ids) = issuer;
        let Ok(serial) = Serial::parse(serial_hex) else {
            return;
        };
        self.record.push(
            Issued {
                serial,
                identity: identity.clone(),
                node: node.map(Arc::from),
                issuer_key_id: issuer_key_id.clone(),
                upper_key_ids,
                issued_at,
                not_after,
            },
            &self.metrics,
        );
    }

    /// The serials the CRL lists at `now`: the list's serial entries, the
    /// unexpired certificates of the record an entry covers, and those
    /// kept from before, each only until its notAfter.
    fn revoked_serials(&self, kept: &[KeptSerial], now: OffsetDateTime) -> Vec<KeptSerial> {
        let list = self.merged.load();
        let record = self.record.snapshot();
        let mut out: BTreeMap<String, KeptSerial> = BTreeMap::new();
        for k in kept {
            if k.not_after.is_none_or(|na| na > now) {
                out.insert(k.serial.clone(), k.clone());
            }
        }
        let mut not_after_of: BTreeMap<&Serial, OffsetDateTime> = BTreeMap::new();
        let mut own = Vec::new();
        for issued in &record {
            not_after_of.insert(&issued.serial, issued.not_after);
            if issued.not_after <= now {
                continue;
            }
            let summary = IssuedSummary {
                serial: &issued.serial,
                identity: &issued.identity,
                node: issued.node.as_deref(),
                issuer_key_id: Some(&issued.issuer_key_id),
                issued_at: issued.issued_at,
            };
            // A revoked CA above the issuer (the root above an
            // intermediate) covers every leaf issued under it too.
            let covering = list.covering(&summary).or_else(|| {
                if !list.has_intermediate_entries() {
                    return None;
                }
                issued.upper_key_ids.iter().find_map(|upper| {
                    list.covering(&IssuedSummary {
                        issuer_key_id: Some(upper),
                        ..summary
                    })
                })
            });
            if let Some(entry) = covering {
                let kept = KeptSerial {
                    serial: issued.serial.to_string(),
                    reason: entry.reason,
                    revoked_at: entry.revoked_at.max(issued.issued_at),
                    not_after: Some(issued.not_after),
                };
                own.push(kept.clone());
                out.entry(issued.serial.to_string()).or_insert(kept);
            }
        }
        self.own_covered.send_if_modified(|current| {
            if *current == own {
                return false;
            }
            *current = own;
            true
        });
        for shared in self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            for k in shared {
                if k.not_after.is_some_and(|na| na > now) {
                    out.entry(k.serial.clone()).or_insert_with(|| k.clone());
                }
            }
        }
        for (serial, entry) in list.serials() {
            let not_after = not_after_of.get(serial).copied();
            if not_after.is_some_and(|na| na <= now) {
                continue;
            }
            // A serial entry that expires stops listing a serial meshca
            // does not know the end of.
            let not_after = not_after.or(entry.expires);
            if not_after.is_some_and(|na| na <= now) {
                continue;
            }
            out.entry(serial.to_string()).or_insert(KeptSerial {
                serial: serial.to_string(),
                reason: entry.reason,
                revoked_at: entry.revoked_at,
                not_after,
            });
        }
        out.into_values().collect()
    }
}

/// The label of the ConfigMaps in which replicas share the revoked
/// serials of their records.
pub(crate) const SHARED_LABEL: &str = "meshca.io/revoked-serials";
/// The data key of those ConfigMaps (JSON: serial, reason, revoked_at,
/// not_after).
const SHARED_KEY: &str = "serials.json";
/// Revoked serials one replica shares (about 130 bytes each in JSON, so
/// the ConfigMap stays under 1 MiB); beyond it, the latest to expire are
/// kept.
const MAX_SHARED_SERIALS: usize = 7_000;

/// The name of this replica's ConfigMap: from `POD_NAME` (stable across
/// container restarts), else the host name.
pub(crate) fn shared_configmap_name() -> String {
    let base = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "meshca".into());
    let clean: String = base
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(200)
        .collect();
    format!("meshca-revoked-{}", clean.trim_matches('-'))
}

/// In a cluster, until dropped: writes the revoked serials of this
/// replica's record to the ConfigMap `name` (labelled [`SHARED_LABEL`]) in
/// `namespace` whenever they change, and follows the other replicas'
/// ConfigMaps into the CRL. Only revoked serials travel, and only when the
/// list or the record changes them: nothing is written per certificate.
pub(crate) async fn share_with_replicas(
    client: kube::Client,
    namespace: String,
    name: String,
    revocations: Arc<Revocations>,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let events = watcher::watcher(
        api.clone(),
        watcher::Config::default().labels(&format!("{SHARED_LABEL}=true")),
    );
    futures::pin_mut!(events);
    let mut retry = meshca_kube::WatchRetry::new("shared revoked serials");
    let mut own = revocations.own_covered.subscribe();
    let mut pending = true;
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            changed = own.changed() => {
                if changed.is_err() {
                    return;
                }
                pending = true;
            }
            _ = tick.tick() => {}
            event = events.next() => {
                let Some(event) = event else { return };
                retry.saw(&event);
                let changed = match event {
                    Ok(Event::Apply(cm)) | Ok(Event::InitApply(cm)) => {
                        let Some(peer) = cm.metadata.name.clone().filter(|n| *n != name) else {
                            continue;
                        };
                        let serials: Vec<KeptSerial> = cm
                            .data
                            .as_ref()
                            .and_then(|d| d.get(SHARED_KEY))
                            .and_then(|t| serde_json::from_str(t).ok())
                            .unwrap_or_default();
                        let serials: Vec<KeptSerial> = serials.into_iter().take(MAX_SHARED_SERIALS).collect();
                        let mut peers = revocations.peers.lock().unwrap_or_else(|e| e.into_inner());
                        let changed = peers.get(&peer) != Some(&serials);
                        peers.insert(peer, serials);
                        changed
                    }
                    Ok(Event::Delete(cm)) => cm
                        .metadata
                        .name
                        .as_ref()
                        .is_some_and(|n| revocations.peers.lock().unwrap_or_else(|e| e.into_inner()).remove(n).is_some()),
                    Ok(_) => false,
                    Err(e) => {
                        retry.failed(&e).await;
                        false
                    }
                };
                if changed {
                    revocations.changes.send_modify(|g| *g += 1);
                }
            }
        }
        if !pending {
            continue;
        }
        let mut serials = own.borrow_and_update().clone();
        serials.sort_by_key(|k| std::cmp::Reverse(k.not_after));
        serials.truncate(MAX_SHARED_SERIALS);
        let json = serde_json::to_string(&serials).unwrap_or_default();
        match write_shared(&api, &namespace, &name, json).await {
            Ok(()) => pending = false,
            Err(e) => {
                tracing::warn!(configmap = %name, error = %meshca_kube::describe(&e), "sharing the revoked serials failed; retrying");
            }
        }
    }
}

async fn write_shared(
    api: &Api<ConfigMap>,
    namespace: &str,
    name: &str,
    json: String,
) -> Result<(), kube::Error> {
    let data = std::collections::BTreeMap::from([(SHARED_KEY.to_string(), json)]);
    match api.get_opt(name).await? {
        Some(cm) if cm.data.as_ref() == Some(&data) => Ok(()),
        Some(mut cm) => {
            cm.metadata.managed_fields = None;
            cm.data = Some(data);
            api.replace(name, &Default::default(), &cm)
                .await
                .map(|_| ())
        }
        // Nothing to share and nothing shared before: no ConfigMap.
        None if data.get(SHARED_KEY).is_some_and(|j| j == "[]") => Ok(()),
        None => {
            let cm = ConfigMap {
                metadata: kube::api::ObjectMeta {
                    name: Some(name.into()),
                    namespace: Some(namespace.into()),
                    labels: Some([(SHARED_LABEL.to_string(), "true".to_string())].into()),
                    ..Default::default()
                },
                data: Some(data),
                ..Default::default()
            };
            api.create(&Default::default(), &cm).await.map(|_| ())
        }
    }
}

/// Reads a document of a source into `revocations`: an unreadable one
/// keeps the source's last good list.
fn take_document(revocations: &Revocations, source: Source, text: &str, source_name: &str) {
    match RevocationList::parse(text, source_name) {
        Ok(list) => revocations.set(source, list, source_name),
        Err(e) => {
            tracing::error!(source = %source_name, error = %e, "revocation list refused; the last good list stays in use");
            let labels = RejectedLabels {
                source: source.name().into(),
                entry: "document".into(),
            };
            revocations.metrics.rejected.get_or_create(&labels).set(1);
            return;
        }
    }
    revocations.metrics.rejected.remove(&RejectedLabels {
        source: source.name().into(),
        entry: "document".into(),
    });
}

/// Follows the data directory's `revocations.yaml`, until dropped: read
/// at once, then whenever its content changes (checked every `interval`).
/// A missing file is an empty list.
pub(crate) async fn watch_file(dir: PathBuf, revocations: Arc<Revocations>, interval: Duration) {
    let path = dir.join(REVOCATIONS_FILE);
    let name = path.display().to_string();
    let mut last: Option<Vec<u8>> = None;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let content = match tokio::fs::read(&path).await {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                if last.is_some() {
                    tracing::warn!(file = %name, error = %e, "reading the revocation list failed; the last one stays in use");
                }
                continue;
            }
        };
        if last.as_ref() == Some(&content) {
            continue;
        }
        match std::str::from_utf8(&content) {
            Ok(text) => take_document(&revocations, Source::File, text, &name),
            Err(_) => {
                tracing::error!(file = %name, "the revocation list is not UTF-8; the last good list stays in use")
            }
        }
        last = Some(content);
    }
}

/// Follows the ConfigMap `meshca-revocations` in `namespace`, until dropped
/// (every replica). A deleted or absent ConfigMap is an empty list.
pub(crate) async fn watch_configmap(
    client: kube::Client,
    namespace: String,
    revocations: Arc<Revocations>,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let name = format!("configmap {namespace}/{CONFIGMAP_NAME}");
    let events = watcher::watcher(
        api,
        watcher::Config::default().fields(&format!("metadata.name={CONFIGMAP_NAME}")),
    );
    futures::pin_mut!(events);
    let mut retry = meshca_kube::WatchRetry::new("revocations configmap");
    let mut found = false;
    while let Some(event) = events.next().await {
        retry.saw(&event);
        match event {
            Ok(Event::Apply(cm)) | Ok(Event::InitApply(cm)) => {
                found = true;
                let text = cm
                    .data
                    .as_ref()
                    .and_then(|d| d.get(CONFIGMAP_KEY))
                    .map(String::as_str)
                    .unwrap_or("");
                take_document(&revocations, Source::ConfigMap, text, &name);
            }
            Ok(Event::Delete(_)) => {
                tracing::warn!(source = %name, "the revocation ConfigMap was deleted: its entries no longer apply");
                revocations.set(Source::ConfigMap, RevocationList::new(), &name);
            }
            Ok(Event::Init) => found = false,
            Ok(Event::InitDone) => {
                if !found {
                    revocations.set(Source::ConfigMap, RevocationList::new(), &name);
                }
            }
            Err(e) => retry.failed(&e).await,
        }
    }
}

fn read_kept(dir: &Path) -> Vec<KeptSerial> {
    let path = dir.join(REVOKED_SERIALS_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(kept) => kept,
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e, "the kept revoked serials are unreadable; starting from the list and the record");
                Vec::new()
            }
        },
        Err(_) => Vec::new(),
    }
}

/// The CRL's number: milliseconds since 1970 of its thisUpdate, above the
/// last one: it increases across restarts and replicas without state.
fn crl_number(this_update: OffsetDateTime, last: u64) -> u64 {
    let ms = u64::try_from(this_update.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
    ms.max(last + 1)
}

/// Signs a CRL with the material in use for `revoked`.
pub(crate) fn sign_with(
    authority: &Authority,
    revoked: &[RevokedCert],
    times: CrlTimes,
) -> Result<Vec<u8>, crl::CrlError> {
    let state = authority.current();
    let signing = &state.material.signing;
    crl::sign_crl_with_ca_key(signing.cert_der(), signing.key(), revoked, times)
}

/// The nextUpdate of the CRL in `path`, if there is a readable one; a
/// stale one (left by a run that could not sign for a while) is removed.
fn read_next_update(path: &Path) -> Option<OffsetDateTime> {
    let text = std::fs::read_to_string(path).ok()?;
    let next = crl::ParsedCrl::from_pem(&text).ok()?.next_update?;
    if next <= OffsetDateTime::now_utc() {
        tracing::warn!(file = %path.display(), next_update = %meshca_certs::Rfc3339(next), "the CRL left in the data directory is past its nextUpdate; removed until a new one is signed");
        let _ = std::fs::remove_file(path);
        return None;
    }
    Some(next)
}

/// Stops serving the CRL whose nextUpdate passed while no new one could
/// be signed: `ca-crl.pem` removed, the agents' and publishers' copy
/// withdrawn (the `istio-ca-crl` ConfigMaps lose their key: see
/// `bundle_publisher::publish_everywhere`); `meshca_crl_next_update_timestamp` tells.
fn withdraw_crl(path: &Path, out: &watch::Sender<Option<Arc<String>>>) {
    tracing::error!(file = %path.display(), "the CRL reached its nextUpdate and no new one could be signed: withdrawn (ca-crl.pem removed) until signing works again");
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(file = %path.display(), error = %e, "removing the stale ca-crl.pem failed");
        }
    }
    out.send_replace(None);
}

/// Keeps `ca-crl.pem` in `dir` current, until dropped: a new CRL when the
/// list or the CA material changes, and every `refresh` (nextUpdate =
/// thisUpdate + 2 × `refresh`). Its PEM goes to `out` too.
pub(crate) async fn maintain_crl(
    dir: PathBuf,
    authority: Arc<Authority>,
    revocations: Arc<Revocations>,
    refresh: Duration,
    out: watch::Sender<Option<Arc<String>>>,
) {
    let mut list_changes = revocations.subscribe();
    let mut material_changes = authority.subscribe();
    let mut kept = read_kept(&dir);
    let mut last_number = 0;
    let crl_path = dir.join(crl::CRL_FILE);
    // The nextUpdate of the CRL served now (the file left by the last run
    // until the first signing): never served past it.
    let mut served_until = read_next_update(&crl_path);
    let mut tick = tokio::time::interval(refresh);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // After a failed signing (an HSM busy or away): tried again in 1 s,
    // doubling up to a minute, not only at the next change or refresh.
    let mut retry_in: Option<Duration> = None;
    loop {
        let now = OffsetDateTime::now_utc();
        let serials = revocations.revoked_serials(&kept, now);
        let revoked: Vec<RevokedCert> = serials
            .iter()
            .filter_map(|k| {
                Some(RevokedCert {
                    serial: Serial::parse(&k.serial).ok()?,
                    revoked_at: k.revoked_at,
                    reason: k.reason,
                })
            })
            .collect();
        let this_update = now.replace_nanosecond(0).unwrap_or(now);
        let number = crl_number(this_update, last_number);
        let refresh_time = time::Duration::try_from(refresh).unwrap_or(time::Duration::HOUR);
        let times = CrlTimes {
            number,
            this_update,
            next_update: this_update + refresh_time * 2,
        };
        let started = std::time::Instant::now();
        match sign_with(&authority, &revoked, times) {
            Ok(der) => {
                last_number = number;
                let pem = crl::encode_crl_pem(&der);
                if let Err(e) =
                    meshca_certs::bundle::write_file_atomic(&crl_path, pem.as_bytes(), 0o644)
                {
                    tracing::warn!(dir = %dir.display(), error = %e, "writing ca-crl.pem failed");
                }
                served_until = Some(times.next_update);
                if serials != kept {
                    let json = serde_json::to_vec(&serials).unwrap_or_default();
                    if let Err(e) = meshca_certs::bundle::write_file_atomic(
                        &dir.join(REVOKED_SERIALS_FILE),
                        &json,
                        0o600,
                    ) {
                        tracing::warn!(dir = %dir.display(), error = %e, "keeping the revoked serials failed");
                    }
                    kept = serials;
                }
                revocations.metrics.crl_serials.set(revoked.len() as i64);
                revocations
                    .metrics
                    .crl_next_update
                    .set(times.next_update.unix_timestamp());
                tracing::info!(number, serials = revoked.len(), bytes = der.len(), took_ms = started.elapsed().as_millis() as u64, next_update = %meshca_certs::Rfc3339(times.next_update), "signed the CRL");
                out.send_replace(Some(Arc::new(pem)));
                retry_in = None;
            }
            Err(e) => {
                let wait = retry_in.map_or(Duration::from_secs(1), |w| {
                    (w * 2).min(Duration::from_secs(60))
                });
                retry_in = Some(wait);
                tracing::error!(error = %e, retry_in = ?wait, "signing the CRL failed; the last one stays published until its nextUpdate");
                // Never served past its nextUpdate (a client would refuse
                // every peer with it): withdrawn then, and the retry wakes
                // up at that moment.
                let wait = match served_until {
                    Some(until) if until <= now => {
                        withdraw_crl(&crl_path, &out);
                        served_until = None;
                        wait
                    }
                    Some(until) => wait.min(
                        Duration::try_from(until - now).unwrap_or(Duration::ZERO)
                            + Duration::from_millis(10),
                    ),
                    None => wait,
                };
                tokio::select! {
                    () = tokio::time::sleep(wait) => continue,
                    closed = list_changes.changed() => {
                        if closed.is_err() {
                            return;
                        }
                        list_changes.mark_unchanged();
                        continue;
                    }
                }
            }
        }
        tokio::select! {
            changed = list_changes.changed() => if changed.is_err() { return },
            changed = material_changes.changed() => if changed.is_err() { return },
            _ = tick.tick() => {}
        }
        tokio::time::sleep(CRL_DEBOUNCE).await;
        list_changes.mark_unchanged();
        material_changes.mark_unchanged();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> SpiffeId {
        SpiffeId::parse(s).unwrap()
    }

    fn none() -> Arc<Vec<Arc<str>>> {
        Arc::new(Vec::new())
    }

    fn t(s: &str) -> OffsetDateTime {
        OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).unwrap()
    }

    #[test]
    fn identity_entries_list_every_unexpired_serial_of_the_record() {
        let r = Revocations::new(10, RevocationMetrics::default());
        let key: Arc<str> = Arc::from("ab");
        let web = id("spiffe://cluster.local/ns/default/sa/web");
        let api = id("spiffe://cluster.local/ns/default/sa/api");
        let at = t("2026-12-03T10:00:00Z");
        let now = t("2026-12-03T12:00:00Z");
        r.record_issued(
            "0a",
            &web,
            None,
            (&key, none()),
            at,
            t("2026-12-04T10:00:00Z"),
        );
        r.record_issued(
            "0b",
            &web,
            Some("n1"),
            (&key, none()),
            at,
            t("2026-12-03T11:00:00Z"),
        );
        r.record_issued(
            "0c",
            &api,
            Some("n1"),
            (&key, none()),
            at,
            t("2026-12-04T10:00:00Z"),
        );
        r.record_issued(
            "0d",
            &api,
            Some("n2"),
            (&key, none()),
            at,
            t("2026-12-04T10:00:00Z"),
        );
        let doc = r#"revocations:
- {"spiffe_id": "spiffe://cluster.local/ns/default/sa/web", "revoked_at": "2026-12-03T11:30:00Z"}
- {"node": "n1", "reason": "keyCompromise", "revoked_at": "2026-12-03T11:30:00Z"}
- {"serial": "ff", "revoked_at": "2026-12-03T11:30:00Z"}
- {"node": "BAD", "revoked_at": "2026-12-03T11:30:00Z"}
"#;
        take_document(&r, Source::File, doc, "test");
        let serials: Vec<String> = r
            .revoked_serials(&[], now)
            .into_iter()
            .map(|k| k.serial)
            .collect();
        // 0b expired; 0d is on another node.
        assert_eq!(serials, ["a", "c", "ff"]);
        assert_eq!(r.metrics.entries.get(), 3);
        let rejected = RejectedLabels {
            source: "file".into(),
            entry: "4".into(),
        };
        assert_eq!(r.metrics.rejected.get_or_create(&rejected).get(), 1);
        // Requests: refused naming the entry, never its reason.
        let e = r.check(&api, None, Some("n1"), None, now).unwrap_err();
        assert_eq!(e.entry, "node n1 (revoked at 2026-12-03T11:30:00Z)");
        assert!(r.check(&api, None, Some("n2"), None, now).is_ok());
        assert!(r.check(&api, Some("00ff"), None, None, now).is_err());
        // A document that is not a list keeps the last good one.
        take_document(&r, Source::File, "revocations: [", "test");
        assert_eq!(r.list().entries().len(), 3);
    }

    #[test]
    fn a_revoked_ca_above_the_issuer_lists_every_leaf_under_it() {
        let r = Revocations::new(10, RevocationMetrics::default());
        let (east, west): (Arc<str>, Arc<str>) = (Arc::from("ee"), Arc::from("ff"));
        let root: Arc<Vec<Arc<str>>> = Arc::new(vec![Arc::from("aa")]);
        let other_root: Arc<Vec<Arc<str>>> = Arc::new(vec![Arc::from("bb")]);
        let web = id("spiffe://cluster.local/ns/default/sa/web");
        let at = t("2026-12-03T10:00:00Z");
        let until = t("2026-12-04T10:00:00Z");
        r.record_issued("01", &web, None, (&east, root.clone()), at, until);
        r.record_issued("02", &web, None, (&west, root), at, until);
        r.record_issued("03", &web, None, (&east, other_root), at, until);
        let listed = |doc: &str| {
            take_document(&r, Source::File, doc, "test");
            r.revoked_serials(&[], t("2026-12-03T12:00:00Z"))
                .into_iter()
                .map(|k| k.serial)
                .collect::<Vec<_>>()
        };
        // The root: both intermediates' leaves under it, not the other root's.
        let root_entry = r#"revocations:
- {"intermediate": {"key_id": "aa", "serial": "1"}, "reason": "cACompromise", "revoked_at": "2026-12-03T11:00:00Z"}
"#;
        assert_eq!(listed(root_entry), ["1", "2"]);
        // One intermediate: its own leaves only.
        let east_entry = r#"revocations:
- {"intermediate": {"key_id": "ee", "serial": "2"}, "revoked_at": "2026-12-03T11:00:00Z"}
"#;
        assert_eq!(listed(east_entry), ["1", "3"]);
    }

    #[test]
    fn a_crl_past_its_next_update_is_never_served_on() {
        use meshca_certs::{KeyAlgorithm, PrivateKey};
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let now = OffsetDateTime::now_utc().replace_nanosecond(0).unwrap();
        let root = meshca_certs::profile::self_signed_root(
            &key,
            &Default::default(),
            meshca_certs::profile::Validity::backdated(now, time::Duration::days(1)),
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(crl::CRL_FILE);
        let write = |next_update: OffsetDateTime| {
            let times = CrlTimes {
                number: 1,
                this_update: now - time::Duration::hours(3),
                next_update,
            };
            let der = crl::sign_crl(&root.der, key.key_pair(), &[], times).unwrap();
            std::fs::write(&path, crl::encode_crl_pem(&der)).unwrap();
        };
        // A current one left by the last run is served until its nextUpdate.
        write(now + time::Duration::hours(1));
        assert_eq!(
            read_next_update(&path),
            Some(now + time::Duration::hours(1))
        );
        assert!(path.exists());
        // A stale one is removed at start.
        write(now - time::Duration::minutes(1));
        assert_eq!(read_next_update(&path), None);
        assert!(!path.exists());
        // Withdrawn when its time comes while signing fails.
        write(now + time::Duration::hours(1));
        let (tx, rx) = watch::channel(Some(Arc::new("pem".to_string())));
        withdraw_crl(&path, &tx);
        assert!(!path.exists());
        assert!(rx.borrow().is_none());
    }

    #[test]
    fn a_full_record_drops_the_oldest_and_counts_it() {
        let metrics = RevocationMetrics::default();
        let record = IssuedRecord::new(2);
        let key: Arc<str> = Arc::from("ab");
        for s in ["1", "2", "3"] {
            record.push(
                Issued {
                    serial: Serial::parse(s).unwrap(),
                    identity: id("spiffe://td/ns/a/sa/b"),
                    node: None,
                    issuer_key_id: key.clone(),
                    upper_key_ids: none(),
                    issued_at: t("2026-12-03T10:00:00Z"),
                    not_after: t("2026-12-04T10:00:00Z"),
                },
                &metrics,
            );
        }
        let serials: Vec<String> = record
            .snapshot()
            .iter()
            .map(|i| i.serial.to_string())
            .collect();
        assert_eq!(serials, ["2", "3"]);
        assert_eq!(metrics.issued_record_dropped.get(), 1);
    }

    /// The cost per certificate in BENCHMARKS.md ("Revocation"): `cargo
    /// test -p meshca-ca --lib revocation::tests::record_cost -- --ignored
    /// --nocapture`.
    #[test]
    #[ignore = "a measurement: run by hand"]
    fn record_cost_per_certificate_and_crl_with_a_full_record() {
        let r = Revocations::new(DEFAULT_ISSUED_RECORD_SIZE, RevocationMetrics::default());
        let key: Arc<str> = Arc::from("ab12");
        let ids: Vec<SpiffeId> = (0..1000)
            .map(|i| id(&format!("spiffe://cluster.local/ns/ns{}/sa/sa{i}", i % 50)))
            .collect();
        let now = OffsetDateTime::now_utc();
        let later = now + time::Duration::hours(24);
        let upper: Arc<Vec<Arc<str>>> = Arc::new(vec![Arc::from("cd34")]);
        let n = DEFAULT_ISSUED_RECORD_SIZE * 2;
        let started = std::time::Instant::now();
        for i in 0..n {
            let serial = format!("{:034x}", (i as u128) << 20 | 0x5a5a5);
            r.record_issued(
                &serial,
                &ids[i % ids.len()],
                Some("node-1"),
                (&key, upper.clone()),
                now,
                later,
            );
        }
        let per = started.elapsed() / n as u32;
        // Identity-level entries over a full record: the CRL's input.
        let doc = (0..10)
            .map(|i| format!("- {{\"service_account\": \"ns{i}/sa{i}\", \"revoked_at\": \"2026-12-03T11:30:00Z\"}}\n"))
            .collect::<String>();
        take_document(&r, Source::File, &format!("revocations:\n{doc}"), "bench");
        let started = std::time::Instant::now();
        let serials = r.revoked_serials(&[], now);
        let scan = started.elapsed();
        println!(
            "record: {:.0} ns per certificate ({} pushed, {} kept); CRL input from a full record: {} serials in {:.1} ms",
            per.as_nanos(),
            n,
            r.record.snapshot().len(),
            serials.len(),
            scan.as_secs_f64() * 1e3
        );
    }
}
