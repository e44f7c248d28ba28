//! Who is asking: the caller's ServiceAccount token, checked with TokenReview
//! against this cluster's API server, and — for node proxies asking on behalf
//! of a pod — whether that pod really runs on the caller's node.

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewStatus};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;
use strait_mesh::identity::protocol::PodRef;
use strait_mesh::names::{LINK_SERVICE_ACCOUNT_PREFIX, TOKEN_AUDIENCE};

/// Extra keys a bound (projected) token's review carries.
const EXTRA_NODE_NAME: &str = "authentication.kubernetes.io/node-name";
const EXTRA_POD_NAME: &str = "authentication.kubernetes.io/pod-name";

/// The authenticated caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub namespace: String,
    pub service_account: String,
    /// The node of the pod the token is bound to, if the token says.
    pub node_name: Option<String>,
    /// The pod the token is bound to, if any.
    pub pod_name: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error(
        "no bearer token: send Authorization: Bearer <ServiceAccount token with audience {TOKEN_AUDIENCE}>"
    )]
    MissingToken,
    #[error(
        "token refused by TokenReview: {0}; use a projected ServiceAccount token with audience {TOKEN_AUDIENCE}"
    )]
    Unauthenticated(String),
    #[error(
        "TokenReview authenticated the token but did not confirm the audience {TOKEN_AUDIENCE} \
         (status.audiences: {audiences:?}): the API server may ignore audiences, or the token is for \
         another audience; use a projected ServiceAccount token with audience {TOKEN_AUDIENCE}"
    )]
    AudienceNotConfirmed { audiences: Vec<String> },
    #[error("token belongs to {0:?}, not a ServiceAccount")]
    NotServiceAccount(String),
    #[error(
        "TokenReview failed: {0}; check the issuer's RBAC (tokenreviews create) and API server"
    )]
    Review(kube::Error),
    #[error(
        "{namespace}/{service_account}: the issuer never certifies ServiceAccounts in namespace {namespace} \
         (--refuse-namespace): clusters linked to this one hold tokens of accounts there (strait link's \
         {LINK_SERVICE_ACCOUNT_PREFIX}<cluster>), so such a token proves nothing; run the workload in another namespace"
    )]
    RefusedNamespace {
        namespace: String,
        service_account: String,
    },
    #[error("{caller} may not request another pod's identity: only node proxies may")]
    NotNodeAgent { caller: String },
    #[error("cannot tell which node the caller runs on: its token is not bound to a pod on a node")]
    CallerNodeUnknown,
    #[error("pod {namespace}/{name} not found")]
    PodNotFound { namespace: String, name: String },
    #[error(
        "pod {namespace}/{name} runs on node {pod_node:?}, not on the caller's node {caller_node}"
    )]
    WrongNode {
        namespace: String,
        name: String,
        pod_node: Option<String>,
        caller_node: String,
    },
    #[error("reading pod {namespace}/{name}: {source}")]
    PodLookup {
        namespace: String,
        name: String,
        source: kube::Error,
    },
}

impl AuthError {
    pub fn reason(&self) -> &'static str {
        match self {
            AuthError::MissingToken => "missing_token",
            AuthError::Unauthenticated(_) => "unauthenticated",
            AuthError::AudienceNotConfirmed { .. } => "audience_not_confirmed",
            AuthError::NotServiceAccount(_) => "not_service_account",
            AuthError::Review(_) => "token_review_error",
            AuthError::RefusedNamespace { .. } => "refused_namespace",
            AuthError::NotNodeAgent { .. } => "not_node_agent",
            AuthError::CallerNodeUnknown => "caller_node_unknown",
            AuthError::PodNotFound { .. } => "pod_not_found",
            AuthError::WrongNode { .. } => "wrong_node",
            AuthError::PodLookup { .. } => "pod_lookup_error",
        }
    }

    /// 401/403 for the caller's fault, 503 when the API server failed us.
    pub fn status(&self) -> u16 {
        match self {
            AuthError::MissingToken
            | AuthError::Unauthenticated(_)
            | AuthError::AudienceNotConfirmed { .. } => 401,
            AuthError::Review(_) | AuthError::PodLookup { .. } => 503,
            _ => 403,
        }
    }
}

/// Reviews `token`, requiring Strait's audience.
pub async fn authenticate(client: &Client, token: &str) -> Result<Caller, AuthError> {
    let api: Api<TokenReview> = Api::all(client.clone());
    let review: TokenReview = serde_json::from_value(json!({
        "spec": {"token": token, "audiences": [TOKEN_AUDIENCE]},
    }))
    .expect("static TokenReview JSON");
    let status = api
        .create(&PostParams::default(), &review)
        .await
        .map_err(AuthError::Review)?
        .status
        .unwrap_or_default();
    caller_of(status)
}

