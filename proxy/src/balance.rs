//! Request-level load balancing: power of two choices over peak-EWMA latency,
//! as Linkerd does. Each endpoint's cost is its latency average, which jumps
//! up at once on a slow response (the "peak") and decays back over time; the
//! load is that cost times the requests in flight plus one. Two endpoints are
//! drawn at random and the lighter one wins, so a slow endpoint loses traffic
//! quickly without every proxy stampeding to the single fastest one.
//!
//! Endpoints may carry weights (a linked cluster's gateway in a clusterset
//! service weighs that cluster's ready endpoints): the two are then drawn in
//! proportion to weight and compared on load per unit of weight, so a
//! cluster with three ready pods takes about three times the traffic of a
//! cluster with one, and still less when it is slower.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::view::Endpoint;

/// Cost of an endpoint never measured.
const DEFAULT_RTT: Duration = Duration::from_millis(5);
/// How fast old latencies are forgotten.
const DECAY: Duration = Duration::from_secs(10);
/// A failed request counts as at least this slow.
const FAILURE_PENALTY: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Stats {
    /// Latency average, nanoseconds.
    cost: f64,
    updated: Instant,
    in_flight: u32,
}

impl Stats {
    fn new(now: Instant) -> Self {
        Self {
            cost: DEFAULT_RTT.as_nanos() as f64,
            updated: now,
            in_flight: 0,
        }
    }

    fn observe(&mut self, rtt: Duration, now: Instant) {
        let rtt = rtt.as_nanos() as f64;
        if rtt > self.cost {
            self.cost = rtt;
        } else {
            let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
            let w = (-elapsed / DECAY.as_secs_f64()).exp();
            self.cost = self.cost * w + rtt * (1.0 - w);
        }
        self.updated = now;
    }

    fn load(&self) -> f64 {
        self.cost * f64::from(self.in_flight + 1)
    }
}

/// Shared by every request of one proxy; endpoints are known by address.
#[derive(Clone, Debug, Default)]
pub struct Balancer {
    stats: Arc<Mutex<HashMap<SocketAddr, Stats>>>,
    seed: Arc<AtomicU64>,
}

/// Marks a request in flight on an endpoint; `finish` records how it went.
pub struct InFlight {
    balancer: Balancer,
    addr: SocketAddr,
    done: bool,
}

impl InFlight {
    pub fn finish(mut self, rtt: Duration, ok: bool) {
        self.done = true;
        let rtt = if ok { rtt } else { rtt.max(FAILURE_PENALTY) };
        let mut stats = self.balancer.lock();
        let now = Instant::now();
        let s = stats.entry(self.addr).or_insert_with(|| Stats::new(now));
        s.in_flight = s.in_flight.saturating_sub(1);
        s.observe(rtt, now);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.done {
            // Cancelled (the caller went away): no latency to learn from.
            let mut stats = self.balancer.lock();
            if let Some(s) = stats.get_mut(&self.addr) {
                s.in_flight = s.in_flight.saturating_sub(1);
            }
        }
    }
}

