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
    RootBundle(FileError),
    /// The token file could not be read.
    #[error("cannot read the token file {path}: {cause}")]
    Token {
        /// The file.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
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
    /// The CA could not be reached or its TLS certificate was not
    /// trusted: the call failed here, not at the CA.
    #[error("could not talk to the CA: {0}")]
    Unreachable(String),
    /// The CA's answer is not a valid certificate for us.
    #[error("the CA's answer is not acceptable: {0}")]
    BadAnswer(String),
}

impl From<FileError> for ClientError {
    fn from(e: FileError) -> Self {
        Self::RootBundle(e)
    }
}

impl From<tonic::Status> for ClientError {
    fn from(s: tonic::Status) -> Self {
        // A status with a source was made here from a transport failure
        // (connection, TLS handshake): the CA did not refuse anything.
        if let Some(source) = std::error::Error::source(&s) {
            let mut text = s.message().to_string();
            let chain = meshca_certs::error_chain(source);
            if !text.contains(&chain) {
                text = if text.is_empty() {
                    chain
                } else {
                    format!("{text}: {chain}")
                };
            }
            return Self::Unreachable(describe_tls_failure(&text));
        }
        Self::Rpc {
            code: s.code(),
            message: s.message().to_string(),
        }
    }
}

/// rustls reports a refused server certificate as `invalid peer
/// certificate: <Debug of the reason>`; this says the common reasons in
/// words, with the name in parentheses.
pub(crate) fn describe_tls_failure(text: &str) -> String {
    const MARK: &str = "invalid peer certificate: ";
    const PLAIN: [(&str, &str); 7] = [
        (
            "UnknownIssuer",
            "the CA's TLS certificate does not chain to a root in the bundle it was checked against (--root-cert)",
        ),
        ("Expired", "the CA's TLS certificate has expired"),
        ("NotValidYet", "the CA's TLS certificate is not valid yet"),
        (
            "NotValidForName",
            "the CA's TLS certificate is not valid for the name in the CA address (set --server-name?)",
        ),
        (
            "BadSignature",
            "a signature in the CA's TLS certificate chain does not verify",
        ),
        (
            "PathLenConstraintViolated",
            "the CA's TLS certificate chain breaks a CA's basicConstraints pathLenConstraint",
        ),
        (
            "UnsupportedSignatureAlgorithm",
            "the CA's TLS certificate chain is signed with an algorithm the roots' key type cannot have made",
        ),
    ];
    let Some(at) = text.find(MARK) else {
        return text.to_string();
    };
    let detail = &text[at + MARK.len()..];
    for (name, plain) in PLAIN {
        if detail.starts_with(name) || detail.contains(&format!("({name}")) {
            return format!("{}{plain} ({name})", &text[..at]);
        }
    }
    text.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_failures_are_said_in_words() {
        let text = describe_tls_failure("transport error: invalid peer certificate: UnknownIssuer");
        assert_eq!(
            text,
            "transport error: the CA's TLS certificate does not chain to a root in the bundle it was checked against (--root-cert) (UnknownIssuer)"
        );
        let text = describe_tls_failure(
            "invalid peer certificate: Other(OtherError(PathLenConstraintViolated))",
        );
        assert!(
            text.contains("pathLenConstraint") && !text.contains("OtherError"),
            "{text}"
        );
        assert_eq!(
            describe_tls_failure("connection refused"),
            "connection refused"
        );
        // A status made from a local failure is not "the CA refused".
        let local = tonic::Status::from_error(Box::new(std::io::Error::other(
            "invalid peer certificate: UnknownIssuer",
        )));
        let err = ClientError::from(local).to_string();
        assert!(err.starts_with("could not talk to the CA: "), "{err}");
        assert!(
            !err.contains("refused") && err.contains("(UnknownIssuer)"),
            "{err}"
        );
        let remote = tonic::Status::permission_denied("no");
        assert_eq!(
            ClientError::from(remote).to_string(),
            "the CA refused: PermissionDenied: no"
        );
    }
}
