//! Checks of each Link: its spec, its credentials and their expiry, the
//! remote API with exactly the access mirroring needs, shared trust anchors,
//! and the gateway (alive, latency) as the controller's probe sees it.

use std::time::Duration;

use k8s_openapi::api::authorization::v1::SelfSubjectAccessReview;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{ApiResource, DynamicObject, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::certs;
use strait_mesh::link::{Link, LinkSpec, LinkStatus, TRUST_ANCHORS_CONFIGMAP, selector_query};

use super::local::now;
use super::pure::{Level, judge_token, jwt_times};
use super::{CheckResult, SYSTEM_NAMESPACE, fetch};
use crate::link::LINK_NAMESPACE;

/// What later checks (orphans) need of a Link.
pub struct LinkInfo {
    pub cluster: String,
    pub spec: LinkSpec,
    /// A client for the remote API when the credentials loaded and it answered.
    pub remote: Option<Client>,
}

/// The bearer token of a link kubeconfig's first user, read from the YAML
/// itself (kube keeps a loaded token behind a secrecy wrapper).
pub(crate) fn bearer_token(kubeconfig_yaml: &str) -> Option<String> {
    serde_yaml::from_str::<serde_yaml::Value>(kubeconfig_yaml)
        .ok()
        .and_then(|v| v["users"][0]["user"]["token"].as_str().map(str::to_string))
}

fn relink_hint(cluster: &str) -> String {
    format!(
        "re-link: strait link --context <{cluster}'s context> --cluster-name {cluster} | kubectl apply -f -"
    )
}

pub async fn check_links(
    client: &Client,
    anchors: Option<&[Vec<u8>]>,
    out: &mut Vec<CheckResult>,
) -> Vec<LinkInfo> {
    let ar = ApiResource::erase::<Link>(&());
    let list = match Api::<DynamicObject>::namespaced_with(client.clone(), LINK_NAMESPACE, &ar)
        .list(&Default::default())
        .await
    {
        Ok(l) => l.items,
        Err(e) => {
            out.push(CheckResult::fail(
                "Links",
                format!("cannot list Links in {LINK_NAMESPACE}: {e}"),
                "run check as someone who may list links.multicluster.strait.dev",
            ));
            return Vec::new();
        }
    };
    if list.is_empty() {
        out.push(CheckResult::warn(
            "Links",
            format!("no Links in {LINK_NAMESPACE}: nothing is mirrored"),
            "link a cluster: strait link --context <remote> --cluster-name NAME | kubectl apply -f -",
        ));
    }
    let mut infos = Vec::new();
    for obj in list {
        if let Some(info) = check_link(client, &obj, anchors, out).await {
            infos.push(info);
        }
    }
    infos
}

/// Validates what the API server's schema cannot: parseable durations, a
/// SPIFFE gateway identity, gateway addresses, a selector that matches something.
pub fn validate_spec(spec: &LinkSpec) -> Vec<String> {
    let mut problems = Vec::new();
    if spec.gateway_addresses.is_empty() {
        problems.push("spec.gatewayAddresses is empty: mirrors get no endpoints".to_string());
    }
    if let Err(e) = spec.gateway_identity.parse::<SpiffeId>() {
        problems.push(format!(
            "spec.gatewayIdentity {:?} is not a SPIFFE ID: {e}",
            spec.gateway_identity
        ));
    }
    for (what, text) in [
        ("period", &spec.probe.period),
        ("timeout", &spec.probe.timeout),
    ] {
        if let Err(e) = humantime::parse_duration(text) {
            problems.push(format!("spec.probe.{what} {text:?} is not a duration: {e}"));
        }
    }
    if let Some(ttl) = &spec.staleness_ttl
        && let Err(e) = humantime::parse_duration(ttl)
    {
        problems.push(format!("spec.stalenessTTL {ttl:?} is not a duration: {e}"));
    }
    if selector_query(&spec.selector).is_none() {
        problems.push("spec.selector matches nothing (empty or an unknown operator)".to_string());
    }
    problems
}

async fn check_link(
    client: &Client,
    obj: &DynamicObject,
    anchors: Option<&[Vec<u8>]>,
    out: &mut Vec<CheckResult>,
) -> Option<LinkInfo> {
    let name = obj.name_any();
    let spec: LinkSpec = match serde_json::from_value(obj.data["spec"].clone()) {
        Ok(s) => s,
        Err(e) => {
            out.push(CheckResult::fail(
                format!("link {name}: spec"),
                format!("the spec does not parse: {e}"),
                format!("fix it: kubectl -n {LINK_NAMESPACE} edit link {name}"),
            ));
            return None;
        }
    };
    let cluster = spec.target_cluster_name.clone();
    let label = |what: &str| format!("link {cluster}: {what}");
    let problems = validate_spec(&spec);
    if problems.is_empty() {
        out.push(CheckResult::pass(
            label("spec"),
            format!(
                "valid: gateway {} port {}, selector {}",
                spec.gateway_addresses.join(","),
                spec.gateway_port,
                selector_query(&spec.selector).unwrap_or_default()
            ),
        ));
    } else {
        out.push(CheckResult::fail(
            label("spec"),
            problems.join("; "),
            format!("fix it: kubectl -n {LINK_NAMESPACE} edit link {name}"),
        ));
    }
    let status: Option<LinkStatus> = serde_json::from_value(obj.data["status"].clone()).ok();

    // Credentials: the Secret, its kubeconfig, the token's expiry.
    let remote = credentials(client, &spec, &label("credentials"), out).await;
    let remote = match remote {
        Some(kc) => remote_api(&kc, &cluster, &label("remote API"), out).await,
        None => None,
    };
    match &remote {
        Some(r) => trust_anchors_match(r, anchors, &cluster, &label("trust anchors"), out).await,
        None => out.push(CheckResult::fail(
            label("trust anchors"),
            "cannot compare: the remote API is not reachable with the link's credentials (above)",
            relink_hint(&cluster),
        )),
    }
    gateway(status.as_ref(), &cluster, &label("gateway"), out);
    Some(LinkInfo {
        cluster,
        spec,
        remote,
    })
}

async fn credentials(
    client: &Client,
    spec: &LinkSpec,
    check: &str,
    out: &mut Vec<CheckResult>,
) -> Option<Kubeconfig> {
    let cluster = &spec.target_cluster_name;
    let secret_name = &spec.cluster_credentials_secret;
    let missing = CheckResult::fail(
        check,
        format!("the credentials Secret {LINK_NAMESPACE}/{secret_name} does not exist"),
        relink_hint(cluster),
    );
    let secret = fetch(
        &Api::<Secret>::namespaced(client.clone(), LINK_NAMESPACE),
        secret_name,
        &format!("{LINK_NAMESPACE}/{secret_name}"),
        missing,
        "run check as someone who may read Secrets in strait-multicluster",
        out,
    )
    .await?;
    let text = secret
        .data
        .unwrap_or_default()
        .remove("kubeconfig")
        .map(|b| String::from_utf8_lossy(&b.0).into_owned());
    let Some(text) = text else {
        out.push(CheckResult::fail(
            check,
            format!("{LINK_NAMESPACE}/{secret_name} has no `kubeconfig` key"),
            relink_hint(cluster),
        ));
        return None;
    };
    let kc = match Kubeconfig::from_yaml(&text) {
        Ok(kc) => kc,
        Err(e) => {
            out.push(CheckResult::fail(
                check,
                format!("the kubeconfig in {LINK_NAMESPACE}/{secret_name} does not parse: {e}"),
                relink_hint(cluster),
            ));
            return None;
        }
    };
    // Before anything builds a client from it: building one would run an
    // exec plugin or read files here, on the operator's machine.
    if let Err(e) = strait_mesh::kubeconfig::inline_only(&kc) {
        out.push(CheckResult::fail(
            check,
            format!("{LINK_NAMESPACE}/{secret_name}: {e}"),
            format!(
                "{}; strait link never writes such a kubeconfig, so find out who changed the Secret",
                relink_hint(cluster)
            ),
        ));
        return None;
    }
    match bearer_token(&text) {
        None => out.push(CheckResult::warn(
            check,
            format!("{LINK_NAMESPACE}/{secret_name} authenticates without a bearer token, so its expiry is unknown"),
            "strait link writes an expiring TokenRequest token that the controller renews; prefer it",
        )),
        Some(t) => match jwt_times(&t) {
            Err(e) => out.push(CheckResult::fail(check, e, relink_hint(cluster))),
            Ok((iat, exp)) => {
                let (level, msg) = judge_token(now(), iat, exp);
                let hint = match level {
                    Level::Fail => relink_hint(cluster),
                    _ => format!(
                        "the mirror controller renews it at 70 % of its life: is it running, and may it still reach {cluster}? Else {}",
                        relink_hint(cluster)
                    ),
                };
                out.push(CheckResult::at(level, check, msg, hint));
            }
        },
    }
    Some(kc)
}

/// What the link's identity must be allowed, and what it must not.
fn access_expectations(cluster: &str) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let ra = |verb: &str, group: &str, resource: &str| json!({"verb": verb, "group": group, "resource": resource});
    let needed = vec![
        ra("list", "", "services"),
        ra("watch", "", "services"),
        ra("list", "discovery.k8s.io", "endpointslices"),
        ra("watch", "discovery.k8s.io", "endpointslices"),
        json!({"verb": "create", "group": "", "resource": "serviceaccounts", "subresource": "token",
               "namespace": LINK_NAMESPACE, "name": format!("strait-link-{cluster}")}),
    ];
    let forbidden = vec![
        ra("get", "", "secrets"),
        ra("list", "", "secrets"),
        ra("list", "", "configmaps"),
        ra("create", "", "services"),
        ra("patch", "", "services"),
        ra("delete", "", "services"),
        ra("create", "discovery.k8s.io", "endpointslices"),
        ra("create", "", "pods"),
        json!({"verb": "create", "group": "", "resource": "pods", "subresource": "exec"}),
        ra("create", "rbac.authorization.k8s.io", "clusterrolebindings"),
        ra("impersonate", "", "users"),
        json!({"verb": "create", "group": "", "resource": "serviceaccounts", "subresource": "token",
               "namespace": "kube-system", "name": "default"}),
    ];
    (needed, forbidden)
}

