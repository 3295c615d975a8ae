//! The self-signed root kept in the Secret `istio-ca-secret` (docs/cluster.md,
//! "The root, the bundle, the leader"), and its rotation as a state machine over that
//! Secret.
//!
//! The Secret is the single source of truth: every replica signs with what
//! it holds, and the only writer is the leader (rotation) or whoever wins
//! the create race at first start. Every write is a compare-and-swap on the
//! Secret's `resourceVersion`, so two writers can never both succeed.
//!
//! Data keys (Istio's, plus two for a rotation in progress):
//! - `ca-cert.pem`, `ca-key.pem`: the root that signs now;
//! - `root-cert.pem`: the trust bundle, every root clients must trust
//!   (two during a rotation);
//! - `next-ca-cert.pem`, `next-ca-key.pem`: the new root while it is being
//!   announced (published, not yet signing).
//!
//! Rotation phases ([`RotationPhase`], annotation
//! `meshca.io/root-rotation-phase`):
//! 1. `stable`: one root, signing, alone in the bundle.
//! 2. `announced`: a new root (new key) is in the bundle beside the old;
//!    the old still signs, for `--root-rotation-grace`, so every client
//!    picks up the bundle before any leaf chains to the new root. Clients
//!    that learn roots only from their answers (every answer ends with the
//!    whole bundle) pick it up when they renew, so the default grace is
//!    longer than a default certificate's renewal interval
//!    ([`safe_rotation_grace`]).
//! 3. `switched`: the new root signs; the old stays in the bundle until the
//!    last leaf it signed has expired (`meshca.io/retire-previous-root-after`:
//!    switch time + the longest workload lifetime + the grace period, never
//!    past the old root's own notAfter).
//! 4. back to `stable` with only the new root in the bundle.
//!
//! A rotation starts when the root has lived `--root-rotation-at` of its
//! lifetime, or at once when an operator sets the annotation
//! `meshca.io/rotate-root` on the Secret (`kubectl annotate secret
//! istio-ca-secret meshca.io/rotate-root=now`).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use meshca_certs::bundle::{encode_cert_pem, encode_certs_pem, parse_certs_pem};
use meshca_certs::inspect::CertSummary;
use meshca_certs::keys::PrivateKey;
use meshca_certs::profile::SigningCa;
use meshca_certs::verify::verify_ca_chain;
use meshca_certs::{TrustBundle, TrustDomain};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::store::{generate_self_signed_root, CaMaterial, CaSource, StoreError};

/// Name of the Secret holding the self-signed root (Istio's).
pub(crate) const SECRET_NAME: &str = "istio-ca-secret";
/// Type of that Secret (Istio's).
pub(crate) const SECRET_TYPE: &str = "istio.io/ca-root";
/// Key of the signing root certificate.
pub(crate) const CA_CERT_KEY: &str = "ca-cert.pem";
/// Key of the signing root's private key.
pub(crate) const CA_KEY_KEY: &str = "ca-key.pem";
/// Key of the trust bundle.
pub(crate) const ROOT_CERT_KEY: &str = "root-cert.pem";
/// Key of the announced (not yet signing) root certificate.
pub(crate) const NEXT_CA_CERT_KEY: &str = "next-ca-cert.pem";
/// Key of the announced root's private key.
pub(crate) const NEXT_CA_KEY_KEY: &str = "next-ca-key.pem";
/// Annotation holding the rotation phase.
pub(crate) const PHASE_ANNOTATION: &str = "meshca.io/root-rotation-phase";
/// Annotation holding when the phase began (RFC 3339).
pub(crate) const PHASE_SINCE_ANNOTATION: &str = "meshca.io/root-rotation-since";
/// Annotation holding when the previous root may leave the bundle (RFC 3339).
pub(crate) const RETIRE_AFTER_ANNOTATION: &str = "meshca.io/retire-previous-root-after";
/// Annotation an operator sets to ask for a rotation now.
pub(crate) const ROTATE_ANNOTATION: &str = "meshca.io/rotate-root";

