//! One Link's mirroring, in four named steps: [`watch`] the remote cluster's
//! exported Services and their EndpointSlices (and the Link's gateway),
//! [`diff`] them against what this worker last applied, [`write`] only what
//! changed, and report each Service's outcome in the Link's [`status`].
//!
//! A steady state makes no API writes. Remote outages keep mirrors as they
//! are until the Link's staleness TTL passes ([`Staleness`] decides that, in
//! one place); then every endpoint of the remote is written not ready until
//! it answers again.

mod diff;
mod local;
mod status;
mod watch;
mod write;

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::{self, Store};
use kube::{Client, ResourceExt};
use strait_mesh::link::{Link, LinkSpec, selector_query};
use strait_mesh::mcs::ServiceExport;
use tokio::sync::Notify;
use tokio::sync::watch as signal;
use tokio::task::JoinSet;
use tokio::time::Instant;

pub use watch::{CredentialsError, remote_client};
pub use write::{FIELD_MANAGER, delete_mirror};

use crate::config::{LocalServices, MirrorConfig};
use crate::probe::GatewayEndpoint;
use crate::remote_slices::ExportedSlices;
use crate::status::{LinkHealth, StatusReporter};
use diff::{Applied, Key};
use watch::{GatewayWatch, RemoteWatch};
use write::Local;

