//! meshca as a child process against the fake Kubernetes API of the
//! end-to-end tests (real HTTPS, real JSON) or a real kube-apiserver
//! (`--kube-apiserver`, see `real_kube`): what the scenarios that start
//! their own server share.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use meshca_tests::fake_kube::FakeKube;

/// Kills the child when dropped.
pub(crate) struct KillOnDrop(pub(crate) Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A free local address (bound and released).
pub(crate) fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// One `GET /healthz`, blocking, bounded by `timeout` per step. Blocking on
/// a thread of its own, like a kubelet probe from another process: the
/// answer time is the server's, not this busy load generator's.
pub(crate) fn healthz(addr: SocketAddr, timeout: Duration) -> Result<(), String> {
    probe(addr, "/healthz", timeout)
}

/// `GET path` on the monitoring port answers 200.
pub(crate) fn probe(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(), String> {
    match http_get(addr, path, timeout)? {
        (200, _) => Ok(()),
        (code, _) => Err(format!("{code}, not 200")),
    }
}

/// The meshca binary: `explicit`, or `meshca` next to this program.
pub(crate) fn meshca_path(explicit: Option<&PathBuf>) -> anyhow::Result<PathBuf> {
    match explicit {
        Some(p) => Ok(p.clone()),
        None => Ok(std::env::current_exe()?
            .parent()
            .context("locating meshca")?
            .join("meshca")),
    }
}

/// A running meshca process and its scratch directory, whatever API
/// server it talks to.
pub(crate) struct MeshcaProcess {
    /// The scratch directory (data dir, log).
    pub(crate) dir: tempfile::TempDir,
    /// gRPC address.
    pub(crate) grpc: SocketAddr,
    /// Monitoring address.
    pub(crate) monitoring: SocketAddr,
    /// The root bundle, PEM.
    pub(crate) root_pem: String,
    /// The server process.
    pub(crate) child: KillOnDrop,
}

/// A running meshca with its fake API server.
pub(crate) struct Meshca {
    /// The fake Kubernetes API.
    pub(crate) kube: FakeKube,
    /// The server.
    process: MeshcaProcess,
    /// The fake's files (its kubeconfig).
    _kube_dir: tempfile::TempDir,
}

impl std::ops::Deref for Meshca {
    type Target = MeshcaProcess;

    fn deref(&self) -> &MeshcaProcess {
        &self.process
    }
}

impl Meshca {
    /// Starts the fake API (answering after `api_latency`) and meshca with
    /// `args` (plus its addresses, data dir and kubeconfig), and waits
    /// until it is healthy and has written its bundle.
    pub(crate) async fn start(
        meshca: &PathBuf,
        api_latency: Duration,
        args: &[String],
    ) -> anyhow::Result<Self> {
        Self::start_on(meshca, api_latency, args, None).await
    }

    /// As [`Meshca::start`], with the server on the CPUs of `cpus` (a
    /// `taskset` list such as `0` or `0-1`), so that it does not share
    /// them with the load generator (run it with `taskset` on the others).
    pub(crate) async fn start_on(
        meshca: &PathBuf,
        api_latency: Duration,
        args: &[String],
        cpus: Option<&str>,
    ) -> anyhow::Result<Self> {
        let kube_dir = tempfile::tempdir()?;
        let kube = FakeKube::start(kube_dir.path()).await;
        kube.set_latency(api_latency);
        let process = MeshcaProcess::start(meshca, &kube.kubeconfig, args, cpus).await?;
        Ok(Self {
            kube,
            process,
            _kube_dir: kube_dir,
        })
    }
}

impl MeshcaProcess {
    /// Starts meshca with `--kubeconfig KUBECONFIG` and `args` (plus its
    /// addresses and data dir), on the CPUs of `cpus` if given, and waits
    /// until it is ready and has written its bundle.
    pub(crate) async fn start(
        meshca: &PathBuf,
        kubeconfig: &std::path::Path,
        args: &[String],
        cpus: Option<&str>,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let grpc = free_addr()?;
        let monitoring = free_addr()?;
        let log = std::fs::File::create(dir.path().join("meshca.log"))?;
        // A load generator asks for many certificates of few identities:
        // the per-identity issuance rate limit is off here.
        let mut command = match cpus {
            Some(cpus) => {
                // taskset execs meshca: the pid stays the server's.
                let mut taskset = Command::new("taskset");
                taskset.args(["-c", cpus]).arg(meshca);
                taskset
            }
            None => Command::new(meshca),
        };
        let child = command
            .env("MESHCA_ISSUANCE_BURST", "0")
            .arg("serve")
            .args([
                "--listen",
                &grpc.to_string(),
                "--monitoring-listen",
                &monitoring.to_string(),
            ])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .env("MESHCA_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", meshca.display()))?;
        let child = KillOnDrop(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        // Ready: start-up is over and gRPC is served (the monitoring port
        // answers /healthz before, while start-up may wait for the API).
        while probe(monitoring, "/ready", Duration::from_secs(2)).is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "meshca did not start: {}",
                std::fs::read_to_string(dir.path().join("meshca.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The bundle file is written by a task of its own, maybe just after
        // the health endpoint answers (a slow start, e.g. under valgrind).
        let root_path = dir.path().join("data/root-cert.pem");
        let root_pem = loop {
            match std::fs::read_to_string(&root_path) {
                Ok(pem) if !pem.is_empty() => break pem,
                result => {
                    if Instant::now() >= deadline {
                        result.with_context(|| format!("reading {}", root_path.display()))?;
                        anyhow::bail!("{} stayed empty", root_path.display());
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        Ok(Self {
            dir,
            grpc,
            monitoring,
            root_pem,
            child,
        })
    }

    /// The server's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.child.0.id()
    }

    /// The server's log so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("meshca.log")).unwrap_or_default()
    }
}

/// `GET path` on `addr` (plain HTTP/1.0, blocking): status and body.
pub(crate) fn http_get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String), String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, timeout).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| "no HTTP status".to_string())?;
    Ok((code, body.to_string()))
}
