//! The deployment manifests in `deploy/kustomize` against the Kubernetes
//! schema (typed k8s-openapi objects) and against what meshca does: RBAC
//! grants exactly the calls in `RBAC_RULES`, the probes and ports are the
//! ones `meshca serve` serves. With `kubectl` on the PATH the rendered
//! overlays (`kubectl kustomize`) are checked too; without it they are
//! skipped, except in CI (`CI` set), where a missing `kubectl` fails.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use meshca_ca::cluster::EXAMPLE_POD_CERTIFICATE_SIGNER;

mod common;
use common::{expected_grants, grants};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kustomize")
}

fn documents(text: &str) -> Vec<serde_json::Value> {
    serde_saphyr::from_multiple::<serde_json::Value>(text)
        .expect("valid YAML")
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

fn base_documents() -> Vec<serde_json::Value> {
    let base = deploy_dir().join("base");
    let kustomization =
        documents(&std::fs::read_to_string(base.join("kustomization.yaml")).unwrap());
    let resources = kustomization[0]["resources"].as_array().unwrap().clone();
    resources
        .iter()
        .flat_map(|r| documents(&std::fs::read_to_string(base.join(r.as_str().unwrap())).unwrap()))
        .collect()
}

fn of_kind<T: serde::de::DeserializeOwned>(docs: &[serde_json::Value], kind: &str) -> Vec<T> {
    docs.iter()
        .filter(|d| d["kind"] == kind)
        .map(|d| {
            serde_json::from_value(d.clone())
                .unwrap_or_else(|e| panic!("{kind} does not match the schema: {e}"))
        })
        .collect()
}

/// The pod template's spec of `deployment`.
fn pod_spec(deployment: &Deployment) -> &k8s_openapi::api::core::v1::PodSpec {
    deployment
        .spec
        .as_ref()
        .expect("a Deployment spec")
        .template
        .spec
        .as_ref()
        .expect("a pod template spec")
}

fn check(docs: &[serde_json::Value]) {
    // RBAC: exactly RBAC_RULES, cluster-wide or in the own namespace.
    let cluster_roles: Vec<ClusterRole> = of_kind(docs, "ClusterRole");
    let roles: Vec<Role> = of_kind(docs, "Role");
    assert_eq!(cluster_roles.len(), 1);
    assert_eq!(roles.len(), 1);
    let expected = |own: bool| expected_grants(own, EXAMPLE_POD_CERTIFICATE_SIGNER);
    assert_eq!(
        grants(cluster_roles[0].rules.as_deref().unwrap()),
        expected(false),
        "ClusterRole"
    );
    assert_eq!(
        grants(&roles[0].rules.clone().unwrap()),
        expected(true),
        "Role"
    );
    let crb: Vec<ClusterRoleBinding> = of_kind(docs, "ClusterRoleBinding");
    let rb: Vec<RoleBinding> = of_kind(docs, "RoleBinding");
    assert_eq!(crb[0].role_ref.name, "meshca");
    assert_eq!(rb[0].role_ref.name, "meshca");
    let sa: Vec<ServiceAccount> = of_kind(docs, "ServiceAccount");
    assert_eq!(sa[0].metadata.name.as_deref(), Some("meshca"));

    // Deployment: 2 replicas, probes on the monitoring port, ports, POD_NAMESPACE.
    let deployment: Vec<Deployment> = of_kind(docs, "Deployment");
    let spec = deployment[0].spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some("meshca"));
    let container = &pod.containers[0];
    assert_eq!(container.args.as_deref(), Some(&["serve".to_string()][..]));
    let ports: BTreeSet<i32> = container
        .ports
        .iter()
        .flatten()
        .map(|p| p.container_port)
        .collect();
    assert_eq!(ports, BTreeSet::from([15012, 15014]));
    let readiness = container
        .readiness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(readiness.path.as_deref(), Some("/ready"));
    let liveness = container
        .liveness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(liveness.path.as_deref(), Some("/healthz"));
    let env: Vec<String> = container
        .env
        .iter()
        .flatten()
        .map(|e| e.name.clone())
        .collect();
    for name in ["POD_NAMESPACE", "MESHCA_LISTEN", "MESHCA_MONITORING_LISTEN"] {
        assert!(env.contains(&name.to_string()), "{name} is set");
    }
    // Every MESHCA_ variable names a real flag of `meshca serve`.
    let flags = meshca_flag_envs();
    for name in env.iter().filter(|n| n.starts_with("MESHCA_")) {
        assert!(flags.contains(name), "{name} is not a flag of meshca serve");
    }

    // Service and PDB.
    let service: Vec<Service> = of_kind(docs, "Service");
    let service_ports: BTreeSet<i32> = service[0]
        .spec
        .as_ref()
        .unwrap()
        .ports
        .iter()
        .flatten()
        .map(|p| p.port)
        .collect();
    assert_eq!(service_ports, BTreeSet::from([15012, 15014]));
    let pdb: Vec<PodDisruptionBudget> = of_kind(docs, "PodDisruptionBudget");
    assert!(pdb[0].spec.as_ref().unwrap().min_available.is_some());

    // NetworkPolicy: the gRPC port from every pod, the monitoring port from
    // Prometheus only (the kubelet's probes come from the node).
    let policies: Vec<NetworkPolicy> = of_kind(docs, "NetworkPolicy");
    assert_eq!(policies.len(), 1);
    let policy = policies[0].spec.as_ref().unwrap();
    assert_eq!(
        policy.pod_selector.as_ref().unwrap().match_labels,
        spec.selector.match_labels,
        "it selects the meshca pods"
    );
    assert_eq!(
        policy.policy_types.as_deref(),
        Some(&["Ingress".to_string()][..])
    );
    let port_names: BTreeSet<(String, i32)> = container
        .ports
        .iter()
        .flatten()
        .filter_map(|p| Some((p.name.clone()?, p.container_port)))
        .collect();
    let mut allowed = BTreeSet::new();
    for rule in policy.ingress.iter().flatten() {
        let peers = rule.from.as_deref().unwrap_or_default();
        let everyone = peers.len() == 1
            && peers[0].ip_block.is_none()
            && peers[0].pod_selector.is_none()
            && peers[0]
                .namespace_selector
                .as_ref()
                .is_some_and(|s| s.match_labels.is_none() && s.match_expressions.is_none());
        let prometheus = peers.len() == 1
            && peers[0].pod_selector.as_ref().is_some_and(|s| {
                s.match_labels
                    .as_ref()
                    .and_then(|l| l.get("app.kubernetes.io/name"))
                    == Some(&"prometheus".to_string())
            });
        for port in rule.ports.iter().flatten() {
            let number = match port.port.as_ref().unwrap() {
                IntOrString::Int(n) => *n,
                IntOrString::String(name) => {
                    port_names
                        .iter()
                        .find(|(n, _)| n == name)
                        .unwrap_or_else(|| panic!("port {name} is not a container port"))
                        .1
                }
            };
            allowed.insert((number, everyone, prometheus));
        }
    }
    assert_eq!(
        allowed,
        BTreeSet::from([(15012, true, false), (15014, false, true)]),
        "15012 from every pod, 15014 from Prometheus only"
    );
}

