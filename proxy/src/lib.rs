//! The node proxy: one per node (a DaemonSet), carrying local mesh traffic
//! between nodes over mutual TLS and mirror traffic to remote gateways.
//!
//! - [`outbound`]: port 4140, the HTTP proxy the node's pods call.
//! - [`transparent`]: pods whose traffic is redirected to the proxy inside
//!   their own network namespace (ztunnel's in-pod mode), with [`dns`];
//!   [`cni`]: chaining the enrolling plugin into the node's CNI configuration.
//! - [`inbound`]: port 4143, mutual TLS from other node proxies; delivers only
//!   to pods on this node.
//! - [`identity`]: the pods' identities this proxy holds, and how the server
//!   side picks the certificate a client asked for.
//! - [`balance`]: power of two choices over peak-EWMA latency.
//! - [`metrics`]: what `/metrics` on the admin port (4191) shows.
#![forbid(unsafe_code)]

pub mod balance;
pub mod cni;
pub mod dns;
pub mod hop;
pub mod identity;
pub mod inbound;
pub mod metrics;
pub mod outbound;
pub mod retry;
pub mod transparent;

// Shared with the gateway; re-exported so `strait_proxy::detect` and
// `strait_proxy::discovery` keep working.
pub use strait_mesh::{detect, discovery};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};

/// Graceful shutdown, in two phases. First *closing* ([`Drain::start_closing`],
/// at SIGTERM, for the shutdown delay): listeners still accept (Service
/// endpoints and peers take a moment to learn that the pod is terminating),
/// but every HTTP/1 response says `connection: close`, so keep-alive clients
/// move to the next proxy between two requests, never in the middle of one.
/// Then the drain proper: listeners stop accepting when `shutdown` fires;
/// open connections hold a [`DrainGuard`] and the process waits for them
/// (bounded).
#[derive(Clone, Debug)]
pub struct Drain {
    active: Arc<AtomicUsize>,
    idle: Arc<Notify>,
    closing: Arc<std::sync::atomic::AtomicBool>,
    shutdown: watch::Receiver<bool>,
}

/// Held by one open connection.
pub struct DrainGuard(Drain);

impl Drop for DrainGuard {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    /// A drain and the sender that starts it.
    pub fn new() -> (Self, watch::Sender<bool>) {
        let (tx, rx) = watch::channel(false);
        (
            Self {
                active: Arc::default(),
                idle: Arc::default(),
                closing: Arc::default(),
                shutdown: rx,
            },
            tx,
        )
    }

    /// The first phase: from now on HTTP/1 responses close their connection.
    pub fn start_closing(&self) {
        self.closing.store(true, Ordering::Release);
    }

    /// Whether connections should close after their current response
    /// (closing phase or drain).
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire) || *self.shutdown.borrow()
    }

    /// Adds `connection: close` to an HTTP/1 response once closing has begun.
    pub fn mark_closing<B>(&self, response: &mut http::Response<B>) {
        if self.is_closing() {
            response.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
    }

    pub fn guard(&self) -> DrainGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        DrainGuard(self.clone())
    }

    /// Resolves once shutdown has begun.
    pub async fn signaled(&self) {
        let mut rx = self.shutdown.clone();
        let _ = rx.wait_for(|down| *down).await;
    }

    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    /// Waits until no connection is open, or `timeout`; returns how many remain.
    pub async fn wait_idle(&self, timeout: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let idle = self.idle.notified();
            if self.active() == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.active();
            }
        }
    }
}

