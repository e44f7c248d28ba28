//! The gateway probe: every `probe.period`, each gateway address is probed with
//! the controller's identity, accepting only the Link's `gatewayIdentity`.
//! By default (`probe.port` unset or the gateway port) through the tunnel
//! itself: a stream to the gateway's probe target over the same QUIC (or
//! TCP fallback) path traffic takes, so the latency is the real path's;
//! with another `probe.port`, an HTTPS GET of `probe.path` there (the admin
//! port). After `failureThreshold` failures in a row an address
//! counts as down and its mirror endpoints turn not ready; one success brings it
//! back. Each address is judged on its own, so one dead replica of a gateway
//! behind several addresses does not take the others' endpoints down.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::tls::{self, CertSlot, TrustBundle};
use strait_mesh::link::{GATEWAY_LATENCY_PUBLISH_INTERVAL_SECS, ProbeSpec};
use strait_mesh::tunnel::client::TunnelError;
use strait_mesh::tunnel::quic::GatewayClient;
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::latency::LatencyWindow;
use crate::metrics::{LinkLabels, MirrorMetrics};
use crate::resolve::GatewayAddresses;
use crate::status::{LinkHealth, StatusReporter};

/// Latency is published after each of this many first successful probes.
const EARLY_LATENCY_SAMPLES: usize = 10;

/// The controller's own identity, presented to gateways when probing them.
#[derive(Clone, Debug)]
pub struct ProbeIdentity {
    pub bundle: TrustBundle,
    pub cert: Arc<CertSlot>,
}

/// One gateway address as the mirrors should see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatewayEndpoint {
    pub ip: IpAddr,
    pub alive: bool,
}

/// Probe settings parsed from a Link.
#[derive(Clone, Debug)]
pub struct ProbeSettings {
    pub path: String,
    pub port: u16,
    /// The gateway's tunnel port: a probe on it goes through the tunnel.
    pub gateway_port: u16,
    pub period: Duration,
    pub timeout: Duration,
    pub failure_threshold: u32,
}

impl ProbeSettings {
    /// Parses durations; what cannot be parsed falls back to the defaults, with a warning.
    pub fn from_spec(spec: &ProbeSpec, gateway_port: u16) -> Self {
        let parse = |what: &str, text: &str, default: Duration| {
            humantime::parse_duration(text).unwrap_or_else(|e| {
                tracing::warn!("probe {what} {text:?} is not a duration ({e}); using {default:?}");
                default
            })
        };
        Self {
            path: if spec.path.starts_with('/') {
                spec.path.clone()
            } else {
                format!("/{}", spec.path)
            },
            port: spec.port.unwrap_or(gateway_port),
            gateway_port,
            period: parse("period", &spec.period, Duration::from_secs(3))
                .max(Duration::from_millis(100)),
            timeout: parse("timeout", &spec.timeout, Duration::from_secs(2))
                .max(Duration::from_millis(50)),
            failure_threshold: spec.failure_threshold.max(1),
        }
    }
}

#[derive(Debug, Default)]
struct AddressState {
    failures: u32,
    last_error: Option<ProbeError>,
}

/// Why a probe of one gateway address failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("connecting to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("mTLS handshake with {addr}: {source}")]
    Handshake {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("HTTP with {addr}: {source}")]
    Http {
        addr: SocketAddr,
        source: hyper::Error,
    },
    #[error("probe request: {0}")]
    Request(#[from] http::Error),
    #[error("GET {path} on {addr}: {source}")]
    Get {
        path: String,
        addr: SocketAddr,
        source: hyper::Error,
    },
    #[error("GET {path} on {addr} answered {status}")]
    Status {
        path: String,
        addr: SocketAddr,
        status: http::StatusCode,
    },
    #[error("tunnel probe of {addr}: {source}")]
    Tunnel {
        addr: SocketAddr,
        source: TunnelError,
    },
    #[error("{what}{addr} gave no answer within {after:?}")]
    Timeout {
        what: &'static str,
        addr: SocketAddr,
        after: Duration,
    },
}

/// Probes one address once: connect, mTLS handshake (the server must be the
/// gateway identity), `GET path`, expecting 200. Returns the time it took.
pub async fn probe_once(
    connector: &tokio_rustls::TlsConnector,
    ip: IpAddr,
    settings: &ProbeSettings,
) -> Result<Duration, ProbeError> {
    let started = Instant::now();
    let addr = SocketAddr::new(ip, settings.port);
    let path = || settings.path.clone();
    let attempt = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|source| ProbeError::Connect { addr, source })?;
        let _ = tcp.set_nodelay(true);
        let tls = connector
            .connect(ServerName::IpAddress(ip.into()), tcp)
            .await
            .map_err(|source| ProbeError::Handshake { addr, source })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|source| ProbeError::Http { addr, source })?;
        let conn = tokio::spawn(conn);
        let request = http::Request::get(settings.path.as_str())
            .header(http::header::HOST, ip.to_string())
            .body(Empty::<Bytes>::new())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|source| ProbeError::Get {
                path: path(),
                addr,
                source,
            })?;
        conn.abort();
        if response.status() != http::StatusCode::OK {
            return Err(ProbeError::Status {
                path: path(),
                addr,
                status: response.status(),
            });
        }
        Ok(started.elapsed())
    };
    tokio::time::timeout(settings.timeout, attempt)
        .await
        .map_err(|_| ProbeError::Timeout {
            what: "",
            addr,
            after: settings.timeout,
        })?
}

