//! QUIC for cross-cluster tunnels (quinn over rustls): the gateway's server
//! side and the node proxy's client side, tuned for WAN paths, and the
//! client's automatic fallback to TCP + TLS.
//!
//! One QUIC connection per (node proxy, gateway), one bidirectional stream per
//! client connection or request; the stream starts with the tunnel header, as
//! a TCP tunnel does. When QUIC cannot connect (UDP blocked), streams go over
//! TCP + TLS to the same port instead: one TLS connection per gateway
//! carrying HTTP/2, one CONNECT stream per tunnel stream (ALPN
//! [`TUNNEL_H2_ALPN`]; a gateway that only speaks [`TUNNEL_ALPN`] on TCP gets
//! one connection per stream). QUIC is tried again in the background and taken
//! back as soon as it works.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use tokio::net::TcpStream;

mod stream;

pub use stream::GatewayStream;

use super::client::{CONNECT_TIMEOUT, TunnelError, handshake};
use super::{TUNNEL_ALPN, TunnelHeader, server_name_for};
use crate::identity::SpiffeId;
use crate::identity::tls::{self, CertSlot, TrustBundle};

/// Streams one connection may have open at once (the gateway's limit for a
/// node proxy): a misbehaving peer cannot open more.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;
/// The streams a new connection may open at first; [`StreamCredit`] raises
/// it (×4, up to [`MAX_STREAMS_PER_CONNECTION`]) once half are in use. quinn
/// keeps an entry in two maps for every stream the peer may open, from the
/// start: at 1 024 that was ~68 KiB of each idle connection. 28 fills a
/// hash table of 32 buckets exactly (7/8 load), as do 112 and 448 after it.
pub const INITIAL_STREAMS_PER_CONNECTION: u32 = 28;
/// Per-stream receive window: one stream can fill a 1 Gbit/s path with 64 ms
/// of round trip (bandwidth × delay).
pub const STREAM_WINDOW: u32 = 8 * 1024 * 1024;
/// Per-connection receive window: several streams at full speed.
pub const CONNECTION_WINDOW: u32 = 32 * 1024 * 1024;
/// A connection that has heard nothing from its peer for this long is
/// closed. It is how a client notices that the path died (WAN cut, UDP
/// blocked) or the gateway went away (a restarted gateway's stateless resets
/// do not match the old connection): until then streams on it hang, new and
/// pooled alike. Measured across the testenv WAN (proxy/tests/cross_cluster.rs),
/// 30 s meant requests hanging 30 s; 5 s bounds that while leaving the
/// keep-alives below several chances to get through on a lossy path.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// Keep-alives keep NAT bindings and an idle pooled connection alive, and
/// give a live connection traffic to hear well within [`IDLE_TIMEOUT`]: about
/// five per timeout (a PING of some 50 bytes a second per node proxy and
/// gateway pair).
pub const KEEP_ALIVE: Duration = Duration::from_secs(1);
/// How long a QUIC handshake may take before the client falls back to TCP.
pub const QUIC_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a fresh QUIC handshake runs alone before the TCP fallback
/// starts next to it ([`GatewayClient::open`]).
pub const QUIC_HEAD_START: Duration = Duration::from_millis(500);
/// UDP socket buffers asked of the kernel (it may cap them at net.core.*mem_max).
pub const SOCKET_BUFFER: usize = 8 * 1024 * 1024;

/// The congestion window a new connection starts with: a node proxy's
/// connection to a gateway carries many streams at once from its first
/// round trip, so the usual ten packets would queue them behind each other.
pub const INITIAL_WINDOW: u64 = 64 * 1024;

