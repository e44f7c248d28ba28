//! Service discovery from the Kubernetes API for the node proxy.
//!
//! Reflectors watch Services, EndpointSlices, Pods and Nodes ([`watch`]); after
//! each burst of changes the lookup tables are rebuilt into an immutable
//! [`Snapshot`] ([`index`]) and published on a `watch` channel. Every lookup is a
//! hash-map read of the current snapshot; nothing scans per request.
//!
//! - Outbound: [`Discovery::resolve_addr`] (ClusterIP:port or pod IP:port) and
//!   [`Discovery::resolve_name`] (`svc.ns[.svc[.<domain>]]`) give the ready
//!   endpoints, each with its [`Route`]: the node proxy of the pod's node
//!   (Linkerd's daemonset transformer) or, for mirror Services, the remote
//!   gateway, with the identity the peer must prove.
//! - Inbound: [`Discovery::local_pod`] answers only for pods on this node
//!   (Linkerd's localnode transformer); anything else is refused by the caller.

mod index;
mod model;
pub mod names;
mod watch;

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::identity::SpiffeId;
pub use index::{IndexConfig, SERVICE_NAME_LABEL, Snapshot, pod_info, slice_port};
pub use model::{
    Destination, Endpoint, MirrorInfo, PodInfo, PodRef, Route, ServicePortRef, ServiceRef,
};

/// Discovery settings.
#[derive(Clone, Debug)]
pub struct DiscoveryConfig {
    /// The node this proxy runs on (downward API `spec.nodeName`).
    pub node_name: String,
    /// The cluster's DNS domain.
    pub cluster_domain: String,
    /// Trust domain of workload identities.
    pub trust_domain: String,
    /// Inbound port of node proxies.
    pub inbound_port: u16,
    /// The label (key, value) that exports a Service to linked clusters.
    pub export_label: (String, String),
}

impl DiscoveryConfig {
    /// Defaults: `cluster.local` for both domains, inbound port 4143.
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            cluster_domain: "cluster.local".into(),
            trust_domain: "cluster.local".into(),
            inbound_port: 4143,
            export_label: (crate::names::EXPORT_LABEL.into(), "true".into()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "discovery stopped before it synced: the future returned by Discovery::start must be spawned and kept running"
)]
pub struct DiscoveryStopped;

/// The proxy's view of the cluster. Cheap to clone; all clones see the same updates.
#[derive(Clone, Debug)]
pub struct Discovery {
    current: tokio::sync::watch::Receiver<Arc<Snapshot>>,
}

impl Discovery {
    /// Starts discovery. The returned future runs the watches (spawn it); it ends
    /// when every `Discovery` clone is dropped.
    pub fn start(
        client: kube::Client,
        config: DiscoveryConfig,
    ) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let index = IndexConfig {
            node_name: config.node_name,
            cluster_domain: config.cluster_domain.trim_end_matches('.').to_string(),
            trust_domain: config.trust_domain,
            inbound_port: config.inbound_port,
            export_label: config.export_label,
        };
        let initial = Snapshot::build(&index, &[], &[], &[], &[]);
        let (tx, rx) = tokio::sync::watch::channel(Arc::new(initial));
        let (stores, changes) = watch::streams(&client);
        (Self { current: rx }, watch::run(index, stores, changes, tx))
    }

    /// Resolves once Services, EndpointSlices, Pods and Nodes have all been
    /// listed (the proxy's `/ready` waits for this and for its identity).
    pub async fn synced(&self) -> Result<(), DiscoveryStopped> {
        let mut rx = self.current.clone();
        rx.wait_for(|s| s.synced)
            .await
            .map(|_| ())
            .map_err(|_| DiscoveryStopped)
    }

    pub fn is_synced(&self) -> bool {
        self.current.borrow().synced
    }

    /// The current snapshot, for several lookups that must agree.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.borrow().clone()
    }

    /// A receiver that wakes (`changed()`) on every new snapshot, so pools can
    /// be refreshed.
    pub fn updates(&self) -> tokio::sync::watch::Receiver<Arc<Snapshot>> {
        self.current.clone()
    }

    /// See [`Snapshot::resolve_addr`].
    pub fn resolve_addr(&self, addr: SocketAddr) -> Option<Arc<Destination>> {
        self.current.borrow().resolve_addr(addr)
    }

    /// See [`Snapshot::resolve_name`].
    pub fn resolve_name(&self, host: &str, port: u16) -> Option<Arc<Destination>> {
        self.current.borrow().resolve_name(host, port)
    }

    /// See [`Snapshot::local_pod`].
    pub fn local_pod(&self, ip: IpAddr) -> Option<Arc<PodInfo>> {
        self.current.borrow().local_pod(ip)
    }

    /// The identity of the pod with this IP (any node), for checking a peer.
    pub fn pod_identity(&self, ip: IpAddr) -> Option<SpiffeId> {
        self.current.borrow().pod(ip)?.identity.clone()
    }
}
