//! Helpers for meshca's end-to-end tests: build and start the real
//! binaries, talk to them over real TLS and gRPC, make CSRs (good, forged,
//! weak) and tokens.

pub mod agent_process;
pub mod control_plane;
pub mod fake_ca;
pub mod fake_certificates;
pub mod fake_kube;
pub mod root_rotation;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use meshca_certs::token::{TokenIssuer, TokenRequest};
use meshca_certs::{build_csr, KeyAlgorithm, PrivateKey, SpiffeId};
use meshca_proto::istio::v1::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use meshca_proto::IstioCertificateRequest;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// The binaries under test, built once per test process.
#[derive(Debug)]
pub struct Binaries {
    /// `meshca`.
    pub meshca: PathBuf,
    /// `meshca-certs`.
    pub meshca_certs: PathBuf,
    /// `meshca-agent`.
    pub meshca_agent: PathBuf,
}

/// Builds `bin` with the feature set `cargo test --workspace` resolves, so
/// the artifacts the test build already made are reused and only the binary
/// itself is linked (no second build of every dependency, which doubles the
/// suite's time and disk).
///
/// Cargo unifies dev-dependency features only when a selected target needs
/// them, so a plain `cargo build --bin` resolves other features than
/// `cargo test` (the test crate's dev-dependencies turn on features of
/// tonic, prost and others) and rebuilds the whole tree. Selecting one test
/// target as well (`--test agent_e2e`, already built by `cargo test`) makes
/// the two builds agree.
///
/// Cargo also re-runs a build script when an environment variable it
/// declared (`rerun-if-env-changed`) differs from the last build, and it
/// sets some of those (`CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR`, `OUT_DIR`…)
/// for the test process: passed on to this build they would rebuild `ring`
/// and everything above it, and the next `cargo test` would rebuild it
/// back. They are removed here.
fn build(bin: &str) -> PathBuf {
    let mut cargo = escargot::CargoBuild::new();
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_")
            || matches!(
                name,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_MANIFEST_LINKS"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
                    | "OUT_DIR"
            )
        {
            cargo = cargo.env_remove(name);
        }
    }
    cargo
        .arg("--workspace")
        .arg("--test")
        .arg("agent_e2e")
        .bin(bin)
        .current_release()
        .run()
        .unwrap_or_else(|e| panic!("building {bin}: {e}"))
        .path()
        .to_path_buf()
}

/// Builds (if needed) and returns the binaries. `MESHCA_TESTS_MESHCA_BIN`
/// names another `meshca` to test instead (e.g. an older build, to see a
/// new test fail on it), `MESHCA_TESTS_AGENT_BIN` another `meshca-agent`
/// (e.g. a release build, to measure it).
pub fn binaries() -> &'static Binaries {
    static BINARIES: OnceLock<Binaries> = OnceLock::new();
    BINARIES.get_or_init(|| Binaries {
        meshca: std::env::var_os("MESHCA_TESTS_MESHCA_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| build("meshca")),
        meshca_certs: build("meshca-certs"),
        meshca_agent: std::env::var_os("MESHCA_TESTS_AGENT_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| build("meshca-agent")),
    })
}

/// Builds (if needed) and returns the `meshca-bench` load generator.
pub fn bench_binary() -> &'static Path {
    static BENCH: OnceLock<PathBuf> = OnceLock::new();
    BENCH.get_or_init(|| build("meshca-bench"))
}

/// The value of the unlabelled metric `name` in a /metrics page.
///
/// # Panics
/// If the page has no such metric.
pub fn metric(body: &str, name: &str) -> u64 {
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .unwrap_or_else(|| panic!("{name} missing in\n{body}"))
}

/// A free TCP port on 127.0.0.1 (released before returning; a small race).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// What `meshca serve` logs once it serves gRPC.
pub const SERVING_LINE: &str = "meshca is serving IstioCertificateService";

/// A running `meshca serve`.
#[derive(Debug)]
pub struct MeshcaServer {
    child: Option<Child>,
    /// gRPC+TLS address.
    pub grpc: SocketAddr,
    /// Monitoring address.
    pub monitoring: SocketAddr,
    /// The data directory.
    pub data_dir: PathBuf,
    /// Where stderr goes.
    pub log_path: PathBuf,
}

/// Why a server did not come up.
#[derive(Debug)]
pub struct StartFailure {
    /// Exit status, if it exited.
    pub status: Option<ExitStatus>,
    /// What it wrote to stderr.
    pub stderr: String,
}

impl MeshcaServer {
    /// Starts `meshca serve` with `data_dir` and `extra` flags on free
    /// ports and waits until /healthz answers.
    pub fn start(data_dir: &Path, extra: &[&str]) -> Result<Self, StartFailure> {
        Self::start_with_env(data_dir, extra, &[])
    }

