//! A small window of recent gateway probe latencies, summarised as the
//! p50/p99 the Link status carries (`status.gatewayLatency`) for
//! `strait gateways` and `strait check`.

use std::collections::VecDeque;
use std::time::Duration;

use strait_mesh::link::GatewayLatency;

/// Probes kept: at the default 3 s period, the last five minutes.
pub const WINDOW: usize = 100;

/// The most recent successful probe latencies, oldest first.
#[derive(Debug, Default)]
pub struct LatencyWindow {
    samples: VecDeque<Duration>,
}

impl LatencyWindow {
    pub fn record(&mut self, latency: Duration) {
        if self.samples.len() == WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back(latency);
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Nearest-rank percentiles, in milliseconds rounded to 0.01 ms; `None` without samples.
    pub fn summary(&self) -> Option<GatewayLatency> {
        if self.samples.is_empty() {
            return None;
        }
        let mut sorted: Vec<Duration> = self.samples.iter().copied().collect();
        sorted.sort_unstable();
        let rank = |p: f64| {
            let n = sorted.len();
            // Nearest rank: the smallest sample with at least p of them at or below it.
            let k = ((p * n as f64).ceil() as usize).clamp(1, n);
            let ms = sorted[k - 1].as_secs_f64() * 1000.0;
            (ms * 100.0).round() / 100.0
        };
        Some(GatewayLatency {
            p50_ms: rank(0.50),
            p99_ms: rank(0.99),
            samples: sorted.len() as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_has_no_summary() {
        assert_eq!(LatencyWindow::default().summary(), None);
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let mut w = LatencyWindow::default();
        for ms in 1..=100u64 {
            w.record(Duration::from_millis(ms));
        }
        let s = w.summary().unwrap();
        assert_eq!((s.p50_ms, s.p99_ms, s.samples), (50.0, 99.0, 100));
        let mut one = LatencyWindow::default();
        one.record(Duration::from_micros(1234));
        let s = one.summary().unwrap();
        assert_eq!((s.p50_ms, s.p99_ms, s.samples), (1.23, 1.23, 1));
    }

    #[test]
    fn the_window_forgets_the_oldest() {
        let mut w = LatencyWindow::default();
        for _ in 0..WINDOW {
            w.record(Duration::from_secs(1));
        }
        for _ in 0..WINDOW {
            w.record(Duration::from_millis(2));
        }
        let s = w.summary().unwrap();
        assert_eq!((s.p50_ms, s.p99_ms, s.samples), (2.0, 2.0, WINDOW as u32));
    }
}