/// The environment variable of every `meshca serve` flag.
fn meshca_flag_envs() -> BTreeSet<String> {
    use clap::CommandFactory;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: meshca_ca::config::ServeArgs,
    }
    Cli::command()
        .get_arguments()
        .filter_map(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
        .collect()
}

#[test]
fn the_pod_certificate_example_and_overlay_name_the_signer_the_rbac_grants() {
    use k8s_openapi::api::core::v1::Pod;
    use meshca_ca::cluster::{EXAMPLE_POD_CERTIFICATE_SIGNER, TRUST_DOMAIN_LABEL};
    let text =
        std::fs::read_to_string(deploy_dir().join("../examples/pod-certificate.yaml")).unwrap();
    let pods: Vec<Pod> = of_kind(&documents(&text), "Pod");
    let sources: Vec<_> = pods[0]
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.projected.as_ref())
        .flat_map(|p| p.sources.clone().unwrap_or_default())
        .collect();
    let certificate = sources
        .iter()
        .find_map(|s| s.pod_certificate.as_ref())
        .expect("a podCertificate source");
    assert_eq!(certificate.signer_name, EXAMPLE_POD_CERTIFICATE_SIGNER);
    assert!(
        ["ECDSAP256", "ECDSAP384", "RSA3072", "RSA4096", "ED25519"]
            .contains(&certificate.key_type.as_str()),
        "a key type meshca signs"
    );
    let trust = sources
        .iter()
        .find_map(|s| s.cluster_trust_bundle.as_ref())
        .expect("a clusterTrustBundle source");
    assert_eq!(
        trust.signer_name.as_deref(),
        Some(EXAMPLE_POD_CERTIFICATE_SIGNER)
    );
    let labels = trust
        .label_selector
        .as_ref()
        .and_then(|s| s.match_labels.clone())
        .unwrap_or_default();
    assert!(labels.contains_key(TRUST_DOMAIN_LABEL));

    // The overlay turns the signer on with the same name.
    let overlay = deploy_dir().join("overlays/pod-certificates");
    let patch = documents(&std::fs::read_to_string(overlay.join("signer.yaml")).unwrap());
    let env = patch[0]["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .clone();
    let signer = env
        .iter()
        .find(|e| e["name"] == "MESHCA_POD_CERTIFICATE_SIGNER")
        .expect("the overlay sets the signer");
    assert_eq!(signer["value"], EXAMPLE_POD_CERTIFICATE_SIGNER);
    assert!(meshca_flag_envs().contains("MESHCA_POD_CERTIFICATE_SIGNER"));
}

