//! The second way for a pod to reach its node's proxy: the `strait-proxy`
//! Service (deploy/proxy/service.yaml, `internalTrafficPolicy: Local`) as its
//! HTTP proxy. testenv has no kube-proxy, so `strait_testenv::kube_proxy`
//! installs in each calling pod's namespace the DNAT rules kube-proxy would;
//! what is under test is that the manifest selects the proxies, that
//! the Local policy keeps each pod on its own node's proxy, and that the proxy
//! serves and identifies a caller that arrives through a ClusterIP.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Output;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::ListParams;
use strait_testenv::kube_proxy::{PortTarget, ServiceRules, sync_service};
use strait_testenv::wait::eventually;
use strait_testenv::{NetNode, NetPod};

mod common;

use common::*;

const URL: &str = "http://web.shop.svc.cluster.local/";

/// Ready endpoints of the `strait-proxy` Service, as (address, node).
async fn proxy_endpoints(mesh: &Mesh) -> BTreeSet<(String, String)> {
    let slices =
        Api::<EndpointSlice>::namespaced(mesh.topology.cluster().client(), "strait-system")
            .list(&ListParams::default().labels("kubernetes.io/service-name=strait-proxy"))
            .await
            .unwrap();
    slices
        .items
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
        .map(|e| {
            (
                e.addresses[0].clone(),
                e.node_name.clone().unwrap_or_default(),
            )
        })
        .collect()
}

/// kube-proxy's rules for the `strait-proxy` Service, in `pod`'s namespace,
/// once they send it to `expected`.
async fn route_to_proxy(mesh: &Mesh, pod: &NetPod, expected: PortTarget) -> ServiceRules {
    let client = mesh.topology.cluster().client();
    eventually(
        &format!("kube-proxy rules for {} show {expected:?}", pod.name()),
        WAIT,
        || async {
            let rules = sync_service(&client, "strait-system", "strait-proxy", pod)
                .await
                .map_err(|e| e.to_string())?;
            if rules.ports.len() == 1 && rules.ports[0].target == expected {
                Ok(rules)
            } else {
                Err(format!("{rules:?}"))
            }
        },
    )
    .await
}

fn local(node: &NetNode) -> PortTarget {
    PortTarget::Endpoints(vec![std::net::SocketAddrV4::new(node.ip(), 4140)])
}

/// Outbound requests of SA `client` counted by each node's proxy.
async fn outbound_requests(mesh: &Mesh) -> Vec<f64> {
    let mut counts = Vec::new();
    for node in mesh.topology.nodes() {
        let metrics = proxy_metrics(node).await;
        counts.push(metric_sum(
            &metrics,
            "request_total",
            &["direction=\"outbound\"", "src_workload=\"client\""],
        ));
    }
    counts
}

/// Outbound TCP connections (CONNECT included) of SA `client` per node proxy.
async fn outbound_connections(mesh: &Mesh) -> Vec<f64> {
    let mut counts = Vec::new();
    for node in mesh.topology.nodes() {
        let metrics = proxy_metrics(node).await;
        counts.push(metric_sum(
            &metrics,
            "tcp_open_total",
            &["direction=\"outbound\"", "src_workload=\"client\""],
        ));
    }
    counts
}

