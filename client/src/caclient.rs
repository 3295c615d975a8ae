//! [`CaClient`]: a gRPC client of `IstioCertificateService` (meshca or
//! istiod) that generates a key and CSR, sends them with the caller's
//! bearer token, and verifies the answer before anyone uses it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use meshca_certs::answer::ChainAnswer;
use meshca_certs::bundle;
use meshca_certs::verify::verify_svid;
use meshca_certs::{build_csr, KeyAlgorithm, PrivateKey, SpiffeId, TrustBundle, VerifiedSvid};
use meshca_proto::istio::v1::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use meshca_proto::meshca::v1::jwt_svid_service_client::JwtSvidServiceClient;
use meshca_proto::meshca::v1::{FetchJwtBundleRequest, MintJwtSvidRequest};
use meshca_proto::{IstioCertificateRequest, IMPERSONATED_IDENTITY_KEY};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::issuer::{CertificateIssuer, ClientError, Svid};
use crate::workload_api::ServedCrl;

/// Default CA address.
pub const DEFAULT_CA_ADDR: &str = "https://127.0.0.1:15012";
/// Default token file (Istio's projected token path).
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/tokens/istio-token";

/// How to reach the CA.
#[derive(Debug, Clone)]
pub struct CaClientConfig {
    /// `https://host:port` of the CA.
    pub ca_addr: String,
    /// PEM bundle the CA's TLS certificate (and the issued chains) must chain to.
    pub root_cert: PathBuf,
    /// Name to verify the CA's certificate against (default: the address host).
    pub server_name: Option<String>,
    /// Bearer token file, read on every request; `None` sends no token.
    pub token_file: Option<PathBuf>,
    /// `clusterid` header, if any.
    pub cluster_id: Option<String>,
    /// Per-call timeout.
    pub timeout: Duration,
    /// What to ask for on each request.
    pub request: RequestOptions,
}

/// What a request asks for.
#[derive(Debug, Clone)]
pub struct RequestOptions {
    /// Key algorithm of the new key.
    pub algorithm: KeyAlgorithm,
    /// Requested lifetime (None: the CA's default).
    pub ttl: Option<Duration>,
    /// Send `ImpersonatedIdentity` (node-agent mode).
    pub impersonate: bool,
    /// Attempts per call for retryable codes (UNAVAILABLE,
    /// DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED); at least 1.
    pub attempts: u32,
    /// Delay before the first retry; doubles each time.
    pub retry_backoff: Duration,
}

impl Default for RequestOptions {
    fn default() -> Self {
        Self {
            algorithm: KeyAlgorithm::EcdsaP256,
            ttl: None,
            impersonate: false,
            attempts: 3,
            retry_backoff: Duration::from_millis(200),
        }
    }
}

/// Whether a status code is worth retrying.
pub(crate) fn is_retryable(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::ResourceExhausted
    )
}

/// The channel and bundle built from one version of the root file.
#[derive(Debug)]
struct Connection {
    client: IstioCertificateServiceClient<Channel>,
    /// meshca's JWT-SVID service, on the same channel.
    jwt: JwtSvidServiceClient<Channel>,
    bundle: TrustBundle,
    stamp: Option<(std::time::SystemTime, u64)>,
}

/// The CA's CRL as the client knows it (e.g. `meshca-agent --crl-file`).
pub type CrlSource = tokio::sync::watch::Receiver<Option<Arc<ServedCrl>>>;

/// The client. Cloning is cheap and shares the connection.
#[derive(Debug, Clone)]
pub struct CaClient {
    config: Arc<CaClientConfig>,
    connection: Arc<Mutex<Arc<Connection>>>,
    /// Every fetched chain is checked against it (none: not checked).
    crl: Option<CrlSource>,
}