impl Balancer {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Stats>> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A cheap pseudo-random number (splitmix64); quality is ample for picking.
    fn random(&self) -> u64 {
        let mut z = self
            .seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Two distinct indexes of `0..n`, uniformly.
    fn uniform_pair(r: u64, n: usize) -> (usize, usize) {
        let a = (r % n as u64) as usize;
        let mut b = ((r >> 32) % (n as u64 - 1)) as usize;
        if b >= a {
            b += 1;
        }
        (a, b)
    }

    /// Two distinct indexes drawn in proportion to the endpoints' weights
    /// (a few draws for the second; then uniformly among the others).
    fn weighted_pair(&self, endpoints: &[Endpoint]) -> (usize, usize) {
        let total: u64 = endpoints.iter().map(|e| u64::from(e.weight.max(1))).sum();
        let at = |mut x: u64| {
            for (i, e) in endpoints.iter().enumerate() {
                let w = u64::from(e.weight.max(1));
                if x < w {
                    return i;
                }
                x -= w;
            }
            endpoints.len() - 1
        };
        let a = at(self.random() % total);
        for _ in 0..4 {
            let b = at(self.random() % total);
            if b != a {
                return (a, b);
            }
        }
        let (_, b) = Self::uniform_pair(self.random(), endpoints.len());
        (a, if b == a { (a + 1) % endpoints.len() } else { b })
    }

    /// Power of two choices: the lighter (per unit of weight) of two random
    /// endpoints, drawn in proportion to their weights.
    pub fn pick(&self, endpoints: &[Endpoint]) -> Option<Endpoint> {
        match endpoints.len() {
            0 => None,
            1 => Some(endpoints[0].clone()),
            n => {
                let weighted = endpoints.iter().any(|e| e.weight != endpoints[0].weight);
                let (a, b) = if weighted {
                    self.weighted_pair(endpoints)
                } else {
                    Self::uniform_pair(self.random(), n)
                };
                let stats = self.lock();
                let load = |e: &Endpoint| {
                    stats
                        .get(&e.addr)
                        .map_or(DEFAULT_RTT.as_nanos() as f64, Stats::load)
                        / f64::from(e.weight.max(1))
                };
                let (ea, eb) = (&endpoints[a], &endpoints[b]);
                Some(if load(eb) < load(ea) { eb } else { ea }.clone())
            }
        }
    }

    /// The P2C choice first, then the others (for connection attempts that
    /// may move on to another endpoint).
    pub fn order(&self, endpoints: &[Endpoint]) -> Vec<Endpoint> {
        let Some(first) = self.pick(endpoints) else {
            return Vec::new();
        };
        let mut ordered = vec![first.clone()];
        ordered.extend(endpoints.iter().filter(|e| **e != first).cloned());
        ordered
    }

    pub fn start(&self, endpoint: &Endpoint) -> InFlight {
        let mut stats = self.lock();
        let now = Instant::now();
        stats
            .entry(endpoint.addr)
            .or_insert_with(|| Stats::new(now))
            .in_flight += 1;
        InFlight {
            balancer: self.clone(),
            addr: endpoint.addr,
            done: false,
        }
    }

    /// Forgets endpoints that are gone, so the map stays bounded.
    pub fn retain(&self, live: impl Fn(&SocketAddr) -> bool) {
        self.lock().retain(|addr, _| live(addr));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(i: u8) -> Endpoint {
        Endpoint {
            addr: SocketAddr::from(([10, 0, 0, i], 8080)),
            identity: "spiffe://td/ns/shop/sa/web".parse().unwrap(),
            via: crate::view::Via::NodeProxy(SocketAddr::from(([10, 1, 0, i], 4143))),
            weight: 1,
            service: None,
        }
    }

    /// Picks `n` times with 8 requests in flight (each taking `rtt(addr)`),
    /// as traffic does: how many each endpoint took.
    fn simulate(
        b: &Balancer,
        eps: &[Endpoint],
        n: usize,
        rtt: impl Fn(SocketAddr) -> u64,
    ) -> HashMap<SocketAddr, usize> {
        let mut counts = HashMap::new();
        let mut in_flight = std::collections::VecDeque::new();
        for _ in 0..n {
            let e = b.pick(eps).unwrap();
            *counts.entry(e.addr).or_insert(0) += 1;
            in_flight.push_back((e.addr, b.start(&e)));
            if in_flight.len() > 8 {
                let (addr, f) = in_flight.pop_front().unwrap();
                f.finish(Duration::from_millis(rtt(addr)), true);
            }
        }
        counts
    }

    #[test]
    fn weights_share_traffic_in_proportion() {
        // Two clusters' gateways: three ready pods behind one, one behind the other.
        let mut eps = vec![endpoint(1), endpoint(2)];
        eps[0].weight = 3;
        let counts = simulate(&Balancer::default(), &eps, 4000, |_| 1);
        let heavy = counts[&eps[0].addr];
        assert!(
            (2600..=3400).contains(&heavy),
            "weight 3 against 1 took {heavy} of 4000"
        );
        // Many endpoints, one heavy: every one still gets some traffic.
        let mut many: Vec<Endpoint> = (1..=5).map(endpoint).collect();
        many[4].weight = 10;
        let counts = simulate(&Balancer::default(), &many, 7000, |_| 1);
        assert_eq!(counts.len(), 5, "{counts:?}");
        let top = counts[&many[4].addr];
        assert!(
            many[..4].iter().all(|e| counts[&e.addr] * 3 < top),
            "{counts:?}"
        );
        // A slow heavy endpoint (100 ms against 1 ms) loses to a fast light one.
        let slow = eps[0].addr;
        let counts = simulate(&Balancer::default(), &eps, 4000, |a| {
            if a == slow { 100 } else { 1 }
        });
        assert!(
            counts[&slow] < 1000,
            "slow heavy endpoint still took {} of 4000",
            counts[&slow]
        );
    }

    #[test]
    fn spreads_over_equal_endpoints_and_avoids_a_slow_one() {
        let b = Balancer::default();
        let eps: Vec<Endpoint> = (1..=3).map(endpoint).collect();
        let mut counts = HashMap::new();
        for _ in 0..3000 {
            let e = b.pick(&eps).unwrap();
            *counts.entry(e.addr).or_insert(0) += 1;
        }
        for e in &eps {
            let n = counts[&e.addr];
            assert!((700..=1300).contains(&n), "uneven spread: {counts:?}");
        }
        // Endpoint 3 turns slow (100 ms against 1 ms): it should get little traffic.
        for e in &eps {
            let rtt = if e.addr == eps[2].addr { 100 } else { 1 };
            b.start(e).finish(Duration::from_millis(rtt), true);
        }
        let slow = (0..3000)
            .filter(|_| b.pick(&eps).unwrap().addr == eps[2].addr)
            .count();
        assert!(
            slow < 100,
            "slow endpoint still picked {slow} times of 3000"
        );
    }

    #[test]
    fn failures_and_in_flight_requests_count_as_load() {
        let b = Balancer::default();
        let eps = vec![endpoint(1), endpoint(2)];
        b.start(&eps[0]).finish(Duration::from_millis(1), false);
        b.start(&eps[1]).finish(Duration::from_millis(1), true);
        assert_eq!(b.pick(&eps).unwrap().addr, eps[1].addr);
        // Many requests in flight on endpoint 2 make endpoint 1 (1 s penalty) the lighter.
        let held: Vec<InFlight> = (0..2000).map(|_| b.start(&eps[1])).collect();
        assert_eq!(b.pick(&eps).unwrap().addr, eps[0].addr);
        drop(held);
        assert_eq!(b.pick(&eps).unwrap().addr, eps[1].addr);
    }

    #[test]
    fn order_puts_the_choice_first_and_keeps_every_endpoint() {
        let b = Balancer::default();
        let eps: Vec<Endpoint> = (1..=4).map(endpoint).collect();
        let ordered = b.order(&eps);
        assert_eq!(ordered.len(), 4);
        let mut addrs: Vec<_> = ordered.iter().map(|e| e.addr).collect();
        addrs.sort();
        addrs.dedup();
        assert_eq!(addrs.len(), 4);
        assert!(b.order(&[]).is_empty());
    }
}
