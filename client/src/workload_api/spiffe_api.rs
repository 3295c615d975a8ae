//! The SPIFFE Workload API (`SpiffeWorkloadAPI`): X.509-SVIDs and bundles as
//! streams that send the current state at once (the SVID as soon as the
//! first certificate arrives, within [`FIRST_SVID_WAIT`]) and again on
//! every rotation and bundle change. An SVID is never served past its
//! notAfter. The JWT methods serve the CA's JWT-SVIDs and JWT bundle
//! ([`super::jwt`]); without them (a library user that gave none) they
//! answer `UNIMPLEMENTED`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use meshca_certs::SpiffeId;
use meshca_proto::spiffe_workload::spiffe_workload_api_server::SpiffeWorkloadApi;
use meshca_proto::spiffe_workload::{
    JwtBundlesRequest, JwtBundlesResponse, Jwtsvid, JwtsvidRequest, JwtsvidResponse,
    ValidateJwtsvidRequest, ValidateJwtsvidResponse, X509BundlesRequest, X509BundlesResponse,
    X509svid, X509svidRequest, X509svidResponse,
};
use meshca_proto::WORKLOAD_API_HEADER;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::callers::{shutting_down, Callers, StreamLease};
use super::credentials::{Credentials, Roots};
use super::feeds::SvidState;
use super::jwt::JwtSvids;

/// A stream of responses to one caller.
pub(crate) type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The Workload API service.
#[derive(Debug, Clone)]
pub(crate) struct WorkloadApiService {
    callers: Arc<Callers>,
    jwt: Option<Arc<JwtSvids>>,
}

impl WorkloadApiService {
    /// Serves `callers`' identities (X.509 only).
    pub(crate) fn new(callers: Arc<Callers>) -> Self {
        Self { callers, jwt: None }
    }

    /// Serves JWT-SVIDs and the JWT bundle from `jwt` too.
    pub(crate) fn with_jwt(mut self, jwt: Option<Arc<JwtSvids>>) -> Self {
        self.jwt = jwt;
        self
    }

    fn jwt(&self) -> Result<&Arc<JwtSvids>, Status> {
        self.jwt.as_ref().ok_or_else(|| {
            Status::unimplemented("this Workload API server serves X.509-SVIDs only")
        })
    }
}

/// Refuses a call without `workload.spiffe.io: true`, as the Workload API
/// specification requires.
fn check_header<T>(request: &Request<T>) -> Result<(), Status> {
    match request.metadata().get(WORKLOAD_API_HEADER) {
        Some(value) if value.as_bytes() == b"true" => Ok(()),
        _ => Err(Status::invalid_argument(format!(
            "security header missing from request: set the metadata `{WORKLOAD_API_HEADER}: true`"
        ))),
    }
}

/// How long `FetchX509SVID` and SDS's `FetchSecrets` wait for an
/// identity's first certificate before answering `UNAVAILABLE` (the
/// client retries with backoff; the fetch goes on meanwhile).
pub(crate) const FIRST_SVID_WAIT: Duration = Duration::from_secs(5);

/// The unavailable status of an identity with no certificate yet.
pub(crate) fn not_ready(identity: &SpiffeId, last_error: Option<&str>) -> Status {
    Status::unavailable(match last_error {
        Some(error) => {
            format!("no certificate for {identity} yet; the last attempt failed: {error}")
        }
        None => format!("no certificate for {identity} yet; retry shortly"),
    })
}

