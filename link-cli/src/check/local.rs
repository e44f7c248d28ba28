//! Checks of this cluster: the Link CRD, trust anchors, the issuer, node
//! proxies, the mirror controller, mirrors' endpoints and orphans.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use strait_mesh::identity::certs;
use strait_mesh::link::{MIRROR_HEARTBEAT_LEASE, TRUST_ANCHORS_CONFIGMAP};
use strait_mesh::names::{CLUSTER_NAME_LABEL, MIRRORED_LABEL, REMOTE_FQ_NAME_ANNOTATION};

use super::links::LinkInfo;
use super::pure::{self, Level, judge_validity};
use super::{CheckResult, SYSTEM_NAMESPACE, fetch};
use crate::link::LINK_NAMESPACE;

const CRD_NAME: &str = "links.multicluster.strait.dev";
const CRD_VERSION: &str = "v1alpha1";

pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}

/// The Link CRD: present, established, serving v1alpha1. False when Links cannot be read.
pub async fn crd(client: &Client, out: &mut Vec<CheckResult>) -> bool {
    const CHECK: &str = "Link CRD";
    let hint = "install it: kubectl apply -f deploy/mirror/crd.yaml (or `strait-mirror crd | kubectl apply -f -`)";
    let missing = CheckResult::fail(CHECK, format!("{CRD_NAME} is not installed"), hint);
    let Some(crd) = fetch(
        &Api::<CustomResourceDefinition>::all(client.clone()),
        CRD_NAME,
        &format!("CRD {CRD_NAME}"),
        missing,
        "check --context and that you may read customresourcedefinitions",
        out,
    )
    .await
    else {
        return false;
    };
    let served: Vec<String> = crd
        .spec
        .versions
        .iter()
        .filter(|v| v.served)
        .map(|v| v.name.clone())
        .collect();
    let established = crd
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        });
    if !served.iter().any(|v| v == CRD_VERSION) {
        out.push(CheckResult::fail(
            CHECK,
            format!("{CRD_NAME} serves {served:?}, not {CRD_VERSION}, which this CLI speaks"),
            hint,
        ));
        return false;
    }
    if !established {
        out.push(CheckResult::fail(
            CHECK,
            format!("{CRD_NAME} is not Established yet"),
            "wait a moment and run again; if it stays, look at `kubectl get crd links.multicluster.strait.dev -o yaml` conditions",
        ));
        return false;
    }
    out.push(CheckResult::pass(
        CHECK,
        format!("{CRD_NAME} installed, serving {}", served.join(", ")),
    ));
    true
}

/// This cluster's trust anchors (DER) from `strait-system/strait-trust-anchors`, each judged.
pub async fn trust_anchors(client: &Client, out: &mut Vec<CheckResult>) -> Option<Vec<Vec<u8>>> {
    const CHECK: &str = "trust anchors";
    let hint = "create it from the anchor certificate: kubectl -n strait-system create configmap strait-trust-anchors --from-file=ca.crt=anchor/ca.crt (strait install does this)";
    let what = format!("{SYSTEM_NAMESPACE}/{TRUST_ANCHORS_CONFIGMAP}");
    let missing = CheckResult::fail(CHECK, format!("no ConfigMap {what}"), hint);
    let cm = fetch(
        &Api::<ConfigMap>::namespaced(client.clone(), SYSTEM_NAMESPACE),
        TRUST_ANCHORS_CONFIGMAP,
        &what,
        missing,
        hint,
        out,
    )
    .await?;
    let pem = cm
        .data
        .unwrap_or_default()
        .remove("ca.crt")
        .unwrap_or_default();
    let ders = match certs::parse_certs("ca.crt", pem.as_bytes()) {
        Ok(d) if !d.is_empty() => d,
        Ok(_) => {
            out.push(CheckResult::fail(CHECK, format!("{SYSTEM_NAMESPACE}/{TRUST_ANCHORS_CONFIGMAP} has no certificate under key ca.crt"), hint));
            return None;
        }
        Err(e) => {
            out.push(CheckResult::fail(
                CHECK,
                format!("{SYSTEM_NAMESPACE}/{TRUST_ANCHORS_CONFIGMAP}: {e}"),
                hint,
            ));
            return None;
        }
    };
    let now = now();
    let mut worst = Level::Ok;
    let mut parts = Vec::new();
    for (i, der) in ders.iter().enumerate() {
        match certs::inspect(&format!("anchor #{}", i + 1), der) {
            Ok(info) => {
                let (level, msg) =
                    judge_validity(now, info.not_before_unix, info.not_after_unix, 60);
                worst = worst.max_with(level);
                parts.push(format!("{} ({msg})", info.subject));
            }
            Err(e) => {
                worst = Level::Fail;
                parts.push(e.to_string());
            }
        }
    }
    out.push(CheckResult::at(
        worst,
        CHECK,
        format!("{} anchor(s): {}", ders.len(), parts.join("; ")),
        "rotate the trust anchor before it expires: ship old+new in ca.crt, re-issue issuers, then drop the old (README: Identity)",
    ));
    Some(ders.into_iter().map(|d| d.to_vec()).collect())
}

