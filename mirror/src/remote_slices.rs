//! The remote cluster's EndpointSlices of exported Services only: what a
//! Link's worker and the MCS controller read, and nothing else of the remote.
//!
//! One cluster-wide watch of slices (one connection, whatever the number of
//! exports) whose events are kept only when their Service is exported there:
//! selected by the Link's label selector, or named by a ServiceExport. When a
//! Service becomes exported its slices, dropped until then, are fetched with
//! one label-selected list (`kubernetes.io/service-name=<name>`); when it stops
//! being exported they are dropped. Kept slices are trimmed to the fields the
//! mirrors are built from.
//!
//! A list and the watch race: a list may answer older or newer than what the
//! watch already delivered. Resource versions decide (comparable integers
//! within a resource type since Kubernetes 1.35, KEP-5504): a slice is replaced
//! only by a newer version, and a deletion seen while a list is in flight is
//! remembered so the list cannot bring the slice back.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Service};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::ListParams;
use kube::runtime::reflector::Store;
use kube::runtime::watcher::Event;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use strait_mesh::mcs::ServiceExport;
use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tokio::task::JoinSet;

use crate::mirror::{MANAGED_BY_LABEL, SERVICE_NAME_LABEL};

/// A namespaced object's (namespace, name).
pub type Key = (String, String);

/// How many label-selected lists run at once (a burst of exports must not
/// open a thousand requests to the remote API server).
const LIST_CONCURRENCY: usize = 8;

/// The slices of the remote's exported Services, by Service. Cheap to clone
/// (shared); an empty one (`default`) follows nothing and is never ready.
#[derive(Clone)]
pub struct ExportedSlices {
    inner: Arc<RwLock<Slices>>,
    ready: watch::Receiver<bool>,
}

impl Default for ExportedSlices {
    fn default() -> Self {
        let (_, ready) = watch::channel(false);
        ExportedSlices {
            inner: Arc::default(),
            ready,
        }
    }
}

impl std::fmt::Debug for ExportedSlices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportedSlices")
            .field("slices", &self.len())
            .finish()
    }
}

