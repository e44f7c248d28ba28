//! Bounds on what pods and peers control, on real node proxies (testenv
//! nodes, root): a hung (SIGSTOPped) gateway or node proxy fails its callers
//! within a bound instead of holding them; a node proxy's pod identities
//! follow the pods of their ServiceAccount on the node.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::DeleteParams;
use strait_testenv::wait::eventually;

mod common;

use common::*;

/// `identity_refresh_total{result="ok"}` of the proxy on `node`.
async fn refreshes(mesh: &Mesh, node: usize) -> f64 {
    let text = proxy_metrics(&mesh.topology.nodes()[node]).await;
    metric_sum(&text, "identity_refresh_total", &["result=\"ok\""])
}

async fn delete_pod(mesh: &Mesh, name: &str) {
    let pods: Api<Pod> = Api::namespaced(mesh.topology.cluster().client(), "shop");
    pods.delete(name, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_identity_follows_the_pods_of_its_account_and_goes_with_the_last() {
    let Some(mut mesh) = small_mesh("0s").await else {
        return;
    };
    // `client` called first: the node proxy fetched the `client` account's
    // identity on its behalf. A second pod of the account on the same node.
    add_client_named(&mut mesh, 0, "client-2").await;
    let proxy = format!("http://{}:4140", mesh.topology.nodes()[0].ip());
    let series = format!(
        "identity=\"spiffe://{}/ns/shop/sa/client\"",
        mesh.trust_domain
    );
    let held = |text: &str| {
        metric_sum(
            text,
            "identity_cert_expiration_timestamp_seconds",
            &[&series],
        )
    };
    let before = refreshes(&mesh, 0).await;
    assert!(held(&proxy_metrics(&mesh.topology.nodes()[0]).await) > 0.0);

    // The pod it was fetched for leaves: the proxy fetches it again at once
    // for the other pod (the issuer would refuse a refresh naming the gone
    // one), instead of failing every refresh until the certificate expires.
    delete_pod(&mesh, "client").await;
    eventually(
        "the identity re-fetched for client-2",
        Duration::from_secs(10),
        || async {
            let now = refreshes(&mesh, 0).await;
            if now > before {
                Ok(())
            } else {
                Err(format!("identity_refresh_total{{result=ok}} still {now}"))
            }
        },
    )
    .await;
    let answered = answered_by(&curl_via(
        pod(&mesh, "client-2"),
        &proxy,
        &["http://web.shop/"],
    ));
    assert_eq!(answered.as_deref(), Ok("web-1"), "client-2 still calls");
    let text = proxy_metrics(&mesh.topology.nodes()[0]).await;
    assert_eq!(
        metric_sum(&text, "identity_refresh_total", &[]),
        metric_sum(&text, "identity_refresh_total", &["result=\"ok\""]),
        "no refresh failed: {text}"
    );

    // The last pod of the account leaves: the identity is dropped.
    delete_pod(&mesh, "client-2").await;
    eventually(
        "the client identity dropped",
        Duration::from_secs(10),
        || async {
            let text = proxy_metrics(&mesh.topology.nodes()[0]).await;
            if held(&text) == 0.0 {
                Ok(())
            } else {
                Err(
                    "identity_cert_expiration_timestamp_seconds still has the client account"
                        .to_string(),
                )
            }
        },
    )
    .await;
}

/// What a node proxy calling the mesh's gateway holds: the gateway's
/// identity, the trust bundle and a proxy certificate.
fn gateway_caller(
    mesh: &Mesh,
) -> (
    strait_mesh::identity::SpiffeId,
    strait_mesh::identity::tls::TrustBundle,
    std::sync::Arc<strait_mesh::identity::tls::CertSlot>,
) {
    let gateway_id = format!(
        "spiffe://{}/ns/strait-system/sa/strait-gateway",
        mesh.trust_domain
    )
    .parse()
    .unwrap();
    let bundle =
        strait_mesh::identity::tls::TrustBundle::from_pem(mesh.anchor.cert_pem.as_bytes()).unwrap();
    let (cert, _) = component_identity(mesh, "strait-proxy");
    (gateway_id, bundle, cert)
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid}");
}

/// What a hung gateway may cost a caller: a stream on a live connection
/// waits for the QUIC idle timeout (5 s after the last packet heard); a new
/// one for the QUIC handshake (2 s) raced by TCP from 0.5 s, whose TLS
/// handshake to a silent peer gives up after 5 s. ARCHITECTURE.md "Limits".
const HUNG_PEER_BOUND: Duration = Duration::from_millis(5_500);
/// Scheduling slack on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(1_500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_gateway_or_node_proxy_fails_its_callers_within_the_bound() {
    let Some(mut mesh) = small_mesh("0s").await else {
        return;
    };
    let (gw_pod, gw) = start_gateway(&mut mesh, 1, &[]).await;
    let gw_pid = gw.pid().unwrap();
    mesh.proxies.push(gw);
    let gw_addr = SocketAddr::new(IpAddr::V4(gw_pod.ip()), 4143);
    let (gateway_id, bundle, cert) = gateway_caller(&mesh);
    let connected =
        strait_mesh::tunnel::quic::GatewayClient::new(bundle.clone(), cert.clone()).unwrap();
    connected.probe(gw_addr, &gateway_id).await.unwrap();
    assert_eq!(connected.transport(gw_addr, &gateway_id), "quic");

    signal(gw_pid, "-STOP");
    // A caller with a live QUIC connection, and one that must connect anew
    // (QUIC times out, TCP connects to the stopped process's backlog, its
    // TLS handshake hears nothing).
    let fresh = strait_mesh::tunnel::quic::GatewayClient::new(bundle, cert).unwrap();
    let started = Instant::now();
    let (on_live, on_new) = tokio::join!(
        async {
            let r = connected.probe(gw_addr, &gateway_id).await;
            (r, started.elapsed())
        },
        async {
            let r = fresh.probe(gw_addr, &gateway_id).await;
            (r, started.elapsed())
        },
    );
    eprintln!(
        "MEASURED hung gateway: live connection failed after {:?}, new connection after {:?}",
        on_live.1, on_new.1
    );
    assert!(on_live.0.is_err(), "{:?}", on_live.0);
    assert!(on_new.0.is_err(), "{:?}", on_new.0);
    for (what, took) in [("live", on_live.1), ("new", on_new.1)] {
        assert!(
            took <= HUNG_PEER_BOUND + SLACK,
            "a {what} connection waited {took:?} for a hung gateway"
        );
    }
    signal(gw_pid, "-CONT");

    // A hung destination node proxy (node 2 serves lazy-1, not called yet:
    // no pooled tunnel there): the caller's proxy answers within the TLS
    // handshake bound instead of holding the request, and does not retry the
    // hung endpoint.
    let web_proxy = mesh.proxies[1].pid().unwrap();
    signal(web_proxy, "-STOP");
    let proxy = format!("http://{}:4140", mesh.topology.nodes()[0].ip());
    let started = Instant::now();
    let out = pod(&mesh, "client")
        .command("curl")
        .args([
            "-sS",
            "--max-time",
            "30",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .args(["-x", &proxy, "http://lazy.shop/"])
        .output()
        .expect("run curl in the pod");
    let took = started.elapsed();
    signal(web_proxy, "-CONT");
    let status = String::from_utf8_lossy(&out.stdout).to_string();
    eprintln!("MEASURED hung node proxy: answered {status} after {took:?}");
    assert!(status.starts_with('5'), "answered {status:?}");
    assert!(
        took <= strait_mesh::tunnel::client::TLS_HANDSHAKE_TIMEOUT + SLACK,
        "the caller waited {took:?} for a hung node proxy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_past_its_connection_limit_refuses_new_connections_and_counts_them() {
    let Some(mut mesh) = small_mesh("0s").await else {
        return;
    };
    let (gw_pod, gw) = start_gateway(&mut mesh, 1, &["--max-connections=2"]).await;
    mesh.proxies.push(gw);
    let gw_ip = IpAddr::V4(gw_pod.ip());
    let gw_addr = SocketAddr::new(gw_ip, 4143);
    let (gateway_id, bundle, cert) = gateway_caller(&mesh);
    let client =
        || strait_mesh::tunnel::quic::GatewayClient::new(bundle.clone(), cert.clone()).unwrap();
    // Two callers take both QUIC places; a third is refused on QUIC and
    // carried by the TCP fallback (its own limit).
    let (a, b, c) = (client(), client(), client());
    for caller in [&a, &b] {
        let (_, transport) = caller.probe(gw_addr, &gateway_id).await.unwrap();
        assert_eq!(transport, "quic");
    }
    let (_, transport) = c.probe(gw_addr, &gateway_id).await.unwrap();
    assert_eq!(transport, "tcp", "the third QUIC connection is refused");
    // TCP: the fallback holds one place, a silent connection the other; the
    // next is closed at once (not held for the 10 s handshake time-out).
    let _silent = tokio::net::TcpStream::connect(gw_addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut over = tokio::net::TcpStream::connect(gw_addr).await.unwrap();
    let mut buf = [0u8; 1];
    let closed = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::io::AsyncReadExt::read(&mut over, &mut buf),
    )
    .await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "a connection past the limit is closed at once: {closed:?}"
    );
    let text = strait_testenv::http_get(SocketAddr::new(gw_ip, 4191), "/metrics")
        .await
        .unwrap();
    for listener in ["quic", "tcp"] {
        assert!(
            metric_sum(
                &text,
                "listener_connections_refused_total",
                &[&format!("listener=\"{listener}\"")]
            ) >= 1.0,
            "{listener} refusals counted:\n{text}"
        );
    }
    assert_eq!(
        metric_sum(&text, "listener_connections", &["listener=\"quic\""]),
        2.0
    );
}
