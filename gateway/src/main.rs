//! `strait-gateway`: QUIC + mTLS multicluster gateway: receives cross-cluster traffic for exported Services.
#![forbid(unsafe_code)]

/// jemalloc, as ztunnel and linkerd2-proxy: measured in
/// `scripts/bench-proxy.sh` (see ARCHITECTURE.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use strait_gateway::server::{Gateway, GatewayMetrics};
use strait_mesh::admin::{self, Readiness};
use strait_mesh::discovery::{Discovery, DiscoveryConfig};
use strait_mesh::identity::client::IdentityMetrics;
use strait_mesh::identity::workload::IdentityArgs;
use strait_mesh::telemetry::{LogFormat, init_tracing};
use strait_mesh::tunnel::quic;

/// QUIC + mTLS multicluster gateway: receives cross-cluster traffic for exported Services.
#[derive(Debug, Parser)]
#[command(name = "strait-gateway", version)]
struct Args {
    /// This cluster's name (metrics, messages).
    #[arg(long, env = "STRAIT_CLUSTER_NAME", default_value = "local")]
    cluster_name: String,
    /// Trust domain of this cluster's workload identities.
    #[arg(long, env = "STRAIT_TRUST_DOMAIN", default_value = "cluster.local")]
    trust_domain: String,
    /// The cluster's DNS domain.
    #[arg(long, env = "STRAIT_CLUSTER_DOMAIN", default_value = "cluster.local")]
    cluster_domain: String,
    /// Where QUIC (UDP) and the TCP + TLS fallback listen: the same port.
    #[arg(long, default_value = "0.0.0.0:4143")]
    listen_addr: SocketAddr,
    /// Inbound port of this cluster's node proxies.
    #[arg(long, default_value_t = 4143)]
    proxy_inbound_port: u16,
    /// The label that exports a Service (key=value), as the Links' selector.
    #[arg(long, default_value = "strait.dev/exported=true", value_parser = parse_label)]
    export_label: (String, String),
    /// Address of the admin server (`/live`, `/ready`, `/metrics`; plain HTTP
    /// and mTLS on the same port, for the mirror controllers' probes).
    #[arg(long, env = "STRAIT_ADMIN_ADDR", default_value = "0.0.0.0:4191")]
    admin_addr: SocketAddr,
    /// A file holding the secret (at least 32 bytes) every replica of this
    /// cluster's gateway derives its QUIC stateless resets from, so a
    /// replacement resets the connections its predecessor held at once
    /// (`strait install` makes it: Secret `strait-gateway-reset-key`). Without
    /// it (or if the file is missing) each process has a random one: peers of
    /// a crashed gateway wait out the idle timeout.
    #[arg(long, env = "STRAIT_STATELESS_RESET_KEY_FILE")]
    stateless_reset_key_file: Option<std::path::PathBuf>,
    /// How long open streams may finish after SIGTERM.
    /// The most connections each transport (QUIC, TCP + TLS) holds at once,
    /// handshakes included; past it QUIC connections are refused
    /// (CONNECTION_REFUSED) and TCP ones closed, counted in
    /// `listener_connections_refused_total`.
    #[arg(long, env = "STRAIT_MAX_CONNECTIONS", default_value_t = strait_mesh::limits::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    #[command(flatten)]
    identity: IdentityArgs,
    /// Log format: plain or json.
    #[arg(long, env = "STRAIT_LOG_FORMAT", default_value = "plain")]
    log_format: LogFormat,
    /// Runtime threads. 1 (the default, as linkerd2-proxy runs on one core
    /// unless given more): a single-threaded runtime: quinn's endpoint task,
    /// its connection tasks and the streams wake each other without crossing
    /// threads. Measured in `scripts/bench-wan.sh` on two CPUs: QUIC bulk
    /// through the gateway 1.09× the TCP fallback in both of two runs, against
    /// 0.86–0.93× in five runs with a worker per CPU (BENCHMARKS.md).
    /// 0 = one worker per available CPU (cgroup limits included), N = N
    /// workers: for a TCP fallback carrying more than one core's worth of
    /// connections.
    #[arg(long, env = "STRAIT_GATEWAY_WORKERS", default_value_t = 1)]
    workers: usize,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?}: write the label as key=value"))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    strait_mesh::runtime::build(args.workers)
        .context("starting the runtime")?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    init_tracing(args.log_format, "info");
    let metrics = GatewayMetrics::default();
    let identity_metrics = IdentityMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    identity_metrics.register(&mut registry);
    let listener_metrics = strait_mesh::limits::ListenerMetrics::default();
    listener_metrics.register(&mut registry);
    let registry = Arc::new(registry);
    let readiness = Readiness::default();

    let (store, bundle) = args.identity.store(identity_metrics)?;
    let own = store
        .own()
        .await
        .context("getting the gateway's identity from the issuer")?;
    tracing::info!(identity = %own.id(), "identity loaded");

    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster or KUBECONFIG)")?;
    let mut config = DiscoveryConfig::new("");
    config.cluster_domain = args.cluster_domain.clone();
    config.trust_domain = args.trust_domain.clone();
    config.inbound_port = args.proxy_inbound_port;
    config.export_label = args.export_label.clone();
    let (discovery, watches) = Discovery::start(client, config);
    tokio::spawn(watches);
    discovery.synced().await?;
    tracing::info!("discovery synced");

    let gateway = Gateway::new(
        &args.cluster_name,
        discovery,
        own.clone(),
        bundle.clone(),
        metrics,
    );
    let tls = Arc::new(gateway.server_tls()?);
    // The fallback offers HTTP/2 multiplexing first; the admin port speaks
    // HTTP/1.1 over mTLS for HTTPS probes.
    let tcp_tls = Arc::new(gateway.server_tls_with(&[
        strait_mesh::tunnel::quic::TUNNEL_H2_ALPN,
        strait_mesh::tunnel::TUNNEL_ALPN,
    ])?);
    let admin_tls = Arc::new(gateway.server_tls_with(&[b"http/1.1"])?);
    let admin = admin::spawn_with_tls(
        args.admin_addr,
        readiness.clone(),
        registry,
        Some(admin_tls),
    )
    .await?;
    let reset_key = match &args.stateless_reset_key_file {
        Some(path) if !path.exists() => {
            tracing::warn!(
                path = %path.display(),
                "no stateless-reset key (Secret strait-gateway-reset-key, made by `strait install`): this replica resets only its own connections; peers of a crashed predecessor wait out the idle timeout"
            );
            None
        }
        Some(path) => Some(std::fs::read(path).with_context(|| {
            format!(
                "reading the stateless-reset key {} (--stateless-reset-key-file)",
                path.display()
            )
        })?),
        None => None,
    };
    let endpoint = quic::endpoint_with_reset_key(
        args.listen_addr,
        Some(quic::server_config((*tls).clone())?),
        reset_key.as_deref(),
    )
    .with_context(|| format!("binding QUIC on udp {}", args.listen_addr))?;
    let tcp = tokio::net::TcpListener::bind(args.listen_addr)
        .await
        .with_context(|| format!("binding the TCP fallback on tcp {}", args.listen_addr))?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(gateway.clone().serve_quic(
        endpoint.clone(),
        strait_mesh::limits::ConnLimit::new("quic", args.max_connections, &listener_metrics),
        stopped.clone(),
    ));
    tokio::spawn(gateway.clone().serve_tcp(
        tcp,
        tcp_tls,
        strait_mesh::limits::ConnLimit::new("tcp", args.max_connections, &listener_metrics),
        stopped,
    ));
    readiness.set_ready(true);
    tracing::info!(listen = %args.listen_addr, %admin, cluster = %args.cluster_name, "gateway ready (QUIC and TCP + TLS)");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    readiness.set_ready(false);
    let _ = stop.send(true);
    tracing::info!(open = gateway.active(), "draining");
    let deadline = tokio::time::Instant::now() + args.drain_timeout;
    while gateway.active() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    endpoint.close(0u32.into(), b"gateway shutting down");
    Ok(())
}