/// Why the Secret could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RootSecretError {
    /// A data key is missing or malformed.
    #[error("Secret {namespace}/{SECRET_NAME}: {key}: {reason}")]
    Malformed {
        /// The Secret's namespace.
        namespace: String,
        /// The data key.
        key: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The certificate and key do not make a CA that can sign.
    #[error("Secret {namespace}/{SECRET_NAME}: {reason}")]
    Unusable {
        /// The Secret's namespace.
        namespace: String,
        /// What is wrong.
        reason: String,
    },
    /// A new root could not be made.
    #[error(transparent)]
    Generate(#[from] StoreError),
}

/// Where a root rotation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RotationPhase {
    /// One root, signing, alone in the bundle.
    Stable,
    /// A new root is in the bundle; the old one still signs.
    Announced,
    /// The new root signs; the old one is still in the bundle.
    Switched,
}

impl RotationPhase {
    /// Every phase, in order.
    pub(crate) const ALL: [RotationPhase; 3] = [Self::Stable, Self::Announced, Self::Switched];

    /// The name used in the annotation and the metric label.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Stable => "stable",
            Self::Announced => "announced",
            Self::Switched => "switched",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == text)
    }
}

/// What is added to the longest renewal interval of a default-lifetime
/// certificate to make the announced phase: time for renewals that are
/// jittered, retried after a failure or held up by a slow bundle ConfigMap.
pub(crate) const ROTATION_GRACE_MARGIN: Duration = Duration::from_secs(3600);

/// The shortest announced phase that a client learning roots only when it
/// renews survives: half of the default workload lifetime (Istio's agents
/// and ztunnel renew at half of it) plus [`ROTATION_GRACE_MARGIN`]. Every
/// such client then renews, and learns the new root, before any leaf
/// chains to it. The default of `--root-rotation-grace` (13 h for 24 h).
pub(crate) fn safe_rotation_grace(default_leaf_ttl: Duration) -> Duration {
    default_leaf_ttl / 2 + ROTATION_GRACE_MARGIN
}

/// When and how the root rotates.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RotationPolicy {
    /// Lifetime of a new root.
    pub(crate) root_ttl: Duration,
    /// Fraction of the root's life after which it rotates.
    pub(crate) rotate_at: f64,
    /// Time both roots are published before signing switches.
    pub(crate) grace: Duration,
    /// Longest lifetime of a leaf the CA signs.
    pub(crate) max_leaf_ttl: Duration,
}

impl RotationPolicy {
    /// Why a rotation under this policy would break clients, one sentence
    /// per problem (empty: none). `default_leaf_ttl` is what a request
    /// asking for no lifetime gets; `expiry_margin` is how long before its
    /// end a root stops signing.
    pub(crate) fn unsafe_because(
        &self,
        default_leaf_ttl: Duration,
        expiry_margin: Duration,
    ) -> Vec<String> {
        let mut problems = Vec::new();
        let needed = safe_rotation_grace(default_leaf_ttl);
        if self.grace < needed {
            problems.push(format!(
                "--root-rotation-grace {} is shorter than half of --workload-cert-ttl {} plus {}: \
                 a client that learns roots only when it renews (Istio's agents and ztunnel renew at half \
                 the lifetime) may not renew while the new root is announced, and after the switch it \
                 cannot verify peers holding new certificates until it does; use at least {}",
                humantime::format_duration(self.grace),
                humantime::format_duration(default_leaf_ttl),
                humantime::format_duration(ROTATION_GRACE_MARGIN),
                humantime::format_duration(needed),
            ));
        }
        let left = self
            .root_ttl
            .mul_f64((1.0 - self.rotate_at).clamp(0.0, 1.0));
        if left < self.grace + expiry_margin {
            problems.push(format!(
                "a root lives --self-signed-root-ttl {} and rotates at --root-rotation-at {}, which leaves \
                 {}: less than --root-rotation-grace {} plus --ca-expiry-margin {}, so the old root stops \
                 signing before the new one takes over",
                humantime::format_duration(self.root_ttl),
                self.rotate_at,
                humantime::format_duration(Duration::from_secs(left.as_secs())),
                humantime::format_duration(self.grace),
                humantime::format_duration(expiry_margin),
            ));
        }
        problems
    }
}

