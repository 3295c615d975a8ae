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
    /// The CA answered with an error (a gRPC status it sent).
    #[error("the CA refused: {code:?}: {message}")]
    Rpc {
        /// gRPC status code.
        code: tonic::Code,
        /// The CA's message.
        message: String,
    },
    /// The CA could not be reached, or did not answer in time: a status
    /// made on this side (connection refused, TLS failure, timeout).
    #[error("could not reach the CA: {code:?}: {message}")]
    Unreachable {
        /// gRPC status code tonic gave the failure.
        code: tonic::Code,
        /// What failed, with its causes.
        message: String,
    },
    /// The CA's answer is not a valid certificate for us.
    #[error("the CA's answer is not acceptable: {0}")]
    BadAnswer(String),
    /// The CA's answer chains through a certificate the CA's CRL lists
    /// (`CaClient::with_crl`): it is not published.
    #[error("the CA's answer is revoked: the CRL lists the {certificate}'s serial {serial}; not published")]
    Revoked {
        /// Which certificate of the chain: `leaf`, or `intermediate N`
        /// (from 1, above the leaf).
        certificate: String,
        /// Its serial, hex.
        serial: String,
    },
}

impl From<FileError> for ClientError {
    fn from(e: FileError) -> Self {
        Self::RootBundle(e)
    }
}

impl ClientError {
    /// The gRPC code of a failed call (from the CA or made locally), if
    /// the failure was a call's.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Self::Rpc { code, .. } | Self::Unreachable { code, .. } => Some(*code),
            _ => None,
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

impl From<tonic::Status> for ClientError {
    /// A status the CA sent is [`ClientError::Rpc`]; one tonic made from a
    /// transport failure (it carries the failure as its source) is
    /// [`ClientError::Unreachable`].
    fn from(s: tonic::Status) -> Self {
        let Some(source) = std::error::Error::source(&s) else {
            return Self::Rpc {
                code: s.code(),
                message: s.message().to_string(),
            };
        };
        // The causes the message does not already say, innermost last.
        let mut message = s.message().to_string();
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source);
        while let Some(error) = cause {
            let text = error.to_string();
            if !message.contains(&text) {
                message = format!("{message}: {text}");
            }
            cause = error.source();
        }
        Self::Unreachable {
            code: s.code(),
            message: describe_tls_failure(&message),
        }
    }
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
        assert!(err.starts_with("could not reach the CA: "), "{err}");
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

    #[test]
    fn a_status_from_the_ca_is_a_refusal_and_a_local_one_is_unreachable() {
        let refused = ClientError::from(tonic::Status::permission_denied("not yours"));
        assert!(matches!(
            refused,
            ClientError::Rpc {
                code: tonic::Code::PermissionDenied,
                ..
            }
        ));
        assert_eq!(
            refused.to_string(),
            "the CA refused: PermissionDenied: not yours"
        );
        // What tonic makes of a connection failure: a status with a source.
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let mut local = tonic::Status::unavailable("tcp connect error");
        local.set_source(std::sync::Arc::new(io));
        let unreachable = ClientError::from(local);
        assert_eq!(unreachable.code(), Some(tonic::Code::Unavailable));
        let text = unreachable.to_string();
        assert!(
            text.starts_with("could not reach the CA: Unavailable: tcp connect error"),
            "{text}"
        );
        assert!(!text.contains("refused: "), "{text}");
    }
}
