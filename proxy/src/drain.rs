//! Graceful shutdown, one mechanism for the whole proxy: a phase that every
//! listener and connection watches, and a count of open connections that
//! the process waits on.
//!
//! 1. **Serving.**
//! 2. **Closing** ([`Shutdown::start_closing`], at SIGTERM, for the shutdown
//!    delay): listeners still accept (Service endpoints and peers take a
//!    moment to learn that the pod is terminating), but every HTTP/1
//!    response says `connection: close`, so keep-alive clients move to the
//!    next proxy between two requests, never in the middle of one.
//! 3. **Draining** ([`Shutdown::drain`]): listeners stop accepting; open
//!    connections finish what is in flight (hyper's graceful shutdown) and the
//!    process waits for them, bounded.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Serving,
    Closing,
    Draining,
}

/// What listeners and connections hold: the phase, and a guard per
/// connection.
#[derive(Clone, Debug)]
pub struct Drain {
    phase: watch::Receiver<Phase>,
    open: Arc<Open>,
}

/// What the process holds: moves the phase on and waits for the drain.
#[derive(Debug)]
pub struct Shutdown {
    phase: watch::Sender<Phase>,
    open: Arc<Open>,
}

#[derive(Debug, Default)]
struct Open {
    count: AtomicUsize,
    idle: Notify,
}

/// Held by one open connection (or a spliced stream that outlives it).
#[derive(Debug)]
pub struct DrainGuard(Arc<Open>);

impl Drop for DrainGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    /// A drain and its [`Shutdown`].
    pub fn new() -> (Self, Shutdown) {
        let (tx, rx) = watch::channel(Phase::Serving);
        let open = Arc::<Open>::default();
        (
            Self {
                phase: rx,
                open: open.clone(),
            },
            Shutdown { phase: tx, open },
        )
    }

    /// Whether connections should close after their current response
    /// (closing or draining).
    pub fn is_closing(&self) -> bool {
        *self.phase.borrow() >= Phase::Closing
    }

    /// Adds `connection: close` to an HTTP/1 response once closing has begun.
    pub fn mark_closing<B>(&self, response: &mut http::Response<B>) {
        if self.is_closing() {
            response.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
    }

    pub fn guard(&self) -> DrainGuard {
        self.open.count.fetch_add(1, Ordering::AcqRel);
        DrainGuard(self.open.clone())
    }

    /// Resolves once the drain has begun.
    pub async fn signaled(&self) {
        let mut rx = self.phase.clone();
        let _ = rx.wait_for(|p| *p == Phase::Draining).await;
    }

    /// Runs a served connection to its end; when the drain begins, asks it
    /// to finish gracefully (`shutdown`: hyper's `graceful_shutdown`, which
    /// answers what is in flight and then closes) and waits for that. The
    /// caller pins the connection (`std::pin::pin!`): taken by value, it
    /// would be stored twice in every connection task's future (~13 KiB per
    /// idle inbound connection, measured by `proxy/tests/robustness.rs`).
    pub async fn serve<C: Future>(
        &self,
        mut connection: Pin<&mut C>,
        shutdown: impl FnOnce(Pin<&mut C>),
    ) -> C::Output {
        tokio::select! {
            done = connection.as_mut() => done,
            _ = self.signaled() => {
                shutdown(connection.as_mut());
                connection.await
            }
        }
    }
}

impl Shutdown {
    /// The closing phase: HTTP/1 responses close their connections.
    pub fn start_closing(&self) {
        self.phase.send_if_modified(|p| {
            let changed = *p < Phase::Closing;
            *p = (*p).max(Phase::Closing);
            changed
        });
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.count.load(Ordering::Acquire)
    }

    /// Starts the drain (listeners stop) and waits until no connection is
    /// open, or `timeout`; returns how many remain.
    pub async fn drain(&self, timeout: Duration) -> usize {
        self.phase.send_replace(Phase::Draining);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let idle = self.open.idle.notified();
            if self.open() == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.open();
            }
        }
    }
}

