//! The admin server every component runs on port 4191: `/live`, `/ready`
//! (503 until the component says it is ready) and `/metrics` (OpenMetrics text).

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
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (readiness, registry) = (readiness.clone(), registry.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let response = handle(&req, &readiness, &registry);
                    async move { Ok::<_, std::convert::Infallible>(response) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(local)
}

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
