//! Why a node could not start, each saying what to fix.

use std::path::PathBuf;

use super::READY_TIMEOUT;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("real nodes need {what}, which is missing: {fix}")]
    Missing { what: String, fix: String },
    #[error("node {node}: cannot {what}: {message}")]
    Setup {
        node: String,
        what: String,
        message: String,
    },
    #[error(
        "node {node}: {component} exited ({status}); last lines of {log}:\n{tail}",
        log = .log.display()
    )]
    Exited {
        node: String,
        component: String,
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error(
        "node {node}: not Ready after {}s ({what}); last lines of the kubelet's log {log}:\n{tail}",
        READY_TIMEOUT.as_secs(), log = .log.display()
    )]
    NotReady {
        node: String,
        what: String,
        log: PathBuf,
        tail: String,
    },
    #[error(
        "port {port}/{protocol} is taken on every address of this host{holder}: real-node clusters run \
         {component} on port {port} of their LAN address; stop that program, or make it listen on \
         specific addresses only (dnsmasq: `bind-interfaces`; systemd-resolved's 127.0.0.53 is fine)"
    )]
    PortInUse {
        port: u16,
        protocol: &'static str,
        component: &'static str,
        /// `, by <ss output>` when `ss` names the socket's owner.
        holder: String,
    },
}
