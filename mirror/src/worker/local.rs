//! Local: this Link's mirrors as they are here, watched (metadata only,
//! selected by the labels Strait sets) so that one deleted or edited by
//! someone else is written again at once instead of at the next remote
//! change. This worker's own writes come back on the watch too: they carry
//! the uid and resourceVersion recorded in [`Applied`] and cause nothing.

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::mpsc;

use super::diff::{Applied, Key, Written};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Service,
    EndpointSlice,
}

/// A local mirror as the watch last saw it.
#[derive(Debug)]
pub(super) struct Seen {
    kind: Kind,
    key: Key,
    uid: String,
    /// `None`: deleted.
    version: Option<String>,
}

/// Watches `cluster`'s local mirrors until dropped.
pub(super) struct LocalMirrors {
    pub seen: mpsc::UnboundedReceiver<Seen>,
    _tasks: tokio::task::JoinSet<()>,
}

impl LocalMirrors {
    pub fn start(client: &Client, selector: &str) -> Self {
        let (tx, seen) = mpsc::unbounded_channel();
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(follow(
            Api::<PartialObjectMeta<Service>>::all(client.clone()),
            Kind::Service,
            selector.to_string(),
            tx.clone(),
        ));
        tasks.spawn(follow(
            Api::<PartialObjectMeta<EndpointSlice>>::all(client.clone()),
            Kind::EndpointSlice,
            selector.to_string(),
            tx,
        ));
        Self {
            seen,
            _tasks: tasks,
        }
    }

    /// Everything seen since the last call (without waiting).
    pub fn drain(&mut self, first: Seen) -> Vec<Seen> {
        let mut all = vec![first];
        while let Ok(s) = self.seen.try_recv() {
            all.push(s);
        }
        all
    }
}

async fn follow<K>(
    api: Api<PartialObjectMeta<K>>,
    kind: Kind,
    selector: String,
    tx: mpsc::UnboundedSender<Seen>,
) where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default + Clone + Eq + std::hash::Hash + Send + Sync,
{
    let stream = watcher(api, watcher::Config::default().labels(&selector)).default_backoff();
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        let (object, deleted) = match event {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => (o, false),
            Ok(watcher::Event::Delete(o)) => (o, true),
            Ok(_) => continue,
            Err(e) => {
                tracing::debug!("watching local mirrors: {e}");
                continue;
            }
        };
        let seen = Seen {
            kind,
            key: (object.namespace().unwrap_or_default(), object.name_any()),
            uid: object.uid().unwrap_or_default(),
            version: (!deleted).then(|| object.resource_version().unwrap_or_default()),
        };
        if tx.send(seen).is_err() {
            return;
        }
    }
}

/// Which of `seen` were someone else's doing, judged against what this
/// worker wrote. Objects this worker never wrote are not its business (a
/// full pass handles orphans). A version that is not the last one written
/// may just be an older write of this worker's arriving late: `verify`
/// reads the live version to decide.
pub(super) fn foreign(seen: Vec<Seen>, applied: &Applied) -> Vec<(Kind, Key, Option<String>)> {
    let mut out = Vec::new();
    for s in seen {
        let written = match s.kind {
            Kind::Service => applied.services.get(&s.key),
            Kind::EndpointSlice => applied.slices.get(&s.key),
        };
        let Some(Written { uid, version, .. }) = written else {
            continue;
        };
        if *uid != s.uid {
            // An older object of that name (deleted before this worker
            // wrote the current one): stale news.
            continue;
        }
        match &s.version {
            Some(v) if v == version => {}
            _ => out.push((s.kind, s.key, s.version)),
        }
    }
    out
}

/// Forgets the objects in `suspects` that are really not as this worker
/// wrote them, so the next pass writes them again. True when any was.
pub(super) async fn verify(
    client: &Client,
    suspects: Vec<(Kind, Key, Option<String>)>,
    applied: &mut Applied,
) -> bool {
    let mut any = false;
    for (kind, key, _) in suspects {
        let (ns, name) = (&key.0, &key.1);
        let live = match kind {
            Kind::Service => {
                live_version(Api::<Service>::namespaced(client.clone(), ns), name).await
            }
            Kind::EndpointSlice => {
                live_version(Api::<EndpointSlice>::namespaced(client.clone(), ns), name).await
            }
        };
        let map = match kind {
            Kind::Service => &mut applied.services,
            Kind::EndpointSlice => &mut applied.slices,
        };
        let ours = map
            .get(&key)
            .is_some_and(|w| live.as_ref() == Some(&(w.uid.clone(), w.version.clone())));
        if !ours {
            tracing::info!(kind = ?kind, mirror = %format!("{ns}/{name}"), "mirror deleted or edited by someone else: writing it again");
            map.remove(&key);
            any = true;
        }
    }
    any
}

/// The live object's (uid, resourceVersion); `None` when it is gone or
/// cannot be read (then it is written again: a no-op apply changes nothing).
async fn live_version<K>(api: Api<K>, name: &str) -> Option<(String, String)>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let meta: PartialObjectMeta<K> = api.get_metadata_opt(name).await.ok()??;
    Some((
        meta.uid().unwrap_or_default(),
        meta.resource_version().unwrap_or_default(),
    ))
}
