//! Revocation end to end, with the real binaries: `meshca-certs revoke`
//! edits the list (the data directory's `revocations.yaml`, or the
//! ConfigMap `meshca-revocations` of a real kube-apiserver), `meshca serve`
//! refuses the next certificate within 5 s with `PERMISSION_DENIED`
//! naming the entry, and the CRL it signs (`ca-crl.pem`, the
//! `istio-ca-crl` ConfigMaps) holds the revoked serials, checked with
//! `openssl crl -verify` and Python's `cryptography`.

// Test helpers outside #[test] functions may unwrap too: a panic is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use meshca_certs::crl::ParsedCrl;
use meshca_certs::inspect::CertSummary;
use meshca_certs::revocation::Serial;
use meshca_certs::KeyAlgorithm;
use meshca_tests::control_plane::{ControlPlane, MESHCA_NAMESPACE};
use meshca_tests::*;
use tonic::Code;

const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";
const API: &str = "spiffe://cluster.local/ns/default/sa/api";
const DB: &str = "spiffe://cluster.local/ns/default/sa/db";
/// The issue's bound: an edit takes effect within this.
const EFFECTIVE_WITHIN: Duration = Duration::from_secs(5);

fn serial_of(chain: &[String]) -> Serial {
    let der = meshca_certs::bundle::parse_certs_pem(&chain[0]).unwrap();
    let summary = CertSummary::from_der(&der[0]).unwrap();
    Serial::parse(&summary.serial).unwrap()
}

fn revoke(args: &[&str]) -> String {
    run_ok(
        Command::new(&binaries().meshca_certs)
            .arg("revoke")
            .args(args),
    )
}