fn file_stamp(path: &std::path::Path) -> Option<(std::time::SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

impl CaClient {
    /// Prepares a connection (made lazily, on the first call).
    pub fn new(config: CaClientConfig) -> Result<Self, ClientError> {
        let connection = Self::connect(&config)?;
        Ok(Self {
            config: Arc::new(config),
            connection: Arc::new(Mutex::new(Arc::new(connection))),
            crl: None,
        })
    }

    /// Checks every fetched chain against the CRL `crl` holds at the time
    /// (the CA's `ca-crl.pem` or a mounted `istio-ca-crl`, read by
    /// [`crate::workload_api::watch_crl_file`]): a chain whose leaf or
    /// intermediate it lists is refused with [`ClientError::Revoked`] and
    /// never reaches the manager's subscribers, the socket or the files.
    /// The CRL applies only while a CA of the chain signed it and it is
    /// not past its nextUpdate ([`ServedCrl::check_chain`]).
    pub fn with_crl(mut self, crl: CrlSource) -> Self {
        self.crl = Some(crl);
        self
    }

    fn connect(config: &CaClientConfig) -> Result<Connection, ClientError> {
        let stamp = file_stamp(&config.root_cert);
        let roots = bundle::read_certs_file(&config.root_cert)?;
        let bundle = TrustBundle::new(roots);
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(bundle.to_pem()));
        if let Some(name) = &config.server_name {
            tls = tls.domain_name(name.clone());
        }
        let endpoint = Endpoint::from_shared(config.ca_addr.clone())
            .map_err(|e| ClientError::Config(format!("CA address {:?}: {e}", config.ca_addr)))?
            .tls_config(tls)
            .map_err(|e| ClientError::Config(format!("TLS configuration: {e}")))?
            .timeout(config.timeout)
            .connect_timeout(config.timeout);
        let channel = endpoint.connect_lazy();
        Ok(Connection {
            jwt: JwtSvidServiceClient::new(channel.clone()),
            client: IstioCertificateServiceClient::new(channel),
            bundle,
            stamp,
        })
    }

    /// The connection for the current root file: rebuilt when the file
    /// changed (a rotated bundle), kept when the new file is unreadable.
    fn current(&self) -> Arc<Connection> {
        let mut guard = self.connection.lock().unwrap_or_else(|e| e.into_inner());
        let stamp = file_stamp(&self.config.root_cert);
        if stamp.is_some() && stamp != guard.stamp {
            match Self::connect(&self.config) {
                Ok(fresh) => {
                    tracing::info!(root_cert = %self.config.root_cert.display(), "root bundle changed; reconnecting");
                    *guard = Arc::new(fresh);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "root bundle changed but cannot be used; keeping the previous one")
                }
            }
        }
        guard.clone()
    }

    /// The trust bundle in use.
    pub fn bundle(&self) -> TrustBundle {
        self.current().bundle.clone()
    }

    /// Requests a certificate for `identity` with the configured options.
    pub async fn fetch_default(&self, identity: &SpiffeId) -> Result<Svid, ClientError> {
        let o = &self.config.request;
        self.fetch(identity, o.algorithm, o.ttl, o.impersonate)
            .await
    }

    /// Requests a certificate for `identity` with a new `algorithm` key.
    /// `ttl` is the requested lifetime (None: the CA's default).
    /// `impersonate` sends `ImpersonatedIdentity` (node-agent mode).
    pub async fn fetch(
        &self,
        identity: &SpiffeId,
        algorithm: KeyAlgorithm,
        ttl: Option<Duration>,
        impersonate: bool,
    ) -> Result<Svid, ClientError> {
        let key = PrivateKey::generate(algorithm).map_err(|e| ClientError::Csr(e.to_string()))?;
        let csr = build_csr(&key, identity).map_err(|e| ClientError::Csr(e.to_string()))?;
        let metadata = impersonate.then(|| prost_types::Struct {
            fields: BTreeMap::from([(
                IMPERSONATED_IDENTITY_KEY.to_string(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(identity.to_string())),
                },
            )]),
        });
        let mut request = tonic::Request::new(IstioCertificateRequest {
            csr,
            validity_duration: ttl.map(|d| d.as_secs() as i64).unwrap_or(0),
            metadata,
        });
        self.add_credentials(&mut request)?;
        let connection = self.current();
        let attempts = self.config.request.attempts.max(1);
        let mut backoff = self.config.request.retry_backoff;
        let mut attempt = 1;
        let response = loop {
            let mut again = tonic::Request::new(request.get_ref().clone());
            *again.metadata_mut() = request.metadata().clone();
            // The whole call is bounded, the connection and its TLS
            // handshake included: tonic's own timeouts cover the TCP
            // connect and the call on a ready connection, not a CA that
            // accepts and then says nothing.
            let mut client = connection.client.clone();
            let call = client.create_certificate(again);
            let result = match tokio::time::timeout(self.config.timeout, call).await {
                Ok(result) => result.map_err(ClientError::from),
                Err(_) => Err(ClientError::Unreachable {
                    code: tonic::Code::DeadlineExceeded,
                    message: format!(
                        "no answer within {:?} (connecting, the TLS handshake or the call)",
                        self.config.timeout
                    ),
                }),
            };
            let result = result.map_err(|e| self.explained(e));
            match result {
                Ok(response) => break response.into_inner(),
                Err(e) if attempt < attempts && e.code().is_some_and(is_retryable) => {
                    tracing::debug!(identity = %identity, code = ?e.code(), attempt, "retrying");
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        };
        let checked = check_answer(
            &key,
            identity,
            &response.cert_chain,
            &connection.bundle,
            SystemTime::now(),
        )?;
        let svid = Svid {
            key,
            chain_pem: response.cert_chain,
            bundle: checked.roots,
            leaf: checked.leaf,
        };
        let crl = self.crl.as_ref().and_then(|crl| crl.borrow().clone());
        if let Some(crl) = crl {
            if let Err(e) = crl.check_chain(&svid, time::OffsetDateTime::now_utc()) {
                tracing::error!(identity = %identity, serial = %svid.leaf.serial_hex, error = %e, "the CA's answer is listed in its CRL; refused, not published");
                return Err(e);
            }
        }
        Ok(svid)
    }
}