/// A root (certificate DER and private key PEM).
#[derive(Clone)]
pub(crate) struct RootKeyPair {
    /// The certificate, DER.
    pub(crate) cert: Vec<u8>,
    /// The private key, PKCS#8 PEM.
    pub(crate) key_pem: String,
}

impl std::fmt::Debug for RootKeyPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("RootKeyPair")
            .field("cert_len", &self.cert.len())
            .finish_non_exhaustive()
    }
}

impl RootKeyPair {
    /// A new self-signed root.
    pub(crate) fn generate(
        trust_domain: &TrustDomain,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Self, StoreError> {
        let ttl = time::Duration::try_from(ttl).unwrap_or(time::Duration::days(3650));
        let (key, root) = generate_self_signed_root(trust_domain, ttl, now)?;
        Ok(Self {
            cert: root.der,
            key_pem: key.to_pkcs8_pem(),
        })
    }
}

/// The content of `istio-ca-secret`.
#[derive(Debug, Clone)]
pub(crate) struct RootSecret {
    /// The root that signs now.
    pub(crate) signing: RootKeyPair,
    /// Every root clients must trust (DER), signing root included.
    pub(crate) bundle: Vec<Vec<u8>>,
    /// The announced root, during [`RotationPhase::Announced`].
    pub(crate) next: Option<RootKeyPair>,
    /// The rotation phase.
    pub(crate) phase: RotationPhase,
    /// When the phase began.
    pub(crate) phase_since: Option<OffsetDateTime>,
    /// When the previous root may leave the bundle ([`RotationPhase::Switched`]).
    pub(crate) retire_after: Option<OffsetDateTime>,
    /// An operator asked for a rotation.
    pub(crate) rotation_requested: bool,
}

/// What the leader should do next to a [`RootSecret`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RotationStep {
    /// Make a new root and publish it beside the old one.
    Announce,
    /// Sign with the announced root.
    Switch,
    /// Drop the previous root from the bundle.
    Retire,
}

impl RootSecret {
    /// A fresh secret around a new root.
    pub(crate) fn new(signing: RootKeyPair) -> Self {
        Self {
            bundle: vec![signing.cert.clone()],
            signing,
            next: None,
            phase: RotationPhase::Stable,
            phase_since: None,
            retire_after: None,
            rotation_requested: false,
        }
    }

