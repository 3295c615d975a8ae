//! meshca in a cluster (docs/cluster.md): state in
//! Kubernetes objects, coordination through the Kubernetes API only.
//!
//! - `root_secret`: the self-signed root in the Secret `istio-ca-secret`,
//!   created with create-if-absent semantics so replicas agree on one root,
//!   and its rotation phases.
//! - `leader`: a Lease; only the leader publishes the bundle and rotates.
//! - `bundle_publisher`: the ConfigMap `istio-ca-root-cert` in every namespace.
//! - `pod_certificates`: with `--pod-certificate-signer`, the leader signs
//!   Kubernetes `PodCertificateRequest`s of that signer, and
//!   `cluster_trust_bundle` publishes the roots as its `ClusterTrustBundle`.
//! - `remote`: remote clusters (Istio's remote secrets, `--remote-cluster`),
//!   each caller authenticated against its own cluster.
//!
//! Every replica follows the Secret (`follow_root_secret`) and signs with
//! what it holds; the leader moves a rotation forward (`rotate_root`).

pub(crate) mod bundle_publisher;
pub(crate) mod cluster_trust_bundle;
pub(crate) mod leader;
pub(crate) mod pod_certificates;
pub(crate) mod remote;
pub(crate) mod root_secret;

pub use cluster_trust_bundle::TRUST_DOMAIN_LABEL;
pub use remote::REMOTE_RBAC_RULES;
pub use root_secret::RootSecretError;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use kube::runtime::watcher::{self, Event};
use meshca_certs::TrustDomain;
use meshca_kube::WatchRetry;
use time::OffsetDateTime;
use tokio::sync::watch;

use crate::authority::Authority;
use crate::metrics::Metrics;
use crate::store::CaMaterial;
use root_secret::{
    RootKeyPair, RootSecret, RotationPhase, RotationPolicy, RotationStep, SECRET_NAME,
};

/// One RBAC rule meshca needs: API group, resource, verbs, and whether it
/// is namespaced to meshca's own namespace (Role) or cluster-wide
/// (ClusterRole). The deployment manifests grant exactly these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RbacRule {
    /// API group ("" for core).
    pub api_group: &'static str,
    /// Resource (plural).
    pub resource: &'static str,
    /// Verbs used.
    pub verbs: &'static [&'static str],
    /// Only in meshca's namespace.
    pub own_namespace_only: bool,
    /// Only on these objects (empty: on all).
    pub resource_names: &'static [&'static str],
}

/// The signer name the deployment manifests grant `sign` and `attest` on
/// (the example of `--pod-certificate-signer`).
pub const EXAMPLE_POD_CERTIFICATE_SIGNER: &str = "meshca.io/spiffe";

/// Every Kubernetes API call meshca makes, as RBAC rules.
pub const RBAC_RULES: &[RbacRule] = &[
    RbacRule {
        api_group: "authentication.k8s.io",
        resource: "tokenreviews",
        verbs: &["create"],
        own_namespace_only: false,
        resource_names: &[],
    },
    RbacRule {
        api_group: "",
        resource: "pods",
        verbs: &["get", "list", "watch"],
        own_namespace_only: false,
        resource_names: &[],
    },
    RbacRule {
        api_group: "",
        resource: "namespaces",
        verbs: &["get", "list", "watch"],
        own_namespace_only: false,
        resource_names: &[],
    },
    RbacRule {
        api_group: "",
        resource: "configmaps",
        verbs: &["create", "get", "list", "update", "watch"],
        own_namespace_only: false,
        resource_names: &[],
    },
    RbacRule {
        api_group: "",
        resource: "secrets",
        verbs: &["create", "get", "list", "update", "watch"],
        own_namespace_only: true,
        resource_names: &[],
    },
    RbacRule {
        api_group: "coordination.k8s.io",
        resource: "leases",
        verbs: &["create", "get", "update"],
        own_namespace_only: true,
        resource_names: &[],
    },
    // With --pod-certificate-signer: PodCertificateRequests of the signer,
    // answered through their status; the signer's ClusterTrustBundle.
    RbacRule {
        api_group: "certificates.k8s.io",
        resource: "podcertificaterequests",
        verbs: &["get", "list", "watch"],
        own_namespace_only: false,
        resource_names: &[],
    },
    RbacRule {
        api_group: "certificates.k8s.io",
        resource: "podcertificaterequests/status",
        verbs: &["update"],
        own_namespace_only: false,
        resource_names: &[],
    },
    RbacRule {
        api_group: "certificates.k8s.io",
        resource: "signers",
        verbs: &["attest", "sign"],
        own_namespace_only: false,
        resource_names: &[EXAMPLE_POD_CERTIFICATE_SIGNER],
    },
    RbacRule {
        api_group: "certificates.k8s.io",
        resource: "clustertrustbundles",
        verbs: &["create", "get", "list", "update", "watch"],
        own_namespace_only: false,
        resource_names: &[],
    },
];

