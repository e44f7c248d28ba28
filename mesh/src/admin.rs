//! The admin server every component runs on port 4191: `/live`, `/ready`
//! (503 until the component says it is ready) and `/metrics` (OpenMetrics text).
//!
//! A gateway's admin port also answers over mutual TLS on the same port, told
//! apart by the first byte (a TLS handshake record): kubelet and Prometheus
//! speak plain HTTP, while remote mirror controllers probe `/ready` over mTLS
//! and check the gateway's identity.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// Readiness flag shared between a component and its admin server.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set_ready(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Binds the admin server and serves it in a background task. Returns the bound address.
pub async fn spawn(
    addr: SocketAddr,
    readiness: Readiness,
    registry: Arc<Registry>,
) -> std::io::Result<SocketAddr> {
    spawn_with_tls(addr, readiness, registry, None).await
}

/// Like [`spawn`]; with `tls`, connections that open with a TLS handshake are
/// served over it (the config decides whether client certificates are required).
pub async fn spawn_with_tls(
    addr: SocketAddr,
    readiness: Readiness,
    registry: Arc<Registry>,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    // Not registered: the admin port's own refusals are logged (a component's
    // metrics are read through this port, which is full then).
    let limit = crate::limits::ConnLimit::new(
        "admin",
        crate::limits::ADMIN_MAX_CONNECTIONS,
        &Default::default(),
    );
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors: pause instead of spinning.
                    tracing::warn!("admin accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(permit) = limit.try_acquire() else {
                let _ = stream.try_write(REFUSED);
                continue;
            };
            let (readiness, registry) = (readiness.clone(), registry.clone());
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let service = hyper::service::service_fn(move |req| {
                    let response = handle(&req, &readiness, &registry);
                    async move { Ok::<_, std::convert::Infallible>(response) }
                });
                let mut http = hyper::server::conn::http1::Builder::new();
                http.timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEADER_READ_TIMEOUT);
                let mut first = [0u8; 1];
                let peeked = tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.peek(&mut first)).await;
                match (acceptor, peeked) {
                    (Some(acceptor), Ok(Ok(1))) if first[0] == TLS_HANDSHAKE_RECORD => {
                        let Ok(Ok(tls)) =
                            tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await
                        else {
                            return;
                        };
                        let _ = http.serve_connection(TokioIo::new(tls), service).await;
                    }
                    (_, Ok(Ok(_))) => {
                        let _ = http.serve_connection(TokioIo::new(stream), service).await;
                    }
                    _ => {}
                }
            });
        }
    });
    Ok(local)
}

/// How long a request's head may take to arrive (and a kept-alive
/// connection may sit idle before its next one).
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// What a connection past [`crate::limits::ADMIN_MAX_CONNECTIONS`] reads
/// before it is closed.
const REFUSED: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n\
connection: close\r\ncontent-length: 38\r\n\r\ntoo many connections to the admin port";

/// First byte of a TLS ClientHello record.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;
/// How long a client may take to send its first bytes or finish a handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

fn handle<B>(
    req: &Request<B>,
    readiness: &Readiness,
    registry: &Registry,
) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match req.uri().path() {
        "/live" => (StatusCode::OK, "text/plain", "live\n".to_string()),
        "/ready" if readiness.is_ready() => (StatusCode::OK, "text/plain", "ready\n".to_string()),
        "/ready" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "not ready\n".to_string(),
        ),
        "/metrics" => {
            let mut text = String::new();
            match prometheus_client::encoding::text::encode(&mut text, registry) {
                Ok(()) => (
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    text,
                ),
                Err(e) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    format!("encoding metrics: {e}\n"),
                ),
            }
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /live, /ready or /metrics\n".to_string(),
        ),
    };
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn read_all(mut stream: TcpStream) -> String {
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer).await;
        String::from_utf8_lossy(&answer).into_owned()
    }

    #[tokio::test]
    async fn a_client_that_never_finishes_its_request_head_is_closed() {
        let addr = spawn(
            "127.0.0.1:0".parse().unwrap(),
            Readiness::default(),
            Arc::new(Registry::default()),
        )
        .await
        .unwrap();
        let started = std::time::Instant::now();
        // Silent, and half a request line: both closed, neither held.
        let silent = TcpStream::connect(addr).await.unwrap();
        let mut partial = TcpStream::connect(addr).await.unwrap();
        partial.write_all(b"GET /metrics HT").await.unwrap();
        let (silent, partial) = tokio::join!(read_all(silent), read_all(partial));
        let took = started.elapsed();
        assert!(silent.is_empty(), "{silent}");
        assert!(
            partial.is_empty() || partial.starts_with("HTTP/1.1 408"),
            "{partial}"
        );
        assert!(
            took >= HEADER_READ_TIMEOUT.min(HANDSHAKE_TIMEOUT)
                && took
                    < HANDSHAKE_TIMEOUT + HEADER_READ_TIMEOUT + std::time::Duration::from_secs(2),
            "closed after {took:?}"
        );
        // A whole request is still answered.
        let mut ok = TcpStream::connect(addr).await.unwrap();
        ok.write_all(b"GET /live HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        assert!(read_all(ok).await.starts_with("HTTP/1.1 200"));
    }
}
