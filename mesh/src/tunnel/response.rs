//! The receiver's answer to a tunnel header: accepted, or refused with a reason
//! the sender can act on (why it exists: the module doc of [`super`]).

use std::fmt;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};

use super::wire::{self, CRITICAL, HeaderError, Kind};

/// Field types of a response.
mod field {
    pub const STATUS: u8 = 0x01;
    pub const MESSAGE: u8 = 0x02;
}

/// Longest message a response carries; longer ones are cut at a character boundary.
pub const MAX_MESSAGE_BYTES: usize = 1024;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TunnelResponse {
    pub status: ResponseStatus,
    /// For the sender's logs and error pages: what the receiver saw. Empty on success.
    pub message: String,
}

/// Why a receiver accepted or refused a tunnel. Every refusal happens before any
/// application byte reached the target, which is what makes `retryable` safe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResponseStatus {
    /// Connected to the target; application bytes follow in both directions.
    Ok,
    /// The header did not decode (the message says why).
    BadHeader,
    /// The receiver does not speak the sender's version.
    UnsupportedVersion,
    /// No such pod on the receiving node, or no such Service: the sender's view
    /// of endpoints is stale.
    NotFound,
    /// The gateway's cluster does not export that Service.
    NotExported,
    /// Policy refuses this caller for this target.
    Denied,
    /// The target refused or did not answer the connection.
    TargetUnavailable,
    /// A code from a newer receiver; a refusal all the same.
    Other(u8),
}

impl ResponseStatus {
    pub fn code(self) -> u8 {
        match self {
            ResponseStatus::Ok => 0,
            ResponseStatus::BadHeader => 1,
            ResponseStatus::UnsupportedVersion => 2,
            ResponseStatus::NotFound => 3,
            ResponseStatus::NotExported => 4,
            ResponseStatus::Denied => 5,
            ResponseStatus::TargetUnavailable => 6,
            ResponseStatus::Other(code) => code,
        }
    }

    pub fn from_code(code: u8) -> Self {
        match code {
            0 => ResponseStatus::Ok,
            1 => ResponseStatus::BadHeader,
            2 => ResponseStatus::UnsupportedVersion,
            3 => ResponseStatus::NotFound,
            4 => ResponseStatus::NotExported,
            5 => ResponseStatus::Denied,
            6 => ResponseStatus::TargetUnavailable,
            other => ResponseStatus::Other(other),
        }
    }

    /// Whether another endpoint may succeed where this one refused. Policy and
    /// export refusals would be refused everywhere; retrying them only adds load.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ResponseStatus::NotFound | ResponseStatus::TargetUnavailable
        )
    }

    /// A stable word for metrics labels.
    pub fn reason(self) -> &'static str {
        match self {
            ResponseStatus::Ok => "ok",
            ResponseStatus::BadHeader => "bad_header",
            ResponseStatus::UnsupportedVersion => "unsupported_version",
            ResponseStatus::NotFound => "not_found",
            ResponseStatus::NotExported => "not_exported",
            ResponseStatus::Denied => "denied",
            ResponseStatus::TargetUnavailable => "target_unavailable",
            ResponseStatus::Other(_) => "other",
        }
    }
}

impl TunnelResponse {
    pub fn ok() -> Self {
        Self {
            status: ResponseStatus::Ok,
            message: String::new(),
        }
    }

    pub fn refused(status: ResponseStatus, message: impl Into<String>) -> Self {
        let mut message = message.into();
        truncate(&mut message);
        Self { status, message }
    }

    /// What a receiver answers when the header itself failed. `None` when there
    /// is nobody to answer: the peer went away, or does not speak this protocol.
    pub fn for_header_error(e: &HeaderError) -> Option<Self> {
        let status = match e {
            HeaderError::UnsupportedVersion { .. } => ResponseStatus::UnsupportedVersion,
            HeaderError::BadMagic { .. }
            | HeaderError::Timeout(..)
            | HeaderError::Closed { .. }
            | HeaderError::Io(_) => return None,
            _ => ResponseStatus::BadHeader,
        };
        Some(Self::refused(status, e.to_string()))
    }

    pub fn is_ok(&self) -> bool {
        self.status == ResponseStatus::Ok
    }

    pub fn encode_into(&self, out: &mut BytesMut) {
        let mut end = self.message.len().min(MAX_MESSAGE_BYTES);
        while !self.message.is_char_boundary(end) {
            end -= 1;
        }
        wire::encode_frame(Kind::Response, out, |out| {
            wire::put_field(out, field::STATUS, &[self.status.code()]);
            if end > 0 {
                wire::put_field(out, field::MESSAGE, &self.message.as_bytes()[..end]);
            }
        });
    }

    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(16 + self.message.len());
        self.encode_into(&mut out);
        out.freeze()
    }

    /// Decodes the response at the front of `buf`, like [`super::TunnelHeader::decode`].
    pub fn decode(buf: &[u8]) -> Result<(Self, usize), HeaderError> {
        let (body, consumed) = wire::split_frame(buf, Kind::Response)?;
        let malformed = |why: String| HeaderError::Malformed {
            kind: Kind::Response,
            why,
        };
        let duplicate = |field| HeaderError::DuplicateField {
            kind: Kind::Response,
            field,
        };
        let mut status = None;
        let mut message = None;
        for f in wire::fields(Kind::Response, body) {
            let f = f?;
            match f.ty {
                field::STATUS => {
                    let [code] = *f.value else {
                        return Err(malformed(format!(
                            "status is {} bytes, expected 1",
                            f.value.len()
                        )));
                    };
                    if status.replace(ResponseStatus::from_code(code)).is_some() {
                        return Err(duplicate("a status"));
                    }
                }
                field::MESSAGE => {
                    if f.value.len() > MAX_MESSAGE_BYTES {
                        return Err(malformed(format!(
                            "message is {} bytes, the limit is {MAX_MESSAGE_BYTES}",
                            f.value.len()
                        )));
                    }
                    let text = std::str::from_utf8(f.value)
                        .map_err(|_| malformed("message is not UTF-8".into()))?;
                    if message.replace(text.to_string()).is_some() {
                        return Err(duplicate("a message"));
                    }
                }
                ty if ty & CRITICAL != 0 => {
                    return Err(HeaderError::UnknownCriticalField {
                        kind: Kind::Response,
                        ty,
                    });
                }
                _ => {}
            }
        }
        let status = status.ok_or(HeaderError::MissingField {
            kind: Kind::Response,
            field: "status",
        })?;
        Ok((
            Self {
                status,
                message: message.unwrap_or_default(),
            },
            consumed,
        ))
    }

    /// Reads exactly one response from `r` within `timeout`.
    pub async fn read_from<R: AsyncRead + Unpin>(
        r: &mut R,
        timeout: Duration,
    ) -> Result<Self, HeaderError> {
        let frame = wire::read_frame(r, Kind::Response, timeout).await?;
        let (response, _) = Self::decode(&frame)?;
        Ok(response)
    }

    /// Writes the response and flushes.
    pub async fn write_to<W: AsyncWrite + Unpin>(&self, w: &mut W) -> std::io::Result<()> {
        wire::write_frame(w, &self.encode()).await
    }
}

fn truncate(message: &mut String) {
    if message.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
}

impl fmt::Display for TunnelResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.status.reason())?;
        if let ResponseStatus::Other(code) = self.status {
            write!(f, " ({code})")?;
        }
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}
