//! Proxy metrics on the admin port's `/metrics`, named as operators of Linkerd
//! already query them. A workload is named by its ServiceAccount (what its
//! identity says); the cluster label is this proxy's cluster.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use strait_mesh::identity::SpiffeId;

use strait_mesh::names::ClusterNames;

use crate::view::{Endpoint, LocalPod, Via};

/// Labels of `inbound_refusals_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub reason: &'static str,
}

/// Who talked to whom, across clusters: the caller (`src_*`, its cluster
/// named from its identity's trust domain) and the destination (`dst_*`: for
/// a call through a gateway, the remote Service and its cluster, not the
/// gateway). `cluster` is the cluster of the proxy that counted.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TcpLabels {
    pub direction: String,
    pub src_cluster: String,
    pub src_namespace: String,
    pub src_workload: String,
    pub dst_cluster: String,
    pub dst_namespace: String,
    /// The destination pod's ServiceAccount; empty through a gateway (the
    /// remote cluster picks the pod).
    pub dst_workload: String,
    /// The Service called (outbound) or named by a caller of another
    /// cluster (inbound); empty when none was (a pod called by address).
    pub dst_service: String,
    pub cluster: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResponseLabels {
    #[prometheus(flatten)]
    pub peers: TcpLabels,
    /// `2xx` … `5xx`, or `error` when no response came.
    pub status_class: String,
}

/// Cheap to clone; clones share every series.
#[derive(Clone, Debug)]
pub struct ProxyMetrics {
    clusters: ClusterNames,
    tcp_open: Family<TcpLabels, Counter>,
    tcp_close: Family<TcpLabels, Counter>,
    tcp_read_bytes: Family<TcpLabels, Counter>,
    tcp_write_bytes: Family<TcpLabels, Counter>,
    requests: Family<TcpLabels, Counter>,
    responses: Family<ResponseLabels, Counter>,
    latency: Family<TcpLabels, Histogram>,
    retries: Family<TcpLabels, Counter>,
    budget_exhausted: Family<TcpLabels, Counter>,
    /// Tunnels the inbound side refused, by reason (a bounded set).
    inbound_refusals: Family<RefusalLabels, Counter>,
    end_to_end_proven: Counter,
    /// The outbound side's series by source, destination identity and
    /// Service: one lookup per request instead of one per metric, and no
    /// label built or cloned.
    #[allow(clippy::type_complexity)]
    outbound_http: Arc<Mutex<HashMap<SpiffeId, HashMap<SpiffeId, HashMap<Service, HttpSeries>>>>>,
    /// The (source, destination) label sets in use: at most
    /// `max_label_sets`, then [`TcpLabels::overflow`] (counted).
    peers: Arc<Mutex<std::collections::HashSet<TcpLabels>>>,
    max_label_sets: usize,
    overflows: strait_mesh::limits::OverflowMetrics,
}

/// An endpoint's Service, as the outbound cache keys it.
type Service = Option<Arc<crate::view::ServiceName>>;

impl TcpLabels {
    /// Every workload and Service label `other` (the clusters kept: there are
    /// few, each proven by a name-constrained issuer): where label sets past
    /// the bound are counted.
    fn overflow(&self) -> Self {
        let other = || strait_mesh::limits::OVERFLOW_LABEL.to_string();
        Self {
            direction: self.direction.clone(),
            src_cluster: self.src_cluster.clone(),
            src_namespace: other(),
            src_workload: other(),
            dst_cluster: self.dst_cluster.clone(),
            dst_namespace: other(),
            dst_workload: other(),
            dst_service: other(),
            cluster: self.cluster.clone(),
        }
    }
}

/// One (source, destination) pair's HTTP series, resolved once. Counting
/// through it touches no map and builds no label; response classes are
/// resolved on their first response (no series for what never happened).
#[derive(Clone, Debug)]
pub struct HttpSeries(Arc<HttpSeriesInner>);

#[derive(Debug)]
struct HttpSeriesInner {
    responses_family: Family<ResponseLabels, Counter>,
    retries: Family<TcpLabels, Counter>,
    budget_exhausted: Family<TcpLabels, Counter>,
    /// With this proxy's cluster.
    peers: TcpLabels,
    requests: Counter,
    latency: Histogram,
    /// `1xx` … `5xx`, then `error`.
    responses: [OnceLock<Counter>; 6],
}

const STATUS_CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "error"];

impl HttpSeries {
    pub fn request(&self) {
        self.0.requests.inc();
    }

