//! `meshca-bench attack SCENARIO`: hostile load against a real meshca (the
//! binary, started against the fake Kubernetes API of the end-to-end
//! tests), and what it costs the server and its honest clients.
//!
//! Scenarios:
//! - `cancelled-junk`: distinct JWT-shaped tokens, each request given up
//!   after a short deadline (the client's `grpc-timeout` and a RST_STREAM)
//!   while the TokenReview is still in flight;
//! - `reset-flood`: one HTTP/2 connection sending malformed HEADERS frames
//!   (each makes the server reset the stream): how many until GOAWAY, and
//!   its error code;
//! - `connection-flood`: more TLS connections than the server allows,
//!   held open;
//! - `idle`: idle HTTP/2 connections: when does the server close them;
//! - `junk-mix`: real load, then real load with 10× as many junk requests:
//!   the real requests' errors and p99, and the TokenReviews junk caused.
//!
//! Every scenario reports the server's RSS before, after and at its peak
//! (sampled every 50 ms), and what a probe (one real request every 250 ms,
//! rotating over 64 identities) saw meanwhile.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use meshca_certs::parse_duration;
use meshca_tests::fake_kube::FakeUser;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::load::{self, Client, Prepared};
use crate::report::new_histogram;
use crate::server_process::{self, Meshca};
use crate::{proc_stats, RunArgs};

/// The hostile scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Scenario {
    /// Distinct JWT-shaped tokens, each request cancelled after --deadline.
    CancelledJunk,
    /// Malformed HEADERS frames on one connection until GOAWAY.
    ResetFlood,
    /// --connections TLS connections held open (more than the server's cap).
    ConnectionFlood,
    /// --connections idle HTTP/2 connections: when the server closes them.
    Idle,
    /// Real load, then real load plus --junk-ratio times as many junk requests.
    JunkMix,
}

/// What junk tokens look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum JunkKind {
    /// Random strings that are not JWTs.
    Opaque,
    /// JWT-shaped (three base64url parts, plausible claims), bad signature.
    Jwt,
}

