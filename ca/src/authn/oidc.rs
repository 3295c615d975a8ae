//! The Kubernetes API server's own token keys, found by OIDC discovery
//! (`/.well-known/openid-configuration`, then its `jwks_uri`), so
//! service-account tokens can be checked offline without `--jwks`.

use std::time::Duration;

use async_trait::async_trait;

use super::JwksFetcher;

/// Fetches the API server's JWKS through the Kubernetes client (same TLS
/// trust and credentials as every other call). Each GET has a timeout.
pub(crate) struct KubernetesJwks {
    client: kube::Client,
    timeout: Duration,
}

/// Timeout of each GET unless [`KubernetesJwks::with_timeout`] sets one.
pub(crate) const DEFAULT_OIDC_TIMEOUT: Duration = Duration::from_secs(5);

impl std::fmt::Debug for KubernetesJwks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesJwks").finish_non_exhaustive()
    }
}

/// What OIDC discovery says.
#[derive(Debug, Clone, serde::Deserialize)]
pub(crate) struct Discovery {
    /// The issuer (`iss` of the tokens).
    pub(crate) issuer: String,
    /// Where the keys are.
    pub(crate) jwks_uri: String,
}

impl KubernetesJwks {
    /// A fetcher using `client`.
    pub(crate) fn new(client: kube::Client) -> Self {
        Self {
            client,
            timeout: DEFAULT_OIDC_TIMEOUT,
        }
    }

    /// Gives up each GET after `timeout`.
    pub(crate) fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn get(&self, path: &str) -> Result<String, String> {
        let request = http::Request::get(path)
            .body(Vec::new())
            .map_err(|e| format!("GET {path}: {e}"))?;
        tokio::time::timeout(self.timeout, self.client.request_text(request))
            .await
            .map_err(|_| {
                format!(
                    "GET {path} from the Kubernetes API: no answer within {:?}",
                    self.timeout
                )
            })?
            .map_err(|e| format!("GET {path} from the Kubernetes API: {e}"))
    }

    /// Reads `/.well-known/openid-configuration`.
    pub(crate) async fn discover(&self) -> Result<Discovery, String> {
        let text = self.get("/.well-known/openid-configuration").await?;
        serde_json::from_str(&text).map_err(|e| format!("OIDC discovery document: {e}"))
    }
}

/// The path (and query) of a URL, so the request goes through the API
/// client rather than to whatever host the document names.
fn path_of(uri: &str) -> String {
    match uri.parse::<http::Uri>() {
        Ok(u) => u
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_else(|| "/".into()),
        Err(_) => uri.to_string(),
    }
}

#[async_trait]
impl JwksFetcher for KubernetesJwks {
    async fn fetch_jwks(&self) -> Result<String, String> {
        let discovery = self.discover().await?;
        self.get(&path_of(&discovery.jwks_uri)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jwks_uri_path() {
        assert_eq!(
            path_of("https://10.0.0.1:6443/openid/v1/jwks"),
            "/openid/v1/jwks"
        );
        assert_eq!(path_of("/openid/v1/jwks"), "/openid/v1/jwks");
    }
}
