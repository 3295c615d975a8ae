//! End-to-end tests of the `meshca-certs` CLI, as processes.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output};

use meshca_certs::bundle::parse_certs_pem;
use meshca_certs::cadir::load_ca_dir;
use meshca_certs::profile::{SubjectKey, Validity};
use meshca_certs::{KeyAlgorithm, PrivateKey, SpiffeId};
use meshca_tests::*;
use time::OffsetDateTime;

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";

fn certs(args: &[&str]) -> Output {
    Command::new(&binaries().meshca_certs)
        .args(args)
        .output()
        .expect("running meshca-certs")
}

fn ok(args: &[&str]) -> String {
    let out = certs(args);
    assert!(
        out.status.success(),
        "meshca-certs {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn p(path: &Path) -> String {
    path.display().to_string()
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// root → cluster1 intermediate → workload, in `dir`.
fn make_pki(dir: &Path) {
    ok(&["root-ca", "--out", &p(&dir.join("root"))]);
    ok(&[
        "intermediate-ca",
        "--root",
        &p(&dir.join("root")),
        "--cluster",
        "cluster1",
        "--out",
        &p(dir),
    ]);
    ok(&[
        "workload",
        "--ca",
        &p(&dir.join("cluster1")),
        "--spiffe-id",
        WEB,
        "--out",
        &p(&dir.join("wl")),
    ]);
}

#[test]
fn root_intermediate_workload_in_istio_layout() {
    let dir = tempfile::tempdir().unwrap();
    make_pki(dir.path());
    let root = dir.path().join("root");
    let int = dir.path().join("cluster1");
    let wl = dir.path().join("wl");
    for key in [
        root.join("root-key.pem"),
        int.join("ca-key.pem"),
        wl.join("key.pem"),
    ] {
        assert_eq!(mode(&key), 0o600, "{}", key.display());
    }
    // cacerts layout: cert-chain.pem = intermediate then root.
    let ca_cert =
        parse_certs_pem(&std::fs::read_to_string(int.join("ca-cert.pem")).unwrap()).unwrap();
    let chain =
        parse_certs_pem(&std::fs::read_to_string(int.join("cert-chain.pem")).unwrap()).unwrap();
    let root_cert =
        parse_certs_pem(&std::fs::read_to_string(root.join("root-cert.pem")).unwrap()).unwrap();
    assert_eq!(chain, vec![ca_cert[0].clone(), root_cert[0].clone()]);
    assert_eq!(
        std::fs::read(int.join("root-cert.pem")).unwrap(),
        std::fs::read(root.join("root-cert.pem")).unwrap()
    );

    let json: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", "--json", &p(&int.join("cert-chain.pem"))])).unwrap();
    let certs = json["certificates"].as_array().unwrap();
    assert_eq!(certs.len(), 2);
    let i = &certs[0];
    assert_eq!(i["is_ca"], true);
    assert_eq!(i["path_len"], 0);
    assert_eq!(i["subject"], "O=Istio, L=cluster1, CN=Intermediate CA");
    assert_eq!(i["key"], "ECDSA P-256");
    assert_eq!(i["expired"], false);
    assert!(i["seconds_left"].as_i64().unwrap() > 700 * 86400);
    assert_eq!(i["authority_key_id"], certs[1]["subject_key_id"]);
    assert!(i["key_usage"]
        .as_array()
        .unwrap()
        .contains(&"keyCertSign".into()));
    assert_eq!(certs[1]["self_signed"], true);
    // The root is 10 years by default; the intermediate 2.
    assert!(certs[1]["seconds_left"].as_i64().unwrap() > 3600 * 86400);

    let leaf: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", "--json", &p(&wl.join("cert-chain.pem"))])).unwrap();
    let leaf = &leaf["certificates"][0];
    assert_eq!(leaf["spiffe_ids"], serde_json::json!([WEB]));
    assert_eq!(leaf["is_ca"], false);
    assert_eq!(leaf["subject"], "");

    let human = ok(&["inspect", &p(&wl.join("cert-chain.pem"))]);
    assert!(human.contains(WEB) && human.contains("left"), "{human}");

    let good = ok(&[
        "verify",
        "--bundle",
        &p(&root.join("root-cert.pem")),
        &p(&wl.join("cert-chain.pem")),
        "--spiffe-id",
        WEB,
    ]);
    assert!(good.starts_with("OK"), "{good}");

    // Without openssl the cross-check is skipped (it fails in CI).
    if have_openssl() {
        let out = run_ok(Command::new("openssl").args([
            "verify",
            "-x509_strict",
            "-CAfile",
            &p(&root.join("root-cert.pem")),
            "-untrusted",
            &p(&int.join("ca-cert.pem")),
            &p(&wl.join("cert-chain.pem")),
        ]));
        assert!(out.contains("OK"), "{out}");
    } else {
        eprintln!("SKIPPED openssl cross-check: openssl is not installed");
    }
}

#[test]
fn key_types_and_limits() {
    let dir = tempfile::tempdir().unwrap();
    for (alg, want) in [
        ("ecdsa-p384", "ECDSA P-384"),
        ("rsa-2048", "RSA 2048"),
        ("rsa-3072", "RSA 3072"),
    ] {
        let out = dir.path().join(alg);
        ok(&[
            "root-ca",
            "--out",
            &p(&out),
            "--key",
            alg,
            "--days",
            "30",
            "--org",
            "Acme",
            "--common-name",
            "Acme Root",
        ]);
        let json: serde_json::Value =
            serde_json::from_str(&ok(&["inspect", "--json", &p(&out.join("root-cert.pem"))]))
                .unwrap();
        assert_eq!(json["certificates"][0]["key"], want);
        assert_eq!(json["certificates"][0]["subject"], "O=Acme, CN=Acme Root");
    }
    // An intermediate never outlives its root.
    let short = dir.path().join("ecdsa-p384");
    ok(&[
        "intermediate-ca",
        "--root",
        &p(&short),
        "--cluster",
        "c",
        "--out",
        &p(dir.path()),
        "--days",
        "3650",
    ]);
    ends_with_its_issuer(&dir.path().join("c").join("cert-chain.pem"));
}

#[test]
fn safety_and_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    ok(&["root-ca", "--out", &p(&root)]);
    let key_before = std::fs::read(root.join("root-key.pem")).unwrap();
    let out = certs(&["root-ca", "--out", &p(&root)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
    assert_eq!(
        std::fs::read(root.join("root-key.pem")).unwrap(),
        key_before,
        "key untouched"
    );
    ok(&["root-ca", "--out", &p(&root), "--force"]);
    assert_ne!(
        std::fs::read(root.join("root-key.pem")).unwrap(),
        key_before
    );

    let bad: [(&[&str], &str); 6] = [
        (&["root-ca", "--out", "x", "--key", "dsa-1024"], "dsa-1024"),
        (&["root-ca", "--out", "x", "--days", "-3"], "-3"),
        (&["root-ca", "--out", "x", "--days", "0"], "--days"),
        (
            &[
                "workload",
                "--ca",
                &p(&root),
                "--spiffe-id",
                "http://x/y",
                "--out",
                "x",
            ],
            "spiffe://",
        ),
        (
            &["inspect", "/nonexistent/chain.pem"],
            "/nonexistent/chain.pem",
        ),
        (
            &[
                "intermediate-ca",
                "--root",
                &p(&dir.path().join("nope")),
                "--cluster",
                "c",
                "--out",
                "x",
            ],
            "nope",
        ),
    ];
    for (args, needle) in bad {
        let out = certs(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    // A malformed input file is named.
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(
        &garbage,
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let out = certs(&["inspect", &p(&garbage)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("garbage.pem"));
}

#[test]
fn verify_reports_each_problem_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    make_pki(dir.path());
    let wl_chain = p(&dir.path().join("wl").join("cert-chain.pem"));
    let other = dir.path().join("other");
    ok(&["root-ca", "--out", &p(&other)]);

    // Foreign root.
    let out = certs(&[
        "verify",
        "--bundle",
        &p(&other.join("root-cert.pem")),
        &wl_chain,
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("certificate #1") && stdout.contains("path validation"),
        "{stdout}"
    );

    // Wrong expected identity.
    let root_bundle = p(&dir.path().join("root").join("root-cert.pem"));
    let out = certs(&[
        "verify",
        "--bundle",
        &root_bundle,
        &wl_chain,
        "--spiffe-id",
        "spiffe://cluster.local/ns/x/sa/y",
    ]);
    assert_eq!(out.status.code(), Some(1));

    // Expired leaf, made with the library and the intermediate's key.
    let ca = load_ca_dir(&dir.path().join("cluster1"), OffsetDateTime::now_utc()).unwrap();
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
    let past = OffsetDateTime::now_utc() - time::Duration::days(3);
    let expired = ca
        .signing
        .issue_workload(
            &SubjectKey::of(&key).unwrap(),
            &SpiffeId::parse(WEB).unwrap(),
            Validity::backdated(past, time::Duration::hours(1)),
        )
        .unwrap();
    let expired_file = dir.path().join("expired.pem");
    std::fs::write(
        &expired_file,
        format!(
            "{}{}",
            expired.to_pem(),
            meshca_certs::bundle::encode_certs_pem(&ca.chain)
        ),
    )
    .unwrap();
    let out = certs(&["verify", "--bundle", &root_bundle, &p(&expired_file)]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("certificate #1") && stdout.contains("expired"),
        "{stdout}"
    );

    // Two URI SANs, signed by the intermediate with rcgen.
    let int_dir = dir.path().join("cluster1");
    let ca_key =
        rcgen::KeyPair::from_pem(&std::fs::read_to_string(int_dir.join("ca-key.pem")).unwrap())
            .unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_pem(
        &std::fs::read_to_string(int_dir.join("ca-cert.pem")).unwrap(),
        ca_key,
    )
    .unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.subject_alt_names = vec![
        rcgen::SanType::URI(WEB.try_into().unwrap()),
        rcgen::SanType::URI(
            "spiffe://cluster.local/ns/default/sa/db"
                .try_into()
                .unwrap(),
        ),
    ];
    params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
    ];
    params.not_before = OffsetDateTime::now_utc() - time::Duration::minutes(1);
    params.not_after = OffsetDateTime::now_utc() + time::Duration::hours(1);
    params.use_authority_key_identifier_extension = true;
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let two = params.signed_by(&leaf_key, &issuer).unwrap();
    let two_file = dir.path().join("two.pem");
    std::fs::write(
        &two_file,
        format!(
            "{}{}",
            two.pem(),
            meshca_certs::bundle::encode_certs_pem(&ca.chain)
        ),
    )
    .unwrap();
    let out = certs(&["verify", "--bundle", &root_bundle, &p(&two_file)]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("2 URI SANs"), "{stdout}");
}

#[tokio::test]
async fn meshca_serves_from_intermediate_ca_output() {
    let dir = tempfile::tempdir().unwrap();
    ok(&["root-ca", "--out", &p(&dir.path().join("root"))]);
    ok(&[
        "intermediate-ca",
        "--root",
        &p(&dir.path().join("root")),
        "--cluster",
        "east",
        "--out",
        &p(dir.path()),
    ]);
    let server = MeshcaServer::start(
        &dir.path().join("data"),
        &["--ca-dir", &p(&dir.path().join("east"))],
    )
    .unwrap_or_else(|f| panic!("{f:?}"));
    let root_pem = std::fs::read_to_string(dir.path().join("root").join("root-cert.pem")).unwrap();
    let mut client = server.client_trusting(&root_pem).await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    let response = client
        .create_certificate(with_token(request, &server.token("default", "web")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.cert_chain.len(), 3);
    let chain_file = dir.path().join("issued.pem");
    std::fs::write(&chain_file, response.cert_chain[..2].concat()).unwrap();
    let good = ok(&[
        "verify",
        "--bundle",
        &p(&dir.path().join("root").join("root-cert.pem")),
        &p(&chain_file),
        "--spiffe-id",
        WEB,
    ]);
    assert!(good.starts_with("OK"), "{good}");
}

/// Runs `meshca-certs` expecting a clean failure (exit 1, not a panic's
/// 101) and returns its stderr.
fn fails(args: &[&str]) -> String {
    let out = certs(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        matches!(out.status.code(), Some(1 | 2)),
        "{args:?}: {:?} {stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    stderr
}

/// `token` without a usable issuer key: the advice to start `meshca serve`
/// once is given only when the key is missing (a corrupt key stops the
/// server too).
#[test]
fn token_advises_a_first_start_only_when_the_issuer_key_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let args = |d: &Path| {
        [
            "token".to_string(),
            "--data-dir".into(),
            p(d),
            "--namespace".into(),
            "a".into(),
            "--service-account".into(),
            "b".into(),
        ]
    };
    let run = |d: &Path| {
        let args = args(d);
        fails(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let stderr = run(dir.path());
    assert!(stderr.contains("once to create it"), "{stderr}");
    std::fs::write(dir.path().join("token-issuer-key.pem"), "garbage").unwrap();
    let stderr = run(dir.path());
    assert!(
        stderr.contains("token-issuer-key.pem") && !stderr.contains("once to create it"),
        "{stderr}"
    );
}

#[test]
fn absurd_lifetimes_are_refused_or_capped_without_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    make_pki(dir.path());
    let ca = p(&dir.path().join("cluster1"));
    let out = p(&dir.path().join("long"));
    // Used to panic at profile.rs ("resulting value is out of range").
    let stderr = fails(&[
        "workload",
        "--ca",
        &ca,
        "--spiffe-id",
        WEB,
        "--out",
        &out,
        "--ttl",
        "10000y",
    ]);
    assert!(
        stderr.contains("--ttl") && stderr.contains("too long"),
        "{stderr}"
    );
    // Up to 100 years is accepted and capped at the CA's notAfter.
    ok(&[
        "workload",
        "--ca",
        &ca,
        "--spiffe-id",
        WEB,
        "--out",
        &out,
        "--ttl",
        "100y",
    ]);
    ends_with_its_issuer(&dir.path().join("long").join("cert-chain.pem"));
}

/// The first certificate of the chain at `chain` expires with the second
/// (its lifetime was cut to its issuer's).
fn ends_with_its_issuer(chain: &Path) {
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", "--json", &p(chain)])).unwrap();
    let certs = json["certificates"].as_array().unwrap();
    assert_eq!(certs[0]["not_after"], certs[1]["not_after"]);
}

#[test]
fn intermediate_ca_refuses_a_root_whose_path_length_is_used_up() {
    let dir = tempfile::tempdir().unwrap();
    make_pki(dir.path());
    // cluster1 is an intermediate with pathlen:0: a CA under it would make
    // certificates nobody can verify.
    let stderr = fails(&[
        "intermediate-ca",
        "--root",
        &p(&dir.path().join("cluster1")),
        "--cluster",
        "sub",
        "--out",
        &p(dir.path()),
    ]);
    assert!(
        stderr.contains("ca-cert.pem") && stderr.contains("pathLenConstraint is 0"),
        "{stderr}"
    );
    assert!(!dir.path().join("sub").exists());
}

#[test]
fn input_errors_are_said_once_and_in_words() {
    let dir = tempfile::tempdir().unwrap();
    make_pki(dir.path());
    // D6: each cause once.
    let stderr = fails(&["inspect", &p(&dir.path().join("nonexist.pem"))]);
    assert_eq!(stderr.matches("No such file").count(), 1, "{stderr}");
    assert_eq!(stderr.matches("nonexist.pem").count(), 1, "{stderr}");
    // D8: a file where a directory is expected, a missing directory, DER.
    let afile = dir.path().join("afile");
    std::fs::write(&afile, "x").unwrap();
    let stderr = fails(&["root-ca", "--out", &p(&afile)]);
    assert!(
        stderr.contains("--out") && stderr.contains("is a file, not a directory"),
        "{stderr}"
    );
    let stderr = fails(&[
        "workload",
        "--ca",
        &p(&dir.path().join("nope")),
        "--spiffe-id",
        WEB,
        "--out",
        "x",
    ]);
    assert!(stderr.contains("nope: no such directory"), "{stderr}");
    let pem = std::fs::read_to_string(dir.path().join("root").join("root-cert.pem")).unwrap();
    let der = dir.path().join("ca.der");
    std::fs::write(&der, parse_certs_pem(&pem).unwrap().remove(0)).unwrap();
    let stderr = fails(&["inspect", &p(&der)]);
    assert!(
        stderr.contains("not PEM") && !stderr.contains("UTF-8"),
        "{stderr}"
    );
    // D2: a truncated last block is not dropped silently.
    let chain = std::fs::read_to_string(dir.path().join("wl").join("cert-chain.pem")).unwrap();
    let cut = dir.path().join("cut.pem");
    std::fs::write(&cut, &chain[..chain.len() - 200]).unwrap();
    let stderr = fails(&["inspect", &p(&cut)]);
    assert!(
        stderr.contains("cut.pem") && stderr.contains("no END line"),
        "{stderr}"
    );
    // D9: empty and over-long subject attributes.
    for (flag, value) in [
        ("--common-name", String::new()),
        ("--org", String::new()),
        ("--common-name", "x".repeat(65)),
    ] {
        let stderr = fails(&["root-ca", "--out", &p(&dir.path().join("r2")), flag, &value]);
        assert!(stderr.contains(flag), "{flag} {value:?}: {stderr}");
    }
    // D10: RFC 3339 times in text output.
    let text = ok(&["inspect", &p(&dir.path().join("wl").join("cert-chain.pem"))]);
    let line = text.lines().find(|l| l.contains("Not after:")).unwrap();
    let stamp = line.split_whitespace().nth(2).unwrap();
    assert!(
        stamp.len() == 20 && stamp.ends_with('Z') && stamp.as_bytes()[10] == b'T',
        "{line}"
    );
}
