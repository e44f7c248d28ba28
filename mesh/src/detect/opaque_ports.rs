//! Which ports skip detection: annotation `strait.dev/opaque-ports` on a Pod,
//! its Namespace or a Service, else Linkerd's default list.
//!
//! # Precedence
//!
//! - The **workload's** list is the Pod's annotation if it has one, else its
//!   Namespace's, else [`DEFAULT_OPAQUE_PORTS`]. The Pod wins over the
//!   Namespace (the Namespace's value is a default for its pods, as Linkerd's
//!   injector copies it onto pods without their own), and any annotation,
//!   even an empty one, replaces the defaults: write `""` to detect on every
//!   port, or repeat the defaults you want to keep, as with Linkerd.
//! - A **Service's** annotation adds its ports: a port is opaque if the
//!   workload's list or the Service's names it. The Service cannot take a port
//!   away from the workload's list, because skipping detection is always safe
//!   (opaque forwarding carries HTTP too; only HTTP features are lost), while
//!   detecting a server-speaks-first protocol stalls every connection for the
//!   detect timeout.
//!
//! Which port is asked about: outbound to a Service, the Service port the client
//! dialled, with that Service's annotation; inbound, the pod port, with the
//! Pod's and Namespace's (no Service).
//!
//! # Syntax
//!
//! Like Linkerd's `config.linkerd.io/opaque-ports`: comma-separated ports and
//! inclusive ranges, `"25,443,8000-8100"`; spaces and empty entries are ignored.
//! A bad entry is reported with what is wrong and skipped; the valid rest still
//! applies, so one typo does not turn detection back on for every other port.
//! Named ports (`mysql`) are not supported: the proxy sees port numbers.

use std::fmt;
use std::ops::RangeInclusive;

use crate::names::OPAQUE_PORTS_ANNOTATION;

/// Linkerd's default opaque ports (since 2.11): SMTP (25, 587), MySQL (3306),
/// Galera (4444), PostgreSQL (5432), Redis (6379), Elasticsearch transport
/// (9300), Memcached (11211). Server-speaks-first protocols, or ones whose
/// clients sometimes wait for the server.
pub const DEFAULT_OPAQUE_PORTS: &[u16] = &[25, 587, 3306, 4444, 5432, 6379, 9300, 11211];

/// The longest piece of a bad entry an error repeats.
const MAX_ENTRY_IN_ERROR: usize = 64;

/// Where a list of opaque ports came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PortsSource {
    Pod,
    Namespace,
    Service,
    /// [`DEFAULT_OPAQUE_PORTS`]: nothing annotated the workload.
    Defaults,
}

impl fmt::Display for PortsSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PortsSource::Pod => "Pod",
            PortsSource::Namespace => "Namespace",
            PortsSource::Service => "Service",
            PortsSource::Defaults => "default opaque ports",
        })
    }
}

/// One entry of the annotation that was skipped, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "annotation {OPAQUE_PORTS_ANNOTATION} on the {on}: {entry:?} {problem}; the other entries still apply"
)]
pub struct OpaquePortsError {
    pub on: PortsSource,
    /// The entry as written (cut at 64 characters).
    pub entry: String,
    pub problem: EntryProblem,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EntryProblem {
    #[error(
        "is not a port or a range: write `8080` or `8000-8100` (named ports are not supported)"
    )]
    NotANumber,
    #[error("is not a port: ports are 1 to 65535")]
    OutOfRange,
    #[error("is a range that ends before it starts: write the lower port first")]
    Reversed,
}

/// A parsed annotation value: the ports it names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpaquePorts {
    ranges: Vec<RangeInclusive<u16>>,
}

