//! Protocol detection: what the client of a new connection speaks, decided from
//! its first bytes, so the proxy knows whether it can apply HTTP features
//! (per-request balancing, metrics, retries) or must forward bytes as they come.
//! Used on both sides: outbound (port 4140) and inbound (4143, after mTLS).
//!
//! # Rules
//!
//! - **HTTP/2** iff the bytes start with the client connection preface
//!   `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n` (prior knowledge: h2c, gRPC).
//! - **HTTP/1** iff they start with a request line
//!   `METHOD SP request-target SP HTTP/1.0|HTTP/1.1 CRLF`: an upper-case method
//!   (registered ones are all upper-case; `get` is memcached, not HTTP), and a
//!   target in a form the method allows: origin-form `/path` for any method,
//!   absolute-form `http://host/path` (what clients send to an HTTP proxy),
//!   authority-form `host:port` only with `CONNECT`, `*` only with `OPTIONS`.
//! - **Opaque** as soon as the bytes can no longer be either: at the first byte
//!   for TLS, binary protocols and lower-case text; otherwise by the end of the
//!   request line.
//!
//! [`classify`] is pure and total, and bounded: it looks at no more than
//! [`MAX_DETECT_BYTES`] (8 KiB, Linkerd's detect buffer), and a request line
//! longer than that is opaque. A decision never changes when more bytes arrive,
//! so reading more can only turn [`Detection::NeedMore`] into an answer.
//!
//! [`detect`] reads into a buffer of at most [`MAX_DETECT_BYTES`] until
//! [`classify`] decides, the client closes, or the timeout fires. A timeout is
//! an answer, not an error: the client of a *server-speaks-first* protocol
//! (MySQL, SMTP) sends nothing until the server greets it, so silence means
//! opaque, as in Linkerd. That costs such a connection the whole timeout, which
//! is why those ports are configured as opaque and skip detection entirely
//! ([`skip_detection`], annotation `strait.dev/opaque-ports`). The bytes
//! detection consumed are returned, and [`PrefixedIo`] replays them in front of
//! the stream, so whatever comes next sees the connection unchanged.
//!
//! Misreading HTTP as opaque costs features, never correctness (the bytes are
//! forwarded unchanged); misreading anything else as HTTP breaks the
//! connection. So the rules are strict where they could be lenient.
//!
//! Except where the proxy vouches for the caller: the inbound proxy must not
//! splice bytes a pod's server would read as HTTP (they could carry a forged
//! `strait-client-id`), so on a stream the sender marked opaque it reads the
//! caller's first bytes with [`classify_lenient`], which calls HTTP/1
//! whatever a forgiving server would parse as a request line.

mod classify;
mod io;
mod lenient;
mod opaque_ports;

use std::time::Duration;

/// The protocols detection tells apart; the same hint the tunnel header
/// carries to the next hop, so the receiver need not detect again.
pub use crate::tunnel::Protocol;
pub use classify::{Detection, H2_PREFACE, MAX_DETECT_BYTES, MAX_METHOD_LEN, classify};
pub use io::{PrefixedIo, detect};
pub use lenient::classify_lenient;
pub use opaque_ports::{
    DEFAULT_OPAQUE_PORTS, EntryProblem, OpaqueDecision, OpaquePorts, OpaquePortsError, PortsSource,
    skip_detection,
};

/// How long [`detect`] waits for the client's first bytes by default:
/// Linkerd's 10 s, long enough for a slow client, short enough that a
/// server-speaks-first connection on a port nobody marked opaque still works.
pub const DEFAULT_DETECT_TIMEOUT: Duration = Duration::from_secs(10);