/// Flags of `meshca-bench attack`.
#[derive(Debug, Clone, Args)]
pub(crate) struct AttackArgs {
    /// Which attack.
    #[arg(value_enum)]
    pub(crate) scenario: Scenario,
    /// The meshca binary (default: `meshca` next to this program).
    #[arg(long)]
    pub(crate) meshca: Option<PathBuf>,
    /// Latency of every Kubernetes API answer (default: 500ms for
    /// cancelled-junk, as a slow API server; 5ms otherwise).
    #[arg(long, value_parser = parse_duration)]
    pub(crate) api_latency: Option<Duration>,
    /// cancelled-junk: requests sent.
    #[arg(long, default_value_t = 200_000)]
    pub(crate) requests: u64,
    /// cancelled-junk: requests in flight; junk-mix: real requests in flight.
    #[arg(long, default_value_t = 256)]
    pub(crate) concurrency: usize,
    /// cancelled-junk: each request is given up after this long.
    #[arg(long, default_value = "20ms", value_parser = parse_duration)]
    pub(crate) deadline: Duration,
    /// reset-flood: most malformed HEADERS frames sent.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) frames: u64,
    /// connection-flood, idle: connections opened (default: 12,000 for
    /// connection-flood, 1,000 for idle).
    #[arg(long)]
    pub(crate) connections: Option<usize>,
    /// connection-flood, idle: how long the connections are held (default:
    /// 20s for connection-flood, 6m for idle).
    #[arg(long, value_parser = parse_duration)]
    pub(crate) hold: Option<Duration>,
    /// connection-flood, idle: the address the connections come from
    /// (e.g. 127.0.0.2; Linux routes all of 127/8 to lo).
    #[arg(long)]
    pub(crate) source: Option<std::net::IpAddr>,
    /// connection-flood, idle: the address the probe's connections come
    /// from (e.g. 127.0.0.3).
    #[arg(long)]
    pub(crate) probe_source: Option<std::net::IpAddr>,
    /// junk-mix: length of each phase.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// junk-mix: junk requests per real request.
    #[arg(long, default_value_t = 10)]
    pub(crate) junk_ratio: u32,
    /// junk-mix: real requests per second, sent at a steady pace whatever
    /// the answers (an open loop, latency counted from when each was due),
    /// instead of --concurrency requests always in flight (a closed loop
    /// at the server's saturation, where any extra work shows as latency).
    #[arg(long)]
    pub(crate) real_rate: Option<u32>,
    /// junk-mix: what the junk tokens look like.
    #[arg(long, value_enum, default_value = "opaque")]
    pub(crate) junk: JunkKind,
    /// junk-mix: distinct real identities.
    #[arg(long, default_value_t = 2000)]
    pub(crate) identities: usize,
    /// Extra flags for `meshca serve`, e.g. `--meshca-arg=--max-connections=10000`.
    #[arg(long = "meshca-arg", allow_hyphen_values = true)]
    pub(crate) meshca_args: Vec<String>,
    /// Run the server on these CPUs only (a `taskset` list, e.g. `0`);
    /// run meshca-bench itself with `taskset` on the others, so that the
    /// attackers' and real clients' work is not charged to the server.
    #[arg(long)]
    pub(crate) server_cpus: Option<String>,
    /// Print the report as one line of JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Runs a scenario and prints its report. `Ok(false)`: real clients saw errors.
pub(crate) async fn run(args: AttackArgs) -> anyhow::Result<bool> {
    let meshca = server_process::meshca_path(args.meshca.as_ref())?;
    let api_latency = args.api_latency.unwrap_or(match args.scenario {
        Scenario::CancelledJunk => Duration::from_millis(500),
        _ => Duration::from_millis(5),
    });
    let server = Meshca::start_on(
        &meshca,
        api_latency,
        &args.meshca_args,
        args.server_cpus.as_deref(),
    )
    .await?;
    let probe = Probe::prepare(&server)?;
    let rss = RssSampler::start(server.pid());
    let mut report = match args.scenario {
        Scenario::CancelledJunk => cancelled_junk(&args, &server, &probe).await?,
        Scenario::ResetFlood => reset_flood(&args, &server, &probe).await?,
        Scenario::ConnectionFlood | Scenario::Idle => connections(&args, &server, &probe).await?,
        Scenario::JunkMix => junk_mix(&args, &server).await?,
    };
    let (rss_before, rss_peak) = rss.stop();
    let stats = proc_stats::read(server.pid());
    let mib = |b: u64| (b as f64 / 1048576.0 * 10.0).round() / 10.0;
    report["scenario"] = json!(format!("{:?}", args.scenario));
    report["meshca_args"] = json!(args.meshca_args);
    report["server_cpus"] = json!(args.server_cpus);
    report["api_latency_ms"] = json!(api_latency.as_millis() as u64);
    report["server"] = json!({
        "rss_before_mib": mib(rss_before),
        "rss_peak_mib": mib(rss_peak),
        "rss_after_mib": stats.map(|s| mib(s.rss_bytes)),
        "rss_growth_mib": stats.map(|s| mib(s.rss_bytes.saturating_sub(rss_before))),
        "cpu_seconds": stats.map(|s| (s.cpu_seconds * 100.0).round() / 100.0),
        "alive": proc_stats::read(server.pid()).is_some(),
    });
    report["token_reviews_total"] = json!(server.kube.reviews());
    let clean = report["real_clients_clean"].as_bool().unwrap_or(false);
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(clean)
}

// ----- what the server and its honest clients saw --------------------------

/// Samples the server's RSS every 50 ms on a thread of its own.
struct RssSampler {
    before: u64,
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    fn start(pid: u32) -> Self {
        let before = proc_stats::read(pid).map_or(0, |s| s.rss_bytes);
        let peak = Arc::new(AtomicU64::new(before));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (peak, stop) = (peak.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(s) = proc_stats::read(pid) {
                        peak.fetch_max(s.rss_bytes, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        };
        Self {
            before,
            peak,
            stop,
            thread: Some(thread),
        }
    }

    /// (RSS when sampling started, highest RSS seen), bytes.
    fn stop(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        (self.before, self.peak.load(Ordering::Relaxed))
    }
}

/// Identities the probe rotates over (so the per-identity rate limit
/// never throttles it).
const PROBE_IDENTITIES: usize = 64;
/// Time between two probe requests.
const PROBE_INTERVAL: Duration = Duration::from_millis(250);

/// A real client asking now and then during an attack.
struct Probe {
    prepared: Arc<Vec<Prepared>>,
    addr: String,
    root_pem: String,
}

/// What the probe saw.
struct ProbeResult {
    ok: u64,
    errors: BTreeMap<String, u64>,
    latency: Histogram<u64>,
}

impl ProbeResult {
    fn to_json(&self) -> Value {
        json!({
            "ok": self.ok,
            "errors": self.errors,
            "p50_ms": ms(&self.latency, 0.5),
            "p99_ms": ms(&self.latency, 0.99),
            "max_ms": self.latency.max() as f64 / 1000.0,
        })
    }
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

impl Probe {
    fn prepare(server: &Meshca) -> anyhow::Result<Self> {
        let tokens = register_identities(server, "probe", PROBE_IDENTITIES);
        Ok(Self {
            prepared: Arc::new(load::prepare(
                &run_args(server, PROBE_IDENTITIES),
                None,
                Some(&tokens),
            )?),
            addr: format!("https://{}", server.grpc),
            root_pem: server.root_pem.clone(),
        })
    }

    /// Probes until `stop` is set: over one connection opened now, or
    /// (`fresh`) over a new connection per request, as a pod that starts.
    fn spawn(&self, fresh: bool, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<ProbeResult> {
        self.spawn_from(fresh, stop, None)
    }

    /// As [`Probe::spawn`], its connections from `source`.
    fn spawn_from(
        &self,
        fresh: bool,
        stop: Arc<AtomicBool>,
        source: Option<std::net::IpAddr>,
    ) -> tokio::task::JoinHandle<ProbeResult> {
        let (prepared, addr, root_pem) = (
            self.prepared.clone(),
            self.addr.clone(),
            self.root_pem.clone(),
        );
        tokio::spawn(async move {
            let mut result = ProbeResult {
                ok: 0,
                errors: BTreeMap::new(),
                latency: new_histogram(),
            };
            let mut shared: Option<Client> = None;
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let outcome = async {
                    let cached = if fresh { None } else { shared.clone() };
                    let mut client = match cached {
                        Some(c) => c,
                        None => {
                            let c = load::connect_istio_from(&addr, &root_pem, 1, source)
                                .await
                                .map_err(|_| "CONNECT_FAILED".to_string())?
                                .remove(0);
                            if !fresh {
                                shared = Some(c.clone());
                            }
                            c
                        }
                    };
                    client.call(&prepared[i % prepared.len()]).await
                };
                match tokio::time::timeout(Duration::from_secs(10), outcome).await {
                    Ok(Ok(())) => {
                        result.ok += 1;
                        let _ = result.latency.record(t.elapsed().as_micros().max(1) as u64);
                    }
                    Ok(Err(code)) => *result.errors.entry(code).or_default() += 1,
                    Err(_) => {
                        *result
                            .errors
                            .entry("CLIENT_TIMEOUT_10S".into())
                            .or_default() += 1
                    }
                }
                i += 1;
                tokio::time::sleep(PROBE_INTERVAL.saturating_sub(t.elapsed())).await;
            }
            result
        })
    }
}

/// Registers `n` service accounts `NS/sa-<i>` with tokens at the fake API
/// (each bound to its own pod, as kubelet's tokens are).
fn register_identities(
    server: &Meshca,
    namespace: &str,
    n: usize,
) -> Vec<(String, String, String)> {
    (0..n)
        .map(|i| {
            let sa = format!("sa-{i}");
            let token = server.kube.add_review_token(
                &format!("{namespace}-token-{i}"),
                FakeUser::service_account(namespace, &sa),
            );
            (namespace.to_string(), sa, token)
        })
        .collect()
}

fn run_args(server: &Meshca, identities: usize) -> RunArgs {
    RunArgs {
        addr: format!("https://{}", server.grpc),
        target: crate::Target::Istio,
        data_dir: None,
        root_cert: None,
        tokens: None,
        identities,
        connections: 1,
        concurrency: 1,
        duration: Duration::ZERO,
        requests: None,
        warmup: Duration::ZERO,
        key: meshca_certs::KeyAlgorithm::EcdsaP256,
        trust_domain: "cluster.local".into(),
        server_pid: None,
        crypto_baseline: false,
        json: false,
        threads: 1,
    }
}

// ----- junk tokens ----------------------------------------------------------

/// Distinct junk bearer tokens of one kind, cheap to make.
struct JunkTokens {
    kind: JunkKind,
    salt: u64,
}

impl JunkTokens {
    fn new(kind: JunkKind) -> Self {
        let mut salt = [0u8; 8];
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut salt);
        Self {
            kind,
            salt: u64::from_le_bytes(salt),
        }
    }

    /// The `n`th token: never the same twice in a run.
    fn token(&self, n: u64) -> String {
        let unique = format!("{:016x}{:016x}", self.salt, n);
        match self.kind {
            JunkKind::Opaque => format!("junk-{unique}"),
            JunkKind::Jwt => {
                let b64 = |v: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
                let exp = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
                    + 3600;
                let header = json!({"alg": "RS256", "kid": "junk"}).to_string();
                let claims = json!({
                    "iss": "https://kubernetes.default.svc.cluster.local",
                    "aud": ["istio-ca"],
                    "exp": exp,
                    "sub": format!("system:serviceaccount:junk:sa-{n}"),
                    "jti": unique,
                })
                .to_string();
                format!(
                    "{}.{}.{}",
                    b64(header.as_bytes()),
                    b64(claims.as_bytes()),
                    b64(unique.repeat(8).as_bytes())
                )
            }
        }
    }
}

/// One junk request: a valid CSR, a junk token, optionally a deadline.
async fn junk_call(
    client: &mut Client,
    csr: &str,
    token: &str,
    deadline: Option<Duration>,
) -> Result<(), String> {
    let Client::Istio(grpc) = client else {
        return Err("NOT_ISTIO".into());
    };
    let mut request = tonic::Request::new(meshca_proto::IstioCertificateRequest {
        csr: csr.to_string(),
        validity_duration: 0,
        metadata: None,
    });
    let bearer = format!("Bearer {token}")
        .parse()
        .map_err(|_| "BAD_HEADER".to_string())?;
    request.metadata_mut().insert("authorization", bearer);
    let Some(deadline) = deadline else {
        return match grpc.create_certificate(request).await {
            Ok(_) => Ok(()),
            Err(s) => Err(format!("{:?}", s.code())),
        };
    };
    // The deadline travels as grpc-timeout, and the client gives up at it
    // too (dropping the call resets the stream).
    request.set_timeout(deadline);
    match tokio::time::timeout(deadline, grpc.create_certificate(request)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(s)) => Err(format!("{:?}", s.code())),
        Err(_) => Err("CANCELLED_BY_CLIENT".into()),
    }
}

fn one_csr() -> anyhow::Result<String> {
    let key = meshca_certs::PrivateKey::generate(meshca_certs::KeyAlgorithm::EcdsaP256)?;
    let id = meshca_certs::SpiffeId::parse("spiffe://cluster.local/ns/junk/sa/junk")?;
    Ok(meshca_certs::build_csr(&key, &id)?)
}

// ----- cancelled-junk -------------------------------------------------------

async fn cancelled_junk(
    args: &AttackArgs,
    server: &Meshca,
    probe: &Probe,
) -> anyhow::Result<Value> {
    let clients =
        load::connect_istio(&format!("https://{}", server.grpc), &server.root_pem, 8).await?;
    let csr: Arc<str> = one_csr()?.into();
    let junk = Arc::new(JunkTokens::new(JunkKind::Jwt));
    let reviews_before = server.kube.reviews();
    let stop = Arc::new(AtomicBool::new(false));
    let probing = probe.spawn(false, stop.clone());
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut workers = Vec::new();
    for w in 0..args.concurrency.max(1) {
        let mut client = clients[w % clients.len()].clone();
        let (next, csr, junk, total, deadline) = (
            next.clone(),
            csr.clone(),
            junk.clone(),
            args.requests,
            args.deadline,
        );
        workers.push(tokio::spawn(async move {
            let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    break;
                }
                let outcome = junk_call(&mut client, &csr, &junk.token(n), Some(deadline)).await;
                *outcomes
                    .entry(outcome.err().unwrap_or_else(|| "OK".into()))
                    .or_default() += 1;
            }
            outcomes
        }));
    }
    let outcomes = merge(workers).await;
    let sent_in = start.elapsed();
    // Reviews still in flight when their requests were cancelled finish.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let probed = probing.await?;
    Ok(json!({
        "requests": args.requests,
        "deadline_ms": args.deadline.as_millis() as u64,
        "concurrency": args.concurrency,
        "seconds": sent_in.as_secs_f64(),
        "per_second": args.requests as f64 / sent_in.as_secs_f64().max(1e-9),
        "junk_outcomes": outcomes,
        "token_reviews": server.kube.reviews() - reviews_before,
        "real_clients_clean": probed.errors.is_empty(),
        "probe": probed.to_json(),
    }))
}

