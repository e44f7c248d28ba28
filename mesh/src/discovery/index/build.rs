//! Building the tables' entries from Kubernetes objects: ready endpoints and
//! how each is reached, mirrors, opaque ports, the node proxies, pods.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;

use super::super::model::{Endpoint, MirrorInfo, PodInfo, PodRef, Route};
use crate::detect::{OpaquePorts, PortsSource};
use crate::identity::SpiffeId;
use crate::mcs::{Affinity, LABEL_SERVICE_NAME, MANAGED_BY as MCS_MANAGED_BY};
use crate::names::{
    AFFINITY_ANNOTATION, CLUSTER_NAME_LABEL, Carrier, GATEWAY_IDENTITY_ANNOTATION, MIRRORED_LABEL,
    OPAQUE_PORTS_ANNOTATION, READY_ENDPOINTS_ANNOTATION, REMOTE_FQ_NAME_ANNOTATION,
};

pub(super) struct EndpointContext<'a> {
    pub(super) node_proxies: &'a HashMap<String, SocketAddr>,
    pub(super) pods_by_name: &'a HashMap<(&'a str, &'a str), Arc<PodInfo>>,
    pub(super) pods_by_ip: &'a HashMap<IpAddr, Arc<PodInfo>>,
}

/// Ready endpoints of one Service port across its slices. The target port comes
/// from the slice port of the same name, which the EndpointSlice controller
/// resolved per pod (named targetPorts may differ between pods).
pub(super) fn ready_endpoints(
    ctx: &EndpointContext<'_>,
    slices: &[&EndpointSlice],
    port_name: Option<&str>,
    mirror: &Option<MirrorInfo>,
) -> Vec<Endpoint> {
    // By address: an endpoint moving between slices may briefly be in two.
    let mut out: BTreeMap<SocketAddr, (Route, u32)> = BTreeMap::new();
    for slice in slices {
        let Some(target_port) = slice_port(slice, port_name) else {
            continue;
        };
        let gateway_identity = slice
            .annotations()
            .get(GATEWAY_IDENTITY_ANNOTATION)
            .map(|id| id.parse::<SpiffeId>());
        let remote_service = slice.annotations().get(REMOTE_FQ_NAME_ANNOTATION).cloned();
        let weight = gateway_weight(slice);
        for ep in slice.endpoints.iter().flatten() {
            // Kubernetes: an unset `ready` means ready.
            if ep.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            for address in &ep.addresses {
                let Ok(ip) = address.parse::<IpAddr>() else {
                    continue;
                };
                let addr = SocketAddr::new(ip, target_port);
                let route = match (&gateway_identity, mirror) {
                    (Some(Ok(identity)), _) => Some(Route::Gateway {
                        gateway: addr,
                        identity: identity.clone(),
                        service: remote_service.clone(),
                    }),
                    (Some(Err(e)), _) => {
                        tracing::warn!(slice = %slice.name_any(), "gateway identity is not valid: {e}; skipping its endpoints");
                        None
                    }
                    // A mirror endpoint without a gateway identity cannot be verified.
                    (None, Some(_)) => None,
                    (None, None) => endpoint_route(ctx, ep, ip),
                };
                if let Some(route) = route {
                    let weight = if matches!(route, Route::Gateway { .. }) {
                        weight
                    } else {
                        1
                    };
                    out.entry(addr).or_insert((route, weight));
                }
            }
        }
    }
    out.into_iter()
        .map(|(addr, (route, weight))| Endpoint {
            addr,
            route,
            weight,
        })
        .collect()
}

/// The weight of each gateway address of a linked cluster's slice: the
/// service's ready endpoints there ([`READY_ENDPOINTS_ANNOTATION`]) spread
/// over the slice's addresses, at least 1; 1 when the slice does not say.
fn gateway_weight(slice: &EndpointSlice) -> u32 {
    let Some(ready) = slice
        .annotations()
        .get(READY_ENDPOINTS_ANNOTATION)
        .and_then(|n| n.parse::<u32>().ok())
    else {
        return 1;
    };
    let addresses = slice
        .endpoints
        .iter()
        .flatten()
        .map(|e| e.addresses.len() as u32)
        .sum::<u32>()
        .max(1);
    ready.div_ceil(addresses).max(1)
}

