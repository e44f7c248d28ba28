//! Workload identity: SPIFFE IDs, certificates under one shared trust anchor,
//! rustls configs for mutual TLS, the issuer protocol, and the client that keeps
//! certificates fresh.

pub mod ca;
pub mod certs;
pub mod client;
pub mod protocol;
pub mod refusals;
mod spiffe;
pub mod tls;
pub mod trust;
pub mod workload;

pub use spiffe::{SpiffeId, SpiffeIdError};