/// A JWT-SVID as the CA answered it.
#[derive(Clone)]
pub struct MintedJwtSvid {
    /// The token (a bearer credential: never logged).
    pub token: String,
    /// Its `sub`.
    pub spiffe_id: SpiffeId,
    /// Its `iat`, Unix seconds.
    pub issued_at: i64,
    /// Its `exp`, Unix seconds.
    pub expires_at: i64,
}

impl std::fmt::Debug for MintedJwtSvid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MintedJwtSvid")
            .field("spiffe_id", &self.spiffe_id)
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

/// The trust domain's JWT bundle as the CA answered it.
#[derive(Debug, Clone)]
pub struct JwtBundleAnswer {
    /// The JWKS (JSON, `use: jwt-svid`).
    pub jwks: Vec<u8>,
    /// How long it may be kept before it is fetched again.
    pub refresh_hint: Duration,
}

impl CaClient {
    /// The caller's credentials on `request`: the bearer token read from
    /// the token file now (projected tokens rotate), and `clusterid`.
    fn add_credentials<T>(&self, request: &mut tonic::Request<T>) -> Result<(), ClientError> {
        if let Some(path) = &self.config.token_file {
            let token = std::fs::read_to_string(path).map_err(|cause| ClientError::Token {
                path: path.clone(),
                cause,
            })?;
            if token.trim().is_empty() {
                return Err(ClientError::Config(format!(
                    "token file {} is empty",
                    path.display()
                )));
            }
            let value = format!("Bearer {}", token.trim()).parse().map_err(|_| {
                ClientError::Config(format!(
                    "token file {} holds invalid characters",
                    path.display()
                ))
            })?;
            request.metadata_mut().insert("authorization", value);
        }
        if let Some(cluster) = &self.config.cluster_id {
            let value = cluster.parse().map_err(|_| {
                ClientError::Config(format!(
                    "cluster ID {cluster:?} is not a valid header value"
                ))
            })?;
            request.metadata_mut().insert("clusterid", value);
        }
        Ok(())
    }

