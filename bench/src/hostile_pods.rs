//! `meshca-bench hostile-pods`: a node agent (`meshca-agent
//! --node-agent`) with hostile pods on its node, each at its limits, and
//! one well-behaved pod getting its SVID and its rotations meanwhile.
//!
//! The agent runs against a real meshca (the binary, with the fake
//! Kubernetes API of the end-to-end tests as its API server and the
//! agent's pod watch) and a fake `--proc-root`: every pod is a process of
//! its own (this program re-run as `meshca-bench pod-process`), and the
//! cgroup file of its PID names its pod, so the agent charges what it does
//! to that pod. A hostile pod runs four attacks at once, each repeated as
//! soon as the agent closes what it opened:
//! - parked header blocks: HEADERS and CONTINUATION frames (about 48 KiB)
//!   with a socket path as `:authority`, as Python's grpcio sends, and
//!   never END_HEADERS;
//! - never-read streams: `FetchX509SVID` streams whose answers (and
//!   rotations) are never read, with a 2 GiB flow-control window offered;
//! - SDS nonce and NACK storms: Envoy `StreamSecrets` streams sending
//!   requests with bad nonces, and NACKs of every answer, as fast as the
//!   stream takes them;
//! - messages split over many DATA frames: a `StreamSecrets` request of
//!   200,000 bytes declared, sent 16 bytes a frame (within the flow-control
//!   window the agent grants), never finished.
//!
//! The run is an A/B in one process: a phase with the well-behaved pod
//! alone, then a phase of the same length with the hostile pods, then the
//! wait for the agent's memory to come back. The well-behaved pod holds a
//! `FetchX509SVID` stream (each rotation's arrival is timed against when
//! the agent's certificate manager scheduled it, read from the agent's
//! debug line `certificate issued … renew_in=…`) and asks for its SVID on
//! a fresh connection every 500 ms.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use clap::{Args, ValueEnum};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use hyper_util::rt::TokioIo;
use meshca_certs::parse_duration;
use meshca_proto::spiffe_workload::spiffe_workload_api_client::SpiffeWorkloadApiClient;
use meshca_proto::spiffe_workload::X509svidRequest;
use meshca_tests::fake_kube::FakeUser;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

use crate::server_process::{KillOnDrop, Meshca};
use crate::{proc_stats, server_process};

/// The node of the agent and of every pod.
const NODE: &str = "node-a";
/// The trusted node agent's service account.
const NODE_AGENT: &str = "istio-system/meshca-agent";
/// The container ID every pod's process claims (each pod lists it).
const CONTAINER: &str = "3b1ad5e2c0f4a8b9c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4";
/// The well-behaved pod's identity.
const GOOD_ID: &str = "spiffe://cluster.local/ns/default/sa/good";
/// How much above its memory before the attack the agent must come back to.
const RSS_RETURN_MARGIN: u64 = 8 * 1024 * 1024;
/// The agent's line for each certificate it got (debug, the manager's).
const ISSUED_LINE: &str = "certificate issued";
/// Envoy's secret type URL.
const SECRET_TYPE: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

/// Each hostile pod's share of its 64 connections, by attack.
const PARKED_CONNECTIONS: usize = 16;
/// Never-read connections (two streams each).
const NEVER_READ_CONNECTIONS: usize = 8;
/// Streams per never-read connection.
const NEVER_READ_STREAMS: u32 = 2;
/// SDS storm connections (four streams each).
const SDS_CONNECTIONS: usize = 4;
/// Streams per SDS storm connection.
const SDS_STREAMS: usize = 4;
/// Connections sending a message split into many DATA frames.
const SPLIT_CONNECTIONS: usize = 16;

/// Flags of `meshca-bench hostile-pods`.
#[derive(Debug, Clone, Args)]
pub(crate) struct HostilePodsArgs {
    /// Hostile pods on the node agent's node.
    #[arg(long, default_value_t = 10)]
    pub(crate) pods: usize,
    /// Length of each phase (the well-behaved pod alone, then attacked).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// The workload certificates' lifetime the agent asks for (it renews
    /// at about half of it).
    #[arg(long, default_value = "4s", value_parser = parse_duration)]
    pub(crate) workload_ttl: Duration,
    /// The meshca binary (default: `meshca` next to this program).
    #[arg(long)]
    pub(crate) meshca: Option<PathBuf>,
    /// The meshca-agent binary (default: `meshca-agent` next to this program).
    #[arg(long)]
    pub(crate) meshca_agent: Option<PathBuf>,
    /// Latency of every answer of the fake Kubernetes API.
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub(crate) api_latency: Duration,
    /// Extra flags for `meshca serve`.
    #[arg(long = "meshca-arg", allow_hyphen_values = true)]
    pub(crate) meshca_args: Vec<String>,
    /// Extra flags for `meshca-agent` (e.g. `--agent-arg=--max-streams-per-pod=32`).
    #[arg(long = "agent-arg", allow_hyphen_values = true)]
    pub(crate) agent_args: Vec<String>,
    /// The attacks each hostile pod runs (default: all of them).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) attacks: Vec<Attack>,
    /// Print the report as one line of JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The attacks of a hostile pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Attack {
    /// Header blocks parked without END_HEADERS.
    Parked,
    /// Streams whose answers are never read.
    NeverRead,
    /// SDS streams of bad nonces and NACKs, as fast as they go.
    SdsStorm,
    /// Messages split over many 16-byte DATA frames.
    Split,
}

