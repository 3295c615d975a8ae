//! # meshca-serve
//!
//! What meshca's servers share: the CA's gRPC and monitoring ports
//! (`meshca-ca`) and the agent's Workload API and SDS Unix socket
//! (`meshca-client`) are each a long-running tokio server open to
//! callers it does not trust, and they defend themselves the same way:
//!
//! - [`stream_activity`]: how busy one HTTP/2 connection is (its open
//!   streams, since when it has had none), so an idle connection is told
//!   to go away and one that goes on idling is cut off;
//! - [`rate_limited_log`]: at most one log line per interval for events a
//!   caller can repeat at will (refused requests, a failing dependency),
//!   with exact counters;
//! - [`heap_trim`]: the heap's free pages given back to the operating
//!   system after a burst of requests or connections has passed (glibc's
//!   `malloc_trim`, the workspace's one `unsafe` call).
//!
//! The X.509 and SPIFFE side of meshca is `meshca-certs`, which does not
//! need this crate.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use meshca_serve::rate_limited_log::RateLimitedLog;
//! use meshca_serve::stream_activity::StreamActivity;
//!
//! // One connection: a request is an open stream while its answer lives.
//! let activity = Arc::new(StreamActivity::default());
//! let request = activity.open();
//! assert_eq!(activity.open_streams(), 1);
//! drop(request);
//! activity.idle_for(Duration::from_millis(10)).await; // idle: send GOAWAY
//!
//! // Refusals: the first gets a line, the next ones are counted.
//! let refusals = RateLimitedLog::default();
//! assert_eq!(refusals.record(), Some(0));
//! assert_eq!(refusals.record(), None);
//! assert_eq!(refusals.total(), 2);
//! # }
//! ```

pub mod heap_trim;
pub mod rate_limited_log;
pub mod stream_activity;
