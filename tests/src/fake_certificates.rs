//! kube-apiserver's own validation of `certificates.k8s.io/v1beta1`
//! `PodCertificateRequest`s (at creation, and on the `status`
//! subresource) and `ClusterTrustBundle`s, for the fake API server: a
//! status the real API server would refuse is refused here too (422
//! Invalid), so the end-to-end tests catch it. Also the pieces a test
//! needs to make requests the way a kubelet does.
//!
//! One knowing gap: a P-521 key is accepted at creation without checking
//! its signature (`ring` has no P-521), where the real API server checks it.

use meshca_certs::pod_certificate::{
    self, is_dns1123_subdomain, is_kubernetes_signer, read_pod_key, trust_bundle_name_prefix,
    validate_signer_name, PodKeyError,
};
use meshca_certs::PrivateKey;
use serde_json::Value;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, X509Certificate};

const TERMINAL: [&str; 3] = ["Issued", "Denied", "Failed"];

fn bytes_field(value: &Value) -> Result<Vec<u8>, String> {
    use base64::Engine;
    match value.as_str() {
        None | Some("") => Ok(Vec::new()),
        Some(text) => base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|_| "not base64".to_string()),
    }
}

fn text<'a>(value: &'a Value, field: &str) -> &'a str {
    value[field].as_str().unwrap_or_default()
}

