//! The SPIFFE Workload API (`SpiffeWorkloadAPI`): X.509-SVIDs and bundles as
//! streams that send the current state at once (or as soon as the first
//! certificate arrives) and again on every rotation and bundle change.
//! The JWT methods answer `UNIMPLEMENTED`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use meshca_proto::spiffe_workload::spiffe_workload_api_server::SpiffeWorkloadApi;
use meshca_proto::spiffe_workload::{
    JwtBundlesRequest, JwtBundlesResponse, JwtsvidRequest, JwtsvidResponse, ValidateJwtsvidRequest,
    ValidateJwtsvidResponse, X509BundlesRequest, X509BundlesResponse, X509svid, X509svidRequest,
    X509svidResponse,
};
use meshca_proto::WORKLOAD_API_HEADER;
use tonic::{Request, Response, Status};

use super::callers::{Callers, StreamLease};
use super::credentials::Credentials;

/// A stream of responses to one caller.
pub(crate) type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The Workload API service.
#[derive(Debug, Clone)]
pub(crate) struct WorkloadApiService {
    callers: Arc<Callers>,
}

impl WorkloadApiService {
    /// Serves `callers`' identities.
    pub(crate) fn new(callers: Arc<Callers>) -> Self {
        Self { callers }
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

/// The credentials of `lease`'s identity: the current ones as soon as
/// there are any, then each that `changed(previous, next)` calls a change.
/// The stream holds the lease, so closing it frees the slot and the feed.
pub(crate) fn credential_updates(
    lease: StreamLease,
    changed: fn(&Credentials, &Credentials) -> bool,
) -> impl Stream<Item = Arc<Credentials>> + Send {
    let receiver = lease.feed.credentials();
    futures::stream::unfold(
        (receiver, None::<Arc<Credentials>>, lease),
        move |(mut receiver, last, lease)| async move {
            loop {
                let current = receiver.borrow_and_update().clone();
                if let Some(current) = current {
                    if last.as_deref().is_none_or(|l| changed(l, &current)) {
                        return Some((current.clone(), (receiver, Some(current), lease)));
                    }
                }
                if receiver.changed().await.is_err() {
                    return None;
                }
            }
        },
    )
}

/// The Workload API's bundle map: the trust domain's ID to every root.
fn bundles(credentials: &Credentials) -> HashMap<String, Vec<u8>> {
    HashMap::from([(
        credentials.spiffe_id.trust_domain().id_string(),
        credentials.roots_der_concat(),
    )])
}

fn svid_response(credentials: &Credentials) -> X509svidResponse {
    X509svidResponse {
        svids: vec![X509svid {
            spiffe_id: credentials.spiffe_id.to_string(),
            x509_svid: credentials.chain_der_concat(),
            x509_svid_key: credentials.key_pkcs8_der().to_vec(),
            bundle: credentials.roots_der_concat(),
            hint: String::new(),
        }],
        crl: Vec::new(),
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
        let lease = self.callers.lease(&identity)?;
        tracing::debug!(identity = %identity, "X.509-SVID stream opened");
        let stream = futures::StreamExt::map(
            credential_updates(lease, |old, new| new.differs_from(old)),
            |c| Ok::<_, Status>(svid_response(&c)),
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn fetch_x509_bundles(
        &self,
        request: Request<X509BundlesRequest>,
    ) -> Result<Response<Self::FetchX509BundlesStream>, Status> {
        check_header(&request)?;
        let identity = self.callers.identity_of(&request).await?;
        let lease = self.callers.lease(&identity)?;
        let stream = futures::StreamExt::map(
            credential_updates(lease, |old, new| old.roots_der != new.roots_der),
            |c| {
                Ok::<_, Status>(X509BundlesResponse {
                    crl: Vec::new(),
                    bundles: bundles(&c),
                })
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn fetch_jwtsvid(
        &self,
        request: Request<JwtsvidRequest>,
    ) -> Result<Response<JwtsvidResponse>, Status> {
        check_header(&request)?;
        Err(Status::unimplemented(
            "meshca-agent serves X.509-SVIDs only; JWT-SVIDs are not implemented",
        ))
    }

    async fn fetch_jwt_bundles(
        &self,
        request: Request<JwtBundlesRequest>,
    ) -> Result<Response<Self::FetchJWTBundlesStream>, Status> {
        check_header(&request)?;
        Err(Status::unimplemented(
            "meshca-agent serves X.509 bundles only; JWT bundles are not implemented",
        ))
    }

    async fn validate_jwtsvid(
        &self,
        request: Request<ValidateJwtsvidRequest>,
    ) -> Result<Response<ValidateJwtsvidResponse>, Status> {
        check_header(&request)?;
        Err(Status::unimplemented(
            "meshca-agent serves X.509-SVIDs only; JWT-SVID validation is not implemented",
        ))
    }
}