/// Transport settings for both sides.
///
/// Congestion control is BBR, not quinn's default Cubic: WAN links lose
/// packets at random (1 % in the benchmark), and a loss-based controller
/// reads every such loss as congestion and shrinks the window shared by all
/// streams, so requests queue in the sender. BBR paces at the measured
/// bandwidth and round trip instead (as Google's QUIC does). Measured in
/// `scripts/bench-wan.sh`; see ARCHITECTURE.md.
/// `peer_streams`: how many bidirectional streams the peer may open at
/// first (the gateway's clients open them; the gateway never opens one).
pub fn transport(peer_streams: u32) -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    let mut bbr = quinn::congestion::BbrConfig::default();
    bbr.initial_window(INITIAL_WINDOW);
    t.congestion_controller_factory(Arc::new(bbr));
    t.max_concurrent_bidi_streams(peer_streams.into())
        .max_concurrent_uni_streams(0u32.into())
        .stream_receive_window(STREAM_WINDOW.into())
        .receive_window(CONNECTION_WINDOW.into())
        .send_window(u64::from(CONNECTION_WINDOW))
        .keep_alive_interval(Some(KEEP_ALIVE))
        .max_idle_timeout(Some(
            IDLE_TIMEOUT
                .try_into()
                .expect("a few seconds is a valid idle timeout"),
        ));
    Arc::new(t)
}

/// The gateway's count of one connection's open streams, raising the
/// peer's stream limit as they fill it: an idle connection keeps the small
/// initial limit, a busy one grows to [`MAX_STREAMS_PER_CONNECTION`] before
/// its client runs out (the raise is sent when half are in use).
pub struct StreamCredit {
    open: Arc<std::sync::atomic::AtomicU32>,
    limit: u32,
}

