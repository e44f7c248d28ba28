//! Discovery against a real API server: nodes, pods, the real EndpointSlice
//! controller, and a hand-written mirror slice.

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;
use strait_proxy::discovery::{Destination, Discovery, DiscoveryConfig, Route};
use strait_testenv::Cluster;
use strait_testenv::wait::eventually;
use strait_testenv::workloads::{
    TestPod, create_node, create_ready_pod, ensure_namespace, set_pod_ready,
};

const WAIT: Duration = Duration::from_secs(30);

fn from_json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("test manifest")
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// (endpoint address, node proxy address) of every ready endpoint.
fn via_node_proxies(dest: &Destination) -> Result<Vec<(SocketAddr, SocketAddr)>, String> {
    dest.endpoints
        .iter()
        .map(|e| match &e.route {
            Route::NodeProxy { proxy, .. } => Ok((e.addr, *proxy)),
            other => Err(format!("{} routed {other:?}", e.addr)),
        })
        .collect()
}

async fn create<K>(client: &Client, ns: &str, v: serde_json::Value) -> K
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    Api::<K>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &from_json(v))
        .await
        .expect("create test object")
}

async fn cluster_ip(client: &Client, name: &str) -> String {
    let svc = Api::<Service>::namespaced(client.clone(), "shop")
        .get(name)
        .await
        .unwrap();
    svc.spec.unwrap().cluster_ip.unwrap()
}

