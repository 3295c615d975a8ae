//! Envoy's Secret Discovery Service (SDS v3, state of the world).
//!
//! Resource names, as SPIRE's agent answers them:
//! - `default`, or the caller's SPIFFE ID: a `tls_certificate` with the
//!   chain and the key;
//! - `ROOTCA`, `ALL`, or the trust domain's ID (`spiffe://cluster.local`):
//!   a `validation_context` whose `trusted_ca` holds every root;
//! - any other name is answered empty: the answer leaves it out, the
//!   stream goes on, and the agent logs the name (at most one line per
//!   interval, the name cut to [`LOGGED_TEXT_BYTES`]); no names at all
//!   means `default` and `ROOTCA`. A name asked for twice is answered once.
//!
//! Bundle names are answered at once (the roots are known from
//! `--root-cert` before any certificate); a request that names the
//! certificate waits for it (`FetchSecrets` up to `FIRST_SVID_WAIT`, then
//! `UNAVAILABLE`). A certificate refused by the CA (`PERMISSION_DENIED`)
//! or expired with no successor (`UNAVAILABLE`) ends the stream with that
//! status; so does the agent stopping (`UNAVAILABLE`).
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

use meshca_certs::SpiffeId;

use meshca_certs::untrusted_text::shortened;
use meshca_serve::rate_limited_log::RateLimitedLog;

use super::callers::{shutting_down, Callers, StreamLease};
use super::credentials::{Credentials, Roots};
use super::feeds::{FeedState, SvidState};
use super::spiffe_api::{not_ready, ResponseStream, FIRST_SVID_WAIT};

/// The type URL of SDS resources.
pub(crate) const SECRET_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
/// Istio's and SPIRE's name of the workload certificate.
pub(crate) const DEFAULT_CERT_NAME: &str = "default";
/// Istio's and SPIRE's name of the trust bundle.
pub(crate) const ROOT_CA_NAME: &str = "ROOTCA";
/// SPIRE's name of every bundle (here: the one trust domain's).
pub(crate) const ALL_BUNDLES_NAME: &str = "ALL";

/// The most bytes of a caller's text (a secret name, a NACK's message, a
/// type URL) that a log line or a status message carries.
pub(crate) const LOGGED_TEXT_BYTES: usize = 256;

/// The most requests one SDS stream has read per second; past them its
/// next request is read when the second is over, so that a client sending
/// stale nonces or NACKs as fast as it can (a storm) is held back by its
/// own stream's flow-control window, not served on the node's CPU. Envoy
/// sends one request per answer (an ACK or a NACK) and one per change of
/// names: a few a second at most. Pushes to the stream are not delayed.
pub const MAX_SDS_REQUESTS_PER_SECOND: u32 = 20;

/// The SDS service.
#[derive(Debug, Clone)]
pub(crate) struct SdsService {
    callers: Arc<Callers>,
    logs: Arc<SdsLogs>,
}

/// The log lines any caller can repeat at will: one per interval each.
#[derive(Debug, Default)]
struct SdsLogs {
    unknown_names: RateLimitedLog,
    nacks: RateLimitedLog,
}

impl SdsService {
    /// Serves `callers`' identities.
    pub(crate) fn new(callers: Arc<Callers>) -> Self {
        Self {
            callers,
            logs: Arc::default(),
        }
    }
}

fn inline(bytes: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(Specifier::InlineBytes(bytes.as_bytes().to_vec())),
        ..Default::default()
    })
}

/// What a secret name stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SecretKind {
    /// The certificate and key (`default`, or the SPIFFE ID).
    Certificate,
    /// The trust bundle (`ROOTCA`, `ALL`, or the trust domain's ID).
    Roots,
}

/// What `name` stands for, for a caller with `identity`; `None` for a
/// name this agent does not serve.
pub(crate) fn kind_of(name: &str, identity: &SpiffeId) -> Option<SecretKind> {
    if name == DEFAULT_CERT_NAME || name == identity.as_str() {
        Some(SecretKind::Certificate)
    } else if name == ROOT_CA_NAME
        || name == ALL_BUNDLES_NAME
        || name == identity.trust_domain().id_string()
    {
        Some(SecretKind::Roots)
    } else {
        None
    }
}

/// What an answer is made of: the certificate (with its roots), or the
/// roots alone when only bundle names were asked for.
#[derive(Debug, Clone)]
enum Material {
    Certificate(Arc<Credentials>),
    Roots(Arc<Roots>),
}

impl Material {
    fn roots(&self) -> &Roots {
        match self {
            Self::Certificate(credentials) => &credentials.roots,
            Self::Roots(roots) => roots,
        }
    }