/// Why the cluster state could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The Secret exists but cannot be used; meshca never overwrites it.
    #[error("{0}; meshca never overwrites an existing CA Secret: fix or delete it")]
    BadSecret(RootSecretError),
    /// A Kubernetes API call failed.
    #[error(
        "Kubernetes API: {action} Secret {namespace}/{SECRET_NAME}: {}",
        meshca_certs::error_chain(cause)
    )]
    Api {
        /// What was being done.
        action: &'static str,
        /// The namespace.
        namespace: String,
        /// The error.
        cause: kube::Error,
    },
}

impl From<RootSecretError> for ClusterError {
    fn from(e: RootSecretError) -> Self {
        Self::BadSecret(e)
    }
}

/// meshca's namespace: the flag, else `$POD_NAMESPACE`, else the
/// kubeconfig's (or the in-cluster service account's) namespace.
pub(crate) fn own_namespace(flag: Option<&str>, client: &kube::Client) -> String {
    flag.map(str::to_string)
        .or_else(|| {
            std::env::var("POD_NAMESPACE")
                .ok()
                .filter(|s| !s.is_empty())
        })
        .unwrap_or_else(|| client.default_namespace().to_string())
}

/// Loads the root from the Secret, or creates it if absent. When several
/// replicas start together, exactly one create succeeds; the others get
/// `AlreadyExists` and read the winner's Secret. Every API failure is an
/// error, a `404` of a missing namespace too: a replica never falls back to
/// a root of its own (replicas would then sign with different roots).
pub(crate) async fn load_or_create_root_secret(
    client: &kube::Client,
    namespace: &str,
    trust_domain: &TrustDomain,
    root_ttl: Duration,
) -> Result<CaMaterial, ClusterError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let api_error = |action: &'static str| {
        let namespace = namespace.to_string();
        move |cause| ClusterError::Api {
            action,
            namespace,
            cause,
        }
    };
    let now = OffsetDateTime::now_utc();
    if let Some(secret) = api
        .get_opt(SECRET_NAME)
        .await
        .map_err(api_error("reading"))?
    {
        let root = RootSecret::from_secret(&secret, namespace)?;
        let material = root.material(namespace, now)?;
        tracing::info!(
            namespace,
            secret = SECRET_NAME,
            phase = root.phase.name(),
            "using the CA root from the Secret"
        );
        return Ok(material);
    }
    let root = RootSecret::new(
        RootKeyPair::generate(trust_domain, root_ttl, now).map_err(RootSecretError::from)?,
    );
    let secret = root.to_secret(namespace, None);
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            let material = root.material(namespace, now)?;
            tracing::info!(namespace, secret = SECRET_NAME, not_after = %meshca_certs::Rfc3339(material.signing.validity().not_after), "generated a new self-signed root and stored it in the Secret");
            Ok(material)
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {
            // Another replica won the race: use its root, drop ours.
            let secret = api
                .get(SECRET_NAME)
                .await
                .map_err(api_error("reading (after losing the create race)"))?;
            let root = RootSecret::from_secret(&secret, namespace)?;
            let material = root.material(namespace, now)?;
            tracing::info!(
                namespace,
                secret = SECRET_NAME,
                "another replica created the Secret first; using its root"
            );
            Ok(material)
        }
        Err(e) => Err(api_error("creating")(e)),
    }
}

