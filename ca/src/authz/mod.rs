//! Authorization (docs/authentication.md, "Node agents (ztunnel)"): which identity an authenticated caller may
//! get a certificate for.
//!
//! A caller may hold its own identity. Another identity only by
//! impersonation (node agents such as ztunnel), decided by an
//! [`ImpersonationPolicy`]; without one, impersonation is refused. A CSR's
//! URI SANs, if any, must all be the identity granted.

pub(crate) mod node_agent;

use std::sync::Arc;

use async_trait::async_trait;
use meshca_certs::SpiffeId;

use crate::authn::Caller;

/// Why a caller may not have the identity it asks for (gRPC
/// `PERMISSION_DENIED`; Istio answers `UNAUTHENTICATED` here).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AuthzError {
    /// The impersonation target is not a valid SPIFFE ID.
    #[error("ImpersonatedIdentity {value:?} is not a valid SPIFFE ID: {reason}")]
    BadImpersonationTarget {
        /// The value sent (truncated).
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// Impersonation is not allowed for this caller.
    #[error("{caller} may not request certificates for {target}: {reason}")]
    ImpersonationDenied {
        /// The caller's identity.
        caller: String,
        /// The identity asked for.
        target: String,
        /// The rule that failed.
        reason: String,
    },
    /// The decision cannot be made now (gRPC `UNAVAILABLE`), e.g. the pod
    /// index is not synced yet.
    #[error("{0}")]
    Unavailable(String),
    /// The CSR asks for an identity the caller may not hold.
    #[error(
        "the CSR asks for {requested} but the caller may only get a certificate for {allowed}"
    )]
    CsrIdentityMismatch {
        /// The URI SAN in the CSR.
        requested: String,
        /// The identity granted.
        allowed: String,
    },
}

/// Decides whether a caller may get a certificate for another identity.
#[async_trait]
pub(crate) trait ImpersonationPolicy: Send + Sync {
    /// `Ok(())` if `caller` may get a certificate for `target`.
    async fn may_impersonate(&self, caller: &Caller, target: &SpiffeId) -> Result<(), AuthzError>;

    /// The node the caller's pod runs on, when the policy knows it (for
    /// revocation by node).
    fn node_of(&self, _caller: &Caller) -> Option<String> {
        None
    }
}

/// The authorizer.
#[derive(Clone, Default)]
pub(crate) struct Authorizer {
    impersonation: Option<Arc<dyn ImpersonationPolicy>>,
}

impl std::fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authorizer")
            .field("impersonation", &self.impersonation.is_some())
            .finish()
    }
}

impl Authorizer {
    /// An authorizer that allows only a caller's own identity.
    pub(crate) fn own_identity_only() -> Self {
        Self::default()
    }

    /// An authorizer that also allows impersonation where `policy` says so.
    pub(crate) fn with_impersonation(policy: Arc<dyn ImpersonationPolicy>) -> Self {
        Self {
            impersonation: Some(policy),
        }
    }

    /// The node of the caller's pod, when known (a pod index is kept only
    /// with node agents configured).
    pub(crate) fn node_of(&self, caller: &Caller) -> Option<String> {
        self.impersonation.as_ref()?.node_of(caller)
    }

    /// The identity `caller` gets, given the requested impersonation target
    /// (empty means none) and the CSR's URI SANs.
    pub(crate) async fn authorize(
        &self,
        caller: &Caller,
        impersonated: Option<&str>,
        csr_uri_sans: &[SpiffeId],
    ) -> Result<SpiffeId, AuthzError> {
        let identity = match impersonated.map(str::trim).filter(|s| !s.is_empty()) {
            None => caller.identity.clone(),
            Some(target) => {
                let target =
                    SpiffeId::parse(target).map_err(|e| AuthzError::BadImpersonationTarget {
                        value: target.chars().take(256).collect(),
                        reason: e.to_string(),
                    })?;
                if target != caller.identity {
                    match &self.impersonation {
                        Some(policy) => policy.may_impersonate(caller, &target).await?,
                        None => return Err(AuthzError::ImpersonationDenied {
                            caller: caller.identity.to_string(),
                            target: target.to_string(),
                            reason:
                                "impersonation is not enabled on this CA (no trusted node agents)"
                                    .into(),
                        }),
                    }
                }
                target
            }
        };
        if let Some(other) = csr_uri_sans.iter().find(|id| **id != identity) {
            return Err(AuthzError::CsrIdentityMismatch {
                requested: other.to_string(),
                allowed: identity.to_string(),
            });
        }
        Ok(identity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authn::CallerKind;

    fn caller(id: &str) -> Caller {
        Caller {
            identity: SpiffeId::parse(id).unwrap(),
            kind: CallerKind::Token { issuer: "x".into() },
            pod_name: None,
            pod_uid: None,
            cluster: None,
        }
    }

    const ME: &str = "spiffe://cluster.local/ns/a/sa/me";
    const OTHER: &str = "spiffe://cluster.local/ns/a/sa/other";

    #[tokio::test]
    async fn own_identity_is_granted() {
        let authz = Authorizer::own_identity_only();
        let me = SpiffeId::parse(ME).unwrap();
        assert_eq!(authz.authorize(&caller(ME), None, &[]).await.unwrap(), me);
        assert_eq!(
            authz
                .authorize(&caller(ME), Some(""), std::slice::from_ref(&me))
                .await
                .unwrap(),
            me
        );
        assert_eq!(
            authz.authorize(&caller(ME), Some(ME), &[]).await.unwrap(),
            me
        );
    }

    #[tokio::test]
    async fn other_identities_are_denied() {
        let authz = Authorizer::own_identity_only();
        let other = SpiffeId::parse(OTHER).unwrap();
        assert!(matches!(
            authz.authorize(&caller(ME), None, &[other]).await,
            Err(AuthzError::CsrIdentityMismatch { .. })
        ));
        assert!(matches!(
            authz.authorize(&caller(ME), Some(OTHER), &[]).await,
            Err(AuthzError::ImpersonationDenied { .. })
        ));
        assert!(matches!(
            authz
                .authorize(&caller(ME), Some("not-a-spiffe-id"), &[])
                .await,
            Err(AuthzError::BadImpersonationTarget { .. })
        ));
    }
}
