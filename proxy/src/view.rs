//! What the proxy asks of discovery: the pods on this node ([`LocalPods`],
//! for the inbound check and for naming a caller), and where a destination
//! can be reached ([`Destinations`], as typed [`Endpoint`]s the outbound side
//! balances over and pools by). [`MeshView`] answers both from a
//! [`Discovery`](crate::discovery::Discovery) snapshot.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use strait_mesh::identity::SpiffeId;

use crate::discovery;

/// A pod running on this node, as the inbound check needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalPod {
    pub namespace: String,
    pub name: String,
    pub service_account: String,
}

/// Answers "does a pod with this IP run on this node?" (the localnode rule).
pub trait LocalPods: Send + Sync + 'static {
    fn local_pod(&self, ip: IpAddr) -> Option<LocalPod>;
    /// A pod on this node running as `namespace/service_account`, if any.
    fn local_pod_running_as(&self, namespace: &str, service_account: &str) -> Option<LocalPod>;
    /// Whether the Service `fqdn:port` of this cluster has `pod` (IP and
    /// target port) among its ready endpoints, and its allowed identities:
    /// `None` when there is no such Service.
    fn service_serving(&self, fqdn: &str, port: u16, pod: SocketAddr) -> Option<ServiceCheck>;
}

/// What the inbound side needs to know of a Service an end-to-end caller named.
#[derive(Clone, Debug)]
pub struct ServiceCheck {
    /// `<namespace>/<name>`.
    pub name: String,
    pub has_pod: bool,
    pub allowed_identities: Option<Arc<str>>,
}

/// One place a destination can be reached, and the identity that must
/// answer there. Equal (and hashed, as a pool key) by where and whom, not
/// by weight: a changing ready count must not open new connections.
#[derive(Clone, Debug)]
pub struct Endpoint {
    /// The pod's address; for a mirror, the remote cluster's gateway.
    pub addr: SocketAddr,
    /// The pod's identity; for a mirror, the gateway's.
    pub identity: SpiffeId,
    pub via: Via,
    /// Its share of the traffic relative to the others (1 for a pod; a
    /// linked cluster's gateway: that cluster's ready endpoints).
    pub weight: u32,
    /// The Service it serves (for a gateway, the remote one), as metrics
    /// name the destination; `None` for a pod called by its address.
    pub service: Option<Arc<ServiceName>>,
}

/// A Service by namespace and name (of whichever cluster serves it).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServiceName {
    pub namespace: String,
    pub name: String,
}

/// How a tunnel reaches an [`Endpoint`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Via {
    /// A pod of this cluster, through the inbound port of its node's proxy.
    NodeProxy(SocketAddr),
    /// A mirror: the stream to the gateway names this Service there
    /// (`<svc>.<ns>.svc.<domain>` of the remote cluster, and its port).
    Gateway { service: String, port: u16 },
}

impl PartialEq for Endpoint {
    fn eq(&self, other: &Self) -> bool {
        (self.addr, &self.identity, &self.via) == (other.addr, &other.identity, &other.via)
    }
}

impl Eq for Endpoint {}

impl std::hash::Hash for Endpoint {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.addr, &self.identity, &self.via).hash(state);
    }
}

impl Endpoint {
    pub fn is_remote(&self) -> bool {
        matches!(self.via, Via::Gateway { .. })
    }

    /// The first hop a tunnel to this endpoint opens to: its node proxy, or
    /// the remote gateway (whose address is the endpoint's).
    pub fn hop(&self) -> SocketAddr {
        match self.via {
            Via::NodeProxy(proxy) => proxy,
            Via::Gateway { .. } => self.addr,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("{0} is not a known service: use <service>.<namespace>[.svc.<cluster-domain>]")]
    UnknownHost(String),
    #[error("service {0} has no ready endpoints")]
    NoEndpoints(String),
}

/// A destination as the outbound side uses it.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub endpoints: Vec<Endpoint>,
    /// Never protocol-detect connections to it (`strait.dev/opaque-ports`).
    pub opaque: bool,
    /// The whole request's deadline, retries included (`strait.dev/timeout`).
    pub timeout: Option<Duration>,
}

/// What the outbound side needs from discovery.
pub trait Destinations: LocalPods {
    /// The ready endpoints of `host:port` (a service name or a ClusterIP).
    fn resolve(&self, host: &str, port: u16) -> Result<Resolved, ResolveError>;
    /// The pod `namespace/name` if it runs on this node (a pod enrolled in
    /// transparent mode is known by name, not by source address).
    fn local_pod_named(&self, namespace: &str, name: &str) -> Option<LocalPod>;
    /// Whether the pod `namespace/name` scheduled to this node asked for
    /// transparent mode; `None` when no such pod is scheduled here.
    fn transparent_wanted(&self, namespace: &str, name: &str) -> Option<bool>;
}

/// Discovery as the inbound and outbound sides ask it.
pub struct MeshView {
    discovery: discovery::Discovery,
}

