//! The Helm chart in `deploy/helm/meshca` against the kustomize manifests
//! and the code: for each variant (self-signed, plugged-in,
//! pod-certificates, node-agent, and agent-node: node-agent with the
//! meshca-agent DaemonSet) `helm lint` passes, `helm template` renders
//! objects of the Kubernetes schema (typed k8s-openapi objects), the same
//! objects `kubectl kustomize` renders for that overlay (labels aside: the
//! chart adds Helm's), and RBAC granting exactly `RBAC_RULES`.
//!
//! helm is `$MESHCA_HELM`, else `<repo>/target/go-tools/bin/helm`, built
//! from the pinned module in `tests/helm` (see [`HELM_BUILD`]). Without it
//! the tests are skipped, except in CI (`CI` set), where they fail.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use meshca_ca::cluster::EXAMPLE_POD_CERTIFICATE_SIGNER;
use serde_json::Value;

mod common;
use common::{expected_grants, grants};

/// How to build the helm binary the tests use.
const HELM_BUILD: &str = "cd tests/helm && go build -trimpath -o ../../target/go-tools/bin/helm helm.sh/helm/v4/cmd/helm";

/// The chart's variants: each has `ci/<variant>-values.yaml` in the chart.
const VARIANTS: &[&str] = &[
    "self-signed",
    "plugged-in",
    "pod-certificates",
    "node-agent",
    "agent-node",
];

/// The namespace the chart is rendered into (as the kustomize manifests).
const NAMESPACE: &str = "istio-system";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn chart_dir() -> PathBuf {
    repo().join("deploy/helm/meshca")
}

/// The helm binary, or `None` (after saying so) when it is not built;
/// in CI a missing helm fails the test.
fn helm() -> Option<PathBuf> {
    let path = std::env::var_os("MESHCA_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/go-tools/bin/helm"));
    if path.is_file() {
        // Absolute: helm runs in the repository's directory.
        return Some(std::fs::canonicalize(path).unwrap());
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "helm is needed by this test and is not at {} (CI is set, so the test fails instead \
         of skipping); build it with `{HELM_BUILD}` or point MESHCA_HELM at one",
        path.display()
    );
    eprintln!(
        "SKIPPED: helm is not at {} (build it with `{HELM_BUILD}`, or set MESHCA_HELM)",
        path.display()
    );
    None
}

/// Runs helm with `args`: its standard output, or its error output when
/// it fails. Helm's own files (cache, config) live under the test's
/// temporary directory, not in `$HOME`.
fn run_helm(helm: &Path, args: &[&str]) -> Result<String, String> {
    let home = Path::new(env!("CARGO_TARGET_TMPDIR")).join("helm-home");
    let out = Command::new(helm)
        .args(args)
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .current_dir(repo())
        .output()
        .expect("running helm");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(format!(
            "helm {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn values_file(variant: &str) -> String {
    assert!(VARIANTS.contains(&variant), "unknown variant {variant}");
    chart_dir()
        .join(format!("ci/{variant}-values.yaml"))
        .display()
        .to_string()
}

/// `helm template` of the chart for `variant`, with more helm arguments.
fn template(helm: &Path, variant: &str, more: &[&str]) -> Result<String, String> {
    let chart = chart_dir().display().to_string();
    let values = values_file(variant);
    let mut args = vec![
        "template",
        "meshca",
        &chart,
        "--namespace",
        NAMESPACE,
        "--values",
        &values,
    ];
    args.extend_from_slice(more);
    run_helm(helm, &args)
}

/// The chart rendered for `variant` (one of "self-signed", "plugged-in",
/// "pod-certificates", "node-agent", "agent-node") into `istio-system`, as
/// multi-document YAML ready for `kubectl apply --server-side -f -`.
/// Panics when helm is missing or fails (check with `helm()` first).
pub fn rendered(variant: &str) -> String {
    let helm = helm().expect("helm is built");
    template(&helm, variant, &[]).unwrap_or_else(|e| panic!("{e}"))
}

/// What `kubectl kustomize` renders for `variant`.
fn kustomized(variant: &str) -> Vec<Value> {
    let dirs: Vec<String> = match variant {
        "agent-node" => vec!["overlays/node-agent".into(), "agent-node".into()],
        v if VARIANTS.contains(&v) => vec![format!("overlays/{v}")],
        other => panic!("unknown variant {other}"),
    };
    let mut docs = Vec::new();
    for dir in dirs {
        let out = Command::new("kubectl")
            .arg("kustomize")
            .arg(repo().join("deploy/kustomize").join(&dir))
            .output()
            .expect("running kubectl");
        assert!(
            out.status.success(),
            "kubectl kustomize {dir}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        docs.extend(documents(&String::from_utf8(out.stdout).unwrap()));
    }
    docs
}

fn documents(text: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(text)
        .expect("valid YAML")
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

/// `doc` through the typed object `T` and back: the schema check (an
/// unknown field or a wrong type fails) and a normal form for comparing.
fn through<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value) -> Value {
    let typed: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{:?} does not match the schema: {e}", key(doc)));
    let back = serde_json::to_value(&typed).unwrap();
    if let Some(difference) = difference("", doc, &back) {
        panic!(
            "{:?}: not of the schema (as rendered, and through the typed object): {difference}",
            key(doc)
        );
    }
    back
}

/// Where `a` and `b` first differ (a JSON path and both values), if they do.
fn difference(path: &str, a: &Value, b: &Value) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let (x, y) = (
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                );
                difference(&format!("{path}.{k}"), x, y)
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (x, y))| difference(&format!("{path}[{i}]"), x, y)),
        _ if a == b => None,
        _ => Some(format!("at {path}: {a} ≠ {b}")),
    }
}

