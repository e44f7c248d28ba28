//! Tunnels and the pools that keep them: opening a tunnel to an endpoint
//! ([`Opener`]: TCP + mutual TLS to a node proxy, or a stream to a remote
//! gateway), and pooled HTTP connections per caller and endpoint, keyed by a
//! typed [`PoolKey`] and pruned when their endpoints go.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::client::ManagedIdentity;
use strait_mesh::io::ClientTls;
use strait_mesh::tunnel::client::{TunnelError, end_to_end, open_to_pod};
use strait_mesh::tunnel::quic::{GatewayClient, GatewayStream};
use strait_mesh::tunnel::{Protocol, Target, TunnelHeader};
use tokio_util::either::Either;

use crate::identity::PodIdentities;
use crate::view::{Endpoint, Via};

/// A tunnel: to a node proxy (TCP + TLS, `Left`), or through a remote gateway
/// (a QUIC stream, or TCP + TLS on fallback) to the destination's node proxy,
/// end to end inside (`Right`).
pub type TunnelStream = Either<Box<ClientTls>, Either<GatewayStream, Box<EndToEnd>>>;

/// The end-to-end session inside a gateway stream.
pub type EndToEnd = tokio_rustls::client::TlsStream<GatewayStream>;

/// Everything needed to open a tunnel to any endpoint for a caller.
#[derive(Clone)]
pub(super) struct Opener {
    pub(super) identities: Arc<PodIdentities>,
    configs: Arc<ConfigCache>,
    pub(super) gateways: Option<Arc<GatewayClient>>,
}

impl Opener {
    pub(super) fn new(
        identities: Arc<PodIdentities>,
        gateways: Option<Arc<GatewayClient>>,
    ) -> Self {
        Self {
            identities,
            configs: Arc::default(),
            gateways,
        }
    }

    /// The same identities and gateway client, its own TLS config cache
    /// (another worker thread's).
    pub(super) fn worker(&self) -> Self {
        Self::new(self.identities.clone(), self.gateways.clone())
    }

    pub(super) async fn open(
        &self,
        source: &ManagedIdentity,
        endpoint: &Endpoint,
        protocol: Protocol,
    ) -> Result<TunnelStream, TunnelError> {
        match &endpoint.via {
            Via::NodeProxy(node_proxy) => {
                let config = self
                    .configs
                    .get(&self.identities, source, &endpoint.identity)?;
                let tls = open_to_pod(
                    config,
                    *node_proxy,
                    endpoint.addr,
                    &endpoint.identity,
                    protocol,
                    None,
                    false,
                )
                .await?;
                Ok(Either::Left(Box::new(tls)))
            }
            Via::Gateway { service, port } => {
                let gateways = self.gateways.as_ref().ok_or_else(|| {
                    TunnelError::Config(
                        "no gateway client (the proxy has no identity of its own)".into(),
                    )
                })?;
                let target = Target::service(service, *port)
                    .map_err(|e| TunnelError::Protocol(e.to_string(), endpoint.addr))?;
                // The outer header: what the gateway needs to route and
                // decide early (the caller it is told about); the inner
                // session proves that caller to the destination's proxy,
                // which accepts only workloads of the Service's namespace in
                // the gateway's cluster (trust domain) as the far end.
                let mut header = TunnelHeader::new(target.clone(), protocol);
                header.source = Some(source.id());
                header.end_to_end = self.identities.end_to_end().sends();
                let stream = gateways
                    .open(endpoint.addr, &endpoint.identity, &header)
                    .await?;
                if !header.end_to_end {
                    return Ok(Either::Right(Either::Left(stream)));
                }
                let namespace = service.split('.').nth(1).unwrap_or_default();
                let config = self.configs.end_to_end(
                    &self.identities,
                    source,
                    endpoint.identity.trust_domain(),
                    namespace,
                )?;
                let inner = TunnelHeader::new(target, protocol);
                let tls = end_to_end(stream, config, &inner, endpoint.addr).await?;
                Ok(Either::Right(Either::Right(Box::new(tls))))
            }
        }
    }
}

/// Client configs by (source, destination), built once: building one
/// validates the trust anchors, too slow to do per connection.
#[derive(Default)]
struct ConfigCache(
    Mutex<HashMap<(SpiffeId, SpiffeId), Arc<rustls::ClientConfig>>>,
    Mutex<HashMap<(SpiffeId, String, String), Arc<rustls::ClientConfig>>>,
);

