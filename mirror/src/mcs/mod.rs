//! The Multi-Cluster Services controller (KEP-1645), pull model: every cluster
//! derives its own ServiceImports from the exports it can see, and writes only
//! to itself.
//!
//! - Local ServiceExports are validated against their Service ([`resolve::validate`]);
//!   a valid one is published on the export itself (annotation
//!   [`resolve::EXPORTED_SERVICE_ANNOTATION`]: type, ports, affinity, policies) so
//!   linked clusters need to watch only ServiceExports.
//! - Each Link's worker watches its remote's ServiceExports and joins the
//!   [`ClustersetFeed`] under the remote's cluster name (a second Link to the
//!   same name, or one named like this cluster, is refused).
//! - A sync pass resolves every exported service from all of them
//!   ([`resolve::resolve`]: oldest export wins, conflicts named) and writes the
//!   ServiceImport (server-side apply, field manager `strait-mirror`, label
//!   `app.kubernetes.io/managed-by=strait-mirror`; one without the label is
//!   never touched), its status (`clusters`), for ClusterSetIP a derived Service
//!   owned by the import whose cluster IPs become the import's `ips`, and the
//!   local exports' conditions `Valid`, `Ready`, `Conflict`.
//! - Imports are deleted only when every linked cluster's exports are listed
//!   (an unreachable remote keeps what it exported); failed writes are retried
//!   by the next pass (on change, and every 10 s).

pub mod resolve;
pub mod slices;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use strait_mesh::mcs::{LABEL_SERVICE_NAME, ServiceExport, ServiceImport, ServiceImportType};
use strait_mesh::names::{AFFINITY_ANNOTATION, CLUSTERSET_EXPORTED_ANNOTATION};

/// Field manager of the exported mark on Services: its own, so releasing the
/// mark never touches a derived Service this controller also applies.
const MARK_FIELD_MANAGER: &str = "strait-mirror-clusterset";
use tokio::sync::{Notify, watch};

use crate::probe::GatewayEndpoint;
use crate::remote_slices::ExportedSlices;

use resolve::{EXPORTED_SERVICE_ANNOTATION, Export, ExportedService, Resolved, Validity};

/// Field manager of every write (the mirror's own).
const FIELD_MANAGER: &str = crate::worker::FIELD_MANAGER;
/// On ServiceImports and derived Services Strait writes; others are never touched.
pub use strait_mesh::mcs::MANAGED_BY;

/// The linked clusters' ServiceExports, by cluster name, shared by the Link
/// workers (which fill it) and the MCS controller (which reads it).
#[derive(Clone, Default)]
pub struct ClustersetFeed {
    clusters: Arc<Mutex<BTreeMap<String, Member>>>,
    changed: Arc<Notify>,
}

impl std::fmt::Debug for ClustersetFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let clusters: Vec<String> = self
            .clusters
            .lock()
            .map(|c| c.keys().cloned().collect())
            .unwrap_or_default();
        f.debug_struct("ClustersetFeed")
            .field("clusters", &clusters)
            .finish()
    }
}

struct Member {
    link: String,
    remote: RemoteCluster,
    /// Whether a worker is watching the remote now.
    attached: bool,
    /// Which join this is (a restarted worker's old membership must not
    /// detach the new one).
    id: u64,
}

/// What a Link's worker shares about its remote cluster.
pub struct RemoteCluster {
    /// The remote's ServiceExports.
    pub exports: Store<ServiceExport>,
    /// The remote's slices of its exported Services (for ready counts and
    /// headless endpoints), when watched.
    pub slices: Option<ExportedSlices>,
    /// The Link's gateway addresses and their liveness.
    pub gateways: watch::Receiver<Option<Vec<GatewayEndpoint>>>,
    pub gateway_port: u16,
    pub gateway_identity: String,
    /// The remote cluster's DNS domain.
    pub domain: String,
}

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error(
        "Link {other} already links a cluster named {cluster:?}: two clusters cannot share a name in a clusterset; give one of them another name (`strait install --cluster-name`) and link it again"
    )]
    DuplicateClusterName { cluster: String, other: String },
    #[error(
        "the linked cluster is named {0:?}, like this cluster: give one of them another name (`strait install --cluster-name`) and link it again"
    )]
    SameNameAsThisCluster(String),
}

impl JoinError {
    pub fn reason(&self) -> &'static str {
        match self {
            JoinError::DuplicateClusterName { .. } => "DuplicateClusterName",
            JoinError::SameNameAsThisCluster(_) => "SameNameAsThisCluster",
        }
    }
}

/// A Link's place in the feed; leaving it (drop) removes the cluster's exports.
pub struct Membership {
    feed: ClustersetFeed,
    cluster: String,
    id: u64,
}