fn deltas(before: &[f64], after: &[f64]) -> Vec<f64> {
    before.iter().zip(after).map(|(b, a)| a - b).collect()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `CONNECT web.shop:9000` through `proxy`, then the echo server's `WHOAMI`.
fn connect_whoami(pod: &NetPod, proxy: &std::net::Ipv4Addr) -> String {
    let script = format!(
        "exec 3<>/dev/tcp/{proxy}/4140 || exit 1
         printf 'CONNECT web.shop:9000 HTTP/1.1\\r\\nHost: web.shop:9000\\r\\n\\r\\n' >&3
         IFS= read -r -t 5 status <&3
         while IFS= read -r -t 5 line <&3 && [ -n \"${{line%$'\\r'}}\" ]; do :; done
         printf 'WHOAMI\\n' >&3
         IFS= read -r -t 5 who <&3
         echo \"${{status%$'\\r'}}|$who\""
    );
    let out = pod.command("bash").args(["-c", &script]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_reach_their_own_nodes_proxy_through_the_local_traffic_policy_service() {
    let Some(mut mesh) = mesh(Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await else {
        return;
    };
    let nodes: Vec<NetNode> = mesh.topology.nodes().to_vec();
    let service = Api::<Service>::namespaced(mesh.topology.cluster().client(), "strait-system")
        .get("strait-proxy")
        .await
        .unwrap();
    let spec = service.spec.unwrap();
    assert_eq!(spec.internal_traffic_policy.as_deref(), Some("Local"));
    let cluster_ip: std::net::Ipv4Addr = spec.cluster_ip.unwrap().parse().unwrap();
    let proxy = format!("http://{cluster_ip}:4140");

    // The manifest's selector picks the DaemonSet's pods: every node's proxy.
    let want: BTreeSet<(String, String)> = nodes
        .iter()
        .map(|n| (n.ip().to_string(), n.name().to_string()))
        .collect();
    eventually(
        "the strait-proxy Service lists every node proxy",
        WAIT,
        || async {
            let have = proxy_endpoints(&mesh).await;
            if have == want {
                Ok(())
            } else {
                Err(format!("{have:?}"))
            }
        },
    )
    .await;

    // Node 1's client: the ClusterIP leads to node 1's proxy only.
    let client = pod(&mesh, "client");
    route_to_proxy(&mesh, client, local(&nodes[0])).await;
    let first = eventually(
        "the service answers through the ClusterIP",
        WAIT,
        || async { answered_by(&curl_via(client, &proxy, &[URL])) },
    )
    .await;
    assert!(first.starts_with("web-"), "{first}");

    let before = outbound_requests(&mesh).await;
    let mut seen = BTreeSet::new();
    for i in 0..20 {
        let out = curl_via(client, &proxy, &[&format!("{URL}{i}")]);
        seen.insert(answered_by(&out).unwrap_or_else(|e| panic!("request {i}: {e}")));
    }
    let counted = deltas(&before, &outbound_requests(&mesh).await);
    assert_eq!(
        counted,
        vec![20.0, 0.0, 0.0],
        "node 1's proxy, and only it, handled the 20 requests"
    );
    assert!(
        seen.iter().all(|p| p == "web-1" || p == "web-2"),
        "answered by the pods on nodes 2 and 3: {seen:?}"
    );

    // CONNECT through the ClusterIP: the echo port, answered by a web pod.
    let before = outbound_connections(&mesh).await;
    let answer = connect_whoami(client, &cluster_ip);
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("|web-"),
        "CONNECT web.shop:9000 via {cluster_ip}: {answer:?}"
    );
    let opened = deltas(&before, &outbound_connections(&mesh).await);
    assert!(
        opened[0] >= 1.0 && opened[1] == 0.0 && opened[2] == 0.0,
        "the CONNECT went to node 1's proxy only: {opened:?}"
    );

    // The same ClusterIP from a pod on node 2 lands on node 2's proxy: the
    // destination depends on the caller's node (the Local policy), not on the IP.
    add_client_named(&mut mesh, 1, "client-node-2").await;
    let client2 = pod(&mesh, "client-node-2");
    route_to_proxy(&mesh, client2, local(&nodes[1])).await;
    eventually("node 2's proxy knows the new pod", WAIT, || async {
        answered_by(&curl_via(client2, &proxy, &[URL]))
    })
    .await;
    let before = outbound_requests(&mesh).await;
    for i in 0..5 {
        let out = curl_via(client2, &proxy, &[&format!("{URL}node-2/{i}")]);
        answered_by(&out).unwrap_or_else(|e| panic!("from node 2, request {i}: {e}"));
    }
    assert_eq!(
        deltas(&before, &outbound_requests(&mesh).await),
        vec![0.0, 5.0, 0.0],
        "node 2's proxy, and only it, handled the pod on node 2"
    );

    // No ready proxy on node 3: its pods' traffic is dropped, never sent to
    // another node's proxy (which would make that proxy see a caller not on
    // its node).
    add_client_named(&mut mesh, 2, "client-node-3").await;
    mark_proxy_ready(&mesh, &nodes[2], false).await;
    let client3 = pod(&mesh, "client-node-3");
    route_to_proxy(&mesh, client3, PortTarget::NoLocalEndpoints).await;
    let before = outbound_requests(&mesh).await;
    let out = client3
        .command("curl")
        .args(["-sS", "--max-time", "2", "-x", &proxy, URL])
        .output()
        .unwrap();
    assert!(
        !out.status.success() && out.stdout.is_empty(),
        "no local proxy, no answer: {} {}",
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
    assert_eq!(
        deltas(&before, &outbound_requests(&mesh).await),
        vec![0.0, 0.0, 0.0],
        "no proxy handled the dropped request"
    );
    // Back to Ready: the same pod now reaches node 3's proxy.
    mark_proxy_ready(&mesh, &nodes[2], true).await;
    route_to_proxy(&mesh, client3, local(&nodes[2])).await;
    eventually(
        "the pod on node 3 reaches its proxy again",
        WAIT,
        || async { answered_by(&curl_via(client3, &proxy, &[URL])) },
    )
    .await;
    assert_eq!(
        deltas(&before, &outbound_requests(&mesh).await)[..2],
        [0.0, 0.0],
        "node 3's pod never reached node 1's or node 2's proxy"
    );
}
