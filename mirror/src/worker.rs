//! One Link's mirroring: watch the remote cluster's exported Services and their
//! EndpointSlices, and keep the local mirrors equal to what they should be.
//!
//! Writes are server-side apply under one field manager, and only when the
//! desired object differs from what this worker last applied, so a steady
//! state makes no API writes. Remote outages keep mirrors as they are.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use strait_mesh::link::{
    CLUSTER_NAME_LABEL, Link, LinkSpec, MIRRORED_LABEL, ServiceMirrorStatus, selector_query,
};
use tokio::sync::{Notify, watch};

use crate::mirror::{self, SERVICE_NAME_LABEL};
use crate::probe::{GatewayEndpoint, GatewayProbe, ProbeSettings};
use crate::status::{LinkHealth, StatusReporter};

/// Field manager of every write.
pub const FIELD_MANAGER: &str = "strait-mirror";

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error(
        "Secret {namespace}/{name} not found: create it with `strait link … | kubectl apply -f -`"
    )]
    Missing { namespace: String, name: String },
    #[error("Secret {namespace}/{name} has no `kubeconfig` key")]
    NoKubeconfig { namespace: String, name: String },
    #[error("Secret {namespace}/{name}: kubeconfig is not valid: {message}")]
    Invalid {
        namespace: String,
        name: String,
        message: String,
    },
    #[error("reading Secret {namespace}/{name}: {source}")]
    Read {
        namespace: String,
        name: String,
        source: kube::Error,
    },
}

/// Builds a client for the remote cluster from the Link's credentials Secret.
pub async fn remote_client(local: &Client, link: &Link) -> Result<Client, CredentialsError> {
    let namespace = link.namespace().unwrap_or_default();
    let name = link.spec.cluster_credentials_secret.clone();
    let err_ctx = (namespace.clone(), name.clone());
    let secret = Api::<Secret>::namespaced(local.clone(), &namespace)
        .get_opt(&name)
        .await
        .map_err(|source| CredentialsError::Read {
            namespace: err_ctx.0.clone(),
            name: err_ctx.1.clone(),
            source,
        })?
        .ok_or_else(|| CredentialsError::Missing {
            namespace: err_ctx.0.clone(),
            name: err_ctx.1.clone(),
        })?;
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get("kubeconfig"))
        .map(|b| b.0.clone())
        .ok_or_else(|| CredentialsError::NoKubeconfig {
            namespace: err_ctx.0.clone(),
            name: err_ctx.1.clone(),
        })?;
    let invalid = |message: String| CredentialsError::Invalid {
        namespace: err_ctx.0.clone(),
        name: err_ctx.1.clone(),
        message,
    };
    let text = String::from_utf8(bytes).map_err(|e| invalid(e.to_string()))?;
    let kubeconfig =
        kube::config::Kubeconfig::from_yaml(&text).map_err(|e| invalid(e.to_string()))?;
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(|e| invalid(e.to_string()))?;
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(330));
    Client::try_from(config).map_err(|e| invalid(e.to_string()))
}

/// A Link's mirroring state between passes.
#[derive(Default)]
struct LinkState {
    applied: Applied,
    /// The remote has been silent longer than the Link's staleness TTL: all
    /// endpoints are written not ready until it answers again.
    stale: bool,
}

/// What was last applied, by (namespace, name): a hash of the object we sent.
#[derive(Default)]
struct Applied {
    services: HashMap<(String, String), u64>,
    slices: HashMap<(String, String), u64>,
    /// Cluster IPs the API server gave our per-pod mirrors.
    cluster_ips: HashMap<(String, String), String>,
}

fn hash_of<T: serde::Serialize>(value: &T) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(value)
        .unwrap_or_default()
        .hash(&mut h);
    h.finish()
}

