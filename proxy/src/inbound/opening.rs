//! How a tunnel the sender marked opaque opens (CONNECT, an opaque port, a
//! transparent connection whose detection gave up): who speaks first, and
//! what. Splicing it unread would let the caller's own `strait-client-id`
//! reach the pod, so no caller byte passes before it has been classified
//! ([`classify_lenient`]): HTTP goes through the proxy's HTTP server, which
//! sets the header; only what no HTTP server would read is spliced.
//!
//! The pod is connected already. Then the caller's first bytes race the
//! pod's:
//! - the caller first: its bytes decide: HTTP/1 or HTTP/2 is served as HTTP
//!   (as with the sender's hint), anything else spliced;
//! - the pod first with an HTTP/2 server's SETTINGS frame (gRPC servers send
//!   it at once): served as HTTP/2, which is all such a pod speaks;
//! - the pod first with anything else (SMTP, MySQL greet first): spliced at
//!   once so the greeting flows, but the caller's first bytes still pass
//!   [`Guarded`]: HTTP after a greeting closes the tunnel.
//!
//! Neither side is hurried: the caller decides how long it waits, and the
//! pod's first bytes end the wait for a server-speaks-first protocol. Only a
//! tunnel in which nobody says anything for [`FIRST_BYTES_TIMEOUT`] is closed
//! (it cannot be spliced instead: its first bytes would then pass unread).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use strait_mesh::detect::{Detection, MAX_DETECT_BYTES, classify_lenient};
use strait_mesh::tunnel::Protocol;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// How long a tunnel may stay silent both ways before its first byte. Not
/// a detection timeout (the caller's first bytes, however late, are read and
/// classified): a bound on what a forgotten tunnel holds (a pod connection,
/// a task, a buffer). Ten minutes is longer than idle load balancers wait
/// (AWS NLB 350 s), so clients already reopen connections idle that long.
pub const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(600);

/// First allocation for the caller's first bytes (detect's own).
const INITIAL_BUFFER: usize = 1024;

/// What the first bytes of an opaque-hinted tunnel said.
#[derive(Debug, PartialEq, Eq)]
pub enum Opening {
    /// Serve as HTTP in this version; the caller's bytes read so far.
    Http(Protocol, Bytes),
    /// The caller spoke first, and no HTTP: splice, its bytes first.
    Opaque(Bytes),
    /// The pod spoke first, and no HTTP/2: splice, the caller's bytes so far
    /// (undecided) and the rest through [`Guarded`].
    PodFirst(Bytes),
    /// Nobody spoke within the timeout.
    Silent,
}

/// Races the caller's first bytes (`tunnel`) against the pod's (`pod`, only
/// peeked: whoever serves the tunnel reads them). Errors are the streams'.
pub async fn opening<T: AsyncRead + Unpin>(
    tunnel: &mut T,
    pod: &TcpStream,
    timeout: Duration,
) -> io::Result<Opening> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut buf = BytesMut::with_capacity(INITIAL_BUFFER);
    loop {
        match classify_lenient(&buf) {
            Detection::Protocol(Protocol::Opaque) => return Ok(Opening::Opaque(buf.freeze())),
            Detection::Protocol(http) => return Ok(Opening::Http(http, buf.freeze())),
            Detection::NeedMore => {}
        }
        let room = MAX_DETECT_BYTES - buf.len();
        if buf.capacity() == buf.len() {
            buf.reserve(buf.len().min(room));
        }
        let mut limited = (&mut buf).limit(room);
        // The caller first when both are ready: its bytes decide.
        let event = tokio::select! {
            biased;
            read = tunnel.read_buf(&mut limited) => Event::Caller(read?),
            ready = pod.readable() => Event::Pod(ready),
            () = tokio::time::sleep_until(deadline) => Event::Timeout,
        };
        match event {
            // A caller closing before its bytes decide sent no request.
            Event::Caller(0) => return Ok(Opening::Opaque(buf.freeze())),
            Event::Caller(_) => {}
            Event::Pod(ready) => {
                ready?;
                let mut first = [0u8; 9];
                let n = pod.peek(&mut first).await?;
                return Ok(if starts_server_settings(&first[..n]) {
                    Opening::Http(Protocol::Http2, buf.freeze())
                } else {
                    Opening::PodFirst(buf.freeze())
                });
            }
            Event::Timeout => return Ok(Opening::Silent),
        }
    }
}

enum Event {
    Caller(usize),
    Pod(io::Result<()>),
    Timeout,
}

/// Whether `first` is the header of an HTTP/2 server's first frame: SETTINGS
/// (type 4), no flags, stream 0, a length of whole settings (RFC 9113 §3.4,
/// §6.5). Needs all nine bytes (a peer writes them at once); fewer read as
/// no, which is safe: [`Guarded`] still keeps HTTP from the pod.
fn starts_server_settings(first: &[u8]) -> bool {
    match first {
        [l0, l1, l2, 4, 0, 0, 0, 0, 0] => {
            let len = u32::from_be_bytes([0, *l0, *l1, *l2]);
            len.is_multiple_of(6)
        }
        _ => false,
    }
}

/// The caller's side of a tunnel whose pod spoke first: its bytes are held
/// until [`classify_lenient`] decides, then passed on if opaque; HTTP is an
/// error (the pod already spoke, so the proxy cannot put its HTTP server in
/// between any more) and ends the splice. Writes go straight through.
pub struct Guarded<I> {
    io: I,
    /// The caller's bytes read and not yet passed on.
    held: BytesMut,
    decided: bool,
}

