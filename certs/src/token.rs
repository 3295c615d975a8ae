//! Service-account tokens in the shape Kubernetes projects into pods, and the
//! local token issuer of meshca's embedded (no-cluster) mode.
//!
//! [`ServiceAccountClaims`] is the claim set of a Kubernetes projected
//! service-account token. [`TokenIssuer`] is an ES256 key in the data
//! directory that mints such tokens for development and tests
//! (`meshca-certs token`), and publishes its public key as a JWKS so the CA
//! can check them offline.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use serde::{Deserialize, Serialize};

use crate::bundle::{self, BundleError};
use crate::keys::{KeyAlgorithm, KeyError, KeyKind, PrivateKey};

/// File in the data directory holding the local issuer's private key.
pub const ISSUER_KEY_FILE: &str = "token-issuer-key.pem";
/// File in the data directory holding the local issuer's public JWKS.
pub const ISSUER_JWKS_FILE: &str = "token-issuer-jwks.json";
/// The `iss` of tokens minted by the local issuer.
pub(crate) const LOCAL_ISSUER: &str = "https://meshca.local/token-issuer";
/// Istio's default token audience.
pub const DEFAULT_AUDIENCE: &str = "istio-ca";

/// Errors of the token issuer.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The issuer key could not be read or written.
    #[error(transparent)]
    File(#[from] BundleError),
    /// The issuer key is not a usable ES256 key.
    #[error("token issuer key {path}: {cause}")]
    Key {
        /// The key file.
        path: String,
        /// What is wrong.
        cause: KeyError,
    },
    /// The issuer key is not P-256.
    #[error("token issuer key {path} is {kind}; the local issuer needs ECDSA P-256 (ES256)")]
    WrongKeyType {
        /// The key file.
        path: String,
        /// What it is.
        kind: KeyKind,
    },
    /// Signing the token failed.
    #[error("signing the token failed: {0}")]
    Sign(String),
}

/// `aud` may be one string or a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Audiences {
    /// A single audience.
    One(String),
    /// Several audiences.
    Many(Vec<String>),
}

/// Read by the JSON value's type (a string or a list), where serde's
/// `untagged` would buffer the value and build an error for the variant
/// that does not fit: with list audiences, as Kubernetes writes them, that
/// was a formatted error message per token checked.
impl<'de> Deserialize<'de> for Audiences {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct AudiencesVisitor;

        impl<'de> serde::de::Visitor<'de> for AudiencesVisitor {
            type Value = Audiences;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or a list of strings")
            }

            fn visit_str<E: serde::de::Error>(self, one: &str) -> Result<Audiences, E> {
                Ok(Audiences::One(one.to_owned()))
            }

            fn visit_string<E: serde::de::Error>(self, one: String) -> Result<Audiences, E> {
                Ok(Audiences::One(one))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Audiences, A::Error> {
                let mut many = Vec::with_capacity(seq.size_hint().unwrap_or(1).min(16));
                while let Some(aud) = seq.next_element::<String>()? {
                    many.push(aud);
                }
                Ok(Audiences::Many(many))
            }
        }

        deserializer.deserialize_any(AudiencesVisitor)
    }
}

impl Audiences {
    /// Whether `aud` is among them.
    pub fn contains(&self, aud: &str) -> bool {
        match self {
            Self::One(a) => a == aud,
            Self::Many(list) => list.iter().any(|a| a == aud),
        }
    }
}

/// A name and UID, as in the `kubernetes.io` claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ObjectRef {
    /// Object name.
    pub name: String,
    /// Object UID.
    #[serde(default)]
    pub uid: String,
}

/// The `kubernetes.io` claim of a projected token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct KubernetesClaim {
    /// The service account's namespace.
    pub namespace: String,
    /// The service account.
    pub serviceaccount: ObjectRef,
    /// The pod the token is bound to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<ObjectRef>,
    /// The node the pod runs on (Kubernetes 1.30+), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<ObjectRef>,
}

/// Claims of a Kubernetes projected service-account token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceAccountClaims {
    /// Issuer.
    pub iss: String,
    /// Subject: `system:serviceaccount:<ns>:<sa>`.
    pub sub: String,
    /// Audiences.
    pub aud: Audiences,
    /// Expiry, seconds since the epoch.
    pub exp: u64,
    /// Issued at.
    #[serde(default)]
    pub iat: u64,
    /// Not before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    /// The Kubernetes claim.
    #[serde(
        rename = "kubernetes.io",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub kubernetes: Option<KubernetesClaim>,
}

