//! Bytes under every tunnel: [`splice`], the copy both ways every opaque
//! tunnel ends in (node proxy outbound and inbound, the gateway), and
//! [`ReadAhead`], the socket under every mutual-TLS connection.
//!
//! `splice` is like `tokio::io::copy_bidirectional`, with one difference that matters
//! for bulk transfers: each direction's buffer starts small
//! ([`INITIAL_BUFFER`]) and doubles, up to [`MAX_BUFFER`], each time a read
//! fills it. An idle or chatty connection keeps 2 × 8 KiB, as before; a bulk
//! transfer moves 64 KiB per read, which means an eighth of the syscalls, of
//! the TLS writes (four full 16 KiB records per write instead of one
//! half-full one) and of the chunks a QUIC stream's send buffer holds
//! (quinn-proto scans those per packet). Measured in `scripts/bench-bulk.sh`
//! and `scripts/bench-wan.sh`; see ARCHITECTURE.md.

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Each direction's buffer to start with.
pub const INITIAL_BUFFER: usize = 8 * 1024;
/// The most a direction's buffer grows to: the bound on a splice's memory
/// (2 × this), whatever its peers do.
pub const MAX_BUFFER: usize = 64 * 1024;

/// Copies `a` → `b` and `b` → `a` until both directions end, shutting down
/// each writer after its reader's EOF. Returns the bytes copied each way
/// (`a` → `b`, `b` → `a`); the first error of either direction ends both.
pub async fn splice<A, B>(a: &mut A, b: &mut B) -> io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let (mut a_to_b, mut b_to_a) = (Copier::default(), Copier::default());
    poll_fn(|cx| {
        let a_to_b = a_to_b.poll_copy(cx, &mut *a, &mut *b)?;
        let b_to_a = b_to_a.poll_copy(cx, &mut *b, &mut *a)?;
        match (a_to_b, b_to_a) {
            (Poll::Ready(up), Poll::Ready(down)) => Poll::Ready(Ok((up, down))),
            _ => Poll::Pending,
        }
    })
    .await
}

/// One direction: reads into its buffer, writes it all out, and again until
/// EOF; then flushes and shuts the writer down, and is done.
#[derive(Default)]
struct Copier {
    buf: Vec<u8>,
    /// `buf[pos..end]` is read and not yet written.
    pos: usize,
    end: usize,
    eof: bool,
    /// Written since the last flush.
    unflushed: bool,
    copied: u64,
    /// The writer is shut down: polling again only returns the count.
    done: bool,
}

impl Copier {
    fn poll_copy<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        reader: &mut R,
        writer: &mut W,
    ) -> Poll<io::Result<u64>>
    where
        R: AsyncRead + Unpin + ?Sized,
        W: AsyncWrite + Unpin + ?Sized,
    {
        if self.done {
            return Poll::Ready(Ok(self.copied));
        }
        loop {
            if self.pos == self.end && !self.eof {
                // The last read filled the buffer: more is waiting, read more
                // at once next time.
                if self.buf.is_empty() {
                    self.buf = vec![0; INITIAL_BUFFER];
                } else if self.end == self.buf.len() && self.buf.len() < MAX_BUFFER {
                    self.buf = vec![0; (self.buf.len() * 2).min(MAX_BUFFER)];
                }
                let mut read = ReadBuf::new(&mut self.buf);
                match Pin::new(&mut *reader).poll_read(cx, &mut read) {
                    Poll::Ready(Ok(())) => {
                        let n = read.filled().len();
                        self.pos = 0;
                        self.end = n;
                        self.eof = n == 0;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        // Nothing to read now: what was written must not wait
                        // in the writer's buffer (TLS, QUIC) for more.
                        if self.unflushed {
                            ready!(Pin::new(&mut *writer).poll_flush(cx))?;
                            self.unflushed = false;
                        }
                        return Poll::Pending;
                    }
                }
            }
            while self.pos < self.end {
                let n =
                    ready!(Pin::new(&mut *writer).poll_write(cx, &self.buf[self.pos..self.end]))?;
                if n == 0 {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "the writer accepted no bytes",
                    )));
                }
                self.pos += n;
                self.copied += n as u64;
                self.unflushed = true;
            }
            if self.eof {
                if self.unflushed {
                    ready!(Pin::new(&mut *writer).poll_flush(cx))?;
                    self.unflushed = false;
                }
                ready!(Pin::new(&mut *writer).poll_shutdown(cx))?;
                self.done = true;
                return Poll::Ready(Ok(self.copied));
            }
        }
    }
}

