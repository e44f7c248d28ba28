//! Pure parsing: service host names and the opaque-ports annotation.

use crate::names::TIMEOUT_ANNOTATION;

/// A Service named by a host: `svc.ns`, `svc.ns.svc` or `svc.ns.svc.<cluster domain>`
/// (any case, an optional trailing dot). Returns `(namespace, name)`.
///
/// Short names (`svc` alone) need the caller's namespace and are not
/// accepted here; other domains are not ours and return `None`. `svc.ns` looks
/// like any two-label name (`example.com`): it only resolves if that Service exists.
pub fn parse_service_host(host: &str, cluster_domain: &str) -> Option<(String, String)> {
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty() || host.len() > 253 {
        return None;
    }
    let lower = host.to_ascii_lowercase();
    let domain = cluster_domain.trim_end_matches('.').to_ascii_lowercase();
    let rest: &str = if let Some(prefix) = lower
        .strip_suffix(domain.as_str())
        .and_then(|p| p.strip_suffix(".svc."))
    {
        prefix
    } else if let Some(prefix) = lower.strip_suffix(".svc") {
        prefix
    } else {
        &lower
    };
    let mut labels = rest.split('.');
    let (name, namespace) = (labels.next()?, labels.next()?);
    if labels.next().is_some() || !is_dns_label(name) || !is_dns_label(namespace) {
        return None;
    }
    Some((namespace.to_string(), name.to_string()))
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A [`TIMEOUT_ANNOTATION`] value that is no usable timeout.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TimeoutError {
    #[error("{TIMEOUT_ANNOTATION}: {0:?} is zero; give a duration like \"2s\" or remove it")]
    Zero(String),
    #[error(
        "{TIMEOUT_ANNOTATION}: {value:?} is not a duration ({why}); write it like \"2s\" or \"500ms\""
    )]
    NotADuration { value: String, why: String },
}

/// Parses a [`TIMEOUT_ANNOTATION`] value; the error says what is wrong.
pub fn parse_timeout(value: &str) -> Result<std::time::Duration, TimeoutError> {
    match humantime::parse_duration(value.trim()) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err(TimeoutError::Zero(value.into())),
        Err(e) => Err(TimeoutError::NotADuration {
            value: value.into(),
            why: e.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::{OpaquePorts, PortsSource};

    #[test]
    fn timeouts_parse_and_bad_ones_say_why() {
        assert_eq!(parse_timeout("2s"), Ok(std::time::Duration::from_secs(2)));
        assert_eq!(
            parse_timeout(" 250ms "),
            Ok(std::time::Duration::from_millis(250))
        );
        assert!(
            parse_timeout("0s")
                .unwrap_err()
                .to_string()
                .contains("zero")
        );
        assert!(
            parse_timeout("soon")
                .unwrap_err()
                .to_string()
                .contains("not a duration")
        );
    }

    fn parsed(host: &str) -> Option<(String, String)> {
        parse_service_host(host, "cluster.local")
    }

    fn key(ns: &str, name: &str) -> Option<(String, String)> {
        Some((ns.to_string(), name.to_string()))
    }

    #[test]
    fn every_service_name_form_parses() {
        assert_eq!(parsed("web.shop"), key("shop", "web"));
        assert_eq!(parsed("web.shop.svc"), key("shop", "web"));
        assert_eq!(parsed("web.shop.svc.cluster.local"), key("shop", "web"));
        assert_eq!(parsed("web.shop.svc.cluster.local."), key("shop", "web"));
        assert_eq!(parsed("Web.Shop.SVC.Cluster.Local"), key("shop", "web"));
    }

    #[test]
    fn other_names_do_not() {
        for host in [
            "",
            "web",
            "web.shop.svc.example.org",
            "pod.web.shop.svc.cluster.local",
            "web.shop.cluster.local",
            "-web.shop",
            "web..svc",
            "we_b.shop",
        ] {
            assert_eq!(parsed(host), None, "{host}");
        }
    }

    #[test]
    fn the_cluster_domain_is_configurable() {
        assert_eq!(
            parse_service_host("web.shop.svc.east.example", "east.example."),
            key("shop", "web")
        );
        assert_eq!(
            parse_service_host("web.shop.svc.cluster.local", "east.example"),
            None
        );
    }

    #[test]
    fn opaque_ports_take_lists_and_ranges_and_skip_junk() {
        // One parser for the annotation everywhere: detection's.
        let set = OpaquePorts::parse("25, 443,4000-4100,x,9-1,0,70000", PortsSource::Pod).0;
        for p in [25, 443, 4000, 4050, 4100] {
            assert!(set.contains(p), "{p}");
        }
        for p in [24, 80, 3999, 4101, 9, 1] {
            assert!(!set.contains(p), "{p}");
        }
        assert!(OpaquePorts::parse("", PortsSource::Pod).0.is_empty());
    }
}
