//! The mass-restart scenario: N distinct identities ask at the same moment,
//! as after a node or cluster restart. meshca runs as its real binary with
//! TokenReview against the fake Kubernetes API server of the end-to-end
//! tests (real HTTPS, real JSON) answering with a configurable latency.
//! Reported: time until every identity has an answer, latency percentiles,
//! errors by status, and how the health endpoint answered meanwhile.
//!
//! With `--clusters N` the identities belong to N clusters, each a fake
//! API server of its own that meshca knows as a remote cluster
//! (`--remote-cluster`), every request naming its cluster in `clusterid`:
//! the same storm after the restart of a mesh of N clusters.
//!
//! With `--kube-apiserver` the API is a real kube-apiserver (see
//! `real_kube`): the identities are real ServiceAccounts (and, for
//! `--node-agent`, real pods), each with a token from the TokenRequest API
//! (audience `istio-ca`), all made before meshca starts as its own
//! ServiceAccount; the storm is the same. The report adds what the API
//! server itself saw: its calls by verb, resource and code, their
//! server-side latency, API Priority and Fairness, and its CPU time.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use meshca_certs::parse_duration;
use meshca_tests::control_plane;
use meshca_tests::fake_kube::{FakeKube, FakeUser, OIDC_ISSUER};
use serde_json::json;

use crate::load::{self, Prepared};
use crate::real_kube::{self, RealKube};
use crate::report::new_histogram;
use crate::server_process::{self, healthz, Meshca, MeshcaProcess};
use crate::{proc_stats, RunArgs};

/// Retries of one identity before it gives up.
const MAX_RETRIES: u32 = 6;
/// The trusted node agent of `--node-agent`.
const NODE_AGENT: &str = "istio-system/ztunnel";
/// Its token at the fake API server.
const NODE_AGENT_TOKEN: &str = "ztunnel-token";
/// The node of the agent and of every pod.
const NODE: &str = "node-a";

/// Flags of `meshca-bench mass-restart`.
#[derive(Debug, Clone, Args)]
pub(crate) struct MassRestartArgs {
    /// The meshca binary (default: `meshca` next to this program).
    #[arg(long)]
    pub(crate) meshca: Option<PathBuf>,
    /// Distinct identities, all asking at once.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) identities: usize,
    /// Latency of every Kubernetes API answer (of the fake).
    #[arg(long, default_value = "5ms", value_parser = parse_duration, conflicts_with = "kube_apiserver")]
    pub(crate) api_latency: Duration,
    /// Against a real kube-apiserver (the tests' control plane, built by
    /// tests/controlplane/build.sh) instead of the fake: real
    /// ServiceAccounts, tokens from the TokenRequest API, meshca as its own
    /// ServiceAccount with deploy/'s RBAC.
    #[arg(long)]
    pub(crate) kube_apiserver: bool,
    /// Client connections the requests are spread over (HTTP/2), opened
    /// before the storm.
    #[arg(long, default_value_t = 64, conflicts_with = "connection_per_identity")]
    pub(crate) connections: usize,
    /// Every identity opens its own connection when the storm starts, as
    /// restarted sidecars do: TCP connect and TLS handshake are part of
    /// each request's time, and the server sees one connection per pod.
    #[arg(long)]
    pub(crate) connection_per_identity: bool,
    /// One node agent asks for every identity, as ztunnel does for the pods
    /// of its node after a restart: one token (istio-system/ztunnel, a
    /// trusted node agent), one pod per identity on the agent's node, each
    /// request naming the pod's identity in its metadata.
    #[arg(long)]
    pub(crate) node_agent: bool,
    /// Tokens signed with the cluster's key and checked offline (meshca
    /// with `--jwt-issuer`, keys by OIDC discovery) instead of TokenReview.
    #[arg(long)]
    pub(crate) offline_jwt: bool,
    /// The identities spread over N clusters, as after the restart of a
    /// mesh of N clusters served by one meshca: N fake API servers (each
    /// with --api-latency), each one of meshca's remote clusters
    /// (`--remote-cluster cluster-K=KUBECONFIG`) reviewing the tokens of
    /// its share (identity i in cluster i mod N), every request naming its
    /// cluster in `clusterid`. 1: every identity in meshca's local
    /// cluster, no `clusterid` (the scenario without this flag).
    #[arg(
        long,
        default_value_t = 1,
        value_parser = clap::value_parser!(u16).range(1..=64),
        conflicts_with_all = ["kube_apiserver", "offline_jwt"]
    )]
    pub(crate) clusters: u16,
    /// Extra flags for `meshca serve`, e.g. `--max-concurrent-requests=512`.
    #[arg(long = "meshca-arg", allow_hyphen_values = true)]
    pub(crate) meshca_args: Vec<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

