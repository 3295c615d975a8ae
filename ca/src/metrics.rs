//! Prometheus metrics with Istio's exact names (docs/metrics.md), so existing
//! Istio dashboards and alerts work against meshca.
//!
//! Istio's counters have no `_total` suffix. OpenMetrics requires one on
//! counters, so these are exposed in the classic Prometheus text format
//! (`text/plain; version=0.0.4`), where counter names are free; see
//! [`IstioCounter`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use time::OffsetDateTime;

/// A monotonic counter exposed under its exact name (no `_total`).
#[derive(Debug, Clone, Default)]
pub(crate) struct IstioCounter(Arc<AtomicU64>);

impl IstioCounter {
    /// Adds one.
    pub(crate) fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// The current value.
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl prometheus_client::metrics::TypedMetric for IstioCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for IstioCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // Written like a gauge so the encoder adds no `_total`; typed as a
        // counter in the TYPE line.
        encoder.encode_gauge(&self.get())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
}

/// Label of `citadel_server_csr_sign_err_count`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SignErrorLabels {
    /// What kind of error.
    pub(crate) error: String,
}

/// Every metric of the CA.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    /// CSRs received.
    pub(crate) csr_count: IstioCounter,
    /// Authentication failures.
    pub(crate) authentication_failure_count: IstioCounter,
    /// CSRs that could not be parsed or verified.
    pub(crate) csr_parsing_err_count: IstioCounter,
    /// Identity could not be determined or was not allowed.
    pub(crate) id_extraction_err_count: IstioCounter,
    /// Signing failures, by error.
    pub(crate) csr_sign_err_count: Family<SignErrorLabels, IstioCounter>,
    /// Certificates issued.
    pub(crate) success_cert_issuance_count: IstioCounter,
    /// Root certificate notAfter (unix seconds).
    pub(crate) root_cert_expiry_timestamp: Gauge<f64, AtomicU64>,
    /// Root certificate time left (seconds).
    pub(crate) root_cert_expiry_seconds: Gauge<f64, AtomicU64>,
    /// Signing chain notAfter (earliest in the chain, unix seconds).
    pub(crate) cert_chain_expiry_timestamp: Gauge<f64, AtomicU64>,
    /// Signing chain time left (seconds).
    pub(crate) cert_chain_expiry_seconds: Gauge<f64, AtomicU64>,
    /// 1 when the CA can sign, 0 otherwise.
    pub(crate) ready: Gauge<i64>,
    /// CreateCertificate latency, successful issuances.
    pub(crate) issuance_duration_seconds: Histogram,
    /// New CA material taken into use (a `--ca-dir` change, a Secret change).
    pub(crate) reloads_ok: IstioCounter,
    /// New CA material refused (the previous material keeps signing).
    pub(crate) reloads_refused: IstioCounter,
    /// 1 while the last offered CA material was refused.
    pub(crate) reload_refused: Gauge<i64>,
    /// Failed attempts of the HSM key to sign a new intermediate.
    pub(crate) hsm_renewal_failures: IstioCounter,
    /// 1 while the HSM key cannot sign a new intermediate.
    pub(crate) hsm_unavailable: Gauge<i64>,
    /// Root rotation phase: 1 on the current phase's label.
    pub(crate) root_rotation_phase: Family<PhaseLabels, Gauge<i64>>,
    /// 1 while this replica holds the leader Lease.
    pub(crate) leader: Gauge<i64>,
    /// Bundle ConfigMaps created or updated.
    pub(crate) bundle_configmap_writes: IstioCounter,
    /// Requests authenticated from the cache of verified tokens.
    pub(crate) token_cache_hits: IstioCounter,
    /// gRPC connections open: in their TLS handshake or established.
    pub(crate) grpc_connections: Gauge<i64>,
    /// gRPC connections closed before their TLS handshake completed.
    pub(crate) tls_handshake_failures: IstioCounter,
    /// Of those, the handshakes that took longer than allowed.
    pub(crate) tls_handshake_timeouts: IstioCounter,
    /// gRPC connections closed at accept: `--max-connections` were open.
    pub(crate) grpc_connections_refused: IstioCounter,
    /// gRPC connections closed at accept: `--max-connections-per-source`
    /// were open from their source address and none could make room.
    pub(crate) grpc_connections_refused_per_source: IstioCounter,
    /// gRPC connections sent a GOAWAY after `--max-connection-idle`
    /// without an open stream.
    pub(crate) grpc_idle_connections_closed: IstioCounter,
    /// gRPC connections sent a GOAWAY to make room for a new one while
    /// `--max-connections` were open.
    pub(crate) grpc_connections_evicted: IstioCounter,
    /// gRPC connections cut off in their TLS handshake to make room for a
    /// new one while `--max-connections` were open.
    pub(crate) grpc_stalled_handshakes_cut: IstioCounter,
    /// CreateCertificate requests waiting for a slot.
    pub(crate) requests_waiting: Gauge<i64>,
    /// Requests refused at once: `--max-open-requests` were open.
    pub(crate) open_requests_refused: IstioCounter,
    /// TokenReviews waiting for a call to the Kubernetes API.
    pub(crate) token_reviews_waiting: Gauge<i64>,
    /// Requests refused by the per-identity issuance rate limit.
    pub(crate) issuance_throttled: IstioCounter,
    /// PodCertificateRequests answered, by result and reason.
    pub(crate) pod_certificate_requests: Family<PodCertificateLabels, IstioCounter>,
    /// PodCertificateRequests queued or in progress.
    pub(crate) pod_certificate_requests_waiting: Gauge<i64>,
    /// ClusterTrustBundles created or updated.
    pub(crate) cluster_trust_bundle_writes: IstioCounter,
    /// Revocation entries, refusals, the CRL and the issued record.
    pub(crate) revocation: crate::revocation::RevocationMetrics,
    /// Remote clusters: up, count, refused configurations, refusals.
    pub(crate) remote_clusters: crate::cluster::remote::RemoteClusterMetrics,
    /// JWT-SVIDs: mints by result, key changes, the signing key's age.
    pub(crate) jwt_svid: crate::jwt_svid::JwtSvidMetrics,
}

