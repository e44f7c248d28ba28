//! Connections a pod enrolled in transparent mode opened to anywhere,
//! redirected to the proxy by its network namespace's rules: the original
//! destination (SO_ORIGINAL_DST) says where they were going.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use strait_mesh::tunnel::Protocol;
use strait_mesh::tunnel::client::CONNECT_TIMEOUT;
use tokio::net::TcpStream;

use super::{Outbound, http1_server, splice, text};
use crate::detect::{DEFAULT_DETECT_TIMEOUT, OpaquePorts, PrefixedIo, detect};
use crate::drain::Drain;
use crate::view::ResolveError;

impl Outbound {
    /// A redirected connection of the pod `namespace/name`. A Service or pod
    /// of the mesh is detected (unless its port is opaque) and carried like
    /// the HTTP proxy's traffic; anything else passes through unchanged.
    pub async fn handle_transparent(
        self: Arc<Self>,
        mut stream: TcpStream,
        namespace: String,
        name: String,
        drain: Drain,
    ) {
        let original = match socket2::SockRef::from(&stream).original_dst_v4() {
            Ok(addr) => addr.as_socket(),
            Err(e) => {
                tracing::debug!("transparent: no original destination ({e}): closing");
                None
            }
        };
        let Some(original) = original else { return };
        let resolved = match self
            .destinations
            .resolve(&original.ip().to_string(), original.port())
        {
            Ok(r) => r,
            Err(ResolveError::UnknownHost(_)) => return passthrough(stream, original).await,
            Err(e) => {
                tracing::debug!(pod = %format!("{namespace}/{name}"), "transparent: {e}: closing");
                return;
            }
        };
        let caller = match self.caller_named(&namespace, &name).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("transparent: {e}: closing");
                return;
            }
        };
        let opaque = resolved.opaque || OpaquePorts::defaults().contains(original.port());
        let (protocol, prefix) = if opaque {
            (Protocol::Opaque, Bytes::new())
        } else {
            match detect(&mut stream, DEFAULT_DETECT_TIMEOUT).await {
                Ok(found) => found,
                Err(e) => {
                    tracing::debug!(%original, "transparent: reading the first bytes: {e}");
                    return;
                }
            }
        };
        let io = PrefixedIo::new(prefix, stream);
        if protocol == Protocol::Opaque {
            match self
                .open_any(&caller, &resolved.endpoints, Protocol::Opaque)
                .await
            {
                Ok((tunnel, endpoint)) => {
                    let labels = self
                        .metrics
                        .outbound_labels(&caller.identity.id(), &endpoint);
                    splice(&self.metrics, &labels, io, tunnel).await;
                }
                Err(e) => tracing::debug!(
                    %original,
                    "transparent: no tunnel: {}",
                    e.map_or("no endpoint".to_string(), |e| e.to_string())
                ),
            }
            return;
        }
        let this = self.clone();
        let http1 = protocol == Protocol::Http1;
        let closing = drain.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (this, caller, closing) = (this.clone(), caller.clone(), closing.clone());
            async move {
                // Endpoints change under a long-lived connection: ask per request.
                let mut response = match this
                    .destinations
                    .resolve(&original.ip().to_string(), original.port())
                {
                    Ok(resolved) => {
                        this.forward_within(req, caller, resolved, &original.to_string())
                            .await
                    }
                    Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                };
                if http1 {
                    closing.mark_closing(&mut response);
                }
                Ok::<_, Infallible>(response)
            }
        });
        // The HTTP proxy's limits; on drain, finish what is in flight.
        let io = TokioIo::new(io);
        let served = if http1 {
            let connection = http1_server().serve_connection(io, service).with_upgrades();
            drain
                .serve(std::pin::pin!(connection), |c| c.graceful_shutdown())
                .await
        } else {
            let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .serve_connection(io, service);
            drain
                .serve(std::pin::pin!(connection), |c| c.graceful_shutdown())
                .await
        };
        if let Err(e) = served {
            tracing::debug!(%original, "transparent connection: {e}");
        }
    }
}

/// A connection to something outside the mesh: connected from the node, as
/// the pod would have.
async fn passthrough(mut stream: TcpStream, original: SocketAddr) {
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(original)).await {
        Ok(Ok(mut upstream)) => {
            let _ = upstream.set_nodelay(true);
            let _ = strait_mesh::io::splice(&mut stream, &mut upstream).await;
        }
        Ok(Err(e)) => tracing::debug!(%original, "passthrough: {e}"),
        Err(_) => tracing::debug!(%original, "passthrough: connect timed out"),
    }
}
