//! Bearer tokens arrive from anyone who can open a connection: splitting,
//! decoding and checking one must never panic, never accept a token the
//! issuer did not sign, and never repeat the token in an error.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use meshca_ca::authn::JwtAuthenticator;
use meshca_certs::token::TokenIssuer;
use meshca_certs::TrustDomain;

fn authenticator() -> &'static JwtAuthenticator {
    static AUTHN: OnceLock<JwtAuthenticator> = OnceLock::new();
    AUTHN.get_or_init(|| {
        let issuer = TokenIssuer::generate().expect("a P-256 key");
        JwtAuthenticator::from_jwks(
            "fuzz",
            issuer.issuer(),
            &issuer.jwks_json(),
            vec!["istio-ca".into()],
            TrustDomain::default(),
        )
        .expect("the issuer's own JWKS")
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(token) = std::str::from_utf8(data) else {
        return;
    };
    // The key was made in this process and never signed anything: nothing
    // the fuzzer writes can verify.
    match authenticator().validate(token) {
        Ok(caller) => panic!("a token nobody signed was accepted: {caller:?}"),
        Err(e) => {
            if token.len() >= 16 && e.to_string().contains(token) {
                // Unless the token is a piece of the fixed wording (the
                // fuzzer finds those): then another token's refusal has it too.
                let other = authenticator()
                    .validate(&"#".repeat(token.len()))
                    .expect_err("not a JWT");
                assert!(other.to_string().contains(token), "the error repeats the token");
            }
        }
    }
});