impl Level {
    fn max_with(self, other: Level) -> Level {
        match (self, other) {
            (Level::Fail, _) | (_, Level::Fail) => Level::Fail,
            (Level::Warning, _) | (_, Level::Warning) => Level::Warning,
            _ => Level::Ok,
        }
    }
}

/// Which anchor (index) signed `cert_der`, if any.
pub fn signed_by(cert_der: &[u8], anchors: &[Vec<u8>]) -> Option<usize> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, cert) = X509Certificate::from_der(cert_der).ok()?;
    anchors.iter().position(|a| {
        X509Certificate::from_der(a).is_ok_and(|(_, anchor)| {
            anchor.subject() == cert.issuer()
                && cert.verify_signature(Some(anchor.public_key())).is_ok()
        })
    })
}

/// The issuer certificate in `strait-system/strait-identity-issuer`: valid now,
/// days left, and signed by one of this cluster's anchors. Only `tls.crt` is read.
pub async fn issuer(client: &Client, anchors: Option<&[Vec<u8>]>, out: &mut Vec<CheckResult>) {
    const CHECK: &str = "issuer certificate";
    let name = "strait-identity-issuer";
    let hint = "issue one: strait identity issuer --anchor-cert anchor/ca.crt --anchor-key anchor/ca.key --cluster NAME -o yaml | kubectl apply -f -";
    let missing = CheckResult::fail(CHECK, format!("no Secret {SYSTEM_NAMESPACE}/{name}"), hint);
    let Some(secret) = fetch(
        &Api::<Secret>::namespaced(client.clone(), SYSTEM_NAMESPACE),
        name,
        &format!("{SYSTEM_NAMESPACE}/{name}"),
        missing,
        "run check as someone who may read that Secret",
        out,
    )
    .await
    else {
        return;
    };
    let pem = secret
        .data
        .unwrap_or_default()
        .remove("tls.crt")
        .map(|b| b.0)
        .unwrap_or_default();
    let der = match certs::parse_certs("tls.crt", &pem) {
        Ok(d) if !d.is_empty() => d[0].to_vec(),
        Ok(_) => {
            out.push(CheckResult::fail(
                CHECK,
                format!("{SYSTEM_NAMESPACE}/{name} has no tls.crt"),
                hint,
            ));
            return;
        }
        Err(e) => {
            out.push(CheckResult::fail(CHECK, e.to_string(), hint));
            return;
        }
    };
    let info = match certs::inspect("the issuer certificate", &der) {
        Ok(i) => i,
        Err(e) => {
            out.push(CheckResult::fail(CHECK, e.to_string(), hint));
            return;
        }
    };
    let (level, validity) = judge_validity(now(), info.not_before_unix, info.not_after_unix, 30);
    if !info.is_ca {
        out.push(CheckResult::fail(
            CHECK,
            format!(
                "{} is not a CA certificate, so it cannot issue",
                info.subject
            ),
            hint,
        ));
        return;
    }
    let chain = match anchors {
        None => Err("cannot check its chain without the trust anchors (above)".to_string()),
        Some(a) => match signed_by(&der, a) {
            Some(i) => Ok(format!("signed by anchor #{}", i + 1)),
            None => Err(format!(
                "{} is not signed by any of this cluster's trust anchors",
                info.subject
            )),
        },
    };
    match chain {
        Ok(chain) => out.push(CheckResult::at(
            level,
            CHECK,
            format!("{}: {validity}, {chain}", info.subject),
            format!("re-issue it before it expires: {hint}, then restart strait-identity"),
        )),
        Err(why) => out.push(CheckResult::fail(
            CHECK,
            format!("{why} ({validity})"),
            "re-issue the issuer under the anchor in strait-system/strait-trust-anchors, or fix that ConfigMap",
        )),
    }
}

