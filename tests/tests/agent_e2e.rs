//! End-to-end tests of the agent library and `meshca-agent`: a scripted
//! fake CA for bad answers, the real `meshca` for rotation and recovery.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshca_certs::bundle::parse_certs_pem;
use meshca_certs::inspect::CertSummary;
use meshca_certs::{KeyAlgorithm, PrivateKey, SpiffeId};
use meshca_client::{CaClient, CaClientConfig, ClientError, RequestOptions};
use meshca_tests::fake_ca::{FakeAnswer, FakeCa};
use meshca_tests::*;

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";

fn client_for(addr: &str, root: &Path, token: Option<&Path>, attempts: u32) -> CaClient {
    CaClient::new(CaClientConfig {
        ca_addr: addr.to_string(),
        root_cert: root.to_path_buf(),
        server_name: None,
        token_file: token.map(Path::to_path_buf),
        cluster_id: None,
        timeout: Duration::from_secs(5),
        request: RequestOptions {
            attempts,
            retry_backoff: Duration::from_millis(50),
            ..Default::default()
        },
    })
    .unwrap()
}

#[tokio::test]
async fn bad_answers_are_refused() {
    let fake = FakeCa::start(FakeAnswer::Good).await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root.pem");
    std::fs::write(&root, &fake.root_pem).unwrap();
    let client = client_for(&format!("https://{}", fake.addr), &root, None, 1);
    let id = SpiffeId::parse(WEB).unwrap();
    let svid = client
        .fetch(&id, KeyAlgorithm::EcdsaP256, None, false)
        .await
        .expect("good answer");
    assert_eq!(svid.leaf.spiffe_id, id);

    for (answer, needle) in [
        (FakeAnswer::WrongKey, "not the key we sent"),
        (FakeAnswer::WrongSan, "not the expected"),
        (FakeAnswer::CaAsLeaf, "CA"),
        (FakeAnswer::ForeignRoot, "does not chain"),
        (FakeAnswer::Expired, "expired"),
        (FakeAnswer::EmptyChain, "empty"),
    ] {
        fake.answer(answer);
        match client
            .fetch(&id, KeyAlgorithm::EcdsaP256, None, false)
            .await
        {
            Err(ClientError::BadAnswer(message)) => {
                assert!(message.contains(needle), "{answer:?}: {message}")
            }
            other => panic!("{answer:?} must be refused, got {other:?}"),
        }
    }

    // Retryable codes are retried; others are not (counted at the fake CA).
    fake.answer(FakeAnswer::Error(tonic::Code::PermissionDenied));
    let retrying = client_for(&format!("https://{}", fake.addr), &root, None, 3);
    let before = fake.requests();
    match retrying
        .fetch(&id, KeyAlgorithm::EcdsaP256, None, false)
        .await
    {
        Err(ClientError::Rpc { code, .. }) => assert_eq!(code, tonic::Code::PermissionDenied),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        fake.requests() - before,
        1,
        "PERMISSION_DENIED is not retried"
    );
    fake.answer(FakeAnswer::Error(tonic::Code::Unavailable));
    let before = fake.requests();
    let started = Instant::now();
    assert!(retrying
        .fetch(&id, KeyAlgorithm::EcdsaP256, None, false)
        .await
        .is_err());
    assert_eq!(
        fake.requests() - before,
        3,
        "UNAVAILABLE is retried up to the attempt limit"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "with backoff between attempts (50 + 100 ms)"
    );
}

fn start_agent(server: &MeshcaServer, dir: &Path, ttl: &str) -> Child {
    let token = dir.join("token");
    std::fs::write(&token, server.token("default", "web")).unwrap();
    Command::new(&binaries().meshca_agent)
        .args([
            "--ca-addr",
            &format!("https://{}", server.grpc),
            "--root-cert",
            &server.data_dir.join("root-cert.pem").display().to_string(),
            "--token-file",
            &token.display().to_string(),
            "--spiffe-id",
            WEB,
            "--ttl",
            ttl,
            "--out",
            &dir.join("out").display().to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("agent.log")).unwrap())
        .spawn()
        .unwrap()
}

/// Reads the output directory like an application would: the key, then the
/// chain. Returns the leaf serial, or why the pair is unusable.
fn read_pair(out: &Path) -> Result<String, String> {
    let key_text = std::fs::read_to_string(out.join("key.pem")).map_err(|e| format!("key: {e}"))?;
    let chain_text =
        std::fs::read_to_string(out.join("cert-chain.pem")).map_err(|e| format!("chain: {e}"))?;
    let key = PrivateKey::from_pem(&key_text).map_err(|e| format!("half-written key: {e}"))?;
    let chain = parse_certs_pem(&chain_text).map_err(|e| format!("half-written chain: {e}"))?;
    let leaf_spki = meshca_certs::inspect::spki_der(&chain[0]).ok_or("leaf without key")?;
    if leaf_spki != key.public_key_spki_der() {
        return Err("mismatch".into());
    }
    Ok(CertSummary::from_der(&chain[0])
        .map_err(|e| e.to_string())?
        .serial)
}

