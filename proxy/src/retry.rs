//! The retry budget (Finagle's, as Linkerd uses it): retries may add at most
//! `ratio` of the recent request load, plus a floor of `min_per_second`, over a
//! sliding `ttl` window. A failing endpoint's retryable requests are retried;
//! when everything fails, the budget runs dry and stops a retry storm.

use std::collections::VecDeque;
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

#[derive(Debug)]
struct Window {
    /// When each counted request and retry happened (oldest first).
    requests: VecDeque<Instant>,
    retries: VecDeque<Instant>,
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
                requests: VecDeque::new(),
                retries: VecDeque::new(),
            }),
        }
    }

    fn expire(&self, w: &mut Window, now: Instant) {
        let ttl = self.config.ttl;
        while w
            .requests
            .front()
            .is_some_and(|t| now.duration_since(*t) > ttl)
        {
            w.requests.pop_front();
        }
        while w
            .retries
            .front()
            .is_some_and(|t| now.duration_since(*t) > ttl)
        {
            w.retries.pop_front();
        }
    }

    /// Counts an original request (it earns retry allowance).
    pub fn deposit(&self, now: Instant) {
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        self.expire(&mut w, now);
        // Bounded: a window never needs more entries than requests in it.
        if w.requests.len() < 1_000_000 {
            w.requests.push_back(now);
        }
    }

    /// Takes one retry from the budget; false when it is spent.
    pub fn withdraw(&self, now: Instant) -> bool {
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        self.expire(&mut w, now);
        let allowed = self.config.ratio * w.requests.len() as f64
            + f64::from(self.config.min_per_second) * self.config.ttl.as_secs_f64();
        if (w.retries.len() as f64) < allowed {
            w.retries.push_back(now);
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
}
