//! The JWT-SVID keys in a cluster: the Secret [`SECRET_NAME`] in meshca's
//! namespace (key [`SECRET_KEY`], the data directory file's JSON), so that
//! every replica signs with the same key.
//!
//! No leader is needed: every replica runs the same rotation
//! ([`super::keys::plan`]) on what the Secret holds and writes a change
//! with the `resourceVersion` it read, so when two replicas make the next
//! key at once, one write wins and the other replica adopts the winner's
//! keys at its next read (the create at first start races the same way:
//! `AlreadyExists`, then read). Replicas read the Secret at least every
//! bundle refresh interval, so a key one of them made is published by all
//! within a quarter of its announcement.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{Api, ObjectMeta, PostParams};

use super::keys::{self, JwtKeyError, KeyRecord};

/// The Secret of the JWT-SVID keys.
pub(crate) const SECRET_NAME: &str = "meshca-jwt-svid-keys";
/// Its data key.
pub(crate) const SECRET_KEY: &str = keys::KEYS_FILE;

/// The keys' Secret in meshca's namespace.
#[derive(Clone)]
pub(crate) struct SecretStore {
    api: Api<Secret>,
    namespace: String,
}

impl std::fmt::Debug for SecretStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretStore")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    /// The keys are stored.
    Stored,
    /// Another replica wrote first (`AlreadyExists`, `Conflict`): read again.
    Lost,
}

impl SecretStore {
    /// The Secret in `namespace`.
    pub(crate) fn new(client: kube::Client, namespace: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
        }
    }

    fn error(&self, action: &'static str, cause: impl std::fmt::Display) -> JwtKeyError {
        JwtKeyError::Secret {
            action,
            namespace: self.namespace.clone(),
            name: SECRET_NAME,
            cause: cause.to_string(),
        }
    }

    /// The keys and the `resourceVersion` they were read at; `None` when
    /// there is no Secret yet.
    pub(crate) async fn read(&self) -> Result<Option<(Vec<KeyRecord>, String)>, JwtKeyError> {
        let Some(secret) = self
            .api
            .get_opt(SECRET_NAME)
            .await
            .map_err(|e| self.error("reading", e))?
        else {
            return Ok(None);
        };
        let version = secret.metadata.resource_version.clone().unwrap_or_default();
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(SECRET_KEY))
            .map(|b| b.0.as_slice())
            .ok_or_else(|| self.error("reading", format!("it has no key {SECRET_KEY}")))?;
        let keys = keys::parse(bytes).map_err(|reason| self.error("reading", reason))?;
        Ok(Some((keys, version)))
    }

    fn secret(&self, keys: &[KeyRecord], version: Option<String>) -> Result<Secret, JwtKeyError> {
        Ok(Secret {
            metadata: ObjectMeta {
                name: Some(SECRET_NAME.to_string()),
                namespace: Some(self.namespace.clone()),
                resource_version: version,
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_string(),
                    "meshca".to_string(),
                )])),
                ..Default::default()
            },
            type_: Some("Opaque".into()),
            data: Some(BTreeMap::from([(
                SECRET_KEY.to_string(),
                ByteString(keys::encode(keys)?),
            )])),
            ..Default::default()
        })
    }

    /// Creates the Secret with `keys`, unless another replica did first.
    pub(crate) async fn create(&self, keys: &[KeyRecord]) -> Result<Written, JwtKeyError> {
        let secret = self.secret(keys, None)?;
        match self.api.create(&PostParams::default(), &secret).await {
            Ok(_) => Ok(Written::Stored),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(Written::Lost),
            Err(e) => Err(self.error("creating", e)),
        }
    }

    /// Replaces the keys read at `version`, unless another replica wrote
    /// since.
    pub(crate) async fn replace(
        &self,
        keys: &[KeyRecord],
        version: &str,
    ) -> Result<Written, JwtKeyError> {
        let secret = self.secret(keys, Some(version.to_string()))?;
        match self
            .api
            .replace(SECRET_NAME, &PostParams::default(), &secret)
            .await
        {
            Ok(_) => Ok(Written::Stored),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(Written::Lost),
            Err(e) => Err(self.error("updating", e)),
        }
    }
}
