//! `strait-wan-delay`: the delay line of testenv's WAN (`strait_testenv::wan`).
//!
//! Holds every packet that iptables sends to NFQUEUE `--queue` for `--delay`,
//! then lets it go on, in arrival order. It stands in for tc netem, which the
//! kernels Strait's CI runs on do not have. Run inside the WAN namespace; it
//! prints `ready` once bound, so rules may send packets to the queue.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::io::Write;
use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "strait-wan-delay", version)]
struct Args {
    /// The NFQUEUE number to serve.
    #[arg(long, default_value_t = 0)]
    queue: u16,
    /// How long to hold each packet, e.g. `25ms`.
    #[arg(long, value_parser = humantime::parse_duration)]
    delay: Duration,
}

/// How long the loop may sleep: packets are released at most this late, and
/// new ones are seen at most this late (their delay counts from then).
const TICK: Duration = Duration::from_micros(500);
/// Packets the kernel may hold for us; beyond, it drops (as a full netem queue would).
const MAX_QUEUED: u32 = 100_000;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let n = args.queue;
    let mut queue =
        nfq::Queue::open().map_err(|e| anyhow::anyhow!("open a netfilter queue socket: {e}"))?;
    queue
        .bind(n)
        .map_err(|e| anyhow::anyhow!("bind NFQUEUE {n}: {e}"))?;
    // Metadata only: the packet ids are all a verdict needs.
    queue.set_copy_range(n, 0)?;
    queue.set_queue_max_len(n, MAX_QUEUED)?;
    queue.set_nonblocking(true);
    println!("ready: holding packets of NFQUEUE {n} for {:?}", args.delay);
    std::io::stdout().flush()?;

    let mut held: VecDeque<(Instant, nfq::Message)> = VecDeque::new();
    loop {
        loop {
            match queue.recv() {
                Ok(message) => held.push_back((Instant::now() + args.delay, message)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(anyhow::anyhow!("receive from NFQUEUE {n}: {e}")),
            }
        }
        let now = Instant::now();
        while held.front().is_some_and(|(due, _)| *due <= now) {
            let (_, mut message) = held.pop_front().expect("just checked");
            message.set_verdict(nfq::Verdict::Accept);
            queue.verdict(message)?;
        }
        let wait = held.front().map_or(TICK, |(due, _)| {
            due.saturating_duration_since(now).min(TICK)
        });
        std::thread::sleep(wait);
    }
}
