//! `strait-proxy`: the node proxy (one per node, a DaemonSet).
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
use strait_mesh::admin::{self, Readiness};
use strait_mesh::identity::client::IdentityMetrics;
use strait_mesh::identity::workload::IdentityArgs;
use strait_mesh::names::{NODE_PROXY_DAEMONSET, SYSTEM_NAMESPACE};
use strait_mesh::telemetry::{LogFormat, init_tracing};
use strait_proxy::discovery::{Discovery, DiscoveryConfig};
use strait_proxy::drain::Drain;
use strait_proxy::identity::PodIdentities;
use strait_proxy::inbound::Inbound;
use strait_proxy::metrics::ProxyMetrics;
use strait_proxy::outbound::Outbound;
use strait_proxy::transparent::Transparent;
use strait_proxy::view::{MeshView, Via};

/// Node proxy (one per node): carries local mesh traffic and traffic to remote gateways.
#[derive(Debug, Parser)]
#[command(name = "strait-proxy", version)]
struct Args {
    /// The node this proxy runs on (downward API `spec.nodeName`).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// This cluster's name (a metrics label).
    #[arg(long, env = "STRAIT_CLUSTER_NAME", default_value = "local")]
    cluster_name: String,
    /// Trust domain of workload identities.
    #[arg(long, env = "STRAIT_TRUST_DOMAIN", default_value = "cluster.local")]
    trust_domain: String,
    /// Callers through gateways: `strict` sends the caller's end-to-end proof and refuses
    /// gateway-carried callers without one; `permissive` sends it and also believes this
    /// cluster's gateway about callers that bring none; `off` neither (for gateways of older
    /// versions). Upgrades: `permissive` until every linked cluster runs this version.
    #[arg(
        long,
        env = "STRAIT_END_TO_END_IDENTITY",
        value_enum,
        default_value = "strict"
    )]
    end_to_end_identity: strait_proxy::identity::EndToEnd,
    /// The cluster's DNS domain.
    #[arg(long, env = "STRAIT_CLUSTER_DOMAIN", default_value = "cluster.local")]
    cluster_domain: String,
    /// Where the node's pods reach the proxy (`http_proxy`, CONNECT).
    #[arg(long, default_value = "0.0.0.0:4140")]
    outbound_addr: SocketAddr,
    /// Where other node proxies connect (mutual TLS).
    #[arg(long, default_value = "0.0.0.0:4143")]
    inbound_addr: SocketAddr,
    /// Address of the admin server (`/live`, `/ready`, `/metrics`).
    #[arg(long, env = "STRAIT_ADMIN_ADDR", default_value = "0.0.0.0:4191")]
    admin_addr: SocketAddr,
    /// Transparent mode: the Unix socket where the node's CNI plugin enrolls
    /// pods (their traffic is then redirected to the proxy inside their own
    /// network namespace). Root-only (0600). Off when not given.
    #[arg(long, env = "STRAIT_ENROLL_SOCKET")]
    enroll_socket: Option<std::path::PathBuf>,
    /// Transparent mode: where captured pods are remembered, so that the
    /// next proxy on the node enrolls them again (default: `pods/` beside
    /// the enrollment socket).
    #[arg(long, env = "STRAIT_ENROLL_STATE_DIR")]
    enroll_state_dir: Option<std::path::PathBuf>,
    /// Transparent mode: the node's CNI configuration folder (mounted from
    /// the host); when given, the proxy chains `strait-cni` into the node's
    /// primary network configuration and keeps it there.
    #[arg(long, env = "STRAIT_CNI_CONF_DIR", requires = "cni_bin_dir")]
    cni_conf_dir: Option<std::path::PathBuf>,
    /// The node's CNI plugin folder (mounted from the host), where
    /// `strait-cni` is copied.
    #[arg(long, env = "STRAIT_CNI_BIN_DIR", requires = "cni_conf_dir")]
    cni_bin_dir: Option<std::path::PathBuf>,
    /// The plugin binary to copy (default: `strait-cni` beside this binary).
    #[arg(long, env = "STRAIT_CNI_PLUGIN")]
    cni_plugin: Option<std::path::PathBuf>,
    /// The namespace of this proxy's DaemonSet (downward API): when the
    /// proxy stops while its DaemonSet or Namespace is gone or being
    /// deleted, Strait is being uninstalled and transparent mode is undone
    /// on the node (CNI entry, plugin, every captured pod's rules).
    #[arg(long, env = "POD_NAMESPACE", default_value = SYSTEM_NAMESPACE)]
    pod_namespace: String,
    /// Where the DNS responder of transparent mode forwards names that are
    /// not Services of this cluster (default: the first non-loopback
    /// nameserver of /etc/resolv.conf; none: such names are refused).
    #[arg(long, env = "STRAIT_DNS_UPSTREAM")]
    dns_upstream: Option<SocketAddr>,
    /// How long open connections may finish after SIGTERM (after the
    /// shutdown delay).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    /// After SIGTERM, how long the proxy still accepts connections (not
    /// ready; every HTTP/1 response closes its connection) before its
    /// listeners stop: the time kube-proxy and the other proxies take to
    /// learn that this pod is terminating, so none of their new connections
    /// is refused. As Istio's terminationDrainDuration.
    #[arg(long, env = "STRAIT_SHUTDOWN_DELAY", default_value = "3s", value_parser = humantime::parse_duration)]
    shutdown_delay: Duration,
    /// The most connections each of the outbound and inbound ports holds at
    /// once (every worker thread together); past it, new ones are refused
    /// (outbound: a 503 naming this flag; inbound: closed before TLS, so the
    /// peer tries another endpoint) and counted in
    /// `listener_connections_refused_total`.
    #[arg(long, env = "STRAIT_MAX_CONNECTIONS", default_value_t = strait_mesh::limits::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    #[command(flatten)]
    identity: IdentityArgs,
    /// Log format: plain or json.
    #[arg(long, env = "STRAIT_LOG_FORMAT", default_value = "plain")]
    log_format: LogFormat,
    /// Runtime threads: 0 = one per available CPU (cgroup limits included);
    /// 1 = a single-threaded runtime, no cross-thread wake-ups (as
    /// linkerd2-proxy runs on one core); N = N worker threads.
    #[arg(long, env = "STRAIT_PROXY_WORKERS", default_value_t = 0)]
    workers: usize,
    /// How the threads share the work: `per-core` = each thread a
    /// single-threaded runtime with its own listeners (SO_REUSEPORT: the
    /// kernel spreads connections over them) and its own tunnel pools, as
    /// Envoy's workers: a connection never leaves its thread; `shared` = one
    /// work-stealing runtime for all threads.
    #[arg(
        long,
        env = "STRAIT_PROXY_RUNTIME",
        value_enum,
        default_value = "per-core"
    )]
    runtime: RuntimeModel,
    /// How HTTP/1 callers' requests travel to other node proxies and through
    /// gateways: `multiplexed` = as HTTP/2 streams over one tunnel per caller
    /// and endpoint (the receiving proxy speaks HTTP/1 to the pod); `per-connection`
    /// = one tunnel per pooled HTTP/1 connection. A receiver that predates
    /// multiplexing refuses it and gets per-connection tunnels.
    #[arg(
        long,
        env = "STRAIT_PROXY_HTTP1_TUNNELS",
        value_enum,
        default_value = "per-connection"
    )]
    http1_tunnels: strait_proxy::outbound::Http1Tunnels,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum RuntimeModel {
    Shared,
    PerCore,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let threads = match args.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // Per core, the main thread is one of the single-threaded workers.
    let workers = match args.runtime {
        RuntimeModel::PerCore => 1,
        RuntimeModel::Shared => args.workers,
    };
    strait_mesh::runtime::build(workers)
        .context("starting the runtime")?
        .block_on(run(args, threads))
}

