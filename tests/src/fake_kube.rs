//! A fake Kubernetes API server for end-to-end tests: HTTPS with its own
//! CA, a kubeconfig pointing at it, and the real JSON of the endpoints
//! meshca uses: `TokenReview`, and pods list and watch (streamed watch
//! events, resource versions). It counts reviews, can answer slowly, and
//! can be stopped and restarted on the same port.

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

#[derive(Default)]
struct Pods {
    items: std::collections::BTreeMap<(String, String), serde_json::Value>,
    resource_version: u64,
    history: Vec<(u64, &'static str, serde_json::Value)>,
    watchers: Vec<tokio::sync::mpsc::UnboundedSender<Bytes>>,
}

impl Pods {
    fn event(&mut self, kind: &'static str, mut pod: serde_json::Value) {
        self.resource_version += 1;
        pod["metadata"]["resourceVersion"] = serde_json::json!(self.resource_version.to_string());
        let line = watch_line(kind, &pod);
        self.history.push((self.resource_version, kind, pod));
        self.watchers.retain(|w| w.send(line.clone()).is_ok());
    }
}

fn watch_line(kind: &str, pod: &serde_json::Value) -> Bytes {
    let mut text = serde_json::json!({"type": kind, "object": pod}).to_string();
    text.push('\n');
    Bytes::from(text)
}

/// The issuer of the fake cluster's service-account tokens.
pub const OIDC_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

#[derive(Default)]
struct Shared {
    tokens: Mutex<HashMap<String, FakeUser>>,
    jwks: Mutex<String>,
    pods: Mutex<Pods>,
    reviews: AtomicUsize,
    latency_ms: AtomicU64,
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

    /// Adds (or replaces) a running pod; watchers see the event.
    pub fn add_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        service_account: &str,
        node: &str,
    ) {
        let pod = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
            "spec": {"serviceAccountName": service_account, "nodeName": node, "containers": [{"name": "app", "image": "app"}]},
            "status": {"phase": "Running"}
        });
        if let Ok(mut pods) = self.shared.pods.lock() {
            let kind = if pods.items.contains_key(&(namespace.into(), name.into())) {
                "MODIFIED"
            } else {
                "ADDED"
            };
            pods.items
                .insert((namespace.into(), name.into()), pod.clone());
            pods.event(kind, pod);
        }
    }

    /// Deletes a pod; watchers see the event.
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        if let Ok(mut pods) = self.shared.pods.lock() {
            if let Some(pod) = pods.items.remove(&(namespace.into(), name.into())) {
                pods.event("DELETED", pod);
            }
        }
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
        ("GET", "/api/v1/pods") => Ok(pods(&shared, &query)),
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
        _ => Ok(status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        )),
    }
}

fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn pods(shared: &Shared, query: &str) -> Response<Body> {
    let Ok(mut pods) = shared.pods.lock() else {
        return status_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "poisoned",
        );
    };
    // Field selectors on the node, as a node agent would use them.
    let node = query_param(query, "fieldSelector").and_then(|f| {
        f.strip_prefix("spec.nodeName%3D")
            .or(f.strip_prefix("spec.nodeName="))
    });
    let matches = |pod: &serde_json::Value| node.is_none_or(|n| pod["spec"]["nodeName"] == n);
    if matches!(query_param(query, "watch"), Some("true") | Some("1")) {
        let since: u64 = query_param(query, "resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
        for (rv, kind, pod) in &pods.history {
            if *rv > since && matches(pod) {
                let _ = tx.send(watch_line(kind, pod));
            }
        }
        pods.watchers.push(tx);
        let stream = futures_util_stream(rx);
        let mut response = Response::new(BodyExt::boxed(StreamBody::new(stream)));
        response.headers_mut().insert(
            "content-type",
            hyper::header::HeaderValue::from_static("application/json"),
        );
        return response;
    }
    let items: Vec<&serde_json::Value> = pods.items.values().filter(|p| matches(p)).collect();
    json_response(
        StatusCode::OK,
        serde_json::json!({
            "kind": "PodList", "apiVersion": "v1",
            "metadata": {"resourceVersion": pods.resource_version.to_string()},
            "items": items,
        }),
    )
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
