//! The gateway data path in one cluster (testenv nodes, root): a mirror
//! Service whose endpoint is the gateway, called from a pod on node 1 →
//! its node proxy → QUIC (or TCP + TLS when UDP is blocked) → the gateway →
//! the node proxy of a backend pod → the pod, which learns the caller's
//! identity. Real processes, real sockets, real certificates.

use std::path::Path;

use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use strait_testenv::http_get;
use strait_testenv::process::rss_kib;
use strait_testenv::wait::eventually;

mod common;

use common::*;

async fn gateway_metrics(pod: &strait_testenv::NetPod) -> String {
    http_get(
        std::net::SocketAddr::new(std::net::IpAddr::V4(pod.ip()), 4191),
        "/metrics",
    )
    .await
    .unwrap()
}

fn body(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirror_traffic_goes_through_the_gateway_over_quic_and_falls_back_to_tcp() {
    let Some(mut mesh) = mesh(Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await else {
        return;
    };
    let client = mesh.topology.cluster().client();
    export(&client, "web", true).await;
    let (gw_pod, gw) = start_gateway(&mut mesh, 2, &[]).await;
    mesh.proxies.push(gw);
    let gw_ip = std::net::IpAddr::V4(gw_pod.ip());
    mirror_service(&client, "web", "west", gw_ip, &mesh.trust_domain).await;
    mirror_service(&client, "slow", "west", gw_ip, &mesh.trust_domain).await;

    // UDP to the gateway blocked from the caller's node: QUIC cannot connect,
    // TCP + TLS carries the traffic.
    let node0 = mesh.topology.node(0).unwrap().clone();
    let block = [
        "-w", "-I", "OUTPUT", "-p", "udp", "--dport", "4143", "-j", "DROP",
    ];
    let out = node0.command("iptables").args(block).output().unwrap();
    assert!(out.status.success(), "{}", body(&out));
    let url = "http://web-west.shop.svc.cluster.local/cross";
    let first = eventually("the mirror answers through the gateway", WAIT, || async {
        let out = curl(&mesh, &[url]);
        answered_by(&out).map(|pod| (pod, body(&out)))
    })
    .await;
    assert!(first.0.starts_with("web-"), "{}", first.1);
    let v: serde_json::Value = serde_json::from_str(first.1.trim()).unwrap();
    assert_eq!(
        v["headers"]["strait-client-id"],
        format!("spiffe://{}/ns/shop/sa/client", mesh.trust_domain),
        "the pod learns the original caller, not the gateway: {v}"
    );
    let m = gateway_metrics(&gw_pod).await;
    assert!(
        metric_sum(&m, "gateway_connections_total", &["transport=\"tcp\""]) >= 1.0,
        "{m}"
    );
    assert_eq!(
        metric_sum(&m, "gateway_connections_total", &["transport=\"quic\""]),
        0.0,
        "{m}"
    );
    // The fallback multiplexes: more streams (each CONNECT is one), still
    // one TCP + TLS connection (HTTP/2 CONNECT inside it).
    let tcp_before = metric_sum(&m, "gateway_connections_total", &["transport=\"tcp\""]);
    let client_pod = pod(&mesh, "client");
    for i in 0..3 {
        let script = format!(
            "exec 3<>/dev/tcp/{}/4140; printf 'CONNECT web-west.shop:9000 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\nfallback-{i}\\n' >&3; timeout 2 cat <&3",
            client_pod.node().ip()
        );
        let out = client_pod
            .command("bash")
            .args(["-c", &script])
            .output()
            .unwrap();
        assert!(
            body(&out).contains(&format!("fallback-{i}")),
            "{}",
            body(&out)
        );
    }
    let m = gateway_metrics(&gw_pod).await;
    assert_eq!(
        metric_sum(&m, "gateway_connections_total", &["transport=\"tcp\""]),
        tcp_before,
        "three more streams, no new TCP connection: {m}"
    );
    assert!(
        metric_sum(&m, "gateway_streams_total", &["transport=\"tcp\""]) >= 4.0,
        "{m}"
    );

    // Unblocked: back to QUIC by itself (a background attempt after the backoff).
    let unblock = [
        "-w", "-D", "OUTPUT", "-p", "udp", "--dport", "4143", "-j", "DROP",
    ];
    let out = node0.command("iptables").args(unblock).output().unwrap();
    assert!(out.status.success(), "{}", body(&out));
    eventually("streams move back to QUIC", WAIT, || async {
        let out = curl(&mesh, &[url]);
        answered_by(&out)?;
        let m = gateway_metrics(&gw_pod).await;
        if metric_sum(
            &m,
            "gateway_streams_total",
            &["transport=\"quic\"", "src_workload=\"client\""],
        ) >= 1.0
        {
            Ok(())
        } else {
            Err("no QUIC stream yet".to_string())
        }
    })
    .await;

    // The probe through the tunnel itself (what the mirror controller's
    // gateway probe is to use): same QUIC path, header, answer; as a mirror
    // controller would, with its own certificate under the anchor.
    let (cert, bundle) = component_identity(&mesh, "strait-mirror");
    let prober = strait_mesh::tunnel::quic::GatewayClient::new(bundle, cert).unwrap();
    let gateway_id = format!(
        "spiffe://{}/ns/strait-system/sa/strait-gateway",
        mesh.trust_domain
    )
    .parse()
    .unwrap();
    let gw_addr = std::net::SocketAddr::new(gw_ip, 4143);
    let (rtt, transport) = prober.probe(gw_addr, &gateway_id).await.unwrap();
    assert_eq!(transport, "quic");
    let (again, _) = prober.probe(gw_addr, &gateway_id).await.unwrap();
    eprintln!("tunnel probe: first {rtt:?} (QUIC handshake included), then {again:?}");
    let m = gateway_metrics(&gw_pod).await;
    assert!(
        metric_sum(&m, "gateway_probes_total", &["transport=\"quic\""]) >= 2.0,
        "{m}"
    );
    // A gateway that is not the Link's gateway identity fails the probe.
    let wrong: strait_mesh::identity::SpiffeId = format!(
        "spiffe://{}/ns/strait-system/sa/impostor",
        mesh.trust_domain
    )
    .parse()
    .unwrap();
    assert!(prober.probe(gw_addr, &wrong).await.is_err());

    // Opaque TCP through CONNECT to the mirror's echo port.
    let client_pod = pod(&mesh, "client");
    let script = format!(
        "exec 3<>/dev/tcp/{}/4140; printf 'CONNECT web-west.shop:9000 HTTP/1.1\\r\\nHost: x\\r\\n\\r\\nhello-gateway\\n' >&3; timeout 3 cat <&3",
        client_pod.node().ip()
    );
    let out = client_pod
        .command("bash")
        .args(["-c", &script])
        .output()
        .unwrap();
    let text = body(&out);
    assert!(
        text.contains("200") && text.contains("hello-gateway"),
        "echo through the gateway: {text}"
    );

    // A Service that is not exported: refused at the gateway, saying why.
    let out = curl(&mesh, &["http://slow-west.shop.svc.cluster.local/"]);
    let text = body(&out);
    assert!(text.contains("not exported"), "{text}");

    // The Service's policy: only listed identities may call.
    let services: Api<Service> = Api::namespaced(client.clone(), "shop");
    let set_allowed = |value: serde_json::Value| {
        let services = services.clone();
        async move {
            services
                .patch(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"annotations": {
                        "strait.dev/allowed-identities": value}}})),
                )
                .await
                .unwrap();
        }
    };
    set_allowed(json!("spiffe://*/ns/shop/sa/someone-else")).await;
    let denied = eventually("the policy denies the client", WAIT, || async {
        let out = curl(&mesh, &[url]);
        let text = body(&out);
        if text.contains("not allowed") {
            Ok(text)
        } else {
            Err(text)
        }
    })
    .await;
    assert!(denied.contains("shop/sa/client"), "{denied}");
    let m = gateway_metrics(&gw_pod).await;
    assert!(
        metric_sum(&m, "gateway_denied_total", &["reason=\"policy\""]) >= 1.0,
        "{m}"
    );
    assert!(
        metric_sum(&m, "gateway_denied_total", &["reason=\"not-exported\""]) >= 1.0,
        "{m}"
    );
    set_allowed(json!("spiffe://*/ns/shop/sa/client")).await;
    eventually("the listed caller is let through", WAIT, || async {
        answered_by(&curl(&mesh, &[url]))
    })
    .await;
    mesh.pods.insert("gateway".into(), (gw_pod, None));
}

