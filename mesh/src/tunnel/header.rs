//! The tunnel header: what the sender writes first on every tunnelled
//! connection or QUIC stream. Layout and rules: [`super`] and ARCHITECTURE.md.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};

use super::wire::{self, Kind};
use crate::identity::SpiffeId;

pub use super::wire::{
    CRITICAL, DEFAULT_READ_TIMEOUT, HeaderError, MAGIC, MAX_HEADER_BYTES, VERSION,
};

/// Field types of a header (see the module doc of [`super`]).
pub(crate) mod field {
    pub const TARGET_POD: u8 = 0x01;
    pub const TARGET_SERVICE: u8 = 0x02;
    pub const SOURCE_IDENTITY: u8 = 0x03;
    pub const PROTOCOL: u8 = 0x04;
    /// Critical, empty: an end-to-end mutual-TLS session between the caller's
    /// node proxy and the destination's follows the answer (a receiver that
    /// does not know it must refuse, not deliver TLS bytes to a pod).
    pub const END_TO_END: u8 = 0x85;
    /// Critical, empty, only beside protocol `2` (HTTP/2): the HTTP/2 in the
    /// tunnel carries HTTP/1 callers' requests, which the receiver sends on
    /// to the pod as HTTP/1 (see [`super::Protocol::Http1Multiplexed`]). A
    /// receiver that does not know it refuses, instead of speaking HTTP/2 to
    /// an HTTP/1 pod.
    pub const POD_HTTP1: u8 = 0x86;
}

/// Opens every tunnelled connection: where the bytes go, on whose behalf, and
/// what they are.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TunnelHeader {
    pub target: Target,
    /// The original caller, set only by a hop that forwards for someone else
    /// (the gateway). Trusted only from peers allowed to speak for others.
    pub source: Option<SpiffeId>,
    pub protocol: Protocol,
    /// After the answer, the caller's node proxy opens a TLS session with the
    /// destination's node proxy inside the stream, as the caller: the proof of
    /// who called, which the hops between can carry but not forge.
    pub end_to_end: bool,
}

/// Where the receiver delivers the stream.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// A pod on the receiving node: its IP and port. What node proxies send to
    /// node proxies.
    Pod { addr: SocketAddr },
    /// A Service in the receiver's cluster, by name. What node proxies send to a
    /// remote gateway, which picks the endpoint.
    Service { fqdn: Fqdn, port: u16 },
}

/// What the application bytes are, so the receiver need not sniff them. A
/// hint: a receiver may always treat the stream as opaque bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// Unknown or not HTTP: forwarded byte for byte.
    #[default]
    Opaque,
    Http1,
    /// HTTP/2 with prior knowledge (h2c inside the tunnel, gRPC).
    Http2,
    /// HTTP/2 in the tunnel, HTTP/1 at the pod: many HTTP/1 callers'
    /// requests multiplexed over one tunnel between node proxies. On the wire
    /// protocol `2` with the critical field `POD_HTTP1`.
    Http1Multiplexed,
}

impl Protocol {
    fn code(self) -> u8 {
        match self {
            Protocol::Opaque => 0,
            Protocol::Http1 => 1,
            Protocol::Http2 | Protocol::Http1Multiplexed => 2,
        }
    }

    /// What the tunnel itself carries: HTTP/2 for both HTTP/2 kinds.
    pub fn in_tunnel(self) -> Protocol {
        match self {
            Protocol::Http1Multiplexed => Protocol::Http2,
            other => other,
        }
    }

    /// Codes a newer sender may define decode as `Opaque`, which is always safe.
    fn from_code(code: u8) -> Self {
        match code {
            1 => Protocol::Http1,
            2 => Protocol::Http2,
            _ => Protocol::Opaque,
        }
    }
}

impl Target {
    /// A pod target, refused if it could never be one (port 0, unspecified IP).
    /// IPv4-mapped IPv6 addresses become IPv4, so each pod has one spelling.
    pub fn pod(addr: SocketAddr) -> Result<Self, HeaderError> {
        let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
        if addr.port() == 0 {
            return Err(HeaderError::InvalidTarget(format!("pod {addr} has port 0")));
        }
        if addr.ip().is_unspecified() {
            return Err(HeaderError::InvalidTarget(format!(
                "pod {addr} has an unspecified IP"
            )));
        }
        Ok(Target::Pod { addr })
    }

