//! What a mirror should look like: pure functions from a remote Service, its
//! EndpointSlices and the Link to the local Service and EndpointSlice.

use std::collections::BTreeMap;

use crate::probe::GatewayEndpoint;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use strait_mesh::link::{LinkSpec, is_excluded};
use strait_mesh::names::{
    CLUSTER_NAME_LABEL, GATEWAY_IDENTITY_ANNOTATION, HEADLESS_OWNER_LABEL, MIRRORED_LABEL,
    REMOTE_FQ_NAME_ANNOTATION,
};

/// EndpointSlice label naming the controller that manages a slice.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "mirror.strait.dev";
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Labels the remote API server or controllers own; never copied.
const NEVER_COPIED: &[&str] = &[MIRRORED_LABEL, CLUSTER_NAME_LABEL, "strait.dev/exported"];

/// The local name of a mirror: `<service>-<cluster>`.
pub fn mirror_name(service: &str, cluster: &str) -> String {
    format!("{service}-{cluster}")
}

/// Local mirror Service for `remote` (ports only, no selector).
pub fn mirror_service(remote: &Service, link: &LinkSpec) -> Option<Service> {
    let meta = &remote.metadata;
    let (name, namespace) = (meta.name.as_ref()?, meta.namespace.as_ref()?);
    let cluster = &link.target_cluster_name;
    let mut labels: BTreeMap<String, String> = meta
        .labels
        .iter()
        .flatten()
        .filter(|(k, _)| {
            !NEVER_COPIED.contains(&k.as_str()) && !is_excluded(k, &link.excluded_labels)
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    labels.insert(MIRRORED_LABEL.into(), "true".into());
    labels.insert(CLUSTER_NAME_LABEL.into(), cluster.clone());
    let mut annotations: BTreeMap<String, String> = meta
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| {
            k.as_str() != "kubectl.kubernetes.io/last-applied-configuration"
                && !is_excluded(k, &link.excluded_annotations)
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    annotations.insert(
        REMOTE_FQ_NAME_ANNOTATION.into(),
        format!("{name}.{namespace}.svc.{}", link.target_cluster_domain),
    );
    let spec = remote.spec.as_ref()?;
    let ports: Vec<ServicePort> = spec
        .ports
        .iter()
        .flatten()
        .map(|p| ServicePort {
            name: p.name.clone(),
            port: p.port,
            protocol: p.protocol.clone(),
            app_protocol: p.app_protocol.clone(),
            // Traffic goes to the gateway; the remote target port is the gateway's business.
            ..Default::default()
        })
        .collect();
    let headless = spec.cluster_ip.as_deref() == Some("None");
    Some(Service {
        metadata: ObjectMeta {
            name: Some(mirror_name(name, cluster)),
            namespace: Some(namespace.clone()),
            labels: Some(labels),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(ports),
            cluster_ip: headless.then(|| "None".to_string()),
            type_: Some("ClusterIP".into()),
            ..Default::default()
        }),
        status: None,
    })
}

/// The slice ports of a mirror Service, each port number chosen by `port`.
fn endpoint_ports(
    mirror: &Service,
    port: impl Fn(&ServicePort) -> i32,
) -> Option<Vec<EndpointPort>> {
    Some(
        mirror
            .spec
            .as_ref()?
            .ports
            .iter()
            .flatten()
            .map(|p| EndpointPort {
                name: p.name.clone(),
                port: Some(port(p)),
                protocol: p.protocol.clone(),
                app_protocol: p.app_protocol.clone(),
            })
            .collect(),
    )
}

/// Whether any remote EndpointSlice of the service has a ready endpoint.
pub fn has_ready_endpoints(slices: &[&EndpointSlice]) -> bool {
    slices
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .any(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
}

/// The mirror's EndpointSlice: every gateway address with the gateway port for
/// each service port; an address is ready only if the remote service has ready
/// endpoints (`ready`) and that gateway address answers its probe.
pub fn mirror_endpoint_slice(
    mirror: &Service,
    link: &LinkSpec,
    gateways: &[GatewayEndpoint],
    ready: bool,
) -> Option<EndpointSlice> {
    let name = mirror.metadata.name.clone()?;
    let namespace = mirror.metadata.namespace.clone()?;
    // Every service port reaches the gateway on its one port.
    let ports = endpoint_ports(mirror, |_| i32::from(link.gateway_port))?;
    let endpoints: Vec<Endpoint> = gateways
        .iter()
        .filter(|g| g.ip.is_ipv4())
        .map(|g| {
            let ready = ready && g.alive;
            Endpoint {
                addresses: vec![g.ip.to_string()],
                conditions: Some(EndpointConditions {
                    ready: Some(ready),
                    serving: Some(ready),
                    terminating: Some(false),
                }),
                ..Default::default()
            }
        })
        .collect();
    let mut labels = BTreeMap::from([
        (SERVICE_NAME_LABEL.to_string(), name.clone()),
        (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        (MIRRORED_LABEL.to_string(), "true".to_string()),
        (
            CLUSTER_NAME_LABEL.to_string(),
            link.target_cluster_name.clone(),
        ),
    ]);
    labels.retain(|_, v| !v.is_empty());
    Some(EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(namespace),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([(
                GATEWAY_IDENTITY_ANNOTATION.to_string(),
                link.gateway_identity.clone(),
            )])),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: Some(endpoints),
        ports: Some(ports),
    })
}

/// A Service without a cluster IP (StatefulSets): mirrored per pod, as Linkerd does.
pub fn is_headless(remote: &Service) -> bool {
    remote.spec.as_ref().and_then(|s| s.cluster_ip.as_deref()) == Some("None")
}

/// Hostnames of the remote endpoints (StatefulSet pods) and whether each is ready.
pub fn remote_hostnames(slices: &[&EndpointSlice]) -> Vec<(String, bool)> {
    let mut seen: BTreeMap<String, bool> = BTreeMap::new();
    for e in slices.iter().flat_map(|s| s.endpoints.iter().flatten()) {
        if let Some(h) = &e.hostname {
            let ready = e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            *seen.entry(h.clone()).or_insert(false) |= ready;
        }
    }
    seen.into_iter().collect()
}

/// The per-pod mirror `<hostname>-<cluster>`: a ClusterIP Service whose
/// endpoints are the gateway, addressed to `<hostname>.<svc>.<ns>.svc.<domain>`.
pub fn endpoint_mirror_service(
    remote: &Service,
    hostname: &str,
    link: &LinkSpec,
) -> Option<Service> {
    let mut svc = mirror_service(remote, link)?;
    let (name, namespace) = (
        remote.metadata.name.clone()?,
        remote.metadata.namespace.clone()?,
    );
    let cluster = &link.target_cluster_name;
    svc.metadata.name = Some(mirror_name(hostname, cluster));
    svc.metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(HEADLESS_OWNER_LABEL.into(), mirror_name(&name, cluster));
    svc.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(
            REMOTE_FQ_NAME_ANNOTATION.into(),
            format!(
                "{hostname}.{name}.{namespace}.svc.{}",
                link.target_cluster_domain
            ),
        );
    if let Some(spec) = svc.spec.as_mut() {
        spec.cluster_ip = None;
    }
    Some(svc)
}

/// The headless mirror's slice: one endpoint per pod, addressed at its per-pod
/// mirror's cluster IP with the pod's hostname, so
/// `<pod>.<svc>-<cluster>.<ns>.svc.cluster.local` resolves.
pub fn headless_endpoint_slice(
    mirror: &Service,
    link: &LinkSpec,
    pods: &[(String, String, bool)],
) -> Option<EndpointSlice> {
    let mut slice = mirror_endpoint_slice(mirror, link, &[], false)?;
    slice.endpoints = Some(
        pods.iter()
            .map(|(hostname, ip, ready)| Endpoint {
                addresses: vec![ip.clone()],
                hostname: Some(hostname.clone()),
                conditions: Some(EndpointConditions {
                    ready: Some(*ready),
                    serving: Some(*ready),
                    terminating: Some(false),
                }),
                ..Default::default()
            })
            .collect(),
    );
    // Callers reach the per-pod mirrors on the service's own ports.
    slice.ports = Some(endpoint_ports(mirror, |p| p.port)?);
    Some(slice)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn link() -> LinkSpec {
        serde_json::from_value(json!({
            "targetClusterName": "west", "clusterCredentialsSecret": "s",
            "gatewayAddresses": ["10.0.0.9"], "gatewayIdentity": "spiffe://west/ns/strait-system/sa/strait-gateway",
            "excludedLabels": ["secret.example.com/*"], "excludedAnnotations": ["noisy"],
        }))
        .unwrap()
    }

    fn remote() -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "shop",
                "labels": {"app": "web", "strait.dev/exported": "true", "secret.example.com/owner": "x"},
                "annotations": {"noisy": "1", "keep": "2"}},
            "spec": {"clusterIP": "10.96.0.10", "selector": {"app": "web"},
                "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]},
        }))
        .unwrap()
    }

    #[test]
    fn mirror_service_copies_ports_and_filters_metadata() {
        let m = mirror_service(&remote(), &link()).unwrap();
        assert_eq!(m.metadata.name.as_deref(), Some("web-west"));
        let labels = m.metadata.labels.clone().unwrap();
        assert_eq!(labels.get("app").map(String::as_str), Some("web"));
        assert_eq!(labels.get(MIRRORED_LABEL).map(String::as_str), Some("true"));
        assert_eq!(
            labels.get(CLUSTER_NAME_LABEL).map(String::as_str),
            Some("west")
        );
        assert!(
            !labels.contains_key("secret.example.com/owner")
                && !labels.contains_key("strait.dev/exported")
        );
        let ann = m.metadata.annotations.clone().unwrap();
        assert_eq!(
            ann.get(REMOTE_FQ_NAME_ANNOTATION).map(String::as_str),
            Some("web.shop.svc.cluster.local")
        );
        assert!(ann.contains_key("keep") && !ann.contains_key("noisy"));
        let spec = m.spec.unwrap();
        assert!(spec.selector.is_none(), "mirrors have no selector");
        let port = &spec.ports.unwrap()[0];
        assert_eq!((port.port, port.target_port.is_none()), (80, true));
    }

    #[test]
    fn endpoint_slice_points_at_the_gateway_and_follows_its_liveness() {
        let gw = |ip: &str, alive| GatewayEndpoint {
            ip: ip.parse().unwrap(),
            alive,
        };
        let readiness = |s: &EndpointSlice| -> Vec<(String, Option<bool>)> {
            s.endpoints
                .iter()
                .flatten()
                .map(|e| {
                    (
                        e.addresses[0].clone(),
                        e.conditions.as_ref().and_then(|c| c.ready),
                    )
                })
                .collect()
        };
        let m = mirror_service(&remote(), &link()).unwrap();
        let gateways = [gw("10.0.0.9", true), gw("10.0.0.10", false)];
        let s = mirror_endpoint_slice(&m, &link(), &gateways, true).unwrap();
        assert_eq!(
            readiness(&s),
            vec![
                ("10.0.0.9".to_string(), Some(true)),
                ("10.0.0.10".to_string(), Some(false))
            ],
            "a dead gateway address is not ready, a live one is"
        );
        assert_eq!(s.ports.as_ref().unwrap()[0].port, Some(4143));
        assert_eq!(
            s.metadata.labels.as_ref().unwrap()[SERVICE_NAME_LABEL],
            "web-west"
        );
        let not_ready = mirror_endpoint_slice(&m, &link(), &gateways, false).unwrap();
        assert_eq!(
            readiness(&not_ready),
            vec![
                ("10.0.0.9".to_string(), Some(false)),
                ("10.0.0.10".to_string(), Some(false))
            ],
            "no ready remote endpoints: nothing is ready"
        );
    }
}