#[test]
fn base_manifests_match_the_schema_and_the_code() {
    check(&base_documents());
}

#[test]
fn rendered_overlays_match_when_kubectl_is_available() {
    if !meshca_tests::have_kubectl() {
        eprintln!("SKIPPED: kubectl is not installed; only the base manifests were checked");
        return;
    }
    for overlay in [
        "self-signed",
        "plugged-in",
        "pod-certificates",
        "node-agent",
    ] {
        let out = std::process::Command::new("kubectl")
            .arg("kustomize")
            .arg(deploy_dir().join("overlays").join(overlay))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kubectl kustomize {overlay}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let docs = documents(&String::from_utf8(out.stdout).unwrap());
        check(&docs);
        let deployment: Vec<Deployment> = of_kind(&docs, "Deployment");
        let pod = pod_spec(&deployment[0]);
        let has_cacerts = pod.volumes.iter().flatten().any(|v| {
            v.secret
                .as_ref()
                .is_some_and(|s| s.secret_name.as_deref() == Some("cacerts"))
        });
        assert_eq!(has_cacerts, overlay == "plugged-in", "{overlay}");
        for doc in &docs {
            if doc["kind"] != "ClusterRole" && doc["kind"] != "ClusterRoleBinding" {
                assert_eq!(
                    doc["metadata"]["namespace"], "istio-system",
                    "{}",
                    doc["kind"]
                );
            }
        }
    }
}

fn documents_of(dir: &str) -> Vec<serde_json::Value> {
    let dir = deploy_dir().join(dir);
    let kustomization =
        documents(&std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap());
    let resources = kustomization[0]["resources"].as_array().unwrap().clone();
    resources
        .iter()
        .flat_map(|r| documents(&std::fs::read_to_string(dir.join(r.as_str().unwrap())).unwrap()))
        .collect()
}

fn env_value(container: &k8s_openapi::api::core::v1::Container, name: &str) -> Option<String> {
    container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

fn env_field(container: &k8s_openapi::api::core::v1::Container, name: &str) -> Option<String> {
    container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.clone())
}

/// The directory of `volume` mounted in `container`.
fn mount_of(container: &k8s_openapi::api::core::v1::Container, volume: &str) -> String {
    container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume)
        .unwrap_or_else(|| panic!("{} mounts {volume}", container.name))
        .mount_path
        .clone()
}

#[test]
fn agent_pod_mode_manifest_shares_the_socket_with_the_workload() {
    let docs = documents_of("agent-pod");
    let deployment: Vec<Deployment> = of_kind(&docs, "Deployment");
    let pod = pod_spec(&deployment[0]).clone();
    let sidecar = pod
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "meshca-agent")
        .expect("the agent is a native sidecar");
    assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
    let socket = env_value(sidecar, "MESHCA_WORKLOAD_API_SOCKET").unwrap();
    assert_eq!(
        socket, "/var/run/secrets/workload-spiffe-uds/socket",
        "Istio's path"
    );
    let socket_dir = mount_of(sidecar, "workload-socket");
    assert!(socket.starts_with(&format!("{socket_dir}/")));
    assert_eq!(
        env_field(sidecar, "MESHCA_SERVICE_ACCOUNT").as_deref(),
        Some("spec.serviceAccountName")
    );
    let app = &pod.containers[0];
    assert_eq!(mount_of(app, "workload-socket"), socket_dir);
    assert_eq!(
        env_value(app, "SPIFFE_ENDPOINT_SOCKET"),
        Some(format!("unix://{socket}"))
    );
    let volumes = pod.volumes.unwrap();
    let shared = volumes
        .iter()
        .find(|v| v.name == "workload-socket")
        .unwrap();
    assert!(shared.empty_dir.is_some(), "an emptyDir");
    let token = volumes.iter().find(|v| v.name == "istio-token").unwrap();
    let audience = token.projected.as_ref().unwrap().sources.as_ref().unwrap()[0]
        .service_account_token
        .as_ref()
        .unwrap()
        .audience
        .clone();
    assert_eq!(audience.as_deref(), Some("istio-ca"));
}

