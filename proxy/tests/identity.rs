//! Identity refusals on real processes (testenv nodes, root): peers under a
//! foreign trust anchor, with an expired certificate, or minted by a leaked
//! issuer of another cluster (name-constrained to its own trust domain) are
//! refused during the handshake at the gateway (QUIC and TCP) and at a node
//! proxy's inbound port, and counted in `tls_refusals_total`; a forging node
//! proxy (a real proxy certificate) is refused at every hop: another
//! cluster's caller by the gateway, its own cluster's without the end-to-end
//! proof or with a proof of someone else by the destination's node proxy;
//! the honest caller's identity is what the pod sees. A client refuses a
//! server that is not the identity it expects. Nothing of a refused peer
//! reaches a pod.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use strait_mesh::identity::tls::TrustBundle;
use strait_mesh::identity::{SpiffeId, ca};
use strait_mesh::tunnel::client::end_to_end;
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

    // A forging node proxy: a real process's certificate (strait-proxy of this
    // cluster), claiming callers it cannot prove.
    let header = |source: &str, end_to_end: bool| TunnelHeader {
        target: Target::service("web.shop.svc.cluster.local", 80).unwrap(),
        source: Some(id(source)),
        protocol: Protocol::Http1,
        end_to_end,
    };
    let admin = format!("spiffe://{td}/ns/shop/sa/admin");
    let client_id = format!("spiffe://{td}/ns/shop/sa/client");
    // 1. Another cluster's caller: the gateway refuses the claim.
    let err = quic
        .open(
            gw_addr,
            &gateway_id,
            &header("spiffe://west.clusterset.local/ns/shop/sa/client", true),
        )
        .await
        .err()
        .expect("a node proxy cannot speak for another cluster's caller");
    assert!(err.to_string().contains("own trust domain"), "{err}");
    let m = metrics(gw_ip).await;
    assert!(
        metric_sum(&m, "gateway_denied_total", &["reason=\"source-claim\""]) >= 1.0,
        "{m}"
    );
    // 2. A caller of its own cluster, without the end-to-end proof: the
    //    gateway cannot tell, the destination's node proxy refuses.
    let err = quic
        .open(gw_addr, &gateway_id, &header(&admin, false))
        .await
        .err()
        .expect("a claim without proof is refused by the destination");
    assert!(err.to_string().contains("end-to-end proof"), "{err}");
    // 3. With the session, proving what it holds (its own certificate), not
    //    the workload it claims: refused inside the session.
    let inner = TunnelHeader::new(
        Target::service("web.shop.svc.cluster.local", 80).unwrap(),
        Protocol::Http1,
    );
    let expect_shop = strait_mesh::identity::tls::Expected::Namespace {
        trust_domain: td.clone(),
        namespace: "shop".into(),
    };
    let as_config = |cert| {
        std::sync::Arc::new(
            strait_mesh::identity::tls::client_config_expecting(
                &bundle,
                cert,
                expect_shop.clone(),
                &[strait_mesh::tunnel::TUNNEL_ALPN],
            )
            .unwrap(),
        )
    };
    let stream = quic
        .open(gw_addr, &gateway_id, &header(&admin, true))
        .await
        .expect("the outer tunnel: neither the gateway nor the destination can tell yet");
    let err = end_to_end(stream, as_config(good.clone()), &inner, gw_addr)
        .await
        .err()
        .expect("a caller proving another identity than claimed is refused");
    assert!(err.to_string().contains("proved to be"), "{err}");
    // 4. The honest caller: claims and proves `client`; the pod sees that
    //    identity, whatever the request says.
    let (client_cert, _) = issued_identity(&mesh, "shop", "client").await;
    let stream = quic
        .open(gw_addr, &gateway_id, &header(&client_id, true))
        .await
        .unwrap();
    let mut session = end_to_end(stream, as_config(client_cert), &inner, gw_addr)
        .await
        .expect("the proven caller gets through");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    session
        .write_all(
            format!("GET /e2e HTTP/1.1\r\nHost: web\r\nstrait-client-id: {admin}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
    let mut answer = String::new();
    let _ =
        tokio::time::timeout(Duration::from_secs(10), session.read_to_string(&mut answer)).await;
    assert!(
        answer.contains(&format!("\"strait-client-id\":\"{client_id}\"")),
        "{answer}"
    );
    assert!(!answer.contains("sa/admin"), "{answer}");
    // Both refusals counted by the destination's node proxy (wherever the
    // gateway sent them), and the claimed identity never reached a pod.
    let mut counted = [0.0, 0.0, 0.0];
    for node in mesh.topology.nodes() {
        let m = metrics(IpAddr::V4(node.ip())).await;
        counted[0] += metric_sum(&m, "inbound_refusals_total", &["reason=\"no-proof\""]);
        counted[1] += metric_sum(&m, "inbound_refusals_total", &["reason=\"forged-source\""]);
        counted[2] += metric_sum(&m, "inbound_end_to_end_proven_total", &[]);
    }
    assert_eq!(
        counted[..2],
        [1.0, 1.0],
        "inbound refusals (no-proof, forged-source)"
    );
    assert!(counted[2] >= 1.0, "the honest caller's proof was counted");
    for node in mesh.topology.nodes() {
        let m = metrics(IpAddr::V4(node.ip())).await;
        assert_eq!(
            metric_sum(
                &m,
                "request_total",
                &["direction=\"inbound\"", "src_workload=\"admin\""]
            ),
            0.0,
            "{m}"
        );
    }

    // The client side: a gateway that is not the expected identity is refused
    // and counted by the client's bundle.
    let impostor = id(&format!("spiffe://{td}/ns/strait-system/sa/impostor"));
    assert!(quic.probe(gw_addr, &impostor).await.is_err());
    assert!(bundle.refusals().count("client", "wrong-identity") >= 1);
    mesh.pods.insert("gateway".into(), (gw_pod, None));
}
