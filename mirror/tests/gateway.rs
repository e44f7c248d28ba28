//! The gateway side of mirroring: the mTLS probe that decides whether mirror
//! endpoints are ready, and gateway hostnames resolved (and re-resolved) with DNS.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use kube::Api;
use serde_json::json;
use strait_mesh::admin::{self, Readiness};
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::ca::{self, LeafSigner};
use strait_mesh::identity::tls::{self, TrustBundle};
use strait_mesh::link::Link;
use strait_mirror::probe::ProbeIdentity;
use strait_testenv::dns::TestDns;
use strait_testenv::wait::eventually;

use common::{
    WAIT, admin_kubeconfig, condition, link_with, mirror_slice, pair_with_web, ready,
    routable_host_ip,
};

const DAY: Duration = Duration::from_secs(24 * 3600);
const GATEWAY_ID: &str = "spiffe://west.strait/ns/strait-system/sa/strait-gateway";

struct Pki {
    bundle: TrustBundle,
    signer: LeafSigner,
}

fn pki() -> Pki {
    let (anchor, issuer) = ca::new_anchor_and_issuer("west", None, DAY).unwrap();
    Pki {
        bundle: TrustBundle::from_pem(anchor.cert_pem.as_bytes()).unwrap(),
        signer: LeafSigner::load(&issuer, &anchor.cert_pem).unwrap(),
    }
}

/// A gateway's admin server (the real one from strait-mesh) with mTLS as `id`.
async fn gateway_admin(pki: &Pki, id: &str, readiness: Readiness) -> std::net::SocketAddr {
    let ip = routable_host_ip();
    let cert = pki
        .signer
        .new_identity(&id.parse::<SpiffeId>().unwrap(), DAY)
        .unwrap();
    let config = tls::server_config(&pki.bundle, cert, &[b"http/1.1"]).unwrap();
    let registry = Arc::new(prometheus_client::registry::Registry::default());
    admin::spawn_with_tls(
        std::net::SocketAddr::new(ip, 0),
        readiness,
        registry,
        Some(Arc::new(config)),
    )
    .await
    .unwrap()
}

fn metrics_text(registry: &prometheus_client::registry::Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_probe_marks_mirror_endpoints_not_ready_and_restores_them() {
    strait_mesh::telemetry::init_test_tracing("strait_mirror=debug,warn");
    let (east, west) = pair_with_web().await;
    let ec = east.client();
    let pki = pki();
    let readiness = Readiness::default();
    readiness.set_ready(true);
    let gateway = gateway_admin(&pki, GATEWAY_ID, readiness.clone()).await;
    // The same trust anchor, another identity: a gateway impostor.
    let impostor_id = "spiffe://west.strait/ns/default/sa/not-the-gateway";
    let impostor = gateway_admin(&pki, impostor_id, readiness.clone()).await;

    let controller_id: SpiffeId = "spiffe://east.strait/ns/strait-multicluster/sa/strait-mirror"
        .parse()
        .unwrap();
    let metrics = strait_mirror::metrics::MirrorMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let config = strait_mirror::MirrorConfig {
        metrics,
        identity: Some(ProbeIdentity {
            bundle: pki.bundle.clone(),
            cert: pki.signer.new_identity(&controller_id, DAY).unwrap(),
        }),
        ..Default::default()
    };
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), config));
    let probe = |port: u16| json!({"path": "/ready", "port": port, "period": "200ms", "timeout": "1s", "failureThreshold": 2});
    link_with(
        &ec,
        "west",
        Some(&admin_kubeconfig(&west)),
        json!({"gatewayAddresses": [gateway.ip().to_string()], "gatewayIdentity": GATEWAY_ID, "probe": probe(gateway.port())}),
    )
    .await;
    let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
    let want = |name: &'static str, status: &'static str, slice_ready: bool| {
        let (ec, links) = (ec.clone(), links.clone());
        async move {
            eventually(name, WAIT, || async {
                let s = mirror_slice(&ec, "shop", "web-west").await?;
                let c = condition(&links, "west", "GatewayAlive").await;
                match (&c, ready(&s) == vec![slice_ready]) {
                    (Some((st, msg)), true) if st == status => Ok(msg.clone()),
                    _ => Err(format!(
                        "GatewayAlive {c:?}, endpoints ready {:?}",
                        ready(&s)
                    )),
                }
            })
            .await
        }
    };

    want("gateway alive, mirror ready", "True", true).await;
    let text = metrics_text(&registry);
    assert_eq!(metric(&text, "mirror_gateway_alive{"), Some(1.0), "{text}");
    assert!(
        metric(&text, "mirror_gateway_probe_latency_seconds_count{").unwrap_or(0.0) >= 1.0,
        "probe latency recorded: {text}"
    );

    // The gateway says it is not ready: after two failed probes the mirror's endpoints go.
    readiness.set_ready(false);
    let message = want("gateway down, mirror not ready", "False", false).await;
    assert!(message.contains("503"), "the condition says why: {message}");
    let text = metrics_text(&registry);
    assert_eq!(metric(&text, "mirror_gateway_alive{"), Some(0.0), "{text}");
    assert!(metric(&text, "mirror_gateway_probe_failures_total{").unwrap_or(0.0) >= 2.0);

    readiness.set_ready(true);
    want("gateway back, mirror ready again", "True", true).await;

    // A server with a valid certificate but the wrong identity is not the gateway.
    links
        .patch(
            "west",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"probe": probe(impostor.port())}})),
        )
        .await
        .unwrap();
    let message = want("impostor refused", "False", false).await;
    assert!(
        message.contains(impostor_id) || message.contains("not-the-gateway"),
        "the condition names the identity that was refused: {message}"
    );
    controller.abort();
}

