//! The pod-certificate scenario: N `PodCertificateRequest`s pending (as
//! after a mass restart of pods with a `podCertificate` volume) when meshca
//! starts with `--pod-certificate-signer`. meshca runs as its real binary
//! against the fake Kubernetes API server of the end-to-end tests (real
//! HTTPS, real JSON, kube-apiserver's validation of every status) answering
//! with a configurable latency. Reported: time from meshca's start and from
//! its leadership until every request is answered, and the API calls
//! meshca made per certificate, by resource and verb.
//!
//! With `--kube-apiserver` the API is a real kube-apiserver (see
//! `real_kube`): the pods are real (bound to a node, their service
//! account real), each request is created by the node's kubelet
//! credentials with the real UIDs (so NodeRestriction admits it), all
//! pending before meshca starts as its own ServiceAccount. The calls are
//! then kube-apiserver's own count, and its CPU time is reported too.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use meshca_certs::{parse_duration, KeyAlgorithm, PrivateKey};
use meshca_tests::fake_certificates::{KeyEncoding, PodRequest};
use meshca_tests::fake_kube::FakeKube;

use crate::proc_stats;
use crate::real_kube::{self, RealKube};
use crate::server_process::{self, free_addr, KillOnDrop};

const SIGNER: &str = "meshca.io/spiffe";
const NODE: &str = "node-a";

/// Flags of `meshca-bench pod-certificates`.
#[derive(Debug, Clone, Args)]
pub(crate) struct PodCertificatesArgs {
    /// The meshca binary (default: `meshca` next to this program).
    #[arg(long)]
    pub(crate) meshca: Option<PathBuf>,
    /// Pending requests (one pod each).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) requests: usize,
    /// Latency of every Kubernetes API answer (of the fake).
    #[arg(long, default_value = "5ms", value_parser = parse_duration, conflicts_with = "kube_apiserver")]
    pub(crate) api_latency: Duration,
    /// Against a real kube-apiserver (the tests' control plane, built by
    /// tests/controlplane/build.sh) instead of the fake: real pods, requests
    /// created as the node, meshca as its own ServiceAccount.
    #[arg(long)]
    pub(crate) kube_apiserver: bool,
    /// Extra flags for `meshca serve`.
    #[arg(long = "meshca-arg", allow_hyphen_values = true)]
    pub(crate) meshca_args: Vec<String>,
}

/// meshca with `--kubeconfig KUBECONFIG`, `--pod-certificate-signer` and
/// `flags`, its data and log in `dir`: the process, its monitoring address
/// and its log's path.
fn spawn_meshca(
    meshca: &Path,
    dir: &Path,
    kubeconfig: &Path,
    flags: &[String],
) -> anyhow::Result<(KillOnDrop, SocketAddr, PathBuf)> {
    let grpc = free_addr()?;
    let monitoring = free_addr()?;
    let log_path = dir.join("meshca.log");
    let child = Command::new(meshca)
        .arg("serve")
        .args(["--listen", &grpc.to_string()])
        .args(["--monitoring-listen", &monitoring.to_string()])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["--pod-certificate-signer", SIGNER])
        .args(flags)
        .env("MESHCA_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()
        .with_context(|| format!("starting {}", meshca.display()))?;
    Ok((KillOnDrop(child), monitoring, log_path))
}

fn answered(kube: &FakeKube) -> (usize, usize) {
    let all = kube.list_objects("podcertificaterequests");
    let issued = all
        .iter()
        .filter(|r| {
            r["status"]["conditions"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["type"] == "Issued"))
        })
        .count();
    let answered = all
        .iter()
        .filter(|r| {
            r["status"]["conditions"]
                .as_array()
                .is_some_and(|c| !c.is_empty())
        })
        .count();
    (answered, issued)
}