impl Drop for Membership {
    /// The worker lost the remote (its credentials failed): the cluster's last
    /// known exports stay, marked detached, so nothing it exported is deleted
    /// until the Link itself goes ([`ClustersetFeed::leave`]).
    fn drop(&mut self) {
        if let Ok(mut clusters) = self.feed.clusters.lock()
            && let Some(member) = clusters.get_mut(&self.cluster)
            && member.id == self.id
        {
            member.attached = false;
        }
        self.feed.changed.notify_one();
    }
}

impl ClustersetFeed {
    /// Adds `cluster`'s exports, as seen through `link`.
    pub fn join(
        &self,
        local_cluster: Option<&str>,
        cluster: &str,
        link: &str,
        remote: RemoteCluster,
    ) -> Result<Membership, JoinError> {
        if local_cluster == Some(cluster) {
            return Err(JoinError::SameNameAsThisCluster(cluster.to_string()));
        }
        let mut clusters = self.clusters.lock().expect("feed lock");
        if let Some(other) = clusters.get(cluster)
            && other.link != link
        {
            return Err(JoinError::DuplicateClusterName {
                cluster: cluster.to_string(),
                other: other.link.clone(),
            });
        }
        static JOINS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = JOINS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        clusters.insert(
            cluster.to_string(),
            Member {
                link: link.to_string(),
                remote,
                attached: true,
                id,
            },
        );
        drop(clusters);
        self.changed.notify_one();
        Ok(Membership {
            feed: self.clone(),
            cluster: cluster.to_string(),
            id,
        })
    }

    /// Removes `cluster` as linked by `link` (the Link was deleted, or now
    /// names another cluster): its exports stop counting.
    pub fn leave(&self, cluster: &str, link: &str) {
        if let Ok(mut clusters) = self.clusters.lock()
            && clusters.get(cluster).is_some_and(|m| m.link == link)
        {
            clusters.remove(cluster);
        }
        self.changed.notify_one();
    }

    /// Wakes the controller (a remote store changed).
    pub fn notify(&self) {
        self.changed.notify_one();
    }

    /// Every linked cluster's exports, what their slices need, and whether
    /// every cluster's exports are listed yet.
    fn snapshot(&self) -> Snapshot {
        let clusters = self.clusters.lock().expect("feed lock");
        let mut snap = Snapshot {
            all_listed: true,
            ..Default::default()
        };
        for (cluster, member) in clusters.iter() {
            let r = &member.remote;
            // A store that never listed is empty: it must not read as "exports nothing".
            if !member.attached || !store_ready(&r.exports) {
                snap.all_listed = false;
            }
            for export in r.exports.state() {
                snap.exports.push((cluster.clone(), export));
            }
            let view = slices::RemoteView {
                cluster: cluster.clone(),
                gateways: r.gateways.borrow().clone().unwrap_or_default(),
                gateway_port: r.gateway_port,
                gateway_identity: r.gateway_identity.clone(),
                domain: r.domain.clone(),
            };
            snap.remotes
                .insert(cluster.clone(), (view, r.slices.clone()));
        }
        snap
    }
}

#[derive(Default)]
struct Snapshot {
    exports: Vec<(String, Arc<ServiceExport>)>,
    remotes: BTreeMap<String, (slices::RemoteView, Option<ExportedSlices>)>,
    all_listed: bool,
}

fn store_ready<K: Resource + Clone + 'static>(store: &Store<K>) -> bool
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    futures::FutureExt::now_or_never(store.wait_until_ready()).is_some_and(|r| r.is_ok())
}

/// Watches a remote's ServiceExports into a store, waking `feed` and
/// `changed` on changes, until the returned task is aborted.
pub fn watch_remote_exports(
    remote: &Client,
    feed: &ClustersetFeed,
    cluster: &str,
    changed: Arc<Notify>,
) -> (Store<ServiceExport>, tokio::task::JoinHandle<()>) {
    let (store, writer) = reflector::store::<ServiceExport>();
    let stream = watcher(
        Api::<ServiceExport>::all(remote.clone()),
        Default::default(),
    )
    .modify(|e| e.metadata.managed_fields = None)
    .default_backoff();
    let (feed, cluster) = (feed.clone(), cluster.to_string());
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(reflector::reflector(writer, stream));
        let mut last_error: Option<String> = None;
        while let Some(item) = stream.next().await {
            match item {
                Ok(_) => {
                    last_error = None;
                    feed.notify();
                    changed.notify_one();
                }
                Err(e) => {
                    let e = e.to_string();
                    if last_error.as_ref() != Some(&e) {
                        tracing::warn!(%cluster, "watching the linked cluster's ServiceExports: {e} (is the MCS API installed there, and the link's role up to date? re-run `strait link`)");
                        last_error = Some(e);
                    }
                }
            }
        }
    });
    (store, task)
}