/// A gateway's tunnel side as far as probes see it: QUIC with mTLS as `id`,
/// answering the probe target OK while `ready`, else refusing it.
async fn tunnel_gateway(
    pki: &Pki,
    id: &str,
    ready: Arc<std::sync::atomic::AtomicBool>,
) -> std::net::SocketAddr {
    use strait_mesh::tunnel::{ResponseStatus, TUNNEL_ALPN, TunnelHeader, TunnelResponse, quic};
    let cert = pki
        .signer
        .new_identity(&id.parse::<SpiffeId>().unwrap(), DAY)
        .unwrap();
    let config = tls::server_config(&pki.bundle, cert, &[TUNNEL_ALPN]).unwrap();
    let endpoint = quic::endpoint(
        std::net::SocketAddr::new(routable_host_ip(), 0),
        Some(quic::server_config(config).unwrap()),
    )
    .unwrap();
    let addr = endpoint.local_addr().unwrap();
    tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let ready = ready.clone();
            tokio::spawn(async move {
                let Ok(connection) = incoming.await else {
                    return;
                };
                while let Ok((mut send, mut recv)) = connection.accept_bi().await {
                    let ready = ready.clone();
                    tokio::spawn(async move {
                        let header =
                            TunnelHeader::read_from(&mut recv, Duration::from_secs(2)).await;
                        let is_probe = header.is_ok_and(|h| h == quic::probe_header());
                        let answer = if is_probe && ready.load(std::sync::atomic::Ordering::SeqCst)
                        {
                            TunnelResponse::ok()
                        } else {
                            TunnelResponse::refused(
                                ResponseStatus::TargetUnavailable,
                                "the gateway has not synced yet",
                            )
                        };
                        let _ = answer.write_to(&mut send).await;
                        let _ = send.finish();
                        let _ = send.stopped().await;
                    });
                }
            });
        }
    });
    addr
}