impl OpaquePorts {
    /// Parses an annotation value found on `on`. Bad entries are skipped and
    /// returned as errors (in the order written); the rest is the result.
    pub fn parse(value: &str, on: PortsSource) -> (Self, Vec<OpaquePortsError>) {
        let mut ports = OpaquePorts::default();
        let mut errors = Vec::new();
        for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            match parse_entry(entry) {
                Ok(range) => ports.ranges.push(range),
                Err(problem) => errors.push(OpaquePortsError {
                    on,
                    entry: cut(entry),
                    problem,
                }),
            }
        }
        (ports, errors)
    }

    /// [`DEFAULT_OPAQUE_PORTS`].
    pub fn defaults() -> Self {
        Self {
            ranges: DEFAULT_OPAQUE_PORTS.iter().map(|&p| p..=p).collect(),
        }
    }

    pub fn contains(&self, port: u16) -> bool {
        self.ranges.iter().any(|r| r.contains(&port))
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

/// Whether a connection to `port` skips detection, which list said so, and the
/// annotation entries that were skipped (for a warning or an Event).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpaqueDecision {
    pub opaque: bool,
    /// The list that named the port; `None` when not opaque.
    pub by: Option<PortsSource>,
    pub errors: Vec<OpaquePortsError>,
}

/// Decides whether a connection to `port` skips detection, given the
/// `strait.dev/opaque-ports` annotation of the Pod, Service and Namespace
/// (`None`: not annotated). Precedence in the module docs: the workload's list
/// is the Pod's, else the Namespace's, else the defaults; the Service's adds.
///
/// Pure, and parses every time: a caller on the connection path keeps the
/// [`OpaquePorts`] of each object instead and asks [`OpaquePorts::contains`].
pub fn skip_detection(
    port: u16,
    pod: Option<&str>,
    service: Option<&str>,
    namespace: Option<&str>,
) -> OpaqueDecision {
    let mut errors = Vec::new();
    let mut parse = |value: &str, on| {
        let (ports, errs) = OpaquePorts::parse(value, on);
        errors.extend(errs);
        ports
    };
    let (workload, workload_source) = match (pod, namespace) {
        (Some(value), _) => (parse(value, PortsSource::Pod), PortsSource::Pod),
        (None, Some(value)) => (parse(value, PortsSource::Namespace), PortsSource::Namespace),
        (None, None) => (OpaquePorts::defaults(), PortsSource::Defaults),
    };
    let service = service.map(|value| parse(value, PortsSource::Service));

    let by = if workload.contains(port) {
        Some(workload_source)
    } else if service.is_some_and(|s| s.contains(port)) {
        Some(PortsSource::Service)
    } else {
        None
    };
    OpaqueDecision {
        opaque: by.is_some(),
        by,
        errors,
    }
}

/// `8080` or `8000-8100` (inclusive; spaces around the dash allowed).
fn parse_entry(entry: &str) -> Result<RangeInclusive<u16>, EntryProblem> {
    match entry.split_once('-') {
        Some((low, high)) => {
            let (low, high) = (parse_port(low.trim())?, parse_port(high.trim())?);
            if low > high {
                return Err(EntryProblem::Reversed);
            }
            Ok(low..=high)
        }
        None => parse_port(entry).map(|p| p..=p),
    }
}

fn parse_port(s: &str) -> Result<u16, EntryProblem> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(EntryProblem::NotANumber);
    }
    // Digits only from here, so the only failure left is the size.
    let significant = s.trim_start_matches('0');
    if significant.is_empty() || significant.len() > 5 {
        return Err(EntryProblem::OutOfRange);
    }
    significant
        .parse::<u16>()
        .map_err(|_| EntryProblem::OutOfRange)
}

