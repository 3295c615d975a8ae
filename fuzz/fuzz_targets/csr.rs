//! CSRs arrive from any authenticated caller: parsing and verifying one
//! must never panic, whatever the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshca_certs::VerifiedCsr;

fuzz_target!(|data: &[u8]| {
    let _ = VerifiedCsr::from_der(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = VerifiedCsr::from_pem(text);
    }
});
