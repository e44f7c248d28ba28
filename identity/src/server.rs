//! The HTTPS front of the issuer. Callers have no certificate yet, so the
//! server authenticates itself (a certificate from its own issuer, with DNS
//! names callers dial) and the caller proves itself with its token.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use strait_mesh::identity::protocol::{CERTIFICATES_PATH, ErrorResponse, MAX_REQUEST_BYTES};
use tokio::net::TcpListener;

use crate::service::IssuerService;

/// A connection gets this long in all; issuance takes milliseconds.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(30);

/// Accepts connections until the task is dropped. One bad peer costs one task.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    service: Arc<IssuerService>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, service) = (acceptor.clone(), service.clone());
        tokio::spawn(async move {
            let work = async {
                let stream = match acceptor.accept(tcp).await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::debug!(%peer, "TLS handshake failed: {e}");
                        return;
                    }
                };
                let svc = hyper::service::service_fn(move |req| {
                    let service = service.clone();
                    async move { Ok::<_, std::convert::Infallible>(route(req, &service).await) }
                });
                let mut builder = hyper::server::conn::http1::Builder::new();
                builder
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(5));
                if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
                    tracing::debug!(%peer, "connection ended: {e}");
                }
            };
            if tokio::time::timeout(CONNECTION_DEADLINE, work)
                .await
                .is_err()
            {
                tracing::debug!(%peer, "connection closed at its deadline");
            }
        });
    }
}

async fn route(
    req: Request<hyper::body::Incoming>,
    service: &IssuerService,
) -> Response<Full<Bytes>> {
    if req.uri().path() != CERTIFICATES_PATH {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("POST {CERTIFICATES_PATH} is the only endpoint"),
        );
    }
    if req.method() != Method::POST {
        return error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("use POST {CERTIFICATES_PATH}"),
        );
    }
    let authorization = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = match Limited::new(req.into_body(), MAX_REQUEST_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                format!("request body over {MAX_REQUEST_BYTES} bytes"),
            );
        }
    };
    match service.handle(authorization.as_deref(), &body).await {
        Ok(answer) => json(StatusCode::OK, &answer),
        Err(refusal) => json(
            StatusCode::from_u16(refusal.status).unwrap_or(StatusCode::FORBIDDEN),
            &refusal.body,
        ),
    }
}

fn error(status: StatusCode, reason: &str, message: String) -> Response<Full<Bytes>> {
    json(
        status,
        &ErrorResponse {
            reason: reason.into(),
            message,
        },
    )
}

fn json<T: serde::Serialize>(status: StatusCode, body: &T) -> Response<Full<Bytes>> {
    let bytes = serde_json::to_vec(body).expect("response types serialise");
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(bytes)))
        .expect("static response parts are valid")
}
