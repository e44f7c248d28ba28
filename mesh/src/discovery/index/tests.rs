//! The tables from hand-made objects: port resolution, readiness, routes.

use super::*;
use crate::discovery::model::{MirrorInfo, Route};
use crate::names::{
    CLUSTER_NAME_LABEL, CLUSTERSET_SLICE_SERVICE_LABEL, GATEWAY_IDENTITY_ANNOTATION,
    MIRRORED_LABEL, READY_ENDPOINTS_ANNOTATION, REMOTE_FQ_NAME_ANNOTATION,
};
use serde_json::json;

fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Arc<T> {
    Arc::new(serde_json::from_value(v).expect("test object"))
}

fn config() -> IndexConfig {
    IndexConfig {
        node_name: "node-a".into(),
        cluster_domain: "cluster.local".into(),
        trust_domain: "east.strait".into(),
        inbound_port: 4143,
        export_label: ("strait.dev/exported".into(), "true".into()),
    }
}

fn node(name: &str, ip: &str) -> Arc<Node> {
    obj(json!({"metadata": {"name": name},
        "status": {"addresses": [{"type": "Hostname", "address": name}, {"type": "InternalIP", "address": ip}]}}))
}

fn pod(name: &str, node: &str, ip: &str, sa: &str) -> Arc<Pod> {
    obj(json!({
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"nodeName": node, "serviceAccountName": sa, "containers": []},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True"}]},
    }))
}

fn service(name: &str, cluster_ip: &str, extra: serde_json::Value) -> Arc<Service> {
    let mut v = json!({
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
            "ports": [{"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP"},
                      {"name": "dns", "port": 53, "protocol": "UDP"}]},
    });
    merge(&mut v, extra);
    obj(v)
}

fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

