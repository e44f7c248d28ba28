//! The multicluster gateway: receives cross-cluster streams from linked
//! clusters' node proxies over QUIC (UDP 4143) or TCP + TLS (TCP 4143), checks
//! them against the exported Service's policy, and forwards them through this
//! cluster's node proxies with the original caller's identity.
#![forbid(unsafe_code)]

pub mod policy;
pub mod refusal;
pub mod server;
