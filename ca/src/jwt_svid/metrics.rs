//! The JWT-SVID metrics on the CA's `/metrics` (docs/metrics.md): tokens
//! minted by result, key changes, and the signing key's age, read at
//! scrape time from the published keys (a key takes over at its time,
//! with no event to count).

use std::sync::Arc;

use arc_swap::ArcSwap;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::metrics::IstioCounter;

/// Label of `meshca_jwt_svid_mint_count`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct MintLabels {
    /// `issued`, or the gRPC status of the refusal in snake case
    /// (`permission_denied`, `resource_exhausted`, `invalid_argument`…).
    pub(crate) result: &'static str,
}

/// Label of `meshca_jwt_svid_key_change_count`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KeyChangeLabels {
    /// `published` (a new key in the bundles) or `retired` (a key left
    /// them).
    pub(crate) change: &'static str,
}

/// When each published key signs from (Unix seconds), shared with the
/// gauges that read it at scrape time.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyTimes(Arc<ArcSwap<Vec<i64>>>);

impl KeyTimes {
    fn set(&self, signs_from: Vec<i64>) {
        self.0.store(Arc::new(signs_from));
    }

    /// Seconds since the key that signs at `now` took over; none before
    /// the keys are loaded.
    fn signing_key_age(&self, now: i64) -> Option<i64> {
        self.0
            .load()
            .iter()
            .copied()
            .filter(|&from| from <= now)
            .max()
            .map(|from| now - from)
    }
}

/// `meshca_jwt_svid_signing_key_age_seconds`: computed when scraped.
#[derive(Debug, Clone, Default)]
struct SigningKeyAge(KeyTimes);

impl prometheus_client::metrics::TypedMetric for SigningKeyAge {
    const TYPE: MetricType = MetricType::Gauge;
}

impl EncodeMetric for SigningKeyAge {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        encoder.encode_gauge(&self.0.signing_key_age(now).unwrap_or(-1))
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Gauge
    }
}

/// `meshca_jwt_svid_keys_published`: the keys in the bundles.
#[derive(Debug, Clone, Default)]
struct KeysPublished(KeyTimes);

impl prometheus_client::metrics::TypedMetric for KeysPublished {
    const TYPE: MetricType = MetricType::Gauge;
}

impl EncodeMetric for KeysPublished {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_gauge(&(self.0 .0.load().len() as i64))
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Gauge
    }
}

/// The JWT-SVID metrics (clones share their values).
#[derive(Debug, Clone, Default)]
pub(crate) struct JwtSvidMetrics {
    /// MintJwtSvid answers, by result.
    mints: Family<MintLabels, IstioCounter>,
    /// Keys published and retired while serving.
    key_changes: Family<KeyChangeLabels, IstioCounter>,
    /// Failed rotation steps (the keys in use stay).
    rotation_failures: IstioCounter,
    /// The published keys' start times.
    keys: KeyTimes,
}

impl JwtSvidMetrics {
    /// Adds these metrics to `registry`.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "meshca_jwt_svid_mint_count",
            "MintJwtSvid answers, by result: issued, or the gRPC status of the refusal (permission_denied, resource_exhausted, invalid_argument, unauthenticated, unavailable, internal, failed_precondition); requests refused by the caller gate before the method are counted in citadel_server_authentication_failure_count only",
            self.mints.clone(),
        );
        registry.register(
            "meshca_jwt_svid_key_change_count",
            "JWT-SVID signing keys published in the bundles (change=published, one --max-jwt-svid-ttl before they sign) or retired from them (change=retired) while serving",
            self.key_changes.clone(),
        );
        registry.register(
            "meshca_jwt_svid_key_rotation_failed_count",
            "JWT-SVID key rotation steps that failed (writing the key file or the Secret); the keys in use stay and the step is retried in 60 s",
            self.rotation_failures.clone(),
        );
        registry.register(
            "meshca_jwt_svid_signing_key_age_seconds",
            "Seconds since the JWT-SVID signing key in use took over (-1 before the keys are loaded); above --jwt-key-rotation the rotation is stuck",
            SigningKeyAge(self.keys.clone()),
        );
        registry.register(
            "meshca_jwt_svid_keys_published",
            "JWT-SVID keys in the bundles and the OIDC JWKS: the signing one, the next one once announced, a retired one until its tokens expired",
            KeysPublished(self.keys.clone()),
        );
    }

    /// Counts a MintJwtSvid answer.
    pub(crate) fn minted(&self, result: Result<(), tonic::Code>) {
        let result = match result {
            Ok(()) => "issued",
            Err(code) => code_name(code),
        };
        self.mints.get_or_create(&MintLabels { result }).inc();
    }

    /// Records the keys now published, counting the change from `before`
    /// (`None`: the first load, not a change).
    pub(crate) fn keys_changed(&self, before: Option<&[(String, i64)]>, after: &[(String, i64)]) {
        if let Some(before) = before {
            let published = after
                .iter()
                .filter(|(kid, _)| !before.iter().any(|(b, _)| b == kid))
                .count();
            let retired = before
                .iter()
                .filter(|(kid, _)| !after.iter().any(|(a, _)| a == kid))
                .count();
            for (change, n) in [("published", published), ("retired", retired)] {
                let counter = self.key_changes.get_or_create(&KeyChangeLabels { change });
                for _ in 0..n {
                    counter.inc();
                }
            }
        }
        self.keys.set(after.iter().map(|(_, from)| *from).collect());
    }

    /// Counts a failed rotation step.
    pub(crate) fn rotation_failed(&self) {
        self.rotation_failures.inc();
    }
}

/// A gRPC code in snake case, as the `result` label spells it.
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_key_changes_and_the_signing_key_age_are_exposed() {
        let m = JwtSvidMetrics::default();
        let mut registry = Registry::default();
        m.register(&mut registry);
        let text = crate::metrics::encode_text(&registry);
        assert!(
            text.contains("\nmeshca_jwt_svid_signing_key_age_seconds -1\n"),
            "{text}"
        );
        m.minted(Ok(()));
        m.minted(Ok(()));
        m.minted(Err(tonic::Code::PermissionDenied));
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let first = vec![("a".to_string(), now - 100)];
        m.keys_changed(None, &first);
        let next = vec![("a".to_string(), now - 100), ("b".to_string(), now + 3600)];
        m.keys_changed(Some(&first), &next);
        m.keys_changed(Some(&next), &next[1..]);
        m.rotation_failed();
        let text = crate::metrics::encode_text(&registry);
        for line in [
            "meshca_jwt_svid_mint_count{result=\"issued\"} 2\n",
            "meshca_jwt_svid_mint_count{result=\"permission_denied\"} 1\n",
            "meshca_jwt_svid_key_change_count{change=\"published\"} 1\n",
            "meshca_jwt_svid_key_change_count{change=\"retired\"} 1\n",
            "\nmeshca_jwt_svid_key_rotation_failed_count 1\n",
            "\nmeshca_jwt_svid_keys_published 1\n",
            "# TYPE meshca_jwt_svid_mint_count counter\n",
        ] {
            assert!(text.contains(line), "{line:?} in\n{text}");
        }
        // Only b is left, and it signs from an hour ahead: no key signs
        // yet, so no age.
        assert_eq!(m.keys.signing_key_age(now), None);
        m.keys_changed(Some(&next[1..]), &first);
        let age = m.keys.signing_key_age(now).unwrap();
        assert_eq!(age, 100);
    }
}
