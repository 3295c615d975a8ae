//! End-to-end tests of `meshca serve`: the real binary, real TLS, real gRPC.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, SystemTime};

use meshca_certs::bundle::parse_certs_pem;
use meshca_certs::inspect::CertSummary;
use meshca_certs::token::{TokenIssuer, TokenRequest};
use meshca_certs::verify::verify_svid;
use meshca_certs::{KeyAlgorithm, SpiffeId, TrustBundle};
use meshca_proto::IstioCertificateRequest;
use meshca_tests::*;
use tonic::Code;
use x509_parser::prelude::{FromDer, X509Certificate};

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";

fn server() -> (tempfile::TempDir, MeshcaServer) {
    server_with(&[])
}

/// A meshca on a fresh data directory, started with `extra` flags.
fn server_with(extra: &[&str]) -> (tempfile::TempDir, MeshcaServer) {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = MeshcaServer::start(&dir.path().join("data"), extra)
        .unwrap_or_else(|f| panic!("meshca did not start: {f:?}"));
    (dir, server)
}

fn ders(chain: &[String]) -> Vec<Vec<u8>> {
    chain
        .iter()
        .flat_map(|pem| parse_certs_pem(pem).expect("PEM"))
        .collect()
}

#[tokio::test]
async fn issues_correct_svids_for_each_key_type() {
    let (_dir, server) = server();
    let mut client = server.client().await;
    let bundle = TrustBundle::from_pem(&server.root_pem()).unwrap();
    for alg in [
        KeyAlgorithm::EcdsaP256,
        KeyAlgorithm::EcdsaP384,
        KeyAlgorithm::Rsa2048,
    ] {
        let (key, request) = csr_request(alg, WEB, 3600);
        let response = client
            .create_certificate(with_token(request, &server.token("default", "web")))
            .await
            .unwrap_or_else(|s| panic!("{alg}: {s:?}"))
            .into_inner();
        // One PEM certificate per element, leaf first, root last.
        assert_eq!(response.cert_chain.len(), 2, "{alg}");
        for element in &response.cert_chain {
            assert_eq!(parse_certs_pem(element).unwrap().len(), 1);
        }
        let chain = ders(&response.cert_chain);
        assert_eq!(chain[1], bundle.roots()[0], "root last");
        let (_, leaf) = X509Certificate::from_der(&chain[0]).unwrap();
        assert_eq!(
            leaf.public_key().raw,
            key.public_key_spki_der().as_slice(),
            "{alg}: the CSR's key"
        );
        let san = leaf.subject_alternative_name().unwrap().unwrap();
        assert!(san.critical);
        assert_eq!(san.value.general_names.len(), 1);
        let bc = leaf.basic_constraints().unwrap().unwrap();
        assert!(bc.critical && !bc.value.ca);
        let ku = leaf.key_usage().unwrap().unwrap();
        assert!(ku.critical && ku.value.digital_signature() && !ku.value.key_cert_sign());
        assert_eq!(ku.value.key_encipherment(), alg == KeyAlgorithm::Rsa2048);
        let eku = leaf.extended_key_usage().unwrap().unwrap();
        assert!(eku.value.client_auth && eku.value.server_auth);
        let svid = verify_svid(
            &chain,
            &bundle,
            SystemTime::now(),
            Some(&SpiffeId::parse(WEB).unwrap()),
        )
        .unwrap();
        let lifetime = svid.not_after - svid.not_before;
        assert_eq!(
            lifetime.whole_seconds(),
            3600 + 120,
            "1 h plus the 2 min backdate"
        );
    }
}

#[tokio::test]
async fn bad_csrs_are_invalid_argument_and_the_server_keeps_serving() {
    let (_dir, server) = server();
    let mut client = server.client().await;
    let token = server.token("default", "web");

    // Forged signature: flip a bit in the signature of a good CSR.
    let (_, good) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    let mut der = parse_pem_block(&good.csr);
    let last = der.len() - 3;
    der[last] ^= 0x01;
    let forged = pem_block("CERTIFICATE REQUEST", &der);
    let weak = RsaTestKey::generate(1024).csr(WEB);
    let cases: Vec<(&str, String)> = vec![
        ("forged signature", forged),
        ("garbage", "this is not a CSR".into()),
        ("empty", String::new()),
        ("RSA-1024", weak),
        ("oversized CSR", "A".repeat(40 * 1024)),
        ("oversized request", "A".repeat(200 * 1024)),
    ];
    for (name, csr) in cases {
        let status = client
            .create_certificate(with_token(
                IstioCertificateRequest {
                    csr,
                    validity_duration: 0,
                    metadata: None,
                },
                &token,
            ))
            .await
            .expect_err(name);
        assert_eq!(status.code(), Code::InvalidArgument, "{name}: {status:?}");
        assert!(!status.message().is_empty(), "{name}: a message to act on");
    }
    // An RSA key of an accepted size with public exponent 3: refused,
    // naming the rule; the same signer with e = 65537 is issued for.
    let ask = |csr: String| {
        let mut client = client.clone();
        let request = with_token(
            IstioCertificateRequest {
                csr,
                validity_duration: 0,
                metadata: None,
            },
            &token,
        );
        async move { client.create_certificate(request).await }
    };
    let e3 = RsaTestKey::with_exponent(2048, 3);
    let status = ask(e3.csr(WEB)).await.expect_err("an e = 3 key");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("RSA public exponent must be odd and at least 65537 (this key's is 3)"),
        "{status:?}"
    );
    let f4 = RsaTestKey::generate(2048);
    let chain = ask(f4.csr(WEB))
        .await
        .expect("an e = 65537 key")
        .into_inner()
        .cert_chain;
    let leaf = parse_certs_pem(&chain[0]).unwrap().remove(0);
    let (_, leaf) = X509Certificate::from_der(&leaf).unwrap();
    assert_eq!(leaf.public_key().raw, f4.spki_der().as_slice());
    // Still serving.
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    client
        .create_certificate(with_token(request, &token))
        .await
        .expect("still serving");
}

fn parse_pem_block(text: &str) -> Vec<u8> {
    pem::parse(text).unwrap().into_contents()
}

fn pem_block(tag: &str, der: &[u8]) -> String {
    meshca_certs::bundle::encode_cert_pem(der).replace("CERTIFICATE", tag)
}

