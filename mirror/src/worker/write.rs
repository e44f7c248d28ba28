//! Write: server-side apply of mirrors under one field manager, only what
//! differs from what this worker last applied; deletion of mirrors no longer
//! wanted; marking a silent remote's endpoints not ready.

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, Resource, ResourceExt};
use strait_mesh::link::LinkSpec;
use strait_mesh::names::{CLUSTER_NAME_LABEL, MIRRORED_LABEL};

use super::diff::{Applied, Desired, Key, Written, key_of};
use super::status::Refusal;
use crate::config::LocalServices;
use crate::mirror;

pub use strait_mesh::names::{MIRROR_FIELD_MANAGER as FIELD_MANAGER, is_mirror_of};

/// How many remote Services are mirrored at once: an initial sync of
/// thousands is dominated by API round trips, not CPU.
pub(super) const APPLY_CONCURRENCY: usize = 16;

/// Where mirrors are written: the local API and what is known of its Services.
#[derive(Clone, Copy)]
pub(super) struct Local<'a> {
    pub client: &'a Client,
    pub services: &'a LocalServices,
}

/// Writes made while mirroring one remote Service, merged into [`Applied`]
/// once every Service of the pass is done (they run concurrently).
#[derive(Default)]
pub(super) struct Writes {
    services: Vec<(Key, Written, Option<String>)>,
    slices: Vec<(Key, Written)>,
}

impl Writes {
    pub fn merge_into(self, applied: &mut Applied) {
        for (key, written, ip) in self.services {
            if let Some(ip) = ip {
                applied.cluster_ips.insert(key.clone(), ip);
            }
            applied.services.insert(key, written);
        }
        for (key, written) in self.slices {
            applied.slices.insert(key, written);
        }
    }

    fn cluster_ip(&self, cache: &Applied, key: &Key) -> Option<String> {
        self.services
            .iter()
            .rev()
            .find(|(k, _, ip)| k == key && ip.is_some())
            .and_then(|(_, _, ip)| ip.clone())
            .or_else(|| cache.cluster_ips.get(key).cloned())
    }
}

/// Writes what one remote Service should look like here. Per-pod mirrors of
/// a headless Service go first: the headless mirror's endpoints are their
/// cluster IPs. A refused pod mirror does not stop the others.
pub(super) async fn write_desired(
    local: Local<'_>,
    spec: &LinkSpec,
    desired: Desired,
    cache: &Applied,
) -> (Result<(), Refusal>, Writes) {
    let mut writes = Writes::default();
    let result = match desired {
        Desired::Service { service, slice } => {
            apply(local, spec, &service, slice.as_ref(), cache, &mut writes).await
        }
        Desired::Headless { service, pods } => {
            let mut outcome = Ok(());
            let mut written = Vec::new();
            for pod in pods {
                let key = key_of(&pod.service);
                match apply(
                    local,
                    spec,
                    &pod.service,
                    pod.slice.as_ref(),
                    cache,
                    &mut writes,
                )
                .await
                {
                    Ok(()) => {
                        if let Some(ip) = writes.cluster_ip(cache, &key) {
                            written.push((pod.hostname, ip, pod.ready));
                        }
                    }
                    Err(e) => outcome = Err(e),
                }
            }
            let slice = mirror::headless_endpoint_slice(&service, spec, &written);
            apply(local, spec, &service, slice.as_ref(), cache, &mut writes)
                .await
                .and(outcome)
        }
    };
    (result, writes)
}

