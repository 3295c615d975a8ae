//! A fake Kubernetes API server for end-to-end tests: HTTPS with its own
//! CA, a kubeconfig pointing at it, and the real JSON of the endpoints
//! meshca uses: `TokenReview`, OIDC discovery, `/version`, and an object store for
//! pods, namespaces, Secrets, ConfigMaps and Leases with the API's
//! semantics: get, list, streamed watch from a resourceVersion, create
//! (409 AlreadyExists), update with optimistic concurrency (409 Conflict on
//! a stale resourceVersion), merge patch, delete, field selectors. It counts
//! calls, can answer slowly, can hold creates to force a race, can fail
//! chosen calls (500) until told to stop, can let "another writer" answer a
//! PodCertificateRequest just before meshca's status update lands (a 409
//! for certain), can send a stale watch event, and can be stopped and
//! restarted on the same port. `PodCertificateRequest`s (with
//! their `status` subresource) and `ClusterTrustBundle`s are checked as
//! kube-apiserver checks them (see `fake_certificates`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use meshca_certs::profile::{self_signed_root, SigningCa, SubjectKey, SubjectName, Validity};
use meshca_certs::{KeyAlgorithm, PrivateKey};
use time::OffsetDateTime;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

/// The bearer token meshca's kubeconfig carries (checked by the fake).
pub const CLIENT_TOKEN: &str = "meshca-service-account-token";

/// Who a token belongs to.
#[derive(Debug, Clone)]
pub struct FakeUser {
    /// `user.username`.
    pub username: String,
    /// `user.groups`.
    pub groups: Vec<String>,
    /// The token's audiences.
    pub audiences: Vec<String>,
    /// Bound pod name and UID.
    pub pod: Option<(String, String)>,
}

impl FakeUser {
    /// A service account token with audience `istio-ca`.
    pub fn service_account(namespace: &str, name: &str) -> Self {
        Self {
            username: format!("system:serviceaccount:{namespace}:{name}"),
            groups: vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".into(),
            ],
            audiences: vec!["istio-ca".into()],
            pod: Some((format!("{name}-pod"), format!("uid-{name}"))),
        }
    }
}

/// A resource kind the store serves: (plural, kind, apiVersion, namespaced).
const RESOURCES: &[(&str, &str, &str, bool)] = &[
    ("pods", "Pod", "v1", true),
    ("secrets", "Secret", "v1", true),
    ("configmaps", "ConfigMap", "v1", true),
    ("namespaces", "Namespace", "v1", false),
    ("leases", "Lease", "coordination.k8s.io/v1", true),
    (
        "podcertificaterequests",
        "PodCertificateRequest",
        "certificates.k8s.io/v1beta1",
        true,
    ),
    (
        "clustertrustbundles",
        "ClusterTrustBundle",
        "certificates.k8s.io/v1beta1",
        false,
    ),
];

type ObjectKey = (String, String, String);

struct Watcher {
    plural: String,
    namespace: Option<String>,
    selector: Vec<(String, String)>,
    tx: tokio::sync::mpsc::UnboundedSender<Bytes>,
}

#[derive(Default)]
struct Objects {
    items: std::collections::BTreeMap<ObjectKey, serde_json::Value>,
    resource_version: u64,
    history: Vec<(u64, String, &'static str, serde_json::Value)>,
    watchers: Vec<Watcher>,
    calls: HashMap<(String, String), usize>,
    uid: u64,
}

impl Objects {
    /// Stores (or removes, for DELETED) an object and tells the watchers.
    fn event(
        &mut self,
        plural: &str,
        kind: &'static str,
        mut object: serde_json::Value,
    ) -> serde_json::Value {
        self.resource_version += 1;
        let rv = self.resource_version;
        object["metadata"]["resourceVersion"] = serde_json::json!(rv.to_string());
        if object["metadata"]["uid"].is_null() {
            self.uid += 1;
            object["metadata"]["uid"] = serde_json::json!(format!("uid-{}", self.uid));
        }
        if object["metadata"]["creationTimestamp"].is_null() {
            object["metadata"]["creationTimestamp"] = serde_json::json!("2026-01-01T00:00:00Z");
        }
        let key = key_of(plural, &object);
        if kind == "DELETED" {
            self.items.remove(&key);
            if plural == "namespaces" {
                // The namespace's objects go with it.
                let inside: Vec<(ObjectKey, serde_json::Value)> = self
                    .items
                    .iter()
                    .filter(|((_, ns, _), _)| *ns == key.2)
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                for ((p, _, _), v) in inside {
                    self.event(&p, "DELETED", v);
                }
            }
        } else {
            self.items.insert(key, object.clone());
        }
        let line = watch_line(kind, &object);
        self.history
            .push((rv, plural.to_string(), kind, object.clone()));
        self.watchers.retain(|w| {
            if w.plural != plural || !matches_filter(&object, w.namespace.as_deref(), &w.selector) {
                return true;
            }
            w.tx.send(line.clone()).is_ok()
        });
        object
    }

