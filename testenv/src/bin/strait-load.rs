//! `strait-load`: an open-loop HTTP/1.1 load generator (the wrk2 way): requests
//! leave at a fixed rate whatever the answers do, and each latency is measured
//! from when the request *should* have left, so a stalled server shows up as
//! latency instead of silently lowering the rate (no coordinated omission).
//! Runs inside a pod's network namespace in the benchmarks.
//!
//! Pacing: a pacer task sleeps on a timerfd (the kernel's high-resolution
//! timers) until the next request is due, then hands every request due
//! within `--pace-window` (default 200 µs) to its connection's task, all on
//! one thread. A request handed over early is timed from when it left
//! instead, so leaving early never shortens a latency. The report's
//! `achieved_rps` counts the answers received within the measured window
//! (of requests due in it), so a path that cannot keep up shows a lower rate
//! and `saturated: true`, not the rate that was asked. Why not simpler:
//! - a tokio timer fires on 1 ms ticks, late: every request left up to 1 ms
//!   after it was due (counted as latency, a floor of ~1 ms under every p50)
//!   and each tick's requests left together, rate/1000 at once;
//! - a wake-up per request (no window) costs the generator itself 0.6 vCPU
//!   at 10 000 rps on this machine's two (most of it the VM's wake-ups),
//!   taken from the proxies being measured; a pacing thread of its own, 0.7.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustix::time::{
    Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec, timerfd_create,
    timerfd_settime,
};
use tokio::io::unix::AsyncFd;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Open-loop HTTP/1.1 load at a fixed rate; prints latency percentiles as JSON.
#[derive(Debug, Parser)]
#[command(name = "strait-load", version)]
struct Args {
    /// TCP address to connect to (the server, or an HTTP proxy).
    #[arg(long)]
    connect: SocketAddr,
    /// The request target: `/path` for a server, `http://host/path` for a proxy.
    #[arg(long, default_value = "/")]
    uri: String,
    /// Host header.
    #[arg(long, default_value = "localhost")]
    host: String,
    /// Requests per second, all connections together.
    #[arg(long, default_value_t = 1000)]
    rate: u32,
    /// Connections (each keeps one request in flight at a time).
    #[arg(long, default_value_t = 100)]
    connections: u32,
    /// How long to measure.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Load before measuring (connections warm, pools full).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Request body size in bytes (sent with POST; 0 sends GET).
    #[arg(long, default_value_t = 1024)]
    body: usize,
    /// Requests due within this long of the one the pacer woke for leave
    /// with it (timed from when they leave): fewer wake-ups of the
    /// generator, at the price of small bursts. 0: one wake-up per request.
    #[arg(long, default_value = "200us", value_parser = humantime::parse_duration)]
    pace_window: Duration,
}

/// Below this share of the asked rate answered within the window, the run
/// is reported `saturated`: the rate was not carried, and its latencies are
/// those of a queue, not of the path.
const SATURATED_BELOW: f64 = 0.95;

/// A request handed to a connection: when it was due, and when the pacer
/// let it go (earlier than due if it left with an earlier one).
#[derive(Clone, Copy)]
struct Due {
    intended: Instant,
    released: Instant,
}

impl Due {
    /// What its latency counts from: when it was due, or when it left if
    /// that was earlier. A request that waits behind a slow answer still
    /// counts from when it was due (no coordinated omission).
    fn clock_start(self) -> Instant {
        self.intended.min(self.released)
    }
}

#[derive(Default)]
struct Outcome {
    latencies_us: Vec<u64>,
    /// When each of `latencies_us` was due, in µs after the measured window
    /// began (same order).
    due_us: Vec<u64>,
    errors: u64,
    /// Errors by kind: `connect`, `send`, `body`, or `status NNN`.
    error_kinds: BTreeMap<String, u64>,
    /// Answers with `Connection: close`.
    server_closes: u64,
    /// Requests due in the measured window answered (successfully) before
    /// it ended: what the path under test actually carried in the window.
    answered_in_window: u64,
}

impl Outcome {
    fn error(&mut self, kind: impl Into<String>) {
        self.errors += 1;
        *self.error_kinds.entry(kind.into()).or_default() += 1;
    }
}

