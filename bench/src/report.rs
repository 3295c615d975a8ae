//! Latency recording and the report (human or JSON).

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde_json::json;

use crate::baseline::Baseline;
use crate::proc_stats::ProcStats;

/// Latencies in microseconds, 1 µs to 60 s, 3 significant digits.
pub(crate) fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3)
        .unwrap_or_else(|_| Histogram::new(3).unwrap_or_else(|_| unreachable_histogram()))
}

fn unreachable_histogram() -> Histogram<u64> {
    // new(3) only fails for sigfig > 5.
    Histogram::new(2).unwrap_or_else(|_| panic!("hdrhistogram refuses 2 significant digits"))
}

/// What one run measured.
#[derive(Debug)]
pub(crate) struct RunReport {
    /// What was measured (target, key, concurrency…).
    pub(crate) setup: BTreeMap<&'static str, serde_json::Value>,
    /// Successful requests in the measured window.
    pub(crate) ok: u64,
    /// Failed requests by status (gRPC code name or HTTP status).
    pub(crate) errors: BTreeMap<String, u64>,
    /// The measured window.
    pub(crate) elapsed: Duration,
    /// Latencies of successful requests (µs).
    pub(crate) latency: Histogram<u64>,
    /// Server CPU and memory over the window.
    pub(crate) server: Option<(ProcStats, ProcStats)>,
    /// The load generator's own CPU and memory over the window.
    pub(crate) generator: Option<(ProcStats, ProcStats)>,
    /// Share of the machine's CPU time the hypervisor gave to others.
    pub(crate) steal_percent: Option<f64>,
    /// The crypto limit, if measured.
    pub(crate) baseline: Option<Baseline>,
}

/// The server's, the load generator's and the machine's CPU at one edge
/// of a measured window.
pub(crate) struct WindowEdge {
    server: Option<ProcStats>,
    generator: Option<ProcStats>,
    machine: Option<crate::proc_stats::MachineCpu>,
}

impl WindowEdge {
    /// Read now (`server_pid`: the server's process, if known).
    pub(crate) fn read(server_pid: Option<u32>) -> Self {
        Self {
            server: server_pid.and_then(crate::proc_stats::read),
            generator: crate::proc_stats::read(std::process::id()),
            machine: crate::proc_stats::read_machine(),
        }
    }
}

impl RunReport {
    /// The report of a window from `before` to `after` in which `driven`
    /// was measured.
    pub(crate) fn of_window(
        setup: BTreeMap<&'static str, serde_json::Value>,
        driven: crate::load::Driven,
        before: WindowEdge,
        after: WindowEdge,
        baseline: Option<Baseline>,
    ) -> Self {
        Self {
            setup,
            ok: driven.ok,
            errors: driven.errors,
            elapsed: driven.elapsed,
            latency: driven.latency,
            server: before.server.zip(after.server),
            generator: before.generator.zip(after.generator),
            steal_percent: before
                .machine
                .zip(after.machine)
                .map(|(before, after)| crate::proc_stats::steal_percent(before, after)),
            baseline,
        }
    }

    /// Prints the report (JSON or text); whether the run was clean (no
    /// error, at least one success).
    pub(crate) fn print(&self, json: bool) -> bool {
        if json {
            println!("{}", self.to_json());
        } else {
            print!("{}", self.to_text());
        }
        self.errors.is_empty() && self.ok > 0
    }

