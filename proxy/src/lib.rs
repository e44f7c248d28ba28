//! The node proxy: one per node (a DaemonSet), carrying local mesh traffic
//! between nodes over mutual TLS and mirror traffic to remote gateways.
//!
//! - [`outbound`]: port 4140, the HTTP proxy the node's pods call.
//! - [`transparent`]: pods whose traffic is redirected to the proxy inside
//!   their own network namespace (ztunnel's in-pod mode), with [`dns`];
//!   [`cni`]: chaining the enrolling plugin into the node's CNI configuration.
//! - [`inbound`]: port 4143, mutual TLS from other node proxies; delivers only
//!   to pods on this node.
//! - [`identity`]: the pods' identities this proxy holds, and how the server
//!   side picks the certificate a client asked for.
//! - [`view`]: what the proxy asks of discovery (local pods, destinations
//!   as typed endpoints).
//! - [`drain`]: graceful shutdown (closing, then draining).
//! - [`balance`]: power of two choices over peak-EWMA latency.
//! - [`metrics`]: what `/metrics` on the admin port (4191) shows.
#![forbid(unsafe_code)]

pub mod balance;
pub mod cni;
pub mod dns;
pub mod drain;
pub mod hop;
pub mod identity;
pub mod inbound;
pub mod metrics;
pub mod outbound;
pub mod retry;
pub mod transparent;
pub mod view;

// Shared with the gateway; re-exported so `strait_proxy::detect` and
// `strait_proxy::discovery` keep working.
pub use strait_mesh::{detect, discovery};