impl MeshView {
    pub fn new(discovery: discovery::Discovery) -> Self {
        Self { discovery }
    }
}

fn local(pod: &discovery::PodInfo) -> LocalPod {
    LocalPod {
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        service_account: pod.service_account.clone(),
    }
}

/// The endpoints the outbound side may use for a destination: pods behind
/// their node proxies, and for a mirror its remote gateways (the stream
/// names the remote Service; the mirror's port is the remote one).
/// Hand-written endpoints outside the mesh are not carried.
fn endpoints_of(destination: &discovery::Destination) -> Vec<Endpoint> {
    let local = destination.service.as_ref().map(|s| {
        Arc::new(ServiceName {
            namespace: s.namespace.clone(),
            name: s.name.clone(),
        })
    });
    // A remote Service's name, read once per name (one per destination,
    // save a clusterset service's linked clusters naming theirs apart).
    let mut remote_names: Vec<(String, Option<Arc<ServiceName>>)> = Vec::new();
    let mut remote_name = |fqdn: &str| -> Option<Arc<ServiceName>> {
        if let Some((_, name)) = remote_names.iter().find(|(f, _)| *f == fqdn) {
            return name.clone();
        }
        let name = strait_mesh::names::service_of_fqdn(fqdn).map(|(namespace, name)| {
            Arc::new(ServiceName {
                namespace: namespace.to_string(),
                name: name.to_string(),
            })
        });
        remote_names.push((fqdn.to_string(), name.clone()));
        name
    };
    destination
        .endpoints
        .iter()
        .filter_map(|e| match &e.route {
            discovery::Route::NodeProxy {
                proxy, identity, ..
            } => Some(Endpoint {
                addr: e.addr,
                identity: identity.clone(),
                via: Via::NodeProxy(*proxy),
                weight: e.weight,
                service: local.clone(),
            }),
            discovery::Route::Gateway {
                gateway,
                identity,
                service,
            } => {
                // The slice names the remote Service (a clusterset service's
                // linked clusters), else the mirror does.
                let remote = service.clone().or_else(|| {
                    destination
                        .mirror
                        .as_ref()
                        .map(|m| m.remote_fq_name.clone())
                })?;
                (!remote.is_empty()).then(|| Endpoint {
                    addr: *gateway,
                    identity: identity.clone(),
                    service: remote_name(&remote),
                    via: Via::Gateway {
                        service: remote,
                        port: destination.port.port,
                    },
                    weight: e.weight,
                })
            }
            discovery::Route::Direct => None,
        })
        .collect()
}

impl LocalPods for MeshView {
    fn local_pod(&self, ip: IpAddr) -> Option<LocalPod> {
        self.discovery.local_pod(ip).map(|p| local(&p))
    }

    fn local_pod_running_as(&self, namespace: &str, service_account: &str) -> Option<LocalPod> {
        self.discovery
            .snapshot()
            .local_pods()
            .find(|p| p.namespace == namespace && p.service_account == service_account)
            .map(|p| local(p))
    }

    fn service_serving(&self, fqdn: &str, port: u16, pod: SocketAddr) -> Option<ServiceCheck> {
        let destination = self.discovery.resolve_name(fqdn, port)?;
        let service = destination.service.as_ref()?;
        Some(ServiceCheck {
            name: format!("{}/{}", service.namespace, service.name),
            has_pod: destination.endpoints.iter().any(|e| e.addr == pod),
            allowed_identities: destination.allowed_identities.clone(),
        })
    }
}

impl Destinations for MeshView {
    fn resolve(&self, host: &str, port: u16) -> Result<Resolved, ResolveError> {
        let destination = match host.parse::<IpAddr>() {
            Ok(ip) => self.discovery.resolve_addr(SocketAddr::new(ip, port)),
            Err(_) => self.discovery.resolve_name(host, port),
        }
        .ok_or_else(|| ResolveError::UnknownHost(format!("{host}:{port}")))?;
        let endpoints = endpoints_of(&destination);
        if endpoints.is_empty() {
            return Err(ResolveError::NoEndpoints(format!("{host}:{port}")));
        }
        Ok(Resolved {
            endpoints,
            opaque: destination.opaque,
            timeout: destination.timeout,
        })
    }

    fn transparent_wanted(&self, namespace: &str, name: &str) -> Option<bool> {
        self.discovery
            .snapshot()
            .transparent_wanted(namespace, name)
    }

    fn local_pod_named(&self, namespace: &str, name: &str) -> Option<LocalPod> {
        self.discovery
            .snapshot()
            .local_pod_named(namespace, name)
            .map(|p| local(&p))
    }
}

impl crate::dns::ServiceNames for MeshView {
    fn lookup(&self, host: &str) -> Option<Vec<IpAddr>> {
        self.discovery
            .snapshot()
            .dns_lookup(host)
            .map(<[IpAddr]>::to_vec)
    }

    fn cluster_domain(&self) -> String {
        self.discovery.snapshot().cluster_domain().to_string()
    }
}