/// What kind of failure a connection attempt met, for the report.
fn connect_failure_kind(e: &anyhow::Error) -> String {
    let text = format!("{e:#}").to_lowercase();
    let kind = if text.contains("timed out") {
        "CONNECT_TIMEOUT"
    } else if text.contains("reset") {
        "CONNECTION_RESET"
    } else if text.contains("refused") {
        "CONNECTION_REFUSED"
    } else if text.contains("eof") || text.contains("closed") {
        "CLOSED_BY_SERVER"
    } else {
        "CONNECT_FAILED"
    };
    kind.to_string()
}

/// The wait before try `retries + 1` of identity `i`: 1 s doubling, with a
/// jitter of ±20 % that differs between identities.
fn backoff(retries: u32, i: usize) -> Duration {
    let base = Duration::from_secs(1) * 2u32.pow(retries);
    let jitter = 0.8 + 0.4 * ((i as u64).wrapping_mul(2654435761) % 1000) as f64 / 1000.0;
    base.mul_f64(jitter)
}

/// `--max-connections-per-source=0` unless `meshca_args` set it: each
/// identity stands for a pod with an address of its own, but here all
/// connect from one loopback address.
fn per_source_bound_off(meshca_args: &[String]) -> Option<String> {
    let set = meshca_args
        .iter()
        .any(|a| a.starts_with("--max-connections-per-source"));
    (!set).then(|| "--max-connections-per-source=0".to_string())
}

/// The ID of remote cluster `k` (0-based) of `--clusters`.
fn cluster_id(k: usize) -> String {
    format!("cluster-{}", k + 1)
}

/// The fake API servers of `--clusters N` (N > 1), each answering after
/// `latency`, and the `--remote-cluster` flags that make them meshca's
/// remote clusters. None for N = 1: the local cluster serves.
async fn remote_clusters(
    n: u16,
    latency: Duration,
) -> anyhow::Result<(Vec<(FakeKube, tempfile::TempDir)>, Vec<String>)> {
    let mut kubes = Vec::new();
    let mut flags = Vec::new();
    if n < 2 {
        return Ok((kubes, flags));
    }
    for k in 0..usize::from(n) {
        let dir = tempfile::tempdir()?;
        let kube = FakeKube::start(dir.path()).await;
        kube.set_latency(latency);
        flags.push(format!(
            "--remote-cluster={}={}",
            cluster_id(k),
            kube.kubeconfig.display()
        ));
        kubes.push((kube, dir));
    }
    Ok((kubes, flags))
}

