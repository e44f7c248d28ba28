//! `strait-load`: an open-loop HTTP/1.1 load generator (the wrk2 way): requests
//! leave at a fixed rate whatever the answers do, and each latency is measured
//! from when the request *should* have left, so a stalled server shows up as
//! latency instead of silently lowering the rate (no coordinated omission).
//! Runs inside a pod's network namespace in the benchmarks.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

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
}

#[derive(Default)]
struct Outcome {
    latencies_us: Vec<u64>,
    errors: u64,
    /// Errors by kind: `connect`, `send`, `body`, or `status NNN`.
    error_kinds: BTreeMap<String, u64>,
    /// Answers with `Connection: close`.
    server_closes: u64,
}

impl Outcome {
    fn error(&mut self, kind: impl Into<String>) {
        self.errors += 1;
        *self.error_kinds.entry(kind.into()).or_default() += 1;
    }
}

async fn connection(args: &Args, index: u32, start: Instant, measure_from: Instant) -> Outcome {
    let mut out = Outcome::default();
    let body = Bytes::from(vec![b'x'; args.body]);
    let interval = Duration::from_secs_f64(f64::from(args.connections) / f64::from(args.rate));
    // Spread the connections' first requests over one interval.
    let offset = interval.mul_f64(f64::from(index) / f64::from(args.connections));
    let end = measure_from + args.duration;
    let mut sender = None;
    let mut k: u32 = 0;
    loop {
        let intended = start + offset + interval * k;
        k += 1;
        if intended >= end {
            return out;
        }
        tokio::time::sleep_until(intended).await;
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
        if let Some(kind) = failure {
            out.error(kind);
            sender = None;
        } else if closing {
            sender = None;
        }
        if intended >= measure_from {
            out.latencies_us
                .push(Instant::now().duration_since(intended).as_micros() as u64);
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.rate > 0 && args.connections > 0,
        "--rate and --connections must be above 0"
    );
    let start = Instant::now();
    let measure_from = start + args.warmup;
    let args = std::sync::Arc::new(args);
    let tasks: Vec<_> = (0..args.connections)
        .map(|i| {
            let args = args.clone();
            tokio::spawn(async move { connection(&args, i, start, measure_from).await })
        })
        .collect();
    let mut all = Outcome::default();
    for t in tasks {
        let o = t.await?;
        all.latencies_us.extend(o.latencies_us);
        all.errors += o.errors;
        all.server_closes += o.server_closes;
        for (kind, n) in o.error_kinds {
            *all.error_kinds.entry(kind).or_default() += n;
        }
    }
    all.latencies_us.sort_unstable();
    let pct = |p: f64| -> f64 {
        if all.latencies_us.is_empty() {
            return 0.0;
        }
        let i = ((all.latencies_us.len() as f64 * p).ceil() as usize).saturating_sub(1);
        all.latencies_us[i.min(all.latencies_us.len() - 1)] as f64 / 1000.0
    };
    let report = serde_json::json!({
        "requests": all.latencies_us.len(),
        "errors": all.errors,
        "error_kinds": all.error_kinds,
        "server_closes": all.server_closes,
        "rate": args.rate,
        "achieved_rps": all.latencies_us.len() as f64 / args.duration.as_secs_f64(),
        "p50_ms": pct(0.50),
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "p999_ms": pct(0.999),
        "max_ms": pct(1.0),
    });
    println!("{report}");
    Ok(())
}