/// Defaults and validates a request being created (the API's
/// `ValidatePodCertificateRequestCreate`); clears its status.
pub(crate) fn create_pod_certificate_request(object: &mut Value) -> Result<(), String> {
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    if !is_dns1123_subdomain(name) {
        return Err(format!("metadata.name: Invalid value: {name:?}"));
    }
    if object["spec"]["maxExpirationSeconds"].is_null() {
        object["spec"]["maxExpirationSeconds"] =
            serde_json::json!(pod_certificate::DEFAULT_MAX_EXPIRATION_SECONDS);
    }
    if let Some(map) = object.as_object_mut() {
        map.remove("status");
    }
    let spec = &object["spec"];
    let signer = text(spec, "signerName");
    validate_signer_name(signer).map_err(|e| format!("spec.signerName: {e}"))?;
    if let Some(annotations) = spec["unverifiedUserAnnotations"].as_object() {
        for key in annotations.keys() {
            let ok = key
                .split_once('/')
                .is_some_and(|(prefix, rest)| is_dns1123_subdomain(prefix) && !rest.is_empty());
            if !ok {
                return Err(format!(
                    "spec.unverifiedUserAnnotations: Invalid value: {key:?}: keys must be domain-prefixed"
                ));
            }
        }
    }
    for field in ["podName", "serviceAccountName", "nodeName"] {
        if !is_dns1123_subdomain(text(spec, field)) {
            return Err(format!("spec.{field}: Invalid value"));
        }
    }
    for field in ["podUID", "serviceAccountUID", "nodeUID"] {
        let value = text(spec, field);
        if value.is_empty() {
            return Err(format!("spec.{field}: Invalid value: must not be empty"));
        }
        if value.len() > 128 {
            return Err(format!("spec.{field}: Too long: may not be more than 128"));
        }
    }
    let max = spec["maxExpirationSeconds"].as_i64().unwrap_or_default();
    let upper = if is_kubernetes_signer(signer) {
        86400
    } else {
        pod_certificate::MAX_MAX_EXPIRATION_SECONDS
    };
    if !(pod_certificate::MIN_MAX_EXPIRATION_SECONDS..=upper).contains(&max) {
        return Err(format!(
            "spec.maxExpirationSeconds: Invalid value: {max}: must be in the range [{}, {upper}]",
            pod_certificate::MIN_MAX_EXPIRATION_SECONDS
        ));
    }
    let stub = bytes_field(&spec["stubPKCS10Request"])
        .map_err(|e| format!("spec.stubPKCS10Request: {e}"))?;
    let pkix =
        bytes_field(&spec["pkixPublicKey"]).map_err(|e| format!("spec.pkixPublicKey: {e}"))?;
    let proof = bytes_field(&spec["proofOfPossession"])
        .map_err(|e| format!("spec.proofOfPossession: {e}"))?;
    match read_pod_key(&stub, &pkix, &proof, text(spec, "podUID")) {
        Ok(_) => Ok(()),
        // Allowed by the API, not signed by meshca (P-521): stored.
        Err(PodKeyError::UnsupportedKeyType {
            api_allows: true, ..
        }) => Ok(()),
        Err(PodKeyError::UnsupportedKeyType { kind, .. }) => Err(format!(
            "spec.pkixPublicKey: Invalid value: {kind}: unsupported key type"
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// The DER SubjectPublicKeyInfo the request asks a certificate for.
fn requested_spki(spec: &Value) -> Result<Vec<u8>, String> {
    let stub = bytes_field(&spec["stubPKCS10Request"])?;
    if !stub.is_empty() {
        let (_, csr) =
            x509_parser::certification_request::X509CertificationRequest::from_der(&stub)
                .map_err(|e| e.to_string())?;
        return Ok(csr.certification_request_info.subject_pki.raw.to_vec());
    }
    bytes_field(&spec["pkixPublicKey"])
}

fn has_condition(status: &Value, kind: &str) -> bool {
    status["conditions"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["type"] == kind && c["status"] == "True"))
}

fn is_terminal(status: &Value) -> bool {
    TERMINAL.iter().any(|t| has_condition(status, t))
}

fn parse_time(value: &Value, field: &str) -> Result<OffsetDateTime, String> {
    let text = value
        .as_str()
        .ok_or_else(|| format!("{field}: Required value"))?;
    OffsetDateTime::parse(text, &Rfc3339).map_err(|e| format!("{field}: Invalid value: {e}"))
}

fn is_condition_reason(reason: &str) -> bool {
    let bytes = reason.as_bytes();
    let inner_ok = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b',' | b':');
    let last_ok = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_';
    match bytes {
        [] => false,
        [first] => first.is_ascii_alphabetic(),
        [first, middle @ .., last] => {
            first.is_ascii_alphabetic() && middle.iter().all(inner_ok) && last_ok(last)
        }
    }
}

/// The API's `ValidatePodCertificateRequestStatusUpdate`: `new` is the
/// stored object with the status sent; `old` the stored object.
pub(crate) fn pod_certificate_request_status(
    new: &Value,
    old: &Value,
    now: OffsetDateTime,
) -> Result<(), String> {
    let status = &new["status"];
    let empty = Vec::new();
    let conditions = status["conditions"].as_array().unwrap_or(&empty);
    let mut known = 0;
    for (i, c) in conditions.iter().enumerate() {
        let kind = text(c, "type");
        if !TERMINAL.contains(&kind) {
            return Err(format!(
                "status.conditions[{i}].type: Unsupported value: {kind:?}: supported values: \"Issued\", \"Denied\", \"Failed\""
            ));
        }
        known += 1;
        if known > 1 {
            return Err(format!("status.conditions[{i}].type: Invalid value: There may be at most one condition with type \"Issued\", \"Denied\", or \"Failed\""));
        }
        if c["status"] != "True" {
            return Err(format!(
                "status.conditions[{i}].status: Unsupported value: {}",
                c["status"]
            ));
        }
        // metav1 ValidateConditions.
        if c["lastTransitionTime"]
            .as_str()
            .unwrap_or_default()
            .is_empty()
        {
            return Err(format!(
                "status.conditions[{i}].lastTransitionTime: Required value: must be set"
            ));
        }
        parse_time(&c["lastTransitionTime"], "lastTransitionTime")?;
        let reason = text(c, "reason");
        if reason.is_empty() {
            return Err(format!(
                "status.conditions[{i}].reason: Required value: must be set"
            ));
        }
        if reason.len() > 1024 || !is_condition_reason(reason) {
            return Err(format!(
                "status.conditions[{i}].reason: Invalid value: {reason:?}: a condition reason must start with alphabetic character, optionally followed by a string of alphanumeric characters or '_,:', and must end with an alphanumeric character or '_'"
            ));
        }
        if text(c, "message").len() > 32768 {
            return Err(format!("status.conditions[{i}].message: Too long"));
        }
        if c["observedGeneration"].as_i64().is_some_and(|g| g < 0) {
            return Err(format!(
                "status.conditions[{i}].observedGeneration: Invalid value"
            ));
        }
    }
    let old_status = &old["status"];
    let same = |a: &Value, b: &Value| {
        let norm = |v: &Value| {
            if v.is_null() {
                serde_json::json!({})
            } else {
                v.clone()
            }
        };
        norm(a) == norm(b)
    };
    if is_terminal(old_status) {
        if !same(status, old_status) {
            return Err("status: Invalid value: immutable after PodCertificateRequest is issued, denied, or failed".into());
        }
        return Ok(());
    }
    if has_condition(status, "Denied") || has_condition(status, "Failed") {
        for field in [
            "certificateChain",
            "notBefore",
            "notAfter",
            "beginRefreshAt",
        ] {
            let v = &status[field];
            if !(v.is_null() || v.as_str() == Some("")) {
                return Err("status: Invalid value: non-condition status fields must be empty when denying or failing the PodCertificateRequest".into());
            }
        }
        return Ok(());
    }
    if !has_condition(status, "Issued") {
        if !same(status, old_status) {
            return Err("status: Invalid value: status is immutable unless transitioning to \"Issued\", \"Denied\", or \"Failed\"".into());
        }
        return Ok(());
    }
    let chain = text(status, "certificateChain");
    if chain.len() > pod_certificate::MAX_CERTIFICATE_CHAIN_SIZE {
        return Err("status.certificateChain: Too long".into());
    }
    let blocks = pem::parse_many(chain).map_err(|e| format!("status.certificateChain: {e}"))?;
    let Some(leaf_block) = blocks.first() else {
        return Err("status.certificateChain: Invalid value: issued certificate chain must contain at least one certificate".into());
    };
    for block in &blocks {
        if block.tag() != "CERTIFICATE" {
            return Err("status.certificateChain: Invalid value: issued certificate chain must consist entirely of CERTIFICATE PEM blocks".into());
        }
        X509Certificate::from_der(block.contents()).map_err(|_| {
            "status.certificateChain: Invalid value: certificate does not parse as valid X.509"
                .to_string()
        })?;
    }
    let (_, leaf) = X509Certificate::from_der(leaf_block.contents())
        .map_err(|_| "status.certificateChain: leaf certificate does not parse".to_string())?;
    let wanted = requested_spki(&old["spec"]).map_err(|e| format!("spec: {e}"))?;
    if leaf.public_key().raw != wanted.as_slice() {
        return Err("status.certificateChain: Invalid value: leaf certificate was not issued to the requested public key".into());
    }
    for field in ["notBefore", "notAfter", "beginRefreshAt"] {
        if status[field].is_null() {
            return Err(format!("status.{field}: Required value"));
        }
    }
    let not_before = parse_time(&status["notBefore"], "status.notBefore")?;
    let not_after = parse_time(&status["notAfter"], "status.notAfter")?;
    let refresh = parse_time(&status["beginRefreshAt"], "status.beginRefreshAt")?;
    let leaf_nb = leaf.validity().not_before.to_datetime();
    let leaf_na = leaf.validity().not_after.to_datetime();
    if not_before != leaf_nb {
        return Err("status.notBefore: Invalid value: must be set to the NotBefore time encoded in the leaf certificate".into());
    }
    let skew = time::Duration::minutes(5);
    if !(not_before > now - skew && not_before < now + skew) {
        return Err("status.notBefore: Invalid value: must be set to within 5 minutes of kube-apiserver's current time".into());
    }
    if not_after != leaf_na {
        return Err("status.notAfter: Invalid value: must be set to the NotAfter time encoded in the leaf certificate".into());
    }
    let lifetime = leaf_na - leaf_nb;
    if lifetime < time::Duration::hours(1) {
        return Err(
            "status.certificateChain: Invalid value: leaf certificate lifetime must be >= 1 hour"
                .into(),
        );
    }
    let max = old["spec"]["maxExpirationSeconds"]
        .as_i64()
        .unwrap_or_default();
    if lifetime > time::Duration::seconds(max) {
        return Err(format!("status.certificateChain: Invalid value: leaf certificate lifetime must be <= spec.maxExpirationSeconds ({max})"));
    }
    if refresh < not_before + time::Duration::minutes(10) {
        return Err("status.beginRefreshAt: Invalid value: must be at least 10 minutes after status.notBefore".into());
    }
    if refresh > not_after - time::Duration::minutes(10) {
        return Err("status.beginRefreshAt: Invalid value: must be at least 10 minutes before status.notAfter".into());
    }
    Ok(())
}

/// The API's `ValidateClusterTrustBundle` (and the update rules when `old`
/// is given).
pub(crate) fn cluster_trust_bundle(object: &Value, old: Option<&Value>) -> Result<(), String> {
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let signer = text(&object["spec"], "signerName");
    if signer.is_empty() {
        if name.contains(':') || !is_dns1123_subdomain(name) {
            return Err(format!("metadata.name: Invalid value: {name:?}: ClusterTrustBundle without signer name must not have \":\" in its name"));
        }
    } else {
        let prefix = trust_bundle_name_prefix(signer);
        match name.strip_prefix(&prefix) {
            Some(rest) if is_dns1123_subdomain(rest) => {}
            _ => {
                return Err(format!(
                "metadata.name: Invalid value: {name:?}: ClusterTrustBundle for signerName {signer} must be named with prefix {prefix}"
            ))
            }
        }
        validate_signer_name(signer).map_err(|e| format!("spec.signerName: {e}"))?;
    }
    if let Some(old) = old {
        if text(&old["spec"], "signerName") != signer {
            return Err("spec.signerName: Invalid value: field is immutable".into());
        }
        if old["spec"]["trustBundle"] == object["spec"]["trustBundle"] {
            return Ok(());
        }
    }
    let bundle = text(&object["spec"], "trustBundle");
    if bundle.len() > pod_certificate::MAX_TRUST_BUNDLE_SIZE {
        return Err("spec.trustBundle: Too long".into());
    }
    let blocks = pem::parse_many(bundle).map_err(|e| format!("spec.trustBundle: {e}"))?;
    let mut seen = std::collections::HashSet::new();
    for (i, block) in blocks.iter().enumerate() {
        if block.tag() != "CERTIFICATE" {
            return Err(format!("spec.trustBundle: entry {i} has bad block type"));
        }
        if block.headers().iter().next().is_some() {
            return Err(format!("spec.trustBundle: entry {i} has PEM block headers"));
        }
        let (_, cert) = X509Certificate::from_der(block.contents())
            .map_err(|_| format!("spec.trustBundle: entry {i} does not parse as X.509"))?;
        let is_ca = cert
            .basic_constraints()
            .ok()
            .flatten()
            .is_some_and(|bc| bc.value.ca);
        if !is_ca {
            return Err(format!(
                "spec.trustBundle: entry {i} does not have the CA bit set"
            ));
        }
        if !seen.insert(block.contents().to_vec()) {
            return Err(format!("spec.trustBundle: duplicate trust anchor ({i})"));
        }
    }
    if seen.is_empty() {
        return Err("spec.trustBundle: at least one trust anchor must be provided".into());
    }
    Ok(())
}

/// How a test's kubelet encodes the pod's key in a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyEncoding {
    /// Kubernetes 1.36+: `stubPKCS10Request`.
    StubCsr,
    /// Kubernetes 1.35: `pkixPublicKey` + `proofOfPossession`.
    ProofOfPossession,
}

/// An empty PKCS#10 request signed by `key` (what the kubelet sends), DER.
pub fn stub_csr_der(key: &PrivateKey) -> Vec<u8> {
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .serialize_request(key.key_pair())
        .expect("serializing a stub CSR")
        .der()
        .to_vec()
}

/// The kubelet's proof of possession: `key`'s signature over the pod UID
/// (ECDSA P-256 over SHA-256, Ed25519 over the bytes, RSA-PSS SHA-256 with
/// Go's default salt length). `None` for keys it cannot make one for here
/// (P-384 needs ECDSA over SHA-256 on P-384, which `ring` does not sign).
pub fn proof_of_possession(key: &PrivateKey, pod_uid: &str) -> Option<Vec<u8>> {
    use meshca_certs::KeyKind;
    match key.kind() {
        KeyKind::EcdsaP256 | KeyKind::Ed25519 => {
            rcgen::SigningKey::sign(key.key_pair(), pod_uid.as_bytes()).ok()
        }
        KeyKind::Rsa(bits) => {
            use rsa::pkcs8::DecodePrivateKey;
            use rsa::sha2::{Digest, Sha256};
            let private = rsa::RsaPrivateKey::from_pkcs8_der(&key.to_pkcs8_der()).ok()?;
            let salt = (bits - 1).div_ceil(8) - 2 - 32;
            private
                .sign_with_rng(
                    &mut rand_core::OsRng,
                    rsa::Pss::new_with_salt::<Sha256>(salt),
                    &Sha256::digest(pod_uid.as_bytes()),
                )
                .ok()
        }
        _ => None,
    }
}

/// A `PodCertificateRequest` as a kubelet creates it for a pod.
#[derive(Debug, Clone)]
pub struct PodRequest<'a> {
    /// Namespace.
    pub namespace: &'a str,
    /// Object name.
    pub name: &'a str,
    /// `spec.signerName`.
    pub signer: &'a str,
    /// The pod's name, UID, service account and node.
    pub pod: (&'a str, &'a str, &'a str, &'a str),
    /// `spec.maxExpirationSeconds` (`None`: left to the API's default).
    pub max_expiration_seconds: Option<i64>,
}