impl<I> Guarded<I> {
    /// `read`: the caller's bytes read already (undecided).
    pub fn new(read: Bytes, io: I) -> Self {
        Self {
            io,
            held: BytesMut::from(&read[..]),
            decided: false,
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Guarded<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        while !this.decided {
            match classify_lenient(&this.held) {
                Detection::NeedMore => {}
                Detection::Protocol(Protocol::Opaque) => {
                    this.decided = true;
                    break;
                }
                Detection::Protocol(_) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        "the caller sent HTTP after the pod spoke first: refused, \
                         its strait-client-id could not be set by the proxy",
                    )));
                }
            }
            let room = MAX_DETECT_BYTES - this.held.len();
            if this.held.capacity() == this.held.len() {
                this.held
                    .reserve(this.held.len().max(INITIAL_BUFFER).min(room));
            }
            let mut limited = (&mut this.held).limit(room);
            let read = std::task::ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut this.io),
                cx,
                &mut limited
            ))?;
            // Closed before deciding: no request, pass on what came.
            if read == 0 {
                this.decided = true;
            }
        }
        if this.held.is_empty() {
            return Pin::new(&mut this.io).poll_read(cx, out);
        }
        let n = this.held.len().min(out.remaining());
        out.put_slice(&this.held[..n]);
        this.held.advance(n);
        if this.held.is_empty() {
            this.held = BytesMut::new();
        }
        Poll::Ready(Ok(()))
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Guarded<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strait_mesh::detect::H2_PREFACE;
    use tokio::io::{AsyncWriteExt, duplex};
    use tokio::net::TcpListener;

    /// A connected pair: (the proxy's end to the pod, the pod's end).
    async fn pod_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let to_pod = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (pod, _) = listener.accept().await.unwrap();
        (to_pod, pod)
    }

    const LONG: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn the_caller_first_decides() {
        let (to_pod, _pod) = pod_pair().await;
        for (sent, want) in [
            (&b"get / HTTP/1.1\r\n"[..], Protocol::Http1),
            (H2_PREFACE, Protocol::Http2),
        ] {
            let (mut caller, mut tunnel) = duplex(1024);
            caller.write_all(sent).await.unwrap();
            let got = opening(&mut tunnel, &to_pod, LONG).await.unwrap();
            assert_eq!(got, Opening::Http(want, Bytes::copy_from_slice(sent)));
        }
        let (mut caller, mut tunnel) = duplex(1024);
        caller.write_all(b"\x16\x03\x01").await.unwrap();
        let got = opening(&mut tunnel, &to_pod, LONG).await.unwrap();
        assert_eq!(got, Opening::Opaque(Bytes::from_static(b"\x16\x03\x01")));
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_caller_is_still_read() {
        let (to_pod, _pod) = pod_pair().await;
        let (mut caller, mut tunnel) = duplex(1024);
        let late = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            caller.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
            caller
        });
        let got = opening(&mut tunnel, &to_pod, LONG).await.unwrap();
        assert!(matches!(got, Opening::Http(Protocol::Http1, _)), "{got:?}");
        drop(late.await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn silence_both_ways_ends_at_the_bound() {
        let (to_pod, _pod) = pod_pair().await;
        let (_caller, mut tunnel) = duplex(1024);
        let got = opening(&mut tunnel, &to_pod, LONG).await.unwrap();
        assert_eq!(got, Opening::Silent);
    }

    #[tokio::test]
    async fn the_pod_first_is_spliced_unless_it_speaks_http2() {
        let (to_pod, mut pod) = pod_pair().await;
        let (_caller, mut tunnel) = duplex(1024);
        pod.write_all(b"220 smtp ready\r\n").await.unwrap();
        let got = opening(&mut tunnel, &to_pod, LONG).await.unwrap();
        assert_eq!(got, Opening::PodFirst(Bytes::new()));

        let (to_pod, mut pod) = pod_pair().await;
        let (mut caller, mut tunnel) = duplex(1024);
        caller.write_all(&H2_PREFACE[..4]).await.unwrap();
        let settings = [0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 100];
        pod.write_all(&settings).await.unwrap();
        // The caller's four bytes are read first (biased); then the pod.
        let got = opening(&mut tunnel, &to_pod, LONG).await.unwrap();
        let want = Opening::Http(Protocol::Http2, Bytes::copy_from_slice(&H2_PREFACE[..4]));
        assert_eq!(got, want);
        let mut peeked = [0u8; 15];
        to_pod.peek(&mut peeked).await.unwrap();
        assert_eq!(peeked, settings, "the pod's bytes are left for HTTP/2");
    }

    #[tokio::test]
    async fn guarded_passes_opaque_and_refuses_http() {
        let (mut caller, tunnel) = duplex(1024);
        caller.write_all(b"O ping\r\nmore").await.unwrap();
        drop(caller);
        let mut guarded = Guarded::new(Bytes::from_static(b"EHL"), tunnel);
        let mut all = Vec::new();
        guarded.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"EHLO ping\r\nmore");

        let (mut caller, tunnel) = duplex(1024);
        caller
            .write_all(b"T / HTTP/1.1\r\nstrait-client-id: forged\r\n\r\n")
            .await
            .unwrap();
        let mut guarded = Guarded::new(Bytes::from_static(b"GE"), tunnel);
        let mut all = Vec::new();
        let err = guarded.read_to_end(&mut all).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(all.is_empty(), "nothing passed: {all:?}");
    }
}