/// Name of the Service holding a ClusterSetIP import's IPs (as the MCS
/// reference implementation: `derived-` + a stable hash of namespace/name).
pub fn derived_name(ns: &str, name: &str) -> String {
    // FNV-1a 64: stable across releases (std's hasher is not promised to be).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in format!("{ns}/{name}").bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("derived-{h:016x}")
}

type Key = (String, String);

/// The local stores the controller reads.
struct Local {
    exports: Store<ServiceExport>,
    imports: Store<ServiceImport>,
    services: Store<Service>,
    /// Every slice that belongs to a Service (the exported ones' and ours).
    slices: Store<EndpointSlice>,
}

fn watch<K>(api: Api<K>, changed: Arc<Notify>, what: &'static str) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    let (store, writer) = reflector::store::<K>();
    let stream = watcher(api, Default::default())
        .modify(|o: &mut K| o.meta_mut().managed_fields = None)
        .default_backoff();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(reflector::reflector(writer, stream));
        while let Some(item) = stream.next().await {
            match item {
                Ok(_) => changed.notify_one(),
                Err(e) => tracing::warn!("watching local {what}: {e}"),
            }
        }
    });
    store
}

/// Runs the controller for cluster `cluster` until dropped.
pub async fn run(client: Client, cluster: String, feed: ClustersetFeed) {
    let changed = feed.changed.clone();
    let local = Local {
        exports: watch(Api::all(client.clone()), changed.clone(), "ServiceExports"),
        imports: watch(Api::all(client.clone()), changed.clone(), "ServiceImports"),
        services: watch(Api::all(client.clone()), changed.clone(), "Services"),
        slices: watch(Api::all(client.clone()), changed.clone(), "EndpointSlices"),
    };
    for ready in [
        local.exports.wait_until_ready().await,
        local.imports.wait_until_ready().await,
        local.services.wait_until_ready().await,
        local.slices.wait_until_ready().await,
    ] {
        if ready.is_err() {
            return;
        }
    }
    tracing::info!(%cluster, "multi-cluster services controller started");
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "strait-mirror".into(),
            instance: std::env::var("POD_NAME").ok(),
        },
    );
    let controller = Controller {
        client,
        cluster,
        feed,
        local,
        recorder,
    };
    loop {
        controller.sync().await;
        tokio::select! {
            _ = changed.notified() => {
                // Coalesce bursts (one export touches several stores).
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            _ = tokio::time::sleep(Duration::from_secs(10)) => {}
        }
    }
}

struct Controller {
    client: Client,
    cluster: String,
    feed: ClustersetFeed,
    local: Local,
    /// Events on ServiceExports, one per condition change.
    recorder: Recorder,
}

/// A write's outcome for the Ready condition.
type Written = Result<(), String>;

