//! A real Kubernetes control plane for the end-to-end tests, envtest-style:
//! `etcd` and `kube-apiserver` built from the Go modules pinned in
//! `tests/controlplane` (`tests/controlplane/build.sh`), started on
//! loopback in a temporary directory and stopped by PID.
//!
//! The API server runs as a platform team runs one: the RBAC and Node
//! authorizers, the NodeRestriction admission plugin, service-account
//! tokens signed by its own key (OIDC discovery on), and the
//! PodCertificateRequest and ClusterTrustBundle gates with
//! `certificates.k8s.io/v1beta1`. Static tokens authenticate the test's
//! administrator and the kubelets of a few nodes ([`NODES`]); meshca runs
//! as its own ServiceAccount `istio-system/meshca`, bound only to the RBAC
//! in `deploy/kustomize/base/rbac.yaml` ([`ControlPlane::meshca_kubeconfig`]).
//!
//! Without the binaries the tests that need them are skipped with a note
//! saying how to build them; with `CI` set they fail instead.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerStatus, Namespace, Node, Pod, PodCondition, PodSpec, PodStatus,
    ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use meshca_certs::profile::{self_signed_root, SigningCa, SubjectKey, SubjectName, Validity};
use meshca_certs::{KeyAlgorithm, PrivateKey};
use time::OffsetDateTime;

/// The nodes whose kubelets have a static token (`system:node:<name>`).
pub const NODES: &[&str] = &["node-a", "node-b", "node-c"];
/// The service-account issuer of the API server.
pub const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// meshca's namespace in these tests.
pub const MESHCA_NAMESPACE: &str = "istio-system";
/// The static token of the administrator (`system:masters`).
const ADMIN_TOKEN: &str = "meshca-tests-admin-token";
/// The field manager of the objects the tests apply.
const FIELD_MANAGER: &str = "meshca-tests";

/// Where the control plane's binaries are: `$MESHCA_GO_TOOLS/bin`, else
/// `target/go-tools/bin` of the repository (what `build.sh` writes).
pub fn tools_dir() -> PathBuf {
    match std::env::var_os("MESHCA_GO_TOOLS") {
        Some(dir) => PathBuf::from(dir).join("bin"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/go-tools/bin"),
    }
}

/// The path of one of the Go tools (`etcd`, `kube-apiserver`, `kubectl`,
/// `helm`), if it is built.
pub fn tool(name: &str) -> Option<PathBuf> {
    let path = tools_dir().join(name);
    path.is_file().then_some(path)
}

/// Whether the control plane is built. Without it: `false` and a note on
/// stderr, or with `CI` set a panic, both saying how to build it.
pub fn available() -> bool {
    let missing: Vec<&str> = ["etcd", "kube-apiserver", "kubectl"]
        .into_iter()
        .filter(|t| tool(t).is_none())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let message = format!(
        "the tests' Kubernetes control plane is not built ({} missing in {}): run tests/controlplane/build.sh (Go 1.26; about 10 minutes the first time)",
        missing.join(", "),
        tools_dir().display()
    );
    if std::env::var_os("CI").is_some() {
        panic!("{message}");
    }
    eprintln!("skipped: {message}");
    false
}

/// How the API server is configured.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// The PodCertificateRequest and ClusterTrustBundle gates and
    /// `certificates.k8s.io/v1beta1` (on by default).
    pub pod_certificates: bool,
    /// `--shutdown-delay-duration`: how long a stopping API server keeps
    /// serving after SIGTERM (0 by default; a real one waits for its load
    /// balancer to notice).
    pub shutdown_delay: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            pod_certificates: true,
            shutdown_delay: Duration::ZERO,
        }
    }
}

/// A running etcd and kube-apiserver; both are killed when dropped.
pub struct ControlPlane {
    options: Options,
    dir: tempfile::TempDir,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    /// An API server stopping after a hand-over, while it drains.
    retiring: Option<Child>,
    /// API servers started so far (names their log files).
    starts: usize,
    etcd_url: String,
    /// The API server's address.
    pub addr: SocketAddr,
    /// The API server's CA (PEM).
    pub ca_pem: String,
    /// The administrator's kubeconfig.
    pub admin_kubeconfig: PathBuf,
    /// How long the last start of the API server took until `/readyz`.
    pub last_start: Duration,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver and waits until the API server is
    /// ready; `None` when the binaries are not built (see [`available`]).
    pub async fn start() -> Option<Self> {
        Self::start_with(Options::default()).await
    }

