//! Stateless resets between gateway replicas, on real UDP sockets with real
//! certificates: a server "crashes" (its runtime dropped: nothing is sent)
//! and another binds the same address.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::*;
use crate::identity::{SpiffeId, ca, tls};

const GATEWAY: &str = "spiffe://east.strait/ns/strait-system/sa/strait-gateway";
const PROXY: &str = "spiffe://east.strait/ns/strait-system/sa/strait-proxy";

struct Pki {
    signer: ca::LeafSigner,
    bundle: tls::TrustBundle,
}

fn pki() -> Pki {
    let day = Duration::from_secs(86_400);
    let (anchor, issuer) = ca::new_anchor_and_issuer("east", Some("east.strait"), day).unwrap();
    Pki {
        signer: ca::LeafSigner::load(&issuer, &anchor.cert_pem).unwrap(),
        bundle: tls::TrustBundle::from_pem(anchor.cert_pem.as_bytes()).unwrap(),
    }
}

/// A QUIC server in a runtime of its own thread, accepting and holding
/// connections.
struct Server {
    addr: SocketAddr,
    crash: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Server {
    fn start(pki: &Pki, addr: SocketAddr, key: &[u8]) -> Self {
        let id: SpiffeId = GATEWAY.parse().unwrap();
        let cert = pki
            .signer
            .new_identity(&id, Duration::from_secs(3600))
            .unwrap();
        let config =
            server_config(tls::server_config(&pki.bundle, cert, &[TUNNEL_ALPN]).unwrap()).unwrap();
        let key = key.to_vec();
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let (crash, crashed) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let endpoint = rt
                .block_on(async { endpoint_with_reset_key(addr, Some(config), Some(&key)) })
                .unwrap();
            bound_tx.send(endpoint.local_addr().unwrap()).unwrap();
            rt.spawn(async move {
                let mut held = Vec::new();
                while let Some(incoming) = endpoint.accept().await {
                    if let Ok(connection) = incoming.await {
                        held.push(connection);
                    }
                }
            });
            // Serve until told to crash, then drop everything unpolled.
            rt.block_on(async {
                while let Err(std::sync::mpsc::TryRecvError::Empty) = crashed.try_recv() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            });
            rt.shutdown_background();
        });
        Self {
            addr: bound_rx.recv().unwrap(),
            crash,
            thread,
        }
    }

    /// Gone without a word: its runtime dropped, its socket closed.
    fn crash(self) {
        drop(self.crash);
        self.thread.join().unwrap();
    }
}

async fn connect(pki: &Pki, client: &quinn::Endpoint, addr: SocketAddr) -> quinn::Connection {
    let id: SpiffeId = PROXY.parse().unwrap();
    let cert = pki
        .signer
        .new_identity(&id, Duration::from_secs(3600))
        .unwrap();
    let tls = tls::client_config(
        &pki.bundle,
        cert,
        vec![GATEWAY.parse().unwrap()],
        &[TUNNEL_ALPN],
    )
    .unwrap();
    client
        .connect_with(client_config(tls).unwrap(), addr, "gateway.strait.internal")
        .unwrap()
        .await
        .unwrap()
}

/// Crashes `server` (holding `conn`), starts one with `next_key` at the
/// same address, sends on `conn`: how the connection ended and when.
async fn replace_and_send(
    pki: &Pki,
    conn: &quinn::Connection,
    server: Server,
    next_key: &[u8],
) -> (quinn::ConnectionError, Duration, Server) {
    let addr = server.addr;
    server.crash();
    let next = Server::start(pki, addr, next_key);
    let started = Instant::now();
    if let Ok((mut send, _recv)) = conn.open_bi().await {
        let _ = send.write_all(b"after the crash").await;
    }
    let reason = tokio::time::timeout(IDLE_TIMEOUT * 3, conn.closed())
        .await
        .expect("the connection ended");
    (reason, started.elapsed(), next)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_with_the_shared_key_resets_its_predecessors_connections_at_once() {
    let pki = pki();
    let key = [7u8; 32];
    let server = Server::start(&pki, "127.0.0.1:0".parse().unwrap(), &key);
    let addr = server.addr;
    let client = endpoint("127.0.0.1:0".parse().unwrap(), None).unwrap();

    let conn = connect(&pki, &client, addr).await;
    let (reason, took, next) = replace_and_send(&pki, &conn, server, &key).await;
    assert!(
        matches!(reason, quinn::ConnectionError::Reset),
        "the replacement reset the connection: {reason:?}"
    );
    assert!(
        took < Duration::from_secs(1),
        "reset after {took:?} (the idle timeout is {IDLE_TIMEOUT:?})"
    );
    eprintln!("MEASURED stateless reset by a replacement with the shared key: {took:?}");

    // A replacement with another key cannot: the peer waits out the idle timeout.
    let conn = connect(&pki, &client, addr).await;
    let (reason, took, last) = replace_and_send(&pki, &conn, next, &[9u8; 32]).await;
    last.crash();
    assert!(
        matches!(reason, quinn::ConnectionError::TimedOut),
        "without the key, only the idle timeout ends it: {reason:?}"
    );
    assert!(took >= IDLE_TIMEOUT / 2, "{took:?}");
}

#[test]
fn a_short_reset_key_is_refused_saying_what_to_give() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let e = endpoint_with_reset_key("127.0.0.1:0".parse().unwrap(), None, Some(&[1u8; 16]))
        .unwrap_err();
    assert!(e.to_string().contains("at least 32 random bytes"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_forgets_gateways_with_nothing_open_and_no_backoff() {
    let pki = pki();
    let server = Server::start(&pki, "127.0.0.1:0".parse().unwrap(), &[7u8; 32]);
    let cert = pki
        .signer
        .new_identity(&PROXY.parse().unwrap(), Duration::from_secs(3600))
        .unwrap();
    let client = GatewayClient::new(pki.bundle.clone(), cert).unwrap();
    let gateway: SpiffeId = GATEWAY.parse().unwrap();
    let connection = client.connect_quic(server.addr, &gateway).await.unwrap();
    // A gateway that does not answer at all: QUIC in back-off.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let dead = silent.local_addr().unwrap();
    assert!(client.connect_quic(dead, &gateway).await.is_none());
    assert_eq!(client.known_gateways(), 2);

    let now = Instant::now();
    client.prune(now);
    assert_eq!(
        client.known_gateways(),
        2,
        "open connection and back-off kept"
    );
    connection.close(0u32.into(), b"done");
    client.prune(now);
    assert_eq!(
        client.known_gateways(),
        1,
        "the closed connection's gateway forgotten"
    );
    client.prune(now + MAX_BACKOFF + Duration::from_secs(1));
    assert_eq!(client.known_gateways(), 0, "the back-off over: forgotten");
    assert!(client.configs.lock().unwrap().is_empty());
    server.crash();
}
