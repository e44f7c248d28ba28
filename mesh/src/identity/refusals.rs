//! Refused handshakes made visible: `tls_refusals_total{side, reason}` (both
//! labels bounded) and a log line at most once a minute per peer (the identity
//! the peer presented, or its issuer when it presented none).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::certs;
use super::trust::Refusal;

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
    logged: crate::telemetry::PeerLogLimit,
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
        if self.logged.allow(&who) {
            let role = if side == "server" { "client" } else { "server" };
            tracing::warn!(peer = %who, reason = refusal.reason(), "refused a {role}: {refusal}");
        }
    }
}