#[tokio::test]
async fn bad_tokens_are_unauthenticated() {
    let (_dir, server) = server();
    let mut client = server.client().await;
    let expired = TokenIssuer::load(&server.data_dir)
        .unwrap()
        .mint(
            &TokenRequest {
                namespace: "default".into(),
                service_account: "web".into(),
                audiences: vec!["istio-ca".into()],
                ttl: Duration::from_secs(60),
                pod: None,
            },
            SystemTime::now() - Duration::from_secs(3600),
        )
        .unwrap();
    let wrong_audience = mint_token(
        &server.data_dir,
        "default",
        "web",
        "not-istio-ca",
        Duration::from_secs(600),
    );
    let request = |i: &TokenIssuer| {
        i.mint(
            &TokenRequest {
                namespace: "default".into(),
                service_account: "web".into(),
                audiences: vec!["istio-ca".into()],
                ttl: Duration::from_secs(600),
                pod: None,
            },
            SystemTime::now(),
        )
        .unwrap()
    };
    let foreign_key = request(&TokenIssuer::generate().unwrap());
    let foreign_issuer = request(
        &TokenIssuer::generate()
            .unwrap()
            .with_issuer("https://evil.example"),
    );
    let cases = [
        ("expired", Some(expired)),
        ("wrong audience", Some(wrong_audience)),
        ("same issuer name, foreign key", Some(foreign_key)),
        ("foreign issuer", Some(foreign_issuer)),
        ("garbage token", Some("abc.def.ghi".to_string())),
        ("no token", None),
    ];
    let sent: Vec<String> = cases.iter().filter_map(|(_, t)| t.clone()).collect();
    for (name, token) in cases {
        let (_, message) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
        let request = match &token {
            Some(t) => with_token(message, t),
            None => tonic::Request::new(message),
        };
        let status = client.create_certificate(request).await.expect_err(name);
        assert_eq!(status.code(), Code::Unauthenticated, "{name}: {status:?}");
        if let Some(t) = &token {
            assert!(
                !status.message().contains(t.as_str()),
                "{name}: token echoed"
            );
        }
    }
    // No token, nor its signature part, reaches the log.
    let log = server.log();
    assert!(
        log.contains("authentication failed"),
        "failures are logged:\n{log}"
    );
    for token in sent {
        let signature = token.rsplit('.').next().unwrap_or_default();
        assert!(
            !log.contains(&token) && !log.contains(signature),
            "token in the log:\n{log}"
        );
    }
}

#[tokio::test]
async fn another_identity_in_the_csr_is_permission_denied() {
    let (_dir, server) = server();
    let mut client = server.client().await;
    let (_, request) = csr_request(
        KeyAlgorithm::EcdsaP256,
        "spiffe://cluster.local/ns/kube-system/sa/admin",
        0,
    );
    let status = client
        .create_certificate(with_token(request, &server.token("default", "web")))
        .await
        .expect_err("other identity");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("kube-system"), "{status:?}");

    // Impersonation without being a trusted node agent.
    let (_, mut request) = csr_request(
        KeyAlgorithm::EcdsaP256,
        "spiffe://cluster.local/ns/other/sa/x",
        0,
    );
    request.metadata = Some(prost_types::Struct {
        fields: [(
            "ImpersonatedIdentity".to_string(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue(
                    "spiffe://cluster.local/ns/other/sa/x".into(),
                )),
            },
        )]
        .into(),
    });
    let status = client
        .create_certificate(with_token(request, &server.token("default", "web")))
        .await
        .expect_err("impersonation");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
}

#[tokio::test]
async fn ttl_rules() {
    let (_dir, server) = server();
    let mut client = server.client().await;
    let token = server.token("default", "web");
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 91 * 24 * 3600);
    let status = client
        .create_certificate(with_token(request, &token))
        .await
        .expect_err("too long");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    let before = time::OffsetDateTime::now_utc().unix_timestamp();
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    let response = client
        .create_certificate(with_token(request, &token))
        .await
        .unwrap()
        .into_inner();
    let after = time::OffsetDateTime::now_utc().unix_timestamp();
    let leaf = CertSummary::from_der(&ders(&response.cert_chain)[0]).unwrap();
    let not_after = leaf.not_after.unix_timestamp();
    assert!(
        not_after >= before + 86400 && not_after <= after + 86400,
        "0 means 24 h"
    );
    assert!(
        leaf.not_before.unix_timestamp() <= before - 119,
        "backdated 2 min"
    );
}