    /// As [`ControlPlane::start`], configured by `options`.
    pub async fn start_with(options: Options) -> Option<Self> {
        if !available() {
            return None;
        }
        let dir = tempfile::tempdir().expect("temporary directory");
        let (ca_pem, cert_pem, key_pem) = serving_certificate();
        write(dir.path(), "ca.pem", &ca_pem);
        write(dir.path(), "serving.pem", &cert_pem);
        write(dir.path(), "serving-key.pem", &key_pem);
        let signing = PrivateKey::generate(KeyAlgorithm::EcdsaP256).expect("key");
        write(dir.path(), "sa-signing-key.pem", &signing.to_pkcs8_pem());
        // kube-apiserver reads public keys from PUBLIC KEY blocks only.
        write(
            dir.path(),
            "sa-public-key.pem",
            &pem::encode(&pem::Pem::new("PUBLIC KEY", signing.public_key_spki_der())),
        );
        let mut tokens = format!("{ADMIN_TOKEN},meshca-tests-admin,admin,\"system:masters\"\n");
        for node in NODES {
            tokens.push_str(&format!(
                "{},system:node:{node},{node},\"system:nodes\"\n",
                node_token(node)
            ));
        }
        write(dir.path(), "tokens.csv", &tokens);
        let etcd_port = crate::free_port();
        let peer_port = crate::free_port();
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let etcd = Command::new(tool("etcd").expect("etcd"))
            .args([
                "--name=meshca-tests",
                &format!("--data-dir={}", dir.path().join("etcd").display()),
                &format!("--listen-client-urls={etcd_url}"),
                &format!("--advertise-client-urls={etcd_url}"),
                &format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
                &format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
                &format!("--initial-cluster=meshca-tests=http://127.0.0.1:{peer_port}"),
                "--unsafe-no-fsync",
                "--log-level=warn",
                "--quota-backend-bytes=2147483648",
            ])
            .stdout(Stdio::null())
            .stderr(log_file(dir.path(), "etcd.log"))
            .spawn()
            .expect("starting etcd");
        let addr: SocketAddr = format!("127.0.0.1:{}", crate::free_port())
            .parse()
            .expect("address");
        let admin_kubeconfig = dir.path().join("admin.kubeconfig");
        write_kubeconfig(&admin_kubeconfig, addr, &ca_pem, ADMIN_TOKEN, "default");
        let mut plane = Self {
            options,
            dir,
            etcd: Some(etcd),
            apiserver: None,
            retiring: None,
            starts: 0,
            etcd_url,
            addr,
            ca_pem,
            admin_kubeconfig,
            last_start: Duration::ZERO,
        };
        plane.start_apiserver().await;
        plane.ensure_namespace(MESHCA_NAMESPACE).await;
        Some(plane)
    }

    /// The directory holding the control plane's files and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What kube-apiserver wrote to stderr.
    pub fn apiserver_log(&self) -> String {
        (0..self.starts)
            .map(|n| {
                std::fs::read_to_string(self.dir.path().join(format!("kube-apiserver-{n}.log")))
                    .unwrap_or_default()
            })
            .collect()
    }

    /// The API server's PID, while it runs.
    pub fn apiserver_pid(&self) -> Option<u32> {
        self.apiserver.as_ref().map(Child::id)
    }

    /// Starts kube-apiserver (again, on the same port) and waits for
    /// `/readyz`.
    pub async fn start_apiserver(&mut self) {
        assert!(self.apiserver.is_none(), "the API server already runs");
        let started = Instant::now();
        let child = self.spawn_apiserver();
        self.apiserver = Some(child);
        self.wait_ready(Duration::from_secs(120)).await;
        self.last_start = started.elapsed();
    }

