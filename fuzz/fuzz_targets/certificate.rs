//! Certificates arrive as client certificates and in CA answers: the SVID
//! checks and inspection must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = meshca_certs::verify::check_svid_leaf(data);
    let _ = meshca_certs::inspect::CertSummary::from_der(data);
    let bundle = meshca_certs::TrustBundle::new(vec![data.to_vec()]);
    let _ = meshca_certs::verify::audit_svid_chain(
        &[data.to_vec()],
        &bundle,
        std::time::SystemTime::now(),
        None,
    );
});