/// The prefix of a service account's username and token subject.
pub(crate) const SERVICE_ACCOUNT_USER_PREFIX: &str = "system:serviceaccount:";

impl ServiceAccountClaims {
    /// The namespace and service account the token is for: from the
    /// `kubernetes.io` claim, else from `sub`.
    pub fn service_account(&self) -> Option<(&str, &str)> {
        if let Some(k) = &self.kubernetes {
            if !k.namespace.is_empty() && !k.serviceaccount.name.is_empty() {
                return Some((&k.namespace, &k.serviceaccount.name));
            }
        }
        parse_service_account_username(&self.sub)
    }
}

/// Splits `system:serviceaccount:<ns>:<sa>` into its namespace and name.
pub fn parse_service_account_username(username: &str) -> Option<(&str, &str)> {
    let rest = username.strip_prefix(SERVICE_ACCOUNT_USER_PREFIX)?;
    let (ns, sa) = rest.split_once(':')?;
    if ns.is_empty() || sa.is_empty() || sa.contains(':') {
        return None;
    }
    Some((ns, sa))
}

/// What to put in a minted token.
#[derive(Debug, Clone)]
pub struct TokenRequest {
    /// Namespace.
    pub namespace: String,
    /// Service account.
    pub service_account: String,
    /// Audiences.
    pub audiences: Vec<String>,
    /// Lifetime.
    pub ttl: Duration,
    /// Pod name and UID to bind, if any.
    pub pod: Option<ObjectRef>,
}

/// The local ES256 token issuer.
pub struct TokenIssuer {
    key: PrivateKey,
    kid: String,
    issuer: String,
}

impl std::fmt::Debug for TokenIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenIssuer")
            .field("kid", &self.kid)
            .field("issuer", &self.issuer)
            .finish_non_exhaustive()
    }
}

impl TokenIssuer {
    /// A new issuer with a fresh P-256 key.
    pub fn generate() -> Result<Self, KeyError> {
        Self::from_key(PrivateKey::generate(KeyAlgorithm::EcdsaP256)?)
    }

    fn from_key(key: PrivateKey) -> Result<Self, KeyError> {
        let kid = key_id(&key.public_key_spki_der());
        Ok(Self {
            key,
            kid,
            issuer: LOCAL_ISSUER.to_string(),
        })
    }

    /// The same key under another issuer name (`iss`), e.g. to stand in
    /// for an external issuer validated with `--jwks` in tests.
    pub fn with_issuer(mut self, issuer: impl Into<String>) -> Self {
        self.issuer = issuer.into();
        self
    }

    /// Loads the issuer from `<data_dir>/token-issuer-key.pem`.
    pub fn load(data_dir: &Path) -> Result<Self, TokenError> {
        let path = data_dir.join(ISSUER_KEY_FILE);
        let text = bundle::read_text(&path)?;
        let key = PrivateKey::from_pem(&text).map_err(|cause| TokenError::Key {
            path: path.display().to_string(),
            cause,
        })?;
        if key.kind() != KeyKind::EcdsaP256 {
            return Err(TokenError::WrongKeyType {
                path: path.display().to_string(),
                kind: key.kind(),
            });
        }
        Self::from_key(key).map_err(|cause| TokenError::Key {
            path: path.display().to_string(),
            cause,
        })
    }

    /// Writes the key (0600) and the JWKS into `data_dir`.
    pub fn save(&self, data_dir: &Path) -> Result<(), TokenError> {
        bundle::write_file_atomic(
            &data_dir.join(ISSUER_KEY_FILE),
            self.key.to_pkcs8_pem().as_bytes(),
            bundle::PRIVATE_KEY_MODE,
        )?;
        bundle::write_file_atomic(
            &data_dir.join(ISSUER_JWKS_FILE),
            self.jwks_json().as_bytes(),
            bundle::PUBLIC_FILE_MODE,
        )?;
        Ok(())
    }

    /// The issuer name (`iss`).
    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// The key ID (`kid`): base64url SHA-256 of the public key, as Kubernetes does.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// The public key as a JWKS document.
    pub fn jwks_json(&self) -> String {
        let spki = self.key.public_key_spki_der();
        // The last 65 bytes of a P-256 SPKI are the uncompressed point 04||X||Y.
        let point = &spki[spki.len().saturating_sub(65)..];
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let (x, y) = if point.len() == 65 {
            (b64.encode(&point[1..33]), b64.encode(&point[33..65]))
        } else {
            (String::new(), String::new())
        };
        serde_json::json!({
            "keys": [{
                "kty": "EC",
                "crv": "P-256",
                "alg": "ES256",
                "use": "sig",
                "kid": self.kid,
                "x": x,
                "y": y,
            }]
        })
        .to_string()
    }

