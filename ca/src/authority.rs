//! The signing authority: the current CA material (swappable while serving)
//! and the lifetime rules, turned into signed chains.
//!
//! [`Authority::sign_workload`] is the whole signing path after
//! authentication and authorization, so benchmarks can call it directly.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use meshca_certs::profile::{ProfileError, SubjectKey, Validity};
use meshca_certs::{SpiffeId, TrustBundle};
use time::OffsetDateTime;

use crate::store::CaMaterial;

/// Why a certificate was not signed.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    /// The requested lifetime is above the maximum (`INVALID_ARGUMENT`).
    #[error("requested validity_duration {requested_secs}s is longer than the maximum {max_secs}s allowed by this CA")]
    TtlTooLong {
        /// What was asked.
        requested_secs: i64,
        /// The maximum.
        max_secs: u64,
    },
    /// The CA cannot sign now (`UNAVAILABLE`): its certificate is not yet
    /// valid, expired, or expires within the safety margin.
    #[error(
        "the CA cannot sign: its signing certificate is valid from {} until {}, and signing stops {margin_secs}s before it expires; the operator must renew or rotate the CA",
        meshca_certs::Rfc3339(*not_before),
        meshca_certs::Rfc3339(*not_after)
    )]
    CaOutsideValidity {
        /// CA notBefore.
        not_before: OffsetDateTime,
        /// CA notAfter.
        not_after: OffsetDateTime,
        /// The safety margin before notAfter, in seconds.
        margin_secs: i64,
    },
    /// Signing failed (`INTERNAL`).
    #[error("signing failed: {0}")]
    Signing(ProfileError),
}

impl From<ProfileError> for SignError {
    fn from(e: ProfileError) -> Self {
        Self::Signing(e)
    }
}

/// A signed certificate and its chain.
#[derive(Debug, Clone)]
pub struct IssuedChain {
    /// The answer's `cert_chain`: `[leaf, intermediates..., roots]`, one
    /// PEM certificate per element except the last, which holds every root
    /// of the trust bundle (the anchor first; see [`meshca_certs::answer`]).
    pub chain_pem: Vec<String>,
    /// The leaf's serial, hex.
    pub serial_hex: String,
    /// The leaf's notAfter.
    pub not_after: OffsetDateTime,
}

/// The CA material in use and what is derived from it once.
#[derive(Debug)]
pub(crate) struct SigningState {
    /// The material.
    pub(crate) material: CaMaterial,
    tail_pem: Vec<String>,
    /// When the signing certificate, or a certificate above it up to the
    /// anchoring root, expires first: no leaf outlives its chain.
    chain_not_after: OffsetDateTime,
}

impl SigningState {
    /// The signing certificate's validity, ending when its chain ends.
    fn usable_validity(&self) -> Validity {
        Validity {
            not_before: self.material.signing.validity().not_before,
            not_after: self.chain_not_after,
        }
    }
}

/// The signing authority.
#[derive(Debug)]
pub struct Authority {
    state: ArcSwap<SigningState>,
    ttl: TtlPolicy,
    expiry_margin: time::Duration,
    generation: tokio::sync::watch::Sender<u64>,
    refused: ArcSwapOption<String>,
}

impl Authority {
    /// An authority signing with `material` under the `ttl` rules.
    pub fn new(material: CaMaterial, ttl: TtlPolicy) -> Self {
        Self {
            state: ArcSwap::from_pointee(Self::state_for(material)),
            ttl,
            expiry_margin: time::Duration::ZERO,
            generation: tokio::sync::watch::Sender::new(0),
            refused: ArcSwapOption::empty(),
        }
    }

    /// Stops signing (and reports not ready) once the signing certificate
    /// expires within `margin`.
    pub(crate) fn with_expiry_margin(mut self, margin: Duration) -> Self {
        self.expiry_margin = to_time_duration(margin);
        self
    }

    /// A receiver that sees a new value each time the material is replaced.
    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// How many times the material was replaced so far. Read it before
    /// [`Authority::bundle`] to tag a result computed with that bundle: the
    /// new material is in place before the count moves.
    pub(crate) fn generation(&self) -> u64 {
        *self.generation.borrow()
    }

