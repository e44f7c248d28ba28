//! Identity refusals on real processes (testenv nodes, root): peers under a
//! foreign trust anchor, with an expired certificate, or minted by a leaked
//! issuer of another cluster (name-constrained to its own trust domain) are
//! refused during the handshake at the gateway (QUIC and TCP) and at a node
//! proxy's inbound port, and counted in `tls_refusals_total`; a node proxy
//! that claims a caller of another cluster is refused by the gateway; a
//! client refuses a server that is not the identity it expects. Nothing of
//! a refused peer reaches a pod.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use strait_mesh::identity::tls::TrustBundle;
use strait_mesh::identity::{SpiffeId, ca};
use strait_mesh::tunnel::{Protocol, Target, TunnelHeader};
use strait_testenv::http_get;

mod common;

use common::*;

const DAY: Duration = Duration::from_secs(86_400);

fn id(s: &str) -> SpiffeId {
    s.parse().unwrap()
}

async fn metrics(addr: IpAddr) -> String {
    http_get(SocketAddr::new(addr, 4191), "/metrics")
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_expired_and_out_of_domain_peers_are_refused_at_every_hop() {
    let Some(mut mesh) = mesh(Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await else {
        return;
    };
    let client = mesh.topology.cluster().client();
    export(&client, "web", true).await;
    let (gw_pod, gw) = start_gateway(&mut mesh, 1, &[]).await;
    mesh.proxies.push(gw);
    let gw_ip = IpAddr::V4(gw_pod.ip());
    let gw_addr = SocketAddr::new(gw_ip, 4143);
    let td = mesh.trust_domain.clone();
    let gateway_id = id(&format!("spiffe://{td}/ns/strait-system/sa/strait-gateway"));
    let proxy_id = format!("spiffe://{td}/ns/strait-system/sa/strait-proxy");
    let bundle = TrustBundle::from_pem(mesh.anchor.cert_pem.as_bytes()).unwrap();

    // The peers to refuse: a foreign anchor's proxy, an expired proxy
    // certificate from this cluster's own issuer, and this cluster's proxy
    // identity minted by a leaked issuer of cluster west.
    let (foreign_anchor, foreign_issuer) =
        ca::new_anchor_and_issuer("east", Some(&td), DAY).unwrap();
    let foreign = mint_identity(&foreign_issuer, &proxy_id, 1);
    let expired = mint_identity(&mesh.issuer_pair, &proxy_id, -1);
    let west_issuer =
        ca::new_issuer(&mesh.anchor, "west", Some("west.clusterset.local"), DAY).unwrap();
    let stolen = mint_identity(&west_issuer, &proxy_id, 1);
    // The foreign peer trusts its own anchor (it would not even get to send
    // its certificate otherwise); the others trust ours.
    let foreign_bundle = TrustBundle::from_pem(
        format!("{}{}", foreign_anchor.cert_pem, mesh.anchor.cert_pem).as_bytes(),
    )
    .unwrap();
    let peers = [
        ("unknown-anchor", &foreign_bundle, foreign),
        ("expired", &bundle, expired),
        ("name-constraint", &bundle, stolen),
    ];
    let sni = "strait-gateway.strait-system.identity.strait.internal";

    // The control: a real proxy certificate is let through, on both transports.
    let (good, _) = component_identity(&mesh, "strait-proxy");
    let quic = strait_mesh::tunnel::quic::GatewayClient::new(bundle.clone(), good.clone()).unwrap();
    quic.probe(gw_addr, &gateway_id).await.unwrap();
    assert!(tls_accepted(gw_addr, &bundle, good.clone(), &gateway_id, sni).await);

    for (reason, peer_bundle, cert) in &peers {
        // QUIC: the probe takes the real path (handshake, stream, header).
        let over_quic =
            strait_mesh::tunnel::quic::GatewayClient::new((*peer_bundle).clone(), cert.clone())
                .unwrap();
        let refused = over_quic.probe(gw_addr, &gateway_id).await;
        assert!(refused.is_err(), "{reason}: QUIC let through: {refused:?}");
        // TCP + TLS on the same port.
        assert!(
            !tls_accepted(gw_addr, peer_bundle, cert.clone(), &gateway_id, sni).await,
            "{reason}: TCP let through"
        );
        let m = metrics(gw_ip).await;
        assert!(
            metric_sum(
                &m,
                "tls_refusals_total",
                &["side=\"server\"", &format!("reason=\"{reason}\"")]
            ) >= 2.0,
            "{reason}: the gateway counts each refusal (QUIC and TCP):\n{m}"
        );
    }

    // A node proxy's inbound port (node 1's serves web-1's identity) refuses
    // the same peers, and lets a real workload certificate through.
    let node = mesh.topology.node(1).unwrap().clone();
    let inbound = SocketAddr::new(IpAddr::V4(node.ip()), 4143);
    let web = id(&format!("spiffe://{td}/ns/shop/sa/web"));
    let (caller, _) = issued_identity(&mesh, "shop", "client").await;
    assert!(
        tls_accepted(
            inbound,
            &bundle,
            caller,
            &web,
            "web.shop.identity.strait.internal"
        )
        .await
    );
    for (reason, peer_bundle, cert) in &peers {
        assert!(
            !tls_accepted(
                inbound,
                peer_bundle,
                cert.clone(),
                &web,
                "web.shop.identity.strait.internal"
            )
            .await,
            "{reason}: the inbound port let it through"
        );
        let m = metrics(IpAddr::V4(node.ip())).await;
        assert!(
            metric_sum(
                &m,
                "tls_refusals_total",
                &["side=\"server\"", &format!("reason=\"{reason}\"")]
            ) >= 1.0,
            "{reason}: the node proxy counts it:\n{m}"
        );
    }

    // A real node proxy of this cluster may speak for its own callers, not
    // for another cluster's: the gateway refuses the claim before any byte
    // goes on.
    let header = |source: &str| TunnelHeader {
        target: Target::Service {
            fqdn: "web.shop.svc.cluster.local".parse().unwrap(),
            port: 80,
        },
        source: Some(id(source)),
        protocol: Protocol::Http1,
    };
    quic.open(
        gw_addr,
        &gateway_id,
        &header(&format!("spiffe://{td}/ns/shop/sa/client")),
    )
    .await
    .expect("a node proxy speaks for a caller of its own cluster");
    let claim = quic
        .open(
            gw_addr,
            &gateway_id,
            &header("spiffe://west.clusterset.local/ns/shop/sa/client"),
        )
        .await;
    let err = claim
        .err()
        .expect("a node proxy cannot speak for another cluster's caller");
    assert!(err.to_string().contains("own trust domain"), "{err}");
    let m = metrics(gw_ip).await;
    assert!(
        metric_sum(&m, "gateway_denied_total", &["reason=\"source-claim\""]) >= 1.0,
        "{m}"
    );

    // The client side: a gateway that is not the expected identity is refused
    // and counted by the client's bundle.
    let impostor = id(&format!("spiffe://{td}/ns/strait-system/sa/impostor"));
    assert!(quic.probe(gw_addr, &impostor).await.is_err());
    assert!(bundle.refusals().count("client", "wrong-identity") >= 1);
    mesh.pods.insert("gateway".into(), (gw_pod, None));
}
