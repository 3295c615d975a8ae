//! # meshca-ca
//!
//! meshca's certificate authority: an Istio-compatible
//! `istio.v1.auth.IstioCertificateService` over TLS that authenticates the
//! caller (service-account token or a client SVID it issued), decides which
//! SPIFFE identity it may hold, and signs an X.509 SVID for the CSR's key.
//!
//! Modules, in request order:
//! [`tls`] (server certificate, client certificates) →
//! [`service`] (the gRPC handler) → [`authn`] (who is calling) →
//! [`authz`] (which identity it gets) → [`authority`] (signing, lifetimes) →
//! [`store`] (where the CA key material comes from).
//! [`config`] parses the command line; [`metrics`] holds Istio's metrics;
//! [`rate_limit`] bounds how often one identity gets a certificate;
//! [`reload`] takes a changed `--ca-dir` into use; [`cluster`] keeps the
//! root in a Secret, the bundle in every namespace, elects a leader and
//! rotates the root; [`server`] wires it all together.
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

pub mod authn;
pub mod authority;
pub mod authz;
pub mod batched_io;
pub mod cluster;
pub mod config;
pub mod event_loops;
pub mod log_lines;
pub mod metrics;
pub mod rate_limit;
pub mod reload;
#[cfg(test)]
mod renewal_pace_tests;
pub mod server;
pub mod service;
pub mod store;
pub mod tls;