    /// Bounds `call` by the configured timeout, the connection included.
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, ClientError> {
        match tokio::time::timeout(self.config.timeout, call).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(self.explained(ClientError::from(status))),
            Err(_) => Err(self.explained(ClientError::Unreachable {
                code: tonic::Code::DeadlineExceeded,
                message: format!(
                    "no answer within {:?} (connecting, the TLS handshake or the call)",
                    self.config.timeout
                ),
            })),
        }
    }

    /// A JWT-SVID for `identity` (impersonated in node-agent mode) with
    /// `audiences`, living `ttl` (None: the CA's default). The answer's
    /// SPIFFE ID must be `identity`.
    pub async fn mint_jwt_svid(
        &self,
        identity: &SpiffeId,
        audiences: &[String],
        ttl: Option<Duration>,
    ) -> Result<MintedJwtSvid, ClientError> {
        let mut request = tonic::Request::new(MintJwtSvidRequest {
            audiences: audiences.to_vec(),
            lifetime_seconds: ttl.map(|d| d.as_secs() as i64).unwrap_or(0),
            impersonated_identity: if self.config.request.impersonate {
                identity.to_string()
            } else {
                String::new()
            },
        });
        self.add_credentials(&mut request)?;
        let mut client = self.current().jwt.clone();
        let answer = self.bounded(client.mint_jwt_svid(request)).await?;
        let spiffe_id = SpiffeId::parse(&answer.spiffe_id)
            .map_err(|e| ClientError::BadAnswer(format!("the JWT-SVID's SPIFFE ID: {e}")))?;
        if &spiffe_id != identity {
            return Err(ClientError::BadAnswer(format!(
                "a JWT-SVID for {spiffe_id}, not the {identity} asked for"
            )));
        }
        if answer.expires_at <= answer.issued_at || answer.token.split('.').count() != 3 {
            return Err(ClientError::BadAnswer(
                "the JWT-SVID is not a signed JWT with a lifetime".into(),
            ));
        }
        Ok(MintedJwtSvid {
            token: answer.token,
            spiffe_id,
            issued_at: answer.issued_at,
            expires_at: answer.expires_at,
        })
    }

    /// The trust domain's JWT bundle.
    pub async fn fetch_jwt_bundle(&self) -> Result<JwtBundleAnswer, ClientError> {
        let mut request = tonic::Request::new(FetchJwtBundleRequest {});
        self.add_credentials(&mut request)?;
        let mut client = self.current().jwt.clone();
        let answer = self.bounded(client.fetch_jwt_bundle(request)).await?;
        Ok(JwtBundleAnswer {
            jwks: answer.jwks,
            refresh_hint: Duration::from_secs(
                u64::try_from(answer.refresh_hint_seconds).unwrap_or(0),
            ),
        })
    }
}

impl CaClient {
    /// Adds what only this side knows to a failure: which token file the
    /// CA refused, or that a plain `http://` address met a TLS server.
    fn explained(&self, e: ClientError) -> ClientError {
        match e {
            ClientError::Rpc {
                code: tonic::Code::Unauthenticated,
                message,
            } => match &self.config.token_file {
                Some(path) => ClientError::Rpc {
                    code: tonic::Code::Unauthenticated,
                    message: format!("{message} (the token read from {})", path.display()),
                },
                None => ClientError::Rpc {
                    code: tonic::Code::Unauthenticated,
                    message,
                },
            },
            ClientError::Unreachable { code, message }
                if self.config.ca_addr.starts_with("http://") =>
            {
                ClientError::Unreachable {
                    code,
                    message: format!(
                        "{message} (the CA address is plain http://; meshca speaks TLS only: use https://)"
                    ),
                }
            }
            other => other,
        }
    }
}

/// What a checked answer gives.
#[derive(Debug, Clone)]
pub struct CheckedAnswer {
    /// What the leaf says.
    pub leaf: VerifiedSvid,
    /// Every root of the answer's last element, in order.
    pub roots: TrustBundle,
}

