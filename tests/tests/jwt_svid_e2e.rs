//! End-to-end tests of JWT-SVIDs with the real binaries: `meshca`'s
//! `meshca.v1.JwtSvidService` and its OIDC discovery endpoint, and
//! `meshca-agent`'s Workload API JWT methods, checked by independent
//! clients: the `spiffe` crate's `JwtSource` on the agent's socket, and
//! Python's PyJWT, a validator that knows nothing but the discovery
//! document's URL (as a cloud's STS or Vault would).

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use meshca_proto::meshca::v1::jwt_svid_service_client::JwtSvidServiceClient;
use meshca_proto::meshca::v1::{FetchJwtBundleRequest, MintJwtSvidRequest};
use meshca_proto::spiffe_workload::spiffe_workload_api_client::SpiffeWorkloadApiClient;
use meshca_proto::spiffe_workload::{JwtBundlesRequest, JwtsvidRequest, ValidateJwtsvidRequest};
use meshca_tests::agent_process::{unix_channel, Agent};
use meshca_tests::*;
use serde_json::Value;
use tonic::Code;

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";

/// A validator that knows only the issuer URL: PyJWT's `PyJWKClient`
/// reads the discovery document, fetches its `jwks_uri` (keys with
/// `use: sig`; refetched once when a token names an unknown `kid`),
/// then checks signature, `aud`, `exp`, `iss`. One token a line on
/// stdin, one answer a line on stdout: `OK <sub> <kid>` or `FAIL <why>`.
const PYJWT_VALIDATOR: &str = r#"
import json, sys, urllib.request
import jwt
issuer, audience = sys.argv[1], sys.argv[2]
config = json.load(urllib.request.urlopen(issuer + "/.well-known/openid-configuration"))
assert config["issuer"] == issuer, config
client = jwt.PyJWKClient(config["jwks_uri"], cache_keys=False, lifespan=1)
for line in sys.stdin:
    token = line.strip()
    try:
        key = client.get_signing_key_from_jwt(token)
        claims = jwt.decode(token, key.key, algorithms=config["id_token_signing_alg_values_supported"],
                            audience=audience, issuer=issuer, options={"require": ["exp", "iat", "sub", "aud"]})
        print("OK", claims["sub"], jwt.get_unverified_header(token)["kid"], flush=True)
    except Exception as e:
        print("FAIL", type(e).__name__, str(e).replace("\n", " "), flush=True)
"#;

/// Whether PyJWT is importable; with `CI` set its absence fails the test.
fn have_pyjwt() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import jwt, cryptography"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let message = "PyJWT is not installed (pip install pyjwt cryptography)";
        if std::env::var_os("CI").is_some() {
            panic!("{message} (CI is set, so the test fails instead of skipping)");
        }
        eprintln!("skipped: {message}");
    }
    ok
}

struct PyJwt {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl PyJwt {
    fn start(issuer: &str, audience: &str) -> Self {
        let mut child = Command::new("python3")
            .args(["-c", PYJWT_VALIDATOR, issuer, audience])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Self {
            child,
            stdin,
            stdout,
        }
    }