    /// A Service target, e.g. `("web.default.svc.cluster.local", 8080)`.
    pub fn service(fqdn: &str, port: u16) -> Result<Self, HeaderError> {
        if port == 0 {
            return Err(HeaderError::InvalidTarget(format!(
                "service {fqdn}:0 has port 0"
            )));
        }
        let fqdn = fqdn.parse().map_err(HeaderError::InvalidTarget)?;
        Ok(Target::Service { fqdn, port })
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Pod { addr } => write!(f, "pod {addr}"),
            Target::Service { fqdn, port } => write!(f, "service {fqdn}:{port}"),
        }
    }
}

/// A Service's fully qualified name, e.g. `web.default.svc.cluster.local`:
/// lower-case DNS labels, at least two (a bare name would resolve in whatever
/// namespace the receiver runs in), no trailing dot. One spelling per Service,
/// so policy can compare names as strings.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fqdn(String);

/// Longest DNS name (RFC 1035), without the trailing dot.
pub const MAX_FQDN_BYTES: usize = 253;

impl Fqdn {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn check(name: &str) -> Result<(), String> {
        let bad = |why: &str| {
            Err(format!(
                "{name:?} is not a service FQDN like web.default.svc.cluster.local: {why}"
            ))
        };
        if name.is_empty() || name.len() > MAX_FQDN_BYTES {
            return bad("it must be 1 to 253 characters");
        }
        let mut labels = 0;
        let mut last = "";
        for label in name.split('.') {
            if label.is_empty() || label.len() > 63 {
                return bad("each dot-separated label must be 1 to 63 characters");
            }
            if !label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                return bad("only lower-case letters, digits, '-' and '.' may appear");
            }
            if label.starts_with('-') || label.ends_with('-') {
                return bad("labels must start and end with a letter or digit");
            }
            labels += 1;
            last = label;
        }
        if labels < 2 {
            return bad("it needs at least <service>.<namespace>");
        }
        if last.bytes().all(|b| b.is_ascii_digit()) {
            return bad("the last label is numeric, like an IP address");
        }
        Ok(())
    }
}

impl FromStr for Fqdn {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::check(s)?;
        Ok(Fqdn(s.to_string()))
    }
}

impl fmt::Display for Fqdn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TunnelHeader {
    /// A header for a direct caller (no `source`).
    pub fn new(target: Target, protocol: Protocol) -> Self {
        Self {
            target,
            source: None,
            protocol,
            end_to_end: false,
        }
    }

