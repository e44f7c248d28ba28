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
