//! A real Kubernetes control plane for the `--kube-apiserver` variants of
//! the scenarios: the end-to-end tests' etcd and kube-apiserver
//! (`meshca_tests::control_plane`, built by `tests/controlplane/build.sh`),
//! with the RBAC and Node authorizers, NodeRestriction, API Priority and
//! Fairness and service-account tokens signed by its own key. meshca runs
//! as its own ServiceAccount bound only to `deploy/kustomize/base/rbac.yaml`.
//!
//! What the fake cannot tell, read from kube-apiserver itself: its
//! `/metrics` before and after the measured part (`apiserver_request_total`
//! by verb, resource and code; the server-side latency of each kind of
//! call; API Priority and Fairness waits and rejections) and its CPU time
//! (and etcd's) from `/proc/<pid>/stat`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{Api, ObjectMeta, PostParams};
use meshca_tests::control_plane::{self, ControlPlane, MESHCA_NAMESPACE};
use serde_json::json;

use crate::proc_stats;

/// The audience of the workloads' tokens.
pub(crate) const AUDIENCE: &str = "istio-ca";
/// Set-up calls in flight at once (service accounts, pods, tokens,
/// requests): enough to keep both cores busy, few enough not to queue in
/// the API server.
pub(crate) const SETUP_CONCURRENCY: usize = 32;
/// How long the API server is watched idle, before the measured part, for
/// its own background CPU (controllers, its identity Lease, meshca idle).
pub(crate) const IDLE_BASELINE: Duration = Duration::from_secs(3);

/// A running control plane and its administrator's client.
pub(crate) struct RealKube {
    /// etcd and kube-apiserver (stopped when dropped).
    pub(crate) plane: ControlPlane,
    /// The administrator (`system:masters`, exempt from API Priority and
    /// Fairness): one client, one connection pool, for all the set-up.
    pub(crate) admin: kube::Client,
    /// kube-apiserver's version (`gitVersion`).
    pub(crate) version: String,
    etcd_pid: Option<u32>,
}

impl RealKube {
    /// Starts etcd and kube-apiserver, or says how to build them.
    pub(crate) async fn start() -> anyhow::Result<Self> {
        anyhow::ensure!(
            control_plane::available(),
            "--kube-apiserver needs the tests' control plane: run tests/controlplane/build.sh (or set MESHCA_GO_TOOLS)"
        );
        let started = Instant::now();
        let plane = ControlPlane::start()
            .await
            .context("starting the control plane")?;
        let admin = plane.admin().await;
        let version = admin
            .apiserver_version()
            .await
            .map(|v| v.git_version)
            .unwrap_or_default();
        let etcd_pid = child_named("etcd");
        eprintln!(
            "meshca-bench: kube-apiserver {version} ready at {} after {:.1} s",
            plane.addr,
            started.elapsed().as_secs_f64()
        );
        Ok(Self {
            plane,
            admin,
            version,
            etcd_pid,
        })
    }

    /// meshca's kubeconfig (its own ServiceAccount and RBAC) and the flags
    /// that go with it, `--kubeconfig` aside.
    pub(crate) async fn meshca_kubeconfig(&self) -> (PathBuf, Vec<String>) {
        let kubeconfig = self.plane.meshca_kubeconfig().await;
        (
            kubeconfig,
            vec!["--namespace".into(), MESHCA_NAMESPACE.into()],
        )
    }

    /// Creates the namespace if absent.
    pub(crate) async fn namespace(&self, name: &str) -> anyhow::Result<()> {
        let api: Api<Namespace> = Api::all(self.admin.clone());
        let namespace = Namespace {
            metadata: meta(name, None),
            ..Default::default()
        };
        create_if_absent(&api, &namespace).await.map(drop)
    }

    /// Creates the Node object if absent; its UID.
    pub(crate) async fn node(&self, name: &str) -> anyhow::Result<String> {
        let api: Api<Node> = Api::all(self.admin.clone());
        let node = Node {
            metadata: meta(name, None),
            ..Default::default()
        };
        create_if_absent(&api, &node).await?;
        uid(&api.get(name).await?.metadata)
    }