#[test]
fn agent_node_mode_manifests_match_the_ca_overlay() {
    use k8s_openapi::api::apps::v1::DaemonSet;
    let docs = documents_of("agent-node");
    let daemonset: Vec<DaemonSet> = of_kind(&docs, "DaemonSet");
    let pod = daemonset[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .clone()
        .unwrap();
    assert_eq!(pod.host_pid, Some(true), "peer PIDs are host PIDs");
    let agent = &pod.containers[0];
    assert_eq!(
        env_value(agent, "MESHCA_NODE_AGENT").as_deref(),
        Some("true")
    );
    assert_eq!(
        env_field(agent, "MESHCA_NODE_NAME").as_deref(),
        Some("spec.nodeName")
    );
    let socket = env_value(agent, "MESHCA_WORKLOAD_API_SOCKET").unwrap();
    let socket_dir = mount_of(agent, "sockets");
    assert!(socket.starts_with(&format!("{socket_dir}/")));
    let volumes = pod.volumes.unwrap();
    let host = volumes.iter().find(|v| v.name == "sockets").unwrap();
    assert_eq!(
        host.host_path.as_ref().unwrap().type_.as_deref(),
        Some("DirectoryOrCreate")
    );

    // RBAC: pods, read-only, bound to the agent's service account.
    let roles: Vec<ClusterRole> = of_kind(&docs, "ClusterRole");
    assert_eq!(
        grants(roles[0].rules.as_deref().unwrap()),
        BTreeSet::from([(
            String::new(),
            "pods".to_string(),
            vec!["get".to_string(), "list".to_string(), "watch".to_string()],
            Vec::new(),
        )])
    );
    let binding: Vec<ClusterRoleBinding> = of_kind(&docs, "ClusterRoleBinding");
    let subject = &binding[0].subjects.as_ref().unwrap()[0];
    assert_eq!(
        Some(subject.name.as_str()),
        pod.service_account_name.as_deref()
    );
    let namespace = subject.namespace.clone().unwrap();

    // The CA overlay trusts exactly this service account as a node agent.
    let patch = documents(
        &std::fs::read_to_string(deploy_dir().join("overlays/node-agent/trusted-node-agent.yaml"))
            .unwrap(),
    );
    let patched: Vec<Deployment> = of_kind(&patch, "Deployment");
    let ca = &pod_spec(&patched[0]).containers[0];
    assert_eq!(
        env_value(ca, "MESHCA_TRUSTED_NODE_AGENT"),
        Some(format!("{namespace}/{}", subject.name))
    );
    assert!(meshca_flag_envs().contains("MESHCA_TRUSTED_NODE_AGENT"));
}

/// A quantity such as `256Mi`, `1Gi` or `300M`, in bytes.
fn quantity_bytes(quantity: &str) -> u64 {
    let (number, unit) = quantity
        .find(|c: char| !c.is_ascii_digit())
        .map_or((quantity, ""), |i| quantity.split_at(i));
    let number: u64 = number.parse().expect("a whole number");
    let unit = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        other => panic!("unit {other} not expected in the manifests"),
    };
    number * unit
}

#[test]
fn the_memory_limit_holds_what_the_default_limits_allow() {
    use meshca_ca::config::{
        memory_bound, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_OPEN_REQUESTS, MEMORY_AT_REST,
    };
    let docs = base_documents();
    let deployment: Vec<Deployment> = of_kind(&docs, "Deployment");
    let pod = pod_spec(&deployment[0]);
    let container = &pod.containers[0];
    // The manifests leave both limits at their defaults.
    for name in ["MESHCA_MAX_CONNECTIONS", "MESHCA_MAX_OPEN_REQUESTS"] {
        assert!(env_value(container, name).is_none(), "{name} is set");
    }
    let resources = container.resources.as_ref().expect("resources");
    let limit = quantity_bytes(&resources.limits.as_ref().unwrap()["memory"].0);
    let request = quantity_bytes(&resources.requests.as_ref().unwrap()["memory"].0);
    let bound = memory_bound(
        u64::from(DEFAULT_MAX_CONNECTIONS),
        u64::from(DEFAULT_MAX_OPEN_REQUESTS),
    );
    assert!(
        bound <= limit,
        "the defaults allow {} MiB, the limit is {} MiB",
        bound >> 20,
        limit >> 20
    );
    // Not so far below it that the limit could be much smaller (a third
    // of headroom over the estimate at most), and the request covers the
    // server at rest.
    assert!(
        bound * 3 >= limit * 2,
        "the limit ({} MiB) is far above what the defaults allow ({} MiB)",
        limit >> 20,
        bound >> 20
    );
    assert!(
        request >= MEMORY_AT_REST,
        "the request covers the server at rest"
    );
}