/// Runs until `stop` fires. Restarts its watches on credential or remote errors.
pub async fn run(
    local: Client,
    local_services: crate::LocalServices,
    link: Link,
    status: StatusReporter,
    config: crate::MirrorConfig,
    mut stop: watch::Receiver<bool>,
) {
    let key = format!(
        "{}/{}",
        link.namespace().unwrap_or_default(),
        link.name_any()
    );
    let gateways = spawn_gateway_watch(&link, &status, &config, &key);
    let _gateway_tasks = AbortOnDrop(gateways.1);
    let gateways = gateways.0;
    let mut backoff = Duration::from_millis(500);
    loop {
        let outcome = tokio::select! {
            r = run_once(&local, &local_services, &link, &status, &config, gateways.clone()) => r,
            _ = stop.changed() => return,
        };
        if let Err(message) = outcome {
            tracing::warn!(link = %key, "mirroring interrupted: {message}; retrying in {backoff:?}");
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// Starts resolving and probing the Link's gateway; the receiver carries its
/// addresses and whether each is alive (`None` until first known).
fn spawn_gateway_watch(
    link: &Link,
    status: &StatusReporter,
    config: &crate::MirrorConfig,
    key: &str,
) -> (GatewayWatch, Vec<tokio::task::JoinHandle<()>>) {
    let resolver = match crate::resolve::resolver(&config.dns) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(link = %key, "{e}; gateway hostnames cannot be resolved");
            None
        }
    };
    let (addr_tx, addr_rx) = watch::channel(None);
    let (gw_tx, gw_rx) = watch::channel(None);
    let probe = GatewayProbe {
        link: key.to_string(),
        settings: ProbeSettings::from_spec(&link.spec.probe, link.spec.gateway_port),
        gateway_identity: link.spec.gateway_identity.clone(),
        identity: config.identity.clone(),
        metrics: config.metrics.clone(),
        status: status.clone(),
    };
    let tasks = vec![
        tokio::spawn(crate::resolve::keep_resolved(
            resolver,
            link.spec.gateway_addresses.clone(),
            addr_tx,
        )),
        tokio::spawn(probe.run(addr_rx, gw_tx)),
    ];
    (gw_rx, tasks)
}

type GatewayWatch = watch::Receiver<Option<Vec<GatewayEndpoint>>>;

async fn run_once(
    local: &Client,
    local_services: &crate::LocalServices,
    link: &Link,
    status: &StatusReporter,
    config: &crate::MirrorConfig,
    mut gateways: GatewayWatch,
) -> Result<(), String> {
    let spec = &link.spec;
    let remote = match remote_client(local, link).await {
        Ok(c) => c,
        Err(e) => {
            status
                .set_health(LinkHealth::credentials_invalid(&e.to_string()))
                .await;
            return Err(e.to_string());
        }
    };
    status.set_health(LinkHealth::credentials_ok()).await;
    let renewer = tokio::spawn(crate::token::keep_fresh(
        local.clone(),
        remote.clone(),
        link.clone(),
        config.token_renew_at,
    ));
    let _renewer = AbortOnDrop(vec![renewer]);
    let Some(selector) = selector_query(&spec.selector) else {
        // An empty selector matches nothing: remove every mirror of this Link.
        status.set_health(LinkHealth::remote_ok()).await;
        let _ = local_services.wait_until_ready().await;
        let mut state = LinkState::default();
        let (no_services, _) = reflector::store::<Service>();
        let (no_slices, _) = reflector::store::<EndpointSlice>();
        let nothing = Remote {
            services: &no_services,
            slices: &no_slices,
            gateways: &[],
        };
        let here = Local {
            client: local,
            services: local_services,
        };
        sync(here, spec, nothing, &mut state, status, true).await;
        futures::future::pending::<()>().await;
        return Ok(());
    };

    let notify = Arc::new(Notify::new());
    let (svc_reader, svc_writer) = reflector::store::<Service>();
    let (slice_reader, slice_writer) = reflector::store::<EndpointSlice>();
    // Managed fields are never mirrored; dropping them roughly halves what
    // the stores hold (10,000 exported services).
    let services = watcher(
        Api::<Service>::all(remote.clone()),
        watcher::Config::default().labels(&selector),
    )
    .modify(|s| {
        s.metadata.managed_fields = None;
        if let Some(a) = s.metadata.annotations.as_mut() {
            a.remove("kubectl.kubernetes.io/last-applied-configuration");
        }
    });
    // Only slices that belong to a Service; filtered to exported ones when syncing.
    let slices = watcher(
        Api::<EndpointSlice>::all(remote.clone()),
        watcher::Config::default().labels(SERVICE_NAME_LABEL),
    )
    .modify(|s| s.metadata.managed_fields = None);
    let (health_tx, mut health_rx) = tokio::sync::mpsc::channel::<Result<(), String>>(16);
    let watch_task = |stream: futures::stream::BoxStream<'static, Result<(), watcher::Error>>| {
        let (notify, health) = (notify.clone(), health_tx.clone());
        tokio::spawn(async move {
            let mut stream = stream;
            while let Some(item) = stream.next().await {
                let _ = health.try_send(item.map_err(|e| e.to_string()));
                notify.notify_one();
            }
        })
    };
    let t1 = watch_task(
        reflector::reflector(svc_writer, services)
            .default_backoff()
            .map(|r| r.map(|_| ()))
            .boxed(),
    );
    let t2 = watch_task(
        reflector::reflector(slice_writer, slices)
            .default_backoff()
            .map(|r| r.map(|_| ()))
            .boxed(),
    );
    let _guard = AbortOnDrop(vec![t1, t2]);

    // Wait for the first full list of both, then clean up orphans from before.
    // Errors meanwhile mark the remote unreachable; the watchers retry by themselves.
    let ready = async {
        svc_reader.wait_until_ready().await.ok();
        slice_reader.wait_until_ready().await.ok();
    };
    tokio::pin!(ready);
    let ttl = spec
        .staleness_ttl
        .as_deref()
        .and_then(|t| humantime::parse_duration(t).ok());
    let mut unreachable_since: Option<tokio::time::Instant> = None;
    let mut marked_stale = false;
    loop {
        tokio::select! {
            _ = &mut ready => break,
            Some(health) = health_rx.recv() => {
                if let (Err(e), None) = (health, unreachable_since) {
                    unreachable_since = Some(tokio::time::Instant::now());
                    tracing::warn!(cluster = %spec.target_cluster_name, "remote API unreachable while listing: {e}");
                    status.set_health(LinkHealth::remote_unreachable(&e)).await;
                }
            }
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        // No remote state yet, but the mirrors from before must still go stale.
        if let (Some(ttl), Some(since), false) = (ttl, unreachable_since, marked_stale)
            && since.elapsed() >= ttl
        {
            marked_stale = mark_all_not_ready(local, &spec.target_cluster_name).await;
        }
    }
    status.set_health(LinkHealth::remote_ok()).await;
    // The first pass waits for the gateway's addresses (resolved, not yet probed)
    // and for the local Services (the name-conflict check reads them).
    let _ = gateways.wait_for(Option::is_some).await;
    let _ = local_services.wait_until_ready().await;
    let mut state = LinkState::default();
    // One sync pass over this Link's stores; `full` also removes orphans.
    let pass = async |state: &mut LinkState, gateways: &GatewayWatch, full: bool| {
        let endpoints = gateways.borrow().clone().unwrap_or_default();
        let remote = Remote {
            services: &svc_reader,
            slices: &slice_reader,
            gateways: &endpoints,
        };
        let here = Local {
            client: local,
            services: local_services,
        };
        sync(here, spec, remote, state, status, full).await
    };
    pass(&mut state, &gateways, true).await;
    let mut remote_ok = true;
    let mut unreachable_since: Option<tokio::time::Instant> = None;
    loop {
        // Past the staleness TTL, a silent remote's endpoints turn not ready.
        if let (Some(ttl), Some(since), false) = (ttl, unreachable_since, state.stale)
            && since.elapsed() >= ttl
        {
            tracing::warn!(cluster = %spec.target_cluster_name, "remote silent for {ttl:?}: marking its endpoints not ready");
            state.stale = true;
            pass(&mut state, &gateways, false).await;
        }
        tokio::select! {
            _ = notify.notified() => {
                // Coalesce bursts (a deployment rollout touches many slices).
                tokio::time::sleep(Duration::from_millis(50)).await;
                pass(&mut state, &gateways, false).await;
            }
            Ok(()) = gateways.changed() => {
                pass(&mut state, &gateways, false).await;
            }
            Some(h) = health_rx.recv() => match h {
                Ok(()) if !remote_ok => {
                    remote_ok = true;
                    unreachable_since = None;
                    status.set_health(LinkHealth::remote_ok()).await;
                    if state.stale {
                        state.stale = false;
                        pass(&mut state, &gateways, false).await;
                    }
                }
                Err(e) if remote_ok => {
                    remote_ok = false;
                    unreachable_since = Some(tokio::time::Instant::now());
                    tracing::warn!(cluster = %spec.target_cluster_name, "remote API unreachable: {e}; keeping mirrors");
                    status.set_health(LinkHealth::remote_unreachable(&e)).await;
                }
                _ => {}
            },
            // Periodic pass: retries failed writes (a namespace created later, a conflict
            // removed); also wakes the staleness check.
            _ = tokio::time::sleep(ttl.map_or(Duration::from_secs(10), |t| t.min(Duration::from_secs(10)) / 2)) => {
                pass(&mut state, &gateways, false).await;
            }
        }
    }
}

pub(crate) struct AbortOnDrop(pub(crate) Vec<tokio::task::JoinHandle<()>>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Where mirrors are written: the local API and what is known of its Services.
#[derive(Clone, Copy)]
struct Local<'a> {
    client: &'a Client,
    services: &'a crate::LocalServices,
}

/// What one sync pass mirrors: the remote's exported services and their
/// slices, and the gateway's addresses with their liveness.
#[derive(Clone, Copy)]
struct Remote<'a> {
    services: &'a Store<Service>,
    slices: &'a Store<EndpointSlice>,
    gateways: &'a [GatewayEndpoint],
}

