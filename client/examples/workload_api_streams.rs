//! Holds many `FetchX509SVID` streams open on a running agent's socket and
//! measures what they cost and how fast a rotation reaches all of them.
//!
//! ```sh
//! meshca-agent ... --ttl 60s --workload-api-socket /tmp/agent.sock &
//! cargo run --release -p meshca-client --example workload_api_streams -- \
//!     --socket /tmp/agent.sock --streams 1000 --connections 10 --agent-pid $!
//! ```
//!
//! Prints, as `key=value` lines:
//! - `opened`: streams asked for, streams held (each had its first SVID),
//!   streams refused (`RESOURCE_EXHAUSTED` beyond `--max-streams`), the time
//!   until every held stream had its first SVID, the agent's RSS (from
//!   `/proc/PID/status`) before and with the streams open, and the agent's
//!   CPU time (from `/proc/PID/task/*/schedstat`) while they opened;
//! - `idle`: the agent's CPU time over `--idle` seconds with every stream
//!   open and nothing changing;
//! - `rotation`: for each rotation (the agent renewing its certificate),
//!   how many streams received the new SVID, the time from the first stream
//!   receiving it to the last (the agent pushes as soon as it holds the new
//!   certificate, so this is the time to push a rotation to every stream),
//!   and the agent's CPU time from the first to the last and since the
//!   wait for the rotation began (the renewal itself, the push, and
//!   whatever the idle agent spent meanwhile);
//! - `closed`: the agent's RSS once every stream and connection is closed,
//!   and whether a new stream is then served (the slots were freed);
//! - `cycle`: with `--cycles N`, the agent's RSS after each of N more
//!   rounds of opening every stream (each had its first SVID) and closing
//!   them.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use meshca_proto::spiffe_workload::spiffe_workload_api_client::SpiffeWorkloadApiClient;
use meshca_proto::spiffe_workload::{X509svidRequest, X509svidResponse};
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
    /// The agent's PID, to read its RSS and CPU time.
    #[arg(long)]
    agent_pid: Option<u32>,
    /// Rotations to wait for.
    #[arg(long, default_value_t = 1)]
    rotations: usize,
    /// Seconds to watch the agent's CPU with every stream open and idle.
    #[arg(long, default_value_t = 10)]
    idle: u64,
    /// After the rotations: open and close all the streams this many more
    /// times, printing the agent's RSS after each (closing frees the
    /// streams: RSS stays flat).
    #[arg(long, default_value_t = 0)]
    cycles: usize,
}

/// The agent's resident memory, KiB.
fn rss_kib(pid: Option<u32>) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid?)).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The agent's CPU time so far (user + system, every live thread), ms:
/// the sum of `/proc/PID/task/*/schedstat`'s first field (ns on a CPU).
fn cpu_ms(pid: Option<u32>) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{}/task", pid?)).ok()?;
    let mut ns: u64 = 0;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        ns += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(ns / 1_000_000)
}

fn delta(after: Option<u64>, before: Option<u64>) -> String {
    match (after, before) {
        (Some(a), Some(b)) => a.saturating_sub(b).to_string(),
        _ => "?".into(),
    }
}

