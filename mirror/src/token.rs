//! Link token renewal. `strait link` puts an expiring TokenRequest token in the
//! credentials Secret; before it expires the controller asks the remote
//! TokenRequest API (the link's ServiceAccount may request tokens for itself
//! only) for a fresh one and writes it back into the Secret. The Secret change
//! restarts the Link's worker with the new token.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use strait_mesh::link::Link;

/// What a token says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenClaims {
    pub issued_at: i64,
    pub expires_at: i64,
    pub namespace: String,
    pub service_account: String,
}

/// Reads `iat`, `exp` and `sub` (`system:serviceaccount:<ns>:<name>`) without
/// verifying: the remote API server verifies; we only schedule.
pub fn claims(jwt: &str) -> Option<TokenClaims> {
    let payload = jwt.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let sub = v.get("sub")?.as_str()?;
    let rest = sub.strip_prefix("system:serviceaccount:")?;
    let (ns, sa) = rest.split_once(':')?;
    Some(TokenClaims {
        issued_at: v.get("iat")?.as_i64()?,
        expires_at: v.get("exp")?.as_i64()?,
        namespace: ns.into(),
        service_account: sa.into(),
    })
}

impl TokenClaims {
    /// The token's lifetime in seconds (at least 1) and when to renew it: after
    /// `renew_at` of its lifetime. The claims are whatever the Secret's token
    /// says (unverified), so the arithmetic saturates.
    pub fn renewal(&self, renew_at: f64) -> (i64, i64) {
        let lifetime = self.expires_at.saturating_sub(self.issued_at).max(1);
        // `as` saturates a float (NaN becomes 0); rounding may not pass expiry.
        let after = ((lifetime as f64 * renew_at) as i64).clamp(0, lifetime);
        let due = self.issued_at.saturating_add(after);
        (lifetime, due)
    }
}

fn kubeconfig_of(secret: &Secret) -> Option<serde_yaml::Value> {
    let bytes = secret.data.as_ref()?.get("kubeconfig")?.0.clone();
    serde_yaml::from_slice(&bytes).ok()
}

fn token_of(kubeconfig: &serde_yaml::Value) -> Option<String> {
    kubeconfig
        .get("users")?
        .get(0)?
        .get("user")?
        .get("token")?
        .as_str()
        .map(str::to_string)
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Keeps the Link's token fresh until dropped. `renew_at` is the fraction of
/// the token's lifetime after which it is renewed (0.7 by default).
pub async fn keep_fresh(local: Client, remote: Client, link: Link, renew_at: f64) {
    let ns = link.namespace().unwrap_or_default();
    let secret_name = link.spec.cluster_credentials_secret.clone();
    let secrets: Api<Secret> = Api::namespaced(local, &ns);
    let mut backoff = Duration::from_secs(1);
    loop {
        let Ok(Some(secret)) = secrets.get_opt(&secret_name).await else {
            tokio::time::sleep(Duration::from_secs(10)).await;
            continue;
        };
        let Some(mut kubeconfig) = kubeconfig_of(&secret) else {
            return;
        };
        let Some(token) = token_of(&kubeconfig) else {
            return;
        }; // client certs etc.: nothing to renew
        let Some(c) = claims(&token) else {
            tracing::info!(secret = %secret_name, "link token is not a bound ServiceAccount token; not renewing it");
            return;
        };
        let (lifetime, due) = c.renewal(renew_at);
        tokio::time::sleep(Duration::from_secs(
            due.saturating_sub(unix_now()).max(0) as u64
        ))
        .await;

        let request: TokenRequest =
            serde_json::from_value(json!({"spec": {"expirationSeconds": lifetime.max(600)}}))
                .expect("static JSON");
        let renewed = Api::<ServiceAccount>::namespaced(remote.clone(), &c.namespace)
            .create_token_request(&c.service_account, &PostParams::default(), &request)
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| {
                r.status
                    .and_then(|s| s.token)
                    .ok_or_else(|| "no token in the answer".to_string())
            });
        match renewed {
            Ok(new_token) => {
                kubeconfig["users"][0]["user"]["token"] = serde_yaml::Value::String(new_token);
                let text = serde_yaml::to_string(&kubeconfig).unwrap_or_default();
                let patch = json!({"data": {"kubeconfig": base64::engine::general_purpose::STANDARD.encode(text)}});
                match secrets
                    .patch(&secret_name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {
                        tracing::info!(secret = %secret_name, cluster = %link.spec.target_cluster_name, "link token renewed");
                        // The Secret change restarts this Link's worker, which starts a new renewer.
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(secret = %secret_name, "writing the renewed token failed: {e}")
                    }
                }
            }
            Err(e) => tracing::warn!(
                secret = %secret_name, seconds_left = c.expires_at - unix_now(),
                "renewing the link token failed: {e}; retrying (re-run `strait link` if it expires)"
            ),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(60));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_service_account_token_claims() {
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(r#"{"iat":100,"exp":700,"sub":"system:serviceaccount:strait-multicluster:strait-link-west"}"#);
        let c = claims(&format!("h.{payload}.s")).unwrap();
        assert_eq!((c.issued_at, c.expires_at), (100, 700));
        assert_eq!(
            (c.namespace.as_str(), c.service_account.as_str()),
            ("strait-multicluster", "strait-link-west")
        );
        assert!(claims("not-a-jwt").is_none());
        let user = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(r#"{"iat":1,"exp":2,"sub":"alice"}"#);
        assert!(claims(&format!("h.{user}.s")).is_none());
    }

    /// Found by the `jwt` fuzz target: claims at the ends of i64 overflowed.
    #[test]
    fn renewal_is_due_within_the_lifetime_for_any_claims() {
        let at = |issued_at, expires_at| TokenClaims {
            issued_at,
            expires_at,
            namespace: "ns".into(),
            service_account: "sa".into(),
        };
        assert_eq!(at(100, 1100).renewal(0.5), (1000, 600));
        assert_eq!(at(100, 1100).renewal(2.0), (1000, 1100));
        assert_eq!(at(100, 50).renewal(0.7), (1, 100));
        assert_eq!(at(i64::MIN, i64::MAX).renewal(0.7).0, i64::MAX);
        let (lifetime, due) = at(i64::MAX - 10, i64::MAX).renewal(1.0);
        assert_eq!((lifetime, due), (10, i64::MAX));
        assert_eq!(at(0, i64::MAX).renewal(1.0), (i64::MAX, i64::MAX));
    }
}
