//! HTTP in an inbound tunnel: served by the proxy's own HTTP server, each
//! request sent on over one connection to the pod with the caller's proven
//! identity in `strait-client-id` (whatever the caller put there is replaced).

use std::sync::Arc;

use strait_mesh::identity::SpiffeId;
use strait_mesh::names::CLIENT_ID_HEADER;
use strait_mesh::tunnel::Protocol;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::drain::Drain;
use crate::metrics::HttpSeries;

/// HTTP over one tunnel (`tunnel`: its TLS stream, or that with the first
/// bytes read ahead) to one pod connection, in the tunnel's version. One
/// task drives both connections (no hand-over to another task per request).
pub(super) async fn serve_http<T>(
    tunnel: T,
    upstream: TcpStream,
    protocol: Protocol,
    client: &SpiffeId,
    series: HttpSeries,
    drain: &Drain,
) -> Result<(), String>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let client_id = http::HeaderValue::from_str(&client.to_string())
        .map_err(|e| format!("caller identity as a header: {e}"))?;
    let pod = upstream.peer_addr().ok();
    let (sender, pod_connection): (PodSender, BoxFuture) = match protocol {
        Protocol::Http2 => {
            let (sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(upstream))
                    .await
                    .map_err(|e| format!("HTTP/2 to pod {pod:?}: {e}"))?;
            (PodSender::H2(sender), Box::pin(quietly(conn)))
        }
        _ => {
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(upstream))
                .await
                .map_err(|e| format!("HTTP/1 to pod {pod:?}: {e}"))?;
            (
                PodSender::H1(Arc::new(tokio::sync::Mutex::new(sender))),
                Box::pin(quietly(conn)),
            )
        }
    };
    let h1 = protocol != Protocol::Http2;
    let closing = drain.clone();
    let service =
        hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            let (sender, series, client_id) = (sender.clone(), series.clone(), client_id.clone());
            let drain_closing = closing.clone();
            async move {
                crate::hop::strip(req.headers_mut());
                req.headers_mut().insert(CLIENT_ID_HEADER, client_id);
                series.request();
                let started = std::time::Instant::now();
                let result = match sender {
                    PodSender::H1(s) => s.lock().await.send_request(req).await,
                    PodSender::H2(mut s) => s.send_request(req).await,
                };
                series.response(
                    result.as_ref().ok().map(|r| r.status()),
                    started.elapsed().as_secs_f64(),
                );
                result.map(|mut response| {
                    // This tunnel's HTTP/1 connection is tied to one pod
                    // connection: when the pod closes it, the tunnel closes too
                    // (the sending proxy then opens a new one).
                    // Or this proxy is shutting down: the sender's pool
                    // drops the tunnel after this answer, not during the next.
                    let closing = crate::hop::says_close(response.headers())
                        || (h1 && drain_closing.is_closing());
                    crate::hop::strip(response.headers_mut());
                    if closing {
                        response.headers_mut().insert(
                            http::header::CONNECTION,
                            http::HeaderValue::from_static("close"),
                        );
                    }
                    response
                })
            }
        });
    let io = TokioIo::new(tunnel);
    let tunnel = async move {
        match protocol {
            Protocol::Http2 => {
                let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(io, service);
                drain
                    .serve(std::pin::pin!(connection), |c| c.graceful_shutdown())
                    .await
            }
            _ => {
                let connection =
                    hyper::server::conn::http1::Builder::new().serve_connection(io, service);
                drain
                    .serve(std::pin::pin!(connection), |c| c.graceful_shutdown())
                    .await
            }
        }
    };
    // The pod's connection ends once the tunnel's (holding its sender) has.
    let (served, ()) = tokio::join!(tunnel, pod_connection);
    served.map_err(|e| format!("HTTP in the tunnel: {e}"))
}

type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A pod connection's future, its error only logged.
async fn quietly<E: std::fmt::Display>(
    connection: impl std::future::Future<Output = Result<(), E>>,
) {
    if let Err(e) = connection.await {
        tracing::debug!("HTTP to the pod: {e}");
    }
}

#[derive(Clone)]
enum PodSender {
    /// One HTTP/1 connection: requests in turn.
    H1(Arc<tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<hyper::body::Incoming>>>),
    H2(hyper::client::conn::http2::SendRequest<hyper::body::Incoming>),
}