async fn merge(
    workers: Vec<tokio::task::JoinHandle<BTreeMap<String, u64>>>,
) -> BTreeMap<String, u64> {
    let mut all = BTreeMap::new();
    for w in workers {
        match w.await {
            Ok(map) => {
                for (k, v) in map {
                    *all.entry(k).or_default() += v;
                }
            }
            Err(_) => *all.entry("TASK_FAILED".to_string()).or_default() += 1,
        }
    }
    all
}

// ----- raw HTTP/2 over TLS --------------------------------------------------

/// HTTP/2 frame types used here.
mod frame {
    pub(super) const HEADERS: u8 = 0x1;
    pub(super) const RST_STREAM: u8 = 0x3;
    pub(super) const SETTINGS: u8 = 0x4;
    pub(super) const PING: u8 = 0x6;
    pub(super) const GOAWAY: u8 = 0x7;
    pub(super) const END_STREAM: u8 = 0x1;
    pub(super) const ACK: u8 = 0x1;
    pub(super) const END_HEADERS: u8 = 0x4;
}

/// The client connection preface and an empty SETTINGS frame.
fn preface() -> Vec<u8> {
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(encode_frame(frame::SETTINGS, 0, 0, &[]));
    out
}

fn encode_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// A HEADERS frame of a gRPC-looking request that the server must reset:
/// `content-length: x` is not a number (a stream error, PROTOCOL_ERROR).
/// HPACK without Huffman or the dynamic table, so every frame is the same
/// bytes but its stream ID.
fn malformed_headers(stream: u32) -> Vec<u8> {
    let mut block = vec![
        0x83, // :method POST (static 3)
        0x87, // :scheme https (static 7)
    ];
    let mut literal = |index_prefix: &[u8], value: &[u8]| {
        block.extend_from_slice(index_prefix);
        block.push(value.len() as u8);
        block.extend_from_slice(value);
    };
    literal(
        &[0x04],
        b"/istio.v1.auth.IstioCertificateService/CreateCertificate",
    ); // :path
    literal(&[0x01], b"istiod.istio-system.svc"); // :authority
    literal(&[0x0f, 0x0d], b"x"); // content-length (static 28): not a number
    encode_frame(
        frame::HEADERS,
        frame::END_HEADERS | frame::END_STREAM,
        stream,
        &block,
    )
}