/// A clusterset service's endpoints as its affinity wants them: local pods
/// first (`Local`), other clusters' gateways first (`Remote`), or all.
pub(super) fn with_affinity(endpoints: Vec<Endpoint>, affinity: Affinity) -> Vec<Endpoint> {
    let remote = |e: &Endpoint| matches!(e.route, Route::Gateway { .. });
    let preferred = |e: &Endpoint| match affinity {
        Affinity::Local => !remote(e),
        Affinity::Remote => remote(e),
        Affinity::None => true,
    };
    if endpoints.iter().any(preferred) {
        endpoints.into_iter().filter(preferred).collect()
    } else {
        endpoints
    }
}

/// The clusterset service a Service stands for: the `multicluster.kubernetes.io/service-name`
/// of a ClusterSetIP's derived Service written by Strait's controller, and its affinity.
pub(super) fn clusterset_service(svc: &Service) -> Option<(String, Affinity)> {
    let labels = svc.labels();
    if labels.get(MCS_MANAGED_BY.0).map(String::as_str) != Some(MCS_MANAGED_BY.1) {
        return None;
    }
    let name = labels.get(LABEL_SERVICE_NAME)?.clone();
    let affinity = svc
        .annotations()
        .get(AFFINITY_ANNOTATION)
        .and_then(|a| Affinity::parse(a))
        .unwrap_or_default();
    Some((name, affinity))
}

/// Addresses of the ready endpoints of a headless Service, in a stable order.
pub(super) fn ready_addresses(slices: &[&EndpointSlice]) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = slices
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .filter(|ep| ep.conditions.as_ref().and_then(|c| c.ready) != Some(false))
        .flat_map(|ep| ep.addresses.iter().filter_map(|a| a.parse().ok()))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The port of `slice` for the Service port named `port_name` (unnamed: `None` or "").
pub fn slice_port(slice: &EndpointSlice, port_name: Option<&str>) -> Option<u16> {
    slice
        .ports
        .iter()
        .flatten()
        .find(|p| {
            p.name.as_deref().filter(|n| !n.is_empty()) == port_name
                && p.protocol.as_deref().is_none_or(|p| p == "TCP")
        })
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
}

pub(super) fn endpoint_route(
    ctx: &EndpointContext<'_>,
    ep: &k8s_openapi::api::discovery::v1::Endpoint,
    ip: IpAddr,
) -> Option<Route> {
    let target = ep.target_ref.as_ref();
    if target.and_then(|t| t.kind.as_deref()) != Some("Pod") {
        return Some(Route::Direct);
    }
    let target = target?;
    let pod = match (target.namespace.as_deref(), target.name.as_deref()) {
        (Some(ns), Some(name)) => ctx.pods_by_name.get(&(ns, name)),
        _ => ctx.pods_by_ip.get(&ip),
    };
    let Some(pod) = pod else {
        // The slice can be ahead of the pod watch; the next rebuild fills it in.
        tracing::debug!(%ip, "endpoint's pod not known yet");
        return None;
    };
    pod_route(pod, ctx.node_proxies)
}

/// A pod is reached through its node's proxy, which must speak for the pod's identity.
pub(super) fn pod_route(
    pod: &PodInfo,
    node_proxies: &HashMap<String, SocketAddr>,
) -> Option<Route> {
    let Some(proxy) = node_proxies.get(&pod.node) else {
        tracing::debug!(pod = %format!("{}/{}", pod.namespace, pod.name), node = %pod.node, "node has no InternalIP yet");
        return None;
    };
    Some(Route::NodeProxy {
        pod: PodRef {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
        },
        node: pod.node.clone(),
        proxy: *proxy,
        identity: pod.identity.clone()?,
    })
}

pub(super) fn mirror_info(svc: &Service) -> Option<MirrorInfo> {
    if svc.labels().get(MIRRORED_LABEL).map(String::as_str) != Some("true") {
        return None;
    }
    Some(MirrorInfo {
        cluster: svc
            .labels()
            .get(CLUSTER_NAME_LABEL)
            .cloned()
            .unwrap_or_default(),
        remote_fq_name: svc
            .annotations()
            .get(REMOTE_FQ_NAME_ANNOTATION)
            .cloned()
            .unwrap_or_default(),
    })
}