struct KillOnDrop(Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn agent_rotates_files_that_are_never_half_written() {
    let (dir, server) = {
        let dir = tempfile::tempdir().unwrap();
        let server = MeshcaServer::start(&dir.path().join("data"), &[]).unwrap();
        (dir, server)
    };
    let _agent = KillOnDrop(start_agent(&server, dir.path(), "20s"));
    let out = dir.path().join("out");
    let stop = Arc::new(AtomicBool::new(false));
    let broken = Arc::new(AtomicUsize::new(0));
    // How many distinct certificates the reader has seen, as an event.
    let (seen_tx, mut seen) = tokio::sync::watch::channel(0usize);
    let reader = {
        let (out, stop, broken) = (out.clone(), stop.clone(), broken.clone());
        std::thread::spawn(move || {
            let mut serials = Vec::<String>::new();
            let mut reads = 0;
            while !stop.load(Ordering::Relaxed) {
                if out.join("cert-chain.pem").exists() {
                    reads += 1;
                    // A reader that straddles the back-to-back renames of a
                    // rotation can see the new key with the old chain;
                    // reading again a moment later resolves it. Half-written
                    // files are never acceptable.
                    let mut result = read_pair(&out);
                    for _ in 0..3 {
                        match &result {
                            Err(e) if e == "mismatch" => {
                                std::thread::sleep(Duration::from_millis(5));
                                result = read_pair(&out);
                            }
                            _ => break,
                        }
                    }
                    // Read through `..data` resolved once, both files come
                    // from one generation: never a mismatch, with no re-read.
                    // (The generation can be removed under a reader two
                    // rotations later; then the read fails and is retried.)
                    if let Ok(generation) = std::fs::read_link(out.join("..data")) {
                        match read_pair(&out.join(generation)) {
                            Err(e) if e != "mismatch" && e.contains("No such file") => {}
                            Err(e) => {
                                eprintln!("unusable read through ..data: {e}");
                                broken.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(_) => {}
                        }
                    }
                    match result {
                        Ok(serial) => {
                            if serials.last() != Some(&serial) {
                                serials.push(serial);
                                let _ = seen_tx.send(serials.len());
                            }
                        }
                        Err(e) => {
                            eprintln!("unusable read: {e}");
                            broken.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            (serials, reads)
        })
    };
    // 20 s certificates renew at about 10 s: expect two rotations within 40 s,
    // as the reader sees them (not as the log says: the reader may not have
    // read the second one yet when its line is written).
    let _ = tokio::time::timeout(Duration::from_secs(40), seen.wait_for(|n| *n >= 3)).await;
    stop.store(true, Ordering::Relaxed);
    let (serials, reads) = reader.join().unwrap();
    assert!(
        serials.len() >= 3,
        "initial + 2 rotations within 40 s, saw {serials:?}"
    );
    // The loop ends at the second rotation (about 20 s); the reader polls
    // every 50 ms, slower when the machine is busy.
    assert!(reads >= 20, "the reader polled ({reads} reads)");
    assert_eq!(
        broken.load(Ordering::Relaxed),
        0,
        "no half-written or mismatched reads"
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(out.join("key.pem"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
}

#[tokio::test]
async fn agent_recovers_after_the_ca_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut server = MeshcaServer::start(&data, &[]).unwrap();
    let (grpc, monitoring) = (server.grpc, server.monitoring);
    let _agent = KillOnDrop(start_agent(&server, dir.path(), "20s"));
    let out = dir.path().join("out");
    let first = wait_for(|| read_pair(&out).ok(), Duration::from_secs(20))
        .await
        .expect("first certificate");
    assert!(server.terminate().is_some_and(|s| s.success()));
    // At least one renewal (due at ~10 s) fails against the stopped CA.
    let agent_log = || std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();
    let failed = wait_for(
        || agent_log().contains("failed").then_some(()),
        Duration::from_secs(30),
    )
    .await;
    assert!(
        failed.is_some(),
        "renewal failed while the CA was down:\n{}",
        agent_log()
    );
    assert_eq!(
        read_pair(&out).ok().as_ref(),
        Some(&first),
        "the still-valid certificate stays"
    );
    let _server = MeshcaServer::start_on(&data, grpc, monitoring, &[], &[]).unwrap();
    let recovered = wait_for(
        || read_pair(&out).ok().filter(|s| *s != first),
        Duration::from_secs(40),
    )
    .await;
    assert!(
        recovered.is_some(),
        "the agent got a new certificate after the CA came back"
    );
}

async fn wait_for<T>(mut f: impl FnMut() -> Option<T>, limit: Duration) -> Option<T> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(v) = f() {
            return Some(v);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

#[tokio::test]
async fn agent_once_fails_clearly_without_a_ca() {
    let dir = tempfile::tempdir().unwrap();
    let (_d, server) = {
        let d = tempfile::tempdir().unwrap();
        let s = MeshcaServer::start(&d.path().join("data"), &[]).unwrap();
        (d, s)
    };
    let token = dir.path().join("token");
    std::fs::write(&token, "not-a-token").unwrap();
    let output = Command::new(&binaries().meshca_agent)
        .args([
            "--ca-addr",
            &format!("https://{}", server.grpc),
            "--root-cert",
            &server.data_dir.join("root-cert.pem").display().to_string(),
            "--token-file",
            &token.display().to_string(),
            "--spiffe-id",
            WEB,
            "--out",
            &dir.path().join("out").display().to_string(),
            "--once",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("Unauthenticated"), "{stderr}");
    // The refusal names the file the token came from, never the token.
    assert!(
        stderr.contains(&format!("(the token read from {})", token.display()))
            && !stderr.contains("not-a-token"),
        "{stderr}"
    );
    assert!(!dir.path().join("out").join("key.pem").exists());
}