/// Accepts connections until the drain starts; each is handled in its own
/// task that holds a drain guard. Accept errors (out of file descriptors)
/// pause briefly instead of spinning.
pub async fn serve_connections<F, Fut>(
    listener: tokio::net::TcpListener,
    drain: Drain,
    side: &'static str,
    handle: F,
) where
    F: Fn(tokio::net::TcpStream, std::net::SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = drain.signaled() => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                let (work, guard) = (handle(stream, peer), drain.guard());
                tokio::spawn(async move {
                    let _guard = guard;
                    work.await
                });
            }
            Err(e) => {
                tracing::warn!("{side} accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Discovery as the inbound and outbound sides ask it.
pub struct MeshView {
    discovery: discovery::Discovery,
}

impl MeshView {
    pub fn new(discovery: discovery::Discovery) -> Self {
        Self { discovery }
    }
}

impl inbound::LocalPods for MeshView {
    fn local_pod(&self, ip: std::net::IpAddr) -> Option<inbound::LocalPod> {
        self.discovery.local_pod(ip).map(|p| inbound::LocalPod {
            namespace: p.namespace.clone(),
            name: p.name.clone(),
            service_account: p.service_account.clone(),
        })
    }

    fn local_pod_running_as(
        &self,
        namespace: &str,
        service_account: &str,
    ) -> Option<inbound::LocalPod> {
        self.discovery
            .snapshot()
            .local_pods()
            .find(|p| p.namespace == namespace && p.service_account == service_account)
            .map(|p| inbound::LocalPod {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                service_account: p.service_account.clone(),
            })
    }
}

impl outbound::Destinations for MeshView {
    fn resolve(&self, host: &str, port: u16) -> Result<outbound::Resolved, outbound::ResolveError> {
        let destination = match host.parse::<std::net::IpAddr>() {
            Ok(ip) => self
                .discovery
                .resolve_addr(std::net::SocketAddr::new(ip, port)),
            Err(_) => self.discovery.resolve_name(host, port),
        }
        .ok_or_else(|| outbound::ResolveError::UnknownHost(format!("{host}:{port}")))?;
        let endpoints: Vec<outbound::Endpoint> = destination
            .endpoints
            .iter()
            .filter_map(|e| match &e.route {
                discovery::Route::NodeProxy {
                    proxy, identity, ..
                } => Some(outbound::Endpoint {
                    addr: e.addr,
                    node_proxy: *proxy,
                    identity: identity.clone(),
                    remote: None,
                }),
                // A mirror: the stream goes to the remote gateway and names
                // the remote Service (the mirror's port is the remote one).
                discovery::Route::Gateway { gateway, identity } => {
                    let mirror = destination.mirror.as_ref()?;
                    (!mirror.remote_fq_name.is_empty()).then(|| outbound::Endpoint {
                        addr: *gateway,
                        node_proxy: *gateway,
                        identity: identity.clone(),
                        remote: Some((mirror.remote_fq_name.clone(), destination.port.port)),
                    })
                }
                // Hand-written endpoints outside the mesh: not carried.
                discovery::Route::Direct => None,
            })
            .collect();
        if endpoints.is_empty() {
            return Err(outbound::ResolveError::NoEndpoints(format!(
                "{host}:{port}"
            )));
        }
        Ok(outbound::Resolved {
            endpoints,
            opaque: destination.opaque,
            timeout: destination.timeout,
        })
    }

    fn transparent_wanted(&self, namespace: &str, name: &str) -> Option<bool> {
        self.discovery
            .snapshot()
            .transparent_wanted(namespace, name)
    }

    fn local_pod_named(&self, namespace: &str, name: &str) -> Option<inbound::LocalPod> {
        self.discovery
            .snapshot()
            .local_pod_named(namespace, name)
            .map(|p| inbound::LocalPod {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                service_account: p.service_account.clone(),
            })
    }

    fn endpoint(&self, addr: std::net::SocketAddr) -> Option<outbound::Endpoint> {
        let snapshot = self.discovery.snapshot();
        let pod = snapshot.pod(addr.ip())?;
        Some(outbound::Endpoint {
            addr,
            node_proxy: snapshot.node_proxy(&pod.node)?,
            identity: pod.identity.clone()?,
            remote: None,
        })
    }
}

impl dns::ServiceNames for MeshView {
    fn lookup(&self, host: &str) -> Option<Vec<std::net::IpAddr>> {
        self.discovery
            .snapshot()
            .dns_lookup(host)
            .map(<[std::net::IpAddr]>::to_vec)
    }

    fn cluster_domain(&self) -> String {
        self.discovery.snapshot().cluster_domain().to_string()
    }
}
