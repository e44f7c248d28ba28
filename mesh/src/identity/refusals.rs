//! Refused handshakes made visible: `tls_refusals_total{side, reason}` (both
//! labels bounded) and a log line at most once a minute per peer (the identity
//! the peer presented, or its issuer when it presented none).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::certs;
use super::trust::Refusal;

/// One log line per peer per this long.
pub const LOG_INTERVAL: Duration = Duration::from_secs(60);
/// Peers remembered for the log limit; past it, old entries are dropped and,
/// if none is old enough, the refusal is counted but not logged.
const MAX_PEERS: usize = 4096;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    /// `server`: this process refused a client; `client`: it refused a server.
    side: &'static str,
    reason: &'static str,
}

/// Counters and the log limiter, shared by every config of one trust bundle.
#[derive(Clone, Debug, Default)]
pub struct RefusalLog {
    total: Family<RefusalLabels, Counter>,
    logged: Arc<Mutex<HashMap<String, Instant>>>,
}

impl RefusalLog {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tls_refusals",
            "Peers refused during the TLS handshake, by side (server: a client was refused; client: a server was) and reason",
            self.total.clone(),
        );
    }

    /// How many refusals of `side` and `reason` were counted.
    pub fn count(&self, side: &'static str, reason: &'static str) -> u64 {
        self.total
            .get_or_create(&RefusalLabels { side, reason })
            .get()
    }

    pub fn record(&self, side: &'static str, peer: &[u8], refusal: &Refusal) {
        self.total
            .get_or_create(&RefusalLabels {
                side,
                reason: refusal.reason(),
            })
            .inc();
        let who = certs::spiffe_id_of(peer)
            .map(|id| id.to_string())
            .or_else(|| certs::uri_sans(peer).into_iter().next())
            .or_else(|| certs::issuer_name(peer).map(|i| format!("a certificate issued by {i}")))
            .unwrap_or_else(|| "an unreadable certificate".into());
        if self.should_log(&who, Instant::now()) {
            let role = if side == "server" { "client" } else { "server" };
            tracing::warn!(peer = %who, reason = refusal.reason(), "refused a {role}: {refusal}");
        }
    }

    fn should_log(&self, who: &str, now: Instant) -> bool {
        let mut logged = self.logged.lock().expect("not poisoned");
        if let Some(last) = logged.get(who)
            && now.duration_since(*last) < LOG_INTERVAL
        {
            return false;
        }
        if logged.len() >= MAX_PEERS && !logged.contains_key(who) {
            logged.retain(|_, t| now.duration_since(*t) < LOG_INTERVAL);
            if logged.len() >= MAX_PEERS {
                return false;
            }
        }
        logged.insert(who.to_string(), now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_peer_per_interval_and_bounded() {
        let log = RefusalLog::default();
        let t0 = Instant::now();
        assert!(log.should_log("spiffe://a/ns/x/sa/y", t0));
        assert!(!log.should_log("spiffe://a/ns/x/sa/y", t0 + Duration::from_secs(59)));
        assert!(log.should_log("spiffe://a/ns/x/sa/z", t0));
        assert!(log.should_log("spiffe://a/ns/x/sa/y", t0 + LOG_INTERVAL));
        for i in 0..MAX_PEERS * 2 {
            log.should_log(&format!("peer-{i}"), t0);
        }
        assert!(log.logged.lock().unwrap().len() <= MAX_PEERS);
        // Once the old entries age out, new peers are logged again.
        assert!(log.should_log("late", t0 + LOG_INTERVAL * 2));
    }
}
