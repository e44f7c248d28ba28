//! Node proxies on testenv nodes (network namespaces, root): a pod on node 1
//! calls a service whose pods run on nodes 2 and 3, through its node's proxy,
//! over mutual TLS to the peer node proxies. Real processes, real sockets, the
//! real issuer and API server.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use strait_mesh::identity::SpiffeId;
use strait_mesh::tunnel::{Protocol, ResponseStatus, Target, TunnelHeader, TunnelResponse};
use strait_proxy::identity::{TUNNEL_ALPN, server_name_for};
use strait_testenv::NetNode;
use strait_testenv::wait::eventually;

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_calls_a_service_on_other_nodes_through_the_node_proxies_over_mtls() {
    let Some(mesh) = mesh(Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await else {
        return;
    };
    let url = "http://web.shop.svc.cluster.local/hello";

    // Absolute-form HTTP/1 (http_proxy): balanced per request over both pods.
    let first = eventually("the service answers through the proxies", WAIT, || async {
        answered_by(&curl(&mesh, &[url]))
    })
    .await;
    assert!(first.starts_with("web-"), "{first}");
    // Ten at a time (a sequential client would rightly stick to the faster pod):
    // requests in flight count as load, so both pods get a share.
    let urls: Vec<String> = (0..60).map(|i| format!("{url}/{i}")).collect();
    let mut args = vec!["--parallel", "--parallel-immediate", "--parallel-max", "10"];
    args.extend(urls.iter().map(String::as_str));
    let out = curl(&mesh, &args);
    let mut seen = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("one JSON answer per line");
        *seen
            .entry(v["pod"].as_str().unwrap_or("?").to_string())
            .or_insert(0) += 1;
    }
    assert_eq!(
        seen.values().sum::<i32>(),
        60,
        "every request answered: {seen:?}"
    );
    assert_eq!(
        seen.keys().cloned().collect::<Vec<_>>(),
        vec!["web-1".to_string(), "web-2".to_string()],
        "requests spread over the pods on both nodes: {seen:?}"
    );

    // Tunnels are pooled: a kept-alive client's requests share its tunnels,
    // and a new client connection takes the tunnels an earlier one left.
    // Without pooling these 30 requests would open 30 tunnels.
    let nodes = mesh.topology.nodes().to_vec();
    let tunnels_accepted = async || {
        let mut sum = 0.0;
        for node in &nodes[1..] {
            let text = proxy_metrics(node).await;
            sum += metric_sum(&text, "tcp_open_total", &["direction=\"inbound\""]);
        }
        sum
    };
    let before = tunnels_accepted().await;
    let urls: Vec<String> = (0..20).map(|i| format!("{url}/kept-alive/{i}")).collect();
    let out = curl(&mesh, &urls.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .matches("\"pod\"")
            .count(),
        20,
        "every kept-alive request answered: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for i in 0..10 {
        answered_by(&curl(&mesh, &[&format!("{url}/new-connection/{i}")])).unwrap();
    }
    let opened = tunnels_accepted().await - before;
    assert!(
        opened <= 4.0,
        "30 requests opened {opened} tunnels: pooled tunnels were not reused"
    );

    // CONNECT (any TCP): HTTP inside a CONNECT tunnel, and a short name.
    let out = curl(&mesh, &["-p", "http://web.shop:80/over-connect"]);
    assert!(
        answered_by(&out).is_ok(),
        "CONNECT: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A server-speaks-first protocol through CONNECT: the client sends nothing
    // after the tunnel is up, the banner must still arrive.
    let client = pod(&mesh, "client");
    let script = format!(
        "exec 3<>/dev/tcp/{}/4140; printf 'CONNECT web.shop:2525 HTTP/1.1\\r\\nHost: web.shop:2525\\r\\n\\r\\n' >&3; timeout 3 cat <&3",
        client.node().ip()
    );
    let out = client
        .command("bash")
        .args(["-c", &script])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("HTTP/1.1 200") && text.contains("220 web-"),
        "banner through CONNECT: {text:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A slow endpoint loses its share (peak-EWMA): slow-1 answers after 150 ms.
    let mut slow_hits = 0;
    for _ in 0..60 {
        if answered_by(&curl(&mesh, &["http://slow.shop/"])).unwrap() == "slow-1" {
            slow_hits += 1;
        }
    }
    assert!(
        slow_hits < 15,
        "the slow endpoint still got {slow_hits} of 60 requests"
    );

    // A failing endpoint (flaky-1 answers 503): its requests are retried elsewhere.
    // Ten at a time, so both endpoints get requests (one after another, a
    // client may rightly stick to flaky-2 and never meet the failure).
    let node1 = mesh.topology.nodes()[0].clone();
    let urls: Vec<String> = (0..30).map(|i| format!("http://flaky.shop/{i}")).collect();
    let mut args = vec!["--parallel", "--parallel-immediate", "--parallel-max", "10"];
    args.extend(["-w", "%{http_code}\n"]);
    for url in &urls {
        args.extend(["-o", "/dev/null", url.as_str()]);
    }
    let out = curl(&mesh, &args);
    let codes = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        codes.lines().filter(|c| *c == "200").count(),
        30,
        "every request to flaky answered 200 (retried past flaky-1): {codes}"
    );
    let metrics = proxy_metrics(&node1).await;
    assert!(
        metric_sum(&metrics, "retries_total", &[]) >= 1.0,
        "retries counted: {metrics}"
    );
    assert!(metric_sum(&metrics, "request_total", &["dst_workload=\"web\""]) >= 60.0);
    assert!(metric_sum(&metrics, "response_total", &["status_class=\"2xx\""]) >= 60.0);
    assert!(metric_sum(&metrics, "tcp_open_total", &["direction=\"outbound\""]) >= 2.0);

    // A Service's timeout (strait.dev/timeout: 200ms) cuts a 3 s answer short.
    let started = std::time::Instant::now();
    assert_eq!(curl_status(&mesh, "http://sleepy.shop/"), 504);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "the timeout did not apply: {:?}",
        started.elapsed()
    );

    // Everything failing (both broken pods answer 503): the budget stops the storm.
    let before = proxy_metrics(&node1).await;
    let started = std::time::Instant::now();
    let requests = 200;
    for _ in 0..requests {
        assert_eq!(curl_status(&mesh, "http://broken.shop/"), 503);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let after = proxy_metrics(&node1).await;
    let retries =
        metric_sum(&after, "retries_total", &[]) - metric_sum(&before, "retries_total", &[]);
    let exhausted = metric_sum(&after, "retry_budget_exhausted_total", &[])
        - metric_sum(&before, "retry_budget_exhausted_total", &[]);
    // 20 % of the requests plus 10/s (over the window, or the phase if longer).
    let allowed = 0.2 * f64::from(requests) + 10.0 * elapsed.max(10.0) + 5.0;
    assert!(
        retries <= allowed && exhausted > 0.0,
        "{retries} retries (allowed {allowed:.0}), budget exhausted {exhausted} times, in {elapsed:.1} s"
    );

    // The bytes between nodes are TLS: capture the cluster LAN during a request
    // and look for the request's path and the answer in clear.
    let pcap = mesh.dir.path().join("lan.pcap");
    let mut capture = mesh
        .topology
        .network()
        .lan_command("tcpdump")
        .args(["-i", "any", "-U", "-w"])
        .arg(&pcap)
        .args(["tcp", "port", "4143"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run tcpdump in the LAN namespace (package tcpdump)");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let marker = "find-me-in-the-capture-7f3a";
    for _ in 0..3 {
        answered_by(&curl(&mesh, &[&format!("{url}/{marker}")])).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = capture.kill();
    let _ = capture.wait();
    let bytes = std::fs::read(&pcap).expect("the capture file");
    assert!(
        bytes.len() > 2000,
        "the capture saw the traffic ({} bytes)",
        bytes.len()
    );
    let text = String::from_utf8_lossy(&bytes);
    assert!(
        !text.contains(marker) && !text.contains("\"pod\""),
        "plaintext between nodes"
    );
    // TLS 1.3 application data records: 0x17 0x03 0x03.
    assert!(
        bytes.windows(3).any(|w| w == [0x17, 0x03, 0x03]),
        "no TLS records in the capture"
    );
}

/// A client of its own (the test, with the `client` ServiceAccount's identity
/// from the issuer) talking to a node proxy's inbound port directly.
async fn inbound_attempt(
    mesh: &Mesh,
    node: &NetNode,
    server_id: &SpiffeId,
    target: SocketAddr,
) -> TunnelResponse {
    let (slot, bundle) = issued_identity(mesh, "shop", "client").await;
    let config = strait_mesh::identity::tls::client_config(
        &bundle,
        slot,
        vec![server_id.clone()],
        &[TUNNEL_ALPN],
    )
    .unwrap();
    let tcp = tokio::net::TcpStream::connect((node.ip(), 4143))
        .await
        .unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(server_name_for(server_id), tcp)
        .await
        .expect("mTLS with the node proxy");
    TunnelHeader::new(Target::pod(target).unwrap(), Protocol::Opaque)
        .write_to(&mut tls)
        .await
        .unwrap();
    TunnelResponse::read_from(&mut tls, Duration::from_secs(5))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbound_side_delivers_only_to_pods_on_its_own_node() {
    let Some(mesh) = mesh(Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await else {
        return;
    };
    let web: SpiffeId = format!("spiffe://{}/ns/shop/sa/web", mesh.trust_domain)
        .parse()
        .unwrap();
    let web1 = SocketAddr::new(IpAddr::V4(pod(&mesh, "web-1").ip()), 8080);
    let nodes = mesh.topology.nodes().to_vec();
    // web-1 runs on node 2 (index 1): node 3 must refuse it, node 2 deliver.
    let refused = inbound_attempt(&mesh, &nodes[2], &web, web1).await;
    assert_eq!(refused.status, ResponseStatus::NotFound, "{refused:?}");
    assert!(
        refused.message.contains(nodes[2].name()),
        "{}",
        refused.message
    );
    let delivered = inbound_attempt(&mesh, &nodes[1], &web, web1).await;
    assert!(delivered.is_ok(), "{delivered:?}");
}
