//! The CA key in an HSM, end to end: a real SoftHSM2 token initialised in
//! a temporary directory, keys made in it by `meshca-certs --pkcs11`, and
//! `meshca serve --ca-key-pkcs11` in both modes, chains checked with
//! openssl. Without SoftHSM2 (Debian's `softhsm2`) or openssl the tests
//! say so and skip; with `CI` set they fail (`.ci/run` installs both).

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use meshca_certs::bundle::parse_certs_pem;
use meshca_certs::keys::{KeyAlgorithm, PrivateKey};
use meshca_certs::profile::{self_signed_root, SigningCa, SubjectKey, SubjectName, Validity};
use meshca_certs::SpiffeId;
use meshca_tests::*;
use time::OffsetDateTime;
use tonic::Code;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::{FromDer, X509Certificate};

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";
const PIN: &str = "4711";

/// Where Debian (and the softhsm2 package elsewhere) installs the module.
const MODULE_PATHS: [&str; 3] = [
    "/usr/lib/softhsm/libsofthsm2.so",
    "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
    "/usr/local/lib/softhsm/libsofthsm2.so",
];

/// A SoftHSM2 token of its own, in a temporary directory.
struct SoftHsm {
    dir: tempfile::TempDir,
    conf: PathBuf,
    module: PathBuf,
}

impl SoftHsm {
    /// A fresh token labelled `meshca` with user PIN [`PIN`], or None
    /// (and a line saying why) when SoftHSM2 is not installed.
    fn new() -> Option<Self> {
        let module = MODULE_PATHS.iter().map(PathBuf::from).find(|p| p.is_file());
        if !tool_available("softhsm2-util", &["--version"]) || module.is_none() {
            if std::env::var_os("CI").is_some() {
                panic!("the SoftHSM2 module is needed by this test and is not installed (CI is set; `.ci/run` installs softhsm2)");
            }
            eprintln!("SKIPPED: SoftHSM2 (softhsm2-util and libsofthsm2.so) is not installed");
            return None;
        }
        if !have_openssl() {
            eprintln!("SKIPPED: openssl is not installed");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let tokens = dir.path().join("tokens");
        std::fs::create_dir(&tokens).unwrap();
        let conf = dir.path().join("softhsm2.conf");
        std::fs::write(
            &conf,
            format!(
                "directories.tokendir = {}\nobjectstore.backend = file\nlog.level = ERROR\n",
                tokens.display()
            ),
        )
        .unwrap();
        std::fs::write(dir.path().join("pin"), format!("{PIN}\n")).unwrap();
        std::fs::write(dir.path().join("wrong-pin"), "999999\n").unwrap();
        let hsm = Self {
            dir,
            conf,
            module: module.unwrap(),
        };
        run_ok(hsm.command("softhsm2-util").args([
            "--init-token",
            "--free",
            "--label",
            "meshca",
            "--pin",
            PIN,
            "--so-pin",
            "123456",
        ]));
        Some(hsm)
    }

    /// A command with `SOFTHSM2_CONF` pointing at this token.
    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new(program);
        command.env("SOFTHSM2_CONF", &self.conf);
        command
    }

    /// The URI of the key labelled `object`, PIN from the `pin` file.
    fn uri(&self, object: &str) -> String {
        self.uri_with_pin_file(object, "pin")
    }

    fn uri_with_pin_file(&self, object: &str, pin_file: &str) -> String {
        format!(
            "pkcs11:token=meshca;object={object}?module-path={}&pin-source=file:{}",
            self.module.display(),
            self.dir.path().join(pin_file).display()
        )
    }

    fn env(&self) -> [(&str, &str); 1] {
        [("SOFTHSM2_CONF", self.conf.to_str().unwrap())]
    }

    /// `meshca-certs ARGS` against this token; its stdout.
    fn certs(&self, args: &[&str]) -> String {
        run_ok(self.command(&binaries().meshca_certs).args(args))
    }

    /// Takes the token away (its directory moved aside), as a removed
    /// token or an unplugged HSM.
    fn remove_token(&self) {
        std::fs::rename(
            self.dir.path().join("tokens"),
            self.dir.path().join("tokens.gone"),
        )
        .unwrap();
    }