#[tokio::test]
async fn mtls_renewal_works_without_a_token() {
    let (_dir, server) = server();
    let mut client = server.client().await;
    let (key, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    let first = client
        .create_certificate(with_token(request, &server.token("default", "web")))
        .await
        .unwrap()
        .into_inner();
    let identity = (first.cert_chain.concat(), key.to_pkcs8_pem());
    let mut mtls = server.client_with_identity(Some(identity)).await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    let renewed = mtls
        .create_certificate(tonic::Request::new(request))
        .await
        .expect("renewal with the client certificate")
        .into_inner();
    let leaf = CertSummary::from_der(&ders(&renewed.cert_chain)[0]).unwrap();
    assert_eq!(leaf.uris, vec![WEB.to_string()]);

    // The same certificate may not ask for someone else.
    let (_, request) = csr_request(
        KeyAlgorithm::EcdsaP256,
        "spiffe://cluster.local/ns/default/sa/db",
        0,
    );
    let status = mtls
        .create_certificate(tonic::Request::new(request))
        .await
        .expect_err("other id");
    assert_eq!(status.code(), Code::PermissionDenied);

    // A client certificate from a foreign CA is UNAUTHENTICATED.
    let other_dir = tempfile::tempdir().unwrap();
    let other = MeshcaServer::start(&other_dir.path().join("data"), &[]).unwrap();
    let mut other_client = other.client().await;
    let (okey, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    let foreign = other_client
        .create_certificate(with_token(request, &other.token("default", "web")))
        .await
        .unwrap()
        .into_inner();
    let mut foreign_mtls = server
        .client_with_identity(Some((foreign.cert_chain.concat(), okey.to_pkcs8_pem())))
        .await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    let status = foreign_mtls
        .create_certificate(tonic::Request::new(request))
        .await
        .expect_err("foreign");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
}

/// notAfter − notBefore of the leaf of `chain`, in seconds.
fn lifetime_secs(chain: &[String]) -> i64 {
    let leaf = CertSummary::from_der(&ders(chain)[0]).unwrap();
    (leaf.not_after - leaf.not_before).whole_seconds()
}

#[tokio::test]
async fn renewal_by_certificate_never_extends_the_credential_and_can_be_turned_off() {
    let (_dir, server) = server();
    let mut client = server.client().await;
    let (key, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    let first = client
        .create_certificate(with_token(request, &server.token("default", "web")))
        .await
        .unwrap()
        .into_inner();
    // One hour, backdated two minutes.
    assert_eq!(lifetime_secs(&first.cert_chain), 3720);

    // A stolen 1 h SVID asks for 90 days, then for the default 24 h: it
    // gets no more than its own lifetime, each time.
    let mut identity = (first.cert_chain.concat(), key.to_pkcs8_pem());
    for asked in [90 * 24 * 3600, 0] {
        let mut mtls = server.client_with_identity(Some(identity.clone())).await;
        let (key, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, asked);
        let renewed = mtls
            .create_certificate(tonic::Request::new(request))
            .await
            .expect("renewal with the client certificate")
            .into_inner();
        assert_eq!(lifetime_secs(&renewed.cert_chain), 3720, "asked {asked}s");
        identity = (renewed.cert_chain.concat(), key.to_pkcs8_pem());
    }

    // The cluster ID is checked for certificate callers too.
    let mut mtls = server.client_with_identity(Some(identity.clone())).await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 600);
    let mut request = tonic::Request::new(request);
    request
        .metadata_mut()
        .insert("clusterid", "another-cluster".parse().unwrap());
    let status = mtls
        .create_certificate(request)
        .await
        .expect_err("clusterid");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // --allow-cert-renewal=false: a certificate alone is refused, a token
    // still works (with the certificate presented too).
    let (_dir2, strict) = server_with(&["--allow-cert-renewal=false"]);
    let mut plain = strict.client().await;
    let (key, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    let issued = plain
        .create_certificate(with_token(request, &strict.token("default", "web")))
        .await
        .unwrap()
        .into_inner();
    let mut mtls = strict
        .client_with_identity(Some((issued.cert_chain.concat(), key.to_pkcs8_pem())))
        .await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    let status = mtls
        .create_certificate(tonic::Request::new(request))
        .await
        .expect_err("certificate renewal is off");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    mtls.create_certificate(with_token(request, &strict.token("default", "web")))
        .await
        .expect("a token works with the certificate presented");
}

#[tokio::test]
async fn a_restart_keeps_the_root_and_the_issuer() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut first = MeshcaServer::start(&data, &[]).unwrap();
    let root = first.root_pem();
    let token = first.token("default", "web");
    assert!(first.terminate().is_some_and(|s| s.success()));
    let second = MeshcaServer::start(&data, &[]).unwrap();
    assert_eq!(second.root_pem(), root);
    let mut client = second.client().await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    client
        .create_certificate(with_token(request, &token))
        .await
        .expect("a token minted before the restart still works");
}

#[tokio::test]
async fn plugged_in_ca_made_by_openssl_gives_leaf_intermediate_root() {
    if !have_openssl() {
        eprintln!(
            "SKIPPED: openssl is not installed; the plugged-in CA test needs it to make the CA"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("cacerts");
    std::fs::create_dir(&ca).unwrap();
    let d = |f: &str| ca.join(f).display().to_string();
    let ext = dir.path().join("ext.cnf");
    std::fs::write(
        &ext,
        "[req]\ndistinguished_name=dn\nprompt=no\n[dn]\nO=Example\nCN=Example Root CA\n\
         [root]\nbasicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\nsubjectKeyIdentifier=hash\n\
         [int]\nbasicConstraints=critical,CA:TRUE,pathlen:0\nkeyUsage=critical,keyCertSign,cRLSign,digitalSignature\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid:always\n",
    )
    .unwrap();
    let ext = ext.display().to_string();
    run_ok(Command::new("openssl").args([
        "ecparam",
        "-name",
        "prime256v1",
        "-genkey",
        "-out",
        &d("root-key.pem"),
    ]));
    run_ok(Command::new("openssl").args([
        "req",
        "-new",
        "-x509",
        "-key",
        &d("root-key.pem"),
        "-out",
        &d("root-cert.pem"),
        "-days",
        "30",
        "-config",
        &ext,
        "-extensions",
        "root",
    ]));
    run_ok(Command::new("openssl").args(["genrsa", "-out", &d("ca-key.pem"), "2048"]));
    run_ok(
        Command::new("openssl")
            .args([
                "req",
                "-new",
                "-key",
                &d("ca-key.pem"),
                "-out",
                &d("ca.csr"),
                "-subj",
                "/O=Example/OU=Mesh/L=cluster1/CN=Intermediate CA",
            ])
            .env("OPENSSL_CONF", "/dev/null"),
    );
    run_ok(Command::new("openssl").args([
        "x509",
        "-req",
        "-in",
        &d("ca.csr"),
        "-CA",
        &d("root-cert.pem"),
        "-CAkey",
        &d("root-key.pem"),
        "-CAcreateserial",
        "-out",
        &d("ca-cert.pem"),
        "-days",
        "20",
        "-extfile",
        &ext,
        "-extensions",
        "int",
    ]));
    let chain = format!(
        "{}{}",
        std::fs::read_to_string(d("ca-cert.pem")).unwrap(),
        std::fs::read_to_string(d("root-cert.pem")).unwrap()
    );
    std::fs::write(d("cert-chain.pem"), chain).unwrap();

    let server = MeshcaServer::start(
        &dir.path().join("data"),
        &["--ca-dir", &ca.display().to_string()],
    )
    .unwrap_or_else(|f| panic!("{f:?}"));
    let ca_root = std::fs::read_to_string(d("root-cert.pem")).unwrap();
    // The server's own certificate was issued by the plugged-in CA.
    let mut client = server.client_trusting(&ca_root).await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    let response = client
        .create_certificate(with_token(request, &server.token("default", "web")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.cert_chain.len(), 3, "[leaf, intermediate, root]");
    let chain = ders(&response.cert_chain);
    let ca_cert = parse_certs_pem(&std::fs::read_to_string(d("ca-cert.pem")).unwrap()).unwrap();
    assert_eq!(chain[1], ca_cert[0]);
    assert_eq!(chain[2], parse_certs_pem(&ca_root).unwrap()[0]);
    let leaf = CertSummary::from_der(&chain[0]).unwrap();
    let int = CertSummary::from_der(&chain[1]).unwrap();
    assert_eq!(leaf.issuer, int.subject);
    assert_eq!(leaf.authority_key_id, int.subject_key_id);
    // Independent check with openssl, strict.
    let leaf_file = dir.path().join("leaf.pem");
    let untrusted = dir.path().join("untrusted.pem");
    std::fs::write(&leaf_file, &response.cert_chain[0]).unwrap();
    std::fs::write(&untrusted, &response.cert_chain[1]).unwrap();
    let out = run_ok(Command::new("openssl").args([
        "verify",
        "-x509_strict",
        "-CAfile",
        &d("root-cert.pem"),
        "-untrusted",
        &untrusted.display().to_string(),
        &leaf_file.display().to_string(),
    ]));
    assert!(out.contains("OK"), "{out}");
}

#[tokio::test]
async fn issued_chain_passes_openssl_strict_verification() {
    if !have_openssl() {
        eprintln!("SKIPPED: openssl is not installed; cannot cross-check with it");
        return;
    }
    let (dir, server) = server();
    let mut client = server.client().await;
    for alg in [KeyAlgorithm::EcdsaP256, KeyAlgorithm::Rsa2048] {
        let (_, request) = csr_request(alg, WEB, 0);
        let response = client
            .create_certificate(with_token(request, &server.token("default", "web")))
            .await
            .unwrap()
            .into_inner();
        let leaf = dir.path().join("leaf.pem");
        std::fs::write(&leaf, &response.cert_chain[0]).unwrap();
        let out = run_ok(Command::new("openssl").args([
            "verify",
            "-x509_strict",
            "-purpose",
            "sslclient",
            "-CAfile",
            &server.data_dir.join("root-cert.pem").display().to_string(),
            &leaf.display().to_string(),
        ]));
        assert!(out.contains("OK"), "{alg}: {out}");
    }
}

#[tokio::test]
async fn two_hundred_concurrent_requests_get_distinct_serials() {
    let (_dir, server) = server();
    let client = server.client().await;
    let mut tasks = Vec::new();
    for i in 0..200 {
        let mut client = client.clone();
        let token = server.token("ns", &format!("sa-{i}"));
        let id = format!("spiffe://cluster.local/ns/ns/sa/sa-{i}");
        tasks.push(tokio::spawn(async move {
            let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, &id, 0);
            let response = client
                .create_certificate(with_token(request, &token))
                .await?
                .into_inner();
            Ok::<_, tonic::Status>(response)
        }));
    }
    let mut serials = HashSet::new();
    for task in futures::future::join_all(tasks).await {
        let response = task.unwrap().expect("every request succeeds");
        let leaf = CertSummary::from_der(&ders(&response.cert_chain)[0]).unwrap();
        serials.insert(leaf.serial);
    }
    assert_eq!(serials.len(), 200);
}

#[tokio::test]
async fn metrics_move_and_readiness_reports() {
    let (_dir, server) = server();
    let (code, before) = http_get(server.monitoring, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        metric(&before, "citadel_server_success_cert_issuance_count"),
        0
    );
    let mut client = server.client().await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    client
        .create_certificate(with_token(request, &server.token("default", "web")))
        .await
        .unwrap();
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    let _ = client
        .create_certificate(tonic::Request::new(request))
        .await;
    let (_, after) = http_get(server.monitoring, "/metrics").unwrap();
    assert_eq!(metric(&after, "citadel_server_csr_count"), 2);
    assert_eq!(
        metric(&after, "citadel_server_success_cert_issuance_count"),
        1
    );
    assert_eq!(
        metric(&after, "citadel_server_authentication_failure_count"),
        1
    );
    assert!(metric(&after, "citadel_server_root_cert_expiry_seconds") > 86400 * 365);
    assert!(after.contains("# TYPE citadel_server_csr_count counter"));
    let (code, _) = http_get(server.monitoring, "/ready").unwrap();
    assert_eq!(code, 200);
}

/// Three certificates for `web`, all with one token.
async fn issue_three_times(server: &MeshcaServer) {
    let mut client = server.client().await;
    let token = server.token("default", "web");
    for _ in 0..3 {
        let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
        client
            .create_certificate(with_token(request, &token))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn a_verified_token_is_reused_until_it_expires_and_only_when_enabled() {
    let (_dir, server) = server();
    let cache_hits = || {
        let (_, body) = http_get(server.monitoring, "/metrics").unwrap();
        metric(&body, "meshca_token_cache_hit_count")
    };
    let mut client = server.client().await;
    issue_three_times(&server).await;
    assert_eq!(
        cache_hits(),
        2,
        "the second and third use come from the cache"
    );

    // A cached token still dies at its `exp`.
    let short = mint_token(
        &server.data_dir,
        "default",
        "web",
        "istio-ca",
        // `exp` is whole seconds: 2 s from now leaves at least 1 s to use it.
        Duration::from_secs(2),
    );
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    client
        .create_certificate(with_token(request, &short))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    let status = client
        .create_certificate(with_token(request, &short))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("expired"), "{status:?}");
    assert_eq!(cache_hits(), 2);

    // Off: every request checks the signature.
    let (_dir, uncached) = server_with(&["--jwt-cache-ttl", "0s"]);
    issue_three_times(&uncached).await;
    let (_, body) = http_get(uncached.monitoring, "/metrics").unwrap();
    assert_eq!(metric(&body, "meshca_token_cache_hit_count"), 0);
}

#[tokio::test]
async fn sigterm_exits_cleanly() {
    let (_dir, mut server) = server();
    let status = server.terminate().expect("was running");
    assert!(status.success(), "{status:?}\n{}", server.log());
}

#[tokio::test]
async fn bad_plugged_in_ca_stops_startup_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("cacerts");
    std::fs::create_dir(&ca).unwrap();
    std::fs::write(ca.join("ca-cert.pem"), "garbage").unwrap();
    // A partial CA must not start.
    MeshcaServer::refuses_to_start(
        &dir.path().join("data"),
        &["--ca-dir", &ca.display().to_string()],
        "ca-key.pem is missing",
    );
}

#[tokio::test]
async fn external_jwks_issuer_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let external = TokenIssuer::generate()
        .unwrap()
        .with_issuer("https://kubernetes.default.svc.cluster.local");
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, external.jwks_json()).unwrap();
    let server = MeshcaServer::start_with_env(
        &dir.path().join("data"),
        &["--jwks", &jwks.display().to_string()],
        &[(
            "MESHCA_JWT_ISSUER",
            "https://kubernetes.default.svc.cluster.local",
        )],
    )
    .unwrap_or_else(|f| panic!("{f:?}"));
    let token = external
        .mint(
            &TokenRequest {
                namespace: "default".into(),
                service_account: "web".into(),
                audiences: vec!["istio-ca".into()],
                ttl: Duration::from_secs(600),
                pod: None,
            },
            SystemTime::now(),
        )
        .unwrap();
    let mut client = server.client().await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 0);
    client
        .create_certificate(with_token(request, &token))
        .await
        .expect("external issuer");
}

#[test]
fn token_cli_prints_a_token_the_server_accepts_and_names_missing_data() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(&binaries().meshca_certs)
        .args([
            "token",
            "--data-dir",
            &dir.path().join("nope").display().to_string(),
            "--namespace",
            "a",
            "--service-account",
            "b",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("nope"), "{stderr}");
}

#[tokio::test]
async fn agent_once_writes_a_matching_key_and_chain() {
    let (dir, server) = server();
    let token_file = dir.path().join("token");
    let out_dir = dir.path().join("out");
    std::fs::write(
        &token_file,
        run_ok(Command::new(&binaries().meshca_certs).args([
            "token",
            "--data-dir",
            &server.data_dir.display().to_string(),
            "--namespace",
            "default",
            "--service-account",
            "web",
        ])),
    )
    .unwrap();
    let stdout = run_ok(Command::new(&binaries().meshca_agent).args([
        "--ca-addr",
        &format!("https://{}", server.grpc),
        "--root-cert",
        &server.data_dir.join("root-cert.pem").display().to_string(),
        "--token-file",
        &token_file.display().to_string(),
        "--namespace",
        "default",
        "--service-account",
        "web",
        "--out",
        &out_dir.display().to_string(),
        "--once",
    ]));
    assert!(stdout.contains(WEB), "{stdout}");
    let key = meshca_certs::PrivateKey::from_pem(
        &std::fs::read_to_string(out_dir.join("key.pem")).unwrap(),
    )
    .unwrap();
    let chain =
        parse_certs_pem(&std::fs::read_to_string(out_dir.join("cert-chain.pem")).unwrap()).unwrap();
    let (_, leaf) = X509Certificate::from_der(&chain[0]).unwrap();
    assert_eq!(leaf.public_key().raw, key.public_key_spki_der().as_slice());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(out_dir.join("key.pem"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);
    }
}

/// A TLS connection to `server`'s gRPC port from a rustls client with its
/// default cipher suites (AES-256-GCM-SHA384 listed first) and ALPN `h2`.
async fn tls_connect(
    server: &MeshcaServer,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    tls_over(server, None).await
}

/// A TLS connection to `server` over `tcp` (default: a new one), as
/// [`tls_connect`].
async fn tls_over(
    server: &MeshcaServer,
    tcp: Option<tokio::net::TcpStream>,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    for der in parse_certs_pem(&server.root_pem()).unwrap() {
        roots.add(der.into()).unwrap();
    }
    let provider = rustls::crypto::ring::default_provider();
    assert_eq!(
        provider.cipher_suites[0].suite(),
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384
    );
    let mut config = rustls::ClientConfig::builder_with_provider(provider.into())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = match tcp {
        Some(tcp) => tcp,
        None => tokio::net::TcpStream::connect(server.grpc).await.unwrap(),
    };
    let name = rustls::pki_types::ServerName::try_from("istiod.istio-system.svc").unwrap();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    tls
}

/// The cipher suite `server` picks for a default rustls client, and the
/// SETTINGS_MAX_CONCURRENT_STREAMS of its HTTP/2 SETTINGS.
async fn tls_suite_and_stream_limit(server: &MeshcaServer) -> (rustls::CipherSuite, u32) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tls = tls_connect(server).await;
    let suite = tls.get_ref().1.negotiated_cipher_suite().unwrap().suite();

    // Client preface and an empty SETTINGS frame; the server's first frame
    // is its SETTINGS (RFC 9113 §3.4): 9-byte header, then 6-byte entries.
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut header = [0u8; 9];
    tls.read_exact(&mut header).await.unwrap();
    assert_eq!(header[3], 0x4, "first frame is SETTINGS: {header:?}");
    let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    let mut payload = vec![0u8; len];
    tls.read_exact(&mut payload).await.unwrap();
    let max_streams = payload
        .chunks_exact(6)
        .find(|entry| u16::from_be_bytes([entry[0], entry[1]]) == 0x3)
        .map(|entry| u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]))
        .expect("SETTINGS_MAX_CONCURRENT_STREAMS");
    (suite, max_streams)
}

