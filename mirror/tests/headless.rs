//! Headless Services against real API servers: east mirrors each of west's
//! pods as its own Service, so per-pod names resolve across clusters.

mod common;

use common::{WAIT, admin_kubeconfig, from_json, install_crd, link, mirror_slice};

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Service;
use kube::api::PostParams;
use kube::{Api, ResourceExt};
use serde_json::json;
use strait_testenv::Cluster;
use strait_testenv::wait::{eventually, until_exists};
use strait_testenv::workloads::{TestPod, create_node, create_ready_pod, ensure_namespace};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headless_services_get_per_pod_mirrors() {
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    let (ec, wc) = (east.client(), west.client());
    install_crd(&ec).await;
    ensure_namespace(&ec, "data").await.unwrap();
    ensure_namespace(&wc, "data").await.unwrap();
    create_node(&wc, "w-node-1", "10.20.0.1".parse().unwrap())
        .await
        .unwrap();
    Api::<Service>::namespaced(wc.clone(), "data")
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": "db", "labels": {"strait.dev/exported": "true"}},
                "spec": {"clusterIP": "None", "selector": {"app": "db"}, "ports": [{"name": "sql", "port": 5432}]}})),
        )
        .await
        .unwrap();
    for (i, ip) in ["10.244.9.10", "10.244.9.11"].iter().enumerate() {
        let pod = TestPod::new("data", &format!("db-{i}"), "w-node-1", ip.parse().unwrap())
            .with_label("app", "db")
            .with_hostname(&format!("db-{i}"), "db")
            .with_port("sql", 5432);
        create_ready_pod(&wc, &pod).await.unwrap();
    }
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), Default::default()));
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;

    let services: Api<Service> = Api::namespaced(ec.clone(), "data");
    let headless = until_exists("headless mirror db-west", WAIT, &services, "db-west").await;
    assert_eq!(
        headless.spec.as_ref().and_then(|s| s.cluster_ip.as_deref()),
        Some("None")
    );
    let mut pod_ips = BTreeMap::new();
    for pod in ["db-0", "db-1"] {
        let name = format!("{pod}-west");
        let svc = until_exists(&name, WAIT, &services, &name).await;
        assert_eq!(
            svc.annotations()
                .get("strait.dev/remote-svc-fq-name")
                .map(String::as_str),
            Some(format!("{pod}.db.data.svc.cluster.local").as_str())
        );
        assert_eq!(
            svc.labels()
                .get("strait.dev/headless-mirror-svc-name")
                .map(String::as_str),
            Some("db-west")
        );
        pod_ips.insert(pod.to_string(), svc.spec.unwrap().cluster_ip.unwrap());
        let slice = mirror_slice(&ec, "data", &name).await.unwrap();
        assert_eq!(
            slice.ports.as_ref().unwrap()[0].port,
            Some(4143),
            "per-pod mirrors point at the gateway"
        );
    }
    // What DNS needs for <pod>.db-west.data.svc.cluster.local: hostname → per-pod mirror IP.
    let slice = eventually("headless slice with both pods", WAIT, || async {
        let s = mirror_slice(&ec, "data", "db-west").await?;
        if s.endpoints.as_ref().map(Vec::len) == Some(2) {
            Ok(s)
        } else {
            Err(format!("{:?}", s.endpoints))
        }
    })
    .await;
    let got: BTreeMap<String, String> = slice
        .endpoints
        .unwrap()
        .into_iter()
        .map(|e| (e.hostname.unwrap_or_default(), e.addresses[0].clone()))
        .collect();
    assert_eq!(got, pod_ips);
    assert_eq!(slice.ports.as_ref().unwrap()[0].port, Some(5432));
    controller.abort();
}
