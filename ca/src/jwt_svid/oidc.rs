//! OIDC discovery for relying parties outside the mesh (`--oidc-listen`):
//! `/.well-known/openid-configuration` and the JWKS it names (`/keys`), on
//! the monitoring port's bounded HTTP/1.1 server ([`crate::monitoring`]).
//!
//! The JWKS served here marks its keys `use: sig` with their `alg`, as
//! OIDC relying parties (AWS STS, GCP Workload Identity Federation,
//! Vault, PyJWT's `PyJWKClient`) select signing keys; the SPIFFE bundle
//! of the Workload API marks the same keys `use: jwt-svid`. Both are
//! cacheable for [`super::keys::RotationPolicy::bundle_max_age`], a
//! quarter of the time a new key is published before it signs.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use super::JwtIssuer;

/// Path of the JWKS, under the issuer URL.
pub(crate) const JWKS_PATH: &str = "/keys";
/// Path of the discovery document, under the issuer URL.
pub(crate) const DISCOVERY_PATH: &str = "/.well-known/openid-configuration";

/// The discovery document of `issuer`.
pub(crate) fn discovery_document(issuer: &JwtIssuer) -> serde_json::Value {
    let iss = issuer.issuer().unwrap_or_default();
    serde_json::json!({
        "issuer": iss,
        "jwks_uri": format!("{iss}{JWKS_PATH}"),
        "authorization_endpoint": "",
        "response_types_supported": ["id_token"],
        "subject_types_supported": ["public"],
        "id_token_signing_alg_values_supported": issuer.algorithms(),
        "claims_supported": ["sub", "aud", "exp", "iat", "iss"],
    })
}

fn cache_control(issuer: &JwtIssuer) -> String {
    format!("public, max-age={}", issuer.bundle_max_age().as_secs())
}

/// 503 while the keys cannot be loaded (in a cluster, from the Secret).
async fn not_ready(issuer: &Arc<JwtIssuer>) -> Option<axum::response::Response> {
    match issuer.ensure_ready().await {
        Ok(()) => None,
        Err(_) => Some(
            (
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, "5")],
                "the JWT-SVID keys are not loaded yet\n",
            )
                .into_response(),
        ),
    }
}

async fn discovery(State(issuer): State<Arc<JwtIssuer>>) -> axum::response::Response {
    if let Some(refusal) = not_ready(&issuer).await {
        return refusal;
    }
    (
        [
            (header::CONTENT_TYPE, "application/json".to_string()),
            (header::CACHE_CONTROL, cache_control(&issuer)),
        ],
        discovery_document(&issuer).to_string(),
    )
        .into_response()
}

async fn jwks(State(issuer): State<Arc<JwtIssuer>>) -> axum::response::Response {
    if let Some(refusal) = not_ready(&issuer).await {
        return refusal;
    }
    (
        [
            (header::CONTENT_TYPE, "application/jwk-set+json".to_string()),
            (header::CACHE_CONTROL, cache_control(&issuer)),
        ],
        issuer.oidc_jwks(),
    )
        .into_response()
}

/// The path of an issuer URL (`https://host/tenant` → `/tenant`; none:
/// empty), without a trailing `/`.
fn issuer_path(issuer: &str) -> &str {
    let after_scheme = issuer.split_once("://").map_or(issuer, |(_, rest)| rest);
    after_scheme
        .find('/')
        .map_or("", |at| &after_scheme[at..])
        .trim_end_matches('/')
}

/// The routes of the discovery endpoint: at the root and, for an issuer
/// URL with a path, under that path too (where OIDC relying parties look:
/// `ISSUER/.well-known/openid-configuration`, and the document's
/// `jwks_uri`, `ISSUER/keys`).
pub(crate) fn router(issuer: Arc<JwtIssuer>) -> axum::Router {
    let prefix = issuer
        .issuer()
        .map(issuer_path)
        .unwrap_or_default()
        .to_string();
    let mut router = axum::Router::new()
        .route(DISCOVERY_PATH, get(discovery))
        .route(JWKS_PATH, get(jwks));
    // Characters axum's router would read as parameters or wildcards are
    // not routed (the root paths still are).
    let routable = prefix
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._~/%".contains(&b))
        && !prefix.contains("//");
    if !prefix.is_empty() && !routable {
        tracing::warn!(path = %prefix, "the --jwt-svid-issuer path holds characters that cannot be routed; the discovery document is served at the root only");
    }
    if !prefix.is_empty() && routable {
        router = router
            .route(&format!("{prefix}{DISCOVERY_PATH}"), get(discovery))
            .route(&format!("{prefix}{JWKS_PATH}"), get(jwks));
    }
    router.with_state(issuer)
}

#[cfg(test)]
mod tests {
    use super::issuer_path;

    #[test]
    fn the_routes_follow_the_issuers_path() {
        assert_eq!(issuer_path("https://oidc.example.com"), "");
        assert_eq!(issuer_path("https://oidc.example.com/"), "");
        assert_eq!(issuer_path("https://h:8443/tenant/a"), "/tenant/a");
        assert_eq!(issuer_path("http://h/x/"), "/x");
    }
}
