//! `strait stat`: the golden metrics (request rate, success rate, latency
//! percentiles) of the calls this cluster's pods made and received, per
//! Service and the cluster serving it, as `linkerd viz stat` prints them but
//! with no Prometheus to run: the node proxies' `/metrics` are read through
//! the API server (`pods/proxy`) twice, `--window` apart, and the rates are
//! the differences.
//!
//! What one cluster's proxies count: every call its pods make (`outbound`, to
//! Services here and, through gateways, in other clusters) and every call
//! into its pods from other clusters (`inbound` with another `src_cluster`;
//! a local caller's calls are already counted on its way out).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use serde::Serialize;
use strait_mesh::names::{NODE_PROXY_DAEMONSET, SYSTEM_NAMESPACE};

use crate::check::Output;
use crate::link::{client_for, load_kubeconfig};

#[derive(Debug, clap::Args)]
pub struct StatArgs {
    /// Kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the cluster whose node proxies are read.
    #[arg(long)]
    pub context: Option<String>,
    /// Only Services of this namespace.
    #[arg(short, long)]
    pub namespace: Option<String>,
    /// Only calls whose caller runs in this cluster, one row per Service.
    #[arg(long)]
    pub from: Option<String>,
    /// Time between the two reads the rates are computed over.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub window: Duration,
    #[arg(short, long, value_enum, default_value = "text")]
    pub output: Output,
}

/// A Service and the cluster that serves it.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServiceKey {
    pub namespace: String,
    pub service: String,
    pub cluster: String,
}

/// Counts of one Service's calls from one source cluster, summed over
/// series (callers, proxies).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counts {
    pub requests: f64,
    pub responses: f64,
    /// Responses that failed: 5xx, or none at all.
    pub failures: f64,
    /// Cumulative latency buckets: upper bound (seconds) → count.
    pub buckets: BTreeMap<u64, f64>,
}

impl Counts {
    pub(crate) fn add(&mut self, other: &Counts) {
        self.requests += other.requests;
        self.responses += other.responses;
        self.failures += other.failures;
        for (le, n) in &other.buckets {
            *self.buckets.entry(*le).or_default() += n;
        }
    }

    /// `self - before`: what happened between two reads (a series that
    /// restarted from zero, a proxy replaced, counts from zero).
    pub(crate) fn since(&self, before: &Counts) -> Counts {
        let sub = |a: f64, b: f64| if a >= b { a - b } else { a };
        Counts {
            requests: sub(self.requests, before.requests),
            responses: sub(self.responses, before.responses),
            failures: sub(self.failures, before.failures),
            buckets: self
                .buckets
                .iter()
                .map(|(le, n)| (*le, sub(*n, before.buckets.get(le).copied().unwrap_or(0.0))))
                .collect(),
        }
    }

    /// The `q` quantile of the latencies, in seconds (linear within a bucket,
    /// as PromQL's `histogram_quantile`); `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.values().copied().fold(0.0, f64::max);
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for (le, count) in &self.buckets {
            let upper = f64::from_bits(*le);
            if *count >= rank {
                if upper.is_infinite() {
                    return Some(lower.0);
                }
                let in_bucket = count - lower.1;
                let share = if in_bucket > 0.0 {
                    (rank - lower.1) / in_bucket
                } else {
                    1.0
                };
                return Some(lower.0 + (upper - lower.0) * share);
            }
            lower = (upper, *count);
        }
        Some(lower.0)
    }
}

