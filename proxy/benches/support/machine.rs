//! What the machine's CPUs did over a run. On a machine this small the
//! client, the server and both proxies share its CPUs; when they want more
//! than it has, requests wait for a CPU and the tail shows it.
//! - CPU wait: the share of the run's wall time in which some runnable task
//!   waited for a CPU (/proc/pressure/cpu, `some`; the scheduler's own
//!   accounting). /proc/stat's busy ticks are no use here: they are sampled
//!   at the timer tick, which a load paced in milliseconds aliases with.
//! - Steal: the share of the CPUs' time the hypervisor ran someone else
//!   (/proc/stat).

use std::time::Instant;

/// A reading to measure a run from.
#[derive(Clone, Copy)]
pub struct Reading {
    at: Instant,
    /// Microseconds some task waited for a CPU, so far.
    cpu_wait_us: Option<u64>,
    /// Ticks stolen and all ticks, all CPUs, so far.
    steal: u64,
    ticks: u64,
}

/// Shares over a run, in percent.
#[derive(Clone, Copy, Default)]
pub struct Usage {
    /// `None` without pressure stall information (kernel without PSI).
    pub cpu_wait: Option<f64>,
    pub steal: f64,
}

/// A share for a table: `-` when unknown.
pub fn percent_text(share: Option<f64>) -> String {
    share.map_or("-".into(), |s| format!("{s:.0}"))
}

impl Reading {
    pub fn now() -> Reading {
        let stat = std::fs::read_to_string("/proc/stat").expect("read /proc/stat");
        let (steal, ticks) = steal_and_ticks(&stat).expect("/proc/stat starts with the `cpu` line");
        Reading {
            at: Instant::now(),
            cpu_wait_us: std::fs::read_to_string("/proc/pressure/cpu")
                .ok()
                .and_then(|p| some_total_us(&p)),
            steal,
            ticks,
        }
    }

    /// What the CPUs did since `self`.
    pub fn since(self) -> Usage {
        let now = Reading::now();
        let wall_us = now.at.duration_since(self.at).as_micros() as f64;
        let ticks = now.ticks.saturating_sub(self.ticks);
        Usage {
            cpu_wait: match (self.cpu_wait_us, now.cpu_wait_us) {
                (Some(then), Some(now)) if wall_us > 0.0 => {
                    Some(100.0 * now.saturating_sub(then) as f64 / wall_us)
                }
                _ => None,
            },
            steal: if ticks == 0 {
                0.0
            } else {
                100.0 * now.steal.saturating_sub(self.steal) as f64 / ticks as f64
            },
        }
    }
}

/// `some avg10=… avg60=… avg300=… total=<µs>`: the total.
fn some_total_us(pressure: &str) -> Option<u64> {
    pressure
        .lines()
        .find(|l| l.starts_with("some "))?
        .split_whitespace()
        .find_map(|f| f.strip_prefix("total="))?
        .parse()
        .ok()
}

/// The first line of /proc/stat: `cpu user nice system idle iowait irq
/// softirq steal …`: steal, and the sum of those eight.
fn steal_and_ticks(stat: &str) -> Option<(u64, u64)> {
    let mut fields = stat.lines().next()?.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let ticks: Vec<u64> = fields
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    (ticks.len() == 8).then(|| (ticks[7], ticks.iter().sum()))
}
