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
///
/// The claims are whatever the token says: the arithmetic saturates.
pub fn judge_token(now: i64, iat: Option<i64>, exp: i64) -> (Level, String) {
    if now >= exp {
        return (
            Level::Fail,
            format!(
                "the link token expired {} ago",
                short_duration(now.saturating_sub(exp))
            ),
        );
    }
    let left = exp.saturating_sub(now);
    let lifetime = iat.map(|i| exp.saturating_sub(i)).filter(|l| *l > 0);
    let low = match lifetime {
        Some(l) => i128::from(left) * 4 < i128::from(l),
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
                short_duration(not_before.saturating_sub(now))
            ),
        );
    }
    if now >= not_after {
        return (
            Level::Fail,
            format!(
                "expired {} ago",
                short_duration(now.saturating_sub(not_after))
            ),
        );
    }
    let left = not_after.saturating_sub(now);
    let level = if left < warn_days.saturating_mul(86_400) {
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

    /// The JWT fuzzer's seeds read as their names say.
    #[test]
    fn jwt_fuzz_seeds_read_as_named() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/jwt");
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).expect("seed folder") {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let got = jwt_times(std::fs::read_to_string(&path).unwrap().trim_end());
            match name.as_str() {
                "link_token.txt" => assert_eq!(got, Ok((Some(1764979200), 1765065600))),
                "no_iat.txt" => assert_eq!(got, Ok((None, 1765065600))),
                "user_sub.txt" => assert_eq!(got, Ok((Some(1), 2))),
                "padded_payload.txt" => assert_eq!(got, Ok((Some(5), 10))),
                "no_exp.txt" => assert!(got.unwrap_err().contains("`exp`")),
                "not_base64.txt" => assert!(got.unwrap_err().contains("base64")),
                "two_parts.txt" => assert!(got.unwrap_err().contains("not a JWT")),
                "extreme_claims.txt" => assert_eq!(got, Ok((Some(i64::MIN), i64::MAX))),
                other => panic!("seed {other} is not in this table"),
            }
            seen += 1;
        }
        assert!(seen >= 8);
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

    /// Found by the `jwt` fuzz target: claims at the ends of i64 overflowed.
    #[test]
    fn extreme_claims_and_clocks_do_not_overflow() {
        let (l, m) = judge_token(0, Some(i64::MIN), i64::MAX);
        assert_eq!(
            (l, m.as_str()),
            (
                Level::Ok,
                "the link token expires in 106751991167300d15h of 106751991167300d15h"
            )
        );
        assert_eq!(judge_token(1_000, None, i64::MIN).0, Level::Fail);
        assert_eq!(judge_token(i64::MIN, Some(0), 10).0, Level::Ok);
        assert_eq!(judge_token(i64::MAX, None, i64::MIN).0, Level::Fail);
        assert_eq!(judge_validity(i64::MIN, i64::MAX, 0, 30).0, Level::Fail);
        assert_eq!(
            judge_validity(i64::MAX, i64::MIN, i64::MIN, 30).0,
            Level::Fail
        );
        assert_eq!(judge_validity(0, 0, 100, i64::MAX).0, Level::Warning);
        assert_eq!(
            judge_validity(i64::MIN, i64::MIN, i64::MAX, 30).0,
            Level::Ok
        );
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