/// One connection: sends a request for each instant the pacer hands it, in
/// order; when answers are slow the instants queue up and their latency
/// counts from when each request was due.
async fn connection(
    args: &Args,
    mut queue: mpsc::UnboundedReceiver<Due>,
    measure_from: Instant,
    measure_end: Instant,
) -> Outcome {
    let mut out = Outcome::default();
    let body = Bytes::from(vec![b'x'; args.body]);
    let mut sender = None;
    while let Some(due) = queue.recv().await {
        if sender.is_none() {
            sender = match TcpStream::connect(args.connect).await {
                Ok(tcp) => {
                    let _ = tcp.set_nodelay(true);
                    match hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await {
                        Ok((s, conn)) => {
                            tokio::spawn(conn);
                            Some(s)
                        }
                        Err(_) => None,
                    }
                }
                Err(_) => None,
            };
        }
        let Some(s) = sender.as_mut() else {
            out.error("connect");
            continue;
        };
        let mut request = http::Request::builder()
            .uri(args.uri.as_str())
            .header(http::header::HOST, args.host.as_str());
        request = if args.body > 0 {
            request.method(http::Method::POST)
        } else {
            request.method(http::Method::GET)
        };
        let request = request
            .body(Full::new(body.clone()))
            .expect("valid request parts");
        let mut closing = false;
        let failure = match s.send_request(request).await {
            Ok(response) => {
                let status = response.status();
                if response
                    .headers()
                    .get(http::header::CONNECTION)
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"))
                {
                    // The server ends the connection after this answer: the
                    // next request opens a new one, as any client does.
                    out.server_closes += 1;
                    closing = true;
                }
                match response.into_body().collect().await {
                    Ok(_) if status.is_success() => None,
                    Ok(_) => Some(format!("status {}", status.as_u16())),
                    Err(_) => Some("body".to_string()),
                }
            }
            Err(e) if e.is_canceled() => Some("send (connection closed)".to_string()),
            Err(e) if e.is_incomplete_message() => Some("send (incomplete answer)".to_string()),
            Err(e) => Some(format!("send ({e})")),
        };
        let answered = failure.is_none();
        if let Some(kind) = failure {
            out.error(kind);
            sender = None;
        } else if closing {
            sender = None;
        }
        if due.intended >= measure_from {
            let now = Instant::now();
            out.latencies_us
                .push(now.duration_since(due.clock_start()).as_micros() as u64);
            out.due_us
                .push(due.intended.duration_since(measure_from).as_micros() as u64);
            out.answered_in_window += u64::from(answered && now <= measure_end);
        }
    }
    out
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.rate > 0 && args.connections > 0,
        "--rate and --connections must be above 0"
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let args = std::sync::Arc::new(args);
    let all = runtime.block_on(async {
        let start = Instant::now();
        let measure_from = start + args.warmup;
        let (senders, tasks): (Vec<_>, Vec<_>) = (0..args.connections)
            .map(|_| {
                let (tx, rx) = mpsc::unbounded_channel();
                let args = args.clone();
                let task = tokio::spawn(async move {
                    connection(&args, rx, measure_from, measure_from + args.duration).await
                });
                (tx, task)
            })
            .unzip();
        pace(&args, start, measure_from + args.duration, senders).await?;
        let mut all = Outcome::default();
        for t in tasks {
            let o = t.await?;
            all.latencies_us.extend(o.latencies_us);
            all.due_us.extend(o.due_us);
            all.errors += o.errors;
            all.server_closes += o.server_closes;
            all.answered_in_window += o.answered_in_window;
            for (kind, n) in o.error_kinds {
                *all.error_kinds.entry(kind).or_default() += n;
            }
        }
        anyhow::Ok(all)
    })?;
    let mut all = all;
    let tail = Tail::of(&all.latencies_us, &all.due_us, args.duration);
    all.latencies_us.sort_unstable();
    let pct = |p: f64| -> f64 {
        if all.latencies_us.is_empty() {
            return 0.0;
        }
        let i = ((all.latencies_us.len() as f64 * p).ceil() as usize).saturating_sub(1);
        all.latencies_us[i.min(all.latencies_us.len() - 1)] as f64 / 1000.0
    };
    // What was answered within the window, not what was due in it: a path
    // that cannot keep up leaves requests queued past the window's end
    // (their latencies still count), and carried less than was asked.
    let achieved = all.answered_in_window as f64 / args.duration.as_secs_f64();
    let saturated = achieved < SATURATED_BELOW * f64::from(args.rate);
    if saturated {
        eprintln!(
            "strait-load: saturated: {achieved:.0} of {} requests a second answered within the window (below {:.0} %)",
            args.rate,
            SATURATED_BELOW * 100.0
        );
    }
    let report = serde_json::json!({
        "requests": all.latencies_us.len(),
        "errors": all.errors,
        "error_kinds": all.error_kinds,
        "server_closes": all.server_closes,
        "rate": args.rate,
        "achieved_rps": achieved,
        "saturated": saturated,
        "p50_ms": pct(0.50),
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "p999_ms": pct(0.999),
        "max_ms": pct(1.0),
        "over_p99_per_second": tail.over_p99_per_second,
        "slowest": tail.slowest,
    });
    println!("{report}");
    Ok(())
}

