//! End-to-end tests of `meshca-agent --workload-api-socket` read by
//! go-spiffe (`github.com/spiffe/go-spiffe/v2`), the Workload API client
//! most Go workloads use: an independent client beside the Rust `spiffe`
//! crate of `workload_api_e2e.rs`. The Go side is `meshca-gospiffe`
//! (`tests/gospiffe`), built by `tests/controlplane/build.sh` beside the
//! control plane; it prints what it got as JSON, having verified each SVID
//! with `x509svid.Verify` against the bundle served with it.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use meshca_certs::bundle::parse_certs_pem;
use meshca_tests::*;
use rsa::sha2::{Digest, Sha256};
use serde_json::Value;

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";
/// The certificate lifetime the agent asks for: renewed at about half, so
/// a rotation every 4 s or so.
const TTL_SECONDS: i64 = 8;

/// The `meshca-gospiffe` binary, or `None` (with a note) when it is not
/// built; with `CI` set a missing binary fails the test.
fn gospiffe() -> Option<PathBuf> {
    let path = meshca_tests::control_plane::tools_dir().join("meshca-gospiffe");
    if path.is_file() {
        return Some(path);
    }
    let message = format!(
        "the go-spiffe client is not built ({} missing): run tests/controlplane/build.sh (Go 1.26)",
        path.display()
    );
    if std::env::var_os("CI").is_some() {
        panic!("{message} (CI is set, so the test fails instead of skipping)");
    }
    eprintln!("skipped: {message}");
    None
}

/// A running `meshca-agent` serving the Workload API on a socket.
struct Agent {
    child: Option<Child>,
    log: PathBuf,
}

impl Agent {
    /// Starts `meshca-agent` for `WEB` against `server` on `socket`.
    fn start(server: &MeshcaServer, dir: &Path, name: &str, socket: &Path, extra: &[&str]) -> Self {
        let token_file = dir.join(format!("{name}.token"));
        std::fs::write(&token_file, server.token("default", "web")).unwrap();
        let log = dir.join(format!("{name}.log"));
        let child = Command::new(&binaries().meshca_agent)
            .arg("--ca-addr")
            .arg(format!("https://{}", server.grpc))
            .arg("--root-cert")
            .arg(dir.join("root-cert.pem"))
            .arg("--token-file")
            .arg(&token_file)
            .args(["--spiffe-id", WEB, "--workload-api-socket"])
            .arg(socket)
            .args(extra)
            .env("MESHCA_LOG", "info,meshca_client=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut agent = Self {
            child: Some(child),
            log,
        };
        agent.wait_for_socket(socket);
        agent
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `socket` accepts connections.
    fn wait_for_socket(&mut self, socket: &Path) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("the agent exited ({status}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "no socket:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends SIGTERM and waits (at most 30 s) for the exit status.
    fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("the agent runs");
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the agent did not exit on SIGTERM:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A running `meshca-gospiffe`: its stdout collected, its stderr collected
/// and passed on line by line as it comes.
struct GoClient {
    child: Child,
    args: Vec<String>,
    stdout: Option<JoinHandle<String>>,
    stderr_lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

/// How a `meshca-gospiffe` run ended.
struct GoRun {
    args: Vec<String>,
    /// `None`: killed at the test's own deadline.
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
}

impl GoRun {
    /// Its JSON, or a panic telling everything: the command, how it ended,
    /// its stdout and stderr, and the agent's log.
    fn json(self, agent: &Agent) -> Value {
        let ok = self.status.is_some_and(|s| s.success());
        let parsed = serde_json::from_str::<Value>(&self.stdout);
        match (ok, parsed) {
            (true, Ok(value)) => value,
            (_, parsed) => panic!(
                "meshca-gospiffe {:?}: {} (JSON: {:?})\nstdout:\n{}\nstderr:\n{}\nagent log:\n{}",
                self.args,
                self.status
                    .map_or("killed at the test's deadline".to_string(), |s| s
                        .to_string()),
                parsed.err(),
                self.stdout,
                self.stderr,
                agent.log()
            ),
        }
    }
}

impl GoClient {
    fn start(bin: &Path, args: &[&str]) -> Self {
        let mut child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let mut out = child.stdout.take().unwrap();
        let stdout = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text);
            text
        });
        let err = child.stderr.take().unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, stderr_lines) = mpsc::channel();
        std::thread::spawn({
            let stderr = stderr.clone();
            move || {
                for line in BufReader::new(err).lines() {
                    let Ok(line) = line else { break };
                    let mut all = stderr.lock().unwrap();
                    all.push_str(&line);
                    all.push('\n');
                    let _ = tx.send(line);
                }
            }
        });
        Self {
            child,
            args: args.iter().map(|a| a.to_string()).collect(),
            stdout: Some(stdout),
            stderr_lines,
            stderr,
        }
    }

