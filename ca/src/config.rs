//! Configuration of `meshca serve`: the command line (every flag also as a
//! `MESHCA_<FLAG>` environment variable) parsed once into [`Config`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use meshca_certs::{parse_duration, TrustDomain};

use crate::authority::TtlPolicy;

/// Default gRPC+TLS address (istiod's port).
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:15012";
/// Default monitoring address (istiod's port).
pub(crate) const DEFAULT_MONITORING_LISTEN: &str = "127.0.0.1:15014";
/// Default data directory of the embedded mode.
pub(crate) const DEFAULT_DATA_DIR: &str = "./meshca-data";
/// DNS names always on the server's own certificate.
pub(crate) const DEFAULT_SERVER_DNS: [&str; 2] = ["istiod.istio-system.svc", "localhost"];
/// Default cluster ID, as Istio's.
pub(crate) const DEFAULT_CLUSTER_ID: &str = "Kubernetes";

/// gRPC connections open at once unless `--max-connections` says
/// otherwise. With [`DEFAULT_MAX_OPEN_REQUESTS`], what [`memory_bound`]
/// keeps well inside the Deployment's memory limit of 256 MiB (docs/flags.md,
/// "Memory", has the formula; a test of the manifests checks it). A
/// mass restart with a connection per sidecar drains faster with fewer
/// seats, not slower: each connection lasts a handshake and a request, a
/// newcomer waits a moment in the listen queue for a seat, and at the cap
/// an idle connection makes room (docs/benchmarks-history.md, "A connection per
/// sidecar, with eviction and a seat wait").
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;

/// gRPC connections open at once from one source address unless
/// `--max-connections-per-source` says otherwise. A sidecar or a ztunnel
/// keeps one connection to the CA, or a few while one is replaced (a
/// GOAWAY at `--max-connection-age`, a reconnect), and every pod has an
/// address of its own; a node's ztunnel or node agent is one source for
/// all the pods of its node, over one or a few connections; 64 is far
/// above all of these, and one address holding every seat is not.
pub const DEFAULT_MAX_CONNECTIONS_PER_SOURCE: u32 = 64;

/// The server's resident memory at rest (release build: the CA material,
/// the caches, the runtime), measured before every hostile-load scenario
/// (docs/benchmarks-history.md, "Hostile load, after the limits") and rounded up.
pub const MEMORY_AT_REST: u64 = 16 << 20;
/// Resident memory of one open gRPC connection, TLS and HTTP/2 included,
/// at its worst: in a storm of new connections, each with its handshake
/// just done and its first request (docs/benchmarks-history.md, "A connection per
/// sidecar, with eviction and a seat wait"), rounded up.
pub(crate) const MEMORY_PER_CONNECTION: u64 = 96 << 10;
/// Resident memory of one open request at its worst: 8 KiB measured for
/// its HTTP/2 stream, its task and its place in a queue in a mass restart
/// over 64 shared connections (docs/benchmarks-history.md, "A connection per sidecar,
/// final code"), plus, for a caller that authenticated and then sends a
/// largest message slowly, one message in tonic's decoder and one stream
/// window unread in h2 (8 KiB each), rounded up (docs/flags.md, "Memory").
pub(crate) const MEMORY_PER_OPEN_REQUEST: u64 = 25 << 10;

/// The most gRPC health requests (`Check`, `Watch`) open at once across
/// every connection, in a pool apart from `--max-open-requests` (anyone
/// may send them, without credentials); one more is answered
/// `RESOURCE_EXHAUSTED` at its HEADERS. Kubernetes probes the CA over HTTP
/// on the monitoring port, so these serve only gRPC clients that check
/// health themselves.
pub const MAX_HEALTH_REQUESTS: usize = 64;

/// The most resident memory `max_connections` connections and
/// `max_open_requests` open requests can make the server use: the sum of
/// [`MEMORY_AT_REST`] and the measured cost of each, the health requests'
/// places ([`MAX_HEALTH_REQUESTS`]) included (docs/flags.md, "Memory").
pub const fn memory_bound(max_connections: u64, max_open_requests: u64) -> u64 {
    MEMORY_AT_REST
        + max_connections * MEMORY_PER_CONNECTION
        + (max_open_requests + MAX_HEALTH_REQUESTS as u64) * MEMORY_PER_OPEN_REQUEST
}

/// gRPC requests (HTTP/2 streams) open at once across every connection
/// unless `--max-open-requests` says otherwise: 32 node agents' or shared
/// connections' worth of `--max-concurrent-streams`, and what
/// [`memory_bound`] keeps inside the Deployment's limit at the worst cost
/// of a request (docs/flags.md, "Memory"). A request beyond it is refused at its
/// HEADERS, before anything is read, and its client comes back.
pub const DEFAULT_MAX_OPEN_REQUESTS: u32 = 4096;

/// HTTP/2 streams (requests) one connection may have open at once unless
/// `--max-concurrent-streams` says otherwise. A node agent such as ztunnel
/// asks for every pod of its node over one connection; beyond this many
/// its HTTP/2 client holds further requests until an answer frees a
/// stream, so a burst waits in the clients, not in the CA's memory
/// (docs/benchmarks-history.md has the peak memory and drain time for 64 to 256). 128
/// is nginx's default and above the 100 RFC 9113 recommends as the least;
/// a node (110 pods by Kubernetes' default) fits in it.
pub(crate) const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 128;

