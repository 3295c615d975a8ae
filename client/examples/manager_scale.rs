//! Measures a `CertManager` holding many identities against a fast
//! in-process fake CA: time to fetch them all at start, peak RSS, CPU.
//!
//! ```sh
//! cargo run --release -p meshca-client --example manager_scale -- 10000
//! ```
//!
//! The fake CA does what the real path does minus the network: the client
//! side generates a P-256 key and CSR and verifies the answer
//! (`check_answer`: leaf key, SVID rules, path to the root); the fake CA
//! verifies the CSR and signs an SVID.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use meshca_certs::profile::{self_signed_root, SigningCa, SubjectName, Validity};
use meshca_certs::{build_csr, KeyAlgorithm, PrivateKey, SpiffeId, TrustBundle, VerifiedCsr};
use meshca_client::caclient::check_answer;
use meshca_client::{CertManager, CertState, CertificateIssuer, ClientError, ManagerConfig, Svid};
use time::OffsetDateTime;

struct InProcessCa {
    ca: SigningCa,
    bundle: TrustBundle,
    root_pem: String,
}

#[async_trait]
impl CertificateIssuer for InProcessCa {
    async fn fetch(&self, identity: &SpiffeId) -> Result<Svid, ClientError> {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256)
            .map_err(|e| ClientError::Csr(e.to_string()))?;
        let csr = build_csr(&key, identity).map_err(|e| ClientError::Csr(e.to_string()))?;
        // The fake CA.
        let verified =
            VerifiedCsr::from_pem(&csr).map_err(|e| ClientError::BadAnswer(e.to_string()))?;
        let validity = Validity::backdated(OffsetDateTime::now_utc(), time::Duration::hours(24));
        let cert = self
            .ca
            .issue_workload(verified.subject_key(), identity, validity)
            .map_err(|e| ClientError::BadAnswer(e.to_string()))?;
        let chain = vec![cert.to_pem(), self.root_pem.clone()];
        // Back on the client side.
        let checked = check_answer(&key, identity, &chain, &self.bundle, SystemTime::now())?;
        Ok(Svid {
            key,
            chain_pem: chain,
            bundle: checked.roots,
            leaf: checked.leaf,
        })
    }
}

fn proc_status(field: &str) -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_else(|| "n/a".into())
}

fn cpu_seconds() -> f64 {
    // utime and stime are fields 14 and 15 of /proc/self/stat, in clock ticks (100/s).
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let after = s.rsplit_once(')')?.1;
            let fields: Vec<&str> = after.split_whitespace().collect();
            let utime: f64 = fields.get(11)?.parse().ok()?;
            let stime: f64 = fields.get(12)?.parse().ok()?;
            Some((utime + stime) / 100.0)
        })
        .unwrap_or(0.0)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(10_000);
    let in_flight: usize = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(8);
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256)?;
    let root = self_signed_root(
        &key,
        &SubjectName {
            common_name: Some("scale".into()),
            ..Default::default()
        },
        Validity::backdated(OffsetDateTime::now_utc(), time::Duration::days(365)),
    )?;
    let root_pem = root.to_pem();
    let bundle = TrustBundle::new(vec![root.der.clone()]);
    let issuer = Arc::new(InProcessCa {
        ca: SigningCa::new(root.der, key)?,
        bundle,
        root_pem,
    });
    println!("rss before: {}", proc_status("VmRSS:"));
    let cpu0 = cpu_seconds();
    let started = Instant::now();
    let manager = CertManager::new(
        issuer,
        ManagerConfig {
            max_in_flight: in_flight,
            ..Default::default()
        },
    );
    let mut receivers = Vec::with_capacity(n);
    for i in 0..n {
        let id = SpiffeId::parse(&format!(
            "spiffe://cluster.local/ns/ns-{}/sa/sa-{i}",
            i % 100
        ))?;
        receivers.push(manager.add(id));
    }
    for rx in &mut receivers {
        loop {
            if matches!(&*rx.borrow(), CertState::Available(_)) {
                break;
            }
            rx.changed().await?;
        }
    }
    let elapsed = started.elapsed();
    let cpu = cpu_seconds() - cpu0;
    println!(
        "identities={n} max_in_flight={in_flight} all_fetched_in={:.2}s rate={:.0}/s cpu={:.2}s rss_now={} rss_peak={}",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64(),
        cpu,
        proc_status("VmRSS:"),
        proc_status("VmHWM:")
    );
    // Idle CPU while holding them (no renewals are due for 12 h).
    let cpu1 = cpu_seconds();
    tokio::time::sleep(Duration::from_secs(5)).await;
    println!("idle cpu over 5 s: {:.3}s", cpu_seconds() - cpu1);
    Ok(())
}
