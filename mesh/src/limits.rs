//! Bounds on what peers control: how many connections a listener holds
//! ([`ConnLimit`]) and how many label sets a metric family may grow to
//! ([`BoundedFamily`]). Every limit is listed, with its default and flag, in
//! ARCHITECTURE.md ("Limits").

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The default cap on one listener's open connections (each of the
/// gateway's two transports, the node proxy's inbound and outbound ports).
/// The memory limits in deploy/ are sized for both of a process's listeners
/// full: ~27 KiB per proxy connection (2 × 8192 → ~440 MiB of the
/// DaemonSet's 512 MiB), ~40 KiB per established QUIC connection (~114 KiB
/// before stream credit grew on demand, which the limit was sized for) and
/// ~11 KiB per TCP one at the gateway (under 1 GiB of its 1.5 GiB).
pub const DEFAULT_MAX_CONNECTIONS: usize = 8_192;
/// The cap on the admin port's open connections: probes and scrapes need a
/// handful; idle ones are closed after 5 s, so this bounds memory (some
/// 30 MiB) without letting a few slow clients starve the kubelet's probes.
pub const ADMIN_MAX_CONNECTIONS: usize = 1_024;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    pub listener: String,
}

/// Connections open and refused per listener.
#[derive(Clone, Debug, Default)]
pub struct ListenerMetrics {
    open: Family<ListenerLabels, Gauge>,
    refused: Family<ListenerLabels, Counter>,
}

impl ListenerMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "listener_connections",
            "Connections a listener holds open now",
            self.open.clone(),
        );
        registry.register(
            "listener_connections_refused",
            "Connections refused because the listener held its maximum (--max-connections)",
            self.refused.clone(),
        );
    }
}

/// A cap on the connections one listener holds at once: a connection takes
/// a permit from accept until it closes (its handshake included, so peers
/// that never finish one count too); past the cap, new connections are
/// refused (counted, logged at most every 10 s) instead of growing memory.
#[derive(Clone, Debug)]
pub struct ConnLimit {
    listener: &'static str,
    max: usize,
    permits: Arc<Semaphore>,
    /// This listener's series, resolved once (no label built per connection).
    open: Gauge,
    refused: Counter,
    last_log: Arc<Mutex<Option<Instant>>>,
}

/// A connection's place under its listener's [`ConnLimit`]; released on drop.
#[derive(Debug)]
pub struct ConnPermit {
    _permit: OwnedSemaphorePermit,
    open: Gauge,
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl ConnLimit {
    const LOG_INTERVAL: Duration = Duration::from_secs(10);

    pub fn new(listener: &'static str, max: usize, metrics: &ListenerMetrics) -> Self {
        let labels = ListenerLabels {
            listener: listener.to_string(),
        };
        Self {
            listener,
            max,
            permits: Arc::new(Semaphore::new(max)),
            open: metrics.open.get_or_create(&labels).clone(),
            refused: metrics.refused.get_or_create(&labels).clone(),
            last_log: Arc::default(),
        }
    }

    /// A permit for one more connection, or `None` (counted and logged) when
    /// the listener holds its maximum.
    pub fn try_acquire(&self) -> Option<ConnPermit> {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                self.open.inc();
                Some(ConnPermit {
                    _permit: permit,
                    open: self.open.clone(),
                })
            }
            Err(_) => {
                self.refused.inc();
                let mut last = self.last_log.lock().unwrap_or_else(|e| e.into_inner());
                let now = Instant::now();
                if last.is_none_or(|at| now.duration_since(at) >= Self::LOG_INTERVAL) {
                    *last = Some(now);
                    tracing::warn!(
                        listener = self.listener,
                        max = self.max,
                        "refusing connections: the listener holds its maximum of {} (--max-connections); \
                         raise it if this is real traffic",
                        self.max
                    );
                }
                None
            }
        }
    }

    /// Connections held now.
    pub fn open(&self) -> usize {
        self.max - self.permits.available_permits()
    }

    pub fn max(&self) -> usize {
        self.max
    }
}

/// The value every label of an overflowing label set takes.
pub const OVERFLOW_LABEL: &str = "other";

/// A label set that can stand for "any other": each label's value becomes
/// [`OVERFLOW_LABEL`].
pub trait Overflow {
    fn overflow() -> Self;
}

/// A metric family that keeps at most `max` label sets: label values come
/// from peers (caller identities, namespaces, Services), so without a bound a
/// peer could grow every scrape and the process's memory. Past the bound,
/// new label sets are counted in the one [`Overflow::overflow`] series and
/// in `metric_label_sets_overflow_total{metric}`.
#[derive(Debug)]
pub struct BoundedFamily<L, M> {
    family: Family<L, M>,
    seen: Arc<Mutex<HashSet<L>>>,
    max: usize,
    name: &'static str,
    overflows: Family<MetricLabels, Counter>,
}