/// Brings local mirrors in line with the remote stores. `full` also removes
/// local mirrors of this cluster that are no longer wanted even if this worker
/// never applied them (orphans from before a restart).
async fn sync(
    local: Local<'_>,
    spec: &LinkSpec,
    remote: Remote<'_>,
    state: &mut LinkState,
    status: &StatusReporter,
    full: bool,
) {
    let Remote {
        services,
        slices,
        gateways,
    } = remote;
    let started = std::time::Instant::now();
    let stale = state.stale;
    let applied = &mut state.applied;
    let cluster = &spec.target_cluster_name;
    let mut slices_by_service: BTreeMap<(String, String), Vec<Arc<EndpointSlice>>> =
        BTreeMap::new();
    for slice in slices.state() {
        if let (Some(ns), Some(svc)) = (
            slice.namespace(),
            slice.labels().get(SERVICE_NAME_LABEL).cloned(),
        ) {
            slices_by_service.entry((ns, svc)).or_default().push(slice);
        }
    }
    let remotes = services.state();
    // Mirror services concurrently (bounded): an initial sync of thousands of
    // services is dominated by API round trips, not CPU.
    let cache: &Applied = applied;
    let outcomes: Vec<Outcome> = futures::stream::iter(remotes.into_iter().map(|remote| {
        let key = (remote.namespace().unwrap_or_default(), remote.name_any());
        let remote_slices: Vec<Arc<EndpointSlice>> =
            slices_by_service.get(&key).cloned().unwrap_or_default();
        mirror_one(local, spec, remote, remote_slices, gateways, cache, stale)
    }))
    .buffer_unordered(APPLY_CONCURRENCY)
    .collect()
    .await;
    let mut wanted: BTreeSet<(String, String)> = BTreeSet::new();
    let mut report = Vec::new();
    for outcome in outcomes {
        wanted.extend(outcome.wanted);
        outcome.writes.merge_into(applied);
        let (ns, name) = outcome.remote;
        match outcome.result {
            Ok(()) => report.push(ServiceMirrorStatus {
                namespace: ns,
                name,
                mirrored: true,
                reason: String::new(),
                message: String::new(),
            }),
            Err((reason, message)) => {
                tracing::warn!(cluster = %cluster, service = %format!("{ns}/{name}"), "{message}");
                report.push(ServiceMirrorStatus {
                    namespace: ns,
                    name,
                    mirrored: false,
                    reason: reason.into(),
                    message,
                });
            }
        }
    }
    // Remove mirrors no longer wanted.
    let stale: Vec<(String, String)> = if full {
        match list_local_mirrors(local.client, cluster).await {
            Ok(all) => all.into_iter().filter(|k| !wanted.contains(k)).collect(),
            Err(e) => {
                tracing::warn!(cluster = %cluster, "listing local mirrors failed: {e}");
                Vec::new()
            }
        }
    } else {
        applied
            .services
            .keys()
            .filter(|k| !wanted.contains(*k))
            .cloned()
            .collect()
    };
    for (ns, name) in stale {
        if delete_mirror(local.client, &ns, &name).await {
            applied.services.remove(&(ns.clone(), name.clone()));
            applied.cluster_ips.remove(&(ns.clone(), name.clone()));
            applied.slices.remove(&(ns, name));
        }
    }
    status.set_services(report).await;
    status.observe_sync(started.elapsed().as_secs_f64());
}