    /// Records that new material was offered and refused (`None`: the last
    /// offer was accepted). Shown by `/ready` and the metrics.
    pub(crate) fn set_refused(&self, reason: Option<String>) {
        self.refused.store(reason.map(Arc::new));
    }

    /// Why the last offered material was refused, if it was.
    pub(crate) fn refused(&self) -> Option<Arc<String>> {
        self.refused.load_full()
    }

    fn state_for(material: CaMaterial) -> SigningState {
        let tail_pem = material.response_tail_pem();
        let chain_not_after = material
            .chain
            .iter()
            .chain(std::iter::once(&material.anchor_root))
            .filter_map(|der| meshca_certs::inspect::CertSummary::from_der(der).ok())
            .map(|summary| summary.not_after)
            .fold(material.signing.validity().not_after, OffsetDateTime::min);
        SigningState {
            material,
            tail_pem,
            chain_not_after,
        }
    }

    /// Swaps in new CA material; requests in flight finish with the old.
    /// Subscribers are told.
    pub(crate) fn replace(&self, material: CaMaterial) {
        self.state.store(Arc::new(Self::state_for(material)));
        self.refused.store(None);
        self.generation.send_modify(|g| *g += 1);
    }

    /// The material in use now.
    pub(crate) fn current(&self) -> Arc<SigningState> {
        self.state.load_full()
    }

    /// Whether signing asks a key outside the process (an HSM in direct
    /// mode): such a call may wait for the key.
    pub(crate) fn signs_externally(&self) -> bool {
        self.state
            .load()
            .material
            .signing
            .key()
            .external_name()
            .is_some()
    }

    /// The trust bundle in use now.
    pub(crate) fn bundle(&self) -> TrustBundle {
        self.state.load().material.bundle.clone()
    }

    /// Whether the CA can sign at `now`: its certificate is inside its
    /// validity and does not expire within the safety margin.
    pub(crate) fn can_sign(&self, now: OffsetDateTime) -> bool {
        check_ca_validity(self.state.load().usable_validity(), now, self.expiry_margin).is_ok()
    }

    /// Why the CA cannot sign at `now`, if it cannot.
    pub(crate) fn cannot_sign_reason(&self, now: OffsetDateTime) -> Option<SignError> {
        check_ca_validity(self.state.load().usable_validity(), now, self.expiry_margin).err()
    }

    /// The lifetime to give a workload certificate that asked for
    /// `requested_secs` (0 or less: the default).
    pub(crate) fn workload_ttl(&self, requested_secs: i64) -> Result<Duration, SignError> {
        if requested_secs <= 0 {
            return Ok(self.ttl.default);
        }
        let requested = requested_secs as u64;
        if requested > self.ttl.max.as_secs() {
            return Err(SignError::TtlTooLong {
                requested_secs,
                max_secs: self.ttl.max.as_secs(),
            });
        }
        Ok(Duration::from_secs(requested))
    }

    /// Signs an X509-SVID for `identity` with `subject`'s key and returns
    /// the chain, ending with every root clients must trust now.
    /// notAfter is `now + ttl`, never past the CA's own notAfter.
    pub fn sign_workload(
        &self,
        subject: &SubjectKey,
        identity: &SpiffeId,
        requested_ttl_secs: i64,
        now: OffsetDateTime,
    ) -> Result<IssuedChain, SignError> {
        self.sign_workload_within(subject, identity, requested_ttl_secs, None, now)
    }