impl Controller {
    async fn sync(&self) {
        // 1. Local exports: validity, and what each publishes.
        let mut exports: BTreeMap<Key, Vec<Export>> = BTreeMap::new();
        let mut local: Vec<(Arc<ServiceExport>, Validity)> = Vec::new();
        for export in self.local.exports.state() {
            let (ns, name) = (export.namespace().unwrap_or_default(), export.name_any());
            let service = self.local.services.get(&ObjectRef::new(&name).within(&ns));
            let validity = resolve::validate(service.as_deref(), export.annotations());
            if let Validity::Valid(shape) = &validity {
                exports
                    .entry((ns.clone(), name.clone()))
                    .or_default()
                    .push(Export {
                        cluster: self.cluster.clone(),
                        created: created(&export),
                        service: shape.clone(),
                        exported_labels: export.spec.spec.exported_labels.clone(),
                        exported_annotations: export.spec.spec.exported_annotations.clone(),
                    });
            }
            if let Err(e) = self.publish(&export, &validity).await {
                tracing::warn!(export = %format!("{ns}/{name}"), "publishing the export: {e}");
            }
            local.push((export, validity));
        }
        // The gateway serves a Service to linked clusters only when it is
        // exported: mark the valid exports' Services, unmark the others.
        let served: std::collections::BTreeSet<Key> = local
            .iter()
            .filter(|(_, v)| matches!(v, Validity::Valid(_)))
            .map(|(e, _)| (e.namespace().unwrap_or_default(), e.name_any()))
            .collect();
        for svc in self.local.services.state() {
            let key = (svc.namespace().unwrap_or_default(), svc.name_any());
            let marked = svc
                .annotations()
                .get(CLUSTERSET_EXPORTED_ANNOTATION)
                .map(String::as_str)
                == Some("true");
            if marked != served.contains(&key)
                && let Err(e) = self.mark_exported(&key, !marked).await
            {
                tracing::warn!(service = %format!("{}/{}", key.0, key.1), "marking the Service exported: {e}");
            }
        }
        // 2. Linked clusters' published exports.
        let snap = self.feed.snapshot();
        let all_listed = snap.all_listed;
        for (cluster, export) in snap.exports.iter().cloned() {
            let Some(shape) = export
                .annotations()
                .get(EXPORTED_SERVICE_ANNOTATION)
                .and_then(|a| serde_json::from_str::<ExportedService>(a).ok())
            else {
                continue; // invalid there, or not yet published
            };
            exports
                .entry((export.namespace().unwrap_or_default(), export.name_any()))
                .or_default()
                .push(Export {
                    cluster,
                    created: created(&export),
                    service: shape,
                    exported_labels: export.spec.spec.exported_labels.clone(),
                    exported_annotations: export.spec.spec.exported_annotations.clone(),
                });
        }
        // 3. One ServiceImport per exported service.
        let mut written: BTreeMap<Key, (Resolved, Written)> = BTreeMap::new();
        for (key, exports) in &exports {
            let Some(resolved) = resolve::resolve(exports) else {
                continue;
            };
            let mut outcome = self.write_import(key, &resolved).await;
            if outcome.is_ok() {
                outcome = self.write_slices(key, &resolved, &snap).await;
            }
            if let Err(e) = &outcome {
                tracing::warn!(import = %format!("{}/{}", key.0, key.1), "{e}");
            }
            written.insert(key.clone(), (resolved, outcome));
        }
        // 4. The local exports' conditions.
        for (export, validity) in &local {
            let key = (export.namespace().unwrap_or_default(), export.name_any());
            if let Err(e) = self
                .set_conditions(export, validity, written.get(&key))
                .await
            {
                tracing::warn!(export = %format!("{}/{}", key.0, key.1), "writing conditions: {e}");
            }
        }
        // 5. Slices of sources that no longer back an import (a source
        //    cluster gone, an import deleted: owner references take the rest).
        let wanted: std::collections::BTreeSet<(String, String)> = written
            .iter()
            .flat_map(|((ns, name), (r, _))| {
                let derived = derived_name(ns, name);
                r.clusters
                    .iter()
                    .map(move |c| (ns.clone(), slices::slice_name(&derived, c)))
                    .collect::<Vec<_>>()
            })
            .collect();
        if all_listed {
            for slice in self.local.slices.state() {
                let managed = slice
                    .labels()
                    .get(crate::mirror::MANAGED_BY_LABEL)
                    .map(String::as_str)
                    == Some(slices::MANAGED_BY);
                let key = (slice.namespace().unwrap_or_default(), slice.name_any());
                if managed && !wanted.contains(&key) {
                    let api: Api<EndpointSlice> = Api::namespaced(self.client.clone(), &key.0);
                    match api.delete(&key.1, &only_this(slice.as_ref())).await {
                        Ok(_) | Err(kube::Error::Api(_)) => {}
                        Err(e) => {
                            tracing::warn!(slice = %format!("{}/{}", key.0, key.1), "deleting: {e}")
                        }
                    }
                }
            }
        }
        // 6. Imports no export backs any more.
        if all_listed {
            for import in self.local.imports.state() {
                let key = (import.namespace().unwrap_or_default(), import.name_any());
                if ours(import.labels()) && !exports.contains_key(&key) {
                    let api: Api<ServiceImport> = Api::namespaced(self.client.clone(), &key.0);
                    match api.delete(&key.1, &only_this(import.as_ref())).await {
                        Ok(_) => {
                            tracing::info!(import = %format!("{}/{}", key.0, key.1), "no cluster exports it any more: ServiceImport deleted")
                        }
                        Err(kube::Error::Api(e)) if e.code == 404 => {}
                        Err(e) => {
                            tracing::warn!(import = %format!("{}/{}", key.0, key.1), "deleting: {e}")
                        }
                    }
                }
            }
        }
    }

    /// Sets or removes [`CLUSTERSET_EXPORTED_ANNOTATION`] on a Service (server-side
    /// apply: removing it releases the field, nothing else of the Service changes).
    async fn mark_exported(&self, (ns, name): &Key, exported: bool) -> kube::Result<()> {
        let mut patch = json!({"apiVersion": "v1", "kind": "Service",
                               "metadata": {"name": name, "namespace": ns}});
        if exported {
            patch["metadata"]["annotations"] = json!({ CLUSTERSET_EXPORTED_ANNOTATION: "true" });
        }
        Api::<Service>::namespaced(self.client.clone(), ns)
            .patch(
                name,
                &PatchParams::apply(MARK_FIELD_MANAGER).force(),
                &Patch::Apply(patch),
            )
            .await
            .map(|_| ())
    }

