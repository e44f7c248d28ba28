//! The EndpointSlices of a ClusterSetIP import's derived Service, one per
//! source cluster, as pure functions: this cluster's ready pods (copied from
//! the exported Service's own slices), and for each linked cluster its gateway
//! addresses, annotated with what the node proxy needs to tunnel there and
//! how many ready endpoints stand behind it. Only the local slice names the
//! derived Service for kube-proxy; the gateways' slices name it for the node
//! proxies alone ([`CLUSTERSET_SLICE_SERVICE_LABEL`]).

use std::collections::BTreeMap;

use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use strait_mesh::mcs::{LABEL_SERVICE_NAME, LABEL_SOURCE_CLUSTER, ServicePort};
use strait_mesh::names::{
    CLUSTERSET_SLICE_SERVICE_LABEL, GATEWAY_IDENTITY_ANNOTATION, REMOTE_FQ_NAME_ANNOTATION,
};

use crate::mirror::{MANAGED_BY_LABEL, SERVICE_NAME_LABEL};
use crate::probe::GatewayEndpoint;

/// `endpointslice.kubernetes.io/managed-by` of the slices written here (never
/// the Kubernetes controller's, as the MCS API asks).
pub const MANAGED_BY: &str = "mcs.strait.dev";
pub use strait_mesh::names::READY_ENDPOINTS_ANNOTATION;

/// A linked cluster as its slice needs it.
#[derive(Clone, Debug)]
pub struct RemoteView {
    pub cluster: String,
    pub gateways: Vec<GatewayEndpoint>,
    pub gateway_port: u16,
    pub gateway_identity: String,
    pub domain: String,
}

/// The slice name for `cluster`'s endpoints of a derived Service.
pub fn slice_name(derived: &str, cluster: &str) -> String {
    let mut name = format!("{derived}-{cluster}");
    name.truncate(253);
    name
}

fn meta(ns: &str, name: &str, derived: &str, cluster: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(slice_name(derived, cluster)),
        namespace: Some(ns.to_string()),
        labels: Some(BTreeMap::from([
            (SERVICE_NAME_LABEL.to_string(), derived.to_string()),
            (LABEL_SERVICE_NAME.to_string(), name.to_string()),
            (LABEL_SOURCE_CLUSTER.to_string(), cluster.to_string()),
            (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        ])),
        ..Default::default()
    }
}

/// This cluster's endpoints of the service: those of its own slices
/// (`service_slices`: the exported Service's, by the Kubernetes controller),
/// IPv4, with their conditions, on the pods' ports.
pub fn local_slice(
    ns: &str,
    name: &str,
    derived: &str,
    cluster: &str,
    service_slices: &[&EndpointSlice],
) -> EndpointSlice {
    let mut endpoints: Vec<Endpoint> = Vec::new();
    let mut ports: Vec<EndpointPort> = Vec::new();
    for slice in service_slices.iter().filter(|s| s.address_type == "IPv4") {
        for e in slice.endpoints.iter().flatten() {
            if !endpoints.iter().any(|x| x.addresses == e.addresses) {
                endpoints.push(Endpoint {
                    addresses: e.addresses.clone(),
                    conditions: e.conditions.clone(),
                    hostname: e.hostname.clone(),
                    node_name: e.node_name.clone(),
                    target_ref: e.target_ref.clone(),
                    zone: e.zone.clone(),
                    ..Default::default()
                });
            }
        }
        for p in slice.ports.iter().flatten() {
            if !ports.iter().any(|x| x.name == p.name) {
                ports.push(p.clone());
            }
        }
    }
    endpoints.sort_by(|a, b| a.addresses.cmp(&b.addresses));
    ports.sort_by(|a, b| a.name.cmp(&b.name));
    EndpointSlice {
        metadata: meta(ns, name, derived, cluster),
        address_type: "IPv4".into(),
        endpoints: Some(endpoints),
        ports: Some(ports),
    }
}

