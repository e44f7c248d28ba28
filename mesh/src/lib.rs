//! The parts of Strait that more than one binary needs.
//!
//! Identity and TLS, the tunnel protocol, discovery from the Kubernetes API,
//! protocol detection, the admin server and telemetry, so the mirror, gateway,
//! proxy and CLI all call the same code (see ARCHITECTURE.md).
#![forbid(unsafe_code)]

pub mod admin;
pub mod detect;
pub mod discovery;
pub mod identity;
pub mod io;
pub mod kubeconfig;
pub mod limits;
pub mod link;
pub mod mcs;
pub mod names;
pub mod policy;
pub mod runtime;
pub mod telemetry;
pub mod tunnel;