    /// Starts `meshca serve` with `data_dir` and `extra` expecting a refusal:
    /// panics unless it exits non-zero with `expected` in its stderr.
    pub fn refuses_to_start(data_dir: &Path, extra: &[&str], expected: &str) {
        match Self::start(data_dir, extra) {
            Ok(server) => panic!("meshca started with {extra:?}:\n{}", server.log()),
            Err(failure) => {
                assert!(failure.status.is_some_and(|s| !s.success()), "{failure:?}");
                assert!(failure.stderr.contains(expected), "{}", failure.stderr);
            }
        }
    }

    /// As [`MeshcaServer::start`], with extra environment variables.
    pub fn start_with_env(
        data_dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self, StartFailure> {
        // A port found free can be taken (by another test's outgoing
        // connection) before meshca binds it: try again on new ports.
        let mut attempt = 0;
        loop {
            let grpc: SocketAddr = format!("127.0.0.1:{}", free_port())
                .parse()
                .expect("address");
            let monitoring: SocketAddr = format!("127.0.0.1:{}", free_port())
                .parse()
                .expect("address");
            match Self::start_on(data_dir, grpc, monitoring, extra, env) {
                Err(f) if attempt < 3 && f.stderr.contains("Address already in use") => {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Starts on the given addresses (e.g. to restart where a server was)
    /// and waits until it serves gRPC.
    pub fn start_on(
        data_dir: &Path,
        grpc: SocketAddr,
        monitoring: SocketAddr,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self, StartFailure> {
        Self::spawn_on(data_dir, grpc, monitoring, extra, env, true)
    }

    /// Starts `meshca serve` and returns once `/healthz` answers, before
    /// start-up has finished (it may be waiting for the Kubernetes API).
    pub fn start_unready(
        data_dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self, StartFailure> {
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port())
            .parse()
            .expect("address");
        let monitoring: SocketAddr = format!("127.0.0.1:{}", free_port())
            .parse()
            .expect("address");
        Self::spawn_on(data_dir, grpc, monitoring, extra, env, false)
    }

    /// Whether the server has said it serves gRPC (its start-up is over).
    pub fn serves_grpc(&self) -> bool {
        self.log().contains(SERVING_LINE)
    }

    fn spawn_on(
        data_dir: &Path,
        grpc: SocketAddr,
        monitoring: SocketAddr,
        extra: &[&str],
        env: &[(&str, &str)],
        until_serving: bool,
    ) -> Result<Self, StartFailure> {
        let log_path = data_dir.with_extension(format!("{}.log", grpc.port()));
        let log = std::fs::File::create(&log_path).expect("log file");
        let mut command = Command::new(&binaries().meshca);
        // The per-identity issuance rate limit is off in the end-to-end
        // tests, which ask for many certificates of one identity; a test's
        // own `--issuance-burst` (a flag wins over the environment) turns it
        // back on.
        command
            .env("MESHCA_ISSUANCE_BURST", "0")
            .arg("serve")
            .arg("--listen")
            .arg(grpc.to_string())
            .arg("--monitoring-listen")
            .arg(monitoring.to_string())
            .arg("--data-dir")
            .arg(data_dir)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        for (k, v) in env {
            command.env(k, v);
        }
        let child = command.spawn().expect("spawning meshca");
        let mut server = Self {
            child: Some(child),
            grpc,
            monitoring,
            data_dir: data_dir.to_path_buf(),
            log_path,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(child) = server.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    server.child = None;
                    return Err(StartFailure {
                        status: Some(status),
                        stderr: server.log(),
                    });
                }
            }
            // The monitoring port answers first; gRPC once start-up is over.
            if http_get(monitoring, "/healthz").is_ok_and(|(code, _)| code == 200)
                && (!until_serving || server.serves_grpc())
            {
                return Ok(server);
            }
            if Instant::now() > deadline {
                let stderr = server.log();
                return Err(StartFailure {
                    status: None,
                    stderr,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's process ID (0 once stopped).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// The server's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// `root-cert.pem` of the data directory.
    pub fn root_pem(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("root-cert.pem")).expect("root-cert.pem")
    }

    /// Mints a token with the local issuer.
    pub fn token(&self, namespace: &str, service_account: &str) -> String {
        mint_token(
            &self.data_dir,
            namespace,
            service_account,
            "istio-ca",
            Duration::from_secs(600),
        )
    }

    /// A gRPC client over TLS trusting `root-cert.pem`, verifying the
    /// server as `istiod.istio-system.svc`.
    pub async fn client(&self) -> IstioCertificateServiceClient<Channel> {
        self.client_with_identity(None).await
    }

    /// A gRPC client presenting a client certificate.
    pub async fn client_with_identity(
        &self,
        identity: Option<(String, String)>,
    ) -> IstioCertificateServiceClient<Channel> {
        self.connect(&self.root_pem(), identity).await
    }

    /// A gRPC client trusting `root_pem` (e.g. a plugged-in CA's root)
    /// instead of the data directory's `root-cert.pem`.
    pub async fn client_trusting(&self, root_pem: &str) -> IstioCertificateServiceClient<Channel> {
        self.connect(root_pem, None).await
    }

    async fn connect(
        &self,
        root_pem: &str,
        identity: Option<(String, String)>,
    ) -> IstioCertificateServiceClient<Channel> {
        IstioCertificateServiceClient::new(self.channel_trusting(root_pem, identity).await)
    }

    /// A gRPC channel over TLS trusting `root-cert.pem`, for calls the
    /// generated client cannot make (e.g. a request that is never finished).
    pub async fn channel(&self) -> Channel {
        self.channel_trusting(&self.root_pem(), None).await
    }

    async fn channel_trusting(
        &self,
        root_pem: &str,
        identity: Option<(String, String)>,
    ) -> Channel {
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(root_pem))
            .domain_name("istiod.istio-system.svc");
        if let Some((chain, key)) = identity {
            tls = tls.identity(Identity::from_pem(chain, key));
        }
        Endpoint::from_shared(format!("https://{}", self.grpc))
            .expect("endpoint")
            .tls_config(tls)
            .expect("tls")
            .connect()
            .await
            .expect("connecting to meshca over TLS")
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return child.wait().ok();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for MeshcaServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts meshca off the async runtime (on a blocking thread), so a fake
/// API server running on the test's runtime can answer the calls meshca
/// makes while starting. Panics with meshca's log if it does not start.
pub async fn start_off_runtime(data: PathBuf, args: Vec<String>) -> MeshcaServer {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        MeshcaServer::start(&data, &args)
    })
    .await
    .expect("start task")
    .unwrap_or_else(|f| panic!("{f:?}"))
}

/// Mints a token with the data directory's local issuer.
pub fn mint_token(
    data_dir: &Path,
    namespace: &str,
    service_account: &str,
    audience: &str,
    ttl: Duration,
) -> String {
    let issuer = TokenIssuer::load(data_dir).expect("local issuer");
    issuer
        .mint(
            &TokenRequest {
                namespace: namespace.into(),
                service_account: service_account.into(),
                audiences: vec![audience.into()],
                ttl,
                pod: None,
            },
            std::time::SystemTime::now(),
        )
        .expect("minting")
}

/// A minimal HTTP/1.0 GET: (status code, body).
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// A request with a fresh key of `alg` asking for `id`; returns the key too.
pub fn csr_request(
    alg: KeyAlgorithm,
    id: &str,
    ttl_secs: i64,
) -> (PrivateKey, IstioCertificateRequest) {
    let key = PrivateKey::generate(alg).expect("key");
    let id = SpiffeId::parse(id).expect("spiffe id");
    let csr = build_csr(&key, &id).expect("csr");
    (
        key,
        IstioCertificateRequest {
            csr,
            validity_duration: ttl_secs,
            metadata: None,
        },
    )
}

/// Asks `server` for a P-256 SVID of `id` with `token`; the chain, or the
/// gRPC status.
pub async fn ask(
    server: &MeshcaServer,
    token: &str,
    id: &str,
) -> Result<Vec<String>, tonic::Status> {
    let mut client = server.client().await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, id, 0);
    client
        .create_certificate(with_token(request, token))
        .await
        .map(|r| r.into_inner().cert_chain)
}

/// Asks `server`, as a node agent with `token`, for an SVID of `target`
/// (the `ImpersonatedIdentity` metadata Istio's node agents send).
pub async fn impersonate(
    server: &MeshcaServer,
    token: &str,
    target: &str,
) -> Result<Vec<String>, tonic::Status> {
    let mut client = server.client().await;
    let (_, mut request) = csr_request(KeyAlgorithm::EcdsaP256, target, 0);
    request.metadata = Some(prost_types::Struct {
        fields: [(
            "ImpersonatedIdentity".to_string(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue(target.to_string())),
            },
        )]
        .into(),
    });
    client
        .create_certificate(with_token(request, token))
        .await
        .map(|r| r.into_inner().cert_chain)
}

/// Adds `authorization: Bearer <token>`.
pub fn with_token<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("header"),
    );
    request
}

/// An RSA key of any size (1024 included) or public exponent (3
/// included) that signs CSRs with PKCS#1 v1.5 SHA-256, for testing the
/// CA's refusal of weak keys (ring loads no such key).
pub struct RsaTestKey {
    key: rsa::RsaPrivateKey,
    public_der: Vec<u8>,
}

impl RsaTestKey {
    /// Generates a key of `bits` with public exponent 65537.
    pub fn generate(bits: usize) -> Self {
        Self::with_exponent(bits, 65537)
    }

    /// Generates a key of `bits` with public exponent `exponent`.
    pub fn with_exponent(bits: usize, exponent: u32) -> Self {
        use rsa::pkcs1::EncodeRsaPublicKey;
        let key = rsa::RsaPrivateKey::new_with_exp(
            &mut rand_core::OsRng,
            bits,
            &rsa::BigUint::from(exponent),
        )
        .expect("rsa key");
        let public_der = key
            .to_public_key()
            .to_pkcs1_der()
            .expect("pkcs1")
            .as_bytes()
            .to_vec();
        Self { key, public_der }
    }

    /// The private key.
    pub fn private(&self) -> &rsa::RsaPrivateKey {
        &self.key
    }

    /// The DER SubjectPublicKeyInfo.
    pub fn spki_der(&self) -> Vec<u8> {
        use rsa::pkcs8::EncodePublicKey;
        self.key
            .to_public_key()
            .to_public_key_der()
            .expect("SPKI")
            .into_vec()
    }

    /// A PEM CSR for `id` signed with this key.
    pub fn csr(&self, id: &str) -> String {
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.subject_alt_names = vec![rcgen::SanType::URI(id.try_into().expect("uri"))];
        params
            .serialize_request(self)
            .expect("csr")
            .pem()
            .expect("pem")
    }

    /// An empty PKCS#10 request signed with this key (a kubelet's
    /// `stubPKCS10Request`), DER.
    pub fn stub_csr_der(&self) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .serialize_request(self)
            .expect("stub csr")
            .der()
            .to_vec()
    }
}

impl rcgen::PublicKeyData for RsaTestKey {
    fn der_bytes(&self) -> &[u8] {
        &self.public_der
    }
    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_RSA_SHA256
    }
}

impl rcgen::SigningKey for RsaTestKey {
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        use rsa::signature::{SignatureEncoding, Signer};
        let signer = rsa::pkcs1v15::SigningKey::<rsa::sha2::Sha256>::new(self.key.clone());
        Ok(signer.sign(msg).to_vec())
    }
}