    /// Whether serving `self` after `other` is a change the client must see.
    fn differs_from(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Certificate(a), Self::Certificate(b)) => a.differs_from(b),
            (Self::Roots(a), Self::Roots(b)) => a != b,
            _ => true,
        }
    }
}

/// The secret named `name`, if `material` has it.
fn secret_for(name: &str, identity: &SpiffeId, material: &Material) -> Option<Secret> {
    let kind = match (kind_of(name, identity)?, material) {
        (SecretKind::Certificate, Material::Certificate(credentials)) => {
            secret::Type::TlsCertificate(TlsCertificate {
                certificate_chain: inline(&credentials.chain_pem),
                private_key: inline(credentials.key_pem()),
                ..Default::default()
            })
        }
        (SecretKind::Certificate, Material::Roots(_)) => return None,
        (SecretKind::Roots, material) => {
            secret::Type::ValidationContext(CertificateValidationContext {
                trusted_ca: inline(&material.roots().pem),
                crl: material.roots().crl.as_ref().and_then(|c| inline(&c.pem)),
                // The CRL is the signing CA's: without this Envoy would
                // want one for every CA of a peer's chain too, and refuse
                // every peer whose chain has an intermediate.
                only_verify_leaf_cert_crl: material.roots().crl.is_some(),
                ..Default::default()
            })
        }
    };
    Some(Secret {
        name: name.to_string(),
        r#type: Some(kind),
    })
}

/// The names a request asks for that this agent serves, each once, in
/// the order asked (none asked: the certificate and the bundle); the names
/// it does not serve are left out and logged (see the module's
/// documentation).
fn requested_names(request: &DiscoveryRequest, identity: &SpiffeId, logs: &SdsLogs) -> Vec<String> {
    if request.resource_names.is_empty() {
        return vec![DEFAULT_CERT_NAME.to_string(), ROOT_CA_NAME.to_string()];
    }
    let mut names: Vec<String> = Vec::new();
    let mut unknown = 0usize;
    let mut first_unknown = None;
    for name in &request.resource_names {
        if kind_of(name, identity).is_none() {
            unknown += 1;
            first_unknown.get_or_insert(name.as_str());
        } else if !names.contains(name) {
            names.push(name.clone());
        }
    }
    if let Some(first) = first_unknown {
        if let Some(unlogged) = logs.unknown_names.record() {
            tracing::warn!(
                identity = %identity,
                unknown,
                first = %shortened(first, LOGGED_TEXT_BYTES),
                unlogged,
                "SDS request names secrets this agent does not serve: answered without them (it serves default or the SPIFFE ID, and ROOTCA, ALL or the trust domain's ID; unlogged: such requests since the last line)"
            );
        }
    }
    names
}

/// Whether any of `names` is the certificate.
fn wants_certificate(names: &[String], identity: &SpiffeId) -> bool {
    names
        .iter()
        .any(|name| kind_of(name, identity) == Some(SecretKind::Certificate))
}

/// What `state` has for `names`: `Ok(None)` while the certificate they
/// need is pending, an error when it will not come soon (refused,
/// expired).
fn material_for(
    names: &[String],
    identity: &SpiffeId,
    state: &FeedState,
) -> Result<Option<Material>, Status> {
    if !wants_certificate(names, identity) {
        return Ok(Some(Material::Roots(state.roots.clone())));
    }
    match &state.svid {
        SvidState::Ready(credentials) => Ok(Some(Material::Certificate(credentials.clone()))),
        SvidState::Pending { .. } => Ok(None),
        other => Err(other
            .failure()
            .unwrap_or_else(|| Status::unavailable("no certificate to serve"))),
    }
}

fn response(
    names: &[String],
    identity: &SpiffeId,
    material: &Material,
    version: u64,
) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: version.to_string(),
        resources: names
            .iter()
            .filter_map(|name| secret_for(name, identity, material))
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
            shortened(&request.type_url, LOGGED_TEXT_BYTES)
        )))
    }
}

/// One SDS stream's state.
struct SdsStream {
    requests: Streaming<DiscoveryRequest>,
    logs: Arc<SdsLogs>,
    lease: StreamLease,
    /// The names the client asked for last; `None` before its first request.
    names: Option<Vec<String>>,
    /// What was last sent.
    sent: Option<Material>,
    /// The last version and nonce sent (they are the same number).
    version: u64,
    /// The client asked for something not answered yet.
    owed: bool,
    /// Requests read since `window_start` (see [`MAX_SDS_REQUESTS_PER_SECOND`]).
    requests_in_window: u32,
    /// When the current one-second window started.
    window_start: tokio::time::Instant,
}