    /// Reads the Secret's data and annotations.
    pub(crate) fn from_secret(secret: &Secret, namespace: &str) -> Result<Self, RootSecretError> {
        let malformed = |key: &'static str, reason: String| RootSecretError::Malformed {
            namespace: namespace.to_string(),
            key,
            reason,
        };
        let empty = BTreeMap::new();
        let data = secret.data.as_ref().unwrap_or(&empty);
        let text = |key: &'static str| -> Result<Option<String>, RootSecretError> {
            match data.get(key) {
                None => Ok(None),
                Some(b) if b.0.is_empty() => Ok(None),
                Some(b) => String::from_utf8(b.0.clone())
                    .map(Some)
                    .map_err(|_| malformed(key, "not UTF-8 text".into())),
            }
        };
        let first_cert = |key: &'static str, pem: &str| -> Result<Vec<u8>, RootSecretError> {
            parse_certs_pem(pem)
                .map_err(|e| malformed(key, e.to_string()))?
                .into_iter()
                .next()
                .ok_or_else(|| malformed(key, "no certificate".into()))
        };
        let cert_pem =
            text(CA_CERT_KEY)?.ok_or_else(|| malformed(CA_CERT_KEY, "missing".into()))?;
        let key_pem = text(CA_KEY_KEY)?.ok_or_else(|| malformed(CA_KEY_KEY, "missing".into()))?;
        let signing = RootKeyPair {
            cert: first_cert(CA_CERT_KEY, &cert_pem)?,
            key_pem,
        };
        let mut bundle = match text(ROOT_CERT_KEY)? {
            Some(pem) => {
                parse_certs_pem(&pem).map_err(|e| malformed(ROOT_CERT_KEY, e.to_string()))?
            }
            None => Vec::new(),
        };
        if !bundle.contains(&signing.cert) {
            bundle.insert(0, signing.cert.clone());
        }
        let next = match (text(NEXT_CA_CERT_KEY)?, text(NEXT_CA_KEY_KEY)?) {
            (Some(cert), Some(key_pem)) => Some(RootKeyPair {
                cert: first_cert(NEXT_CA_CERT_KEY, &cert)?,
                key_pem,
            }),
            _ => None,
        };
        let annotations = secret.metadata.annotations.as_ref();
        let annotation = |key: &str| annotations.and_then(|a| a.get(key)).map(String::as_str);
        let time_of =
            |key: &str| annotation(key).and_then(|t| OffsetDateTime::parse(t, &Rfc3339).ok());
        let mut phase = annotation(PHASE_ANNOTATION)
            .and_then(RotationPhase::parse)
            .unwrap_or(RotationPhase::Stable);
        if phase == RotationPhase::Announced && next.is_none() {
            // An announced phase without the new root cannot go on.
            phase = RotationPhase::Stable;
        }
        Ok(Self {
            signing,
            bundle,
            next,
            phase,
            phase_since: time_of(PHASE_SINCE_ANNOTATION),
            retire_after: time_of(RETIRE_AFTER_ANNOTATION),
            rotation_requested: annotation(ROTATE_ANNOTATION).is_some(),
        })
    }

    /// Writes the content into a Secret, keeping `base`'s other metadata
    /// (labels, foreign annotations, resourceVersion for the compare-and-swap).
    pub(crate) fn to_secret(&self, namespace: &str, base: Option<&Secret>) -> Secret {
        let mut metadata = base
            .map(|s| s.metadata.clone())
            .unwrap_or_else(|| ObjectMeta {
                name: Some(SECRET_NAME.to_string()),
                namespace: Some(namespace.to_string()),
                ..Default::default()
            });
        metadata.managed_fields = None;
        let annotations = metadata.annotations.get_or_insert_with(BTreeMap::new);
        for key in [
            PHASE_ANNOTATION,
            PHASE_SINCE_ANNOTATION,
            RETIRE_AFTER_ANNOTATION,
            ROTATE_ANNOTATION,
        ] {
            annotations.remove(key);
        }
        annotations.insert(PHASE_ANNOTATION.into(), self.phase.name().into());
        if let Some(t) = self.phase_since.and_then(|t| t.format(&Rfc3339).ok()) {
            annotations.insert(PHASE_SINCE_ANNOTATION.into(), t);
        }
        if let Some(t) = self.retire_after.and_then(|t| t.format(&Rfc3339).ok()) {
            annotations.insert(RETIRE_AFTER_ANNOTATION.into(), t);
        }
        if self.rotation_requested {
            annotations.insert(ROTATE_ANNOTATION.into(), "requested".into());
        }
        let mut data = BTreeMap::new();
        let bytes = |s: String| ByteString(s.into_bytes());
        data.insert(
            CA_CERT_KEY.into(),
            bytes(encode_cert_pem(&self.signing.cert)),
        );
        data.insert(CA_KEY_KEY.into(), bytes(self.signing.key_pem.clone()));
        data.insert(ROOT_CERT_KEY.into(), bytes(encode_certs_pem(&self.bundle)));
        if let Some(next) = &self.next {
            data.insert(NEXT_CA_CERT_KEY.into(), bytes(encode_cert_pem(&next.cert)));
            data.insert(NEXT_CA_KEY_KEY.into(), bytes(next.key_pem.clone()));
        }
        Secret {
            metadata,
            type_: Some(SECRET_TYPE.to_string()),
            data: Some(data),
            ..Default::default()
        }
    }

    /// The CA material to sign with: the signing root, checked (key matches,
    /// CA bits, inside its validity), and the bundle.
    pub(crate) fn material(
        &self,
        namespace: &str,
        now: OffsetDateTime,
    ) -> Result<CaMaterial, RootSecretError> {
        let unusable = |reason: String| RootSecretError::Unusable {
            namespace: namespace.to_string(),
            reason,
        };
        let key = PrivateKey::from_pem(&self.signing.key_pem)
            .map_err(|e| unusable(format!("{CA_KEY_KEY}: {e}")))?;
        let signing = SigningCa::new(self.signing.cert.clone(), key)
            .map_err(|e| unusable(format!("{CA_CERT_KEY} and {CA_KEY_KEY}: {e}")))?;
        let bundle = TrustBundle::new(self.bundle.clone());
        verify_ca_chain(std::slice::from_ref(&self.signing.cert), &bundle, now)
            .map_err(|e| unusable(format!("{CA_CERT_KEY}: {e}")))?;
        Ok(CaMaterial {
            signing,
            chain: Vec::new(),
            anchor_root: self.signing.cert.clone(),
            bundle,
            source: CaSource::Secret {
                namespace: namespace.to_string(),
                name: SECRET_NAME.to_string(),
            },
        })
    }

    /// The next rotation step due at `now`, if any.
    pub(crate) fn due_step(
        &self,
        policy: &RotationPolicy,
        now: OffsetDateTime,
    ) -> Option<RotationStep> {
        match self.phase {
            RotationPhase::Stable => {
                if self.rotation_requested || now >= self.rotation_due(policy) {
                    Some(RotationStep::Announce)
                } else {
                    None
                }
            }
            RotationPhase::Announced => {
                let since = self.phase_since.unwrap_or(now);
                (now >= since + to_time(policy.grace)).then_some(RotationStep::Switch)
            }
            RotationPhase::Switched => {
                let retire = self.retire_after.unwrap_or(now);
                (now >= retire).then_some(RotationStep::Retire)
            }
        }
    }

    /// When the next step is due (for sleeping until then).
    pub(crate) fn next_step_at(
        &self,
        policy: &RotationPolicy,
        now: OffsetDateTime,
    ) -> OffsetDateTime {
        match self.phase {
            RotationPhase::Stable if self.rotation_requested => now,
            RotationPhase::Stable => self.rotation_due(policy),
            RotationPhase::Announced => self.phase_since.unwrap_or(now) + to_time(policy.grace),
            RotationPhase::Switched => self.retire_after.unwrap_or(now),
        }
    }

    /// When the signing root has lived `rotate_at` of its life.
    fn rotation_due(&self, policy: &RotationPolicy) -> OffsetDateTime {
        match CertSummary::from_der(&self.signing.cert) {
            Ok(s) => {
                let life = s.not_after - s.not_before;
                s.not_before + life * policy.rotate_at
            }
            Err(_) => OffsetDateTime::UNIX_EPOCH,
        }
    }

    /// The Secret after `step`. `Announce` takes the new root.
    pub(crate) fn after(
        &self,
        step: RotationStep,
        new_root: Option<RootKeyPair>,
        policy: &RotationPolicy,
        now: OffsetDateTime,
    ) -> Self {
        let mut next = self.clone();
        match (step, new_root) {
            (RotationStep::Announce, Some(root)) => {
                next.bundle = vec![self.signing.cert.clone(), root.cert.clone()];
                next.next = Some(root);
                next.phase = RotationPhase::Announced;
                next.phase_since = Some(now);
                next.retire_after = None;
                next.rotation_requested = false;
            }
            (RotationStep::Announce, None) => {}
            (RotationStep::Switch, _) => {
                let Some(new) = self.next.clone() else {
                    return next;
                };
                let old_not_after = CertSummary::from_der(&self.signing.cert)
                    .map(|s| s.not_after)
                    .unwrap_or(now);
                // Checked: both durations come from flags.
                let retire = now
                    .checked_add(to_time(policy.max_leaf_ttl))
                    .and_then(|t| t.checked_add(to_time(policy.grace)))
                    .map_or(old_not_after.max(now), |t| t.min(old_not_after.max(now)));
                next.bundle = vec![new.cert.clone(), self.signing.cert.clone()];
                next.signing = new;
                next.next = None;
                next.phase = RotationPhase::Switched;
                next.phase_since = Some(now);
                next.retire_after = Some(retire);
            }
            (RotationStep::Retire, _) => {
                next.bundle = vec![self.signing.cert.clone()];
                next.phase = RotationPhase::Stable;
                next.phase_since = Some(now);
                next.retire_after = None;
            }
        }
        next
    }
}