    /// A response (or `None`: the request failed) after `seconds`.
    pub fn response(&self, status: Option<http::StatusCode>, seconds: f64) {
        let inner = &self.0;
        inner.latency.observe(seconds);
        let class = match status.map(|s| s.as_u16() / 100) {
            Some(c @ 1..=5) => usize::from(c) - 1,
            // Non-standard 6xx…9xx: rare enough to look up each time.
            Some(c) => {
                inner
                    .responses_family
                    .get_or_create(&ResponseLabels {
                        peers: inner.peers.clone(),
                        status_class: format!("{c}xx"),
                    })
                    .inc();
                return;
            }
            None => 5,
        };
        inner.responses[class]
            .get_or_init(|| {
                inner
                    .responses_family
                    .get_or_create(&ResponseLabels {
                        peers: inner.peers.clone(),
                        status_class: STATUS_CLASSES[class].to_string(),
                    })
                    .clone()
            })
            .inc();
    }

    pub fn retry(&self) {
        self.0.retries.get_or_create(&self.0.peers).inc();
    }

    pub fn budget_exhausted(&self) {
        self.0.budget_exhausted.get_or_create(&self.0.peers).inc();
    }
}

impl ProxyMetrics {
    /// The metrics of a proxy in `cluster`, whose identities are under
    /// `trust_domain`.
    pub fn new(cluster: &str, trust_domain: &str) -> Self {
        Self {
            clusters: ClusterNames::new(cluster, trust_domain),
            tcp_open: Family::default(),
            tcp_close: Family::default(),
            tcp_read_bytes: Family::default(),
            tcp_write_bytes: Family::default(),
            requests: Family::default(),
            responses: Family::default(),
            latency: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 2.0, 18))
            }),
            retries: Family::default(),
            budget_exhausted: Family::default(),
            inbound_refusals: Family::default(),
            end_to_end_proven: Counter::default(),
            outbound_http: Arc::default(),
            peers: Arc::default(),
            max_label_sets: strait_mesh::limits::DEFAULT_MAX_LABEL_SETS,
            overflows: Default::default(),
        }
    }

    /// At most `max` (source, destination) label sets (default
    /// [`strait_mesh::limits::DEFAULT_MAX_LABEL_SETS`]): callers and
    /// destinations are named by peers' identities (other clusters' too).
    pub fn with_max_label_sets(mut self, max: usize) -> Self {
        self.max_label_sets = max;
        self
    }

    /// An inbound connection from `client` to a pod on this node; `service`:
    /// the Service a caller of another cluster named (its FQDN).
    pub fn inbound_labels(
        &self,
        client: &SpiffeId,
        pod: &LocalPod,
        service: Option<&str>,
    ) -> TcpLabels {
        let own = self.clusters.own();
        TcpLabels {
            direction: "inbound".into(),
            src_cluster: self.clusters.of(client.trust_domain()).into(),
            src_namespace: client.namespace().into(),
            src_workload: client.service_account().into(),
            dst_cluster: own.into(),
            dst_namespace: pod.namespace.clone(),
            dst_workload: pod.service_account.clone(),
            dst_service: service
                .and_then(strait_mesh::names::service_of_fqdn)
                .map_or_else(String::new, |(_, name)| name.to_string()),
            cluster: own.into(),
        }
    }

    /// An outbound connection from a local pod (`source`) to `endpoint`: a
    /// pod (its identity names it) or a gateway (the remote Service does).
    pub fn outbound_labels(&self, source: &SpiffeId, endpoint: &Endpoint) -> TcpLabels {
        let id = &endpoint.identity;
        let service = endpoint.service.as_deref();
        let (dst_namespace, dst_workload) = match endpoint.via {
            Via::NodeProxy(_) => (id.namespace(), id.service_account()),
            Via::Gateway { .. } => (service.map_or("", |s| s.namespace.as_str()), ""),
        };
        TcpLabels {
            direction: "outbound".into(),
            src_cluster: self.clusters.of(source.trust_domain()).into(),
            src_namespace: source.namespace().into(),
            src_workload: source.service_account().into(),
            dst_cluster: self.clusters.of(id.trust_domain()).into(),
            dst_namespace: dst_namespace.into(),
            dst_workload: dst_workload.into(),
            dst_service: service.map_or_else(String::new, |s| s.name.clone()),
            cluster: self.clusters.own().into(),
        }
    }

    /// Counts a tunnel the inbound side refused.
    pub fn inbound_refused(&self, reason: &'static str) {
        self.inbound_refusals
            .get_or_create(&RefusalLabels { reason })
            .inc();
    }

    /// Counts a tunnel whose caller proved its identity end to end.
    pub fn end_to_end_proven(&self) {
        self.end_to_end_proven.inc();
    }

    /// The HTTP series of `labels` (an inbound tunnel's, resolved once per
    /// connection).
    pub fn http(&self, labels: &TcpLabels) -> HttpSeries {
        let peers = self.labelled(labels);
        HttpSeries(Arc::new(HttpSeriesInner {
            requests: self.requests.get_or_create(&peers).clone(),
            latency: self.latency.get_or_create(&peers).clone(),
            responses: Default::default(),
            responses_family: self.responses.clone(),
            retries: self.retries.clone(),
            budget_exhausted: self.budget_exhausted.clone(),
            peers,
        }))
    }

    /// The HTTP series of requests from `source` to `endpoint` (outbound).
    pub fn outbound_http(&self, source: &SpiffeId, endpoint: &Endpoint) -> HttpSeries {
        let mut cache = self.outbound_http.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(series) = cache
            .get(source)
            .and_then(|d| d.get(&endpoint.identity))
            .and_then(|s| s.get(&endpoint.service))
        {
            return series.clone();
        }
        let series = self.http(&self.outbound_labels(source, endpoint));
        // The cache holds the destinations with label sets of their own; the
        // rest (counted as `other`) resolve their series each time.
        let cached: usize = cache
            .values()
            .flat_map(HashMap::values)
            .map(HashMap::len)
            .sum();
        if cached < self.max_label_sets {
            cache
                .entry(source.clone())
                .or_default()
                .entry(endpoint.identity.clone())
                .or_default()
                .insert(endpoint.service.clone(), series.clone());
        }
        series
    }

    fn labelled(&self, labels: &TcpLabels) -> TcpLabels {
        let labels = labels.clone();
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if peers.contains(&labels) {
            return labels;
        }
        if peers.len() < self.max_label_sets {
            peers.insert(labels.clone());
            return labels;
        }
        self.overflows.inc("tcp");
        labels.overflow()
    }

    pub fn tcp_open(&self, labels: &TcpLabels) {
        self.tcp_open.get_or_create(&self.labelled(labels)).inc();
    }

    /// A connection closed after `read` bytes from its client and `written` to it.
    pub fn tcp_close(&self, labels: &TcpLabels, read: u64, written: u64) {
        let labels = self.labelled(labels);
        self.tcp_close.get_or_create(&labels).inc();
        self.tcp_read_bytes.get_or_create(&labels).inc_by(read);
        self.tcp_write_bytes.get_or_create(&labels).inc_by(written);
    }

    pub fn register(&self, registry: &mut Registry) {
        self.overflows.register(registry);
        registry.register("tcp_open", "Connections opened", self.tcp_open.clone());
        registry.register(
            "inbound_refusals",
            "Tunnels the inbound side refused before any byte reached a pod, by reason",
            self.inbound_refusals.clone(),
        );
        registry.register(
            "inbound_end_to_end_proven",
            "Tunnels through a gateway whose caller proved its identity end to end (inner mutual TLS)",
            self.end_to_end_proven.clone(),
        );
        registry.register("tcp_close", "Connections closed", self.tcp_close.clone());
        registry.register(
            "tcp_read_bytes",
            "Bytes read from the connection's client",
            self.tcp_read_bytes.clone(),
        );
        registry.register(
            "tcp_write_bytes",
            "Bytes written to the connection's client",
            self.tcp_write_bytes.clone(),
        );
        registry.register("request", "HTTP requests", self.requests.clone());
        registry.register(
            "response",
            "HTTP responses by status class",
            self.responses.clone(),
        );
        registry.register(
            "response_latency_seconds",
            "Time from request to response headers",
            self.latency.clone(),
        );
        registry.register(
            "retries",
            "Requests sent again after a retryable failure",
            self.retries.clone(),
        );
        registry.register(
            "retry_budget_exhausted",
            "Retryable failures not retried because the retry budget was spent",
            self.budget_exhausted.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::ServiceName;

    fn service(namespace: &str, name: &str) -> Service {
        Some(Arc::new(ServiceName {
            namespace: namespace.into(),
            name: name.into(),
        }))
    }

    /// A pod of this cluster serving shop/web.
    fn pod(identity: &SpiffeId) -> Endpoint {
        Endpoint {
            addr: "10.0.0.1:8080".parse().unwrap(),
            identity: identity.clone(),
            via: Via::NodeProxy("10.1.0.1:4143".parse().unwrap()),
            weight: 1,
            service: service("shop", "web"),
        }
    }

    fn encode(metrics: &ProxyMetrics) -> String {
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    /// A call through west's gateway names west and its Service, not the
    /// gateway; west's proxy names the caller's cluster from its identity.
    #[test]
    fn cross_cluster_calls_name_both_clusters_and_the_remote_service() {
        let east = ProxyMetrics::new("east", "east.clusterset.local");
        let client: SpiffeId = "spiffe://east.clusterset.local/ns/shop/sa/client"
            .parse()
            .unwrap();
        let gateway = Endpoint {
            addr: "10.201.0.11:4143".parse().unwrap(),
            identity: "spiffe://west.clusterset.local/ns/strait-system/sa/strait-gateway"
                .parse()
                .unwrap(),
            via: Via::Gateway {
                service: "web.shop.svc.cluster.local".into(),
                port: 80,
            },
            weight: 1,
            service: service("shop", "web"),
        };
        east.outbound_http(&client, &gateway).request();
        let text = encode(&east);
        assert!(
            text.contains(
                r#"request_total{direction="outbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="",dst_service="web",cluster="east"} 1"#
            ),
            "{text}"
        );

        let west = ProxyMetrics::new("west", "west.clusterset.local");
        let web = LocalPod {
            namespace: "shop".into(),
            name: "web-0".into(),
            service_account: "web".into(),
        };
        let labels = west.inbound_labels(&client, &web, Some("web.shop.svc.cluster.local"));
        west.http(&labels).request();
        let text = encode(&west);
        assert!(
            text.contains(
                r#"request_total{direction="inbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="web",dst_service="web",cluster="west"} 1"#
            ),
            "{text}"
        );
    }

    /// Series resolved once count like the families they came from: one
    /// series per status class that happened, retries and budget alike.
    #[test]
    fn http_series_count_into_their_families() {
        let metrics = ProxyMetrics::new("east", "cluster.local");
        let source: SpiffeId = "spiffe://cluster.local/ns/shop/sa/client".parse().unwrap();
        let destination = pod(&"spiffe://cluster.local/ns/shop/sa/web".parse().unwrap());
        let series = metrics.outbound_http(&source, &destination);
        for status in [200, 201, 503, 999] {
            series.request();
            series.response(http::StatusCode::from_u16(status).ok(), 0.001);
        }
        series.request();
        series.response(None, 0.002);
        series.retry();
        // The same pair again: the same series.
        metrics
            .outbound_http(&source, &destination)
            .budget_exhausted();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let value = |name: &str, class: Option<&str>| {
            text.lines()
                .find(|l| {
                    l.starts_with(name)
                        && l.contains(r#"src_workload="client""#)
                        && l.contains(r#"cluster="east""#)
                        && class.is_none_or(|c| l.contains(&format!(r#"status_class="{c}""#)))
                })
                .and_then(|l| l.rsplit(' ').next())
                .unwrap_or_else(|| panic!("no {name} {class:?} in\n{text}"))
                .to_string()
        };
        assert_eq!(value("request_total", None), "5");
        assert_eq!(value("response_total", Some("2xx")), "2");
        assert_eq!(value("response_total", Some("5xx")), "1");
        assert_eq!(value("response_total", Some("9xx")), "1");
        assert_eq!(value("response_total", Some("error")), "1");
        assert_eq!(value("response_latency_seconds_count", None), "5");
        assert_eq!(value("retries_total", None), "1");
        assert_eq!(value("retry_budget_exhausted_total", None), "1");
        assert!(!text.contains(r#"status_class="4xx""#), "{text}");
    }

    #[test]
    fn peer_label_sets_past_the_bound_count_as_other() {
        let metrics = ProxyMetrics::new("east", "cluster.local").with_max_label_sets(2);
        let destination = pod(&"spiffe://west/ns/shop/sa/web".parse().unwrap());
        for i in 0..5 {
            let source: SpiffeId = format!("spiffe://west/ns/shop/sa/c{i}").parse().unwrap();
            let series = metrics.outbound_http(&source, &destination);
            series.request();
            metrics.tcp_open(&metrics.outbound_labels(&source, &destination));
        }
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let requests: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("request_total"))
            .collect();
        assert_eq!(requests.len(), 3, "two pairs and `other`: {text}");
        assert!(
            requests
                .iter()
                .any(|l| l.contains(r#"src_workload="other""#) && l.ends_with(" 3")),
            "{text}"
        );
        assert!(
            text.contains(r#"metric_label_sets_overflow_total{metric="tcp"} 6"#),
            "{text}"
        );
    }
}