impl ConfigCache {
    fn get(
        &self,
        identities: &PodIdentities,
        source: &ManagedIdentity,
        destination: &SpiffeId,
    ) -> Result<Arc<rustls::ClientConfig>, TunnelError> {
        let key = (source.id(), destination.clone());
        if let Some(found) = self.0.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(found.clone());
        }
        let config = identities
            .client_config(source, destination.clone())
            .map_err(|e| TunnelError::Config(e.to_string()))?;
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, config.clone());
        Ok(config)
    }

    /// The end-to-end session's config: presents `source`, accepts any
    /// workload of `namespace` in `trust_domain`.
    fn end_to_end(
        &self,
        identities: &PodIdentities,
        source: &ManagedIdentity,
        trust_domain: &str,
        namespace: &str,
    ) -> Result<Arc<rustls::ClientConfig>, TunnelError> {
        let key = (source.id(), trust_domain.to_string(), namespace.to_string());
        if let Some(found) = self.1.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(found.clone());
        }
        let config = identities
            .end_to_end_config(source, trust_domain, namespace)
            .map_err(|e| TunnelError::Config(e.to_string()))?;
        self.1
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, config.clone());
        Ok(config)
    }
}

/// A multiplexed tunnel's HTTP/2 sender, once opened; the lock is held while
/// it is being opened, so concurrent first requests share one tunnel.
pub(super) type H2Slot<B> = Arc<tokio::sync::Mutex<Option<H2Tunnel<B>>>>;

/// An open multiplexed tunnel.
pub(super) struct H2Tunnel<B> {
    pub(super) sender: hyper::client::conn::http2::SendRequest<B>,
    /// It is a TCP fallback stream to a gateway (replaced once QUIC works again).
    pub(super) fallback: bool,
}

/// Whether a slot may be kept: being opened, or open.
pub(super) fn slot_in_use<B>(slot: &H2Slot<B>) -> bool {
    slot.try_lock()
        .map_or(true, |s| s.as_ref().is_some_and(|t| !t.sender.is_closed()))
}

/// Whether `stream` is a TCP fallback stream to a gateway (bare, or carrying
/// an end-to-end session).
pub(super) fn is_fallback_tcp(stream: &TunnelStream) -> bool {
    match stream {
        Either::Right(Either::Left(s)) => s.transport() == "tcp",
        Either::Right(Either::Right(s)) => s.get_ref().0.transport() == "tcp",
        Either::Left(_) => false,
    }
}

/// What a pooled connection is for: one caller's identity to one endpoint
/// (a pod behind its node proxy, or a remote Service behind a gateway).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub source: SpiffeId,
    pub endpoint: Endpoint,
}

/// Pools (or anything kept per [`PoolKey`]), with when each was last used.
pub(super) struct Pools<T>(Mutex<HashMap<PoolKey, (T, Instant)>>);

impl<T> Default for Pools<T> {
    fn default() -> Self {
        Self(Mutex::default())
    }
}

impl<T: Clone> Pools<T> {
    /// The entry for `key` that `usable` accepts, made (and kept) first if
    /// there is none; marks it used now.
    pub(super) fn get_or_insert(
        &self,
        key: &PoolKey,
        usable: impl Fn(&T) -> bool,
        make: impl FnOnce() -> T,
    ) -> T {
        let now = Instant::now();
        let mut pools = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((value, used)) = pools.get_mut(key)
            && usable(value)
        {
            *used = now;
            return value.clone();
        }
        let value = make();
        pools.insert(key.clone(), (value.clone(), now));
        value
    }

    /// The entry for `key` if `usable` accepts it (marked used now).
    #[cfg(test)]
    fn get(&self, key: &PoolKey, usable: impl Fn(&T) -> bool) -> Option<T> {
        let mut pools = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (value, used) = pools.get_mut(key).filter(|(v, _)| usable(v))?;
        *used = Instant::now();
        Some(value.clone())
    }

    #[cfg(test)]
    fn insert(&self, key: PoolKey, value: T) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, (value, Instant::now()));
    }

    /// Keeps the entries whose endpoint `keep` accepts and that were used
    /// within `idle` (an idle pool holds no connection any more); returns
    /// how many remain.
    pub(super) fn retain(
        &self,
        keep: impl Fn(&Endpoint, &T) -> bool,
        idle: Duration,
        now: Instant,
    ) -> usize {
        let mut pools = self.0.lock().unwrap_or_else(|e| e.into_inner());
        pools.retain(|key, (value, used)| {
            now.saturating_duration_since(*used) < idle && keep(&key.endpoint, value)
        });
        pools.len()
    }
}

