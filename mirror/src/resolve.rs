//! Gateway addresses: IPs are used as given; hostnames (a cloud load balancer's
//! name, say) are resolved with hickory and resolved again when their records
//! expire, so mirror endpoints follow the gateway when DNS moves it.
//!
//! A failed lookup keeps the addresses known from before: a DNS hiccup must not
//! empty every mirror's endpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::NetError;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use tokio::sync::watch;

/// Where hostnames are looked up.
#[derive(Clone, Debug, Default)]
pub enum DnsConfig {
    /// The system's resolver configuration (`/etc/resolv.conf`).
    #[default]
    System,
    /// These name servers only (UDP).
    Servers(Vec<SocketAddr>),
}

/// Shortest and longest time between lookups of one name, whatever its TTL.
const MIN_REFRESH: Duration = Duration::from_secs(1);
const MAX_REFRESH: Duration = Duration::from_secs(30);

/// The gateway's addresses as last resolved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GatewayAddresses {
    /// Every address, sorted, without duplicates.
    pub ips: Vec<IpAddr>,
    /// The names that failed to resolve last time, with why.
    pub errors: Vec<String>,
}

/// Why no resolver could be made.
#[derive(Debug, thiserror::Error)]
pub enum ResolverError {
    #[error("reading the system DNS configuration (/etc/resolv.conf): {0}")]
    SystemConfig(#[source] NetError),
    #[error("building the DNS resolver: {0}")]
    Build(#[source] NetError),
}

pub fn resolver(config: &DnsConfig) -> Result<TokioResolver, ResolverError> {
    let mut builder = match config {
        DnsConfig::System => TokioResolver::builder_tokio().map_err(ResolverError::SystemConfig)?,
        DnsConfig::Servers(servers) => {
            let servers = servers
                .iter()
                .map(|s| {
                    let mut udp = ConnectionConfig::udp();
                    udp.port = s.port();
                    NameServerConfig::new(s.ip(), true, vec![udp])
                })
                .collect();
            TokioResolver::builder_with_config(
                ResolverConfig::from_name_servers(servers),
                TokioRuntimeProvider::default(),
            )
        }
    };
    // Cap cached answers so a long TTL does not hide a moved gateway for hours.
    builder.options_mut().positive_max_ttl = Some(MAX_REFRESH);
    builder.options_mut().negative_max_ttl = Some(MAX_REFRESH);
    builder.build().map_err(ResolverError::Build)
}

/// Why Kubernetes would refuse `ip` as an endpoint address, if it would.
fn unusable(ip: IpAddr) -> Option<&'static str> {
    if ip.is_loopback() {
        Some("is a loopback address")
    } else if ip.is_unspecified() {
        Some("is unspecified")
    } else if ip.is_multicast() {
        Some("is multicast")
    } else {
        None
    }
}

/// Splits a Link's gateway addresses into usable IPs, hostnames, and errors.
fn split(addresses: &[String]) -> (BTreeSet<IpAddr>, Vec<String>, Vec<String>) {
    let mut ips = BTreeSet::new();
    let mut names = Vec::new();
    let mut errors = Vec::new();
    for a in addresses {
        match a.trim().parse::<IpAddr>() {
            Ok(ip) => match unusable(ip) {
                Some(why) => errors.push(format!(
                    "gateway address {ip} {why}: endpoints cannot point at it; use an address other clusters can reach"
                )),
                None => {
                    ips.insert(ip);
                }
            },
            Err(_) if !a.trim().is_empty() => names.push(a.trim().to_string()),
            Err(_) => {}
        }
    }
    (ips, names, errors)
}

/// Keeps `tx` equal to the resolved `addresses` until every receiver is gone.
/// Publishes only changes; `None` until the first lookups are done.
pub async fn keep_resolved(
    resolver: Option<TokioResolver>,
    addresses: Vec<String>,
    tx: watch::Sender<Option<GatewayAddresses>>,
) {
    let (static_ips, names, static_errors) = split(&addresses);
    let mut known: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    let mut backoff = MIN_REFRESH;
    loop {
        let mut errors = static_errors.clone();
        let mut next = MAX_REFRESH;
        for name in &names {
            let Some(resolver) = &resolver else {
                errors.push(format!("{name}: no DNS resolver available"));
                continue;
            };
            match resolver.lookup_ip(name.as_str()).await {
                Ok(lookup) => {
                    let ttl = lookup
                        .valid_until()
                        .saturating_duration_since(std::time::Instant::now());
                    next = next.min(ttl);
                    let ips: Vec<IpAddr> =
                        lookup.iter().filter(|ip| unusable(*ip).is_none()).collect();
                    if known.get(name) != Some(&ips) {
                        tracing::info!(gateway = %name, ?ips, "gateway hostname resolved");
                    }
                    known.insert(name.clone(), ips);
                }
                Err(e) => {
                    tracing::warn!(gateway = %name, "resolving the gateway failed: {e}; keeping the addresses known before");
                    errors.push(format!("{name}: {e}"));
                }
            }
        }
        if errors.len() == static_errors.len() {
            backoff = MIN_REFRESH;
        } else {
            next = next.min(backoff);
            backoff = (backoff * 2).min(MAX_REFRESH);
        }
        let mut ips = static_ips.clone();
        ips.extend(known.values().flatten().copied());
        let current = GatewayAddresses {
            ips: ips.into_iter().collect(),
            errors,
        };
        tx.send_if_modified(|old| {
            let changed = old.as_ref() != Some(&current);
            *old = Some(current);
            changed
        });
        if names.is_empty() {
            // Nothing to look up again; stay until the receivers are gone.
            tx.closed().await;
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(next.clamp(MIN_REFRESH, MAX_REFRESH)) => {}
            _ = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_ips_from_names() {
        let (ips, names, errors) = split(&[
            "10.0.0.2".into(),
            " gw.example.com ".into(),
            "fd00::1".into(),
            "10.0.0.2".into(),
            "".into(),
            "127.0.0.1".into(),
        ]);
        assert_eq!(errors.len(), 1);
        assert!(errors[0].contains("127.0.0.1") && errors[0].contains("loopback"));
        assert_eq!(
            ips.into_iter().collect::<Vec<_>>(),
            vec![
                "10.0.0.2".parse::<IpAddr>().unwrap(),
                "fd00::1".parse().unwrap()
            ]
        );
        assert_eq!(names, vec!["gw.example.com".to_string()]);
    }
}