/// Flags of `meshca serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// gRPC+TLS address.
    #[arg(long, env = "MESHCA_LISTEN", default_value = DEFAULT_LISTEN)]
    pub(crate) listen: SocketAddr,

    /// Address of /metrics, /ready and /healthz.
    #[arg(long, env = "MESHCA_MONITORING_LISTEN", default_value = DEFAULT_MONITORING_LISTEN)]
    pub(crate) monitoring_listen: SocketAddr,

    /// Embedded state: self-signed root, local token issuer, root-cert.pem.
    #[arg(long, env = "MESHCA_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub(crate) data_dir: PathBuf,

    /// Plugged-in CA directory (ca-cert.pem ca-key.pem cert-chain.pem
    /// root-cert.pem, or tls.crt tls.key ca.crt).
    #[arg(long, env = "MESHCA_CA_DIR")]
    pub(crate) ca_dir: Option<PathBuf>,

    /// Trust domain of issued SPIFFE IDs.
    #[arg(long, env = "MESHCA_TRUST_DOMAIN", default_value = meshca_certs::spiffe::DEFAULT_TRUST_DOMAIN)]
    pub(crate) trust_domain: TrustDomain,

    /// Default workload certificate lifetime (when a request asks for 0).
    #[arg(long, env = "MESHCA_WORKLOAD_CERT_TTL", default_value = "24h", value_parser = parse_duration)]
    pub(crate) workload_cert_ttl: Duration,

    /// Longest workload certificate lifetime a request may ask for.
    #[arg(long, env = "MESHCA_MAX_WORKLOAD_CERT_TTL", default_value = "90d", value_parser = parse_duration)]
    pub(crate) max_workload_cert_ttl: Duration,

    /// Accepted token audience; repeatable (env: comma-separated).
    #[arg(
        long = "token-audience",
        env = "MESHCA_TOKEN_AUDIENCE",
        value_delimiter = ',',
        default_value = "istio-ca"
    )]
    pub(crate) token_audiences: Vec<String>,

    /// JWKS file of an external token issuer (offline validation); needs --jwt-issuer.
    #[arg(long, env = "MESHCA_JWKS", requires = "jwt_issuer")]
    pub(crate) jwks: Option<PathBuf>,

    /// The `iss` of tokens validated offline: with --jwks from that file;
    /// without it, the keys come from the Kubernetes API's OIDC discovery.
    #[arg(long, env = "MESHCA_JWT_ISSUER")]
    pub(crate) jwt_issuer: Option<String>,

    /// How long a token that passed offline validation is accepted again
    /// without checking its signature (never past its `exp`; forgotten when
    /// the keys change); 0 checks every request. The Kubernetes API server
    /// caches its own token checks for 10 s the same way.
    #[arg(long, env = "MESHCA_JWT_CACHE_TTL", default_value = "10s", value_parser = parse_duration)]
    pub(crate) jwt_cache_ttl: Duration,

    /// Kubernetes API access (TokenReview). In a pod, the in-cluster
    /// service account is used without this flag.
    #[arg(long, env = "MESHCA_KUBECONFIG")]
    pub(crate) kubeconfig: Option<PathBuf>,

    /// How long a positive TokenReview result is reused (never past the
    /// token's expiry); 0 turns the cache off.
    #[arg(long, env = "MESHCA_TOKEN_REVIEW_CACHE_TTL", default_value = "30s", value_parser = parse_duration)]
    pub(crate) token_review_cache_ttl: Duration,

    /// How long a token the Kubernetes API refused is refused again without
    /// asking (never past the token's expiry); 0 asks every time.
    #[arg(long, env = "MESHCA_TOKEN_REVIEW_REFUSAL_CACHE_TTL", default_value = "5s", value_parser = parse_duration)]
    pub(crate) token_review_refusal_cache_ttl: Duration,

    /// Timeout of each Kubernetes API call.
    #[arg(long, env = "MESHCA_KUBE_API_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub(crate) kube_api_timeout: Duration,

    /// Most Kubernetes API calls in flight at once.
    #[arg(long, env = "MESHCA_KUBE_API_MAX_IN_FLIGHT", default_value_t = 64)]
    pub(crate) kube_api_max_in_flight: usize,

    /// How long start-up waits for the Kubernetes API (unreachable,
    /// starting, RBAC not synced yet) before giving up; `/ready` says what
    /// it waits for meanwhile.
    #[arg(long, env = "MESHCA_KUBE_API_STARTUP_TIMEOUT", default_value = "5m", value_parser = parse_duration)]
    pub(crate) kube_api_startup_timeout: Duration,

    /// A node agent (NAMESPACE/SERVICE_ACCOUNT, e.g. istio-system/ztunnel)
    /// that may get certificates for pods on its node; repeatable.
    #[arg(
        long = "trusted-node-agent",
        env = "MESHCA_TRUSTED_NODE_AGENT",
        value_delimiter = ','
    )]
    pub(crate) trusted_node_agents: Vec<String>,

    /// Extra DNS SANs for the server's own TLS certificate; repeatable.
    #[arg(long = "server-dns", env = "MESHCA_SERVER_DNS", value_delimiter = ',')]
    pub(crate) server_dns: Vec<String>,

    /// This cluster's ID; requests naming another cluster in the
    /// `clusterid` header are refused.
    #[arg(long, env = "MESHCA_CLUSTER_ID", default_value = DEFAULT_CLUSTER_ID)]
    pub(crate) cluster_id: String,

    /// Most CreateCertificate requests handled at once; more wait briefly,
    /// then get RESOURCE_EXHAUSTED.
    #[arg(long, env = "MESHCA_MAX_CONCURRENT_REQUESTS", default_value_t = 256)]
    pub(crate) max_concurrent_requests: usize,

    /// HTTP/2 streams (requests) one connection may have open at once;
    /// a client asking for more waits in its HTTP/2 layer until an answer
    /// frees a stream. Bounds what a burst puts in the CA's memory.
    #[arg(
        long,
        env = "MESHCA_MAX_CONCURRENT_STREAMS",
        default_value_t = DEFAULT_MAX_STREAMS_PER_CONNECTION,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub(crate) max_concurrent_streams: u32,

    /// A connection older than this is asked to reconnect (HTTP/2 GOAWAY;
    /// its requests in flight finish first), so clients spread over the
    /// replicas after a rollout and idle connections do not stay open
    /// forever; 0: never. Istio's istiod uses 30m.
    #[arg(long, env = "MESHCA_MAX_CONNECTION_AGE", default_value = "30m", value_parser = parse_duration)]
    pub(crate) max_connection_age: Duration,

    /// A connection with no open stream (request) for this long is asked
    /// to go away (HTTP/2 GOAWAY), gRPC's MAX_CONNECTION_IDLE; its client
    /// reconnects on its next call. 0: never.
    #[arg(long, env = "MESHCA_MAX_CONNECTION_IDLE", default_value = "5m", value_parser = parse_duration)]
    pub(crate) max_connection_idle: Duration,

    /// gRPC connections open at once (in their TLS handshake or
    /// established). When they are all open, a new connection takes the
    /// seat of the one idle longest (see `--evict-idle-connections-after`),
    /// or waits a moment in the listen queue for a seat; failing both it
    /// is closed as soon as it is accepted. Sized from the memory limit
    /// (docs/flags.md, "Memory").
    #[arg(
        long,
        env = "MESHCA_MAX_CONNECTIONS",
        default_value_t = DEFAULT_MAX_CONNECTIONS,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub(crate) max_connections: u32,

    /// gRPC connections open at once from one source address. A new one
    /// beyond it takes the seat of one of that source's connections that
    /// has made no authenticated request (a stalled handshake, one
    /// established 2 s ago without one) or is idle (see
    /// `--evict-idle-connections-after`), and is closed as soon as it is
    /// accepted otherwise. The default is far above what an honest client
    /// holds: a sidecar or ztunnel keeps one connection or a few, every
    /// pod has its own address, a node's ztunnel is one source over a few
    /// connections. Clients behind one address (a NAT, an east-west
    /// gateway in front of a remote cluster's sidecars, hostNetwork pods)
    /// are the exception: raise it for them; 0: no bound.
    #[arg(
        long,
        env = "MESHCA_MAX_CONNECTIONS_PER_SOURCE",
        default_value_t = DEFAULT_MAX_CONNECTIONS_PER_SOURCE
    )]
    pub(crate) max_connections_per_source: u32,

    /// gRPC requests (HTTP/2 streams) open at once across all connections;
    /// one beyond it is answered RESOURCE_EXHAUSTED before its message is
    /// read. Sized from the memory limit (docs/flags.md, "Memory").
    #[arg(
        long,
        env = "MESHCA_MAX_OPEN_REQUESTS",
        default_value_t = DEFAULT_MAX_OPEN_REQUESTS,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub(crate) max_open_requests: u32,

    /// While `--max-connections` are open, a new connection makes room by
    /// asking the connection that has had no open stream for longest to go
    /// away (HTTP/2 GOAWAY), if that one has been idle at least this long;
    /// so connections held idle (a flood, or sidecars that keep theirs
    /// between renewals) cannot lock new clients out. 0: never.
    #[arg(long, env = "MESHCA_EVICT_IDLE_CONNECTIONS_AFTER", default_value = "10s", value_parser = parse_duration)]
    pub(crate) evict_idle_connections_after: Duration,

    /// A client that has not completed its TLS handshake this long after
    /// connecting is dropped.
    #[arg(long, env = "MESHCA_TLS_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    pub(crate) tls_handshake_timeout: Duration,

    /// A request not answered within this time is ended with CANCELLED
    /// (a shorter `grpc-timeout` from the client wins), so a client that
    /// opens a request and never finishes sending it holds nothing for long.
    #[arg(long, env = "MESHCA_REQUEST_TIMEOUT", default_value = "30s", value_parser = parse_positive_duration)]
    pub(crate) request_timeout: Duration,

    /// Time allowed for in-flight requests to finish on SIGTERM/SIGINT.
    #[arg(long, env = "MESHCA_SHUTDOWN_GRACE", default_value = "15s", value_parser = parse_duration)]
    pub(crate) shutdown_grace: Duration,

    /// Refuse to sign, and fail /ready, when the signing certificate
    /// expires within this margin.
    #[arg(long, env = "MESHCA_CA_EXPIRY_MARGIN", default_value = "10m", value_parser = parse_duration)]
    pub(crate) ca_expiry_margin: Duration,

    /// How often the files of --ca-dir are checked for a change (a mounted
    /// Secret is updated by a symlink swap).
    #[arg(long, env = "MESHCA_CA_DIR_CHECK_INTERVAL", default_value = "2s", value_parser = parse_duration)]
    pub(crate) ca_dir_check_interval: Duration,

    /// The CA key in an HSM: --ca-key-pkcs11 and the --hsm-* flags.
    #[command(flatten)]
    pub(crate) hsm: crate::hsm::HsmArgs,

    /// A new CRL (ca-crl.pem, istio-ca-crl) at least this often, and on
    /// every change of the revocation list; its nextUpdate is twice this.
    #[arg(long, env = "MESHCA_CRL_REFRESH", default_value = "1h", value_parser = parse_positive_duration)]
    pub(crate) crl_refresh: Duration,

    /// Unexpired certificates this replica remembers (serial, identity,
    /// node, notAfter), so revoking an identity lists all its serials in
    /// the CRL; the oldest beyond it are forgotten (0: none).
    #[arg(long, env = "MESHCA_ISSUED_RECORD_SIZE", default_value_t = crate::revocation::DEFAULT_ISSUED_RECORD_SIZE)]
    pub(crate) issued_record_size: usize,

    /// meshca's own namespace in the cluster: where the Secret
    /// `istio-ca-secret` and the leader-election Lease live. Default:
    /// $POD_NAMESPACE, else the kubeconfig's namespace.
    #[arg(long, env = "MESHCA_NAMESPACE")]
    pub(crate) namespace: Option<String>,

    /// Lifetime of a self-signed root made by meshca.
    #[arg(long, env = "MESHCA_SELF_SIGNED_ROOT_TTL", default_value = "3650d", value_parser = parse_duration)]
    pub(crate) self_signed_root_ttl: Duration,

    /// In a cluster, the self-signed root is rotated once this fraction of
    /// its lifetime has passed (0 < f < 1).
    #[arg(long, env = "MESHCA_ROOT_ROTATION_AT", default_value_t = 0.8)]
    pub(crate) root_rotation_at: f64,

    /// During a root rotation, how long both roots are published before
    /// signing switches to the new one (time for clients to pick up the
    /// bundle). Default: half of --workload-cert-ttl plus 1h (13h), so a
    /// client that learns roots only when it renews renews in time.
    #[arg(long, env = "MESHCA_ROOT_ROTATION_GRACE", value_parser = parse_duration)]
    pub(crate) root_rotation_grace: Option<Duration>,

    /// Namespaces that get no `istio-ca-root-cert` ConfigMap; repeatable.
    #[arg(
        long = "bundle-exclude-namespace",
        env = "MESHCA_BUNDLE_EXCLUDE_NAMESPACE",
        value_delimiter = ',',
        default_value = "kube-system,kube-public,kube-node-lease,local-path-storage"
    )]
    pub(crate) bundle_exclude_namespaces: Vec<String>,

    /// Leader-election Lease duration (the leader renews well before it ends).
    #[arg(long, env = "MESHCA_LEADER_LEASE_DURATION", default_value = "15s", value_parser = parse_duration)]
    pub(crate) leader_lease_duration: Duration,

    /// Whether a caller may renew with a client certificate this CA issued
    /// (mTLS, no token). The new certificate is never longer-lived than the
    /// one presented; `false` requires a service-account token every time.
    #[arg(long, env = "MESHCA_ALLOW_CERT_RENEWAL", default_value_t = true, action = clap::ArgAction::Set)]
    pub(crate) allow_cert_renewal: bool,

    /// Certificates one identity (per pod, when the caller's token names
    /// one) may get at once before the rate limit applies; 0 turns the
    /// per-identity rate limit off.
    #[arg(long, env = "MESHCA_ISSUANCE_BURST", default_value_t = crate::rate_limit::DEFAULT_BURST)]
    pub(crate) issuance_burst: u32,

    /// After the burst, one more certificate per identity per this
    /// interval; beyond it RESOURCE_EXHAUSTED with a retry hint.
    #[arg(long, env = "MESHCA_ISSUANCE_INTERVAL", default_value = "1s", value_parser = parse_positive_duration)]
    pub(crate) issuance_interval: Duration,

    /// Identities the rate limit tracks at once (memory bound; an identity
    /// beyond it is not limited until others age out).
    #[arg(long, env = "MESHCA_ISSUANCE_RATE_LIMIT_KEYS", default_value_t = crate::rate_limit::DEFAULT_MAX_KEYS)]
    pub(crate) issuance_rate_limit_keys: usize,

    /// With --trusted-node-agent: when the pod watch has been failing this
    /// long, the pod index counts as stale and impersonation is refused
    /// with UNAVAILABLE until the watch recovers.
    #[arg(long, env = "MESHCA_POD_WATCH_FAILURE_LIMIT", default_value = "30s", value_parser = parse_positive_duration)]
    pub(crate) pod_watch_failure_limit: Duration,

    /// Sign Kubernetes PodCertificateRequests of this signer name (e.g.
    /// meshca.io/spiffe) and publish its ClusterTrustBundle (leader only).
    /// Off when not given.
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_SIGNER")]
    pub(crate) pod_certificate_signer: Option<String>,

    /// Log format: text or json.
    #[arg(long, env = "MESHCA_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,

    /// JWT-SVIDs and the OIDC discovery endpoint.
    #[command(flatten)]
    pub(crate) jwt_svid: crate::jwt_svid::JwtSvidArgs,

    /// Remote clusters: --remote-cluster, --remote-cluster-jwt-issuer, --max-remote-clusters.
    #[command(flatten)]
    pub(crate) remote: crate::cluster::remote::RemoteClusterArgs,
}

