//! The parts of Strait that more than one binary needs.
//!
//! Today this holds telemetry set-up; identity/TLS, the tunnel protocol and
//! discovery land here as their issues do, so the mirror, gateway, proxy and
//! CLI all call the same code (see ARCHITECTURE.md).
#![forbid(unsafe_code)]

pub mod admin;
pub mod identity;
pub mod link;
pub mod telemetry;
pub mod tunnel;