/// How a Link's gateways are probed.
enum Prober {
    /// Through the tunnel (the gateway port): the data path itself.
    Tunnel {
        client: Arc<GatewayClient>,
        expected: SpiffeId,
    },
    /// HTTPS GET of `probe.path` on another port (the admin port).
    Https(tokio_rustls::TlsConnector),
}

impl Prober {
    async fn probe(&self, ip: IpAddr, settings: &ProbeSettings) -> Result<Duration, ProbeError> {
        match self {
            Prober::Https(connector) => probe_once(connector, ip, settings).await,
            Prober::Tunnel { client, expected } => {
                let addr = std::net::SocketAddr::new(ip, settings.port);
                match tokio::time::timeout(settings.timeout, client.probe(addr, expected)).await {
                    Ok(Ok((latency, _transport))) => Ok(latency),
                    Ok(Err(source)) => Err(ProbeError::Tunnel { addr, source }),
                    Err(_) => Err(ProbeError::Timeout {
                        what: "tunnel probe of ",
                        addr,
                        after: settings.timeout,
                    }),
                }
            }
        }
    }
}

/// Everything one Link's probe needs.
pub struct GatewayProbe {
    pub link: String,
    pub settings: ProbeSettings,
    pub gateway_identity: String,
    pub identity: Option<ProbeIdentity>,
    pub metrics: MirrorMetrics,
    pub status: StatusReporter,
}

impl GatewayProbe {
    /// Publishes the gateway's endpoints (address and liveness) on `tx` until
    /// every receiver is gone; updates the GatewayAlive condition and metrics.
    pub async fn run(
        self,
        mut addresses: watch::Receiver<Option<GatewayAddresses>>,
        tx: watch::Sender<Option<Vec<GatewayEndpoint>>>,
    ) {
        let labels = LinkLabels {
            link: self.link.clone(),
        };
        if addresses.wait_for(Option::is_some).await.is_err() {
            return;
        }
        let connector = match self.connector() {
            Ok(c) => c,
            Err(health) => {
                // No probing possible. Without an identity (probe disabled on
                // purpose) every address counts as alive; with a gateway that
                // cannot be verified (a bad gatewayIdentity) none does. The
                // condition says which.
                let alive = health.status != "False";
                self.metrics
                    .gateway_alive
                    .get_or_create(&labels)
                    .set(i64::from(alive));
                self.status.set_health(health).await;
                loop {
                    let ips = addresses
                        .borrow_and_update()
                        .clone()
                        .unwrap_or_default()
                        .ips;
                    publish(&tx, ips.iter().map(|&ip| (ip, alive)));
                    tokio::select! {
                        r = addresses.changed() => if r.is_err() { return },
                        _ = tx.closed() => return,
                    }
                }
            }
        };
        let mut states: BTreeMap<IpAddr, AddressState> = BTreeMap::new();
        let mut latencies = LatencyWindow::default();
        let mut latency_published: Option<Instant> = None;
        let mut ticker = tokio::time::interval(self.settings.period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                r = addresses.changed() => if r.is_err() { return },
                _ = tx.closed() => return,
            }
            let current = addresses.borrow_and_update().clone().unwrap_or_default();
            // New addresses start alive (one failure does not condemn them);
            // vanished ones are forgotten.
            states.retain(|ip, _| current.ips.contains(ip));
            for ip in &current.ips {
                states.entry(*ip).or_default();
            }
            // Mirrors may use new addresses before their first probe ends.
            publish(
                &tx,
                states
                    .iter()
                    .map(|(ip, s)| (*ip, s.failures < self.settings.failure_threshold)),
            );
            let results = futures::future::join_all(current.ips.iter().map(|&ip| {
                let (connector, settings) = (&connector, &self.settings);
                async move { (ip, connector.probe(ip, settings).await) }
            }))
            .await;
            for (ip, result) in results {
                let state = states.entry(ip).or_default();
                match result {
                    Ok(latency) => {
                        self.metrics
                            .probe_latency
                            .get_or_create(&labels)
                            .observe(latency.as_secs_f64());
                        latencies.record(latency);
                        if state.failures >= self.settings.failure_threshold {
                            tracing::info!(link = %self.link, gateway = %ip, ?latency, "gateway answers the probe again");
                        }
                        state.failures = 0;
                        state.last_error = None;
                    }
                    Err(e) => {
                        self.metrics.probe_failures.get_or_create(&labels).inc();
                        state.failures = state.failures.saturating_add(1);
                        if state.failures == self.settings.failure_threshold {
                            tracing::warn!(link = %self.link, gateway = %ip, "gateway down after {} failed probes: {e}", state.failures);
                        } else {
                            tracing::debug!(link = %self.link, gateway = %ip, "probe failed: {e}");
                        }
                        state.last_error = Some(e);
                    }
                }
            }
            let threshold = self.settings.failure_threshold;
            let alive = |s: &AddressState| s.failures < threshold;
            publish(&tx, states.iter().map(|(ip, s)| (*ip, alive(s))));
            let alive_count = states.values().filter(|s| alive(s)).count();
            self.metrics
                .gateway_alive
                .get_or_create(&labels)
                .set(i64::from(alive_count > 0));
            self.status
                .set_health(gateway_health(&states, threshold, &current))
                .await;
            // Each of the first few probes (the first one includes the
            // connection's handshake, so one sample alone misleads), then at
            // most every interval: a status write per probe would be churn
            // for every watcher of Links.
            let due = latencies.len() <= EARLY_LATENCY_SAMPLES
                || latency_published.is_none_or(|at| {
                    at.elapsed() >= Duration::from_secs(GATEWAY_LATENCY_PUBLISH_INTERVAL_SECS)
                });
            if due && let Some(summary) = latencies.summary() {
                self.status.set_gateway_latency(summary).await;
                latency_published = Some(Instant::now());
            }
        }
    }

    fn connector(&self) -> Result<Prober, LinkHealth> {
        let Some(identity) = &self.identity else {
            return Err(LinkHealth::gateway_unknown(
                "ProbeDisabled",
                "the controller has no identity (start it with the issuer flags) so the gateway is not probed and counts as alive",
            ));
        };
        let expected = self.gateway_identity.parse::<SpiffeId>().map_err(|e| {
            LinkHealth::gateway_down(
                "InvalidGatewayIdentity",
                &format!(
                    "spec.gatewayIdentity {:?} is not a SPIFFE ID ({e}); the gateway cannot be verified",
                    self.gateway_identity
                ),
            )
        })?;
        if self.settings.port == self.settings.gateway_port {
            let client = GatewayClient::new(identity.bundle.clone(), identity.cert.clone())
                .map_err(|e| {
                    LinkHealth::gateway_down("ProbeConfig", &format!("QUIC socket: {e}"))
                })?;
            return Ok(Prober::Tunnel { client, expected });
        }
        let config = tls::client_config(
            &identity.bundle,
            identity.cert.clone(),
            vec![expected],
            &[b"http/1.1"],
        )
        .map_err(|e| LinkHealth::gateway_down("ProbeConfig", &e.to_string()))?;
        Ok(Prober::Https(tokio_rustls::TlsConnector::from(Arc::new(
            config,
        ))))
    }
}

