//! `strait-identity`: the per-cluster certificate issuer.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Duration;

use clap::Parser;
use strait_identity::IssuerConfig;
use strait_mesh::names::{LINK_NAMESPACE, MIRROR_SERVICE_ACCOUNT};
use strait_mesh::telemetry::{LogFormat, init_tracing};

/// The mirror controller's account: it probes gateways as itself, from the link namespace.
static MIRROR_ACCOUNT: LazyLock<String> =
    LazyLock::new(|| format!("{LINK_NAMESPACE}/{MIRROR_SERVICE_ACCOUNT}"));

/// Strait identity issuer: signs short-lived SPIFFE certificates for verified ServiceAccount tokens.
#[derive(Debug, Parser)]
#[command(name = "strait-identity", version)]
struct Args {
    /// HTTPS address certificate requests arrive on.
    #[arg(long, env = "STRAIT_IDENTITY_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Admin address (/live, /ready, /metrics).
    #[arg(long, env = "STRAIT_ADMIN_ADDR", default_value = "0.0.0.0:4191")]
    admin_addr: SocketAddr,
    /// The issuer (intermediate CA) certificate, PEM: `tls.crt` of the issuer Secret.
    #[arg(long, default_value = "/var/run/strait/issuer/tls.crt")]
    issuer_cert: PathBuf,
    /// The issuer key, PEM: `tls.key` of the issuer Secret. Never leaves this process.
    #[arg(long, default_value = "/var/run/strait/issuer/tls.key")]
    issuer_key: PathBuf,
    /// Trust-anchor bundle, PEM (one or more roots).
    #[arg(long, default_value = "/var/run/strait/issuer/ca.crt")]
    trust_anchors: PathBuf,
    /// Trust domain of issued SPIFFE IDs. Default: the one the issuer certificate is
    /// name-constrained to (else cluster.local); if given, it must agree.
    #[arg(long, env = "STRAIT_TRUST_DOMAIN")]
    trust_domain: Option<String>,
    /// Validity of issued certificates (e.g. 24h, 90m).
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    leaf_validity: Duration,
    /// ServiceAccount (<namespace>/<name>) of node proxies, which may request
    /// the identity of pods on their own node. Repeatable.
    #[arg(long = "node-agent", default_value = "strait-system/strait-proxy")]
    node_agents: Vec<String>,
    /// Namespace whose ServiceAccounts are never certified, because others
    /// hold their tokens: the link namespace, where `strait link` creates the
    /// accounts whose tokens linked clusters use. Repeatable.
    #[arg(long = "refuse-namespace", default_value = LINK_NAMESPACE)]
    refused_namespaces: Vec<String>,
    /// ServiceAccount (<namespace>/<name>) certified although its namespace is
    /// refused (the mirror controller, which probes gateways as itself). Repeatable.
    #[arg(long = "certify-in-refused", default_value = MIRROR_ACCOUNT.as_str())]
    refusal_exceptions: Vec<String>,
    /// DNS names for the issuer's serving certificate. Repeatable.
    #[arg(long = "dns-name", default_value = "strait-identity.strait-system.svc")]
    dns_names: Vec<String>,
    /// Namespace the issuer runs in.
    #[arg(long, env = "POD_NAMESPACE", default_value = strait_mesh::names::SYSTEM_NAMESPACE)]
    namespace: String,
    /// ServiceAccount the issuer runs as.
    #[arg(long, default_value = "strait-identity")]
    service_account: String,
    /// Log format: plain or json.
    #[arg(long, env = "STRAIT_LOG_FORMAT", default_value = "plain")]
    log_format: LogFormat,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    init_tracing(a.log_format, "info");
    if a.leaf_validity < Duration::from_secs(60) {
        anyhow::bail!(
            "--leaf-validity {:?} is too short: at least 1m",
            a.leaf_validity
        );
    }
    let config = IssuerConfig {
        listen: a.listen,
        admin: a.admin_addr,
        issuer_cert: a.issuer_cert,
        issuer_key: a.issuer_key,
        trust_anchors: a.trust_anchors,
        trust_domain: a.trust_domain,
        leaf_validity: a.leaf_validity,
        node_agents: a.node_agents,
        refused_namespaces: a.refused_namespaces,
        refusal_exceptions: a.refusal_exceptions,
        dns_names: a.dns_names,
        namespace: a.namespace,
        service_account: a.service_account,
    };
    tokio::select! {
        result = strait_identity::run(config) => result,
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}
