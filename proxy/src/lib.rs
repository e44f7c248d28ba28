//! The node proxy: one per node (a DaemonSet), carrying local mesh traffic
//! between nodes over mutual TLS and mirror traffic to remote gateways.
#![forbid(unsafe_code)]

pub mod detect;
