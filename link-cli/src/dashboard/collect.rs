//! Where the dashboard's state comes from, and what each refresh costs the
//! API server.
//!
//! Kubernetes objects (Links, exported and mirrored Services, ServiceImports,
//! EndpointSlices, Strait's pods) are watched once into in-memory stores, as
//! a controller does: a refresh lists nothing. The golden metrics are read
//! each refresh from every node proxy's `/metrics` through the API server
//! (`pods/proxy`, one GET per node) or, with `--prometheus`, with three
//! PromQL queries and no API call. `strait check` (which reaches the linked
//! clusters) and the link tokens run on their own, slower, interval.

use std::collections::{HashMap, VecDeque};
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use strait_mesh::link::{Link, LinkSpec, TRUST_ANCHORS_CONFIGMAP};
use strait_mesh::names::{
    CLUSTER_NAME_LABEL, EXPORT_LABEL, LINK_NAMESPACE, MIRRORED_LABEL, SYSTEM_NAMESPACE,
};
use tokio::time::Instant;

use super::model::{self, Inputs, State, TokenTimes};
use crate::check::CheckResult;
use crate::check::bearer_token;
use crate::check::pure::jwt_times;
use crate::stat::{self, Totals};

/// The watched objects.
pub struct Stores {
    links: Store<DynamicObject>,
    exported: Store<Service>,
    mirrored: Store<Service>,
    imports: Store<DynamicObject>,
    slices: Store<EndpointSlice>,
    system_pods: Store<Pod>,
    link_pods: Store<Pod>,
}

/// Keeps `api`'s objects (matching `config`) in a store, re-watching with
/// backoff after errors; a broken object or a missing CRD leaves the store
/// as it was, it does not stop the dashboard.
fn reflect<K>(
    what: &'static str,
    api: Api<K>,
    config: watcher::Config,
    dyntype: K::DynamicType,
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Send + Sync,
{
    let writer = reflector::store::Writer::new(dyntype);
    let reader = writer.as_reader();
    let stream = watcher(api, config)
        .default_backoff()
        // Field managers are most of an object's size, and nothing the page shows.
        .modify(|o| o.managed_fields_mut().clear())
        .reflect(writer)
        .applied_objects();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        let mut warned = false;
        while let Some(event) = stream.next().await {
            match event {
                Err(e) if !warned => {
                    tracing::warn!("watching {what}: {e} (retrying with backoff)");
                    warned = true;
                }
                Err(e) => tracing::debug!("watching {what}: {e}"),
                Ok(_) => warned = false,
            }
        }
    });
    reader
}

impl Stores {
    pub fn watch(client: &Client) -> Self {
        let imports = ApiResource::from_gvk(&GroupVersionKind::gvk(
            strait_mesh::mcs::MCS_GROUP,
            "v1alpha1",
            "ServiceImport",
        ));
        let links = ApiResource::erase::<Link>(&());
        Stores {
            links: reflect(
                "Links",
                Api::namespaced_with(client.clone(), LINK_NAMESPACE, &links),
                watcher::Config::default(),
                links.clone(),
            ),
            exported: reflect(
                "exported Services",
                Api::all(client.clone()),
                watcher::Config::default().labels(&format!("{EXPORT_LABEL}=true")),
                (),
            ),
            mirrored: reflect(
                "mirrored Services",
                Api::all(client.clone()),
                watcher::Config::default().labels(&format!("{MIRRORED_LABEL}=true")),
                (),
            ),
            imports: reflect(
                "ServiceImports",
                Api::all_with(client.clone(), &imports),
                watcher::Config::default(),
                imports.clone(),
            ),
            slices: reflect(
                "EndpointSlices",
                Api::all(client.clone()),
                watcher::Config::default(),
                (),
            ),
            system_pods: reflect(
                "Strait's pods",
                Api::namespaced(client.clone(), SYSTEM_NAMESPACE),
                watcher::Config::default(),
                (),
            ),
            link_pods: reflect(
                "the mirror controller's pods",
                Api::namespaced(client.clone(), LINK_NAMESPACE),
                watcher::Config::default(),
                (),
            ),
        }
    }

    /// Until every store has its first list (or `limit` passed: a store
    /// whose API is missing stays empty).
    pub async fn ready(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, async {
            let _ = self.links.wait_until_ready().await;
            let _ = self.exported.wait_until_ready().await;
            let _ = self.mirrored.wait_until_ready().await;
            let _ = self.slices.wait_until_ready().await;
            let _ = self.system_pods.wait_until_ready().await;
            let _ = self.link_pods.wait_until_ready().await;
        })
        .await;
    }

    fn links(&self) -> Vec<DynamicObject> {
        let mut links: Vec<DynamicObject> =
            self.links.state().iter().map(|l| (**l).clone()).collect();
        links.sort_by_key(|l| l.name_any());
        links
    }
}

