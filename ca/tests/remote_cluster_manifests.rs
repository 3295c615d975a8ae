//! `deploy/kustomize/remote-cluster` (the account a remote cluster gives
//! meshca through an Istio remote secret) against the code: its
//! ClusterRole grants exactly `REMOTE_RBAC_RULES`, bound to its
//! ServiceAccount, whose token Secret is the one the kustomization names.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;

use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use meshca_ca::cluster::REMOTE_RBAC_RULES;

fn documents(text: &str) -> Vec<serde_json::Value> {
    serde_saphyr::from_multiple::<serde_json::Value>(text)
        .expect("valid YAML")
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

fn of_kind<T: serde::de::DeserializeOwned>(docs: &[serde_json::Value], kind: &str) -> Vec<T> {
    docs.iter()
        .filter(|d| d["kind"] == kind)
        .map(|d| serde_json::from_value(d.clone()).expect(kind))
        .collect()
}

#[test]
fn the_remote_cluster_rbac_is_exactly_what_the_code_calls() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kustomize/remote-cluster");
    let kustomization =
        documents(&std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap());
    assert_eq!(kustomization[0]["namespace"], "istio-system");
    let docs: Vec<serde_json::Value> = kustomization[0]["resources"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| documents(&std::fs::read_to_string(dir.join(r.as_str().unwrap())).unwrap()))
        .collect();

    let roles: Vec<ClusterRole> = of_kind(&docs, "ClusterRole");
    assert_eq!(roles.len(), 1);
    let mut granted = BTreeSet::new();
    for rule in roles[0].rules.as_deref().unwrap() {
        assert!(rule.resource_names.is_none(), "{rule:?}");
        for group in rule.api_groups.clone().unwrap_or_default() {
            for resource in rule.resources.clone().unwrap_or_default() {
                let mut verbs = rule.verbs.clone();
                verbs.sort();
                assert!(
                    granted.insert((group.clone(), resource, verbs)),
                    "granted twice"
                );
            }
        }
    }
    let expected: BTreeSet<(String, String, Vec<String>)> = REMOTE_RBAC_RULES
        .iter()
        .map(|r| {
            assert!(
                !r.own_namespace_only,
                "a remote cluster grants cluster-wide only"
            );
            let mut verbs: Vec<String> = r.verbs.iter().map(|v| v.to_string()).collect();
            verbs.sort();
            (r.api_group.to_string(), r.resource.to_string(), verbs)
        })
        .collect();
    assert_eq!(granted, expected);
    assert!(
        !granted.iter().any(|(_, resource, _)| resource == "secrets"),
        "meshca reads no Secret of a remote cluster"
    );

    let account: Vec<ServiceAccount> = of_kind(&docs, "ServiceAccount");
    let name = account[0].metadata.name.clone().unwrap();
    let bindings: Vec<ClusterRoleBinding> = of_kind(&docs, "ClusterRoleBinding");
    assert_eq!(
        bindings[0].role_ref.name,
        roles[0].metadata.name.clone().unwrap()
    );
    let subject = &bindings[0].subjects.as_ref().unwrap()[0];
    assert_eq!(
        (subject.kind.as_str(), subject.name.as_str()),
        ("ServiceAccount", name.as_str())
    );
    assert_eq!(subject.namespace.as_deref(), Some("istio-system"));
    let token: Vec<Secret> = of_kind(&docs, "Secret");
    assert_eq!(
        token[0].type_.as_deref(),
        Some("kubernetes.io/service-account-token")
    );
    assert_eq!(
        token[0]
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("kubernetes.io/service-account.name")),
        Some(&name)
    );
}