/// The decision on a TokenReview's answer: authenticated, for Strait's
/// audience as the API server itself reports it (an API server that ignores
/// `spec.audiences` would authenticate a token minted for anyone), and a
/// ServiceAccount.
pub fn caller_of(status: TokenReviewStatus) -> Result<Caller, AuthError> {
    if status.authenticated != Some(true) {
        return Err(AuthError::Unauthenticated(
            status.error.unwrap_or_else(|| "not authenticated".into()),
        ));
    }
    let audiences = status.audiences.unwrap_or_default();
    if !audiences.iter().any(|a| a == TOKEN_AUDIENCE) {
        return Err(AuthError::AudienceNotConfirmed { audiences });
    }
    let user = status.user.unwrap_or_default();
    let username = user.username.unwrap_or_default();
    let (namespace, service_account) = parse_service_account(&username)
        .ok_or_else(|| AuthError::NotServiceAccount(username.clone()))?;
    let extra = user.extra.unwrap_or_default();
    let first = |key: &str| extra.get(key).and_then(|v| v.first().cloned());
    Ok(Caller {
        namespace,
        service_account,
        node_name: first(EXTRA_NODE_NAME),
        pod_name: first(EXTRA_POD_NAME),
    })
}

/// `system:serviceaccount:<ns>:<name>` → (ns, name).
pub fn parse_service_account(username: &str) -> Option<(String, String)> {
    let rest = username.strip_prefix("system:serviceaccount:")?;
    let (ns, name) = rest.split_once(':')?;
    (!ns.is_empty() && !name.is_empty() && !name.contains(':'))
        .then(|| (ns.to_string(), name.to_string()))
}

/// Checks that the node proxy `caller` may obtain the identity of `pod`, and
/// returns that pod's (namespace, ServiceAccount).
pub async fn authorize_pod(
    client: &Client,
    caller: &Caller,
    pod: &PodRef,
) -> Result<(String, String), AuthError> {
    // The caller's node: the bound token's node claim, else its pod's spec.nodeName.
    let caller_node = match (&caller.node_name, &caller.pod_name) {
        (Some(node), _) => node.clone(),
        (None, Some(pod_name)) => get_pod(client, &caller.namespace, pod_name)
            .await?
            .spec
            .and_then(|s| s.node_name)
            .ok_or(AuthError::CallerNodeUnknown)?,
        (None, None) => return Err(AuthError::CallerNodeUnknown),
    };
    let target = get_pod(client, &pod.namespace, &pod.name).await?;
    let spec = target.spec.unwrap_or_default();
    if spec.node_name.as_deref() != Some(caller_node.as_str()) {
        return Err(AuthError::WrongNode {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            pod_node: spec.node_name,
            caller_node,
        });
    }
    let sa = spec
        .service_account_name
        .unwrap_or_else(|| "default".to_string());
    Ok((pod.namespace.clone(), sa))
}

async fn get_pod(client: &Client, namespace: &str, name: &str) -> Result<Pod, AuthError> {
    Api::<Pod>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(|source| AuthError::PodLookup {
            namespace: namespace.into(),
            name: name.into(),
            source,
        })?
        .ok_or_else(|| AuthError::PodNotFound {
            namespace: namespace.into(),
            name: name.into(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TokenReview answer as the API server writes it.
    fn answer(authenticated: bool, audiences: Option<&[&str]>) -> TokenReviewStatus {
        serde_json::from_value(json!({
            "authenticated": authenticated,
            "audiences": audiences,
            "user": {"username": "system:serviceaccount:shop:web",
                     "extra": {EXTRA_NODE_NAME: ["node-1"]}},
        }))
        .unwrap()
    }

    #[test]
    fn a_review_must_confirm_strait_s_audience() {
        let caller = caller_of(answer(true, Some(&["other", TOKEN_AUDIENCE]))).unwrap();
        assert_eq!(
            (caller.namespace.as_str(), caller.service_account.as_str()),
            ("shop", "web")
        );
        assert_eq!(caller.node_name.as_deref(), Some("node-1"));
        // An API server that ignores spec.audiences answers without them, or
        // with its own: authenticated, yet not for us.
        for audiences in [
            None,
            Some(&[][..]),
            Some(&["https://kubernetes.default.svc"][..]),
        ] {
            let e = caller_of(answer(true, audiences)).unwrap_err();
            assert_eq!((e.reason(), e.status()), ("audience_not_confirmed", 401));
            assert!(
                e.to_string().contains(
                    "use a projected ServiceAccount token with audience strait.dev/identity"
                ),
                "{e}"
            );
        }
        let e = caller_of(answer(false, Some(&[TOKEN_AUDIENCE]))).unwrap_err();
        assert_eq!(e.reason(), "unauthenticated");
    }

    #[test]
    fn parses_service_account_usernames() {
        assert_eq!(
            parse_service_account("system:serviceaccount:shop:web"),
            Some(("shop".into(), "web".into()))
        );
        assert_eq!(parse_service_account("system:serviceaccount:shop"), None);
        assert_eq!(parse_service_account("system:serviceaccount::web"), None);
        assert_eq!(parse_service_account("system:serviceaccount:a:b:c"), None);
        assert_eq!(parse_service_account("admin"), None);
    }
}
