//! Copying bytes both ways between two connections: the splice every
//! opaque tunnel ends in (node proxy outbound and inbound, the gateway).
//!
//! Like `tokio::io::copy_bidirectional`, with one difference that matters
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
    let mut a_to_b = Direction::Copying(Copier::default());
    let mut b_to_a = Direction::Copying(Copier::default());
    poll_fn(|cx| {
        let a_to_b = a_to_b.poll(cx, &mut *a, &mut *b)?;
        let b_to_a = b_to_a.poll(cx, &mut *b, &mut *a)?;
        match (a_to_b, b_to_a) {
            (Poll::Ready(up), Poll::Ready(down)) => Poll::Ready(Ok((up, down))),
            _ => Poll::Pending,
        }
    })
    .await
}

/// One direction: copying, then shutting the writer down, then done.
enum Direction {
    Copying(Copier),
    ShuttingDown(u64),
    Done(u64),
}

impl Direction {
    fn poll<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        reader: &mut R,
        writer: &mut W,
    ) -> Poll<io::Result<u64>>
    where
        R: AsyncRead + Unpin + ?Sized,
        W: AsyncWrite + Unpin + ?Sized,
    {
        loop {
            match self {
                Direction::Copying(copier) => {
                    let copied = ready!(copier.poll_copy(cx, reader, writer))?;
                    *self = Direction::ShuttingDown(copied);
                }
                Direction::ShuttingDown(copied) => {
                    ready!(Pin::new(&mut *writer).poll_shutdown(cx))?;
                    *self = Direction::Done(*copied);
                }
                Direction::Done(copied) => return Poll::Ready(Ok(*copied)),
            }
        }
    }
}

/// Reads into its buffer, writes it all out, and again, until EOF.
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
                ready!(Pin::new(&mut *writer).poll_flush(cx))?;
                self.unflushed = false;
                return Poll::Ready(Ok(self.copied));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