fn describe(attrs: &serde_json::Value) -> String {
    let resource = match attrs["subresource"].as_str() {
        Some(sub) => format!("{}/{sub}", attrs["resource"].as_str().unwrap_or("")),
        None => attrs["resource"].as_str().unwrap_or("").to_string(),
    };
    let group = attrs["group"]
        .as_str()
        .filter(|g| !g.is_empty())
        .map(|g| format!(".{g}"))
        .unwrap_or_default();
    let scope = match (attrs["namespace"].as_str(), attrs["name"].as_str()) {
        (Some(ns), Some(n)) => format!(" {ns}/{n}"),
        _ => String::new(),
    };
    format!(
        "{} {resource}{group}{scope}",
        attrs["verb"].as_str().unwrap_or("")
    )
}

async fn allowed(remote: &Client, attrs: &serde_json::Value) -> Result<bool, kube::Error> {
    let review: SelfSubjectAccessReview = serde_json::from_value(json!({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attrs},
    }))
    .expect("a valid review");
    let answer = Api::<SelfSubjectAccessReview>::all(remote.clone())
        .create(&PostParams::default(), &review)
        .await?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

/// The remote API answers with the link's credentials, which allow what
/// mirroring needs and nothing more.
async fn remote_api(
    kc: &Kubeconfig,
    cluster: &str,
    check: &str,
    out: &mut Vec<CheckResult>,
) -> Option<Client> {
    let config =
        match kube::Config::from_custom_kubeconfig(kc.clone(), &KubeConfigOptions::default()).await
        {
            Ok(mut c) => {
                c.connect_timeout = Some(Duration::from_secs(5));
                c.read_timeout = Some(Duration::from_secs(10));
                c
            }
            Err(e) => {
                out.push(CheckResult::fail(
                    check,
                    format!("the link's kubeconfig is unusable: {e}"),
                    relink_hint(cluster),
                ));
                return None;
            }
        };
    let server = config.cluster_url.to_string();
    let remote = match Client::try_from(config) {
        Ok(c) => c,
        Err(e) => {
            out.push(CheckResult::fail(
                check,
                format!("cannot build a client for {server}: {e}"),
                relink_hint(cluster),
            ));
            return None;
        }
    };
    let version = match remote.apiserver_version().await {
        Ok(v) => v.git_version,
        Err(e) => {
            let (why, hint) = match &e {
                kube::Error::Api(s) if s.code == 401 => (
                    "the API server refuses the link's token (401: expired or revoked)".to_string(),
                    relink_hint(cluster),
                ),
                _ => (
                    format!("{server} does not answer: {e}"),
                    format!(
                        "is {cluster}'s API server up and reachable from here (and from the mirror controller)? The address is the link kubeconfig's server (strait link --api-server-address)"
                    ),
                ),
            };
            out.push(CheckResult::fail(check, why, hint));
            return None;
        }
    };
    let (needed, forbidden) = access_expectations(cluster);
    let mut missing = Vec::new();
    let mut excess = Vec::new();
    for attrs in &needed {
        match allowed(&remote, attrs).await {
            Ok(true) => {}
            Ok(false) => missing.push(describe(attrs)),
            Err(e) => missing.push(format!("{} (review failed: {e})", describe(attrs))),
        }
    }
    for attrs in &forbidden {
        match allowed(&remote, attrs).await {
            Ok(false) => {}
            Ok(true) => excess.push(describe(attrs)),
            Err(e) => excess.push(format!("{} (review failed: {e})", describe(attrs))),
        }
    }
    if missing.is_empty() && excess.is_empty() {
        out.push(CheckResult::pass(
            check,
            format!("{server} ({version}) answers; the link may list/watch services and endpointslices and renew its own token, and may not read secrets or write anything"),
        ));
        Some(remote)
    } else {
        let mut parts = Vec::new();
        if !missing.is_empty() {
            parts.push(format!("missing: {}", missing.join(", ")));
        }
        if !excess.is_empty() {
            parts.push(format!("more than it needs: {}", excess.join(", ")));
        }
        out.push(CheckResult::fail(
            check,
            format!("{server} answers, but the link's access is wrong: {}", parts.join("; ")),
            format!("bind the link's ServiceAccount to the strait-link-reader ClusterRole only (on {cluster}: kubectl get clusterrolebindings,rolebindings -A -o wide | grep strait-link-{cluster}); strait link sets this up"),
        ));
        // Still usable for the comparisons that follow.
        Some(remote)
    }
}