/// RSS the gateway (`pid`) holds per connection over `before`, once the
/// allocator has returned what the handshakes freed (its dirty pages decay
/// over ~10 s) and quinn's per-connection queues have settled (~20 s of
/// keep-alives): what `count` idle connections themselves hold.
async fn settled_per_connection(pid: u32, before: u64, count: usize, what: &str) -> u64 {
    tokio::time::sleep(std::time::Duration::from_secs(30)).await;
    let settled = rss_kib(pid);
    let each = (settled.saturating_sub(before) * 1024) / count as u64;
    eprintln!(
        "gateway RSS 30 s after {count} idle {what} connections: {settled} KiB ({before} KiB before): {each} bytes ({:.1} KiB) per connection",
        each as f64 / 1024.0
    );
    each
}

/// The gateway holds many idle QUIC connections (each a caller's node proxy),
/// and as many idle TCP fallback connections, with bounded memory per
/// connection. Counts, not timings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_holds_thousands_of_idle_quic_connections_with_bounded_memory() {
    let Some(mut mesh) = mesh(Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await else {
        return;
    };
    let count: usize = std::env::var("STRAIT_IDLE_CONNECTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        // 2 000 in CI (debug builds, 2 cores: ~10 ms per handshake pair);
        // the 10 000 of the issue with STRAIT_IDLE_CONNECTIONS=10000 and a
        // release gateway (a debug one, at full CPU through the burst, lets a
        // few dozen handshakes reach its time-out).
        .unwrap_or(2_000);
    // Each of the gateway's listeners holds at most --max-connections (8 192 by
    // default); this test holds `count` on each, plus the warm-up's.
    let max = format!("--max-connections={}", count + 1_000);
    let (gw_pod, gw) = start_gateway(&mut mesh, 2, &[&max]).await;
    let pid = gw.pid().unwrap();
    mesh.proxies.push(gw);
    let (cert, bundle) = component_identity(&mesh, "strait-proxy");
    let gateway_id: strait_mesh::identity::SpiffeId = format!(
        "spiffe://{}/ns/strait-system/sa/strait-gateway",
        mesh.trust_domain
    )
    .parse()
    .unwrap();
    let tls = strait_mesh::identity::tls::client_config(
        &bundle,
        cert,
        vec![gateway_id.clone()],
        &[strait_mesh::tunnel::TUNNEL_ALPN],
    )
    .unwrap();
    let client_config = strait_mesh::tunnel::quic::client_config(tls).unwrap();
    let gw_addr = std::net::SocketAddr::new(std::net::IpAddr::V4(gw_pod.ip()), 4143);
    let server_name = "strait-gateway.strait-system.identity.strait.internal";
    // Warm up (first connections allocate the gateway's shared state), then measure.
    let endpoint = strait_mesh::tunnel::quic::endpoint("0.0.0.0:0".parse().unwrap(), None).unwrap();
    let mut held = Vec::with_capacity(count + 16);
    for _ in 0..16 {
        held.push(
            endpoint
                .connect_with(client_config.clone(), gw_addr, server_name)
                .unwrap()
                .await
                .unwrap(),
        );
    }
    let before = rss_kib(pid);
    // Several client sockets: a realistic spread of source ports.
    let endpoints: Vec<_> = (0..8)
        .map(|_| strait_mesh::tunnel::quic::endpoint("0.0.0.0:0".parse().unwrap(), None).unwrap())
        .collect();
    let mut pending = futures::stream::FuturesUnordered::new();
    use futures::StreamExt;
    for i in 0..count {
        let connecting = endpoints[i % endpoints.len()]
            .connect_with(client_config.clone(), gw_addr, server_name)
            .unwrap();
        pending.push(connecting);
        // At most 64 handshakes in flight.
        while pending.len() >= 64 {
            held.push(pending.next().await.unwrap().unwrap());
        }
    }
    while let Some(c) = pending.next().await {
        held.push(c.unwrap());
    }
    // The server side finishes each handshake a moment after the client.
    eventually("the gateway accepted every connection", WAIT, || async {
        let m = gateway_metrics(&gw_pod).await;
        let accepted = metric_sum(&m, "gateway_connections_total", &["transport=\"quic\""]);
        if accepted >= (count + 16) as f64 {
            Ok(())
        } else {
            Err(format!("{accepted} of {}", count + 16))
        }
    })
    .await;
    let after = rss_kib(pid);
    eprintln!(
        "gateway RSS: {before} KiB before, {after} KiB with {count} more idle QUIC connections: {} bytes each",
        (after.saturating_sub(before) * 1024) / count as u64
    );
    let per_connection = settled_per_connection(pid, before, count, "QUIC").await;
    // Measured: ~40 KiB of RSS per connection after a burst of handshakes
    // (126 KiB before the stream limit started at 64 and grew on demand:
    // quinn keeps map entries for every stream a peer may open). The bound
    // catches that coming back, a leak or a per-connection buffer growing.
    assert!(
        per_connection < 64 * 1024,
        "{per_connection} bytes per idle QUIC connection"
    );

    // The TCP fallback: TLS with the multiplexing ALPN and an HTTP/2
    // connection on it, as a node proxy's fallback holds it, idle.
    let tcp_tls = std::sync::Arc::new(
        strait_mesh::identity::tls::client_config(
            &bundle,
            component_identity(&mesh, "strait-proxy").0,
            vec![gateway_id.clone()],
            &[strait_mesh::tunnel::quic::TUNNEL_H2_ALPN],
        )
        .unwrap(),
    );
    let accepted_tcp = async || {
        metric_sum(
            &gateway_metrics(&gw_pod).await,
            "gateway_connections_total",
            &["transport=\"tcp\""],
        )
    };
    let tcp_before_count = accepted_tcp().await;
    let before = rss_kib(pid);
    let server_name = strait_mesh::tunnel::server_name_for(&gateway_id);
    let open_tcp = || {
        let (tcp_tls, server_name) = (tcp_tls.clone(), server_name.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect(gw_addr).await.unwrap();
            let tls = tokio_rustls::TlsConnector::from(tcp_tls)
                .connect(server_name, tcp)
                .await
                .unwrap();
            let (sender, connection) =
                hyper::client::conn::http2::handshake::<_, _, http_body_util::Empty<bytes::Bytes>>(
                    hyper_util::rt::TokioExecutor::new(),
                    hyper_util::rt::TokioIo::new(tls),
                )
                .await
                .unwrap();
            (sender, tokio::spawn(connection))
        }
    };
    let mut held_tcp = Vec::with_capacity(count);
    let mut pending = futures::stream::FuturesUnordered::new();
    for _ in 0..count {
        pending.push(open_tcp());
        while pending.len() >= 64 {
            held_tcp.push(pending.next().await.unwrap());
        }
    }
    while let Some(c) = pending.next().await {
        held_tcp.push(c);
    }
    eventually(
        "the gateway accepted every TCP connection",
        WAIT,
        || async {
            let accepted = accepted_tcp().await - tcp_before_count;
            if accepted >= count as f64 {
                Ok(())
            } else {
                Err(format!("{accepted} of {count}"))
            }
        },
    )
    .await;
    let per_tcp = settled_per_connection(pid, before, count, "TCP+TLS (HTTP/2)").await;
    assert!(
        held_tcp.iter().all(|(_, c)| !c.is_finished()),
        "the gateway closed idle fallback connections"
    );
    assert!(
        per_tcp < 64 * 1024,
        "{per_tcp} bytes per idle TCP fallback connection"
    );
    drop(held_tcp);
    // Still serving: a probe through the tunnel answers.
    let (cert, bundle) = component_identity(&mesh, "strait-proxy");
    let prober = strait_mesh::tunnel::quic::GatewayClient::new(bundle, cert).unwrap();
    prober.probe(gw_addr, &gateway_id).await.unwrap();
    drop(held);
    mesh.pods.insert("gateway".into(), (gw_pod, None));
}