fn cut(entry: &str) -> String {
    match entry.char_indices().nth(MAX_ENTRY_IN_ERROR) {
        Some((end, _)) => format!("{}…", &entry[..end]),
        None => entry.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opaque(port: u16, pod: Option<&str>, svc: Option<&str>, ns: Option<&str>) -> bool {
        skip_detection(port, pod, svc, ns).opaque
    }

    #[test]
    fn defaults_are_linkerds() {
        assert_eq!(
            DEFAULT_OPAQUE_PORTS,
            [25, 587, 3306, 4444, 5432, 6379, 9300, 11211]
        );
        for &port in DEFAULT_OPAQUE_PORTS {
            let d = skip_detection(port, None, None, None);
            assert_eq!((d.opaque, d.by), (true, Some(PortsSource::Defaults)));
        }
        assert!(!opaque(80, None, None, None));
        assert!(!opaque(8080, None, None, None));
    }

    #[test]
    fn pod_wins_over_namespace_and_replaces_the_defaults() {
        let d = skip_detection(8080, Some("8080"), None, Some("9090"));
        assert_eq!(d.by, Some(PortsSource::Pod));
        assert!(!opaque(9090, Some("8080"), None, Some("9090")));
        assert!(!opaque(3306, Some("8080"), None, None));
        // An empty annotation means: detect on every port.
        assert!(!opaque(3306, Some(""), None, None));
        assert!(!opaque(3306, None, None, Some("")));
    }

    #[test]
    fn namespace_applies_to_pods_without_their_own() {
        let d = skip_detection(9090, None, None, Some("9090"));
        assert_eq!((d.opaque, d.by), (true, Some(PortsSource::Namespace)));
        assert!(!opaque(3306, None, None, Some("9090")));
    }

    #[test]
    fn service_adds_ports() {
        let d = skip_detection(8080, None, Some("8080"), None);
        assert_eq!(d.by, Some(PortsSource::Service));
        // The workload's defaults still hold beside it.
        assert_eq!(
            skip_detection(3306, None, Some("8080"), None).by,
            Some(PortsSource::Defaults)
        );
        // And a Service cannot take a port from the workload's list.
        assert!(opaque(3306, None, Some(""), None));
        assert!(opaque(7000, Some("7000"), Some("8080"), None));
        assert!(opaque(8080, Some(""), Some("8080"), Some("9090")));
    }

    #[test]
    fn ports_and_ranges() {
        let (ports, errors) = OpaquePorts::parse(" 25, 443 ,8000 - 8100,,", PortsSource::Pod);
        assert!(errors.is_empty(), "{errors:?}");
        for port in [25, 443, 8000, 8050, 8100] {
            assert!(ports.contains(port), "{port}");
        }
        for port in [24, 26, 7999, 8101, 65535] {
            assert!(!ports.contains(port), "{port}");
        }
        let (ports, errors) = OpaquePorts::parse("1-65535,7-7,0080", PortsSource::Pod);
        assert!(errors.is_empty() && ports.contains(1) && ports.contains(65535));
    }

    #[test]
    fn bad_entries_are_named_and_the_rest_applies() {
        let value = "25,mysql,70000,0,9000-8000,-1,1-2-3,100000000000000000000,443";
        let d = skip_detection(443, Some(value), None, None);
        assert!(d.opaque && opaque(25, Some(value), None, None));
        let problems: Vec<_> = d
            .errors
            .iter()
            .map(|e| (e.entry.as_str(), e.problem))
            .collect();
        assert_eq!(
            problems,
            [
                ("mysql", EntryProblem::NotANumber),
                ("70000", EntryProblem::OutOfRange),
                ("0", EntryProblem::OutOfRange),
                ("9000-8000", EntryProblem::Reversed),
                ("-1", EntryProblem::NotANumber),
                ("1-2-3", EntryProblem::NotANumber),
                ("100000000000000000000", EntryProblem::OutOfRange),
            ]
        );
        assert_eq!(
            d.errors[0].to_string(),
            "annotation strait.dev/opaque-ports on the Pod: \"mysql\" is not a port or a range: \
             write `8080` or `8000-8100` (named ports are not supported); the other entries still apply"
        );
        // Errors name the object they came from; a namespace the Pod overrides is not read.
        let d = skip_detection(1, Some("x"), Some("y"), Some("z"));
        let on: Vec<_> = d.errors.iter().map(|e| e.on).collect();
        assert_eq!(on, [PortsSource::Pod, PortsSource::Service]);
    }

    #[test]
    fn long_bad_entries_are_cut_in_errors() {
        let long = "é".repeat(1000);
        let (_, errors) = OpaquePorts::parse(&long, PortsSource::Service);
        assert_eq!(errors[0].entry.chars().count(), MAX_ENTRY_IN_ERROR + 1);
    }
}