/// Runs the scenario. `Ok(false)` when a request got no certificate.
pub(crate) async fn run(args: MassRestartArgs) -> anyhow::Result<bool> {
    let meshca = server_process::meshca_path(args.meshca.as_ref())?;
    if args.kube_apiserver {
        return run_real(&args, &meshca).await;
    }
    let (remotes, mut flags) = remote_clusters(args.clusters, args.api_latency).await?;
    if args.node_agent {
        flags.extend(["--trusted-node-agent".into(), NODE_AGENT.into()]);
    }
    if args.offline_jwt {
        flags.extend(["--jwt-issuer".into(), OIDC_ISSUER.into()]);
    }
    flags.extend(per_source_bound_off(&args.meshca_args));
    flags.extend(args.meshca_args.iter().cloned());
    let server = Meshca::start(&meshca, args.api_latency, &flags).await?;
    // The API server of each cluster, and the `clusterid` its callers send.
    let clusters: Vec<(&FakeKube, Option<String>)> = if remotes.is_empty() {
        vec![(&server.kube, None)]
    } else {
        remotes
            .iter()
            .enumerate()
            .map(|(k, (kube, _))| (kube, Some(cluster_id(k))))
            .collect()
    };

    eprintln!(
        "meshca-bench: preparing {} identities in {} cluster(s)…",
        args.identities,
        clusters.len()
    );
    let mut tokens = Vec::with_capacity(args.identities);
    let mut cluster_of = Vec::with_capacity(args.identities);
    // Each cluster's node agent: ztunnel's own pod, and its token bound to
    // that pod.
    let mut node_agent_tokens = Vec::new();
    for (kube, _) in clusters.iter().filter(|_| args.node_agent) {
        kube.add_pod(
            "istio-system",
            "ztunnel-pod",
            "uid-ztunnel",
            "ztunnel",
            NODE,
        );
        node_agent_tokens.push(if args.offline_jwt {
            kube.mint_token(
                "istio-system",
                "ztunnel",
                Some(("ztunnel-pod", "uid-ztunnel")),
            )
        } else {
            // FakeUser binds a reviewed token to `ztunnel-pod` too.
            kube.add_review_token(
                NODE_AGENT_TOKEN,
                FakeUser::service_account("istio-system", "ztunnel"),
            )
        });
    }
    for i in 0..args.identities {
        let k = i % clusters.len();
        let (kube, cluster) = &clusters[k];
        let (ns, sa) = ("bench".to_string(), format!("sa-{i}"));
        let token = if let Some(agent_token) = node_agent_tokens.get(k) {
            kube.add_pod(&ns, &format!("pod-{i}"), &format!("uid-{i}"), &sa, NODE);
            agent_token.clone()
        } else if args.offline_jwt {
            kube.mint_token(&ns, &sa, None)
        } else {
            kube.add_review_token(&format!("token-{i}"), FakeUser::service_account(&ns, &sa))
        };
        tokens.push((ns, sa, token));
        cluster_of.push(cluster.clone());
    }
    let storm = Storm::prepare(&args, &server, &tokens, &cluster_of).await?;
    let (mut report, clean) = storm.fire().await?;
    // TokenReviews by cluster (the node agents' warm-up included).
    let reviews: BTreeMap<String, usize> = clusters
        .iter()
        .map(|(kube, id)| {
            let id = id.clone().unwrap_or_else(|| "local".into());
            (id, kube.reviews())
        })
        .collect();
    report["api"] = json!("fake");
    report["api_latency_ms"] = json!(args.api_latency.as_secs_f64() * 1000.0);
    report["clusters"] = json!(clusters.len());
    report["token_reviews"] = json!(reviews.values().sum::<usize>());
    if !remotes.is_empty() {
        report["token_reviews_by_cluster"] = json!(reviews);
        report["token_reviews_local_cluster"] = json!(server.kube.reviews());
    }
    print_report(&args, &report)?;
    Ok(clean)
}