/// Whether the command-line tool `tool` runs (`tool probe…` succeeds), for
/// the checks that cross-check meshca with it. When it does not and the
/// environment variable `CI` is set, panics naming the tool: in CI a check
/// must fail, not pass by not running (`.ci/run` installs the tools).
/// Elsewhere the caller skips the check and says so.
pub fn tool_available(tool: &str, probe: &[&str]) -> bool {
    let runs = Command::new(tool)
        .args(probe)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !runs && std::env::var_os("CI").is_some() {
        panic!(
            "`{tool}` is needed by this test and is not installed (CI is set, so the test \
             fails instead of skipping; `.ci/run` installs it)"
        );
    }
    runs
}

/// Whether `openssl` is on PATH (see [`tool_available`]: panics in CI if not).
pub fn have_openssl() -> bool {
    tool_available("openssl", &["version"])
}

/// Whether `kubectl` is on PATH (see [`tool_available`]: panics in CI if not).
pub fn have_kubectl() -> bool {
    tool_available("kubectl", &["version", "--client"])
}

/// Runs `meshca-certs` with `args`, panicking with its error output if it
/// fails.
pub fn certs_cli(args: &[&str]) {
    let out = Command::new(&binaries().meshca_certs)
        .args(args)
        .output()
        .expect("running meshca-certs");
    assert!(
        out.status.success(),
        "meshca-certs {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Makes a plugged-in CA the way an operator does with `meshca-certs`: an
/// intermediate for `cluster` under the root in `root`, written to
/// `pki/<cluster>` in Istio's `cacerts` layout (`extra`: more flags of
/// `intermediate-ca`). Returns that directory.
pub fn intermediate_ca(pki: &Path, root: &Path, cluster: &str, extra: &[&str]) -> PathBuf {
    let (root, out) = (
        root.to_str().expect("UTF-8 path"),
        pki.to_str().expect("UTF-8 path"),
    );
    let mut args = vec![
        "intermediate-ca",
        "--root",
        root,
        "--cluster",
        cluster,
        "--out",
        out,
    ];
    args.extend_from_slice(extra);
    certs_cli(&args);
    pki.join(cluster)
}

/// Runs a command, panicking with its output if it fails.
pub fn run_ok(command: &mut Command) -> String {
    let output = command.output().expect("running command");
    assert!(
        output.status.success(),
        "{command:?} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}
