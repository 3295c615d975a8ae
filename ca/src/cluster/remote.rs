//! Remote clusters: one CA for every cluster of a mesh, as istiod does
//! with Istio's remote secrets (README, "Many clusters, one CA").
//!
//! - Where they come from: Secrets in meshca's namespace labelled
//!   `istio/multiCluster: "true"` (what `istioctl create-remote-secret`
//!   makes), each key of `data` a cluster ID and its value a kubeconfig of
//!   that cluster's API server, watched at run time
//!   ([`watch_remote_secrets`]); and `--remote-cluster ID=KUBECONFIG`
//!   (static, for meshca outside a cluster).
//! - What they are for: a request whose `clusterid` names a remote cluster
//!   is authenticated against that cluster only ([`RemoteCluster`]):
//!   TokenReview on its API server, or offline with its issuer's keys
//!   (`--remote-cluster-jwt-issuer ID=ISSUER`, found by OIDC discovery on
//!   its API server). A `clusterid` naming no known cluster is refused
//!   before any API call (the caller of [`RemoteClusters::get`] does that).
//! - Isolation: every remote cluster has its own Kubernetes client
//!   (connection pool), its own in-flight limit and timeout
//!   (`--kube-api-max-in-flight`, `--kube-api-timeout`, per cluster) and its
//!   own caches, so one cluster's API server down, slow or black-holed
//!   costs only its own callers. `/ready` does not look at them;
//!   `meshca_remote_cluster_up{cluster}` does.
//! - Bad input: a Secret key that is no cluster ID, a kubeconfig that does
//!   not parse or asks for what a remote secret may not (exec plugins, auth
//!   providers, files of meshca's own file system: istiod refuses the same
//!   by default) is logged naming the Secret and key, counted
//!   (`meshca_remote_cluster_config_errors_count`) and left out; every
//!   other cluster keeps working. Credentials are never logged.
//! - The bundle: the leader publishes `istio-ca-root-cert` into every
//!   namespace of every remote cluster and, with `--pod-certificate-signer`,
//!   the signer's ClusterTrustBundle ([`publish_to_remote_clusters`]).
//! - Bounds: at most `--max-remote-clusters` (64); the remote clusters'
//!   TokenReview caches share the local cluster's bound
//!   ([`remote_cache_entries`]: 781 results and 156 refusals each with
//!   the default 64), so all of them together hold no more than it.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams};
use kube::runtime::watcher::{self, Event};
use meshca_certs::TrustDomain;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::authn::oidc::KubernetesJwks;
use crate::authn::JwksFetcher;
use crate::authn::{
    Authenticator, AuthnError, Caller, Credentials, JwtAuthenticator, TokenReviewAuthenticator,
    TokenReviewConfig,
};
use crate::authz::node_agent::{watch_pods, NodeAgentPolicy, PodIndex};
use crate::authz::{AuthzError, ImpersonationPolicy};
use crate::metrics::IstioCounter;

/// Every Kubernetes API call meshca makes in a remote cluster, as RBAC
/// rules (all cluster-wide); `deploy/kustomize/remote-cluster` grants
/// exactly these. Beyond them: `/version`, and with
/// `--remote-cluster-jwt-issuer` the OIDC discovery URLs every cluster
/// grants.
pub const REMOTE_RBAC_RULES: &[super::RbacRule] = &[
    super::RbacRule {
        api_group: "authentication.k8s.io",
        resource: "tokenreviews",
        verbs: &["create"],
        own_namespace_only: false,
        resource_names: &[],
    },
    super::RbacRule {
        api_group: "",
        resource: "pods",
        verbs: &["get", "list", "watch"],
        own_namespace_only: false,
        resource_names: &[],
    },
    super::RbacRule {
        api_group: "",
        resource: "namespaces",
        verbs: &["get", "list", "watch"],
        own_namespace_only: false,
        resource_names: &[],
    },
    super::RbacRule {
        api_group: "",
        resource: "configmaps",
        verbs: &["create", "get", "list", "update", "watch"],
        own_namespace_only: false,
        resource_names: &[],
    },
    // With --pod-certificate-signer: the signer's ClusterTrustBundle.
    super::RbacRule {
        api_group: "certificates.k8s.io",
        resource: "clustertrustbundles",
        verbs: &["create", "get", "list", "update", "watch"],
        own_namespace_only: false,
        resource_names: &[],
    },
];

/// Label of a remote secret (Istio's).
pub(crate) const REMOTE_SECRET_LABEL: &str = "istio/multiCluster";
/// Remote clusters at most, unless `--max-remote-clusters` says otherwise.
pub(crate) const DEFAULT_MAX_REMOTE_CLUSTERS: usize = 64;
/// Positive TokenReview results and refusals one remote cluster keeps
/// when there may be `max_clusters`: together, every remote cluster holds
/// no more than the local cluster's caches ([`MAX_CACHED_TOKENS`],
/// [`MAX_REMEMBERED_REFUSALS`]), and each at least [`MIN_REMOTE_CACHE_ENTRIES`].
///
/// [`MAX_CACHED_TOKENS`]: crate::authn::cache::MAX_CACHED_TOKENS
/// [`MAX_REMEMBERED_REFUSALS`]: crate::authn::token_review::MAX_REMEMBERED_REFUSALS
pub(crate) fn remote_cache_entries(max_clusters: usize) -> (usize, usize) {
    let share = |total: usize| (total / max_clusters.max(1)).max(MIN_REMOTE_CACHE_ENTRIES);
    (
        share(crate::authn::cache::MAX_CACHED_TOKENS),
        share(crate::authn::token_review::MAX_REMEMBERED_REFUSALS),
    )
}
/// The smallest cache of a remote cluster.
pub(crate) const MIN_REMOTE_CACHE_ENTRIES: usize = 128;
/// How often each remote cluster's API server is asked for `/version`
/// (`meshca_remote_cluster_up`).
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_secs(10);
/// How often a remote cluster's discovered keys are fetched again, and
/// how soon a failed discovery is tried again.
const JWKS_REFRESH_PERIOD: Duration = crate::server::JWKS_REFRESH_PERIOD;
const DISCOVERY_RETRY: Duration = Duration::from_secs(10);
/// Longest cluster ID (a Secret key is at most 253 characters).
const MAX_CLUSTER_ID_LEN: usize = 253;