fn publish(
    tx: &watch::Sender<Option<Vec<GatewayEndpoint>>>,
    endpoints: impl Iterator<Item = (IpAddr, bool)>,
) {
    let new: Vec<GatewayEndpoint> = endpoints
        .map(|(ip, alive)| GatewayEndpoint { ip, alive })
        .collect();
    tx.send_if_modified(|old| {
        let changed = old.as_ref() != Some(&new);
        *old = Some(new);
        changed
    });
}

/// The GatewayAlive condition for the current probe state. Its message changes
/// only when liveness does, so a steady state writes no status.
fn gateway_health(
    states: &BTreeMap<IpAddr, AddressState>,
    threshold: u32,
    addresses: &GatewayAddresses,
) -> LinkHealth {
    if states.is_empty() {
        let why = if addresses.errors.is_empty() {
            "the Link has no gateway address: set spec.gatewayAddresses".to_string()
        } else {
            format!(
                "no gateway address could be resolved: {}",
                addresses.errors.join("; ")
            )
        };
        return LinkHealth::gateway_down("NoGatewayAddress", &why);
    }
    let down: Vec<String> = states
        .iter()
        .filter(|(_, s)| s.failures >= threshold)
        .map(|(ip, s)| {
            format!(
                "{ip}: {}",
                s.last_error
                    .as_ref()
                    .map_or("failing".into(), ToString::to_string)
            )
        })
        .collect();
    let also = if addresses.errors.is_empty() {
        String::new()
    } else {
        format!("; unusable: {}", addresses.errors.join("; "))
    };
    if down.is_empty() {
        LinkHealth::gateway_alive(&format!(
            "{} gateway address(es) answer the probe{also}",
            states.len()
        ))
    } else if down.len() < states.len() {
        LinkHealth::gateway_alive(&format!(
            "{} of {} gateway addresses answer the probe; down: {}{also}",
            states.len() - down.len(),
            states.len(),
            down.join("; ")
        ))
    } else {
        LinkHealth::gateway_down(
            "GatewayDown",
            &format!(
                "the gateway fails its probe ({threshold} in a row); its mirror endpoints are not ready: {}{also}",
                down.join("; ")
            ),
        )
    }
}