/// Labels of `meshca_pod_certificate_request_count`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PodCertificateLabels {
    /// `Issued`, `Denied`, `Failed`, `GaveUp` (a round of attempts failed;
    /// tried again later) or `Skipped` (a stale watch event of a request
    /// already answered).
    pub(crate) result: String,
    /// The condition's reason.
    pub(crate) reason: String,
}

/// Label of `meshca_root_rotation_phase`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PhaseLabels {
    /// The phase's name.
    pub(crate) phase: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            csr_count: Default::default(),
            authentication_failure_count: Default::default(),
            csr_parsing_err_count: Default::default(),
            id_extraction_err_count: Default::default(),
            csr_sign_err_count: Default::default(),
            success_cert_issuance_count: Default::default(),
            root_cert_expiry_timestamp: Default::default(),
            root_cert_expiry_seconds: Default::default(),
            cert_chain_expiry_timestamp: Default::default(),
            cert_chain_expiry_seconds: Default::default(),
            ready: Default::default(),
            issuance_duration_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            reloads_ok: Default::default(),
            reloads_refused: Default::default(),
            reload_refused: Default::default(),
            hsm_renewal_failures: Default::default(),
            hsm_unavailable: Default::default(),
            root_rotation_phase: Default::default(),
            leader: Default::default(),
            bundle_configmap_writes: Default::default(),
            token_cache_hits: Default::default(),
            grpc_connections: Default::default(),
            tls_handshake_failures: Default::default(),
            tls_handshake_timeouts: Default::default(),
            grpc_connections_refused: Default::default(),
            grpc_connections_refused_per_source: Default::default(),
            grpc_idle_connections_closed: Default::default(),
            grpc_connections_evicted: Default::default(),
            grpc_stalled_handshakes_cut: Default::default(),
            requests_waiting: Default::default(),
            token_reviews_waiting: Default::default(),
            open_requests_refused: Default::default(),
            issuance_throttled: Default::default(),
            pod_certificate_requests: Default::default(),
            pod_certificate_requests_waiting: Default::default(),
            cluster_trust_bundle_writes: Default::default(),
            revocation: Default::default(),
            remote_clusters: Default::default(),
            jwt_svid: Default::default(),
        }
    }
}

