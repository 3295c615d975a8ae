//! kube-apiserver's own validation of `certificates.k8s.io/v1beta1`
//! `PodCertificateRequest`s (at creation, and on the `status`
//! subresource) and `ClusterTrustBundle`s, for the fake API server: a
//! status the real API server would refuse is refused here too (422
//! Invalid), so the end-to-end tests catch it. Also the pieces a test
//! needs to make requests the way a kubelet does.
//!
//! One knowing gap: a P-521 key is accepted at creation without checking
//! its signature (`ring` has no P-521), where the real API server checks it.
//!
//! The name rules (signer names, DNS-1123 names) are written here on their
//! own, from the API's source, not taken from meshca: a difference between
//! meshca's start-time check and the API then shows in a test.

use meshca_certs::pod_certificate::{
    self, is_kubernetes_signer, read_pod_key, trust_bundle_name_prefix, PodKeyError, PodKeyKind,
};
use meshca_certs::{KeyKind, PrivateKey};
use serde_json::Value;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, X509Certificate};

const TERMINAL: [&str; 3] = ["Issued", "Denied", "Failed"];

/// One piece of a DNS-1123 name: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
fn api_name_piece(piece: &str) -> bool {
    let mut chars = piece.chars();
    let alnum = |c: char| c.is_ascii_digit() || c.is_ascii_lowercase();
    match (chars.next(), chars.next_back()) {
        (None, _) => false,
        (Some(only), None) => alnum(only),
        (Some(first), Some(last)) => {
            alnum(first) && alnum(last) && chars.all(|c| alnum(c) || c == '-')
        }
    }
}

/// The API's `IsDNS1123Label`: one piece, at most 63 characters.
fn api_label(label: &str) -> bool {
    label.len() <= 63 && api_name_piece(label)
}

/// The API's `IsDNS1123Subdomain`: pieces separated by dots, at most 253
/// characters in all (no limit per piece).
fn api_subdomain(name: &str) -> bool {
    name.len() <= 253 && name.split('.').all(api_name_piece)
}

