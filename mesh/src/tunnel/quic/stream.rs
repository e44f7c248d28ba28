//! One tunnel stream to a gateway, whatever carries it.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, Join, ReadBuf};

/// A tunnel stream to a gateway: a QUIC stream or, on fallback, TCP + TLS.
pub enum GatewayStream {
    Quic(Join<quinn::RecvStream, quinn::SendStream>),
    Tcp(Box<crate::io::ClientTls>),
    /// A CONNECT stream on the fallback's shared HTTP/2 connection.
    H2(hyper_util::rt::TokioIo<hyper::upgrade::Upgraded>),
}

impl GatewayStream {
    /// Which transport carries it: `quic` or `tcp`.
    pub fn transport(&self) -> &'static str {
        match self {
            GatewayStream::Quic(_) => "quic",
            GatewayStream::Tcp(_) | GatewayStream::H2(_) => "tcp",
        }
    }
}

impl AsyncRead for GatewayStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            GatewayStream::Quic(s) => Pin::new(s).poll_read(cx, buf),
            GatewayStream::Tcp(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            GatewayStream::H2(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for GatewayStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            GatewayStream::Quic(s) => Pin::new(s).poll_write(cx, buf),
            GatewayStream::Tcp(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            GatewayStream::H2(s) => Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            GatewayStream::Quic(s) => Pin::new(s).poll_flush(cx),
            GatewayStream::Tcp(s) => Pin::new(s.as_mut()).poll_flush(cx),
            GatewayStream::H2(s) => Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            GatewayStream::Quic(s) => Pin::new(s).poll_shutdown(cx),
            GatewayStream::Tcp(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            GatewayStream::H2(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
