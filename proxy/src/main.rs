//! `strait-proxy`: Node proxy (one per node): carries local mesh traffic and traffic to remote gateways.
#![forbid(unsafe_code)]

use clap::Parser;
use strait_mesh::telemetry::{LogFormat, init_tracing};

/// Node proxy (one per node): carries local mesh traffic and traffic to remote gateways.
#[derive(Debug, Parser)]
#[command(name = "strait-proxy", version)]
struct Args {
    /// Address of the admin server (`/live`, `/ready`, `/metrics`).
    #[arg(long, env = "STRAIT_ADMIN_ADDR", default_value = "0.0.0.0:4191")]
    admin_addr: std::net::SocketAddr,
    /// Log format: plain or json.
    #[arg(long, env = "STRAIT_LOG_FORMAT", default_value = "plain")]
    log_format: LogFormat,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    init_tracing(args.log_format, "info");
    tracing::error!(
        admin_addr = %args.admin_addr,
        "strait-proxy is not built yet: it arrives with issue #5"
    );
    std::process::ExitCode::from(2)
}
