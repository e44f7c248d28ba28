//! Detection on a live stream: read until [`classify`] decides, then hand the
//! stream on with the consumed bytes in front ([`PrefixedIo`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};

use super::Protocol;
use super::classify::{Detection, MAX_DETECT_BYTES, classify};

/// First allocation for the detect buffer: a typical request line and headers
/// fit, so most connections never grow it to [`MAX_DETECT_BYTES`].
const INITIAL_BUFFER: usize = 1024;

/// Reads the client's first bytes from `io` and says what it speaks, with the
/// bytes read (to replay with [`PrefixedIo`]; never more than
/// [`MAX_DETECT_BYTES`]). Stops as soon as [`classify`] decides.
///
/// `timeout` bounds the whole detection, not each read. When it fires, or the
/// client closes before the bytes decide, the answer is [`Protocol::Opaque`]:
/// a server-speaks-first client (MySQL, SMTP) is silent until the server
/// greets it, and a closed stream can no longer become a request. Errors are
/// only the stream's own.
pub async fn detect<I: AsyncRead + Unpin>(
    io: &mut I,
    timeout: Duration,
) -> io::Result<(Protocol, Bytes)> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut buf = BytesMut::with_capacity(INITIAL_BUFFER);
    loop {
        if let Detection::Protocol(protocol) = classify(&buf) {
            return Ok((protocol, buf.freeze()));
        }
        // `classify` decides by MAX_DETECT_BYTES, so there is room here.
        let room = MAX_DETECT_BYTES - buf.len();
        if buf.capacity() == buf.len() {
            buf.reserve(buf.len().min(room));
        }
        let mut limited = (&mut buf).limit(room);
        let read = tokio::time::timeout_at(deadline, io.read_buf(&mut limited)).await;
        match read {
            // Cancelling `read_buf` loses no bytes: it is cancel safe.
            Err(_elapsed) => {
                tracing::debug!(
                    ?timeout,
                    read = buf.len(),
                    "protocol detection timed out: treating the connection as opaque \
                     (server-speaks-first? mark the port in strait.dev/opaque-ports)"
                );
                return Ok((Protocol::Opaque, buf.freeze()));
            }
            Ok(Ok(0)) => return Ok((Protocol::Opaque, buf.freeze())),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
        }
    }
}

/// A stream that yields `prefix` first, then reads from the inner stream;
/// writes go straight to the inner stream. What detection hands on, so the
/// next layer (HTTP server, TCP forwarder) sees every byte the client sent.
#[derive(Debug)]
pub struct PrefixedIo<I> {
    prefix: Bytes,
    io: I,
}

impl<I> PrefixedIo<I> {
    pub fn new(prefix: Bytes, io: I) -> Self {
        Self { prefix, io }
    }

    /// The bytes not replayed yet.
    pub fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    pub fn get_ref(&self) -> &I {
        &self.io
    }

    pub fn get_mut(&mut self) -> &mut I {
        &mut self.io
    }

    /// The bytes not replayed yet, and the inner stream.
    pub fn into_parts(self) -> (Bytes, I) {
        (self.prefix, self.io)
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for PrefixedIo<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.prefix.is_empty() {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        let n = this.prefix.len().min(buf.remaining());
        buf.put_slice(&this.prefix[..n]);
        this.prefix.advance(n);
        if this.prefix.is_empty() {
            // Drop the detect buffer now rather than with the connection.
            this.prefix = Bytes::new();
        }
        Poll::Ready(Ok(()))
    }
}

crate::io::write_through!(PrefixedIo, io);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::H2_PREFACE;
    use tokio::io::{AsyncWriteExt, duplex};

