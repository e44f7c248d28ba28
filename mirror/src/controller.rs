//! The controller: a kube-runtime controller over `Link` objects that keeps
//! one worker per Link (restarted when the Link's spec or its credentials
//! Secret changes) and a finalizer that removes the Link's mirrors before the
//! Link goes away.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use kube::api::ListParams;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use strait_mesh::link::{LINK_FINALIZER, Link};
use strait_mesh::names::{CLUSTER_NAME_LABEL, MIRRORED_LABEL};
use tokio::sync::{Mutex, watch};

use crate::config::{LocalServices, MirrorConfig};
use crate::status::{LinkHealth, StatusReporter};
use crate::{heartbeat, worker};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    #[error("removing mirrors of cluster {cluster}: {message}")]
    Cleanup { cluster: String, message: String },
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

struct WorkerHandle {
    fingerprint: u64,
    stop: watch::Sender<bool>,
    /// The Link's target cluster name (its clusterset membership).
    cluster: String,
}

/// Shared by every reconcile.
pub struct Context {
    config: MirrorConfig,
    client: Client,
    recorder: Recorder,
    workers: Mutex<HashMap<String, WorkerHandle>>,
    local_services: LocalServices,
    /// Every Link, to tell which of two claiming one cluster name mirrors it.
    links: reflector::Store<Link>,
}

impl Context {
    fn new(
        client: Client,
        config: MirrorConfig,
        local_services: LocalServices,
        links: reflector::Store<Link>,
    ) -> Self {
        let reporter = Reporter {
            controller: "strait-mirror".into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Self {
            config,
            recorder: Recorder::new(client.clone(), reporter),
            client,
            workers: Mutex::new(HashMap::new()),
            local_services,
            links,
        }
    }
}

/// Watches local Services' metadata into a store, keeping only what the
/// ownership rule needs (name, namespace, the mirror labels, whether
/// Strait's field manager wrote it) to bound memory.
fn watch_local_services(client: Client, tasks: &mut tokio::task::JoinSet<()>) -> LocalServices {
    let (reader, writer) = reflector::store::<PartialObjectMeta<Service>>();
    let stream = watcher(
        Api::<PartialObjectMeta<Service>>::all(client),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(|svc| {
        let m = &mut svc.metadata;
        m.annotations = None;
        // Only Strait's own manager entries, without their field sets.
        m.managed_fields = Some(
            m.managed_fields
                .take()
                .into_iter()
                .flatten()
                .filter(|f| f.manager.as_deref() == Some(worker::FIELD_MANAGER))
                .map(|f| ManagedFieldsEntry {
                    manager: f.manager,
                    ..Default::default()
                })
                .collect(),
        );
        m.owner_references = None;
        if let Some(labels) = m.labels.as_mut() {
            labels.retain(|k, _| k == MIRRORED_LABEL || k == CLUSTER_NAME_LABEL);
        }
    });
    tasks.spawn(async move {
        let mut stream = std::pin::pin!(reflector::reflector(writer, stream));
        while let Some(item) = stream.next().await {
            if let Err(e) = item {
                tracing::warn!("watching local Services: {e}");
            }
        }
    });
    reader
}

/// Runs the controller until the future is dropped.
pub async fn run(client: Client, config: MirrorConfig) {
    let mut tasks = tokio::task::JoinSet::new();
    let local_services = watch_local_services(client.clone(), &mut tasks);
    if config.heartbeat {
        tasks.spawn(heartbeat::run(client.clone(), config.namespace.clone()));
    }
    let links: Api<Link> = Api::namespaced(client.clone(), &config.namespace);
    let controller = Controller::new(links, watcher::Config::default());
    let store = controller.store();
    let ctx = Arc::new(Context::new(
        client.clone(),
        config,
        local_services,
        store.clone(),
    ));
    controller
        // A changed credentials Secret restarts the Links that use it.
        .watches(
            Api::<Secret>::namespaced(client, &ctx.config.namespace),
            watcher::Config::default(),
            move |secret| {
                store
                    .state()
                    .into_iter()
                    .filter(|l| {
                        l.namespace() == secret.namespace()
                            && l.spec.cluster_credentials_secret == secret.name_any()
                    })
                    .map(|l| ObjectRef::from_obj(&*l))
                    .collect::<Vec<_>>()
            },
        )
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!("reconcile: {e}");
            }
        })
        .await;
}

