//! Fuzzes JWT claims parsing on any token a credentials Secret may hold: the
//! mirror controller's (when to renew a Link's token) and `strait check`'s
//! (how long the token has left). Neither verifies: the API server does.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strait_mirror::token::claims;

// link-cli is a binary only; its pure arithmetic is compiled in from source.
#[allow(dead_code)]
#[path = "../../link-cli/src/check/pure.rs"]
mod pure;

fuzz_target!(|data: &[u8]| {
    let Ok(token) = std::str::from_utf8(data) else {
        return;
    };
    let cli = pure::jwt_times(token);
    if let Err(e) = &cli {
        assert!(!e.is_empty());
    }
    let mirror = claims(token);
    if let Some(c) = &mirror {
        // Both read the same claims; `strait check` also insists on three parts.
        if token.split('.').count() == 3 {
            assert_eq!(cli, Ok((Some(c.issued_at), c.expires_at)));
        }
        // `sub` is system:serviceaccount:<ns>:<sa>, and a namespace has no colon.
        assert!(!c.namespace.contains(':'));
        // Renewal arithmetic is total: any claims, any fraction of the lifetime.
        for renew_at in [0.0, 0.7, 1.0] {
            let (lifetime, due) = c.renewal(renew_at);
            assert!(lifetime >= 1);
            assert!(c.issued_at <= due && due <= c.issued_at.saturating_add(lifetime));
        }
    }
    if let Ok((iat, exp)) = cli {
        // The judgement is total too, at any clock.
        let now = clock(data);
        for now in [now, 0, exp, i64::MIN, i64::MAX] {
            let (level, message) = pure::judge_token(now, iat, exp);
            assert!(!message.is_empty());
            assert_eq!(level == pure::Level::Fail, now >= exp, "{message}");
        }
        let (_, message) = pure::judge_validity(clock(data), iat.unwrap_or(exp), exp, 30);
        assert!(!message.is_empty());
    }
});

/// A clock reading taken from the input, so the fuzzer steers it too.
fn clock(data: &[u8]) -> i64 {
    let mut bytes = [0u8; 8];
    for (b, d) in bytes.iter_mut().zip(data.iter().rev()) {
        *b = *d;
    }
    i64::from_le_bytes(bytes)
}