/// A mutual-TLS connection as its client holds it (node proxy → node proxy,
/// gateway → node proxy, node proxy → gateway over TCP), socket read ahead.
pub type ClientTls = tokio_rustls::client::TlsStream<ReadAhead<tokio::net::TcpStream>>;
/// A mutual-TLS connection as its server holds it (a node proxy's inbound,
/// the gateway's TCP listener), socket read ahead.
pub type ServerTls = tokio_rustls::server::TlsStream<ReadAhead<tokio::net::TcpStream>>;

/// How much a [`ReadAhead`] asks of the socket at once.
pub const READ_AHEAD: usize = 64 * 1024;

/// A socket read ahead of its reader, while it carries bulk: rustls asks the
/// socket for 4 KiB at a time, so a TLS connection receiving bulk made one
/// `recv` syscall per 4 KiB (~100 000 a second at 3 Gbit/s).
///
/// Reads go straight into the reader's buffer until one fills it (the socket
/// had at least as much as asked: bulk). From then on the socket is read up
/// to [`READ_AHEAD`] at once into a buffer of its own and the reader is
/// served from that, until a read brings less than the reader asks (back to
/// direct reads). Request/response traffic thus never copies or allocates;
/// the buffer is allocated uninitialised (no zeroing per read) and freed
/// whenever the socket has nothing more, so an idle connection holds none.
/// Writes pass straight through.
pub struct ReadAhead<T> {
    inner: T,
    /// Read from the socket and not yet handed on.
    buf: bytes::BytesMut,
    /// The last direct read filled the reader's buffer: read ahead next time.
    bulk: bool,
}

impl<T> ReadAhead<T> {
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            buf: bytes::BytesMut::new(),
            bulk: false,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ReadAhead<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.buf.is_empty() {
            let wanted = out.remaining();
            // A reader asking for as much as we would read gains nothing
            // from a copy; nor does one reading small messages.
            if !this.bulk || wanted >= READ_AHEAD {
                let before = out.filled().len();
                match Pin::new(&mut this.inner).poll_read(cx, out) {
                    Poll::Ready(Ok(())) => {
                        let got = out.filled().len() - before;
                        this.bulk = got > 0 && got == wanted && wanted < READ_AHEAD;
                        return Poll::Ready(Ok(()));
                    }
                    Poll::Pending => {
                        this.buf = bytes::BytesMut::new();
                        return Poll::Pending;
                    }
                    error => return error,
                }
            }
            this.buf.reserve(READ_AHEAD);
            match tokio_util::io::poll_read_buf(Pin::new(&mut this.inner), cx, &mut this.buf) {
                Poll::Ready(Ok(got)) => {
                    // Less than the reader wanted: the burst is over.
                    if got < wanted {
                        this.bulk = false;
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    this.buf = bytes::BytesMut::new();
                    return Poll::Pending;
                }
            }
        }
        let n = out.remaining().min(this.buf.len());
        out.put_slice(&this.buf[..n]);
        bytes::Buf::advance(&mut this.buf, n);
        Poll::Ready(Ok(()))
    }
}

/// `AsyncWrite` for a wrapper `$ty<T>` that only changes how it reads: every
/// write goes straight to its field `$field`.
macro_rules! write_through {
    ($ty:ident, $field:ident) => {
        impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for $ty<T> {
            fn poll_write(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.get_mut().$field).poll_write(cx, buf)
            }

            fn poll_write_vectored(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.get_mut().$field).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.$field.is_write_vectored()
            }

            fn poll_flush(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.get_mut().$field).poll_flush(cx)
            }

            fn poll_shutdown(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.get_mut().$field).poll_shutdown(cx)
            }
        }
    };
}
pub(crate) use write_through;