    /// A rolling restart on one address, as an upgrade of a single API
    /// server does it (the port is shared, `SO_REUSEPORT`): a new
    /// kube-apiserver starts beside the running one; once it serves, the
    /// old one gets SIGTERM and, for its `shutdown_delay`, keeps serving
    /// what is connected to it (watches included) while new connections
    /// reach either. Returns once the old one was told to stop; it exits
    /// in the background ([`ControlPlane::retiring_exited`]).
    pub async fn hand_over_apiserver(&mut self) {
        let old = self.apiserver.take().expect("an API server runs");
        let log = self
            .dir
            .path()
            .join(format!("kube-apiserver-{}.log", self.starts));
        let started = Instant::now();
        let new = self.spawn_apiserver();
        let deadline = Instant::now() + Duration::from_secs(120);
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("Serving securely")
        {
            assert!(
                Instant::now() < deadline,
                "the new kube-apiserver did not serve"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.apiserver = Some(new);
        self.wait_ready(Duration::from_secs(120)).await;
        self.last_start = started.elapsed();
        let pid = nix::unistd::Pid::from_raw(old.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        self.retiring = Some(old);
    }

    /// Whether the API server stopped by the last hand-over has exited.
    pub fn retiring_exited(&mut self) -> bool {
        match self.retiring.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(Some(_))),
            None => true,
        }
    }

    fn spawn_apiserver(&mut self) -> Child {
        let d = self.dir.path();
        let log = format!("kube-apiserver-{}.log", self.starts);
        self.starts += 1;
        let path = |name: &str| d.join(name).display().to_string();
        let mut command = Command::new(tool("kube-apiserver").expect("kube-apiserver"));
        if self.options.pod_certificates {
            command.args([
                "--feature-gates=PodCertificateRequest=true,ClusterTrustBundle=true,ClusterTrustBundleProjection=true",
                "--runtime-config=certificates.k8s.io/v1beta1=true",
            ]);
        }
        command
            .args([
                &format!("--etcd-servers={}", self.etcd_url),
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                &format!("--secure-port={}", self.addr.port()),
                &format!("--cert-dir={}", path("apiserver-certs")),
                &format!("--tls-cert-file={}", path("serving.pem")),
                &format!("--tls-private-key-file={}", path("serving-key.pem")),
                &format!("--client-ca-file={}", path("ca.pem")),
                &format!("--token-auth-file={}", path("tokens.csv")),
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                &format!("--service-account-issuer={ISSUER}"),
                &format!("--service-account-key-file={}", path("sa-public-key.pem")),
                &format!(
                    "--service-account-signing-key-file={}",
                    path("sa-signing-key.pem")
                ),
                "--service-cluster-ip-range=10.96.0.0/16",
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                &format!(
                    "--shutdown-delay-duration={}s",
                    self.options.shutdown_delay.as_secs()
                ),
                "--permit-port-sharing=true",
                "--v=0",
            ])
            .stdout(Stdio::null())
            .stderr(log_file(d, &log))
            .spawn()
            .expect("starting kube-apiserver")
    }

    /// Rotates the service-account signing key as an operator does: a new
    /// key signs, the old one still verifies (both in
    /// `--service-account-key-file`, so both in the JWKS), and the API
    /// server restarts to read them.
    pub async fn rotate_service_account_key(&mut self) {
        let d = self.dir.path();
        let next = PrivateKey::generate(KeyAlgorithm::EcdsaP256).expect("key");
        let mut public = std::fs::read_to_string(d.join("sa-public-key.pem")).expect("public keys");
        public.push_str(&pem::encode(&pem::Pem::new(
            "PUBLIC KEY",
            next.public_key_spki_der(),
        )));
        write(d, "sa-public-key.pem", &public);
        write(d, "sa-signing-key.pem", &next.to_pkcs8_pem());
        self.stop_apiserver();
        self.start_apiserver().await;
    }

    /// How many requests of `verb` (`POST`, `GET`, `LIST`, `WATCH`, …) on
    /// `resource` the API server has answered since it started, from its
    /// own `apiserver_request_total`.
    pub async fn api_calls(&self, verb: &str, resource: &str) -> u64 {
        let request = http::Request::get("/metrics")
            .body(Vec::new())
            .expect("request");
        let text = self
            .admin()
            .await
            .request_text(request)
            .await
            .expect("kube-apiserver's /metrics");
        let (verb, resource) = (
            format!("verb=\"{verb}\""),
            format!("resource=\"{resource}\""),
        );
        text.lines()
            .filter(|l| l.starts_with("apiserver_request_total{"))
            .filter(|l| l.contains(&verb) && l.contains(&resource))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    /// Stops kube-apiserver with SIGTERM (a graceful shutdown) and waits
    /// for it to exit; SIGKILL after 30 s.
    pub fn stop_apiserver(&mut self) {
        if let Some(child) = self.apiserver.take() {
            stop(child, "kube-apiserver");
        }
    }

    /// Kills kube-apiserver (SIGKILL): connections break without a word.
    pub fn kill_apiserver(&mut self) {
        if let Some(mut child) = self.apiserver.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    async fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let client = self.admin().await;
        loop {
            let request = http::Request::get("/readyz")
                .body(Vec::new())
                .expect("request");
            match client.request_text(request).await {
                Ok(body) if body.trim() == "ok" => return,
                _ => {}
            }
            if let Some(child) = self.apiserver.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "kube-apiserver exited ({status}) while starting:\n{}",
                        tail(&self.apiserver_log(), 40)
                    );
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "kube-apiserver was not ready within {timeout:?}:\n{}",
                    tail(&self.apiserver_log(), 40)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A client as the administrator.
    pub async fn admin(&self) -> kube::Client {
        client_for(&self.admin_kubeconfig).await
    }

    /// A client as the kubelet of `node` (one of [`NODES`]).
    pub async fn node(&self, node: &str) -> kube::Client {
        assert!(NODES.contains(&node), "{node} has no kubelet token");
        let path = self.dir.path().join(format!("{node}.kubeconfig"));
        write_kubeconfig(&path, self.addr, &self.ca_pem, &node_token(node), "default");
        client_for(&path).await
    }

    /// A kubeconfig file that authenticates with `token`.
    pub fn kubeconfig_with_token(&self, name: &str, token: &str, namespace: &str) -> PathBuf {
        let path = self.dir.path().join(format!("{name}.kubeconfig"));
        write_kubeconfig(&path, self.addr, &self.ca_pem, token, namespace);
        path
    }

    /// Creates the namespace if it does not exist.
    pub async fn ensure_namespace(&self, name: &str) {
        let api: Api<Namespace> = Api::all(self.admin().await);
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        create_if_absent(&api, &namespace).await;
    }

    /// Creates the service account (and its namespace) if absent.
    pub async fn ensure_service_account(&self, namespace: &str, name: &str) {
        self.ensure_namespace(namespace).await;
        let api: Api<ServiceAccount> = Api::namespaced(self.admin().await, namespace);
        let account = ServiceAccount {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        create_if_absent(&api, &account).await;
    }

    /// Creates the Node object if absent (as the cluster's administrator
    /// or the kubelet would).
    pub async fn ensure_node(&self, name: &str) {
        let api: Api<Node> = Api::all(self.admin().await);
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        create_if_absent(&api, &node).await;
    }

    /// meshca's RBAC (`deploy/kustomize/base/rbac.yaml`, nothing more),
    /// its ServiceAccount, and a kubeconfig with a token of that account
    /// (audience: the API server). Returns the kubeconfig's path.
    pub async fn meshca_kubeconfig(&self) -> PathBuf {
        self.ensure_service_account(MESHCA_NAMESPACE, "meshca")
            .await;
        self.apply_rbac(&std::fs::read_to_string(rbac_yaml()).expect("rbac.yaml"))
            .await;
        let token = self
            .token(
                MESHCA_NAMESPACE,
                "meshca",
                None,
                &[],
                Duration::from_secs(86_400),
            )
            .await;
        self.kubeconfig_with_token("meshca", &token, MESHCA_NAMESPACE)
    }

    /// Applies (server-side) the RBAC objects of a YAML stream, in
    /// meshca's namespace where they are namespaced.
    pub async fn apply_rbac(&self, yaml: &str) {
        let client = self.admin().await;
        let params = PatchParams::apply(FIELD_MANAGER).force();
        for doc in serde_saphyr::from_multiple::<serde_json::Value>(yaml).expect("YAML") {
            if doc.is_null() {
                continue;
            }
            let name = doc["metadata"]["name"].as_str().expect("name").to_string();
            let kind = doc["kind"].as_str().expect("kind").to_string();
            match kind.as_str() {
                "ClusterRole" => {
                    let api: Api<ClusterRole> = Api::all(client.clone());
                    api.patch(&name, &params, &Patch::Apply(&doc))
                        .await
                        .map(drop)
                }
                "ClusterRoleBinding" => {
                    let api: Api<ClusterRoleBinding> = Api::all(client.clone());
                    api.patch(&name, &params, &Patch::Apply(&doc))
                        .await
                        .map(drop)
                }
                "Role" => {
                    let api: Api<Role> = Api::namespaced(client.clone(), MESHCA_NAMESPACE);
                    api.patch(&name, &params, &Patch::Apply(&doc))
                        .await
                        .map(drop)
                }
                "RoleBinding" => {
                    let api: Api<RoleBinding> = Api::namespaced(client.clone(), MESHCA_NAMESPACE);
                    api.patch(&name, &params, &Patch::Apply(&doc))
                        .await
                        .map(drop)
                }
                other => panic!("not an RBAC object: {other}"),
            }
            .unwrap_or_else(|e| panic!("applying {kind} {name}: {e}"));
        }
    }

    /// A service-account token from the TokenRequest API, bound to `pod`
    /// when given, for `audiences` (the API server's own when empty).
    pub async fn token(
        &self,
        namespace: &str,
        service_account: &str,
        pod: Option<&Pod>,
        audiences: &[&str],
        lifetime: Duration,
    ) -> String {
        let api: Api<ServiceAccount> = Api::namespaced(self.admin().await, namespace);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: (!audiences.is_empty())
                    .then(|| audiences.iter().map(|a| a.to_string()).collect()),
                expiration_seconds: Some(lifetime.as_secs() as i64),
                bound_object_ref: pod.map(|pod| BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: pod.metadata.name.clone(),
                    uid: pod.metadata.uid.clone(),
                }),
            }),
            ..Default::default()
        };
        let answer: TokenRequest = api
            .create_subresource("token", service_account, &PostParams::default(), &request)
            .await
            .unwrap_or_else(|e| panic!("token for {namespace}/{service_account}: {e}"));
        answer
            .status
            .and_then(|status| status.token)
            .expect("a token")
    }

