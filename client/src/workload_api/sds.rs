//! Envoy's Secret Discovery Service (SDS v3, state of the world).
//!
//! Resource names, as SPIRE's agent answers them:
//! - `default`, or the caller's SPIFFE ID: a `tls_certificate` with the
//!   chain and the key;
//! - `ROOTCA`, `ALL`, or the trust domain's ID (`spiffe://cluster.local`):
//!   a `validation_context` whose `trusted_ca` holds every root;
//! - any other name is left out of the answer (an empty answer, never an
//!   error); no names at all means `default` and `ROOTCA`.
//!
//! Each response carries a new `version_info` and `nonce`. A request that
//! names the last nonce is an ACK, or a NACK when it carries `error_detail`
//! (logged; the same secrets are not sent again until they change); one
//! that names an older nonce is stale and ignored, as the xDS protocol
//! says. A request with other names is answered at once; a rotation or
//! bundle change is pushed.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{data_source::Specifier, DataSource};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    secret, CertificateValidationContext, Secret, TlsCertificate,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::SecretDiscoveryService;
use futures::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use super::callers::{Callers, StreamLease};
use super::credentials::Credentials;
use super::spiffe_api::ResponseStream;

/// The type URL of SDS resources.
pub(crate) const SECRET_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
/// Istio's and SPIRE's name of the workload certificate.
pub(crate) const DEFAULT_CERT_NAME: &str = "default";
/// Istio's and SPIRE's name of the trust bundle.
pub(crate) const ROOT_CA_NAME: &str = "ROOTCA";
/// SPIRE's name of every bundle (here: the one trust domain's).
pub(crate) const ALL_BUNDLES_NAME: &str = "ALL";

/// The SDS service.
#[derive(Debug, Clone)]
pub(crate) struct SdsService {
    callers: Arc<Callers>,
}

impl SdsService {
    /// Serves `callers`' identities.
    pub(crate) fn new(callers: Arc<Callers>) -> Self {
        Self { callers }
    }
}

fn inline(bytes: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(Specifier::InlineBytes(bytes.as_bytes().to_vec())),
        ..Default::default()
    })
}

/// The secret named `name` for `credentials`, if the name is one we answer to.
pub(crate) fn secret_for(name: &str, credentials: &Credentials) -> Option<Secret> {
    let trust_domain_id = credentials.spiffe_id.trust_domain().id_string();
    let kind = if name == DEFAULT_CERT_NAME || name == credentials.spiffe_id.as_str() {
        secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: inline(&credentials.chain_pem),
            private_key: inline(credentials.key_pem()),
            ..Default::default()
        })
    } else if name == ROOT_CA_NAME || name == ALL_BUNDLES_NAME || name == trust_domain_id {
        secret::Type::ValidationContext(CertificateValidationContext {
            trusted_ca: inline(&credentials.roots_pem),
            ..Default::default()
        })
    } else {
        return None;
    };
    Some(Secret {
        name: name.to_string(),
        r#type: Some(kind),
    })
}

/// The names a request asks for (none: the certificate and the bundle).
fn requested_names(request: &DiscoveryRequest) -> Vec<String> {
    if request.resource_names.is_empty() {
        vec![DEFAULT_CERT_NAME.to_string(), ROOT_CA_NAME.to_string()]
    } else {
        request.resource_names.clone()
    }
}

fn response(names: &[String], credentials: &Credentials, version: u64) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: version.to_string(),
        resources: names
            .iter()
            .filter_map(|name| secret_for(name, credentials))
            .map(envoy_types::util::pack_any)
            .collect(),
        type_url: SECRET_TYPE_URL.to_string(),
        nonce: format!("{version}"),
        ..Default::default()
    }
}

fn check_type(request: &DiscoveryRequest) -> Result<(), Status> {
    if request.type_url.is_empty() || request.type_url == SECRET_TYPE_URL {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "this is an SDS server: type_url must be {SECRET_TYPE_URL}, not {:?}",
            request.type_url
        )))
    }
}