/// Accepts connections until the drain starts; each is handled in its own
/// task that holds a drain guard and a place under `limit`. Past the limit a
/// connection gets `refusal` (written if the socket takes it at once) and is
/// closed. Accept errors (out of file descriptors) pause briefly instead of
/// spinning.
pub async fn serve_connections<F, Fut>(
    listener: tokio::net::TcpListener,
    drain: Drain,
    side: &'static str,
    limit: strait_mesh::limits::ConnLimit,
    refusal: &'static [u8],
    handle: F,
) where
    F: Fn(tokio::net::TcpStream, std::net::SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = drain.signaled() => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                let Some(permit) = limit.try_acquire() else {
                    let _ = stream.try_write(refusal);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let (work, guard) = (handle(stream, peer), drain.guard());
                tokio::spawn(async move {
                    let _guard = guard;
                    let _permit = permit;
                    work.await
                });
            }
            Err(e) => {
                tracing::warn!("{side} accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn phases_move_forward_only_and_responses_close_from_closing_on() {
        let (drain, shutdown) = Drain::new();
        let mut response = http::Response::new(());
        drain.mark_closing(&mut response);
        assert!(!drain.is_closing());
        assert!(response.headers().get(http::header::CONNECTION).is_none());
        shutdown.start_closing();
        drain.mark_closing(&mut response);
        assert!(drain.is_closing());
        assert_eq!(response.headers()[http::header::CONNECTION], "close");
        // Closing does not start the drain.
        let signaled = tokio::time::timeout(Duration::from_millis(20), drain.signaled()).await;
        assert!(signaled.is_err(), "closing is not draining");
        assert_eq!(shutdown.drain(Duration::ZERO).await, 0);
        drain.signaled().await;
        shutdown.start_closing();
        assert!(
            drain.is_closing(),
            "closing after the drain leaves it draining"
        );
        drain.signaled().await;
    }

    #[tokio::test]
    async fn the_drain_waits_for_guards_and_reports_what_outlived_the_timeout() {
        let (drain, shutdown) = Drain::new();
        let kept = drain.guard();
        let released = drain.guard();
        assert_eq!(shutdown.open(), 2);
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(released);
        });
        assert_eq!(shutdown.drain(Duration::from_millis(200)).await, 1);
        release.await.unwrap();
        let waiting = tokio::spawn(async move { shutdown.drain(Duration::from_secs(10)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(kept);
        assert_eq!(waiting.await.unwrap(), 0, "the last guard ends the drain");
    }

    #[tokio::test]
    async fn connections_accepted_before_the_drain_finish_and_later_ones_are_refused() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (drain, shutdown) = Drain::new();
        // Echoes one message after a pause: in flight when the drain starts.
        let served = tokio::spawn(serve_connections(
            listener,
            drain,
            "test",
            strait_mesh::limits::ConnLimit::new("test", 16, &Default::default()),
            b"",
            |mut s, _| async move {
                let mut buf = [0u8; 5];
                if s.read_exact(&mut buf).await.is_ok() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let _ = s.write_all(&buf).await;
                }
            },
        ));
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client.write_all(b"hello").await.unwrap();
        while shutdown.open() == 0 {
            tokio::task::yield_now().await;
        }
        let (left, echoed) = tokio::join!(shutdown.drain(Duration::from_secs(10)), async {
            let mut buf = [0u8; 5];
            client.read_exact(&mut buf).await.map(|_| buf)
        });
        assert_eq!(left, 0);
        assert_eq!(
            &echoed.unwrap(),
            b"hello",
            "the connection in flight finished"
        );
        served.await.unwrap();
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "the listener is closed after the drain"
        );
    }

    #[tokio::test]
    async fn past_the_connection_limit_a_connection_reads_the_refusal_and_is_closed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (drain, _shutdown) = Drain::new();
        let limit = strait_mesh::limits::ConnLimit::new("test", 1, &Default::default());
        tokio::spawn(serve_connections(
            listener,
            drain,
            "test",
            limit.clone(),
            b"refused",
            |mut s, _| async move {
                // Holds its place until the client closes.
                let mut buf = [0u8; 1];
                let _ = s.read(&mut buf).await;
            },
        ));
        let held = tokio::net::TcpStream::connect(addr).await.unwrap();
        while limit.open() == 0 {
            tokio::task::yield_now().await;
        }
        let mut over = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut answer = Vec::new();
        over.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"refused");
        // Its place is free again once the first closes.
        drop(held);
        while limit.open() != 0 {
            tokio::task::yield_now().await;
        }
        let mut again = tokio::net::TcpStream::connect(addr).await.unwrap();
        again.write_all(b"x").await.unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(
            again.read(&mut buf).await.unwrap(),
            0,
            "served, not refused"
        );
    }

    #[tokio::test]
    async fn serve_asks_a_connection_to_finish_when_the_drain_begins() {
        let (drain, shutdown) = Drain::new();
        let (asked_tx, mut asked_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        // A "connection" that ends only once asked to shut down.
        let connection = async move {
            asked_rx.recv().await;
            "finished"
        };
        let serving = tokio::spawn(async move {
            drain
                .serve(std::pin::pin!(connection), move |_| {
                    let _ = asked_tx.send(());
                })
                .await
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!serving.is_finished());
        shutdown.drain(Duration::ZERO).await;
        assert_eq!(serving.await.unwrap(), "finished");
    }
}