    /// [`Authority::sign_workload`], with the whole lifetime (notAfter −
    /// notBefore, backdating included) at most `max_lifetime` when given:
    /// a renewal by client certificate gets no longer a lifetime than the
    /// certificate it presented. The TTL is capped at `max_lifetime` before
    /// the backdate is derived from it, so notAfter is always after `now`.
    pub(crate) fn sign_workload_within(
        &self,
        subject: &SubjectKey,
        identity: &SpiffeId,
        requested_ttl_secs: i64,
        max_lifetime: Option<Duration>,
        now: OffsetDateTime,
    ) -> Result<IssuedChain, SignError> {
        let mut ttl = self.workload_ttl(requested_ttl_secs)?;
        // The TTL is capped before the backdate is derived from it: a
        // backdate taken from a longer requested TTL could exceed the whole
        // allowed lifetime and leave notAfter in the past.
        if let Some(max) = max_lifetime {
            ttl = ttl.min(max);
        }
        let state = self.state.load();
        let ca = &state.material.signing;
        let ca_validity = check_ca_validity(state.usable_validity(), now, self.expiry_margin)?;
        let mut validity =
            Validity::backdated(now, to_time_duration(ttl)).capped_at(ca_validity.not_after);
        if let Some(max) = max_lifetime {
            validity = validity.with_lifetime_at_most(to_time_duration(max));
        }
        let issued = ca.issue_workload(subject, identity, validity)?;
        let mut chain_pem = Vec::with_capacity(1 + state.tail_pem.len());
        chain_pem.push(issued.to_pem());
        chain_pem.extend(state.tail_pem.iter().cloned());
        Ok(IssuedChain {
            chain_pem,
            serial_hex: issued.serial_hex,
            not_after: issued.validity.not_after,
        })
    }

    /// Issues the server's own TLS certificate: returns the chain as DER,
    /// `[leaf, intermediates...]` (no root), and the leaf's notAfter.
    pub(crate) fn issue_server_cert(
        &self,
        subject: &SubjectKey,
        dns: &[String],
        ips: &[IpAddr],
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<(Vec<Vec<u8>>, OffsetDateTime), SignError> {
        let state = self.state.load();
        let ca = &state.material.signing;
        // No safety margin here: the server keeps a TLS identity while the
        // CA is still valid, so it can tell clients why it will not sign.
        let ca_validity = check_ca_validity(state.usable_validity(), now, time::Duration::ZERO)?;
        let validity =
            Validity::backdated(now, to_time_duration(ttl)).capped_at(ca_validity.not_after);
        let issued = ca.issue_server(subject, dns, ips, validity)?;
        let mut chain = vec![issued.der];
        chain.extend(state.material.chain.iter().cloned());
        Ok((chain, validity.not_after))
    }
}

/// The CA's validity `v`, if `now` is inside it and at least `margin`
/// before its end.
fn check_ca_validity(
    v: Validity,
    now: OffsetDateTime,
    margin: time::Duration,
) -> Result<Validity, SignError> {
    // Checked: the margin comes from a flag.
    let too_late = now.checked_add(margin).is_none_or(|end| end >= v.not_after);
    if now < v.not_before || too_late {
        return Err(SignError::CaOutsideValidity {
            not_before: v.not_before,
            not_after: v.not_after,
            margin_secs: margin.whole_seconds(),
        });
    }
    Ok(v)
}

fn to_time_duration(d: Duration) -> time::Duration {
    time::Duration::try_from(d).unwrap_or(time::Duration::MAX)
}

/// Default workload certificate lifetime.
pub(crate) const DEFAULT_WORKLOAD_TTL: Duration = Duration::from_secs(24 * 3600);
/// Default longest workload certificate lifetime (Istio's 90 days).
pub(crate) const DEFAULT_MAX_WORKLOAD_TTL: Duration = Duration::from_secs(90 * 24 * 3600);

/// Workload certificate lifetime rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlPolicy {
    /// Used when a request asks for 0 or less.
    pub(crate) default: Duration,
    /// Requests above this are refused.
    pub(crate) max: Duration,
}