fn show(value: Option<u64>) -> String {
    value.map_or_else(|| "?".into(), |v| v.to_string())
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

/// What a stream task reports.
enum Event {
    /// Stream `index` received an SVID whose DER chain is `svid`.
    Svid {
        index: usize,
        svid: Vec<u8>,
        at: Instant,
    },
    /// Stream `index` was refused or ended.
    Failed { index: usize, status: tonic::Status },
}

async fn open_stream(
    channel: Channel,
) -> Result<tonic::Streaming<X509svidResponse>, tonic::Status> {
    let mut client = SpiffeWorkloadApiClient::new(channel);
    let mut request = tonic::Request::new(X509svidRequest {});
    let header = "true"
        .parse()
        .map_err(|_| tonic::Status::internal("header value"))?;
    request.metadata_mut().insert("workload.spiffe.io", header);
    Ok(client.fetch_x509svid(request).await?.into_inner())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let pid = args.agent_pid;
    let rss_before = rss_kib(pid);
    let cpu_before = cpu_ms(pid);
    let mut channels = Vec::new();
    for _ in 0..args.connections.max(1) {
        channels.push(channel(args.socket.clone()).await?);
    }
    let (tx, mut rx) = mpsc::unbounded_channel::<Event>();
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(args.streams);
    for index in 0..args.streams {
        let channel = channels[index % channels.len()].clone();
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            let mut stream = match open_stream(channel).await {
                Ok(stream) => stream,
                Err(status) => {
                    let _ = tx.send(Event::Failed { index, status });
                    return;
                }
            };
            loop {
                match stream.message().await {
                    Ok(Some(message)) => {
                        let svid = message
                            .svids
                            .into_iter()
                            .next()
                            .map(|s| s.x509_svid)
                            .unwrap_or_default();
                        let event = Event::Svid {
                            index,
                            svid,
                            at: Instant::now(),
                        };
                        if tx.send(event).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {
                        let status = tonic::Status::unavailable("the stream ended");
                        let _ = tx.send(Event::Failed { index, status });
                        return;
                    }
                    Err(status) => {
                        let _ = tx.send(Event::Failed { index, status });
                        return;
                    }
                }
            }
        }));
    }
    drop(tx);
    let mut current: Vec<Option<Vec<u8>>> = vec![None; args.streams];
    let mut failed: Vec<Option<tonic::Code>> = vec![None; args.streams];
    let (mut held, mut refused) = (0, 0);
    while held + refused < args.streams {
        match rx.recv().await.context("every stream ended")? {
            Event::Svid { index, svid, .. } => {
                if current[index].replace(svid).is_none() {
                    held += 1;
                }
            }
            Event::Failed { index, status } => {
                if failed[index].replace(status.code()).is_none() {
                    if current[index].is_some() {
                        held -= 1;
                    }
                    refused += 1;
                    if refused <= 3 {
                        eprintln!("stream {index}: {status}");
                    }
                }
            }
        }
    }
    let all_first = started.elapsed();
    let cpu_opened = cpu_ms(pid);
    // Let the agent settle, then read its memory with every stream open.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_open = rss_kib(pid);
    let refused_exhausted = failed
        .iter()
        .filter(|c| **c == Some(tonic::Code::ResourceExhausted))
        .count();
    println!(
        "opened streams={} held={held} refused={refused} refused_resource_exhausted={refused_exhausted} \
         connections={} all_first_svid_ms={} agent_rss_kib_before={} agent_rss_kib_open={} \
         agent_cpu_ms_opening={}",
        args.streams,
        channels.len(),
        all_first.as_millis(),
        show(rss_before),
        show(rss_open),
        delta(cpu_opened, cpu_before),
    );
    let idle_from = cpu_ms(pid);
    tokio::time::sleep(Duration::from_secs(args.idle)).await;
    println!(
        "idle seconds={} held={held} agent_cpu_ms={} agent_rss_kib={}",
        args.idle,
        delta(cpu_ms(pid), idle_from),
        show(rss_kib(pid))
    );
    for rotation in 1..=args.rotations {
        let cpu_waiting = cpu_ms(pid);
        let mut first_seen: Option<(Instant, Option<u64>)> = None;
        let mut last_seen = Instant::now();
        let mut moved = 0;
        let mut rotated = vec![false; args.streams];
        while moved < held {
            let event = rx.recv().await.context("every stream ended")?;
            let (index, svid, at) = match event {
                Event::Svid { index, svid, at } => (index, svid, at),
                Event::Failed { index, status } => {
                    anyhow::bail!("stream {index} ended while waiting for a rotation: {status}")
                }
            };
            if current[index].as_ref() != Some(&svid) && !rotated[index] {
                rotated[index] = true;
                moved += 1;
                first_seen.get_or_insert_with(|| (at, cpu_ms(pid)));
                last_seen = at;
            }
            current[index] = Some(svid);
        }
        let cpu_after = cpu_ms(pid);
        let (spread, cpu) = match first_seen {
            Some((first, cpu_first)) => (last_seen - first, delta(cpu_after, cpu_first)),
            None => (Duration::ZERO, "?".into()),
        };
        println!(
            "rotation={rotation} streams_updated={moved} first_to_last_ms={:.1} agent_cpu_ms={cpu} \
             agent_cpu_ms_since_waiting={} agent_rss_kib={}",
            spread.as_secs_f64() * 1000.0,
            delta(cpu_after, cpu_waiting),
            show(rss_kib(pid))
        );
    }
    // Close everything; the agent frees each stream's slot and feed.
    for task in &tasks {
        task.abort();
    }
    drop(tasks);
    drop(rx);
    drop(channels);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_closed = rss_kib(pid);
    let again = open_stream(channel(args.socket.clone()).await?)
        .await
        .context("a new stream after closing")?
        .message()
        .await
        .context("a new stream after closing")?
        .is_some();
    println!(
        "closed agent_rss_kib={} new_stream_served={again}",
        show(rss_closed)
    );
    for cycle in 1..=args.cycles {
        let mut connections = Vec::new();
        let mut streams = Vec::with_capacity(args.streams);
        let mut opened = 0;
        for index in 0..args.streams {
            // A new connection every 100 streams (the agent allows 128).
            if index % 100 == 0 {
                connections.push(channel(args.socket.clone()).await?);
            }
            let Some(connection) = connections.last() else {
                continue;
            };
            if let Ok(mut stream) = open_stream(connection.clone()).await {
                if matches!(stream.message().await, Ok(Some(_))) {
                    opened += 1;
                }
                streams.push(stream);
            }
        }
        drop(streams);
        drop(connections);
        tokio::time::sleep(Duration::from_secs(1)).await;
        println!(
            "cycle={cycle} opened={opened} closed agent_rss_kib={}",
            show(rss_kib(pid))
        );
    }
    Ok(())
}
