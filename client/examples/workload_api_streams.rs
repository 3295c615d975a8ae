//! Holds many `FetchX509SVID` streams open on a running agent's socket and
//! measures what they cost and how fast a rotation reaches all of them.
//!
//! ```sh
//! meshca-agent ... --ttl 60s --workload-api-socket /tmp/agent.sock &
//! cargo run --release -p meshca-client --example workload_api_streams -- \
//!     --socket /tmp/agent.sock --streams 1000 --connections 10 --agent-pid $!
//! ```
//!
//! Prints the time until every stream had its first SVID, the agent's RSS
//! (from `/proc/PID/status`) before and with the streams open, and for each
//! rotation the time from the first stream seeing the new serial to the
//! last.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use meshca_proto::spiffe_workload::spiffe_workload_api_client::SpiffeWorkloadApiClient;
use meshca_proto::spiffe_workload::X509svidRequest;
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

#[derive(Parser)]
struct Args {
    /// The agent's socket.
    #[arg(long)]
    socket: PathBuf,
    /// Streams to hold open.
    #[arg(long, default_value_t = 1000)]
    streams: usize,
    /// Connections to spread them over.
    #[arg(long, default_value_t = 10)]
    connections: usize,
    /// The agent's PID, to read its RSS.
    #[arg(long)]
    agent_pid: Option<u32>,
    /// Rotations to wait for.
    #[arg(long, default_value_t = 1)]
    rotations: usize,
}

fn rss_kib(pid: Option<u32>) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid?)).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

async fn channel(socket: PathBuf) -> anyhow::Result<Channel> {
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
        .context("connecting to the socket")
}

/// (stream index, serial of the leaf it just received, when).
type Seen = (usize, Vec<u8>, Instant);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rss_before = rss_kib(args.agent_pid);
    let mut channels = Vec::new();
    for _ in 0..args.connections.max(1) {
        channels.push(channel(args.socket.clone()).await?);
    }
    let (tx, mut rx) = mpsc::unbounded_channel::<Seen>();
    let started = Instant::now();
    let open = Arc::new(tokio::sync::Semaphore::new(0));
    for i in 0..args.streams {
        let mut client = SpiffeWorkloadApiClient::new(channels[i % channels.len()].clone());
        let tx = tx.clone();
        let open = open.clone();
        tokio::spawn(async move {
            let mut request = tonic::Request::new(X509svidRequest {});
            request
                .metadata_mut()
                .insert("workload.spiffe.io", "true".parse().expect("header value"));
            let mut stream = match client.fetch_x509svid(request).await {
                Ok(s) => s.into_inner(),
                Err(status) => {
                    eprintln!("stream {i}: {status}");
                    return;
                }
            };
            open.add_permits(1);
            while let Ok(Some(message)) = stream.message().await {
                let serial = message
                    .svids
                    .first()
                    .map(|s| s.x509_svid.get(..64).unwrap_or_default().to_vec())
                    .unwrap_or_default();
                if tx.send((i, serial, Instant::now())).is_err() {
                    return;
                }
            }
        });
    }
    drop(tx);
    let mut current: Vec<Option<Vec<u8>>> = vec![None; args.streams];
    let mut have = 0;
    while have < args.streams {
        let (i, serial, _) = rx.recv().await.context("streams ended")?;
        if current[i].replace(serial).is_none() {
            have += 1;
        }
    }
    let all_first = started.elapsed();
    // Let the agent settle, then read its memory with every stream open.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_open = rss_kib(args.agent_pid);
    println!(
        "streams={} connections={} all_first_svid_ms={} agent_rss_kib_before={:?} agent_rss_kib_open={:?}",
        args.streams,
        channels.len(),
        all_first.as_millis(),
        rss_before,
        rss_open
    );
    for rotation in 1..=args.rotations {
        let mut first_seen: Option<Instant> = None;
        let mut last_seen = Instant::now();
        let mut moved = 0;
        let mut rotated = vec![false; args.streams];
        while moved < args.streams {
            let (i, serial, at) = rx.recv().await.context("streams ended")?;
            if current[i].as_ref() != Some(&serial) && !rotated[i] {
                rotated[i] = true;
                moved += 1;
                first_seen.get_or_insert(at);
                last_seen = at;
            }
            current[i] = Some(serial);
        }
        let spread = first_seen.map(|f| last_seen - f).unwrap_or_default();
        println!(
            "rotation={rotation} streams_updated={moved} first_to_last_ms={:.1} agent_rss_kib={:?}",
            spread.as_secs_f64() * 1000.0,
            rss_kib(args.agent_pid)
        );
    }
    Ok(())
}
