//! No TLS session resumption between Strait components: every connection
//! runs the full handshake, so each one is checked against the live trust
//! bundle. Real rustls, real certificates, real sockets on loopback.

use std::sync::Arc;
use std::time::Duration;

use rustls::HandshakeKind;
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::ca::{self, LeafSigner};
use strait_mesh::identity::tls::{self, TrustBundle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DAY: Duration = Duration::from_secs(86_400);

#[tokio::test]
async fn every_connection_is_a_full_handshake_checked_against_the_live_bundle() {
    let anchor = ca::new_trust_anchor("anchor", DAY).unwrap();
    let issuer = ca::new_issuer(&anchor, "east", Some("east.clusterset.local"), DAY).unwrap();
    let signer = LeafSigner::load(&issuer, &anchor.cert_pem).unwrap();
    let server_id: SpiffeId = "spiffe://east.clusterset.local/ns/strait-system/sa/strait-gateway"
        .parse()
        .unwrap();
    let client_id: SpiffeId = "spiffe://east.clusterset.local/ns/strait-system/sa/strait-proxy"
        .parse()
        .unwrap();
    let bundle = TrustBundle::from_pem(anchor.cert_pem.as_bytes()).unwrap();
    let server = tls::server_config(
        &bundle,
        signer.new_identity(&server_id, DAY).unwrap(),
        &[b"test"],
    )
    .unwrap();
    let client = tls::client_config(
        &bundle,
        signer.new_identity(&client_id, DAY).unwrap(),
        vec![server_id.clone()],
        &[b"test"],
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    // The server answers each connection with how its handshake went.
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let kind = tls.get_ref().1.handshake_kind();
                let _ = tls.write_all(format!("{kind:?}").as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let connect = || async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut tls = connector
            .connect(strait_mesh::tunnel::server_name_for(&server_id), tcp)
            .await?;
        let mut seen = String::new();
        tls.read_to_string(&mut seen).await?;
        Ok::<_, std::io::Error>((tls.get_ref().1.handshake_kind(), seen))
    };
    for i in 0..3 {
        let (client_kind, server_kind) = connect().await.unwrap();
        assert_eq!(client_kind, Some(HandshakeKind::Full), "connection {i}");
        assert_eq!(server_kind, "Some(Full)", "connection {i}");
    }
    // The anchor is rotated out: the same client config, which just spoke
    // to this server, is refused at once (a resumed session would skip the
    // verifier and get in).
    let other = ca::new_trust_anchor("another anchor", DAY).unwrap();
    bundle.replace_from_pem(other.cert_pem.as_bytes()).unwrap();
    assert!(
        connect().await.is_err(),
        "a peer under a rotated-out anchor was let in"
    );
}