/// The default probe goes through the tunnel itself (the gateway port, QUIC):
/// what traffic takes, not the admin port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_probe_goes_through_the_tunnel() {
    strait_mesh::telemetry::init_test_tracing("strait_mirror=debug,strait_mesh=debug,warn");
    let (east, west) = pair_with_web().await;
    let ec = east.client();
    let pki = pki();
    let up = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let gateway = tunnel_gateway(&pki, GATEWAY_ID, up.clone()).await;
    let controller_id: SpiffeId = "spiffe://east.strait/ns/strait-multicluster/sa/strait-mirror"
        .parse()
        .unwrap();
    let metrics = strait_mirror::metrics::MirrorMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let config = strait_mirror::MirrorConfig {
        metrics,
        identity: Some(ProbeIdentity {
            bundle: pki.bundle.clone(),
            cert: pki.signer.new_identity(&controller_id, DAY).unwrap(),
        }),
        ..Default::default()
    };
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), config));
    // No probe port: it defaults to the gateway port, so the tunnel is probed.
    link_with(
        &ec,
        "west",
        Some(&admin_kubeconfig(&west)),
        json!({"gatewayAddresses": [gateway.ip().to_string()], "gatewayPort": gateway.port(),
               "gatewayIdentity": GATEWAY_ID,
               "probe": {"period": "200ms", "timeout": "1s", "failureThreshold": 2}}),
    )
    .await;
    let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
    let want = |name: &'static str, status: &'static str, slice_ready: bool| {
        let (ec, links) = (ec.clone(), links.clone());
        async move {
            eventually(name, WAIT, || async {
                let s = mirror_slice(&ec, "shop", "web-west").await?;
                let c = condition(&links, "west", "GatewayAlive").await;
                match (&c, ready(&s) == vec![slice_ready]) {
                    (Some((st, msg)), true) if st == status => Ok(msg.clone()),
                    _ => Err(format!(
                        "GatewayAlive {c:?}, endpoints ready {:?}",
                        ready(&s)
                    )),
                }
            })
            .await
        }
    };
    want("alive through the tunnel", "True", true).await;
    // The probe latency reaches the Link's status (for `strait gateways`).
    let latency = eventually("probe latency in the Link status", WAIT, || async {
        let l = links.get("west").await.map_err(|e| e.to_string())?;
        l.status
            .and_then(|s| s.gateway_latency)
            .filter(|l| l.samples >= 2)
            .ok_or_else(|| "not yet".to_string())
    })
    .await;
    assert!(
        latency.p50_ms > 0.0 && latency.p99_ms >= latency.p50_ms,
        "{latency:?}"
    );
    let text = metrics_text(&registry);
    assert!(
        metric(&text, "mirror_gateway_probe_latency_seconds_count{").unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    up.store(false, std::sync::atomic::Ordering::SeqCst);
    let message = want("the gateway refuses the probe", "False", false).await;
    assert!(
        message.contains("not synced"),
        "the condition says why: {message}"
    );
    up.store(true, std::sync::atomic::Ordering::SeqCst);
    want("back", "True", true).await;
    controller.abort();
}

fn addresses(slice: &k8s_openapi::api::discovery::v1::EndpointSlice) -> BTreeSet<String> {
    slice
        .endpoints
        .iter()
        .flatten()
        .flat_map(|e| e.addresses.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_hostnames_are_resolved_and_followed_when_dns_changes() {
    strait_mesh::telemetry::init_test_tracing("strait_mirror=debug,warn");
    let (east, west) = pair_with_web().await;
    let ec = east.client();
    let dns = TestDns::start().await.unwrap();
    dns.set("gw.west.example", &["10.77.0.1".parse().unwrap()]);
    let config = strait_mirror::MirrorConfig {
        dns: strait_mirror::resolve::DnsConfig::Servers(vec![dns.addr()]),
        ..Default::default()
    };
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), config));
    link_with(
        &ec,
        "west",
        Some(&admin_kubeconfig(&west)),
        json!({"gatewayAddresses": ["gw.west.example", "10.77.0.9"]}),
    )
    .await;
    let expect = |want: &'static [&'static str]| {
        let ec = ec.clone();
        async move {
            let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
            eventually(
                "mirror endpoints at the gateway's addresses",
                WAIT,
                || async {
                    let s = mirror_slice(&ec, "shop", "web-west").await?;
                    if addresses(&s) == want {
                        Ok(())
                    } else {
                        Err(format!("endpoints {:?}, want {want:?}", addresses(&s)))
                    }
                },
            )
            .await
        }
    };
    expect(&["10.77.0.1", "10.77.0.9"]).await;

    // The load balancer moves: the mirror follows within the record's TTL.
    dns.set(
        "gw.west.example",
        &["10.77.0.2".parse().unwrap(), "10.77.0.3".parse().unwrap()],
    );
    expect(&["10.77.0.2", "10.77.0.3", "10.77.0.9"]).await;

    // DNS breaks: the last known addresses stay (no endpoints vanish on a DNS hiccup),
    // and the controller keeps asking.
    let asked = dns.queries();
    dns.set("gw.west.example", &[]);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(dns.queries() > asked, "the name is looked up again");
    expect(&["10.77.0.2", "10.77.0.3", "10.77.0.9"]).await;
    controller.abort();
}