/// The certificates of `lease`'s identity: the current one as soon as
/// there is one, then each change (a new certificate or new roots). Ends
/// with `UNAVAILABLE` when no certificate has come [`FIRST_SVID_WAIT`]
/// after the call, when the certificate expires with no successor, or
/// when the agent stops; with `PERMISSION_DENIED` when the CA refuses the
/// identity. The stream holds the lease, so closing it frees the slot and
/// the feed.
pub(crate) fn svid_updates(
    lease: StreamLease,
) -> impl Stream<Item = Result<Arc<Credentials>, Status>> + Send {
    let receiver = lease.feed.state();
    let deadline = Instant::now() + FIRST_SVID_WAIT;
    futures::stream::unfold(
        Some((receiver, None::<Arc<Credentials>>, lease)),
        move |state| async move {
            let (mut receiver, last, mut lease) = state?;
            loop {
                let current = receiver.borrow_and_update().svid.clone();
                match &current {
                    SvidState::Ready(credentials) => {
                        if last.as_deref().is_none_or(|l| credentials.differs_from(l)) {
                            let credentials = credentials.clone();
                            return Some((
                                Ok(credentials.clone()),
                                Some((receiver, Some(credentials), lease)),
                            ));
                        }
                    }
                    SvidState::Pending { last_error } => {
                        if last.is_none() && Instant::now() >= deadline {
                            let status = not_ready(lease.feed.identity(), last_error.as_deref());
                            return Some((Err(status), None));
                        }
                    }
                    other => {
                        if let Some(status) = other.failure() {
                            return Some((Err(status), None));
                        }
                    }
                }
                let first_wait = async {
                    if last.is_none() {
                        tokio::time::sleep_until(deadline).await;
                    } else {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::select! {
                    changed = receiver.changed() => {
                        if changed.is_err() {
                            return Some((Err(shutting_down()), None));
                        }
                    }
                    () = first_wait => {}
                    () = lease.stopped() => return Some((Err(shutting_down()), None)),
                }
            }
        },
    )
}

/// The roots of `lease`'s identity: at once (they are known before any
/// certificate), then on each change. Ends with `UNAVAILABLE` when the
/// agent stops.
pub(crate) fn root_updates(
    lease: StreamLease,
) -> impl Stream<Item = Result<Arc<Roots>, Status>> + Send {
    let receiver = lease.feed.state();
    futures::stream::unfold(
        Some((receiver, None::<Arc<Roots>>, lease)),
        |state| async move {
            let (mut receiver, last, mut lease) = state?;
            loop {
                let roots = receiver.borrow_and_update().roots.clone();
                if last.as_deref() != Some(&*roots) {
                    return Some((Ok(roots.clone()), Some((receiver, Some(roots), lease))));
                }
                tokio::select! {
                    changed = receiver.changed() => {
                        if changed.is_err() {
                            return Some((Err(shutting_down()), None));
                        }
                    }
                    () = lease.stopped() => return Some((Err(shutting_down()), None)),
                }
            }
        },
    )
}

/// The Workload API's bundle map: the trust domain's ID to every root.
fn bundles(identity: &SpiffeId, roots: &Roots) -> HashMap<String, Vec<u8>> {
    HashMap::from([(identity.trust_domain().id_string(), roots.der_concat())])
}

fn svid_response(credentials: &Credentials) -> X509svidResponse {
    X509svidResponse {
        svids: vec![X509svid {
            spiffe_id: credentials.spiffe_id.to_string(),
            x509_svid: credentials.chain_der_concat(),
            x509_svid_key: credentials.key_pkcs8_der().to_vec(),
            bundle: credentials.roots.der_concat(),
            hint: String::new(),
        }],
        crl: credentials
            .roots
            .crl
            .iter()
            .map(|c| c.der.clone())
            .collect(),
        federated_bundles: HashMap::new(),
    }
}

#[tonic::async_trait]
impl SpiffeWorkloadApi for WorkloadApiService {
    type FetchX509SVIDStream = ResponseStream<X509svidResponse>;
    type FetchX509BundlesStream = ResponseStream<X509BundlesResponse>;
    type FetchJWTBundlesStream = ResponseStream<JwtBundlesResponse>;

    async fn fetch_x509svid(
        &self,
        request: Request<X509svidRequest>,
    ) -> Result<Response<Self::FetchX509SVIDStream>, Status> {
        check_header(&request)?;
        let identity = self.callers.identity_of(&request).await?;
        let lease = self.callers.lease(&request, &identity)?;
        tracing::debug!(identity = %identity, "X.509-SVID stream opened");
        let stream = futures::StreamExt::map(svid_updates(lease), |c| c.map(|c| svid_response(&c)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn fetch_x509_bundles(
        &self,
        request: Request<X509BundlesRequest>,
    ) -> Result<Response<Self::FetchX509BundlesStream>, Status> {
        check_header(&request)?;
        let identity = self.callers.identity_of(&request).await?;
        let lease = self.callers.lease(&request, &identity)?;
        let stream = futures::StreamExt::map(root_updates(lease), move |roots| {
            roots.map(|roots| X509BundlesResponse {
                crl: roots.crl.iter().map(|c| c.der.clone()).collect(),
                bundles: bundles(&identity, &roots),
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn fetch_jwtsvid(
        &self,
        request: Request<JwtsvidRequest>,
    ) -> Result<Response<JwtsvidResponse>, Status> {
        check_header(&request)?;
        let jwt = self.jwt()?;
        if request.get_ref().audience.is_empty() {
            return Err(Status::invalid_argument("FetchJWTSVID needs an audience"));
        }
        let identity = self.callers.identity_of(&request).await?;
        let asked = request.get_ref().spiffe_id.trim();
        if !asked.is_empty() && asked != identity.to_string() {
            return Err(Status::permission_denied(format!(
                "this caller is {identity}, not {:?}",
                meshca_certs::untrusted_text::shortened(asked, 256)
            )));
        }
        let token = jwt.fetch(&identity, &request.get_ref().audience).await?;
        Ok(Response::new(JwtsvidResponse {
            svids: vec![Jwtsvid {
                spiffe_id: identity.to_string(),
                svid: token.token,
                hint: String::new(),
            }],
        }))
    }

    async fn fetch_jwt_bundles(
        &self,
        request: Request<JwtBundlesRequest>,
    ) -> Result<Response<Self::FetchJWTBundlesStream>, Status> {
        check_header(&request)?;
        let jwt = self.jwt()?.clone();
        let identity = self.callers.identity_of(&request).await?;
        let lease = self.callers.lease(&request, &identity)?;
        let trust_domain = identity.trust_domain().id_string();
        let receiver = jwt.bundle();
        let deadline = Instant::now() + FIRST_SVID_WAIT;
        let stream = futures::stream::unfold(
            Some((receiver, None::<Arc<super::jwt::JwtBundle>>, lease)),
            move |state| {
                let trust_domain = trust_domain.clone();
                async move {
                    let (mut receiver, last, mut lease) = state?;
                    loop {
                        let current = receiver.borrow_and_update().clone();
                        if let Some(bundle) = current {
                            if last.as_ref().is_none_or(|l| !Arc::ptr_eq(l, &bundle)) {
                                let response = JwtBundlesResponse {
                                    bundles: HashMap::from([(trust_domain, bundle.jwks.clone())]),
                                };
                                return Some((Ok(response), Some((receiver, Some(bundle), lease))));
                            }
                        } else if Instant::now() >= deadline {
                            let status =
                                Status::unavailable("no JWT bundle from the CA yet; retry shortly");
                            return Some((Err(status), None));
                        }
                        let first_wait = async {
                            if last.is_none() {
                                tokio::time::sleep_until(deadline).await;
                            } else {
                                std::future::pending::<()>().await;
                            }
                        };
                        tokio::select! {
                            changed = receiver.changed() => {
                                if changed.is_err() {
                                    return Some((Err(shutting_down()), None));
                                }
                            }
                            () = first_wait => {}
                            () = lease.stopped() => return Some((Err(shutting_down()), None)),
                        }
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn validate_jwtsvid(
        &self,
        request: Request<ValidateJwtsvidRequest>,
    ) -> Result<Response<ValidateJwtsvidResponse>, Status> {
        check_header(&request)?;
        let jwt = self.jwt()?;
        let request = request.into_inner();
        if request.audience.is_empty() {
            return Err(Status::invalid_argument(
                "ValidateJWTSVID needs an audience",
            ));
        }
        if request.svid.is_empty() {
            return Err(Status::invalid_argument(
                "ValidateJWTSVID needs the svid to validate",
            ));
        }
        let validated = jwt.validate(&request.svid, &request.audience)?;
        Ok(Response::new(ValidateJwtsvidResponse {
            spiffe_id: validated.spiffe_id.to_string(),
            claims: Some(validated.claims),
        }))
    }
}