/// Errors in a configuration that parsed but does not make sense.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The default TTL is above the maximum.
    #[error("--workload-cert-ttl ({default:?}) is longer than --max-workload-cert-ttl ({max:?})")]
    DefaultAboveMax {
        /// --workload-cert-ttl
        default: Duration,
        /// --max-workload-cert-ttl
        max: Duration,
    },
    /// A TTL of zero.
    #[error("{flag} must be more than zero")]
    ZeroTtl {
        /// Which flag.
        flag: &'static str,
    },
    /// No audience.
    #[error("--token-audience must name at least one audience")]
    NoAudience,
    /// A concurrency limit of zero.
    #[error("--max-concurrent-requests must be at least 1")]
    ZeroConcurrency,
    /// A malformed --trusted-node-agent.
    #[error(
        "--trusted-node-agent {0:?} must be NAMESPACE/SERVICE_ACCOUNT, e.g. istio-system/ztunnel"
    )]
    BadNodeAgent(String),
    /// An invalid DNS name.
    #[error("--server-dns {0:?} is not a valid DNS name")]
    BadDnsName(String),
    /// The HSM flags are unusable.
    #[error(transparent)]
    Hsm(#[from] crate::hsm::HsmConfigError),
    /// A rotation fraction outside (0, 1).
    #[error("--root-rotation-at {0} must be between 0 and 1 (a fraction of the root's lifetime)")]
    BadRotationFraction(f64),
    /// A lease duration too short to renew.
    #[error("--leader-lease-duration must be at least 2s")]
    ShortLease,
    /// A signer name the API would refuse, or one reserved for Kubernetes.
    #[error("--pod-certificate-signer {name:?}: {reason}")]
    BadPodCertificateSigner {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A JWT-SVID flag that does not make sense.
    #[error(transparent)]
    JwtSvid(#[from] crate::jwt_svid::JwtSvidConfigError),
    /// A remote-cluster flag that does not make sense.
    #[error("{0}")]
    RemoteCluster(String),
    /// Pod certificates must live at least an hour (the API's minimum).
    #[error("--pod-certificate-signer needs --max-workload-cert-ttl of at least 1h (pod certificates live at least an hour); it is {0:?}")]
    PodCertificateTtlTooShort(Duration),
}

/// Validated configuration of the CA server.
#[derive(Debug, Clone)]
pub struct Config {
    /// gRPC+TLS address.
    pub(crate) listen: SocketAddr,
    /// Monitoring address.
    pub(crate) monitoring_listen: SocketAddr,
    /// Data directory.
    pub(crate) data_dir: PathBuf,
    /// Plugged-in CA directory, if any.
    pub(crate) ca_dir: Option<PathBuf>,
    /// Trust domain.
    pub(crate) trust_domain: TrustDomain,
    /// Default and maximum workload certificate lifetimes.
    pub(crate) ttl: TtlPolicy,
    /// Accepted token audiences.
    pub(crate) token_audiences: Vec<String>,
    /// External JWKS and its issuer.
    pub(crate) external_jwt: Option<(PathBuf, String)>,
    /// Issuer whose keys come from the Kubernetes API's OIDC discovery.
    pub(crate) discovered_jwt_issuer: Option<String>,
    /// How long a token that passed offline validation is reused.
    pub(crate) jwt_cache_ttl: Duration,
    /// All DNS names of the server certificate.
    pub(crate) server_dns: Vec<String>,
    /// Kubernetes API access.
    pub(crate) kubernetes: KubernetesConfig,
    /// Trusted node agents (namespace, service account).
    pub(crate) trusted_node_agents: Vec<(String, String)>,
    /// This cluster's ID.
    pub(crate) cluster_id: String,
    /// Concurrency limit of CreateCertificate.
    pub(crate) max_concurrent_requests: usize,
    /// HTTP/2 streams one connection may have open at once.
    pub(crate) max_concurrent_streams: u32,
    /// Connections older than this get a GOAWAY (`None`: never).
    pub(crate) max_connection_age: Option<Duration>,
    /// Longest time a request is served before it is cancelled.
    pub(crate) request_timeout: Duration,
    /// Connections with no open stream this long get a GOAWAY (`None`: never).
    pub(crate) max_connection_idle: Option<Duration>,
    /// gRPC connections open at once; more evict an idle one, wait, or
    /// are closed at accept.
    pub(crate) max_connections: usize,
    /// gRPC connections open at once from one source address (`None`:
    /// no bound).
    pub(crate) max_connections_per_source: Option<usize>,
    /// At the connection cap, the connection idle longest is asked to go
    /// away for a new one if idle at least this long (`None`: never).
    pub(crate) evict_idle_connections_after: Option<Duration>,
    /// gRPC requests open at once across all connections; more are refused.
    pub(crate) max_open_requests: usize,
    /// Longest time a TLS handshake may take.
    pub(crate) tls_handshake_timeout: Duration,
    /// Drain time on shutdown.
    pub(crate) shutdown_grace: Duration,
    /// Signing stops this long before the signing certificate expires.
    pub(crate) ca_expiry_margin: Duration,
    /// How often --ca-dir is checked for changes.
    pub(crate) ca_dir_check_interval: Duration,
    /// The CA key in an HSM (--ca-key-pkcs11), if it is.
    pub(crate) hsm: Option<crate::hsm::HsmConfig>,
    /// A new CRL at least this often (nextUpdate: twice this).
    pub(crate) crl_refresh: Duration,
    /// Unexpired certificates remembered for the CRL.
    pub(crate) issued_record_size: usize,
    /// In-cluster state: Secret, ConfigMaps, Lease, root rotation.
    pub(crate) cluster: ClusterConfig,
    /// Whether renewal by client certificate is allowed.
    pub(crate) allow_cert_renewal: bool,
    /// The per-identity issuance rate limit.
    pub(crate) rate_limit: crate::rate_limit::RateLimitPolicy,
    /// How long the pod watch may fail before impersonation is refused.
    pub(crate) pod_watch_failure_limit: Duration,
    /// JWT-SVIDs: lifetimes, keys, issuer, the OIDC endpoint.
    pub(crate) jwt_svid: crate::jwt_svid::JwtSvidConfig,
    /// Remote clusters given by flags, their offline issuers, the bound.
    pub(crate) remote: crate::cluster::remote::RemoteClusterConfig,
}

/// How meshca keeps its state in a cluster (docs/cluster.md).
#[derive(Debug, Clone)]
pub(crate) struct ClusterConfig {
    /// meshca's namespace, if given (else $POD_NAMESPACE or the kubeconfig's).
    pub(crate) namespace: Option<String>,
    /// Lifetime of a self-signed root.
    pub(crate) root_ttl: Duration,
    /// Fraction of the root's life after which it is rotated.
    pub(crate) rotation_at: f64,
    /// Both roots are published this long before signing switches.
    pub(crate) rotation_grace: Duration,
    /// Namespaces without the bundle ConfigMap.
    pub(crate) bundle_excluded_namespaces: Vec<String>,
    /// Leader-election Lease duration.
    pub(crate) lease_duration: Duration,
    /// The PodCertificateRequest signer name served, if any.
    pub(crate) pod_certificate_signer: Option<String>,
}

/// How meshca reaches the Kubernetes API.
#[derive(Debug, Clone)]
pub(crate) struct KubernetesConfig {
    /// Explicit kubeconfig; without it, in-cluster config when in a pod.
    pub(crate) kubeconfig: Option<PathBuf>,
    /// TokenReview positive cache lifetime.
    pub(crate) token_review_cache_ttl: Duration,
    /// How long a refused token is refused again without a TokenReview.
    pub(crate) token_review_refusal_cache_ttl: Duration,
    /// Per-call timeout.
    pub(crate) api_timeout: Duration,
    /// Calls in flight.
    pub(crate) api_max_in_flight: usize,
    /// How long start-up waits for the API.
    pub(crate) startup_timeout: Duration,
}

impl TryFrom<ServeArgs> for Config {
    type Error = ConfigError;

    fn try_from(args: ServeArgs) -> Result<Self, ConfigError> {
        let hsm = args.hsm.clone().into_config(args.ca_expiry_margin)?;
        if args.workload_cert_ttl.is_zero() {
            return Err(ConfigError::ZeroTtl {
                flag: "--workload-cert-ttl",
            });
        }
        if args.max_workload_cert_ttl.is_zero() {
            return Err(ConfigError::ZeroTtl {
                flag: "--max-workload-cert-ttl",
            });
        }
        if args.workload_cert_ttl > args.max_workload_cert_ttl {
            return Err(ConfigError::DefaultAboveMax {
                default: args.workload_cert_ttl,
                max: args.max_workload_cert_ttl,
            });
        }
        let token_audiences: Vec<String> = args
            .token_audiences
            .into_iter()
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .collect();
        if token_audiences.is_empty() {
            return Err(ConfigError::NoAudience);
        }
        if args.max_concurrent_requests == 0 {
            return Err(ConfigError::ZeroConcurrency);
        }
        if !(args.root_rotation_at > 0.0 && args.root_rotation_at < 1.0) {
            return Err(ConfigError::BadRotationFraction(args.root_rotation_at));
        }
        if args.self_signed_root_ttl.is_zero() {
            return Err(ConfigError::ZeroTtl {
                flag: "--self-signed-root-ttl",
            });
        }
        if args.leader_lease_duration < Duration::from_secs(2) {
            return Err(ConfigError::ShortLease);
        }
        let pod_certificate_signer = match args.pod_certificate_signer.map(|s| s.trim().to_string())
        {
            None => None,
            Some(name) if name.is_empty() => None,
            Some(name) => {
                let refuse = |reason: String| ConfigError::BadPodCertificateSigner {
                    name: name.clone(),
                    reason,
                };
                meshca_certs::pod_certificate::validate_signer_name(&name).map_err(refuse)?;
                if meshca_certs::pod_certificate::is_kubernetes_signer(&name) {
                    return Err(refuse(
                        "names under kubernetes.io are reserved for Kubernetes; use a domain of your own, e.g. meshca.io/spiffe".into(),
                    ));
                }
                // The trust domain labels the ClusterTrustBundle the signer
                // publishes, and a label value is shorter than some trust
                // domains: the API would refuse every write.
                let td = args.trust_domain.as_str();
                let alphanumeric_ends = td.starts_with(|c: char| c.is_ascii_alphanumeric())
                    && td.ends_with(|c: char| c.is_ascii_alphanumeric());
                if td.len() > 63 || !alphanumeric_ends {
                    return Err(refuse(format!(
                        "the trust domain {td:?} cannot be the value of the ClusterTrustBundle's label {} (at most 63 characters, beginning and ending with a letter or digit); pod certificates need a trust domain that can",
                        crate::cluster::TRUST_DOMAIN_LABEL
                    )));
                }
                if args.max_workload_cert_ttl < Duration::from_secs(3600) {
                    return Err(ConfigError::PodCertificateTtlTooShort(
                        args.max_workload_cert_ttl,
                    ));
                }
                Some(name)
            }
        };
        let mut server_dns: Vec<String> =
            DEFAULT_SERVER_DNS.iter().map(|s| s.to_string()).collect();
        for name in args.server_dns {
            let name = name.trim().to_ascii_lowercase();
            if name.is_empty() {
                continue;
            }
            if !is_dns_name(&name) {
                return Err(ConfigError::BadDnsName(name));
            }
            if !server_dns.contains(&name) {
                server_dns.push(name);
            }
        }
        let mut trusted_node_agents = Vec::new();
        for agent in args.trusted_node_agents {
            let agent = agent.trim();
            if agent.is_empty() {
                continue;
            }
            match agent.split_once('/') {
                Some((ns, sa))
                    if !ns.is_empty()
                        && !sa.is_empty()
                        && !sa.contains('/')
                        && meshca_certs::SpiffeId::for_workload(&args.trust_domain, ns, sa)
                            .is_ok() =>
                {
                    trusted_node_agents.push((ns.to_string(), sa.to_string()))
                }
                _ => return Err(ConfigError::BadNodeAgent(agent.to_string())),
            }
        }
        Ok(Self {
            jwt_svid: crate::jwt_svid::JwtSvidConfig::try_from(args.jwt_svid)?,
            remote: crate::cluster::remote::RemoteClusterConfig::from_args(
                args.remote,
                &args.cluster_id,
            )
            .map_err(|e| ConfigError::RemoteCluster(e.to_string()))?,
            allow_cert_renewal: args.allow_cert_renewal,
            rate_limit: crate::rate_limit::RateLimitPolicy {
                burst: args.issuance_burst,
                interval: args.issuance_interval,
                max_keys: args.issuance_rate_limit_keys.max(1),
            },
            pod_watch_failure_limit: args.pod_watch_failure_limit,
            trusted_node_agents,
            listen: args.listen,
            monitoring_listen: args.monitoring_listen,
            data_dir: args.data_dir,
            ca_dir: args.ca_dir,
            trust_domain: args.trust_domain,
            ttl: TtlPolicy {
                default: args.workload_cert_ttl,
                max: args.max_workload_cert_ttl,
            },
            token_audiences,
            discovered_jwt_issuer: if args.jwks.is_none() {
                args.jwt_issuer.clone()
            } else {
                None
            },
            external_jwt: args.jwks.zip(args.jwt_issuer),
            jwt_cache_ttl: args.jwt_cache_ttl,
            server_dns,
            kubernetes: KubernetesConfig {
                kubeconfig: args.kubeconfig,
                token_review_cache_ttl: args.token_review_cache_ttl,
                token_review_refusal_cache_ttl: args.token_review_refusal_cache_ttl,
                api_timeout: args.kube_api_timeout,
                api_max_in_flight: args.kube_api_max_in_flight.max(1),
                startup_timeout: args.kube_api_startup_timeout,
            },
            cluster_id: args.cluster_id,
            max_concurrent_requests: args.max_concurrent_requests,
            max_concurrent_streams: args.max_concurrent_streams,
            max_connection_age: Some(args.max_connection_age).filter(|age| !age.is_zero()),
            request_timeout: args.request_timeout,
            max_connection_idle: Some(args.max_connection_idle).filter(|idle| !idle.is_zero()),
            max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
            max_connections_per_source: Some(args.max_connections_per_source)
                .filter(|max| *max > 0)
                .map(|max| usize::try_from(max).unwrap_or(usize::MAX)),
            evict_idle_connections_after: Some(args.evict_idle_connections_after)
                .filter(|idle| !idle.is_zero()),
            max_open_requests: usize::try_from(args.max_open_requests).unwrap_or(usize::MAX),
            tls_handshake_timeout: args.tls_handshake_timeout,
            shutdown_grace: args.shutdown_grace,
            ca_expiry_margin: args.ca_expiry_margin,
            ca_dir_check_interval: args.ca_dir_check_interval.max(Duration::from_millis(100)),
            hsm,
            crl_refresh: args.crl_refresh.max(Duration::from_secs(1)),
            issued_record_size: args.issued_record_size,
            cluster: ClusterConfig {
                namespace: args.namespace.filter(|n| !n.trim().is_empty()),
                root_ttl: args.self_signed_root_ttl,
                rotation_at: args.root_rotation_at,
                rotation_grace: args.root_rotation_grace.unwrap_or_else(|| {
                    crate::cluster::root_secret::safe_rotation_grace(args.workload_cert_ttl)
                }),
                bundle_excluded_namespaces: args
                    .bundle_exclude_namespaces
                    .into_iter()
                    .map(|n| n.trim().to_string())
                    .filter(|n| !n.is_empty())
                    .collect(),
                lease_duration: args.leader_lease_duration,
                pod_certificate_signer,
            },
        })
    }
}

/// A duration that must not be zero (a zero timeout would refuse everything).
fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        d if d.is_zero() => Err(format!(
            "{text:?} is zero; give a duration above 0, e.g. 30s"
        )),
        d => Ok(d),
    }
}