impl<L, M> Clone for BoundedFamily<L, M> {
    fn clone(&self) -> Self {
        Self {
            family: self.family.clone(),
            seen: self.seen.clone(),
            max: self.max,
            name: self.name,
            overflows: self.overflows.clone(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MetricLabels {
    pub metric: String,
}

/// The default bound on one family's label sets.
pub const DEFAULT_MAX_LABEL_SETS: usize = 2_048;

/// Counts label sets that went to the overflow series, per metric.
#[derive(Clone, Debug, Default)]
pub struct OverflowMetrics(Family<MetricLabels, Counter>);

impl OverflowMetrics {
    /// Counts one label set of `metric` sent to its `other` series.
    pub fn inc(&self, metric: &str) {
        self.0
            .get_or_create(&MetricLabels {
                metric: metric.to_string(),
            })
            .inc();
    }

    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "metric_label_sets_overflow",
            "Label sets counted in a metric's `other` series because it held its maximum of label sets",
            self.0.clone(),
        );
    }
}

impl<L, M> BoundedFamily<L, M>
where
    L: Clone + Hash + Eq + Overflow + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
    M: Default + prometheus_client::metrics::TypedMetric + Clone,
{
    pub fn new(name: &'static str, max: usize, overflows: &OverflowMetrics) -> Self {
        Self::with_constructor(name, max, overflows, M::default)
    }
}

impl<L, M> BoundedFamily<L, M>
where
    L: Clone + Hash + Eq + Overflow + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
    M: prometheus_client::metrics::TypedMetric + Clone,
{
    /// A family whose series `new` makes (a histogram's buckets).
    pub fn with_constructor(
        name: &'static str,
        max: usize,
        overflows: &OverflowMetrics,
        new: fn() -> M,
    ) -> Self {
        Self {
            family: Family::new_with_constructor(new),
            seen: Arc::default(),
            max,
            name,
            overflows: overflows.0.clone(),
        }
    }

    /// The family to register.
    pub fn family(&self) -> &Family<L, M> {
        &self.family
    }

    /// The metric for `labels`, or the overflow series once the family holds
    /// its maximum of label sets.
    pub fn get_or_create(&self, labels: &L) -> M {
        let labels = {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if seen.contains(labels) {
                labels.clone()
            } else if seen.len() < self.max {
                seen.insert(labels.clone());
                labels.clone()
            } else {
                self.overflows
                    .get_or_create(&MetricLabels {
                        metric: self.name.to_string(),
                    })
                    .inc();
                L::overflow()
            }
        };
        self.family.get_or_create(&labels).clone()
    }

    /// Forgets label sets (their series too) that `keep` refuses: what a
    /// process calls when the peers, pods or Services they name are gone.
    pub fn retain(&self, keep: impl Fn(&L) -> bool) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.retain(|labels| {
            let kept = keep(labels);
            if !kept {
                self.family.remove(labels);
            }
            kept
        });
    }

    /// Label sets held now (the overflow series not counted).
    pub fn len(&self) -> usize {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct Caller {
        caller: String,
    }

    impl Overflow for Caller {
        fn overflow() -> Self {
            Caller {
                caller: OVERFLOW_LABEL.into(),
            }
        }
    }

    fn encode(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    }

    #[test]
    fn label_sets_past_the_bound_go_to_one_other_series_and_are_counted() {
        let overflows = OverflowMetrics::default();
        let family: BoundedFamily<Caller, Counter> = BoundedFamily::new("calls", 3, &overflows);
        let mut registry = Registry::default();
        registry.register("calls", "calls", family.family().clone());
        overflows.register(&mut registry);
        for i in 0..10 {
            family
                .get_or_create(&Caller {
                    caller: format!("c{i}"),
                })
                .inc();
        }
        // A known set keeps its own series after the bound is reached.
        family
            .get_or_create(&Caller {
                caller: "c0".into(),
            })
            .inc();
        let text = encode(&registry);
        assert!(text.contains("calls_total{caller=\"c0\"} 2"), "{text}");
        assert!(text.contains("calls_total{caller=\"c2\"} 1"), "{text}");
        assert!(!text.contains("caller=\"c3\""), "{text}");
        assert!(text.contains("calls_total{caller=\"other\"} 7"), "{text}");
        assert!(
            text.contains("metric_label_sets_overflow_total{metric=\"calls\"} 7"),
            "{text}"
        );
        assert_eq!(family.len(), 3);

        // Pruned sets free their places.
        family.retain(|l| l.caller != "c1");
        assert_eq!(family.len(), 2);
        assert!(!encode(&registry).contains("caller=\"c1\""));
        family
            .get_or_create(&Caller {
                caller: "c9".into(),
            })
            .inc();
        assert!(encode(&registry).contains("calls_total{caller=\"c9\"} 1"));
    }

    #[test]
    fn a_listener_refuses_past_its_cap_and_counts_it() {
        let metrics = ListenerMetrics::default();
        let limit = ConnLimit::new("test", 2, &metrics);
        let a = limit.try_acquire().unwrap();
        let _b = limit.try_acquire().unwrap();
        assert!(limit.try_acquire().is_none());
        assert_eq!(limit.open(), 2);
        drop(a);
        assert_eq!(limit.open(), 1);
        assert!(limit.try_acquire().is_some());
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let text = encode(&registry);
        assert!(
            text.contains("listener_connections_refused_total{listener=\"test\"} 1"),
            "{text}"
        );
    }
}
