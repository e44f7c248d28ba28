//! What the dashboard page shows, built from snapshots (Kubernetes objects,
//! metric counts, check results) by pure functions, so it is unit-tested
//! without a cluster. The page renders this JSON as it is.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kube::api::DynamicObject;
use serde::Serialize;
use strait_mesh::link::{LinkSpec, LinkStatus};
use strait_mesh::names::{CLUSTER_NAME_LABEL, GATEWAY_SERVICE, REMOTE_FQ_NAME_ANNOTATION};

use crate::check::CheckResult;
use crate::check::local::parse_remote_fq_name;
use crate::stat::{Counts, ServiceKey};

/// The whole page.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct State {
    /// The cluster the dashboard reads (its context).
    pub cluster: String,
    /// Unix milliseconds of this state.
    pub generated_at: i64,
    /// Where the golden metrics come from, and the window their rates cover.
    pub metrics: MetricsSource,
    /// This cluster first, then every cluster it links to or trades calls with.
    pub clusters: Vec<ClusterView>,
    pub links: Vec<LinkView>,
    /// This cluster's gateway pods (`app.kubernetes.io/name=strait-gateway`).
    pub gateways: Vec<PodView>,
    /// Strait's other pods here (node proxies, mirror controller, identity).
    pub components: Vec<PodView>,
    pub services: Vec<ServiceView>,
    /// Calls between clusters (source → serving cluster), summed over Services.
    pub traffic: Vec<Edge>,
    /// The last `strait check` run (it reaches linked clusters, so it runs
    /// less often than the page refreshes).
    pub checks: Vec<CheckResult>,
    pub checked_at: Option<i64>,
}