fn anchor_fingerprints(ders: &[Vec<u8>]) -> Vec<String> {
    use sha2::Digest as _;
    ders.iter()
        .map(|d| hex::encode(&sha2::Sha256::digest(d)[..8]))
        .collect()
}

/// This cluster's anchors and the remote's share at least one (both equal is
/// the steady state; an overlap is a rotation in progress).
async fn trust_anchors_match(
    remote: &Client,
    local: Option<&[Vec<u8>]>,
    cluster: &str,
    check: &str,
    out: &mut Vec<CheckResult>,
) {
    let Some(local) = local else {
        out.push(CheckResult::fail(
            check,
            "cannot compare: this cluster's trust anchors are missing (above)",
            "fix this cluster's strait-system/strait-trust-anchors first",
        ));
        return;
    };
    let cm = Api::<ConfigMap>::namespaced(remote.clone(), SYSTEM_NAMESPACE)
        .get_opt(TRUST_ANCHORS_CONFIGMAP)
        .await;
    let pem = match cm {
        Ok(Some(cm)) => cm
            .data
            .unwrap_or_default()
            .remove("ca.crt")
            .unwrap_or_default(),
        Ok(None) => {
            out.push(CheckResult::fail(
                check,
                format!("{cluster} has no {SYSTEM_NAMESPACE}/{TRUST_ANCHORS_CONFIGMAP}: is Strait installed there?"),
                format!("install Strait on {cluster} with the same trust anchor as this cluster"),
            ));
            return;
        }
        Err(kube::Error::Api(e)) if e.code == 403 => {
            out.push(CheckResult::warn(
                check,
                format!("the link may not read {cluster}'s {SYSTEM_NAMESPACE}/{TRUST_ANCHORS_CONFIGMAP}, so the anchors were not compared"),
                relink_hint(cluster),
            ));
            return;
        }
        Err(e) => {
            out.push(CheckResult::fail(
                check,
                format!("reading {cluster}'s trust anchors: {e}"),
                relink_hint(cluster),
            ));
            return;
        }
    };
    let remote_ders: Vec<Vec<u8>> = match certs::parse_certs("remote ca.crt", pem.as_bytes()) {
        Ok(d) => d.into_iter().map(|d| d.to_vec()).collect(),
        Err(e) => {
            out.push(CheckResult::fail(
                check,
                format!("{cluster}'s anchors: {e}"),
                format!("fix {SYSTEM_NAMESPACE}/{TRUST_ANCHORS_CONFIGMAP} on {cluster}"),
            ));
            return;
        }
    };
    let (mine, theirs) = (
        anchor_fingerprints(local),
        anchor_fingerprints(&remote_ders),
    );
    let shared: Vec<&String> = mine.iter().filter(|f| theirs.contains(f)).collect();
    if shared.is_empty() {
        out.push(CheckResult::fail(
            check,
            format!("no anchor in common: this cluster trusts [{}], {cluster} trusts [{}] (sha256 prefixes): mTLS between them fails", mine.join(", "), theirs.join(", ")),
            "every cluster must share one trust anchor: install both from the same anchor (strait identity trust-anchor), or ship old+new bundles while rotating",
        ));
    } else if mine.len() != theirs.len() || shared.len() != mine.len() {
        out.push(CheckResult::warn(
            check,
            format!("{} anchor(s) shared with {cluster}, but the bundles differ (this [{}], {cluster} [{}])", shared.len(), mine.join(", "), theirs.join(", ")),
            "fine during a rotation; finish it by shipping the same bundle to every cluster",
        ));
    } else {
        out.push(CheckResult::pass(
            check,
            format!("{cluster} trusts the same anchor(s) [{}]", mine.join(", ")),
        ));
    }
}