fn to_time(d: Duration) -> time::Duration {
    time::Duration::try_from(d).unwrap_or(time::Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RotationPolicy {
        RotationPolicy {
            root_ttl: Duration::from_secs(1000),
            rotate_at: 0.5,
            grace: Duration::from_secs(10),
            max_leaf_ttl: Duration::from_secs(60),
        }
    }

    fn root(now: OffsetDateTime) -> RootKeyPair {
        RootKeyPair::generate(&TrustDomain::default(), Duration::from_secs(1000), now).unwrap()
    }

    #[test]
    fn secret_round_trip_keeps_everything() {
        let now = OffsetDateTime::now_utc();
        let mut s = RootSecret::new(root(now));
        s = s.after(RotationStep::Announce, Some(root(now)), &policy(), now);
        let secret = s.to_secret("istio-system", None);
        assert_eq!(secret.type_.as_deref(), Some(SECRET_TYPE));
        let back = RootSecret::from_secret(&secret, "istio-system").unwrap();
        assert_eq!(back.signing.cert, s.signing.cert);
        assert_eq!(back.bundle, s.bundle);
        assert_eq!(back.phase, RotationPhase::Announced);
        assert_eq!(
            back.next.as_ref().unwrap().cert,
            s.next.as_ref().unwrap().cert
        );
        assert_eq!(
            back.phase_since.unwrap().unix_timestamp(),
            now.unix_timestamp()
        );
        assert!(back.material("istio-system", now).is_ok());
    }

    #[test]
    fn phases_follow_the_policy() {
        let t0 = OffsetDateTime::now_utc();
        let p = policy();
        let s = RootSecret::new(root(t0));
        // Backdated by 2 minutes: due at notBefore + 500 s.
        assert_eq!(s.due_step(&p, t0), None);
        let due = s.next_step_at(&p, t0);
        assert!(due > t0 + time::Duration::seconds(300));
        assert_eq!(s.due_step(&p, due), Some(RotationStep::Announce));

        let t1 = due;
        let new = root(t1);
        let announced = s.after(RotationStep::Announce, Some(new.clone()), &p, t1);
        assert_eq!(announced.bundle.len(), 2);
        assert_eq!(
            announced.signing.cert, s.signing.cert,
            "the old root still signs"
        );
        assert_eq!(
            announced.due_step(&p, t1 + time::Duration::seconds(9)),
            None
        );
        let t2 = t1 + time::Duration::seconds(10);
        assert_eq!(announced.due_step(&p, t2), Some(RotationStep::Switch));

        let switched = announced.after(RotationStep::Switch, None, &p, t2);
        assert_eq!(switched.signing.cert, new.cert);
        assert_eq!(
            switched.bundle,
            vec![new.cert.clone(), s.signing.cert.clone()]
        );
        assert_eq!(
            switched.retire_after,
            Some(t2 + time::Duration::seconds(70))
        );
        assert_eq!(
            switched.due_step(&p, t2 + time::Duration::seconds(69)),
            None
        );
        let t3 = t2 + time::Duration::seconds(70);
        assert_eq!(switched.due_step(&p, t3), Some(RotationStep::Retire));

        let stable = switched.after(RotationStep::Retire, None, &p, t3);
        assert_eq!(stable.bundle, vec![new.cert]);
        assert_eq!(stable.phase, RotationPhase::Stable);
        assert_eq!(stable.due_step(&p, t3), None);
    }

    /// The roots of the last element a replica answers with in this state
    /// of the Secret, after a round trip through the Secret as a follower
    /// reads it.
    fn answered_roots(s: &RootSecret, now: OffsetDateTime) -> Vec<Vec<u8>> {
        let read = RootSecret::from_secret(&s.to_secret("ns", None), "ns").unwrap();
        let tail = read.material("ns", now).unwrap().response_tail_pem();
        assert_eq!(tail.len(), 1, "a self-signed root: the roots element alone");
        parse_certs_pem(&tail[0]).unwrap()
    }

    #[test]
    fn every_phase_answers_every_root_of_the_bundle_signing_root_first() {
        let t0 = OffsetDateTime::now_utc();
        let p = policy();
        let (old, new) = (root(t0), root(t0));
        let stable = RootSecret::new(old.clone());
        assert_eq!(answered_roots(&stable, t0), vec![old.cert.clone()]);
        let announced = stable.after(RotationStep::Announce, Some(new.clone()), &p, t0);
        assert_eq!(
            answered_roots(&announced, t0),
            vec![old.cert.clone(), new.cert.clone()]
        );
        let switched = announced.after(RotationStep::Switch, None, &p, t0);
        assert_eq!(
            answered_roots(&switched, t0),
            vec![new.cert.clone(), old.cert.clone()]
        );
        let retired = switched.after(RotationStep::Retire, None, &p, t0);
        assert_eq!(answered_roots(&retired, t0), vec![new.cert]);
    }

    #[test]
    fn the_default_grace_outlasts_a_default_renewal_and_short_ones_are_named() {
        let day = Duration::from_secs(86_400);
        let grace = safe_rotation_grace(day);
        assert_eq!(grace, Duration::from_secs(13 * 3600));
        let safe = RotationPolicy {
            root_ttl: Duration::from_secs(3650 * 86_400),
            rotate_at: 0.8,
            grace,
            max_leaf_ttl: 90 * day,
        };
        assert!(safe
            .unsafe_because(day, Duration::from_secs(600))
            .is_empty());
        // The old default, 1 h, is shorter than a 24 h certificate's renewal.
        let short = RotationPolicy {
            grace: Duration::from_secs(3600),
            ..safe
        };
        let problems = short.unsafe_because(day, Duration::from_secs(600));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("--root-rotation-grace 1h") && problems[0].contains("13h"),
            "{}",
            problems[0]
        );
        // A root that rotates too late to announce for the grace period.
        let late = RotationPolicy {
            root_ttl: 10 * day,
            rotate_at: 0.99,
            ..safe
        };
        let problems = late.unsafe_because(day, Duration::from_secs(600));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("--root-rotation-at 0.99"),
            "{}",
            problems[0]
        );
    }

    #[test]
    fn operator_request_starts_a_rotation_at_once() {
        let now = OffsetDateTime::now_utc();
        let mut secret = RootSecret::new(root(now)).to_secret("ns", None);
        secret
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(ROTATE_ANNOTATION.into(), "now".into());
        let s = RootSecret::from_secret(&secret, "ns").unwrap();
        assert_eq!(s.due_step(&policy(), now), Some(RotationStep::Announce));
        let announced = s.after(RotationStep::Announce, Some(root(now)), &policy(), now);
        assert!(!announced.rotation_requested);
        let written = announced.to_secret("ns", Some(&secret));
        assert!(!written
            .metadata
            .annotations
            .unwrap()
            .contains_key(ROTATE_ANNOTATION));
    }

    #[test]
    fn retiring_never_waits_past_the_old_roots_end() {
        let t0 = OffsetDateTime::now_utc();
        let mut p = policy();
        p.max_leaf_ttl = Duration::from_secs(100_000);
        let s = RootSecret::new(root(t0));
        let announced = s.after(RotationStep::Announce, Some(root(t0)), &p, t0);
        let switched = announced.after(RotationStep::Switch, None, &p, t0);
        let old_end = CertSummary::from_der(&s.signing.cert).unwrap().not_after;
        assert_eq!(switched.retire_after, Some(old_end));
    }

    #[test]
    fn malformed_secrets_name_the_key() {
        let now = OffsetDateTime::now_utc();
        let mut secret = RootSecret::new(root(now)).to_secret("ns", None);
        let data = secret.data.as_mut().unwrap();
        data.remove(CA_KEY_KEY);
        let err = RootSecret::from_secret(&secret, "ns")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ca-key.pem") && err.contains("missing"),
            "{err}"
        );
        let data = secret.data.as_mut().unwrap();
        data.insert(CA_KEY_KEY.into(), ByteString(b"garbage".to_vec()));
        let s = RootSecret::from_secret(&secret, "ns").unwrap();
        let err = s.material("ns", now).unwrap_err().to_string();
        assert!(err.contains("ca-key.pem"), "{err}");
        assert!(!err.contains("garbage"));
    }
}