/// Marks every local mirror endpoint of `cluster` not ready, keeping the rest
/// of each slice. True when all were written.
async fn mark_all_not_ready(local: &Client, cluster: &str) -> bool {
    tracing::warn!(cluster = %cluster, "remote silent past its staleness TTL: marking its endpoints not ready");
    let selector = format!("{MIRRORED_LABEL}=true,{CLUSTER_NAME_LABEL}={cluster}");
    let Ok(list) = Api::<EndpointSlice>::all(local.clone())
        .list(&ListParams::default().labels(&selector))
        .await
    else {
        return false;
    };
    let mut ok = true;
    for mut slice in list.items {
        for e in slice.endpoints.iter_mut().flatten() {
            let c = e.conditions.get_or_insert_with(Default::default);
            c.ready = Some(false);
            c.serving = Some(false);
        }
        let (ns, name) = (slice.namespace().unwrap_or_default(), slice.name_any());
        slice.metadata.managed_fields = None;
        slice.metadata.resource_version = None;
        let body = with_type_meta(&slice, "discovery.k8s.io/v1", "EndpointSlice");
        ok &= Api::<EndpointSlice>::namespaced(local.clone(), &ns)
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
            .is_ok();
    }
    ok
}

async fn list_local_mirrors(local: &Client, cluster: &str) -> kube::Result<Vec<(String, String)>> {
    let selector = format!("{MIRRORED_LABEL}=true,{CLUSTER_NAME_LABEL}={cluster}");
    let list = Api::<Service>::all(local.clone())
        .list_metadata(&ListParams::default().labels(&selector))
        .await?;
    Ok(list
        .items
        .into_iter()
        .map(|m| (m.namespace().unwrap_or_default(), m.name_any()))
        .collect())
}