    /// Publishes (or withdraws) what a local export exports, when it changed.
    async fn publish(&self, export: &ServiceExport, validity: &Validity) -> kube::Result<()> {
        let wanted = match validity {
            Validity::Valid(shape) => Some(serde_json::to_string(shape).unwrap_or_default()),
            _ => None,
        };
        let current = export.annotations().get(EXPORTED_SERVICE_ANNOTATION);
        if current == wanted.as_ref() {
            return Ok(());
        }
        let ns = export.namespace().unwrap_or_default();
        let mut patch = json!({
            "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceExport",
            "metadata": {"name": export.name_any(), "namespace": ns},
        });
        if let Some(w) = wanted {
            patch["metadata"]["annotations"] = json!({ EXPORTED_SERVICE_ANNOTATION: w });
        }
        Api::<ServiceExport>::namespaced(self.client.clone(), &ns)
            .patch(
                &export.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(patch),
            )
            .await
            .map(|_| ())
    }

    /// Writes the ServiceImport of `key` (and its derived Service) when it
    /// differs from what is there.
    async fn write_import(&self, key: &Key, r: &Resolved) -> Written {
        let (ns, name) = key;
        let api: Api<ServiceImport> = Api::namespaced(self.client.clone(), ns);
        let existing = self.local.imports.get(&ObjectRef::new(name).within(ns));
        if let Some(existing) = &existing
            && !ours(existing.labels())
        {
            return Err(format!(
                "ServiceImport {ns}/{name} exists and was not created by Strait (no label {}={}): left alone; delete it to let Strait manage it",
                MANAGED_BY.0, MANAGED_BY.1
            ));
        }
        let derived = derived_name(ns, name);
        let derived_service = self
            .local
            .services
            .get(&ObjectRef::new(&derived).within(ns));
        let (ips, families) = match (&r.service.type_, &derived_service) {
            (ServiceImportType::ClusterSetIP, Some(svc)) => {
                let spec = svc.spec.clone().unwrap_or_default();
                (
                    spec.cluster_ips.unwrap_or_default(),
                    spec.ip_families.unwrap_or_default(),
                )
            }
            // Headless: no IP, but the families its endpoints may have.
            (ServiceImportType::Headless, _) => (Vec::new(), r.service.ip_families.clone()),
            _ => (Vec::new(), Vec::new()),
        };
        let mut labels: BTreeMap<String, String> = r.labels.clone();
        labels.insert(MANAGED_BY.0.into(), MANAGED_BY.1.into());
        let mut spec = json!({
            "type": r.service.type_,
            "ports": r.service.ports,
        });
        let s = &r.service;
        let set = |spec: &mut serde_json::Value, k: &str, v: serde_json::Value| {
            if !v.is_null() {
                spec[k] = v;
            }
        };
        set(&mut spec, "sessionAffinity", json!(s.session_affinity));
        set(
            &mut spec,
            "sessionAffinityConfig",
            json!(s.session_affinity_config),
        );
        set(
            &mut spec,
            "internalTrafficPolicy",
            json!(s.internal_traffic_policy),
        );
        set(
            &mut spec,
            "trafficDistribution",
            json!(s.traffic_distribution),
        );
        if !ips.is_empty() {
            spec["ips"] = json!(ips);
        }
        if !families.is_empty() {
            spec["ipFamilies"] = json!(families);
        }
        let desired = json!({
            "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
            "metadata": {"name": name, "namespace": ns, "labels": labels, "annotations": r.annotations},
            "spec": spec,
        });
        let up_to_date = existing.as_ref().is_some_and(|e| {
            serde_json::to_value(&e.spec.spec).ok().as_ref() == Some(&desired["spec"])
                && labels.iter().all(|(k, v)| e.labels().get(k) == Some(v))
                && r.annotations
                    .iter()
                    .all(|(k, v)| e.annotations().get(k) == Some(v))
        });
        let import = if up_to_date {
            existing.clone().expect("checked")
        } else {
            Arc::new(
                api.patch(
                    name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&desired),
                )
                .await
                .map_err(|e| format!("writing ServiceImport {ns}/{name}: {e}"))?,
            )
        };
        // Status: the clusters that back it.
        let clusters: Vec<_> = r.clusters.iter().map(|c| json!({"cluster": c})).collect();
        let current: Vec<String> = import
            .status
            .as_ref()
            .map(|s| s.clusters.iter().map(|c| c.cluster.clone()).collect())
            .unwrap_or_default();
        if current != r.clusters {
            api.patch_status(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(json!({
                    "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
                    "metadata": {"name": name, "namespace": ns},
                    "status": {"clusters": clusters},
                })),
            )
            .await
            .map_err(|e| format!("writing the status of ServiceImport {ns}/{name}: {e}"))?;
        }
        // The derived Service: the ClusterSetIP.
        let services: Api<Service> = Api::namespaced(self.client.clone(), ns);
        if let Some(svc) = &derived_service
            && !ours(svc.labels())
        {
            return Err(format!(
                "Service {ns}/{derived} (this import's ClusterSetIP) exists and was not created by Strait (no label {}={}): left alone; delete it to let Strait manage it",
                MANAGED_BY.0, MANAGED_BY.1
            ));
        }
        if r.service.type_ == ServiceImportType::Headless {
            if let Some(svc) = &derived_service {
                match services.delete(&derived, &only_this(svc.as_ref())).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(format!("deleting Service {ns}/{derived}: {e}")),
                }
            }
            return Ok(());
        }
        let ports: Vec<_> = r
            .service
            .ports
            .iter()
            .map(|p| {
                let mut port = json!({"name": p.name, "port": p.port, "protocol": p.protocol});
                if let Some(a) = &p.app_protocol {
                    port["appProtocol"] = json!(a);
                }
                port
            })
            .collect();
        let wanted_ports = json!(ports);
        let affinity = r.service.affinity.unwrap_or_default().as_str();
        let derived_up_to_date = derived_service.as_ref().is_some_and(|svc| {
            let have: Vec<_> = svc
                .spec
                .as_ref()
                .and_then(|s| s.ports.clone())
                .unwrap_or_default()
                .into_iter()
                .map(|p| {
                    let mut port = json!({"name": p.name.unwrap_or_default(), "port": p.port, "protocol": p.protocol});
                    if let Some(a) = p.app_protocol {
                        port["appProtocol"] = json!(a);
                    }
                    port
                })
                .collect();
            json!(have) == wanted_ports
                && svc.annotations().get(AFFINITY_ANNOTATION).map(String::as_str) == Some(affinity)
        });
        if !derived_up_to_date {
            let owner = json!({
                "apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
                "name": name, "uid": import.uid().unwrap_or_default(),
                "controller": true, "blockOwnerDeletion": false,
            });
            let svc = services
                .patch(
                    &derived,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(json!({
                        "apiVersion": "v1", "kind": "Service",
                        "metadata": {"name": derived, "namespace": ns,
                                     "labels": {MANAGED_BY.0: MANAGED_BY.1, LABEL_SERVICE_NAME: name},
                                     "annotations": {AFFINITY_ANNOTATION: affinity},
                                     "ownerReferences": [owner]},
                        "spec": {"type": "ClusterIP", "ports": wanted_ports},
                    })),
                )
                .await
                .map_err(|e| format!("writing Service {ns}/{derived} (the ClusterSetIP): {e}"))?;
            // The IPs now, not at the next pass.
            let spec = svc.spec.unwrap_or_default();
            let ips = spec.cluster_ips.unwrap_or_default();
            if !ips.is_empty() && derived_service.is_none() {
                let mut desired = desired.clone();
                desired["spec"]["ips"] = json!(ips);
                desired["spec"]["ipFamilies"] = json!(spec.ip_families.unwrap_or_default());
                api.patch(
                    name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&desired),
                )
                .await
                .map_err(|e| format!("writing the IPs of ServiceImport {ns}/{name}: {e}"))?;
            }
        }
        Ok(())
    }

    /// The import's slices, one per source cluster, where they differ: for a
    /// ClusterSetIP, its derived Service's (this cluster's pods, the other
    /// clusters' gateways); for a Headless import, each source cluster's own
    /// endpoints (owned by the ServiceImport: there is no derived Service),
    /// which cluster DNS answers for the import's names.
    async fn write_slices(&self, key: &Key, r: &Resolved, snap: &Snapshot) -> Written {
        let (ns, name) = key;
        let derived = derived_name(ns, name);
        let headless = r.service.type_ == ServiceImportType::Headless;
        let api: Api<EndpointSlice> = Api::namespaced(self.client.clone(), ns);
        let owner = if headless {
            self.local
                .imports
                .get(&ObjectRef::new(name).within(ns))
                .and_then(|import| import.uid())
                .map(|uid| {
                    json!([{"apiVersion": "multicluster.x-k8s.io/v1beta1", "kind": "ServiceImport",
                            "name": name, "uid": uid, "controller": true, "blockOwnerDeletion": false}])
                })
        } else {
            self.local
                .services
                .get(&ObjectRef::new(&derived).within(ns))
                .and_then(|svc| svc.uid())
                .map(|uid| {
                    json!([{"apiVersion": "v1", "kind": "Service", "name": derived, "uid": uid,
                                   "controller": true, "blockOwnerDeletion": false}])
                })
        };
        let Some(owner) = owner else {
            return Ok(()); // the import or derived Service is new: the next pass writes them
        };
        let not_ours = |s: &Arc<EndpointSlice>| {
            s.labels()
                .get(crate::mirror::MANAGED_BY_LABEL)
                .map(String::as_str)
                != Some(slices::MANAGED_BY)
        };
        let slices_of = |store: &Store<EndpointSlice>, svc: &str| -> Vec<Arc<EndpointSlice>> {
            store
                .state()
                .into_iter()
                .filter(|s| {
                    s.namespace().as_deref() == Some(ns.as_str())
                        && s.labels()
                            .get(crate::mirror::SERVICE_NAME_LABEL)
                            .map(String::as_str)
                            == Some(svc)
                        && not_ours(s)
                })
                .collect()
        };
        let remote_slices_of =
            |store: &ExportedSlices, svc: &str| -> Option<Vec<Arc<EndpointSlice>>> {
                let mut theirs = store.known_slices(ns, svc)?;
                theirs.retain(not_ours);
                Some(theirs)
            };
        for cluster in &r.clusters {
            let desired = if headless {
                let theirs = if *cluster == self.cluster {
                    slices_of(&self.local.slices, name)
                } else if let Some((_, Some(store))) = snap.remotes.get(cluster)
                    && let Some(theirs) = remote_slices_of(store, name)
                {
                    theirs
                } else {
                    continue; // not known yet: what was written stays
                };
                let theirs: Vec<&EndpointSlice> = theirs.iter().map(|s| s.as_ref()).collect();
                slices::headless_slice(ns, name, &derived, cluster, &theirs)
            } else if *cluster == self.cluster {
                let own = slices_of(&self.local.slices, name);
                let own: Vec<&EndpointSlice> = own.iter().map(|s| s.as_ref()).collect();
                slices::local_slice(ns, name, &derived, cluster, &own)
            } else if let Some((view, remote_slices)) = snap.remotes.get(cluster) {
                let ready = match remote_slices
                    .as_ref()
                    .map(|store| remote_slices_of(store, name))
                {
                    Some(None) => continue, // its slices are being listed: written once they are
                    Some(Some(theirs)) => Some(slices::ready_count(
                        &theirs.iter().map(|s| s.as_ref()).collect::<Vec<_>>(),
                    )),
                    None => None,
                };
                slices::remote_slice(ns, name, &derived, view, &r.service.ports, ready)
            } else {
                continue;
            };
            let slice_name = desired.metadata.name.clone().unwrap_or_default();
            let current = self
                .local
                .slices
                .get(&ObjectRef::new(&slice_name).within(ns));
            let same = current.as_ref().is_some_and(|c| {
                c.endpoints == desired.endpoints
                    && c.ports == desired.ports
                    && c.labels().get(crate::mirror::SERVICE_NAME_LABEL)
                        == desired.labels().get(crate::mirror::SERVICE_NAME_LABEL)
                    && desired
                        .metadata
                        .annotations
                        .iter()
                        .flatten()
                        .all(|(k, v)| c.annotations().get(k) == Some(v))
            });
            if same {
                continue;
            }
            if let Some(c) = &current
                && c.labels()
                    .get(crate::mirror::MANAGED_BY_LABEL)
                    .map(String::as_str)
                    != Some(slices::MANAGED_BY)
            {
                return Err(format!(
                    "EndpointSlice {ns}/{slice_name} exists and was not created by Strait (no label {}={}): left alone; delete it to let Strait manage it",
                    crate::mirror::MANAGED_BY_LABEL,
                    slices::MANAGED_BY
                ));
            }
            let mut body = serde_json::to_value(&desired).map_err(|e| e.to_string())?;
            body["apiVersion"] = json!("discovery.k8s.io/v1");
            body["kind"] = json!("EndpointSlice");
            body["metadata"]["ownerReferences"] = owner.clone();
            api.patch(
                &slice_name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(body),
            )
            .await
            .map_err(|e| format!("writing EndpointSlice {ns}/{slice_name}: {e}"))?;
        }
        Ok(())
    }

    /// The export's conditions, written only when one changed.
    async fn set_conditions(
        &self,
        export: &ServiceExport,
        validity: &Validity,
        import: Option<&(Resolved, Written)>,
    ) -> kube::Result<()> {
        let (ns, name) = (export.namespace().unwrap_or_default(), export.name_any());
        let mut wanted: Vec<(&str, String, String, String)> = Vec::new();
        let (status, reason, message) = validity.condition(&ns, &name);
        wanted.push(("Valid", status.into(), reason.into(), message));
        match (validity, import) {
            (Validity::Valid(_), Some((resolved, written))) => {
                let (status, reason, message) = resolved.conflict_condition();
                wanted.push(("Conflict", status.into(), reason, message));
                match written {
                    Ok(()) if resolved.clusters.contains(&self.cluster) => wanted.push((
                        "Ready",
                        "True".into(),
                        "Ready".into(),
                        format!(
                            "ServiceImport {ns}/{name} written; clusters that link to this one import it"
                        ),
                    )),
                    Ok(()) => wanted.push((
                        "Ready",
                        "False".into(),
                        "Failed".into(),
                        "this export conflicts with the oldest one and is not served (see Conflict)".into(),
                    )),
                    Err(e) => wanted.push(("Ready", "False".into(), "Failed".into(), e.clone())),
                }
            }
            (Validity::Valid(_), None) => wanted.push((
                "Ready",
                "Unknown".into(),
                "Pending".into(),
                "being exported".into(),
            )),
            _ => wanted.push((
                "Ready",
                "False".into(),
                "Failed".into(),
                "not exported: see the Valid condition".into(),
            )),
        }
        let current = export
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default();
        let summary = |c: &Condition| {
            (
                c.type_.clone(),
                c.status.clone(),
                c.reason.clone(),
                c.message.clone(),
            )
        };
        let mut have: Vec<_> = current.iter().map(summary).collect();
        let mut want: Vec<_> = wanted
            .iter()
            .map(|w| (w.0.to_string(), w.1.clone(), w.2.clone(), w.3.clone()))
            .collect();
        have.sort();
        want.sort();
        if have == want {
            return Ok(());
        }
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let generation = export.metadata.generation;
        let conditions: Vec<Condition> = wanted
            .iter()
            .map(|w| {
                // The transition time moves only when the status does.
                let since = current
                    .iter()
                    .find(|c| c.type_ == w.0 && c.status == w.1)
                    .map(|c| c.last_transition_time.clone())
                    .unwrap_or_else(|| now.clone());
                Condition {
                    type_: w.0.into(),
                    status: w.1.clone(),
                    reason: w.2.clone(),
                    message: w.3.clone(),
                    last_transition_time: since,
                    observed_generation: generation,
                }
            })
            .collect();
        Api::<ServiceExport>::namespaced(self.client.clone(), &ns)
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"conditions": conditions}})),
            )
            .await?;
        // An Event for each condition that changed (what `kubectl describe`
        // and `kubectl get events` show beside the status).
        for c in &conditions {
            let before = current.iter().find(|p| p.type_ == c.type_);
            if before.is_some_and(|p| p.status == c.status && p.reason == c.reason) {
                continue;
            }
            let event = Event {
                type_: condition_event_type(c),
                reason: c.reason.chars().take(128).collect(),
                note: Some(
                    format!("{}={}: {}", c.type_, c.status, c.message)
                        .chars()
                        .take(1000)
                        .collect(),
                ),
                action: "Export".into(),
                secondary: None,
            };
            if let Err(e) = self.recorder.publish(&event, &export.object_ref(&())).await {
                tracing::debug!(export = %format!("{ns}/{name}"), "publishing an Event failed: {e}");
            }
        }
        Ok(())
    }
}

