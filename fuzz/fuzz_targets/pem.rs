//! PEM bundles and keys come from files and from CA answers.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = meshca_certs::bundle::parse_certs_pem(text);
        let _ = meshca_certs::PrivateKey::from_pem(text);
        let _ = meshca_certs::TrustBundle::from_pem(text);
    }
});