write_through!(ReadAhead, inner);

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Bytes arrive whole and in order both ways, each writer is shut down
    /// after its reader's EOF, and the counts are the bytes moved.
    #[tokio::test]
    async fn copies_both_ways_and_shuts_down() {
        let (mut a_far, mut a) = tokio::io::duplex(1024 * 1024);
        let (mut b, mut b_far) = tokio::io::duplex(1024 * 1024);
        let up: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let down: Vec<u8> = (0..70_000u32).map(|i| (i % 13) as u8).collect();
        let task = tokio::spawn(async move { splice(&mut a, &mut b).await });
        let (up2, down2) = (up.clone(), down.clone());
        let writer = tokio::spawn(async move {
            a_far.write_all(&up2).await.unwrap();
            a_far.shutdown().await.unwrap();
            let mut got = Vec::new();
            a_far.read_to_end(&mut got).await.unwrap();
            got
        });
        let far = tokio::spawn(async move {
            let mut got = Vec::new();
            b_far.read_to_end(&mut got).await.unwrap();
            b_far.write_all(&down2).await.unwrap();
            b_far.shutdown().await.unwrap();
            got
        });
        assert_eq!(far.await.unwrap(), up);
        assert_eq!(writer.await.unwrap(), down);
        assert_eq!(
            task.await.unwrap().unwrap(),
            (up.len() as u64, down.len() as u64)
        );
    }

    /// A buffer grows only while reads fill it, and never past the bound.
    #[tokio::test]
    async fn buffer_grows_to_the_bound_under_bulk_only() {
        let data = vec![7u8; 1024 * 1024];
        let mut reader: &[u8] = &data;
        let mut sink = Vec::new();
        let mut copier = Copier::default();
        let copied = poll_fn(|cx| copier.poll_copy(cx, &mut reader, &mut sink))
            .await
            .unwrap();
        assert_eq!(copied, data.len() as u64);
        assert_eq!(copier.buf.len(), MAX_BUFFER);
        assert_eq!(sink, data);

        // Small reads keep the initial buffer.
        let (mut near, mut far) = tokio::io::duplex(64);
        let mut copier = Copier::default();
        let mut out = Vec::new();
        let feeder = tokio::spawn(async move {
            for _ in 0..100 {
                far.write_all(b"ping").await.unwrap();
            }
        });
        poll_fn(|cx| copier.poll_copy(cx, &mut near, &mut out))
            .await
            .unwrap();
        feeder.await.unwrap();
        assert_eq!(out.len(), 400);
        assert_eq!(copier.buf.len(), INITIAL_BUFFER);
    }

    /// Under bulk, small reads are served from one large read of the socket;
    /// small messages are read directly (no buffer); the buffer is gone once
    /// the socket has nothing more; writes pass through.
    #[tokio::test]
    async fn read_ahead_only_under_bulk_and_frees_when_idle() {
        let (mut far, near) = tokio::io::duplex(1024 * 1024);
        let mut ahead = ReadAhead::new(near);
        let mut small = [0u8; 4096];
        // A small message: read straight into the reader's buffer.
        far.write_all(b"request").await.unwrap();
        assert_eq!(ahead.read(&mut small).await.unwrap(), 7);
        assert!(!ahead.bulk);
        assert_eq!(ahead.buf.capacity(), 0);

        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 241) as u8).collect();
        far.write_all(&data).await.unwrap();
        let mut got = Vec::new();
        while got.len() < data.len() {
            let n = ahead.read(&mut small).await.unwrap();
            got.extend_from_slice(&small[..n]);
            if got.len() == 4096 {
                // The first read filled the reader's buffer: bulk.
                assert!(ahead.bulk);
                assert!(ahead.buf.is_empty());
            }
            if got.len() == 2 * 4096 {
                // The second pulled a whole READ_AHEAD from the socket.
                assert_eq!(ahead.buf.len(), READ_AHEAD - 4096);
            }
        }
        assert_eq!(got, data);
        // Nothing more to read: the next read waits, and holds no buffer.
        let pending = tokio::time::timeout(Duration::from_millis(50), ahead.read(&mut small)).await;
        assert!(pending.is_err());
        assert_eq!(ahead.buf.capacity(), 0);
        ahead.write_all(b"back").await.unwrap();
        let mut back = [0u8; 4];
        far.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"back");
        drop(far);
        assert_eq!(ahead.read(&mut small).await.unwrap(), 0);
    }

    /// A reader's error ends the splice with that error.
    #[tokio::test]
    async fn an_error_ends_the_splice() {
        struct Broken;
        impl AsyncRead for Broken {
            fn poll_read(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
                _: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionReset, "reset")))
            }
        }
        impl AsyncWrite for Broken {
            fn poll_write(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
                b: &[u8],
            ) -> Poll<io::Result<usize>> {
                Poll::Ready(Ok(b.len()))
            }
            fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
                Poll::Ready(Ok(()))
            }
            fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
                Poll::Ready(Ok(()))
            }
        }
        let (mut a, _far) = tokio::io::duplex(64);
        let err = splice(&mut a, &mut Broken).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);
    }
}