/// Applies a mirror Service and its slice where they differ from the cache,
/// only over objects that are this cluster's mirrors ([`is_mirror_of`]).
async fn apply(
    local: Local<'_>,
    spec: &LinkSpec,
    service: &Service,
    slice: Option<&EndpointSlice>,
    cache: &Applied,
    writes: &mut Writes,
) -> Result<(), Refusal> {
    let key = key_of(service);
    let (ns, name) = key.clone();
    let cluster = &spec.target_cluster_name;
    if let Some(hash) = cache.service_changed(&key, service) {
        // Never take over a Service that is not ours (the store may lag a
        // moment; the apply below refuses then too, see `apply_owned`).
        if let Some(existing) = local.services.get(&ObjectRef::new(&name).within(&ns))
            && !is_mirror_of(&existing.metadata, cluster)
        {
            return Err(Refusal::name_conflict("Service", &key, &existing.metadata));
        }
        let body = with_type_meta(service, "v1", "Service");
        let api = Api::<Service>::namespaced(local.client.clone(), &ns);
        let written = apply_owned(
            &api,
            &key,
            cluster,
            &body,
            cache.services.contains_key(&key),
        )
        .await
        .map_err(|e| match e {
            ApplyError::Api(kube::Error::Api(e)) if e.code == 404 => Refusal::NamespaceMissing {
                namespace: ns.clone(),
            },
            e => e.into_refusal("Service", &key),
        })?;
        let ip = written
            .spec
            .as_ref()
            .and_then(|s| s.cluster_ip.clone())
            .filter(|ip| ip != "None");
        writes
            .services
            .push((key.clone(), written_of(hash, &written), ip));
        tracing::debug!(service = %format!("{ns}/{name}"), "mirror service applied");
    }
    if let Some(slice) = slice
        && let Some(hash) = cache.slice_changed(&key, slice)
    {
        let body = with_type_meta(slice, "discovery.k8s.io/v1", "EndpointSlice");
        let api = Api::<EndpointSlice>::namespaced(local.client.clone(), &ns);
        let written = apply_owned(&api, &key, cluster, &body, cache.slices.contains_key(&key))
            .await
            .map_err(|e| e.into_refusal("EndpointSlice", &key))?;
        writes.slices.push((key, written_of(hash, &written)));
    }
    Ok(())
}

fn written_of<K: Resource>(hash: u64, object: &K) -> Written {
    let meta = object.meta();
    Written {
        hash,
        uid: meta.uid.clone().unwrap_or_default(),
        version: meta.resource_version.clone().unwrap_or_default(),
    }
}

enum ApplyError {
    /// The object exists and is not this cluster's mirror.
    NotOurs(Box<ObjectMeta>),
    Api(kube::Error),
}

impl ApplyError {
    fn into_refusal(self, kind: &'static str, key: &Key) -> Refusal {
        match self {
            ApplyError::NotOurs(meta) => Refusal::name_conflict(kind, key, &meta),
            ApplyError::Api(source) => Refusal::api(kind, key, source),
        }
    }
}

/// Server-side apply that takes fields over (`force`) only on this cluster's
/// mirrors. An object this worker never wrote is applied without force first:
/// a foreign object that sets different values answers 409, and is then
/// looked at; a hand-edited mirror of ours is then applied with force,
/// restoring it.
async fn apply_owned<K>(
    api: &Api<K>,
    (_, name): &Key,
    cluster: &str,
    body: &serde_json::Value,
    written_before: bool,
) -> Result<K, ApplyError>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if !written_before {
        let first = api
            .patch(
                name,
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Apply(body),
            )
            .await;
        match first {
            Ok(written) if is_mirror_of(written.meta(), cluster) => return Ok(written),
            // Applied beside someone else's fields, or refused by them: whose
            // it is decides.
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(ApplyError::Api(e)),
        }
        let existing = api.get_metadata(name).await.map_err(ApplyError::Api)?;
        if !is_mirror_of(&existing.metadata, cluster) {
            return Err(ApplyError::NotOurs(Box::new(existing.metadata)));
        }
    }
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(body),
    )
    .await
    .map_err(ApplyError::Api)
}

/// The label selector of `cluster`'s mirrors.
pub(super) fn mirrors_of(cluster: &str) -> String {
    format!("{MIRRORED_LABEL}=true,{CLUSTER_NAME_LABEL}={cluster}")
}