    /// A running pod: created by the administrator with `nodeName` (no
    /// scheduler runs), its status then written by the node's kubelet
    /// (`Running`, ready, an IP). Namespace, service account and node are
    /// created if absent.
    pub async fn running_pod(
        &self,
        namespace: &str,
        name: &str,
        service_account: &str,
        node: &str,
    ) -> Pod {
        self.running_pod_with_containers(namespace, name, service_account, node, &[])
            .await
    }

    /// As [`ControlPlane::running_pod`], its kubelet reporting the
    /// `app` container running as `containerd://<ID>` for each ID of
    /// `container_ids` (what a node agent matches a caller's cgroup to).
    pub async fn running_pod_with_containers(
        &self,
        namespace: &str,
        name: &str,
        service_account: &str,
        node: &str,
        container_ids: &[&str],
    ) -> Pod {
        self.ensure_service_account(namespace, service_account)
            .await;
        self.ensure_node(node).await;
        let api: Api<Pod> = Api::namespaced(self.admin().await, namespace);
        let pod = pod_on_node(namespace, name, service_account, node);
        let created = api
            .create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("creating pod {namespace}/{name}: {e}"));
        let ip = pod_ip(created.metadata.uid.as_deref().unwrap_or(name));
        let status = PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some(ip.clone()),
            pod_ips: Some(vec![k8s_openapi::api::core::v1::PodIP { ip }]),
            host_ip: Some("127.0.0.1".into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..Default::default()
            }]),
            container_statuses: (!container_ids.is_empty()).then(|| {
                container_ids
                    .iter()
                    .map(|id| ContainerStatus {
                        name: "app".into(),
                        container_id: Some(format!("containerd://{id}")),
                        image: "registry.k8s.io/pause:3.10".into(),
                        image_id: String::new(),
                        ready: true,
                        ..Default::default()
                    })
                    .collect()
            }),
            ..Default::default()
        };
        let kubelet: Api<Pod> = Api::namespaced(self.node(node).await, namespace);
        kubelet
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "status": status })),
            )
            .await
            .unwrap_or_else(|e| panic!("kubelet {node} writing the status of {name}: {e}"))
    }

    /// Deletes a pod at once (grace period 0, as after its kubelet
    /// confirmed it).
    pub async fn delete_pod(&self, namespace: &str, name: &str) {
        let api: Api<Pod> = Api::namespaced(self.admin().await, namespace);
        let params = kube::api::DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        api.delete(name, &params)
            .await
            .unwrap_or_else(|e| panic!("deleting pod {namespace}/{name}: {e}"));
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.kill_apiserver();
        if let Some(mut child) = self.retiring.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(mut etcd) = self.etcd.take() {
            let _ = etcd.kill();
            let _ = etcd.wait();
        }
    }
}