#[tokio::test]
async fn the_grpc_port_prefers_aes_128_and_limits_streams_per_connection() {
    let (_dir, server) = server();
    let (suite, max_streams) = tls_suite_and_stream_limit(&server).await;
    // The server's order, not the client's: SHA-256 key schedule.
    assert_eq!(suite, rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    assert_eq!(max_streams, 128);

    let (dir, server) = server_with(&["--max-concurrent-streams", "7"]);
    assert_eq!(tls_suite_and_stream_limit(&server).await.1, 7);

    // Zero streams would refuse every request: the flag is refused.
    MeshcaServer::refuses_to_start(
        &dir.path().join("data2"),
        &["--max-concurrent-streams", "0"],
        "--max-concurrent-streams",
    );
}

/// `name`'s value on `server`'s /metrics, once it satisfies `done` (within 5 s).
fn metric_once(server: &MeshcaServer, name: &str, done: impl Fn(u64) -> bool) -> u64 {
    metric_within(server, name, done, Duration::from_secs(5))
}

/// `name`'s value on `server`'s /metrics, once it satisfies `done` (within `limit`).
fn metric_within(
    server: &MeshcaServer,
    name: &str,
    done: impl Fn(u64) -> bool,
    limit: Duration,
) -> u64 {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let (_, body) = http_get(server.monitoring, "/metrics").unwrap();
        let value = metric(&body, name);
        if done(value) || std::time::Instant::now() > deadline {
            return value;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn open_connections_and_failed_handshakes_are_exported() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_dir, server) = server();
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 0),
        0
    );
    assert_eq!(
        metric_once(&server, "meshca_tls_handshake_failure_count", |_| true),
        0
    );
    // The queue's gauge is exported, empty when idle.
    assert_eq!(metric_once(&server, "meshca_requests_waiting", |_| true), 0);

    let first = tls_connect(&server).await;
    let second = tls_connect(&server).await;
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 2),
        2
    );

    // Plain HTTP on the TLS port: the handshake fails, the server closes.
    let mut plain = tokio::net::TcpStream::connect(server.grpc).await.unwrap();
    plain
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    let _ = plain.read_to_end(&mut rest).await;
    assert_eq!(
        metric_once(&server, "meshca_tls_handshake_failure_count", |v| v == 1),
        1
    );

    drop(first);
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 1),
        1
    );
    drop(second);
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 0),
        0
    );
}

