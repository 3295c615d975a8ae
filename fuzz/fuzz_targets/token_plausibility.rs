//! The check every bearer token passes before it may cost a TokenReview
//! (`check_plausible`, `UnverifiedClaims::parse`): anyone who can open a
//! connection reaches it. It must never panic, never call a token
//! plausible whose own claims say otherwise, and never repeat the token
//! in its error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshca_ca::authn::{check_plausible, AuthnError, UnverifiedClaims};

/// The moment the checks run at (fixed, so runs are reproducible).
const NOW: u64 = 1_800_000_000;

fuzz_target!(|data: &[u8]| {
    let Ok(token) = std::str::from_utf8(data) else {
        return;
    };
    let audiences = vec!["istio-ca".to_string()];
    let parsed = UnverifiedClaims::parse(token);
    match check_plausible(token, &audiences, NOW) {
        Ok(claims) => {
            assert_eq!(parsed.as_ref(), Ok(&claims), "the check reads what parse reads");
            assert!(claims.audiences.iter().any(|a| a == "istio-ca"));
            assert!(claims.expires_at.is_none_or(|exp| exp > NOW));
            assert_eq!(token.split('.').count(), 3);
        }
        Err(e) => {
            match (&e, &parsed) {
                (AuthnError::MalformedToken, Err(AuthnError::MalformedToken)) => {}
                (AuthnError::Expired(exp), Ok(claims)) => {
                    assert_eq!(claims.expires_at, Some(*exp));
                    assert!(*exp <= NOW);
                }
                (AuthnError::WrongAudience(_), Ok(claims)) => {
                    assert!(!claims.audiences.iter().any(|a| a == "istio-ca"));
                }
                other => panic!("unexpected refusal: {other:?}"),
            }
            if token.len() >= 16 && e.to_string().contains(token) {
                // Unless the token is a piece of the fixed wording (the
                // fuzzer finds those): then another token's refusal has it too.
                let other = check_plausible(&"#".repeat(token.len()), &audiences, NOW)
                    .expect_err("not a JWT");
                assert!(other.to_string().contains(token), "the error repeats the token");
            }
        }
    }
});