    /// Waits for a stderr line starting with `prefix`, at most `timeout`.
    fn wait_for_line(&self, prefix: &str, timeout: Duration, agent: &Agent) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr_lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(_) => panic!(
                    "meshca-gospiffe {:?}: no `{prefix}` line within {timeout:?}; stderr:\n{}\nagent log:\n{}",
                    self.args,
                    self.stderr.lock().unwrap(),
                    agent.log()
                ),
            }
        }
    }

    /// Waits for the exit, at most `timeout` (then kills it).
    fn finish(mut self, timeout: Duration) -> GoRun {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stdout = self.stdout.take().unwrap().join().unwrap_or_default();
        // The stderr reader ends with the pipe, closed at the exit.
        std::thread::sleep(Duration::from_millis(20));
        let stderr = self.stderr.lock().unwrap().clone();
        GoRun {
            args: self.args.clone(),
            status,
            stdout,
            stderr,
        }
    }
}

impl Drop for GoClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `meshca-gospiffe` with `args` plus `--socket` and `--timeout`
/// (`go_timeout`); the test gives it 30 s more before killing it.
fn run(bin: &Path, socket: &Path, args: &[&str], go_timeout: Duration) -> GoRun {
    let socket = socket.display().to_string();
    let timeout = format!("{}s", go_timeout.as_secs());
    let mut all = args.to_vec();
    all.extend_from_slice(&["--socket", &socket, "--timeout", &timeout]);
    GoClient::start(bin, &all).finish(go_timeout + Duration::from_secs(30))
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// SHA-256 of each root of a PEM bundle, hex, as the Go side prints them.
fn fingerprints(pem: &str) -> Vec<String> {
    parse_certs_pem(pem)
        .unwrap()
        .iter()
        .map(|der| {
            Sha256::digest(der)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        })
        .collect()
}

/// Checks a `bundles` array of the Go side's JSON: one bundle, the
/// trust domain `cluster.local`, exactly the roots of `roots`.
fn check_bundles(bundles: &Value, roots: &[String], what: &str) {
    let bundles = bundles.as_array().unwrap();
    assert_eq!(bundles.len(), 1, "{what}: one trust domain: {bundles:?}");
    let bundle = &bundles[0];
    assert_eq!(bundle["trust_domain"], "cluster.local", "{what}: {bundle}");
    assert_eq!(
        bundle["roots"].as_u64(),
        Some(roots.len() as u64),
        "{what}: {bundle}"
    );
    let served: Vec<String> = bundle["root_sha256"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    assert_eq!(served, roots, "{what}: the server's root-cert.pem");
}

/// Checks one SVID of the Go side's JSON: `WEB`, verified by
/// `x509svid.Verify`, the leaf alone in the chain (the embedded CA's root
/// signs it directly; roots are in the bundle, not the chain), the path
/// leaf → root, an ECDSA key, a lifetime of the `--ttl` asked for, and
/// unexpired when it was served (`served_from`).
fn check_svid(svid: &Value, served_from: i64, what: &str) {
    assert_eq!(svid["spiffe_id"], WEB, "{what}: {svid}");
    assert_eq!(svid["verified"], true, "{what}: {svid}");
    assert_eq!(svid["chain_length"], 1, "{what}: {svid}");
    assert_eq!(svid["verified_chain_length"], 2, "{what}: {svid}");
    assert_eq!(svid["key_type"], "*ecdsa.PrivateKey", "{what}: {svid}");
    assert_eq!(svid["hint"], "", "{what}: {svid}");
    let not_before = svid["not_before_unix"].as_i64().unwrap();
    let not_after = svid["not_after_unix"].as_i64().unwrap();
    // The CA backdates notBefore by a tenth of the lifetime (whole seconds).
    let lifetime = not_after - not_before;
    assert!(
        (TTL_SECONDS..=TTL_SECONDS + TTL_SECONDS / 10).contains(&lifetime),
        "{what}: a lifetime of {lifetime} s: {svid}"
    );
    assert!(
        not_after >= served_from && not_after <= unix_now() + TTL_SECONDS,
        "{what}: notAfter {not_after}, served at {served_from}..{}: {svid}",
        unix_now()
    );
}

/// Starts meshca (embedded mode) and writes its root where the agents
/// read it; returns the server and its roots' fingerprints.
fn start_server(dir: &Path) -> (MeshcaServer, Vec<String>) {
    let server = MeshcaServer::start(&dir.join("data"), &[]).unwrap_or_else(|f| panic!("{f:?}"));
    let root_pem = server.root_pem();
    std::fs::write(dir.join("root-cert.pem"), &root_pem).unwrap();
    let roots = fingerprints(&root_pem);
    assert_eq!(roots.len(), 1, "the embedded CA has one root");
    (server, roots)
}

#[test]
fn go_spiffe_reads_svids_bundles_and_rotations() {
    let Some(go) = gospiffe() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (server, roots) = start_server(dir.path());
    let socket = dir.path().join("uds/agent.sock");
    let ttl = format!("{TTL_SECONDS}s");
    let agent = Agent::start(&server, dir.path(), "agent", &socket, &["--ttl", &ttl]);
    let go_timeout = Duration::from_secs(30);

    // FetchX509Context: one SVID, verified against its bundle, the bundle
    // the server's root.
    let served_from = unix_now();
    let fetched = run(&go, &socket, &["x509", "--expect-id", WEB], go_timeout).json(&agent);
    assert_eq!(fetched["api"], "FetchX509Context");
    let svids = fetched["svids"].as_array().unwrap();
    assert_eq!(svids.len(), 1, "{fetched}");
    check_svid(&svids[0], served_from, "FetchX509Context");
    check_bundles(&fetched["bundles"], &roots, "FetchX509Context");

    // NewX509Source (a stream held open) and an mTLS handshake between
    // go-spiffe's server and client configurations on its SVID and bundle.
    let served_from = unix_now();
    let sourced = run(
        &go,
        &socket,
        &["x509", "--source", "--mtls", "--expect-id", WEB],
        go_timeout,
    )
    .json(&agent);
    assert_eq!(sourced["api"], "X509Source");
    check_svid(&sourced["svids"][0], served_from, "X509Source");
    check_bundles(&sourced["bundles"], &roots, "X509Source");
    assert_eq!(sourced["mtls_handshake"], true, "{sourced}");

    // FetchX509Bundles: the same root, keyed by the trust domain.
    let bundles = run(&go, &socket, &["bundles"], go_timeout).json(&agent);
    assert_eq!(bundles["api"], "FetchX509Bundles");
    check_bundles(&bundles["bundles"], &roots, "FetchX509Bundles");

    // Rotation on one stream: three answers (the first at once, then one per
    // renewal at about half of the 8 s lifetime), each a new certificate
    // (no answer repeats one), each verified, with no watch error.
    let started = unix_now();
    let watched = run(
        &go,
        &socket,
        &["watch", "--updates", "3", "--expect-id", WEB],
        Duration::from_secs(45),
    )
    .json(&agent);
    let updates = watched["updates"].as_array().unwrap();
    assert_eq!(updates.len(), 3, "{watched}");
    assert_eq!(
        watched["distinct_serials"], 3,
        "a new serial each time: {watched}"
    );
    assert_eq!(watched["watch_errors"], serde_json::json!([]), "{watched}");
    for (i, update) in updates.iter().enumerate() {
        check_svid(&update["svid"], started, &format!("watch update {}", i + 1));
        check_bundles(
            &update["bundles"],
            &roots,
            &format!("watch update {}", i + 1),
        );
    }
    let not_afters: Vec<i64> = updates
        .iter()
        .map(|u| u["svid"]["not_after_unix"].as_i64().unwrap())
        .collect();
    assert!(
        not_afters.windows(2).all(|w| w[0] <= w[1]),
        "each rotation lives at least as long as the last: {not_afters:?}"
    );

    // JWT: go-spiffe fetches (and parses, checking `sub` and `aud`) a
    // JWT-SVID for the caller's identity, and the JWT bundles.
    let jwt = run(
        &go,
        &socket,
        &["jwt", "--audience", "meshca-test"],
        go_timeout,
    )
    .json(&agent);
    assert_eq!(jwt["fetch_jwt_svid"]["code"], "OK", "{jwt}");
    assert_eq!(jwt["jwt_spiffe_id"], WEB, "{jwt}");
    assert_eq!(jwt["fetch_jwt_bundles"]["code"], "OK", "{jwt}");

    // So go-spiffe's BundleSource, which waits for the JWT bundles as well
    // as the X.509 context, becomes ready on this socket.
    let bundle_source = run(&go, &socket, &["bundle-source"], go_timeout).json(&agent);
    assert_eq!(bundle_source["ready"], true, "{bundle_source}");
    assert!(!bundle_source["bundles"].is_null(), "{bundle_source}");
}

#[test]
fn go_spiffe_watch_moves_to_the_next_agent() {
    let Some(go) = gospiffe() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (server, roots) = start_server(dir.path());
    let socket = dir.path().join("agent.sock");
    let mut first = Agent::start(&server, dir.path(), "first", &socket, &[]);

    // One watch across an agent's stop (SIGTERM: open streams end with
    // UNAVAILABLE, the socket file is removed) and the next agent's start
    // on the same socket: go-spiffe reconnects with its backoff (1 s, 2 s,
    // …) and gets the next agent's certificate.
    let socket_arg = socket.display().to_string();
    let watch = GoClient::start(
        &go,
        &[
            "watch",
            "--socket",
            &socket_arg,
            "--updates",
            "2",
            "--expect-id",
            WEB,
            "--timeout",
            "60s",
        ],
    );
    watch.wait_for_line(
        "meshca-gospiffe: watch: update 1 ",
        Duration::from_secs(30),
        &first,
    );
    let status = first.terminate();
    assert!(status.success(), "{status}:\n{}", first.log());
    assert!(!socket.exists(), "a stopped agent removes its socket");
    watch.wait_for_line(
        "meshca-gospiffe: watch: error ",
        Duration::from_secs(30),
        &first,
    );
    let second = Agent::start(&server, dir.path(), "second", &socket, &[]);
    let watched = watch.finish(Duration::from_secs(90)).json(&second);

    let updates = watched["updates"].as_array().unwrap();
    assert_eq!(updates.len(), 2, "{watched}");
    assert_eq!(
        watched["distinct_serials"], 2,
        "the next agent's own certificate: {watched}"
    );
    for update in updates {
        assert_eq!(update["svid"]["spiffe_id"], WEB, "{watched}");
        assert_eq!(update["svid"]["verified"], true, "{watched}");
        check_bundles(&update["bundles"], &roots, "across the restart");
    }
    let errors: Vec<&str> = watched["watch_errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert!(
        errors.first().is_some_and(|e| e.contains("Unavailable")),
        "the stream ended with UNAVAILABLE: {errors:?}"
    );
    drop(first);
}
