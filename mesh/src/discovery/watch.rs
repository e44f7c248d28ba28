//! The reflectors: Services, EndpointSlices, Pods and Nodes, trimmed on arrival
//! to what discovery reads, so a node proxy's memory follows the cluster's
//! size and not the size of its objects (no managedFields, no node images list,
//! no container specs).

use std::sync::Arc;
use std::time::Duration;

use futures::stream::{BoxStream, SelectAll};
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node, NodeStatus, Pod, PodSpec, PodStatus, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::watch;

use super::index::{IndexConfig, SERVICE_NAME_LABEL, Snapshot};
use crate::names::CLUSTERSET_SLICE_SERVICE_LABEL;

/// Bursts of changes (a rollout touches many pods and slices) make one rebuild.
const DEBOUNCE: Duration = Duration::from_millis(25);

pub(super) struct Stores {
    services: Store<Service>,
    slices: Store<EndpointSlice>,
    /// Linked clusters' gateways in clusterset services: named for node
    /// proxies only, not `kubernetes.io/service-name` (kube-proxy must not
    /// route to them).
    gateway_slices: Store<EndpointSlice>,
    pods: Store<Pod>,
    nodes: Store<Node>,
    namespaces: Store<Namespace>,
}

impl Stores {
    fn all_ready(&self) -> bool {
        self.services.wait_until_ready().now_or_never().is_some()
            && self.slices.wait_until_ready().now_or_never().is_some()
            && self
                .gateway_slices
                .wait_until_ready()
                .now_or_never()
                .is_some()
            && self.pods.wait_until_ready().now_or_never().is_some()
            && self.nodes.wait_until_ready().now_or_never().is_some()
            && self.namespaces.wait_until_ready().now_or_never().is_some()
    }
}

/// One reflector's progress: which kind, and whether the watch is healthy.
type Change = BoxStream<'static, (&'static str, Result<(), watcher::Error>)>;
type Changes = SelectAll<Change>;

fn reflect<K>(
    kind: &'static str,
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
) -> (Store<K>, Change)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store::<K>();
    let stream = watcher(api, config.any_semantic())
        .default_backoff()
        .modify(trim)
        .reflect(writer)
        .map(move |r| (kind, r.map(|_| ())))
        .boxed();
    (reader, stream)
}

pub(super) fn streams(client: &Client) -> (Stores, Changes) {
    let (services, s1) = reflect(
        "Service",
        Api::<Service>::all(client.clone()),
        watcher::Config::default(),
        trim_service,
    );
    // Only slices that belong to a Service.
    let (slices, s2) = reflect(
        "EndpointSlice",
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(SERVICE_NAME_LABEL),
        trim_slice,
    );
    let (gateway_slices, s6) = reflect(
        "EndpointSlice",
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(CLUSTERSET_SLICE_SERVICE_LABEL),
        trim_slice,
    );
    // Finished pods hold no traffic (and their IPs are reused).
    let (pods, s3) = reflect(
        "Pod",
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().fields("status.phase!=Succeeded,status.phase!=Failed"),
        trim_pod,
    );
    let (nodes, s4) = reflect(
        "Node",
        Api::<Node>::all(client.clone()),
        watcher::Config::default(),
        trim_node,
    );
    // For their `strait.dev/opaque-ports` only.
    let (namespaces, s5) = reflect(
        "Namespace",
        Api::<Namespace>::all(client.clone()),
        watcher::Config::default(),
        trim_namespace,
    );
    let stores = Stores {
        services,
        slices,
        gateway_slices,
        pods,
        nodes,
        namespaces,
    };
    (
        stores,
        futures::stream::select_all([s1, s2, s3, s4, s5, s6]),
    )
}

/// Drives the reflectors and publishes a new snapshot after each burst of changes.
pub(super) async fn run(
    config: IndexConfig,
    stores: Stores,
    mut changes: Changes,
    tx: watch::Sender<Arc<Snapshot>>,
) {
    let mut synced = false;
    while let Some((kind, item)) = changes.next().await {
        if let Err(e) = item {
            tracing::warn!(
                "watching {kind}s failed: {e}; retrying (check the proxy's RBAC: list/watch {kind}s cluster-wide)"
            );
            continue;
        }
        let quiet = tokio::time::sleep(DEBOUNCE);
        tokio::pin!(quiet);
        loop {
            tokio::select! {
                _ = &mut quiet => break,
                next = changes.next() => match next {
                    Some((kind, Err(e))) => tracing::warn!("watching {kind}s failed: {e}; retrying"),
                    Some(_) => {}
                    None => return,
                },
            }
        }
        if !synced {
            synced = stores.all_ready();
            if !synced {
                continue;
            }
            tracing::info!("discovery synced");
        }
        let mut slices = stores.slices.state();
        slices.extend(stores.gateway_slices.state());
        let mut snapshot = Snapshot::build_with(
            &config,
            &stores.services.state(),
            &slices,
            &stores.pods.state(),
            &stores.nodes.state(),
            &stores.namespaces.state(),
        );
        snapshot.synced = true;
        if tx.send(Arc::new(snapshot)).is_err() {
            return; // nobody reads any more
        }
    }
}

fn trim_meta(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    if let Some(a) = meta.annotations.as_mut() {
        // Strait's own (`strait.dev/…` and its subdomains', e.g. the MCS
        // controller's `multicluster.strait.dev/exported`).
        a.retain(|k, _| {
            k.starts_with(crate::names::PREFIX)
                || k.split_once('/')
                    .is_some_and(|(p, _)| p.ends_with(".strait.dev"))
        });
    }
}

fn trim_service(svc: &mut Service) {
    trim_meta(&mut svc.metadata);
    svc.status = None;
}

fn trim_slice(slice: &mut EndpointSlice) {
    trim_meta(&mut slice.metadata);
    for ep in slice.endpoints.iter_mut().flatten() {
        ep.hints = None;
        ep.deprecated_topology = None;
    }
}

/// Pods dominate memory: keep name, namespace, strait.dev annotations, node,
/// service account, host network, phase, IPs and the Ready condition.
fn trim_pod(pod: &mut Pod) {
    trim_meta(&mut pod.metadata);
    pod.metadata.labels = None;
    pod.spec = pod.spec.take().map(|s| PodSpec {
        node_name: s.node_name,
        service_account_name: s.service_account_name,
        host_network: s.host_network,
        ..Default::default()
    });
    pod.status = pod.status.take().map(|s| PodStatus {
        phase: s.phase,
        pod_ip: s.pod_ip,
        pod_ips: s.pod_ips,
        conditions: s
            .conditions
            .map(|c| c.into_iter().filter(|c| c.type_ == "Ready").collect()),
        ..Default::default()
    });
}

fn trim_namespace(ns: &mut Namespace) {
    trim_meta(&mut ns.metadata);
    ns.metadata.labels = None;
    ns.spec = None;
    ns.status = None;
}

/// Nodes carry image lists and more; only the addresses matter here.
fn trim_node(node: &mut Node) {
    trim_meta(&mut node.metadata);
    node.metadata.labels = None;
    node.spec = None;
    node.status = node.status.take().map(|s| NodeStatus {
        addresses: s.addresses,
        ..Default::default()
    });
}
