//! The lookup tables, rebuilt from the reflector stores after each burst of
//! changes. Building is pure (objects in, tables out), so it is unit-tested
//! without an API server; lookups are hash-map reads of an immutable snapshot.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;

use super::model::{Destination, Endpoint, PodInfo, ServicePortRef, ServiceRef};
use crate::detect::{OpaquePorts, PortsSource};

use super::names::{parse_service_host, parse_timeout};
use crate::names::{
    ALLOWED_IDENTITIES_ANNOTATION, CLUSTERSET_DOMAIN, CLUSTERSET_EXPORTED_ANNOTATION,
    CLUSTERSET_SLICE_SERVICE_LABEL, OPAQUE_PORTS_ANNOTATION, TIMEOUT_ANNOTATION,
    TRANSPARENT_ANNOTATION,
};

mod build;

use build::*;
pub use build::{pod_info, slice_port};

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
    /// `<svc>.<ns>.svc.clusterset.local`: the ClusterSetIP's derived Service.
    by_clusterset_name: HashMap<(String, String, u16), Arc<Destination>>,
    clusterset_dns: HashMap<(String, String), Vec<IpAddr>>,
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
                    .and_then(|l| {
                        l.get(SERVICE_NAME_LABEL)
                            .or_else(|| l.get(CLUSTERSET_SLICE_SERVICE_LABEL))
                    })
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
        let mut by_clusterset_name = HashMap::new();
        let mut clusterset_dns = HashMap::new();
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
            let clusterset = clusterset_service(svc);
            let opaque = annotation_ports(svc.annotations(), PortsSource::Service);
            let (export_key, export_value) = &config.export_label;
            let exported = svc.labels().get(export_key) == Some(export_value)
                || svc
                    .annotations()
                    .get(CLUSTERSET_EXPORTED_ANNOTATION)
                    .map(String::as_str)
                    == Some("true");
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
                let mut endpoints =
                    ready_endpoints(&ctx, svc_slices, port_name.as_deref(), &mirror);
                if let Some((_, affinity)) = &clusterset {
                    endpoints = with_affinity(endpoints, *affinity);
                }
                // A clusterset service's local pods are asked for as the
                // exported Service of the same name (its policy applies).
                let fq_service = clusterset.as_ref().map_or(name, |(n, _)| n);
                let dest = Arc::new(Destination {
                    service: Some(ServiceRef {
                        namespace: ns.clone(),
                        name: name.clone(),
                    }),
                    fq_name: Some(format!("{fq_service}.{ns}.svc.{}", config.cluster_domain)),
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
                if let Some((clusterset_name, _)) = &clusterset {
                    by_clusterset_name
                        .insert((ns.clone(), clusterset_name.clone(), port), dest.clone());
                }
                by_name.insert((ns.clone(), name.clone(), port), dest);
            }
            if let Some((clusterset_name, _)) = &clusterset
                && let Some(addresses) = dns.get(&(ns.clone(), name.clone()))
            {
                clusterset_dns.insert((ns.clone(), clusterset_name.clone()), addresses.clone());
            }
        }
        Self {
            synced: false,
            node_name: config.node_name.clone(),
            cluster_domain: config.cluster_domain.clone(),
            by_addr,
            by_name,
            by_clusterset_name,
            clusterset_dns,
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
            .map(|route| Endpoint {
                addr,
                route,
                weight: 1,
            })
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
        if let Some((ns, name)) = clusterset_host(host) {
            return self.by_clusterset_name.get(&(ns, name, port)).cloned();
        }
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
        if let Some(key) = clusterset_host(host) {
            return self.clusterset_dns.get(&key).map(Vec::as_slice);
        }
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

#[cfg(test)]
mod tests;

/// `<svc>.<ns>.svc.clusterset.local` (any case, optional final dot) → (ns, svc).
fn clusterset_host(host: &str) -> Option<(String, String)> {
    let lower = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    if !lower.ends_with(&format!(".svc.{CLUSTERSET_DOMAIN}")) {
        return None;
    }
    parse_service_host(&lower, CLUSTERSET_DOMAIN)
}
