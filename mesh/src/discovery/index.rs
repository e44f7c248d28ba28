//! The lookup tables, rebuilt from the reflector stores after each burst of
//! changes. Building is pure (objects in, tables out), so it is unit-tested
//! without an API server; lookups are hash-map reads of an immutable snapshot.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::identity::SpiffeId;
use crate::names::{
    CLUSTER_NAME_LABEL, GATEWAY_IDENTITY_ANNOTATION, MIRRORED_LABEL, REMOTE_FQ_NAME_ANNOTATION,
};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;

use super::model::{
    Destination, Endpoint, MirrorInfo, PodInfo, PodRef, Route, ServicePortRef, ServiceRef,
};
use crate::detect::{OpaquePorts, PortsSource};

use super::names::{parse_service_host, parse_timeout};
use crate::names::{
    ALLOWED_IDENTITIES_ANNOTATION, Carrier, OPAQUE_PORTS_ANNOTATION, TIMEOUT_ANNOTATION,
    TRANSPARENT_ANNOTATION,
};

/// The label tying an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// What the tables depend on besides the objects.
#[derive(Clone, Debug)]
pub struct IndexConfig {
    /// This node (`spec.nodeName` of the pods this proxy delivers to).
    pub node_name: String,
    /// `cluster.local` unless the cluster says otherwise.
    pub cluster_domain: String,
    /// Trust domain of pod identities.
    pub trust_domain: String,
    /// The inbound port of every node proxy (4143).
    pub inbound_port: u16,
    /// The label (key, value) that exports a Service (what the gateway serves).
    pub export_label: (String, String),
}

/// One consistent view of the cluster. Cheap to share (`Arc`); never mutated.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// All four kinds have been listed once.
    pub(crate) synced: bool,
    node_name: String,
    cluster_domain: String,
    /// ClusterIP:port → destination.
    by_addr: HashMap<SocketAddr, Arc<Destination>>,
    /// (namespace, name, port) → destination; headless Services too.
    by_name: HashMap<(String, String, u16), Arc<Destination>>,
    /// Pod IP → pod (host-network pods excluded: their IP is the node's).
    pods_by_ip: HashMap<IpAddr, Arc<PodInfo>>,
    /// Node name → its proxy's inbound address.
    node_proxies: HashMap<String, SocketAddr>,
    /// (namespace, name) → what `<name>.<namespace>.svc.<cluster domain>`
    /// resolves to: the ClusterIPs, or for a headless Service its ready
    /// endpoints' addresses (the node proxy's DNS responder answers from it).
    dns: HashMap<(String, String), Vec<IpAddr>>,
    /// Namespaces with a `strait.dev/opaque-ports` annotation.
    namespace_ports: HashMap<String, OpaquePorts>,
    /// Pods scheduled to this node (with or without an IP yet) → whether
    /// they asked for transparent mode ([`TRANSPARENT_ANNOTATION`]).
    transparent: HashMap<(String, String), bool>,
}

fn transparent_value(annotations: &BTreeMap<String, String>) -> Option<bool> {
    match annotations.get(TRANSPARENT_ANNOTATION)?.trim() {
        "enabled" | "true" => Some(true),
        "disabled" | "false" => Some(false),
        other => {
            tracing::debug!(
                "{TRANSPARENT_ANNOTATION}: {other:?} is neither enabled nor disabled; ignored"
            );
            None
        }
    }
}

impl Snapshot {
    /// [`Snapshot::build_with`] without namespace annotations.
    pub fn build(
        config: &IndexConfig,
        services: &[Arc<Service>],
        slices: &[Arc<EndpointSlice>],
        pods: &[Arc<Pod>],
        nodes: &[Arc<Node>],
    ) -> Self {
        Self::build_with(config, services, slices, pods, nodes, &[])
    }

