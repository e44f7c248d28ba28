//! `strait-mirror`: Service mirror controller: copies Services exported from linked clusters into this cluster.
#![forbid(unsafe_code)]

use clap::Parser;
use strait_mesh::telemetry::{LogFormat, init_tracing};

/// Service mirror controller: copies Services exported from linked clusters into this cluster.
#[derive(Debug, Parser)]
#[command(name = "strait-mirror", version)]
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
        "strait-mirror is not built yet: it arrives with issue #4"
    );
    std::process::ExitCode::from(2)
}