/// A Ready `strait-proxy` Pod on every Node.
pub async fn node_proxies(client: &Client, out: &mut Vec<CheckResult>) {
    const CHECK: &str = "node proxies";
    let nodes = match Api::<Node>::all(client.clone())
        .list_metadata(&ListParams::default())
        .await
    {
        Ok(n) => n.items,
        Err(e) => {
            out.push(CheckResult::fail(
                CHECK,
                format!("cannot list Nodes: {e}"),
                "run check as someone who may list nodes",
            ));
            return;
        }
    };
    let pods = match Api::<Pod>::namespaced(client.clone(), SYSTEM_NAMESPACE)
        .list(&ListParams::default().labels("app.kubernetes.io/name=strait-proxy"))
        .await
    {
        Ok(p) => p.items,
        Err(e) => {
            out.push(CheckResult::fail(
                CHECK,
                format!("cannot list proxy Pods: {e}"),
                "run check as someone who may list pods in strait-system",
            ));
            return;
        }
    };
    let mut ready_on: BTreeSet<String> = BTreeSet::new();
    for p in &pods {
        let ready = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        if let (true, Some(node)) = (ready, p.spec.as_ref().and_then(|s| s.node_name.clone())) {
            ready_on.insert(node);
        }
    }
    let missing: Vec<String> = nodes
        .iter()
        .map(|n| n.name_any())
        .filter(|n| !ready_on.contains(n))
        .collect();
    if nodes.is_empty() {
        out.push(CheckResult::warn(
            CHECK,
            "the cluster has no Nodes",
            "nothing to run proxies on yet",
        ));
    } else if missing.is_empty() {
        out.push(CheckResult::pass(
            CHECK,
            format!("a ready proxy on each of {} node(s)", nodes.len()),
        ));
    } else {
        out.push(CheckResult::fail(
            CHECK,
            format!("no ready strait-proxy on {} of {} node(s): {}", missing.len(), nodes.len(), missing.join(", ")),
            "kubectl -n strait-system get pods -l app.kubernetes.io/name=strait-proxy -o wide; look at the logs of the one on that node (deploy/proxy/daemonset.yaml tolerates every taint)",
        ));
    }
}

/// The controller's heartbeat Lease is fresh (mirror/src/heartbeat.rs).
pub async fn mirror_controller(client: &Client, links_exist: bool, out: &mut Vec<CheckResult>) {
    const CHECK: &str = "mirror controller";
    let hint = "start it: kubectl apply -f deploy/mirror/ and look at its logs (kubectl -n strait-multicluster logs deploy/strait-mirror)";
    let level_if_down = if links_exist {
        Level::Fail
    } else {
        Level::Warning
    };
    let missing = CheckResult::at(
        level_if_down,
        CHECK,
        format!(
            "no heartbeat: Lease {LINK_NAMESPACE}/{MIRROR_HEARTBEAT_LEASE} does not exist, so strait-mirror has never run here"
        ),
        hint,
    );
    let Some(lease) = fetch(
        &Api::<Lease>::namespaced(client.clone(), LINK_NAMESPACE),
        MIRROR_HEARTBEAT_LEASE,
        &format!("Lease {LINK_NAMESPACE}/{MIRROR_HEARTBEAT_LEASE}"),
        missing,
        "run check as someone who may read leases there",
        out,
    )
    .await
    else {
        return;
    };
    let spec = lease.spec.unwrap_or_default();
    let holder = spec.holder_identity.unwrap_or_else(|| "(unknown)".into());
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(30));
    let Some(renewed) = spec.renew_time.map(|t| t.0.as_second()) else {
        out.push(CheckResult::at(
            level_if_down,
            CHECK,
            "the heartbeat Lease was never renewed",
            hint,
        ));
        return;
    };
    let age = now() - renewed;
    if age <= duration {
        out.push(CheckResult::pass(
            CHECK,
            format!(
                "running ({holder}, heartbeat {} ago)",
                pure::short_duration(age)
            ),
        ));
    } else {
        out.push(CheckResult::at(
            level_if_down,
            CHECK,
            format!(
                "not running: last heartbeat from {holder} {} ago (expected every {}s)",
                pure::short_duration(age),
                duration / 3
            ),
            hint,
        ));
    }
}

