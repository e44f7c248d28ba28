//! The frame every tunnel message shares: an 8-byte prefix, then TLV fields.
//! [`TunnelHeader`](super::TunnelHeader) and [`TunnelResponse`](super::TunnelResponse)
//! only say which fields they carry; bounds, versioning and I/O live here once.

use std::io;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::identity::SpiffeIdError;

/// First bytes of every tunnel message. `0xF5` is neither a TLS record type nor
/// ASCII nor a UTF-8 lead byte, so plain HTTP, TLS or PROXY protocol sent to a
/// tunnel port is told apart from the first byte.
pub const MAGIC: [u8; 4] = [0xF5, b'S', b'T', b'R'];
/// The one format version this code speaks.
pub const VERSION: u8 = 1;
/// magic (4) + version (1) + kind (1) + body length (2).
pub const PREFIX_LEN: usize = 8;
/// Largest message, prefix included. Everything v1 defines fits in under 1 KiB;
/// the rest is room for extensions.
pub const MAX_HEADER_BYTES: usize = 4096;
/// A field type with this bit set must be understood: a receiver that does not
/// know it refuses the message. Without it, unknown fields are skipped.
pub const CRITICAL: u8 = 0x80;
/// How long a receiver waits for a complete message by default.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Which message a frame holds, so a header is never mistaken for a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Header = 1,
    Response = 2,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Header => "tunnel header",
            Kind::Response => "tunnel response",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// Not enough bytes yet; `needed` is the least total length that could decode.
    #[error("incomplete tunnel message: have {have} bytes, need at least {needed}")]
    Incomplete { have: usize, needed: usize },
    #[error(
        "not a Strait tunnel message (first bytes {found}){hint}: is the peer a Strait proxy or gateway?"
    )]
    BadMagic { found: String, hint: &'static str },
    #[error("{}", version_message(*.peer))]
    UnsupportedVersion { peer: u8 },
    #[error("expected a {} but the peer sent a {}: is it connecting to the right port?", .expected.name(), .found)]
    WrongKind { expected: Kind, found: String },
    #[error("{} is {len} bytes, larger than the {MAX_HEADER_BYTES}-byte limit", .kind.name())]
    TooLarge { kind: Kind, len: usize },
    #[error("malformed {}: {why}", .kind.name())]
    Malformed { kind: Kind, why: String },
    #[error(
        "{} carries field 0x{ty:02x}, which this proxy must understand but does not: upgrade this proxy",
        .kind.name()
    )]
    UnknownCriticalField { kind: Kind, ty: u8 },
    #[error("{} has no {field}: the sender must set it", .kind.name())]
    MissingField { kind: Kind, field: &'static str },
    #[error("{} carries {field} twice", .kind.name())]
    DuplicateField { kind: Kind, field: &'static str },
    #[error("tunnel header names an invalid target: {0}")]
    InvalidTarget(String),
    #[error("tunnel header carries an invalid source identity: {0}")]
    InvalidSource(#[from] SpiffeIdError),
    #[error("timed out after {0:?} waiting for the {1}: is the peer a Strait proxy?")]
    Timeout(Duration, &'static str),
    #[error("peer closed the connection after {received} bytes of the {kind}", kind = .kind.name())]
    Closed { kind: Kind, received: usize },
    #[error("reading the tunnel message: {0}")]
    Io(#[source] io::Error),
}

fn version_message(peer: u8) -> String {
    let advice = if peer > VERSION {
        "upgrade this proxy (or roll the peer back) so both speak the same version"
    } else {
        "upgrade the peer so both speak the same version"
    };
    format!("peer speaks tunnel version {peer}, this proxy speaks {VERSION}: {advice}")
}

impl HeaderError {
    /// A stable word for metrics labels and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            HeaderError::Incomplete { .. } => "incomplete",
            HeaderError::BadMagic { .. } => "bad_magic",
            HeaderError::UnsupportedVersion { .. } => "unsupported_version",
            HeaderError::WrongKind { .. } => "wrong_kind",
            HeaderError::TooLarge { .. } => "too_large",
            HeaderError::Malformed { .. }
            | HeaderError::UnknownCriticalField { .. }
            | HeaderError::MissingField { .. }
            | HeaderError::DuplicateField { .. } => "malformed",
            HeaderError::InvalidTarget(_) => "invalid_target",
            HeaderError::InvalidSource(_) => "invalid_source",
            HeaderError::Timeout(..) => "timeout",
            HeaderError::Closed { .. } => "closed",
            HeaderError::Io(_) => "io",
        }
    }
}

/// Names what a peer sent instead of a tunnel message, so the operator does not
/// have to decode hex.
fn magic_hint(found: &[u8]) -> &'static str {
    match found {
        [0x16, 0x03, ..] => {
            ": looks like a TLS handshake (TLS inside the tunnel, or a port that expected TLS)"
        }
        [b'P', b'R', b'I', b' ', ..] => {
            ": looks like an HTTP/2 preface sent without a tunnel header"
        }
        [b'P', b'R', b'O', b'X', ..] => ": looks like a PROXY protocol header",
        [first, ..] if first.is_ascii_uppercase() => {
            ": looks like plain text or HTTP/1 sent without a tunnel header"
        }
        _ => "",
    }
}

/// Checks as much of the prefix as `buf` holds and returns the total message
/// length once the prefix is complete. Fails as early as the bytes allow, so a
/// non-Strait peer is refused before its bytes are waited for.
pub(crate) fn check_prefix(buf: &[u8], kind: Kind) -> Result<Option<usize>, HeaderError> {
    let magic_len = buf.len().min(MAGIC.len());
    if buf[..magic_len] != MAGIC[..magic_len] {
        let found = &buf[..magic_len];
        return Err(HeaderError::BadMagic {
            found: found
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" "),
            hint: magic_hint(found),
        });
    }
    if let Some(&version) = buf.get(4)
        && version != VERSION
    {
        return Err(HeaderError::UnsupportedVersion { peer: version });
    }
    if let Some(&found) = buf.get(5)
        && found != kind as u8
    {
        let found = match found {
            1 => Kind::Header.name().to_string(),
            2 => Kind::Response.name().to_string(),
            other => format!("message of unknown kind {other}"),
        };
        return Err(HeaderError::WrongKind {
            expected: kind,
            found,
        });
    }
    if buf.len() < PREFIX_LEN {
        return Ok(None);
    }
    let total = PREFIX_LEN + usize::from(u16::from_be_bytes([buf[6], buf[7]]));
    if total > MAX_HEADER_BYTES {
        return Err(HeaderError::TooLarge { kind, len: total });
    }
    Ok(Some(total))
}