/// Runs until `stop` fires. Starts over (new credentials, new watches) after
/// a credentials error, with backoff.
pub async fn run(
    local: Client,
    local_services: LocalServices,
    link: Link,
    status: StatusReporter,
    config: MirrorConfig,
    mut stop: signal::Receiver<bool>,
) {
    let key = format!(
        "{}/{}",
        link.namespace().unwrap_or_default(),
        link.name_any()
    );
    let mut gateway_tasks = JoinSet::new();
    let gateways = watch::gateways(&link, &status, &config, &key, &mut gateway_tasks);
    let here = Local {
        client: &local,
        services: &local_services,
    };
    let mut backoff = Duration::from_millis(500);
    loop {
        let Err(e) = tokio::select! {
            r = mirror_link(here, &link, &status, &config, gateways.clone()) => r,
            _ = stop.changed() => return,
        };
        tracing::warn!(link = %key, "mirroring interrupted: {e}; retrying in {backoff:?}");
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// Mirrors the Link until its credentials fail: connect, list, then follow
/// every change. Remote API errors do not end it (the watches retry).
async fn mirror_link(
    here: Local<'_>,
    link: &Link,
    status: &StatusReporter,
    config: &MirrorConfig,
    mut gateways: GatewayWatch,
) -> Result<Infallible, CredentialsError> {
    let spec = &link.spec;
    let remote = match remote_client(here.client, link).await {
        Ok(c) => c,
        Err(e) => {
            status
                .set_health(LinkHealth::credentials_invalid(e.reason(), &e.to_string()))
                .await;
            return Err(e);
        }
    };
    status.set_health(LinkHealth::credentials_ok()).await;
    let mut renewer = JoinSet::new();
    renewer.spawn(crate::token::keep_fresh(
        here.client.clone(),
        remote.clone(),
        link.clone(),
        config.token_renew_at,
    ));
    let mut applied = Applied::default();
    let Some(selector) = selector_query(&spec.selector) else {
        // An empty selector matches nothing: remove every mirror of this Link.
        status.set_health(LinkHealth::remote_ok()).await;
        let _ = here.services.wait_until_ready().await;
        let (services, _) = reflector::store::<Service>();
        let slices = ExportedSlices::default();
        let nothing = Remote {
            services: &services,
            slices: &slices,
            gateways: &[],
        };
        sync(here, spec, nothing, &mut applied, status, Pass::full()).await;
        // Still a member of the clusterset (its exports are not selected by label).
        let exports = watch_exports(&remote, link, config, Arc::new(Notify::new()));
        let _clusterset =
            join_clusterset(link, status, config, exports, None, gateways.clone()).await;
        return futures::future::pending().await;
    };
    // Only the exported Services' slices are cached: those the selector picks
    // and those the remote's ServiceExports name.
    let exports_changed = Arc::new(Notify::new());
    let exports = watch_exports(&remote, link, config, exports_changed.clone());
    let remote_watch = RemoteWatch::start(
        &remote,
        &selector,
        exports.as_ref().map(|(store, _)| store.clone()),
        exports_changed,
    );
    let _clusterset = join_clusterset(
        link,
        status,
        config,
        exports,
        Some(remote_watch.slices.clone()),
        gateways.clone(),
    )
    .await;
    let mut remote = remote_watch;
    let mut staleness = Staleness::new(spec.staleness_ttl.as_deref());

    // Until the first full list: errors mark the remote unreachable, and past
    // the TTL the mirrors from before go not ready (there is no remote state
    // to diff yet, so all of them).
    let listed = remote.listed();
    tokio::pin!(listed);
    let mut marked = false;
    loop {
        tokio::select! {
            _ = &mut listed => break,
            Some(health) = remote.health.recv() => {
                if let Err(e) = health && staleness.failed(Instant::now()) {
                    tracing::warn!(cluster = %spec.target_cluster_name, "remote API unreachable while listing: {e}");
                    status.set_health(LinkHealth::remote_unreachable(&e)).await;
                }
            }
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        if staleness.went_stale(Instant::now()) {
            tracing::warn!(cluster = %spec.target_cluster_name, "remote silent past its staleness TTL: marking its endpoints not ready");
        }
        if staleness.is_stale() && !marked {
            marked = write::mark_all_not_ready(here.client, &spec.target_cluster_name).await;
        }
    }
    staleness.answered();
    status.set_health(LinkHealth::remote_ok()).await;
    // The first pass waits for the gateway's addresses (resolved, not yet probed)
    // and for the local Services (the name-conflict check reads them).
    let _ = gateways.wait_for(Option::is_some).await;
    let _ = here.services.wait_until_ready().await;
    // One sync pass over this Link's stores.
    let pass = async |applied: &mut Applied, gateways: &GatewayWatch, pass: Pass| {
        let endpoints = gateways.borrow().clone().unwrap_or_default();
        let stores = Remote {
            services: &remote.services,
            slices: &remote.slices,
            gateways: &endpoints,
        };
        sync(here, spec, stores, applied, status, pass).await
    };
    // This Link's mirrors here: one deleted or edited by someone else is
    // written again within a pass (see `local`).
    let mut mirrors_here =
        local::LocalMirrors::start(here.client, &write::mirrors_of(&spec.target_cluster_name));
    pass(&mut applied, &gateways, Pass::full()).await;
    loop {
        if staleness.went_stale(Instant::now()) {
            tracing::warn!(cluster = %spec.target_cluster_name, "remote silent for {:?}: marking its endpoints not ready", staleness.ttl.unwrap_or_default());
            pass(&mut applied, &gateways, Pass::stale(true)).await;
        }
        tokio::select! {
            _ = remote.changed.notified() => {
                if let Some((_, feed)) = &config.clusterset {
                    feed.notify();
                }
                // Coalesce bursts (a deployment rollout touches many slices).
                tokio::time::sleep(Duration::from_millis(50)).await;
                pass(&mut applied, &gateways, Pass::stale(staleness.is_stale())).await;
            }
            Ok(()) = gateways.changed() => {
                if let Some((_, feed)) = &config.clusterset {
                    feed.notify();
                }
                pass(&mut applied, &gateways, Pass::stale(staleness.is_stale())).await;
            }
            Some(health) = remote.health.recv() => match health {
                Ok(()) => if let Some(was_stale) = staleness.answered() {
                    status.set_health(LinkHealth::remote_ok()).await;
                    if was_stale {
                        pass(&mut applied, &gateways, Pass::stale(false)).await;
                    }
                }
                Err(e) => if staleness.failed(Instant::now()) {
                    tracing::warn!(cluster = %spec.target_cluster_name, "remote API unreachable: {e}; keeping mirrors");
                    status.set_health(LinkHealth::remote_unreachable(&e)).await;
                }
            },
            Some(first) = mirrors_here.seen.recv() => {
                // Coalesce: a pass's own writes come back in a burst.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let suspects = local::foreign(mirrors_here.drain(first), &applied);
                if !suspects.is_empty() && local::verify(here.client, suspects, &mut applied).await {
                    pass(&mut applied, &gateways, Pass::stale(staleness.is_stale())).await;
                }
            }
            // Periodic pass: retries failed writes (a namespace created later, a conflict
            // removed); also wakes the staleness check.
            _ = tokio::time::sleep(staleness.recheck()) => {
                pass(&mut applied, &gateways, Pass::stale(staleness.is_stale())).await;
            }
        }
    }
}

/// Starts watching the remote's ServiceExports when this controller is in a
/// clusterset (waking `changed` on every change).
fn watch_exports(
    remote: &Client,
    link: &Link,
    config: &MirrorConfig,
    changed: Arc<Notify>,
) -> Option<(Store<ServiceExport>, tokio::task::JoinHandle<()>)> {
    let (_, feed) = config.clusterset.as_ref()?;
    Some(crate::mcs::watch_remote_exports(
        remote,
        feed,
        &link.spec.target_cluster_name,
        changed,
    ))
}

/// Joins the clusterset feed with the remote's ServiceExports (watched for
/// as long as the result is held), its slices and the Link's gateway; a
/// refusal (a name already linked, or this cluster's) goes to the Link's status.
async fn join_clusterset(
    link: &Link,
    status: &StatusReporter,
    config: &MirrorConfig,
    exports: Option<(Store<ServiceExport>, tokio::task::JoinHandle<()>)>,
    slices: Option<ExportedSlices>,
    gateways: GatewayWatch,
) -> Option<(crate::mcs::Membership, AbortOnDrop)> {
    let (local_name, feed) = config.clusterset.as_ref()?;
    let spec = &link.spec;
    let (exports, task) = exports?;
    let key = format!(
        "{}/{}",
        link.namespace().unwrap_or_default(),
        link.name_any()
    );
    let member = crate::mcs::RemoteCluster {
        exports,
        slices,
        gateways,
        gateway_port: spec.gateway_port,
        gateway_identity: spec.gateway_identity.clone(),
        domain: spec.target_cluster_domain.clone(),
    };
    match feed.join(Some(local_name), &spec.target_cluster_name, &key, member) {
        Ok(member) => {
            status.set_health(LinkHealth::clusterset_member()).await;
            Some((member, AbortOnDrop(task)))
        }
        Err(e) => {
            task.abort();
            tracing::warn!(link = %key, "{e}");
            status
                .set_health(LinkHealth::clusterset_refused(e.reason(), &e.to_string()))
                .await;
            None
        }
    }
}

/// Aborts a task when dropped (a worker's remote watches end with it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What one sync pass mirrors: the remote's exported services and their
/// slices, and the gateway's addresses with their liveness.
#[derive(Clone, Copy)]
struct Remote<'a> {
    services: &'a Store<Service>,
    slices: &'a ExportedSlices,
    gateways: &'a [GatewayEndpoint],
}

/// How a sync pass runs.
#[derive(Clone, Copy, Debug)]
struct Pass {
    /// Also remove local mirrors of this cluster that this worker never
    /// applied (orphans from before a restart).
    full: bool,
    /// The remote is stale: write all its endpoints not ready.
    stale: bool,
}

impl Pass {
    fn full() -> Self {
        Pass {
            full: true,
            stale: false,
        }
    }

    fn stale(stale: bool) -> Self {
        Pass { full: false, stale }
    }
}

/// Brings local mirrors in line with the remote stores: diff each exported
/// Service, write what changed (bounded concurrency), delete mirrors no
/// longer wanted, report each Service's outcome.
async fn sync(
    local: Local<'_>,
    spec: &LinkSpec,
    remote: Remote<'_>,
    applied: &mut Applied,
    status: &StatusReporter,
    pass: Pass,
) {
    let started = std::time::Instant::now();
    let cluster = &spec.target_cluster_name;
    let slices = remote.slices.snapshot();
    let cache: &Applied = applied;
    let outcomes: Vec<(Key, Vec<Key>, _, write::Writes)> =
        futures::stream::iter(remote.services.state().into_iter().map(|service| {
            let key = diff::key_of(service.as_ref());
            // None: just exported, its slices not listed yet; written once they are.
            let known = slices.of(&key);
            let listing = known.is_none();
            let service_slices = known.unwrap_or_default();
            let desired =
                diff::desired(&service, service_slices, spec, remote.gateways, pass.stale);
            async move {
                let Some(desired) = desired else {
                    return (key, Vec::new(), Ok(()), write::Writes::default());
                };
                let wanted = desired.wanted();
                if listing {
                    return (key, wanted, Ok(()), write::Writes::default());
                }
                let (result, writes) = write::write_desired(local, spec, desired, cache).await;
                (key, wanted, result, writes)
            }
        }))
        .buffer_unordered(write::APPLY_CONCURRENCY)
        .collect()
        .await;
    let mut wanted: BTreeSet<Key> = BTreeSet::new();
    let mut report = Vec::with_capacity(outcomes.len());
    for (key, service_wanted, result, writes) in outcomes {
        wanted.extend(service_wanted);
        writes.merge_into(applied);
        report.push(status::service_status(cluster, key, result));
    }
    let unwanted: Vec<Key> = if pass.full {
        match write::list_local_mirrors(local.client, cluster).await {
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
    for key in unwanted {
        if delete_mirror(local.client, cluster, &key.0, &key.1).await {
            applied.forget(&key);
        }
    }
    status.set_services(report).await;
    status.observe_sync(started.elapsed().as_secs_f64());
}

/// Whether the remote has been silent past the Link's staleness TTL: the
/// one place that decides it.
#[derive(Debug)]
struct Staleness {
    ttl: Option<Duration>,
    silent_since: Option<Instant>,
    stale: bool,
}

impl Staleness {
    /// A TTL that does not parse means never stale (the Link's validation
    /// reports it).
    fn new(ttl: Option<&str>) -> Self {
        Staleness {
            ttl: ttl.and_then(|t| humantime::parse_duration(t).ok()),
            silent_since: None,
            stale: false,
        }
    }

    /// The remote failed to answer. True when this starts a silent period.
    fn failed(&mut self, now: Instant) -> bool {
        let starts = self.silent_since.is_none();
        self.silent_since.get_or_insert(now);
        starts
    }

    /// The remote answered. `Some(was_stale)` when this ends a silent period.
    fn answered(&mut self) -> Option<bool> {
        self.silent_since.take()?;
        Some(std::mem::take(&mut self.stale))
    }

    /// True once per silent period, when it has lasted the TTL.
    fn went_stale(&mut self, now: Instant) -> bool {
        let due = matches!((self.ttl, self.silent_since), (Some(ttl), Some(since)) if now.duration_since(since) >= ttl);
        let turns = due && !self.stale;
        self.stale |= turns;
        turns
    }

    fn is_stale(&self) -> bool {
        self.stale
    }

    /// How often a quiet Link is passed over again: often enough to retry
    /// failed writes and to notice the TTL soon after it passes.
    fn recheck(&self) -> Duration {
        let every = Duration::from_secs(10);
        self.ttl.map_or(every, |ttl| ttl.min(every) / 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_silent_remote_goes_stale_once_after_its_ttl_and_recovers_when_it_answers() {
        let t0 = Instant::now();
        let mut s = Staleness::new(Some("30s"));
        assert_eq!(
            s.answered(),
            None,
            "answering while answering changes nothing"
        );
        assert!(s.failed(t0), "the first failure starts a silent period");
        assert!(
            !s.failed(t0 + Duration::from_secs(5)),
            "later failures do not restart it"
        );
        assert!(!s.went_stale(t0 + Duration::from_secs(29)));
        assert!(s.went_stale(t0 + Duration::from_secs(30)));
        assert!(!s.went_stale(t0 + Duration::from_secs(40)), "decided once");
        assert!(s.is_stale());
        assert_eq!(s.answered(), Some(true));
        assert!(!s.is_stale());
        assert!(s.failed(t0 + Duration::from_secs(50)));
        assert_eq!(
            s.answered(),
            Some(false),
            "recovered before the TTL: never stale"
        );
    }

    #[test]
    fn without_a_ttl_a_remote_is_never_stale() {
        let t0 = Instant::now();
        let mut s = Staleness::new(None);
        s.failed(t0);
        assert!(!s.went_stale(t0 + Duration::from_secs(86_400)));
        assert_eq!(s.recheck(), Duration::from_secs(10));
        assert_eq!(Staleness::new(Some("4s")).recheck(), Duration::from_secs(2));
        assert_eq!(Staleness::new(Some("1h")).recheck(), Duration::from_secs(5));
    }
}