    fn check(&mut self, token: &str) -> String {
        writeln!(self.stdin, "{token}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "PyJWT exited");
        line.trim().to_string()
    }
}

impl Drop for PyJwt {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn decode(part: &str) -> Value {
    serde_json::from_slice(&URL_SAFE_NO_PAD.decode(part).unwrap()).unwrap()
}

/// An HTTP/1.1 GET: (status line and headers, body).
fn http_get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}

fn oidc_flags(port: u16) -> (String, Vec<String>) {
    let issuer = format!("http://127.0.0.1:{port}");
    let flags = vec![
        "--jwt-svid-issuer".to_string(),
        issuer.clone(),
        "--oidc-listen".to_string(),
        format!("127.0.0.1:{port}"),
    ];
    (issuer, flags)
}

fn mint_request(audiences: &[&str], lifetime: i64, impersonate: &str) -> MintJwtSvidRequest {
    MintJwtSvidRequest {
        audiences: audiences.iter().map(|a| a.to_string()).collect(),
        lifetime_seconds: lifetime,
        impersonated_identity: impersonate.into(),
    }
}

#[tokio::test]
async fn the_ca_mints_spiffe_jwt_svids_that_pyjwt_verifies_from_the_discovery_document_alone() {
    for alg in ["ES256", "RS256"] {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let (issuer, mut flags) = oidc_flags(port);
        flags.extend(["--jwt-svid-algorithm".to_string(), alg.to_string()]);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let server = MeshcaServer::start(&dir.path().join("data"), &flags).unwrap();
        let mut client = JwtSvidServiceClient::new(server.channel().await);
        let token = server.token("default", "web");

        let minted = client
            .mint_jwt_svid(with_token(
                mint_request(&["sts.amazonaws.com"], 0, ""),
                &token,
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(minted.spiffe_id, WEB);
        let parts: Vec<&str> = minted.token.split('.').collect();
        assert_eq!(parts.len(), 3);
        let header = decode(parts[0]);
        assert_eq!(
            header.as_object().unwrap().len(),
            3,
            "alg, kid, typ only: {header}"
        );
        assert_eq!(header["alg"], alg);
        assert_eq!(header["typ"], "JWT");
        let claims = decode(parts[1]);
        assert_eq!(claims["sub"], WEB);
        assert_eq!(claims["aud"], "sts.amazonaws.com");
        assert_eq!(claims["iss"], issuer.as_str());
        let (iat, exp) = (
            claims["iat"].as_i64().unwrap(),
            claims["exp"].as_i64().unwrap(),
        );
        assert_eq!(exp - iat, 300, "5 minutes by default");
        assert!((iat - now()).abs() <= 5);
        assert!(!server.log().contains(&minted.token), "no token in the log");
        assert!(server.log().contains("issued JWT-SVID"), "audited");

        // The discovery document and the JWKS, cacheable for less than the
        // announcement of a new key (1 h: max-age 5 min).
        let (head, body) = http_get(
            format!("127.0.0.1:{port}").parse().unwrap(),
            "/.well-known/openid-configuration",
        );
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("cache-control: public, max-age=300"),
            "{head}"
        );
        let document: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(document["issuer"], issuer.as_str());
        assert_eq!(document["jwks_uri"], format!("{issuer}/keys").as_str());
        assert_eq!(
            document["id_token_signing_alg_values_supported"],
            serde_json::json!([alg])
        );
        let (_, jwks) = http_get(format!("127.0.0.1:{port}").parse().unwrap(), "/keys");
        let jwks: Value = serde_json::from_str(&jwks).unwrap();
        assert_eq!(jwks["keys"][0]["use"], "sig");
        assert_eq!(jwks["keys"][0]["kid"], header["kid"]);
        assert!(jwks["keys"][0].get("d").is_none(), "no private part");

        // The SPIFFE bundle, over gRPC: the same key, use jwt-svid.
        let bundle = client
            .fetch_jwt_bundle(with_token(FetchJwtBundleRequest {}, &token))
            .await
            .unwrap()
            .into_inner();
        let spiffe: Value = serde_json::from_slice(&bundle.jwks).unwrap();
        assert_eq!(spiffe["keys"][0]["use"], "jwt-svid");
        assert_eq!(spiffe["keys"][0]["kid"], header["kid"]);
        assert_eq!(bundle.trust_domain, "cluster.local");

        if have_pyjwt() {
            let mut pyjwt = PyJwt::start(&issuer, "sts.amazonaws.com");
            let answer = pyjwt.check(&minted.token);
            assert!(answer.starts_with(&format!("OK {WEB}")), "{answer}");
            let other = client
                .mint_jwt_svid(with_token(mint_request(&["vault"], 0, ""), &token))
                .await
                .unwrap()
                .into_inner();
            let answer = pyjwt.check(&other.token);
            assert!(answer.starts_with("FAIL InvalidAudienceError"), "{answer}");
        }

        // Refusals, with the codes CreateCertificate answers.
        let refused = |request: tonic::Request<MintJwtSvidRequest>| {
            let mut client = client.clone();
            async move { client.mint_jwt_svid(request).await.unwrap_err() }
        };
        let status = refused(tonic::Request::new(mint_request(&["x"], 0, ""))).await;
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        let status = refused(with_token(mint_request(&[], 0, ""), &token)).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("audience"), "{status:?}");
        let status = refused(with_token(mint_request(&["x"], 3601, ""), &token)).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains("--max-jwt-svid-ttl"),
            "{status:?}"
        );
        let status = refused(with_token(
            mint_request(&["x"], 0, "spiffe://cluster.local/ns/default/sa/db"),
            &token,
        ))
        .await;
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        let status = refused(with_token(mint_request(&["x"], 0, ""), "junk")).await;
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    }
}

#[tokio::test]
async fn the_per_identity_rate_limit_holds_for_jwt_svids_with_a_budget_of_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let server = MeshcaServer::start(
        &dir.path().join("data"),
        &["--issuance-burst", "2", "--issuance-interval", "1h"],
    )
    .unwrap();
    let mut client = JwtSvidServiceClient::new(server.channel().await);
    let token = server.token("default", "web");
    for _ in 0..2 {
        client
            .mint_jwt_svid(with_token(mint_request(&["x"], 0, ""), &token))
            .await
            .unwrap();
    }
    let status = client
        .mint_jwt_svid(with_token(mint_request(&["x"], 0, ""), &token))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("too many JWT-SVIDs"),
        "{status:?}"
    );
    // X.509-SVIDs are not held back by the JWT-SVIDs minted.
    ask(&server, &token, WEB).await.unwrap();
}

