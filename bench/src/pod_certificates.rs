//! The pod-certificate scenario: N `PodCertificateRequest`s pending (as
//! after a mass restart of pods with a `podCertificate` volume) when meshca
//! starts with `--pod-certificate-signer`. meshca runs as its real binary
//! against the fake Kubernetes API server of the end-to-end tests (real
//! HTTPS, real JSON, kube-apiserver's validation of every status) answering
//! with a configurable latency. Reported: time from meshca's start and from
//! its leadership until every request is answered, and the API calls
//! meshca made per certificate, by resource and verb.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use meshca_certs::{parse_duration, KeyAlgorithm, PrivateKey};
use meshca_tests::fake_certificates::{KeyEncoding, PodRequest};
use meshca_tests::fake_kube::FakeKube;

use crate::proc_stats;

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
    /// Latency of every Kubernetes API answer.
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub(crate) api_latency: Duration,
    /// Extra flags for `meshca serve`.
    #[arg(long = "meshca-arg", allow_hyphen_values = true)]
    pub(crate) meshca_args: Vec<String>,
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
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
    let meshca = match &args.meshca {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("locating meshca")?
            .join("meshca"),
    };
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

    let grpc = free_addr()?;
    let monitoring = free_addr()?;
    let log_path = dir.path().join("meshca.log");
    let started = Instant::now();
    let child = Command::new(&meshca)
        .arg("serve")
        .args(["--listen", &grpc.to_string()])
        .args(["--monitoring-listen", &monitoring.to_string()])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--kubeconfig")
        .arg(&kube.kubeconfig)
        .args(["--pod-certificate-signer", SIGNER])
        .args(&args.meshca_args)
        .env("MESHCA_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()
        .with_context(|| format!("starting {}", meshca.display()))?;
    let child = KillOnDrop(child);
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
