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

/// Two nodes: the client pod on node 1, `web-1` (Service `web`) on node 2;
/// the proxies stopped and node 1's (and, with `both`, node 2's) started
/// again multiplexing HTTP/1.
async fn multiplexing_mesh(both: bool) -> (Mesh, Vec<NetNode>) {
    let binary = Path::new(env!("CARGO_BIN_EXE_strait-proxy"));
    let mut mesh = start_mesh(2, binary).await;
    backend(&mut mesh, 1, "web-1", "web", &[]).await;
    add_client(&mut mesh, 0).await;
    service(&mesh.topology.cluster().client(), "web").await;
    let nodes = mesh.topology.nodes().to_vec();
    for proxy in &mut mesh.proxies {
        proxy.stop(std::time::Duration::from_secs(3));
    }
    let restarted = if both { &nodes[..] } else { &nodes[..1] };
    mesh.proxies = restarted
        .iter()
        .map(|node| spawn_proxy_with(&mesh, node, binary, &["--http1-tunnels=multiplexed"]))
        .collect();
    for node in restarted {
        proxy_ready(node).await;
    }
    (mesh, nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_callers_share_one_tunnel_per_endpoint_and_the_pod_still_sees_http1() {
    if !strait_testenv::net::root_or_skip("multiplexed HTTP/1 tunnels") {
        return;
    }
    let (mesh, nodes) = multiplexing_mesh(true).await;
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

/// A node proxy of a version before multiplexing refuses the header's
/// critical field (`BadHeader`): the sender falls back to per-connection
/// tunnels to that node, and does not ask again for a while. The old
/// receiver is this test's own TLS server on node 2's proxy port, refusing
/// multiplexed tunnels as the old decoder does and splicing the others to
/// their pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_predates_multiplexing_gets_per_connection_tunnels() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use strait_mesh::identity::ca::LeafSigner;
    use strait_mesh::identity::tls::{self, TrustBundle};
    use strait_mesh::tunnel::{Protocol, ResponseStatus, TunnelHeader, TunnelResponse};

    if !strait_testenv::net::root_or_skip("multiplexed HTTP/1 tunnels, old receiver") {
        return;
    }
    let (mesh, nodes) = multiplexing_mesh(false).await;

    // The old node 2 proxy: it serves web-1's identity.
    let web: strait_mesh::identity::SpiffeId =
        format!("spiffe://{}/ns/shop/sa/web", mesh.trust_domain)
            .parse()
            .unwrap();
    let cert = LeafSigner::load(&mesh.issuer_pair, &mesh.anchor.cert_pem)
        .unwrap()
        .new_identity(&web, std::time::Duration::from_secs(3600))
        .unwrap();
    let bundle = TrustBundle::from_pem(mesh.anchor.cert_pem.as_bytes()).unwrap();
    let config = tls::server_config(&bundle, cert, &[strait_mesh::tunnel::TUNNEL_ALPN]).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::from_std(nodes[1].listen_tcp(4143).unwrap()).unwrap();
    let (refused, spliced) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (refused_count, spliced_count) = (refused.clone(), spliced.clone());
    let old_proxy = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, refused, spliced) = (acceptor.clone(), refused.clone(), spliced.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(header) =
                    TunnelHeader::read_from(&mut tls, std::time::Duration::from_secs(5)).await
                else {
                    return;
                };
                if header.protocol == Protocol::Http1Multiplexed {
                    // What a decoder without the field answers.
                    refused.fetch_add(1, Ordering::SeqCst);
                    let _ = TunnelResponse::refused(
                        ResponseStatus::BadHeader,
                        "header field 0x86 is critical and unknown: upgrade this proxy",
                    )
                    .write_to(&mut tls)
                    .await;
                    return;
                }
                let strait_mesh::tunnel::Target::Pod { addr } = header.target else {
                    return;
                };
                let Ok(mut pod) = tokio::net::TcpStream::connect(addr).await else {
                    return;
                };
                spliced.fetch_add(1, Ordering::SeqCst);
                let _ = TunnelResponse::ok().write_to(&mut tls).await;
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut pod).await;
            });
        }
    });

    let url = "http://web.shop.svc.cluster.local/hello";
    for i in 0..5 {
        let answer = answered_by(&curl(&mesh, &[&format!("{url}/{i}")]));
        assert_eq!(answer.as_deref(), Ok("web-1"), "request {i}");
    }
    assert_eq!(
        refused_count.load(Ordering::SeqCst),
        1,
        "asked once, then remembered"
    );
    assert!(spliced_count.load(Ordering::SeqCst) >= 1);
    old_proxy.abort();
}