/// The scenario against a real kube-apiserver (`--kube-apiserver`).
async fn run_real(args: &MassRestartArgs, meshca: &PathBuf) -> anyhow::Result<bool> {
    let real = RealKube::start().await?;
    let (ns, n) = ("bench", args.identities);
    let setup = Instant::now();
    eprintln!(
        "meshca-bench: creating {n} ServiceAccounts{} and their tokens ({} calls in flight)…",
        if args.node_agent { " and pods" } else { "" },
        real_kube::SETUP_CONCURRENCY
    );
    real.namespace(ns).await?;
    let accounts: Vec<String> = (0..n).map(|i| format!("sa-{i}")).collect();
    real.service_accounts(ns, &accounts).await?;
    let tokens: Vec<(String, String, String)> = if args.node_agent {
        // ztunnel's own pod on the node, its token bound to that pod; one
        // pod per identity on the same node.
        let (agent_ns, agent_sa) = NODE_AGENT.split_once('/').context("NODE_AGENT")?;
        real.node(NODE).await?;
        real.service_accounts(agent_ns, &[agent_sa.to_string()])
            .await?;
        let agent_pod = "ztunnel-pod".to_string();
        let agent_uid = real
            .pods(agent_ns, &[(agent_pod.clone(), agent_sa.into())], NODE)
            .await?;
        let agent_token = real
            .tokens(
                agent_ns,
                &[(agent_sa.into(), Some((agent_pod, agent_uid[0].clone())))],
            )
            .await?
            .remove(0);
        let pods: Vec<(String, String)> = accounts
            .iter()
            .enumerate()
            .map(|(i, sa)| (format!("pod-{i}"), sa.clone()))
            .collect();
        real.pods(ns, &pods, NODE).await?;
        accounts
            .iter()
            .map(|sa| (ns.to_string(), sa.clone(), agent_token.clone()))
            .collect()
    } else {
        let requests: Vec<(String, Option<(String, String)>)> =
            accounts.iter().map(|sa| (sa.clone(), None)).collect();
        let tokens = real.tokens(ns, &requests).await?;
        accounts
            .iter()
            .zip(tokens)
            .map(|(sa, token)| (ns.to_string(), sa.clone(), token))
            .collect()
    };
    let setup_seconds = setup.elapsed().as_secs_f64();
    eprintln!("meshca-bench: set-up took {setup_seconds:.1} s; starting meshca…");

    let (kubeconfig, mut flags) = real.meshca_kubeconfig().await;
    if args.node_agent {
        flags.extend(["--trusted-node-agent".into(), NODE_AGENT.into()]);
    }
    if args.offline_jwt {
        flags.extend(["--jwt-issuer".into(), control_plane::ISSUER.into()]);
    }
    flags.extend(per_source_bound_off(&args.meshca_args));
    flags.extend(args.meshca_args.iter().cloned());
    let server = MeshcaProcess::start(meshca, &kubeconfig, &flags, None).await?;
    let storm = Storm::prepare(args, &server, &tokens, &[]).await?;
    // The API server's own background, meshca started and idle.
    let idle = real_kube::idle_rate(&real).await?;
    let before = real.snapshot().await?;
    let (mut report, clean) = storm.fire().await?;
    let after = real.snapshot().await?;
    let delta = before.until(&after);
    report["api"] = json!("kube-apiserver");
    report["api_latency_ms"] = json!(null);
    report["token_reviews"] = json!(delta.count("POST", "tokenreviews"));
    report["setup_seconds"] = json!(setup_seconds);
    report["kube_apiserver"] = delta.report(n, idle, &real.version);
    print_report(args, &report)?;
    Ok(clean)
}

fn print_report(args: &MassRestartArgs, report: &serde_json::Value) -> anyhow::Result<()> {
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(report)?);
    }
    Ok(())
}

/// The storm, ready to start: CSRs made, connections open, the node agent
/// warmed up.
struct Storm<'a> {
    args: &'a MassRestartArgs,
    server: &'a MeshcaProcess,
    addr: String,
    root_pem: Arc<str>,
    prepared: Arc<Vec<Prepared>>,
    clients: Vec<load::Client>,
}