impl Default for TtlPolicy {
    fn default() -> Self {
        Self {
            default: DEFAULT_WORKLOAD_TTL,
            max: DEFAULT_MAX_WORKLOAD_TTL,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::load_or_create_data_dir;
    use meshca_certs::keys::{KeyAlgorithm, PrivateKey};
    use x509_parser_check::parse_not_after;

    /// The test roots' lifetime.
    const ROOT_TTL: time::Duration = time::Duration::days(3650);

    mod x509_parser_check {
        pub(super) fn parse_not_after(pem_text: &str) -> i64 {
            let certs = meshca_certs::bundle::parse_certs_pem(pem_text).unwrap();
            let summary = meshca_certs::inspect::CertSummary::from_der(&certs[0]).unwrap();
            summary.not_after.unix_timestamp()
        }
    }

    fn authority(dir: &std::path::Path) -> Authority {
        let material = load_or_create_data_dir(
            dir,
            &Default::default(),
            ROOT_TTL,
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        Authority::new(material, TtlPolicy::default())
    }

    fn subject() -> SubjectKey {
        SubjectKey::of(&PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap()).unwrap()
    }

    fn id() -> SpiffeId {
        SpiffeId::parse("spiffe://cluster.local/ns/a/sa/b").unwrap()
    }

    #[test]
    fn ttl_rules() {
        let dir = tempfile::tempdir().unwrap();
        let a = authority(dir.path());
        let now = OffsetDateTime::now_utc();
        let issued = a.sign_workload(&subject(), &id(), 0, now).unwrap();
        let now_s = now.unix_timestamp();
        assert_eq!(issued.chain_pem.len(), 2);
        assert_eq!(parse_not_after(&issued.chain_pem[0]), now_s + 24 * 3600);
        let issued = a.sign_workload(&subject(), &id(), -5, now).unwrap();
        assert_eq!(parse_not_after(&issued.chain_pem[0]), now_s + 24 * 3600);
        let issued = a.sign_workload(&subject(), &id(), 3600, now).unwrap();
        assert_eq!(parse_not_after(&issued.chain_pem[0]), now_s + 3600);
        let max = 90 * 24 * 3600;
        assert!(a.sign_workload(&subject(), &id(), max, now).is_ok());
        assert!(matches!(
            a.sign_workload(&subject(), &id(), max + 1, now),
            Err(SignError::TtlTooLong { .. })
        ));
    }

    #[test]
    fn a_lifetime_limit_bounds_the_whole_window_and_short_ttls_are_backdated_less() {
        let dir = tempfile::tempdir().unwrap();
        let a = authority(dir.path());
        let now = OffsetDateTime::now_utc();
        let now_s = now.unix_timestamp();
        let lifetime = |pem: &str| {
            let der = meshca_certs::bundle::parse_certs_pem(pem).unwrap();
            let s = meshca_certs::inspect::CertSummary::from_der(&der[0]).unwrap();
            (s.not_after - s.not_before).whole_seconds()
        };
        // 90 days asked, a 1 h + 2 min certificate presented: 1 h + 2 min.
        let issued = a
            .sign_workload_within(
                &subject(),
                &id(),
                90 * 86_400,
                Some(Duration::from_secs(3720)),
                now,
            )
            .unwrap();
        assert_eq!(lifetime(&issued.chain_pem[0]), 3720);
        assert_eq!(parse_not_after(&issued.chain_pem[0]), now_s + 3600);
        // Above --max-workload-cert-ttl is refused whatever the limit.
        assert!(matches!(
            a.sign_workload_within(&subject(), &id(), 91 * 86_400, Some(Duration::MAX), now),
            Err(SignError::TtlTooLong { .. })
        ));
        // A 60 s certificate is backdated 6 s, so its half-life (where
        // ztunnel renews) is 27 s after issuance.
        let issued = a.sign_workload(&subject(), &id(), 60, now).unwrap();
        assert_eq!(lifetime(&issued.chain_pem[0]), 66);
    }

    #[test]
    fn renewing_a_short_lived_certificate_never_issues_an_expired_one() {
        let dir = tempfile::tempdir().unwrap();
        let a = authority(dir.path());
        let now = OffsetDateTime::now_utc();
        let now_s = now.unix_timestamp();
        let window = |pem: &str| {
            let der = meshca_certs::bundle::parse_certs_pem(pem).unwrap();
            let s = meshca_certs::inspect::CertSummary::from_der(&der[0]).unwrap();
            (s.not_before.unix_timestamp(), s.not_after.unix_timestamp())
        };
        // A 60 s SVID (66 s with its backdate) presented, the default TTL
        // (24 h) asked: the backdate comes from 66 s, not from 24 h.
        for requested in [0, 3600, 90 * 86_400] {
            let issued = a
                .sign_workload_within(
                    &subject(),
                    &id(),
                    requested,
                    Some(Duration::from_secs(66)),
                    now,
                )
                .unwrap();
            let (not_before, not_after) = window(&issued.chain_pem[0]);
            assert!(
                not_after > now_s,
                "requested {requested}: notAfter {not_after} <= now {now_s}"
            );
            assert!(
                not_before <= now_s,
                "requested {requested}: notBefore after now"
            );
            assert!(
                not_after - not_before <= 66,
                "requested {requested}: lifetime {}",
                not_after - not_before
            );
            assert_eq!(
                (not_before, not_after),
                (now_s - 6, now_s + 60),
                "requested {requested}"
            );
        }
    }

    #[test]
    fn not_after_is_capped_at_the_ca() {
        let dir = tempfile::tempdir().unwrap();
        let a = authority(dir.path());
        let ca_not_after = a.current().material.signing.validity().not_after;
        // Ten days before the CA expires, a 30-day certificate is capped.
        let now = ca_not_after - time::Duration::days(10);
        let issued = a.sign_workload(&subject(), &id(), 30 * 86400, now).unwrap();
        assert_eq!(
            parse_not_after(&issued.chain_pem[0]),
            ca_not_after.unix_timestamp()
        );
        // After it expires, nothing is signed.
        assert!(matches!(
            a.sign_workload(
                &subject(),
                &id(),
                0,
                ca_not_after + time::Duration::seconds(1)
            ),
            Err(SignError::CaOutsideValidity { .. })
        ));
        assert!(!a.can_sign(ca_not_after));
    }

    /// An intermediate that outlives its root: no leaf outlives the root
    /// either, and signing stops when the root ends.
    #[test]
    fn not_after_is_capped_at_the_root_when_the_root_ends_first() {
        use meshca_certs::profile::{self_signed_root, SigningCa, SubjectName};
        let now = OffsetDateTime::now_utc();
        let name = |cn: &str| SubjectName {
            common_name: Some(cn.into()),
            ..Default::default()
        };
        let root_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let root_cert = self_signed_root(
            &root_key,
            &name("Root"),
            Validity::backdated(now, time::Duration::days(2)),
        )
        .unwrap();
        let root = SigningCa::new(root_cert.der.clone(), root_key).unwrap();
        let int_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let long = Validity {
            not_before: now - time::Duration::hours(1),
            not_after: now + time::Duration::days(100),
        };
        let int_cert = root
            .issue_ca(&SubjectKey::of(&int_key).unwrap(), &name("Int"), None, long)
            .unwrap();
        let root_not_after = meshca_certs::inspect::CertSummary::from_der(&root_cert.der)
            .unwrap()
            .not_after;
        assert!(
            meshca_certs::inspect::CertSummary::from_der(&int_cert.der)
                .unwrap()
                .not_after
                > root_not_after,
            "the test needs an intermediate that outlives its root"
        );
        let material = CaMaterial {
            signing: SigningCa::new(int_cert.der.clone(), int_key).unwrap(),
            chain: vec![int_cert.der.clone()],
            anchor_root: root_cert.der.clone(),
            bundle: meshca_certs::verify::TrustBundle::new(vec![root_cert.der.clone()]),
            source: crate::store::CaSource::PluggedIn("/nonexistent".into()),
        };
        let a = Authority::new(material, TtlPolicy::default());
        let issued = a.sign_workload(&subject(), &id(), 72 * 3600, now).unwrap();
        assert_eq!(
            parse_not_after(&issued.chain_pem[0]),
            root_not_after.unix_timestamp()
        );
        assert!(!a.can_sign(root_not_after + time::Duration::seconds(1)));
    }

    #[test]
    fn extreme_lifetimes_and_margins_are_capped_not_a_panic() {
        // `--max-workload-cert-ttl 10000y` (now refused by the flag parser,
        // but the authority must not depend on that) and a request for as
        // long: the certificate ends with the CA, no worker panics.
        let dir = tempfile::tempdir().unwrap();
        let material = load_or_create_data_dir(
            dir.path(),
            &Default::default(),
            ROOT_TTL,
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        let huge = Duration::from_secs(10_000 * 31_557_600);
        let a = Authority::new(
            material,
            TtlPolicy {
                default: huge,
                max: Duration::MAX,
            },
        );
        let ca_not_after = a.current().material.signing.validity().not_after;
        let now = OffsetDateTime::now_utc();
        for requested in [0, 315_576_000_000, i64::MAX] {
            let issued = a.sign_workload(&subject(), &id(), requested, now).unwrap();
            assert_eq!(
                parse_not_after(&issued.chain_pem[0]),
                ca_not_after.unix_timestamp(),
                "requested {requested}"
            );
            let within = a
                .sign_workload_within(&subject(), &id(), requested, Some(Duration::MAX), now)
                .unwrap();
            assert_eq!(within.not_after, ca_not_after);
        }
        // A margin longer than time can count means "never sign", not a panic.
        let a = a.with_expiry_margin(Duration::MAX);
        assert!(matches!(
            a.sign_workload(&subject(), &id(), 0, now),
            Err(SignError::CaOutsideValidity { .. })
        ));
    }

    #[test]
    fn signing_stops_inside_the_expiry_margin() {
        let dir = tempfile::tempdir().unwrap();
        let a = authority(dir.path()).with_expiry_margin(Duration::from_secs(3600));
        let ca_not_after = a.current().material.signing.validity().not_after;
        let early = ca_not_after - time::Duration::hours(2);
        assert!(a.can_sign(early));
        assert!(a.sign_workload(&subject(), &id(), 600, early).is_ok());
        let late = ca_not_after - time::Duration::minutes(30);
        assert!(!a.can_sign(late));
        let err = a.sign_workload(&subject(), &id(), 600, late).unwrap_err();
        assert!(err.to_string().contains("3600s before it expires"), "{err}");
        assert!(a.cannot_sign_reason(late).is_some());
    }

    #[test]
    fn the_answer_ends_with_every_root_and_the_leaf_verifies_to_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut material = load_or_create_data_dir(
            dir.path(),
            &Default::default(),
            ROOT_TTL,
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        let anchor = material.anchor_root.clone();
        let (_, announced) = crate::store::generate_self_signed_root(
            &Default::default(),
            time::Duration::days(1),
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        // A bundle as in a rotation's announced phase, the new root first
        // in the bundle: the answer still puts the anchor first.
        material.bundle = TrustBundle::new(vec![announced.der.clone(), anchor.clone()]);
        let a = Authority::new(material, TtlPolicy::default());
        let issued = a
            .sign_workload(&subject(), &id(), 0, OffsetDateTime::now_utc())
            .unwrap();
        assert_eq!(issued.chain_pem.len(), 2, "[leaf, roots]");
        let answer = meshca_certs::answer::ChainAnswer::parse(&issued.chain_pem).unwrap();
        assert_eq!(answer.roots.roots(), &[anchor, announced.der]);
        meshca_certs::verify::verify_svid(
            &answer.presented_chain(),
            &answer.roots,
            std::time::SystemTime::now(),
            Some(&id()),
        )
        .unwrap();
    }

    #[test]
    fn replace_notifies_subscribers_and_clears_refusal() {
        let dir = tempfile::tempdir().unwrap();
        let a = authority(dir.path());
        let rx = a.subscribe();
        a.set_refused(Some("bad".into()));
        assert_eq!(a.refused().as_deref().map(String::as_str), Some("bad"));
        let other = tempfile::tempdir().unwrap();
        let material = load_or_create_data_dir(
            other.path(),
            &Default::default(),
            ROOT_TTL,
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        a.replace(material);
        assert!(rx.has_changed().unwrap());
        assert!(a.refused().is_none());
    }
}