fn workload<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("workload.spiffe.io", "true".parse().unwrap());
    request
}

fn fetch(audience: &str) -> tonic::Request<JwtsvidRequest> {
    workload(JwtsvidRequest {
        audience: vec![audience.into()],
        spiffe_id: String::new(),
    })
}

fn validate(token: &str, audience: &str) -> tonic::Request<ValidateJwtsvidRequest> {
    workload(ValidateJwtsvidRequest {
        audience: audience.into(),
        svid: token.into(),
    })
}

/// An ES256 token signed by a key no bundle holds, under `kid`.
fn foreign_token(kid: &str, claims: &Value) -> String {
    use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    token_signed_with(pkcs8.as_ref(), kid, claims)
}

/// An ES256 token signed with the PKCS#8 P-256 key `pkcs8`, under `kid`.
fn token_signed_with(pkcs8: &[u8], kid: &str, claims: &Value) -> String {
    use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
    let rng = ring::rand::SystemRandom::new();
    let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8, &rng).unwrap();
    let input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD
            .encode(serde_json::json!({"alg": "ES256", "kid": kid, "typ": "JWT"}).to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let signature = key.sign(&rng, input.as_bytes()).unwrap();
    format!("{input}.{}", URL_SAFE_NO_PAD.encode(signature.as_ref()))
}

fn start_agent(server: &MeshcaServer, dir: &Path) -> (Agent, std::path::PathBuf) {
    std::fs::write(dir.join("root-cert.pem"), server.root_pem()).unwrap();
    let socket = dir.join("agent.sock");
    let agent = Agent::start(
        server,
        dir,
        &server.token("default", "web"),
        "agent",
        &[
            "--spiffe-id",
            WEB,
            "--workload-api-socket",
            &socket.display().to_string(),
        ],
    );
    (agent, socket)
}