async fn run(args: Args, threads: usize) -> anyhow::Result<()> {
    init_tracing(args.log_format, "info");
    let metrics = ProxyMetrics::new(&args.cluster_name, &args.trust_domain);
    let identity_metrics = IdentityMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    identity_metrics.register(&mut registry);
    let listener_metrics = strait_mesh::limits::ListenerMetrics::default();
    listener_metrics.register(&mut registry);
    let limits = (
        strait_mesh::limits::ConnLimit::new("outbound", args.max_connections, &listener_metrics),
        strait_mesh::limits::ConnLimit::new("inbound", args.max_connections, &listener_metrics),
    );
    let readiness = Readiness::default();
    let admin = admin::spawn(args.admin_addr, readiness.clone(), Arc::new(registry)).await?;
    tracing::info!(%admin, node = %args.node_name, "node proxy starting");

    // Identity first: without it the proxy can carry nothing.
    let (store, bundle) = args.identity.store(identity_metrics)?;
    let own = store
        .own()
        .await
        .context("getting the proxy's own identity from the issuer")?;
    tracing::info!(identity = %own.id(), "identity loaded");
    let identities =
        PodIdentities::new(store, bundle, &args.trust_domain, args.end_to_end_identity);

    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster or KUBECONFIG)")?;
    let mut config = DiscoveryConfig::new(&args.node_name);
    config.cluster_domain = args.cluster_domain.clone();
    config.trust_domain = args.trust_domain.clone();
    config.inbound_port = args.inbound_addr.port();
    let (discovery, watches) = Discovery::start(client.clone(), config);
    tokio::spawn(watches);
    discovery.synced().await?;
    tracing::info!("discovery synced");
    let view = Arc::new(MeshView::new(discovery.clone()));

    let (drain, shutdown) = Drain::new();
    let per_core = args.runtime == RuntimeModel::PerCore;
    let addrs = (args.outbound_addr, args.inbound_addr);
    let (outbound_listener, inbound_listener) = bind(addrs, per_core)?;
    // Mirror traffic: one QUIC connection per remote gateway, as this proxy.
    let gateways =
        strait_mesh::tunnel::quic::GatewayClient::new(identities.bundle().clone(), own.cert())
            .context("opening the UDP socket for QUIC to remote gateways")?;
    let outbound = Outbound::new(
        &args.node_name,
        identities.clone(),
        view.clone(),
        metrics.clone(),
        Some(gateways),
        args.http1_tunnels,
    );
    forget_gone(outbound.clone(), discovery.updates());
    follow_pods(identities.clone(), discovery.updates());
    let mut transparent_mode = None;
    if let Some(path) = &args.enroll_socket {
        let upstream = args.dns_upstream.or_else(|| {
            std::fs::read_to_string("/etc/resolv.conf")
                .ok()
                .and_then(|text| strait_proxy::dns::upstream_from_resolv_conf(&text))
        });
        let dns = Arc::new(strait_proxy::dns::DnsResponder {
            names: view.clone(),
            upstream,
        });
        let listener = Transparent::bind(path)
            .with_context(|| format!("binding the enrollment socket {}", path.display()))?;
        let state = args.enroll_state_dir.clone().unwrap_or_else(|| {
            path.parent()
                .unwrap_or(std::path::Path::new("/"))
                .join("pods")
        });
        let transparent = Transparent::new(outbound.clone(), dns, drain.clone(), Some(state));
        tokio::spawn(transparent.clone().serve(listener));
        // The pods an earlier proxy captured, before this one says ready.
        let restored = transparent.restore().await;
        tracing::info!(socket = %path.display(), ?upstream, restored, "transparent mode: pods may enroll");
        let chain = match (&args.cni_conf_dir, &args.cni_bin_dir) {
            (Some(conf_dir), Some(bin_dir)) => {
                let plugin = match &args.cni_plugin {
                    Some(p) => p.clone(),
                    None => std::env::current_exe()
                        .context("finding this binary (set --cni-plugin)")?
                        .with_file_name(strait_proxy::cni::PLUGIN),
                };
                let chain = strait_proxy::cni::CniChain {
                    conf_dir: conf_dir.clone(),
                    bin_dir: bin_dir.clone(),
                    plugin,
                    enroll_socket: path.clone(),
                };
                // Stopped at SIGTERM, before the uninstall check: a recheck
                // during the shutdown delay must not put back an entry the
                // uninstall just took out.
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let keeper = tokio::spawn(chain.clone().keep_installed(async {
                    let _ = stopped.await;
                }));
                Some((chain, stop, keeper))
            }
            _ => None,
        };
        transparent_mode = Some((transparent, chain));
    }
    let inbound = Arc::new(Inbound {
        node: args.node_name.clone(),
        identities,
        pods: view,
        metrics,
        refusal_log: Default::default(),
    });
    if per_core {
        // This thread serves too: threads - 1 more, each with its own
        // runtime, listeners and pools.
        for worker in 1..threads {
            let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
            let (outbound, updates, inbound, drain, (outbound_limit, inbound_limit)) = (
                outbound.worker(),
                discovery.updates(),
                inbound.clone(),
                drain.clone(),
                limits.clone(),
            );
            std::thread::Builder::new()
                .name(format!("strait-worker-{worker}"))
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(runtime) => runtime,
                        Err(e) => {
                            let _ = ready_tx.send(Err(anyhow::Error::from(e)));
                            return;
                        }
                    };
                    runtime.block_on(async move {
                        let (outbound_listener, inbound_listener) = match bind(addrs, true) {
                            Ok(listeners) => listeners,
                            Err(e) => {
                                let _ = ready_tx.send(Err(e));
                                return;
                            }
                        };
                        forget_gone(outbound.clone(), updates);
                        tokio::spawn(outbound.serve(
                            outbound_listener,
                            drain.clone(),
                            outbound_limit,
                        ));
                        tokio::spawn(inbound.serve(inbound_listener, drain, inbound_limit));
                        let _ = ready_tx.send(Ok(()));
                        // The listeners stop at the drain; the connections
                        // they accepted run on until they finish or the
                        // process exits (the main thread waits for the
                        // drain): the runtime must outlive them.
                        std::future::pending::<()>().await;
                    });
                })
                .context("starting a worker thread")?;
            ready_rx
                .await
                .context("a worker thread stopped while starting")?
                .with_context(|| format!("starting worker thread {worker}"))?;
        }
    }
    let (outbound_limit, inbound_limit) = limits;
    tokio::spawn(outbound.serve(outbound_listener, drain.clone(), outbound_limit));
    let inbound_task = tokio::spawn(inbound.serve(inbound_listener, drain.clone(), inbound_limit));
    readiness.set_ready(true);
    tracing::info!(outbound = %args.outbound_addr, inbound = %args.inbound_addr, "ready");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = inbound_task => {
            anyhow::bail!("the inbound listener stopped");
        }
    }
    readiness.set_ready(false);
    shutdown.start_closing();
    tracing::info!(delay = ?args.shutdown_delay, "shutting down: closing connections after their current response");
    let delay = tokio::time::sleep(args.shutdown_delay);
    if let Some((transparent, chain)) = transparent_mode {
        let chain = match chain {
            Some((chain, stop, keeper)) => {
                let _ = stop.send(());
                let _ = keeper.await;
                Some(chain)
            }
            None => None,
        };
        if being_uninstalled(&client, &args.pod_namespace).await {
            uninstall_transparent(&transparent, chain).await;
        }
    }
    delay.await;
    tracing::info!(open = shutdown.open(), "draining");
    let left = shutdown.drain(args.drain_timeout).await;
    if left > 0 {
        tracing::warn!(
            "{left} connections still open after {:?}; closing them",
            args.drain_timeout
        );
    }
    Ok(())
}