    /// Appends the encoded header to `out` (so a sender can coalesce it with
    /// the first application bytes).
    pub fn encode_into(&self, out: &mut BytesMut) {
        wire::encode_frame(Kind::Header, out, |out| {
            match &self.target {
                Target::Pod { addr } => {
                    let mut value = [0u8; 18];
                    let len = match addr.ip().to_canonical() {
                        IpAddr::V4(ip) => {
                            value[..4].copy_from_slice(&ip.octets());
                            4
                        }
                        IpAddr::V6(ip) => {
                            value[..16].copy_from_slice(&ip.octets());
                            16
                        }
                    };
                    value[len..len + 2].copy_from_slice(&addr.port().to_be_bytes());
                    wire::put_field(out, field::TARGET_POD, &value[..len + 2]);
                }
                Target::Service { fqdn, port } => {
                    out.put_u8(field::TARGET_SERVICE);
                    out.put_u16((2 + fqdn.0.len()) as u16);
                    out.put_u16(*port);
                    out.put_slice(fqdn.0.as_bytes());
                }
            }
            if let Some(source) = &self.source {
                wire::put_field(out, field::SOURCE_IDENTITY, source.to_string().as_bytes());
            }
            wire::put_field(out, field::PROTOCOL, &[self.protocol.code()]);
            if self.protocol == Protocol::Http1Multiplexed {
                wire::put_field(out, field::POD_HTTP1, &[]);
            }
            if self.end_to_end {
                wire::put_field(out, field::END_TO_END, &[]);
            }
        });
    }

    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(64);
        self.encode_into(&mut out);
        out.freeze()
    }

    /// Decodes the header at the front of `buf`, returning it and the bytes it
    /// took; whatever follows is the application's. Never panics; reads at most
    /// [`MAX_HEADER_BYTES`]. `Incomplete` means "read more and call again".
    pub fn decode(buf: &[u8]) -> Result<(Self, usize), HeaderError> {
        let (body, consumed) = wire::split_frame(buf, Kind::Header)?;
        let mut target = None;
        let mut source = None;
        let mut protocol = None;
        let mut end_to_end = false;
        let mut pod_http1 = false;
        for f in wire::fields(Kind::Header, body) {
            let f = f?;
            match f.ty {
                field::TARGET_POD | field::TARGET_SERVICE => {
                    let decoded = decode_target(f.ty, f.value)?;
                    if target.replace(decoded).is_some() {
                        return Err(HeaderError::DuplicateField {
                            kind: Kind::Header,
                            field: "a target",
                        });
                    }
                }
                field::SOURCE_IDENTITY => {
                    let id = std::str::from_utf8(f.value)
                        .map_err(|_| malformed("source identity is not UTF-8".into()))?
                        .parse::<SpiffeId>()?;
                    if source.replace(id).is_some() {
                        return Err(HeaderError::DuplicateField {
                            kind: Kind::Header,
                            field: "a source identity",
                        });
                    }
                }
                field::PROTOCOL => {
                    let [code] = *f.value else {
                        return Err(malformed(format!(
                            "protocol field is {} bytes, expected 1",
                            f.value.len()
                        )));
                    };
                    if protocol.replace(Protocol::from_code(code)).is_some() {
                        return Err(HeaderError::DuplicateField {
                            kind: Kind::Header,
                            field: "a protocol",
                        });
                    }
                }
                field::POD_HTTP1 => set_flag(&mut pod_http1, f.value, "pod-HTTP/1")?,
                field::END_TO_END => set_flag(&mut end_to_end, f.value, "end-to-end")?,
                ty if ty & CRITICAL != 0 => {
                    return Err(HeaderError::UnknownCriticalField {
                        kind: Kind::Header,
                        ty,
                    });
                }
                // An optional field from a newer sender.
                _ => {}
            }
        }
        let target = target.ok_or(HeaderError::MissingField {
            kind: Kind::Header,
            field: "target (pod or service)",
        })?;
        let protocol = match (protocol.unwrap_or_default(), pod_http1) {
            (Protocol::Http2, true) => Protocol::Http1Multiplexed,
            (other, true) => {
                return Err(malformed(format!(
                    "pod-HTTP/1 field with protocol {}, expected 2 (HTTP/2)",
                    other.code()
                )));
            }
            (protocol, false) => protocol,
        };
        Ok((
            Self {
                target,
                source,
                protocol,
                end_to_end,
            },
            consumed,
        ))
    }

    /// Reads exactly one header from `r` (never the application bytes behind it)
    /// within `timeout`.
    pub async fn read_from<R: AsyncRead + Unpin>(
        r: &mut R,
        timeout: Duration,
    ) -> Result<Self, HeaderError> {
        let frame = wire::read_frame(r, Kind::Header, timeout).await?;
        let (header, _) = Self::decode(&frame)?;
        Ok(header)
    }

    /// Writes the header and flushes.
    pub async fn write_to<W: AsyncWrite + Unpin>(&self, w: &mut W) -> std::io::Result<()> {
        wire::write_frame(w, &self.encode()).await
    }
}

/// A flag field (empty, at most once) seen: sets `flag`.
fn set_flag(flag: &mut bool, value: &[u8], field: &'static str) -> Result<(), HeaderError> {
    if !value.is_empty() {
        return Err(malformed(format!(
            "{field} field is {} bytes, expected 0",
            value.len()
        )));
    }
    if std::mem::replace(flag, true) {
        return Err(HeaderError::DuplicateField {
            kind: Kind::Header,
            field,
        });
    }
    Ok(())
}

fn malformed(why: String) -> HeaderError {
    HeaderError::Malformed {
        kind: Kind::Header,
        why,
    }
}

fn decode_target(ty: u8, value: &[u8]) -> Result<Target, HeaderError> {
    if ty == field::TARGET_POD {
        let (ip, port) = value.split_at(value.len().saturating_sub(2));
        let ip: IpAddr = if let Ok(v4) = <[u8; 4]>::try_from(ip) {
            Ipv4Addr::from(v4).into()
        } else if let Ok(v6) = <[u8; 16]>::try_from(ip) {
            Ipv6Addr::from(v6).into()
        } else {
            return Err(malformed(format!(
                "target pod is {} bytes, expected 6 (IPv4) or 18 (IPv6)",
                value.len()
            )));
        };
        let port =
            <[u8; 2]>::try_from(port).map_err(|_| malformed("target pod has no port".into()))?;
        return Target::pod(SocketAddr::new(ip, u16::from_be_bytes(port)));
    }
    let [hi, lo, ref name @ ..] = *value else {
        return Err(malformed("target service is shorter than its port".into()));
    };
    let name =
        std::str::from_utf8(name).map_err(|_| malformed("target service is not UTF-8".into()))?;
    Target::service(name, u16::from_be_bytes([hi, lo]))
}