/// A Headless import's slice for `cluster`: that cluster's endpoints of the
/// exported Service (`service_slices`, its own slices there), with hostnames,
/// under the MCS labels only. No `kubernetes.io/service-name`: no Service
/// selects them (kube-proxy and the node proxies leave them alone); cluster
/// DNS answers the import's names from them.
pub fn headless_slice(
    ns: &str,
    name: &str,
    derived: &str,
    cluster: &str,
    service_slices: &[&EndpointSlice],
) -> EndpointSlice {
    let mut slice = local_slice(ns, name, derived, cluster, service_slices);
    if let Some(labels) = slice.metadata.labels.as_mut() {
        labels.remove(SERVICE_NAME_LABEL);
    }
    slice
}

/// How many ready endpoints `slices` (one Service's, in any cluster) hold.
pub fn ready_count(slices: &[&EndpointSlice]) -> usize {
    let mut ready: Vec<&Vec<String>> = slices
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
        .map(|e| &e.addresses)
        .collect();
    ready.sort();
    ready.dedup();
    ready.len()
}

/// A linked cluster's endpoint of the service: its gateway addresses on the
/// gateway port for every service port, ready when the gateway answers its
/// probe and the service has ready endpoints there (`ready`: `None` when
/// unknown, counted as ready).
pub fn remote_slice(
    ns: &str,
    name: &str,
    derived: &str,
    remote: &RemoteView,
    ports: &[ServicePort],
    ready: Option<usize>,
) -> EndpointSlice {
    let serving = ready != Some(0);
    let endpoints = remote
        .gateways
        .iter()
        .filter(|g| g.ip.is_ipv4())
        .map(|g| Endpoint {
            addresses: vec![g.ip.to_string()],
            conditions: Some(EndpointConditions {
                ready: Some(serving && g.alive),
                serving: Some(serving && g.alive),
                terminating: Some(false),
            }),
            ..Default::default()
        })
        .collect();
    let ports = ports
        .iter()
        .map(|p| EndpointPort {
            name: Some(p.name.clone()),
            port: Some(i32::from(remote.gateway_port)),
            protocol: p.protocol.clone(),
            app_protocol: p.app_protocol.clone(),
        })
        .collect();
    let mut metadata = meta(ns, name, derived, &remote.cluster);
    if let Some(labels) = metadata.labels.as_mut() {
        labels.remove(SERVICE_NAME_LABEL);
        labels.insert(CLUSTERSET_SLICE_SERVICE_LABEL.into(), derived.into());
    }
    let mut annotations = BTreeMap::from([
        (
            GATEWAY_IDENTITY_ANNOTATION.to_string(),
            remote.gateway_identity.clone(),
        ),
        (
            REMOTE_FQ_NAME_ANNOTATION.to_string(),
            format!("{name}.{ns}.svc.{}", remote.domain),
        ),
    ]);
    if let Some(n) = ready {
        annotations.insert(READY_ENDPOINTS_ANNOTATION.to_string(), n.to_string());
    }
    metadata.annotations = Some(annotations);
    EndpointSlice {
        metadata,
        address_type: "IPv4".into(),
        endpoints: Some(endpoints),
        ports: Some(ports),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(json: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_headless_slice_keeps_hostnames_and_names_no_service() {
        let theirs = slice(
            serde_json::json!({"addressType": "IPv4", "metadata": {"name": "db-x"},
            "endpoints": [{"addresses": ["10.244.2.7"], "hostname": "db-0", "conditions": {"ready": true}}],
            "ports": [{"name": "pg", "port": 5432, "protocol": "TCP"}]}),
        );
        let s = headless_slice("shop", "db", "derived-db", "west", &[&theirs]);
        let labels = s.metadata.labels.unwrap();
        assert_eq!(labels[LABEL_SERVICE_NAME], "db");
        assert_eq!(labels[LABEL_SOURCE_CLUSTER], "west");
        assert!(!labels.contains_key(SERVICE_NAME_LABEL), "{labels:?}");
        let endpoints = s.endpoints.unwrap();
        assert_eq!(endpoints[0].hostname.as_deref(), Some("db-0"));
        assert_eq!(endpoints[0].addresses, ["10.244.2.7"]);
        assert_eq!(s.ports.unwrap()[0].port, Some(5432));
    }

    #[test]
    fn the_local_slice_copies_the_services_endpoints_with_mcs_labels() {
        let a = slice(
            serde_json::json!({"addressType": "IPv4", "metadata": {"name": "web-abc"},
            "endpoints": [{"addresses": ["10.244.1.5"], "conditions": {"ready": true}, "nodeName": "n1"},
                          {"addresses": ["10.244.1.6"], "conditions": {"ready": false}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}),
        );
        let v6 = slice(
            serde_json::json!({"addressType": "IPv6", "metadata": {"name": "web-v6"},
            "endpoints": [{"addresses": ["fd00::5"]}]}),
        );
        let s = local_slice("shop", "web", "derived-x", "east", &[&a, &v6]);
        assert_eq!(s.metadata.name.as_deref(), Some("derived-x-east"));
        let labels = s.metadata.labels.unwrap();
        assert_eq!(labels[SERVICE_NAME_LABEL], "derived-x");
        assert_eq!(labels[LABEL_SERVICE_NAME], "web");
        assert_eq!(labels[LABEL_SOURCE_CLUSTER], "east");
        assert_eq!(labels[MANAGED_BY_LABEL], MANAGED_BY);
        let endpoints = s.endpoints.unwrap();
        assert_eq!(endpoints.len(), 2);
        assert_eq!(endpoints[0].node_name.as_deref(), Some("n1"));
        assert_eq!(s.ports.unwrap()[0].port, Some(8080));
        assert_eq!(
            ready_count(&[&a, &v6]),
            2,
            "one ready v4 and the v6 without conditions"
        );
    }

    #[test]
    fn a_remote_slice_points_at_its_gateway_and_says_what_is_behind_it() {
        let remote = RemoteView {
            cluster: "west".into(),
            gateways: vec![
                GatewayEndpoint {
                    ip: "172.18.0.3".parse().unwrap(),
                    alive: true,
                },
                GatewayEndpoint {
                    ip: "172.18.0.4".parse().unwrap(),
                    alive: false,
                },
            ],
            gateway_port: 4143,
            gateway_identity: "spiffe://west.clusterset.local/ns/strait-system/sa/strait-gateway"
                .into(),
            domain: "cluster.local".into(),
        };
        let ports = [ServicePort {
            name: "http".into(),
            protocol: Some("TCP".into()),
            app_protocol: None,
            port: 80,
        }];
        let s = remote_slice("shop", "web", "derived-x", &remote, &ports, Some(3));
        let annotations = s.metadata.annotations.clone().unwrap();
        assert_eq!(annotations[READY_ENDPOINTS_ANNOTATION], "3");
        assert_eq!(
            annotations[REMOTE_FQ_NAME_ANNOTATION],
            "web.shop.svc.cluster.local"
        );
        assert!(annotations[GATEWAY_IDENTITY_ANNOTATION].contains("west"));
        // For node proxies only: kube-proxy must not send plain TCP to a gateway.
        let labels = s.metadata.labels.clone().unwrap();
        assert!(!labels.contains_key(SERVICE_NAME_LABEL), "{labels:?}");
        assert_eq!(labels[CLUSTERSET_SLICE_SERVICE_LABEL], "derived-x");
        assert_eq!(labels[LABEL_SOURCE_CLUSTER], "west");
        let ready: Vec<_> = s
            .endpoints
            .unwrap()
            .iter()
            .map(|e| e.conditions.as_ref().unwrap().ready.unwrap())
            .collect();
        assert_eq!(ready, [true, false]);
        assert_eq!(s.ports.unwrap()[0].port, Some(4143));
        let none = remote_slice("shop", "web", "derived-x", &remote, &ports, Some(0));
        assert!(
            none.endpoints
                .unwrap()
                .iter()
                .all(|e| e.conditions.as_ref().unwrap().ready == Some(false))
        );
    }
}
