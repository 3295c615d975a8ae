//! The CA boundary: [`CertificateIssuer`] (the real [`crate::CaClient`], or
//! a scripted fake in tests), what it returns ([`Svid`]) and how it fails
//! ([`ClientError`]). The client and the manager both depend on this module
//! and not on each other.

use std::path::PathBuf;

use async_trait::async_trait;
use meshca_certs::bundle::FileError;
use meshca_certs::{PrivateKey, SpiffeId, TrustBundle, VerifiedSvid};

/// Something that issues certificates: the real [`crate::CaClient`], or a
/// fake in tests.
#[async_trait]
pub trait CertificateIssuer: Send + Sync + 'static {
    /// Fetches a fresh, verified certificate for `identity`.
    async fn fetch(&self, identity: &SpiffeId) -> Result<Svid, ClientError>;
}

/// A certificate from the CA, verified, with its key.
#[derive(Debug)]
pub struct Svid {
    /// The private key (ours, never sent).
    pub key: PrivateKey,
    /// The chain as the CA sent it, PEM: leaf first, then one element per
    /// intermediate, then one element holding every root to trust.
    pub chain_pem: Vec<String>,
    /// Every root of the answer's last element: what the CA says workloads
    /// must trust now (both roots during a root rotation). This is what
    /// `root-cert.pem` gets, as Istio's agent and ztunnel take it.
    pub bundle: TrustBundle,
    /// What the leaf says.
    pub leaf: VerifiedSvid,
}

/// Errors of the CA client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The configuration is unusable.
    #[error("{0}")]
    Config(String),
    /// The root bundle could not be read.
    #[error("root bundle: {0}")]
    RootBundle(#[from] FileError),
    /// The token file could not be read.
    #[error("cannot read the token file {path}: {source}")]
    Token {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Generating the key or CSR failed.
    #[error("generating the key or CSR failed: {0}")]
    Csr(String),
    /// The CA answered with an error.
    #[error("the CA refused: {code:?}: {message}")]
    Rpc {
        /// gRPC status code.
        code: tonic::Code,
        /// The CA's message.
        message: String,
    },
    /// The CA's answer is not a valid certificate for us.
    #[error("the CA's answer is not acceptable: {0}")]
    BadAnswer(String),
}

impl From<tonic::Status> for ClientError {
    fn from(s: tonic::Status) -> Self {
        Self::Rpc {
            code: s.code(),
            message: s.message().to_string(),
        }
    }
}
