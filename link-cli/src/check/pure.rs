//! The arithmetic of `strait check`, kept pure so it is unit-tested: token
//! expiry from a JWT, certificate validity windows, and short durations.

use base64::Engine as _;

/// How a judged thing stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Ok,
    Warning,
    Fail,
}

/// The `iat` and `exp` claims of a JWT (seconds since the Unix epoch). The
/// signature is not checked: the remote API server does that when it is called.
pub fn jwt_times(token: &str) -> Result<(Option<i64>, i64), String> {
    let payload = token
        .split('.')
        .nth(1)
        .filter(|_| token.split('.').count() == 3)
        .ok_or("the token is not a JWT (three dot-separated parts)")?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|e| format!("the token's payload is not base64url: {e}"))?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| format!("the token's payload is not JSON: {e}"))?;
    let exp = claims["exp"].as_i64().ok_or(
        "the token has no `exp` claim: it never expires, which a TokenRequest token always does",
    )?;
    Ok((claims["iat"].as_i64(), exp))
}

/// Judges a link token: expired fails; less than a quarter of its life left
/// (the controller renews at 70 %, so it should never get there), or under an
/// hour when its issue time is unknown, warns.
pub fn judge_token(now: i64, iat: Option<i64>, exp: i64) -> (Level, String) {
    if now >= exp {
        return (
            Level::Fail,
            format!("the link token expired {} ago", short_duration(now - exp)),
        );
    }
    let left = exp - now;
    let lifetime = iat.map(|i| exp - i).filter(|l| *l > 0);
    let low = match lifetime {
        Some(l) => left * 4 < l,
        None => left < 3600,
    };
    let of = lifetime
        .map(|l| format!(" of {}", short_duration(l)))
        .unwrap_or_default();
    if low {
        (
            Level::Warning,
            format!(
                "the link token expires in {}{of}: it should have been renewed by now",
                short_duration(left)
            ),
        )
    } else {
        (
            Level::Ok,
            format!("the link token expires in {}{of}", short_duration(left)),
        )
    }
}

/// Judges a certificate's validity window at `now`: not yet valid or expired
/// fails, fewer than `warn_days` days left warns.
pub fn judge_validity(
    now: i64,
    not_before: i64,
    not_after: i64,
    warn_days: i64,
) -> (Level, String) {
    if now < not_before {
        return (
            Level::Fail,
            format!(
                "not valid for another {} (check the clocks)",
                short_duration(not_before - now)
            ),
        );
    }
    if now >= not_after {
        return (
            Level::Fail,
            format!("expired {} ago", short_duration(now - not_after)),
        );
    }
    let left = not_after - now;
    let level = if left < warn_days * 86_400 {
        Level::Warning
    } else {
        Level::Ok
    };
    (level, format!("{} left", short_duration(left)))
}

/// `3d4h`, `5h12m`, `7m3s`, `42s`: the two largest units.
pub fn short_duration(secs: i64) -> String {
    let s = secs.max(0);
    let (d, h, m, sec) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60, s % 60);
    if d > 0 {
        format!("{d}d{h}h")
    } else if h > 0 {
        format!("{h}h{m}m")
    } else if m > 0 {
        format!("{m}m{sec}s")
    } else {
        format!("{sec}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwt(claims: serde_json::Value) -> String {
        let b = |v: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
        format!(
            "{}.{}.{}",
            b(br#"{"alg":"ES256"}"#),
            b(claims.to_string().as_bytes()),
            b(b"sig")
        )
    }

    #[test]
    fn jwt_claims_are_read_and_bad_tokens_explained() {
        let t = jwt(serde_json::json!({"iat": 100, "exp": 200, "sub": "x"}));
        assert_eq!(jwt_times(&t), Ok((Some(100), 200)));
        assert!(jwt_times("abc").unwrap_err().contains("not a JWT"));
        assert!(jwt_times("a.!!!.c").unwrap_err().contains("base64"));
        let no_exp = jwt(serde_json::json!({"iat": 1}));
        assert!(jwt_times(&no_exp).unwrap_err().contains("exp"));
    }

    #[test]
    fn token_expiry_is_judged_against_its_lifetime() {
        let day = 86_400;
        // Fresh: 20 h of 24 h left.
        let (l, m) = judge_token(4 * 3600, Some(0), day);
        assert_eq!(l, Level::Ok, "{m}");
        assert_eq!(m, "the link token expires in 20h0m of 1d0h");
        // Past the renewal point and then some: 5 h of 24 h left.
        assert_eq!(judge_token(19 * 3600, Some(0), day).0, Level::Warning);
        // Expired.
        let (l, m) = judge_token(day + 90, Some(0), day);
        assert_eq!(
            (l, m.as_str()),
            (Level::Fail, "the link token expired 1m30s ago")
        );
        // Unknown issue time: under an hour warns.
        assert_eq!(judge_token(0, None, 1800).0, Level::Warning);
        assert_eq!(judge_token(0, None, 7200).0, Level::Ok);
    }

    #[test]
    fn certificate_validity_windows() {
        let day = 86_400;
        assert_eq!(judge_validity(10, 20, 100, 30).0, Level::Fail);
        let (l, m) = judge_validity(100 * day, 0, 99 * day, 30);
        assert_eq!((l, m.as_str()), (Level::Fail, "expired 1d0h ago"));
        let (l, m) = judge_validity(0, 0, 10 * day, 30);
        assert_eq!((l, m.as_str()), (Level::Warning, "10d0h left"));
        let (l, m) = judge_validity(0, 0, 365 * day, 30);
        assert_eq!((l, m.as_str()), (Level::Ok, "365d0h left"));
    }

    #[test]
    fn durations_are_short() {
        assert_eq!(short_duration(42), "42s");
        assert_eq!(short_duration(423), "7m3s");
        assert_eq!(short_duration(5 * 3600 + 12 * 60 + 9), "5h12m");
        assert_eq!(short_duration(3 * 86_400 + 4 * 3600 + 5), "3d4h");
        assert_eq!(short_duration(-5), "0s");
    }
}