    /// Creates the service accounts of `namespace` (bounded concurrency);
    /// their UIDs, in order.
    pub(crate) async fn service_accounts(
        &self,
        namespace: &str,
        names: &[String],
    ) -> anyhow::Result<Vec<String>> {
        let api: Api<ServiceAccount> = Api::namespaced(self.admin.clone(), namespace);
        let progress = Progress::new("service accounts", names.len());
        bounded(names.len(), |i| {
            let (api, progress) = (api.clone(), &progress);
            async move {
                let account = ServiceAccount {
                    metadata: meta(&names[i], Some(namespace)),
                    ..Default::default()
                };
                let created = with_retries(|| create_if_absent(&api, &account)).await?;
                progress.one();
                match created {
                    Some(account) => uid(&account.metadata),
                    None => uid(&api.get(&names[i]).await?.metadata),
                }
            }
        })
        .await
    }

    /// Creates pods `(name, service account)` of `namespace` bound to
    /// `node` (no scheduler runs; no status: pending, as after a restart);
    /// their UIDs, in order.
    pub(crate) async fn pods(
        &self,
        namespace: &str,
        pods: &[(String, String)],
        node: &str,
    ) -> anyhow::Result<Vec<String>> {
        let api: Api<Pod> = Api::namespaced(self.admin.clone(), namespace);
        let progress = Progress::new("pods", pods.len());
        bounded(pods.len(), |i| {
            let (api, progress) = (api.clone(), &progress);
            async move {
                let (name, account) = &pods[i];
                let pod = control_plane::pod_on_node(namespace, name, account, node);
                let created = with_retries(|| async {
                    api.create(&PostParams::default(), &pod)
                        .await
                        .with_context(|| format!("creating pod {namespace}/{name}"))
                })
                .await?;
                progress.one();
                uid(&created.metadata)
            }
        })
        .await
    }

    /// A token from the TokenRequest API for each `(service account, pod
    /// (name, UID) to bind it to)` of `namespace`, audience
    /// [`AUDIENCE`], living an hour (bounded concurrency).
    pub(crate) async fn tokens(
        &self,
        namespace: &str,
        accounts: &[(String, Option<(String, String)>)],
    ) -> anyhow::Result<Vec<String>> {
        let api: Api<ServiceAccount> = Api::namespaced(self.admin.clone(), namespace);
        let progress = Progress::new("tokens (TokenRequest)", accounts.len());
        bounded(accounts.len(), |i| {
            let (api, progress) = (api.clone(), &progress);
            async move {
                let (account, pod) = &accounts[i];
                let request = TokenRequest {
                    spec: Some(TokenRequestSpec {
                        audiences: Some(vec![AUDIENCE.into()]),
                        expiration_seconds: Some(3600),
                        bound_object_ref: pod.as_ref().map(|(name, uid)| BoundObjectReference {
                            api_version: Some("v1".into()),
                            kind: Some("Pod".into()),
                            name: Some(name.clone()),
                            uid: Some(uid.clone()),
                        }),
                    }),
                    ..Default::default()
                };
                let answer: TokenRequest = with_retries(|| async {
                    api.create_subresource("token", account, &PostParams::default(), &request)
                        .await
                        .with_context(|| format!("a token for {namespace}/{account}"))
                })
                .await?;
                progress.one();
                answer
                    .status
                    .and_then(|s| s.token)
                    .filter(|t| !t.is_empty())
                    .context("TokenRequest answered without a token")
            }
        })
        .await
    }

    /// kube-apiserver's metrics and CPU time, and etcd's CPU time, now.
    pub(crate) async fn snapshot(&self) -> anyhow::Result<Snapshot> {
        let request = http::Request::get("/metrics").body(Vec::new())?;
        let text = self
            .admin
            .request_text(request)
            .await
            .context("reading kube-apiserver's /metrics")?;
        let pid = self.plane.apiserver_pid().context("kube-apiserver runs")?;
        Ok(Snapshot {
            at: Instant::now(),
            samples: parse_metrics(&text, KEPT_METRICS),
            apiserver: proc_stats::read(pid).unwrap_or_default(),
            etcd_cpu_seconds: self
                .etcd_pid
                .and_then(proc_stats::read)
                .map(|s| s.cpu_seconds),
        })
    }
}