/// One SDS stream's state.
struct SdsStream {
    requests: Streaming<DiscoveryRequest>,
    lease: StreamLease,
    /// The names the client asked for last; `None` before its first request.
    names: Option<Vec<String>>,
    /// The credentials last sent.
    sent: Option<Arc<Credentials>>,
    /// The last version and nonce sent (they are the same number).
    version: u64,
    /// The client asked for something not answered yet.
    owed: bool,
}

enum Step {
    Send(DiscoveryResponse),
    Fail(Status),
    End,
}

impl SdsStream {
    async fn next(&mut self) -> Step {
        let mut credentials = self.lease.feed.credentials();
        loop {
            let current = credentials.borrow_and_update().clone();
            if let (Some(names), Some(current)) = (&self.names, current) {
                let changed = self.sent.as_deref().is_none_or(|s| current.differs_from(s));
                if self.owed || changed {
                    self.owed = false;
                    self.version += 1;
                    self.sent = Some(current.clone());
                    tracing::debug!(identity = %current.spiffe_id, serial = %current.serial_hex, version = self.version, "SDS push");
                    return Step::Send(response(names, &current, self.version));
                }
            }
            tokio::select! {
                request = self.requests.next() => {
                    let request = match request {
                        Some(Ok(request)) => request,
                        Some(Err(_)) | None => return Step::End,
                    };
                    if let Err(status) = check_type(&request) {
                        return Step::Fail(status);
                    }
                    if self.names.is_some()
                        && !request.response_nonce.is_empty()
                        && request.response_nonce != self.version.to_string()
                    {
                        // A request about an answer older than the last one
                        // sent is stale (xDS): the client has not seen the
                        // newest answer yet, and will ACK or NACK that one.
                        tracing::debug!(
                            nonce = %request.response_nonce,
                            latest = self.version,
                            "stale SDS request ignored"
                        );
                        continue;
                    }
                    let names = requested_names(&request);
                    if let Some(error) = &request.error_detail {
                        tracing::warn!(
                            identity = %self.lease.feed.identity(),
                            nonce = %request.response_nonce,
                            code = error.code,
                            error = %error.message,
                            "Envoy rejected the secrets (NACK); the next change will be pushed"
                        );
                    }
                    if self.names.as_ref() != Some(&names) {
                        // The first request, or new names: answer now.
                        self.names = Some(names);
                        self.owed = true;
                    } else if request.response_nonce.is_empty() {
                        // Same names without a nonce: a client that reconnected
                        // its subscription wants the state again.
                        self.owed = true;
                    }
                }
                changed = credentials.changed() => {
                    if changed.is_err() {
                        return Step::End;
                    }
                }
            }
        }
    }
}

#[tonic::async_trait]
impl SecretDiscoveryService for SdsService {
    type DeltaSecretsStream = ResponseStream<DeltaDiscoveryResponse>;
    type StreamSecretsStream = ResponseStream<DiscoveryResponse>;

    async fn delta_secrets(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaSecretsStream>, Status> {
        Err(Status::unimplemented(
            "incremental SDS is not implemented; use StreamSecrets (state of the world)",
        ))
    }

    async fn stream_secrets(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamSecretsStream>, Status> {
        let identity = self.callers.identity_of(&request).await?;
        let lease = self.callers.lease(&identity)?;
        tracing::debug!(identity = %identity, "SDS stream opened");
        let state = SdsStream {
            requests: request.into_inner(),
            lease,
            names: None,
            sent: None,
            version: 0,
            owed: false,
        };
        let stream = futures::stream::unfold(Some(state), |state| async move {
            let mut state = state?;
            match state.next().await {
                Step::Send(response) => Some((Ok(response), Some(state))),
                Step::Fail(status) => Some((Err(status), None)),
                Step::End => None,
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn fetch_secrets(
        &self,
        request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        let identity = self.callers.identity_of(&request).await?;
        check_type(request.get_ref())?;
        let lease = self.callers.lease(&identity)?;
        let mut credentials = lease.feed.credentials();
        // Wait for the first certificate (bounded by the caller's deadline).
        let current = loop {
            if let Some(current) = credentials.borrow_and_update().clone() {
                break current;
            }
            credentials
                .changed()
                .await
                .map_err(|_| Status::unavailable("the agent is shutting down"))?;
        };
        let names = requested_names(request.get_ref());
        Ok(Response::new(response(&names, &current, 1)))
    }
}