/// Logs a warning, at start, for each reason a root rotation under
/// `policy` would break clients (see [`RotationPolicy::unsafe_because`]).
/// meshca still starts: short settings are how rotation is tried out.
pub(crate) fn warn_if_rotation_unsafe(
    policy: &RotationPolicy,
    default_leaf_ttl: Duration,
    expiry_margin: Duration,
) {
    for problem in policy.unsafe_because(default_leaf_ttl, expiry_margin) {
        tracing::warn!(problem = %problem, "root rotation would not be safe for clients");
    }
}

/// The Secret as the watch last saw it: `None` until the first listing,
/// then `Some(None)` if it does not exist.
pub(crate) type SeenSecret = Option<Option<Secret>>;

/// Keeps `authority` signing with what the Secret holds (every replica),
/// and shares the latest Secret on `latest` for the leader's rotation.
pub(crate) async fn follow_root_secret(
    client: kube::Client,
    namespace: String,
    authority: Arc<Authority>,
    metrics: Metrics,
    latest: watch::Sender<SeenSecret>,
) {
    let mut found = false;
    let api: Api<Secret> = Api::namespaced(client, &namespace);
    let events = watcher::watcher(
        api,
        watcher::Config::default().fields(&format!("metadata.name={SECRET_NAME}")),
    );
    futures::pin_mut!(events);
    let mut retry = WatchRetry::new("ca secret");
    while let Some(event) = events.next().await {
        retry.saw(&event);
        match event {
            Ok(Event::Apply(secret)) | Ok(Event::InitApply(secret)) => {
                found = true;
                adopt(&secret, &namespace, &authority, &metrics);
                latest.send_replace(Some(Some(secret)));
            }
            Ok(Event::Delete(_)) => {
                // Repaired without an operator (the leader writes it
                // back from memory): a warning, not an error.
                tracing::warn!(namespace = %namespace, secret = SECRET_NAME, "the CA Secret was deleted; still signing with the root in memory (the leader writes it back)");
                latest.send_replace(Some(None));
            }
            Ok(Event::Init) => found = false,
            Ok(Event::InitDone) => {
                if !found {
                    latest.send_replace(Some(None));
                }
            }
            Err(e) => retry.failed(&e).await,
        }
    }
}

/// Signs with the Secret's root if it differs from the one in use.
fn adopt(secret: &Secret, namespace: &str, authority: &Authority, metrics: &Metrics) {
    let root = match RootSecret::from_secret(secret, namespace) {
        Ok(root) => root,
        Err(e) => {
            tracing::error!(error = %e, "the CA Secret changed but is unusable; still signing with the previous root");
            authority.set_refused(Some(e.to_string()));
            return;
        }
    };
    metrics.set_rotation_phase(
        root.phase.name(),
        &RotationPhase::ALL.map(RotationPhase::name),
    );
    let current = authority.current();
    let same = current.material.signing.cert_der() == root.signing.cert.as_slice()
        && current.material.bundle.roots() == root.bundle.as_slice();
    if same {
        return;
    }
    match root.material(namespace, OffsetDateTime::now_utc()) {
        Ok(material) => {
            tracing::info!(
                phase = root.phase.name(),
                roots = root.bundle.len(),
                not_after = %meshca_certs::Rfc3339(material.signing.validity().not_after),
                "the CA Secret changed: signing with its root and publishing its bundle"
            );
            authority.replace(material);
            metrics.reloads_ok.inc();
        }
        Err(e) => {
            tracing::error!(error = %e, "the CA Secret changed but is unusable; still signing with the previous root");
            authority.set_refused(Some(e.to_string()));
            metrics.reloads_refused.inc();
        }
    }
}