/// The metrics of kube-apiserver kept in a [`Snapshot`].
const KEPT_METRICS: &[&str] = &[
    "apiserver_request_total",
    "apiserver_request_duration_seconds_sum",
    "apiserver_request_duration_seconds_count",
    "apiserver_request_duration_seconds_bucket",
    "apiserver_flowcontrol_request_wait_duration_seconds_sum",
    "apiserver_flowcontrol_request_wait_duration_seconds_count",
    "apiserver_flowcontrol_rejected_requests_total",
    "apiserver_longrunning_requests",
];

/// kube-apiserver at one instant.
pub(crate) struct Snapshot {
    at: Instant,
    samples: BTreeMap<Sample, f64>,
    apiserver: proc_stats::ProcStats,
    etcd_cpu_seconds: Option<f64>,
}

/// A metric's name and labels.
type Sample = (String, BTreeMap<String, String>);

/// What kube-apiserver did between two snapshots.
pub(crate) struct Delta {
    /// Requests by `VERB resource[/subresource] code`, every client's
    /// (a watch is counted when it ends: see `watches_opened`).
    pub(crate) calls: BTreeMap<String, u64>,
    /// Watches (long-running requests) open at the end and not at the
    /// start, by `VERB resource`.
    pub(crate) watches_opened: BTreeMap<String, u64>,
    samples: BTreeMap<Sample, f64>,
    /// kube-apiserver's CPU seconds.
    pub(crate) cpu_seconds: f64,
    /// etcd's CPU seconds.
    pub(crate) etcd_cpu_seconds: Option<f64>,
    /// kube-apiserver's peak RSS so far, bytes.
    pub(crate) peak_rss_bytes: u64,
    /// Wall-clock time between the snapshots.
    pub(crate) elapsed: Duration,
}

impl Snapshot {
    /// What happened from `self` until `after`.
    pub(crate) fn until(&self, after: &Snapshot) -> Delta {
        let mut samples = BTreeMap::new();
        for (key, value) in &after.samples {
            let d = value - self.samples.get(key).copied().unwrap_or(0.0);
            if d > 0.0 {
                samples.insert(key.clone(), d);
            }
        }
        let (mut calls, mut watches_opened) = (BTreeMap::new(), BTreeMap::new());
        for ((name, labels), value) in &samples {
            let label = |k: &str| labels.get(k).map(String::as_str).unwrap_or("");
            match name.as_str() {
                "apiserver_request_total" => {
                    *calls.entry(call_name(labels, label("code"))).or_default() += *value as u64
                }
                "apiserver_longrunning_requests" => {
                    *watches_opened.entry(call_name(labels, "")).or_default() += *value as u64
                }
                _ => {}
            }
        }
        Delta {
            calls,
            watches_opened,
            samples,
            cpu_seconds: after.apiserver.cpu_seconds - self.apiserver.cpu_seconds,
            etcd_cpu_seconds: after
                .etcd_cpu_seconds
                .zip(self.etcd_cpu_seconds)
                .map(|(a, b)| a - b),
            peak_rss_bytes: after.apiserver.peak_rss_bytes,
            elapsed: after.at - self.at,
        }
    }
}

/// `VERB resource[/subresource] [code]`, or `VERB (non-resource URL)`.
fn call_name(labels: &BTreeMap<String, String>, code: &str) -> String {
    let label = |k: &str| labels.get(k).map(String::as_str).unwrap_or("");
    let what = match (label("resource"), label("subresource")) {
        ("", _) => "(non-resource URL)".to_string(),
        (r, "") => r.to_string(),
        (r, s) => format!("{r}/{s}"),
    };
    let mut name = format!("{} {what}", label("verb"));
    if !code.is_empty() {
        name = format!("{name} {code}");
    }
    name
}