/// The API's `ValidateSignerName` (certificates validation): one `/`; the
/// domain at most 253 characters of DNS-1123 labels with at least one
/// dot; the path's dot-separated pieces DNS-1123 subdomains; the whole
/// name at most 253 + 1 + 253 + 63 + 1 characters.
pub(crate) fn api_signer_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("Required value".into());
    }
    let segments: Vec<&str> = name.split('/').collect();
    let [domain, path] = segments.as_slice() else {
        return Err(format!(
            "Invalid value: {name:?}: must be a fully qualified domain and path of the form 'example.com/signer-name'"
        ));
    };
    let mut errors = Vec::new();
    if domain.len() > 253 {
        errors.push("Too long: may not be more than 253 bytes".to_string());
    }
    let labels: Vec<&str> = domain.split('.').collect();
    if let Some(label) = labels.iter().find(|l| !api_label(l)) {
        errors.push(format!(
            "Invalid value: {domain:?}: validating label {label:?}: a lowercase RFC 1123 label"
        ));
    }
    if labels.len() < 2 {
        errors.push(format!(
            "Invalid value: {domain:?}: should be a domain with at least two segments separated by dots"
        ));
    }
    if let Some(piece) = path.split('.').find(|p| !api_subdomain(p)) {
        errors.push(format!(
            "Invalid value: {path:?}: validating label {piece:?}: a lowercase RFC 1123 subdomain"
        ));
    }
    let max = 253 + (253 + 63 + 1) + 1;
    if name.len() > max {
        errors.push(format!("Too long: may not be more than {max} bytes"));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

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
    if !api_subdomain(name) {
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
    api_signer_name(signer).map_err(|e| format!("spec.signerName: {e}"))?;
    if let Some(annotations) = spec["unverifiedUserAnnotations"].as_object() {
        for key in annotations.keys() {
            let ok = key
                .split_once('/')
                .is_some_and(|(prefix, rest)| api_subdomain(prefix) && !rest.is_empty());
            if !ok {
                return Err(format!(
                    "spec.unverifiedUserAnnotations: Invalid value: {key:?}: keys must be domain-prefixed"
                ));
            }
        }
    }
    for field in ["podName", "serviceAccountName", "nodeName"] {
        if !api_subdomain(text(spec, field)) {
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
        // kube-apiserver's own words (pkg/apis/certificates/validation).
        Err(PodKeyError::UnsupportedKeyType { kind, .. }) => {
            let field = if stub.is_empty() {
                "spec.pkixPublicKey"
            } else {
                "spec.stubPKCS10Request"
            };
            Err(match kind {
                PodKeyKind::Known(KeyKind::Rsa(bits)) => format!(
                    "{field}: Invalid value: \"{bits}-bit modulus\": RSA keys must have modulus size 3072 or 4096"
                ),
                PodKeyKind::Known(KeyKind::EcdsaOther) => format!(
                    "{field}: Invalid value: {kind}: elliptic public keys must use curve P256, P384, or P521"
                ),
                _ => format!(
                    "{field}: Invalid value: {kind}: unknown public key type; supported types are Ed25519, ECDSA, and RSA"
                ),
            })
        }
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
        if name.contains(':') || !api_subdomain(name) {
            return Err(format!("metadata.name: Invalid value: {name:?}: ClusterTrustBundle without signer name must not have \":\" in its name"));
        }
    } else {
        let prefix = trust_bundle_name_prefix(signer);
        match name.strip_prefix(&prefix) {
            Some(rest) if api_subdomain(rest) => {}
            _ => {
                return Err(format!(
                "metadata.name: Invalid value: {name:?}: ClusterTrustBundle for signerName {signer} must be named with prefix {prefix}"
            ))
            }
        }
        api_signer_name(signer).map_err(|e| format!("spec.signerName: {e}"))?;
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
/// (ECDSA over SHA-256 on either curve, as Go's `ecdsa.SignASN1` over
/// `sha256.Sum256(uid)`; Ed25519 over the bytes; RSA-PSS SHA-256 with
/// Go's default salt length). `None` for other key types.
pub fn proof_of_possession(key: &PrivateKey, pod_uid: &str) -> Option<Vec<u8>> {
    use meshca_certs::KeyKind;
    match key.kind() {
        KeyKind::EcdsaP256 | KeyKind::Ed25519 => {
            rcgen::SigningKey::sign(key.key_pair(), pod_uid.as_bytes()).ok()
        }
        KeyKind::EcdsaP384 => {
            // ring signs P-384 only over SHA-384: RustCrypto signs the
            // SHA-256 digest the API verifies.
            use p384::ecdsa::signature::hazmat::PrehashSigner;
            use p384::pkcs8::DecodePrivateKey;
            use rsa::sha2::{Digest, Sha256};
            let signing = p384::ecdsa::SigningKey::from_pkcs8_der(&key.to_pkcs8_der()).ok()?;
            let signature: p384::ecdsa::Signature = signing
                .sign_prehash(&Sha256::digest(pod_uid.as_bytes()))
                .ok()?;
            Some(signature.to_der().as_bytes().to_vec())
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

/// The kubelet's RSA proof of possession: RSA-PSS SHA-256 over the pod UID
/// with Go's default salt length.
pub fn rsa_pss_proof(key: &rsa::RsaPrivateKey, pod_uid: &str) -> Vec<u8> {
    use rsa::sha2::{Digest, Sha256};
    use rsa::traits::PublicKeyParts;
    let salt = (key.n().bits() - 1).div_ceil(8) - 2 - 32;
    key.sign_with_rng(
        &mut rand_core::OsRng,
        rsa::Pss::new_with_salt::<Sha256>(salt),
        &Sha256::digest(pod_uid.as_bytes()),
    )
    .expect("RSA-PSS signature")
}

#[cfg(test)]
mod tests {
    //! The fake's validators, one rule broken at a time: each is refused
    //! with the API's own wording, and the valid object is accepted (so a
    //! validator that refused everything would fail too).

    use super::*;
    use meshca_certs::profile::{self_signed_root, SigningCa, SubjectKey, SubjectName, Validity};
    use meshca_certs::{KeyAlgorithm, SpiffeId};

    fn key() -> PrivateKey {
        PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap()
    }

    fn ca() -> (SigningCa, String) {
        let key = key();
        let root = self_signed_root(
            &key,
            &SubjectName {
                common_name: Some("fake-certificates-test".into()),
                ..Default::default()
            },
            Validity::backdated(OffsetDateTime::now_utc(), time::Duration::days(1)),
        )
        .unwrap();
        let pem = root.to_pem();
        (SigningCa::new(root.der, key).unwrap(), pem)
    }

    /// A request as stored after creation (defaults applied).
    fn created(key: &PrivateKey) -> Value {
        let mut object = PodRequest {
            namespace: "default",
            name: "req",
            signer: "meshca.io/spiffe",
            pod: ("pod", "uid-1", "web", "node-a"),
            max_expiration_seconds: None,
        }
        .to_json(key, KeyEncoding::StubCsr);
        create_pod_certificate_request(&mut object).unwrap();
        object
    }

    fn rfc3339(t: OffsetDateTime) -> Value {
        serde_json::json!(t.format(&Rfc3339).unwrap())
    }

    fn condition(kind: &str, now: OffsetDateTime) -> Value {
        serde_json::json!({
            "type": kind, "status": "True", "reason": kind, "message": "",
            "lastTransitionTime": rfc3339(now),
        })
    }

    /// An Issued status for `key`, valid from `nb` to `na`, refreshing at
    /// `refresh`.
    fn issued(
        ca: &SigningCa,
        key: &PrivateKey,
        nb: OffsetDateTime,
        na: OffsetDateTime,
        refresh: OffsetDateTime,
    ) -> Value {
        let leaf = ca
            .issue_workload(
                &SubjectKey::of(key).unwrap(),
                &SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap(),
                Validity {
                    not_before: nb,
                    not_after: na,
                },
            )
            .unwrap();
        serde_json::json!({
            "certificateChain": meshca_certs::bundle::encode_cert_pem(&leaf.der),
            "notBefore": rfc3339(nb),
            "notAfter": rfc3339(na),
            "beginRefreshAt": rfc3339(refresh),
            "conditions": [condition("Issued", nb)],
        })
    }

    fn with_status(old: &Value, status: Value) -> Value {
        let mut new = old.clone();
        new["status"] = status;
        new
    }

    fn now() -> OffsetDateTime {
        let t = OffsetDateTime::now_utc();
        t.replace_nanosecond(0).unwrap()
    }

    #[track_caller]
    fn refused(result: Result<(), String>, wording: &str) {
        match result {
            Ok(()) => panic!("accepted; wanted {wording:?}"),
            Err(e) => assert!(e.contains(wording), "{e:?} does not say {wording:?}"),
        }
    }

    #[test]
    fn an_issued_status_breaking_one_rule_is_refused() {
        let (ca, _) = ca();
        let key = key();
        let old = created(&key);
        let now = now();
        let nb = now - time::Duration::minutes(2);
        let day = time::Duration::days(1);
        let status = |nb, na, refresh| with_status(&old, issued(&ca, &key, nb, na, refresh));
        let check = |new: &Value| pod_certificate_request_status(new, &old, now);

        check(&status(nb, nb + day, nb + day / 2)).unwrap();
        refused(
            check(&status(
                nb,
                nb + time::Duration::minutes(59),
                nb + time::Duration::minutes(20),
            )),
            "lifetime must be >= 1 hour",
        );
        refused(
            check(&status(
                nb,
                nb + day + time::Duration::seconds(1),
                nb + day / 2,
            )),
            "must be <= spec.maxExpirationSeconds (86400)",
        );
        let early = now - time::Duration::minutes(6);
        refused(
            check(&status(early, early + day, early + day / 2)),
            "within 5 minutes of kube-apiserver's current time",
        );
        let late = now + time::Duration::minutes(6);
        refused(
            check(&status(late, late + day, late + day / 2)),
            "within 5 minutes of kube-apiserver's current time",
        );
        refused(
            check(&status(nb, nb + day, nb + time::Duration::minutes(9))),
            "at least 10 minutes after status.notBefore",
        );
        refused(
            check(&status(nb, nb + day, nb + day - time::Duration::minutes(9))),
            "at least 10 minutes before status.notAfter",
        );
        let mut other_nb = status(nb, nb + day, nb + day / 2);
        other_nb["status"]["notBefore"] = rfc3339(nb + time::Duration::seconds(1));
        refused(check(&other_nb), "NotBefore time encoded in the leaf");
        let mut other_na = status(nb, nb + day, nb + day / 2);
        other_na["status"]["notAfter"] = rfc3339(nb + day - time::Duration::seconds(1));
        refused(check(&other_na), "NotAfter time encoded in the leaf");
        // Issued to another key than the request's.
        let other_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let to_other = with_status(&old, issued(&ca, &other_key, nb, nb + day, nb + day / 2));
        refused(check(&to_other), "not issued to the requested public key");
        // Not a certificate in the chain.
        let mut garbage = status(nb, nb + day, nb + day / 2);
        garbage["status"]["certificateChain"] =
            serde_json::json!("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
        refused(check(&garbage), "does not parse as valid X.509");
        let mut not_certificate = status(nb, nb + day, nb + day / 2);
        not_certificate["status"]["certificateChain"] = serde_json::json!(format!(
            "{}-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
            not_certificate["status"]["certificateChain"]
                .as_str()
                .unwrap()
        ));
        refused(
            check(&not_certificate),
            "must consist entirely of CERTIFICATE PEM blocks",
        );
        let mut no_refresh = status(nb, nb + day, nb + day / 2);
        no_refresh["status"]
            .as_object_mut()
            .unwrap()
            .remove("beginRefreshAt");
        refused(check(&no_refresh), "status.beginRefreshAt: Required value");
    }

    #[test]
    fn conditions_follow_the_api_rules() {
        let key = key();
        let old = created(&key);
        let now = now();
        let check =
            |status: Value| pod_certificate_request_status(&with_status(&old, status), &old, now);
        check(serde_json::json!({"conditions": [condition("Denied", now)]})).unwrap();
        check(serde_json::json!({"conditions": [condition("Failed", now)]})).unwrap();
        refused(
            check(
                serde_json::json!({"conditions": [condition("Denied", now), condition("Failed", now)]}),
            ),
            "at most one condition",
        );
        refused(
            check(serde_json::json!({"conditions": [condition("Approved", now)]})),
            "Unsupported value: \"Approved\"",
        );
        let mut not_true = condition("Denied", now);
        not_true["status"] = serde_json::json!("False");
        refused(
            check(serde_json::json!({"conditions": [not_true]})),
            "status: Unsupported value",
        );
        let mut bad_reason = condition("Denied", now);
        bad_reason["reason"] = serde_json::json!("not a reason!");
        refused(
            check(serde_json::json!({"conditions": [bad_reason]})),
            "a condition reason must start with alphabetic character",
        );
        let mut no_time = condition("Denied", now);
        no_time["lastTransitionTime"] = serde_json::json!("");
        refused(
            check(serde_json::json!({"conditions": [no_time]})),
            "lastTransitionTime: Required value",
        );
        // Denied or Failed carry the condition only.
        refused(
            check(serde_json::json!({
                "conditions": [condition("Denied", now)],
                "notBefore": rfc3339(now),
            })),
            "non-condition status fields must be empty when denying or failing",
        );
        // No terminal condition: nothing else may change.
        refused(
            check(serde_json::json!({"notBefore": rfc3339(now)})),
            "status is immutable unless transitioning",
        );
    }

    #[test]
    fn an_answered_request_is_never_answered_again() {
        let key = key();
        let now = now();
        let old = with_status(
            &created(&key),
            serde_json::json!({"conditions": [condition("Denied", now)]}),
        );
        let again = with_status(
            &old,
            serde_json::json!({"conditions": [condition("Failed", now)]}),
        );
        refused(
            pod_certificate_request_status(&again, &old, now),
            "immutable after PodCertificateRequest is issued, denied, or failed",
        );
        // The same status written again is no change.
        pod_certificate_request_status(&old, &old, now).unwrap();
    }

    #[test]
    fn a_request_breaking_one_creation_rule_is_refused() {
        let key = key();
        let base = || {
            PodRequest {
                namespace: "default",
                name: "req",
                signer: "meshca.io/spiffe",
                pod: ("pod", "uid-1", "web", "node-a"),
                max_expiration_seconds: None,
            }
            .to_json(&key, KeyEncoding::StubCsr)
        };
        let mut ok = base();
        create_pod_certificate_request(&mut ok).unwrap();
        assert_eq!(
            ok["spec"]["maxExpirationSeconds"], 86400,
            "defaulted to 24 hours"
        );
        let broken = |edit: &dyn Fn(&mut Value)| {
            let mut object = base();
            edit(&mut object);
            create_pod_certificate_request(&mut object)
        };
        refused(
            broken(&|o| o["spec"]["signerName"] = serde_json::json!("spiffe")),
            "spec.signerName",
        );
        refused(
            broken(&|o| o["spec"]["maxExpirationSeconds"] = serde_json::json!(3599)),
            "must be in the range [3600, 7862400]",
        );
        refused(
            broken(&|o| {
                o["spec"]["signerName"] = serde_json::json!("kubernetes.io/pods");
                o["spec"]["maxExpirationSeconds"] = serde_json::json!(86401);
            }),
            "must be in the range [3600, 86400]",
        );
        refused(
            broken(&|o| o["spec"]["podUID"] = serde_json::json!("")),
            "spec.podUID: Invalid value: must not be empty",
        );
        refused(
            broken(&|o| o["spec"]["nodeName"] = serde_json::json!("Node_A")),
            "spec.nodeName",
        );
        refused(
            broken(&|o| o["spec"]["unverifiedUserAnnotations"] = serde_json::json!({"role": "db"})),
            "keys must be domain-prefixed",
        );
        let proof_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        refused(
            broken(&|o| {
                let other = PodRequest {
                    namespace: "default",
                    name: "req",
                    signer: "meshca.io/spiffe",
                    pod: ("pod", "uid-2", "web", "node-a"),
                    max_expiration_seconds: None,
                }
                .to_json(&proof_key, KeyEncoding::ProofOfPossession);
                o["spec"]["stubPKCS10Request"] = Value::Null;
                o["spec"]["pkixPublicKey"] = other["spec"]["pkixPublicKey"].clone();
                o["spec"]["proofOfPossession"] = other["spec"]["proofOfPossession"].clone();
            }),
            "could not verify proof-of-possession signature",
        );
        let rsa2048 = PrivateKey::generate(KeyAlgorithm::Rsa2048).unwrap();
        refused(
            broken(&|o| {
                o["spec"]["stubPKCS10Request"] =
                    serde_json::json!(base64_of(&stub_csr_der(&rsa2048)))
            }),
            "RSA keys must have modulus size 3072 or 4096",
        );
    }

    fn base64_of(bytes: &[u8]) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    #[test]
    fn a_cluster_trust_bundle_breaking_one_rule_is_refused() {
        let (ca, root_pem) = ca();
        let bundle = |name: &str, roots: &str| {
            serde_json::json!({
                "metadata": {"name": name},
                "spec": {"signerName": "meshca.io/spiffe", "trustBundle": roots},
            })
        };
        let good = bundle("meshca.io:spiffe:trust-bundle", &root_pem);
        cluster_trust_bundle(&good, None).unwrap();
        refused(
            cluster_trust_bundle(&bundle("trust-bundle", &root_pem), None),
            "must be named with prefix meshca.io:spiffe:",
        );
        refused(
            cluster_trust_bundle(
                &bundle(
                    "meshca.io:spiffe:trust-bundle",
                    &format!("{root_pem}{root_pem}"),
                ),
                None,
            ),
            "duplicate trust anchor",
        );
        let leaf_key = key();
        let leaf = ca
            .issue_server(
                &SubjectKey::of(&leaf_key).unwrap(),
                &["example.com".into()],
                &[],
                Validity::backdated(OffsetDateTime::now_utc(), time::Duration::hours(1)),
            )
            .unwrap();
        refused(
            cluster_trust_bundle(
                &bundle(
                    "meshca.io:spiffe:trust-bundle",
                    &meshca_certs::bundle::encode_cert_pem(&leaf.der),
                ),
                None,
            ),
            "does not have the CA bit set",
        );
        refused(
            cluster_trust_bundle(&bundle("meshca.io:spiffe:trust-bundle", ""), None),
            "at least one trust anchor",
        );
        let mut moved = good.clone();
        moved["spec"]["signerName"] = serde_json::json!("meshca.io/other");
        moved["metadata"]["name"] = serde_json::json!("meshca.io:other:trust-bundle");
        refused(
            cluster_trust_bundle(&moved, Some(&good)),
            "spec.signerName: Invalid value: field is immutable",
        );
        let mut no_signer = good.clone();
        no_signer["spec"]["signerName"] = Value::Null;
        refused(
            cluster_trust_bundle(&no_signer, None),
            "without signer name must not have \":\"",
        );
    }

    #[test]
    fn signer_names_are_checked_as_the_api_does_and_as_meshca_does() {
        let domain = format!(
            "{}.{}.{}.example.com",
            "d".repeat(63),
            "e".repeat(63),
            "f".repeat(63)
        );
        let longest = format!("{domain}/{}.{}", "p".repeat(253), "q".repeat(113));
        assert_eq!(longest.len(), 571);
        let accepted = [
            "meshca.io/spiffe".to_string(),
            "example.com/a.b".to_string(),
            format!("example.com/ns.{}", "a".repeat(200)),
            format!("example.com/{}", "a".repeat(253)),
            longest.clone(),
        ];
        let refused_names = [
            String::new(),
            "spiffe".into(),
            "meshca/spiffe".into(),
            "meshca.io/".into(),
            "meshca.io/a/b".into(),
            "Meshca.io/spiffe".into(),
            "meshca.io/-x".into(),
            "meshca.io/a..b".into(),
            format!("{}.io/x", "a".repeat(64)),
            format!("example.com/{}", "a".repeat(254)),
            format!("{longest}q"),
        ];
        for name in &accepted {
            assert!(api_signer_name(name).is_ok(), "the API accepts {name:?}");
        }
        for name in &refused_names {
            assert!(api_signer_name(name).is_err(), "the API refuses {name:?}");
        }
        // meshca's start-time check agrees with the API on every one.
        for name in accepted.iter().chain(&refused_names) {
            assert_eq!(
                meshca_certs::pod_certificate::validate_signer_name(name).is_ok(),
                api_signer_name(name).is_ok(),
                "{name:?}"
            );
        }
    }
}