enum Step {
    Send(DiscoveryResponse),
    Fail(Status),
    End,
}

impl SdsStream {
    async fn next(&mut self) -> Step {
        let mut state = self.lease.feed.state();
        let identity = self.lease.feed.identity().clone();
        loop {
            let current = state.borrow_and_update().clone();
            if let Some(names) = &self.names {
                let material = match material_for(names, &identity, &current) {
                    Ok(material) => material,
                    Err(status) => return Step::Fail(status),
                };
                if let Some(material) = material {
                    let changed = self.sent.as_ref().is_none_or(|s| material.differs_from(s));
                    if self.owed || changed {
                        self.owed = false;
                        self.version += 1;
                        let answer = response(names, &identity, &material, self.version);
                        tracing::debug!(identity = %identity, version = self.version, resources = answer.resources.len(), "SDS push");
                        self.sent = Some(material);
                        return Step::Send(answer);
                    }
                }
            }
            // Past the stream's requests per second: read again when the
            // second is over.
            let throttled_until = (self.requests_in_window >= MAX_SDS_REQUESTS_PER_SECOND)
                .then(|| self.window_start + std::time::Duration::from_secs(1));
            tokio::select! {
                () = tokio::time::sleep_until(throttled_until.unwrap_or_else(tokio::time::Instant::now)), if throttled_until.is_some() => {
                    self.requests_in_window = 0;
                    self.window_start = tokio::time::Instant::now();
                }
                request = self.requests.next(), if throttled_until.is_none() => {
                    let now = tokio::time::Instant::now();
                    if now.duration_since(self.window_start) >= std::time::Duration::from_secs(1) {
                        self.requests_in_window = 0;
                        self.window_start = now;
                    }
                    self.requests_in_window += 1;
                    let request = match request {
                        Some(Ok(request)) => request,
                        // A request past the pod's buffer budget (refused
                        // while it was read) ends the stream with that
                        // status, not a clean close Envoy would retry.
                        Some(Err(status)) if status.code() == tonic::Code::ResourceExhausted => {
                            return Step::Fail(status)
                        }
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
                            nonce = %shortened(&request.response_nonce, LOGGED_TEXT_BYTES),
                            latest = self.version,
                            "stale SDS request ignored"
                        );
                        continue;
                    }
                    if let Some(error) = &request.error_detail {
                        if let Some(unlogged) = self.logs.nacks.record() {
                            tracing::warn!(
                                identity = %identity,
                                nonce = %shortened(&request.response_nonce, LOGGED_TEXT_BYTES),
                                code = error.code,
                                error = %shortened(&error.message, LOGGED_TEXT_BYTES),
                                unlogged,
                                "Envoy rejected the secrets (NACK); the next change will be pushed (unlogged: NACKs since the last line)"
                            );
                        }
                    }
                    let names = requested_names(&request, &identity, &self.logs);
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
                changed = state.changed() => {
                    if changed.is_err() {
                        return Step::Fail(shutting_down());
                    }
                }
                () = self.lease.stopped() => return Step::Fail(shutting_down()),
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
        let lease = self.callers.lease(&request, &identity)?;
        tracing::debug!(identity = %identity, "SDS stream opened");
        let state = SdsStream {
            requests: request.into_inner(),
            logs: self.logs.clone(),
            lease,
            names: None,
            sent: None,
            version: 0,
            owed: false,
            requests_in_window: 0,
            window_start: tokio::time::Instant::now(),
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
        let names = requested_names(request.get_ref(), &identity, &self.logs);
        let mut lease = self.callers.lease(&request, &identity)?;
        let mut state = lease.feed.state();
        // The roots are there at once; a certificate is waited for up to
        // FIRST_SVID_WAIT.
        let deadline = tokio::time::Instant::now() + FIRST_SVID_WAIT;
        let material = loop {
            let current = state.borrow_and_update().clone();
            if let Some(material) = material_for(&names, &identity, &current)? {
                break material;
            }
            tokio::select! {
                changed = state.changed() => {
                    changed.map_err(|_| shutting_down())?;
                }
                () = tokio::time::sleep_until(deadline) => {
                    let last_error = match &state.borrow().svid {
                        SvidState::Pending { last_error } => last_error.clone(),
                        _ => None,
                    };
                    return Err(not_ready(&identity, last_error.as_deref()));
                }
                () = lease.stopped() => return Err(shutting_down()),
            }
        };
        Ok(Response::new(response(&names, &identity, &material, 1)))
    }
}