/// A frame as read: type, flags, stream, payload.
type Frame = (u8, u8, u32, Vec<u8>);

async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Frame> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    Ok((head[3], head[4], stream, payload))
}

fn goaway_code_name(code: u32) -> &'static str {
    match code {
        0x0 => "NO_ERROR",
        0x1 => "PROTOCOL_ERROR",
        0x2 => "INTERNAL_ERROR",
        0x7 => "REFUSED_STREAM",
        0xb => "ENHANCE_YOUR_CALM",
        _ => "OTHER",
    }
}

type TlsStream = tokio_rustls::client::TlsStream<TcpStream>;

fn tls_connector(root_pem: &str) -> anyhow::Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for der in meshca_certs::bundle::parse_certs_pem(root_pem)? {
        roots.add(rustls_pki_types::CertificateDer::from(der))?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

async fn tls_connect(
    connector: &tokio_rustls::TlsConnector,
    addr: SocketAddr,
) -> Result<TlsStream, &'static str> {
    let tcp = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .map_err(|_| "connect_timeout")?
        .map_err(|_| "connect_failed")?;
    let name = rustls_pki_types::ServerName::try_from("istiod.istio-system.svc")
        .map_err(|_| "bad_server_name")?;
    tokio::time::timeout(Duration::from_secs(10), connector.connect(name, tcp))
        .await
        .map_err(|_| "handshake_timeout")?
        .map_err(|_| "handshake_failed")
}