/// The command-line flags of remote clusters.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RemoteClusterArgs {
    /// A remote cluster and the kubeconfig of its API server, `ID=FILE`;
    /// repeatable. Requests with `clusterid: ID` are authenticated there.
    #[arg(
        long = "remote-cluster",
        env = "MESHCA_REMOTE_CLUSTER",
        value_delimiter = ','
    )]
    pub(crate) remote_clusters: Vec<String>,
    /// `ID=ISSUER`: tokens of the remote cluster ID with this `iss` are
    /// checked offline with that cluster's keys (OIDC discovery on its API
    /// server); repeatable.
    #[arg(
        long = "remote-cluster-jwt-issuer",
        env = "MESHCA_REMOTE_CLUSTER_JWT_ISSUER",
        value_delimiter = ','
    )]
    pub(crate) remote_jwt_issuers: Vec<String>,
    /// Remote clusters at most (flags and remote secrets together); more
    /// are refused, logged and counted.
    #[arg(long, env = "MESHCA_MAX_REMOTE_CLUSTERS", default_value_t = DEFAULT_MAX_REMOTE_CLUSTERS)]
    pub(crate) max_remote_clusters: usize,
}

/// A remote-cluster flag that does not make sense.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RemoteClusterConfigError {
    /// Not `ID=VALUE`, or a bad cluster ID.
    #[error("{flag} {value:?}: {reason}")]
    Bad {
        /// Which flag.
        flag: &'static str,
        /// What was given (a path or an issuer: no credential).
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// More `--remote-cluster` than `--max-remote-clusters`.
    #[error("{given} --remote-cluster flags, more than --max-remote-clusters {max}")]
    TooMany {
        /// How many were given.
        given: usize,
        /// The bound.
        max: usize,
    },
}

/// Validated remote-cluster settings.
#[derive(Debug, Clone, Default)]
pub(crate) struct RemoteClusterConfig {
    /// Static clusters: ID and kubeconfig file.
    pub(crate) static_clusters: Vec<(String, PathBuf)>,
    /// Offline issuers by cluster ID.
    pub(crate) jwt_issuers: HashMap<String, String>,
    /// At most this many remote clusters.
    pub(crate) max_clusters: usize,
}

/// Whether `id` can name a cluster: what a Secret key may be
/// (`[-._a-zA-Z0-9]+`, at most 253 characters).
pub(crate) fn valid_cluster_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_CLUSTER_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
}

fn split_assignment(
    flag: &'static str,
    value: &str,
    local_cluster_id: &str,
) -> Result<(String, String), RemoteClusterConfigError> {
    let bad = |reason: &str| RemoteClusterConfigError::Bad {
        flag,
        value: value.chars().take(256).collect(),
        reason: reason.into(),
    };
    let (id, rest) = value
        .split_once('=')
        .ok_or_else(|| bad("must be ID=VALUE"))?;
    if !valid_cluster_id(id) {
        return Err(bad(
            "the cluster ID must be letters, digits, '-', '.' or '_' (a Secret key)",
        ));
    }
    if id == local_cluster_id {
        return Err(bad("names the local cluster (--cluster-id)"));
    }
    if rest.is_empty() {
        return Err(bad("nothing after '='"));
    }
    Ok((id.to_string(), rest.to_string()))
}

impl RemoteClusterConfig {
    /// Checks the flags; `local_cluster_id` is `--cluster-id`.
    pub(crate) fn from_args(
        args: RemoteClusterArgs,
        local_cluster_id: &str,
    ) -> Result<Self, RemoteClusterConfigError> {
        let mut static_clusters: Vec<(String, PathBuf)> = Vec::new();
        for value in &args.remote_clusters {
            let (id, path) = split_assignment("--remote-cluster", value, local_cluster_id)?;
            if static_clusters.iter().any(|(seen, _)| *seen == id) {
                return Err(RemoteClusterConfigError::Bad {
                    flag: "--remote-cluster",
                    value: value.clone(),
                    reason: "this cluster ID is given twice".into(),
                });
            }
            static_clusters.push((id, PathBuf::from(path)));
        }
        if static_clusters.len() > args.max_remote_clusters {
            return Err(RemoteClusterConfigError::TooMany {
                given: static_clusters.len(),
                max: args.max_remote_clusters,
            });
        }
        let mut jwt_issuers = HashMap::new();
        for value in &args.remote_jwt_issuers {
            let (id, issuer) =
                split_assignment("--remote-cluster-jwt-issuer", value, local_cluster_id)?;
            if jwt_issuers.insert(id, issuer).is_some() {
                return Err(RemoteClusterConfigError::Bad {
                    flag: "--remote-cluster-jwt-issuer",
                    value: value.clone(),
                    reason: "this cluster ID is given twice".into(),
                });
            }
        }
        Ok(Self {
            static_clusters,
            jwt_issuers,
            max_clusters: args.max_remote_clusters,
        })
    }
}

/// Label of the per-cluster metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ClusterLabel {
    /// The cluster ID.
    pub(crate) cluster: String,
}

/// Metrics of the remote clusters.
#[derive(Debug, Clone, Default)]
pub(crate) struct RemoteClusterMetrics {
    /// 1 while the cluster's API server answers, 0 while it does not.
    pub(crate) up: Family<ClusterLabel, Gauge>,
    /// Remote clusters known now.
    pub(crate) clusters: Gauge,
    /// Remote-secret keys (or flags) left out: malformed, refused, too many.
    pub(crate) config_errors: IstioCounter,
    /// Requests of a remote cluster refused by its authentication.
    pub(crate) authentication_failures: Family<ClusterLabel, IstioCounter>,
}

impl RemoteClusterMetrics {
    /// Adds these metrics to `registry`.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "meshca_remote_cluster_up",
            "1 while the remote cluster's API server answers, 0 while it does not",
            self.up.clone(),
        );
        registry.register(
            "meshca_remote_clusters",
            "Remote clusters known (--remote-cluster and remote secrets)",
            self.clusters.clone(),
        );
        registry.register(
            "meshca_remote_cluster_config_errors_count",
            "Remote-secret keys left out: not a cluster ID, a kubeconfig that does not parse or is refused, beyond --max-remote-clusters",
            self.config_errors.clone(),
        );
        registry.register(
            "meshca_remote_cluster_authentication_failure_count",
            "Requests naming a remote cluster refused by that cluster's authentication",
            self.authentication_failures.clone(),
        );
    }
}