async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut done: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !done().await {
        assert!(
            started.elapsed() < timeout,
            "{what}: not within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

/// The data directory's CRL, parsed.
fn crl_file(dir: &Path) -> Option<ParsedCrl> {
    let pem = std::fs::read_to_string(dir.join("ca-crl.pem")).ok()?;
    ParsedCrl::from_pem(&pem).ok()
}

/// A root, its intermediate `east` (a `--ca-dir`) and meshca signing
/// with it: the set-up of the tests that revoke a CA.
struct CaDirServer {
    root: PathBuf,
    east: PathBuf,
    data: PathBuf,
    server: MeshcaServer,
    /// east's `root-cert.pem`.
    root_pem: String,
}

async fn ca_dir_server(dir: &Path) -> CaDirServer {
    let pki = dir.join("pki");
    let root = pki.join("root");
    certs_cli(&["root-ca", "--out", root.to_str().unwrap()]);
    let east = intermediate_ca(&pki, &root, "east", &[]);
    let data = dir.join("data");
    let server = start_off_runtime(
        data.clone(),
        vec!["--ca-dir".into(), east.display().to_string()],
    )
    .await;
    let root_pem = std::fs::read_to_string(east.join("root-cert.pem")).unwrap();
    CaDirServer {
        root,
        east,
        data,
        server,
        root_pem,
    }
}

/// Waits until `server` refuses a new certificate naming a revoked
/// intermediate.
async fn wait_until_a_ca_is_refused(what: &str, server: &MeshcaServer, root_pem: &str) {
    let client = server.client_trusting(root_pem).await;
    wait_until(what, EFFECTIVE_WITHIN, || {
        let mut client = client.clone();
        let token = server.token("default", "api");
        async move {
            let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, API, 3600);
            client
                .create_certificate(with_token(request, &token))
                .await
                .is_err_and(|s| {
                    s.code() == Code::PermissionDenied && s.message().contains("intermediate")
                })
        }
    })
    .await;
}

/// `meshca serve`'s arguments in the cluster of `kubeconfig`, then `extra`.
fn cluster_args(kubeconfig: &Path, extra: &[&str]) -> Vec<String> {
    [
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--namespace",
        MESHCA_NAMESPACE,
        "--leader-lease-duration",
        "4s",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect()
}

/// `openssl crl -verify` of `crl_pem` against `root_pem`, and its text.
fn openssl_verifies(dir: &Path, crl_pem: &str, root_pem: &str) -> Option<String> {
    if !have_openssl() {
        eprintln!("skipped: openssl is not installed");
        return None;
    }
    let (crl, root) = (dir.join("check-crl.pem"), dir.join("check-root.pem"));
    std::fs::write(&crl, crl_pem).unwrap();
    std::fs::write(&root, root_pem).unwrap();
    let out = Command::new("openssl")
        .args(["crl", "-in"])
        .arg(&crl)
        .arg("-CAfile")
        .arg(&root)
        .args(["-verify", "-noout", "-text"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.contains("verify OK"),
        "openssl crl -verify: {stderr}"
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What Python's `cryptography` reads of the CRL: the signature checked
/// with the root's key, then one line per serial with its reason.
const CRYPTOGRAPHY_CHECK: &str = r#"
import sys
from cryptography import x509
crl = x509.load_pem_x509_crl(open(sys.argv[1], "rb").read())
root = x509.load_pem_x509_certificate(open(sys.argv[2], "rb").read())
assert crl.is_signature_valid(root.public_key()), "signature"
assert crl.issuer == root.subject, "issuer"
number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
aki = crl.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier
ski = root.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest
assert aki == ski, "aki"
assert crl.next_update_utc > crl.last_update_utc
print("number", number)
for r in crl:
    try:
        reason = r.extensions.get_extension_for_class(x509.CRLReason).value.reason.name
    except x509.ExtensionNotFound:
        reason = "none"
    print(format(r.serial_number, "x"), reason)
"#;

/// Runs [`CRYPTOGRAPHY_CHECK`]; `None` when `cryptography` is missing
/// (outside CI).
fn cryptography_reads(dir: &Path) -> Option<String> {
    let importable = Command::new("python3")
        .args(["-c", "import cryptography"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !importable {
        let message = "Python's cryptography is not installed (pip install cryptography)";
        assert!(
            std::env::var_os("CI").is_none(),
            "{message} (CI is set, so the test fails instead of skipping)"
        );
        eprintln!("skipped: {message}");
        return None;
    }
    let out = Command::new("python3")
        .args(["-c", CRYPTOGRAPHY_CHECK])
        .arg(dir.join("check-crl.pem"))
        .arg(dir.join("check-root.pem"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cryptography refused the CRL: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_service_account_serial_and_spiffe_id_get_no_certificate_and_are_in_the_crl() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = start_off_runtime(data.clone(), vec![]).await;

    // Nothing revoked: an empty, valid CRL is there from the start.
    let empty = crl_file(&data).expect("ca-crl.pem at start");
    assert!(empty.revoked.is_empty());
    empty
        .verify(
            &meshca_certs::bundle::parse_certs_pem(&server.root_pem()).unwrap()[0],
            time::OffsetDateTime::now_utc(),
        )
        .unwrap();
    let next = empty.next_update.unwrap() - empty.this_update;
    assert_eq!(
        next,
        time::Duration::hours(2),
        "nextUpdate = 2 x --crl-refresh (1h)"
    );

    let token = |sa| server.token("default", sa);
    let web = ask(&server, &token("web"), WEB).await.unwrap();
    let web_again = ask(&server, &token("web"), WEB).await.unwrap();
    let other = ask(
        &server,
        &token("other"),
        "spiffe://cluster.local/ns/default/sa/other",
    )
    .await
    .unwrap();
    // db renews with its certificate later.
    let mut client = server.client().await;
    let (db_key, request) = csr_request(KeyAlgorithm::EcdsaP256, DB, 3600);
    let db = client
        .create_certificate(with_token(request, &token("db")))
        .await
        .unwrap()
        .into_inner()
        .cert_chain;

    let data_arg = data.to_str().unwrap();
    let printed = revoke(&[
        "--service-account",
        "default/web",
        "--reason",
        "keyCompromise",
        "--data-dir",
        data_arg,
    ]);
    assert!(
        printed.starts_with("revoked service-account default/web"),
        "{printed}"
    );
    let db_serial = serial_of(&db);
    revoke(&[
        "--serial",
        db_serial.as_str(),
        "--reason",
        "superseded",
        "--data-dir",
        data_arg,
    ]);
    revoke(&[
        "--spiffe-id",
        "spiffe://cluster.local/ns/default/sa/other",
        "--data-dir",
        data_arg,
    ]);
    // A malformed entry, written by hand: refused, the others apply.
    let path = data.join("revocations.yaml");
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("- {\"node\": \"Not A Node\", \"revoked_at\": \"2026-01-01T00:00:00Z\"}\n");
    std::fs::write(&path, text).unwrap();

    let took = wait_until(
        "the revoked service account refused",
        EFFECTIVE_WITHIN,
        || async { ask(&server, &token("web"), WEB).await.is_err() },
    )
    .await;
    eprintln!("refused {took:?} after the edit");
    let refused = ask(&server, &token("web"), WEB).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains("service-account default/web"),
        "{refused:?}"
    );
    assert!(
        !refused.message().contains("keyCompromise"),
        "the reason stays internal: {refused:?}"
    );
    let refused = ask(
        &server,
        &token("other"),
        "spiffe://cluster.local/ns/default/sa/other",
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    // The revoked serial cannot renew, though its identity is not revoked.
    let mut mtls = server
        .client_with_identity(Some((db.concat(), db_key.to_pkcs8_pem())))
        .await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, DB, 3600);
    let refused = mtls
        .create_certificate(tonic::Request::new(request))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains(&format!("serial {db_serial}")),
        "{refused:?}"
    );
    assert!(
        ask(&server, &token("db"), DB).await.is_ok(),
        "db with a token is not revoked"
    );
    // Nobody else is affected by the entries or by the malformed one.
    assert!(ask(&server, &token("api"), API).await.is_ok());

    // The CRL: both of web's serials, db's, other's.
    let expected: Vec<Serial> = vec![
        serial_of(&web),
        serial_of(&web_again),
        db_serial.clone(),
        serial_of(&other),
    ];
    // (The web certificates issued while the edit was being taken up are
    // there too: they were issued before the entry applied.)
    wait_until("the CRL lists the serials", EFFECTIVE_WITHIN, || async {
        crl_file(&data).is_some_and(|c| expected.iter().all(|s| c.revoked.contains(s)))
    })
    .await;
    let crl = crl_file(&data).unwrap();
    assert!(crl.number > empty.number, "the CRL number grows");
    let pem = std::fs::read_to_string(data.join("ca-crl.pem")).unwrap();
    if let Some(text) = openssl_verifies(dir.path(), &pem, &server.root_pem()) {
        assert!(text.contains("Key Compromise"), "{text}");
        assert!(text.contains("Superseded"), "{text}");
        assert!(text.contains("X509v3 Authority Key Identifier"), "{text}");
        assert!(text.contains("X509v3 CRL Number"), "{text}");
    }
    if let Some(read) = cryptography_reads(dir.path()) {
        assert!(
            read.contains(&format!("{} key_compromise", serial_of(&web))),
            "{read}"
        );
        assert!(read.contains(&format!("{db_serial} superseded")), "{read}");
        assert!(
            read.contains(&format!("{} none", serial_of(&other))),
            "{read}"
        );
    }

    // The malformed entry is logged and counted by its place.
    let (_, metrics) = http_get(server.monitoring, "/metrics").unwrap();
    assert!(
        metrics.contains("meshca_revocation_entries_rejected{source=\"file\",entry=\"4\"} 1"),
        "{metrics}"
    );
    assert!(
        server.log().contains("revocation entry refused"),
        "{}",
        server.log()
    );

    // A restart takes no serial back.
    drop(server);
    let server = start_off_runtime(data.clone(), vec![]).await;
    let token = |sa| server.token("default", sa);
    wait_until("the restarted CA's CRL", EFFECTIVE_WITHIN, || async {
        crl_file(&data).is_some_and(|c| c.number > crl.number)
    })
    .await;
    let after = crl_file(&data).unwrap().revoked;
    let mut before = crl.revoked.clone();
    let mut after_sorted = after.clone();
    before.sort();
    after_sorted.sort();
    assert_eq!(after_sorted, before, "the serials survive a restart");
    assert_eq!(
        ask(&server, &token("web"), WEB).await.unwrap_err().code(),
        Code::PermissionDenied
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_configmap_list_revokes_a_node_on_every_path_and_the_crl_reaches_every_namespace() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let web = plane.running_pod("default", "web-1", "web", "node-a").await;
    let api = plane.running_pod("default", "api-1", "api", "node-b").await;
    let kubeconfig = plane.meshca_kubeconfig().await;
    let args = cluster_args(
        &kubeconfig,
        &["--trusted-node-agent", "istio-system/ztunnel"],
    );
    let server = start_off_runtime(dir.path().join("data"), args).await;
    let hour = Duration::from_secs(3600);
    let web_token = plane
        .token("default", "web", Some(&web), &["istio-ca"], hour)
        .await;
    let api_token = plane
        .token("default", "api", Some(&api), &["istio-ca"], hour)
        .await;
    let issued = wait_until_ok(&server, &web_token, WEB).await;
    assert!(ask(&server, &api_token, API).await.is_ok());

    // The empty CRL is published in the namespaces first.
    let admin = plane.admin().await;
    let crls: Api<ConfigMap> = Api::namespaced(admin.clone(), "default");
    let published = |want: Option<Serial>| {
        let crls = crls.clone();
        async move {
            let Ok(Some(cm)) = crls.get_opt("istio-ca-crl").await else {
                return false;
            };
            let Some(pem) = cm.data.and_then(|d| d.get("ca-crl.pem").cloned()) else {
                return false;
            };
            ParsedCrl::from_pem(&pem).is_ok_and(|c| match &want {
                None => c.revoked.is_empty(),
                Some(s) => c.revoked.contains(s),
            })
        }
    };
    wait_until(
        "an empty istio-ca-crl in default",
        Duration::from_secs(20),
        || published(None),
    )
    .await;

    let admin_kubeconfig = plane.admin_kubeconfig.to_str().unwrap().to_string();
    revoke(&[
        "--node",
        "node-a",
        "--kubeconfig",
        &admin_kubeconfig,
        "--namespace",
        MESHCA_NAMESPACE,
    ]);
    let edited = Instant::now();
    wait_until("node-a's pod refused", EFFECTIVE_WITHIN, || async {
        ask(&server, &web_token, WEB)
            .await
            .is_err_and(|s| s.code() == Code::PermissionDenied)
    })
    .await;
    let refused = ask(&server, &web_token, WEB).await.unwrap_err();
    assert!(refused.message().contains("node node-a"), "{refused:?}");
    assert!(
        ask(&server, &api_token, API).await.is_ok(),
        "node-b is not revoked"
    );
    wait_until("the serial in istio-ca-crl", EFFECTIVE_WITHIN, || {
        published(Some(serial_of(&issued)))
    })
    .await;
    eprintln!(
        "node revoked, refused and published {:?} after the edit",
        edited.elapsed()
    );

    // A second writer's edit is not lost: both entries are there.
    revoke(&[
        "--service-account",
        "default/api",
        "--kubeconfig",
        &admin_kubeconfig,
        "--namespace",
        MESHCA_NAMESPACE,
    ]);
    let listed = run_ok(Command::new(&binaries().meshca_certs).args([
        "revocations",
        "list",
        "--json",
        "--kubeconfig",
        &admin_kubeconfig,
        "--namespace",
        MESHCA_NAMESPACE,
    ]));
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let targets: Vec<String> = listed["revocations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            e["name"]
                .as_str()
                .unwrap()
                .split(" (")
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(targets, ["node node-a", "service-account default/api"]);
    wait_until("api refused", EFFECTIVE_WITHIN, || async {
        ask(&server, &api_token, API).await.is_err()
    })
    .await;

    // A malformed ConfigMap document keeps the last good list.
    let lists: Api<ConfigMap> = Api::namespaced(admin, MESHCA_NAMESPACE);
    let mut cm = lists.get("meshca-revocations").await.unwrap();
    cm.data
        .as_mut()
        .unwrap()
        .insert("revocations.yaml".into(), "revocations: [".into());
    lists
        .replace("meshca-revocations", &Default::default(), &cm)
        .await
        .unwrap();
    wait_until(
        "the malformed document refused (logged)",
        EFFECTIVE_WITHIN,
        || async { server.log().contains("revocation list refused") },
    )
    .await;
    assert_eq!(
        ask(&server, &web_token, WEB).await.unwrap_err().code(),
        Code::PermissionDenied,
        "the last good list stays in use"
    );
}

/// Asks until the answer is a certificate (the pod index syncs first).
async fn wait_until_ok(server: &MeshcaServer, token: &str, id: &str) -> Vec<String> {
    let started = Instant::now();
    loop {
        match ask(server, token, id).await {
            Ok(chain) => return chain,
            Err(e) => assert!(started.elapsed() < Duration::from_secs(20), "{e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_serves_the_crl_on_the_workload_api_and_in_sds_once_it_verifies() {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{secret, Secret};
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
    use meshca_proto::spiffe_workload::spiffe_workload_api_client::SpiffeWorkloadApiClient;
    use meshca_proto::spiffe_workload::X509svidRequest;
    use meshca_tests::agent_process::{unix_channel, Agent};
    use prost::Message;

    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = start_off_runtime(data.clone(), vec![]).await;
    std::fs::write(dir.path().join("root-cert.pem"), server.root_pem()).unwrap();
    let old = ask(
        &server,
        &server.token("default", "old"),
        "spiffe://cluster.local/ns/default/sa/old",
    )
    .await
    .unwrap();
    revoke(&[
        "--spiffe-id",
        "spiffe://cluster.local/ns/default/sa/old",
        "--data-dir",
        data.to_str().unwrap(),
    ]);
    let revoked = serial_of(&old);
    wait_until("the CRL lists the serial", EFFECTIVE_WITHIN, || async {
        crl_file(&data).is_some_and(|c| c.revoked.contains(&revoked))
    })
    .await;

    let socket = dir.path().join("agent.sock");
    let out = dir.path().join("out");
    let (socket_arg, crl_arg, out_arg) = (
        socket.display().to_string(),
        data.join("ca-crl.pem").display().to_string(),
        out.display().to_string(),
    );
    let mut agent = Agent::start(
        &server,
        dir.path(),
        &server.token("default", "web"),
        "agent",
        &[
            "--spiffe-id",
            WEB,
            "--workload-api-socket",
            &socket_arg,
            "--crl-file",
            &crl_arg,
            "--bundle-refresh",
            "200ms",
            "--out",
            &out_arg,
        ],
    );
    agent.wait_for_socket(&socket).await;
    let channel = unix_channel(&socket).await;
    let mut request = tonic::Request::new(X509svidRequest {});
    request
        .metadata_mut()
        .insert("workload.spiffe.io", "true".parse().unwrap());
    let mut stream = SpiffeWorkloadApiClient::new(channel.clone())
        .fetch_x509svid(request)
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        first.crl.len(),
        1,
        "X509SVIDResponse.crl carries the CA's CRL"
    );
    let served = ParsedCrl::from_der(&first.crl[0]).unwrap();
    assert!(served.revoked.contains(&revoked));

    // A new revocation reaches the open stream.
    let db = ask(&server, &server.token("default", "db"), DB)
        .await
        .unwrap();
    revoke(&["--spiffe-id", DB, "--data-dir", data.to_str().unwrap()]);
    let db_serial = serial_of(&db);
    let took = Instant::now();
    let updated = tokio::time::timeout(EFFECTIVE_WITHIN, async {
        loop {
            let next = stream.message().await.unwrap().unwrap();
            if next
                .crl
                .first()
                .and_then(|d| ParsedCrl::from_der(d).ok())
                .is_some_and(|c| c.revoked.contains(&db_serial))
            {
                return next;
            }
        }
    })
    .await
    .expect("the new CRL on the socket within 5 s");
    eprintln!(
        "the socket carried the new CRL {:?} after the edit",
        took.elapsed()
    );
    assert_eq!(updated.svids[0].spiffe_id, WEB);
    // The output directory: ca-crl.pem beside root-cert.pem, the new one.
    wait_until(
        "out/ca-crl.pem lists db's serial",
        EFFECTIVE_WITHIN,
        || async {
            crl_file(&out)
                .is_some_and(|c| c.revoked.contains(&db_serial) && c.revoked.contains(&revoked))
        },
    )
    .await;
    assert!(out.join("root-cert.pem").exists());

    // Envoy's SDS: the validation context carries the CRL beside the roots.
    let request = DiscoveryRequest {
        type_url: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret".into(),
        resource_names: vec!["ROOTCA".into()],
        ..Default::default()
    };
    let mut sds = SecretDiscoveryServiceClient::new(channel)
        .stream_secrets(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let answer = tokio::time::timeout(Duration::from_secs(10), sds.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let secret = Secret::decode(answer.resources[0].value.as_slice()).unwrap();
    let Some(secret::Type::ValidationContext(context)) = secret.r#type else {
        panic!("not a validation context: {secret:?}");
    };
    // Only the leaf is checked against it (Envoy would otherwise want a
    // CRL for every CA of the chain).
    assert!(context.only_verify_leaf_cert_crl);
    let crl = context.crl.expect("a CRL in the validation context");
    let Some(envoy_types::pb::envoy::config::core::v3::data_source::Specifier::InlineBytes(pem)) =
        crl.specifier
    else {
        panic!("an inline CRL");
    };
    let parsed = ParsedCrl::from_pem(std::str::from_utf8(&pem).unwrap()).unwrap();
    assert!(parsed.revoked.contains(&db_serial));

    // The serial the agent is serving, revoked: the agent renews it at
    // once (not at its half-life) and the stream gets another one.
    let serving = meshca_certs::inspect::CertSummary::from_der(&updated.svids[0].x509_svid)
        .unwrap()
        .serial;
    revoke(&["--serial", &serving, "--data-dir", data.to_str().unwrap()]);
    let took = Instant::now();
    let renewed = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let next = stream.message().await.unwrap().unwrap();
            let serial = meshca_certs::inspect::CertSummary::from_der(&next.svids[0].x509_svid)
                .unwrap()
                .serial;
            if serial != serving {
                return serial;
            }
        }
    })
    .await
    .expect("a new SVID once the CRL lists the one served");
    eprintln!(
        "renewed {:?} after revoking the served serial",
        took.elapsed()
    );
    assert_ne!(renewed, serving);
    assert!(agent.log().contains("the CRL lists the certificate in use"));
}

/// Starts a replica named `pod` (its `POD_NAME`) off the runtime.
async fn replica(data: std::path::PathBuf, args: Vec<String>, pod: &'static str) -> MeshcaServer {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        MeshcaServer::start_with_env(&data, &args, &[("POD_NAME", pod)])
    })
    .await
    .unwrap()
    .unwrap_or_else(|f| panic!("{f:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serial_issued_by_one_replica_is_in_every_replicas_crl() {
    let Some(plane) = ControlPlane::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let web = plane.running_pod("default", "web-1", "web", "node-a").await;
    let kubeconfig = plane.meshca_kubeconfig().await;
    let args = cluster_args(&kubeconfig, &[]);
    let (a_data, b_data) = (dir.path().join("a"), dir.path().join("b"));
    let a = replica(a_data.clone(), args.clone(), "meshca-a").await;
    let b = replica(b_data.clone(), args, "meshca-b").await;
    let token = plane
        .token(
            "default",
            "web",
            Some(&web),
            &["istio-ca"],
            Duration::from_secs(3600),
        )
        .await;
    // Issued by replica a only.
    let issued = serial_of(&ask(&a, &token, WEB).await.unwrap());
    let admin_kubeconfig = plane.admin_kubeconfig.to_str().unwrap().to_string();
    revoke(&[
        "--spiffe-id",
        WEB,
        "--kubeconfig",
        &admin_kubeconfig,
        "--namespace",
        MESHCA_NAMESPACE,
    ]);
    let took = wait_until("b's CRL lists a's serial", EFFECTIVE_WITHIN, || async {
        crl_file(&b_data).is_some_and(|c| c.revoked.contains(&issued))
    })
    .await;
    eprintln!("replica b's CRL listed replica a's serial {took:?} after the edit");
    assert!(crl_file(&a_data).is_some_and(|c| c.revoked.contains(&issued)));
    assert_eq!(
        ask(&b, &token, WEB).await.unwrap_err().code(),
        Code::PermissionDenied
    );
    // The published ConfigMap (whichever replica leads) lists it too.
    let crls: Api<ConfigMap> = Api::namespaced(plane.admin().await, "default");
    wait_until(
        "istio-ca-crl lists a's serial",
        EFFECTIVE_WITHIN,
        || async {
            crls.get_opt("istio-ca-crl")
                .await
                .ok()
                .flatten()
                .is_some_and(|cm| {
                    cm.data
                        .and_then(|d| d.get("ca-crl.pem").cloned())
                        .and_then(|pem| ParsedCrl::from_pem(&pem).ok())
                        .is_some_and(|c| c.revoked.contains(&issued))
                })
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_intermediate_signs_nothing_more_and_its_crl_lists_its_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let CaDirServer {
        east,
        data,
        server,
        root_pem,
        ..
    } = ca_dir_server(dir.path()).await;
    let mut client = server.client_trusting(&root_pem).await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    let leaf = client
        .create_certificate(with_token(request, &server.token("default", "web")))
        .await
        .unwrap()
        .into_inner()
        .cert_chain;
    let intermediate = east.join("ca-cert.pem");
    revoke(&[
        "--intermediate",
        intermediate.to_str().unwrap(),
        "--reason",
        "cACompromise",
        "--data-dir",
        data.to_str().unwrap(),
    ]);
    wait_until_a_ca_is_refused(
        "signing with the revoked intermediate refused",
        &server,
        &root_pem,
    )
    .await;
    // Its leaves are in the CRL it signed (the intermediate is the issuer).
    let serial = serial_of(&leaf);
    wait_until("the leaf in the CRL", EFFECTIVE_WITHIN, || async {
        crl_file(&data).is_some_and(|c| c.revoked.contains(&serial))
    })
    .await;
    let crl = crl_file(&data).unwrap();
    crl.verify(
        &meshca_certs::bundle::parse_certs_pem(&std::fs::read_to_string(&intermediate).unwrap())
            .unwrap()[0],
        time::OffsetDateTime::now_utc(),
    )
    .unwrap();
}

/// A CA above the signing one (here the root above `--ca-dir`'s
/// intermediate; with an HSM, the HSM-held CA above the in-memory
/// intermediate) revoked: nothing more is issued under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_a_ca_above_the_signing_one_stops_issuance_too() {
    let dir = tempfile::tempdir().unwrap();
    let CaDirServer {
        root,
        data,
        server,
        root_pem,
        ..
    } = ca_dir_server(dir.path()).await;
    let mut client = server.client_trusting(&root_pem).await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, WEB, 3600);
    let leaf = client
        .create_certificate(with_token(request, &server.token("default", "web")))
        .await
        .expect("issued before the revocation")
        .into_inner()
        .cert_chain;
    let root_cert = root.join("root-cert.pem");
    revoke(&[
        "--intermediate",
        root_cert.to_str().unwrap(),
        "--reason",
        "cACompromise",
        "--data-dir",
        data.to_str().unwrap(),
    ]);
    wait_until_a_ca_is_refused(
        "issuance under the revoked root refused",
        &server,
        &root_pem,
    )
    .await;
    // The leaf issued under it (by the intermediate) is in the CRL.
    let serial = serial_of(&leaf);
    wait_until(
        "the leaf under the revoked root in the CRL",
        EFFECTIVE_WITHIN,
        || async { crl_file(&data).is_some_and(|c| c.revoked.contains(&serial)) },
    )
    .await;
}

/// A CRL the root signs (offline, by the operator) listing the
/// intermediate of a CA that has not been told: `meshca-agent --crl-file`
/// refuses every chain through it and publishes nothing (no files, no
/// SVID on the socket), then publishes as soon as the CRL no longer lists it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_publishes_no_chain_its_crl_lists() {
    use meshca_certs::crl::{encode_crl_pem, sign_crl, CrlTimes, RevokedCert};
    use meshca_certs::revocation::RevocationReason;
    use meshca_tests::agent_process::Agent;

    let dir = tempfile::tempdir().unwrap();
    let CaDirServer {
        root,
        east,
        server,
        root_pem,
        ..
    } = ca_dir_server(dir.path()).await;
    std::fs::write(dir.path().join("root-cert.pem"), &root_pem).unwrap();
    let root_der = meshca_certs::bundle::parse_certs_pem(
        &std::fs::read_to_string(root.join("root-cert.pem")).unwrap(),
    )
    .unwrap()
    .remove(0);
    let root_key = meshca_certs::PrivateKey::from_pem(
        &std::fs::read_to_string(root.join("root-key.pem")).unwrap(),
    )
    .unwrap();
    let east_der = meshca_certs::bundle::parse_certs_pem(
        &std::fs::read_to_string(east.join("ca-cert.pem")).unwrap(),
    )
    .unwrap()
    .remove(0);
    let east_serial = Serial::parse(&CertSummary::from_der(&east_der).unwrap().serial).unwrap();
    // A CRL of `ca_der` (signed with `key`) listing `revoked`.
    let crl_of = |ca_der: &[u8],
                  key: &meshca_certs::PrivateKey,
                  revoked: &[Serial],
                  reason: RevocationReason,
                  number: u64| {
        let now = time::OffsetDateTime::now_utc()
            .replace_nanosecond(0)
            .unwrap();
        let revoked: Vec<RevokedCert> = revoked
            .iter()
            .map(|serial| RevokedCert {
                serial: serial.clone(),
                revoked_at: now,
                reason,
            })
            .collect();
        let times = CrlTimes {
            number,
            this_update: now,
            next_update: now + time::Duration::hours(2),
        };
        encode_crl_pem(&sign_crl(ca_der, key.key_pair(), &revoked, times).unwrap())
    };
    let root_crl = |revoked: &[Serial], number: u64| {
        crl_of(
            &root_der,
            &root_key,
            revoked,
            RevocationReason::CaCompromise,
            number,
        )
    };
    let crl_path = dir.path().join("root-crl.pem");
    std::fs::write(&crl_path, root_crl(std::slice::from_ref(&east_serial), 1)).unwrap();

    let out = dir.path().join("out");
    let (crl_arg, out_arg) = (crl_path.display().to_string(), out.display().to_string());
    let agent = Agent::start(
        &server,
        dir.path(),
        &server.token("default", "web"),
        "agent",
        &[
            "--spiffe-id",
            WEB,
            "--crl-file",
            &crl_arg,
            "--bundle-refresh",
            "200ms",
            "--out",
            &out_arg,
        ],
    );
    wait_until(
        "the agent refuses the chain its CRL lists",
        Duration::from_secs(20),
        || async { agent.log().contains("listed in its CRL") },
    )
    .await;
    let log = agent.log();
    assert!(
        log.contains(&format!(
            "the CRL lists the intermediate 1's serial {east_serial}; not published"
        )),
        "{log}"
    );
    assert!(
        !out.join("cert-chain.pem").exists() && !out.join("key.pem").exists(),
        "nothing written"
    );
    // The root's next CRL no longer lists it: the next attempt is published.
    std::fs::write(&crl_path, root_crl(&[], 2)).unwrap();
    wait_until(
        "the chain written once the CRL no longer lists it",
        Duration::from_secs(20),
        || async { out.join("cert-chain.pem").exists() },
    )
    .await;

    // The leaf in use, then revoked by its issuer's CRL: an agent with
    // `--out` only (no socket) renews it at once, not at its half-life.
    let leaf_serial = |dir: &Path| {
        let chain = std::fs::read_to_string(dir.join("cert-chain.pem")).ok()?;
        let der = meshca_certs::bundle::parse_certs_pem(&chain)
            .ok()?
            .into_iter()
            .next()?;
        CertSummary::from_der(&der).ok().map(|s| s.serial)
    };
    let in_use = leaf_serial(&out).unwrap();
    let east_key = meshca_certs::PrivateKey::from_pem(
        &std::fs::read_to_string(east.join("ca-key.pem")).unwrap(),
    )
    .unwrap();
    std::fs::write(
        &crl_path,
        crl_of(
            &east_der,
            &east_key,
            &[Serial::parse(&in_use).unwrap()],
            RevocationReason::KeyCompromise,
            3,
        ),
    )
    .unwrap();
    wait_until(
        "a new leaf written once the CRL lists the one in use",
        Duration::from_secs(20),
        || async { leaf_serial(&out).is_some_and(|s| s != in_use) },
    )
    .await;
    assert!(agent.log().contains("the CRL lists the certificate in use"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_entry_does_not_stop_a_ca_change_and_the_crl_follows_the_new_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let root = pki.join("root");
    certs_cli(&["root-ca", "--out", root.to_str().unwrap()]);
    let east = intermediate_ca(&pki, &root, "east", &[]);
    let west = intermediate_ca(&pki, &root, "west", &[]);
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(
        data.join("revocations.yaml"),
        "revocations:\n- {\"serial\": 12, \"revoked_at\": \"2026-12-03T00:00:00Z\"}\n- {\"spiffe_id\": \"spiffe://cluster.local/ns/default/sa/api\", \"revoked_at\": \"2026-12-03T00:00:00Z\"}\n",
    )
    .unwrap();
    let live = dir.path().join("live");
    std::fs::create_dir(&live).unwrap();
    for name in [
        "ca-cert.pem",
        "ca-key.pem",
        "cert-chain.pem",
        "root-cert.pem",
    ] {
        std::fs::copy(east.join(name), live.join(name)).unwrap();
    }
    let server = start_off_runtime(
        data.clone(),
        vec![
            "--ca-dir".into(),
            live.display().to_string(),
            "--ca-dir-check-interval".into(),
            "200ms".into(),
        ],
    )
    .await;
    let first = |dir: &Path| {
        meshca_certs::bundle::parse_certs_pem(
            &std::fs::read_to_string(dir.join("ca-cert.pem")).unwrap(),
        )
        .unwrap()
        .remove(0)
    };
    let now = time::OffsetDateTime::now_utc;
    wait_until("a CRL signed by east", EFFECTIVE_WITHIN, || async {
        crl_file(&data).is_some_and(|c| c.verify(&first(&east), now()).is_ok())
    })
    .await;
    // The operator switches to west (a new intermediate): taken, and the CRL follows.
    for name in ["ca-key.pem", "ca-cert.pem", "cert-chain.pem"] {
        std::fs::copy(west.join(name), live.join(name)).unwrap();
    }
    wait_until("a CRL signed by west", Duration::from_secs(10), || async {
        crl_file(&data).is_some_and(|c| c.verify(&first(&west), now()).is_ok())
    })
    .await;
    // The good entry still applies, the malformed one is still refused.
    let root_pem = std::fs::read_to_string(west.join("root-cert.pem")).unwrap();
    let mut client = server.client_trusting(&root_pem).await;
    let (_, request) = csr_request(KeyAlgorithm::EcdsaP256, API, 3600);
    let refused = client
        .create_certificate(with_token(request, &server.token("default", "api")))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let (_, metrics) = http_get(server.monitoring, "/metrics").unwrap();
    assert!(
        metrics.contains("meshca_revocation_entries_rejected{source=\"file\",entry=\"1\"} 1"),
        "{metrics}"
    );
}