// ----- reset-flood ----------------------------------------------------------

async fn reset_flood(args: &AttackArgs, server: &Meshca, probe: &Probe) -> anyhow::Result<Value> {
    let connector = tls_connector(&server.root_pem)?;
    let stream = tls_connect(&connector, server.grpc)
        .await
        .map_err(|e| anyhow::anyhow!("connecting: {e}"))?;
    let (mut reader, writer) = tokio::io::split(stream);
    let writer = Arc::new(tokio::sync::Mutex::new(writer));
    writer.lock().await.write_all(&preface()).await?;
    let cpu_before = proc_stats::read(server.pid()).map_or(0.0, |s| s.cpu_seconds);
    let sent = Arc::new(AtomicU64::new(0));
    let goaway: Arc<Mutex<Option<(u32, u32, u64)>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let resets = Arc::new(AtomicU64::new(0));
    // The reader answers SETTINGS and PING (as any client must) and
    // watches for GOAWAY.
    let reading = {
        let (writer, sent, goaway, done, resets) = (
            writer.clone(),
            sent.clone(),
            goaway.clone(),
            done.clone(),
            resets.clone(),
        );
        tokio::spawn(async move {
            let closed = loop {
                match read_frame(&mut reader).await {
                    Ok((frame::SETTINGS, flags, _, _)) if flags & frame::ACK == 0 => {
                        let ack = encode_frame(frame::SETTINGS, frame::ACK, 0, &[]);
                        let _ = writer.lock().await.write_all(&ack).await;
                    }
                    Ok((frame::PING, flags, _, payload)) if flags & frame::ACK == 0 => {
                        let pong = encode_frame(frame::PING, frame::ACK, 0, &payload);
                        let _ = writer.lock().await.write_all(&pong).await;
                    }
                    Ok((frame::RST_STREAM, ..)) => {
                        resets.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok((frame::GOAWAY, _, _, payload)) if payload.len() >= 8 => {
                        let last =
                            u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]])
                                & 0x7fff_ffff;
                        let code =
                            u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
                        *goaway.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((last, code, sent.load(Ordering::Relaxed)));
                        done.store(true, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(_) => break true,
                }
            };
            done.store(true, Ordering::Relaxed);
            closed
        })
    };
    let stop = Arc::new(AtomicBool::new(false));
    let probing = probe.spawn(false, stop.clone());
    let start = Instant::now();
    // Batches of 100 frames per write, as fast as the connection takes them.
    let mut stream_id = 1u32;
    let mut write_error = None;
    while sent.load(Ordering::Relaxed) < args.frames && !done.load(Ordering::Relaxed) {
        let mut batch = Vec::with_capacity(100 * 100);
        for _ in 0..100 {
            batch.extend(malformed_headers(stream_id));
            stream_id += 2;
        }
        let written = tokio::time::timeout(Duration::from_secs(10), async {
            writer.lock().await.write_all(&batch).await
        })
        .await;
        match written {
            Ok(Ok(())) => {
                sent.fetch_add(100, Ordering::Relaxed);
            }
            Ok(Err(e)) => {
                write_error = Some(e.to_string());
                break;
            }
            Err(_) => {
                write_error = Some("a write blocked for 10 s (the server stopped reading)".into());
                break;
            }
        }
    }
    let written_in = start.elapsed();
    // The frames sit in socket buffers: wait until the server has answered
    // each (a RST_STREAM), sent GOAWAY, or made no progress for 5 s.
    let (mut last, mut last_progress) = (0, Instant::now());
    while !done.load(Ordering::Relaxed)
        && resets.load(Ordering::Relaxed) < sent.load(Ordering::Relaxed)
        && last_progress.elapsed() < Duration::from_secs(5)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = resets.load(Ordering::Relaxed);
        if now != last {
            (last, last_progress) = (now, Instant::now());
        }
    }
    let flood_time = start.elapsed();
    let reader_result = tokio::time::timeout(Duration::from_secs(2), reading).await;
    let cpu_after = proc_stats::read(server.pid()).map_or(0.0, |s| s.cpu_seconds);
    stop.store(true, Ordering::Relaxed);
    let probed = probing.await?;
    let closed = matches!(reader_result, Ok(Ok(true)));
    let goaway = *goaway.lock().unwrap_or_else(|e| e.into_inner());
    Ok(json!({
        "frames_sent": sent.load(Ordering::Relaxed),
        "frames_limit": args.frames,
        "written_in_seconds": written_in.as_secs_f64(),
        "answered_in_seconds": flood_time.as_secs_f64(),
        "goaway": goaway.map(|(last, code, at)| json!({
            "error_code": code,
            "error": goaway_code_name(code),
            "last_stream_id": last,
            "streams_processed": last.div_ceil(2),
            "frames_sent_when_seen": at,
        })),
        "rst_streams_received": resets.load(Ordering::Relaxed),
        "connection_closed_by_server": closed,
        "write_error": write_error,
        "server_cpu_seconds_during_flood": ((cpu_after - cpu_before) * 100.0).round() / 100.0,
        "real_clients_clean": probed.errors.is_empty(),
        "probe": probed.to_json(),
    }))
}