impl Metrics {
    /// Registers every metric in a new registry.
    pub(crate) fn register(&self) -> Registry {
        let mut r = Registry::default();
        r.register(
            "citadel_server_csr_count",
            "The number of CSRs received by Citadel server",
            self.csr_count.clone(),
        );
        r.register(
            "citadel_server_authentication_failure_count",
            "The number of authentication failures",
            self.authentication_failure_count.clone(),
        );
        r.register(
            "citadel_server_csr_parsing_err_count",
            "The number of errors occurred when parsing the CSR",
            self.csr_parsing_err_count.clone(),
        );
        r.register(
            "citadel_server_id_extraction_err_count",
            "The number of errors occurred when extracting the ID from CSR",
            self.id_extraction_err_count.clone(),
        );
        r.register(
            "citadel_server_csr_sign_err_count",
            "The number of errors occurred when signing the CSR",
            self.csr_sign_err_count.clone(),
        );
        r.register(
            "citadel_server_success_cert_issuance_count",
            "The number of certificates issuances that have succeeded",
            self.success_cert_issuance_count.clone(),
        );
        r.register(
            "citadel_server_root_cert_expiry_timestamp",
            "The unix timestamp, in seconds, when Citadel root cert will expire",
            self.root_cert_expiry_timestamp.clone(),
        );
        r.register(
            "citadel_server_root_cert_expiry_seconds",
            "The time remaining, in seconds, before the root cert will expire",
            self.root_cert_expiry_seconds.clone(),
        );
        r.register(
            "citadel_server_cert_chain_expiry_timestamp",
            "The unix timestamp, in seconds, when Citadel cert chain will expire",
            self.cert_chain_expiry_timestamp.clone(),
        );
        r.register(
            "citadel_server_cert_chain_expiry_seconds",
            "The time remaining, in seconds, before the cert chain will expire",
            self.cert_chain_expiry_seconds.clone(),
        );
        r.register(
            "meshca_ready",
            "1 when the CA can sign certificates, else 0",
            self.ready.clone(),
        );
        r.register(
            "meshca_issuance_duration_seconds",
            "Time to handle a successful CreateCertificate, from receipt to signed chain",
            self.issuance_duration_seconds.clone(),
        );
        r.register(
            "meshca_ca_reload_count",
            "New CA material taken into use while serving (a --ca-dir change, a CA Secret change)",
            self.reloads_ok.clone(),
        );
        r.register(
            "meshca_ca_reload_refused_count",
            "New CA material refused while serving; the previous material kept signing",
            self.reloads_refused.clone(),
        );
        r.register(
            "meshca_ca_reload_refused",
            "Whether the last offered CA material was refused (1) or not (0); see the log and /ready",
            self.reload_refused.clone(),
        );
        r.register(
            "meshca_hsm_intermediate_renewal_failed_count",
            "Attempts of the HSM key (--ca-key-pkcs11) to sign a new in-memory intermediate that failed",
            self.hsm_renewal_failures.clone(),
        );
        r.register(
            "meshca_hsm_unavailable",
            "Whether the HSM key could not sign the next intermediate (1; the current one signs on until --ca-expiry-margin) or could (0)",
            self.hsm_unavailable.clone(),
        );
        r.register(
            "meshca_root_rotation_phase",
            "Root rotation phase of the CA Secret (stable, announced, switched): the current phase is set to 1",
            self.root_rotation_phase.clone(),
        );
        r.register(
            "meshca_leader",
            "Whether this replica holds the leader Lease (1) or not (0): bundle publishing, root rotation",
            self.leader.clone(),
        );
        r.register(
            "meshca_bundle_configmap_write_count",
            "istio-ca-root-cert ConfigMaps created or updated",
            self.bundle_configmap_writes.clone(),
        );
        r.register(
            "meshca_token_cache_hit_count",
            "Requests authenticated from the cache of verified tokens (--jwt-cache-ttl, --token-review-cache-ttl): no signature check or TokenReview",
            self.token_cache_hits.clone(),
        );
        r.register(
            "meshca_grpc_connections",
            "gRPC connections open, in their TLS handshake or established (a mass restart of sidecars opens one per pod)",
            self.grpc_connections.clone(),
        );
        r.register(
            "meshca_tls_handshake_failure_count",
            "gRPC connections closed before their TLS handshake completed: refused by TLS, broken off, or slower than --tls-handshake-timeout",
            self.tls_handshake_failures.clone(),
        );
        r.register(
            "meshca_tls_handshake_timeout_count",
            "gRPC connections dropped because their TLS handshake took longer than --tls-handshake-timeout (also counted in meshca_tls_handshake_failure_count)",
            self.tls_handshake_timeouts.clone(),
        );
        r.register(
            "meshca_grpc_connections_refused_count",
            "gRPC connections closed as soon as they were accepted because --max-connections were open",
            self.grpc_connections_refused.clone(),
        );
        r.register(
            "meshca_grpc_connections_refused_per_source_count",
            "gRPC connections closed as soon as they were accepted because --max-connections-per-source were open from their source address and none of those could make room",
            self.grpc_connections_refused_per_source.clone(),
        );
        r.register(
            "meshca_grpc_idle_connections_closed_count",
            "gRPC connections sent an HTTP/2 GOAWAY after --max-connection-idle without an open stream",
            self.grpc_idle_connections_closed.clone(),
        );
        r.register(
            "meshca_grpc_connections_evicted_count",
            "gRPC connections sent an HTTP/2 GOAWAY to make room for a new one while --max-connections were open (each idle at least --evict-idle-connections-after)",
            self.grpc_connections_evicted.clone(),
        );
        r.register(
            "meshca_grpc_stalled_handshakes_cut_count",
            "gRPC connections cut off in a TLS handshake that had lasted 2 s or more, to make room for a new one while --max-connections were open",
            self.grpc_stalled_handshakes_cut.clone(),
        );
        r.register(
            "meshca_requests_waiting",
            "CreateCertificate requests waiting for a slot (--max-concurrent-requests); the queue is as long as what the CA answered in the last second, past it requests get RESOURCE_EXHAUSTED",
            self.requests_waiting.clone(),
        );
        r.register(
            "meshca_open_requests_refused_count",
            "gRPC requests refused with RESOURCE_EXHAUSTED before their message was read, because --max-open-requests requests were open across all connections",
            self.open_requests_refused.clone(),
        );
        r.register(
            "meshca_token_reviews_waiting",
            "TokenReviews waiting for a call to the Kubernetes API (--kube-api-max-in-flight calls at once); past the queue's bound requests get RESOURCE_EXHAUSTED",
            self.token_reviews_waiting.clone(),
        );
        r.register(
            "meshca_issuance_throttled_count",
            "CreateCertificate requests refused with RESOURCE_EXHAUSTED by the per-identity issuance rate limit (--issuance-burst, --issuance-interval): a client renewing in a loop",
            self.issuance_throttled.clone(),
        );
        r.register(
            "meshca_pod_certificate_request_count",
            "PodCertificateRequests answered (--pod-certificate-signer), by result (Issued, Denied, Failed; GaveUp: a round of attempts failed, tried again later; Skipped: a stale watch event of a request already answered, not signed again) and reason",
            self.pod_certificate_requests.clone(),
        );
        r.register(
            "meshca_pod_certificate_requests_waiting",
            "PodCertificateRequests read from the watch and not yet answered (queued or in progress)",
            self.pod_certificate_requests_waiting.clone(),
        );
        r.register(
            "meshca_cluster_trust_bundle_write_count",
            "ClusterTrustBundles of the pod-certificate signer created or updated",
            self.cluster_trust_bundle_writes.clone(),
        );
        self.revocation.register(&mut r);
        self.remote_clusters.register(&mut r);
        self.jwt_svid.register(&mut r);
        r
    }