// Two worker threads: `metric_once` blocks its thread, and the client's
// connection task must still answer the server's GOAWAY and PING meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_connection_is_asked_to_reconnect_and_the_client_carries_on() {
    let (_dir, server) = server_with(&["--max-connection-age", "2s"]);
    let token = server.token("default", "web");
    let mut client = server.client().await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    client
        .create_certificate(with_token(request.clone(), &token))
        .await
        .expect("first request");
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 1),
        1
    );
    // Past its age the server sends GOAWAY and closes the idle connection,
    // although the client keeps its channel.
    assert_eq!(
        metric_within(
            &server,
            "meshca_grpc_connections",
            |v| v == 0,
            Duration::from_secs(15)
        ),
        0,
        "the connection outlived --max-connection-age"
    );
    // The same channel connects again on its next call.
    let response = client
        .create_certificate(with_token(request, &token))
        .await
        .expect("request after the server closed the old connection")
        .into_inner();
    assert_eq!(response.cert_chain.len(), 2);
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 1),
        1
    );

    // 0 turns it off: the connection stays.
    let (_dir, server) = server_with(&["--max-connection-age", "0"]);
    let _client = server.client().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(metric_once(&server, "meshca_grpc_connections", |_| true), 1);
}

#[tokio::test]
async fn a_request_never_finished_is_cancelled_after_the_request_timeout() {
    use meshca_proto::codec::CaCodec;
    use meshca_proto::IstioCertificateResponse;
    use tonic::codegen::http::uri::PathAndQuery;

    let (_dir, server) = server_with(&["--request-timeout", "1s"]);
    let mut grpc = tonic::client::Grpc::new(server.channel().await);
    grpc.ready().await.expect("channel ready");
    // Headers sent, the request message never: the server would wait for
    // it forever.
    let never = futures::stream::pending::<IstioCertificateRequest>();
    let call = grpc.client_streaming::<_, IstioCertificateRequest, IstioCertificateResponse, _>(
        with_token(never, &server.token("default", "web")),
        PathAndQuery::from_static("/istio.v1.auth.IstioCertificateService/CreateCertificate"),
        CaCodec::<IstioCertificateRequest, IstioCertificateResponse>::default(),
    );
    let status = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("the server never ended the unfinished request")
        .expect_err("an unfinished request cannot succeed");
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");

    // The server is fine: a whole request on a new channel is answered.
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    server
        .client()
        .await
        .create_certificate(with_token(request, &server.token("default", "web")))
        .await
        .expect("a complete request");

    let dir = tempfile::tempdir().unwrap();
    MeshcaServer::refuses_to_start(
        &dir.path().join("data"),
        &["--request-timeout", "0s"],
        "--request-timeout",
    );
}

