//! Driving and observing meshca's root rotation through the fake
//! Kubernetes API: the Secret `istio-system/istio-ca-secret` holds the
//! phase and the signing root, the ConfigMap `istio-ca-root-cert` the
//! published trust bundle (docs/cluster.md, "The root, the bundle, the leader").

use meshca_certs::bundle::parse_certs_pem;

use crate::fake_kube::FakeKube;

/// The line meshca logs at start when `--root-rotation-grace` is shorter
/// than what clients renewing at half of their lifetime need.
pub const UNSAFE_GRACE_WARNING: &str = "root rotation would not be safe for clients";

/// `meshca serve` flags for a root rotation short enough for a test,
/// against `kube`: both roots announced 6 s, leaves living 4 s (renewed at
/// most every 2 s), the old root retired 4 s + 6 s after the switch. Far
/// below what clients renewing at half of a 24 h lifetime need: meshca
/// warns at start ([`UNSAFE_GRACE_WARNING`]).
pub fn fast_rotation_flags(kube: &FakeKube) -> Vec<String> {
    [
        "--kubeconfig",
        kube.kubeconfig.to_str().expect("UTF-8 path"),
        "--leader-lease-duration",
        "3s",
        "--root-rotation-grace",
        "6s",
        "--workload-cert-ttl",
        "4s",
        "--max-workload-cert-ttl",
        "4s",
    ]
    .map(String::from)
    .to_vec()
}

/// The rotation as the Secret says now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RotationState {
    /// `meshca.io/root-rotation-phase`: `stable`, `announced` or `switched`.
    pub phase: String,
    /// The root that signs now (`ca-cert.pem`), DER.
    pub signing_root: Vec<u8>,
}

impl RotationState {
    /// The phase, with `stable` under a root other than `first_root` named
    /// `retired` (the old root has left the bundle).
    pub fn label(&self, first_root: &[u8]) -> String {
        if self.phase == "stable" && self.signing_root != first_root {
            "retired".to_string()
        } else {
            self.phase.clone()
        }
    }
}

fn unb64(value: &serde_json::Value) -> Option<String> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(value.as_str()?)
        .ok()?;
    String::from_utf8(bytes).ok()
}

fn ca_secret(kube: &FakeKube) -> Option<serde_json::Value> {
    kube.get_object("secrets", "istio-system", "istio-ca-secret")
}

/// The rotation state, once meshca has written its Secret.
pub fn rotation_state(kube: &FakeKube) -> Option<RotationState> {
    let secret = ca_secret(kube)?;
    let phase = secret["metadata"]["annotations"]["meshca.io/root-rotation-phase"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let signing_root = parse_certs_pem(&unb64(&secret["data"]["ca-cert.pem"])?)
        .ok()?
        .into_iter()
        .next()?;
    Some(RotationState {
        phase,
        signing_root,
    })
}

/// The bundle meshca published in `namespace`'s `istio-ca-root-cert`, PEM.
pub fn bundle_configmap(kube: &FakeKube, namespace: &str) -> Option<String> {
    kube.get_object("configmaps", namespace, "istio-ca-root-cert")
        .and_then(|cm| cm["data"]["root-cert.pem"].as_str().map(String::from))
}

/// Asks for a rotation now, as an operator does with `kubectl annotate
/// secret istio-ca-secret meshca.io/rotate-root=now`. Returns whether the
/// Secret existed.
pub fn ask_root_rotation(kube: &FakeKube) -> bool {
    let Some(mut secret) = ca_secret(kube) else {
        return false;
    };
    secret["metadata"]["annotations"]["meshca.io/rotate-root"] = serde_json::json!("now");
    kube.put_object("secrets", secret);
    true
}