/// Decrements its connection's open streams when dropped (the stream ended).
pub struct OpenStream(Arc<std::sync::atomic::AtomicU32>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl Default for StreamCredit {
    fn default() -> Self {
        Self {
            open: Arc::default(),
            limit: INITIAL_STREAMS_PER_CONNECTION,
        }
    }
}

impl StreamCredit {
    /// A stream was accepted on `connection`: counted until the returned
    /// guard drops; the limit raised if half of it is in use.
    pub fn accepted(&mut self, connection: &quinn::Connection) -> OpenStream {
        let open = self.open.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1;
        if let Some(limit) = raised_stream_limit(open, self.limit) {
            self.limit = limit;
            connection.set_max_concurrent_bi_streams(limit.into());
        }
        OpenStream(self.open.clone())
    }
}

/// The new stream limit when `open` streams are in use under `limit`.
pub fn raised_stream_limit(open: u32, limit: u32) -> Option<u32> {
    (open.saturating_mul(2) >= limit && limit < MAX_STREAMS_PER_CONNECTION)
        .then(|| limit.saturating_mul(4).min(MAX_STREAMS_PER_CONNECTION))
}

/// A UDP socket bound to `addr` with large buffers (quinn enables GSO/GRO on
/// it by itself where the kernel has them).
pub fn udp_socket(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    let _ = socket.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = socket.set_send_buffer_size(SOCKET_BUFFER);
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

/// The gateway's QUIC server config from its TLS config (TLS 1.3, client
/// certificates required, the tunnel ALPN).
pub fn server_config(tls: rustls::ServerConfig) -> Result<quinn::ServerConfig, TunnelError> {
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| TunnelError::Config(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(transport(INITIAL_STREAMS_PER_CONNECTION));
    Ok(config)
}

/// A QUIC client config from a TLS client config.
pub fn client_config(tls: rustls::ClientConfig) -> Result<quinn::ClientConfig, TunnelError> {
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| TunnelError::Config(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    // The gateway never opens a stream to its client.
    config.transport_config(transport(0));
    Ok(config)
}

/// A QUIC endpoint on `addr` (the gateway: its listener; a client: `0.0.0.0:0`).
pub fn endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> std::io::Result<quinn::Endpoint> {
    endpoint_with_reset_key(addr, server, None)
}

/// The shortest stateless-reset secret accepted (HMAC-SHA256's output size).
pub const MIN_RESET_KEY_BYTES: usize = 32;

/// [`endpoint`] whose stateless resets (RFC 9000 §10.3) derive from
/// `reset_key` instead of a random secret of its own. Every replica of one
/// cluster's gateway given the same secret can reset a connection another
/// replica (or a crashed predecessor at the same address) accepted: a peer
/// whose packets reach the new process learns at once that its connection is
/// gone, instead of waiting out the idle timeout. The secret must stay secret
/// (knowing it and a connection ID, anyone could end that connection).
pub fn endpoint_with_reset_key(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
    reset_key: Option<&[u8]>,
) -> std::io::Result<quinn::Endpoint> {
    let socket = udp_socket(addr)?;
    let runtime = quinn::default_runtime()
        .ok_or_else(|| std::io::Error::other("no async runtime for QUIC"))?;
    let config = match reset_key {
        Some(key) if key.len() < MIN_RESET_KEY_BYTES => {
            return Err(std::io::Error::other(format!(
                "a stateless-reset key of {} bytes is too short: give at least {MIN_RESET_KEY_BYTES} random bytes",
                key.len()
            )));
        }
        Some(key) => {
            let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
            // Connection IDs must validate across replicas too: a packet
            // whose ID this process did not issue is otherwise dropped as
            // garbage before a reset is considered.
            let tag = ring::hmac::sign(&key, b"strait quic connection ids");
            let mut cid_key = [0u8; 8];
            cid_key.copy_from_slice(&tag.as_ref()[..8]);
            let cid_key = u64::from_le_bytes(cid_key);
            let mut config = quinn::EndpointConfig::new(Arc::new(key));
            config.cid_generator(move || {
                Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key))
            });
            config
        }
        None => quinn::EndpointConfig::default(),
    };
    quinn::Endpoint::new(config, server, socket, runtime)
}

/// The reserved target of a probe: a gateway answers a stream naming it with
/// OK when it is ready to forward (and nothing else), so the probe's time is
/// the real path's: the same QUIC connection (or fallback), TLS and header
/// exchange as traffic. Not a name any cluster's Services can have.
pub const PROBE_FQDN: &str = "probe.gateway.strait.internal";
/// The port the probe target names.
pub const PROBE_PORT: u16 = 4143;

/// The header of a probe stream.
pub fn probe_header() -> TunnelHeader {
    TunnelHeader::new(
        super::Target::service(PROBE_FQDN, PROBE_PORT).expect("the probe target is valid"),
        super::Protocol::Opaque,
    )
}

/// ALPN of the TCP fallback when it multiplexes streams with HTTP/2 CONNECT.
pub const TUNNEL_H2_ALPN: &[u8] = b"strait-tunnel-h2/1";
/// The `:authority` of the fallback's CONNECT requests (the tunnel header
/// names the real target).
pub const H2_AUTHORITY: &str = "tunnel.strait.internal:4143";

/// How long a new stream may wait for the gateway's permission to open
/// (its stream limit, [`MAX_STREAMS_PER_CONNECTION`], is reached until it
/// grants more): as long as a silent connection lives, so a caller never
/// waits longer for a stream than for a dead connection.
pub const OPEN_STREAM_TIMEOUT: Duration = IDLE_TIMEOUT;

/// A new bidirectional stream on `connection`, within [`OPEN_STREAM_TIMEOUT`].
async fn open_bi(
    connection: &quinn::Connection,
    addr: SocketAddr,
) -> Result<(quinn::SendStream, quinn::RecvStream), TunnelError> {
    match tokio::time::timeout(OPEN_STREAM_TIMEOUT, connection.open_bi()).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(e)) => Err(TunnelError::Protocol(format!("QUIC stream: {e}"), addr)),
        Err(_) => Err(TunnelError::Connect {
            node: addr,
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the gateway granted no new stream within {OPEN_STREAM_TIMEOUT:?} ({MAX_STREAMS_PER_CONNECTION} open on this connection?)"
                ),
            ),
        }),
    }
}

