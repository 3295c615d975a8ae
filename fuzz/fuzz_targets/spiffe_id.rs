//! SPIFFE IDs arrive in CSR SANs and in request metadata.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(id) = meshca_certs::SpiffeId::parse(text) {
            // A parsed ID round-trips and its accessors hold.
            assert_eq!(id.as_str(), text);
            let _ = id.kubernetes_workload();
            assert!(id.as_str().starts_with("spiffe://"));
        }
    }
});