    /// Mints a token.
    pub fn mint(&self, request: &TokenRequest, now: SystemTime) -> Result<String, TokenError> {
        let iat = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        let claims = ServiceAccountClaims {
            iss: self.issuer.clone(),
            sub: format!(
                "{SERVICE_ACCOUNT_USER_PREFIX}{}:{}",
                request.namespace, request.service_account
            ),
            aud: Audiences::Many(request.audiences.clone()),
            exp: iat + request.ttl.as_secs(),
            iat,
            nbf: Some(iat),
            kubernetes: Some(KubernetesClaim {
                namespace: request.namespace.clone(),
                serviceaccount: ObjectRef {
                    name: request.service_account.clone(),
                    uid: String::new(),
                },
                pod: request.pod.clone(),
                node: None,
            }),
        };
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
        header.kid = Some(self.kid.clone());
        let key = jsonwebtoken::EncodingKey::from_ec_der(&self.key.to_pkcs8_der());
        jsonwebtoken::encode(&header, &claims, &key).map_err(|e| TokenError::Sign(e.to_string()))
    }
}

fn key_id(spki_der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, spki_der);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(digest.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audiences_are_one_string_or_a_list_of_strings() {
        let one: Audiences = serde_json::from_str(r#""istio-ca""#).unwrap();
        assert_eq!(one, Audiences::One("istio-ca".into()));
        let escaped: Audiences = serde_json::from_str(r#""istio\u002dca""#).unwrap();
        assert_eq!(escaped, Audiences::One("istio-ca".into()));
        let many: Audiences = serde_json::from_str(r#"["api", "istio-ca"]"#).unwrap();
        assert_eq!(many, Audiences::Many(vec!["api".into(), "istio-ca".into()]));
        assert!(many.contains("istio-ca") && !many.contains("other"));
        let none: Audiences = serde_json::from_str("[]").unwrap();
        assert_eq!(none, Audiences::Many(vec![]));
        // Written back as read.
        assert_eq!(
            serde_json::to_string(&many).unwrap(),
            r#"["api","istio-ca"]"#
        );
        assert_eq!(serde_json::to_string(&one).unwrap(), r#""istio-ca""#);
        for bad in ["42", "[1]", "{}", "null", r#"["a", null]"#] {
            let err = serde_json::from_str::<Audiences>(bad).unwrap_err();
            assert!(err.to_string().contains("string"), "{bad}: {err}");
        }
    }

    #[test]
    fn minted_tokens_verify_against_the_jwks() {
        let issuer = TokenIssuer::generate().unwrap();
        let token = issuer
            .mint(
                &TokenRequest {
                    namespace: "default".into(),
                    service_account: "web".into(),
                    audiences: vec![DEFAULT_AUDIENCE.into()],
                    ttl: Duration::from_secs(600),
                    pod: None,
                },
                SystemTime::now(),
            )
            .unwrap();
        let jwks: jsonwebtoken::jwk::JwkSet = serde_json::from_str(&issuer.jwks_json()).unwrap();
        let key = jsonwebtoken::DecodingKey::from_jwk(&jwks.keys[0]).unwrap();
        let mut validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::ES256);
        validation.set_audience(&[DEFAULT_AUDIENCE]);
        validation.set_issuer(&[LOCAL_ISSUER]);
        let data = jsonwebtoken::decode::<ServiceAccountClaims>(&token, &key, &validation).unwrap();
        assert_eq!(data.claims.service_account(), Some(("default", "web")));
        assert_eq!(data.header.kid.as_deref(), Some(issuer.kid()));
    }

    #[test]
    fn save_and_load() {
        let dir = tempfile::tempdir().unwrap();
        let issuer = TokenIssuer::generate().unwrap();
        issuer.save(dir.path()).unwrap();
        let loaded = TokenIssuer::load(dir.path()).unwrap();
        assert_eq!(loaded.kid(), issuer.kid());
    }

    #[test]
    fn usernames() {
        assert_eq!(
            parse_service_account_username("system:serviceaccount:ns:sa"),
            Some(("ns", "sa"))
        );
        assert_eq!(
            parse_service_account_username("system:serviceaccount:ns"),
            None
        );
        assert_eq!(
            parse_service_account_username("system:serviceaccount::sa"),
            None
        );
        assert_eq!(parse_service_account_username("admin"), None);
    }
}