impl ExportedSlices {
    /// The slices of Service `ns/name` (none when it is not exported).
    pub fn of_service(&self, ns: &str, name: &str) -> Vec<Arc<EndpointSlice>> {
        let inner = self.inner.read().expect("slices lock");
        inner
            .by_service
            .get(&(ns.to_string(), name.to_string()))
            .map(|s| s.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Every exported Service's slices, and which Services' are known, as
    /// of one moment.
    pub fn snapshot(&self) -> SlicesSnapshot {
        let inner = self.inner.read().expect("slices lock");
        SlicesSnapshot {
            by_service: inner
                .by_service
                .iter()
                .map(|(k, s)| (k.clone(), s.values().cloned().collect()))
                .collect(),
            exported: inner.exported.clone(),
            listing: inner.listing.clone(),
        }
    }

    /// The slices of Service `ns/name` when they are known: `None` while it
    /// is not yet followed as exported, or was just exported and its slices
    /// are being listed (a mirror written now would be written again when
    /// they come).
    pub fn known_slices(&self, ns: &str, name: &str) -> Option<Vec<Arc<EndpointSlice>>> {
        let inner = self.inner.read().expect("slices lock");
        let key = (ns.to_string(), name.to_string());
        if !inner.exported.contains(&key) || inner.listing.contains(&key) {
            return None;
        }
        Some(
            inner
                .by_service
                .get(&key)
                .map(|s| s.values().cloned().collect())
                .unwrap_or_default(),
        )
    }

    /// How many slices are held.
    pub fn len(&self) -> usize {
        self.inner.read().expect("slices lock").service_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves once the first full list of the remote's slices is in.
    pub async fn wait_until_ready(&self) {
        let mut ready = self.ready.clone();
        // An error means the follower ended: nothing will come.
        if ready.wait_for(|r| *r).await.is_err() {
            futures::future::pending::<()>().await;
        }
    }

    /// Follows the remote's slices of what `exported` names, until the
    /// returned tasks are dropped. `exported_changed` must be woken when
    /// `exported` changes; `changed` is woken when the slices held change;
    /// each watch event's outcome goes to `health`.
    pub fn follow(
        remote: &Client,
        exported: Exported,
        exported_changed: Arc<Notify>,
        changed: Arc<Notify>,
        health: mpsc::Sender<Result<(), String>>,
    ) -> (Self, JoinSet<()>) {
        let (ready_tx, ready) = watch::channel(false);
        let slices = ExportedSlices {
            inner: Arc::default(),
            ready,
        };
        let follower = Follower {
            cache: Cache::new(slices.inner.clone()),
            api: Api::all(remote.clone()),
            exported,
            changed,
            health,
            ready: ready_tx,
        };
        let mut tasks = JoinSet::new();
        tasks.spawn(follower.run(exported_changed));
        (slices, tasks)
    }
}

/// [`ExportedSlices`] at one moment.
pub struct SlicesSnapshot {
    by_service: BTreeMap<Key, Vec<Arc<EndpointSlice>>>,
    exported: HashSet<Key>,
    listing: HashSet<Key>,
}

impl SlicesSnapshot {
    /// The Service's slices when they are known (see [`ExportedSlices::known_slices`]).
    pub fn of(&self, service: &Key) -> Option<&[Arc<EndpointSlice>]> {
        if !self.exported.contains(service) || self.listing.contains(service) {
            return None;
        }
        Some(self.by_service.get(service).map_or(&[][..], Vec::as_slice))
    }
}

/// What is exported in the remote: its Services matching the Link's selector,
/// and (with the MCS API) its ServiceExports.
#[derive(Clone)]
pub struct Exported {
    pub services: Store<Service>,
    pub exports: Option<Store<ServiceExport>>,
}

impl Exported {
    fn keys(&self) -> HashSet<Key> {
        let services = self.services.state().into_iter().map(|s| key_of(&*s));
        let exports = self.exports.iter().flat_map(|e| e.state());
        services
            .chain(exports.map(|e| key_of(&*e)))
            .collect::<HashSet<_>>()
    }

    /// Waits for the Services' first list (and briefly for the exports': a
    /// remote without the MCS API never lists them), so the first list of
    /// slices is filtered by what is really exported. Polled:
    /// `Store::wait_until_ready` wakes only the last of several waiters.
    async fn listed(&self) {
        let since = tokio::time::Instant::now();
        loop {
            let exports = self.exports.as_ref().is_none_or(is_listed)
                || since.elapsed() > Duration::from_secs(5);
            if is_listed(&self.services) && exports {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn is_listed<K>(store: &Store<K>) -> bool
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    futures::FutureExt::now_or_never(store.wait_until_ready()).is_some_and(|r| r.is_ok())
}

fn key_of<K: ResourceExt>(object: &K) -> Key {
    (object.namespace().unwrap_or_default(), object.name_any())
}

/// The Service a slice belongs to.
fn service_of(slice: &EndpointSlice) -> Option<Key> {
    Some((
        slice.namespace()?,
        slice.labels().get(SERVICE_NAME_LABEL)?.clone(),
    ))
}

/// A resource version as the integer it is (KEP-5504); one that is not
/// (an old or unusual server) reads as 0: never newer than what is held.
fn version(object: &impl ResourceExt) -> u64 {
    object
        .resource_version()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A slice reduced to what mirrors are built from: the endpoints' addresses,
/// conditions, hostname, node, zone and pod; ports; two labels.
pub fn trim(slice: EndpointSlice) -> EndpointSlice {
    let meta = slice.metadata;
    let labels = meta.labels.map(|mut l| {
        l.retain(|k, _| k == SERVICE_NAME_LABEL || k == MANAGED_BY_LABEL);
        l
    });
    EndpointSlice {
        metadata: ObjectMeta {
            name: meta.name,
            namespace: meta.namespace,
            resource_version: meta.resource_version,
            labels,
            ..Default::default()
        },
        address_type: slice.address_type,
        endpoints: slice.endpoints.map(|endpoints| {
            endpoints
                .into_iter()
                .map(|e| Endpoint {
                    addresses: e.addresses,
                    conditions: e.conditions,
                    hostname: e.hostname,
                    node_name: e.node_name,
                    zone: e.zone,
                    target_ref: e.target_ref.map(|r| ObjectReference {
                        kind: r.kind,
                        name: r.name,
                        namespace: r.namespace,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect()
        }),
        ports: slice.ports,
    }
}

/// What readers see.
#[derive(Default)]
struct Slices {
    by_service: HashMap<Key, BTreeMap<String, Arc<EndpointSlice>>>,
    /// Slice key → its Service (a slice may move, or be deleted by name).
    service_of: HashMap<Key, Key>,
    /// The exported Services followed, and those whose slices are being listed.
    exported: HashSet<Key>,
    listing: HashSet<Key>,
}

impl Slices {
    fn get(&self, slice: &Key) -> Option<&Arc<EndpointSlice>> {
        let service = self.service_of.get(slice)?;
        self.by_service.get(service)?.get(&slice.1)
    }

    fn remove(&mut self, slice: &Key) -> bool {
        let Some(service) = self.service_of.remove(slice) else {
            return false;
        };
        if let Some(s) = self.by_service.get_mut(&service) {
            s.remove(&slice.1);
            if s.is_empty() {
                self.by_service.remove(&service);
            }
        }
        true
    }

    fn insert(&mut self, service: Key, slice: EndpointSlice) {
        let key = key_of(&slice);
        self.remove(&key);
        self.service_of.insert(key.clone(), service.clone());
        self.by_service
            .entry(service)
            .or_default()
            .insert(key.1, Arc::new(slice));
    }

    fn drop_service(&mut self, service: &Key) -> bool {
        let Some(slices) = self.by_service.remove(service) else {
            return false;
        };
        for name in slices.keys() {
            self.service_of.remove(&(service.0.clone(), name.clone()));
        }
        true
    }
}

/// The filtering cache: watch events, list answers and changes of what is
/// exported go in; [`Slices`] comes out. No I/O, so its races are unit-tested.
struct Cache {
    shared: Arc<RwLock<Slices>>,
    /// Services whose slices are kept.
    exported: HashSet<Key>,
    /// Services with lists in flight: how many, and the slices deleted
    /// meanwhile (name → version of the deletion).
    pending: HashMap<Key, (usize, HashMap<String, u64>)>,
    /// During a relist: what was exported when it began, and the slices seen.
    relist: Option<(HashSet<Key>, HashSet<Key>)>,
}

impl Cache {
    fn new(shared: Arc<RwLock<Slices>>) -> Self {
        Cache {
            shared,
            exported: HashSet::new(),
            pending: HashMap::new(),
            relist: None,
        }
    }

    /// What is exported now; returns the Services newly exported (to list).
    /// True in the second field when held slices were dropped.
    fn set_exported(&mut self, now: HashSet<Key>) -> (Vec<Key>, bool) {
        let mut dropped = false;
        {
            let mut shared = self.shared.write().expect("slices lock");
            for gone in self.exported.difference(&now) {
                dropped |= shared.drop_service(gone);
            }
        }
        let added: Vec<Key> = now.difference(&self.exported).cloned().collect();
        {
            let mut shared = self.shared.write().expect("slices lock");
            for service in &added {
                self.pending.entry(service.clone()).or_default().0 += 1;
                shared.listing.insert(service.clone());
            }
            shared.listing.retain(|s| now.contains(s));
            shared.exported = now.clone();
        }
        self.exported = now;
        (added, dropped)
    }

    /// A watch event; true when the slices held changed.
    fn on_event(&mut self, event: Event<EndpointSlice>) -> bool {
        match event {
            Event::Init => {
                self.relist = Some((self.exported.clone(), HashSet::new()));
                false
            }
            Event::InitApply(slice) => {
                if let Some((_, seen)) = &mut self.relist {
                    seen.insert(key_of(&slice));
                }
                self.apply(slice, None)
            }
            Event::InitDone => {
                let Some((exported, seen)) = self.relist.take() else {
                    return false;
                };
                let mut shared = self.shared.write().expect("slices lock");
                let gone: Vec<Key> = shared
                    .service_of
                    .iter()
                    .filter(|(slice, service)| {
                        !seen.contains(*slice) && exported.contains(*service)
                    })
                    .map(|(slice, _)| slice.clone())
                    .collect();
                for slice in &gone {
                    shared.remove(slice);
                }
                !gone.is_empty()
            }
            Event::Apply(slice) => self.apply(slice, None),
            Event::Delete(slice) => {
                let key = key_of(&slice);
                if let Some(service) = service_of(&slice)
                    && let Some((_, deleted)) = self.pending.get_mut(&service)
                {
                    let v = deleted.entry(key.1.clone()).or_default();
                    *v = (*v).max(version(&slice));
                }
                self.shared.write().expect("slices lock").remove(&key)
            }
        }
    }

    /// A label-selected list of `service`'s slices answered at version
    /// `at`; true when the slices held changed, or the Service's are known
    /// now (even none: its mirror can be written).
    fn on_listed(&mut self, service: &Key, at: u64, items: Vec<EndpointSlice>) -> bool {
        let deleted = match self.pending.get_mut(service) {
            Some((n, deleted)) => {
                *n -= 1;
                if *n == 0 {
                    self.shared
                        .write()
                        .expect("slices lock")
                        .listing
                        .remove(service);
                    self.pending
                        .remove(service)
                        .map(|p| p.1)
                        .unwrap_or_default()
                } else {
                    deleted.clone()
                }
            }
            None => HashMap::new(),
        };
        if !self.exported.contains(service) {
            return false;
        }
        let listed: HashSet<String> = items.iter().map(|s| s.name_any()).collect();
        let mut changed = !self.pending.contains_key(service);
        for slice in items {
            changed |= self.apply(slice, Some(&deleted));
        }
        // Held but not in the list: gone by `at`, unless the watch brought a
        // newer one.
        let mut shared = self.shared.write().expect("slices lock");
        let stale: Vec<Key> = shared
            .by_service
            .get(service)
            .into_iter()
            .flat_map(|s| s.iter())
            .filter(|(name, s)| !listed.contains(*name) && version(s.as_ref()) <= at)
            .map(|(name, _)| (service.0.clone(), name.clone()))
            .collect();
        for slice in &stale {
            changed |= shared.remove(slice);
        }
        changed
    }

    /// Keeps `slice` when its Service is exported and it is newer than what
    /// is held (and, from a list, not deleted since: `deleted`).
    fn apply(&mut self, slice: EndpointSlice, deleted: Option<&HashMap<String, u64>>) -> bool {
        let key = key_of(&slice);
        let mut shared = self.shared.write().expect("slices lock");
        let Some(service) = service_of(&slice).filter(|s| self.exported.contains(s)) else {
            // Not (or no longer) an exported Service's.
            return shared.remove(&key);
        };
        let v = version(&slice);
        if deleted.and_then(|d| d.get(&key.1)).is_some_and(|d| *d >= v) {
            return false;
        }
        if shared
            .get(&key)
            .is_some_and(|held| version(held.as_ref()) >= v)
        {
            return false;
        }
        shared.insert(service, trim(slice));
        true
    }
}

/// The task behind [`ExportedSlices::follow`].
struct Follower {
    cache: Cache,
    api: Api<EndpointSlice>,
    exported: Exported,
    changed: Arc<Notify>,
    health: mpsc::Sender<Result<(), String>>,
    ready: watch::Sender<bool>,
}

impl Follower {
    async fn run(mut self, exported_changed: Arc<Notify>) {
        self.exported.listed().await;
        let lists = Arc::new(Semaphore::new(LIST_CONCURRENCY));
        let mut listing: JoinSet<(Key, u64, Vec<EndpointSlice>)> = JoinSet::new();
        let (added, _) = self.cache.set_exported(self.exported.keys());
        // Before the first list of slices: those are filtered, not listed one by one.
        for service in added {
            self.cache.pending.remove(&service);
        }
        self.cache
            .shared
            .write()
            .expect("slices lock")
            .listing
            .clear();
        let mut events = watcher(
            self.api.clone(),
            watcher::Config::default().labels(SERVICE_NAME_LABEL),
        )
        .default_backoff()
        .boxed();
        loop {
            let changed = tokio::select! {
                event = events.next() => {
                    let Some(event) = event else { return };
                    let _ = self.health.try_send(event.as_ref().map(|_| ()).map_err(|e| e.to_string()));
                    match event {
                        Ok(event) => {
                            let done = matches!(event, Event::InitDone);
                            let changed = self.cache.on_event(event);
                            if done {
                                self.ready.send_replace(true);
                            }
                            changed
                        }
                        Err(_) => false,
                    }
                }
                _ = exported_changed.notified() => {
                    let (added, dropped) = self.cache.set_exported(self.exported.keys());
                    for service in added {
                        listing.spawn(list(self.api.clone(), service, lists.clone()));
                    }
                    dropped
                }
                Some(Ok((service, at, items))) = listing.join_next() => {
                    self.cache.on_listed(&service, at, items)
                }
            };
            if changed {
                self.changed.notify_one();
            }
        }
    }
}

/// Lists `service`'s slices (retrying until it succeeds): its version and items.
async fn list(
    api: Api<EndpointSlice>,
    service: Key,
    permits: Arc<Semaphore>,
) -> (Key, u64, Vec<EndpointSlice>) {
    let api = Api::<EndpointSlice>::namespaced(api.into_client(), &service.0);
    let params = ListParams::default().labels(&format!("{SERVICE_NAME_LABEL}={}", service.1));
    let mut backoff = Duration::from_millis(200);
    loop {
        let answer = {
            let _permit = permits.acquire().await;
            api.list(&params).await
        };
        match answer {
            Ok(list) => {
                let at = list
                    .metadata
                    .resource_version
                    .as_deref()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                return (service, at, list.items);
            }
            Err(e) => {
                tracing::debug!(service = %format!("{}/{}", service.0, service.1), "listing its remote slices: {e}; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(svc: &str, name: &str, rv: u64, ready: bool) -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "resourceVersion": rv.to_string(),
                         "labels": {SERVICE_NAME_LABEL: svc, "app": "x"},
                         "annotations": {"a": "b"},
                         "managedFields": [{"manager": "kube-controller-manager"}]},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": ready},
                           "hints": {"forZones": [{"name": "a"}]}}],
        }))
        .unwrap()
    }

    fn key(name: &str) -> Key {
        ("ns".into(), name.into())
    }

    fn exported(names: &[&str]) -> HashSet<Key> {
        names.iter().map(|n| key(n)).collect()
    }

    fn held(cache: &Cache) -> Vec<(String, String)> {
        let shared = cache.shared.read().unwrap();
        let mut v: Vec<_> = shared
            .by_service
            .iter()
            .flat_map(|(svc, s)| {
                s.values().map(|s| {
                    (
                        svc.1.clone(),
                        format!("{}@{}", s.name_any(), version(s.as_ref())),
                    )
                })
            })
            .collect();
        v.sort();
        v
    }

    fn cache(names: &[&str]) -> Cache {
        let mut c = Cache::new(Arc::default());
        let (added, _) = c.set_exported(exported(names));
        for s in added {
            c.pending.remove(&s);
        }
        c.shared.write().unwrap().listing.clear();
        c
    }

    #[test]
    fn only_exported_services_slices_are_kept_and_trimmed() {
        let mut c = cache(&["web"]);
        assert!(c.on_event(Event::Apply(slice("web", "web-1", 5, true))));
        assert!(!c.on_event(Event::Apply(slice("noise", "noise-1", 6, true))));
        assert_eq!(held(&c), vec![("web".into(), "web-1@5".into())]);
        let kept = c
            .shared
            .read()
            .unwrap()
            .get(&key("web-1"))
            .cloned()
            .unwrap();
        assert!(kept.metadata.managed_fields.is_none());
        assert!(kept.metadata.annotations.is_none());
        assert_eq!(kept.labels().len(), 1, "only the service-name label");
        assert!(kept.endpoints.as_ref().unwrap()[0].hints.is_none());
    }

    #[test]
    fn a_service_exported_later_is_listed_and_unexporting_drops_its_slices() {
        let mut c = cache(&["web"]);
        c.on_event(Event::Apply(slice("api", "api-1", 3, true)));
        assert!(held(&c).is_empty());
        let (added, _) = c.set_exported(exported(&["web", "api"]));
        assert_eq!(added, vec![key("api")]);
        assert!(c.shared.read().unwrap().listing.contains(&key("api")));
        let reader = ExportedSlices {
            inner: c.shared.clone(),
            ready: watch::channel(true).1,
        };
        assert!(reader.known_slices("ns", "api").is_none());
        assert_eq!(reader.known_slices("ns", "web").map(|s| s.len()), Some(0));
        assert!(reader.known_slices("ns", "other").is_none(), "not followed");
        assert!(c.on_listed(&key("api"), 10, vec![slice("api", "api-1", 3, true)]));
        assert_eq!(
            reader.snapshot().of(&key("api")).map(|s| s.len()),
            Some(1),
            "listed: known now"
        );
        assert_eq!(held(&c), vec![("api".into(), "api-1@3".into())]);
        assert!(c.pending.is_empty());
        let (added, dropped) = c.set_exported(exported(&["web"]));
        assert!(added.is_empty() && dropped);
        assert!(held(&c).is_empty());
        // Its later events are dropped again.
        assert!(!c.on_event(Event::Apply(slice("api", "api-1", 12, true))));
    }

    #[test]
    fn a_list_older_than_the_watch_does_not_undo_it() {
        let mut c = cache(&[]);
        c.set_exported(exported(&["api"]));
        // The watch is ahead of the list: a newer version, then a deletion.
        c.on_event(Event::Apply(slice("api", "api-1", 20, false)));
        c.on_event(Event::Delete(slice("api", "api-2", 21, true)));
        let listed = vec![
            slice("api", "api-1", 15, true),
            slice("api", "api-2", 16, true),
        ];
        c.on_listed(&key("api"), 18, listed);
        assert_eq!(held(&c), vec![("api".into(), "api-1@20".into())]);
    }

    #[test]
    fn a_list_newer_than_the_watch_wins_and_removes_what_it_lacks() {
        let mut c = cache(&["api"]);
        c.on_event(Event::Apply(slice("api", "api-1", 5, true)));
        c.on_event(Event::Apply(slice("api", "old", 6, true)));
        // Unexported and exported again: the list is ahead of the watch.
        c.set_exported(exported(&[]));
        c.set_exported(exported(&["api"]));
        c.on_event(Event::Apply(slice("api", "api-1", 7, true)));
        c.on_event(Event::Apply(slice("api", "old", 8, true)));
        c.on_listed(&key("api"), 30, vec![slice("api", "api-1", 25, false)]);
        assert_eq!(held(&c), vec![("api".into(), "api-1@25".into())]);
        // The watch catches up with older news: ignored.
        assert!(!c.on_event(Event::Apply(slice("api", "api-1", 9, true))));
        // A slice created after the list stays.
        c.on_event(Event::Apply(slice("api", "api-3", 31, true)));
        assert_eq!(held(&c).len(), 2);
    }

    #[test]
    fn a_relist_removes_slices_deleted_meanwhile() {
        let mut c = cache(&["web"]);
        c.on_event(Event::Apply(slice("web", "web-1", 5, true)));
        c.on_event(Event::Apply(slice("web", "web-2", 6, true)));
        c.on_event(Event::Init);
        c.on_event(Event::InitApply(slice("web", "web-1", 5, true)));
        c.on_event(Event::InitApply(slice("noise", "noise-1", 9, true)));
        assert!(c.on_event(Event::InitDone));
        assert_eq!(held(&c), vec![("web".into(), "web-1@5".into())]);
    }

    #[test]
    fn a_slice_that_changes_service_moves() {
        let mut c = cache(&["a", "b"]);
        c.on_event(Event::Apply(slice("a", "s", 5, true)));
        c.on_event(Event::Apply(slice("b", "s", 6, true)));
        assert_eq!(held(&c), vec![("b".into(), "s@6".into())]);
        c.on_event(Event::Apply(slice("c", "s", 7, true)));
        assert!(held(&c).is_empty());
    }
}
