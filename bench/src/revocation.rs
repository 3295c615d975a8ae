//! The revocation scenario: meshca (its real binary) running, then N
//! serials revoked at once in its data directory's `revocations.yaml`.
//! Reported: the CRL's size, how long meshca took to take the list and to
//! sign the CRL (from its log), and when the new CRL was visible where
//! clients read it: `ca-crl.pem` in the data directory and, with
//! `--kube-apiserver` (a real kube-apiserver, see `real_kube`), the
//! `istio-ca-crl` ConfigMap in the namespace `default`.
//!
//! The list is written to the file in both cases: 10,000 entries of the
//! operator's format (about 95 bytes each) come close to a ConfigMap's
//! 1 MiB, and where the list comes from does not change what is signed
//! and published.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use meshca_certs::crl::ParsedCrl;
use time::OffsetDateTime;

use crate::proc_stats;
use crate::real_kube::RealKube;
use crate::server_process::{self, free_addr, KillOnDrop};

/// How long each step may take before the scenario gives up.
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// Flags of `meshca-bench revocation`.
#[derive(Debug, Clone, Args)]
pub(crate) struct RevocationArgs {
    /// The meshca binary (default: `meshca` next to this program).
    #[arg(long)]
    pub(crate) meshca: Option<PathBuf>,
    /// Serials revoked at once.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) entries: usize,
    /// Also time the `istio-ca-crl` ConfigMap, against a real
    /// kube-apiserver (the tests' control plane, built by
    /// tests/controlplane/build.sh), meshca as its own ServiceAccount.
    #[arg(long)]
    pub(crate) kube_apiserver: bool,
    /// Extra flags for `meshca serve`.
    #[arg(long = "meshca-arg", allow_hyphen_values = true)]
    pub(crate) meshca_args: Vec<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `n` serials as meshca makes them (17 random bytes, the first below
/// 0x80), as the operator's list: one entry per line.
fn revocation_list(n: usize) -> anyhow::Result<String> {
    use ring::rand::SecureRandom;
    let rng = ring::rand::SystemRandom::new();
    let now = meshca_certs::Rfc3339(OffsetDateTime::now_utc().replace_nanosecond(0)?);
    let mut text = String::from("revocations:\n");
    for _ in 0..n {
        let mut serial = [0u8; 17];
        rng.fill(&mut serial)
            .map_err(|_| anyhow::anyhow!("no randomness"))?;
        serial[0] = (serial[0] & 0x7f) | 0x01;
        let hex: String = serial.iter().map(|b| format!("{b:02x}")).collect();
        text.push_str(&format!(
            "- {{\"serial\": \"{hex}\", \"reason\": \"keyCompromise\", \"revoked_at\": \"{now}\"}}\n"
        ));
    }
    Ok(text)
}

/// Polls `check` every `every` until it gives a value, at most
/// [`STEP_TIMEOUT`].
async fn poll<T, F, Fut>(what: &str, every: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        anyhow::ensure!(
            started.elapsed() < STEP_TIMEOUT,
            "{what}: not within {STEP_TIMEOUT:?}"
        );
        tokio::time::sleep(every).await;
    }
}

/// The CRL in `path` when it lists `n` serials (parsed only when its size
/// changed since `last_len`).
fn crl_with(path: &Path, n: usize, last_len: &mut u64) -> Option<ParsedCrl> {
    let len = std::fs::metadata(path).ok()?.len();
    if len == *last_len {
        return None;
    }
    let crl = ParsedCrl::from_pem(&std::fs::read_to_string(path).ok()?).ok()?;
    *last_len = len;
    (crl.revoked.len() == n).then_some(crl)
}

/// The first line of meshca's log at or after `since` (its RFC 3339
/// timestamp) that contains `needle`, and that timestamp.
fn log_line(log: &str, since: OffsetDateTime, needle: &str) -> Option<(OffsetDateTime, String)> {
    log.lines().find_map(|line| {
        let stamp = line.split_whitespace().next()?;
        let at =
            OffsetDateTime::parse(stamp, &time::format_description::well_known::Rfc3339).ok()?;
        (at >= since && line.contains(needle)).then(|| (at, line.to_string()))
    })
}

/// The value of `field=` in a log line.
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
}

fn millis(d: time::Duration) -> f64 {
    d.as_seconds_f64() * 1e3
}

