//! The service mirror controller: one process per cluster handles every Link.
//!
//! A kube-runtime controller reconciles `Link` objects: it keeps one worker per
//! Link (restarted when the Link's spec or its credentials Secret changes) and
//! a finalizer that removes the Link's mirrors before the Link goes away. Each
//! worker ([`worker`]) watches its remote cluster and writes mirrors here.
#![forbid(unsafe_code)]

pub mod clusterset;
pub mod config;
pub mod controller;
pub mod coredns;
pub mod heartbeat;
pub mod latency;
pub mod leader;
pub mod mcs;
pub mod metrics;
pub mod mirror;
pub mod probe;
pub mod remote_slices;
pub mod resolve;
pub mod status;
pub mod token;
pub mod worker;

pub use config::{LocalServices, MirrorConfig};
pub use controller::{Error, remove_all_mirrors, run};
