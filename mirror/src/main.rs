//! `strait-mirror`: Service mirror controller: copies Services exported from linked clusters into this cluster.
#![forbid(unsafe_code)]

use std::sync::Arc;

use clap::{Parser, Subcommand};
use kube::CustomResourceExt;
use strait_mesh::admin::{self, Readiness};
use strait_mesh::identity::client::IdentityMetrics;
use strait_mesh::identity::workload::IdentityArgs;
use strait_mesh::link::Link;
use strait_mesh::telemetry::{LogFormat, init_tracing};

/// Service mirror controller: copies Services exported from linked clusters into this cluster.
#[derive(Debug, Parser)]
#[command(name = "strait-mirror", version)]
struct Args {
    /// Address of the admin server (`/live`, `/ready`, `/metrics`).
    #[arg(long, env = "STRAIT_ADMIN_ADDR", default_value = "0.0.0.0:4191")]
    admin_addr: std::net::SocketAddr,
    /// Namespace of the Links and their credentials Secrets.
    #[arg(
        long,
        env = "STRAIT_LINK_NAMESPACE",
        default_value = strait_mesh::names::LINK_NAMESPACE
    )]
    namespace: String,
    /// Renew link tokens after this fraction of their lifetime.
    #[arg(long, default_value_t = 0.7)]
    token_renew_at: f64,
    /// Do not probe gateways (no identity needed); every gateway counts as alive.
    #[arg(long)]
    no_gateway_probe: bool,
    /// Resolve gateway hostnames with these DNS servers (`ip:port`) instead of the system's.
    #[arg(long, value_delimiter = ',')]
    dns_server: Vec<std::net::SocketAddr>,
    /// This cluster's name in the clusterset, published as the ClusterProperty
    /// `cluster.clusterset.k8s.io` (created if missing; a different existing
    /// name stops the controller). `strait install` sets it.
    #[arg(long, env = "STRAIT_CLUSTER_NAME")]
    cluster_name: Option<String>,
    #[command(flatten)]
    identity: IdentityArgs,
    /// Log format: plain or json.
    #[arg(long, env = "STRAIT_LOG_FORMAT", default_value = "plain")]
    log_format: LogFormat,
    /// CoreDNS's ConfigMap (`namespace/name`) whose Corefile should serve
    /// `clusterset.local` from ServiceImports (CoreDNS 1.12.2+ `multicluster`);
    /// kept so by this controller. Empty: leave cluster DNS alone.
    #[arg(long, env = "STRAIT_COREDNS_CONFIGMAP", default_value = "")]
    coredns_configmap: String,
    /// Elect one leader among the replicas with the Lease `strait-mirror` in
    /// the Links' namespace: only the leader mirrors; the others stand by
    /// (Ready) and take over when its lease runs out. `--leader-elect=false`
    /// for a single replica that just renews the Lease as its heartbeat.
    #[arg(long, env = "STRAIT_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// How long a leader's Lease lasts without renewal (a follower takes over
    /// within this plus two retry periods of the leader dying).
    #[arg(long, default_value = "7s", value_parser = humantime::parse_duration)]
    leader_lease_duration: std::time::Duration,
    /// A leader that could not renew for this long stops every writer (and
    /// exits, to start over as a follower); shorter than the lease duration.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    leader_renew_deadline: std::time::Duration,
    /// How often the leader renews and followers look at the Lease.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    leader_retry_period: std::time::Duration,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the Link CustomResourceDefinition (YAML) and exit: `strait-mirror crd | kubectl apply -f -`.
    Crd {
        /// Print the Multi-Cluster Services CRDs instead: ServiceExport and
        /// ServiceImport (`multicluster.x-k8s.io/v1beta1`, served as `v1alpha1`
        /// too) and ClusterProperty
        /// (`about.k8s.io/v1alpha1`).
        #[arg(long)]
        mcs: bool,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(Command::Crd { mcs }) = args.command {
        if mcs {
            for crd in strait_mesh::mcs::crds() {
                print!("---\n{}", serde_yaml::to_string(&crd)?);
            }
        } else {
            print!("{}", serde_yaml::to_string(&Link::crd())?);
        }
        return Ok(());
    }
    init_tracing(args.log_format, "info");
    let readiness = Readiness::default();
    let metrics = strait_mirror::metrics::MirrorMetrics::default();
    let identity_metrics = IdentityMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    identity_metrics.register(&mut registry);
    let registry = Arc::new(registry);
    let admin = admin::spawn(args.admin_addr, readiness.clone(), registry).await?;
    tracing::info!(%admin, "mirror controller starting");
    // The identity is held for the life of the process: it keeps refreshing.
    let workload = if args.no_gateway_probe {
        tracing::warn!("--no-gateway-probe: gateways are not probed and count as alive");
        None
    } else {
        let w = args.identity.start(identity_metrics).await.map_err(|e| {
            anyhow::anyhow!("{e}\n(the gateway probe needs this controller's identity; pass --no-gateway-probe to run without it)")
        })?;
        tracing::info!(identity = %w.identity.id(), "identity loaded");
        Some(w)
    };
    let client = kube::Client::try_default().await?;
    if let Some(name) = args.cluster_name.clone() {
        // In the background: the MCS CRDs may arrive after the controller.
        // Every replica checks it (a contradicting name must stop a standby
        // too); creating it twice is harmless (a conflict is retried as a read).
        let client = client.clone();
        tokio::spawn(async move {
            if let Err(e) = strait_mirror::clusterset::ensure_cluster_name(&client, &name).await {
                tracing::error!("{e}");
                eprintln!("Error: {e}");
                std::process::exit(1);
            }
        });
    }
    // Every replica is Ready (it serves /metrics and stands by); only the
    // leader acts, as with kube-controller-manager.
    readiness.set_ready(true);
    if args.leader_elect {
        let timing = strait_mirror::leader::ElectionTiming {
            lease_duration: args.leader_lease_duration,
            renew_deadline: args.leader_renew_deadline,
            retry_period: args.leader_retry_period,
        };
        timing.check()?;
        let mut leadership = strait_mirror::leader::start(
            client.clone(),
            &args.namespace,
            strait_mesh::link::MIRROR_HEARTBEAT_LEASE,
            strait_mirror::heartbeat::holder(),
            timing,
            metrics.leader.clone(),
        );
        tracing::info!(identity = %strait_mirror::heartbeat::holder(), "standing by until this replica holds the leader Lease");
        leadership.acquired().await;
        tokio::spawn(async move {
            leadership.lost().await;
            // Exiting stops every Link worker and the MCS controller at once,
            // before another replica may take the Lease over.
            eprintln!("Error: lost the leader Lease; exiting so that only the new leader writes");
            std::process::exit(1);
        });
    } else {
        metrics.leader.set(1);
    }
    if !args.coredns_configmap.is_empty() {
        let Some((ns, name)) = args.coredns_configmap.split_once('/') else {
            anyhow::bail!(
                "--coredns-configmap {:?} is not namespace/name (kubeadm's and kind's: kube-system/coredns)",
                args.coredns_configmap
            );
        };
        tokio::spawn(strait_mirror::coredns::keep_configured(
            client.clone(),
            ns.to_string(),
            name.to_string(),
            strait_mesh::names::CLUSTERSET_DOMAIN.to_string(),
        ));
    }
    let identity = workload
        .as_ref()
        .map(|w| strait_mirror::probe::ProbeIdentity {
            bundle: w.bundle.clone(),
            cert: w.identity.cert(),
        });
    let dns = if args.dns_server.is_empty() {
        strait_mirror::resolve::DnsConfig::System
    } else {
        strait_mirror::resolve::DnsConfig::Servers(args.dns_server)
    };
    let namespace = args.namespace.clone();
    let clusterset = args
        .cluster_name
        .map(|name| (name, strait_mirror::mcs::ClustersetFeed::default()));
    if let Some((name, feed)) = &clusterset {
        tokio::spawn(strait_mirror::mcs::run(
            client.clone(),
            name.clone(),
            feed.clone(),
        ));
    }
    strait_mirror::run(
        client.clone(),
        strait_mirror::MirrorConfig {
            namespace: namespace.clone(),
            token_renew_at: args.token_renew_at,
            metrics,
            identity,
            dns,
            clusterset,
            heartbeat: !args.leader_elect,
        },
    )
    .await;
    // Shut down by a signal: hand the lead over now rather than when it expires.
    if args.leader_elect {
        strait_mirror::leader::release(
            client,
            &namespace,
            strait_mesh::link::MIRROR_HEARTBEAT_LEASE,
            &strait_mirror::heartbeat::holder(),
        )
        .await;
    }
    Ok(())
}