// ----- connection-flood and idle --------------------------------------------

/// How an attacker's connection ended.
#[derive(Debug, Default)]
struct ConnectionLog {
    refused: BTreeMap<&'static str, u64>,
    established: u64,
    /// Seconds from establishment to the server closing it.
    closed_after: Vec<f64>,
    goaways: BTreeMap<&'static str, u64>,
}

/// As [`tls_connect`], from `source` (default: the system's choice).
async fn tls_connect_from(
    connector: &tokio_rustls::TlsConnector,
    addr: SocketAddr,
    source: Option<std::net::IpAddr>,
) -> Result<TlsStream, &'static str> {
    let Some(source) = source else {
        return tls_connect(connector, addr).await;
    };
    let socket = if source.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
    .map_err(|_| "socket_failed")?;
    socket
        .bind(SocketAddr::new(source, 0))
        .map_err(|_| "bind_failed")?;
    let tcp = tokio::time::timeout(Duration::from_secs(5), socket.connect(addr))
        .await
        .map_err(|_| "connect_timeout")?
        .map_err(|_| "connect_failed")?;
    let name = rustls_pki_types::ServerName::try_from("istiod.istio-system.svc")
        .map_err(|_| "bad_server_name")?;
    tokio::time::timeout(Duration::from_secs(10), connector.connect(name, tcp))
        .await
        .map_err(|_| "handshake_timeout")?
        .map_err(|_| "handshake_failed")
}

async fn connections(args: &AttackArgs, server: &Meshca, probe: &Probe) -> anyhow::Result<Value> {
    let flood = args.scenario == Scenario::ConnectionFlood;
    let count = args
        .connections
        .unwrap_or(if flood { 12_000 } else { 1_000 });
    let hold = args.hold.unwrap_or(if flood {
        Duration::from_secs(20)
    } else {
        Duration::from_secs(360)
    });
    let connector = tls_connector(&server.root_pem)?;
    let log = Arc::new(Mutex::new(ConnectionLog::default()));
    let release = Arc::new(tokio::sync::Notify::new());
    let released = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    // A pod starting meanwhile: a fresh connection per request.
    let probing = probe.spawn_from(true, stop.clone(), args.probe_source);
    let start = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let mut openers = Vec::new();
    let mut holders = tokio::task::JoinSet::new();
    let (holder_tx, mut holder_rx) = tokio::sync::mpsc::unbounded_channel();
    // 64 handshakes at a time.
    for _ in 0..64 {
        let (connector, log, next, holder_tx, addr, source) = (
            connector.clone(),
            log.clone(),
            next.clone(),
            holder_tx.clone(),
            server.grpc,
            args.source,
        );
        openers.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < count as u64 {
                let mut stream = match tls_connect_from(&connector, addr, source).await {
                    Ok(s) => s,
                    Err(why) => {
                        *log.lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .refused
                            .entry(why)
                            .or_default() += 1;
                        continue;
                    }
                };
                if stream.write_all(&preface()).await.is_err() {
                    *log.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .refused
                        .entry("closed_at_preface")
                        .or_default() += 1;
                    continue;
                }
                log.lock().unwrap_or_else(|e| e.into_inner()).established += 1;
                let _ = holder_tx.send(stream);
            }
        }));
    }
    drop(holder_tx);
    // Each established connection: read (answering SETTINGS, never
    // opening a stream) until the server closes it or we let go.
    let hold_connections = {
        let (log, release, released) = (log.clone(), release.clone(), released.clone());
        tokio::spawn(async move {
            while let Some(stream) = holder_rx.recv().await {
                let (log, release, released) = (log.clone(), release.clone(), released.clone());
                holders.spawn(async move {
                    let opened = Instant::now();
                    let (mut reader, mut writer) = tokio::io::split(stream);
                    let read_until_closed = async {
                        loop {
                            match read_frame(&mut reader).await {
                                Ok((frame::SETTINGS, flags, _, _)) if flags & frame::ACK == 0 => {
                                    let ack = encode_frame(frame::SETTINGS, frame::ACK, 0, &[]);
                                    let _ = writer.write_all(&ack).await;
                                }
                                Ok((frame::PING, flags, _, payload)) if flags & frame::ACK == 0 => {
                                    let pong = encode_frame(frame::PING, frame::ACK, 0, &payload);
                                    let _ = writer.write_all(&pong).await;
                                }
                                Ok((frame::GOAWAY, _, _, p)) if p.len() >= 8 => {
                                    let code = u32::from_be_bytes([p[4], p[5], p[6], p[7]]);
                                    *log.lock().unwrap_or_else(|e| e.into_inner()).goaways.entry(goaway_code_name(code)).or_default() += 1;
                                }
                                Ok(_) => {}
                                Err(_) => return,
                            }
                        }
                    };
                    tokio::select! {
                        _ = read_until_closed => {
                            if !released.load(Ordering::Relaxed) {
                                log.lock().unwrap_or_else(|e| e.into_inner()).closed_after.push(opened.elapsed().as_secs_f64());
                            }
                        }
                        _ = release.notified() => {}
                    }
                });
            }
            holders
        })
    };
    for o in openers {
        let _ = o.await;
    }
    let opened_in = start.elapsed();
    let open_now = |log: &ConnectionLog| log.established - log.closed_after.len() as u64;
    let peak_open = open_now(&log.lock().unwrap_or_else(|e| e.into_inner()));
    tokio::time::sleep(hold.saturating_sub(start.elapsed())).await;
    let open_at_end = open_now(&log.lock().unwrap_or_else(|e| e.into_inner()));
    released.store(true, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let probed = probing.await?;
    release.notify_waiters();
    if let Ok(mut holders) = hold_connections.await {
        // Tasks still waiting for a notification registered late: end them.
        holders.abort_all();
        while holders.join_next().await.is_some() {}
    }
    let log = std::mem::take(&mut *log.lock().unwrap_or_else(|e| e.into_inner()));
    let mut closed = log.closed_after.clone();
    closed.sort_by(f64::total_cmp);
    let quantile =
        |q: f64| (!closed.is_empty()).then(|| closed[((closed.len() - 1) as f64 * q) as usize]);
    Ok(json!({
        "connections_attempted": count,
        "established": log.established,
        "refused": log.refused,
        "opened_in_seconds": opened_in.as_secs_f64(),
        "open_after_opening": peak_open,
        "hold_seconds": hold.as_secs_f64(),
        "open_at_end_of_hold": open_at_end,
        "closed_by_server": closed.len(),
        "closed_after_seconds": {"min": quantile(0.0), "p50": quantile(0.5), "max": quantile(1.0)},
        "goaways": log.goaways,
        "source": args.source,
        "probe_source": args.probe_source,
        "real_clients_clean": probed.errors.is_empty(),
        "probe_mode": "a fresh connection per request",
        "probe": probed.to_json(),
    }))
}