    /// The tables from the objects. Which ports skip protocol detection
    /// follows `detect::skip_detection`: a Service port is opaque when the
    /// Service's list or its workloads' list (the Namespace's, else the
    /// defaults) names it; a pod port when the Pod's list (else the
    /// Namespace's, else the defaults) names it.
    pub fn build_with(
        config: &IndexConfig,
        services: &[Arc<Service>],
        slices: &[Arc<EndpointSlice>],
        pods: &[Arc<Pod>],
        nodes: &[Arc<Node>],
        namespaces: &[Arc<Namespace>],
    ) -> Self {
        let namespace_ports: HashMap<String, OpaquePorts> = namespaces
            .iter()
            .filter(|ns| ns.annotations().contains_key(OPAQUE_PORTS_ANNOTATION))
            .map(|ns| {
                (
                    ns.name_any(),
                    annotation_ports(ns.annotations(), PortsSource::Namespace),
                )
            })
            .collect();
        let defaults = OpaquePorts::defaults();
        let namespace_transparent: HashMap<String, bool> = namespaces
            .iter()
            .filter_map(|ns| Some((ns.name_any(), transparent_value(ns.annotations())?)))
            .collect();
        let transparent: HashMap<(String, String), bool> = pods
            .iter()
            .filter(|p| {
                p.spec.as_ref().and_then(|s| s.node_name.as_deref())
                    == Some(config.node_name.as_str())
            })
            .filter_map(|p| {
                let ns = p.metadata.namespace.clone()?;
                let wanted = transparent_value(p.annotations())
                    .or_else(|| namespace_transparent.get(&ns).copied())
                    .unwrap_or(false);
                Some(((ns, p.name_any()), wanted))
            })
            .collect();
        let node_proxies = node_proxies(nodes, pods, config.inbound_port);
        let mut pods_by_ip: HashMap<IpAddr, Arc<PodInfo>> = HashMap::new();
        let mut pods_by_name: HashMap<(&str, &str), Arc<PodInfo>> = HashMap::new();
        for pod in pods {
            let Some(info) = pod_info(pod, &config.trust_domain) else {
                continue;
            };
            let info = Arc::new(info);
            if let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) {
                pods_by_name.insert((ns.as_str(), name.as_str()), info.clone());
            }
            if pod.spec.as_ref().and_then(|s| s.host_network) == Some(true) {
                continue;
            }
            for ip in &info.ips {
                // A reused IP (a pod going away, its successor starting): the ready one wins.
                match pods_by_ip.get(ip) {
                    Some(existing) if existing.ready && !info.ready => {}
                    _ => {
                        pods_by_ip.insert(*ip, info.clone());
                    }
                }
            }
        }
        let mut slices_by_service: HashMap<(&str, &str), Vec<&EndpointSlice>> = HashMap::new();
        for slice in slices {
            if let (Some(ns), Some(svc)) = (
                slice.metadata.namespace.as_deref(),
                slice
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(SERVICE_NAME_LABEL))
                    .map(String::as_str),
            ) {
                slices_by_service
                    .entry((ns, svc))
                    .or_default()
                    .push(&**slice);
            }
        }
        let ctx = EndpointContext {
            node_proxies: &node_proxies,
            pods_by_name: &pods_by_name,
            pods_by_ip: &pods_by_ip,
        };
        let mut by_addr = HashMap::new();
        let mut by_name = HashMap::new();
        let mut dns = HashMap::new();
        for svc in services {
            let (Some(ns), Some(name)) = (&svc.metadata.namespace, &svc.metadata.name) else {
                continue;
            };
            let Some(spec) = &svc.spec else { continue };
            if spec.type_.as_deref() == Some("ExternalName") {
                continue;
            }
            let svc_slices = slices_by_service
                .get(&(ns.as_str(), name.as_str()))
                .map(Vec::as_slice)
                .unwrap_or_default();
            let mirror = mirror_info(svc);
            let opaque = annotation_ports(svc.annotations(), PortsSource::Service);
            let (export_key, export_value) = &config.export_label;
            let exported = svc.labels().get(export_key) == Some(export_value);
            let allowed_identities = svc
                .annotations()
                .get(ALLOWED_IDENTITIES_ANNOTATION)
                .map(|v| Arc::<str>::from(v.as_str()));
            let workloads = namespace_ports.get(ns.as_str()).unwrap_or(&defaults);
            let timeout = svc
                .annotations()
                .get(TIMEOUT_ANNOTATION)
                .and_then(|v| match parse_timeout(v) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        tracing::warn!(service = %format!("{ns}/{name}"), "{e}; no timeout applies");
                        None
                    }
                });
            let cluster_ips: Vec<IpAddr> = spec
                .cluster_ips
                .iter()
                .flatten()
                .chain(spec.cluster_ip.iter())
                .filter_map(|ip| ip.parse().ok())
                .collect();
            let addresses = if cluster_ips.is_empty() {
                ready_addresses(svc_slices)
            } else {
                let mut ips = cluster_ips.clone();
                ips.dedup();
                ips
            };
            dns.insert((ns.clone(), name.clone()), addresses);
            for sp in spec.ports.iter().flatten() {
                if sp.protocol.as_deref().is_some_and(|p| p != "TCP") {
                    continue;
                }
                let Ok(port) = u16::try_from(sp.port) else {
                    continue;
                };
                let port_name = sp.name.clone().filter(|n| !n.is_empty());
                let endpoints = ready_endpoints(&ctx, svc_slices, port_name.as_deref(), &mirror);
                let dest = Arc::new(Destination {
                    service: Some(ServiceRef {
                        namespace: ns.clone(),
                        name: name.clone(),
                    }),
                    fq_name: Some(format!("{name}.{ns}.svc.{}", config.cluster_domain)),
                    port: ServicePortRef {
                        name: port_name,
                        port,
                    },
                    mirror: mirror.clone(),
                    opaque: opaque.contains(port) || workloads.contains(port),
                    endpoints: endpoints.into(),
                    timeout,
                    exported,
                    allowed_identities: allowed_identities.clone(),
                });
                for ip in &cluster_ips {
                    by_addr.insert(SocketAddr::new(*ip, port), dest.clone());
                }
                by_name.insert((ns.clone(), name.clone(), port), dest);
            }
        }
        Self {
            synced: false,
            node_name: config.node_name.clone(),
            cluster_domain: config.cluster_domain.clone(),
            by_addr,
            by_name,
            pods_by_ip,
            node_proxies,
            dns,
            namespace_ports,
            transparent,
        }
    }

    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// A ClusterIP:port → that Service port; a pod IP:port → that pod (whether
    /// or not it is ready: the caller chose it). Anything else: `None`.
    pub fn resolve_addr(&self, addr: SocketAddr) -> Option<Arc<Destination>> {
        if let Some(dest) = self.by_addr.get(&addr) {
            return Some(dest.clone());
        }
        let pod = self.pods_by_ip.get(&addr.ip())?;
        let endpoints: Vec<Endpoint> = pod_route(pod, &self.node_proxies)
            .map(|route| Endpoint { addr, route })
            .into_iter()
            .collect();
        Some(Arc::new(Destination {
            service: None,
            fq_name: None,
            port: ServicePortRef {
                name: None,
                port: addr.port(),
            },
            mirror: None,
            opaque: self.pod_opaque_ports(pod).contains(addr.port()),
            endpoints: endpoints.into(),
            timeout: None,
            exported: false,
            allowed_identities: None,
        }))
    }

    /// `svc.ns`, `svc.ns.svc`, `svc.ns.svc.<cluster domain>` and a Service port.
    pub fn resolve_name(&self, host: &str, port: u16) -> Option<Arc<Destination>> {
        let (ns, name) = parse_service_host(host, &self.cluster_domain)?;
        self.by_name.get(&(ns, name, port)).cloned()
    }

    /// The pod with this IP if, and only if, it runs on this node (the inbound
    /// side delivers nowhere else).
    pub fn local_pod(&self, ip: IpAddr) -> Option<Arc<PodInfo>> {
        self.pods_by_ip
            .get(&ip)
            .filter(|p| p.node == self.node_name)
            .cloned()
    }

    /// Whether the pod `namespace/name`, scheduled to this node, asked for
    /// transparent mode; `None` when no such pod is scheduled here (yet).
    pub fn transparent_wanted(&self, namespace: &str, name: &str) -> Option<bool> {
        self.transparent
            .get(&(namespace.to_string(), name.to_string()))
            .copied()
    }

    /// The ports of `pod` that skip detection: its own list, else its
    /// namespace's, else the defaults.
    fn pod_opaque_ports(&self, pod: &PodInfo) -> OpaquePorts {
        pod.opaque_ports
            .clone()
            .or_else(|| self.namespace_ports.get(&pod.namespace).cloned())
            .unwrap_or_else(OpaquePorts::defaults)
    }

    /// What a DNS name of a Service resolves to: `Some(addresses)` (maybe
    /// empty: a headless Service without ready endpoints) when the Service
    /// exists, `None` when it does not. Only the full form
    /// `<name>.<namespace>.svc.<cluster domain>` (any case, optional final dot).
    pub fn dns_lookup(&self, host: &str) -> Option<&[IpAddr]> {
        let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
        let suffix = format!(".svc.{}", self.cluster_domain.trim_end_matches('.'));
        if !host.ends_with(&suffix.to_ascii_lowercase()) {
            return None;
        }
        let (ns, name) = parse_service_host(&host, &self.cluster_domain)?;
        self.dns.get(&(ns, name)).map(Vec::as_slice)
    }

    /// The cluster's DNS domain (`cluster.local`).
    pub fn cluster_domain(&self) -> &str {
        &self.cluster_domain
    }

    /// The pod `namespace/name` if it runs on this node.
    pub fn local_pod_named(&self, namespace: &str, name: &str) -> Option<Arc<PodInfo>> {
        self.local_pods()
            .find(|p| p.namespace == namespace && p.name == name)
            .cloned()
    }

    /// The pods running on this node (the identities this proxy may hold).
    pub fn local_pods(&self) -> impl Iterator<Item = &Arc<PodInfo>> {
        self.pods_by_ip
            .values()
            .filter(|p| p.node == self.node_name)
    }

    /// Any pod of the cluster by IP.
    pub fn pod(&self, ip: IpAddr) -> Option<Arc<PodInfo>> {
        self.pods_by_ip.get(&ip).cloned()
    }

    /// The inbound address of a node's proxy.
    pub fn node_proxy(&self, node: &str) -> Option<SocketAddr> {
        self.node_proxies.get(node).copied()
    }
}

