//! Mirror controller metrics, served on the admin port's `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LinkLabels {
    pub link: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub link: String,
    pub reason: String,
}

/// Cheap to clone; every clone updates the same series.
#[derive(Clone, Debug)]
pub struct MirrorMetrics {
    pub mirrored_services: Family<LinkLabels, Gauge>,
    pub remote_reachable: Family<LinkLabels, Gauge>,
    pub mirror_errors: Family<ErrorLabels, Counter>,
    pub sync_duration: Family<LinkLabels, Histogram>,
    pub gateway_alive: Family<LinkLabels, Gauge>,
    pub probe_latency: Family<LinkLabels, Histogram>,
    pub probe_failures: Family<LinkLabels, Counter>,
    /// 1 while this replica holds the leader Lease (and so mirrors).
    pub leader: Gauge,
}

impl Default for MirrorMetrics {
    fn default() -> Self {
        Self {
            mirrored_services: Family::default(),
            remote_reachable: Family::default(),
            mirror_errors: Family::default(),
            sync_duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0005, 2.0, 16))
            }),
            gateway_alive: Family::default(),
            probe_latency: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0005, 2.0, 16))
            }),
            probe_failures: Family::default(),
            leader: Gauge::default(),
        }
    }
}

impl MirrorMetrics {
    /// Drops a deleted Link's gauges, so dashboards do not show a ghost.
    pub fn forget(&self, link: &str) {
        let labels = LinkLabels {
            link: link.to_string(),
        };
        self.mirrored_services.remove(&labels);
        self.remote_reachable.remove(&labels);
        self.gateway_alive.remove(&labels);
    }

    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "mirror_services",
            "Services mirrored per Link",
            self.mirrored_services.clone(),
        );
        registry.register(
            "mirror_remote_reachable",
            "1 while the Link's remote API server answers, 0 while it does not",
            self.remote_reachable.clone(),
        );
        registry.register(
            "mirror_errors",
            "Services that could not be mirrored, by Link and reason (NameConflict, NamespaceMissing, ApiError)",
            self.mirror_errors.clone(),
        );
        registry.register(
            "mirror_sync_duration_seconds",
            "Time of one pass that brings a Link's mirrors in line with its remote",
            self.sync_duration.clone(),
        );
        registry.register(
            "mirror_gateway_alive",
            "1 while at least one of the Link's gateway addresses answers the probe",
            self.gateway_alive.clone(),
        );
        registry.register(
            "mirror_gateway_probe_latency_seconds",
            "Time of successful gateway probes (connect, mTLS handshake, request)",
            self.probe_latency.clone(),
        );
        registry.register(
            "mirror_gateway_probe_failures",
            "Gateway probes that failed",
            self.probe_failures.clone(),
        );
        registry.register(
            "mirror_leader",
            "1 while this replica holds the leader Lease and mirrors, 0 while it stands by",
            self.leader.clone(),
        );
    }
}