/// Runs the scenario. `Ok(false)` when a request was not issued.
pub(crate) async fn run(args: PodCertificatesArgs) -> anyhow::Result<bool> {
    let meshca = server_process::meshca_path(args.meshca.as_ref())?;
    if args.kube_apiserver {
        return run_real(&args, &meshca).await;
    }
    let dir = tempfile::tempdir()?;
    let kube = FakeKube::start(dir.path()).await;

    eprintln!(
        "meshca-bench: creating {} pending PodCertificateRequests…",
        args.requests
    );
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256)?;
    let template = PodRequest {
        namespace: "default",
        name: "template",
        signer: SIGNER,
        pod: ("pod", "uid", "web", NODE),
        max_expiration_seconds: None,
    }
    .to_json(&key, KeyEncoding::StubCsr);
    for i in 0..args.requests {
        let (name, pod, uid) = (format!("pcr-{i}"), format!("pod-{i}"), format!("uid-{i}"));
        kube.add_pod("default", &pod, &uid, "web", NODE);
        let mut object = template.clone();
        object["metadata"]["name"] = serde_json::json!(name);
        object["spec"]["podName"] = serde_json::json!(pod);
        object["spec"]["podUID"] = serde_json::json!(uid);
        kube.create_object("podcertificaterequests", object)
            .map_err(|e| anyhow::anyhow!("creating {name}: {e}"))?;
    }
    kube.set_latency(args.api_latency);

    let started = Instant::now();
    let (child, _, log_path) =
        spawn_meshca(&meshca, dir.path(), &kube.kubeconfig, &args.meshca_args)?;
    let pid = child.0.id();

    let mut leader_at = None;
    let deadline = started + Duration::from_secs(600);
    loop {
        if leader_at.is_none() && kube.calls("podcertificaterequests", "list") > 0 {
            leader_at = Some(started.elapsed());
        }
        // Counting writes is cheap; reading every object back is not, and
        // this process shares the machine with meshca.
        let written = kube.calls("podcertificaterequests/status", "update");
        let done = if written >= args.requests {
            answered(&kube).0
        } else {
            0
        };
        if done == args.requests {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {done} of {} answered after 600 s: {}",
            args.requests,
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let total = started.elapsed();
    let stats = proc_stats::read(pid);
    let (_, issued) = answered(&kube);
    let listed_at = leader_at.unwrap_or_default();
    let signing = total.saturating_sub(listed_at);

    println!(
        "pod certificates: {} pending requests, API latency {:?}",
        args.requests, args.api_latency
    );
    println!("  answered: {} issued of {}", issued, args.requests);
    println!(
        "  time from meshca's start: {:.2} s (listing requested after {:.2} s)",
        total.as_secs_f64(),
        listed_at.as_secs_f64()
    );
    println!(
        "  from the listing to the last answer: {:.2} s = {:.0} certificates/s",
        signing.as_secs_f64(),
        args.requests as f64 / signing.as_secs_f64().max(1e-9)
    );
    if let Some(stats) = stats {
        println!(
            "  meshca: {:.2} CPU seconds, peak RSS {:.1} MiB",
            stats.cpu_seconds,
            stats.peak_rss_bytes as f64 / (1024.0 * 1024.0)
        );
    }
    let mut by_call: BTreeMap<String, usize> = BTreeMap::new();
    for ((plural, verb), count) in kube.call_counts() {
        by_call.insert(format!("{verb} {plural}"), count);
    }
    let total_calls: usize = by_call.values().sum();
    println!(
        "  Kubernetes API calls by meshca: {total_calls} = {:.3} per certificate",
        total_calls as f64 / args.requests as f64
    );
    for (call, count) in &by_call {
        println!(
            "    {call}: {count} ({:.3} per certificate)",
            *count as f64 / args.requests as f64
        );
    }
    drop(child);
    Ok(issued == args.requests)
}

/// What meshca's `/metrics` says: leader, and requests answered (Issued,
/// Denied or Failed) and issued.
fn meshca_progress(monitoring: SocketAddr) -> Option<(bool, u64, u64)> {
    let (code, body) =
        server_process::http_get(monitoring, "/metrics", Duration::from_secs(2)).ok()?;
    if code != 200 {
        return None;
    }
    let samples = real_kube::parse_metrics(
        &body,
        &["meshca_leader", "meshca_pod_certificate_request_count"],
    );
    let (mut leader, mut answered, mut issued) = (false, 0, 0);
    for ((name, labels), value) in samples {
        if name == "meshca_leader" {
            leader = value >= 1.0;
            continue;
        }
        match labels.get("result").map(String::as_str) {
            Some("Issued") => {
                issued += value as u64;
                answered += value as u64;
            }
            Some("Denied" | "Failed") => answered += value as u64,
            _ => {}
        }
    }
    Some((leader, answered, issued))
}

/// The scenario against a real kube-apiserver (`--kube-apiserver`).
async fn run_real(args: &PodCertificatesArgs, meshca: &Path) -> anyhow::Result<bool> {
    use k8s_openapi::api::certificates::v1beta1::PodCertificateRequest;
    use kube::api::{Api, ListParams, PostParams};

    let real = RealKube::start().await?;
    let (ns, n) = ("default", args.requests);
    let setup = Instant::now();
    eprintln!(
        "meshca-bench: creating {n} pods and their pending PodCertificateRequests (as the kubelet of {NODE}, {} calls in flight)…",
        real_kube::SETUP_CONCURRENCY
    );
    let node_uid = real.node(NODE).await?;
    let account_uid = real
        .service_accounts(ns, &["web".to_string()])
        .await?
        .remove(0);
    let pods: Vec<(String, String)> = (0..n).map(|i| (format!("pod-{i}"), "web".into())).collect();
    let pod_uids = real.pods(ns, &pods, NODE).await?;
    // One key for all, as the fake variant: the API checks the stub CSR's
    // signature, meshca checks it again; neither ties it to the pod.
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256)?;
    let mut template = PodRequest {
        namespace: ns,
        name: "template",
        signer: SIGNER,
        pod: ("pod", "uid", "web", NODE),
        max_expiration_seconds: None,
    }
    .to_json(&key, KeyEncoding::StubCsr);
    template["spec"]["serviceAccountUID"] = serde_json::json!(account_uid);
    template["spec"]["nodeUID"] = serde_json::json!(node_uid);
    let kubelet: Api<PodCertificateRequest> = Api::namespaced(real.plane.node(NODE).await, ns);
    let progress = real_kube::Progress::new("PodCertificateRequests", n);
    real_kube::bounded(n, |i| {
        let (kubelet, progress) = (kubelet.clone(), &progress);
        let mut object = template.clone();
        object["metadata"]["name"] = serde_json::json!(format!("pcr-{i}"));
        object["spec"]["podName"] = serde_json::json!(pods[i].0);
        object["spec"]["podUID"] = serde_json::json!(pod_uids[i]);
        async move {
            let request: PodCertificateRequest = serde_json::from_value(object)?;
            // The Node authorizer's graph learns of a new pod from a
            // watch: a 403 for a pod just created is tried again.
            real_kube::with_retries(|| async {
                kubelet
                    .create(&PostParams::default(), &request)
                    .await
                    .with_context(|| format!("the kubelet of {NODE} creating pcr-{i}"))
            })
            .await?;
            progress.one();
            Ok(())
        }
    })
    .await?;
    let setup_seconds = setup.elapsed().as_secs_f64();
    let (kubeconfig, mut flags) = real.meshca_kubeconfig().await;
    flags.extend(args.meshca_args.iter().cloned());
    // The API server's own background, before meshca starts.
    let idle = real_kube::idle_rate(&real).await?;
    eprintln!("meshca-bench: set-up took {setup_seconds:.1} s; starting meshca…");

    let dir = tempfile::tempdir()?;
    let before = real.snapshot().await?;
    let started = Instant::now();
    let (child, monitoring, log_path) = spawn_meshca(meshca, dir.path(), &kubeconfig, &flags)?;
    let pid = child.0.id();
    let (mut leader_at, mut first_at) = (None, None);
    let deadline = started + Duration::from_secs(600);
    loop {
        let progress = tokio::task::spawn_blocking(move || meshca_progress(monitoring)).await?;
        let (leader, answered, _) = progress.unwrap_or_default();
        if leader && leader_at.is_none() {
            leader_at = Some(started.elapsed());
        }
        if answered > 0 && first_at.is_none() {
            first_at = Some(started.elapsed());
        }
        if answered >= n as u64 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {answered} of {n} answered after 600 s: {}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let total = started.elapsed();
    let after = real.snapshot().await?;
    let stats = proc_stats::read(pid);
    let delta = before.until(&after);
    // What the API holds, read once, after the clock stopped.
    let all = Api::<PodCertificateRequest>::namespaced(real.admin.clone(), ns)
        .list(&ListParams::default())
        .await?;
    let condition = |r: &PodCertificateRequest, t: &str| {
        r.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| t.is_empty() || c.type_ == t))
    };
    let issued = all.items.iter().filter(|r| condition(r, "Issued")).count();
    let answered = all.items.iter().filter(|r| condition(r, "")).count();
    let listed_at = leader_at.unwrap_or_default();
    let signing = total.saturating_sub(listed_at);

    println!(
        "pod certificates: {n} pending requests, real kube-apiserver {}",
        real.version
    );
    println!("  answered: {issued} issued of {n} ({answered} answered)");
    println!(
        "  time from meshca's start: {:.2} s (leader after {:.2} s, first answer after {:.2} s)",
        total.as_secs_f64(),
        listed_at.as_secs_f64(),
        first_at.unwrap_or_default().as_secs_f64()
    );
    println!(
        "  from the leadership to the last answer: {:.2} s = {:.0} certificates/s",
        signing.as_secs_f64(),
        n as f64 / signing.as_secs_f64().max(1e-9)
    );
    if let Some(stats) = stats {
        println!(
            "  meshca: {:.2} CPU seconds, peak RSS {:.1} MiB",
            stats.cpu_seconds,
            stats.peak_rss_bytes as f64 / (1024.0 * 1024.0)
        );
    }
    let report = delta.report(n, idle, &real.version);
    println!(
        "  kube-apiserver: {:.2} CPU seconds = {:.2} ms per certificate ({:.2} ms net of its idle {:.1} ms/s), peak RSS {:.0} MiB; etcd {:.2} CPU seconds",
        delta.cpu_seconds,
        report["cpu_ms_per_unit"].as_f64().unwrap_or_default(),
        report["cpu_ms_per_unit_net_of_idle"].as_f64().unwrap_or_default(),
        idle * 1000.0,
        delta.peak_rss_bytes as f64 / 1048576.0,
        delta.etcd_cpu_seconds.unwrap_or_default()
    );
    let total_calls = delta.resource_calls();
    println!(
        "  Kubernetes API calls (kube-apiserver's count, every client, from meshca's start): {total_calls} = {:.3} per certificate",
        total_calls as f64 / n as f64
    );
    for (call, count) in &delta.calls {
        println!(
            "    {call}: {count} ({:.3} per certificate)",
            *count as f64 / n as f64
        );
    }
    if !delta.watches_opened.is_empty() {
        println!(
            "  watches opened (not in the calls above, which count a watch when it ends): {}",
            delta
                .watches_opened
                .iter()
                .map(|(k, v)| format!("{k}: {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    println!("  server-side latency (kube-apiserver's apiserver_request_duration_seconds):");
    for (call, latency) in delta.latencies() {
        println!(
            "    {call}: {} calls, mean {} ms, p50 ≤ {} ms, p99 ≤ {} ms",
            latency["count"],
            latency["mean_ms"],
            latency["p50_at_most_ms"],
            latency["p99_at_most_ms"]
        );
    }
    println!("  API Priority and Fairness: {}", delta.flow_control());
    drop(child);
    Ok(issued == n)
}