/// `doc` checked against the schema of its kind.
fn typed(doc: &Value) -> Value {
    match doc["kind"].as_str().unwrap_or_default() {
        "ServiceAccount" => through::<ServiceAccount>(doc),
        "ClusterRole" => through::<ClusterRole>(doc),
        "ClusterRoleBinding" => through::<ClusterRoleBinding>(doc),
        "Role" => through::<Role>(doc),
        "RoleBinding" => through::<RoleBinding>(doc),
        "Deployment" => through::<Deployment>(doc),
        "DaemonSet" => through::<DaemonSet>(doc),
        "Service" => through::<Service>(doc),
        "PodDisruptionBudget" => through::<PodDisruptionBudget>(doc),
        "NetworkPolicy" => through::<NetworkPolicy>(doc),
        other => panic!("{:?}: kind {other:?} not expected", key(doc)),
    }
}

/// (kind, name) of `doc`.
fn key(doc: &Value) -> (String, String) {
    (
        doc["kind"].as_str().unwrap_or_default().to_string(),
        doc["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

/// `docs` by (kind, name), each checked against its schema; a name given
/// twice fails.
fn by_key(docs: &[Value]) -> BTreeMap<(String, String), Value> {
    let mut out = BTreeMap::new();
    for doc in docs {
        assert!(
            out.insert(key(doc), typed(doc)).is_none(),
            "{:?} twice",
            key(doc)
        );
    }
    out
}

fn of_kind<T: serde::de::DeserializeOwned>(docs: &[Value], kind: &str) -> Vec<T> {
    docs.iter()
        .filter(|d| d["kind"] == kind)
        .map(|d| serde_json::from_value(d.clone()).unwrap())
        .collect()
}

/// The RBAC of the CA in `docs` is exactly `RBAC_RULES` (with `signer`),
/// bound to the ServiceAccount meshca of the release namespace.
fn check_rbac(docs: &[Value], signer: &str, namespace: &str) {
    let cluster_role: Vec<ClusterRole> = of_kind(docs, "ClusterRole");
    let cluster_role: Vec<_> = cluster_role
        .into_iter()
        .filter(|r| r.metadata.name.as_deref() == Some("meshca"))
        .collect();
    let role: Vec<Role> = of_kind(docs, "Role");
    assert_eq!((cluster_role.len(), role.len()), (1, 1));
    assert_eq!(
        grants(cluster_role[0].rules.as_deref().unwrap()),
        expected_grants(false, signer),
        "ClusterRole"
    );
    assert_eq!(
        grants(role[0].rules.as_deref().unwrap()),
        expected_grants(true, signer),
        "Role"
    );
    let cluster_bindings: Vec<ClusterRoleBinding> = of_kind(docs, "ClusterRoleBinding");
    let bindings: Vec<RoleBinding> = of_kind(docs, "RoleBinding");
    let subjects: Vec<_> = cluster_bindings
        .iter()
        .filter(|b| b.role_ref.name == "meshca")
        .flat_map(|b| b.subjects.clone().unwrap_or_default())
        .chain(
            bindings
                .iter()
                .flat_map(|b| b.subjects.clone().unwrap_or_default()),
        )
        .map(|s| (s.kind, s.name, s.namespace))
        .collect();
    let meshca = (
        "ServiceAccount".to_string(),
        "meshca".to_string(),
        Some(namespace.to_string()),
    );
    assert_eq!(subjects, vec![meshca.clone(), meshca]);
}

/// The meshca container of the Deployment in `docs`.
fn ca_container(docs: &[Value]) -> Container {
    let deployments: Vec<Deployment> = of_kind(docs, "Deployment");
    assert_eq!(deployments.len(), 1);
    let pod = deployments[0].spec.clone().unwrap().template.spec.unwrap();
    pod.containers[0].clone()
}

fn env_value(container: &Container, name: &str) -> Option<String> {
    container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

/// The labels of `doc`, and `doc` without them.
fn split_labels(doc: &Value) -> (BTreeMap<String, Value>, Value) {
    let mut doc = doc.clone();
    let labels = doc["metadata"]
        .as_object_mut()
        .and_then(|m| m.remove("labels"))
        .map(|l| serde_json::from_value(l).unwrap())
        .unwrap_or_default();
    (labels, doc)
}

#[test]
fn the_chart_lints_for_every_variant() {
    let Some(helm) = helm() else { return };
    let chart = chart_dir().display().to_string();
    run_helm(&helm, &["lint", "--strict", &chart]).unwrap_or_else(|e| panic!("{e}"));
    for variant in VARIANTS {
        let values = values_file(variant);
        run_helm(
            &helm,
            &[
                "lint",
                "--strict",
                &chart,
                "--namespace",
                NAMESPACE,
                "--values",
                &values,
            ],
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn every_variant_renders_the_objects_kustomize_renders() {
    if helm().is_none() {
        return;
    }
    // Panics in CI without kubectl; elsewhere the comparison is skipped.
    if !meshca_tests::have_kubectl() {
        eprintln!("SKIPPED: kubectl is not installed; the chart was not compared with kustomize");
        return;
    }
    for variant in VARIANTS {
        let chart_docs = documents(&rendered(variant));
        let kustomize_docs = kustomized(variant);
        let chart = by_key(&chart_docs);
        let kustomize = by_key(&kustomize_docs);
        assert_eq!(
            chart.keys().collect::<Vec<_>>(),
            kustomize.keys().collect::<Vec<_>>(),
            "{variant}: the (kind, name) of the objects"
        );
        for (key, kustomize_doc) in &kustomize {
            // Kustomize's labels are all there; the chart adds Helm's.
            let (chart_labels, chart_doc) = split_labels(&chart[key]);
            let (kustomize_labels, kustomize_doc) = split_labels(kustomize_doc);
            for (name, value) in &kustomize_labels {
                assert_eq!(
                    chart_labels.get(name),
                    Some(value),
                    "{variant}: {key:?} label {name}"
                );
            }
            // Everything else is equal: for the Deployment the whole spec
            // (replicas, strategy, pod labels and annotations, args, env,
            // ports, probes, resources, volumes, security contexts).
            if let Some(difference) = difference("", &chart_doc, &kustomize_doc) {
                panic!("{variant}: {key:?}: the chart's ≠ kubectl kustomize's {difference}");
            }
        }
        check_rbac(&chart_docs, EXAMPLE_POD_CERTIFICATE_SIGNER, NAMESPACE);
        for doc in &chart_docs {
            let cluster_scoped = matches!(
                doc["kind"].as_str(),
                Some("ClusterRole" | "ClusterRoleBinding")
            );
            let expected = if cluster_scoped {
                Value::Null
            } else {
                Value::from(NAMESPACE)
            };
            assert_eq!(doc["metadata"]["namespace"], expected, "{:?}", key(doc));
        }
    }
}

#[test]
fn the_default_values_are_the_self_signed_variant() {
    let Some(helm) = helm() else { return };
    let chart = chart_dir().display().to_string();
    let defaults = run_helm(
        &helm,
        &["template", "meshca", &chart, "--namespace", NAMESPACE],
    )
    .unwrap();
    assert_eq!(defaults, rendered("self-signed"));
}

#[test]
fn the_signer_name_value_sets_the_signer_and_its_rbac() {
    let Some(helm) = helm() else { return };
    let signer = "example.com/workloads";
    let set = format!("podCertificates.signerName={signer}");
    let docs = documents(&template(&helm, "pod-certificates", &["--set", &set]).unwrap());
    check_rbac(&docs, signer, NAMESPACE);
    let container = ca_container(&docs);
    assert_eq!(
        env_value(&container, "MESHCA_POD_CERTIFICATE_SIGNER").as_deref(),
        Some(signer)
    );
    assert!(
        !container
            .args
            .iter()
            .flatten()
            .any(|a| a.starts_with("--pod-certificate-signer")),
        "set once, by the environment"
    );

    // Off, the RBAC still names the signer (as the kustomize base does)
    // and the server is not told to sign.
    let docs = documents(&template(&helm, "self-signed", &["--set", &set]).unwrap());
    check_rbac(&docs, signer, NAMESPACE);
    assert_eq!(
        env_value(&ca_container(&docs), "MESHCA_POD_CERTIFICATE_SIGNER"),
        None
    );

    // A name that is no DOMAIN/PATH is refused at render time.
    for bad in [
        "podCertificates.signerName=nodomain",
        "podCertificates.signerName=",
    ] {
        let err = template(&helm, "pod-certificates", &["--set", bad]).unwrap_err();
        assert!(err.contains("signerName"), "{bad}: {err}");
    }
}

#[test]
fn values_reach_the_objects() {
    let Some(helm) = helm() else { return };
    let chart = chart_dir().display().to_string();
    let render = |args: &[&str]| -> Vec<Value> {
        let mut all = vec!["template", "ca", &chart];
        all.extend_from_slice(args);
        documents(&run_helm(&helm, &all).unwrap_or_else(|e| panic!("{e}")))
    };

    // Another namespace: every namespaced object, the bindings' subjects,
    // the server's DNS names, the trusted node agent and the agent's CA
    // address follow it.
    let docs = render(&["--namespace", "mesh", "--set", "nodeAgent.enabled=true"]);
    by_key(&docs);
    check_rbac(&docs, EXAMPLE_POD_CERTIFICATE_SIGNER, "mesh");
    for doc in &docs {
        if !matches!(
            doc["kind"].as_str(),
            Some("ClusterRole" | "ClusterRoleBinding")
        ) {
            assert_eq!(doc["metadata"]["namespace"], "mesh", "{:?}", key(doc));
        }
    }
    let container = ca_container(&docs);
    assert_eq!(
        env_value(&container, "MESHCA_SERVER_DNS").as_deref(),
        Some("meshca.mesh.svc,meshca.mesh.svc.cluster.local,istiod.istio-system.svc.cluster.local")
    );
    assert_eq!(
        env_value(&container, "MESHCA_TRUSTED_NODE_AGENT").as_deref(),
        Some("mesh/meshca-agent")
    );
    let agent_binding: Vec<ClusterRoleBinding> = of_kind(&docs, "ClusterRoleBinding");
    let agent_binding = agent_binding
        .iter()
        .find(|b| b.role_ref.name == "meshca-agent")
        .unwrap();
    assert_eq!(
        agent_binding.subjects.as_ref().unwrap()[0]
            .namespace
            .as_deref(),
        Some("mesh")
    );
    let daemonsets: Vec<DaemonSet> = of_kind(&docs, "DaemonSet");
    let agent = &daemonsets[0]
        .spec
        .clone()
        .unwrap()
        .template
        .spec
        .unwrap()
        .containers[0];
    assert_eq!(
        env_value(agent, "MESHCA_CA_ADDR").as_deref(),
        Some("https://meshca.mesh.svc:15012")
    );

    // The knobs.
    let docs = render(&[
        "--namespace",
        NAMESPACE,
        "--set",
        "replicas=3,image.repository=registry.example/meshca,image.tag=dev,image.pullPolicy=Always",
        "--set",
        "extraArgs[0]=--workload-cert-ttl=12h,extraEnv[0].name=MESHCA_LOG,extraEnv[0].value=debug",
        "--set",
        "trustedNodeAgents.extra[0]=istio-system/ztunnel,extraServerDNS[0]=ca.example",
        "--set",
        "podAnnotations.extra=yes,podLabels.team=mesh,nodeSelector.pool=system",
        "--set",
        "tolerations[0].key=dedicated,tolerations[0].operator=Exists",
        "--set",
        "podDisruptionBudget.enabled=false,networkPolicy.enabled=false",
        "--set",
        "ca.mode=plugged-in,ca.pluggedIn.secretName=my-ca",
    ]);
    let objects = by_key(&docs);
    let kinds: BTreeSet<&str> = objects.keys().map(|(k, _)| k.as_str()).collect();
    assert!(!kinds.contains("PodDisruptionBudget") && !kinds.contains("NetworkPolicy"));
    let deployments: Vec<Deployment> = of_kind(&docs, "Deployment");
    let spec = deployments[0].spec.clone().unwrap();
    assert_eq!(spec.replicas, Some(3));
    let template_meta = spec.template.metadata.unwrap();
    let annotations = template_meta.annotations.unwrap();
    assert_eq!(annotations["extra"], "yes");
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    let labels = template_meta.labels.unwrap();
    assert_eq!(
        (labels["team"].as_str(), labels["app"].as_str()),
        ("mesh", "meshca")
    );
    let pod = spec.template.spec.unwrap();
    assert_eq!(pod.node_selector.unwrap()["pool"], "system");
    assert_eq!(
        pod.tolerations.unwrap()[0].key.as_deref(),
        Some("dedicated")
    );
    let secret = pod
        .volumes
        .iter()
        .flatten()
        .find_map(|v| v.secret.clone())
        .unwrap();
    assert_eq!(secret.secret_name.as_deref(), Some("my-ca"));
    let container = &pod.containers[0];
    assert_eq!(
        container.image.as_deref(),
        Some("registry.example/meshca:dev")
    );
    assert_eq!(container.image_pull_policy.as_deref(), Some("Always"));
    assert_eq!(
        container.args.as_deref(),
        Some(&["serve".to_string(), "--workload-cert-ttl=12h".to_string()][..])
    );
    assert_eq!(env_value(container, "MESHCA_LOG").as_deref(), Some("debug"));
    assert_eq!(
        env_value(container, "MESHCA_CA_DIR").as_deref(),
        Some("/etc/cacerts")
    );
    assert_eq!(
        env_value(container, "MESHCA_TRUSTED_NODE_AGENT").as_deref(),
        Some("istio-system/ztunnel")
    );
    assert!(env_value(container, "MESHCA_SERVER_DNS")
        .unwrap()
        .ends_with(",ca.example"));

    // Values the chart refuses.
    for bad in [
        "ca.mode=external",
        "trustedNodeAgents.extra[0]=ztunnel",
        "replicas=two",
        "unknownValue=1",
    ] {
        let out = run_helm(&helm, &["template", "ca", &chart, "--set", bad]);
        assert!(out.is_err(), "{bad} is refused");
    }
}

/// The dotted paths of `value`'s leaves (an empty map or list is a leaf).
fn leaf_paths(prefix: &str, value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaf_paths(&path, v, out);
            }
        }
        _ => out.push(prefix.to_string()),
    }
}

#[test]
fn the_chart_readme_documents_every_value() {
    let values = documents(&std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap());
    let readme = std::fs::read_to_string(chart_dir().join("README.md")).unwrap();
    let mut paths = Vec::new();
    leaf_paths("", &values[0], &mut paths);
    // Maps whose keys are the user's (labels, annotations): the map is
    // documented, not its default keys.
    let user_maps = [
        "networkPolicy.prometheusPodLabels",
        "resources",
        "nodeAgent.resources",
    ];
    let mut missing = BTreeSet::new();
    for path in &paths {
        let documented = user_maps
            .iter()
            .find(|m| path.starts_with(&format!("{m}.")))
            .map_or(path.as_str(), |m| m);
        if !readme.contains(&format!("`{documented}`")) {
            missing.insert(documented.to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "not in the chart's README.md: {missing:?}"
    );
}