/// Three nodes, web pods on each (the named target port is 8080 on two pods
/// and 9090 on the third), Service `web` (port 80 → targetPort `web`).
async fn shop(client: &Client) {
    for (i, node) in ["node-a", "node-b", "node-c"].iter().enumerate() {
        create_node(client, node, format!("10.0.0.{}", 11 + i).parse().unwrap())
            .await
            .unwrap();
    }
    ensure_namespace(client, "shop").await.unwrap();
    create::<ServiceAccount>(client, "shop", json!({"metadata": {"name": "web"}})).await;
    for (name, node, ip, port) in [
        ("web-0", "node-a", "10.244.1.2", 8080),
        ("web-1", "node-b", "10.244.2.2", 8080),
        ("web-2", "node-c", "10.244.3.2", 9090),
    ] {
        let pod = TestPod::new("shop", name, node, ip.parse().unwrap())
            .with_label("app", "web")
            .with_service_account("web")
            .with_port("web", port);
        create_ready_pod(client, &pod).await.unwrap();
    }
    create::<Service>(
        client,
        "shop",
        json!({"metadata": {"name": "web"}, "spec": {
            "selector": {"app": "web"},
            "ports": [{"name": "http", "port": 80, "targetPort": "web"}]}}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_follows_services_pods_nodes_and_mirrors() {
    let cluster = Cluster::start("east").await.expect("start cluster");
    let client = cluster.client();
    shop(&client).await;

    let mut config = DiscoveryConfig::new("node-a");
    config.trust_domain = "east.strait".into();
    let (discovery, run) = Discovery::start(client.clone(), config);
    let _task = tokio::spawn(run);
    tokio::time::timeout(WAIT, discovery.synced())
        .await
        .expect("discovery synced in time")
        .expect("discovery running");
    assert!(discovery.is_synced());

    // By ClusterIP: every ready pod, reached through its node's proxy.
    let ip = cluster_ip(&client, "web").await;
    let service_addr = addr(&format!("{ip}:80"));
    let want = vec![
        (addr("10.244.1.2:8080"), addr("10.0.0.11:4143")),
        (addr("10.244.2.2:8080"), addr("10.0.0.12:4143")),
        (addr("10.244.3.2:9090"), addr("10.0.0.13:4143")),
    ];
    let dest = eventually("web's three endpoints", WAIT, || async {
        let dest = discovery
            .resolve_addr(service_addr)
            .ok_or("web not resolved")?;
        let got = via_node_proxies(&dest)?;
        if got == want {
            Ok(dest)
        } else {
            Err(format!("endpoints {got:?}"))
        }
    })
    .await;
    assert_eq!(dest.port.name.as_deref(), Some("http"));
    assert_eq!(dest.fq_name.as_deref(), Some("web.shop.svc.cluster.local"));
    assert!(dest.mirror.is_none());
    for e in dest.endpoints.iter() {
        assert_eq!(
            e.identity().map(ToString::to_string).as_deref(),
            Some("spiffe://east.strait/ns/shop/sa/web"),
            "{e:?}"
        );
    }
    assert_eq!(
        discovery
            .pod_identity("10.244.3.2".parse().unwrap())
            .map(|id| id.to_string())
            .as_deref(),
        Some("spiffe://east.strait/ns/shop/sa/web")
    );

    // By name, in every form.
    for host in ["web.shop", "web.shop.svc", "web.shop.svc.cluster.local"] {
        let d = discovery
            .resolve_name(host, 80)
            .unwrap_or_else(|| panic!("{host} not resolved"));
        assert_eq!(via_node_proxies(&d).unwrap(), want, "{host}");
    }
    assert!(discovery.resolve_name("web.shop", 8080).is_none());

    // Inbound: only pods on this node.
    let local = discovery
        .local_pod("10.244.1.2".parse().unwrap())
        .expect("web-0 runs on node-a");
    assert_eq!(
        (local.name.as_str(), local.node.as_str()),
        ("web-0", "node-a")
    );
    assert!(discovery.local_pod("10.244.2.2".parse().unwrap()).is_none());
    assert!(discovery.local_pod("10.244.9.9".parse().unwrap()).is_none());

    // A pod IP called directly.
    let direct = discovery
        .resolve_addr(addr("10.244.2.2:8080"))
        .expect("pod IP");
    assert_eq!(
        via_node_proxies(&direct).unwrap(),
        vec![(addr("10.244.2.2:8080"), addr("10.0.0.12:4143"))]
    );

    // A pod turning not ready leaves the ready endpoints, and subscribers hear of it.
    let mut updates = discovery.updates();
    updates.mark_unchanged();
    set_pod_ready(
        &client,
        "shop",
        "web-1",
        "10.244.2.2".parse().unwrap(),
        Some("10.0.0.12".parse().unwrap()),
        false,
    )
    .await
    .unwrap();
    tokio::time::timeout(WAIT, updates.changed())
        .await
        .expect("a new snapshot")
        .unwrap();
    eventually("web-1 to leave the ready endpoints", WAIT, || async {
        let got = via_node_proxies(&discovery.resolve_addr(service_addr).unwrap())?;
        if got == vec![want[0], want[2]] {
            Ok(())
        } else {
            Err(format!("endpoints {got:?}"))
        }
    })
    .await;

    // A mirror: selectorless Service + a slice pointing at the remote gateway.
    create::<Service>(
        &client,
        "shop",
        json!({"metadata": {"name": "web-west",
                "labels": {"strait.dev/mirrored-service": "true", "strait.dev/cluster-name": "west"},
                "annotations": {"strait.dev/remote-svc-fq-name": "web.shop.svc.cluster.local"}},
            "spec": {"ports": [{"name": "http", "port": 80}]}}),
    )
    .await;
    create::<EndpointSlice>(
        &client,
        "shop",
        json!({"metadata": {"name": "web-west",
                "labels": {"kubernetes.io/service-name": "web-west",
                    "endpointslice.kubernetes.io/managed-by": "mirror.strait.dev"},
                "annotations": {"strait.dev/gateway-identity": "spiffe://west.strait/ns/strait-system/sa/strait-gateway"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 4143, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.77.0.1"], "conditions": {"ready": true}}]}),
    )
    .await;
    let mirror_addr = addr(&format!("{}:80", cluster_ip(&client, "web-west").await));
    let mirror = eventually("the mirror to resolve to the gateway", WAIT, || async {
        let d = discovery
            .resolve_addr(mirror_addr)
            .ok_or("mirror not resolved")?;
        if d.endpoints.is_empty() {
            return Err("no endpoints".to_string());
        }
        Ok(d)
    })
    .await;
    let m = mirror.mirror.as_ref().expect("a mirror");
    assert_eq!(
        (m.cluster.as_str(), m.remote_fq_name.as_str()),
        ("west", "web.shop.svc.cluster.local")
    );
    match &mirror.endpoints[..] {
        [e] => match &e.route {
            Route::Gateway {
                gateway, identity, ..
            } => {
                assert_eq!(*gateway, addr("10.77.0.1:4143"));
                assert_eq!(
                    identity.to_string(),
                    "spiffe://west.strait/ns/strait-system/sa/strait-gateway"
                );
            }
            other => panic!("mirror endpoint routed {other:?}"),
        },
        other => panic!("mirror endpoints {other:?}"),
    }
    let by_name = discovery.resolve_name("web-west.shop.svc.cluster.local", 80);
    assert!(matches!(by_name, Some(d) if d.mirror.is_some()));
}
