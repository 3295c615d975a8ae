//! What the manifest tests (`manifests.rs`, `helm_chart.rs`) share.

use std::collections::BTreeSet;

use k8s_openapi::api::rbac::v1::PolicyRule;
use meshca_ca::cluster::{EXAMPLE_POD_CERTIFICATE_SIGNER, RBAC_RULES};

/// One grant: (group, resource, verbs, resource names), verbs and names
/// sorted.
pub(crate) type Grant = (String, String, Vec<String>, Vec<String>);

/// The grants of a set of RBAC rules, one per group and resource.
pub(crate) fn grants(rules: &[PolicyRule]) -> BTreeSet<Grant> {
    let mut out = BTreeSet::new();
    for rule in rules {
        for group in rule.api_groups.clone().unwrap_or_default() {
            for resource in rule.resources.clone().unwrap_or_default() {
                let mut verbs = rule.verbs.clone();
                verbs.sort();
                let mut names = rule.resource_names.clone().unwrap_or_default();
                names.sort();
                out.insert((group.clone(), resource, verbs, names));
            }
        }
    }
    out
}

/// The grants of `RBAC_RULES`, cluster-wide or in the own namespace, with
/// `signer` where the rules name the example signer.
pub(crate) fn expected_grants(own_namespace: bool, signer: &str) -> BTreeSet<Grant> {
    RBAC_RULES
        .iter()
        .filter(|r| r.own_namespace_only == own_namespace)
        .map(|r| {
            let mut verbs: Vec<String> = r.verbs.iter().map(|v| v.to_string()).collect();
            verbs.sort();
            let mut names: Vec<String> = r
                .resource_names
                .iter()
                .map(|n| {
                    if *n == EXAMPLE_POD_CERTIFICATE_SIGNER {
                        signer.to_string()
                    } else {
                        n.to_string()
                    }
                })
                .collect();
            names.sort();
            (
                r.api_group.to_string(),
                r.resource.to_string(),
                verbs,
                names,
            )
        })
        .collect()
}
