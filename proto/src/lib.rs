//! The wire contract of meshca: Istio's `istio.v1.auth` CA service, and the
//! SPIFFE Workload API that `meshca-agent` serves ([`spiffe_workload`]).
//!
//! Package `istio.v1.auth`, service `IstioCertificateService`, one RPC
//! `CreateCertificate`, with field names and numbers exactly as Istio's
//! `security/v1alpha1/ca.proto`, so an unmodified Istio agent or ztunnel
//! can use meshca as its CA. The code is generated at build time with
//! `protox` and `tonic-prost-build`: no system `protoc` is needed.
//!
//! ```
//! use meshca_proto::istio::v1::auth::IstioCertificateRequest;
//!
//! let request = IstioCertificateRequest {
//!     csr: "-----BEGIN CERTIFICATE REQUEST-----\n...".to_string(),
//!     validity_duration: 3600,
//!     metadata: None,
//! };
//! assert_eq!(request.validity_duration, 3600);
//! ```

pub mod codec;

/// Generated protobuf packages, laid out as their proto package names.
pub mod istio {
    /// `istio.v1`
    pub mod v1 {
        /// `istio.v1.auth`: the CA service.
        #[allow(missing_docs, unreachable_pub, clippy::all, clippy::unwrap_used)]
        pub mod auth {
            tonic::include_proto!("istio.v1.auth");
        }
    }
}

/// meshca's own services (`meshca.v1`): `JwtSvidService`, JWT-SVIDs minted
/// by the CA on its gRPC port.
pub mod meshca {
    /// `meshca.v1`
    #[allow(missing_docs, unreachable_pub, clippy::all, clippy::unwrap_used)]
    pub mod v1 {
        tonic::include_proto!("meshca.v1");
    }
}

/// The SPIFFE Workload API (`SpiffeWorkloadAPI`, from the SPIFFE project's
/// `workload.proto`; the proto has no package). Servers must refuse calls
/// without the [`WORKLOAD_API_HEADER`] metadata.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::unwrap_used)]
pub mod spiffe_workload {
    tonic::include_proto!("_");
}

pub use istio::v1::auth::{IstioCertificateRequest, IstioCertificateResponse};

/// The metadata key every SPIFFE Workload API call carries (value `true`),
/// so that a server can tell a workload's call from a forwarded one.
pub const WORKLOAD_API_HEADER: &str = "workload.spiffe.io";

/// The full gRPC method path that Istio agents and ztunnel call.
pub const CREATE_CERTIFICATE_PATH: &str =
    "/istio.v1.auth.IstioCertificateService/CreateCertificate";

/// The full gRPC method path of meshca's `MintJwtSvid`.
pub const MINT_JWT_SVID_PATH: &str = "/meshca.v1.JwtSvidService/MintJwtSvid";

/// The request metadata key carrying the identity a node agent asks for.
pub const IMPERSONATED_IDENTITY_KEY: &str = "ImpersonatedIdentity";

/// The request metadata key Istio agents send for a custom signer (ignored).
pub const CERT_SIGNER_KEY: &str = "CertSigner";