/// Deletes a mirror Service and its EndpointSlice. True when both are gone.
pub async fn delete_mirror(local: &Client, ns: &str, name: &str) -> bool {
    let svc = Api::<Service>::namespaced(local.clone(), ns)
        .delete(name, &DeleteParams::default())
        .await;
    let slice = Api::<EndpointSlice>::namespaced(local.clone(), ns)
        .delete(name, &DeleteParams::default())
        .await;
    fn gone<T>(r: &Result<T, kube::Error>) -> bool {
        match r {
            Ok(_) => true,
            Err(kube::Error::Api(e)) => e.code == 404,
            Err(_) => false,
        }
    }
    let ok = gone(&svc) && gone(&slice);
    if ok {
        tracing::info!(service = %format!("{ns}/{name}"), "mirror removed");
    }
    ok
}

/// How many mirrors are written at once.
const APPLY_CONCURRENCY: usize = 16;

/// Writes made while mirroring one service, merged into [`Applied`] afterwards.
#[derive(Default)]
struct Writes {
    services: Vec<((String, String), u64, Option<String>)>,
    slices: Vec<((String, String), u64)>,
}

impl Writes {
    fn merge_into(self, applied: &mut Applied) {
        for (key, hash, ip) in self.services {
            if let Some(ip) = ip {
                applied.cluster_ips.insert(key.clone(), ip);
            }
            applied.services.insert(key, hash);
        }
        for (key, hash) in self.slices {
            applied.slices.insert(key, hash);
        }
    }

    fn cluster_ip(&self, cache: &Applied, key: &(String, String)) -> Option<String> {
        self.services
            .iter()
            .rev()
            .find(|(k, _, ip)| k == key && ip.is_some())
            .and_then(|(_, _, ip)| ip.clone())
            .or_else(|| cache.cluster_ips.get(key).cloned())
    }
}