impl Delta {
    /// Calls on resources (the non-resource URLs left out: the bench's own
    /// `/metrics` reads; meshca reads none during a storm).
    pub(crate) fn resource_calls(&self) -> u64 {
        self.calls
            .iter()
            .filter(|(k, _)| !k.contains("(non-resource URL)"))
            .map(|(_, v)| v)
            .sum()
    }

    /// Requests of `verb` on `resource` (`resource/subresource`), any code.
    pub(crate) fn count(&self, verb: &str, resource: &str) -> u64 {
        let prefix = format!("{verb} {resource} ");
        self.calls
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .map(|(_, v)| v)
            .sum()
    }

    /// The server-side latency of every kind of call: mean, and the upper
    /// bounds of the buckets holding p50 and p99, in ms.
    pub(crate) fn latencies(&self) -> BTreeMap<String, serde_json::Value> {
        let mut out = BTreeMap::new();
        // Per kind of call: sum, count, and (le, cumulative count) buckets.
        let mut kinds: BTreeMap<String, Histogram> = BTreeMap::new();
        for ((name, labels), value) in &self.samples {
            let Some(field) = name.strip_prefix("apiserver_request_duration_seconds_") else {
                continue;
            };
            let entry = kinds.entry(call_name(labels, "")).or_default();
            match field {
                "sum" => entry.0 += value,
                "count" => entry.1 += value,
                "bucket" => {
                    let le = labels
                        .get("le")
                        .and_then(|le| le.parse::<f64>().ok())
                        .unwrap_or(f64::INFINITY);
                    match entry.2.iter_mut().find(|(b, _)| *b == le) {
                        Some(b) => b.1 += value,
                        None => entry.2.push((le, *value)),
                    }
                }
                _ => {}
            }
        }
        for (kind, (sum, count, mut buckets)) in kinds {
            if kind.contains("(non-resource URL)") || kind.starts_with("WATCH ") || count < 1.0 {
                continue;
            }
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            let bound = |q: f64| {
                buckets
                    .iter()
                    .find(|(_, cumulative)| *cumulative >= q * count)
                    .map(|(le, _)| {
                        if le.is_finite() {
                            json!(le * 1000.0)
                        } else {
                            json!("+Inf")
                        }
                    })
                    .unwrap_or(json!(null))
            };
            out.insert(
                kind,
                json!({
                    "count": count as u64,
                    "mean_ms": round(sum / count * 1000.0),
                    "p50_at_most_ms": bound(0.5),
                    "p99_at_most_ms": bound(0.99),
                }),
            );
        }
        out
    }

    /// API Priority and Fairness: requests rejected and the mean wait in
    /// its queues, by priority level (those that saw any).
    pub(crate) fn flow_control(&self) -> serde_json::Value {
        let mut levels: BTreeMap<String, (f64, f64, f64)> = BTreeMap::new();
        for ((name, labels), value) in &self.samples {
            let level = labels.get("priority_level").cloned().unwrap_or_default();
            match name.as_str() {
                "apiserver_flowcontrol_request_wait_duration_seconds_sum" => {
                    levels.entry(level).or_default().0 += value
                }
                "apiserver_flowcontrol_request_wait_duration_seconds_count" => {
                    levels.entry(level).or_default().1 += value
                }
                "apiserver_flowcontrol_rejected_requests_total" => {
                    levels.entry(level).or_default().2 += value
                }
                _ => {}
            }
        }
        let levels: BTreeMap<String, serde_json::Value> = levels
            .into_iter()
            .map(|(level, (sum, count, rejected))| {
                (
                    level,
                    json!({
                        "requests": count as u64,
                        "mean_wait_ms": if count > 0.0 { round(sum / count * 1000.0) } else { 0.0 },
                        "rejected": rejected as u64,
                    }),
                )
            })
            .collect();
        json!(levels)
    }