/// What every remote cluster's authentication shares.
#[derive(Clone)]
pub(crate) struct RemoteAuthnSettings {
    /// Validations each remote cluster's offline JWT check keeps: its
    /// share of the verdict budget, as for its TokenReview results.
    pub(crate) jwt_cache_entries: usize,
    /// `--token-audience`.
    pub(crate) audiences: Vec<String>,
    /// `--trust-domain`.
    pub(crate) trust_domain: TrustDomain,
    /// `--token-review-cache-ttl`.
    pub(crate) cache_ttl: Duration,
    /// `--token-review-refusal-cache-ttl`.
    pub(crate) refusal_cache_ttl: Duration,
    /// `--jwt-cache-ttl`.
    pub(crate) jwt_cache_ttl: Duration,
    /// `--kube-api-timeout`, per call of each cluster.
    pub(crate) timeout: Duration,
    /// `--kube-api-max-in-flight`, per cluster.
    pub(crate) max_in_flight: usize,
    /// Reviews waiting for a call, per cluster.
    pub(crate) max_waiting: usize,
    /// Client certificates (renewal), when allowed: they name no cluster.
    pub(crate) client_certificates: Option<Arc<dyn Authenticator>>,
    /// Cache hits (`meshca_token_cache_hit_count`).
    pub(crate) cache_hits: IstioCounter,
    /// `--trusted-node-agent`: in every cluster, each with its own pod index.
    pub(crate) node_agents: Vec<(String, String)>,
    /// `--pod-watch-failure-limit`.
    pub(crate) pod_watch_failure_limit: Duration,
}

/// Where a remote cluster comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    /// `--remote-cluster ID=FILE`.
    Flag(PathBuf),
    /// A key of a remote secret.
    Secret {
        /// The Secret's name.
        name: String,
    },
}

/// One remote cluster: its API server's client and authentication.
pub(crate) struct RemoteCluster {
    id: String,
    /// Its API server (its own connections).
    client: kube::Client,
    source: Source,
    /// SHA-256 of its kubeconfig: an unchanged one keeps the cluster as is.
    fingerprint: [u8; 32],
    token_review: TokenReviewAuthenticator,
    jwt: RwLock<Option<Arc<JwtAuthenticator>>>,
    client_certificates: Option<Arc<dyn Authenticator>>,
    /// Node-agent impersonation on this cluster's own pods (with
    /// `--trusted-node-agent`).
    node_agents: Option<Arc<NodeAgentPolicy>>,
    failures: IstioCounter,
    up: Gauge,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl std::fmt::Debug for RemoteCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteCluster")
            .field("id", &self.id)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl Drop for RemoteCluster {
    fn drop(&mut self) {
        for task in self.tasks.get_mut().unwrap_or_else(|e| e.into_inner()) {
            task.abort();
        }
    }
}

impl RemoteCluster {
    /// The cluster's ID.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// Authenticates a caller of this cluster: a client certificate (it
    /// names no cluster), else the token, offline with this cluster's keys
    /// when its issuer is configured and the token is of it, else by
    /// TokenReview on this cluster's API server. Never asks another cluster.
    pub(crate) async fn authenticate(
        &self,
        credentials: &Credentials,
    ) -> Result<Caller, AuthnError> {
        let result = self
            .authenticate_here(credentials)
            .await
            .map(|caller| Caller {
                cluster: Some(self.id.clone()),
                ..caller
            });
        match &result {
            Err(e) if e.is_refusal() => self.failures.inc(),
            Err(AuthnError::Unavailable(_)) => {
                self.failures.inc();
                self.up.set(0);
            }
            _ => {}
        }
        result
    }

    async fn authenticate_here(&self, credentials: &Credentials) -> Result<Caller, AuthnError> {
        if credentials.bearer.is_none() && credentials.peer_chain.is_none() {
            return Err(AuthnError::NoCredentials);
        }
        if let Some(certificates) = &self.client_certificates {
            if let Some(caller) = certificates.authenticate(credentials).await? {
                return Ok(caller);
            }
        }
        let Some(token) = &credentials.bearer else {
            return Err(AuthnError::BadClientCertificate(
                "no authenticator accepts client certificates".into(),
            ));
        };
        let jwt = self.jwt.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(jwt) = jwt {
            if let Some(caller) = jwt.authenticate(credentials).await? {
                return Ok(caller);
            }
        }
        self.token_review.review(token).await
    }
}

/// Every remote cluster known now, by ID.
pub(crate) struct RemoteClusters {
    local_cluster_id: String,
    config: RemoteClusterConfig,
    settings: RemoteAuthnSettings,
    metrics: RemoteClusterMetrics,
    /// With `--pod-certificate-signer`: the ClusterTrustBundle the leader
    /// publishes into every remote cluster too.
    trust_bundle: Option<TrustBundleSigner>,
    clusters: RwLock<HashMap<String, Arc<RemoteCluster>>>,
}

/// The ClusterTrustBundle of `--pod-certificate-signer`, as published into
/// each remote cluster (the same object as in the local cluster).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TrustBundleSigner {
    /// `--pod-certificate-signer`: names the object and is its `signerName`.
    pub(crate) signer_name: String,
    /// `--trust-domain`: the object's `meshca.io/trust-domain` label.
    pub(crate) trust_domain: String,
}

impl std::fmt::Debug for RemoteClusters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteClusters")
            .field("clusters", &self.ids())
            .finish_non_exhaustive()
    }
}

/// Why a kubeconfig was not taken (for the log: never its content).
#[derive(Debug, thiserror::Error)]
pub(crate) enum KubeconfigError {
    /// Not UTF-8 YAML of a kubeconfig.
    #[error("not a kubeconfig (it does not parse as one)")]
    Parse,
    /// It asks for something a remote secret may not use.
    #[error("refused: {0}")]
    Refused(String),
    /// kube could not make a client of it.
    #[error("unusable: {0}")]
    Unusable(String),
}

/// Refuses in a remote secret's kubeconfig what would make meshca run a
/// program or read its own files (istiod refuses these by default too).
fn sanitize(kubeconfig: &kube::config::Kubeconfig) -> Result<(), KubeconfigError> {
    for named in &kubeconfig.auth_infos {
        let Some(user) = &named.auth_info else {
            continue;
        };
        let refused = |what: &str| {
            Err(KubeconfigError::Refused(format!(
                "user {:?} uses {what}, which a remote secret may not",
                named.name.chars().take(64).collect::<String>()
            )))
        };
        if user.exec.is_some() {
            return refused("an exec plugin");
        }
        if user.auth_provider.is_some() {
            return refused("an auth provider");
        }
        if user.token_file.is_some() {
            return refused("tokenFile");
        }
        if user.client_certificate.is_some() || user.client_key.is_some() {
            return refused("client-certificate/client-key files");
        }
    }
    for named in &kubeconfig.clusters {
        if named
            .cluster
            .as_ref()
            .is_some_and(|c| c.certificate_authority.is_some())
        {
            return Err(KubeconfigError::Refused(format!(
                "cluster {:?} uses a certificate-authority file, which a remote secret may not",
                named.name.chars().take(64).collect::<String>()
            )));
        }
    }
    Ok(())
}