// ----- junk-mix ---------------------------------------------------------------

async fn junk_mix(args: &AttackArgs, server: &Meshca) -> anyhow::Result<Value> {
    let addr = format!("https://{}", server.grpc);
    eprintln!("meshca-bench: preparing {} identities…", args.identities);
    let tokens = register_identities(server, "bench", args.identities);
    let prepared = Arc::new(load::prepare(
        &run_args(server, args.identities),
        None,
        Some(&tokens),
    )?);
    let real = load::connect_istio(&addr, &server.root_pem, 4).await?;
    // Warm-up: every identity once (TokenReviews cached, connections hot).
    let warm = load::drive(
        &real,
        prepared.clone(),
        args.concurrency,
        None,
        Some(args.identities as u64),
    )
    .await;
    anyhow::ensure!(
        warm.errors.is_empty(),
        "the warm-up failed: {:?}\n{}",
        warm.errors,
        server.log()
    );

    let reviews = server.kube.reviews();
    let alone = match args.real_rate {
        Some(rate) => {
            let unused = Arc::new(AtomicU64::new(0));
            drive_paced(&real, prepared.clone(), rate, args.duration, unused).await
        }
        None => {
            load::drive(
                &real,
                prepared.clone(),
                args.concurrency,
                Some(args.duration),
                None,
            )
            .await
        }
    };
    let reviews_alone = server.kube.reviews() - reviews;

    // Junk: `ratio` requests for each real request sent so far, from
    // connections of its own, at most 4,096 in flight.
    let ratio = u64::from(args.junk_ratio);
    let real_sent = Arc::new(AtomicU64::new(0));
    let attackers = load::connect_istio(&addr, &server.root_pem, 4).await?;
    let csr: Arc<str> = one_csr()?.into();
    let junk = Arc::new(JunkTokens::new(args.junk));
    let in_flight = Arc::new(tokio::sync::Semaphore::new(4096));
    let stop = Arc::new(AtomicBool::new(false));
    let outcomes: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let skipped = Arc::new(AtomicU64::new(0));
    let junk_sender = {
        let (stop, outcomes, skipped, in_flight, real_sent) = (
            stop.clone(),
            outcomes.clone(),
            skipped.clone(),
            in_flight.clone(),
            real_sent.clone(),
        );
        tokio::spawn(async move {
            let mut sent = 0u64;
            let mut accounted = 0u64;
            let mut ticker = tokio::time::interval(Duration::from_millis(2));
            while !stop.load(Ordering::Relaxed) {
                ticker.tick().await;
                let due = ratio * real_sent.load(Ordering::Relaxed);
                while accounted < due {
                    let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                        skipped.fetch_add(due - accounted, Ordering::Relaxed);
                        accounted = due;
                        break;
                    };
                    accounted += 1;
                    let mut client = attackers[(sent as usize) % attackers.len()].clone();
                    let (csr, token, outcomes) = (csr.clone(), junk.token(sent), outcomes.clone());
                    tokio::spawn(async move {
                        let outcome = match tokio::time::timeout(
                            Duration::from_secs(10),
                            junk_call(&mut client, &csr, &token, None),
                        )
                        .await
                        {
                            Ok(r) => r.err().unwrap_or_else(|| "OK".into()),
                            Err(_) => "CLIENT_TIMEOUT_10S".into(),
                        };
                        *outcomes
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .entry(outcome)
                            .or_default() += 1;
                        drop(permit);
                    });
                    sent += 1;
                }
            }
            sent
        })
    };
    let reviews = server.kube.reviews();
    let mixed = match args.real_rate {
        Some(rate) => drive_paced(&real, prepared.clone(), rate, args.duration, real_sent).await,
        None => {
            drive_counted(
                &real,
                prepared.clone(),
                args.concurrency,
                args.duration,
                real_sent,
            )
            .await
        }
    };
    let reviews_mixed = server.kube.reviews() - reviews;
    stop.store(true, Ordering::Relaxed);
    let junk_sent = junk_sender.await?;
    // Let the junk in flight finish (bounded by its 10 s client timeout).
    let _ = tokio::time::timeout(Duration::from_secs(12), in_flight.acquire_many(4096)).await;
    let phase = |d: &load::Driven, reviews: usize| {
        json!({
            "real_ok": d.ok,
            "real_errors": d.errors,
            "real_per_second": d.ok as f64 / d.elapsed.as_secs_f64().max(1e-9),
            "real_p50_ms": ms(&d.latency, 0.5),
            "real_p99_ms": ms(&d.latency, 0.99),
            "token_reviews": reviews,
        })
    };
    let p99_ratio = ms(&mixed.latency, 0.99) / ms(&alone.latency, 0.99).max(1e-9);
    let clean = alone.errors.is_empty() && mixed.errors.is_empty();
    Ok(json!({
        "identities": args.identities,
        "concurrency": args.concurrency,
        "real_rate": args.real_rate,
        "phase_seconds": args.duration.as_secs_f64(),
        "junk_kind": format!("{:?}", args.junk),
        "junk_ratio_asked": args.junk_ratio,
        "alone": phase(&alone, reviews_alone),
        "with_junk": phase(&mixed, reviews_mixed),
        "junk_sent": junk_sent,
        "junk_not_sent_4096_in_flight": skipped.load(Ordering::Relaxed),
        "junk_ratio_achieved": junk_sent as f64 / mixed.ok.max(1) as f64,
        "junk_outcomes": *outcomes.lock().unwrap_or_else(|e| e.into_inner()),
        "token_reviews_caused_by_junk": reviews_mixed.saturating_sub(reviews_alone),
        "real_p99_with_junk_over_alone": (p99_ratio * 100.0).round() / 100.0,
        "real_clients_clean": clean,
    }))
}