fn is_dns_name(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .chars()
                    .enumerate()
                    .all(|(i, c)| c.is_ascii_alphanumeric() || c == '-' || (i == 0 && c == '*'))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<Config, String> {
        let cli = Cli::try_parse_from(std::iter::once("meshca").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        Config::try_from(cli.serve).map_err(|e| e.to_string())
    }

    #[test]
    fn pod_certificates_need_a_trust_domain_that_fits_a_label() {
        let signer = ["--pod-certificate-signer", "meshca.io/spiffe"];
        let long = format!("a{}", "b".repeat(63));
        let error = parse(&[&signer[..], &["--trust-domain", &long]].concat()).unwrap_err();
        assert!(error.contains("meshca.io/trust-domain"), "{error}");
        assert!(parse(&[&signer[..], &["--trust-domain", "td-"]].concat()).is_err());
        let at_limit = "a".repeat(63);
        assert!(parse(&[&signer[..], &["--trust-domain", &at_limit]].concat()).is_ok());
        // Without pod certificates, no label: any trust domain.
        assert!(parse(&["--trust-domain", &long]).is_ok());
    }

    #[test]
    fn defaults() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.monitoring_listen.to_string(), DEFAULT_MONITORING_LISTEN);
        assert_eq!(c.ttl, TtlPolicy::default());
        assert_eq!(c.token_audiences, vec!["istio-ca"]);
        assert_eq!(
            c.kubernetes.token_review_refusal_cache_ttl,
            Duration::from_secs(5)
        );
        assert_eq!(c.trust_domain.as_str(), "cluster.local");
        assert!(c
            .server_dns
            .contains(&"istiod.istio-system.svc".to_string()));
        assert!(c.server_dns.contains(&"localhost".to_string()));
        assert_eq!(c.max_connection_age, Some(Duration::from_secs(30 * 60)));
        assert_eq!(c.request_timeout, Duration::from_secs(30));
        assert!(c.allow_cert_renewal);
        assert_eq!(c.rate_limit, crate::rate_limit::RateLimitPolicy::default());
        assert_eq!(c.pod_watch_failure_limit, Duration::from_secs(30));
        assert_eq!(c.cluster.rotation_grace, Duration::from_secs(13 * 3600));
        assert_eq!(c.max_connection_idle, Some(Duration::from_secs(5 * 60)));
        assert_eq!(c.max_connections, 1024);
        assert_eq!(c.max_connections_per_source, Some(64));
        assert_eq!(
            c.evict_idle_connections_after,
            Some(Duration::from_secs(10))
        );
        assert_eq!(c.max_open_requests, 4096);
        assert_eq!(c.tls_handshake_timeout, Duration::from_secs(10));
    }

    #[test]
    fn a_root_lifetime_past_a_hundred_years_is_refused() {
        let err = parse(&["--self-signed-root-ttl", "101y"]).unwrap_err();
        assert!(
            err.contains("--self-signed-root-ttl") && err.contains("at most 100 years"),
            "{err}"
        );
        let c = parse(&["--self-signed-root-ttl", "100y"]).unwrap();
        assert_eq!(c.cluster.root_ttl, Duration::from_secs(100 * 31_557_600));
    }

    #[test]
    fn connection_limits() {
        let c = parse(&[
            "--max-connection-idle",
            "0s",
            "--max-connections",
            "10",
            "--max-open-requests",
            "20",
            "--tls-handshake-timeout",
            "3s",
            "--evict-idle-connections-after",
            "0",
        ])
        .unwrap();
        assert_eq!(c.evict_idle_connections_after, None);
        assert_eq!(c.max_open_requests, 20);
        assert_eq!(c.max_connection_idle, None);
        assert_eq!(c.max_connections, 10);
        assert_eq!(c.tls_handshake_timeout, Duration::from_secs(3));
        let c = parse(&["--max-connections-per-source", "3"]).unwrap();
        assert_eq!(c.max_connections_per_source, Some(3));
        let c = parse(&["--max-connections-per-source", "0"]).unwrap();
        assert_eq!(c.max_connections_per_source, None, "0: no bound");
        for refused in [
            ["--max-connections", "0"],
            ["--max-open-requests", "0"],
            ["--tls-handshake-timeout", "0s"],
        ] {
            let err = parse(&refused).err().unwrap();
            assert!(err.contains(refused[0]), "{err}");
        }
    }

    #[test]
    fn rotation_grace_follows_the_workload_lifetime_unless_given() {
        let c = parse(&["--workload-cert-ttl", "48h"]).unwrap();
        assert_eq!(c.cluster.rotation_grace, Duration::from_secs(25 * 3600));
        let c = parse(&["--workload-cert-ttl", "48h", "--root-rotation-grace", "2h"]).unwrap();
        assert_eq!(c.cluster.rotation_grace, Duration::from_secs(2 * 3600));
    }

    #[test]
    fn cert_renewal_and_rate_limit_flags() {
        let c = parse(&[
            "--allow-cert-renewal=false",
            "--issuance-burst",
            "3",
            "--issuance-interval",
            "1m",
            "--pod-watch-failure-limit",
            "10s",
        ])
        .unwrap();
        assert!(!c.allow_cert_renewal);
        assert_eq!(c.rate_limit.burst, 3);
        assert_eq!(c.rate_limit.interval, Duration::from_secs(60));
        assert_eq!(c.pod_watch_failure_limit, Duration::from_secs(10));
        assert!(parse(&["--issuance-interval", "0s"]).is_err());
    }

    #[test]
    fn connection_age_zero_means_never_and_a_zero_request_timeout_is_refused() {
        let c = parse(&["--max-connection-age", "0s", "--request-timeout", "2s"]).unwrap();
        assert_eq!(c.max_connection_age, None);
        assert_eq!(c.request_timeout, Duration::from_secs(2));
        let err = parse(&["--request-timeout", "0s"]).err().unwrap();
        assert!(err.contains("--request-timeout"), "{err}");
        assert!(err.contains("zero"), "{err}");
    }

    #[test]
    fn durations_and_lists() {
        let c = parse(&[
            "--workload-cert-ttl",
            "1h",
            "--max-workload-cert-ttl",
            "2d",
            "--token-audience",
            "a",
            "--token-audience",
            "b",
            "--server-dns",
            "ca.example.com",
        ])
        .unwrap();
        assert_eq!(c.ttl.default, Duration::from_secs(3600));
        assert_eq!(c.ttl.max, Duration::from_secs(2 * 86400));
        assert_eq!(c.token_audiences, vec!["a", "b"]);
        assert!(c.server_dns.contains(&"ca.example.com".to_string()));
    }

    #[test]
    fn bad_values_are_clear() {
        assert!(parse(&["--workload-cert-ttl", "soon"])
            .unwrap_err()
            .contains("soon"));
        assert!(parse(&[
            "--workload-cert-ttl",
            "10d",
            "--max-workload-cert-ttl",
            "1d"
        ])
        .unwrap_err()
        .contains("longer than"));
        // Absurd lifetimes are refused by the flag parser, naming the flag
        // (10000y used to reach the signer and panic a worker).
        let err = parse(&["--max-workload-cert-ttl", "10000y"]).unwrap_err();
        assert!(
            err.contains("--max-workload-cert-ttl") && err.contains("too long"),
            "{err}"
        );
        assert!(parse(&["--ca-expiry-margin", "200y"]).is_err());
        assert!(parse(&["--trust-domain", "Bad TD"]).is_err());
        assert!(
            parse(&["--jwks", "/x"]).is_err(),
            "--jwks needs --jwt-issuer"
        );
        assert!(parse(&["--server-dns", "bad name"])
            .unwrap_err()
            .contains("bad name"));
    }
}