    fn count(&mut self, plural: &str, verb: &str) {
        *self
            .calls
            .entry((plural.to_string(), verb.to_string()))
            .or_default() += 1;
    }
}

fn key_of(plural: &str, object: &serde_json::Value) -> ObjectKey {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    (
        plural.to_string(),
        text(&object["metadata"]["namespace"]),
        text(&object["metadata"]["name"]),
    )
}

fn matches_filter(
    object: &serde_json::Value,
    namespace: Option<&str>,
    selector: &[(String, String)],
) -> bool {
    if let Some(ns) = namespace {
        if object["metadata"]["namespace"] != ns {
            return false;
        }
    }
    selector.iter().all(|(field, value)| {
        let mut v = object;
        for part in field.split('.') {
            v = &v[part];
        }
        v.as_str() == Some(value.as_str())
    })
}

fn watch_line(kind: &str, object: &serde_json::Value) -> Bytes {
    let mut text = serde_json::json!({"type": kind, "object": object}).to_string();
    text.push('\n');
    Bytes::from(text)
}

/// The issuer of the fake cluster's service-account tokens.
pub const OIDC_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// The issuer of [`FakeKube::add_review_token`]'s tokens (no keys anywhere).
pub const REVIEW_ONLY_ISSUER: &str = "https://review-only.fake-kube.invalid";

/// A JWT-shaped token with the header and claims a real service-account
/// token has (`aud`, an `exp` an hour away, `label` as its `jti`), but an
/// issuer no offline key checks and no valid signature: only a TokenReview
/// of a fake that knows it ([`FakeKube::add_review_token`]) vouches for it.
pub fn review_only_token(label: &str, audiences: &[String]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let exp = OffsetDateTime::now_utc().unix_timestamp() + 3600;
    let claims = serde_json::json!({
        "iss": REVIEW_ONLY_ISSUER,
        "sub": "system:serviceaccount:unknown:unknown",
        "aud": audiences,
        "exp": exp,
        "jti": label,
    });
    format!(
        "{}.{}.{}",
        b64.encode(r#"{"alg":"RS256","kid":"fake-review-only"}"#),
        b64.encode(claims.to_string()),
        b64.encode(format!("not-a-signature-{label}"))
    )
}

#[derive(Default)]
struct Shared {
    tokens: Mutex<HashMap<String, FakeUser>>,
    jwks: Mutex<String>,
    objects: Mutex<Objects>,
    reviews: AtomicUsize,
    latency_ms: AtomicU64,
    /// Creates of this plural wait until this many are waiting, then all proceed.
    create_gate: Mutex<Option<(String, Arc<tokio::sync::Barrier>)>>,
    /// Calls `(plural, verb)` answered 500 until cleared.
    failing: Mutex<Vec<(String, String)>>,
    /// How many calls were failed on purpose.
    failed: AtomicUsize,
    /// Statuses "another writer" puts on a PodCertificateRequest
    /// `(namespace, name)` right before the next status update of it.
    interlopers: Mutex<HashMap<(String, String), serde_json::Value>>,
}

/// The fake API server.
pub struct FakeKube {
    /// Its address.
    pub addr: SocketAddr,
    /// The kubeconfig file pointing at it.
    pub kubeconfig: PathBuf,
    shared: Arc<Shared>,
    acceptor: TlsAcceptor,
    tasks: Option<JoinSet<()>>,
    oidc: Mutex<meshca_certs::token::TokenIssuer>,
}

impl FakeKube {
    /// Starts the server and writes `dir/kubeconfig`.
    pub async fn start(dir: &Path) -> Self {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).expect("key");
        let name = SubjectName {
            common_name: Some("fake-kube-ca".into()),
            ..Default::default()
        };
        let root = self_signed_root(
            &key,
            &name,
            Validity::backdated(OffsetDateTime::now_utc(), time::Duration::days(1)),
        )
        .expect("root");
        let ca = SigningCa::new(root.der.clone(), key).expect("ca");
        let server_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).expect("key");
        let server_cert = ca
            .issue_server(
                &SubjectKey::of(&server_key).expect("key"),
                &["localhost".into()],
                &["127.0.0.1".parse().expect("ip")],
                Validity::backdated(OffsetDateTime::now_utc(), time::Duration::hours(6)),
            )
            .expect("server cert");
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![rustls::pki_types::CertificateDer::from(
                server_cert.der.clone(),
            )],
            rustls::pki_types::PrivateKeyDer::Pkcs8(server_key.to_pkcs8_der().into()),
        )
        .expect("server config");
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let kubeconfig = dir.join("kubeconfig");
        let ca_b64 = base64_encode(root.to_pem().as_bytes());
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: https://{addr}\n    certificate-authority-data: {ca_b64}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: meshca\n    namespace: istio-system\ncurrent-context: fake\nusers:\n- name: meshca\n  user:\n    token: {CLIENT_TOKEN}\n"
            ),
        )
        .expect("kubeconfig");
        let oidc = meshca_certs::token::TokenIssuer::generate()
            .expect("issuer")
            .with_issuer(OIDC_ISSUER);
        let shared = Arc::new(Shared::default());
        if let Ok(mut jwks) = shared.jwks.lock() {
            *jwks = oidc.jwks_json();
        }
        if let Ok(mut objects) = shared.objects.lock() {
            for ns in ["default", "istio-system", "kube-system"] {
                objects.event("namespaces", "ADDED", namespace_object(ns));
            }
        }
        let mut server = Self {
            addr,
            kubeconfig,
            shared,
            acceptor: TlsAcceptor::from(Arc::new(config)),
            tasks: None,
            oidc: Mutex::new(oidc),
        };
        server.serve(listener);
        server
    }

    fn serve(&mut self, listener: TcpListener) {
        let mut tasks = JoinSet::new();
        let acceptor = self.acceptor.clone();
        let shared = self.shared.clone();
        tasks.spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                let shared = shared.clone();
                connections.spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service =
                        hyper::service::service_fn(move |req| handle(shared.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        self.tasks = Some(tasks);
    }

    /// Registers a token.
    pub fn add_token(&self, token: &str, user: FakeUser) {
        if let Ok(mut tokens) = self.shared.tokens.lock() {
            tokens.insert(token.to_string(), user);
        }
    }

    /// Registers `user` under a new JWT-shaped token
    /// ([`review_only_token`], `aud` from `user.audiences`) and returns it.
    /// meshca sends nothing that is not JWT-shaped to TokenReview; use
    /// [`FakeKube::add_token`] for raw strings.
    pub fn add_review_token(&self, label: &str, user: FakeUser) -> String {
        let token = review_only_token(label, &user.audiences);
        self.add_token(&token, user);
        token
    }

    /// Adds (or replaces) a running pod; watchers see the event.
    pub fn add_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        service_account: &str,
        node: &str,
    ) {
        self.add_pod_with_containers(namespace, name, uid, service_account, node, &[]);
    }

    /// Adds a running pod whose status lists these container IDs (as the
    /// kubelet reports them, `containerd://<id>`), as node-mode agents
    /// check a caller's container against; watchers see the event.
    pub fn add_pod_with_containers(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        service_account: &str,
        node: &str,
        container_ids: &[&str],
    ) {
        let statuses: Vec<serde_json::Value> = container_ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                serde_json::json!({
                    "name": format!("c{i}"), "image": "app", "imageID": "", "ready": true,
                    "restartCount": 0, "containerID": format!("containerd://{id}"),
                    "state": {"running": {}}
                })
            })
            .collect();
        let pod = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
            "spec": {"serviceAccountName": service_account, "nodeName": node, "containers": [{"name": "app", "image": "app"}]},
            "status": {"phase": "Running", "containerStatuses": statuses}
        });
        self.put_object("pods", pod);
    }

    /// Deletes a pod; watchers see the event.
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        self.delete_object("pods", namespace, name);
    }

    /// Creates or replaces an object as a user with kubectl would (no
    /// resourceVersion check); watchers see the event. Returns it as stored.
    pub fn put_object(&self, plural: &str, object: serde_json::Value) -> serde_json::Value {
        let mut objects = self.shared.objects.lock().expect("objects");
        let kind = if objects.items.contains_key(&key_of(plural, &object)) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        objects.event(plural, kind, object)
    }

    /// Creates an object as a client of the API would: the API's
    /// validation and defaults apply, an existing name is refused. Returns
    /// the stored object, or the error message (as the API's 422/409).
    pub fn create_object(
        &self,
        plural: &str,
        mut object: serde_json::Value,
    ) -> Result<serde_json::Value, String> {
        validate_create(plural, &mut object)?;
        let mut objects = self.shared.objects.lock().expect("objects");
        if objects.items.contains_key(&key_of(plural, &object)) {
            return Err("AlreadyExists".into());
        }
        Ok(objects.event(plural, "ADDED", object))
    }

    /// The stored object, if any (`namespace` empty for cluster-scoped kinds).
    pub fn get_object(
        &self,
        plural: &str,
        namespace: &str,
        name: &str,
    ) -> Option<serde_json::Value> {
        let objects = self.shared.objects.lock().expect("objects");
        objects
            .items
            .get(&(plural.to_string(), namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Every stored object of a kind.
    pub fn list_objects(&self, plural: &str) -> Vec<serde_json::Value> {
        let objects = self.shared.objects.lock().expect("objects");
        objects
            .items
            .iter()
            .filter(|((p, _, _), _)| p == plural)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Deletes an object; watchers see the event.
    pub fn delete_object(&self, plural: &str, namespace: &str, name: &str) {
        let mut objects = self.shared.objects.lock().expect("objects");
        let key = (plural.to_string(), namespace.to_string(), name.to_string());
        if let Some(object) = objects.items.get(&key).cloned() {
            objects.event(plural, "DELETED", object);
        }
    }

    /// Creates a namespace; watchers see the event.
    pub fn add_namespace(&self, name: &str) {
        self.put_object("namespaces", namespace_object(name));
    }

    /// How many API calls of `verb` (get, list, watch, create, update,
    /// patch, delete) were made on `plural`.
    pub fn calls(&self, plural: &str, verb: &str) -> usize {
        let objects = self.shared.objects.lock().expect("objects");
        objects
            .calls
            .get(&(plural.to_string(), verb.to_string()))
            .copied()
            .unwrap_or(0)
    }

    /// Every call counted so far: ((plural, verb), count), `plural/status`
    /// for the status subresource.
    pub fn call_counts(&self) -> Vec<((String, String), usize)> {
        let objects = self.shared.objects.lock().expect("objects");
        objects.calls.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// Holds creates of `plural` until `count` of them are waiting, then
    /// lets them through one after the other: a create race, for certain.
    pub fn gate_creates(&self, plural: &str, count: usize) {
        if let Ok(mut gate) = self.shared.create_gate.lock() {
            *gate = Some((
                plural.to_string(),
                Arc::new(tokio::sync::Barrier::new(count)),
            ));
        }
    }

    /// Answers every call of `verb` on `plural` (`plural/status` for the
    /// status subresource; verbs as in [`FakeKube::calls`]) with 500
    /// InternalError until [`FakeKube::stop_failing`]. The call is still
    /// counted.
    pub fn fail_calls(&self, plural: &str, verb: &str) {
        if let Ok(mut failing) = self.shared.failing.lock() {
            failing.push((plural.to_string(), verb.to_string()));
        }
    }

    /// Ends every [`FakeKube::fail_calls`].
    pub fn stop_failing(&self) {
        if let Ok(mut failing) = self.shared.failing.lock() {
            failing.clear();
        }
    }

    /// How many calls were failed by [`FakeKube::fail_calls`].
    pub fn failed_calls(&self) -> usize {
        self.shared.failed.load(Ordering::SeqCst)
    }

    /// The next status update of PodCertificateRequest `namespace/name`
    /// finds that another writer has just put `status` on it (stored
    /// without validation, a new resourceVersion, watchers told), so the
    /// update carries a stale resourceVersion and gets 409 Conflict.
    pub fn answer_before_next_status_update(
        &self,
        namespace: &str,
        name: &str,
        status: serde_json::Value,
    ) {
        if let Ok(mut interlopers) = self.shared.interlopers.lock() {
            interlopers.insert((namespace.to_string(), name.to_string()), status);
        }
    }

    /// Sends watchers of `plural` a MODIFIED event carrying `object` as
    /// given (e.g. an older version), without storing it: a stale event,
    /// as a watch may deliver after a reconnect or a relist.
    pub fn send_stale_event(&self, plural: &str, object: &serde_json::Value) {
        let mut objects = self.shared.objects.lock().expect("objects");
        let line = watch_line("MODIFIED", object);
        objects.watchers.retain(|w| {
            if w.plural != plural || !matches_filter(object, w.namespace.as_deref(), &w.selector) {
                return true;
            }
            w.tx.send(line.clone()).is_ok()
        });
    }

    /// A projected service-account token signed with the cluster's key
    /// (checkable offline through OIDC discovery), bound to a pod.
    pub fn mint_token(
        &self,
        namespace: &str,
        service_account: &str,
        pod: Option<(&str, &str)>,
    ) -> String {
        let issuer = self.oidc.lock().expect("issuer");
        issuer
            .mint(
                &meshca_certs::token::TokenRequest {
                    namespace: namespace.into(),
                    service_account: service_account.into(),
                    audiences: vec!["istio-ca".into()],
                    ttl: Duration::from_secs(600),
                    pod: pod.map(|(name, uid)| meshca_certs::token::ObjectRef {
                        name: name.into(),
                        uid: uid.into(),
                    }),
                },
                std::time::SystemTime::now(),
            )
            .expect("minting")
    }

    /// Replaces the cluster's signing key (new `kid`) and its JWKS.
    pub fn rotate_signing_key(&self) {
        let fresh = meshca_certs::token::TokenIssuer::generate()
            .expect("issuer")
            .with_issuer(OIDC_ISSUER);
        if let Ok(mut jwks) = self.shared.jwks.lock() {
            *jwks = fresh.jwks_json();
        }
        if let Ok(mut oidc) = self.oidc.lock() {
            *oidc = fresh;
        }
    }

    /// How many TokenReviews were answered.
    pub fn reviews(&self) -> usize {
        self.shared.reviews.load(Ordering::SeqCst)
    }

    /// Makes every answer wait this long.
    pub fn set_latency(&self, latency: Duration) {
        self.shared
            .latency_ms
            .store(latency.as_millis() as u64, Ordering::SeqCst);
    }

    /// Stops serving: the listener and every connection are closed.
    pub fn stop(&mut self) {
        // Dropping the JoinSet aborts the accept loop and, with it, the
        // connection tasks it owns.
        self.tasks = None;
    }

    /// Serves again on the same port.
    pub async fn restart(&mut self) {
        let mut listener = None;
        for _ in 0..50 {
            match TcpListener::bind(self.addr).await {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        self.serve(listener.expect("rebinding the fake API server's port"));
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn json_response(status: StatusCode, body: serde_json::Value) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *response.status_mut() = status;
    response.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

fn status_error(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(
        code,
        serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason, "code": code.as_u16()
        }),
    )
}

async fn handle(
    shared: Arc<Shared>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let latency = shared.latency_ms.load(Ordering::SeqCst);
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    let authorized = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {CLIENT_TOKEN}"));
    if !authorized {
        return Ok(status_error(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Unauthorized",
        ));
    }
    let path = request.uri().path().to_string();
    let query = request.uri().query().unwrap_or_default().to_string();
    let method = request.method().clone();
    let body = match request.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return Ok(status_error(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "unreadable body",
            ))
        }
    };
    match (method.as_str(), path.as_str()) {
        ("POST", "/apis/authentication.k8s.io/v1/tokenreviews") => Ok(token_review(&shared, &body)),
        ("GET", "/version") => Ok(json_response(
            StatusCode::OK,
            serde_json::json!({
                "major": "1", "minor": "36", "gitVersion": "v1.36.0-fake", "gitCommit": "fake",
                "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25",
                "compiler": "gc", "platform": "linux/amd64",
            }),
        )),
        ("GET", "/.well-known/openid-configuration") => Ok(json_response(
            StatusCode::OK,
            serde_json::json!({
                "issuer": OIDC_ISSUER,
                "jwks_uri": "https://10.96.0.1:443/openid/v1/jwks",
                "response_types_supported": ["id_token"],
                "subject_types_supported": ["public"],
                "id_token_signing_alg_values_supported": ["ES256", "RS256"],
            }),
        )),
        ("GET", "/openid/v1/jwks") => {
            let jwks = shared.jwks.lock().map(|j| j.clone()).unwrap_or_default();
            Ok(json_response(
                StatusCode::OK,
                serde_json::from_str(&jwks).unwrap_or_default(),
            ))
        }
        ("GET", discovery)
            if discovery.starts_with("/apis/") && discovery.matches('/').count() == 3 =>
        {
            Ok(api_resource_list(&discovery["/apis/".len()..]))
        }
        _ => match parse_resource_path(&path) {
            Some(target) => Ok(resource(&shared, method.as_str(), target, &query, &body).await),
            None => Ok(status_error(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            )),
        },
    }
}

/// API discovery of one group version (`GET /apis/GROUP/VERSION`), as
/// kube-apiserver answers it: 404 when the store serves nothing of it.
fn api_resource_list(group_version: &str) -> Response<Body> {
    let mut resources = Vec::new();
    for (plural, kind, api_version, namespaced) in RESOURCES {
        if *api_version != group_version {
            continue;
        }
        resources.push(serde_json::json!({
            "name": plural, "singularName": "", "namespaced": namespaced, "kind": kind,
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
        }));
        if *plural == "podcertificaterequests" {
            resources.push(serde_json::json!({
                "name": "podcertificaterequests/status", "singularName": "", "namespaced": true,
                "kind": kind, "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        );
    }
    json_response(
        StatusCode::OK,
        serde_json::json!({
            "kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": group_version, "resources": resources,
        }),
    )
}

fn namespace_object(name: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name},
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"}
    })
}

/// A request on the object store: which kind, namespace, name.
struct Target {
    plural: String,
    namespace: Option<String>,
    name: Option<String>,
    /// `status` for the status subresource.
    subresource: Option<String>,
}

fn parse_resource_path(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let rest: &[&str] = match parts.as_slice() {
        ["api", "v1", rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => return None,
    };
    let (plural, namespace, name, subresource) = match rest {
        ["namespaces"] => ("namespaces", None, None, None),
        ["namespaces", ns] => ("namespaces", None, Some(*ns), None),
        ["namespaces", ns, plural] => (*plural, Some(*ns), None, None),
        ["namespaces", ns, plural, name] => (*plural, Some(*ns), Some(*name), None),
        ["namespaces", ns, plural, name, "status"] => {
            (*plural, Some(*ns), Some(*name), Some("status"))
        }
        [plural] => (*plural, None, None, None),
        [plural, name] => (*plural, None, Some(*name), None),
        [plural, name, "status"] => (*plural, None, Some(*name), Some("status")),
        _ => return None,
    };
    let known = RESOURCES.iter().find(|r| r.0 == plural)?;
    let api_version_ok = match parts.as_slice() {
        ["api", ..] => known.2 == "v1",
        ["apis", group, version, ..] => known.2 == format!("{group}/{version}"),
        _ => false,
    };
    if !api_version_ok {
        return None;
    }
    if subresource.is_some() && plural != "podcertificaterequests" {
        return None;
    }
    Some(Target {
        plural: plural.to_string(),
        namespace: namespace.map(String::from),
        name: name.map(String::from),
        subresource: subresource.map(String::from),
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("zz");
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(if bytes[i] == b'+' { b' ' } else { bytes[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn field_selector(query: &str) -> Vec<(String, String)> {
    query_param(query, "fieldSelector")
        .map(percent_decode)
        .map(|f| {
            f.split(',')
                .filter_map(|term| {
                    let (k, v) = term.split_once('=')?;
                    Some((k.trim_end_matches('=').to_string(), v.to_string()))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn kind_of(plural: &str) -> (&'static str, &'static str) {
    RESOURCES
        .iter()
        .find(|r| r.0 == plural)
        .map(|r| (r.1, r.2))
        .unwrap_or(("Unknown", "v1"))
}

async fn resource(
    shared: &Shared,
    method: &str,
    target: Target,
    query: &str,
    body: &[u8],
) -> Response<Body> {
    let (kind, api_version) = kind_of(&target.plural);
    let namespace = target.namespace.clone().unwrap_or_default();
    let not_found = |name: &str| {
        status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{} \"{name}\" not found", target.plural),
        )
    };
    let parse_body = || serde_json::from_slice::<serde_json::Value>(body).ok();
    if method == "POST" && target.name.is_none() {
        let gate = shared
            .create_gate
            .lock()
            .ok()
            .and_then(|g| g.clone())
            .filter(|(p, _)| *p == target.plural)
            .map(|(_, b)| b);
        if let Some(barrier) = gate {
            barrier.wait().await;
        }
    }
    let Ok(mut objects) = shared.objects.lock() else {
        return status_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "poisoned",
        );
    };
    let (call_plural, verb) = call_of(method, &target, query);
    let fail = shared
        .failing
        .lock()
        .is_ok_and(|f| f.iter().any(|(p, v)| *p == call_plural && v == verb));
    if fail {
        objects.count(&call_plural, verb);
        shared.failed.fetch_add(1, Ordering::SeqCst);
        return status_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "an error on the server (injected by the test) has prevented the request from succeeding",
        );
    }
    // As kube-apiserver: a create in a namespace that does not exist is
    // `404 namespaces "…" not found` (the namespace, not the object).
    if method == "POST"
        && target.name.is_none()
        && !namespace.is_empty()
        && !objects.items.contains_key(&(
            "namespaces".to_string(),
            String::new(),
            namespace.clone(),
        ))
    {
        return status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("namespaces \"{namespace}\" not found"),
        );
    }
    let key = |name: &str| (target.plural.clone(), namespace.clone(), name.to_string());
    match (method, target.name.as_deref()) {
        ("GET", None) => {
            let selector = field_selector(query);
            if matches!(query_param(query, "watch"), Some("true") | Some("1")) {
                objects.count(&target.plural, "watch");
                let since: u64 = query_param(query, "resourceVersion")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
                for (rv, plural, event, object) in &objects.history {
                    if *rv > since
                        && *plural == target.plural
                        && matches_filter(object, target.namespace.as_deref(), &selector)
                    {
                        let _ = tx.send(watch_line(event, object));
                    }
                }
                objects.watchers.push(Watcher {
                    plural: target.plural.clone(),
                    namespace: target.namespace.clone(),
                    selector,
                    tx,
                });
                let stream = futures_util_stream(rx);
                let mut response = Response::new(BodyExt::boxed(StreamBody::new(stream)));
                response.headers_mut().insert(
                    "content-type",
                    hyper::header::HeaderValue::from_static("application/json"),
                );
                return response;
            }
            objects.count(&target.plural, "list");
            let items: Vec<&serde_json::Value> = objects
                .items
                .iter()
                .filter(|((p, _, _), o)| {
                    *p == target.plural && matches_filter(o, target.namespace.as_deref(), &selector)
                })
                .map(|(_, o)| o)
                .collect();
            json_response(
                StatusCode::OK,
                serde_json::json!({
                    "kind": format!("{kind}List"), "apiVersion": api_version,
                    "metadata": {"resourceVersion": objects.resource_version.to_string()},
                    "items": items,
                }),
            )
        }
        ("GET", Some(name)) => {
            objects.count(&target.plural, "get");
            match objects.items.get(&key(name)) {
                Some(o) => json_response(StatusCode::OK, o.clone()),
                None => not_found(name),
            }
        }
        ("POST", None) => {
            objects.count(&target.plural, "create");
            let Some(mut object) = parse_body() else {
                return status_error(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
            };
            if target.namespace.is_some() {
                object["metadata"]["namespace"] = serde_json::json!(namespace);
                let ns_key = ("namespaces".to_string(), String::new(), namespace.clone());
                if !objects.items.contains_key(&ns_key) {
                    return not_found(&namespace);
                }
            }
            object["kind"] = serde_json::json!(kind);
            object["apiVersion"] = serde_json::json!(api_version);
            if let Err(message) = validate_create(&target.plural, &mut object) {
                return invalid(kind, &object, &message);
            }
            let name = object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            if objects.items.contains_key(&key(&name)) {
                return status_error(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    &format!("{} \"{name}\" already exists", target.plural),
                );
            }
            let stored = objects.event(&target.plural, "ADDED", object);
            json_response(StatusCode::CREATED, stored)
        }
        ("PUT", Some(name)) => {
            let status_only = target.subresource.as_deref() == Some("status");
            if status_only {
                objects.count(&format!("{}/status", target.plural), "update");
            } else {
                objects.count(&target.plural, "update");
            }
            let Some(mut object) = parse_body() else {
                return status_error(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
            };
            let Some(mut current) = objects.items.get(&key(name)).cloned() else {
                return not_found(name);
            };
            let interloper = if status_only && target.plural == "podcertificaterequests" {
                shared
                    .interlopers
                    .lock()
                    .ok()
                    .and_then(|mut i| i.remove(&(namespace.clone(), name.to_string())))
            } else {
                None
            };
            if let Some(status) = interloper {
                let mut answered = current.clone();
                answered["status"] = status;
                current = objects.event(&target.plural, "MODIFIED", answered);
            }
            let sent = object["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default();
            if !sent.is_empty() && current["metadata"]["resourceVersion"] != sent {
                return status_error(
                    StatusCode::CONFLICT,
                    "Conflict",
                    &format!("Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again", target.plural),
                );
            }
            object["metadata"]["uid"] = current["metadata"]["uid"].clone();
            object["metadata"]["creationTimestamp"] =
                current["metadata"]["creationTimestamp"].clone();
            if target.namespace.is_some() {
                object["metadata"]["namespace"] = serde_json::json!(namespace);
            }
            object["kind"] = serde_json::json!(kind);
            object["apiVersion"] = serde_json::json!(api_version);
            if let Err(message) =
                validate_update(&target.plural, status_only, &mut object, &current)
            {
                return invalid(kind, &object, &message);
            }
            let stored = objects.event(&target.plural, "MODIFIED", object);
            json_response(StatusCode::OK, stored)
        }
        ("PATCH", Some(name)) => {
            objects.count(&target.plural, "patch");
            let Some(patch) = parse_body() else {
                return status_error(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
            };
            let Some(mut object) = objects.items.get(&key(name)).cloned() else {
                return not_found(name);
            };
            merge_patch(&mut object, &patch);
            let stored = objects.event(&target.plural, "MODIFIED", object);
            json_response(StatusCode::OK, stored)
        }
        ("DELETE", Some(name)) => {
            objects.count(&target.plural, "delete");
            let Some(object) = objects.items.get(&key(name)).cloned() else {
                return not_found(name);
            };
            let stored = objects.event(&target.plural, "DELETED", object);
            json_response(StatusCode::OK, stored)
        }
        _ => status_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        ),
    }
}

/// The name a call is counted under: `(plural or plural/status, verb)`.
fn call_of(method: &str, target: &Target, query: &str) -> (String, &'static str) {
    let verb = match (method, target.name.is_some()) {
        ("GET", true) => "get",
        ("GET", false) if matches!(query_param(query, "watch"), Some("true") | Some("1")) => {
            "watch"
        }
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", _) => "delete",
        _ => "other",
    };
    let plural = match target.subresource.as_deref() {
        Some(sub) => format!("{}/{sub}", target.plural),
        None => target.plural.clone(),
    };
    (plural, verb)
}

/// kube-apiserver's creation-time checks (and defaults) of the kinds it
/// validates here.
fn validate_create(plural: &str, object: &mut serde_json::Value) -> Result<(), String> {
    match plural {
        "podcertificaterequests" => {
            crate::fake_certificates::create_pod_certificate_request(object)
        }
        "clustertrustbundles" => crate::fake_certificates::cluster_trust_bundle(object, None),
        _ => Ok(()),
    }
}

/// kube-apiserver's update rules: a PodCertificateRequest's spec never
/// changes and its status only through the `status` subresource (each
/// takes the other part from the stored object, as the API's strategies
/// do); the status is validated; a ClusterTrustBundle is validated.
fn validate_update(
    plural: &str,
    status_only: bool,
    object: &mut serde_json::Value,
    current: &serde_json::Value,
) -> Result<(), String> {
    match plural {
        "podcertificaterequests" if status_only => {
            let status = object["status"].clone();
            *object = current.clone();
            object["status"] = status;
            crate::fake_certificates::pod_certificate_request_status(
                object,
                current,
                OffsetDateTime::now_utc(),
            )
        }
        "podcertificaterequests" => {
            if object["spec"] != current["spec"] {
                return Err("spec: Invalid value: field is immutable".into());
            }
            object["status"] = current["status"].clone();
            Ok(())
        }
        "clustertrustbundles" => {
            crate::fake_certificates::cluster_trust_bundle(object, Some(current))
        }
        _ => Ok(()),
    }
}

/// 422 Invalid, as kube-apiserver answers a validation failure.
fn invalid(kind: &str, object: &serde_json::Value, message: &str) -> Response<Body> {
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    status_error(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        &format!("{kind} \"{name}\" is invalid: {message}"),
    )
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut serde_json::Value, patch: &serde_json::Value) {
    match patch {
        serde_json::Value::Object(fields) => {
            if !target.is_object() {
                *target = serde_json::json!({});
            }
            for (k, v) in fields {
                if v.is_null() {
                    if let Some(map) = target.as_object_mut() {
                        map.remove(k);
                    }
                } else {
                    merge_patch(&mut target[k], v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn futures_util_stream(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Bytes>,
) -> impl futures::Stream<Item = Result<hyper::body::Frame<Bytes>, Infallible>> {
    futures::stream::poll_fn(move |cx| {
        rx.poll_recv(cx)
            .map(|b| b.map(|b| Ok(hyper::body::Frame::data(b))))
    })
}

fn token_review(shared: &Shared, body: &[u8]) -> Response<Body> {
    shared.reviews.fetch_add(1, Ordering::SeqCst);
    let Ok(review) = serde_json::from_slice::<serde_json::Value>(body) else {
        return status_error(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
    };
    let token = review["spec"]["token"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let wanted: Vec<String> = review["spec"]["audiences"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    let user = shared
        .tokens
        .lock()
        .ok()
        .and_then(|t| t.get(&token).cloned());
    let status = match user {
        None => {
            serde_json::json!({"user": {}, "error": "[invalid bearer token, token lookup failed]"})
        }
        Some(user) => {
            let matched: Vec<&String> = if wanted.is_empty() {
                user.audiences.iter().collect()
            } else {
                user.audiences
                    .iter()
                    .filter(|a| wanted.contains(a))
                    .collect()
            };
            if matched.is_empty() {
                serde_json::json!({"user": {}, "error": "[invalid bearer token, token audiences is invalid for the target audiences]"})
            } else {
                let mut extra = serde_json::Map::new();
                if let Some((name, uid)) = &user.pod {
                    extra.insert(
                        "authentication.kubernetes.io/pod-name".into(),
                        serde_json::json!([name]),
                    );
                    extra.insert(
                        "authentication.kubernetes.io/pod-uid".into(),
                        serde_json::json!([uid]),
                    );
                }
                serde_json::json!({
                    "authenticated": true,
                    "user": {"username": user.username, "uid": "sa-uid", "groups": user.groups, "extra": extra},
                    "audiences": matched,
                })
            }
        }
    };
    json_response(
        StatusCode::CREATED,
        serde_json::json!({
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": null},
            "spec": {"token": token, "audiences": wanted},
            "status": status,
        }),
    )
}

fn base64_encode(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(data)
}