/// What a `pod-process` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Role {
    /// Holds an SVID stream and asks again every 500 ms; prints what it saw.
    Good,
    /// Runs every attack at the pod's limits until stdin closes.
    Hostile,
}

/// Flags of the hidden `meshca-bench pod-process` (started by the scenario).
#[derive(Debug, Clone, Args)]
pub(crate) struct PodProcessArgs {
    /// The node agent's socket.
    #[arg(long)]
    pub(crate) socket: PathBuf,
    /// What this pod does.
    #[arg(long, value_enum)]
    pub(crate) role: Role,
    /// A hostile pod's attacks.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) attacks: Vec<Attack>,
}

fn unix_micros(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn mib(bytes: u64) -> f64 {
    (bytes as f64 / 1048576.0 * 10.0).round() / 10.0
}

fn ms(micros: f64) -> f64 {
    (micros / 10.0).round() / 100.0
}

// ----- the scenario ---------------------------------------------------------

/// A pod's process (killed when dropped) and the lines it printed.
struct PodProcess {
    child: KillOnDrop,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl PodProcess {
    /// Starts `meshca-bench pod-process`, writes the cgroup file of its PID
    /// (pod `uid`) and tells it to go.
    fn start(
        socket: &Path,
        role: Role,
        attacks: &[Attack],
        proc_root: &Path,
        uid: &str,
    ) -> anyhow::Result<Self> {
        let attacks: Vec<String> = attacks
            .iter()
            .filter_map(|a| a.to_possible_value().map(|v| v.get_name().to_string()))
            .collect();
        let role_name = match role {
            Role::Good => "good",
            Role::Hostile => "hostile",
        };
        let mut child = Command::new(std::env::current_exe().context("locating meshca-bench")?)
            .arg("pod-process")
            .arg("--socket")
            .arg(socket)
            .args(["--role", role_name])
            .args(if attacks.is_empty() {
                vec![]
            } else {
                vec!["--attacks".to_string(), attacks.join(",")]
            })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting a pod process")?;
        let dir = proc_root.join(child.id().to_string());
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(
            dir.join("cgroup"),
            format!("0::/kubepods/burstable/pod{uid}/{CONTAINER}\n"),
        )
        .context("writing a cgroup file")?;
        let stdout = child.stdout.take().context("the pod's stdout")?;
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let reader = {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(stdout)
                    .lines()
                    .map_while(Result::ok)
                {
                    lines.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                }
            })
        };
        let mut child = KillOnDrop(child);
        let stdin = child.0.stdin.as_mut().context("the pod's stdin")?;
        writeln!(stdin, "go").context("telling the pod to go")?;
        stdin.flush()?;
        Ok(Self {
            child,
            lines,
            reader: Some(reader),
        })
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Closes its stdin and waits (at most 10 s) for it to print its last
    /// lines and exit; returns every line.
    fn finish(mut self) -> Vec<String> {
        drop(self.child.0.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.0.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.0.kill();
        let _ = self.child.0.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        self.lines()
    }
}

/// Samples the agent's RSS every 20 ms while `running`.
fn sample_rss(
    pid: u32,
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            if let Some(s) = proc_stats::read(pid) {
                peak.fetch_max(s.rss_bytes, Ordering::Relaxed);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
}

/// The agent binary: `explicit`, or `meshca-agent` next to this program.
fn agent_path(explicit: Option<&PathBuf>) -> anyhow::Result<PathBuf> {
    match explicit {
        Some(p) => Ok(p.clone()),
        None => Ok(std::env::current_exe()?
            .parent()
            .context("locating meshca-agent")?
            .join("meshca-agent")),
    }
}

/// A pod UID of the scenario, `n` its number (0 is the well-behaved pod).
fn pod_uid(n: usize) -> String {
    format!("00000000-0000-4000-8000-{n:012}")
}

/// Runs the scenario and prints its report. `Ok(false)`: the well-behaved
/// pod was not served in both phases without an error.
pub(crate) async fn run(args: HostilePodsArgs) -> anyhow::Result<bool> {
    let report = measure(&args).await?;
    let clean = report["real_clients_clean"].as_bool().unwrap_or(false);
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(clean)
}

async fn measure(args: &HostilePodsArgs) -> anyhow::Result<Value> {
    let meshca = server_process::meshca_path(args.meshca.as_ref())?;
    let agent_bin = agent_path(args.meshca_agent.as_ref())?;
    let mut flags = vec!["--trusted-node-agent".to_string(), NODE_AGENT.to_string()];
    flags.extend(args.meshca_args.iter().cloned());
    let server = Meshca::start(&meshca, args.api_latency, &flags).await?;
    let kube = &server.kube;
    let (agent_ns, agent_sa) = NODE_AGENT.split_once('/').context("NODE_AGENT")?;
    kube.add_pod(
        agent_ns,
        "meshca-agent-pod",
        "uid-meshca-agent",
        agent_sa,
        NODE,
    );
    kube.add_pod_with_containers("default", "good-1", &pod_uid(0), "good", NODE, &[CONTAINER]);
    for n in 1..=args.pods {
        kube.add_pod_with_containers(
            "hostile",
            &format!("hostile-{n}"),
            &pod_uid(n),
            &format!("pod-{n}"),
            NODE,
            &[CONTAINER],
        );
    }
    let agent_token =
        kube.add_review_token("agent-token", FakeUser::service_account(agent_ns, agent_sa));
    let dir = tempfile::tempdir()?;
    let root = dir.path().join("root-cert.pem");
    std::fs::write(&root, &server.root_pem)?;
    let token_file = dir.path().join("agent.token");
    std::fs::write(&token_file, agent_token)?;
    let proc_root = dir.path().join("proc");
    std::fs::create_dir_all(&proc_root)?;
    let socket = dir.path().join("agent.sock");
    let log_path = dir.path().join("agent.log");
    let ttl = args.workload_ttl.as_secs_f64();
    let agent = Command::new(&agent_bin)
        .arg("--ca-addr")
        .arg(format!("https://{}", server.grpc))
        .arg("--root-cert")
        .arg(&root)
        .arg("--token-file")
        .arg(&token_file)
        .args(["--node-agent", "--node-name", NODE, "--kubeconfig"])
        .arg(&kube.kubeconfig)
        .arg("--proc-root")
        .arg(&proc_root)
        .arg("--workload-api-socket")
        .arg(&socket)
        .arg("--ttl")
        .arg(format!("{}ms", args.workload_ttl.as_millis()))
        .args(&args.agent_args)
        // The manager's debug line times each rotation; everything else at info.
        .env("MESHCA_LOG", "info,meshca_client::manager=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()
        .with_context(|| format!("starting {}", agent_bin.display()))?;
    let agent = KillOnDrop(agent);
    let pid = agent.0.id();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(60);
    while UnixStream::connect(&socket).await.is_err() {
        anyhow::ensure!(
            Instant::now() < deadline && proc_stats::read(pid).is_some(),
            "the agent did not serve its socket:\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The well-behaved pod, for both phases.
    let good = PodProcess::start(&socket, Role::Good, &[], &proc_root, &pod_uid(0))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !good.lines().iter().any(|l| l.starts_with("ROTATION ")) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the well-behaved pod got no SVID: {:?}\n{}",
            good.lines(),
            log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Phase A: the well-behaved pod alone.
    let a_start = SystemTime::now();
    let stats_a0 = proc_stats::read(pid).context("the agent's /proc")?;
    let lines_a0 = log().lines().count();
    tokio::time::sleep(args.duration).await;
    let a_end = SystemTime::now();
    let stats_a1 = proc_stats::read(pid).context("the agent's /proc")?;
    let lines_a1 = log().lines().count();

    // Phase B: the hostile pods, at their limits.
    let rss_before = stats_a1.rss_bytes;
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(rss_before));
    let sampler = sample_rss(pid, stop.clone(), peak.clone());
    let b_start = SystemTime::now();
    let attacks = if args.attacks.is_empty() {
        vec![
            Attack::Parked,
            Attack::NeverRead,
            Attack::SdsStorm,
            Attack::Split,
        ]
    } else {
        args.attacks.clone()
    };
    let mut hostile = Vec::new();
    for n in 1..=args.pods {
        hostile.push(PodProcess::start(
            &socket,
            Role::Hostile,
            &attacks,
            &proc_root,
            &pod_uid(n),
        )?);
    }
    tokio::time::sleep(args.duration).await;
    let b_end = SystemTime::now();
    let stats_b1 = proc_stats::read(pid).context("the agent died during the attack")?;
    let log_b = log();
    let mut counted: BTreeMap<String, u64> = BTreeMap::new();
    for pod in hostile {
        for line in pod.finish() {
            if let Some(counts) = line.strip_prefix("COUNTS ") {
                if let Ok(Value::Object(map)) = serde_json::from_str::<Value>(counts) {
                    for (k, v) in map {
                        *counted.entry(k).or_default() += v.as_u64().unwrap_or(0);
                    }
                }
            }
        }
    }
    let ended = Instant::now();
    // The memory of the attack given back: wait until the agent is within
    // the margin of where it started (at most 60 s).
    let returned_after = loop {
        let now = proc_stats::read(pid).map_or(u64::MAX, |s| s.rss_bytes);
        if now <= rss_before + RSS_RETURN_MARGIN {
            break Some(ended.elapsed());
        }
        if ended.elapsed() > Duration::from_secs(60) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let after = proc_stats::read(pid).context("the agent's /proc")?;
    let rss_peak = peak.load(Ordering::Relaxed).max(after.rss_bytes);

    let good_lines = good.finish();
    let full_log = log();
    let rotations = rotation_delays(&good_lines, &full_log);
    let fetches = fetch_latencies(&good_lines);
    let phase = |from: SystemTime, to: SystemTime| {
        let (from, to) = (unix_micros(from), unix_micros(to));
        let delays: Vec<f64> = rotations
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .map(|(_, d)| *d)
            .collect();
        let fetched: Vec<f64> = fetches
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .map(|(_, d)| *d)
            .collect();
        let errors: Vec<&str> = good_lines
            .iter()
            .filter_map(|l| l.strip_prefix("ERROR "))
            .filter_map(|l| l.split_once(' '))
            .filter(|(at, _)| at.parse::<u64>().is_ok_and(|at| (from..to).contains(&at)))
            .map(|(_, what)| what)
            .collect();
        json!({
            "rotations": delays.len(),
            "rotation_delay_ms": summary(&delays),
            "svid_fetches": fetched.len(),
            "svid_fetch_latency_ms": summary(&fetched),
            "errors": errors.len(),
            "error_kinds": errors.iter().take(8).collect::<Vec<_>>(),
        })
    };
    let alone = phase(a_start, a_end);
    let attacked = phase(b_start, b_end);
    let cpu = |a: &proc_stats::ProcStats, b: &proc_stats::ProcStats| {
        ((b.cpu_seconds - a.cpu_seconds) * 100.0).round() / 100.0
    };
    // Lines the attack made the agent write, not counting the manager's
    // debug lines this benchmark turned on to time rotations.
    let info_lines = |text: &str, from: usize, to: usize| {
        text.lines()
            .skip(from)
            .take(to.saturating_sub(from))
            .filter(|l| !l.contains(" DEBUG "))
            .count()
    };
    let attack_log: Vec<&str> = log_b
        .lines()
        .skip(lines_a1)
        .filter(|l| !l.contains(" DEBUG "))
        .collect();
    let limit = 128 * 1024 * 1024u64;
    let added_p99 = |key: &str| {
        let p = |v: &Value| v[key]["p99"].as_f64();
        match (p(&alone), p(&attacked)) {
            (Some(a), Some(b)) => json!(((b - a) * 100.0).round() / 100.0),
            _ => Value::Null,
        }
    };
    let served = |v: &Value| v["rotations"].as_u64().unwrap_or(0) > 0 && v["errors"] == 0;
    let rotation_added = added_p99("rotation_delay_ms");
    let fetch_added = added_p99("svid_fetch_latency_ms");
    Ok(json!({
        "scenario": "hostile-pods",
        "agent_args": args.agent_args,
        "pods": args.pods,
        "phase_seconds": args.duration.as_secs_f64(),
        "workload_ttl_seconds": ttl,
        "attacks_run": attacks.iter().map(|a| format!("{a:?}")).collect::<Vec<_>>(),
        "per_hostile_pod": {
            "parked_header_block_connections": PARKED_CONNECTIONS,
            "never_read_streams": NEVER_READ_CONNECTIONS * NEVER_READ_STREAMS as usize,
            "sds_storm_streams": SDS_CONNECTIONS * SDS_STREAMS,
            "split_message_connections": SPLIT_CONNECTIONS,
        },
        "attacks": counted,
        "agent": {
            "rss_start_mib": mib(stats_a0.rss_bytes),
            "rss_before_attack_mib": mib(rss_before),
            "rss_peak_mib": mib(rss_peak),
            "rss_after_mib": mib(after.rss_bytes),
            "rss_returned_within_8_mib_after_seconds": returned_after.map(|d| (d.as_secs_f64() * 10.0).round() / 10.0),
            "daemonset_memory_limit_mib": mib(limit),
            "cpu_seconds_alone": cpu(&stats_a0, &stats_a1),
            "cpu_seconds_attacked": cpu(&stats_a1, &stats_b1),
            "log_lines_alone": info_lines(&log_b, lines_a0, lines_a1),
            "log_lines_attacked": attack_log.len(),
            "log_lines_attacked_sample": attack_log.iter().take(12).map(|l| l.chars().take(300).collect::<String>()).collect::<Vec<_>>(),
            "alive": proc_stats::read(pid).is_some(),
        },
        "good_pod": {
            "alone": alone,
            "attacked": attacked,
            "rotation_delay_p99_added_ms": rotation_added,
            "svid_fetch_p99_added_ms": fetch_added,
        },
        "goals": {
            "peak_rss_under_half_the_limit": rss_peak < limit / 2,
            "rss_back_within_8_mib": returned_after.is_some(),
            "no_added_delay_beyond_100_ms": rotation_added.as_f64().is_some_and(|d| d <= 100.0)
                && fetch_added.as_f64().is_some_and(|d| d <= 100.0),
        },
        "real_clients_clean": served(&alone) && served(&attacked),
    }))
}

/// min, p50, p99, max of `values` (ms).
fn summary(values: &[f64]) -> Value {
    if values.is_empty() {
        return Value::Null;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let q = |q: f64| ms(v[((v.len() - 1) as f64 * q).round() as usize]);
    json!({"min": q(0.0), "p50": q(0.5), "p99": q(0.99), "max": q(1.0)})
}

/// The well-behaved pod's fresh-connection fetches: (when, latency µs).
fn fetch_latencies(lines: &[String]) -> Vec<(u64, f64)> {
    lines
        .iter()
        .filter_map(|l| l.strip_prefix("FETCH "))
        .filter_map(|l| {
            let (at, took) = l.split_once(' ')?;
            Some((at.parse().ok()?, took.parse().ok()?))
        })
        .collect()
}

/// Each rotation the well-behaved pod received on its stream, timed
/// against when the agent's manager scheduled it: (arrival, µs from the
/// renewal being due — the previous certificate's `certificate issued`
/// line plus its `renew_in` — to the pod holding the new one). The first
/// SVID of the stream is not a rotation.
fn rotation_delays(pod_lines: &[String], agent_log: &str) -> Vec<(u64, f64)> {
    // The agent's issuance lines for the well-behaved pod: serial → (when
    // issued, when its renewal is due), µs.
    let mut issued: Vec<(String, u64, u64)> = Vec::new();
    for line in agent_log.lines() {
        if !line.contains(ISSUED_LINE) || !line.contains(GOOD_ID) {
            continue;
        }
        let Some(at) = line.split_whitespace().next().and_then(parse_log_time) else {
            continue;
        };
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .map(str::to_string)
        };
        let (Some(serial), Some(renew_in)) = (
            field("serial="),
            field("renew_in=").and_then(|d| parse_debug_duration(&d)),
        ) else {
            continue;
        };
        issued.push((normal_serial(&serial), at, at + renew_in.as_micros() as u64));
    }
    let mut delays = Vec::new();
    let mut previous: Option<String> = None;
    for line in pod_lines {
        let Some(rest) = line.strip_prefix("ROTATION ") else {
            continue;
        };
        let Some((at, serial)) = rest.split_once(' ') else {
            continue;
        };
        let (Ok(at), serial) = (at.parse::<u64>(), normal_serial(serial)) else {
            continue;
        };
        if previous.as_deref() == Some(serial.as_str()) {
            continue;
        }
        if let Some(prev) = &previous {
            if let Some((_, _, due)) = issued.iter().find(|(s, ..)| s == prev) {
                delays.push((at, at.saturating_sub(*due) as f64));
            }
        }
        previous = Some(serial);
    }
    delays
}

fn normal_serial(s: &str) -> String {
    s.trim().trim_start_matches('0').to_ascii_lowercase()
}

/// A tracing timestamp (`2026-12-03T13:11:15.123456Z`) as µs since the epoch.
fn parse_log_time(word: &str) -> Option<u64> {
    let t =
        time::OffsetDateTime::parse(word, &time::format_description::well_known::Rfc3339).ok()?;
    u64::try_from(t.unix_timestamp_nanos() / 1000).ok()
}

/// A `Duration`'s `Debug` text (`1.95s`, `950.2ms`, `12µs`, `3ns`).
fn parse_debug_duration(text: &str) -> Option<Duration> {
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix("µs") {
        (n, 1e-6)
    } else if let Some(n) = text.strip_suffix("ns") {
        (n, 1e-9)
    } else {
        (text.strip_suffix('s')?, 1.0)
    };
    let value: f64 = number.parse().ok()?;
    (value >= 0.0).then(|| Duration::from_secs_f64(value * scale))
}

// ----- the pods' processes --------------------------------------------------

/// `meshca-bench pod-process`: waits for `go` on stdin, then plays its
/// role until stdin closes.
pub(crate) async fn pod_process(args: PodProcessArgs) -> anyhow::Result<bool> {
    let (stdin_closed_tx, stdin_closed) = tokio::sync::oneshot::channel::<()>();
    let (go_tx, go) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut lines = std::io::stdin().lock().lines();
        if let Some(Ok(_)) = lines.next() {
            let _ = go_tx.send(());
        }
        for _ in lines.by_ref() {}
        let _ = stdin_closed_tx.send(());
    });
    go.await.context("stdin closed before go")?;
    match args.role {
        Role::Good => good_pod(&args.socket, stdin_closed).await,
        Role::Hostile => hostile_pod(&args.socket, &args.attacks, stdin_closed).await,
    }
    Ok(true)
}

/// A tonic channel over the Unix socket.
async fn uds_channel(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_path_buf();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
}

fn x509_request() -> tonic::Request<X509svidRequest> {
    let mut request = tonic::Request::new(X509svidRequest {});
    request.metadata_mut().insert(
        meshca_proto::WORKLOAD_API_HEADER,
        tonic::metadata::MetadataValue::from_static("true"),
    );
    request
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The leaf's serial of an `X509SVID` answer's chain (DER, leaf first).
fn leaf_serial(chain: &[u8]) -> Option<String> {
    meshca_certs::inspect::CertSummary::from_der(chain)
        .ok()
        .map(|s| s.serial)
}

/// The well-behaved pod: a stream held (each answer printed `ROTATION
/// <µs> <serial>`), and a fresh connection's first answer every 500 ms
/// (`FETCH <µs> <latency µs>`); failures `ERROR <µs> <what>`.
async fn good_pod(socket: &Path, stop: tokio::sync::oneshot::Receiver<()>) {
    let stream = {
        let socket = socket.to_path_buf();
        tokio::spawn(async move {
            loop {
                let held = async {
                    let mut client = SpiffeWorkloadApiClient::new(
                        uds_channel(&socket).await.map_err(|e| e.to_string())?,
                    );
                    let mut answers = client
                        .fetch_x509svid(x509_request())
                        .await
                        .map_err(|s| format!("{:?}", s.code()))?
                        .into_inner();
                    while let Some(answer) = answers.message().await.map_err(|s| {
                        use std::error::Error as _;
                        let mut what = format!("{:?}: {}", s.code(), s.message());
                        let mut source = s.source();
                        while let Some(cause) = source {
                            what.push_str(&format!(" / {cause}"));
                            source = cause.source();
                        }
                        what.replace('\n', " ")
                    })? {
                        let now = unix_micros(SystemTime::now());
                        match answer.svids.first().and_then(|s| leaf_serial(&s.x509_svid)) {
                            Some(serial) => say(format!("ROTATION {now} {serial}")),
                            None => say(format!("ERROR {now} no-svid")),
                        }
                    }
                    Ok::<(), String>(())
                };
                let outcome = held.await;
                say(format!(
                    "ERROR {} stream-ended {}",
                    unix_micros(SystemTime::now()),
                    outcome.err().unwrap_or_default()
                ));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let fetching = {
        let socket = socket.to_path_buf();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_millis(500));
            loop {
                ticker.tick().await;
                let t = Instant::now();
                let fetched = tokio::time::timeout(Duration::from_secs(10), async {
                    let mut client = SpiffeWorkloadApiClient::new(
                        uds_channel(&socket).await.map_err(|e| e.to_string())?,
                    );
                    let mut answers = client
                        .fetch_x509svid(x509_request())
                        .await
                        .map_err(|s| format!("{:?}", s.code()))?
                        .into_inner();
                    match answers.message().await {
                        Ok(Some(a)) if !a.svids.is_empty() => Ok(()),
                        Ok(_) => Err("no-svid".to_string()),
                        Err(s) => Err(format!("{:?}", s.code())),
                    }
                })
                .await;
                let now = unix_micros(SystemTime::now());
                match fetched {
                    Ok(Ok(())) => say(format!("FETCH {now} {}", t.elapsed().as_micros())),
                    Ok(Err(e)) => say(format!("ERROR {now} fetch {e}")),
                    Err(_) => say(format!("ERROR {now} fetch timeout-10s")),
                }
            }
        })
    };
    let _ = stop.await;
    stream.abort();
    fetching.abort();
}

/// What a hostile pod's attacks did, by name.
#[derive(Default)]
struct Counts(Mutex<BTreeMap<&'static str, u64>>);

impl Counts {
    fn add(&self, what: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(what)
            .or_default() += 1;
    }
}

/// Pause before an attack opens again what the agent closed.
const REOPEN_PAUSE: Duration = Duration::from_millis(50);

/// A hostile pod: every attack at once, each connection reopened when the
/// agent closes it, until stdin closes; then `COUNTS {json}`.
async fn hostile_pod(socket: &Path, attacks: &[Attack], stop: tokio::sync::oneshot::Receiver<()>) {
    let count = |attack: Attack, n: usize| if attacks.contains(&attack) { n } else { 0 };
    let counts = Arc::new(Counts::default());
    let mut tasks = tokio::task::JoinSet::new();
    let authority = socket
        .display()
        .to_string()
        .trim_start_matches('/')
        .replace('/', "%2F");
    for _ in 0..count(Attack::Parked, PARKED_CONNECTIONS) {
        let (socket, counts, authority) = (socket.to_path_buf(), counts.clone(), authority.clone());
        tasks.spawn(async move {
            loop {
                parked_block(&socket, &authority, &counts).await;
                tokio::time::sleep(REOPEN_PAUSE).await;
            }
        });
    }
    for _ in 0..count(Attack::NeverRead, NEVER_READ_CONNECTIONS) {
        let (socket, counts, authority) = (socket.to_path_buf(), counts.clone(), authority.clone());
        tasks.spawn(async move {
            loop {
                never_read(&socket, &authority, &counts).await;
                tokio::time::sleep(REOPEN_PAUSE).await;
            }
        });
    }
    for _ in 0..count(Attack::SdsStorm, SDS_CONNECTIONS) {
        let (socket, counts) = (socket.to_path_buf(), counts.clone());
        tasks.spawn(async move {
            loop {
                sds_storm(&socket, &counts).await;
                tokio::time::sleep(REOPEN_PAUSE).await;
            }
        });
    }
    for _ in 0..count(Attack::Split, SPLIT_CONNECTIONS) {
        let (socket, counts, authority) = (socket.to_path_buf(), counts.clone(), authority.clone());
        tasks.spawn(async move {
            loop {
                split_message(&socket, &authority, &counts).await;
                tokio::time::sleep(REOPEN_PAUSE).await;
            }
        });
    }
    let _ = stop.await;
    tasks.abort_all();
    let counts = std::mem::take(&mut *counts.0.lock().unwrap_or_else(|e| e.into_inner()));
    say(format!("COUNTS {}", json!(counts)));
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

/// A frame as read: type, flags, stream, payload.
async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    Ok((head[3], head[4], stream, payload))
}

mod frame {
    pub(super) const DATA: u8 = 0x0;
    pub(super) const HEADERS: u8 = 0x1;
    pub(super) const SETTINGS: u8 = 0x4;
    pub(super) const PING: u8 = 0x6;
    pub(super) const WINDOW_UPDATE: u8 = 0x8;
    pub(super) const CONTINUATION: u8 = 0x9;
    pub(super) const RST_STREAM: u8 = 0x3;
    pub(super) const GOAWAY: u8 = 0x7;
    pub(super) const END_STREAM: u8 = 0x1;
    pub(super) const ACK: u8 = 0x1;
    pub(super) const END_HEADERS: u8 = 0x4;
}

/// The client preface and a SETTINGS frame offering a 2 GiB stream window.
fn preface_big_window() -> Vec<u8> {
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    // SETTINGS_INITIAL_WINDOW_SIZE (4) = 2^31 - 1.
    out.extend(encode_frame(
        frame::SETTINGS,
        0,
        0,
        &[0, 4, 0x7f, 0xff, 0xff, 0xff],
    ));
    out
}

/// An HPACK block of a gRPC request (literals, no Huffman, no table).
fn request_block(path: &str, authority: &str) -> Vec<u8> {
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    let mut literal = |name: &[u8], value: &[u8]| {
        block.push(0x00);
        block.push(name.len() as u8);
        block.extend_from_slice(name);
        block.push(value.len() as u8);
        block.extend_from_slice(value);
    };
    literal(b":path", path.as_bytes());
    literal(b":authority", authority.as_bytes());
    literal(b"content-type", b"application/grpc");
    literal(b"te", b"trailers");
    literal(meshca_proto::WORKLOAD_API_HEADER.as_bytes(), b"true");
    block
}

/// Parked header blocks: HEADERS and three 16 KiB CONTINUATIONs, never
/// END_HEADERS; held until the agent closes the connection.
async fn parked_block(socket: &Path, authority: &str, counts: &Counts) {
    let Ok(mut c) = UnixStream::connect(socket).await else {
        counts.add("connect_failed");
        return;
    };
    let mut block = vec![0x00, 10];
    block.extend_from_slice(b":authority");
    block.push(authority.len() as u8);
    block.extend_from_slice(authority.as_bytes());
    let mut bytes = preface_big_window();
    bytes.extend(encode_frame(frame::HEADERS, 0, 1, &block));
    for _ in 0..3 {
        bytes.extend(encode_frame(frame::CONTINUATION, 0, 1, &[0x40; 16 * 1024]));
    }
    counts.add("parked_blocks_sent");
    if c.write_all(&bytes).await.is_err() {
        counts.add("parked_refused_while_sending");
        return;
    }
    // Read (and drop) whatever the agent sends, until it closes.
    let mut buf = vec![0u8; 16 * 1024];
    while let Ok(n) = c.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
    counts.add("parked_closed_by_agent");
}

/// Never-read streams: `FetchX509SVID` streams opened, the socket never read.
async fn never_read(socket: &Path, authority: &str, counts: &Counts) {
    let Ok(mut c) = UnixStream::connect(socket).await else {
        counts.add("connect_failed");
        return;
    };
    let mut bytes = preface_big_window();
    let block = request_block("/SpiffeWorkloadAPI/FetchX509SVID", authority);
    for i in 0..NEVER_READ_STREAMS {
        let stream = 1 + 2 * i;
        bytes.extend(encode_frame(
            frame::HEADERS,
            frame::END_HEADERS,
            stream,
            &block,
        ));
        bytes.extend(encode_frame(
            frame::DATA,
            frame::END_STREAM,
            stream,
            &[0; 5],
        ));
    }
    if c.write_all(&bytes).await.is_err() {
        counts.add("never_read_refused");
        return;
    }
    counts.add("never_read_streams_opened");
    // Never read; know when the agent closes (a write fails), checking
    // every second with a PING the agent answers into the unread socket.
    let ping = encode_frame(frame::PING, 0, 0, &[0; 8]);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        match tokio::time::timeout(Duration::from_secs(1), c.write_all(&ping)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => break,
            // The agent stopped reading from us: still open, still held.
            Err(_) => {}
        }
    }
    counts.add("never_read_closed_by_agent");
}

fn sds_request(nonce: &str, nack: bool) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: "1".into(),
        resource_names: vec!["default".into(), "ROOTCA".into()],
        type_url: SECRET_TYPE.into(),
        response_nonce: nonce.into(),
        error_detail: nack.then(|| RpcStatus {
            code: tonic::Code::InvalidArgument as i32,
            message: "NACK".into(),
            details: Vec::new(),
        }),
        ..Default::default()
    }
}

/// SDS storms: on one connection, `SDS_STREAMS` `StreamSecrets` streams
/// sending bad nonces and NACKs of every answer as fast as they go.
async fn sds_storm(socket: &Path, counts: &Arc<Counts>) {
    let Ok(channel) = uds_channel(socket).await else {
        counts.add("connect_failed");
        return;
    };
    let mut streams = tokio::task::JoinSet::new();
    for s in 0..SDS_STREAMS {
        let (channel, counts) = (channel.clone(), counts.clone());
        streams.spawn(async move {
            let mut client = SecretDiscoveryServiceClient::new(channel);
            let (tx, mut rx) = tokio::sync::mpsc::channel::<DiscoveryRequest>(8);
            let outgoing = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
            let _ = tx.send(sds_request("", false)).await;
            let Ok(answers) = client.stream_secrets(outgoing).await else {
                counts.add("sds_refused");
                return;
            };
            counts.add("sds_streams_opened");
            let mut answers = answers.into_inner();
            let last_nonce = Arc::new(Mutex::new(String::new()));
            let sender = {
                let (tx, last_nonce, counts) = (tx.clone(), last_nonce.clone(), counts.clone());
                tokio::spawn(async move {
                    let mut n = 0u64;
                    loop {
                        n += 1;
                        // Alternately a bad nonce and a NACK of the last answer.
                        let request = if n.is_multiple_of(2) {
                            sds_request(&format!("bad-{s}-{n}"), false)
                        } else {
                            let nonce =
                                last_nonce.lock().unwrap_or_else(|e| e.into_inner()).clone();
                            sds_request(&nonce, true)
                        };
                        if tx.send(request).await.is_err() {
                            return;
                        }
                        counts.add("sds_requests_sent");
                    }
                })
            };
            loop {
                match answers.message().await {
                    Ok(Some(answer)) => {
                        counts.add("sds_answers");
                        *last_nonce.lock().unwrap_or_else(|e| e.into_inner()) = answer.nonce;
                    }
                    Ok(None) => {
                        counts.add("sds_streams_ended_by_agent");
                        break;
                    }
                    Err(_) => {
                        counts.add("sds_streams_failed");
                        break;
                    }
                }
            }
            sender.abort();
        });
    }
    while streams.join_next().await.is_some() {}
}

/// A `StreamSecrets` request of 200,000 bytes declared, sent 16 bytes a
/// DATA frame within the windows the agent grants, never finished; the
/// connection reopened when the agent ends it.
async fn split_message(socket: &Path, authority: &str, counts: &Arc<Counts>) {
    let Ok(c) = UnixStream::connect(socket).await else {
        counts.add("connect_failed");
        return;
    };
    let (mut reader, mut writer) = c.into_split();
    let mut head = preface_big_window();
    head.extend(encode_frame(
        frame::HEADERS,
        frame::END_HEADERS,
        1,
        &request_block(
            "/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets",
            authority,
        ),
    ));
    if writer.write_all(&head).await.is_err() {
        counts.add("split_refused");
        return;
    }
    counts.add("split_streams_opened");
    // Send credit: the smaller of the connection's and the stream's
    // windows (65,535 each at first, as HTTP/2 starts).
    let connection_window = Arc::new(AtomicI64::new(65_535));
    let stream_window = Arc::new(AtomicI64::new(65_535));
    let granted = Arc::new(tokio::sync::Notify::new());
    let closed = Arc::new(AtomicBool::new(false));
    let (pong_tx, mut pong_rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    let reading = {
        let (cw, sw, granted, closed, counts) = (
            connection_window.clone(),
            stream_window.clone(),
            granted.clone(),
            closed.clone(),
            counts.clone(),
        );
        tokio::spawn(async move {
            loop {
                match read_frame(&mut reader).await {
                    Ok((frame::WINDOW_UPDATE, _, stream, p)) if p.len() == 4 => {
                        let inc =
                            i64::from(u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff);
                        if stream == 0 {
                            cw.fetch_add(inc, Ordering::Relaxed);
                        } else {
                            sw.fetch_add(inc, Ordering::Relaxed);
                        }
                        granted.notify_one();
                    }
                    Ok((frame::SETTINGS, flags, _, _)) if flags & frame::ACK == 0 => {
                        let _ = pong_tx.send(encode_frame(frame::SETTINGS, frame::ACK, 0, &[]));
                    }
                    Ok((frame::PING, flags, _, p)) if flags & frame::ACK == 0 => {
                        let _ = pong_tx.send(encode_frame(frame::PING, frame::ACK, 0, &p));
                    }
                    Ok((frame::RST_STREAM | frame::GOAWAY, ..)) => {
                        counts.add("split_ended_by_agent");
                        break;
                    }
                    Ok((frame::HEADERS, flags, ..)) if flags & frame::END_STREAM != 0 => {
                        counts.add("split_ended_by_agent");
                        break;
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            closed.store(true, Ordering::Relaxed);
            granted.notify_one();
        })
    };
    let mut first = vec![0u8];
    first.extend_from_slice(&200_000u32.to_be_bytes());
    first.extend_from_slice(&[0; 11]);
    let piece = [0x0a_u8; 16];
    let mut sent_first = false;
    // Never the whole message: at most 16 frames short of its end.
    let mut unsent: i64 = 200_000 - 16 * 16;
    while !closed.load(Ordering::Relaxed) {
        while let Ok(control) = pong_rx.try_recv() {
            if writer.write_all(&control).await.is_err() {
                closed.store(true, Ordering::Relaxed);
            }
        }
        let credit = connection_window
            .load(Ordering::Relaxed)
            .min(stream_window.load(Ordering::Relaxed));
        if credit < 16 || unsent < 16 {
            // Wait for a window update (or answer the agent's pings).
            tokio::select! {
                _ = granted.notified() => {}
                Some(control) = pong_rx.recv() => {
                    if writer.write_all(&control).await.is_err() { break; }
                }
            }
            continue;
        }
        // A batch of up to 64 frames of 16 bytes in one write.
        let frames = (credit.min(unsent) / 16).min(64) as usize;
        unsent -= 16 * frames as i64;
        let mut batch = Vec::with_capacity(frames * 25);
        for _ in 0..frames {
            let payload: &[u8] = if sent_first { &piece } else { &first };
            sent_first = true;
            batch.extend(encode_frame(frame::DATA, 0, 1, payload));
        }
        connection_window.fetch_sub(16 * frames as i64, Ordering::Relaxed);
        stream_window.fetch_sub(16 * frames as i64, Ordering::Relaxed);
        if writer.write_all(&batch).await.is_err() {
            break;
        }
        counts
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry("split_data_frames_sent")
            .and_modify(|n| *n += frames as u64)
            .or_insert(frames as u64);
    }
    reading.abort();
}