/// Splits a complete message off the front of `buf`: its TLV body and the total
/// bytes it occupies. Bytes after the message are not looked at.
pub(crate) fn split_frame(buf: &[u8], kind: Kind) -> Result<(&[u8], usize), HeaderError> {
    let Some(total) = check_prefix(buf, kind)? else {
        return Err(HeaderError::Incomplete {
            have: buf.len(),
            needed: PREFIX_LEN,
        });
    };
    if buf.len() < total {
        return Err(HeaderError::Incomplete {
            have: buf.len(),
            needed: total,
        });
    }
    Ok((&buf[PREFIX_LEN..total], total))
}

/// One field: type, then a big-endian u16 length, then that many bytes.
pub(crate) struct Field<'a> {
    pub ty: u8,
    pub value: &'a [u8],
}

/// Iterates over the fields of a body; malformed framing is an error item.
pub(crate) struct Fields<'a> {
    kind: Kind,
    rest: &'a [u8],
}

pub(crate) fn fields(kind: Kind, body: &[u8]) -> Fields<'_> {
    Fields { kind, rest: body }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<Field<'a>, HeaderError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let malformed = |why: String| {
            Some(Err(HeaderError::Malformed {
                kind: self.kind,
                why,
            }))
        };
        let [ty, hi, lo, ref after @ ..] = *self.rest else {
            let left = self.rest.len();
            self.rest = &[];
            return malformed(format!(
                "{left} stray bytes at the end, too few for a field"
            ));
        };
        let len = usize::from(u16::from_be_bytes([hi, lo]));
        if after.len() < len {
            let left = after.len();
            self.rest = &[];
            return malformed(format!(
                "field 0x{ty:02x} claims {len} bytes but only {left} remain"
            ));
        }
        let (value, rest) = after.split_at(len);
        self.rest = rest;
        Some(Ok(Field { ty, value }))
    }
}

/// Writes a frame: `fill` appends the TLV fields, the length is patched after.
pub(crate) fn encode_frame(kind: Kind, out: &mut BytesMut, fill: impl FnOnce(&mut BytesMut)) {
    let start = out.len();
    out.reserve(64);
    out.put_slice(&MAGIC);
    out.put_u8(VERSION);
    out.put_u8(kind as u8);
    out.put_u16(0);
    fill(out);
    let body = out.len() - start - PREFIX_LEN;
    // Types keep every field bounded (validated names, truncated messages), so a
    // frame over the limit is a bug here, not a peer's doing.
    debug_assert!(
        PREFIX_LEN + body <= MAX_HEADER_BYTES,
        "{} too large",
        kind.name()
    );
    let body = u16::try_from(body).unwrap_or(u16::MAX);
    out[start + 6..start + PREFIX_LEN].copy_from_slice(&body.to_be_bytes());
}

pub(crate) fn put_field(out: &mut BytesMut, ty: u8, value: &[u8]) {
    out.put_u8(ty);
    // Values are bounded well below u16::MAX by their types.
    out.put_u16(u16::try_from(value.len()).unwrap_or(u16::MAX));
    out.put_slice(value);
}

/// Reads exactly one message: the prefix, then the length it declares, never a
/// byte more, so the application bytes behind it stay in `r`.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    kind: Kind,
    timeout: Duration,
) -> Result<Vec<u8>, HeaderError> {
    let read = async {
        let mut buf = vec![0u8; PREFIX_LEN];
        let mut have = 0;
        // The prefix is checked as it arrives, so a peer speaking something else
        // is refused at its first bytes instead of after the timeout.
        let total = loop {
            if let Some(total) = check_prefix(&buf[..have], kind)? {
                break total;
            }
            let n = r.read(&mut buf[have..]).await.map_err(HeaderError::Io)?;
            if n == 0 {
                return Err(HeaderError::Closed {
                    kind,
                    received: have,
                });
            }
            have += n;
        };
        buf.resize(total, 0);
        while have < total {
            let n = r
                .read(&mut buf[have..total])
                .await
                .map_err(HeaderError::Io)?;
            if n == 0 {
                return Err(HeaderError::Closed {
                    kind,
                    received: have,
                });
            }
            have += n;
        }
        Ok(buf)
    };
    tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| HeaderError::Timeout(timeout, kind.name()))?
}

/// Writes an encoded message and flushes it: a sender that waits for the
/// response before sending more must not leave the header in a TLS buffer.
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, bytes: &[u8]) -> io::Result<()> {
    w.write_all(bytes).await?;
    w.flush().await
}