fn mirror_services_selector() -> String {
    format!("{MIRRORED_LABEL}=true")
}

/// Every mirror Service has at least one ready endpoint.
pub async fn mirror_endpoints(client: &Client, out: &mut Vec<CheckResult>) {
    const CHECK: &str = "mirror endpoints";
    let mirrors = match Api::<Service>::all(client.clone())
        .list_metadata(&ListParams::default().labels(&mirror_services_selector()))
        .await
    {
        Ok(m) => m.items,
        Err(e) => {
            out.push(CheckResult::fail(
                CHECK,
                format!("cannot list mirror Services: {e}"),
                "run check as someone who may list services",
            ));
            return;
        }
    };
    let slices = match Api::<EndpointSlice>::all(client.clone())
        .list(&ListParams::default().labels(&mirror_services_selector()))
        .await
    {
        Ok(s) => s.items,
        Err(e) => {
            out.push(CheckResult::fail(
                CHECK,
                format!("cannot list EndpointSlices: {e}"),
                "run check as someone who may list endpointslices",
            ));
            return;
        }
    };
    let mut ready: BTreeMap<(String, String), usize> = BTreeMap::new();
    for s in &slices {
        let Some(svc) = s.labels().get("kubernetes.io/service-name").cloned() else {
            continue;
        };
        let n = s
            .endpoints
            .iter()
            .flatten()
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false))
            .count();
        *ready
            .entry((s.namespace().unwrap_or_default(), svc))
            .or_default() += n;
    }
    let without: Vec<String> = mirrors
        .iter()
        .map(|m| (m.namespace().unwrap_or_default(), m.name_any()))
        .filter(|k| ready.get(k).copied().unwrap_or(0) == 0)
        .map(|(ns, name)| format!("{ns}/{name}"))
        .collect();
    if mirrors.is_empty() {
        out.push(CheckResult::pass(CHECK, "no mirror Services yet"));
    } else if without.is_empty() {
        out.push(CheckResult::pass(
            CHECK,
            format!(
                "all {} mirror Service(s) have ready endpoints",
                mirrors.len()
            ),
        ));
    } else {
        out.push(CheckResult::fail(
            CHECK,
            format!("{} of {} mirror Service(s) have no ready endpoint: {}", without.len(), mirrors.len(), without.join(", ")),
            "a mirror is ready when its remote Service has a ready pod and its gateway answers the probe: see the gateway line above and the remote Service's endpoints",
        ));
    }
}

/// `<svc>.<ns>.svc.<domain>` → (ns, svc).
pub fn parse_remote_fq_name(fq: &str) -> Option<(String, String)> {
    let mut parts = fq.splitn(4, '.');
    let (svc, ns, marker) = (parts.next()?, parts.next()?, parts.next()?);
    (marker == "svc" && !svc.is_empty() && !ns.is_empty())
        .then(|| (ns.to_string(), svc.to_string()))
}

