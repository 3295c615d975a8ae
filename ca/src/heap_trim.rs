//! The CA's heap trimming after a burst of requests: the shared
//! [`meshca_serve::heap_trim`], fed by the open requests' peak.

use std::sync::Arc;

use meshca_serve::heap_trim::{TrimPolicy, CHECK_INTERVAL};

use crate::transport::OpenRequests;

/// Open requests at once that make a burst worth trimming after.
pub(crate) const MIN_PEAK: usize = 64;

/// Trims the heap after each burst of `requests`, until the runtime stops.
pub(crate) fn spawn(requests: Arc<OpenRequests>) {
    let policy = TrimPolicy {
        check_interval: CHECK_INTERVAL,
        min_peak: MIN_PEAK,
    };
    meshca_serve::heap_trim::spawn(policy, "requests", move || Some(requests.take_peak()));
}
