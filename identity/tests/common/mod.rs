//! Shared set-up for identity tests: real clusters (testenv), real issuer
//! processes, real TLS between real sockets.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::ca::PemPair;
use strait_mesh::identity::tls::{self, CertSlot, TrustBundle};
use strait_testenv::Cluster;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

#[allow(unused_imports)] // not every file that includes this module uses all of them
pub use strait_testenv::issuer::{RunningIssuer, token, workload_token};

/// Starts the issuer binary built with these tests.
pub async fn start_issuer(
    cluster: &Cluster,
    issuer: &PemPair,
    bundle_pem: &str,
    trust_domain: &str,
    validity: &str,
) -> RunningIssuer {
    strait_testenv::issuer::start_issuer(
        std::path::Path::new(env!("CARGO_BIN_EXE_strait-identity")),
        cluster,
        issuer,
        bundle_pem,
        trust_domain,
        validity,
    )
    .await
}

pub const ALPN: &[&[u8]] = &[b"strait-test/1"];

/// An mTLS echo server: tells each client the SPIFFE ID it saw, then echoes lines.
pub async fn spawn_mtls_server(bundle: &TrustBundle, cert: Arc<CertSlot>) -> SocketAddr {
    let config = tls::server_config(bundle, cert, ALPN).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            // Small writes must not wait for delayed ACKs (40 ms each).
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let peer = tls::peer_identity(stream.get_ref().1.peer_certificates())
                    .map(|id| id.to_string())
                    .unwrap_or_else(|e| format!("error: {e}"));
                let (r, mut w) = tokio::io::split(stream);
                if w.write_all(format!("{peer}\n").as_bytes()).await.is_err() {
                    return;
                }
                let mut lines = BufReader::new(r).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if w.write_all(format!("{line}\n").as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// An mTLS client connection to `addr` expecting the server to be `expected`.
pub struct MtlsConn {
    pub server_id: SpiffeId,
    pub seen_by_server: String,
    lines: tokio::io::Lines<
        BufReader<tokio::io::ReadHalf<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>>,
    >,
    writer: tokio::io::WriteHalf<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
}

pub async fn connect(
    addr: SocketAddr,
    bundle: &TrustBundle,
    cert: Arc<CertSlot>,
    expected: &SpiffeId,
) -> Result<MtlsConn, String> {
    let config = tls::client_config(bundle, cert, vec![expected.clone()], ALPN)
        .map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("strait.peer").unwrap();
    let stream = connector
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let server_id =
        tls::peer_identity(stream.get_ref().1.peer_certificates()).map_err(|e| e.to_string())?;
    let (r, writer) = tokio::io::split(stream);
    let mut lines = BufReader::new(r).lines();
    // TLS 1.3: a server that rejects our certificate says so on first read.
    let seen_by_server = tokio::time::timeout(Duration::from_secs(5), lines.next_line())
        .await
        .map_err(|_| "server said nothing".to_string())?
        .map_err(|e| e.to_string())?
        .ok_or("server closed the connection")?;
    Ok(MtlsConn {
        server_id,
        seen_by_server,
        lines,
        writer,
    })
}

impl MtlsConn {
    pub async fn ping(&mut self, msg: &str) -> Result<(), String> {
        self.writer
            .write_all(format!("{msg}\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let line = tokio::time::timeout(Duration::from_secs(5), self.lines.next_line())
            .await
            .map_err(|_| "no echo".to_string())?
            .map_err(|e| e.to_string())?
            .ok_or("closed")?;
        if line == msg {
            Ok(())
        } else {
            Err(format!("echo {line:?} != {msg:?}"))
        }
    }
}