#[tokio::test]
async fn the_agent_serves_caches_and_validates_jwt_svids_and_refuses_what_the_spec_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let server = MeshcaServer::start(&dir.path().join("data"), &[]).unwrap();
    let (mut agent, socket) = start_agent(&server, dir.path());
    agent.wait_for_socket(&socket).await;
    let mut api = SpiffeWorkloadApiClient::new(unix_channel(&socket).await);

    let svid = api
        .fetch_jwtsvid(fetch("vault"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(svid.svids.len(), 1);
    assert_eq!(svid.svids[0].spiffe_id, WEB);
    let token = svid.svids[0].svid.clone();
    let claims = decode(token.split('.').nth(1).unwrap());
    assert_eq!(claims["sub"], WEB);
    assert_eq!(claims["aud"], "vault");

    // Cached: the same token while it has more than half its life left,
    // and fast (a debug build; BENCHMARKS.md has the release numbers).
    let mut latencies = Vec::new();
    for _ in 0..200 {
        let started = Instant::now();
        let again = api
            .fetch_jwtsvid(fetch("vault"))
            .await
            .unwrap()
            .into_inner();
        latencies.push(started.elapsed());
        assert_eq!(again.svids[0].svid, token, "served from the cache");
    }
    latencies.sort();
    eprintln!(
        "cached FetchJWTSVID over the socket (debug build): p50 {:?} p99 {:?}",
        latencies[100], latencies[198]
    );
    // Another audience set is another token.
    let other = api.fetch_jwtsvid(fetch("sts")).await.unwrap().into_inner();
    assert_ne!(other.svids[0].svid, token);
    // Another identity is refused; no audience is INVALID_ARGUMENT.
    let status = api
        .fetch_jwtsvid(workload(JwtsvidRequest {
            audience: vec!["vault".into()],
            spiffe_id: "spiffe://cluster.local/ns/default/sa/db".into(),
        }))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let status = api
        .fetch_jwtsvid(workload(JwtsvidRequest {
            audience: vec![],
            spiffe_id: String::new(),
        }))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    // The bundle stream: the key that signed the token, use jwt-svid.
    let mut bundles = api
        .fetch_jwt_bundles(workload(JwtBundlesRequest {}))
        .await
        .unwrap()
        .into_inner();
    let first = bundles.message().await.unwrap().unwrap();
    let jwks: Value = serde_json::from_slice(&first.bundles["spiffe://cluster.local"]).unwrap();
    let kid = decode(token.split('.').next().unwrap())["kid"].clone();
    assert!(
        jwks["keys"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["kid"] == kid && k["use"] == "jwt-svid"),
        "{jwks}"
    );

    // The `spiffe` crate's JwtSource, an independent Workload API client:
    // it parses the agent's JWT-SVID and JWT bundle per the SPIFFE specs,
    // and the bundle holds the token's key.
    let source = spiffe::jwt_source::JwtSource::builder()
        .endpoint(format!("unix://{}", socket.display()))
        .initial_sync_timeout(Duration::from_secs(30))
        .build()
        .await
        .expect("a JwtSource on the agent's socket");
    let from_source = source.fetch_jwt_svid(["vault"]).await.unwrap();
    assert_eq!(from_source.spiffe_id().to_string(), WEB);
    assert_eq!(from_source.audience(), ["vault".to_string()]);
    let trust_domain = spiffe::TrustDomain::new("cluster.local").unwrap();
    let bundle = source
        .try_bundle_for_trust_domain(&trust_domain)
        .expect("the trust domain's JWT bundle");
    assert!(
        bundle.find_jwt_authority(from_source.key_id()).is_some(),
        "the JwtSource's bundle holds the token's key"
    );
    source.shutdown().await;

    // Validation: the good token, then each refusal named.
    let valid = api
        .validate_jwtsvid(validate(&token, "vault"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(valid.spiffe_id, WEB);
    let fields = valid.claims.unwrap().fields;
    assert!(
        fields.contains_key("exp") && fields.contains_key("aud"),
        "{fields:?}"
    );

    let mut refusals = vec![
        (token.clone(), "sts", "aud does not name".to_string()),
        (
            foreign_token(kid.as_str().unwrap(), &claims),
            "vault",
            "signature does not verify".into(),
        ),
        (
            foreign_token("retired-key", &claims),
            "vault",
            "not in the trust domain's JWT bundle".into(),
        ),
    ];
    let body = token.split('.').nth(1).unwrap().to_string();
    for alg in ["none", "HS256"] {
        let header = URL_SAFE_NO_PAD
            .encode(serde_json::json!({"alg": alg, "kid": kid, "typ": "JWT"}).to_string());
        refusals.push((
            format!("{header}.{body}.c2lnbmF0dXJl"),
            "vault",
            format!("algorithm \"{alg}\" is not allowed"),
        ));
    }
    // An expired token: one second of life, from the CA itself.
    let mut ca = JwtSvidServiceClient::new(server.channel().await);
    let short = ca
        .mint_jwt_svid(with_token(
            mint_request(&["vault"], 1, ""),
            &server.token("default", "web"),
        ))
        .await
        .unwrap()
        .into_inner();
    tokio::time::sleep(Duration::from_millis(2100)).await;
    refusals.push((short.token, "vault", "expired".into()));
    for (token, audience, expected) in refusals {
        let status = api
            .validate_jwtsvid(validate(&token, audience))
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "{expected}: {status:?}"
        );
        assert!(
            status.message().contains(&expected),
            "{expected}: {status:?}"
        );
    }
    assert!(!agent.log().contains(&token), "no token in the agent's log");
}

#[tokio::test]
async fn keys_rotate_while_validators_check_continuously_with_zero_failures() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let (issuer, mut flags) = oidc_flags(port);
    // A rotation every 8 s: each key announced 4 s before it signs, the
    // bundle refreshed every second.
    flags.extend(
        [
            "--max-jwt-svid-ttl",
            "4s",
            "--jwt-svid-ttl",
            "4s",
            "--jwt-key-rotation",
            "8s",
        ]
        .map(String::from),
    );
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let server = MeshcaServer::start(&dir.path().join("data"), &flags).unwrap();
    // The first key, private part included, to sign with once it is retired.
    let first: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("data/jwt-svid-keys.json")).unwrap())
            .unwrap();
    let first_kid = first["keys"][0]["kid"].as_str().unwrap().to_string();
    let first_pkcs8 = base64::engine::general_purpose::STANDARD
        .decode(first["keys"][0]["pkcs8"].as_str().unwrap())
        .unwrap();
    let (mut agent, socket) = start_agent(&server, dir.path());
    agent.wait_for_socket(&socket).await;
    let mut api = SpiffeWorkloadApiClient::new(unix_channel(&socket).await);
    let mut pyjwt = have_pyjwt().then(|| PyJwt::start(&issuer, "vault"));

    let mut kids = std::collections::BTreeSet::new();
    let (mut checks, mut failures) = (0, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(26);
    while Instant::now() < deadline {
        let svid = api
            .fetch_jwtsvid(fetch("vault"))
            .await
            .unwrap()
            .into_inner();
        let token = svid.svids[0].svid.clone();
        kids.insert(
            decode(token.split('.').next().unwrap())["kid"]
                .as_str()
                .unwrap()
                .to_string(),
        );
        match api.validate_jwtsvid(validate(&token, "vault")).await {
            Ok(v) => assert_eq!(v.into_inner().spiffe_id, WEB),
            Err(status) => failures.push(format!("agent: {status:?}")),
        }
        if let Some(pyjwt) = pyjwt.as_mut() {
            let answer = pyjwt.check(&token);
            if !answer.starts_with("OK") {
                failures.push(format!("PyJWT: {answer}"));
            }
        }
        checks += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "{checks} checks over {} keys, {} failures",
        kids.len(),
        failures.len()
    );
    assert!(
        kids.len() >= 3,
        "two rotations at least: {kids:?}\n{}",
        server.log()
    );
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(checks > 50, "{checks}");
    // A token signed by the retired first key, still within its `exp`
    // (as only the key's holder could make it): refused by both.
    assert!(kids.contains(&first_kid), "{kids:?}");
    let (_, jwks) = http_get(format!("127.0.0.1:{port}").parse().unwrap(), "/keys");
    assert!(!jwks.contains(&first_kid), "retired: {jwks}");
    let retired = token_signed_with(
        &first_pkcs8,
        &first_kid,
        &serde_json::json!({"sub": WEB, "aud": "vault", "iat": now(), "exp": now() + 60}),
    );
    let status = api
        .validate_jwtsvid(validate(&retired, "vault"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("not in the trust domain's JWT bundle"),
        "{status:?}"
    );
    if let Some(pyjwt) = pyjwt.as_mut() {
        let answer = pyjwt.check(&retired);
        assert!(answer.starts_with("FAIL"), "{answer}");
    }
    // The rotations are on /metrics: keys published and retired, and a
    // signing key younger than one rotation.
    let (_, metrics) = http_get(server.monitoring, "/metrics");
    assert!(
        labelled(
            &metrics,
            "meshca_jwt_svid_key_change_count{change=\"published\"}"
        ) >= 2.0,
        "{metrics}"
    );
    assert!(
        labelled(
            &metrics,
            "meshca_jwt_svid_key_change_count{change=\"retired\"}"
        ) >= 1.0,
        "{metrics}"
    );
    let age = labelled(&metrics, "meshca_jwt_svid_signing_key_age_seconds");
    assert!((0.0..=8.0).contains(&age), "{metrics}");
    let published = labelled(&metrics, "meshca_jwt_svid_keys_published");
    assert!((1.0..=3.0).contains(&published), "{metrics}");
}

/// The value of the series `series` (name and labels, as printed) in a
/// /metrics page.
fn labelled(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing in\n{page}"))
}

/// A channel to `server` presenting the client certificate `chain` of `key`.
async fn channel_with_certificate(
    server: &MeshcaServer,
    chain: &[String],
    key: &meshca_certs::PrivateKey,
) -> tonic::transport::Channel {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(server.root_pem()))
        .domain_name("istiod.istio-system.svc")
        .identity(Identity::from_pem(chain.concat(), key.to_pkcs8_pem()));
    Endpoint::from_shared(format!("https://{}", server.grpc))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_jwt_svid_never_outlives_the_client_certificate_that_asked_and_mints_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let server = MeshcaServer::start(&dir.path().join("data"), &[]).unwrap();
    let token = server.token("default", "web");
    // A certificate living 200 s, shorter than the tokens' default 5 min.
    let (key, request) = csr_request(meshca_certs::KeyAlgorithm::EcdsaP256, WEB, 200);
    let chain = server
        .client()
        .await
        .create_certificate(with_token(request, &token))
        .await
        .unwrap()
        .into_inner()
        .cert_chain;
    let leaf = meshca_certs::bundle::parse_certs_pem(&chain[0]).unwrap();
    let not_after = meshca_certs::inspect::CertSummary::from_der(&leaf[0])
        .unwrap()
        .not_after
        .unix_timestamp();
    let mut by_certificate =
        JwtSvidServiceClient::new(channel_with_certificate(&server, &chain, &key).await);
    let claims_of = |token: &str| decode(token.split('.').nth(1).unwrap());
    for lifetime in [0, 3600] {
        let minted = by_certificate
            .mint_jwt_svid(tonic::Request::new(mint_request(&["vault"], lifetime, "")))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(minted.spiffe_id, WEB);
        let claims = claims_of(&minted.token);
        assert_eq!(
            claims["exp"].as_i64(),
            Some(not_after),
            "lifetime {lifetime}: capped at the certificate's notAfter"
        );
        assert_eq!(minted.expires_at, not_after);
        assert!(claims["iat"].as_i64().unwrap() < not_after - 100);
    }
    // Shorter than the certificate: as asked.
    let minted = by_certificate
        .mint_jwt_svid(tonic::Request::new(mint_request(&["vault"], 60, "")))
        .await
        .unwrap()
        .into_inner();
    let claims = claims_of(&minted.token);
    assert_eq!(
        claims["exp"].as_i64().unwrap() - claims["iat"].as_i64().unwrap(),
        60
    );
    // A token caller is not capped by any certificate.
    let mut by_token = JwtSvidServiceClient::new(server.channel().await);
    let minted = by_token
        .mint_jwt_svid(with_token(mint_request(&["vault"], 3600, ""), &token))
        .await
        .unwrap()
        .into_inner();
    let claims = claims_of(&minted.token);
    assert_eq!(
        claims["exp"].as_i64().unwrap() - claims["iat"].as_i64().unwrap(),
        3600
    );
    let status = by_token
        .mint_jwt_svid(with_token(
            mint_request(&["x"], 0, "spiffe://cluster.local/ns/default/sa/db"),
            &token,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);

    // /metrics: four issued, one refused, one key signing since the start.
    let (_, metrics) = http_get(server.monitoring, "/metrics");
    assert_eq!(
        labelled(&metrics, "meshca_jwt_svid_mint_count{result=\"issued\"}"),
        4.0,
        "{metrics}"
    );
    assert_eq!(
        labelled(
            &metrics,
            "meshca_jwt_svid_mint_count{result=\"permission_denied\"}"
        ),
        1.0,
        "{metrics}"
    );
    assert_eq!(labelled(&metrics, "meshca_jwt_svid_keys_published"), 1.0);
    let age = labelled(&metrics, "meshca_jwt_svid_signing_key_age_seconds");
    assert!((0.0..120.0).contains(&age), "{metrics}");
    assert_eq!(
        labelled(&metrics, "meshca_jwt_svid_key_rotation_failed_count"),
        0.0
    );
}

/// Server CPU time of `pid` (user + system), from `/proc/PID/stat`.
fn cpu_seconds(pid: u32) -> f64 {
    stat_cpu_seconds(&format!("/proc/{pid}/stat"))
}

/// CPU time (user + system) in a `stat` file of `/proc`.
fn stat_cpu_seconds(path: &str) -> f64 {
    let stat = std::fs::read_to_string(path).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the name.
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// The measurement of BENCHMARKS.md's JWT-SVID rows (run with
/// `--ignored --nocapture`): JWT-SVIDs minted per server CPU-second
/// against the crypto limit of one ES256 signature plus one ES256 token
/// verification, measured in the same run, and the agent's cached
/// `FetchJWTSVID` latency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: cargo test --test jwt_svid_e2e -- --ignored --nocapture"]
async fn measure_mint_rate_against_the_crypto_limit_and_the_cached_fetch_latency() {
    use ring::signature::{EcdsaKeyPair, KeyPair as _, ECDSA_P256_SHA256_FIXED_SIGNING};
    let dir = tempfile::tempdir().unwrap();
    // Every request's token checked (no reuse of a verified token), as
    // the crypto limit below counts one verification per request.
    let server = MeshcaServer::start(
        &dir.path().join("data"),
        &["--issuance-burst", "0", "--jwt-cache-ttl", "0"],
    )
    .unwrap();
    let token = server.token("default", "web");
    let channel = server.channel().await;
    // Warm up the connection.
    JwtSvidServiceClient::new(channel.clone())
        .mint_jwt_svid(with_token(mint_request(&["vault"], 0, ""), &token))
        .await
        .unwrap();
    let cpu_before = cpu_seconds(server.pid());
    let started = Instant::now();
    let run = Duration::from_secs(5);
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let mut client = JwtSvidServiceClient::new(channel.clone());
        let token = token.clone();
        tasks.push(tokio::spawn(async move {
            let mut minted = 0u64;
            while started.elapsed() < run {
                client
                    .mint_jwt_svid(with_token(mint_request(&["vault"], 0, ""), &token))
                    .await
                    .unwrap();
                minted += 1;
            }
            minted
        }));
    }
    let mut minted = 0;
    for task in tasks {
        minted += task.await.unwrap();
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(server.pid()) - cpu_before;

    // The crypto limit, measured now: one ES256 signature and one verification.
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    let key =
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng).unwrap();
    let public = ring::signature::UnparsedPublicKey::new(
        &ring::signature::ECDSA_P256_SHA256_FIXED,
        key.public_key().as_ref().to_vec(),
    );
    let message = [7u8; 300];
    // Timed in this thread's CPU time, so other processes on the cores
    // do not make the limit look lower.
    let n = 20_000;
    let cpu_start = stat_cpu_seconds("/proc/thread-self/stat");
    for _ in 0..n {
        let signature = key.sign(&rng, &message).unwrap();
        public.verify(&message, signature.as_ref()).unwrap();
    }
    let per_op = (stat_cpu_seconds("/proc/thread-self/stat") - cpu_start) / n as f64;
    let limit = 1.0 / per_op;
    let rate = minted as f64 / cpu;
    eprintln!(
        "minted {minted} JWT-SVIDs in {wall:.1} s wall, {cpu:.2} s server CPU: {rate:.0}/CPU-s; crypto limit (ES256 sign + verify) {limit:.0}/s; ratio {:.2}",
        rate / limit
    );

    let (mut agent, socket) = start_agent(&server, dir.path());
    agent.wait_for_socket(&socket).await;
    let mut api = SpiffeWorkloadApiClient::new(unix_channel(&socket).await);
    api.fetch_jwtsvid(fetch("vault")).await.unwrap();
    let mut latencies = Vec::new();
    for _ in 0..5000 {
        let t = Instant::now();
        api.fetch_jwtsvid(fetch("vault")).await.unwrap();
        latencies.push(t.elapsed());
    }
    latencies.sort();
    eprintln!(
        "cached FetchJWTSVID: p50 {:?} p99 {:?} max {:?} (5000 calls, one connection)",
        latencies[2500], latencies[4950], latencies[4999]
    );
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_in_a_cluster_sign_with_the_one_key_of_the_secret() {
    use meshca_tests::fake_kube::{FakeKube, FakeUser};
    let dir = tempfile::tempdir().unwrap();
    let kube = FakeKube::start(dir.path()).await;
    let token = kube.add_review_token("web", FakeUser::service_account("default", "web"));
    let args = |name: &str| {
        (
            dir.path().join(name),
            vec![
                "--kubeconfig".to_string(),
                kube.kubeconfig.display().to_string(),
                "--leader-lease-duration".into(),
                "3s".into(),
            ],
        )
    };
    let (a, b) = tokio::join!(
        start_off_runtime(args("a").0, args("a").1),
        start_off_runtime(args("b").0, args("b").1)
    );
    assert!(
        kube.get_object("secrets", "istio-system", "meshca-jwt-svid-keys")
            .is_none(),
        "nothing written before the first JWT request"
    );
    let mut clients = [
        JwtSvidServiceClient::new(a.channel().await),
        JwtSvidServiceClient::new(b.channel().await),
    ];
    // Both replicas at once: one creates the Secret, the other adopts it.
    let [ca, cb] = &mut clients;
    let (ta, tb) = tokio::join!(
        ca.mint_jwt_svid(with_token(mint_request(&["vault"], 0, ""), &token)),
        cb.mint_jwt_svid(with_token(mint_request(&["vault"], 0, ""), &token))
    );
    let kid = |token: &str| decode(token.split('.').next().unwrap())["kid"].clone();
    let (ta, tb) = (ta.unwrap().into_inner(), tb.unwrap().into_inner());
    assert_eq!(kid(&ta.token), kid(&tb.token), "one key for both replicas");
    let stored = kube
        .get_object("secrets", "istio-system", "meshca-jwt-svid-keys")
        .expect("the keys' Secret");
    assert!(stored["data"]["jwt-svid-keys.json"].is_string(), "{stored}");
    for client in &mut clients {
        let bundle = client
            .fetch_jwt_bundle(with_token(FetchJwtBundleRequest {}, &token))
            .await
            .unwrap()
            .into_inner();
        let jwks: Value = serde_json::from_slice(&bundle.jwks).unwrap();
        assert_eq!(jwks["keys"].as_array().unwrap().len(), 1, "{jwks}");
        assert_eq!(jwks["keys"][0]["kid"], kid(&ta.token));
    }
    assert!(!a.log().contains(&ta.token) && !b.log().contains(&tb.token));
}