/// The object's own `strait.dev/opaque-ports` (no defaults: those are the
/// detection policy's, `detect::skip_detection`). Bad entries are skipped.
pub(super) fn annotation_ports(
    annotations: &BTreeMap<String, String>,
    on: PortsSource,
) -> OpaquePorts {
    let Some(value) = annotations.get(OPAQUE_PORTS_ANNOTATION) else {
        return OpaquePorts::default();
    };
    let (ports, errors) = OpaquePorts::parse(value, on);
    for e in errors {
        tracing::debug!("{e}");
    }
    ports
}

/// Where each node's proxy takes tunnels: the newest Ready, not terminating
/// node-proxy pod of the node, at its pod IP (the DaemonSet has no
/// hostPorts, so during a rollout the old and the new proxy of a node run
/// side by side, and callers move to the new one as soon as it is Ready and
/// the old one terminating); a node without one, at its InternalIP (a proxy
/// on the host network).
pub(super) fn node_proxies(
    nodes: &[Arc<Node>],
    pods: &[Arc<Pod>],
    port: u16,
) -> HashMap<String, SocketAddr> {
    let mut proxies: HashMap<String, SocketAddr> = nodes
        .iter()
        .filter_map(|n| Some((n.name_any(), SocketAddr::new(internal_ip(n)?, port))))
        .collect();
    let mut newest: HashMap<&str, &Pod> = HashMap::new();
    for pod in pods {
        let (Some(spec), Some(status)) = (&pod.spec, &pod.status) else {
            continue;
        };
        let (namespace, account) = Carrier::NodeProxy.account();
        let serving = pod.metadata.namespace.as_deref() == Some(namespace)
            && spec.service_account_name.as_deref() == Some(account)
            && pod.metadata.deletion_timestamp.is_none()
            && status.pod_ip.is_some()
            && status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True");
        let Some(node) = spec.node_name.as_deref().filter(|_| serving) else {
            continue;
        };
        let created = |p: &Pod| p.metadata.creation_timestamp.clone();
        match newest.get(node) {
            Some(other) if created(other) >= created(pod) => {}
            _ => {
                newest.insert(node, pod);
            }
        }
    }
    for (node, pod) in newest {
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse().ok());
        if let Some(ip) = ip {
            proxies.insert(node.to_string(), SocketAddr::new(ip, port));
        }
    }
    proxies
}

pub(super) fn internal_ip(node: &Node) -> Option<IpAddr> {
    node.status
        .as_ref()?
        .addresses
        .iter()
        .flatten()
        .find(|a| a.type_ == "InternalIP")
        .and_then(|a| a.address.parse().ok())
}

/// What the proxy needs of a Pod; `None` for a pod not yet bound to a node or without an IP.
pub fn pod_info(pod: &Pod, trust_domain: &str) -> Option<PodInfo> {
    let spec = pod.spec.as_ref()?;
    let status = pod.status.as_ref()?;
    let node = spec.node_name.clone()?;
    let mut ips: Vec<IpAddr> = status
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|p| p.ip.parse().ok())
        .collect();
    if ips.is_empty() {
        ips.extend(
            status
                .pod_ip
                .as_deref()
                .and_then(|ip| ip.parse::<IpAddr>().ok()),
        );
    }
    if ips.is_empty() {
        return None;
    }
    let namespace = pod.metadata.namespace.clone()?;
    let service_account = spec
        .service_account_name
        .clone()
        .unwrap_or_else(|| "default".into());
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    Some(PodInfo {
        identity: SpiffeId::new(trust_domain, &namespace, &service_account).ok(),
        namespace,
        name: pod.name_any(),
        ips,
        node,
        service_account,
        ready,
        opaque_ports: pod
            .annotations()
            .contains_key(OPAQUE_PORTS_ANNOTATION)
            .then(|| annotation_ports(pod.annotations(), PortsSource::Pod)),
    })
}
