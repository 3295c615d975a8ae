//! A scripted fake CA: a real tonic server over TLS on 127.0.0.1:0 whose
//! answers the test chooses, good or deliberately wrong, to check that
//! clients refuse bad answers.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use meshca_certs::profile::{self_signed_root, SigningCa, SubjectKey, SubjectName, Validity};
use meshca_certs::{KeyAlgorithm, PrivateKey, SpiffeId, VerifiedCsr};
use meshca_proto::istio::v1::auth::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use meshca_proto::{IstioCertificateRequest, IstioCertificateResponse};
use time::OffsetDateTime;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status};

/// What the fake CA answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeAnswer {
    /// A correct SVID for the CSR's key and URI SAN.
    Good,
    /// A certificate for another key.
    WrongKey,
    /// A certificate for another SPIFFE ID.
    WrongSan,
    /// The CA certificate itself as the leaf.
    CaAsLeaf,
    /// A correct-looking SVID signed by a CA the client does not trust.
    ForeignRoot,
    /// An SVID that expired yesterday.
    Expired,
    /// An empty chain.
    EmptyChain,
    /// An error status.
    Error(tonic::Code),
}

struct FakeCaService {
    ca: SigningCa,
    foreign: SigningCa,
    answer: Arc<Mutex<FakeAnswer>>,
    requests: Arc<std::sync::atomic::AtomicUsize>,
}

fn make_root(cn: &str) -> SigningCa {
    let key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).expect("key");
    let name = SubjectName {
        common_name: Some(cn.to_string()),
        ..Default::default()
    };
    let root = self_signed_root(
        &key,
        &name,
        Validity::backdated(OffsetDateTime::now_utc(), time::Duration::days(30)),
    )
    .expect("root");
    SigningCa::new(root.der, key).expect("signing CA")
}

#[tonic::async_trait]
impl IstioCertificateService for FakeCaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        self.requests
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let answer = *self
            .answer
            .lock()
            .map_err(|_| Status::internal("poisoned"))?;
        let csr = VerifiedCsr::from_pem(&request.get_ref().csr)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let id = csr
            .uri_sans()
            .first()
            .cloned()
            .ok_or_else(|| Status::invalid_argument("no URI SAN"))?;
        let now = OffsetDateTime::now_utc();
        let good = Validity::backdated(now, time::Duration::hours(1));
        let pem = |der: &[u8]| meshca_certs::bundle::encode_cert_pem(der);
        let issue = |ca: &SigningCa, key: &SubjectKey, id: &SpiffeId, v: Validity| {
            ca.issue_workload(key, id, v)
                .map(|c| c.der)
                .map_err(|e| Status::internal(e.to_string()))
        };
        let chain = match answer {
            FakeAnswer::Good => vec![
                issue(&self.ca, csr.subject_key(), &id, good)?,
                self.ca.cert_der().to_vec(),
            ],
            FakeAnswer::WrongKey => {
                let other = PrivateKey::generate(KeyAlgorithm::EcdsaP256)
                    .map_err(|e| Status::internal(e.to_string()))?;
                let other = SubjectKey::of(&other).map_err(|e| Status::internal(e.to_string()))?;
                vec![
                    issue(&self.ca, &other, &id, good)?,
                    self.ca.cert_der().to_vec(),
                ]
            }
            FakeAnswer::WrongSan => {
                let other = SpiffeId::parse("spiffe://cluster.local/ns/other/sa/other")
                    .map_err(|e| Status::internal(e.to_string()))?;
                vec![
                    issue(&self.ca, csr.subject_key(), &other, good)?,
                    self.ca.cert_der().to_vec(),
                ]
            }
            FakeAnswer::CaAsLeaf => vec![self.ca.cert_der().to_vec(), self.ca.cert_der().to_vec()],
            FakeAnswer::ForeignRoot => vec![
                issue(&self.foreign, csr.subject_key(), &id, good)?,
                self.foreign.cert_der().to_vec(),
            ],
            FakeAnswer::Expired => {
                let past =
                    Validity::backdated(now - time::Duration::days(2), time::Duration::hours(1));
                vec![
                    issue(&self.ca, csr.subject_key(), &id, past)?,
                    self.ca.cert_der().to_vec(),
                ]
            }
            FakeAnswer::EmptyChain => vec![],
            FakeAnswer::Error(code) => return Err(Status::new(code, "scripted error")),
        };
        Ok(Response::new(IstioCertificateResponse {
            cert_chain: chain.iter().map(|d| pem(d)).collect(),
        }))
    }
}

/// A running fake CA.
pub struct FakeCa {
    /// Its address.
    pub addr: SocketAddr,
    /// PEM of the root that signs its TLS certificate and its good answers.
    pub root_pem: String,
    answer: Arc<Mutex<FakeAnswer>>,
    requests: Arc<std::sync::atomic::AtomicUsize>,
    _shutdown: tokio::sync::oneshot::Sender<()>,
}

impl FakeCa {
    /// Starts a fake CA answering `answer` until changed.
    pub async fn start(answer: FakeAnswer) -> Self {
        let ca = make_root("fake CA");
        let foreign = make_root("foreign CA");
        let server_key = PrivateKey::generate(KeyAlgorithm::EcdsaP256).expect("key");
        let server_cert = ca
            .issue_server(
                &SubjectKey::of(&server_key).expect("key"),
                &["localhost".to_string()],
                &["127.0.0.1".parse().expect("ip")],
                Validity::backdated(OffsetDateTime::now_utc(), time::Duration::hours(1)),
            )
            .expect("server cert");
        let root_pem = meshca_certs::bundle::encode_cert_pem(ca.cert_der());
        let answer = Arc::new(Mutex::new(answer));
        let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let service = FakeCaService {
            ca,
            foreign,
            answer: answer.clone(),
            requests: requests.clone(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let tls = ServerTlsConfig::new().identity(Identity::from_pem(
            server_cert.to_pem(),
            server_key.to_pkcs8_pem(),
        ));
        tokio::spawn(async move {
            let _ = Server::builder()
                .tls_config(tls)
                .expect("tls")
                .add_service(IstioCertificateServiceServer::new(service))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async {
                        let _ = rx.await;
                    },
                )
                .await;
        });
        Self {
            addr,
            root_pem,
            answer,
            requests,
            _shutdown: tx,
        }
    }

    /// How many requests it has received.
    pub fn requests(&self) -> usize {
        self.requests.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Changes what it answers.
    pub fn answer(&self, answer: FakeAnswer) {
        if let Ok(mut a) = self.answer.lock() {
            *a = answer;
        }
    }
}
