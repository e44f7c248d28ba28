//! The retry budget (Finagle's, as Linkerd uses it): retries may add at most
//! `ratio` of the recent request load, plus a floor of `min_per_second`, over a
//! sliding `ttl` window. A failing endpoint's retryable requests are retried;
//! when everything fails, the budget runs dry and stops a retry storm.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Budget settings; the defaults are Linkerd's.
#[derive(Clone, Copy, Debug)]
pub struct BudgetConfig {
    /// Extra load retries may add (0.2 = 20 %).
    pub ratio: f64,
    /// Retries always allowed per second, whatever the load.
    pub min_per_second: u32,
    /// How long a request counts towards the budget.
    pub ttl: Duration,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            min_per_second: 10,
            ttl: Duration::from_secs(10),
        }
    }
}

/// The window in slices: each counts the requests and retries of one
/// `ttl / SLICES` of time, so a budget's memory is constant whatever the
/// load (as Finagle's windowed counters).
const SLICES: u64 = 10;

#[derive(Clone, Copy, Debug, Default)]
struct Slice {
    /// Which slice of time since `origin` this one counts.
    index: u64,
    requests: u64,
    retries: u64,
}

#[derive(Debug)]
struct Window {
    origin: Instant,
    slices: [Slice; SLICES as usize],
}

impl Window {
    fn slice_length(ttl: Duration) -> Duration {
        (ttl / SLICES as u32).max(Duration::from_millis(1))
    }

    /// The slice counting `now`, emptied first if it last counted an
    /// older stretch of time.
    fn current(&mut self, ttl: Duration, now: Instant) -> &mut Slice {
        let index = (now.saturating_duration_since(self.origin).as_nanos()
            / Self::slice_length(ttl).as_nanos()) as u64;
        let slice = &mut self.slices[(index % SLICES) as usize];
        if slice.index != index {
            *slice = Slice {
                index,
                ..Slice::default()
            };
        }
        slice
    }

    /// Requests and retries over the last `SLICES` slices up to `now`.
    fn totals(&mut self, ttl: Duration, now: Instant) -> (u64, u64) {
        let index = self.current(ttl, now).index;
        self.slices
            .iter()
            .filter(|s| s.index + SLICES > index)
            .fold((0, 0), |(q, r), s| (q + s.requests, r + s.retries))
    }
}

/// One budget, shared by every request to one destination.
#[derive(Debug)]
pub struct RetryBudget {
    config: BudgetConfig,
    window: Mutex<Window>,
}

impl RetryBudget {
    pub fn new(config: BudgetConfig) -> Self {
        Self {
            config,
            window: Mutex::new(Window {
                origin: Instant::now(),
                slices: [Slice::default(); SLICES as usize],
            }),
        }
    }

    /// Counts an original request (it earns retry allowance).
    pub fn deposit(&self, now: Instant) {
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        w.current(self.config.ttl, now).requests += 1;
    }

    /// Whether nothing was deposited or withdrawn within the window: such a
    /// budget equals a new one, so it can be dropped and made again.
    pub fn is_idle(&self, now: Instant) -> bool {
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        w.totals(self.config.ttl, now) == (0, 0)
    }

    /// Takes one retry from the budget; false when it is spent.
    pub fn withdraw(&self, now: Instant) -> bool {
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        let (requests, retries) = w.totals(self.config.ttl, now);
        let allowed = self.config.ratio * requests as f64
            + f64::from(self.config.min_per_second) * self.config.ttl.as_secs_f64();
        if (retries as f64) < allowed {
            w.current(self.config.ttl, now).retries += 1;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_is_idle_once_its_window_has_passed() {
        let budget = RetryBudget::new(BudgetConfig::default());
        let now = Instant::now();
        assert!(budget.is_idle(now));
        budget.deposit(now);
        assert!(!budget.is_idle(now + Duration::from_secs(9)));
        assert!(budget.is_idle(now + Duration::from_secs(11)));
    }

    #[test]
    fn retries_are_capped_at_the_ratio_plus_the_floor() {
        let budget = RetryBudget::new(BudgetConfig {
            ratio: 0.2,
            min_per_second: 1,
            ttl: Duration::from_secs(10),
        });
        let now = Instant::now();
        for _ in 0..1000 {
            budget.deposit(now);
        }
        // 20 % of 1000 plus 1/s over 10 s = 210 retries, then no more.
        let granted = (0..1000).filter(|_| budget.withdraw(now)).count();
        assert_eq!(granted, 210);
    }

    #[test]
    fn the_floor_allows_retries_without_load_and_the_window_slides() {
        let budget = RetryBudget::new(BudgetConfig::default());
        let start = Instant::now();
        // 10/s for 10 s = 100 with no requests at all.
        assert_eq!((0..500).filter(|_| budget.withdraw(start)).count(), 100);
        assert!(!budget.withdraw(start));
        // After the window, the old retries no longer count.
        let later = start + Duration::from_secs(11);
        assert!(budget.withdraw(later));
    }

    /// Requests and retries leave the window on their own schedules, slice
    /// by slice.
    #[test]
    fn requests_and_retries_leave_the_window() {
        let budget = RetryBudget::new(BudgetConfig {
            ratio: 0.5,
            min_per_second: 0,
            ttl: Duration::from_secs(10),
        });
        let start = budget.window.lock().unwrap().origin;
        let at = |s: u64| start + Duration::from_secs(s);
        let granted = |s: u64| (0..1000).filter(|_| budget.withdraw(at(s))).count();
        for _ in 0..100 {
            budget.deposit(at(0));
        }
        assert_eq!(granted(5), 50);
        // At 12 s the requests of 0 s have left, the retries of 5 s have not:
        // 100 new requests allow 50, all taken.
        for _ in 0..100 {
            budget.deposit(at(12));
        }
        assert_eq!(granted(12), 0);
        // At 16 s the retries of 5 s have left too.
        assert_eq!(granted(16), 50);
    }
}
