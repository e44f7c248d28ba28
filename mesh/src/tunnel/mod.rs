//! The tunnel protocol every hop speaks: node proxy → node proxy (mTLS, port
//! 4143), node proxy → gateway (a QUIC stream, or TCP+TLS), gateway → node proxy.
//!
//! The sender writes a [`TunnelHeader`] first; the receiver reads exactly that
//! header ([`TunnelHeader::read_from`] never consumes a byte more), checks it,
//! connects to the target, and answers with a [`TunnelResponse`]. After the
//! response both directions carry only the application's bytes.
//!
//! # Wire format (version 1)
//!
//! Every message, header or response, is one frame, all integers big-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `F5 53 54 52` (`\xF5STR`) |
//! | 4 | 1 | version, `1` |
//! | 5 | 1 | kind: `1` header, `2` response |
//! | 6 | 2 | body length *n*; 8 + *n* ≤ [`MAX_HEADER_BYTES`] (4096) |
//! | 8 | *n* | fields: type (1), length (2), value, repeated |
//!
//! Header fields: `0x01` target pod (IPv4 + port: 6 bytes, IPv6 + port: 18),
//! `0x02` target service (port, 2 bytes, then the FQDN), `0x03` source identity
//! (SPIFFE ID, UTF-8), `0x04` protocol (`0` opaque, `1` HTTP/1, `2` HTTP/2).
//! Exactly one target; each field at most once. Response fields: `0x01` status
//! (one byte, [`ResponseStatus`]), `0x02` message (UTF-8, ≤ 1 KiB).
//!
//! # Compatibility
//!
//! - The version changes only when a v1 receiver would misread a message. The
//!   receiver refuses other versions by name ("peer speaks tunnel version 3,
//!   this proxy speaks 1: …") and answers `UnsupportedVersion`.
//! - New information goes into new fields, which v1 receivers skip. A field that
//!   must not be skipped (it changes what the rest means) gets a type with the
//!   [`CRITICAL`] bit (`0x80`) set; a receiver that does not know it refuses.
//!   That is the room for flags and extensions without a version bump.
//! - Unknown protocol codes read as `Opaque`, unknown statuses as a refusal:
//!   both are safe readings of something newer.
//!
//! The version is a property of the encoding, not a field of [`TunnelHeader`]:
//! the struct is what this code understands, and it always writes [`VERSION`].
//! Bounds are fixed before anything is allocated: the prefix is checked first
//! (magic, version, kind, length ≤ 4 KiB), then exactly the declared body is
//! read. Decoding is total and fuzzed (`fuzz/fuzz_targets/tunnel_header.rs`).
//!
//! # Whose identity
//!
//! The TLS handshake proves the *immediate* sender (its certificate's SPIFFE
//! ID). A node proxy sends on behalf of a pod on its own node with that pod's
//! certificate, so it leaves [`TunnelHeader::source`] empty. Only a hop that
//! forwards for someone it cannot present a certificate for, the gateway, sets
//! `source` to the original caller, so the destination sees both the gateway and
//! the caller. The rule receivers enforce: **`source` is believed only when the
//! TLS peer is an identity allowed to speak for others** (the gateway identities
//! this cluster trusts); from any other peer a header carrying `source` is
//! refused with `Denied`, not silently ignored, so a misconfiguration shows.
//! Without `source`, the caller is the TLS peer.
//!
//! # Why a response
//!
//! Without one, every refusal looks like a reset, and the sender cannot tell
//! "this pod moved to another node" (try another endpoint) from "policy denies
//! you" (do not retry; answer 403) from "this Service is not exported" (a
//! configuration error the operator in the *caller's* cluster must see). The
//! receiver answers before any target byte flows back, and every refusal comes
//! before the target saw an application byte, so [`ResponseStatus::retryable`]
//! refusals are safe to retry elsewhere. A sender may write application bytes
//! right after the header (no extra round trip) as long as it keeps what it
//! needs to retry, or wait for the response first.

pub mod client;
pub mod header;
mod names;
pub mod quic;
mod response;
mod wire;

pub use header::{Fqdn, MAX_FQDN_BYTES, Protocol, Target, TunnelHeader};
pub use names::{TUNNEL_ALPN, parse_server_name, server_name_for};
pub use response::{MAX_MESSAGE_BYTES, ResponseStatus, TunnelResponse};
pub use wire::{
    CRITICAL, DEFAULT_READ_TIMEOUT, HeaderError, Kind, MAGIC, MAX_HEADER_BYTES, VERSION,
};

#[cfg(test)]
mod tests;
