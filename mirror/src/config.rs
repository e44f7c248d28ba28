//! The controller's settings and what it shares with every Link's worker.

use k8s_openapi::api::core::v1::Service;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::Store;

use crate::{metrics, probe, resolve};

/// Controller settings.
#[derive(Clone, Debug)]
pub struct MirrorConfig {
    /// The namespace holding Links and their credentials Secrets. Only there
    /// may the controller read Secrets (least privilege: not cluster-wide).
    pub namespace: String,
    /// Fraction of a link token's lifetime after which it is renewed.
    pub token_renew_at: f64,
    /// Where the controller's metrics go (register them with the admin server's registry).
    pub metrics: metrics::MirrorMetrics,
    /// The controller's own identity, for probing gateways over mTLS. Without
    /// one, gateways are not probed (and the GatewayAlive condition says so).
    pub identity: Option<probe::ProbeIdentity>,
    /// Where gateway hostnames are resolved.
    pub dns: resolve::DnsConfig,
    /// This cluster's name and the feed of linked clusters' ServiceExports, when
    /// the Multi-Cluster Services controller runs (`--cluster-name`).
    pub clusterset: Option<(String, crate::mcs::ClustersetFeed)>,
    /// Renew the heartbeat Lease that `strait check` reads. Off when leader
    /// election runs: the leader's renewals of the same Lease are the heartbeat.
    pub heartbeat: bool,
}

impl Default for MirrorConfig {
    fn default() -> Self {
        Self {
            namespace: strait_mesh::names::LINK_NAMESPACE.into(),
            token_renew_at: 0.7,
            metrics: Default::default(),
            identity: None,
            dns: Default::default(),
            clusterset: None,
            heartbeat: true,
        }
    }
}

/// Every local Service, names and labels only: whether a name is taken by a
/// Service that is not a mirror is answered here, not by a GET per new mirror.
pub type LocalServices = Store<PartialObjectMeta<Service>>;
