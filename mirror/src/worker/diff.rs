//! Diff: what the local mirrors of one remote Service should be, and whether
//! an object differs from what this worker last applied. Pure functions.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use strait_mesh::link::LinkSpec;

use crate::mirror;
use crate::probe::GatewayEndpoint;

/// A namespaced object's (namespace, name).
pub(super) type Key = (String, String);

/// The key of a namespaced object.
pub(super) fn key_of<K: ResourceExt>(object: &K) -> Key {
    (object.namespace().unwrap_or_default(), object.name_any())
}

/// One object this worker wrote: a hash of what it sent, and the identity
/// (uid) and version (resourceVersion) the API server gave it, which tell
/// this worker's own writes from someone else's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Written {
    pub hash: u64,
    pub uid: String,
    pub version: String,
}

/// What this worker last applied, by key.
#[derive(Default)]
pub(super) struct Applied {
    pub services: HashMap<Key, Written>,
    pub slices: HashMap<Key, Written>,
    /// Cluster IPs the API server gave our per-pod mirrors.
    pub cluster_ips: HashMap<Key, String>,
}

impl Applied {
    /// The hash of `service` when it differs from the last one applied.
    pub fn service_changed(&self, key: &Key, service: &Service) -> Option<u64> {
        changed(self.services.get(key).map(|w| &w.hash), service)
    }

    /// The hash of `slice` when it differs from the last one applied.
    pub fn slice_changed(&self, key: &Key, slice: &EndpointSlice) -> Option<u64> {
        changed(self.slices.get(key).map(|w| &w.hash), slice)
    }

    pub fn forget(&mut self, key: &Key) {
        self.services.remove(key);
        self.slices.remove(key);
        self.cluster_ips.remove(key);
    }
}

fn changed<T: serde::Serialize>(last: Option<&u64>, object: &T) -> Option<u64> {
    let hash = hash_of(object);
    (last != Some(&hash)).then_some(hash)
}

fn hash_of<T: serde::Serialize>(value: &T) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(value)
        .unwrap_or_default()
        .hash(&mut h);
    h.finish()
}

/// The local mirrors one remote Service should have. (One lives per Service
/// for one pass: its size does not matter.)
#[allow(clippy::large_enum_variant)]
pub(super) enum Desired {
    /// A mirror Service and its EndpointSlice (none when the Service has no
    /// ports to route).
    Service {
        service: Service,
        slice: Option<EndpointSlice>,
    },
    /// A headless mirror and one mirror Service per remote pod; the headless
    /// mirror's endpoints are the pod mirrors' cluster IPs, so its slice is
    /// built once those are written.
    Headless {
        service: Service,
        pods: Vec<PodMirror>,
    },
}

/// A per-pod mirror of a headless Service.
pub(super) struct PodMirror {
    pub hostname: String,
    pub service: Service,
    pub slice: Option<EndpointSlice>,
    pub ready: bool,
}

impl Desired {
    /// Every local object name this wants to exist.
    pub fn wanted(&self) -> Vec<Key> {
        match self {
            Desired::Service { service, .. } => vec![key_of(service)],
            Desired::Headless { service, pods } => std::iter::once(key_of(service))
                .chain(pods.iter().map(|p| key_of(&p.service)))
                .collect(),
        }
    }
}

/// What `remote` should look like here; `None` when it is not mirrored.
/// `stale` writes every endpoint not ready (the remote went silent).
pub(super) fn desired(
    remote: &Service,
    slices: &[Arc<EndpointSlice>],
    spec: &LinkSpec,
    gateways: &[GatewayEndpoint],
    stale: bool,
) -> Option<Desired> {
    let service = mirror::mirror_service(remote, spec)?;
    let slices: Vec<&EndpointSlice> = slices.iter().map(|s| s.as_ref()).collect();
    if !mirror::is_headless(remote) {
        let ready = mirror::has_ready_endpoints(&slices) && !stale;
        let slice = mirror::mirror_endpoint_slice(&service, spec, gateways, ready);
        return Some(Desired::Service { service, slice });
    }
    let pods = mirror::remote_hostnames(&slices)
        .into_iter()
        .filter_map(|(hostname, ready)| {
            let ready = ready && !stale;
            let service = mirror::endpoint_mirror_service(remote, &hostname, spec)?;
            let slice = mirror::mirror_endpoint_slice(&service, spec, gateways, ready);
            Some(PodMirror {
                hostname,
                service,
                slice,
                ready,
            })
        })
        .collect();
    Some(Desired::Headless { service, pods })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(name: &str, ip: &str) -> Service {
        let mut s = Service::default();
        s.metadata.name = Some(name.into());
        s.metadata.namespace = Some("default".into());
        s.spec = Some(k8s_openapi::api::core::v1::ServiceSpec {
            cluster_ip: Some(ip.into()),
            ..Default::default()
        });
        s
    }

    #[test]
    fn an_object_is_written_again_only_when_it_changed() {
        let key = ("default".to_string(), "web-west".to_string());
        let mut applied = Applied::default();
        let first = applied.service_changed(&key, &service("web-west", "10.0.0.1"));
        let hash = first.expect("never applied: changed");
        applied.services.insert(
            key.clone(),
            Written {
                hash,
                uid: "u1".into(),
                version: "1".into(),
            },
        );
        assert_eq!(
            applied.service_changed(&key, &service("web-west", "10.0.0.1")),
            None
        );
        assert!(
            applied
                .service_changed(&key, &service("web-west", "10.0.0.2"))
                .is_some()
        );
        applied.forget(&key);
        assert!(
            applied
                .service_changed(&key, &service("web-west", "10.0.0.1"))
                .is_some()
        );
    }
}