struct Outcome {
    remote: (String, String),
    wanted: Vec<(String, String)>,
    result: Result<(), (&'static str, String)>,
    writes: Writes,
}

/// Mirrors one remote service (and, when headless, its pods).
async fn mirror_one(
    local: Local<'_>,
    spec: &LinkSpec,
    remote: Arc<Service>,
    remote_slices: Vec<Arc<EndpointSlice>>,
    gateways: &[GatewayEndpoint],
    cache: &Applied,
    stale: bool,
) -> Outcome {
    let key = (remote.namespace().unwrap_or_default(), remote.name_any());
    let mut writes = Writes::default();
    let mut wanted = Vec::new();
    let Some(desired) = mirror::mirror_service(&remote, spec) else {
        return Outcome {
            remote: key,
            wanted,
            result: Ok(()),
            writes,
        };
    };
    let ns = desired.namespace().unwrap_or_default();
    wanted.push((ns.clone(), desired.name_any()));
    let slices: Vec<&EndpointSlice> = remote_slices.iter().map(|s| s.as_ref()).collect();
    let result = if mirror::is_headless(&remote) {
        // Per-pod mirrors first: the headless mirror's endpoints are their cluster IPs.
        let mut pods = Vec::new();
        let mut outcome = Ok(());
        for (hostname, pod_ready) in mirror::remote_hostnames(&slices) {
            let pod_ready = pod_ready && !stale;
            let Some(pod_svc) = mirror::endpoint_mirror_service(&remote, &hostname, spec) else {
                continue;
            };
            let pod_key = (ns.clone(), pod_svc.name_any());
            wanted.push(pod_key.clone());
            let pod_slice = mirror::mirror_endpoint_slice(&pod_svc, spec, gateways, pod_ready);
            match apply_mirror(local, &pod_svc, pod_slice.as_ref(), cache, &mut writes).await {
                Ok(()) => {
                    if let Some(ip) = writes.cluster_ip(cache, &pod_key) {
                        pods.push((hostname, ip, pod_ready));
                    }
                }
                Err(e) => outcome = Err(e),
            }
        }
        let slice = mirror::headless_endpoint_slice(&desired, spec, &pods);
        apply_mirror(local, &desired, slice.as_ref(), cache, &mut writes)
            .await
            .and(outcome)
    } else {
        let ready = mirror::has_ready_endpoints(&slices) && !stale;
        let slice = mirror::mirror_endpoint_slice(&desired, spec, gateways, ready);
        apply_mirror(local, &desired, slice.as_ref(), cache, &mut writes).await
    };
    Outcome {
        remote: key,
        wanted,
        result,
        writes,
    }
}

async fn apply_mirror(
    local: Local<'_>,
    service: &Service,
    slice: Option<&EndpointSlice>,
    cache: &Applied,
    writes: &mut Writes,
) -> Result<(), (&'static str, String)> {
    let (ns, name) = (service.namespace().unwrap_or_default(), service.name_any());
    let key = (ns.clone(), name.clone());
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let svc_hash = hash_of(service);
    if cache.services.get(&key) != Some(&svc_hash) {
        let api = Api::<Service>::namespaced(local.client.clone(), &ns);
        // Never take over a Service that is not ours.
        if !cache.services.contains_key(&key)
            && let Some(existing) = local.services.get(&ObjectRef::new(&name).within(&ns))
            && existing.labels().get(MIRRORED_LABEL).map(String::as_str) != Some("true")
        {
            return Err((
                "NameConflict",
                format!(
                    "a local Service {ns}/{name} that is not a mirror exists; rename it or exclude the remote Service"
                ),
            ));
        }
        let body = with_type_meta(service, "v1", "Service");
        match api.patch(&name, &params, &Patch::Apply(&body)).await {
            Ok(written) => {
                let ip = written
                    .spec
                    .and_then(|s| s.cluster_ip)
                    .filter(|ip| ip != "None");
                writes.services.push((key.clone(), svc_hash, ip));
                tracing::debug!(service = %format!("{ns}/{name}"), "mirror service applied");
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {
                return Err((
                    "NamespaceMissing",
                    format!("namespace {ns} does not exist here; create it to receive the mirror"),
                ));
            }
            Err(e) => return Err(("ApiError", format!("applying Service {ns}/{name}: {e}"))),
        }
    }
    if let Some(slice) = slice {
        let slice_hash = hash_of(slice);
        if cache.slices.get(&key) != Some(&slice_hash) {
            let body = with_type_meta(slice, "discovery.k8s.io/v1", "EndpointSlice");
            Api::<EndpointSlice>::namespaced(local.client.clone(), &ns)
                .patch(&name, &params, &Patch::Apply(&body))
                .await
                .map_err(|e| {
                    (
                        "ApiError",
                        format!("applying EndpointSlice {ns}/{name}: {e}"),
                    )
                })?;
            writes.slices.push((key, slice_hash));
        }
    }
    Ok(())
}

fn with_type_meta<T: serde::Serialize>(
    obj: &T,
    api_version: &str,
    kind: &str,
) -> serde_json::Value {
    let mut value = serde_json::to_value(obj).unwrap_or_default();
    value["apiVersion"] = api_version.into();
    value["kind"] = kind.into();
    value
}
