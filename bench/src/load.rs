//! The load run: prepare identities, open connections, drive requests,
//! measure.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use meshca_certs::token::{TokenIssuer, TokenRequest};
use meshca_certs::{build_csr, PrivateKey, SpiffeId, TrustDomain};
use meshca_proto::istio::v1::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use meshca_proto::IstioCertificateRequest;
use serde_json::json;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::report::{new_histogram, RunReport, WindowEdge};
use crate::{baseline, RunArgs, Target};

/// One identity's request, made before the clock starts.
#[derive(Clone)]
pub(crate) struct Prepared {
    /// The CSR, PEM.
    pub(crate) csr: String,
    /// `authorization` header value, if any.
    pub(crate) authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    /// The identity asked for on behalf of a pod, as a node agent (ztunnel)
    /// does: sent in the request's metadata.
    pub(crate) impersonate: Option<String>,
    /// The caller's cluster, sent as the `clusterid` header (none: the
    /// CA's local cluster).
    pub(crate) cluster: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

/// Makes `n` CSRs (and tokens) for identities `ns/sa-<i>`.
pub(crate) fn prepare(
    args: &RunArgs,
    issuer: Option<&TokenIssuer>,
    tokens: Option<&[(String, String, String)]>,
) -> anyhow::Result<Vec<Prepared>> {
    let td: TrustDomain = args.trust_domain.parse().context("--trust-domain")?;
    let n = tokens.map(|t| t.len()).unwrap_or(args.identities).max(1);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (ns, sa, token) = match tokens {
            Some(t) => (t[i].0.clone(), t[i].1.clone(), Some(t[i].2.clone())),
            None => {
                let (ns, sa) = ("bench".to_string(), format!("sa-{i}"));
                let token = match issuer {
                    Some(issuer) => Some(issuer.mint(
                        &TokenRequest {
                            namespace: ns.clone(),
                            service_account: sa.clone(),
                            audiences: vec!["istio-ca".into()],
                            ttl: Duration::from_secs(3600),
                            pod: None,
                        },
                        std::time::SystemTime::now(),
                    )?),
                    None => None,
                };
                (ns, sa, token)
            }
        };
        let id = SpiffeId::for_workload(&td, &ns, &sa)?;
        let key = PrivateKey::generate(args.key)?;
        let csr = build_csr(&key, &id)?;
        let authorization = match token {
            Some(t) => Some(
                format!("Bearer {t}")
                    .parse()
                    .context("token is not a valid header value")?,
            ),
            None => None,
        };
        out.push(Prepared {
            csr,
            authorization,
            impersonate: None,
            cluster: None,
        });
    }
    Ok(out)
}

/// A connected client of either protocol.
#[derive(Clone)]
pub(crate) enum Client {
    /// IstioCertificateService over an HTTP/2 TLS channel.
    Istio(IstioCertificateServiceClient<Channel>),
    /// cfssl's HTTP JSON API.
    Cfssl(crate::load::cfssl::CfsslClient),
}

impl Client {
    /// One request; `Err` carries the status name.
    pub(crate) async fn call(&mut self, p: &Prepared) -> Result<(), String> {
        match self {
            Client::Istio(c) => {
                let metadata = p.impersonate.as_ref().map(|id| prost_types::Struct {
                    fields: [(
                        meshca_proto::IMPERSONATED_IDENTITY_KEY.to_string(),
                        prost_types::Value {
                            kind: Some(prost_types::value::Kind::StringValue(id.clone())),
                        },
                    )]
                    .into(),
                });
                let mut request = tonic::Request::new(IstioCertificateRequest {
                    csr: p.csr.clone(),
                    validity_duration: 0,
                    metadata,
                });
                if let Some(a) = &p.authorization {
                    request.metadata_mut().insert("authorization", a.clone());
                }
                if let Some(cluster) = &p.cluster {
                    request.metadata_mut().insert("clusterid", cluster.clone());
                }
                match c.create_certificate(request).await {
                    Ok(r) if !r.get_ref().cert_chain.is_empty() => Ok(()),
                    Ok(_) => Err("EMPTY_CHAIN".into()),
                    Err(s) => Err(format!("{:?}", s.code())),
                }
            }
            Client::Cfssl(c) => c.sign(&p.csr).await,
        }
    }
}

/// Opens `n` connections to an Istio-protocol CA trusting `root_pem`.
pub(crate) async fn connect_istio(
    addr: &str,
    root_pem: &str,
    n: usize,
) -> anyhow::Result<Vec<Client>> {
    connect_istio_from(addr, root_pem, n, None).await
}

