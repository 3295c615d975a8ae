//! # meshca-ca
//!
//! meshca's certificate authority: an Istio-compatible
//! `istio.v1.auth.IstioCertificateService` over TLS that authenticates the
//! caller (service-account token or a client SVID it issued), decides which
//! SPIFFE identity it may hold, and signs an X.509 SVID for the CSR's key.
//!
//! Modules, in request order:
//! `transport` (the gRPC port: accept loop, TLS, HTTP/2) →
//! `service` (the gRPC handler: admission, then each step below) →
//! [`authn`] (who is calling) → `admission` (a signing slot, or a fast
//! refusal) → `authz` (which identity it gets) →
//! [`authority`] (signing, lifetimes) → [`store`] (where the CA key
//! material comes from).
//!
//! Around the request path: [`config`] parses the command line;
//! `server_identity` issues and renews the server's own TLS certificate;
//! `metrics` holds Istio's metrics (refusals are logged through
//! `meshca_serve::rate_limited_log`, so they cannot flood the log); `rate_limit` bounds how often one
//! identity gets a certificate; `reload` takes a changed `--ca-dir`
//! into use; [`cluster`] keeps the root in a Secret, the bundle in every
//! namespace, elects a leader and rotates the root; [`server`] starts it
//! all, in named steps, and drains it on shutdown.
//!
//! Public is only what other crates use: the `meshca` binary, the
//! benchmarks (`ca/benches`, `meshca-bench`), the manifest tests
//! (`ca/tests`) and the fuzz targets, plus the types their signatures
//! name. Everything else is `pub(crate)` or private; ARCHITECTURE.md
//! walks through it.
//!
//! ```no_run
//! use clap::Parser;
//! use meshca_ca::config::{Config, ServeArgs};
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     serve: ServeArgs,
//! }
//!
//! # async fn example() -> anyhow::Result<()> {
//! let config = Config::try_from(Cli::parse().serve)?;
//! meshca_ca::server::run(config, async { let _ = tokio::signal::ctrl_c().await; }, |_| {}).await?;
//! # Ok(())
//! # }
//! ```

pub(crate) mod admission;
pub mod authn;
pub mod authority;
pub(crate) mod authz;
pub(crate) mod caller_gate;
pub mod cluster;
pub mod config;
pub(crate) mod heap_trim;
pub mod hsm;
pub mod jwt_svid;
pub(crate) mod metrics;
pub(crate) mod monitoring;
pub(crate) mod rate_limit;
pub(crate) mod reload;
pub(crate) mod revocation;
pub mod server;
pub(crate) mod server_identity;
pub(crate) mod service;
pub mod store;
pub(crate) mod transport;

pub use authz::node_agent::fuzz_pod_events;