/// What the client knows about one gateway (address and identity).
#[derive(Default)]
struct GatewayState {
    connection: Option<quinn::Connection>,
    /// QUIC failed: use TCP until then.
    quic_down_until: Option<Instant>,
    /// The next wait after a failure (1 s doubling to 30 s).
    backoff: Duration,
    /// A background QUIC attempt is running.
    probing: bool,
    /// A TCP connect just timed out: until then, TCP streams fail at once
    /// instead of waiting out another connect timeout (a request's retries
    /// to the same gateway on a black-holed path).
    tcp_down_until: Option<Instant>,
    /// The fallback's HTTP/2 connection, when the gateway speaks it.
    h2: Option<hyper::client::conn::http2::SendRequest<http_body_util::Empty<bytes::Bytes>>>,
}

/// How long a TCP connect timeout to a gateway fails new TCP streams at once.
/// Just long enough to cover a request's immediate retries; short, so a
/// restored path is used again within a second.
const TCP_HOLD_DOWN: Duration = Duration::from_secs(1);

const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// How often a [`GatewayClient`] drops what it keeps for idle gateways.
const PRUNE_INTERVAL: Duration = Duration::from_secs(60);

/// The client side of cross-cluster tunnels: one QUIC connection per gateway,
/// streams on it, TCP + TLS while QUIC cannot connect. Presents `cert` (the
/// node proxy's own identity); each gateway must prove the identity its
/// mirror endpoints name.
pub struct GatewayClient {
    endpoint: quinn::Endpoint,
    bundle: TrustBundle,
    cert: Arc<CertSlot>,
    gateways: Mutex<HashMap<(SocketAddr, SpiffeId), GatewayState>>,
    configs: Mutex<HashMap<SpiffeId, Arc<rustls::ClientConfig>>>,
    tcp_configs: Mutex<HashMap<SpiffeId, Arc<rustls::ClientConfig>>>,
}

/// See [`GatewayClient::quic_now`].
enum QuicNow {
    Live(quinn::Connection),
    Down,
    /// Connect, giving QUIC this head start over TCP: none when the last
    /// connection died of silence (the path that just went quiet is the
    /// likelier one to be broken, and a request waiting on it has already
    /// spent the idle timeout).
    Connect(Duration),
}