/// As [`connect_istio`], each connection from `source` (default: the
/// system's choice).
pub(crate) async fn connect_istio_from(
    addr: &str,
    root_pem: &str,
    n: usize,
    source: Option<std::net::IpAddr>,
) -> anyhow::Result<Vec<Client>> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(root_pem))
            .domain_name("istiod.istio-system.svc");
        let channel = Endpoint::from_shared(addr.to_string())
            .context("--addr")?
            .tls_config(tls)
            .context("TLS configuration")?
            .connect_timeout(Duration::from_secs(5))
            .local_address(source)
            .connect()
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        clients.push(Client::Istio(IstioCertificateServiceClient::new(channel)));
    }
    Ok(clients)
}

/// The outcome of driving load.
pub(crate) struct Driven {
    /// Successes.
    pub(crate) ok: u64,
    /// Failures by status.
    pub(crate) errors: BTreeMap<String, u64>,
    /// Latencies (µs) of successes.
    pub(crate) latency: Histogram<u64>,
    /// Measured time.
    pub(crate) elapsed: Duration,
}

/// Drives `concurrency` workers over `clients` until `deadline` or `count`.
pub(crate) async fn drive(
    clients: &[Client],
    prepared: Arc<Vec<Prepared>>,
    concurrency: usize,
    duration: Option<Duration>,
    count: Option<u64>,
) -> Driven {
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut workers = Vec::new();
    for w in 0..concurrency.max(1) {
        let mut client = clients[w % clients.len()].clone();
        let (next, stop, prepared) = (next.clone(), stop.clone(), prepared.clone());
        workers.push(tokio::spawn(async move {
            let mut hist = new_histogram();
            let mut errors: BTreeMap<String, u64> = BTreeMap::new();
            let mut ok = 0u64;
            loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if count.is_some_and(|c| i >= c) {
                    break;
                }
                if duration.is_some_and(|d| start.elapsed() >= d) {
                    break;
                }
                let p = &prepared[(i as usize) % prepared.len()];
                let t = Instant::now();
                match client.call(p).await {
                    Ok(()) => {
                        ok += 1;
                        let _ = hist.record(t.elapsed().as_micros().max(1) as u64);
                    }
                    Err(code) => *errors.entry(code).or_default() += 1,
                }
            }
            (ok, errors, hist)
        }));
    }
    let mut driven = Driven {
        ok: 0,
        errors: BTreeMap::new(),
        latency: new_histogram(),
        elapsed: Duration::ZERO,
    };
    for w in workers {
        if let Ok((ok, errors, hist)) = w.await {
            driven.ok += ok;
            for (k, v) in errors {
                *driven.errors.entry(k).or_default() += v;
            }
            let _ = driven.latency.add(&hist);
        }
    }
    stop.store(true, Ordering::Relaxed);
    driven.elapsed = start.elapsed();
    driven
}