/// A pod as its controller would create it once scheduled: bound to
/// `node` (no scheduler runs), one `pause` container, label `app=<name>`.
pub fn pod_on_node(namespace: &str, name: &str, service_account: &str, node: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([("app".to_string(), name.to_string())])),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            service_account_name: Some(service_account.into()),
            containers: vec![Container {
                name: "app".into(),
                image: Some("registry.k8s.io/pause:3.10".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `deploy/kustomize/base/rbac.yaml`.
pub fn rbac_yaml() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kustomize/base/rbac.yaml")
}

/// A kube client for a kubeconfig file.
pub async fn client_for(kubeconfig: &Path) -> kube::Client {
    let text = std::fs::read_to_string(kubeconfig).expect("kubeconfig");
    let parsed = kube::config::Kubeconfig::from_yaml(&text).expect("kubeconfig YAML");
    let config = kube::Config::from_custom_kubeconfig(parsed, &Default::default())
        .await
        .expect("kubeconfig");
    kube::Client::try_from(config).expect("client")
}

async fn create_if_absent<K>(api: &Api<K>, object: &K)
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), object).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("creating {:?}: {e}", object.meta().name),
    }
}

fn node_token(node: &str) -> String {
    format!("meshca-tests-kubelet-{node}")
}

/// A stable pod IP in 10.244.0.0/16 for a pod's UID.
fn pod_ip(seed: &str) -> String {
    let sum: u32 = seed
        .bytes()
        .fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b.into()));
    format!("10.244.{}.{}", (sum >> 8) % 250 + 1, sum % 250 + 1)
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap_or_else(|e| panic!("writing {name}: {e}"));
}