impl GatewayClient {
    pub fn new(bundle: TrustBundle, cert: Arc<CertSlot>) -> std::io::Result<Arc<Self>> {
        let endpoint = endpoint("0.0.0.0:0".parse().expect("valid"), None)?;
        let client = Arc::new(Self {
            endpoint,
            bundle,
            cert,
            gateways: Mutex::new(HashMap::new()),
            configs: Mutex::new(HashMap::new()),
            tcp_configs: Mutex::new(HashMap::new()),
        });
        // Gateways come and go (addresses, identities): what is kept for one
        // that has nothing open goes, until the client itself does.
        let weak = Arc::downgrade(&client);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PRUNE_INTERVAL).await;
                let Some(client) = weak.upgrade() else { return };
                client.prune(Instant::now());
            }
        });
        Ok(client)
    }

    /// Drops the state of gateways with nothing open, nothing running and no
    /// back-off in force (it says nothing a new attempt would not find out),
    /// and the TLS configs of identities no gateway left needs.
    fn prune(&self, now: Instant) {
        let mut gateways = self.gateways.lock().unwrap_or_else(|e| e.into_inner());
        gateways.retain(|_, state| {
            state
                .connection
                .as_ref()
                .is_some_and(|c| c.close_reason().is_none())
                || state.h2.as_ref().is_some_and(|h| !h.is_closed())
                || state.probing
                || state.quic_down_until.is_some_and(|t| t > now)
                || state.tcp_down_until.is_some_and(|t| t > now)
        });
        let wanted: std::collections::HashSet<&SpiffeId> =
            gateways.keys().map(|(_, id)| id).collect();
        for cache in [&self.configs, &self.tcp_configs] {
            cache
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|id, _| wanted.contains(id));
        }
    }

    /// Gateways the client keeps state for now.
    pub fn known_gateways(&self) -> usize {
        self.gateways
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    fn tls(&self, identity: &SpiffeId) -> Result<Arc<rustls::ClientConfig>, TunnelError> {
        Self::cached(&self.configs, identity, || {
            tls::client_config(
                &self.bundle,
                self.cert.clone(),
                vec![identity.clone()],
                &[TUNNEL_ALPN],
            )
        })
    }

    /// The fallback's TLS: HTTP/2 multiplexing preferred, one stream per
    /// connection accepted.
    fn tcp_tls(&self, identity: &SpiffeId) -> Result<Arc<rustls::ClientConfig>, TunnelError> {
        Self::cached(&self.tcp_configs, identity, || {
            tls::client_config(
                &self.bundle,
                self.cert.clone(),
                vec![identity.clone()],
                &[TUNNEL_H2_ALPN, TUNNEL_ALPN],
            )
        })
    }

    fn cached(
        cache: &Mutex<HashMap<SpiffeId, Arc<rustls::ClientConfig>>>,
        identity: &SpiffeId,
        make: impl FnOnce() -> Result<rustls::ClientConfig, tls::TlsError>,
    ) -> Result<Arc<rustls::ClientConfig>, TunnelError> {
        let mut configs = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = configs.get(identity) {
            return Ok(found.clone());
        }
        let config = Arc::new(make().map_err(|e| TunnelError::Config(e.to_string()))?);
        configs.insert(identity.clone(), config.clone());
        Ok(config)
    }

    /// A fallback stream: a CONNECT on the gateway's shared HTTP/2
    /// connection (made first if needed), or a connection of its own when the
    /// gateway does not speak HTTP/2 on TCP.
    async fn tcp_stream(
        &self,
        addr: SocketAddr,
        identity: &SpiffeId,
    ) -> Result<GatewayStream, TunnelError> {
        let key = (addr, identity.clone());
        let existing = self
            .gateways
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .and_then(|s| s.h2.clone())
            .filter(|s| !s.is_closed());
        let mut sender = match existing {
            Some(sender) => sender,
            None => {
                let tls = self.tcp(addr, identity).await?;
                if tls.get_ref().1.alpn_protocol() != Some(TUNNEL_H2_ALPN) {
                    return Ok(GatewayStream::Tcp(Box::new(tls)));
                }
                let (sender, connection) =
                    hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .timer(hyper_util::rt::TokioTimer::new())
                        .keep_alive_interval(KEEP_ALIVE)
                        // A PING goes out after KEEP_ALIVE without a frame
                        // and must be answered within the rest of
                        // IDLE_TIMEOUT: a dead TCP fallback is noticed as
                        // soon as a dead QUIC connection (IDLE_TIMEOUT
                        // after the last thing heard), not a keep-alive later.
                        .keep_alive_timeout(IDLE_TIMEOUT - KEEP_ALIVE)
                        .keep_alive_while_idle(true)
                        .initial_stream_window_size(STREAM_WINDOW)
                        .initial_connection_window_size(CONNECTION_WINDOW)
                        .handshake(hyper_util::rt::TokioIo::new(tls))
                        .await
                        .map_err(|e| TunnelError::Protocol(format!("HTTP/2 on TCP: {e}"), addr))?;
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(%addr, "gateway HTTP/2 connection: {e}");
                    }
                });
                self.gateways
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(key)
                    .or_default()
                    .h2 = Some(sender.clone());
                sender
            }
        };
        let h2_error =
            |e: hyper::Error| TunnelError::Protocol(format!("HTTP/2 CONNECT: {e}"), addr);
        // The gateway grants streams (its limit) and answers CONNECT within
        // the header's time, or the stream is given up.
        let connect = async {
            sender.ready().await.map_err(h2_error)?;
            let request = http::Request::builder()
                .method(http::Method::CONNECT)
                .uri(H2_AUTHORITY)
                .body(http_body_util::Empty::new())
                .map_err(|e| TunnelError::Protocol(e.to_string(), addr))?;
            let response = sender.send_request(request).await.map_err(h2_error)?;
            if response.status() != http::StatusCode::OK {
                return Err(TunnelError::Protocol(
                    format!("the gateway answered CONNECT with {}", response.status()),
                    addr,
                ));
            }
            let upgraded = hyper::upgrade::on(response).await.map_err(h2_error)?;
            Ok(GatewayStream::H2(hyper_util::rt::TokioIo::new(upgraded)))
        };
        tokio::time::timeout(super::client::RESPONSE_TIMEOUT, connect)
            .await
            .map_err(|_| {
                TunnelError::Protocol(
                    format!(
                        "the gateway did not answer HTTP/2 CONNECT within {:?}",
                        super::client::RESPONSE_TIMEOUT
                    ),
                    addr,
                )
            })?
    }

    /// Opens a stream to the gateway at `addr` (which must prove `identity`)
    /// and sends `header`; the stream is ready for application bytes.
    pub async fn open(
        self: &Arc<Self>,
        addr: SocketAddr,
        identity: &SpiffeId,
        header: &TunnelHeader,
    ) -> Result<GatewayStream, TunnelError> {
        let head_start = match self.quic_now(addr, identity) {
            QuicNow::Live(connection) => match open_bi(&connection, addr).await {
                Ok((send, recv)) => {
                    let stream = tokio::io::join(recv, send);
                    return handshake(GatewayStream::Quic(stream), header, addr).await;
                }
                Err(e) => {
                    tracing::debug!(%addr, "QUIC stream: {e}; reconnecting or falling back");
                    self.forget(addr, identity, &connection);
                    Duration::ZERO
                }
            },
            QuicNow::Down => {
                let stream = self.tcp_stream(addr, identity).await?;
                return handshake(stream, header, addr).await;
            }
            QuicNow::Connect(head_start) => head_start,
        };
        let stream = self.connect_either(addr, identity, head_start).await?;
        handshake(stream, header, addr).await
    }

    /// A fresh QUIC connection, and the TCP fallback if QUIC has not
    /// connected within `head_start` ([`QUIC_HEAD_START`], or none right
    /// after a QUIC connection to this gateway failed): the first stream
    /// that opens wins (happy eyeballs, QUIC preferred). Tried one after the
    /// other, a gateway that vanished cost the QUIC handshake timeout plus
    /// the TCP connect timeout (on top of the idle timeout a request on the
    /// dead connection had already waited); raced, the longer of the two.
    async fn connect_either(
        self: &Arc<Self>,
        addr: SocketAddr,
        identity: &SpiffeId,
        head_start: Duration,
    ) -> Result<GatewayStream, TunnelError> {
        // The handshake runs as a task of its own: when TCP wins, it still
        // finishes and records whether QUIC works (the connection for the
        // next streams, or the backoff that sends them straight to TCP).
        let this = self.clone();
        let id = identity.clone();
        let handshake = tokio::spawn(async move { this.connect_quic(addr, &id).await });
        let quic = async {
            let connection = handshake.await.ok()??;
            let (send, recv) = open_bi(&connection, addr).await.ok()?;
            Some(GatewayStream::Quic(tokio::io::join(recv, send)))
        };
        let tcp = async {
            tokio::time::sleep(head_start).await;
            self.tcp_stream(addr, identity).await
        };
        tokio::pin!(quic, tcp);
        tokio::select! {
            quic_stream = &mut quic => match quic_stream {
                Some(stream) => Ok(stream),
                None => tcp.await,
            },
            tcp_stream = &mut tcp => match tcp_stream {
                Ok(stream) => Ok(stream),
                Err(e) => quic.await.ok_or(e),
            },
        }
    }

    /// Which transport new streams to this gateway use now: `quic` or `tcp`.
    pub fn transport(&self, addr: SocketAddr, identity: &SpiffeId) -> &'static str {
        let gateways = self.gateways.lock().unwrap_or_else(|e| e.into_inner());
        match gateways.get(&(addr, identity.clone())) {
            Some(GatewayState {
                connection: Some(c),
                ..
            }) if c.close_reason().is_none() => "quic",
            _ => "tcp",
        }
    }

    /// Probes the gateway through the tunnel: a stream with the probe target,
    /// answered OK when the gateway can forward. Returns the round trip and
    /// the transport used (`quic` or `tcp`).
    pub async fn probe(
        self: &Arc<Self>,
        addr: SocketAddr,
        identity: &SpiffeId,
    ) -> Result<(Duration, &'static str), TunnelError> {
        let started = Instant::now();
        let mut stream = self.open(addr, identity, &probe_header()).await?;
        let elapsed = started.elapsed();
        let transport = stream.transport();
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
        Ok((elapsed, transport))
    }

    /// Whether new streams to this gateway would go over QUIC now. While on
    /// the fallback, this also starts the background QUIC attempt once the
    /// backoff is over, so a caller that keeps reusing pooled TCP streams
    /// (and so never opens new ones) still finds its way back to QUIC.
    pub fn prefers_quic(self: &Arc<Self>, addr: SocketAddr, identity: &SpiffeId) -> bool {
        let mut gateways = self.gateways.lock().unwrap_or_else(|e| e.into_inner());
        let state = gateways.entry((addr, identity.clone())).or_default();
        if state
            .connection
            .as_ref()
            .is_some_and(|c| c.close_reason().is_none())
        {
            return true;
        }
        if state
            .quic_down_until
            .is_some_and(|until| Instant::now() >= until)
            && !state.probing
        {
            state.probing = true;
            let this = self.clone();
            let identity = identity.clone();
            tokio::spawn(async move {
                let _ = this.connect_quic(addr, &identity).await;
            });
        }
        false
    }

    fn forget(&self, addr: SocketAddr, identity: &SpiffeId, connection: &quinn::Connection) {
        let mut gateways = self.gateways.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(state) = gateways.get_mut(&(addr, identity.clone()))
            && state
                .connection
                .as_ref()
                .is_some_and(|c| c.stable_id() == connection.stable_id())
        {
            state.connection = None;
        }
    }

    /// What QUIC offers a new stream now: a live connection, nothing (known
    /// down: the stream goes over TCP, and once the backoff is over one
    /// background attempt finds out whether QUIC is back), or a connection
    /// to make.
    fn quic_now(self: &Arc<Self>, addr: SocketAddr, identity: &SpiffeId) -> QuicNow {
        let mut gateways = self.gateways.lock().unwrap_or_else(|e| e.into_inner());
        let state = gateways.entry((addr, identity.clone())).or_default();
        let mut head_start = QUIC_HEAD_START;
        if let Some(c) = &state.connection {
            match c.close_reason() {
                None => return QuicNow::Live(c.clone()),
                Some(quinn::ConnectionError::TimedOut) => head_start = Duration::ZERO,
                Some(_) => {}
            }
            state.connection = None;
        }
        let Some(until) = state.quic_down_until else {
            return QuicNow::Connect(head_start);
        };
        if Instant::now() >= until && !state.probing {
            state.probing = true;
            let this = self.clone();
            let identity = identity.clone();
            tokio::spawn(async move {
                let _ = this.connect_quic(addr, &identity).await;
            });
        }
        QuicNow::Down
    }

    async fn connect_quic(
        &self,
        addr: SocketAddr,
        identity: &SpiffeId,
    ) -> Option<quinn::Connection> {
        let result = async {
            let tls = (*self.tls(identity)?).clone();
            let config = client_config(tls)?;
            let server_name = match server_name_for(identity) {
                rustls::pki_types::ServerName::DnsName(n) => n.as_ref().to_string(),
                other => format!("{other:?}"),
            };
            let connecting = self
                .endpoint
                .connect_with(config, addr, &server_name)
                .map_err(|e| TunnelError::Protocol(e.to_string(), addr))?;
            tokio::time::timeout(QUIC_CONNECT_TIMEOUT, connecting)
                .await
                .map_err(|_| TunnelError::Connect {
                    node: addr,
                    source: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "QUIC handshake timed out (UDP blocked?)",
                    ),
                })?
                .map_err(|e| TunnelError::Protocol(format!("QUIC: {e}"), addr))
        }
        .await;
        let mut gateways = self.gateways.lock().unwrap_or_else(|e| e.into_inner());
        let state = gateways.entry((addr, identity.clone())).or_default();
        state.probing = false;
        match result {
            Ok(connection) => {
                if state.quic_down_until.take().is_some() {
                    tracing::info!(gateway = %addr, "QUIC works again: leaving the TCP fallback");
                }
                state.backoff = Duration::ZERO;
                state.connection = Some(connection.clone());
                Some(connection)
            }
            Err(e) => {
                state.backoff = (state.backoff * 2).clamp(Duration::from_secs(1), MAX_BACKOFF);
                state.quic_down_until = Some(Instant::now() + state.backoff);
                tracing::info!(gateway = %addr, retry_in = ?state.backoff, "QUIC unavailable ({e}): falling back to TCP + TLS");
                None
            }
        }
    }

    async fn tcp(
        &self,
        addr: SocketAddr,
        identity: &SpiffeId,
    ) -> Result<crate::io::ClientTls, TunnelError> {
        let timed_out = || TunnelError::Connect {
            node: addr,
            source: std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"),
        };
        let key = (addr, identity.clone());
        {
            let gateways = self.gateways.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(until) = gateways.get(&key).and_then(|s| s.tcp_down_until)
                && Instant::now() < until
            {
                return Err(timed_out());
            }
        }
        let tcp = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(connected) => {
                connected.map_err(|source| TunnelError::Connect { node: addr, source })?
            }
            Err(_) => {
                let mut gateways = self.gateways.lock().unwrap_or_else(|e| e.into_inner());
                gateways.entry(key).or_default().tcp_down_until =
                    Some(Instant::now() + TCP_HOLD_DOWN);
                return Err(timed_out());
            }
        };
        let tls = super::client::connect_tls(self.tcp_tls(identity)?, tcp, addr, identity).await;
        if let Err(TunnelError::Tls { source, .. }) = &tls
            && source.kind() == std::io::ErrorKind::TimedOut
        {
            // Accepted TCP, then silence: hung, as good as unreachable.
            let mut gateways = self.gateways.lock().unwrap_or_else(|e| e.into_inner());
            gateways.entry(key).or_default().tcp_down_until = Some(Instant::now() + TCP_HOLD_DOWN);
        }
        tls
    }
}

#[cfg(test)]
mod reset_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_limit_grows_when_half_is_in_use_up_to_the_maximum() {
        assert_eq!(raised_stream_limit(1, 64), None);
        assert_eq!(raised_stream_limit(31, 64), None);
        assert_eq!(raised_stream_limit(32, 64), Some(256));
        assert_eq!(raised_stream_limit(128, 256), Some(1024));
        assert_eq!(raised_stream_limit(1024, 1024), None);
        // Never beyond the maximum, whatever the count says.
        assert_eq!(
            raised_stream_limit(u32::MAX, 512),
            Some(MAX_STREAMS_PER_CONNECTION)
        );
    }
}