/// `meshca-bench` without a subcommand. `Ok(false)` when requests failed.
pub(crate) async fn run(args: RunArgs) -> anyhow::Result<bool> {
    let issuer = match &args.data_dir {
        Some(dir) if args.tokens.is_none() => Some(
            TokenIssuer::load(dir)
                .with_context(|| format!("--data-dir {}: local token issuer", dir.display()))?,
        ),
        _ => None,
    };
    let tokens = match &args.tokens {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--tokens {}", path.display()))?;
            let mut t = Vec::new();
            for (n, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let parts: Vec<&str> = line.split_whitespace().collect();
                let [ns, sa, token] = parts[..] else {
                    anyhow::bail!(
                        "--tokens {} line {}: expected `NAMESPACE SERVICE_ACCOUNT TOKEN`",
                        path.display(),
                        n + 1
                    );
                };
                t.push((ns.to_string(), sa.to_string(), token.to_string()));
            }
            Some(t)
        }
        None => None,
    };
    eprintln!(
        "meshca-bench: preparing {} CSRs ({}) and tokens…",
        tokens.as_ref().map(|t| t.len()).unwrap_or(args.identities),
        args.key.name()
    );
    let prepared = Arc::new(prepare(&args, issuer.as_ref(), tokens.as_deref())?);
    let clients = match args.target {
        Target::Istio => {
            let root_path = args
                .root_cert
                .clone()
                .or_else(|| args.data_dir.as_ref().map(|d| d.join("root-cert.pem")))
                .context(
                    "--root-cert (or --data-dir) is needed to trust the CA's TLS certificate",
                )?;
            let root_pem = std::fs::read_to_string(&root_path)
                .with_context(|| format!("--root-cert {}", root_path.display()))?;
            connect_istio(&args.addr, &root_pem, args.connections).await?
        }
        Target::Cfssl => (0..args.connections.max(1))
            .map(|_| cfssl::CfsslClient::new(&args.addr).map(Client::Cfssl))
            .collect::<anyhow::Result<Vec<_>>>()?,
    };
    let with_token =
        prepared.first().is_some_and(|p| p.authorization.is_some()) && tokens.is_none();
    let yardstick = args
        .crypto_baseline
        .then(|| baseline::Yardstick::new(args.key, with_token))
        .transpose()?;
    let limit_before = yardstick.as_ref().map(|y| y.limits_per_core());
    if !args.warmup.is_zero() {
        drive(
            &clients,
            prepared.clone(),
            args.concurrency,
            Some(args.warmup),
            None,
        )
        .await;
    }
    let before = WindowEdge::read(args.server_pid);
    let driven = drive(
        &clients,
        prepared.clone(),
        args.concurrency,
        if args.requests.is_some() {
            None
        } else {
            Some(args.duration)
        },
        args.requests,
    )
    .await;
    let after = WindowEdge::read(args.server_pid);
    let baseline = match (yardstick, limit_before) {
        (Some(yardstick), Some(limit_before)) => {
            let limit_after = yardstick.limits_per_core();
            let csrs: Vec<String> = prepared.iter().take(256).map(|p| p.csr.clone()).collect();
            Some(baseline::Baseline {
                limit_per_core: (limit_before.full + limit_after.full) / 2.0,
                limit_before: limit_before.full,
                limit_after: limit_after.full,
                limit_without_token_per_core: limit_before
                    .without_token
                    .zip(limit_after.without_token)
                    .map(|(b, a)| (b + a) / 2.0),
                operations: yardstick.operations(),
                in_process_path_per_core: yardstick.in_process_path_per_core(&csrs)?,
            })
        }
        _ => None,
    };
    let mut setup = BTreeMap::new();
    setup.insert("target", json!(format!("{:?}", args.target).to_lowercase()));
    setup.insert("addr", json!(args.addr));
    setup.insert("key", json!(args.key.name()));
    setup.insert("identities", json!(prepared.len()));
    setup.insert("connections", json!(clients.len()));
    setup.insert("concurrency", json!(args.concurrency));
    setup.insert("generator_threads", json!(args.threads));
    setup.insert(
        "auth",
        json!(if tokens.is_some() {
            "tokens-file"
        } else if issuer.is_some() {
            "offline-jwt"
        } else {
            "none"
        }),
    );
    Ok(RunReport::of_window(setup, driven, before, after, baseline).print(args.json))
}

/// cfssl's sign endpoint, for comparison runs.
pub(crate) mod cfssl {
    use anyhow::Context;
    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;
    use hyper_util::rt::TokioIo;
    use std::sync::Arc;
    use tokio::sync::Mutex;

    type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

    /// One keep-alive HTTP/1.1 connection to `cfssl serve`.
    #[derive(Clone)]
    pub(crate) struct CfsslClient {
        authority: String,
        sender: Arc<Mutex<Option<Sender>>>,
    }

    impl CfsslClient {
        /// A client of `http://HOST:PORT`.
        pub(crate) fn new(addr: &str) -> anyhow::Result<Self> {
            let uri: http::Uri = addr.parse().context("--addr")?;
            let authority = uri
                .authority()
                .context("--addr has no host:port")?
                .to_string();
            Ok(Self {
                authority,
                sender: Arc::new(Mutex::new(None)),
            })
        }

        async fn connect(&self) -> Result<Sender, String> {
            let tcp = tokio::net::TcpStream::connect(&self.authority)
                .await
                .map_err(|e| format!("CONNECT: {e}"))?;
            let _ = tcp.set_nodelay(true);
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .map_err(|e| format!("HANDSHAKE: {e}"))?;
            tokio::spawn(conn);
            Ok(sender)
        }

        /// `POST /api/v1/cfssl/sign {"certificate_request": csr}`.
        pub(crate) async fn sign(&self, csr: &str) -> Result<(), String> {
            let mut guard = self.sender.lock().await;
            if guard.as_ref().is_none_or(|s| s.is_closed()) {
                *guard = Some(self.connect().await?);
            }
            let Some(sender) = guard.as_mut() else {
                return Err("NO_CONNECTION".into());
            };
            let body = serde_json::json!({ "certificate_request": csr }).to_string();
            let request = http::Request::post("/api/v1/cfssl/sign")
                .header("host", &self.authority)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| e.to_string())?;
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| format!("HTTP: {e}"))?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("HTTP: {e}"))?
                .to_bytes();
            if !status.is_success() {
                return Err(format!("HTTP_{}", status.as_u16()));
            }
            let v: serde_json::Value =
                serde_json::from_slice(&body).map_err(|_| "BAD_JSON".to_string())?;
            if v["success"] == true
                && v["result"]["certificate"]
                    .as_str()
                    .is_some_and(|c| c.contains("BEGIN CERTIFICATE"))
            {
                Ok(())
            } else {
                Err("CFSSL_ERROR".into())
            }
        }
    }
}