    /// The report of kube-apiserver's side, `units` being the identities or
    /// requests the run was about; `idle` the API server's background CPU
    /// rate (CPU seconds per second) before the run.
    pub(crate) fn report(&self, units: usize, idle: f64, version: &str) -> serde_json::Value {
        let units_f = units.max(1) as f64;
        let net = (self.cpu_seconds - idle * self.elapsed.as_secs_f64()).max(0.0);
        json!({
            "version": version,
            "measured_seconds": round(self.elapsed.as_secs_f64()),
            "calls": self.calls,
            "watches_opened": self.watches_opened,
            "resource_calls": self.resource_calls(),
            "resource_calls_per_unit": round(self.resource_calls() as f64 / units_f),
            "latency_by_call": self.latencies(),
            "flow_control": self.flow_control(),
            "cpu_seconds": round(self.cpu_seconds),
            "cpu_ms_per_unit": round(self.cpu_seconds * 1000.0 / units_f),
            "idle_cpu_ms_per_second": round(idle * 1000.0),
            "cpu_ms_per_unit_net_of_idle": round(net * 1000.0 / units_f),
            "etcd_cpu_seconds": self.etcd_cpu_seconds.map(round),
            "peak_rss_mib": round(self.peak_rss_bytes as f64 / 1048576.0),
        })
    }
}

/// A latency histogram's sum, count and `(le, cumulative count)` buckets.
type Histogram = (f64, f64, Vec<(f64, f64)>);

/// Three decimals.
fn round(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// kube-apiserver's background CPU rate (CPU seconds per second), watched
/// for [`IDLE_BASELINE`].
pub(crate) async fn idle_rate(kube: &RealKube) -> anyhow::Result<f64> {
    let before = kube.snapshot().await?;
    tokio::time::sleep(IDLE_BASELINE).await;
    let after = kube.snapshot().await?;
    let d = before.until(&after);
    Ok(d.cpu_seconds / d.elapsed.as_secs_f64().max(1e-9))
}

/// The samples of the metrics named in `names` of a Prometheus text page.
pub(crate) fn parse_metrics(text: &str, names: &[&str]) -> BTreeMap<Sample, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        if !names.contains(&name) {
            continue;
        }
        let rest = &line[name_end..];
        let (labels, value) = match rest.strip_prefix('{') {
            Some(inner) => match parse_labels(inner) {
                Some((labels, after)) => (labels, after),
                None => continue,
            },
            None => (BTreeMap::new(), rest),
        };
        let Some(value) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        *out.entry((name.to_string(), labels)).or_default() += value;
    }
    out
}

/// `k="v",…}` → the labels and what follows the `}`.
fn parse_labels(mut s: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start_matches(',');
        if let Some(after) = s.strip_prefix('}') {
            return Some((labels, after));
        }
        let (key, rest) = s.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.to_string(), value);
        s = &rest[end + 1..];
    }
}

/// The pid of a child of this process named `name` (etcd: the control
/// plane does not tell it).
fn child_named(name: &str) -> Option<u32> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let (head, tail) = stat.rsplit_once(')')?;
            let comm = head.split_once('(')?.1;
            let ppid: u32 = tail.split_whitespace().nth(1)?.parse().ok()?;
            (comm == name && ppid == me).then_some(pid)
        })
}

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: namespace.map(str::to_string),
        ..Default::default()
    }
}

fn uid(meta: &ObjectMeta) -> anyhow::Result<String> {
    meta.uid.clone().context("an object without a UID")
}

/// Creates `object`; `None` if it existed.
async fn create_if_absent<K>(api: &Api<K>, object: &K) -> anyhow::Result<Option<K>>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), object).await {
        Ok(created) => Ok(Some(created)),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
        Err(e) => Err(e).with_context(|| format!("creating {:?}", object.meta().name)),
    }
}

/// Whether a set-up call's error is worth another try: the API server
/// busy or not ready, or (the Node authorizer's graph catching up with a
/// new pod) forbidden for now.
pub(crate) fn transient(e: &anyhow::Error) -> bool {
    e.chain()
        .any(|cause| match cause.downcast_ref::<kube::Error>() {
            Some(kube::Error::Api(s)) => matches!(s.code, 403 | 429 | 500 | 503 | 504),
            Some(kube::Error::HyperError(_) | kube::Error::Service(_)) => true,
            _ => false,
        })
}