    const TIMEOUT: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn http1_request_is_detected_and_replayed() {
        let (mut client, mut server) = duplex(64 * 1024);
        let request = b"GET /hello HTTP/1.1\r\nHost: web\r\n\r\n";
        client.write_all(request).await.unwrap();
        let (protocol, read) = detect(&mut server, TIMEOUT).await.unwrap();
        assert_eq!(protocol, Protocol::Http1);
        assert_eq!(&read[..], request, "one read took what was there");

        let mut replayed = PrefixedIo::new(read, server);
        client.write_all(b"body").await.unwrap();
        drop(client);
        let mut all = Vec::new();
        replayed.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, [&request[..], &b"body"[..]].concat());
    }

    #[tokio::test]
    async fn request_line_split_across_reads() {
        let (mut client, mut server) = duplex(64 * 1024);
        let task = tokio::spawn(async move {
            let chunks: [&[u8]; 4] = [b"GE", b"T / HT", b"TP/1.1\r", b"\nHost: web\r\n\r\n"];
            for chunk in chunks {
                client.write_all(chunk).await.unwrap();
                tokio::task::yield_now().await;
            }
            client
        });
        let (protocol, read) = detect(&mut server, TIMEOUT).await.unwrap();
        assert_eq!(protocol, Protocol::Http1);
        assert!(read.starts_with(b"GET / HTTP/1.1\r\n"));
        drop(task.await.unwrap());
    }

    #[tokio::test]
    async fn h2_preface_is_detected() {
        let (mut client, mut server) = duplex(64 * 1024);
        client.write_all(&H2_PREFACE[..10]).await.unwrap();
        let task = tokio::spawn(async move {
            tokio::task::yield_now().await;
            client.write_all(&H2_PREFACE[10..]).await.unwrap();
            client
        });
        let (protocol, read) = detect(&mut server, TIMEOUT).await.unwrap();
        assert_eq!((protocol, &read[..]), (Protocol::Http2, H2_PREFACE));
        drop(task.await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn client_first_binary_is_opaque_at_once() {
        let (mut client, mut server) = duplex(64 * 1024);
        let hello: [u8; 10] = [0x16, 0x03, 0x01, 0x00, 0x05, 1, 2, 3, 4, 5];
        client.write_all(&hello).await.unwrap();
        let start = tokio::time::Instant::now();
        let (protocol, read) = detect(&mut server, TIMEOUT).await.unwrap();
        assert_eq!((protocol, &read[..]), (Protocol::Opaque, &hello[..]));
        assert_eq!(start.elapsed(), Duration::ZERO, "no waiting for more bytes");
    }

    #[tokio::test(start_paused = true)]
    async fn server_speaks_first_is_opaque_after_the_timeout() {
        let (_client, mut server) = duplex(64 * 1024);
        let start = tokio::time::Instant::now();
        let (protocol, read) = detect(&mut server, TIMEOUT).await.unwrap();
        assert_eq!((protocol, read.len()), (Protocol::Opaque, 0));
        assert_waited_the_timeout(start);
    }

    /// The paused clock jumps to the deadline (timers may round up a millisecond).
    fn assert_waited_the_timeout(start: tokio::time::Instant) {
        let waited = start.elapsed();
        assert!(
            waited >= TIMEOUT && waited <= TIMEOUT + Duration::from_millis(1),
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn timeout_bounds_the_whole_detection_not_each_read() {
        let (mut client, mut server) = duplex(64 * 1024);
        let trickle = tokio::spawn(async move {
            for b in b"GET /aaaaaaaaaaaaaaaaaaaa" {
                tokio::time::sleep(Duration::from_secs(1)).await;
                client.write_all(&[*b]).await.unwrap();
            }
            client
        });
        let start = tokio::time::Instant::now();
        let (protocol, read) = detect(&mut server, TIMEOUT).await.unwrap();
        assert_eq!(protocol, Protocol::Opaque);
        assert_waited_the_timeout(start);
        assert!(read.starts_with(b"GET /") && read.len() < 12, "{read:?}");
        // The bytes read are kept for the opaque forwarder.
        let mut replayed = PrefixedIo::new(read.clone(), server);
        let mut first = vec![0; read.len()];
        replayed.read_exact(&mut first).await.unwrap();
        assert_eq!(first, read);
        trickle.abort();
    }

    #[tokio::test]
    async fn eof_before_a_decision_is_opaque() {
        let (mut client, mut server) = duplex(64 * 1024);
        client.write_all(b"GET / HT").await.unwrap();
        drop(client);
        let (protocol, read) = detect(&mut server, TIMEOUT).await.unwrap();
        assert_eq!((protocol, &read[..]), (Protocol::Opaque, &b"GET / HT"[..]));

        let (client, mut server) = duplex(64);
        drop(client);
        let (protocol, read) = detect(&mut server, TIMEOUT).await.unwrap();
        assert_eq!((protocol, read.len()), (Protocol::Opaque, 0));
    }

    #[tokio::test]
    async fn never_buffers_more_than_the_bound() {
        let (mut client, mut server) = duplex(64 * 1024);
        let mut line = b"GET /".to_vec();
        line.resize(3 * MAX_DETECT_BYTES, b'a');
        let writer = tokio::spawn(async move {
            client.write_all(&line).await.unwrap();
            client
        });
        let (protocol, read) = detect(&mut server, TIMEOUT).await.unwrap();
        assert_eq!((protocol, read.len()), (Protocol::Opaque, MAX_DETECT_BYTES));
        // The rest stays in the stream, after the replayed bytes.
        let mut replayed = PrefixedIo::new(read, server);
        let mut all = Vec::new();
        drop(writer.await.unwrap());
        replayed.read_to_end(&mut all).await.unwrap();
        assert_eq!(all.len(), 3 * MAX_DETECT_BYTES);
    }

    #[tokio::test]
    async fn prefixed_io_replays_exactly_then_reads_and_writes_through() {
        let (mut client, server) = duplex(1024);
        let mut io = PrefixedIo::new(Bytes::from_static(b"0123456789"), server);
        // Small reads take the prefix piece by piece and never mix in the stream.
        client.write_all(b"abc").await.unwrap();
        let mut small = [0u8; 4];
        let mut got = Vec::new();
        while !io.prefix().is_empty() {
            let n = io.read(&mut small).await.unwrap();
            got.extend_from_slice(&small[..n]);
        }
        assert_eq!(got, b"0123456789");
        let n = io.read(&mut small).await.unwrap();
        assert_eq!(&small[..n], b"abc");

        io.write_all(b"reply").await.unwrap();
        io.shutdown().await.unwrap();
        let mut reply = Vec::new();
        client.read_to_end(&mut reply).await.unwrap();
        assert_eq!(reply, b"reply");

        let (rest, _inner) = io.into_parts();
        assert!(rest.is_empty());
    }
}
