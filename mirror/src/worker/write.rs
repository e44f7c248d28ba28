//! Write: server-side apply of mirrors under one field manager, only what
//! differs from what this worker last applied; deletion of mirrors no longer
//! wanted; marking a silent remote's endpoints not ready.

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, ResourceExt};
use strait_mesh::link::LinkSpec;
use strait_mesh::names::{CLUSTER_NAME_LABEL, MIRRORED_LABEL};

use super::diff::{Applied, Desired, Key, key_of};
use super::status::Refusal;
use crate::config::LocalServices;
use crate::mirror;

/// Field manager of every write.
pub const FIELD_MANAGER: &str = "strait-mirror";

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
    services: Vec<(Key, u64, Option<String>)>,
    slices: Vec<(Key, u64)>,
}

impl Writes {
    pub fn merge_into(self, applied: &mut Applied) {
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
            apply(local, &service, slice.as_ref(), cache, &mut writes).await
        }
        Desired::Headless { service, pods } => {
            let mut outcome = Ok(());
            let mut written = Vec::new();
            for pod in pods {
                let key = key_of(&pod.service);
                match apply(local, &pod.service, pod.slice.as_ref(), cache, &mut writes).await {
                    Ok(()) => {
                        if let Some(ip) = writes.cluster_ip(cache, &key) {
                            written.push((pod.hostname, ip, pod.ready));
                        }
                    }
                    Err(e) => outcome = Err(e),
                }
            }
            let slice = mirror::headless_endpoint_slice(&service, spec, &written);
            apply(local, &service, slice.as_ref(), cache, &mut writes)
                .await
                .and(outcome)
        }
    };
    (result, writes)
}

/// Applies a mirror Service and its slice where they differ from the cache.
async fn apply(
    local: Local<'_>,
    service: &Service,
    slice: Option<&EndpointSlice>,
    cache: &Applied,
    writes: &mut Writes,
) -> Result<(), Refusal> {
    let key = key_of(service);
    let (ns, name) = key.clone();
    let params = PatchParams::apply(FIELD_MANAGER).force();
    if let Some(hash) = cache.service_changed(&key, service) {
        // Never take over a Service that is not ours.
        if !cache.owns(&key)
            && let Some(existing) = local.services.get(&ObjectRef::new(&name).within(&ns))
            && existing.labels().get(MIRRORED_LABEL).map(String::as_str) != Some("true")
        {
            return Err(Refusal::NameConflict {
                namespace: ns,
                name,
            });
        }
        let body = with_type_meta(service, "v1", "Service");
        match Api::<Service>::namespaced(local.client.clone(), &ns)
            .patch(&name, &params, &Patch::Apply(&body))
            .await
        {
            Ok(written) => {
                let ip = written
                    .spec
                    .and_then(|s| s.cluster_ip)
                    .filter(|ip| ip != "None");
                writes.services.push((key.clone(), hash, ip));
                tracing::debug!(service = %format!("{ns}/{name}"), "mirror service applied");
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {
                return Err(Refusal::NamespaceMissing { namespace: ns });
            }
            Err(source) => return Err(Refusal::api("Service", &key, source)),
        }
    }
    if let Some(slice) = slice
        && let Some(hash) = cache.slice_changed(&key, slice)
    {
        let body = with_type_meta(slice, "discovery.k8s.io/v1", "EndpointSlice");
        Api::<EndpointSlice>::namespaced(local.client.clone(), &ns)
            .patch(&name, &params, &Patch::Apply(&body))
            .await
            .map_err(|source| Refusal::api("EndpointSlice", &key, source))?;
        writes.slices.push((key, hash));
    }
    Ok(())
}

fn mirrors_of(cluster: &str) -> String {
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