/// Opens a CreateCertificate stream on `channel` that sends its HEADERS
/// (with `token`, if any) and never its message; what the server answers.
async fn headers_only(channel: tonic::transport::Channel, token: Option<String>) -> tonic::Status {
    use meshca_proto::codec::CaCodec;
    use meshca_proto::IstioCertificateResponse;
    use tonic::codegen::http::uri::PathAndQuery;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("channel ready");
    let never = futures::stream::pending::<IstioCertificateRequest>();
    let request = match &token {
        Some(token) => with_token(never, token),
        None => tonic::Request::new(never),
    };
    grpc.client_streaming::<_, IstioCertificateRequest, IstioCertificateResponse, _>(
        request,
        PathAndQuery::from_static("/istio.v1.auth.IstioCertificateService/CreateCertificate"),
        CaCodec::<IstioCertificateRequest, IstioCertificateResponse>::default(),
    )
    .await
    .expect_err("a request without its message cannot succeed")
}

#[tokio::test]
async fn streams_that_send_only_headers_cannot_hold_every_open_request_place() {
    let (_dir, server) = server_with(&["--max-open-requests", "8"]);
    let token = server.token("default", "web");
    let channel = server.channel().await;
    let certificate = || async {
        let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
        server
            .client()
            .await
            .create_certificate(with_token(request, &token))
            .await
    };

    // Four times the places in streams without credentials: each is
    // answered at its HEADERS, without waiting for its message.
    let unauthenticated = (0..32).map(|_| headers_only(channel.clone(), None));
    let answered = tokio::time::timeout(
        Duration::from_secs(10),
        futures::future::join_all(unauthenticated),
    )
    .await
    .expect("answered without their messages");
    for status in answered {
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    }
    certificate().await.expect("no place is held by them");

    // With a token and no message, a stream holds its place only until
    // its message is overdue (5 s), not for --request-timeout (30 s).
    // The probe's connection is made first: within the 5 s, each probe
    // is one request, not a handshake too.
    let prober = server.client().await;
    let probe = || async {
        let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
        prober
            .clone()
            .create_certificate(with_token(request, &token))
            .await
    };
    // A connection of their own, apart from the 32 refused streams'.
    let held_channel = server.channel().await;
    let started = std::time::Instant::now();
    let held: Vec<_> = (0..8)
        .map(|_| {
            let (channel, token) = (held_channel.clone(), token.clone());
            tokio::spawn(async move {
                // A probe that came in first may have taken the last
                // place: such a stream is refused at once, and tries again.
                loop {
                    let status = headers_only(channel.clone(), Some(token.clone())).await;
                    if status.code() != Code::ResourceExhausted {
                        return status;
                    }
                }
            })
        })
        .collect();
    let full = async {
        loop {
            match probe().await {
                Err(status) if status.code() == Code::ResourceExhausted => return status,
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    };
    // Probes succeed until the eight are in, then are refused until the
    // eight time out; a slow machine shifts that window, it does not
    // close it, so the wait is long.
    let refused = tokio::time::timeout(Duration::from_secs(15), full)
        .await
        .expect("the eight held streams take every place");
    assert!(
        refused.message().contains("--max-open-requests"),
        "{refused:?}"
    );
    for stream in held {
        let status = stream.await.unwrap();
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        assert!(status.message().contains("did not arrive"), "{status:?}");
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_secs(4) && elapsed < Duration::from_secs(15),
        "{elapsed:?}"
    );
    certificate().await.expect("the places are free again");
}

#[tokio::test]
async fn health_watches_cannot_hold_the_places_of_certificate_requests() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let (_dir, server) = server_with(&["--max-open-requests", "8"]);
    let channel = server.channel().await;
    let watch = || {
        let mut client = HealthClient::new(channel.clone());
        async move {
            client
                .watch(HealthCheckRequest {
                    service: String::new(),
                })
                .await
        }
    };
    // Without credentials: eight times the CA's open-request places, in
    // streams that never end by themselves.
    let mut watches = Vec::new();
    for _ in 0..64 {
        let mut stream = watch()
            .await
            .expect("a watch in the health pool")
            .into_inner();
        let first = stream.message().await.expect("a status").expect("one");
        assert_eq!(first.status(), ServingStatus::Serving);
        watches.push(stream);
    }
    let refused = watch().await.expect_err("the health pool is full");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("health requests"), "{refused:?}");

    // Certificate requests still have every one of their places.
    let token = server.token("default", "web");
    let client = server.client().await;
    let answers = (0..8).map(|_| {
        let mut client = client.clone();
        let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
        let request = with_token(request, &token);
        async move { client.create_certificate(request).await }
    });
    for answer in futures::future::join_all(answers).await {
        answer.expect("issued while 64 health watches are open");
    }
    drop(watches);
}

/// Reads HTTP/2 frames from `tls` until a GOAWAY (within `within`):
/// the GOAWAY's error code and how many RST_STREAM frames came before it.
/// `None` if the connection ended or the time ran out without one.
async fn goaway_after_resets<S>(tls: &mut S, within: Duration) -> Option<(u32, usize)>
where
    S: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let read = async {
        let mut resets = 0;
        loop {
            let mut header = [0u8; 9];
            tls.read_exact(&mut header).await.ok()?;
            let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
            let mut payload = vec![0u8; len];
            tls.read_exact(&mut payload).await.ok()?;
            match header[3] {
                0x3 => resets += 1,
                0x7 if payload.len() >= 8 => {
                    let code = u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
                    return Some((code, resets));
                }
                _ => {}
            }
        }
    };
    tokio::time::timeout(within, read).await.ok().flatten()
}

/// The client preface and an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