    /// A root CA whose key `meshca-certs root-ca --pkcs11` made in this
    /// token (object `root`), its certificate in `dir/root`: the directory
    /// and the key's URI.
    fn root_ca(&self, dir: &Path) -> (PathBuf, String) {
        let root = dir.join("root");
        let uri = self.uri("root");
        self.certs(&["root-ca", "--out", path(&root), "--pkcs11", &uri]);
        (root, uri)
    }

    /// Puts the token taken away by [`Self::remove_token`] back.
    fn restore_token(&self) {
        std::fs::rename(
            self.dir.path().join("tokens.gone"),
            self.dir.path().join("tokens"),
        )
        .unwrap();
    }
}

/// Starts meshca with this token's environment off the async runtime (a
/// fake API server on the test's runtime answers meshca while it starts).
async fn start_off_runtime_with(
    hsm: &SoftHsm,
    data: PathBuf,
    args: Vec<String>,
) -> Result<MeshcaServer, StartFailure> {
    let env: Vec<(String, String)> = hsm
        .env()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        MeshcaServer::start_with_env(&data, &args, &env)
    })
    .await
    .expect("start task")
}

fn pem_block(tag: &str, der: &[u8]) -> String {
    pem::encode(&pem::Pem::new(tag, der.to_vec()))
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ders(chain: &[String]) -> Vec<Vec<u8>> {
    chain
        .iter()
        .flat_map(|pem| parse_certs_pem(pem).unwrap())
        .collect()
}

/// `openssl verify` of `leaf` with `untrusted` intermediates to `roots`:
/// its output, and whether it verified.
fn openssl_verify(dir: &Path, roots: &[u8], untrusted: &[&[u8]], leaf: &[u8]) -> (bool, String) {
    let write = |name: &str, certs: &[&[u8]]| {
        let p = dir.join(name);
        let pem: String = certs
            .iter()
            .map(|der| pem_block("CERTIFICATE", der))
            .collect();
        std::fs::write(&p, pem).unwrap();
        p
    };
    let roots = write("v-roots.pem", &[roots]);
    let leaf = write("v-leaf.pem", &[leaf]);
    let mut command = Command::new("openssl");
    command
        .arg("verify")
        .arg("-x509_strict")
        .arg("-CAfile")
        .arg(&roots);
    if !untrusted.is_empty() {
        command
            .arg("-untrusted")
            .arg(write("v-untrusted.pem", untrusted));
    }
    let out = command.arg(&leaf).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The hosts a CA certificate's nameConstraints permit for URIs, and
/// whether the extension is critical (None: no such extension).
fn permitted_uri_hosts(cert: &X509Certificate<'_>) -> Option<(bool, Vec<String>)> {
    cert.extensions()
        .iter()
        .find_map(|ext| match ext.parsed_extension() {
            ParsedExtension::NameConstraints(nc) => {
                let hosts = nc
                    .permitted_subtrees
                    .iter()
                    .flatten()
                    .filter_map(|s| match &s.base {
                        GeneralName::URI(host) => Some(host.to_string()),
                        _ => None,
                    })
                    .collect();
                Some((ext.critical, hosts))
            }
            _ => None,
        })
}

fn start(hsm: &SoftHsm, data: &Path, args: &[&str]) -> MeshcaServer {
    MeshcaServer::start_with_env(data, args, &hsm.env())
        .unwrap_or_else(|f| panic!("meshca did not start: {f:?}"))
}

#[tokio::test]
async fn intermediate_mode_signs_leaves_under_a_name_constrained_intermediate_the_hsm_key_signed() {
    let Some(hsm) = SoftHsm::new() else { return };
    let work = tmp();
    let root = work.path().join("root");
    let uri = hsm.uri("root");
    let made = hsm.certs(&["root-ca", "--out", path(&root), "--pkcs11", &uri]);
    assert!(made.contains("the key is in the token"), "{made}");
    // Only the certificate is written.
    let files: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(files, ["root-cert.pem"]);
    // The key never leaves the token: CKA_EXTRACTABLE false, sensitive.
    let shown = hsm.certs(&[
        "inspect",
        path(&root.join("root-cert.pem")),
        "--pkcs11",
        &uri,
    ]);
    assert!(shown.contains(&format!("key in HSM:   {uri}")), "{shown}");
    assert!(
        shown.contains("sensitive, not extractable, always sensitive, never extractable"),
        "{shown}"
    );

    let server = start(
        &hsm,
        &work.path().join("data"),
        &["--ca-dir", path(&root), "--ca-key-pkcs11", &uri],
    );
    let root_der = std::fs::read_to_string(root.join("root-cert.pem")).unwrap();
    let root_der = parse_certs_pem(&root_der).unwrap().remove(0);
    let token = server.token("default", "web");
    let mut intermediates = vec![];
    for _ in 0..2 {
        let chain = ask(&server, &token, WEB).await.unwrap();
        // [leaf, the in-memory intermediate, the root].
        assert_eq!(chain.len(), 3, "{chain:?}");
        let certs = ders(&chain);
        assert_eq!(certs[2], root_der);
        let (_, int) = X509Certificate::from_der(&certs[1]).unwrap();
        let (_, root_cert) = X509Certificate::from_der(&root_der).unwrap();
        assert_eq!(int.issuer().as_raw(), root_cert.subject().as_raw());
        let bc = int.basic_constraints().unwrap().unwrap().value;
        assert!(bc.ca && bc.path_len_constraint == Some(0), "{bc:?}");
        assert_eq!(
            permitted_uri_hosts(&int),
            Some((true, vec!["cluster.local".to_string()])),
            "a critical URI name constraint for the trust domain"
        );
        let lifetime = int.validity().not_after.timestamp() - int.validity().not_before.timestamp();
        assert_eq!(lifetime, 24 * 3600 + 120, "24 h plus the 2 min backdate");
        let (ok, out) = openssl_verify(work.path(), &root_der, &[&certs[1]], &certs[0]);
        assert!(ok, "openssl verify: {out}");
        // meshca's own verifier (the agent's) checks the URI constraint
        // that webpki alone refuses.
        meshca_certs::verify::verify_svid(
            &certs,
            &meshca_certs::TrustBundle::new(vec![root_der.clone()]),
            std::time::SystemTime::now(),
            Some(&SpiffeId::parse(WEB).unwrap()),
        )
        .unwrap();
        intermediates.push(certs[1].clone());
    }
    // Leaves are signed in memory: one intermediate for both.
    assert_eq!(intermediates[0], intermediates[1]);
    let (code, ready) = http_get(server.monitoring, "/ready").unwrap();
    assert_eq!((code, ready.trim()), (200, "ready"));
    drop(server);

    // `--hsm-name-constraint false` (for rustls-webpki peers such as
    // ztunnel): no name constraint, and plain webpki verifies the chain.
    let server = start(
        &hsm,
        &work.path().join("data2"),
        &[
            "--ca-dir",
            path(&root),
            "--ca-key-pkcs11",
            &uri,
            "--hsm-name-constraint",
            "false",
        ],
    );
    let chain = ders(
        &ask(&server, &server.token("default", "web"), WEB)
            .await
            .unwrap(),
    );
    let (_, int) = X509Certificate::from_der(&chain[1]).unwrap();
    assert_eq!(permitted_uri_hosts(&int), None);
    meshca_certs::verify::verify_svid(
        &chain[..2],
        &meshca_certs::TrustBundle::new(vec![root_der.clone()]),
        std::time::SystemTime::now(),
        Some(&SpiffeId::parse(WEB).unwrap()),
    )
    .unwrap();
    let (code, ready) = http_get(server.monitoring, "/ready").unwrap();
    assert_eq!((code, ready.trim()), (200, "ready"));
}

/// The name constraint as openssl enforces it: an intermediate made by
/// the same code ([`SigningCa::issue_constrained_ca`]) cannot make a leaf
/// of another trust domain that verifies.
#[test]
fn openssl_refuses_a_leaf_outside_the_constrained_trust_domain() {
    if !have_openssl() {
        eprintln!("SKIPPED: openssl is not installed");
        return;
    }
    let work = tmp();
    let now = OffsetDateTime::now_utc();
    let root_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let name = |cn: &str| SubjectName {
        common_name: Some(cn.into()),
        ..Default::default()
    };
    let validity = Validity::backdated(now, time::Duration::hours(1));
    let root = self_signed_root(&root_key, &name("root"), validity).unwrap();
    let root_ca = SigningCa::new(root.der.clone(), root_key).unwrap();
    let int_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let int = root_ca
        .issue_constrained_ca(
            &SubjectKey::of(&int_key).unwrap(),
            &name("int"),
            Some(0),
            &["cluster.local"],
            validity,
        )
        .unwrap();
    let int_ca = SigningCa::new(int.der.clone(), int_key).unwrap();
    let leaf_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let leaf_of = |id: &str| {
        int_ca
            .issue_workload(
                &SubjectKey::of(&leaf_key).unwrap(),
                &SpiffeId::parse(id).unwrap(),
                validity,
            )
            .unwrap()
            .der
    };
    let (ok, out) = openssl_verify(work.path(), &root.der, &[&int.der], &leaf_of(WEB));
    assert!(ok, "inside the trust domain: {out}");
    // webpki alone (rustls: ztunnel) fails closed on URI name
    // constraints, which is why `--hsm-name-constraint false` exists;
    // meshca's own verifier (the agent's) checks them by RFC 5280's rule.
    let verify = |leaf: Vec<u8>| {
        meshca_certs::verify::verify_svid(
            &[leaf, int.der.clone()],
            &meshca_certs::TrustBundle::new(vec![root.der.clone()]),
            std::time::SystemTime::now(),
            None,
        )
    };
    verify(leaf_of(WEB)).unwrap();
    let outside = verify(leaf_of("spiffe://evil.example/ns/default/sa/web")).unwrap_err();
    assert!(
        outside.to_string().contains("outside the URI names"),
        "{outside}"
    );
    let (ok, out) = openssl_verify(
        work.path(),
        &root.der,
        &[&int.der],
        &leaf_of("spiffe://evil.example/ns/default/sa/web"),
    );
    assert!(!ok, "another trust domain verified: {out}");
    assert!(out.contains("permitted subtree violation"), "{out}");
}

#[tokio::test]
async fn direct_mode_signs_every_leaf_with_the_hsm_key_and_refuses_beyond_its_queue() {
    let Some(hsm) = SoftHsm::new() else { return };
    let work = tmp();
    let root = work.path().join("root");
    let root_uri = hsm.uri("root");
    hsm.certs(&["root-ca", "--out", path(&root), "--pkcs11", &root_uri]);
    // The plugged-in intermediate's key in the token too (RSA), signed by
    // the root's key in the token; only certificates are written.
    let east_uri = hsm.uri("east");
    hsm.certs(&[
        "intermediate-ca",
        "--root",
        path(&root),
        "--root-pkcs11",
        &root_uri,
        "--cluster",
        "east",
        "--out",
        path(work.path()),
        "--key",
        "rsa-4096",
        "--pkcs11",
        &east_uri,
    ]);
    let east = work.path().join("east");
    assert!(!east.join("ca-key.pem").exists());
    let shown = hsm.certs(&[
        "inspect",
        path(&east.join("ca-cert.pem")),
        "--pkcs11",
        &east_uri,
    ]);
    assert!(shown.contains("not extractable"), "{shown}");

    let server = start(
        &hsm,
        &work.path().join("data"),
        &[
            "--ca-dir",
            path(&east),
            "--ca-key-pkcs11",
            &east_uri,
            "--hsm-mode",
            "direct",
            "--hsm-sessions",
            "1",
            "--hsm-queue",
            "0",
        ],
    );
    let token = server.token("default", "web");
    let chain = ask(&server, &token, WEB).await.unwrap();
    // [leaf, east's certificate, the root]: no intermediate in memory.
    assert_eq!(chain.len(), 3);
    let certs = ders(&chain);
    let east_der = parse_certs_pem(&std::fs::read_to_string(east.join("ca-cert.pem")).unwrap())
        .unwrap()
        .remove(0);
    assert_eq!(certs[1], east_der);
    let (ok, out) = openssl_verify(work.path(), &certs[2], &[&certs[1]], &certs[0]);
    assert!(ok, "openssl verify: {out}");
    // The CRL is signed by the HSM key too (an empty one at start).
    let crl_file = work.path().join("data").join("ca-crl.pem");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !crl_file.exists() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let crl = meshca_certs::crl::ParsedCrl::from_pem(
        &std::fs::read_to_string(&crl_file).expect("ca-crl.pem in direct mode"),
    )
    .unwrap();
    crl.verify(&east_der, time::OffsetDateTime::now_utc())
        .expect("the CRL verifies with east's certificate");
    assert!(crl.revoked.is_empty());

    // One session, no queue: requests at once beyond it are refused
    // RESOURCE_EXHAUSTED, the rest issued.
    let mut asks = tokio::task::JoinSet::new();
    for _ in 0..24 {
        let (grpc, token) = (server.client().await, token.clone());
        asks.spawn(async move {
            let mut client = grpc;
            let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
            client
                .create_certificate(with_token(request, &token))
                .await
                .map(|_| ())
        });
    }
    let (mut issued, mut refused) = (0, 0);
    while let Some(result) = asks.join_next().await {
        match result.unwrap() {
            Ok(()) => issued += 1,
            Err(status) if status.code() == Code::ResourceExhausted => {
                assert!(status.message().contains("HSM"), "{status:?}");
                refused += 1;
            }
            Err(status) => panic!("unexpected {status:?}"),
        }
    }
    assert!(
        issued >= 1 && refused >= 1,
        "issued {issued}, refused {refused}"
    );
}

#[tokio::test]
async fn a_wrong_pin_a_missing_key_or_a_key_file_beside_are_refused_at_start_naming_the_uri() {
    let Some(hsm) = SoftHsm::new() else { return };
    let work = tmp();
    let root = work.path().join("root");
    hsm.certs(&[
        "root-ca",
        "--out",
        path(&root),
        "--pkcs11",
        &hsm.uri("root"),
    ]);
    let refused = |uri: &str, expected: &str| {
        let data = work.path().join("data");
        match MeshcaServer::start_with_env(
            &data,
            &["--ca-dir", path(&root), "--ca-key-pkcs11", uri],
            &hsm.env(),
        ) {
            Ok(server) => panic!("meshca started with {uri}:\n{}", server.log()),
            Err(f) => {
                assert!(f.status.is_some_and(|s| !s.success()), "{f:?}");
                assert!(f.stderr.contains(uri), "names the URI: {}", f.stderr);
                assert!(f.stderr.contains(expected), "{}", f.stderr);
                assert!(
                    !f.stderr.contains("999999") && !f.stderr.contains(PIN),
                    "no PIN: {}",
                    f.stderr
                );
            }
        }
    };
    refused(
        &hsm.uri_with_pin_file("root", "wrong-pin"),
        "the PIN is wrong (CKR_PIN_INCORRECT)",
    );
    refused(
        &hsm.uri("nope"),
        "the token holds no private key with object \"nope\"",
    );
    refused(
        &hsm.uri_with_pin_file("root", "no-such-pin-file"),
        "reading the PIN from",
    );
    let uri = hsm.uri("root");
    let no_token = uri.replace("token=meshca", "token=other");
    refused(&no_token, "no token matches (tokens present: \"meshca\")");
    // The PIN in the URI is refused without being repeated.
    let data = work.path().join("data");
    let with_pin = format!("{uri}&pin-value={PIN}");
    let f = MeshcaServer::start_with_env(
        &data,
        &["--ca-dir", path(&root), "--ca-key-pkcs11", &with_pin],
        &hsm.env(),
    )
    .unwrap_err();
    assert!(f.stderr.contains("pin-value=<hidden>"), "{}", f.stderr);
    assert!(
        !f.stderr.contains(&format!("pin-value={PIN}")),
        "{}",
        f.stderr
    );
    // A copy of a key next to the certificates defeats the HSM.
    std::fs::write(root.join("root-key.pem"), "not used").unwrap();
    refused(&uri, "must hold certificates only");
}

#[tokio::test]
async fn with_the_token_gone_the_current_intermediate_signs_on_until_the_margin_and_the_token_back_signs_again(
) {
    let Some(hsm) = SoftHsm::new() else { return };
    let work = tmp();
    let (root, uri) = hsm.root_ca(work.path());
    // An intermediate of 16 s, renewed at 8 s; signing stops 2 s before
    // it ends.
    let server = start(
        &hsm,
        &work.path().join("data"),
        &[
            "--ca-dir",
            path(&root),
            "--ca-key-pkcs11",
            &uri,
            "--hsm-intermediate-ttl",
            "16s",
            "--ca-expiry-margin",
            "2s",
            "--ca-dir-check-interval",
            "200ms",
        ],
    );
    let token = server.token("default", "web");
    let first = ders(&ask(&server, &token, WEB).await.unwrap())[1].clone();
    // Renewed at half its lifetime while the token is there.
    let renewed_by = Instant::now() + Duration::from_secs(12);
    let second = loop {
        let int = ders(&ask(&server, &token, WEB).await.unwrap())[1].clone();
        if int != first {
            break int;
        }
        assert!(
            Instant::now() < renewed_by,
            "no new intermediate:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let (_, second_cert) = X509Certificate::from_der(&second).unwrap();
    let second_end = second_cert.validity().not_after.timestamp();

    hsm.remove_token();
    // Past the renewal time the current intermediate still signs, /ready
    // is 200 with a warning, and the metric says the HSM is unavailable.
    let mut warned = false;
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let (code, ready) = http_get(server.monitoring, "/ready").unwrap();
        let result = ask(&server, &token, WEB).await;
        if now < second_end - 3 {
            let chain = result.unwrap_or_else(|s| panic!("refused before the margin: {s:?}"));
            assert_eq!(ders(&chain)[1], second, "the current intermediate signs on");
            assert_eq!(code, 200, "{ready}");
            if ready.contains("the HSM key cannot sign a new intermediate") {
                let (_, metrics) = http_get(server.monitoring, "/metrics").unwrap();
                assert_eq!(metric(&metrics, "meshca_hsm_unavailable"), 1);
                assert!(metric(&metrics, "meshca_hsm_intermediate_renewal_failed_count") >= 1);
                warned = true;
            }
        } else if now >= second_end - 2 {
            // Within the margin: UNAVAILABLE, and /ready says so.
            let status = result.unwrap_err();
            assert_eq!(status.code(), Code::Unavailable, "{status:?}");
            assert_eq!(code, 503, "{ready}");
            break;
        }
        assert!(
            Instant::now() < until,
            "never within the margin:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(warned, "/ready never warned:\n{}", server.log());
    let log = server.log();
    assert!(
        log.contains("the HSM could not sign a new intermediate"),
        "{log}"
    );

    // The token back: without a restart, the module is re-initialised,
    // a new intermediate signs, and the warning and the metric clear.
    hsm.restore_token();
    // The server's own TLS certificate expired with the intermediate: wait
    // for the module to be re-initialised, a new intermediate minted and
    // the server certificate renewed under it (before connecting again).
    let back_by = Instant::now() + Duration::from_secs(30);
    loop {
        let log = server.log();
        let renewed = log
            .find("the PKCS#11 module was re-initialised")
            .is_some_and(|at| log[at..].contains("renewed the server's TLS certificate"));
        let (_, metrics) = http_get(server.monitoring, "/metrics").unwrap();
        if renewed && metric(&metrics, "meshca_hsm_unavailable") == 0 {
            break;
        }
        assert!(
            Instant::now() < back_by,
            "not signing again after the token came back:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let third = ders(&ask(&server, &token, WEB).await.unwrap())[1].clone();
    assert_ne!(third, second, "a new intermediate");
    let (code, ready) = http_get(server.monitoring, "/ready").unwrap();
    assert_eq!((code, ready.trim()), (200, "ready"));
    let (_, metrics) = http_get(server.monitoring, "/metrics").unwrap();
    assert_eq!(metric(&metrics, "meshca_hsm_unavailable"), 0);
    let log = server.log();
    assert!(
        log.contains("the PKCS#11 module was re-initialised"),
        "{log}"
    );
    assert!(!log.contains(PIN), "no PIN in the log");
}

#[tokio::test]
async fn new_certificates_in_the_directory_are_taken_live_under_the_hsm_key() {
    let Some(hsm) = SoftHsm::new() else { return };
    let work = tmp();
    let (root, uri) = hsm.root_ca(work.path());
    let server = start(
        &hsm,
        &work.path().join("data"),
        &[
            "--ca-dir",
            path(&root),
            "--ca-key-pkcs11",
            &uri,
            "--ca-dir-check-interval",
            "200ms",
        ],
    );
    let token = server.token("default", "web");
    let before = ask(&server, &token, WEB).await.unwrap();
    assert_eq!(parse_certs_pem(&before[2]).unwrap().len(), 1);
    // An operator's rotation: a second root listed beside the HSM's.
    let other = work.path().join("other");
    hsm.certs(&["root-ca", "--out", path(&other)]);
    let both = format!(
        "{}{}",
        std::fs::read_to_string(root.join("root-cert.pem")).unwrap(),
        std::fs::read_to_string(other.join("root-cert.pem")).unwrap()
    );
    std::fs::write(root.join("root-cert.pem"), both).unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let chain = ask(&server, &token, WEB).await.unwrap();
        if parse_certs_pem(&chain[2]).unwrap().len() == 2 {
            // Signed under a new intermediate, by the HSM's root still.
            assert_ne!(chain[1], before[1]);
            let certs = ders(&chain);
            let (ok, out) = openssl_verify(work.path(), &certs[2], &[&certs[1]], &certs[0]);
            assert!(ok, "{out}");
            break;
        }
        assert!(Instant::now() < until, "not reloaded:\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Pod certificates (a PodCertificateRequest signed in cluster mode) come
/// from the in-memory intermediate the HSM key signed, like every answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_certificates_are_signed_under_the_intermediate_the_hsm_key_signed() {
    let Some(hsm) = SoftHsm::new() else { return };
    let work = tmp();
    let (root, uri) = hsm.root_ca(work.path());
    let kube = meshca_tests::fake_kube::FakeKube::start(work.path()).await;
    let args: Vec<String> = [
        "--kubeconfig",
        path(&kube.kubeconfig),
        "--leader-lease-duration",
        "3s",
        "--pod-certificate-signer",
        "meshca.io/spiffe",
        "--ca-dir",
        path(&root),
        "--ca-key-pkcs11",
        &uri,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let _server = start_off_runtime_with(&hsm, work.path().join("data"), args)
        .await
        .unwrap_or_else(|f| panic!("meshca did not start: {f:?}"));

    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    kube.add_pod("default", "pod-web", "uid-web", "web", "node-a");
    let request = meshca_tests::fake_certificates::PodRequest {
        namespace: "default",
        name: "web",
        signer: "meshca.io/spiffe",
        pod: ("pod-web", "uid-web", "web", "node-a"),
        max_expiration_seconds: None,
    }
    .to_json(
        &key,
        meshca_tests::fake_certificates::KeyEncoding::ProofOfPossession,
    );
    kube.create_object("podcertificaterequests", request)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let chain_pem = loop {
        let answered = kube.get_object("podcertificaterequests", "default", "web");
        if let Some(chain) = answered
            .as_ref()
            .and_then(|r| r["status"]["certificateChain"].as_str())
        {
            break chain.to_string();
        }
        assert!(Instant::now() < deadline, "not signed: {answered:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let chain = parse_certs_pem(&chain_pem).unwrap();
    assert_eq!(chain.len(), 2, "[leaf, the in-memory intermediate]");
    let root_der = parse_certs_pem(&std::fs::read_to_string(root.join("root-cert.pem")).unwrap())
        .unwrap()
        .remove(0);
    let (_, int) = X509Certificate::from_der(&chain[1]).unwrap();
    let (_, root_cert) = X509Certificate::from_der(&root_der).unwrap();
    assert_eq!(int.issuer().as_raw(), root_cert.subject().as_raw());
    assert_eq!(
        permitted_uri_hosts(&int),
        Some((true, vec!["cluster.local".to_string()]))
    );
    let (_, leaf) = X509Certificate::from_der(&chain[0]).unwrap();
    assert_eq!(leaf.public_key().raw, key.public_key_spki_der().as_slice());
    if have_openssl() {
        let (ok, out) = openssl_verify(work.path(), &root_der, &[&chain[1]], &chain[0]);
        assert!(ok, "openssl verify: {out}");
    }
    meshca_certs::verify::verify_svid(
        &chain,
        &meshca_certs::TrustBundle::new(vec![root_der]),
        std::time::SystemTime::now(),
        Some(&SpiffeId::parse(WEB).unwrap()),
    )
    .unwrap();
}

/// Without `--ca-dir`, the embedded data directory holds the HSM key's
/// root certificate only: made on first start (the key too, inside the
/// token, when it is not there yet), kept on the next; in a cluster,
/// `--ca-dir` is required.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_data_directory_keeps_only_the_root_certificate_of_the_hsm_key() {
    let Some(hsm) = SoftHsm::new() else { return };
    let work = tmp();
    let data = work.path().join("data");
    let uri = hsm.uri("embedded");
    let root_pem = {
        let server = start(&hsm, &data, &["--ca-key-pkcs11", &uri]);
        let chain = ders(
            &ask(&server, &server.token("default", "web"), WEB)
                .await
                .unwrap(),
        );
        let root_pem = std::fs::read_to_string(data.join("root-cert.pem")).unwrap();
        let root_der = parse_certs_pem(&root_pem).unwrap().remove(0);
        // [leaf, the in-memory intermediate, the root of the data directory].
        assert_eq!(chain.len(), 3, "{chain:?}");
        assert_eq!(chain[2], root_der);
        meshca_certs::verify::verify_svid(
            &chain,
            &meshca_certs::TrustBundle::new(vec![root_der]),
            std::time::SystemTime::now(),
            Some(&SpiffeId::parse(WEB).unwrap()),
        )
        .unwrap();
        for file in ["ca-key.pem", "root-key.pem", "ca-cert.pem"] {
            assert!(!data.join(file).exists(), "{file} written");
        }
        assert!(server.log().contains("made the root CA key in the token"));
        root_pem
    };
    // The key is the token's, sensitive and never extractable.
    let shown = hsm.certs(&[
        "inspect",
        path(&data.join("root-cert.pem")),
        "--pkcs11",
        &uri,
    ]);
    assert!(shown.contains("not extractable"), "{shown}");
    // Restarted: the same root, the same key, nothing made.
    let server = start(&hsm, &data, &["--ca-key-pkcs11", &uri]);
    ask(&server, &server.token("default", "web"), WEB)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(data.join("root-cert.pem")).unwrap(),
        root_pem
    );
    assert!(!server.log().contains("made the root CA key"));
    drop(server);

    // In a cluster: refused, naming what to do.
    let kube = meshca_tests::fake_kube::FakeKube::start(work.path()).await;
    let args = [
        "--kubeconfig",
        path(&kube.kubeconfig),
        "--ca-key-pkcs11",
        &uri,
    ]
    .map(String::from)
    .to_vec();
    let refused = start_off_runtime_with(&hsm, work.path().join("data-cluster"), args)
        .await
        .unwrap_err();
    assert!(
        refused
            .stderr
            .contains("--ca-key-pkcs11 in a cluster needs --ca-dir"),
        "{}",
        refused.stderr
    );
}

/// A CRL that cannot be signed again before its nextUpdate (the HSM gone,
/// direct mode) is withdrawn from the `istio-ca-crl` ConfigMaps (its key
/// removed), never served stale, and published again once the HSM is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crl_the_hsm_cannot_sign_again_is_withdrawn_from_the_configmaps_at_its_next_update() {
    let Some(hsm) = SoftHsm::new() else { return };
    let work = tmp();
    let (root, uri) = hsm.root_ca(work.path());
    let kube = meshca_tests::fake_kube::FakeKube::start(work.path()).await;
    kube.add_namespace("default");
    let args: Vec<String> = [
        "--kubeconfig",
        path(&kube.kubeconfig),
        "--leader-lease-duration",
        "3s",
        "--ca-dir",
        path(&root),
        "--ca-key-pkcs11",
        &uri,
        "--hsm-mode",
        "direct",
        "--crl-refresh",
        "1s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let server = start_off_runtime_with(&hsm, work.path().join("data"), args)
        .await
        .unwrap_or_else(|f| panic!("meshca did not start: {f:?}"));
    let crl_in_configmap = || {
        kube.get_object("configmaps", "default", "istio-ca-crl")
            .and_then(|cm| cm["data"]["ca-crl.pem"].as_str().map(str::to_string))
    };
    let until = |what: &'static str, secs: u64| {
        let deadline = Instant::now() + Duration::from_secs(secs);
        move |log: &dyn Fn() -> String| {
            assert!(Instant::now() < deadline, "{what}:\n{}", log());
        }
    };
    let check = until("the CRL published", 30);
    while crl_in_configmap().is_none() {
        check(&|| server.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    hsm.remove_token();
    // nextUpdate is 2 s after each signing: withdrawn then.
    let check = until("the stale CRL withdrawn", 30);
    while crl_in_configmap().is_some() {
        check(&|| server.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        kube.get_object("configmaps", "default", "istio-ca-crl")
            .is_some(),
        "the ConfigMap stays, without the key"
    );
    hsm.restore_token();
    let check = until("the CRL published again", 30);
    while crl_in_configmap().is_none() {
        check(&|| server.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let pem = crl_in_configmap().unwrap();
    let parsed = meshca_certs::crl::ParsedCrl::from_pem(&pem).unwrap();
    assert!(parsed.next_update.unwrap() > OffsetDateTime::now_utc());
}
