//! # meshca-client
//!
//! The agent side of meshca: generate a key and CSR, ask the CA (meshca or
//! istiod, the wire is the same), verify the answer, write the files.
//!
//! - [`issuer`]: the CA boundary: [`CertificateIssuer`], [`Svid`], [`ClientError`];
//! - [`caclient`]: [`CaClient`], the gRPC client that verifies every answer;
//! - [`manager`]: [`CertManager`], rotation for one identity or thousands;
//! - [`output`]: Istio's `cert-chain.pem`, `key.pem`, `root-cert.pem`, replaced together as one (a `..data` symlink to a generation directory);
//! - [`workload_api`]: the SPIFFE Workload API and Envoy SDS on a Unix socket,
//!   in pod mode (one configured identity) or node mode (each caller attested).
//!
//! Public is only what other crates use (the `meshca-agent` binary, the
//! examples, the end-to-end tests) and the types their signatures name.
//! One exception: `CertManager::{subscribe, remove, len, is_empty,
//! in_flight}` and `CertState::svid` are public library API (docs/agent.md, "The
//! agent library (`meshca-client`)") although no crate here calls them.
//!
//! ```no_run
//! use std::time::Duration;
//! use meshca_certs::{KeyAlgorithm, SpiffeId};
//! use meshca_client::caclient::{CaClient, CaClientConfig};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let client = CaClient::new(CaClientConfig {
//!     ca_addr: "https://127.0.0.1:15012".into(),
//!     root_cert: "meshca-data/root-cert.pem".into(),
//!     server_name: None,
//!     token_file: Some("token".into()),
//!     cluster_id: None,
//!     timeout: Duration::from_secs(10),
//!     request: Default::default(),
//! })?;
//! let id = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/web")?;
//! let svid = client.fetch(&id, KeyAlgorithm::EcdsaP256, None, false).await?;
//! println!("serial {} until {}", svid.leaf.serial_hex, svid.leaf.not_after);
//! # Ok(())
//! # }
//! ```

pub mod caclient;
pub mod issuer;
pub mod manager;
pub mod output;
pub mod workload_api;

pub use caclient::{CaClient, CaClientConfig, RequestOptions};
pub use issuer::{CertificateIssuer, ClientError, Svid};
pub use manager::{CertManager, CertState, ManagerConfig};