#[tokio::test]
async fn a_flood_of_malformed_requests_on_one_connection_gets_enhance_your_calm() {
    use tokio::io::AsyncWriteExt;
    let (_dir, server) = server();
    let mut tls = tls_connect(&server).await;
    tls.write_all(H2_PREFACE).await.unwrap();
    // HEADERS (END_STREAM | END_HEADERS) with POST https / and a
    // connection-specific header, which HTTP/2 forbids: each such request
    // is malformed, and the server resets its stream (RST_STREAM
    // PROTOCOL_ERROR) on its own account.
    let block: &[u8] = &[
        0x83, 0x87, 0x84, // :method POST, :scheme https, :path /
        0x00, 10, b'c', b'o', b'n', b'n', b'e', b'c', b't', b'i', b'o', b'n', 1, b'x',
    ];
    let mut frames = Vec::new();
    for n in 0..1_100u32 {
        let stream_id = 2 * n + 1;
        frames.extend_from_slice(&(block.len() as u32).to_be_bytes()[1..]);
        frames.extend_from_slice(&[0x1, 0x5]);
        frames.extend_from_slice(&stream_id.to_be_bytes());
        frames.extend_from_slice(block);
    }
    // Written while the answers are read: the server may stop reading.
    let (mut reader, mut writer) = tokio::io::split(tls);
    let write = tokio::spawn(async move {
        let _ = writer.write_all(&frames).await;
        let _ = writer.flush().await;
        writer
    });
    let (code, resets) = goaway_after_resets(&mut reader, Duration::from_secs(20))
        .await
        .expect("a GOAWAY within 1,100 malformed requests");
    assert_eq!(code, 0xb, "ENHANCE_YOUR_CALM");
    // Every one of the 1,100 HEADERS was malformed: a GOAWAY with
    // ENHANCE_YOUR_CALM before the last of them proves the limit (the
    // resets queued before it may or may not be flushed first).
    assert!(resets < 1_100, "{resets} streams reset before the GOAWAY");
    let _ = write.await;
}

#[tokio::test]
async fn an_idle_connection_is_sent_goaway_and_counted() {
    use tokio::io::AsyncWriteExt;
    let (_dir, server) = server_with(&["--max-connection-idle", "1s"]);
    let mut tls = tls_connect(&server).await;
    tls.write_all(H2_PREFACE).await.unwrap();
    let started = std::time::Instant::now();
    let (code, _) = goaway_after_resets(&mut tls, Duration::from_secs(20))
        .await
        .expect("a GOAWAY for the idle connection");
    assert_eq!(code, 0, "NO_ERROR: a graceful GOAWAY");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "GOAWAY after {:?}, before the idle limit",
        started.elapsed()
    );
    assert_eq!(
        metric_once(&server, "meshca_grpc_idle_connections_closed_count", |v| v
            == 1),
        1
    );
}

// Two worker threads: `metric_once` blocks its thread while the clients'
// connection tasks go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_closed_at_accept_and_counted() {
    use tokio::io::AsyncReadExt;
    let (_dir, server) = server_with(&["--max-connections", "2"]);
    let token = server.token("default", "web");
    let first = tls_connect(&server).await;
    let mut client = server.client().await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    client
        .create_certificate(with_token(request.clone(), &token))
        .await
        .expect("a request on the second connection");
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 2),
        2
    );

    // The third: accepted by the kernel, closed by the server before any
    // TLS byte.
    let mut third = tokio::net::TcpStream::connect(server.grpc).await.unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), third.read_to_end(&mut got))
        .await
        .expect("the server closes the connection");
    assert!(read.is_err() || got.is_empty(), "{got:?}");
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections_refused_count", |v| v == 1),
        1
    );
    assert_eq!(metric_once(&server, "meshca_grpc_connections", |_| true), 2);

    // A slot freed is a slot for the next client.
    drop(first);
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 1),
        1
    );
    let _again = tls_connect(&server).await;
    client
        .create_certificate(with_token(request, &token))
        .await
        .expect("the second connection still serves");
}

/// A TCP connection to `server`'s gRPC port from `source`, a loopback
/// address (Linux routes all of 127/8 to `lo`).
async fn tcp_from(server: &MeshcaServer, source: [u8; 4]) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(std::net::SocketAddr::from((source, 0)))
        .unwrap();
    socket.connect(server.grpc).await.unwrap()
}

/// A gRPC client of `server` whose connection comes from `source`, as
/// [`MeshcaServer::client`]; an error when the server closes it at accept.
async fn client_from(
    server: &MeshcaServer,
    source: [u8; 4],
) -> Result<
    meshca_proto::istio::v1::auth::istio_certificate_service_client::IstioCertificateServiceClient<
        tonic::transport::Channel,
    >,
    tonic::transport::Error,
> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(server.root_pem()))
        .domain_name("istiod.istio-system.svc");
    let channel = Endpoint::from_shared(format!("https://{}", server.grpc))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .local_address(Some(std::net::IpAddr::from(source)))
        .connect()
        .await?;
    Ok(meshca_proto::istio::v1::auth::istio_certificate_service_client::IstioCertificateServiceClient::new(channel))
}

// Two worker threads: `metric_once` blocks its thread while the clients'
// connection tasks go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_at_its_cap_is_refused_or_evicts_its_own_unauthenticated_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const FLOOD: [u8; 4] = [127, 0, 0, 2];
    const REAL: [u8; 4] = [127, 0, 0, 3];
    // Idle eviction off: only the per-source rules make room.
    let (_dir, server) = server_with(&[
        "--max-connections-per-source",
        "2",
        "--evict-idle-connections-after",
        "0",
    ]);
    let token = server.token("default", "web");
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    // Two connections from one source, each with an authenticated request.
    let mut first = client_from(&server, FLOOD).await.unwrap();
    first
        .create_certificate(with_token(request.clone(), &token))
        .await
        .expect("the source's first connection is served");
    let mut second = client_from(&server, FLOOD).await.unwrap();
    second
        .create_certificate(with_token(request.clone(), &token))
        .await
        .expect("the source's second connection is served");
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 2),
        2
    );

    // A third from the same source: none of its connections can make
    // room, so it is closed at accept, before any TLS byte.
    let mut third = tcp_from(&server, FLOOD).await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), third.read_to_end(&mut got))
        .await
        .expect("the server closes the connection");
    assert!(read.is_err() || got.is_empty(), "{got:?}");
    assert_eq!(
        metric_once(
            &server,
            "meshca_grpc_connections_refused_per_source_count",
            |v| v == 1
        ),
        1
    );
    // Another source still connects and is served.
    let mut other = client_from(&server, REAL)
        .await
        .expect("another source connects");
    other
        .create_certificate(with_token(request.clone(), &token))
        .await
        .expect("another source is served");
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 3),
        3
    );

    // The source's second seat taken by a connection that never makes a
    // request (a flood's).
    drop(second);
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 2),
        2
    );
    let mut unauthenticated = tls_over(&server, Some(tcp_from(&server, FLOOD).await)).await;
    unauthenticated.write_all(H2_PREFACE).await.unwrap();
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 3),
        3
    );
    // A newcomer from the source is refused until that connection has
    // gone 2 s (the server's clock) without an authenticated request,
    // then takes its seat.
    let started = std::time::Instant::now();
    let mut newcomer = loop {
        match client_from(&server, FLOOD).await {
            Ok(client) => break client,
            Err(e) => {
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "never seated: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    newcomer
        .create_certificate(with_token(request.clone(), &token))
        .await
        .expect("the newcomer is served");
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections_evicted_count", |v| v == 1),
        1
    );
    // The unauthenticated connection was told to go away and closed...
    let mut got = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        unauthenticated.read_to_end(&mut got),
    )
    .await
    .expect("the server closes the unauthenticated connection")
    .ok();
    // ...the source's real client and the other source's were not.
    first
        .create_certificate(with_token(request.clone(), &token))
        .await
        .expect("the source's authenticated connection still serves");
    other
        .create_certificate(with_token(request, &token))
        .await
        .expect("the other source's connection still serves");
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections_evicted_count", |_| true),
        1,
        "only the unauthenticated connection was evicted"
    );
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections_refused_count", |_| true),
        0,
        "the global cap was never reached"
    );
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 3),
        3
    );
}