fn error_policy(link: Arc<Link>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(link = %format!("{}/{}", link.namespace().unwrap_or_default(), link.name_any()), "{error}");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(link: Arc<Link>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = link.namespace().unwrap_or_default();
    let api: Api<Link> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, LINK_FINALIZER, link, |event| async {
        match event {
            Finalizer::Apply(link) => {
                if let Some(older) = claimed_before(&ctx.links, &link) {
                    // Two Links would write the same `<svc>-<cluster>` mirrors:
                    // the older keeps them, this one waits (and is looked at
                    // again, to take over once the older is gone).
                    stop_worker(&ctx, &key_of(&link)).await;
                    reporter(&ctx, link.clone())
                        .set_health(LinkHealth::duplicate_cluster_name(
                            &link.spec.target_cluster_name,
                            &older,
                        ))
                        .await;
                    return Ok(Action::requeue(DUPLICATE_RECHECK));
                }
                ensure_worker(&ctx, link).await?;
                Ok(Action::requeue(Duration::from_secs(300)))
            }
            Finalizer::Cleanup(link) => {
                stop_worker(&ctx, &key_of(&link)).await;
                if let Some((_, feed)) = &ctx.config.clusterset {
                    feed.leave(&link.spec.target_cluster_name, &key_of(&link));
                }
                ctx.config.metrics.forget(&key_of(&link));
                let cluster = &link.spec.target_cluster_name;
                if let Some(other) = other_claimant(&ctx.links, &link) {
                    // The mirrors are (or will be) the other Link's: it takes
                    // them over with its first pass.
                    tracing::info!(%cluster, other = %other, "link deleted: its cluster name stays linked by another Link, mirrors kept");
                } else {
                    remove_all_mirrors(&ctx.client, cluster).await?;
                    tracing::info!(%cluster, "link deleted: its mirrors are gone");
                }
                Ok(Action::await_change())
            }
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// How often a Link refused for a duplicate cluster name is looked at
/// again: it takes over within this once the older Link is gone.
const DUPLICATE_RECHECK: Duration = Duration::from_secs(5);

/// The other Links claiming `link`'s cluster name, oldest first (creation
/// time, then name): the first of them mirrors the cluster.
fn claimants(links: &reflector::Store<Link>, link: &Link) -> Vec<Arc<Link>> {
    let me = key_of(link);
    let mut others: Vec<Arc<Link>> = links
        .state()
        .into_iter()
        .filter(|l| l.spec.target_cluster_name == link.spec.target_cluster_name && key_of(l) != me)
        .collect();
    others.sort_by_key(|l| seniority(l));
    others
}

fn seniority(link: &Link) -> (Option<i64>, String) {
    (
        link.metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_millisecond()),
        link.name_any(),
    )
}

/// The older Link (`namespace/name`) that claims `link`'s cluster name, if any.
fn claimed_before(links: &reflector::Store<Link>, link: &Link) -> Option<String> {
    claimants(links, link)
        .into_iter()
        .find(|l| seniority(l) < seniority(link))
        .map(|l| key_of(&l))
}

/// Another Link that claims `link`'s cluster name, if any.
fn other_claimant(links: &reflector::Store<Link>, link: &Link) -> Option<String> {
    claimants(links, link).first().map(|l| key_of(l))
}

fn reporter(ctx: &Context, link: Arc<Link>) -> StatusReporter {
    let api: Api<Link> = Api::namespaced(ctx.client.clone(), &link.namespace().unwrap_or_default());
    StatusReporter::new(api, link, ctx.recorder.clone(), ctx.config.metrics.clone())
}

fn key_of(link: &Link) -> String {
    format!(
        "{}/{}",
        link.namespace().unwrap_or_default(),
        link.name_any()
    )
}

async fn ensure_worker(ctx: &Context, link: Arc<Link>) -> Result<(), Error> {
    let key = key_of(&link);
    let secret_version =
        Api::<Secret>::namespaced(ctx.client.clone(), &link.namespace().unwrap_or_default())
            .get_metadata_opt(&link.spec.cluster_credentials_secret)
            .await?
            .and_then(|m| m.metadata.resource_version);
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(&link.spec)
        .unwrap_or_default()
        .hash(&mut hasher);
    secret_version.hash(&mut hasher);
    let fingerprint = hasher.finish();

    let mut workers = ctx.workers.lock().await;
    if workers
        .get(&key)
        .is_some_and(|w| w.fingerprint == fingerprint)
    {
        return Ok(());
    }
    if let Some(old) = workers.remove(&key) {
        let _ = old.stop.send(true);
        // A restart keeps the cluster's exports (the new worker takes its
        // place); a new name means the old cluster is no longer linked here.
        if old.cluster != link.spec.target_cluster_name
            && let Some((_, feed)) = &ctx.config.clusterset
        {
            feed.leave(&old.cluster, &key);
        }
    }
    tracing::info!(link = %key, cluster = %link.spec.target_cluster_name, "starting to mirror");
    let (stop, stop_rx) = watch::channel(false);
    let reporter = reporter(ctx, link.clone());
    reporter.set_health(LinkHealth::accepted()).await;
    tokio::spawn(worker::run(
        ctx.client.clone(),
        ctx.local_services.clone(),
        (*link).clone(),
        reporter,
        ctx.config.clone(),
        stop_rx,
    ));
    workers.insert(
        key,
        WorkerHandle {
            fingerprint,
            stop,
            cluster: link.spec.target_cluster_name.clone(),
        },
    );
    Ok(())
}

async fn stop_worker(ctx: &Context, key: &str) {
    if let Some(old) = ctx.workers.lock().await.remove(key) {
        let _ = old.stop.send(true);
    }
}

/// Deletes every mirror of `cluster`. Fails (and the finalizer retries) if any remain.
pub async fn remove_all_mirrors(client: &Client, cluster: &str) -> Result<(), Error> {
    let selector = format!("{MIRRORED_LABEL}=true,{CLUSTER_NAME_LABEL}={cluster}");
    let list = Api::<Service>::all(client.clone())
        .list_metadata(&ListParams::default().labels(&selector))
        .await?;
    let mut failed = 0;
    for m in list.items {
        if !worker::delete_mirror(
            client,
            cluster,
            &m.namespace().unwrap_or_default(),
            &m.name_any(),
        )
        .await
        {
            failed += 1;
        }
    }
    if failed > 0 {
        return Err(Error::Cleanup {
            cluster: cluster.into(),
            message: format!("{failed} mirrors could not be deleted yet"),
        });
    }
    Ok(())
}