impl PodRequest<'_> {
    /// The JSON object, with `key` in `encoding`.
    pub fn to_json(&self, key: &PrivateKey, encoding: KeyEncoding) -> Value {
        use base64::Engine;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let (pod_name, pod_uid, service_account, node) = self.pod;
        let mut spec = serde_json::json!({
            "signerName": self.signer,
            "podName": pod_name,
            "podUID": pod_uid,
            "serviceAccountName": service_account,
            "serviceAccountUID": format!("sa-uid-{service_account}"),
            "nodeName": node,
            "nodeUID": format!("node-uid-{node}"),
        });
        if let Some(max) = self.max_expiration_seconds {
            spec["maxExpirationSeconds"] = serde_json::json!(max);
        }
        match encoding {
            KeyEncoding::StubCsr => {
                spec["stubPKCS10Request"] = serde_json::json!(b64(&stub_csr_der(key)));
            }
            KeyEncoding::ProofOfPossession => {
                spec["pkixPublicKey"] = serde_json::json!(b64(&key.public_key_spki_der()));
                let proof = proof_of_possession(key, pod_uid).expect("a proof for this key type");
                spec["proofOfPossession"] = serde_json::json!(b64(&proof));
            }
        }
        serde_json::json!({
            "apiVersion": "certificates.k8s.io/v1beta1",
            "kind": "PodCertificateRequest",
            "metadata": {"namespace": self.namespace, "name": self.name},
            "spec": spec,
        })
    }
}
