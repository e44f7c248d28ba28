//! `strait`: the command people use to link clusters, check them and manage identities.
#![forbid(unsafe_code)]

mod check;
mod dashboard;
mod export;
mod gateways;
mod identity;
mod install;
mod link;
mod rotate;
mod stat;
mod table;

use clap::{Parser, Subcommand};
use strait_mesh::telemetry::{LogFormat, init_tracing};

/// Strait: a multicluster service mesh. Link clusters, export services, check the links.
#[derive(Debug, Parser)]
#[command(name = "strait", version)]
struct Cli {
    /// Log format: plain or json (logs go to stderr; stdout stays pipeable).
    #[arg(
        long,
        global = true,
        env = "STRAIT_LOG_FORMAT",
        default_value = "plain"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Trust anchor and issuer certificates: create, inspect, verify.
    #[command(subcommand)]
    Identity(identity::IdentityCommand),
    /// Link a TARGET cluster: prints the Secret and Link to apply to the SOURCE cluster
    /// (`strait link --context west --cluster-name west | kubectl --context east apply -f -`).
    Link(link::LinkArgs),
    /// Remove a Link, its credentials, its mirrors, and (with --target-context) its access on the target.
    Unlink(link::UnlinkArgs),
    /// Print this cluster's Strait manifests, with its identity, for `| kubectl apply -f -`.
    Install(install::InstallArgs),
    /// Print the objects `install` made, for `| kubectl delete -f -`; refuses while Links exist.
    Uninstall(install::UninstallArgs),
    /// Check this cluster's Strait and its links: ✓/× lines with hints; non-zero exit on failure.
    Check(check::CheckArgs),
    /// Linked clusters' gateways: CLUSTER, ALIVE, NUM_SVC, LATENCY (p50/p99).
    Gateways(gateways::GatewaysArgs),
    /// Golden metrics per Service (rate, success, latency), from this cluster's node proxies:
    /// calls its pods make, locally and to linked clusters, and calls into it from them.
    Stat(stat::StatArgs),
    /// A web page on localhost with the clusters, links, gateways and Services,
    /// and the golden metrics between clusters, live: `strait dashboard --context east`.
    Dashboard(dashboard::DashboardArgs),
    /// Export a Service to linked clusters: `strait export svc/web -n shop`.
    Export(export::ExportArgs),
    /// Stop exporting a Service: `strait unexport svc/web -n shop`.
    Unexport(export::ExportArgs),
    /// Print the version of this CLI.
    Version,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format, "warn");
    let result = match cli.command {
        Command::Identity(command) => identity::run(command),
        Command::Link(args) => runtime()
            .and_then(|rt| rt.block_on(link::link(args)))
            .map(|out| print!("{out}")),
        Command::Unlink(args) => runtime().and_then(|rt| rt.block_on(link::unlink(args))),
        Command::Install(args) => install::install(args).map(|out| print!("{out}")),
        Command::Uninstall(args) => runtime()
            .and_then(|rt| rt.block_on(install::uninstall(args)))
            .map(|out| print!("{out}")),
        Command::Check(args) => match runtime().and_then(|rt| rt.block_on(check::check(args))) {
            Ok(true) => Ok(()),
            Ok(false) => return std::process::ExitCode::FAILURE,
            Err(e) => Err(e),
        },
        Command::Gateways(args) => runtime()
            .and_then(|rt| rt.block_on(gateways::gateways(args)))
            .map(|out| print!("{out}")),
        Command::Stat(args) => runtime()
            .and_then(|rt| rt.block_on(stat::stat(args)))
            .map(|out| print!("{out}")),
        Command::Dashboard(args) => {
            runtime().and_then(|rt| rt.block_on(dashboard::dashboard(args)))
        }
        Command::Export(args) => runtime()
            .and_then(|rt| rt.block_on(export::export(args)))
            .map(|out| print!("{out}")),
        Command::Unexport(args) => runtime()
            .and_then(|rt| rt.block_on(export::unexport(args)))
            .map(|out| print!("{out}")),
        Command::Version => {
            println!("strait {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