fn owned<K>(store: &Store<K>) -> Vec<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    store.state().iter().map(|o| (**o).clone()).collect()
}

/// Where the golden metrics are read.
#[derive(Clone, Debug)]
pub enum MetricsFrom {
    /// Every node proxy of the cluster, through the API server.
    Proxies,
    /// A Prometheus server scraping them (its base URL, `http://…`).
    Prometheus(String),
}

/// This cluster's name, as `strait install` labelled its trust anchors.
pub async fn cluster_name(client: &Client) -> anyhow::Result<String> {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), SYSTEM_NAMESPACE)
        .get(TRUST_ANCHORS_CONFIGMAP)
        .await
        .map_err(|e| anyhow::anyhow!("reading {SYSTEM_NAMESPACE}/{TRUST_ANCHORS_CONFIGMAP}: {e} (is Strait installed here? `strait check` says)"))?;
    cm.labels()
        .get(CLUSTER_NAME_LABEL)
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("{SYSTEM_NAMESPACE}/{TRUST_ANCHORS_CONFIGMAP} has no {CLUSTER_NAME_LABEL} label: reinstall with `strait install`"))
}

/// The last check run and the link tokens' times.
#[derive(Default)]
pub struct Checked {
    pub results: Vec<CheckResult>,
    pub tokens: TokenTimes,
    pub at: Option<i64>,
}

/// Runs `strait check` and reads each Link's token every `interval`.
pub fn check_every(client: Client, stores: Arc<Stores>, interval: Duration) -> Arc<Mutex<Checked>> {
    let checked = Arc::new(Mutex::new(Checked::default()));
    let out = checked.clone();
    tokio::spawn(async move {
        loop {
            let results = crate::check::run_all(&client).await;
            let mut tokens = TokenTimes::new();
            let secrets = Api::<Secret>::namespaced(client.clone(), LINK_NAMESPACE);
            for link in stores.links() {
                let Ok(spec) = serde_json::from_value::<LinkSpec>(link.data["spec"].clone()) else {
                    continue;
                };
                let Ok(Some(secret)) = secrets.get_opt(&spec.cluster_credentials_secret).await
                else {
                    continue;
                };
                let token = secret
                    .data
                    .unwrap_or_default()
                    .remove("kubeconfig")
                    .and_then(|kc| bearer_token(&String::from_utf8_lossy(&kc.0)));
                if let Some(Ok(times)) = token.map(|t| jwt_times(&t)) {
                    tokens.insert(spec.target_cluster_name, times);
                }
            }
            *out.lock().unwrap_or_else(|e| e.into_inner()) = Checked {
                results,
                tokens,
                at: Some(crate::check::local::now()),
            };
            tokio::time::sleep(interval).await;
        }
    });
    checked
}

/// The reads of the metrics over the last window, oldest first.
pub struct Window {
    reads: VecDeque<(Instant, Totals)>,
    length: Duration,
}

impl Window {
    pub fn new(length: Duration) -> Self {
        Window {
            reads: VecDeque::new(),
            length,
        }
    }

    /// Adds a read; drops the reads no longer needed to span the window.
    pub fn push(&mut self, at: Instant, totals: Totals) {
        self.reads.push_back((at, totals));
        while self.reads.len() > 2 && at.duration_since(self.reads[1].0) >= self.length {
            self.reads.pop_front();
        }
    }

    /// The calls between the oldest and the newest read, and the seconds
    /// between them (nothing until there are two reads).
    pub fn calls(&self) -> (Totals, f64) {
        let (Some((first, oldest)), Some((last, newest))) = (self.reads.front(), self.reads.back())
        else {
            return (Totals::new(), 0.0);
        };
        if self.reads.len() < 2 {
            return (Totals::new(), 0.0);
        }
        let calls = newest
            .iter()
            .map(|(key, now)| {
                let then = oldest.get(key).cloned().unwrap_or_default();
                (key.clone(), now.since(&then))
            })
            .collect();
        (calls, last.duration_since(*first).as_secs_f64())
    }
}