fn log_file(dir: &Path, name: &str) -> Stdio {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(name))
        .map(Stdio::from)
        .unwrap_or_else(|_| Stdio::null())
}

fn write_kubeconfig(path: &Path, addr: SocketAddr, ca_pem: &str, token: &str, namespace: &str) {
    use base64::Engine;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: tests\n  cluster:\n    server: https://{addr}\n    certificate-authority-data: {ca}\ncontexts:\n- name: tests\n  context:\n    cluster: tests\n    user: user\n    namespace: {namespace}\ncurrent-context: tests\nusers:\n- name: user\n  user:\n    token: {token}\n"
    );
    std::fs::write(path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// A CA and the API server's certificate for 127.0.0.1 and localhost:
/// (CA PEM, certificate PEM, key PEM).
fn serving_certificate() -> (String, String, String) {
    let now = OffsetDateTime::now_utc();
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).expect("key");
    let name = SubjectName {
        common_name: Some("meshca-tests-kube-ca".into()),
        ..Default::default()
    };
    let root = self_signed_root(
        &key,
        &name,
        Validity::backdated(now, time::Duration::days(1)),
    )
    .expect("root");
    let ca = SigningCa::new(root.der.clone(), key).expect("ca");
    let server_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).expect("key");
    let cert = ca
        .issue_server(
            &SubjectKey::of(&server_key).expect("key"),
            &["localhost".into(), "kubernetes.default.svc".into()],
            &["127.0.0.1".parse().expect("ip")],
            Validity::backdated(now, time::Duration::hours(12)),
        )
        .expect("server certificate");
    (root.to_pem(), cert.to_pem(), server_key.to_pkcs8_pem())
}

/// SIGTERM, then SIGKILL if the process has not exited within 30 s.
fn stop(mut child: Child, what: &str) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("{what} did not stop within 30 s of SIGTERM; killing it");
    let _ = child.kill();
    let _ = child.wait();
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