    /// Requests per second.
    pub(crate) fn throughput(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn ms(&self, quantile: f64) -> f64 {
        self.latency.value_at_quantile(quantile) as f64 / 1000.0
    }

    /// The report as JSON.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        let mut out = json!({
            "setup": self.setup,
            "ok": self.ok,
            "errors": self.errors,
            "elapsed_seconds": self.elapsed.as_secs_f64(),
            "throughput_per_second": self.throughput(),
            "latency_ms": {
                "p50": self.ms(0.50), "p90": self.ms(0.90), "p99": self.ms(0.99),
                "max": self.latency.max() as f64 / 1000.0,
                "mean": self.latency.mean() / 1000.0,
            },
        });
        if let Some((before, after)) = self.server {
            let cpu = after.cpu_seconds - before.cpu_seconds;
            out["server"] = json!({
                "cpu_seconds": cpu,
                "cores_used": cpu / self.elapsed.as_secs_f64().max(1e-9),
                "peak_rss_mib": after.peak_rss_bytes as f64 / 1048576.0,
                "rss_mib": after.rss_bytes as f64 / 1048576.0,
                "certs_per_cpu_second": if cpu > 0.0 { self.ok as f64 / cpu } else { 0.0 },
            });
        }
        if let Some(steal) = self.steal_percent {
            out["machine"] = json!({ "cpu_steal_percent": steal });
        }
        if let Some((before, after)) = self.generator {
            let cpu = after.cpu_seconds - before.cpu_seconds;
            out["generator"] = json!({
                "cpu_seconds": cpu,
                "cores_used": cpu / self.elapsed.as_secs_f64().max(1e-9),
                "cpu_microseconds_per_request": if self.ok > 0 { cpu * 1e6 / self.ok as f64 } else { 0.0 },
            });
        }
        if let Some(every) = self.token_repeat_interval() {
            out["token_repeats_every_seconds"] = json!(every);
        }
        if let Some(b) = &self.baseline {
            out["crypto_baseline"] = b.to_json();
            if let Some((before, after)) = self.server {
                let cpu = after.cpu_seconds - before.cpu_seconds;
                if cpu > 0.0 && b.limit_per_core > 0.0 {
                    out["ratio_to_crypto_limit_per_server_cpu_second"] =
                        json!((self.ok as f64 / cpu) / b.limit_per_core);
                }
                if let Some(limit) = b
                    .limit_without_token_per_core
                    .filter(|l| *l > 0.0 && cpu > 0.0)
                {
                    out["ratio_to_crypto_limit_without_token_check"] =
                        json!((self.ok as f64 / cpu) / limit);
                }
            }
        }
        out
    }

    /// The report for people.
    pub(crate) fn to_text(&self) -> String {
        let j = self.to_json();
        let mut s = String::new();
        let setup: Vec<String> = self.setup.iter().map(|(k, v)| format!("{k}={v}")).collect();
        s += &format!("setup: {}\n", setup.join(" "));
        s += &format!(
            "requests: {} ok in {:.2} s = {:.0}/s; errors: {}\n",
            self.ok,
            self.elapsed.as_secs_f64(),
            self.throughput(),
            if self.errors.is_empty() {
                "none".to_string()
            } else {
                format!("{:?}", self.errors)
            }
        );
        s += &format!(
            "latency ms: p50 {:.2}  p90 {:.2}  p99 {:.2}  max {:.2}  (p99/p50 {:.2})\n",
            self.ms(0.5),
            self.ms(0.9),
            self.ms(0.99),
            self.latency.max() as f64 / 1000.0,
            self.ms(0.99) / self.ms(0.5).max(1e-9)
        );
        if let Some(server) = j.get("server") {
            s += &format!(
                "server: {:.2} CPU s ({:.2} cores), {:.0} certs per CPU-second, peak RSS {:.1} MiB\n",
                server["cpu_seconds"].as_f64().unwrap_or(0.0),
                server["cores_used"].as_f64().unwrap_or(0.0),
                server["certs_per_cpu_second"].as_f64().unwrap_or(0.0),
                server["peak_rss_mib"].as_f64().unwrap_or(0.0),
            );
        }
        if let Some(steal) = self.steal_percent {
            s += &format!(
                "machine: {steal:.1}% of CPU time stolen by the hypervisor during the run{}\n",
                if steal >= 5.0 {
                    " (high: latency and throughput say more about the host than about the code)"
                } else {
                    ""
                }
            );
        }
        if let Some(generator) = j.get("generator") {
            s += &format!(
                "load generator: {:.2} CPU s ({:.2} cores, {:.0} µs per request)\n",
                generator["cpu_seconds"].as_f64().unwrap_or(0.0),
                generator["cores_used"].as_f64().unwrap_or(0.0),
                generator["cpu_microseconds_per_request"]
                    .as_f64()
                    .unwrap_or(0.0),
            );
        }
        if let Some(b) = &self.baseline {
            s += &b.to_text();
        }
        if let Some(r) = j
            .get("ratio_to_crypto_limit_per_server_cpu_second")
            .and_then(|v| v.as_f64())
        {
            s += &format!(
                "server throughput per CPU-second = {:.0}% of the crypto limit\n",
                r * 100.0
            );
        }
        if let (Some(every), Some(b)) = (self.token_repeat_interval(), &self.baseline) {
            if let (Some(limit), Some(r)) = (
                b.limit_without_token_per_core,
                j.get("ratio_to_crypto_limit_without_token_check")
                    .and_then(|v| v.as_f64()),
            ) {
                s += &format!(
                    "note: each identity's token came again every {every:.2} s; a CA that reuses a verified token \
                     (meshca: --jwt-cache-ttl, 10 s by default) skips the token check the limit above counts, so \
                     compare with the limit without it: {limit:.0} certs/s on one core, of which this is {:.0}%. \
                     For one token check per request start meshca with MESHCA_JWT_CACHE_TTL=0.\n",
                    r * 100.0
                );
            }
        }
        s
    }

    /// Seconds between two uses of one identity's token (identities are
    /// asked in turn), when the run sent tokens.
    fn token_repeat_interval(&self) -> Option<f64> {
        let auth = self.setup.get("auth")?.as_str()?;
        if auth == "none" || self.ok == 0 {
            return None;
        }
        let identities = self.setup.get("identities")?.as_f64()?;
        Some(identities / self.throughput())
    }
}