/// Undoes transparent mode on this node: new pods first (they must not wait
/// for a proxy that will not come), then the pods this proxy captured get
/// their own network back.
async fn uninstall_transparent(
    transparent: &Arc<Transparent>,
    chain: Option<strait_proxy::cni::CniChain>,
) {
    if let Some(chain) = chain {
        match tokio::task::spawn_blocking(move || chain.uninstall()).await {
            Ok(Ok(files)) => tracing::info!(
                ?files,
                "strait-cni taken out of the node's CNI configuration"
            ),
            Ok(Err(e)) => {
                tracing::warn!("taking strait-cni out of the node's CNI configuration: {e}")
            }
            Err(e) => tracing::warn!("{e}"),
        }
    }
    let released = transparent.release_all().await;
    tracing::info!(
        released,
        "Strait is being uninstalled: transparent mode undone on this node"
    );
}

/// Whether this proxy stops because Strait is being uninstalled (its
/// DaemonSet or Namespace gone or being deleted; its ServiceAccount or
/// RBAC gone, so the API refuses it), rather than replaced by a rollout.
/// When the API cannot be asked, the answer is no: transparent pods stay
/// closed rather than leave the mesh.
async fn being_uninstalled(client: &kube::Client, namespace: &str) -> bool {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use k8s_openapi::api::core::v1::Namespace;
    let asked = async {
        let daemonsets: kube::Api<DaemonSet> = kube::Api::namespaced(client.clone(), namespace);
        let namespaces: kube::Api<Namespace> = kube::Api::all(client.clone());
        let ds = daemonsets.get_opt(NODE_PROXY_DAEMONSET).await?;
        let ns = namespaces
            .list(&kube::api::ListParams::default().fields(&format!("metadata.name={namespace}")))
            .await?;
        let deleting = |m: &kube::api::ObjectMeta| m.deletion_timestamp.is_some();
        Ok::<_, kube::Error>(
            ds.is_none_or(|ds| deleting(&ds.metadata))
                || ns.items.first().is_none_or(|ns| deleting(&ns.metadata)),
        )
    };
    match tokio::time::timeout(Duration::from_secs(5), asked).await {
        Ok(Ok(gone)) => gone,
        Ok(Err(kube::Error::Api(e))) if e.code == 401 || e.code == 403 => {
            tracing::info!(
                "the API refuses this proxy ({}): Strait's RBAC is gone",
                e.code
            );
            true
        }
        Ok(Err(e)) => {
            tracing::warn!(
                "cannot tell whether Strait is being uninstalled ({e}); keeping transparent mode"
            );
            false
        }
        Err(_) => {
            tracing::warn!(
                "cannot tell whether Strait is being uninstalled (no answer in 5 s); keeping transparent mode"
            );
            false
        }
    }
}

