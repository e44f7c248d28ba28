//! Logging set-up shared by every Strait binary.

use tracing_subscriber::{EnvFilter, fmt};

/// Log format chosen on the command line of each binary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (default; what a person reads in a terminal).
    #[default]
    Plain,
    /// One JSON object per line (what a log pipeline ingests).
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "plain" => Ok(Self::Plain),
            "json" => Ok(Self::Json),
            other => Err(format!(
                "unknown log format {other:?}: use \"plain\" or \"json\""
            )),
        }
    }
}

/// Installs the global tracing subscriber. The filter comes from `RUST_LOG`
/// when set, else from `default_filter` (e.g. `"info"`). Logs go to stderr so
/// that a command's stdout stays clean for piping (`strait link | kubectl apply -f -`).
pub fn init_tracing(format: LogFormat, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Colours only on a terminal: logs collected by a kubelet or written to a
    // file stay plain text.
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    // A second call (tests that start several components in one process) is harmless.
    let _ = match format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// For integration tests that run components in-process: logs go through the
/// test harness's capture, so they show only for a test that fails.
pub fn init_test_tracing(default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let _ = fmt().with_env_filter(filter).with_test_writer().try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_format_parses_known_values_and_rejects_others() {
        assert_eq!("plain".parse::<LogFormat>(), Ok(LogFormat::Plain));
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        let err = "xml".parse::<LogFormat>().unwrap_err();
        assert!(err.contains("plain") && err.contains("json"), "{err}");
    }
}

/// At most one log line per peer per [`PeerLogLimit::INTERVAL`]: what a
/// refusal logs, so a peer retrying in a loop cannot flood the log (its
/// refusals are still counted). At most [`PeerLogLimit::MAX_PEERS`] peers
/// are remembered; when full, entries older than the interval are dropped
/// and, if none is, the line is skipped.
#[derive(Clone, Debug, Default)]
pub struct PeerLogLimit {
    logged: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>>,
}

impl PeerLogLimit {
    pub const INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);
    pub const MAX_PEERS: usize = 4096;

    /// Whether a line about `peer` may be logged now.
    pub fn allow(&self, peer: &str) -> bool {
        self.allow_at(peer, std::time::Instant::now())
    }

    fn allow_at(&self, peer: &str, now: std::time::Instant) -> bool {
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(last) = logged.get(peer)
            && now.duration_since(*last) < Self::INTERVAL
        {
            return false;
        }
        if logged.len() >= Self::MAX_PEERS && !logged.contains_key(peer) {
            logged.retain(|_, t| now.duration_since(*t) < Self::INTERVAL);
            if logged.len() >= Self::MAX_PEERS {
                return false;
            }
        }
        logged.insert(peer.to_string(), now);
        true
    }
}

#[cfg(test)]
mod peer_log_limit_tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn one_line_per_peer_per_interval_and_bounded() {
        let log = PeerLogLimit::default();
        let t0 = Instant::now();
        assert!(log.allow_at("spiffe://a/ns/x/sa/y", t0));
        assert!(!log.allow_at("spiffe://a/ns/x/sa/y", t0 + Duration::from_secs(59)));
        assert!(log.allow_at("spiffe://a/ns/x/sa/z", t0));
        assert!(log.allow_at("spiffe://a/ns/x/sa/y", t0 + PeerLogLimit::INTERVAL));
        for i in 0..PeerLogLimit::MAX_PEERS * 2 {
            log.allow_at(&format!("peer-{i}"), t0);
        }
        assert!(log.logged.lock().unwrap().len() <= PeerLogLimit::MAX_PEERS);
        // Once the old entries age out, new peers are logged again.
        assert!(log.allow_at("late", t0 + PeerLogLimit::INTERVAL * 2));
    }
}