/// Where in the window the tail fell: whether the slowest requests cluster
/// in time (a stall of the path: a pause, a timer, a congestion window)
/// or spread evenly (scheduling noise).
#[derive(Debug, PartialEq)]
struct Tail {
    /// Requests slower than the p99, by the second of the window they were
    /// due in.
    over_p99_per_second: Vec<u64>,
    /// The ten slowest as `[due ms into the window, latency ms]`, slowest
    /// first.
    slowest: Vec<[f64; 2]>,
}

impl Tail {
    fn of(latencies_us: &[u64], due_us: &[u64], window: Duration) -> Self {
        let mut by_latency: Vec<(u64, u64)> = latencies_us
            .iter()
            .copied()
            .zip(due_us.iter().copied())
            .collect();
        by_latency.sort_unstable_by_key(|&(latency, _)| std::cmp::Reverse(latency));
        // The requests past the p99 (the slowest 1 %).
        let over = &by_latency[..by_latency.len() / 100];
        let mut over_p99_per_second = vec![0; window.as_secs().max(1) as usize];
        for &(_, due) in over {
            let second = (due / 1_000_000) as usize;
            if let Some(n) = over_p99_per_second.get_mut(second) {
                *n += 1;
            }
        }
        let slowest = by_latency
            .iter()
            .take(10)
            .map(|&(latency, due)| [due as f64 / 1000.0, latency as f64 / 1000.0])
            .collect();
        Self {
            over_p99_per_second,
            slowest,
        }
    }
}

/// Hands request `n`, due at `start + n / rate`, to connection
/// `n % connections`, until `end`, then closes the connections' queues.
async fn pace(
    args: &Args,
    start: Instant,
    end: Instant,
    connections: Vec<mpsc::UnboundedSender<Due>>,
) -> io::Result<()> {
    let timer = timerfd_create(
        TimerfdClockId::Monotonic,
        TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
    )?;
    // Deprecated because a `T` whose `as_raw_fd` can change or close under
    // the registration is unsound; an `OwnedFd` the `AsyncFd` owns cannot,
    // and the sound `register` is `unsafe`, which this crate forbids.
    #[allow(deprecated)]
    let timer = AsyncFd::new(timer)?;
    let interval = Duration::from_secs_f64(1.0 / f64::from(args.rate));
    let mut woke = Instant::now();
    for (n, connection) in (0u32..).zip(connections.iter().cycle()) {
        let intended = start + interval * n;
        if intended >= end {
            break;
        }
        // A request due within the window of the last wake-up, or already
        // late (a slow wake-up), leaves at once; any other, when it is due.
        let wait = if intended <= woke + args.pace_window {
            None
        } else {
            intended
                .checked_duration_since(Instant::now())
                .filter(|w| !w.is_zero())
        };
        if let Some(wait) = wait {
            sleep(&timer, wait).await?;
            woke = Instant::now();
        }
        let due = Due {
            intended,
            released: Instant::now(),
        };
        if connection.send(due).is_err() {
            break;
        }
    }
    Ok(())
}

/// Sleeps `wait` on the timerfd `timer`.
async fn sleep(timer: &AsyncFd<OwnedFd>, wait: Duration) -> io::Result<()> {
    let once = Itimerspec {
        it_interval: Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: Timespec::try_from(wait).map_err(io::Error::other)?,
    };
    timerfd_settime(timer.get_ref(), TimerfdTimerFlags::empty(), &once)?;
    loop {
        let mut ready = timer.readable().await?;
        let mut expirations = [0u8; 8];
        if let Ok(read) = ready.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut expirations)?)) {
            return read.map(drop);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_shows_where_the_slowest_fell() {
        // 1 000 requests over 2 s, 1 ms each, but the 10 due at 1.5 s+ took 9 ms.
        let due: Vec<u64> = (0..1000).map(|i| i * 2_000).collect();
        let latency: Vec<u64> = due
            .iter()
            .map(|&d| {
                if (1_500_000..1_520_000).contains(&d) {
                    9_000
                } else {
                    1_000
                }
            })
            .collect();
        let tail = Tail::of(&latency, &due, Duration::from_secs(2));
        assert_eq!(tail.over_p99_per_second, vec![0, 10]);
        assert_eq!(tail.slowest.len(), 10);
        assert!(
            tail.slowest
                .iter()
                .all(|&[at, ms]| ms == 9.0 && at >= 1500.0)
        );
    }
}