/// Marks every local mirror endpoint of `cluster` not ready, keeping the rest
/// of each slice. True when all were written.
pub(super) async fn mark_all_not_ready(local: &Client, cluster: &str) -> bool {
    let Ok(list) = Api::<EndpointSlice>::all(local.clone())
        .list(&ListParams::default().labels(&mirrors_of(cluster)))
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

/// Every local mirror Service of `cluster`, whoever applied it.
pub(super) async fn list_local_mirrors(local: &Client, cluster: &str) -> kube::Result<Vec<Key>> {
    let list = Api::<Service>::all(local.clone())
        .list_metadata(&ListParams::default().labels(&mirrors_of(cluster)))
        .await?;
    Ok(list
        .items
        .into_iter()
        .map(|m| (m.namespace().unwrap_or_default(), m.name_any()))
        .collect())
}

/// Deletes the mirror Service and EndpointSlice `ns/name` of `cluster`:
/// each only if it is this cluster's mirror ([`is_mirror_of`]), and only the
/// version looked at (uid and resourceVersion preconditions: a Service a
/// user put in its place meanwhile is not deleted). True when no mirror of
/// `cluster` is left under that name.
pub async fn delete_mirror(local: &Client, cluster: &str, ns: &str, name: &str) -> bool {
    let svc = delete_owned(
        &Api::<Service>::namespaced(local.clone(), ns),
        cluster,
        name,
    )
    .await;
    let slice = delete_owned(
        &Api::<EndpointSlice>::namespaced(local.clone(), ns),
        cluster,
        name,
    )
    .await;
    let ok = svc && slice;
    if ok {
        tracing::info!(service = %format!("{ns}/{name}"), "mirror removed");
    }
    ok
}

async fn delete_owned<K>(api: &Api<K>, cluster: &str, name: &str) -> bool
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let existing = match api.get_metadata_opt(name).await {
        Ok(Some(m)) => m.metadata,
        Ok(None) => return true,
        Err(e) => {
            tracing::debug!("reading {name} before deleting it: {e}");
            return false;
        }
    };
    if !is_mirror_of(&existing, cluster) {
        tracing::info!(
            object = %format!("{}/{name}", existing.namespace.unwrap_or_default()),
            "not a mirror of {cluster} (labels or field manager differ): left alone"
        );
        return true;
    }
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: existing.uid,
            resource_version: existing.resource_version,
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => true,
        Err(kube::Error::Api(e)) if e.code == 404 => true,
        // Changed or replaced since it was read: the next pass looks again.
        Err(e) => {
            tracing::debug!("deleting {name}: {e}");
            false
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    fn meta(labels: &[(&str, &str)], managers: &[&str]) -> ObjectMeta {
        ObjectMeta {
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            managed_fields: Some(
                managers
                    .iter()
                    .map(|m| ManagedFieldsEntry {
                        manager: Some(m.to_string()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn a_mirror_is_ours_only_with_our_labels_for_this_cluster_and_our_field_manager() {
        let ours = [(MIRRORED_LABEL, "true"), (CLUSTER_NAME_LABEL, "west")];
        assert!(is_mirror_of(
            &meta(&ours, &[FIELD_MANAGER, "kubectl-edit"]),
            "west"
        ));
        assert!(
            !is_mirror_of(&meta(&ours, &[FIELD_MANAGER]), "east"),
            "another cluster's mirror"
        );
        assert!(
            !is_mirror_of(&meta(&ours, &["kubectl-create"]), "west"),
            "dressed as a mirror, never written by Strait"
        );
        assert!(
            !is_mirror_of(
                &meta(&[(CLUSTER_NAME_LABEL, "west")], &[FIELD_MANAGER]),
                "west"
            ),
            "the mirror label removed by hand"
        );
        assert!(!is_mirror_of(&ObjectMeta::default(), "west"));
    }
}