/// `call` until it succeeds, a non-transient error, or 60 s of tries.
pub(crate) async fn with_retries<T, F, Fut>(mut call: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) if transient(&e) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// `f(0)`, …, `f(n - 1)`, [`SETUP_CONCURRENCY`] at a time; the results in
/// order, or the first error.
pub(crate) async fn bounded<T, F, Fut>(n: usize, f: F) -> anyhow::Result<Vec<T>>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    futures::stream::iter(0..n)
        .map(f)
        .buffered(SETUP_CONCURRENCY)
        .try_collect()
        .await
}

/// A line on stderr every tenth of a set-up step.
pub(crate) struct Progress {
    what: &'static str,
    total: usize,
    done: std::sync::atomic::AtomicUsize,
    started: Instant,
}

impl Progress {
    pub(crate) fn new(what: &'static str, total: usize) -> Self {
        Self {
            what,
            total,
            done: Default::default(),
            started: Instant::now(),
        }
    }

    pub(crate) fn one(&self) {
        let done = self.done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let step = (self.total / 10).max(1);
        if done.is_multiple_of(step) || done == self.total {
            eprintln!(
                "meshca-bench: {} {done}/{} ({:.1} s)",
                self.what,
                self.total,
                self.started.elapsed().as_secs_f64()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_subtracts_the_api_servers_metrics() {
        let page = |n: u64, sum: f64| {
            format!(
                "# HELP apiserver_request_total x\n\
                 apiserver_request_total{{code=\"201\",group=\"authentication.k8s.io\",resource=\"tokenreviews\",subresource=\"\",verb=\"POST\"}} {n}\n\
                 apiserver_request_total{{code=\"200\",resource=\"\",subresource=\"\",verb=\"GET\"}} 7\n\
                 apiserver_request_duration_seconds_bucket{{resource=\"tokenreviews\",subresource=\"\",verb=\"POST\",le=\"0.005\"}} {}\n\
                 apiserver_request_duration_seconds_bucket{{resource=\"tokenreviews\",subresource=\"\",verb=\"POST\",le=\"0.025\"}} {n}\n\
                 apiserver_request_duration_seconds_bucket{{resource=\"tokenreviews\",subresource=\"\",verb=\"POST\",le=\"+Inf\"}} {n}\n\
                 apiserver_request_duration_seconds_sum{{resource=\"tokenreviews\",subresource=\"\",verb=\"POST\"}} {sum}\n\
                 apiserver_request_duration_seconds_count{{resource=\"tokenreviews\",subresource=\"\",verb=\"POST\"}} {n}\n\
                 other_metric{{a=\"b\\\"c\"}} 1\n",
                n / 2
            )
        };
        let snapshot = |text: &str| Snapshot {
            at: Instant::now(),
            samples: parse_metrics(text, KEPT_METRICS),
            apiserver: Default::default(),
            etcd_cpu_seconds: None,
        };
        let before = snapshot(&page(10, 0.1));
        let after = snapshot(&page(110, 0.6));
        let d = before.until(&after);
        assert_eq!(d.calls.get("POST tokenreviews 201"), Some(&100));
        assert_eq!(d.count("POST", "tokenreviews"), 100);
        assert_eq!(d.resource_calls(), 100);
        let latency = &d.latencies()["POST tokenreviews"];
        assert_eq!(latency["count"], 100);
        assert_eq!(latency["mean_ms"], 5.0);
        assert_eq!(latency["p50_at_most_ms"], 5.0);
        assert_eq!(latency["p99_at_most_ms"], 25.0);
        let (labels, rest) = parse_labels("a=\"b\\\"c\",d=\"\"} 1").unwrap();
        assert_eq!(labels["a"], "b\"c");
        assert_eq!(labels["d"], "");
        assert_eq!(rest, " 1");
    }
}