/// Checks a CA answer: `[leaf, intermediates..., roots]` with the leaf alone
/// in its element; the leaf's key is `key`, its only URI SAN is
/// `identity`, it is not a CA; the chain verifies at `now` to `bundle` (the
/// roots this client trusts) and to the roots of the answer's last element
/// (the roots it will hand on, which must cover its own certificate).
/// The last element may hold several roots, as during a root rotation.
pub fn check_answer(
    key: &PrivateKey,
    identity: &SpiffeId,
    chain_pem: &[String],
    bundle: &TrustBundle,
    now: SystemTime,
) -> Result<CheckedAnswer, ClientError> {
    let answer =
        ChainAnswer::parse(chain_pem).map_err(|e| ClientError::BadAnswer(e.to_string()))?;
    let leaf_der = &answer.leaf;
    meshca_certs::verify::check_svid_leaf(leaf_der)
        .map_err(|e| ClientError::BadAnswer(e.to_string()))?;
    let summary = meshca_certs::inspect::CertSummary::from_der(leaf_der)
        .map_err(|e| ClientError::BadAnswer(e.to_string()))?;
    let leaf_spki = x509_spki(leaf_der)
        .ok_or_else(|| ClientError::BadAnswer("leaf has no public key".into()))?;
    if leaf_spki != key.public_key_spki_der() {
        return Err(ClientError::BadAnswer(
            "the leaf certificate's public key is not the key we sent".into(),
        ));
    }
    // Every certificate of the answer may link the leaf to a root we trust.
    let all: Vec<Vec<u8>> = answer
        .presented_chain()
        .into_iter()
        .chain(answer.roots.roots().iter().cloned())
        .collect();
    let verified = verify_svid(&all, bundle, now, Some(identity))
        .map_err(|e| ClientError::BadAnswer(e.to_string()))?;
    verify_svid(
        &answer.presented_chain(),
        &answer.roots,
        now,
        Some(identity),
    )
    .map_err(|e| {
        ClientError::BadAnswer(format!(
            "the roots in the last chain element do not cover the certificate itself: {e}"
        ))
    })?;
    if summary.not_after <= summary.not_before {
        return Err(ClientError::BadAnswer(
            "the leaf's validity is empty".into(),
        ));
    }
    Ok(CheckedAnswer {
        leaf: verified,
        roots: answer.roots,
    })
}

fn x509_spki(der: &[u8]) -> Option<Vec<u8>> {
    meshca_certs::inspect::spki_der(der)
}