impl<'a> Storm<'a> {
    /// Makes a CSR per identity of `tokens` (`namespace, service account,
    /// token`), each naming the cluster of `cluster_of` (the same index;
    /// empty or `None`: the local cluster), opens the connections and,
    /// with `--node-agent`, has each cluster's agent's first request
    /// succeed.
    async fn prepare(
        args: &'a MassRestartArgs,
        server: &'a MeshcaProcess,
        tokens: &[(String, String, String)],
        cluster_of: &[Option<String>],
    ) -> anyhow::Result<Self> {
        let run_args = RunArgs {
            addr: format!("https://{}", server.grpc),
            target: crate::Target::Istio,
            data_dir: None,
            root_cert: None,
            tokens: None,
            identities: args.identities,
            connections: args.connections,
            concurrency: args.identities,
            duration: Duration::ZERO,
            requests: None,
            warmup: Duration::ZERO,
            key: meshca_certs::KeyAlgorithm::EcdsaP256,
            trust_domain: "cluster.local".into(),
            server_pid: None,
            crypto_baseline: false,
            json: false,
            threads: 2,
        };
        let mut prepared = load::prepare(&run_args, None, Some(tokens))?;
        if args.node_agent {
            for (p, (ns, sa, _)) in prepared.iter_mut().zip(tokens) {
                p.impersonate = Some(format!("spiffe://cluster.local/ns/{ns}/sa/{sa}"));
            }
        }
        for (p, cluster) in prepared.iter_mut().zip(cluster_of) {
            p.cluster = match cluster {
                Some(id) => Some(id.parse().context("cluster ID as a header value")?),
                None => None,
            };
        }
        let prepared: Arc<Vec<Prepared>> = Arc::new(prepared);
        // With a connection per identity, one shared connection is still
        // needed: the node agent's warm-up below.
        let shared_connections = if args.connection_per_identity {
            1
        } else {
            args.connections
        };
        let clients =
            load::connect_istio(&run_args.addr, &server.root_pem, shared_connections).await?;
        if args.node_agent {
            // The agent was running before its pods restarted: its token has
            // been reviewed and meshca's pod index is in sync. One request
            // until it succeeds stands for that, for the pod added last in
            // each cluster: the pod watch delivers in order, so then every
            // pod is indexed.
            let mut client = clients[0].clone();
            let mut last_of_cluster: BTreeMap<Option<&str>, &Prepared> = BTreeMap::new();
            for (i, p) in prepared.iter().enumerate() {
                let cluster = cluster_of.get(i).and_then(|c| c.as_deref());
                last_of_cluster.insert(cluster, p);
            }
            anyhow::ensure!(!last_of_cluster.is_empty(), "no identities");
            let deadline = Instant::now() + Duration::from_secs(30);
            for (cluster, last) in last_of_cluster {
                while let Err(code) = client.call(last).await {
                    anyhow::ensure!(
                        Instant::now() < deadline,
                        "the node agent's first request ({}) kept failing ({code}): {}",
                        cluster.unwrap_or("local cluster"),
                        server.log()
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        Ok(Self {
            args,
            server,
            addr: run_args.addr,
            root_pem: server.root_pem.as_str().into(),
            prepared,
            clients,
        })
    }

    /// Every identity at once; the report (without the API's side) and
    /// whether every identity got its certificate.
    async fn fire(self) -> anyhow::Result<(serde_json::Value, bool)> {
        let Self {
            args,
            server,
            addr,
            root_pem,
            prepared,
            clients,
        } = self;
        let (monitoring, pid) = (server.monitoring, server.pid());
        let rss_before = proc_stats::read(pid);

        // Health checks every 50 ms while the storm lasts, from a thread of
        // their own (the tasks of this process are as busy as the server).
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let health = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut hist = new_histogram();
                let mut failures = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let t = Instant::now();
                    match healthz(monitoring, Duration::from_secs(2)) {
                        Ok(()) => {
                            let _ = hist.record(t.elapsed().as_micros().max(1) as u64);
                        }
                        Err(_) => failures += 1,
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                (hist, failures)
            })
        };
        // Every identity at once: one task each. Like the agent library (and
        // Istio's agents), a request refused as overloaded or unavailable, and
        // with --connection-per-identity a connection the server closed at
        // accept (--max-connections), is tried again after a jittered,
        // doubling backoff (1 s, 2 s, 4 s…).
        let start = Instant::now();
        // Why tries were given up and made again, by kind.
        let retry_reasons: Arc<std::sync::Mutex<BTreeMap<String, u64>>> = Arc::default();
        let mut tasks = Vec::with_capacity(args.identities);
        for (i, p) in prepared.iter().enumerate() {
            let shared = clients[i % clients.len()].clone();
            let p = p.clone();
            let (per_identity, addr, root_pem) =
                (args.connection_per_identity, addr.clone(), root_pem.clone());
            let retry_reasons = retry_reasons.clone();
            let count_reason = move |reason: String| {
                *retry_reasons
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(reason)
                    .or_default() += 1;
            };
            tasks.push(tokio::spawn(async move {
                let t = Instant::now();
                let mut retries = 0u32;
                let mut client = if per_identity {
                    loop {
                        match load::connect_istio(&addr, &root_pem, 1).await {
                            Ok(mut own) => break own.remove(0),
                            Err(e) if retries < MAX_RETRIES => {
                                count_reason(connect_failure_kind(&e));
                                tokio::time::sleep(backoff(retries, i)).await;
                                retries += 1;
                            }
                            // Given up: counted by its kind.
                            Err(e) => {
                                let kind = connect_failure_kind(&e);
                                return (t.elapsed(), t.elapsed(), retries, Err(kind));
                            }
                        }
                    }
                } else {
                    shared
                };
                let mut first_answer = None;
                loop {
                    let result = client.call(&p).await;
                    first_answer.get_or_insert(t.elapsed());
                    match result {
                        Err(code)
                            if (code == "ResourceExhausted" || code == "Unavailable")
                                && retries < MAX_RETRIES =>
                        {
                            count_reason(code.to_string());
                            tokio::time::sleep(backoff(retries, i)).await;
                            retries += 1;
                        }
                        other => {
                            return (
                                t.elapsed(),
                                first_answer.unwrap_or_default(),
                                retries,
                                other,
                            )
                        }
                    }
                }
            }));
        }
        let mut latency = new_histogram();
        let mut first_answer = new_histogram();
        let mut errors: BTreeMap<String, u64> = BTreeMap::new();
        let mut retried = BTreeMap::<u32, u64>::new();
        let mut ok = 0u64;
        for t in tasks {
            match t.await {
                Ok((d, first, retries, result)) => {
                    let _ = first_answer.record(first.as_micros().max(1) as u64);
                    *retried.entry(retries).or_default() += 1;
                    match result {
                        Ok(()) => {
                            ok += 1;
                            let _ = latency.record(d.as_micros().max(1) as u64);
                        }
                        Err(code) => *errors.entry(code).or_default() += 1,
                    }
                }
                Err(_) => *errors.entry("TASK_FAILED".into()).or_default() += 1,
            }
        }
        let drained = start.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (health_hist, health_failures) = health.join().unwrap_or((new_histogram(), u64::MAX));
        let stats = proc_stats::read(pid);
        let ms = |h: &hdrhistogram::Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        let report = json!({
            "scenario": if args.node_agent { "mass-restart-node-agent" } else { "mass-restart" },
            "auth": if args.offline_jwt { "offline-jwt" } else { "token-review" },
            "identities": args.identities,
            "connections": if args.connection_per_identity { args.identities } else { args.connections },
            "connected_in_storm": args.connection_per_identity,
            "ok": ok,
            "errors": errors,
            "retry_reasons": retry_reasons.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            "requests_by_retries": retried.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<String, u64>>(),
            "first_answer_ms": {"p50": ms(&first_answer, 0.5), "p99": ms(&first_answer, 0.99), "max": first_answer.max() as f64 / 1000.0},
            "drain_seconds": drained.as_secs_f64(),
            "throughput_per_second": ok as f64 / drained.as_secs_f64().max(1e-9),
            "time_to_certificate_ms": {"p50": ms(&latency, 0.5), "p90": ms(&latency, 0.9), "p99": ms(&latency, 0.99), "max": latency.max() as f64 / 1000.0},
            "healthz": {"checks": health_hist.len(), "failures": health_failures, "p99_ms": ms(&health_hist, 0.99), "max_ms": health_hist.max() as f64 / 1000.0},
            "server": stats.map(|s| json!({
                "cpu_seconds": s.cpu_seconds - rss_before.map(|b| b.cpu_seconds).unwrap_or(0.0),
                "peak_rss_mib": s.peak_rss_bytes as f64 / 1048576.0,
            })),
        });
        Ok((report, errors.is_empty()))
    }
}