/// Runs the scenario.
pub(crate) async fn run(args: RevocationArgs) -> anyhow::Result<bool> {
    let meshca = server_process::meshca_path(args.meshca.as_ref())?;
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let kube = if args.kube_apiserver {
        Some(RealKube::start().await?)
    } else {
        None
    };
    let mut flags: Vec<String> = Vec::new();
    if let Some(kube) = &kube {
        let (kubeconfig, more) = kube.meshca_kubeconfig().await;
        flags.push("--kubeconfig".into());
        flags.push(kubeconfig.display().to_string());
        flags.extend(more);
    }
    flags.extend(args.meshca_args.iter().cloned());
    let log_path = dir.path().join("meshca.log");
    let child = Command::new(&meshca)
        .arg("serve")
        .args(["--listen", &free_addr()?.to_string()])
        .args(["--monitoring-listen", &free_addr()?.to_string()])
        .arg("--data-dir")
        .arg(&data)
        .args(&flags)
        .env("MESHCA_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()
        .with_context(|| format!("starting {}", meshca.display()))?;
    let child = KillOnDrop(child);
    let crl_path = data.join(meshca_certs::crl::CRL_FILE);
    let mut last_len = 0;
    poll("the empty CRL at start", Duration::from_millis(50), || {
        std::future::ready(crl_with(&crl_path, 0, &mut last_len))
    })
    .await?;
    let configmaps: Option<Api<ConfigMap>> = kube
        .as_ref()
        .map(|k| Api::namespaced(k.admin.clone(), "default"));
    let published = |api: Api<ConfigMap>, n: usize| async move {
        let cm = api
            .get_opt(meshca_certs::crl::CRL_CONFIGMAP_NAME)
            .await
            .ok()??;
        let pem = cm.data?.remove(meshca_certs::crl::CRL_CONFIGMAP_KEY)?;
        let crl = ParsedCrl::from_pem(&pem).ok()?;
        (crl.revoked.len() == n).then_some(pem.len())
    };
    if let Some(api) = &configmaps {
        poll(
            "the empty istio-ca-crl in default",
            Duration::from_millis(100),
            || published(api.clone(), 0),
        )
        .await?;
    }

    eprintln!("meshca-bench: revoking {} serials at once…", args.entries);
    let list = revocation_list(args.entries)?;
    let cpu_before = proc_stats::read(child.0.id()).map(|s| s.cpu_seconds);
    let since = OffsetDateTime::now_utc();
    let started = Instant::now();
    meshca_certs::bundle::write_file_atomic(
        &data.join(meshca_certs::revocation::REVOCATIONS_FILE),
        list.as_bytes(),
        0o644,
    )?;
    let mut last_len = 0;
    let crl = poll(
        "ca-crl.pem with every serial",
        Duration::from_millis(5),
        || std::future::ready(crl_with(&crl_path, args.entries, &mut last_len)),
    )
    .await?;
    let file_after = started.elapsed();
    let configmap = match &configmaps {
        Some(api) => Some((
            poll(
                "istio-ca-crl with every serial",
                Duration::from_millis(20),
                || published(api.clone(), args.entries),
            )
            .await?,
            started.elapsed(),
        )),
        None => None,
    };
    let stats = proc_stats::read(child.0.id());
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let taken = log_line(&log, since, "revocation list taken");
    let signed = log_line(&log, since, &format!("serials={}", args.entries));
    let pem_len = std::fs::metadata(&crl_path)?.len();

    let list_ms = taken.as_ref().map(|(at, _)| millis(*at - since));
    let sign_ms = signed
        .as_ref()
        .and_then(|(_, line)| field(line, "took_ms")?.parse::<f64>().ok());
    let signed_ms = signed.as_ref().map(|(at, _)| millis(*at - since));
    let report = serde_json::json!({
        "entries": args.entries,
        "list_bytes": list.len(),
        "crl": {"der_bytes": crl.der.len(), "pem_bytes": pem_len},
        "list_taken_after_ms": list_ms,
        "crl_signing_ms": sign_ms,
        "crl_signed_after_ms": signed_ms,
        "file_published_after_ms": file_after.as_secs_f64() * 1e3,
        "configmap": configmap.map(|(bytes, after)| serde_json::json!({
            "published_after_ms": after.as_secs_f64() * 1e3,
            "bytes": bytes,
        })),
        "meshca_cpu_seconds": match (cpu_before, &stats) {
            (Some(before), Some(after)) => Some(after.cpu_seconds - before),
            _ => None,
        },
        "meshca_peak_rss_mib": stats.map(|s| s.peak_rss_bytes as f64 / (1024.0 * 1024.0)),
        "kube_apiserver": kube.as_ref().map(|k| k.version.clone()),
    });
    if args.json {
        println!("{report}");
        return Ok(true);
    }
    let ms = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v:.0} ms"));
    println!("revocation: {} serials revoked at once", args.entries);
    println!(
        "  CRL: {} bytes DER, {} bytes PEM (the list: {} bytes)",
        crl.der.len(),
        pem_len,
        list.len()
    );
    println!(
        "  meshca took the list after {}, signed the CRL in {} ({} after the write)",
        ms(list_ms),
        ms(sign_ms),
        ms(signed_ms)
    );
    println!(
        "  ca-crl.pem with every serial {:.0} ms after the write",
        file_after.as_secs_f64() * 1e3
    );
    if let Some((bytes, after)) = configmap {
        println!(
            "  istio-ca-crl (default) with every serial {:.0} ms after the write ({bytes} bytes)",
            after.as_secs_f64() * 1e3
        );
    }
    Ok(true)
}