struct EndpointContext<'a> {
    node_proxies: &'a HashMap<String, SocketAddr>,
    pods_by_name: &'a HashMap<(&'a str, &'a str), Arc<PodInfo>>,
    pods_by_ip: &'a HashMap<IpAddr, Arc<PodInfo>>,
}

/// Ready endpoints of one Service port across its slices. The target port comes
/// from the slice port of the same name, which the EndpointSlice controller
/// resolved per pod (named targetPorts may differ between pods).
fn ready_endpoints(
    ctx: &EndpointContext<'_>,
    slices: &[&EndpointSlice],
    port_name: Option<&str>,
    mirror: &Option<MirrorInfo>,
) -> Vec<Endpoint> {
    // By address: an endpoint moving between slices may briefly be in two.
    let mut out: BTreeMap<SocketAddr, Route> = BTreeMap::new();
    for slice in slices {
        let Some(target_port) = slice_port(slice, port_name) else {
            continue;
        };
        let gateway_identity = slice
            .annotations()
            .get(GATEWAY_IDENTITY_ANNOTATION)
            .map(|id| id.parse::<SpiffeId>());
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
                    out.entry(addr).or_insert(route);
                }
            }
        }
    }
    out.into_iter()
        .map(|(addr, route)| Endpoint { addr, route })
        .collect()
}

/// Addresses of the ready endpoints of a headless Service, in a stable order.
fn ready_addresses(slices: &[&EndpointSlice]) -> Vec<IpAddr> {
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

fn endpoint_route(
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
fn pod_route(pod: &PodInfo, node_proxies: &HashMap<String, SocketAddr>) -> Option<Route> {
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

fn mirror_info(svc: &Service) -> Option<MirrorInfo> {
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
fn annotation_ports(annotations: &BTreeMap<String, String>, on: PortsSource) -> OpaquePorts {
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
fn node_proxies(nodes: &[Arc<Node>], pods: &[Arc<Pod>], port: u16) -> HashMap<String, SocketAddr> {
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

fn internal_ip(node: &Node) -> Option<IpAddr> {
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

#[cfg(test)]
mod tests;