/// Connects a pooling HTTP/1 client to its one endpoint: every connection is
/// a new tunnel there (the URI's authority only labels the pool).
#[derive(Clone)]
pub(super) struct EndpointConnector {
    pub(super) source: Arc<ManagedIdentity>,
    pub(super) endpoint: Endpoint,
    pub(super) opener: Opener,
}

impl tower_service::Service<http::Uri> for EndpointConnector {
    type Response = TunnelIo;
    type Error = TunnelError;
    type Future = Pin<Box<dyn Future<Output = Result<TunnelIo, TunnelError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let stream = this
                .opener
                .open(&this.source, &this.endpoint, Protocol::Http1)
                .await?;
            Ok(TunnelIo(TokioIo::new(stream)))
        })
    }
}

/// A tunnel as the pooling client sees it.
pub struct TunnelIo(TokioIo<TunnelStream>);

/// Marks a pooled connection that is a TCP fallback stream to a gateway.
#[derive(Clone, Copy, Debug)]
pub(super) struct FallbackTcp;

impl Connection for TunnelIo {
    fn connected(&self) -> Connected {
        if is_fallback_tcp(self.0.inner()) {
            Connected::new().extra(FallbackTcp)
        } else {
            Connected::new()
        }
    }
}

impl hyper::rt::Read for TunnelIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for TunnelIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(source: &str, pod: u8, via: Via) -> PoolKey {
        PoolKey {
            source: SpiffeId::new("cluster.local", "shop", source).unwrap(),
            endpoint: Endpoint {
                addr: std::net::SocketAddr::from(([10, 1, 0, pod], 8080)),
                identity: SpiffeId::new("cluster.local", "shop", "web").unwrap(),
                via,
                weight: 1,
                service: None,
            },
        }
    }

    fn node(n: u8) -> Via {
        Via::NodeProxy(std::net::SocketAddr::from(([10, 0, 0, n], 4143)))
    }

    #[test]
    fn one_entry_per_caller_and_endpoint_including_its_route() {
        let pools = Pools::<u32>::default();
        let mut made = 0;
        let mut get = |k: &PoolKey| {
            pools.get_or_insert(
                k,
                |_| true,
                || {
                    made += 1;
                    made
                },
            )
        };
        assert_eq!(get(&key("client", 1, node(1))), 1);
        assert_eq!(get(&key("client", 1, node(1))), 1, "reused");
        assert_eq!(get(&key("other", 1, node(1))), 2, "another caller: its own");
        assert_eq!(get(&key("client", 2, node(1))), 3, "another pod: its own");
        // The pod's node proxy was replaced (a rollout): a new pool, never
        // a connection to the old proxy.
        assert_eq!(get(&key("client", 1, node(9))), 4);
        let remote = |service: &str| Via::Gateway {
            service: service.into(),
            port: 80,
        };
        // Two mirrors behind one gateway never share a pooled stream.
        assert_eq!(
            get(&key("client", 7, remote("web.shop.svc.cluster.local"))),
            5
        );
        assert_eq!(
            get(&key("client", 7, remote("api.shop.svc.cluster.local"))),
            6
        );
        assert_eq!(
            get(&key("client", 7, remote("web.shop.svc.cluster.local"))),
            5
        );
    }

    #[test]
    fn an_unusable_entry_is_replaced() {
        let pools = Pools::<(u32, bool)>::default();
        let k = key("client", 1, node(1));
        pools.insert(k.clone(), (1, false));
        assert_eq!(
            pools.get(&k, |(_, open)| *open),
            None,
            "closed: not handed out"
        );
        assert_eq!(
            pools.get_or_insert(&k, |(_, open)| *open, || (2, true)),
            (2, true)
        );
        assert_eq!(pools.get(&k, |(_, open)| *open), Some((2, true)));
    }

    #[test]
    fn retain_drops_gone_endpoints_and_idle_entries() {
        let pools = Pools::<u32>::default();
        let start = Instant::now();
        pools.insert(key("client", 1, node(1)), 1);
        pools.insert(key("client", 2, node(1)), 2);
        let idle = Duration::from_secs(90);
        let gone = std::net::SocketAddr::from(([10, 1, 0, 2], 8080));
        assert_eq!(pools.retain(|e, _| e.addr != gone, idle, start), 1);
        assert_eq!(pools.get(&key("client", 2, node(1)), |_| true), None);
        assert_eq!(pools.get(&key("client", 1, node(1)), |_| true), Some(1));
        // Unused for longer than the idle timeout: its connections are
        // closed by now, the entry goes too.
        let later = Instant::now() + idle;
        assert_eq!(pools.retain(|_, _| true, idle, later), 0);
    }
}