/// At `--max-connections`, a new client gets its certificate, not a
/// refusal: one connection made room, counted by `made_room` (a metric).
/// Returns the newcomer's client, whose connection holds the seat.
async fn a_newcomer_is_served_by_making_room(
    server: &MeshcaServer,
    token: &str,
    made_room: &str,
) -> meshca_proto::istio::v1::auth::istio_certificate_service_client::IstioCertificateServiceClient<
    tonic::transport::Channel,
> {
    let mut client = server.client().await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    client
        .create_certificate(with_token(request, token))
        .await
        .expect("the newcomer is served");
    assert_eq!(metric_once(server, made_room, |v| v == 1), 1, "{made_room}");
    assert_eq!(
        metric_once(server, "meshca_grpc_connections_refused_count", |_| true),
        0
    );
    client
}

// Two worker threads: `metric_once` blocks its thread while the clients'
// connection tasks go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_the_connection_idle_longest_makes_room_for_a_new_one() {
    use tokio::io::AsyncReadExt;
    let (_dir, server) = server_with(&[
        "--max-connections",
        "2",
        "--evict-idle-connections-after",
        "1s",
    ]);
    let token = server.token("default", "web");
    // Every seat held by connections that never ask anything (a flood).
    let mut oldest = tls_connect(&server).await;
    // The server marks a connection established when it has read the
    // client's Finished, after `tls_connect` returns; its first HTTP/2
    // bytes (SETTINGS) come after that: waited for, so that on a loaded
    // machine the oldest is still the one idle longest.
    let mut first = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(10), oldest.read_exact(&mut first))
        .await
        .expect("the server's HTTP/2 preface on the oldest connection")
        .unwrap();
    let mut younger = tls_connect(&server).await;
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 2),
        2
    );
    // Idleness is the server's own clock: both must be idle for 1 s.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // A newcomer gets a seat and its certificate, not a refusal.
    let _newcomer = a_newcomer_is_served_by_making_room(
        &server,
        &token,
        "meshca_grpc_connections_evicted_count",
    )
    .await;
    // The one idle longest was told to go away and closed...
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), oldest.read_to_end(&mut got))
        .await
        .expect("the server closes the connection idle longest")
        .ok();
    // ...the other still holds its seat.
    let mut one = [0u8; 1];
    let mut still_open = true;
    while let Ok(read) =
        tokio::time::timeout(Duration::from_millis(300), younger.read(&mut one)).await
    {
        // The server's HTTP/2 SETTINGS may still be unread; EOF is not.
        if !matches!(read, Ok(n) if n > 0) {
            still_open = false;
            break;
        }
    }
    assert!(still_open, "only one connection is evicted");
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 2),
        2
    );
}

// Two worker threads: `metric_once` blocks its thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_a_connection_that_never_starts_tls_makes_room_for_a_new_one() {
    use tokio::io::AsyncReadExt;
    let (_dir, server) = server_with(&[
        "--max-connections",
        "2",
        "--evict-idle-connections-after",
        "0",
    ]);
    let token = server.token("default", "web");
    // Every seat held by raw TCP connections that never send a byte.
    let mut oldest = tokio::net::TcpStream::connect(server.grpc).await.unwrap();
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 1),
        1
    );
    let mut younger = tokio::net::TcpStream::connect(server.grpc).await.unwrap();
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 2),
        2
    );
    // A handshake is stalled after 2 s of the server's own clock.
    tokio::time::sleep(Duration::from_millis(2300)).await;

    // A newcomer gets a seat and its certificate, not a refusal, even
    // with idle eviction off.
    let _newcomer = a_newcomer_is_served_by_making_room(
        &server,
        &token,
        "meshca_grpc_stalled_handshakes_cut_count",
    )
    .await;
    // The oldest was cut off; the younger still holds its seat.
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), oldest.read_to_end(&mut got))
        .await
        .expect("the server closes the stalled connection")
        .ok();
    assert!(got.is_empty(), "nothing is sent to a cut-off connection");
    let mut one = [0u8; 1];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), younger.read(&mut one))
            .await
            .is_err(),
        "only one stalled connection is cut off"
    );
}

#[tokio::test]
async fn a_client_that_never_finishes_its_handshake_is_dropped() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_dir, server) = server_with(&["--tls-handshake-timeout", "1s"]);
    // The first bytes of a ClientHello, then nothing.
    let mut stalled = tokio::net::TcpStream::connect(server.grpc).await.unwrap();
    stalled
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00])
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stalled.read_to_end(&mut rest))
        .await
        .expect("the server drops the connection")
        .ok();
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "dropped after {:?}, before the handshake timeout",
        started.elapsed()
    );
    assert_eq!(
        metric_once(&server, "meshca_tls_handshake_timeout_count", |v| v == 1),
        1
    );
    assert_eq!(
        metric_once(&server, "meshca_grpc_connections", |v| v == 0),
        0
    );
}

/// Flags that need the Kubernetes API are refused without one before
/// anything is written: the data directory stays as it was, with no root
/// and no local token issuer (the `--jwt-issuer` check once ran after the
/// local issuer's files were written).
#[test]
fn flags_that_need_a_cluster_are_refused_before_the_data_directory_is_written() {
    use meshca_certs::token::{ISSUER_JWKS_FILE, ISSUER_KEY_FILE};
    let dir = tempfile::tempdir().unwrap();
    for (i, (flags, expected)) in [
        (
            &[
                "--jwt-issuer",
                "https://kubernetes.default.svc.cluster.local",
            ][..],
            "--jwt-issuer without --jwks needs the Kubernetes API",
        ),
        (
            &["--trusted-node-agent", "istio-system/ztunnel"][..],
            "--trusted-node-agent needs the Kubernetes API",
        ),
        (
            &["--pod-certificate-signer", "meshca.io/spiffe"][..],
            "--pod-certificate-signer needs the Kubernetes API",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let data = dir.path().join(format!("data{i}"));
        MeshcaServer::refuses_to_start(&data, flags, expected);
        for file in [ISSUER_KEY_FILE, ISSUER_JWKS_FILE] {
            assert!(!data.join(file).exists(), "{flags:?} wrote {file}");
        }
        assert!(!data.exists(), "{flags:?} created the data directory");
    }
}
