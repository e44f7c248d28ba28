//! `strait-mirror`: Service mirror controller: copies Services exported from linked clusters into this cluster.
#![forbid(unsafe_code)]

use std::sync::Arc;

use clap::{Parser, Subcommand};
use kube::CustomResourceExt;
use strait_mesh::admin::{self, Readiness};
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
        default_value = "strait-multicluster"
    )]
    namespace: String,
    /// Renew link tokens after this fraction of their lifetime.
    #[arg(long, default_value_t = 0.7)]
    token_renew_at: f64,
    /// Log format: plain or json.
    #[arg(long, env = "STRAIT_LOG_FORMAT", default_value = "plain")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the Link CustomResourceDefinition (YAML) and exit: `strait-mirror crd | kubectl apply -f -`.
    Crd,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(Command::Crd) = args.command {
        print!("{}", serde_yaml::to_string(&Link::crd())?);
        return Ok(());
    }
    init_tracing(args.log_format, "info");
    let client = kube::Client::try_default().await?;
    let readiness = Readiness::default();
    let metrics = strait_mirror::metrics::MirrorMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let registry = Arc::new(registry);
    let admin = admin::spawn(args.admin_addr, readiness.clone(), registry).await?;
    tracing::info!(%admin, "mirror controller starting");
    readiness.set_ready(true);
    strait_mirror::run(
        client,
        strait_mirror::MirrorConfig {
            namespace: args.namespace,
            token_renew_at: args.token_renew_at,
            metrics,
        },
    )
    .await;
    Ok(())
}
