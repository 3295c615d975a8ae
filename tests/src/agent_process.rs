//! A real `meshca-agent` process for the end-to-end tests, and what its
//! Workload API socket serves, read with the `spiffe` crate's
//! `X509Source` (an independent SPIFFE client).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use meshca_certs::inspect::spki_der;
use meshca_certs::{PrivateKey, SpiffeId, TrustBundle};
use spiffe::X509Source;
use tokio::net::UnixStream;

use crate::{binaries, MeshcaServer};

/// A running `meshca-agent`, killed when dropped.
#[derive(Debug)]
pub struct Agent {
    /// The process.
    pub child: Child,
    /// Where its stderr goes.
    pub log: PathBuf,
}

impl Agent {
    /// Starts `meshca-agent` against `server`, with `dir/root-cert.pem` as
    /// its root and `token` (written to `dir/NAME.token`) as its
    /// credential, then `args`.
    pub fn start(
        server: &MeshcaServer,
        dir: &Path,
        token: &str,
        name: &str,
        args: &[&str],
    ) -> Self {
        let token_file = dir.join(format!("{name}.token"));
        std::fs::write(&token_file, token).expect("token file");
        let log = dir.join(format!("{name}.log"));
        let child = Command::new(&binaries().meshca_agent)
            .args([
                "--ca-addr",
                &format!("https://{}", server.grpc),
                "--root-cert",
                &dir.join("root-cert.pem").display().to_string(),
                "--token-file",
                &token_file.display().to_string(),
            ])
            .args(args)
            .env("MESHCA_LOG", "info,meshca_client=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("starting meshca-agent");
        Self { child, log }
    }

    /// What the agent logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `socket` accepts connections; panics with the log if
    /// the agent exits or 60 s pass.
    pub async fn wait_for_socket(&mut self, socket: &Path) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while UnixStream::connect(socket).await.is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("the agent exited ({status}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "no socket:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A tonic channel over the agent's Unix socket.
pub async fn unix_channel(socket: &Path) -> tonic::transport::Channel {
    let socket = socket.to_path_buf();
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
        .expect("a channel over the socket")
}

/// An `X509Source` on the agent's socket (30 s for its first answer).
pub async fn x509_source(socket: &Path) -> Result<X509Source, spiffe::X509SourceError> {
    X509Source::builder()
        .endpoint(format!("unix://{}", socket.display()))
        .initial_sync_timeout(Duration::from_secs(30))
        .build()
        .await
}

/// Checks what an `X509Source` holds: the SVID is `expected`, its key is
/// the leaf's, the bundle of its trust domain verifies the chain. Returns
/// the leaf's serial and the number of roots.
pub fn check_source(source: &X509Source, expected: &str) -> (String, usize) {
    let svid = source.svid().expect("an SVID");
    assert_eq!(svid.spiffe_id().to_string(), expected);
    let chain: Vec<Vec<u8>> = svid
        .cert_chain()
        .iter()
        .map(|c| c.as_bytes().to_vec())
        .collect();
    let key = PrivateKey::from_pkcs8_der(svid.private_key().as_bytes()).expect("a PKCS#8 key");
    assert_eq!(
        spki_der(&chain[0]).expect("a leaf"),
        key.public_key_spki_der(),
        "the key is the leaf's"
    );
    let bundle = source
        .try_bundle_for_trust_domain(svid.spiffe_id().trust_domain())
        .expect("a bundle for the SVID's trust domain");
    let roots: Vec<Vec<u8>> = bundle
        .authorities()
        .iter()
        .map(|c| c.as_bytes().to_vec())
        .collect();
    let verified = meshca_certs::verify::verify_svid(
        &chain,
        &TrustBundle::new(roots.clone()),
        SystemTime::now(),
        Some(&SpiffeId::parse(expected).expect("a SPIFFE ID")),
    )
    .expect("the bundle verifies the chain");
    (verified.serial_hex, roots.len())
}

/// Writes the cgroup file of `pid` under a fake `--proc-root`, as the
/// container runtime would (`0::/kubepods/…/pod<UID>/<container>` for
/// cgroup v2 with the cgroupfs driver).
pub fn set_cgroup(proc_root: &Path, pid: u32, contents: &str) {
    let dir = proc_root.join(pid.to_string());
    std::fs::create_dir_all(&dir).expect("proc directory");
    std::fs::write(dir.join("cgroup"), contents).expect("cgroup file");
}