/// The calls one read of one proxy's `/metrics` counted, by Service and
/// source cluster.
pub fn counts(text: &str) -> anyhow::Result<HashMap<(ServiceKey, String), Counts>> {
    use prometheus_parse::Value;
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .map_err(|e| anyhow::anyhow!("not Prometheus text: {e}"))?;
    let mut out: HashMap<(ServiceKey, String), Counts> = HashMap::new();
    for sample in &scrape.samples {
        let label = |k: &str| sample.labels.get(k).unwrap_or("");
        let (direction, src, counted_in) =
            (label("direction"), label("src_cluster"), label("cluster"));
        // A local caller's call is counted once, on its way out.
        let counted = match direction {
            "outbound" => true,
            "inbound" => src != counted_in,
            _ => false,
        };
        if !counted || label("dst_service").is_empty() {
            continue;
        }
        let key = ServiceKey {
            namespace: label("dst_namespace").to_string(),
            service: label("dst_service").to_string(),
            cluster: label("dst_cluster").to_string(),
        };
        let entry = out.entry((key, src.to_string())).or_default();
        match (sample.metric.as_str(), &sample.value) {
            ("request_total", Value::Counter(n) | Value::Untyped(n)) => entry.requests += n,
            ("response_total", Value::Counter(n) | Value::Untyped(n)) => {
                entry.responses += n;
                if matches!(label("status_class"), "5xx" | "error") {
                    entry.failures += n;
                }
            }
            ("response_latency_seconds", Value::Histogram(buckets)) => {
                for b in buckets {
                    *entry.buckets.entry(b.less_than.to_bits()).or_default() += b.count;
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// One row of `strait stat`.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StatRow {
    pub namespace: String,
    pub service: String,
    /// The cluster serving it.
    pub cluster: String,
    /// The callers' cluster (`--from`), else every caller's.
    pub from: Option<String>,
    /// Requests in the window.
    pub requests: u64,
    pub requests_per_second: f64,
    /// Share of responses that were not 5xx or missing; `None` without responses.
    pub success_rate: Option<f64>,
    pub latency_p50_ms: Option<f64>,
    pub latency_p95_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
}

/// The rows between two reads (each the sum over every proxy).
pub fn rows(
    before: &HashMap<(ServiceKey, String), Counts>,
    after: &HashMap<(ServiceKey, String), Counts>,
    window: Duration,
    namespace: Option<&str>,
    from: Option<&str>,
) -> Vec<StatRow> {
    let mut by_service: BTreeMap<ServiceKey, Counts> = BTreeMap::new();
    for ((key, src), now) in after {
        if namespace.is_some_and(|n| n != key.namespace) || from.is_some_and(|f| f != src) {
            continue;
        }
        let then = before
            .get(&(key.clone(), src.clone()))
            .cloned()
            .unwrap_or_default();
        by_service
            .entry(key.clone())
            .or_default()
            .add(&now.since(&then));
    }
    let secs = window.as_secs_f64().max(f64::MIN_POSITIVE);
    let ms = |s: Option<f64>| s.map(|s| (s * 1e5).round() / 100.0);
    by_service
        .into_iter()
        .map(|(key, c)| StatRow {
            namespace: key.namespace,
            service: key.service,
            cluster: key.cluster,
            from: from.map(str::to_string),
            requests: c.requests.round() as u64,
            requests_per_second: (c.requests / secs * 100.0).round() / 100.0,
            success_rate: (c.responses > 0.0).then(|| 1.0 - c.failures / c.responses),
            latency_p50_ms: ms(c.quantile(0.5)),
            latency_p95_ms: ms(c.quantile(0.95)),
            latency_p99_ms: ms(c.quantile(0.99)),
        })
        .collect()
}

pub fn table(rows: &[StatRow]) -> String {
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v}ms"));
    let mut lines = vec![
        [
            "NAMESPACE",
            "SERVICE",
            "CLUSTER",
            "FROM",
            "RPS",
            "SUCCESS",
            "LATENCY_P50",
            "LATENCY_P95",
            "LATENCY_P99",
        ]
        .map(String::from),
    ];
    for r in rows {
        lines.push([
            r.namespace.clone(),
            r.service.clone(),
            r.cluster.clone(),
            r.from.clone().unwrap_or_else(|| "*".into()),
            format!("{:.2}", r.requests_per_second),
            r.success_rate
                .map_or_else(|| "-".to_string(), |s| format!("{:.2}%", s * 100.0)),
            ms(r.latency_p50_ms),
            ms(r.latency_p95_ms),
            ms(r.latency_p99_ms),
        ]);
    }
    crate::table::render(&lines)
}

/// Calls counted so far, by (Service, caller cluster).
pub type Totals = HashMap<(ServiceKey, String), Counts>;

/// One read of every node proxy of the cluster, summed.
async fn read(client: &Client) -> anyhow::Result<Totals> {
    let pods = Api::<Pod>::namespaced(client.clone(), SYSTEM_NAMESPACE)
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/name={NODE_PROXY_DAEMONSET}")))
        .await
        .map_err(|e| anyhow::anyhow!("listing the node proxies in {SYSTEM_NAMESPACE}: {e} (is Strait installed? `strait check` says)"))?;
    read_proxies(client, &pods.items)
        .await
        .map(|(total, _)| total)
}

/// Whether `pod` is a Running node proxy.
pub(crate) fn is_node_proxy(pod: &Pod) -> bool {
    let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
    running
        && pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("app.kubernetes.io/name"))
            .map(String::as_str)
            == Some(NODE_PROXY_DAEMONSET)
}

/// One read of each Running node proxy of `pods`, summed, and how many answered.
pub(crate) async fn read_proxies(client: &Client, pods: &[Pod]) -> anyhow::Result<(Totals, usize)> {
    let mut total: HashMap<(ServiceKey, String), Counts> = HashMap::new();
    let mut read = 0;
    for pod in pods {
        let Some(name) = pod.metadata.name.as_deref().filter(|_| is_node_proxy(pod)) else {
            continue;
        };
        let path = format!("/api/v1/namespaces/{SYSTEM_NAMESPACE}/pods/{name}:4191/proxy/metrics");
        let request = http::Request::get(path).body(Vec::new())?;
        let text = match client.request_text(request).await {
            Ok(text) => text,
            Err(e) => {
                // One proxy out of reach (restarting) must not hide the rest.
                eprintln!("warning: reading {SYSTEM_NAMESPACE}/{name}'s /metrics: {e}");
                continue;
            }
        };
        for (key, counts) in counts(&text).map_err(|e| anyhow::anyhow!("{name}'s /metrics: {e}"))? {
            total.entry(key).or_default().add(&counts);
        }
        read += 1;
    }
    if read == 0 {
        anyhow::bail!(
            "no Running node proxy answered in {SYSTEM_NAMESPACE} (`kubectl -n {SYSTEM_NAMESPACE} get pods -l app.kubernetes.io/name={NODE_PROXY_DAEMONSET}`)"
        );
    }
    Ok((total, read))
}

pub async fn stat(args: StatArgs) -> anyhow::Result<String> {
    let kubeconfig = load_kubeconfig(&args.kubeconfig)?;
    let (client, _) = client_for(&kubeconfig, &args.context).await?;
    let before = read(&client).await?;
    let started = tokio::time::Instant::now();
    tokio::time::sleep(args.window).await;
    let after = read(&client).await?;
    let rows = rows(
        &before,
        &after,
        started.elapsed(),
        args.namespace.as_deref(),
        args.from.as_deref(),
    );
    Ok(match args.output {
        Output::Json => serde_json::to_string_pretty(&rows)? + "\n",
        Output::Text if rows.is_empty() => "no meshed calls counted yet\n".to_string(),
        Output::Text => table(&rows),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const EAST: &str = r#"# TYPE request counter
request_total{direction="outbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="",dst_service="web",cluster="east"} 10
request_total{direction="inbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="east",dst_namespace="shop",dst_workload="web",dst_service="",cluster="east"} 99
request_total{direction="inbound",src_cluster="west",src_namespace="shop",src_workload="client",dst_cluster="east",dst_namespace="shop",dst_workload="db",dst_service="db",cluster="east"} 4
# TYPE response counter
response_total{direction="outbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="",dst_service="web",cluster="east",status_class="2xx"} 9
response_total{direction="outbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="",dst_service="web",cluster="east",status_class="5xx"} 1
# TYPE response_latency_seconds histogram
response_latency_seconds_bucket{direction="outbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="",dst_service="web",cluster="east",le="0.01"} 0
response_latency_seconds_bucket{direction="outbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="",dst_service="web",cluster="east",le="0.02"} 8
response_latency_seconds_bucket{direction="outbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="",dst_service="web",cluster="east",le="0.04"} 10
response_latency_seconds_bucket{direction="outbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="",dst_service="web",cluster="east",le="+Inf"} 10
response_latency_seconds_sum{direction="outbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="",dst_service="web",cluster="east"} 0.2
response_latency_seconds_count{direction="outbound",src_cluster="east",src_namespace="shop",src_workload="client",dst_cluster="west",dst_namespace="shop",dst_workload="",dst_service="web",cluster="east"} 10
"#;

    /// Calls out, and calls in from other clusters; a local caller's inbound
    /// side is not counted twice.
    #[test]
    fn counts_calls_out_and_calls_in_from_other_clusters() {
        let counted = counts(EAST).unwrap();
        let web = ServiceKey {
            namespace: "shop".into(),
            service: "web".into(),
            cluster: "west".into(),
        };
        let db = ServiceKey {
            namespace: "shop".into(),
            service: "db".into(),
            cluster: "east".into(),
        };
        assert_eq!(counted.len(), 2, "{counted:?}");
        let out = &counted[&(web, "east".to_string())];
        assert_eq!(
            (out.requests, out.responses, out.failures),
            (10.0, 10.0, 1.0)
        );
        assert_eq!(out.buckets.len(), 4);
        assert_eq!(counted[&(db, "west".to_string())].requests, 4.0);
    }

    #[test]
    fn rows_are_the_window_between_two_reads() {
        let before = counts(
            &EAST
                .replace("} 10\n", "} 0\n")
                .replace("} 9\n", "} 0\n")
                .replace("} 8\n", "} 0\n")
                .replace("} 1\n", "} 0\n"),
        )
        .unwrap();
        let after = counts(EAST).unwrap();
        let rows = rows(&before, &after, Duration::from_secs(5), None, None);
        assert_eq!(rows.len(), 2, "{rows:?}");
        let web = rows.iter().find(|r| r.service == "web").unwrap();
        assert_eq!(web.cluster, "west");
        assert_eq!(web.requests, 10);
        assert_eq!(web.requests_per_second, 2.0);
        assert_eq!(web.success_rate, Some(0.9));
        // 8 of 10 under 20 ms: the median is 10 + 10 × 5/8 ms.
        assert_eq!(web.latency_p50_ms, Some(16.25));
        // The 99th percentile falls in the 20–40 ms bucket.
        assert_eq!(web.latency_p99_ms, Some(39.0));
        // db's counter did not move: no requests in the window.
        let db = rows.iter().find(|r| r.service == "db").unwrap();
        assert_eq!((db.requests, db.success_rate), (0, None));

        let from_west = super::rows(&before, &after, Duration::from_secs(5), None, Some("west"));
        assert_eq!(from_west.len(), 1);
        assert_eq!(from_west[0].service, "db");
        assert_eq!(from_west[0].from.as_deref(), Some("west"));
        let text = table(&rows);
        assert!(text.starts_with("NAMESPACE   SERVICE   CLUSTER"), "{text}");
        assert!(text.contains("90.00%"), "{text}");
    }

    #[test]
    fn a_counter_that_restarted_counts_from_zero() {
        let before = Counts {
            requests: 50.0,
            ..Default::default()
        };
        let now = Counts {
            requests: 7.0,
            ..Default::default()
        };
        assert_eq!(now.since(&before).requests, 7.0);
    }
}
