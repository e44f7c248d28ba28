//! HTTP/1 callers' requests multiplexed between node proxies
//! (`--http1-tunnels=multiplexed`): HTTP/2 streams over one tunnel per caller
//! and endpoint, HTTP/1 again from the receiving proxy to the pod. Real
//! proxies on testenv nodes (root), the real issuer and API server.

use std::path::Path;

use strait_testenv::NetNode;
use strait_testenv::wait::eventually;

mod common;

use common::*;

/// Inbound tunnels the proxies on `nodes` have accepted.
async fn tunnels_accepted(nodes: &[NetNode]) -> f64 {
    let mut sum = 0.0;
    for node in nodes {
        let text = proxy_metrics(node).await;
        sum += metric_sum(&text, "tcp_open_total", &["direction=\"inbound\""]);
    }
    sum
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_callers_share_one_tunnel_per_endpoint_and_the_pod_still_sees_http1() {
    if !strait_testenv::net::root_or_skip("multiplexed HTTP/1 tunnels") {
        return;
    }
    let binary = Path::new(env!("CARGO_BIN_EXE_strait-proxy"));
    let mut mesh = start_mesh(2, binary).await;
    backend(&mut mesh, 1, "web-1", "web", &[]).await;
    add_client(&mut mesh, 0).await;
    service(&mesh.topology.cluster().client(), "web").await;
    let nodes = mesh.topology.nodes().to_vec();
    for proxy in &mut mesh.proxies {
        proxy.stop(std::time::Duration::from_secs(3));
    }
    mesh.proxies = nodes
        .iter()
        .map(|node| spawn_proxy_with(&mesh, node, binary, &["--http1-tunnels=multiplexed"]))
        .collect();
    for node in &nodes {
        proxy_ready(node).await;
    }
    let url = "http://web.shop.svc.cluster.local/hello";
    eventually("the service answers through the proxies", WAIT, || async {
        answered_by(&curl(&mesh, &[url]))
    })
    .await;

    // Sixty requests, twenty at a time, from twenty client connections: one
    // tunnel per worker thread of the sending proxy at most, where
    // per-connection tunnels take one per request in flight.
    let before = tunnels_accepted(&nodes[1..]).await;
    let urls: Vec<String> = (0..60).map(|i| format!("{url}/{i}")).collect();
    let mut args = vec![
        "--parallel",
        "--parallel-immediate",
        "--parallel-max",
        "20",
        "-H",
        "strait-client-id: spiffe://forged/ns/shop/sa/admin",
    ];
    args.extend(urls.iter().map(String::as_str));
    let out = curl(&mesh, &args);
    let answers: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON answer per line"))
        .collect();
    assert_eq!(
        answers.len(),
        60,
        "every request answered: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let caller = format!("spiffe://{}/ns/shop/sa/client", mesh.trust_domain);
    for a in &answers {
        assert_eq!(a["pod"], "web-1", "{a}");
        assert_eq!(
            a["version"], "HTTP/1.1",
            "the pod is spoken to in HTTP/1: {a}"
        );
        assert_eq!(a["headers"]["host"], "web.shop.svc.cluster.local", "{a}");
        assert_eq!(
            a["headers"]["strait-client-id"], caller,
            "the proven caller, never the caller's own value: {a}"
        );
    }
    let opened = tunnels_accepted(&nodes[1..]).await - before;
    assert!(
        opened <= 2.0,
        "60 requests, 20 at a time, opened {opened} tunnels: not multiplexed"
    );

    // Bodies both ways: a POST with a body of known length, and one sent
    // chunked (no length), each read whole by the pod.
    let big = "x".repeat(100_000);
    let out = curl(&mesh, &["-X", "POST", "--data-binary", &big, url]);
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("POST: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(answer["body_bytes"], 100_000, "{answer}");
    let out = curl(
        &mesh,
        &[
            "-X",
            "POST",
            "-H",
            "transfer-encoding: chunked",
            "--data-binary",
            "chunked body",
            url,
        ],
    );
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "chunked POST: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(answer["body_bytes"], 12, "{answer}");

    // Per-request metrics on both sides, by caller.
    let inbound = proxy_metrics(&nodes[1]).await;
    let served = metric_sum(
        &inbound,
        "request_total",
        &["direction=\"inbound\"", "src_workload=\"client\""],
    );
    assert!(
        served >= 62.0,
        "inbound counted {served} requests:\n{inbound}"
    );
}