#[async_trait::async_trait]
impl CertificateIssuer for CaClient {
    async fn fetch(&self, identity: &SpiffeId) -> Result<Svid, ClientError> {
        self.fetch_default(identity).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshca_certs::bundle::encode_cert_pem;
    use meshca_certs::profile::{self_signed_root, SigningCa, SubjectKey, SubjectName, Validity};
    use time::OffsetDateTime;

    fn root_ca(cn: &str) -> SigningCa {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let name = SubjectName {
            common_name: Some(cn.into()),
            ..Default::default()
        };
        let v = Validity::backdated(OffsetDateTime::now_utc(), time::Duration::days(1));
        let root = self_signed_root(&key, &name, v).unwrap();
        SigningCa::new(root.der, key).unwrap()
    }

    fn id() -> SpiffeId {
        SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web").unwrap()
    }

    /// A key and its certificate from `ca`, PEM.
    fn leaf(ca: &SigningCa) -> (PrivateKey, String) {
        let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let v = Validity::backdated(OffsetDateTime::now_utc(), time::Duration::hours(1));
        let cert = ca
            .issue_workload(&SubjectKey::of(&key).unwrap(), &id(), v)
            .unwrap();
        (key, cert.to_pem())
    }

    fn roots(cas: &[&SigningCa]) -> String {
        cas.iter()
            .map(|ca| encode_cert_pem(ca.cert_der()))
            .collect()
    }

    #[test]
    fn a_multi_root_last_element_is_accepted_and_every_root_handed_on() {
        let (old, new) = (root_ca("old"), root_ca("new"));
        let trusted = TrustBundle::new(vec![old.cert_der().to_vec()]);
        // Announced phase: signed by the old root, both roots in the answer.
        let (key, cert) = leaf(&old);
        let chain = vec![cert, roots(&[&old, &new])];
        let checked = check_answer(&key, &id(), &chain, &trusted, SystemTime::now()).unwrap();
        assert_eq!(checked.leaf.spiffe_id, id());
        assert_eq!(
            checked.roots.roots(),
            &[old.cert_der().to_vec(), new.cert_der().to_vec()]
        );

        // And `root-cert.pem` gets both, `cert-chain.pem` the leaf alone.
        let svid = Svid {
            key,
            chain_pem: chain.clone(),
            bundle: checked.roots,
            leaf: checked.leaf,
        };
        let dir = tempfile::tempdir().unwrap();
        crate::output::write_credentials(dir.path(), &svid).unwrap();
        let written = std::fs::read_to_string(dir.path().join("root-cert.pem")).unwrap();
        assert_eq!(written, chain[1]);
        let chain_file = std::fs::read_to_string(dir.path().join("cert-chain.pem")).unwrap();
        assert_eq!(chain_file, chain[0]);
    }

    #[test]
    fn roots_that_do_not_cover_the_leaf_or_no_roots_at_all_are_refused() {
        let (old, new) = (root_ca("old"), root_ca("new"));
        let trusted = TrustBundle::new(vec![old.cert_der().to_vec()]);
        let (key, cert) = leaf(&old);
        // The last element names only a root the leaf does not chain to.
        let err = check_answer(
            &key,
            &id(),
            &[cert.clone(), roots(&[&new])],
            &trusted,
            SystemTime::now(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("do not cover"), "{err}");
        // The leaf alone.
        let err = check_answer(&key, &id(), &[cert], &trusted, SystemTime::now())
            .unwrap_err()
            .to_string();
        assert!(err.contains("only the leaf"), "{err}");
        // Signed by a root the client does not trust, even if the answer
        // lists it among its roots.
        let (key, cert) = leaf(&new);
        let err = check_answer(
            &key,
            &id(),
            &[cert, roots(&[&new, &old])],
            &trusted,
            SystemTime::now(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("does not chain"), "{err}");
    }

    /// The agent library's CRL check: a chain whose leaf its CA's CRL
    /// lists, or whose intermediate the root's CRL lists, is refused; a
    /// CRL of another CA, or a stale one, checks nothing.
    #[test]
    fn a_chain_the_crl_lists_is_refused_before_it_is_handed_on() {
        use meshca_certs::crl::{encode_crl_pem, sign_crl_with_ca_key, CrlTimes, RevokedCert};
        use meshca_certs::revocation::{RevocationReason, Serial};
        let root = root_ca("Root");
        let mid_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).unwrap();
        let now = OffsetDateTime::now_utc();
        let mid_cert = root
            .issue_ca(
                &SubjectKey::of(&mid_key).unwrap(),
                &SubjectName {
                    common_name: Some("Intermediate".into()),
                    ..Default::default()
                },
                Some(0),
                Validity::backdated(now, time::Duration::hours(2)),
            )
            .unwrap();
        let mid = SigningCa::new(mid_cert.der.clone(), mid_key).unwrap();
        let (key, leaf_pem) = leaf(&mid);
        let chain = vec![leaf_pem, mid_cert.to_pem(), roots(&[&root])];
        let trusted = TrustBundle::new(vec![root.cert_der().to_vec()]);
        let checked = check_answer(&key, &id(), &chain, &trusted, SystemTime::now()).unwrap();
        let svid = Svid {
            key,
            chain_pem: chain,
            bundle: checked.roots,
            leaf: checked.leaf,
        };
        let crl = |ca: &SigningCa, serials: &[&str], next_update: time::Duration| {
            let this_update = now.replace_nanosecond(0).unwrap() - time::Duration::hours(3);
            let revoked: Vec<RevokedCert> = serials
                .iter()
                .map(|s| RevokedCert {
                    serial: Serial::parse(s).unwrap(),
                    revoked_at: this_update,
                    reason: RevocationReason::KeyCompromise,
                })
                .collect();
            let times = CrlTimes {
                number: 1,
                this_update,
                next_update: now + next_update,
            };
            let der = sign_crl_with_ca_key(ca.cert_der(), ca.key(), &revoked, times).unwrap();
            ServedCrl::from_pem(&encode_crl_pem(&der)).unwrap()
        };
        let hour = time::Duration::hours(1);
        let leaf_serial = svid.leaf.serial_hex.clone();
        // The issuing CA's CRL lists the leaf.
        let err = crl(&mid, &[&leaf_serial], hour)
            .check_chain(&svid, now)
            .unwrap_err();
        assert!(
            matches!(&err, ClientError::Revoked { certificate, serial }
                if certificate == "leaf" && Serial::parse(serial).unwrap() == Serial::parse(&leaf_serial).unwrap()),
            "{err:?}"
        );
        assert!(err.to_string().contains("not published"), "{err}");
        // The root's CRL lists the intermediate.
        let err = crl(&root, &[&mid_cert.serial_hex], hour)
            .check_chain(&svid, now)
            .unwrap_err();
        assert!(
            matches!(&err, ClientError::Revoked { certificate, .. } if certificate == "intermediate 1"),
            "{err:?}"
        );
        // The root's CRL naming the leaf's serial: not the root's to list.
        crl(&root, &[&leaf_serial], hour)
            .check_chain(&svid, now)
            .unwrap();
        // Nothing listed, another CA's CRL, a stale CRL: accepted.
        crl(&mid, &["01"], hour).check_chain(&svid, now).unwrap();
        crl(&root_ca("Other"), &[&leaf_serial], hour)
            .check_chain(&svid, now)
            .unwrap();
        crl(&mid, &[&leaf_serial], -time::Duration::minutes(1))
            .check_chain(&svid, now)
            .unwrap();
    }

    /// A CA that accepts the connection and then says nothing (a paused
    /// process, a black hole behind a load balancer): the call still ends
    /// within its timeout, the TLS handshake included, as "could not reach".
    #[tokio::test]
    async fn a_ca_that_accepts_and_never_speaks_fails_the_call_in_time() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let held = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let root_cert = dir.path().join("root-cert.pem");
        std::fs::write(&root_cert, roots(&[&root_ca("Root")])).unwrap();
        let client = CaClient::new(CaClientConfig {
            ca_addr: format!("https://{addr}"),
            root_cert,
            server_name: Some("istiod.istio-system.svc".into()),
            token_file: None,
            cluster_id: None,
            timeout: Duration::from_millis(300),
            request: RequestOptions {
                attempts: 2,
                retry_backoff: Duration::from_millis(10),
                ..RequestOptions::default()
            },
        })
        .unwrap();
        let started = std::time::Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(10), client.fetch_default(&id()))
            .await
            .expect("the call must end by itself")
            .unwrap_err();
        assert!(
            matches!(
                err,
                ClientError::Unreachable {
                    code: tonic::Code::DeadlineExceeded,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("TLS handshake"), "{err}");
        // Two attempts of 300 ms and a 10 ms pause.
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        held.abort();
    }

    #[tokio::test]
    async fn an_empty_token_file_is_named_before_anything_is_sent() {
        let dir = tempfile::tempdir().unwrap();
        let root_cert = dir.path().join("root-cert.pem");
        std::fs::write(&root_cert, roots(&[&root_ca("Root")])).unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "\n").unwrap();
        let client = CaClient::new(CaClientConfig {
            // Nothing listens there: the error comes before any connection.
            ca_addr: "https://127.0.0.1:9".into(),
            root_cert,
            server_name: None,
            token_file: Some(token.clone()),
            cluster_id: None,
            timeout: Duration::from_secs(5),
            request: RequestOptions::default(),
        })
        .unwrap();
        let err = client.fetch_default(&id()).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("token file {} is empty", token.display())
        );
    }
}