/// One read of the golden metrics: the totals and how many proxies answered.
/// The node proxies are the watched ones: no list per read.
pub async fn read_metrics(
    client: &Client,
    stores: &Stores,
    from: &MetricsFrom,
    cluster: &str,
) -> anyhow::Result<(Totals, usize)> {
    match from {
        MetricsFrom::Proxies => stat::read_proxies(client, &owned(&stores.system_pods)).await,
        MetricsFrom::Prometheus(url) => Ok((prometheus_totals(url, cluster).await?, 0)),
    }
}

/// The same totals from Prometheus: the node proxies' series of `cluster`,
/// summed over pods, as Prometheus text for [`stat::counts`].
async fn prometheus_totals(url: &str, cluster: &str) -> anyhow::Result<Totals> {
    const BY: &str = "direction, src_cluster, cluster, dst_namespace, dst_service, dst_cluster";
    let selector = format!("{{cluster=\"{cluster}\"}}");
    let mut text = String::new();
    for (metric, kind, extra) in [
        ("request_total", "counter", ""),
        ("response_total", "counter", ", status_class"),
        ("response_latency_seconds_bucket", "histogram", ", le"),
    ] {
        let family = metric.trim_end_matches("_bucket");
        text.push_str(&format!("# TYPE {family} {kind}\n"));
        let query = format!("sum by ({BY}{extra}) ({metric}{selector})");
        for sample in prometheus_query(url, &query).await? {
            let labels: Vec<String> = sample["metric"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| format!("{k}={}", serde_json::Value::from(v.as_str().unwrap_or(""))))
                .collect();
            let value = sample["value"][1].as_str().unwrap_or("0");
            text.push_str(&format!("{metric}{{{}}} {value}\n", labels.join(",")));
        }
    }
    stat::counts(&text).map_err(|e| anyhow::anyhow!("Prometheus at {url}: {e}"))
}

/// One instant query; the result vector.
async fn prometheus_query(base: &str, query: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    use http_body_util::{BodyExt, Empty};
    let uri = format!(
        "{}/api/v1/query?{}",
        base.trim_end_matches('/'),
        form_urlencoded::Serializer::new(String::new())
            .append_pair("query", query)
            .finish()
    );
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let response = tokio::time::timeout(Duration::from_secs(10), client.get(uri.parse()?))
        .await
        .map_err(|_| anyhow::anyhow!("Prometheus at {base} did not answer in 10 s"))?
        .map_err(|e| {
            anyhow::anyhow!("Prometheus at {base}: {e} (is --prometheus an http:// URL it serves?)")
        })?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    let answer: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| anyhow::anyhow!("Prometheus at {base} answered {status}, not JSON: {e}"))?;
    if answer["status"] != "success" {
        anyhow::bail!(
            "Prometheus at {base} refused {query:?}: {}",
            answer["error"]
        );
    }
    Ok(answer["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// Builds the page's state from the stores and the metrics window.
pub fn state(
    cluster: &str,
    stores: &Stores,
    calls: &HashMap<(stat::ServiceKey, String), stat::Counts>,
    window_seconds: f64,
    checked: &Checked,
) -> State {
    let mut pods = owned(&stores.system_pods);
    pods.extend(owned(&stores.link_pods));
    pods.sort_by_key(|p| (p.namespace(), p.name_any()));
    let mut state = model::build(&Inputs {
        cluster,
        now: crate::check::local::now(),
        links: &stores.links(),
        exported: &owned(&stores.exported),
        mirrored: &owned(&stores.mirrored),
        imports: &owned(&stores.imports),
        slices: &owned(&stores.slices),
        pods: &pods,
        window: calls,
        window_seconds,
        checks: &checked.results,
        tokens: &checked.tokens,
    });
    state.checked_at = checked.at.map(|s| s * 1000);
    state
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stat::{Counts, ServiceKey};

    fn totals(requests: f64) -> Totals {
        Totals::from([(
            (ServiceKey::default(), "east".to_string()),
            Counts {
                requests,
                ..Default::default()
            },
        )])
    }

    #[test]
    fn the_window_spans_the_reads_of_its_length() {
        let start = Instant::now();
        let mut window = Window::new(Duration::from_secs(10));
        assert_eq!(window.calls().1, 0.0);
        window.push(start, totals(0.0));
        assert!(window.calls().0.is_empty(), "one read has no window");
        for s in 1..=30 {
            window.push(start + Duration::from_secs(s * 2), totals(s as f64 * 20.0));
        }
        let (calls, seconds) = window.calls();
        // Kept: the newest read and the last one at least 10 s before it.
        assert_eq!(seconds, 10.0);
        assert_eq!(calls.values().next().unwrap().requests, 100.0);
    }
}
