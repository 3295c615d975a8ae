//! End-to-end tests of the monitoring port (`--monitoring-listen`, 15014)
//! under a flood of connections that never finish their request header:
//! the real binary, plain TCP clients. The bounds are those of
//! `ca/src/monitoring.rs` (64 connections, a 5 s header timeout).

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use meshca_tests::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The monitoring port's connection cap.
const CAP: usize = 64;
/// The monitoring port's header read timeout.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

fn server() -> (tempfile::TempDir, MeshcaServer) {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = MeshcaServer::start(&dir.path().join("data"), &[])
        .unwrap_or_else(|f| panic!("meshca did not start: {f:?}"));
    (dir, server)
}

/// A connection that sends the start of a request header, then nothing.
async fn unfinished_header(addr: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    // Closed at accept, the write may fail: that is for the reader to see.
    let _ = stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: meshca\r\nX-Slow: aaaa")
        .await;
    stream
}

/// Whether the server closes `stream` (end of stream or reset) before
/// `deadline`; an answer it sends first (say, a 408) is read past.
async fn closed_before(stream: &mut TcpStream, deadline: Instant) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline.into(), stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// `GET path` on its own connection, from a blocking thread.
async fn probe(addr: SocketAddr, path: &'static str) -> (u16, String) {
    tokio::task::spawn_blocking(move || http_get(addr, path))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

/// One HTTP/1.1 request on `stream`, kept alive: the status and body.
async fn keep_alive_get(stream: &mut TcpStream, path: &str) -> (u16, String) {
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: meshca\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0, "closed before the answer ended");
        received.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&received);
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            continue;
        };
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().ok())?
            })
            .expect("a content-length");
        if body.len() >= length {
            let code = head
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .unwrap();
            return (code, body.to_string());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_headers_are_dropped_after_the_header_timeout_while_probes_answer() {
    let (_dir, server) = server();
    let opened = Instant::now();
    let mut flood = Vec::new();
    for _ in 0..100 {
        flood.push(unfinished_header(server.monitoring).await);
    }
    // Seats held by connections that sent no request for a second go to
    // newcomers: the kubelet's probes and Prometheus get in.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        probe(server.monitoring, "/healthz").await,
        (200, "ok\n".into())
    );
    let (code, _) = probe(server.monitoring, "/ready").await;
    assert_eq!(code, 200);
    let (code, metrics) = probe(server.monitoring, "/metrics").await;
    assert_eq!(code, 200);
    assert!(metrics.contains("citadel_server_csr_count"), "{metrics}");

    // Every unfinished header is dropped after the header timeout (with a
    // margin for a loaded machine), not held for ever.
    let deadline = opened + HEADER_TIMEOUT + Duration::from_secs(10);
    for (i, stream) in flood.iter_mut().enumerate() {
        assert!(
            closed_before(stream, deadline).await,
            "connection {i} still open {:?} after it was opened",
            opened.elapsed()
        );
    }
    assert_eq!(
        probe(server.monitoring, "/healthz").await,
        (200, "ok\n".into())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_beyond_the_cap_is_closed() {
    let (_dir, server) = server();
    let mut streams = Vec::new();
    for _ in 0..=CAP {
        streams.push(unfinished_header(server.monitoring).await);
    }
    let opened = Instant::now();
    // One of the 65 is closed long before the header timeout: the last at
    // accept, or, if the server saw the others quiet for a second already,
    // the one whose seat it took.
    let closed = futures::future::select_all(streams.iter_mut().map(|s| {
        Box::pin(closed_before(
            s,
            opened + HEADER_TIMEOUT - Duration::from_secs(1),
        ))
    }));
    let (first_closed, _, _) = closed.await;
    assert!(
        first_closed,
        "{} connections held open for {:?}",
        CAP + 1,
        opened.elapsed()
    );
}

#[tokio::test]
async fn a_scrape_connection_is_kept_alive_between_requests_and_closed_when_idle() {
    let (_dir, server) = server();
    let mut scrape = TcpStream::connect(server.monitoring).await.unwrap();
    for _ in 0..3 {
        let (code, body) = keep_alive_get(&mut scrape, "/metrics").await;
        assert_eq!(code, 200);
        assert!(body.contains("citadel_server_csr_count"), "{body}");
    }
    assert_eq!(
        keep_alive_get(&mut scrape, "/healthz").await,
        (200, "ok\n".into())
    );
    // Idle after its answers: closed after the header timeout.
    let idle = Instant::now();
    assert!(closed_before(&mut scrape, idle + HEADER_TIMEOUT + Duration::from_secs(10)).await);
    assert!(
        idle.elapsed() >= HEADER_TIMEOUT - Duration::from_millis(500),
        "closed after {:?}, before the timeout",
        idle.elapsed()
    );
}