/// Mirror Services whose Link is gone, or whose remote Service is gone or no longer exported.
pub async fn orphan_mirrors(client: &Client, links: &[LinkInfo], out: &mut Vec<CheckResult>) {
    const CHECK: &str = "orphan mirrors";
    let mirrors = match Api::<Service>::all(client.clone())
        .list_metadata(&ListParams::default().labels(&mirror_services_selector()))
        .await
    {
        Ok(m) => m.items,
        Err(e) => {
            out.push(CheckResult::fail(
                CHECK,
                format!("cannot list mirror Services: {e}"),
                "run check as someone who may list services",
            ));
            return;
        }
    };
    let mut orphans = Vec::new();
    let mut unverified = 0;
    for m in &mirrors {
        let (ns, name) = (m.namespace().unwrap_or_default(), m.name_any());
        let cluster = m
            .labels()
            .get(CLUSTER_NAME_LABEL)
            .cloned()
            .unwrap_or_default();
        let Some(link) = links.iter().find(|l| l.cluster == cluster) else {
            orphans.push(format!("{ns}/{name} (no Link for cluster {cluster:?})"));
            continue;
        };
        // Per-pod mirrors of headless services follow their parent.
        if m.labels()
            .contains_key(strait_mesh::names::HEADLESS_OWNER_LABEL)
        {
            continue;
        }
        let Some(remote) = &link.remote else {
            unverified += 1;
            continue;
        };
        let Some((rns, rname)) = m
            .annotations()
            .get(REMOTE_FQ_NAME_ANNOTATION)
            .and_then(|f| parse_remote_fq_name(f))
        else {
            orphans.push(format!(
                "{ns}/{name} (no valid {REMOTE_FQ_NAME_ANNOTATION} annotation)"
            ));
            continue;
        };
        match Api::<Service>::namespaced(remote.clone(), &rns)
            .get_metadata_opt(&rname)
            .await
        {
            Ok(None) => orphans.push(format!(
                "{ns}/{name} ({rns}/{rname} is gone from {cluster})"
            )),
            Ok(Some(svc)) => {
                let wanted = link.spec.selector.match_labels.clone().unwrap_or_default();
                if !wanted.iter().all(|(k, v)| svc.labels().get(k) == Some(v)) {
                    orphans.push(format!(
                        "{ns}/{name} ({rns}/{rname} in {cluster} is no longer exported)"
                    ));
                }
            }
            Err(_) => unverified += 1,
        }
    }
    let also = if unverified > 0 {
        format!(" ({unverified} could not be compared with their remote: see the remote API lines)")
    } else {
        String::new()
    };
    if orphans.is_empty() {
        out.push(CheckResult::pass(
            CHECK,
            format!("none among {} mirror Service(s){also}", mirrors.len()),
        ));
    } else {
        out.push(CheckResult::fail(
            CHECK,
            format!("{} orphan mirror(s): {}{also}", orphans.len(), orphans.join("; ")),
            "a running mirror controller removes its own Link's stale mirrors; for a Link that is gone: strait unlink --cluster-name NAME, or kubectl -n NS delete svc,endpointslice NAME",
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_names_parse() {
        assert_eq!(
            parse_remote_fq_name("web.shop.svc.cluster.local"),
            Some(("shop".into(), "web".into()))
        );
        assert_eq!(
            parse_remote_fq_name("web.shop.svc.west.example"),
            Some(("shop".into(), "web".into()))
        );
        assert_eq!(parse_remote_fq_name("web.shop"), None);
        assert_eq!(parse_remote_fq_name("web.shop.cluster.local"), None);
    }

    #[test]
    fn issuers_chain_to_their_anchor_only() {
        use strait_mesh::identity::ca;
        let day = std::time::Duration::from_secs(86_400);
        let der = |pem: &str| certs::parse_certs("t", pem.as_bytes()).unwrap()[0].to_vec();
        let (a1, i1) = ca::new_anchor_and_issuer("east", None, day).unwrap();
        let (a2, _) = ca::new_anchor_and_issuer("west", None, day).unwrap();
        assert_eq!(signed_by(&der(&i1.cert_pem), &[der(&a1.cert_pem)]), Some(0));
        assert_eq!(
            signed_by(&der(&i1.cert_pem), &[der(&a2.cert_pem), der(&a1.cert_pem)]),
            Some(1)
        );
        assert_eq!(signed_by(&der(&i1.cert_pem), &[der(&a2.cert_pem)]), None);
    }
}