/// GatewayAlive from the controller's probe, with the probe latency.
fn gateway(status: Option<&LinkStatus>, cluster: &str, check: &str, out: &mut Vec<CheckResult>) {
    let condition = status.and_then(|s| s.conditions.iter().find(|c| c.type_ == "GatewayAlive"));
    let latency = status
        .and_then(|s| s.gateway_latency.as_ref())
        .map(|l| {
            format!(
                "; probe latency p50 {}ms p99 {}ms over {} probes",
                l.p50_ms, l.p99_ms, l.samples
            )
        })
        .unwrap_or_default();
    match condition {
        None => out.push(CheckResult::fail(
            check,
            "no GatewayAlive condition: the mirror controller has not probed this gateway",
            "is strait-mirror running (see the mirror controller line)?",
        )),
        Some(c) if c.status == "True" => out.push(CheckResult::pass(check, format!("alive: {}{latency}", c.message))),
        Some(c) if c.status == "Unknown" => out.push(CheckResult::warn(
            check,
            format!("not probed ({}): {}", c.reason, c.message),
            "give strait-mirror its identity (issuer flags) so it probes gateways",
        )),
        Some(c) => out.push(CheckResult::fail(
            check,
            format!("down ({}): {}", c.reason, c.message),
            format!("is {cluster}'s strait-gateway running and reachable from here on the Link's gatewayAddresses/gatewayPort (UDP and TCP)? kubectl --context <{cluster}> -n strait-system get pods -l app.kubernetes.io/name=strait-gateway"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: serde_json::Value) -> LinkSpec {
        let mut base = json!({"targetClusterName": "west", "clusterCredentialsSecret": "s",
            "gatewayAddresses": ["10.0.0.1"], "gatewayIdentity": "spiffe://cluster.local/ns/strait-system/sa/strait-gateway"});
        for (k, val) in v.as_object().unwrap() {
            base[k] = val.clone();
        }
        serde_json::from_value(base).unwrap()
    }

    #[test]
    fn specs_are_validated_beyond_the_schema() {
        assert!(validate_spec(&spec(json!({}))).is_empty());
        let bad = validate_spec(&spec(
            json!({"gatewayAddresses": [], "gatewayIdentity": "gw",
            "probe": {"period": "often"}, "selector": {}}),
        ));
        let text = bad.join("\n");
        for want in [
            "gatewayAddresses",
            "gatewayIdentity",
            "probe.period",
            "selector",
        ] {
            assert!(text.contains(want), "{want} in {text}");
        }
    }

    #[test]
    fn access_reviews_are_described() {
        let (needed, forbidden) = access_expectations("west");
        assert_eq!(describe(&needed[2]), "list endpointslices.discovery.k8s.io");
        assert_eq!(
            describe(&needed[4]),
            "create serviceaccounts/token strait-multicluster/strait-link-west"
        );
        assert_eq!(describe(&forbidden[0]), "get secrets");
    }
}