/// A condition that needs someone's attention is a Warning.
fn condition_event_type(c: &Condition) -> EventType {
    match (c.type_.as_str(), c.status.as_str()) {
        ("Valid", "False") | ("Conflict", "True") | ("Ready", "False") => EventType::Warning,
        _ => EventType::Normal,
    }
}

/// Deletes only the version looked at: an object replaced meanwhile (by a
/// user, say) is not deleted (uid and resourceVersion preconditions).
fn only_this<K: Resource>(object: &K) -> DeleteParams {
    DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: object.meta().uid.clone(),
            resource_version: object.meta().resource_version.clone(),
        }),
        ..DeleteParams::default()
    }
}

fn ours(labels: &BTreeMap<String, String>) -> bool {
    labels.get(MANAGED_BY.0).map(String::as_str) == Some(MANAGED_BY.1)
}

fn created(export: &ServiceExport) -> i64 {
    export
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
        .unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_names_are_stable_dns_labels() {
        let a = derived_name("shop", "web");
        assert_eq!(a, derived_name("shop", "web"));
        assert_ne!(a, derived_name("shop", "web2"));
        assert!(a.len() <= 63 && a.starts_with("derived-"), "{a}");
        assert!(
            a.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
        // Pinned: a new derivation would orphan every derived Service.
        assert_eq!(a, "derived-1b2ce43c8d2a78c4");
    }
}