/// The leader's side of the root: moves a rotation forward when a step is
/// due, and writes the Secret back if it was deleted. Runs until dropped.
pub(crate) async fn rotate_root(
    client: kube::Client,
    namespace: String,
    trust_domain: TrustDomain,
    policy: RotationPolicy,
    authority: Arc<Authority>,
    metrics: Metrics,
    mut latest: watch::Receiver<SeenSecret>,
) {
    let api: Api<Secret> = Api::namespaced(client, &namespace);
    loop {
        let now = OffsetDateTime::now_utc();
        let current = latest.borrow_and_update().clone();
        let wait = match current {
            None => Duration::from_secs(60),
            Some(None) => {
                restore_deleted_secret(&api, &namespace, &authority).await;
                Duration::from_secs(5)
            }
            Some(Some(secret)) => match RootSecret::from_secret(&secret, &namespace) {
                Err(_) => Duration::from_secs(30),
                Ok(root) => match root.due_step(&policy, now) {
                    None => {
                        let at = root.next_step_at(&policy, now);
                        Duration::try_from(at - now).unwrap_or(Duration::ZERO)
                    }
                    Some(step) => {
                        match take_step(
                            &api,
                            &namespace,
                            &trust_domain,
                            &policy,
                            &secret,
                            &root,
                            step,
                            now,
                        )
                        .await
                        {
                            Ok(written) => {
                                adopt(&written, &namespace, &authority, &metrics);
                                Duration::from_millis(200)
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, step = ?step, "root rotation step failed; retrying");
                                Duration::from_secs(2)
                            }
                        }
                    }
                },
            },
        };
        // Wake for the next due step, a Secret change, or at least every minute.
        let wait = wait.clamp(Duration::from_millis(100), Duration::from_secs(60));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            changed = latest.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn take_step(
    api: &Api<Secret>,
    namespace: &str,
    trust_domain: &TrustDomain,
    policy: &RotationPolicy,
    secret: &Secret,
    root: &RootSecret,
    step: RotationStep,
    now: OffsetDateTime,
) -> Result<Secret, String> {
    let new_root = match step {
        RotationStep::Announce => Some(
            RootKeyPair::generate(trust_domain, policy.root_ttl, now).map_err(|e| e.to_string())?,
        ),
        _ => None,
    };
    let next = root.after(step, new_root, policy, now);
    let written = next.to_secret(namespace, Some(secret));
    let stored = api
        .replace(SECRET_NAME, &PostParams::default(), &written)
        .await
        .map_err(|e| format!("updating Secret {namespace}/{SECRET_NAME}: {e}"))?;
    tracing::info!(
        step = ?step,
        phase = next.phase.name(),
        roots_in_bundle = next.bundle.len(),
        retire_previous_after = ?next.retire_after,
        "root rotation: moved to the next phase"
    );
    Ok(stored)
}

/// Writes the Secret back from the root in memory after someone deleted it.
async fn restore_deleted_secret(api: &Api<Secret>, namespace: &str, authority: &Authority) {
    let state = authority.current();
    let material = &state.material;
    if !matches!(material.source, crate::store::CaSource::Secret { .. }) {
        return;
    }
    // A Secret-held root is a key in memory (an HSM key is refused in
    // cluster mode at start).
    let Some(key) = material.signing.key().software() else {
        return;
    };
    let root = RootSecret {
        bundle: material.bundle.roots().to_vec(),
        ..RootSecret::new(RootKeyPair {
            cert: material.signing.cert_der().to_vec(),
            key_pem: key.to_pkcs8_pem(),
        })
    };
    match api
        .create(&PostParams::default(), &root.to_secret(namespace, None))
        .await
    {
        Ok(_) => tracing::warn!(
            namespace,
            secret = SECRET_NAME,
            "the CA Secret was deleted; wrote it back from the root in memory"
        ),
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => tracing::warn!(error = %e, "writing the deleted CA Secret back failed; retrying"),
    }
}
