//! Shared by the mirror controller's integration tests.
#![allow(dead_code)]

use std::time::Duration;

use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, CustomResourceExt};
use serde_json::json;
use strait_mesh::link::Link;
use strait_testenv::wait::eventually;
use strait_testenv::workloads::{TestPod, create_node, create_ready_pod, ensure_namespace};
use strait_testenv::{Cluster, kubeconfig};

pub const WAIT: Duration = Duration::from_secs(30);

pub fn from_json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("test manifest")
}

pub async fn install_crd(client: &Client) {
    apply_crd(client, Link::crd()).await;
}

/// Applies `crd` and waits until the API server serves it (Established).
pub async fn apply_crd(client: &Client, crd: CustomResourceDefinition) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd.metadata.name.clone().expect("a named CRD");
    crds.patch(
        &name,
        &PatchParams::apply("test").force(),
        &Patch::Apply(crd),
    )
    .await
    .unwrap_or_else(|e| panic!("install the CRD {name}: {e}"));
    eventually(
        &format!("the CRD {name} to be established"),
        WAIT,
        || async {
            let crd = crds.get(&name).await.map_err(|e| e.to_string())?;
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                Ok(())
            } else {
                Err("not established".into())
            }
        },
    )
    .await;
}

/// A credentials Secret (when given a kubeconfig) and a Link named after `cluster_name`.
pub async fn link(local: &Client, cluster_name: &str, secret: Option<&str>) {
    link_with(local, cluster_name, secret, json!({})).await;
}

/// Like [`link`], with `spec` merged over the default spec.
pub async fn link_with(
    local: &Client,
    cluster_name: &str,
    secret: Option<&str>,
    spec: serde_json::Value,
) {
    ensure_namespace(local, "strait-multicluster")
        .await
        .unwrap();
    let secret_name = format!("cluster-credentials-{cluster_name}");
    if let Some(kc) = secret {
        let secrets: Api<Secret> = Api::namespaced(local.clone(), "strait-multicluster");
        secrets
            .create(
                &PostParams::default(),
                &from_json(
                    json!({"metadata": {"name": secret_name}, "stringData": {"kubeconfig": kc}}),
                ),
            )
            .await
            .unwrap();
    }
    let links: Api<Link> = Api::namespaced(local.clone(), "strait-multicluster");
    let mut manifest = json!({
        "apiVersion": "multicluster.strait.dev/v1alpha1", "kind": "Link",
        "metadata": {"name": cluster_name},
        "spec": {
            "targetClusterName": cluster_name,
            "clusterCredentialsSecret": secret_name,
            "gatewayAddresses": ["10.77.0.1", "10.77.0.2"],
            "gatewayIdentity": format!("spiffe://{cluster_name}.strait/ns/strait-system/sa/strait-gateway"),
            "excludedLabels": ["internal.example.com/*"],
        },
    });
    for (k, v) in spec.as_object().into_iter().flatten() {
        manifest["spec"][k] = v.clone();
    }
    links
        .create(&PostParams::default(), &from_json(manifest))
        .await
        .expect("create Link");
}

pub fn admin_kubeconfig(cluster: &Cluster) -> String {
    kubeconfig::to_yaml(cluster.kubeconfig()).unwrap()
}

pub async fn export_web(west: &Client, ns: &str) {
    ensure_namespace(west, ns).await.unwrap();
    create_node(west, "w-node-1", "10.20.0.1".parse().unwrap())
        .await
        .unwrap();
    let services: Api<Service> = Api::namespaced(west.clone(), ns);
    services
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": "web", "labels": {"app": "web", "strait.dev/exported": "true", "internal.example.com/team": "a"},
                             "annotations": {"docs": "yes"}},
                "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
            })),
        )
        .await
        .unwrap();
    create_ready_pod(
        west,
        &TestPod::new(ns, "web-0", "w-node-1", "10.244.9.1".parse().unwrap())
            .with_label("app", "web")
            .with_port("http", 8080),
    )
    .await
    .unwrap();
}

/// East and west running, the Link CRD in east, `shop/web` exported from west
/// with one ready pod.
pub async fn pair_with_web() -> (Cluster, Cluster) {
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    install_crd(&east.client()).await;
    ensure_namespace(&east.client(), "shop").await.unwrap();
    export_web(&west.client(), "shop").await;
    (east, west)
}

pub async fn mirror_slice(east: &Client, ns: &str, name: &str) -> Result<EndpointSlice, String> {
    Api::<EndpointSlice>::namespaced(east.clone(), ns)
        .get(name)
        .await
        .map_err(|e| e.to_string())
}

pub fn ready(slice: &EndpointSlice) -> Vec<bool> {
    slice
        .endpoints
        .iter()
        .flatten()
        .map(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false))
        .collect()
}

pub async fn condition(links: &Api<Link>, name: &str, type_: &str) -> Option<(String, String)> {
    let l = links.get(name).await.ok()?;
    l.status?
        .conditions
        .into_iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status, c.message))
}

/// An address of this machine that Kubernetes accepts in an EndpointSlice
/// (loopback is refused), for test servers standing in for a gateway.
pub fn routable_host_ip() -> std::net::IpAddr {
    let out = std::process::Command::new("ip")
        .args(["-o", "-4", "addr", "show", "scope", "global"])
        .output()
        .expect("run `ip` (package iproute2)");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .filter_map(|cidr| cidr.split('/').next()?.parse().ok())
        .next()
        .expect("this machine needs a non-loopback IPv4 address for the gateway tests")
}