    /// Sets the rotation phase gauge: 1 on `phase`, 0 on the others of
    /// `phases` (every phase's name).
    pub(crate) fn set_rotation_phase(&self, phase: &str, phases: &[&str]) {
        for &p in phases {
            self.root_rotation_phase
                .get_or_create(&PhaseLabels {
                    phase: p.to_string(),
                })
                .set(i64::from(p == phase));
        }
    }

    /// Counts a signing error of the given kind.
    pub(crate) fn sign_error(&self, kind: &str) {
        self.csr_sign_err_count
            .get_or_create(&SignErrorLabels {
                error: kind.to_string(),
            })
            .inc();
    }

    /// Counts a PodCertificateRequest answered with `result` for `reason`.
    pub(crate) fn pod_certificate_answered(&self, result: &str, reason: &str) {
        self.pod_certificate_requests
            .get_or_create(&PodCertificateLabels {
                result: result.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a round of attempts at a PodCertificateRequest that ended
    /// without an answer (it is tried again later).
    pub(crate) fn pod_certificate_error(&self, reason: &str) {
        self.pod_certificate_answered("GaveUp", reason);
    }

    /// Sets the expiry gauges from the root's and the chain's notAfter.
    pub(crate) fn set_expiry(
        &self,
        root_not_after: OffsetDateTime,
        chain_not_after: OffsetDateTime,
        now: OffsetDateTime,
    ) {
        let ts = |t: OffsetDateTime| t.unix_timestamp() as f64;
        self.root_cert_expiry_timestamp.set(ts(root_not_after));
        self.root_cert_expiry_seconds
            .set((root_not_after - now).as_seconds_f64());
        self.cert_chain_expiry_timestamp.set(ts(chain_not_after));
        self.cert_chain_expiry_seconds
            .set((chain_not_after - now).as_seconds_f64());
    }
}

/// Encodes a registry in the classic Prometheus text format.
pub(crate) fn encode_text(registry: &Registry) -> String {
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, registry).is_err() {
        return String::new();
    }
    // Drop the OpenMetrics terminator, which the classic format does not have.
    if let Some(stripped) = out.strip_suffix("# EOF\n") {
        out.truncate(stripped.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_keep_istio_names() {
        let m = Metrics::default();
        let r = m.register();
        m.csr_count.inc();
        m.csr_count.inc();
        m.sign_error("expired");
        let text = encode_text(&r);
        assert!(
            text.contains("# TYPE citadel_server_csr_count counter\n"),
            "{text}"
        );
        assert!(text.contains("\ncitadel_server_csr_count 2\n"), "{text}");
        assert!(
            text.contains("citadel_server_csr_sign_err_count{error=\"expired\"} 1\n"),
            "{text}"
        );
        assert!(!text.contains("_total"), "{text}");
        assert!(!text.contains("# EOF"));
    }
}