#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MetricsSource {
    /// "node proxies" or the Prometheus URL.
    pub source: String,
    /// Node proxies read in the last refresh (0 with Prometheus).
    pub proxies_read: usize,
    pub window_seconds: f64,
    /// How long the last refresh took (reading the metrics, building the state).
    pub refresh_millis: f64,
    /// Why the last read failed, if it did (the page keeps the rest).
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterView {
    pub name: String,
    /// The cluster the dashboard reads.
    pub local: bool,
    /// Linked from this cluster (a Link exists for it).
    pub linked: bool,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LinkView {
    pub name: String,
    pub cluster: String,
    /// "yes", "no" or "unknown", from the GatewayAlive condition.
    pub alive: String,
    pub alive_message: String,
    pub latency_p50_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
    pub mirrored_services: u32,
    pub gateway_addresses: Vec<String>,
    pub gateway_port: u16,
    /// Every condition: type → (status, message).
    pub conditions: Vec<ConditionView>,
    /// Seconds the link token has left, and its whole life; `None` before
    /// the first check or without a bearer token.
    pub credentials_expire_in: Option<i64>,
    pub credentials_lifetime: Option<i64>,
    /// The check of the Link's trust anchors against this cluster's:
    /// "ok", "warning", "fail", or "unknown" before the first check.
    pub trust_anchors: String,
    pub trust_anchors_message: String,
    /// Why the Link could not be read, if it could not.
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConditionView {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub message: String,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodView {
    pub namespace: String,
    pub name: String,
    pub component: String,
    pub node: String,
    pub phase: String,
    pub ready: bool,
    pub restarts: i32,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceView {
    /// "exported" (this cluster's, to linked clusters), "mirrored" (a linked
    /// cluster's, mirrored here), "clusterset" (a ServiceImport), or
    /// "meshed" (a Service seen only in the metrics).
    pub kind: String,
    pub namespace: String,
    /// The local object's name (`web-west` for a mirror).
    pub name: String,
    /// The Service as the metrics name it: its name where it is served.
    pub service: String,
    /// The cluster serving it (every exporting cluster for a clusterset one).
    pub clusters: Vec<String>,
    pub ready_endpoints: u32,
    pub endpoints: u32,
    /// Golden metrics by caller cluster over the window.
    pub traffic: Vec<TrafficRow>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TrafficRow {
    /// The callers' cluster.
    pub from: String,
    /// The serving cluster.
    pub to: String,
    pub requests_per_second: f64,
    pub success_rate: Option<f64>,
    pub latency_p50_ms: Option<f64>,
    pub latency_p95_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Edge {
    pub from: String,
    pub to: String,
    pub requests_per_second: f64,
    pub success_rate: Option<f64>,
}

/// The token times of one Link's credentials (`iat`, `exp`), by cluster.
pub type TokenTimes = BTreeMap<String, (Option<i64>, i64)>;

/// Everything one refresh starts from.
pub struct Inputs<'a> {
    pub cluster: &'a str,
    pub now: i64,
    pub links: &'a [DynamicObject],
    pub exported: &'a [Service],
    pub mirrored: &'a [Service],
    pub imports: &'a [DynamicObject],
    pub slices: &'a [EndpointSlice],
    pub pods: &'a [Pod],
    /// Calls in the window: (Service, caller cluster) → counts.
    pub window: &'a HashMap<(ServiceKey, String), Counts>,
    pub window_seconds: f64,
    pub checks: &'a [CheckResult],
    pub tokens: &'a TokenTimes,
}

pub fn build(input: &Inputs<'_>) -> State {
    let links: Vec<LinkView> = input
        .links
        .iter()
        .map(|l| link_view(l, input.now, input.checks, input.tokens))
        .collect();
    let traffic_of = traffic_rows(input.window, input.window_seconds);
    let (ready, total) = endpoint_counts(input.slices);
    let mut services = Vec::new();
    let mut listed: BTreeSet<(String, String, String)> = BTreeSet::new();
    let mut rows_for = |namespace: &str, service: &str, clusters: &[String]| -> Vec<TrafficRow> {
        clusters
            .iter()
            .flat_map(|c| {
                listed.insert((namespace.to_string(), service.to_string(), c.clone()));
                traffic_of
                    .get(&(namespace.to_string(), service.to_string(), c.clone()))
                    .cloned()
                    .unwrap_or_default()
            })
            .collect()
    };
    for svc in input.exported {
        let (ns, name) = (svc.namespace().unwrap_or_default(), svc.name_any());
        let key = (ns.clone(), name.clone());
        let clusters = vec![input.cluster.to_string()];
        services.push(ServiceView {
            kind: "exported".into(),
            traffic: rows_for(&ns, &name, &clusters),
            namespace: ns,
            service: name.clone(),
            name,
            clusters,
            ready_endpoints: ready.get(&key).copied().unwrap_or(0),
            endpoints: total.get(&key).copied().unwrap_or(0),
        });
    }
    for svc in input.mirrored {
        let (ns, name) = (svc.namespace().unwrap_or_default(), svc.name_any());
        let key = (ns.clone(), name.clone());
        let cluster = svc
            .labels()
            .get(CLUSTER_NAME_LABEL)
            .cloned()
            .unwrap_or_default();
        let remote = svc
            .annotations()
            .get(REMOTE_FQ_NAME_ANNOTATION)
            .and_then(|fq| parse_remote_fq_name(fq))
            .map(|(_, s)| s)
            .or_else(|| {
                name.strip_suffix(&format!("-{cluster}"))
                    .map(str::to_string)
            })
            .unwrap_or_else(|| name.clone());
        let clusters = vec![cluster];
        services.push(ServiceView {
            kind: "mirrored".into(),
            traffic: rows_for(&ns, &remote, &clusters),
            namespace: ns,
            name,
            service: remote,
            clusters,
            ready_endpoints: ready.get(&key).copied().unwrap_or(0),
            endpoints: total.get(&key).copied().unwrap_or(0),
        });
    }
    let (import_ready, import_total) = import_endpoint_counts(input.slices);
    for import in input.imports {
        let (ns, name) = (import.namespace().unwrap_or_default(), import.name_any());
        let key = (ns.clone(), name.clone());
        let mut clusters: Vec<String> = import.data["status"]["clusters"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["cluster"].as_str().map(str::to_string))
            .collect();
        clusters.sort();
        services.push(ServiceView {
            kind: "clusterset".into(),
            traffic: rows_for(&ns, &name, &clusters),
            namespace: ns,
            service: name.clone(),
            name,
            clusters,
            ready_endpoints: import_ready.get(&key).copied().unwrap_or(0),
            endpoints: import_total.get(&key).copied().unwrap_or(0),
        });
    }
    // Services the proxies counted calls to that none of the above names
    // (local meshed Services, or a mirror since removed).
    let mut meshed: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for (ns, svc, cluster) in traffic_of.keys() {
        if !listed.contains(&(ns.clone(), svc.clone(), cluster.clone())) {
            meshed
                .entry((ns.clone(), svc.clone()))
                .or_default()
                .push(cluster.clone());
        }
    }
    for ((ns, name), clusters) in meshed {
        let key = (ns.clone(), name.clone());
        let local = clusters.iter().any(|c| c == input.cluster);
        services.push(ServiceView {
            kind: "meshed".into(),
            traffic: clusters
                .iter()
                .flat_map(|c| traffic_of[&(ns.clone(), name.clone(), c.clone())].clone())
                .collect(),
            namespace: ns,
            service: name.clone(),
            name,
            clusters,
            ready_endpoints: if local {
                ready.get(&key).copied().unwrap_or(0)
            } else {
                0
            },
            endpoints: if local {
                total.get(&key).copied().unwrap_or(0)
            } else {
                0
            },
        });
    }
    services
        .sort_by(|a, b| (&a.namespace, &a.name, &a.kind).cmp(&(&b.namespace, &b.name, &b.kind)));

    let traffic = edges(traffic_of.values().flatten());
    let mut clusters = vec![ClusterView {
        name: input.cluster.to_string(),
        local: true,
        linked: false,
    }];
    let others: BTreeSet<&str> = links
        .iter()
        .map(|l| l.cluster.as_str())
        .chain(
            traffic
                .iter()
                .flat_map(|e| [e.from.as_str(), e.to.as_str()]),
        )
        .filter(|c| !c.is_empty() && *c != input.cluster)
        .collect();
    for name in others {
        clusters.push(ClusterView {
            name: name.to_string(),
            local: false,
            linked: links.iter().any(|l| l.cluster == name),
        });
    }
    let (gateways, components) = input
        .pods
        .iter()
        .map(pod_view)
        .partition(|p| p.component == GATEWAY_SERVICE);
    State {
        cluster: input.cluster.to_string(),
        generated_at: input.now * 1000,
        metrics: MetricsSource {
            window_seconds: input.window_seconds,
            ..Default::default()
        },
        clusters,
        links,
        gateways,
        components,
        services,
        traffic,
        checks: input.checks.to_vec(),
        checked_at: None,
    }
}

fn link_view(
    obj: &DynamicObject,
    now: i64,
    checks: &[CheckResult],
    tokens: &TokenTimes,
) -> LinkView {
    let name = obj.name_any();
    let spec: LinkSpec = match serde_json::from_value(obj.data["spec"].clone()) {
        Ok(spec) => spec,
        Err(e) => {
            return LinkView {
                cluster: obj.data["spec"]["targetClusterName"]
                    .as_str()
                    .unwrap_or(&name)
                    .to_string(),
                name,
                alive: "unknown".into(),
                trust_anchors: "unknown".into(),
                error: Some(format!(
                    "the spec does not parse: {e} (`strait check` says what to fix)"
                )),
                ..Default::default()
            };
        }
    };
    let status: LinkStatus = serde_json::from_value(obj.data["status"].clone()).unwrap_or_default();
    let alive_condition = status.conditions.iter().find(|c| c.type_ == "GatewayAlive");
    let alive = match alive_condition.map(|c| c.status.as_str()) {
        Some("True") => "yes",
        Some("False") => "no",
        _ => "unknown",
    };
    let cluster = spec.target_cluster_name.clone();
    let anchors = checks
        .iter()
        .find(|c| c.check == format!("link {cluster}: trust anchors"));
    let (trust_anchors, trust_anchors_message) = match anchors {
        None => ("unknown", String::new()),
        Some(c) if !c.ok => ("fail", c.message.clone()),
        Some(c) if c.warning => ("warning", c.message.clone()),
        Some(c) => ("ok", c.message.clone()),
    };
    let token = tokens.get(&cluster);
    LinkView {
        name,
        alive: alive.into(),
        alive_message: alive_condition
            .map(|c| c.message.clone())
            .unwrap_or_default(),
        latency_p50_ms: status.gateway_latency.as_ref().map(|l| l.p50_ms),
        latency_p99_ms: status.gateway_latency.as_ref().map(|l| l.p99_ms),
        mirrored_services: status.mirrored_services,
        gateway_addresses: spec.gateway_addresses,
        gateway_port: spec.gateway_port,
        conditions: status
            .conditions
            .iter()
            .map(|c| ConditionView {
                type_: c.type_.clone(),
                status: c.status.clone(),
                message: c.message.clone(),
            })
            .collect(),
        credentials_expire_in: token.map(|(_, exp)| exp.saturating_sub(now)),
        credentials_lifetime: token.and_then(|(iat, exp)| iat.map(|i| exp.saturating_sub(i))),
        trust_anchors: trust_anchors.into(),
        trust_anchors_message,
        cluster,
        error: None,
    }
}

fn pod_view(pod: &Pod) -> PodView {
    let status = pod.status.clone().unwrap_or_default();
    let containers = status.container_statuses.unwrap_or_default();
    let labels = pod.labels();
    PodView {
        namespace: pod.namespace().unwrap_or_default(),
        name: pod.name_any(),
        component: labels
            .get("app.kubernetes.io/name")
            .cloned()
            .unwrap_or_default(),
        node: pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default(),
        phase: status.phase.unwrap_or_default(),
        ready: !containers.is_empty() && containers.iter().all(|c| c.ready),
        restarts: containers.iter().map(|c| c.restart_count).sum(),
    }
}

type ByService = HashMap<(String, String), u32>;

/// Ready and total endpoints per (namespace, Service), from the slices'
/// `kubernetes.io/service-name`.
fn endpoint_counts(slices: &[EndpointSlice]) -> (ByService, ByService) {
    counts_by_label(slices, "kubernetes.io/service-name")
}

/// The same per ServiceImport, from the slices Strait derives for it.
fn import_endpoint_counts(slices: &[EndpointSlice]) -> (ByService, ByService) {
    counts_by_label(slices, strait_mesh::mcs::LABEL_SERVICE_NAME)
}

fn counts_by_label(slices: &[EndpointSlice], label: &str) -> (ByService, ByService) {
    let (mut ready, mut total) = (HashMap::new(), HashMap::new());
    for slice in slices {
        let Some(service) = slice.labels().get(label) else {
            continue;
        };
        let key = (slice.namespace().unwrap_or_default(), service.clone());
        for e in slice.endpoints.iter().flatten() {
            *total.entry(key.clone()).or_insert(0) += 1;
            let is_ready = e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            *ready.entry(key.clone()).or_insert(0) += u32::from(is_ready);
        }
    }
    (ready, total)
}

/// Golden metrics per (namespace, Service, serving cluster), one row per
/// caller cluster.
fn traffic_rows(
    window: &HashMap<(ServiceKey, String), Counts>,
    seconds: f64,
) -> BTreeMap<(String, String, String), Vec<TrafficRow>> {
    let secs = seconds.max(f64::MIN_POSITIVE);
    let ms = |s: Option<f64>| s.map(|s| (s * 1e5).round() / 100.0);
    let mut out: BTreeMap<(String, String, String), Vec<TrafficRow>> = BTreeMap::new();
    for ((key, from), c) in window {
        out.entry((
            key.namespace.clone(),
            key.service.clone(),
            key.cluster.clone(),
        ))
        .or_default()
        .push(TrafficRow {
            from: from.clone(),
            to: key.cluster.clone(),
            requests_per_second: (c.requests / secs * 100.0).round() / 100.0,
            success_rate: (c.responses > 0.0).then(|| 1.0 - c.failures / c.responses),
            latency_p50_ms: ms(c.quantile(0.5)),
            latency_p95_ms: ms(c.quantile(0.95)),
            latency_p99_ms: ms(c.quantile(0.99)),
        });
    }
    for rows in out.values_mut() {
        rows.sort_by(|a, b| a.from.cmp(&b.from));
    }
    out
}

/// Calls between clusters: the rows summed per (from, to), success rate
/// weighted by rate.
fn edges<'a>(rows: impl Iterator<Item = &'a TrafficRow>) -> Vec<Edge> {
    let mut sums: BTreeMap<(String, String), (f64, f64, f64)> = BTreeMap::new();
    for r in rows {
        let e = sums.entry((r.from.clone(), r.to.clone())).or_default();
        e.0 += r.requests_per_second;
        if let Some(s) = r.success_rate {
            e.1 += s * r.requests_per_second;
            e.2 += r.requests_per_second;
        }
    }
    sums.into_iter()
        .map(|((from, to), (rps, ok, weighed))| Edge {
            from,
            to,
            requests_per_second: (rps * 100.0).round() / 100.0,
            success_rate: (weighed > 0.0).then(|| ok / weighed),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj<K: serde::de::DeserializeOwned>(v: serde_json::Value) -> K {
        serde_json::from_value(v).unwrap()
    }

    fn link(cluster: &str, alive: &str) -> DynamicObject {
        obj(json!({
            "apiVersion": "multicluster.strait.dev/v1alpha1", "kind": "Link",
            "metadata": {"name": cluster, "namespace": "strait-multicluster"},
            "spec": {"targetClusterName": cluster, "clusterCredentialsSecret": format!("cluster-credentials-{cluster}"),
                     "gatewayAddresses": ["10.1.0.2"], "gatewayPort": 30143},
            "status": {"mirroredServices": 1, "gatewayLatency": {"p50Ms": 1.5, "p99Ms": 4.0, "samples": 20},
                       "conditions": [{"type": "GatewayAlive", "status": alive, "reason": "Probed", "message": "3 probes failed",
                                       "lastTransitionTime": "2026-12-06T00:00:00Z"}]}
        }))
    }

    fn calls(
        service: &str,
        cluster: &str,
        from: &str,
        requests: f64,
        failures: f64,
    ) -> ((ServiceKey, String), Counts) {
        (
            (
                ServiceKey {
                    namespace: "shop".into(),
                    service: service.into(),
                    cluster: cluster.into(),
                },
                from.into(),
            ),
            Counts {
                requests,
                responses: requests,
                failures,
                buckets: BTreeMap::from([
                    (0.01f64.to_bits(), requests),
                    (f64::INFINITY.to_bits(), requests),
                ]),
            },
        )
    }

    #[test]
    fn the_page_names_clusters_links_services_and_calls_between_clusters() {
        let links = [link("west", "True"), link("north", "False")];
        let mirror: Service = obj(json!({"metadata": {"name": "web-west", "namespace": "shop",
            "labels": {"strait.dev/mirrored-service": "true", "strait.dev/cluster-name": "west"},
            "annotations": {"strait.dev/remote-svc-fq-name": "web.shop.svc.cluster.local"}}}));
        let exported: Service = obj(
            json!({"metadata": {"name": "db", "namespace": "shop", "labels": {"strait.dev/exported": "true"}}}),
        );
        let import: DynamicObject = obj(
            json!({"apiVersion": "multicluster.x-k8s.io/v1alpha1", "kind": "ServiceImport",
            "metadata": {"name": "cart", "namespace": "shop"},
            "spec": {"type": "ClusterSetIP", "ports": []},
            "status": {"clusters": [{"cluster": "west"}, {"cluster": "east"}]}}),
        );
        let slices: Vec<EndpointSlice> = vec![
            obj(
                json!({"metadata": {"name": "web-west-1", "namespace": "shop", "labels": {"kubernetes.io/service-name": "web-west"}},
                "addressType": "IPv4", "endpoints": [{"addresses": ["10.1.0.2"], "conditions": {"ready": true}},
                                                      {"addresses": ["10.1.0.3"], "conditions": {"ready": false}}]}),
            ),
            obj(
                json!({"metadata": {"name": "cart-1", "namespace": "shop", "labels": {"multicluster.kubernetes.io/service-name": "cart"}},
                "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.9"]}]}),
            ),
        ];
        let window: HashMap<_, _> = [
            calls("web", "west", "east", 100.0, 0.0),
            calls("db", "east", "west", 20.0, 5.0),
            calls("cart", "west", "east", 10.0, 0.0),
            calls("api", "east", "east", 50.0, 0.0),
        ]
        .into_iter()
        .collect();
        let checks = vec![CheckResult::fail(
            "link north: trust anchors",
            "no anchor in common",
            "reinstall",
        )];
        let tokens = TokenTimes::from([("west".to_string(), (Some(1_000), 1_000 + 86_400))]);
        let state = build(&Inputs {
            cluster: "east",
            now: 2_000,
            links: &links,
            exported: &[exported],
            mirrored: &[mirror],
            imports: &[import],
            slices: &slices,
            pods: &[],
            window: &window,
            window_seconds: 10.0,
            checks: &checks,
            tokens: &tokens,
        });
        let names: Vec<(&str, bool, bool)> = state
            .clusters
            .iter()
            .map(|c| (c.name.as_str(), c.local, c.linked))
            .collect();
        assert_eq!(
            names,
            [
                ("east", true, false),
                ("north", false, true),
                ("west", false, true)
            ]
        );
        let west = state.links.iter().find(|l| l.cluster == "west").unwrap();
        assert_eq!(
            (west.alive.as_str(), west.latency_p50_ms),
            ("yes", Some(1.5))
        );
        assert_eq!(
            (west.credentials_expire_in, west.credentials_lifetime),
            (Some(85_400), Some(86_400))
        );
        assert_eq!(west.trust_anchors, "unknown");
        let north = state.links.iter().find(|l| l.cluster == "north").unwrap();
        assert_eq!(
            (north.alive.as_str(), north.trust_anchors.as_str()),
            ("no", "fail")
        );
        assert_eq!(north.credentials_expire_in, None);

        let by_name = |n: &str| state.services.iter().find(|s| s.name == n).unwrap();
        let web = by_name("web-west");
        assert_eq!(
            (web.kind.as_str(), web.service.as_str()),
            ("mirrored", "web")
        );
        assert_eq!((web.ready_endpoints, web.endpoints), (1, 2));
        assert_eq!(web.traffic.len(), 1);
        assert_eq!(
            (
                web.traffic[0].from.as_str(),
                web.traffic[0].requests_per_second
            ),
            ("east", 10.0)
        );
        assert_eq!(web.traffic[0].success_rate, Some(1.0));
        let db = by_name("db");
        assert_eq!(
            (db.kind.as_str(), db.traffic[0].from.as_str()),
            ("exported", "west")
        );
        assert_eq!(db.traffic[0].success_rate, Some(0.75));
        let cart = by_name("cart");
        assert_eq!(
            (cart.kind.as_str(), cart.clusters.clone()),
            ("clusterset", vec!["east".to_string(), "west".into()])
        );
        assert_eq!((cart.ready_endpoints, cart.traffic.len()), (1, 1));
        // Calls to a Service none of the above names are still shown.
        assert_eq!(by_name("api").kind, "meshed");

        let edges: Vec<(&str, &str, f64)> = state
            .traffic
            .iter()
            .map(|e| (e.from.as_str(), e.to.as_str(), e.requests_per_second))
            .collect();
        assert_eq!(
            edges,
            [
                ("east", "east", 5.0),
                ("east", "west", 11.0),
                ("west", "east", 2.0)
            ]
        );
        assert_eq!(state.traffic[2].success_rate, Some(0.75));
    }

    #[test]
    fn a_link_that_does_not_parse_is_shown_with_why() {
        let broken: DynamicObject = obj(json!({
            "apiVersion": "multicluster.strait.dev/v1alpha1", "kind": "Link",
            "metadata": {"name": "bad", "namespace": "strait-multicluster"},
            "spec": {"targetClusterName": "south", "gatewayPort": "not a port"}
        }));
        let view = link_view(&broken, 0, &[], &TokenTimes::new());
        assert_eq!(view.cluster, "south");
        assert!(
            view.error
                .as_deref()
                .is_some_and(|e| e.contains("does not parse")),
            "{view:?}"
        );
    }
}
