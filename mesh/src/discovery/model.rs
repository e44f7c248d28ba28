//! What discovery answers: destinations, endpoints and pods.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::identity::SpiffeId;

/// A Service by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceRef {
    pub namespace: String,
    pub name: String,
}

/// One port of a Service, as the caller addressed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortRef {
    /// `spec.ports[].name`; `None` for a single unnamed port.
    pub name: Option<String>,
    pub port: u16,
}

/// A mirror Service: its endpoints are a remote cluster's gateway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MirrorInfo {
    /// `strait.dev/cluster-name`.
    pub cluster: String,
    /// `strait.dev/remote-svc-fq-name`: what the tunnel header names at the gateway.
    pub remote_fq_name: String,
}

/// Where a connection should go: a Service port and its ready endpoints, or
/// (for a pod IP called directly) that pod.
#[derive(Clone, Debug)]
pub struct Destination {
    /// `None` when a pod IP was addressed directly.
    pub service: Option<ServiceRef>,
    /// `<svc>.<ns>.svc.<cluster domain>`, for the tunnel header.
    pub fq_name: Option<String>,
    pub port: ServicePortRef,
    pub mirror: Option<MirrorInfo>,
    /// Never protocol-detect (opaque-ports annotation of the Service, or of the pod
    /// when a pod was addressed).
    pub opaque: bool,
    /// Ready endpoints only; empty when none is ready (the caller fails fast).
    pub endpoints: Arc<[Endpoint]>,
    /// `strait.dev/timeout` of the Service: the whole request, retries included.
    pub timeout: Option<std::time::Duration>,
    /// The Service carries the export label: the gateway may serve it.
    pub exported: bool,
    /// `strait.dev/allowed-identities` of the Service, as written.
    pub allowed_identities: Option<Arc<str>>,
}

/// A pod by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
}

/// One ready endpoint of a destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// What the application would dial: pod IP + target port (for a mirror,
    /// the gateway address from the EndpointSlice).
    pub addr: SocketAddr,
    pub route: Route,
    /// Its share of the traffic relative to the others: 1 for a pod; for a
    /// linked cluster's gateway in a clusterset service, that cluster's
    /// ready endpoints (spread over its gateway addresses).
    pub weight: u32,
}

/// How the node proxy reaches an endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// A pod of this cluster: over mTLS to the inbound port of its node's proxy
    /// (Linkerd's daemonset transformer). The peer must present `identity`.
    NodeProxy {
        pod: PodRef,
        node: String,
        proxy: SocketAddr,
        identity: SpiffeId,
    },
    /// A remote cluster's gateway, which must present `identity`: a mirror's
    /// endpoint, or a linked cluster's in a clusterset service (`service`:
    /// the Service to ask the gateway for, from the slice; a mirror's own
    /// comes from the mirror Service).
    Gateway {
        gateway: SocketAddr,
        identity: SpiffeId,
        service: Option<String>,
    },
    /// Not a pod (a hand-written EndpointSlice to an outside address): plain TCP.
    Direct,
}

impl Endpoint {
    /// The identity the peer must prove, if it is meshed.
    pub fn identity(&self) -> Option<&SpiffeId> {
        match &self.route {
            Route::NodeProxy { identity, .. } | Route::Gateway { identity, .. } => Some(identity),
            Route::Direct => None,
        }
    }
}

/// What the proxy knows of a pod (trimmed from the Pod object).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    pub ips: Vec<IpAddr>,
    pub node: String,
    pub service_account: String,
    pub ready: bool,
    /// `spiffe://<trust domain>/ns/<ns>/sa/<sa>`; `None` if the names are not valid in one.
    pub identity: Option<SpiffeId>,
    /// Parsed `strait.dev/opaque-ports`; `None` when the pod has none (its
    /// namespace's list, else the defaults, apply).
    pub opaque_ports: Option<crate::detect::OpaquePorts>,
}