/// A slice of `svc` with port `http` → `port`, endpoints (pod, ip, node, ready).
fn slice(
    svc: &str,
    name: &str,
    port: u16,
    eps: &[(&str, &str, &str, Option<bool>)],
) -> Arc<EndpointSlice> {
    let endpoints: Vec<_> = eps
        .iter()
        .map(|(pod, ip, node, ready)| {
            json!({"addresses": [ip], "nodeName": node, "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "namespace": "shop", "name": pod}})
        })
        .collect();
    obj(json!({
        "metadata": {"name": name, "namespace": "shop", "labels": {SERVICE_NAME_LABEL: svc}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }))
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn cluster() -> Snapshot {
    Snapshot::build(
        &config(),
        &[service(
            "web",
            "10.96.0.10",
            json!({"metadata": {"annotations": {OPAQUE_PORTS_ANNOTATION: "80"}}}),
        )],
        &[
            // A named targetPort that resolves differently per pod: two slices.
            slice(
                "web",
                "web-a",
                8080,
                &[
                    ("web-0", "10.244.1.2", "node-a", Some(true)),
                    ("web-1", "10.244.2.2", "node-b", None),
                ],
            ),
            slice(
                "web",
                "web-b",
                9090,
                &[
                    ("web-2", "10.244.3.2", "node-c", Some(true)),
                    ("web-3", "10.244.3.3", "node-c", Some(false)),
                ],
            ),
        ],
        &[
            pod("web-0", "node-a", "10.244.1.2", "web"),
            pod("web-1", "node-b", "10.244.2.2", "web"),
            pod("web-2", "node-c", "10.244.3.2", "web"),
            pod("web-3", "node-c", "10.244.3.3", "web"),
        ],
        &[
            node("node-a", "10.0.0.11"),
            node("node-b", "10.0.0.12"),
            node("node-c", "10.0.0.13"),
        ],
    )
}

#[test]
fn a_cluster_ip_resolves_to_ready_endpoints_via_their_node_proxies() {
    let snap = cluster();
    let dest = snap.resolve_addr(addr("10.96.0.10:80")).expect("service");
    assert_eq!(
        dest.service,
        Some(ServiceRef {
            namespace: "shop".into(),
            name: "web".into()
        })
    );
    assert_eq!(dest.fq_name.as_deref(), Some("web.shop.svc.cluster.local"));
    assert_eq!(
        dest.port,
        ServicePortRef {
            name: Some("http".into()),
            port: 80
        }
    );
    assert!(dest.opaque);
    let got: Vec<(SocketAddr, SocketAddr)> = dest
        .endpoints
        .iter()
        .map(|e| match &e.route {
            Route::NodeProxy { proxy, .. } => (e.addr, *proxy),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (addr("10.244.1.2:8080"), addr("10.0.0.11:4143")),
            (addr("10.244.2.2:8080"), addr("10.0.0.12:4143")),
            (addr("10.244.3.2:9090"), addr("10.0.0.13:4143")),
        ],
        "not-ready web-3 left out; unset `ready` counts as ready"
    );
    assert_eq!(
        dest.endpoints[0]
            .identity()
            .map(ToString::to_string)
            .as_deref(),
        Some("spiffe://east.strait/ns/shop/sa/web")
    );
    // UDP ports and unknown ports are not ours.
    assert!(snap.resolve_addr(addr("10.96.0.10:53")).is_none());
    assert!(snap.resolve_addr(addr("10.96.0.10:81")).is_none());
}

#[test]
fn names_resolve_in_every_form_to_the_same_destination() {
    let snap = cluster();
    let by_ip = snap.resolve_addr(addr("10.96.0.10:80")).unwrap();
    for host in [
        "web.shop",
        "web.shop.svc",
        "web.shop.svc.cluster.local",
        "WEB.shop.svc.cluster.local.",
    ] {
        let d = snap
            .resolve_name(host, 80)
            .unwrap_or_else(|| panic!("{host}"));
        assert!(Arc::ptr_eq(&d, &by_ip), "{host}");
    }
    assert!(
        snap.resolve_name("web.shop", 8080).is_none(),
        "a target port is not a service port"
    );
    assert!(snap.resolve_name("web.other", 80).is_none());
}

#[test]
fn pod_ips_resolve_to_that_pod_and_local_pod_is_only_this_node() {
    let snap = cluster();
    let d = snap.resolve_addr(addr("10.244.3.3:7000")).expect("pod IP");
    assert!(d.service.is_none());
    assert_eq!(
        d.endpoints.len(),
        1,
        "a pod called directly is used even when not ready"
    );
    assert_eq!(d.endpoints[0].addr, addr("10.244.3.3:7000"));
    assert!(snap.local_pod("10.244.1.2".parse().unwrap()).is_some());
    assert!(snap.local_pod("10.244.2.2".parse().unwrap()).is_none());
    assert!(snap.local_pod("10.99.99.99".parse().unwrap()).is_none());
    assert_eq!(snap.node_proxy("node-b"), Some(addr("10.0.0.12:4143")));
}

#[test]
fn host_network_pods_are_not_indexed_by_ip() {
    let mut p = (*pod("agent", "node-a", "10.0.0.11", "agent")).clone();
    p.spec.as_mut().unwrap().host_network = Some(true);
    let snap = Snapshot::build(
        &config(),
        &[],
        &[],
        &[Arc::new(p)],
        &[node("node-a", "10.0.0.11")],
    );
    assert!(snap.local_pod("10.0.0.11".parse().unwrap()).is_none());
}

#[test]
fn mirror_services_resolve_to_the_gateway_with_its_identity() {
    let mirror = service(
        "web-west",
        "10.96.0.20",
        json!({"metadata": {
            "labels": {MIRRORED_LABEL: "true", CLUSTER_NAME_LABEL: "west"},
            "annotations": {REMOTE_FQ_NAME_ANNOTATION: "web.shop.svc.cluster.local"}}}),
    );
    let mut gw = (*slice("web-west", "web-west", 4143, &[])).clone();
    gw.endpoints = Some(vec![
        serde_json::from_value(json!({"addresses": ["10.77.0.1"], "conditions": {"ready": true}}))
            .unwrap(),
    ]);
    let without_identity = gw.clone();
    gw.metadata.annotations = Some(BTreeMap::from([(
        GATEWAY_IDENTITY_ANNOTATION.to_string(),
        "spiffe://west.strait/ns/strait-system/sa/strait-gateway".to_string(),
    )]));
    let snap = Snapshot::build(
        &config(),
        std::slice::from_ref(&mirror),
        &[Arc::new(gw)],
        &[],
        &[],
    );
    let d = snap.resolve_addr(addr("10.96.0.20:80")).unwrap();
    assert_eq!(
        d.mirror,
        Some(MirrorInfo {
            cluster: "west".into(),
            remote_fq_name: "web.shop.svc.cluster.local".into()
        })
    );
    assert_eq!(
        d.endpoints.as_ref(),
        &[Endpoint {
            addr: addr("10.77.0.1:4143"),
            route: Route::Gateway {
                gateway: addr("10.77.0.1:4143"),
                identity: "spiffe://west.strait/ns/strait-system/sa/strait-gateway"
                    .parse()
                    .unwrap(),
                service: None,
            },
            weight: 1,
        }]
    );
    // Without a gateway identity the endpoint cannot be verified: none.
    let snap = Snapshot::build(
        &config(),
        &[mirror],
        &[Arc::new(without_identity)],
        &[],
        &[],
    );
    assert!(
        snap.resolve_addr(addr("10.96.0.20:80"))
            .unwrap()
            .endpoints
            .is_empty()
    );
}

/// A ClusterSetIP's derived Service (as the MCS controller writes it): the
/// clusterset name resolves to it, in DNS too; a linked cluster's slice routes
/// to its gateway asking for the Service the slice names; the affinity picks
/// which endpoints are offered, falling back to the others when none is ready.
#[test]
fn clusterset_services_resolve_by_their_clusterset_name_with_affinity() {
    let derived = |affinity: &str| {
        service(
            "derived-1b2ce43c8d2a78c4",
            "10.96.0.30",
            json!({"metadata": {
                "labels": {"app.kubernetes.io/managed-by": "strait-mirror",
                           "multicluster.kubernetes.io/service-name": "web"},
                "annotations": {"strait.dev/affinity": affinity}}}),
        )
    };
    let local = slice(
        "derived-1b2ce43c8d2a78c4",
        "derived-1b2ce43c8d2a78c4-east",
        8080,
        &[("web-0", "10.244.1.5", "node-a", Some(true))],
    );
    let mut remote = (*slice(
        "derived-1b2ce43c8d2a78c4",
        "derived-1b2ce43c8d2a78c4-west",
        4143,
        &[],
    ))
    .clone();
    remote.endpoints = Some(vec![
        serde_json::from_value(json!({"addresses": ["172.18.0.3"], "conditions": {"ready": true}}))
            .unwrap(),
    ]);
    // As the controller writes it: named for the node proxies, not kube-proxy.
    remote.metadata.labels = Some(BTreeMap::from([(
        CLUSTERSET_SLICE_SERVICE_LABEL.to_string(),
        "derived-1b2ce43c8d2a78c4".to_string(),
    )]));
    remote.metadata.annotations = Some(BTreeMap::from([
        (
            GATEWAY_IDENTITY_ANNOTATION.to_string(),
            "spiffe://west.strait/ns/strait-system/sa/strait-gateway".to_string(),
        ),
        (
            REMOTE_FQ_NAME_ANNOTATION.to_string(),
            "web.shop.svc.cluster.local".to_string(),
        ),
    ]));
    let remote = Arc::new(remote);
    let nodes = [node("node-a", "10.0.0.1")];
    let pods = [pod("web-0", "node-a", "10.244.1.5", "web")];
    let build = |affinity: &str, slices: &[Arc<EndpointSlice>]| {
        Snapshot::build(&config(), &[derived(affinity)], slices, &pods, &nodes)
    };
    let routes = |snap: &Snapshot| -> Vec<String> {
        let d = snap
            .resolve_name("Web.shop.svc.clusterset.local.", 80)
            .expect("the clusterset name resolves");
        assert_eq!(d.fq_name.as_deref(), Some("web.shop.svc.cluster.local"));
        d.endpoints
            .iter()
            .map(|e| match &e.route {
                Route::NodeProxy { pod, .. } => format!("pod {}", pod.name),
                Route::Gateway { service, .. } => {
                    format!("gateway for {}", service.clone().unwrap())
                }
                Route::Direct => "direct".into(),
            })
            .collect()
    };
    let both = [local.clone(), remote.clone()];
    assert_eq!(routes(&build("local", &both)), ["pod web-0"]);
    assert_eq!(
        routes(&build("remote", &both)),
        ["gateway for web.shop.svc.cluster.local"]
    );
    assert_eq!(routes(&build("none", &both)).len(), 2);
    // No local pod ready: local affinity falls back to the other clusters.
    let unready = slice(
        "derived-1b2ce43c8d2a78c4",
        "derived-1b2ce43c8d2a78c4-east",
        8080,
        &[("web-0", "10.244.1.5", "node-a", Some(false))],
    );
    assert_eq!(
        routes(&build("local", &[unready, remote.clone()])),
        ["gateway for web.shop.svc.cluster.local"]
    );
    let snap = build("local", &both);
    assert_eq!(
        snap.dns_lookup("web.shop.svc.clusterset.local"),
        Some(&["10.96.0.30".parse().unwrap()][..])
    );
    assert!(
        snap.resolve_name("web.shop.svc.cluster.local", 80)
            .is_none(),
        "not a local Service"
    );
    assert!(
        snap.resolve_name("other.shop.svc.clusterset.local", 80)
            .is_none()
    );
    // A linked cluster's gateway weighs its ready endpoints; pods weigh 1.
    let weights = |remote: &EndpointSlice| -> Vec<u32> {
        let slices = [local.clone(), Arc::new(remote.clone())];
        let snap = build("none", &slices);
        let d = snap
            .resolve_name("web.shop.svc.clusterset.local", 80)
            .unwrap();
        d.endpoints.iter().map(|e| e.weight).collect()
    };
    assert_eq!(weights(&remote), [1, 1], "no count: weight 1");
    let mut counted = (*remote).clone();
    counted
        .metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(READY_ENDPOINTS_ANNOTATION.into(), "5".into());
    assert_eq!(weights(&counted), [1, 5]);
    // Two gateway addresses share the count (rounded up).
    counted.endpoints.as_mut().unwrap().push(
        serde_json::from_value(json!({"addresses": ["172.18.0.4"], "conditions": {"ready": true}}))
            .unwrap(),
    );
    assert_eq!(weights(&counted), [1, 3, 3]);
}

/// The gateway serves a Service exported by label or by a ServiceExport (the
/// MCS controller's mark), and nothing else.
#[test]
fn services_are_exported_by_label_or_by_the_clusterset_mark() {
    let exported = |extra: serde_json::Value| {
        let snap = Snapshot::build(
            &config(),
            &[service("web", "10.96.0.10", extra)],
            &[],
            &[],
            &[],
        );
        snap.resolve_name("web.shop.svc.cluster.local", 80)
            .unwrap()
            .exported
    };
    assert!(!exported(json!({})));
    assert!(exported(
        json!({"metadata": {"labels": {"strait.dev/exported": "true"}}})
    ));
    assert!(exported(
        json!({"metadata": {"annotations": {"multicluster.strait.dev/exported": "true"}}})
    ));
    assert!(!exported(
        json!({"metadata": {"annotations": {"multicluster.strait.dev/exported": "false"}}})
    ));
}

#[test]
fn endpoints_without_a_pod_are_direct_and_unknown_nodes_are_skipped() {
    let mut external = (*slice("web", "ext", 8443, &[])).clone();
    external.endpoints = Some(vec![
        serde_json::from_value(json!({"addresses": ["192.0.2.7"]})).unwrap(),
    ]);
    let snap = Snapshot::build(
        &config(),
        &[service("web", "10.96.0.10", json!({}))],
        &[
            Arc::new(external),
            slice(
                "web",
                "pods",
                8080,
                &[("web-9", "10.244.9.2", "node-z", Some(true))],
            ),
        ],
        &[pod("web-9", "node-z", "10.244.9.2", "web")],
        &[],
    );
    let d = snap.resolve_addr(addr("10.96.0.10:80")).unwrap();
    assert_eq!(
        d.endpoints.as_ref(),
        &[Endpoint {
            addr: addr("192.0.2.7:8443"),
            route: Route::Direct,
            weight: 1,
        }]
    );
}

#[test]
fn slice_ports_match_by_service_port_name() {
    let s: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": "x"}, "addressType": "IPv4",
        "ports": [{"name": "", "port": 8080}, {"name": "grpc", "port": 9090, "protocol": "TCP"},
                  {"name": "dns", "port": 5353, "protocol": "UDP"}],
    }))
    .unwrap();
    assert_eq!(slice_port(&s, None), Some(8080));
    assert_eq!(slice_port(&s, Some("grpc")), Some(9090));
    assert_eq!(slice_port(&s, Some("dns")), None);
    assert_eq!(slice_port(&s, Some("http")), None);
}

#[test]
fn dns_names_answer_cluster_ips_or_headless_endpoints_and_nothing_else() {
    let snap = Snapshot::build(
        &config(),
        &[
            service("web", "10.96.0.10", json!({})),
            service("db", "None", json!({"spec": {"clusterIPs": null}})),
        ],
        &[slice(
            "db",
            "db-a",
            5432,
            &[
                ("db-1", "10.244.2.9", "node-b", Some(true)),
                ("db-0", "10.244.1.9", "node-a", None),
                ("db-2", "10.244.3.9", "node-c", Some(false)),
            ],
        )],
        &[],
        &[],
    );
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    assert_eq!(
        snap.dns_lookup("web.shop.svc.cluster.local"),
        Some(&[ip("10.96.0.10")][..])
    );
    assert_eq!(
        snap.dns_lookup("WEB.shop.svc.cluster.local."),
        Some(&[ip("10.96.0.10")][..])
    );
    // Headless: the ready endpoints, sorted; the not-ready one is left out.
    assert_eq!(
        snap.dns_lookup("db.shop.svc.cluster.local"),
        Some(&[ip("10.244.1.9"), ip("10.244.2.9")][..])
    );
    // Only the full form: short forms are the resolver's search list's job.
    assert_eq!(snap.dns_lookup("web.shop"), None);
    assert_eq!(snap.dns_lookup("web.shop.svc"), None);
    assert_eq!(snap.dns_lookup("web.shop.svc.other.domain"), None);
    assert_eq!(snap.dns_lookup("nope.shop.svc.cluster.local"), None);
    assert_eq!(snap.dns_lookup("a.web.shop.svc.cluster.local"), None);
}

#[test]
fn opaque_ports_come_from_the_pod_or_service_else_the_namespace_else_the_defaults() {
    let ns = |name: &str, ports: Option<&str>| -> Arc<Namespace> {
        let annotations = ports.map_or(json!({}), |p| json!({OPAQUE_PORTS_ANNOTATION: p}));
        obj(json!({"metadata": {"name": name, "annotations": annotations}}))
    };
    let mut annotated = (*pod("db-0", "node-a", "10.244.1.5", "db")).clone();
    annotated.metadata.annotations =
        Some([(OPAQUE_PORTS_ANNOTATION.to_string(), "7000".to_string())].into());
    let build = |namespaces: &[Arc<Namespace>]| {
        Snapshot::build_with(
            &config(),
            &[service("web", "10.96.0.10", json!({}))],
            &[],
            &[
                pod("web-0", "node-a", "10.244.1.2", "web"),
                Arc::new(annotated.clone()),
            ],
            &[node("node-a", "10.0.0.11")],
            namespaces,
        )
    };
    let opaque = |snap: &Snapshot, a: &str| snap.resolve_addr(addr(a)).unwrap().opaque;

    // No namespace list: Linkerd's defaults (3306 yes, 80 no) for pods and Services.
    let plain = build(&[ns("shop", None)]);
    assert!(opaque(&plain, "10.244.1.2:3306"));
    assert!(!opaque(&plain, "10.244.1.2:8080"));
    assert!(!opaque(&plain, "10.96.0.10:80"));
    // The pod's own list replaces the defaults (and the namespace's).
    assert!(opaque(&plain, "10.244.1.5:7000"));
    assert!(!opaque(&plain, "10.244.1.5:3306"));

    // The namespace's list replaces the defaults for its pods and Services.
    let listed = build(&[ns("shop", Some("80,8080"))]);
    assert!(opaque(&listed, "10.244.1.2:8080"));
    assert!(!opaque(&listed, "10.244.1.2:3306"));
    assert!(opaque(&listed, "10.96.0.10:80"));
    assert!(opaque(&listed, "10.244.1.5:7000"));
    assert!(!opaque(&listed, "10.244.1.5:8080"));
}

/// A node-proxy pod of `node` (strait-system, ServiceAccount strait-proxy).
fn proxy_pod(
    name: &str,
    node: &str,
    ip: &str,
    created: &str,
    ready: bool,
    deleting: bool,
) -> Arc<Pod> {
    let mut v = json!({
        "metadata": {"name": name, "namespace": "strait-system", "creationTimestamp": created},
        "spec": {"nodeName": node, "serviceAccountName": "strait-proxy", "containers": []},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    });
    if deleting {
        v["metadata"]["deletionTimestamp"] = json!("2026-12-04T10:00:00Z");
    }
    obj(v)
}

#[test]
fn tunnels_go_to_the_newest_ready_proxy_pod_of_the_node_else_the_node_address() {
    let nodes = [
        node("node-a", "10.0.0.11"),
        node("node-b", "10.0.0.12"),
        node("node-c", "10.0.0.13"),
    ];
    let web = [
        pod("web-0", "node-a", "10.244.1.2", "web"),
        pod("web-1", "node-b", "10.244.2.2", "web"),
        pod("web-2", "node-c", "10.244.3.2", "web"),
    ];
    let build = |proxies: &[Arc<Pod>]| {
        let pods: Vec<Arc<Pod>> = web.iter().cloned().chain(proxies.iter().cloned()).collect();
        Snapshot::build(&config(), &[], &[], &pods, &nodes)
    };
    // A rollout on node-a: the old proxy terminating, the new one Ready.
    // node-b: the new one not Ready yet, so the old one (newest Ready).
    // node-c: a pod that only looks like a proxy (wrong ServiceAccount).
    let mut impostor = (*pod("proxy-x", "node-c", "10.244.3.9", "strait-proxy")).clone();
    impostor.metadata.namespace = Some("shop".into());
    let snap = build(&[
        proxy_pod(
            "proxy-a-old",
            "node-a",
            "10.244.1.100",
            "2026-12-01T00:00:00Z",
            true,
            true,
        ),
        proxy_pod(
            "proxy-a-new",
            "node-a",
            "10.244.1.101",
            "2026-12-04T00:00:00Z",
            true,
            false,
        ),
        proxy_pod(
            "proxy-b-old",
            "node-b",
            "10.244.2.100",
            "2026-12-01T00:00:00Z",
            true,
            false,
        ),
        proxy_pod(
            "proxy-b-new",
            "node-b",
            "10.244.2.101",
            "2026-12-04T00:00:00Z",
            false,
            false,
        ),
        Arc::new(impostor),
    ]);
    assert_eq!(snap.node_proxy("node-a"), Some(addr("10.244.1.101:4143")));
    assert_eq!(snap.node_proxy("node-b"), Some(addr("10.244.2.100:4143")));
    assert_eq!(
        snap.node_proxy("node-c"),
        Some(addr("10.0.0.13:4143")),
        "no proxy pod: the node's address"
    );
    // Two Ready proxies (a surge): the newer one.
    let snap = build(&[
        proxy_pod(
            "proxy-b-old",
            "node-b",
            "10.244.2.100",
            "2026-12-01T00:00:00Z",
            true,
            false,
        ),
        proxy_pod(
            "proxy-b-new",
            "node-b",
            "10.244.2.101",
            "2026-12-04T00:00:00Z",
            true,
            false,
        ),
    ]);
    assert_eq!(snap.node_proxy("node-b"), Some(addr("10.244.2.101:4143")));
    let web1 = snap.pod("10.244.2.2".parse().unwrap()).unwrap();
    assert!(matches!(
        pod_route(&web1, &snap.node_proxies),
        Some(Route::NodeProxy { proxy, .. }) if proxy == addr("10.244.2.101:4143")
    ));
}