/// Forgets the latency statistics and the pooled connections of endpoints
/// that are gone (bounded memory), on the calling thread's runtime.
/// Keeps each held pod identity bound to a pod of its account on this node,
/// and drops it when none is left ([`PodIdentities::follow_pods`]).
fn follow_pods(
    identities: Arc<PodIdentities>,
    mut updates: tokio::sync::watch::Receiver<Arc<strait_mesh::discovery::Snapshot>>,
) {
    tokio::spawn(async move {
        while updates.changed().await.is_ok() {
            let snapshot = updates.borrow_and_update().clone();
            if snapshot.is_synced() {
                identities
                    .follow_pods(snapshot.local_pods().map(|p| p.as_ref()))
                    .await;
            }
        }
    });
}

fn forget_gone(
    outbound: Arc<Outbound>,
    mut updates: tokio::sync::watch::Receiver<Arc<strait_mesh::discovery::Snapshot>>,
) {
    tokio::spawn(async move {
        while updates.changed().await.is_ok() {
            let snapshot = updates.borrow_and_update().clone();
            outbound
                .balancer
                .retain(|addr| snapshot.pod(addr.ip()).is_some());
            outbound.retain_endpoints(|endpoint| match &endpoint.via {
                // The pod is still there, behind the same node proxy (a
                // rolled-out proxy has a new address: a new pool).
                Via::NodeProxy(proxy) => snapshot
                    .pod(endpoint.addr.ip())
                    .is_some_and(|pod| snapshot.node_proxy(&pod.node) == Some(*proxy)),
                // Kept while in use; forgotten once idle.
                Via::Gateway { .. } => true,
            });
        }
    });
}

/// The outbound and inbound listeners (`addrs`) of the calling thread; with
/// SO_REUSEPORT when every thread has its own.
fn bind(
    (outbound, inbound): (SocketAddr, SocketAddr),
    shared: bool,
) -> anyhow::Result<(tokio::net::TcpListener, tokio::net::TcpListener)> {
    Ok((
        listener(outbound, shared).context("binding outbound")?,
        listener(inbound, shared).context("binding inbound")?,
    ))
}

/// A listener on `addr` (SO_REUSEADDR, as tokio's `bind`), registered with
/// the calling thread's runtime; `shared`: other threads' listeners share
/// the address (SO_REUSEPORT) and the kernel spreads connections over them.
fn listener(addr: SocketAddr, shared: bool) -> anyhow::Result<tokio::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    if shared {
        socket.set_reuse_port(true)?;
    }
    socket.set_nonblocking(true)?;
    socket
        .bind(&addr.into())
        .with_context(|| format!("binding {addr}"))?;
    socket.listen(1024)?;
    Ok(tokio::net::TcpListener::from_std(socket.into())?)
}