/// [`load::drive`] for `duration`, counting requests as they are sent.
/// Sends `rate` real requests a second for `duration`, each in a task of
/// its own (at most 4,096 in flight; those beyond are counted as errors
/// `NOT_SENT_4096_IN_FLIGHT`), counting each into `sent`; a request's
/// latency counts from when it was due, so a server that falls behind
/// shows it.
async fn drive_paced(
    clients: &[Client],
    prepared: Arc<Vec<Prepared>>,
    rate: u32,
    duration: Duration,
    sent: Arc<AtomicU64>,
) -> load::Driven {
    let start = Instant::now();
    let in_flight = Arc::new(tokio::sync::Semaphore::new(4096));
    let mut tasks = tokio::task::JoinSet::new();
    let mut not_sent = 0u64;
    let mut issued = 0u64;
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while start.elapsed() < duration {
        ticker.tick().await;
        let due =
            (start.elapsed().as_secs_f64().min(duration.as_secs_f64()) * f64::from(rate)) as u64;
        while issued < due {
            let due_at = start + Duration::from_secs_f64(issued as f64 / f64::from(rate));
            let i = issued as usize;
            issued += 1;
            let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                not_sent += 1;
                continue;
            };
            sent.fetch_add(1, Ordering::Relaxed);
            let mut client = clients[i % clients.len()].clone();
            let prepared = prepared.clone();
            tasks.spawn(async move {
                let result = client.call(&prepared[i % prepared.len()]).await;
                drop(permit);
                (due_at.elapsed(), result)
            });
        }
    }
    let mut driven = load::Driven {
        ok: 0,
        errors: BTreeMap::new(),
        latency: new_histogram(),
        elapsed: Duration::ZERO,
    };
    if not_sent > 0 {
        driven
            .errors
            .insert("NOT_SENT_4096_IN_FLIGHT".into(), not_sent);
    }
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((latency, Ok(()))) => {
                driven.ok += 1;
                let _ = driven.latency.record(latency.as_micros().max(1) as u64);
            }
            Ok((_, Err(code))) => *driven.errors.entry(code).or_default() += 1,
            Err(_) => *driven.errors.entry("TASK_FAILED".into()).or_default() += 1,
        }
    }
    driven.elapsed = start.elapsed();
    driven
}

async fn drive_counted(
    clients: &[Client],
    prepared: Arc<Vec<Prepared>>,
    concurrency: usize,
    duration: Duration,
    sent: Arc<AtomicU64>,
) -> load::Driven {
    let start = Instant::now();
    let mut workers = Vec::new();
    for w in 0..concurrency.max(1) {
        let mut client = clients[w % clients.len()].clone();
        let (sent, prepared) = (sent.clone(), prepared.clone());
        workers.push(tokio::spawn(async move {
            let (mut ok, mut errors, mut hist) =
                (0u64, BTreeMap::<String, u64>::new(), new_histogram());
            while start.elapsed() < duration {
                let i = sent.fetch_add(1, Ordering::Relaxed);
                let t = Instant::now();
                match client.call(&prepared[(i as usize) % prepared.len()]).await {
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
    let mut driven = load::Driven {
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
    driven.elapsed = start.elapsed();
    driven
}