/// A client for the API server `kubeconfig` (its current context) names,
/// with meshca's connect and write timeouts.
async fn client_of(
    kubeconfig: kube::config::Kubeconfig,
    timeout: Duration,
) -> Result<kube::Client, KubeconfigError> {
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .map_err(|e| KubeconfigError::Unusable(e.to_string().chars().take(200).collect()))?;
    config.connect_timeout = Some(timeout);
    config.write_timeout = Some(timeout);
    kube::Client::try_from(config)
        .map_err(|e| KubeconfigError::Unusable(e.to_string().chars().take(200).collect()))
}

fn fingerprint(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

impl RemoteClusters {
    /// No remote cluster yet; `local_cluster_id` is `--cluster-id`;
    /// `trust_bundle` the ClusterTrustBundle to publish in each (with
    /// `--pod-certificate-signer`).
    pub(crate) fn new(
        local_cluster_id: String,
        config: RemoteClusterConfig,
        settings: RemoteAuthnSettings,
        metrics: RemoteClusterMetrics,
        trust_bundle: Option<TrustBundleSigner>,
    ) -> Self {
        Self {
            local_cluster_id,
            config,
            settings,
            metrics,
            trust_bundle,
            clusters: RwLock::new(HashMap::new()),
        }
    }

    /// The cluster named `id`, if it is known.
    pub(crate) fn get(&self, id: &str) -> Option<Arc<RemoteCluster>> {
        self.read().get(id).cloned()
    }

    /// Every known cluster ID, sorted.
    pub(crate) fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.read().keys().cloned().collect();
        ids.sort();
        ids
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<RemoteCluster>>> {
        self.clusters.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<RemoteCluster>>> {
        self.clusters.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Logs that the remote secret `secret`'s key `key` was left out.
    fn reject(&self, secret: &str, key: &str, reason: &dyn std::fmt::Display) {
        self.metrics.config_errors.inc();
        tracing::error!(
            secret = %secret,
            key = %key.chars().take(MAX_CLUSTER_ID_LEN).collect::<String>(),
            error = %reason,
            "remote secret: this cluster is left out; the other clusters are unaffected"
        );
    }

    /// A cluster of `id` from `bytes` (a kubeconfig), with its probe and,
    /// when its issuer is configured, its offline keys started.
    async fn build(
        self: &Arc<Self>,
        id: &str,
        source: Source,
        bytes: &[u8],
    ) -> Result<Arc<RemoteCluster>, KubeconfigError> {
        let text = std::str::from_utf8(bytes).map_err(|_| KubeconfigError::Parse)?;
        let kubeconfig =
            kube::config::Kubeconfig::from_yaml(text).map_err(|_| KubeconfigError::Parse)?;
        if matches!(source, Source::Secret { .. }) {
            sanitize(&kubeconfig)?;
        }
        let client = client_of(kubeconfig, self.settings.timeout).await?;
        let s = &self.settings;
        let (results, refusals) = remote_cache_entries(self.config.max_clusters);
        let pods = (!s.node_agents.is_empty())
            .then(|| Arc::new(PodIndex::with_max_watch_failure(s.pod_watch_failure_limit)));
        let label = ClusterLabel {
            cluster: id.to_string(),
        };
        let token_review = TokenReviewAuthenticator::new(
            client.clone(),
            TokenReviewConfig {
                audiences: s.audiences.clone(),
                trust_domain: s.trust_domain.clone(),
                cache_ttl: s.cache_ttl,
                refusal_cache_ttl: s.refusal_cache_ttl,
                timeout: s.timeout,
                max_in_flight: s.max_in_flight,
                max_waiting: s.max_waiting,
            },
        )
        .with_cache_capacity(results, refusals)
        .counting_cache_hits(s.cache_hits.clone());
        let cluster = Arc::new(RemoteCluster {
            id: id.to_string(),
            client: client.clone(),
            source,
            fingerprint: fingerprint(bytes),
            token_review,
            jwt: RwLock::new(None),
            client_certificates: s.client_certificates.clone(),
            node_agents: pods
                .as_ref()
                .map(|pods| Arc::new(NodeAgentPolicy::new(s.node_agents.clone(), pods.clone()))),
            failures: self
                .metrics
                .authentication_failures
                .get_or_create(&label)
                .clone(),
            up: self.metrics.up.get_or_create(&label).clone(),
            tasks: Mutex::new(Vec::new()),
        });
        let mut tasks = Vec::new();
        if let Some(pods) = pods {
            tasks.push(tokio::spawn(watch_pods(client.clone(), pods)).abort_handle());
        }
        tasks.push(
            tokio::spawn(probe(
                client.clone(),
                id.to_string(),
                cluster.up.clone(),
                s.timeout,
            ))
            .abort_handle(),
        );
        if let Some(issuer) = self.config.jwt_issuers.get(id) {
            tasks.push(
                tokio::spawn(follow_keys(
                    Arc::downgrade(&cluster),
                    client,
                    issuer.clone(),
                    self.settings.clone(),
                ))
                .abort_handle(),
            );
        }
        *cluster.tasks.lock().unwrap_or_else(|e| e.into_inner()) = tasks;
        Ok(cluster)
    }

    /// Adds the `--remote-cluster` flags' clusters (their files are the
    /// operator's: a bad one stops the start, naming the flag).
    pub(crate) async fn add_static(self: &Arc<Self>) -> Result<(), String> {
        for (id, path) in self.config.static_clusters.clone() {
            let bytes = std::fs::read(&path)
                .map_err(|e| format!("--remote-cluster {id}={}: {e}", path.display()))?;
            let cluster = self
                .build(&id, Source::Flag(path.clone()), &bytes)
                .await
                .map_err(|e| format!("--remote-cluster {id}={}: {e}", path.display()))?;
            tracing::info!(cluster = %id, kubeconfig = %path.display(), "remote cluster added");
            self.write().insert(id, cluster);
        }
        self.count();
        Ok(())
    }

    fn count(&self) {
        self.metrics.clusters.set(self.read().len() as i64);
    }

    fn forget(&self, cluster: &RemoteCluster) {
        let label = ClusterLabel {
            cluster: cluster.id.clone(),
        };
        self.metrics.up.remove(&label);
        self.metrics.authentication_failures.remove(&label);
    }

    /// Takes the remote secret `name` as it is now (`data`: `None` when it
    /// is gone or no longer labelled): its clusters added, changed or
    /// removed; the clusters of other Secrets and flags untouched.
    pub(crate) async fn apply_secret(
        self: &Arc<Self>,
        name: &str,
        data: Option<&BTreeMap<String, Vec<u8>>>,
    ) {
        let ours = |c: &RemoteCluster| matches!(&c.source, Source::Secret { name: n } if n == name);
        let wanted = data.cloned().unwrap_or_default();
        // Clusters of this Secret whose key is gone.
        let removed: Vec<Arc<RemoteCluster>> = {
            let mut clusters = self.write();
            let gone: Vec<String> = clusters
                .values()
                .filter(|c| ours(c) && !wanted.contains_key(&c.id))
                .map(|c| c.id.clone())
                .collect();
            gone.iter().filter_map(|id| clusters.remove(id)).collect()
        };
        for cluster in removed {
            self.forget(&cluster);
            tracing::info!(cluster = %cluster.id, secret = %name, "remote cluster removed");
        }
        for (key, bytes) in &wanted {
            if !valid_cluster_id(key) {
                self.reject(name, key, &"the key is not a cluster ID");
                continue;
            }
            if *key == self.local_cluster_id {
                self.reject(name, key, &"names the local cluster (--cluster-id)");
                continue;
            }
            let existing = self.get(key);
            match &existing {
                Some(c) if !ours(c) => {
                    let other = match &c.source {
                        Source::Flag(_) => "--remote-cluster".to_string(),
                        Source::Secret { name } => format!("the remote secret {name}"),
                    };
                    self.reject(
                        name,
                        key,
                        &format!("this cluster is already given by {other}"),
                    );
                    continue;
                }
                Some(c) if c.fingerprint == fingerprint(bytes) => continue,
                Some(_) => {}
                None if self.read().len() >= self.config.max_clusters => {
                    self.reject(
                        name,
                        key,
                        &format!(
                            "already {} remote clusters (--max-remote-clusters)",
                            self.config.max_clusters
                        ),
                    );
                    continue;
                }
                None => {}
            }
            match self
                .build(
                    key,
                    Source::Secret {
                        name: name.to_string(),
                    },
                    bytes,
                )
                .await
            {
                Ok(cluster) => {
                    // Requests in flight keep the cluster they took.
                    self.write().insert(key.clone(), cluster);
                    tracing::info!(
                        cluster = %key,
                        secret = %name,
                        changed = existing.is_some(),
                        "remote cluster from a remote secret"
                    );
                }
                Err(e) => {
                    // A changed kubeconfig that is bad: the cluster is gone
                    // rather than served with credentials its Secret withdrew.
                    if let Some(old) = existing {
                        self.write().remove(key);
                        self.forget(&old);
                    }
                    self.reject(name, key, &e);
                }
            }
        }
        self.count();
    }

    /// After a full listing: removes the clusters of Secrets not in `seen`.
    async fn retain_secrets(self: &Arc<Self>, seen: &[String]) {
        let stale: Vec<String> = {
            let clusters = self.read();
            let mut names: Vec<String> = clusters
                .values()
                .filter_map(|c| match &c.source {
                    Source::Secret { name } if !seen.contains(name) => Some(name.clone()),
                    _ => None,
                })
                .collect();
            names.dedup();
            names
        };
        for name in stale {
            self.apply_secret(&name, None).await;
        }
    }
}

/// Node-agent impersonation in every cluster: a caller authenticated
/// against a remote cluster is judged on that cluster's pods only (its own
/// pod index), a local caller on the local cluster's.
pub(crate) struct ClusterPolicies {
    local: Arc<dyn ImpersonationPolicy>,
    remote: Arc<RemoteClusters>,
}

impl ClusterPolicies {
    /// `local` for local callers, each remote cluster's own for its callers.
    pub(crate) fn new(local: Arc<dyn ImpersonationPolicy>, remote: Arc<RemoteClusters>) -> Self {
        Self { local, remote }
    }

    fn remote_policy(&self, caller: &Caller) -> Result<Arc<NodeAgentPolicy>, String> {
        let Some(id) = &caller.cluster else {
            return Err("no cluster".into());
        };
        match self.remote.get(id) {
            Some(cluster) => cluster
                .node_agents
                .clone()
                .ok_or_else(|| "no trusted node agents".into()),
            None => Err(format!("its cluster {id:?} is no longer known")),
        }
    }
}

#[async_trait::async_trait]
impl ImpersonationPolicy for ClusterPolicies {
    fn node_of(&self, caller: &Caller) -> Option<String> {
        match &caller.cluster {
            None => self.local.node_of(caller),
            Some(_) => self.remote_policy(caller).ok()?.node_of(caller),
        }
    }

    async fn may_impersonate(
        &self,
        caller: &Caller,
        target: &meshca_certs::SpiffeId,
    ) -> Result<(), AuthzError> {
        if caller.cluster.is_none() {
            return self.local.may_impersonate(caller, target).await;
        }
        match self.remote_policy(caller) {
            Ok(policy) => policy.may_impersonate(caller, target).await,
            Err(reason) => Err(AuthzError::ImpersonationDenied {
                caller: caller.identity.to_string(),
                target: target.to_string(),
                reason,
            }),
        }
    }
}

/// How often the leader looks for remote clusters added, changed or
/// removed, to publish the bundle into them.
const PUBLISH_RECONCILE: Duration = Duration::from_secs(1);

/// While leader (until dropped): the bundle ConfigMap `istio-ca-root-cert`
/// in every namespace (but `excluded`) of every remote cluster, kept right
/// as in the local cluster (`bundle_publisher::publish_bundles`: every
/// change of the bundle, a root rotation's both roots included, reaches
/// every cluster), as istiod's namespace controller does for remote
/// clusters; with `--pod-certificate-signer` also the signer's
/// ClusterTrustBundle, as in the local cluster
/// (`cluster_trust_bundle::publish_cluster_trust_bundle`). A cluster added
/// gets them within a second; one removed or changed stops (the new one
/// starts); one whose API server fails is retried on its own, the others
/// unaffected. Their log lines carry the cluster (`remote_cluster{cluster}`).
pub(crate) async fn publish_to_remote_clusters(
    remote: Arc<RemoteClusters>,
    authority: Arc<crate::authority::Authority>,
    excluded: Vec<String>,
    metrics: crate::metrics::Metrics,
) {
    use tracing::Instrument;
    // Dropped with this future (leadership lost): every publisher stops.
    let mut publishers = tokio::task::JoinSet::new();
    let mut running: HashMap<String, (Weak<RemoteCluster>, tokio::task::AbortHandle)> =
        HashMap::new();
    loop {
        let now: HashMap<String, Arc<RemoteCluster>> = remote.read().clone();
        running.retain(|id, (cluster, task)| {
            let same = now
                .get(id)
                .is_some_and(|c| std::ptr::eq(Arc::as_ptr(c), cluster.as_ptr()));
            if !same {
                task.abort();
            }
            same
        });
        for (id, cluster) in now {
            if running.contains_key(&id) {
                continue;
            }
            tracing::info!(
                cluster = %id,
                cluster_trust_bundle = remote.trust_bundle.is_some(),
                "publishing the bundle into the remote cluster"
            );
            let bundles = crate::cluster::bundle_publisher::publish_bundles(
                cluster.client.clone(),
                authority.clone(),
                excluded.clone(),
                metrics.clone(),
            );
            let trust_bundle = remote.trust_bundle.clone().map(|signer| {
                publish_trust_bundle_into(
                    cluster.client.clone(),
                    authority.clone(),
                    signer,
                    metrics.clone(),
                    remote.settings.timeout,
                )
            });
            let publish = async move {
                match trust_bundle {
                    Some(trust_bundle) => {
                        futures::join!(bundles, trust_bundle);
                    }
                    None => bundles.await,
                }
            };
            let task = publishers
                .spawn(publish.instrument(tracing::info_span!("remote_cluster", cluster = %id)));
            running.insert(id, (Arc::downgrade(&cluster), task));
        }
        while publishers.try_join_next().is_some() {}
        tokio::time::sleep(PUBLISH_RECONCILE).await;
    }
}

/// How often a remote cluster that does not take the ClusterTrustBundle
/// (the API not served, or meshca's account not allowed) is asked again.
const TRUST_BUNDLE_RECHECK: Duration = Duration::from_secs(300);
/// How soon a remote cluster whose API server did not answer the question
/// is asked again.
const TRUST_BUNDLE_RETRY: Duration = Duration::from_secs(10);

/// Whether a remote cluster takes the signer's ClusterTrustBundle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TrustBundleApi {
    /// Listing ClusterTrustBundles works: publish.
    Served,
    /// 404: the cluster does not serve `certificates.k8s.io/v1beta1`
    /// ClusterTrustBundles (a beta API, off unless enabled).
    NotServed,
    /// 403: meshca's account there may not list them (a remote secret made
    /// with an older `deploy/kustomize/remote-cluster`).
    Forbidden,
    /// No answer, or another error: asked again soon.
    Unknown,
}

/// Asks the cluster of `client` (within `timeout`) whether it takes the
/// ClusterTrustBundle.
async fn trust_bundle_api(client: &kube::Client, timeout: Duration) -> TrustBundleApi {
    let api: Api<k8s_openapi::api::certificates::v1beta1::ClusterTrustBundle> =
        Api::all(client.clone());
    let listed = tokio::time::timeout(timeout, api.list(&ListParams::default().limit(1))).await;
    match listed {
        Ok(Ok(_)) => TrustBundleApi::Served,
        Ok(Err(kube::Error::Api(e))) if e.code == 404 => TrustBundleApi::NotServed,
        Ok(Err(kube::Error::Api(e))) if e.code == 403 => TrustBundleApi::Forbidden,
        Ok(Err(_)) | Err(_) => TrustBundleApi::Unknown,
    }
}

/// The signer's ClusterTrustBundle in one remote cluster until dropped
/// (`cluster_trust_bundle::publish_cluster_trust_bundle`, as in the local
/// cluster), once that cluster serves the API and lets meshca's account
/// use it. Until then only the ConfigMaps go there: a cluster without the
/// API (a beta API, off by default) or without the RBAC is logged once
/// and asked again every 5 minutes, instead of a failed write every 2 s.
async fn publish_trust_bundle_into(
    client: kube::Client,
    authority: Arc<crate::authority::Authority>,
    signer: TrustBundleSigner,
    metrics: crate::metrics::Metrics,
    timeout: Duration,
) {
    let mut told = None;
    loop {
        let state = trust_bundle_api(&client, timeout).await;
        let pause = match state {
            TrustBundleApi::Served => break,
            TrustBundleApi::Unknown => TRUST_BUNDLE_RETRY,
            TrustBundleApi::NotServed | TrustBundleApi::Forbidden => {
                if told != Some(state) {
                    let why = match state {
                        TrustBundleApi::NotServed => "the cluster does not serve ClusterTrustBundles (certificates.k8s.io/v1beta1)",
                        _ => "meshca's account there may not list ClusterTrustBundles (deploy/kustomize/remote-cluster grants it)",
                    };
                    tracing::warn!(
                        signer = %signer.signer_name,
                        "{why}: the bundle goes there as ConfigMaps only; asked again every 5 minutes"
                    );
                    told = Some(state);
                }
                TRUST_BUNDLE_RECHECK
            }
        };
        tokio::time::sleep(pause).await;
    }
    if told.is_some() {
        tracing::info!(signer = %signer.signer_name, "the cluster takes the ClusterTrustBundle now");
    }
    crate::cluster::cluster_trust_bundle::publish_cluster_trust_bundle(
        client,
        authority,
        signer.signer_name,
        signer.trust_domain,
        metrics,
    )
    .await
}

/// The data of a remote secret, or `None` when it is not one (the label
/// removed: its clusters go).
fn remote_data(secret: &Secret) -> Option<BTreeMap<String, Vec<u8>>> {
    let labelled = secret
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(REMOTE_SECRET_LABEL))
        .is_some_and(|v| v == "true");
    labelled.then(|| {
        secret
            .data
            .as_ref()
            .map(|d| d.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect())
            .unwrap_or_default()
    })
}

/// Follows the remote secrets in `namespace` until dropped: every Secret
/// labelled `istio/multiCluster: "true"` added, changed or deleted takes
/// effect at once.
pub(crate) async fn watch_remote_secrets(
    client: kube::Client,
    namespace: String,
    clusters: Arc<RemoteClusters>,
) {
    let api: Api<Secret> = Api::namespaced(client, &namespace);
    let events = watcher::watcher(
        api,
        watcher::Config::default().labels(&format!("{REMOTE_SECRET_LABEL}=true")),
    );
    futures::pin_mut!(events);
    let mut retry = meshca_kube::WatchRetry::new("remote secrets");
    let mut listed: Vec<String> = Vec::new();
    while let Some(event) = events.next().await {
        retry.saw(&event);
        match event {
            Ok(Event::Apply(secret)) | Ok(Event::InitApply(secret)) => {
                let name = secret.metadata.name.clone().unwrap_or_default();
                listed.push(name.clone());
                let data = remote_data(&secret);
                clusters.apply_secret(&name, data.as_ref()).await;
            }
            Ok(Event::Delete(secret)) => {
                let name = secret.metadata.name.clone().unwrap_or_default();
                clusters.apply_secret(&name, None).await;
            }
            Ok(Event::Init) => listed.clear(),
            Ok(Event::InitDone) => clusters.retain_secrets(&listed).await,
            Err(e) => retry.failed(&e).await,
        }
    }
}

/// Asks `client`'s API server for `/version` every [`PROBE_INTERVAL`]:
/// `up` 1 when it answers within `timeout`, else 0.
async fn probe(client: kube::Client, cluster: String, up: Gauge, timeout: Duration) {
    let mut was_up = None;
    loop {
        let ok = matches!(
            tokio::time::timeout(timeout, client.apiserver_version()).await,
            Ok(Ok(_))
        );
        up.set(i64::from(ok));
        if was_up != Some(ok) {
            if ok {
                tracing::info!(cluster = %cluster, "remote cluster's API server answers");
            } else {
                tracing::warn!(cluster = %cluster, "remote cluster's API server does not answer; only its callers are affected");
            }
            was_up = Some(ok);
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

/// Finds the cluster's keys by OIDC discovery (tried again every 10 s
/// until it works; meanwhile its tokens go to TokenReview), then fetches
/// them again every 5 minutes.
async fn follow_keys(
    cluster: Weak<RemoteCluster>,
    client: kube::Client,
    issuer: String,
    settings: RemoteAuthnSettings,
) {
    let fetcher = Arc::new(KubernetesJwks::new(client).with_timeout(settings.timeout));
    let authn = loop {
        let Some(id) = cluster.upgrade().map(|c| c.id.clone()) else {
            return;
        };
        let found = async {
            let discovery = fetcher.discover().await?;
            if discovery.issuer != issuer {
                return Err(format!(
                    "--remote-cluster-jwt-issuer {issuer:?}, but the cluster's OIDC discovery says its issuer is {:?}",
                    discovery.issuer.chars().take(200).collect::<String>()
                ));
            }
            let jwks = fetcher.fetch_jwks().await?;
            JwtAuthenticator::from_jwks(
                "remote-kubernetes-oidc",
                &issuer,
                &jwks,
                settings.audiences.clone(),
                settings.trust_domain.clone(),
            )
            .map_err(|e| format!("the cluster's JWKS: {e}"))
        }
        .await;
        match found {
            Ok(authn) => {
                tracing::info!(cluster = %id, issuer = %issuer, "offline token validation with the remote cluster's keys");
                break Arc::new(
                    authn
                        .with_refresher(fetcher.clone())
                        .with_fetch_timeout(settings.timeout * 2)
                        .with_cache(settings.jwt_cache_ttl, settings.jwt_cache_entries)
                        .counting_cache_hits(settings.cache_hits.clone()),
                );
            }
            Err(e) => {
                tracing::warn!(cluster = %id, error = %e, "OIDC discovery of the remote cluster failed; its tokens go to TokenReview meanwhile");
                tokio::time::sleep(DISCOVERY_RETRY).await;
            }
        }
    };
    match cluster.upgrade() {
        Some(c) => *c.jwt.write().unwrap_or_else(|e| e.into_inner()) = Some(authn.clone()),
        None => return,
    }
    loop {
        tokio::time::sleep(JWKS_REFRESH_PERIOD).await;
        let Some(id) = cluster.upgrade().map(|c| c.id.clone()) else {
            return;
        };
        if let Err(e) = authn.refresh().await {
            tracing::warn!(cluster = %id, error = %e, "refreshing the remote cluster's JWKS failed; keeping the old keys");
        }
    }
}

/// Each remote cluster's TokenReviews may hold at most this share of
/// `--max-open-requests` waiting (plus its calls in flight), so that one
/// cluster whose API server is down or black-holed, under a storm of its
/// workloads, leaves the other clusters' requests seats to be served in.
pub(crate) const REMOTE_CLUSTER_SHARE_OF_OPEN_REQUESTS: usize = 8;

/// Reviews one remote cluster may have waiting: 1/8 of
/// `max_open_requests` (512 of the default 4,096).
fn remote_reviews_waiting(max_open_requests: usize) -> usize {
    (max_open_requests / REMOTE_CLUSTER_SHARE_OF_OPEN_REQUESTS).max(1)
}

/// Starts the remote clusters of `config`: the flags' at once (an error
/// stops the start), the remote secrets of `local` (client, meshca's
/// namespace) watched in the background.
pub(crate) async fn start(
    config: &crate::config::Config,
    authority: &Arc<crate::authority::Authority>,
    metrics: &crate::metrics::Metrics,
    local: Option<(kube::Client, String)>,
    background: &mut tokio::task::JoinSet<()>,
) -> Result<Arc<RemoteClusters>, String> {
    let settings = RemoteAuthnSettings {
        jwt_cache_entries: remote_cache_entries(config.remote.max_clusters).0,
        audiences: config.token_audiences.clone(),
        trust_domain: config.trust_domain.clone(),
        cache_ttl: config.kubernetes.token_review_cache_ttl,
        refusal_cache_ttl: config.kubernetes.token_review_refusal_cache_ttl,
        jwt_cache_ttl: config.jwt_cache_ttl,
        timeout: config.kubernetes.api_timeout,
        max_in_flight: config.kubernetes.api_max_in_flight,
        max_waiting: remote_reviews_waiting(config.max_open_requests),
        client_certificates: config.allow_cert_renewal.then(|| {
            Arc::new(crate::authn::ClientCertAuthenticator::new(
                authority.clone(),
                config.trust_domain.clone(),
            )) as Arc<dyn Authenticator>
        }),
        cache_hits: metrics.token_cache_hits.clone(),
        node_agents: config.trusted_node_agents.clone(),
        pod_watch_failure_limit: config.pod_watch_failure_limit,
    };
    let trust_bundle = config
        .cluster
        .pod_certificate_signer
        .clone()
        .map(|signer_name| TrustBundleSigner {
            signer_name,
            trust_domain: config.trust_domain.to_string(),
        });
    let clusters = Arc::new(RemoteClusters::new(
        config.cluster_id.clone(),
        config.remote.clone(),
        settings,
        metrics.remote_clusters.clone(),
        trust_bundle,
    ));
    clusters.add_static().await?;
    if let Some((client, namespace)) = local {
        tracing::info!(namespace = %namespace, "watching remote secrets (label {REMOTE_SECRET_LABEL}=true)");
        background.spawn(watch_remote_secrets(client, namespace, clusters.clone()));
    }
    Ok(clusters)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(clusters: &[&str], issuers: &[&str]) -> RemoteClusterArgs {
        RemoteClusterArgs {
            remote_clusters: clusters.iter().map(|s| s.to_string()).collect(),
            remote_jwt_issuers: issuers.iter().map(|s| s.to_string()).collect(),
            max_remote_clusters: 2,
        }
    }

    #[test]
    fn flags_are_checked() {
        let ok = RemoteClusterConfig::from_args(
            args(&["west=/k/west", "east=/k/east"], &["west=https://west"]),
            "Kubernetes",
        )
        .unwrap();
        assert_eq!(ok.static_clusters.len(), 2);
        assert_eq!(ok.jwt_issuers["west"], "https://west");
        for (clusters, issuers, want) in [
            (&["west"][..], &[][..], "must be ID=VALUE"),
            (&["Kubernetes=/k"][..], &[][..], "names the local cluster"),
            (&["a b=/k"][..], &[][..], "cluster ID must be"),
            (&["west=/a", "west=/b"][..], &[][..], "given twice"),
            (
                &["a=/a", "b=/b", "c=/c"][..],
                &[][..],
                "more than --max-remote-clusters",
            ),
            (&[][..], &["west="][..], "nothing after"),
        ] {
            let e = RemoteClusterConfig::from_args(args(clusters, issuers), "Kubernetes")
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{clusters:?} {issuers:?}: {e}");
        }
    }

    #[test]
    fn a_remote_secret_may_not_run_programs_or_read_files() {
        let base = "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://10.0.0.1\n";
        let user = |extra: &str| {
            format!("{base}users:\n- name: u\n  user:\n{extra}contexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n")
        };
        let ok = kube::config::Kubeconfig::from_yaml(&user("    token: abc\n")).unwrap();
        assert!(sanitize(&ok).is_ok());
        for (extra, want) in [
            ("    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/sh\n", "exec"),
            ("    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n", "tokenFile"),
            ("    client-certificate: /etc/x.crt\n    client-key: /etc/x.key\n", "client-certificate"),
            ("    auth-provider:\n      name: gcp\n", "auth provider"),
        ] {
            let config = kube::config::Kubeconfig::from_yaml(&user(extra)).unwrap();
            let e = sanitize(&config).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains("/bin/sh") && !e.contains("/etc/x"), "{e}");
        }
        let ca_file = base.replace(
            "server: https://10.0.0.1",
            "server: https://10.0.0.1\n    certificate-authority: /etc/ca.pem",
        );
        let config = kube::config::Kubeconfig::from_yaml(&ca_file).unwrap();
        assert!(sanitize(&config)
            .unwrap_err()
            .to_string()
            .contains("certificate-authority"));
    }

    #[test]
    fn remote_caches_share_the_local_bound() {
        assert_eq!(remote_cache_entries(64), (781, 156));
        assert_eq!(remote_cache_entries(1), (50_000, 10_000));
        assert_eq!(remote_cache_entries(0), (50_000, 10_000));
        assert_eq!(remote_cache_entries(10_000), (128, 128));
    }

    /// A client whose every request is answered `status` with `body`.
    fn answering(status: u16, body: serde_json::Value) -> kube::Client {
        let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
            let body = body.clone();
            async move {
                assert_eq!(
                    request.uri().path(),
                    "/apis/certificates.k8s.io/v1beta1/clustertrustbundles"
                );
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(axum::body::Body::from(body.to_string()))
                        .unwrap(),
                )
            }
        });
        kube::Client::new(service, "default")
    }

    fn status(code: u16, reason: &str) -> serde_json::Value {
        serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": reason, "reason": reason, "code": code,
        })
    }

    #[tokio::test]
    async fn a_cluster_without_the_trust_bundle_api_or_its_rbac_is_told_apart() {
        let list = serde_json::json!({
            "kind": "ClusterTrustBundleList", "apiVersion": "certificates.k8s.io/v1beta1",
            "metadata": {"resourceVersion": "1"}, "items": [],
        });
        let timeout = Duration::from_secs(5);
        for (client, want) in [
            (answering(200, list), TrustBundleApi::Served),
            (
                answering(404, status(404, "NotFound")),
                TrustBundleApi::NotServed,
            ),
            (
                answering(403, status(403, "Forbidden")),
                TrustBundleApi::Forbidden,
            ),
            (
                answering(500, status(500, "InternalError")),
                TrustBundleApi::Unknown,
            ),
        ] {
            assert_eq!(trust_bundle_api(&client, timeout).await, want);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_cluster_is_unknown_after_the_timeout() {
        let service = tower::service_fn(|_: http::Request<kube::client::Body>| async {
            futures::future::pending::<
                Result<http::Response<axum::body::Body>, std::convert::Infallible>,
            >()
            .await
        });
        let client = kube::Client::new(service, "default");
        assert_eq!(
            trust_bundle_api(&client, Duration::from_secs(5)).await,
            TrustBundleApi::Unknown
        );
    }

    #[test]
    fn cluster_ids_are_secret_keys() {
        for id in ["west", "cluster-1", "eu.prod_2"] {
            assert!(valid_cluster_id(id), "{id}");
        }
        for id in ["", "a b", "a/b", "é", &"x".repeat(254)] {
            assert!(!valid_cluster_id(id), "{id}");
        }
    }
}
