//! An emulation of kube-proxy for tests: testenv runs no kube-proxy, so a test
//! whose pod calls a Service by its ClusterIP installs what kube-proxy's
//! iptables mode would, for that one Service, in that one pod's namespace.
//!
//! [`ServiceRules::fetch`] reads the Service and its EndpointSlices and picks,
//! per Service port, the ready endpoints, honouring `internalTrafficPolicy:
//! Local` (only endpoints whose `nodeName` is the calling pod's node).
//! [`ServiceRules::install`] writes them as kube-proxy does: `nat` DNAT from
//! ClusterIP:port to one endpoint at random per connection (`-m statistic`),
//! and in `filter` REJECT when the Service has no endpoint ("has no
//! endpoints"), DROP when it has some but none on this node ("has no local
//! endpoints"). The rules hang off `OUTPUT` because the client is in the
//! namespace; the DNAT keeps the pod's source address, as in a real cluster.
//!
//! Not kube-proxy: one sync per call (call again after endpoints change), one
//! namespace (no PREROUTING for the node, NodePorts, masquerade/hairpin,
//! session affinity or terminating-endpoint fallback), IPv4 only. Needs root and
//! `iptables` (Debian package `iptables`; the nft and legacy backends both work).

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::Command;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;
use kube::{Api, Client};
use sha2::{Digest, Sha256};

use crate::net::{NetError, NetPod, run};

#[derive(Debug, thiserror::Error)]
pub enum KubeProxyError {
    #[error("reading Service {service} or its EndpointSlices: {source}")]
    Api {
        service: String,
        source: kube::Error,
    },
    #[error("Service {service} does not exist")]
    NotFound { service: String },
    #[error(
        "Service {service} has no IPv4 ClusterIP ({cluster_ip:?}): headless and IPv6-only Services get no kube-proxy rules"
    )]
    NoClusterIp {
        service: String,
        cluster_ip: Option<String>,
    },
    #[error(transparent)]
    Net(#[from] NetError),
}

/// What one Service port leads to from the calling pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortTarget {
    /// DNAT to one of these at random.
    Endpoints(Vec<SocketAddrV4>),
    /// The Service has no ready endpoint for this port: REJECT.
    NoEndpoints,
    /// `internalTrafficPolicy: Local` and none on the caller's node: DROP.
    NoLocalEndpoints,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortRule {
    /// The Service port's name ("" if unnamed).
    pub name: String,
    /// `tcp`, `udp` or `sctp`, as iptables spells it.
    pub protocol: String,
    pub port: u16,
    pub target: PortTarget,
}

/// kube-proxy's view of one Service from one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceRules {
    pub namespace: String,
    pub name: String,
    pub cluster_ip: Ipv4Addr,
    pub ports: Vec<PortRule>,
}

impl ServiceRules {
    /// Reads Service `namespace/name` and its EndpointSlices as seen by a pod on `node`.
    pub async fn fetch(
        client: &Client,
        namespace: &str,
        name: &str,
        node: &str,
    ) -> Result<Self, KubeProxyError> {
        let service_id = format!("{namespace}/{name}");
        let api_error = |source| KubeProxyError::Api {
            service: service_id.clone(),
            source,
        };
        let service = Api::<Service>::namespaced(client.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(api_error)?
            .ok_or_else(|| KubeProxyError::NotFound {
                service: service_id.clone(),
            })?;
        let slices = Api::<EndpointSlice>::namespaced(client.clone(), namespace)
            .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={name}")))
            .await
            .map_err(api_error)?
            .items;
        Self::from_objects(&service, &slices, node)
    }

    /// The rules for `service` with these `slices`, from a pod on `node`.
    pub fn from_objects(
        service: &Service,
        slices: &[EndpointSlice],
        node: &str,
    ) -> Result<Self, KubeProxyError> {
        let namespace = service.metadata.namespace.clone().unwrap_or_default();
        let name = service.metadata.name.clone().unwrap_or_default();
        let spec = service.spec.clone().unwrap_or_default();
        let cluster_ip = spec
            .cluster_ip
            .as_deref()
            .and_then(|ip| ip.parse::<Ipv4Addr>().ok())
            .ok_or_else(|| KubeProxyError::NoClusterIp {
                service: format!("{namespace}/{name}"),
                cluster_ip: spec.cluster_ip.clone(),
            })?;
        let local_only = spec.internal_traffic_policy.as_deref() == Some("Local");
        let ports = spec
            .ports
            .unwrap_or_default()
            .into_iter()
            .map(|sp| {
                let port_name = sp.name.unwrap_or_default();
                let protocol = sp.protocol.unwrap_or_else(|| "TCP".into());
                let mut ready = Vec::new();
                let mut local = Vec::new();
                for slice in slices.iter().filter(|s| s.address_type == "IPv4") {
                    // kube-proxy matches a Service port to a slice port by name.
                    let Some(target_port) = slice.ports.iter().flatten().find_map(|p| {
                        let same_name = p.name.as_deref().unwrap_or("") == port_name;
                        let same_protocol = p.protocol.as_deref().unwrap_or("TCP") == protocol;
                        (same_name && same_protocol)
                            .then_some(p.port)
                            .flatten()
                            .and_then(|p| u16::try_from(p).ok())
                    }) else {
                        continue;
                    };
                    for endpoint in slice.endpoints.iter().flatten() {
                        let is_ready = endpoint
                            .conditions
                            .as_ref()
                            .and_then(|c| c.ready)
                            .unwrap_or(true);
                        let Some(ip) = endpoint
                            .addresses
                            .first()
                            .and_then(|a| a.parse::<Ipv4Addr>().ok())
                        else {
                            continue;
                        };
                        if !is_ready {
                            continue;
                        }
                        let addr = SocketAddrV4::new(ip, target_port);
                        if !ready.contains(&addr) {
                            ready.push(addr);
                            if endpoint.node_name.as_deref() == Some(node) {
                                local.push(addr);
                            }
                        }
                    }
                }
                let target = match (ready.is_empty(), local_only, local.is_empty()) {
                    (true, _, _) => PortTarget::NoEndpoints,
                    (false, true, true) => PortTarget::NoLocalEndpoints,
                    (false, true, false) => PortTarget::Endpoints(local),
                    (false, false, _) => PortTarget::Endpoints(ready),
                };
                PortRule {
                    name: port_name,
                    protocol: protocol.to_ascii_lowercase(),
                    port: u16::try_from(sp.port).unwrap_or(0),
                    target,
                }
            })
            .collect();
        Ok(Self {
            namespace,
            name,
            cluster_ip,
            ports,
        })
    }

    /// The Service's own chain, in `nat` and `filter`: `KUBE-SVC-` and a hash of
    /// its name, as kube-proxy names them (≤ 28 characters).
    pub fn chain(&self) -> String {
        let digest = Sha256::digest(format!("{}/{}", self.namespace, self.name));
        format!("KUBE-SVC-{}", hex::encode_upper(&digest[..8]))
    }

    /// The `iptables-restore --noflush` input: both chains, declared (so
    /// created or emptied) and filled, so installing again replaces the rules.
    pub fn ruleset(&self) -> String {
        let chain = self.chain();
        let mut nat = format!("*nat\n:{chain} - [0:0]\n");
        let mut filter = format!("*filter\n:{chain} - [0:0]\n");
        for p in &self.ports {
            let matches = format!(
                "-d {}/32 -p {proto} -m {proto} --dport {} -m comment --comment \"{}/{}:{}",
                self.cluster_ip,
                p.port,
                self.namespace,
                self.name,
                p.name,
                proto = p.protocol,
            );
            match &p.target {
                PortTarget::Endpoints(endpoints) => {
                    let n = endpoints.len();
                    for (i, endpoint) in endpoints.iter().enumerate() {
                        // Endpoint i of n takes 1/(n-i) of what the ones before left.
                        let statistic = if i + 1 < n {
                            format!(
                                " -m statistic --mode random --probability {:.10}",
                                1.0 / (n - i) as f64
                            )
                        } else {
                            String::new()
                        };
                        let _ = writeln!(
                            nat,
                            "-A {chain} {matches}\"{statistic} -j DNAT --to-destination {endpoint}"
                        );
                    }
                }
                PortTarget::NoEndpoints => {
                    let _ = writeln!(filter, "-A {chain} {matches} has no endpoints\" -j REJECT");
                }
                PortTarget::NoLocalEndpoints => {
                    let _ = writeln!(
                        filter,
                        "-A {chain} {matches} has no local endpoints\" -j DROP"
                    );
                }
            }
        }
        nat.push_str("COMMIT\n");
        filter.push_str("COMMIT\n");
        nat + &filter
    }

    /// Installs (or replaces) the rules in `pod`'s network namespace.
    pub fn install(&self, pod: &NetPod) -> Result<(), KubeProxyError> {
        // On the host first: inside, a missing binary is only nsenter's exit code.
        let mut version = Command::new("iptables");
        version.arg("--version");
        run(version, None)?;
        let mut restore = pod.command("iptables-restore");
        restore.args(["-w", "--noflush"]);
        run(restore, Some(&self.ruleset()))?;
        let chain = self.chain();
        for table in ["nat", "filter"] {
            let mut check = pod.command("iptables");
            check.args(["-w", "-t", table, "-C", "OUTPUT", "-j", &chain]);
            if run(check, None).is_err() {
                // First in OUTPUT, as kube-proxy puts its KUBE-SERVICES jump.
                let mut insert = pod.command("iptables");
                insert.args(["-w", "-t", table, "-I", "OUTPUT", "1", "-j", &chain]);
                run(insert, None)?;
            }
        }
        tracing::debug!(service = %format!("{}/{}", self.namespace, self.name), pod = pod.name(), ports = ?self.ports, "kube-proxy rules installed");
        Ok(())
    }
}

/// Reads Service `namespace/name` as a pod on `pod`'s node sees it and installs
/// its rules in the pod's namespace; returns what it installed.
pub async fn sync_service(
    client: &Client,
    namespace: &str,
    name: &str,
    pod: &NetPod,
) -> Result<ServiceRules, KubeProxyError> {
    let rules = ServiceRules::fetch(client, namespace, name, pod.node().name()).await?;
    rules.install(pod)?;
    Ok(rules)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn service(policy: &str) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": "strait-proxy", "namespace": "strait-system"},
            "spec": {"clusterIP": "10.96.0.20", "internalTrafficPolicy": policy,
                     "ports": [{"name": "http-proxy", "port": 4140, "protocol": "TCP"}]},
        }))
        .unwrap()
    }

    fn slice(endpoints: &[(&str, &str, bool)]) -> EndpointSlice {
        let endpoints: Vec<_> = endpoints
            .iter()
            .map(|(ip, node, ready)| {
                json!({"addresses": [ip], "nodeName": node, "conditions": {"ready": ready}})
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": "strait-proxy-abc", "namespace": "strait-system"},
            "addressType": "IPv4",
            "ports": [{"name": "http-proxy", "port": 4140, "protocol": "TCP"}],
            "endpoints": endpoints,
        }))
        .unwrap()
    }

    fn target(policy: &str, endpoints: &[(&str, &str, bool)], node: &str) -> PortTarget {
        let rules =
            ServiceRules::from_objects(&service(policy), &[slice(endpoints)], node).unwrap();
        rules.ports[0].target.clone()
    }

    const THREE: [(&str, &str, bool); 3] = [
        ("10.1.0.11", "n1", true),
        ("10.1.0.12", "n2", true),
        ("10.1.0.13", "n3", false),
    ];

    #[test]
    fn local_policy_keeps_only_this_nodes_ready_endpoints() {
        let ep = |ip: &str| SocketAddrV4::new(ip.parse().unwrap(), 4140);
        assert_eq!(
            target("Local", &THREE, "n2"),
            PortTarget::Endpoints(vec![ep("10.1.0.12")])
        );
        // n3's endpoint is not ready: dropped, not sent elsewhere.
        assert_eq!(target("Local", &THREE, "n3"), PortTarget::NoLocalEndpoints);
        assert_eq!(
            target("Cluster", &THREE, "n3"),
            PortTarget::Endpoints(vec![ep("10.1.0.11"), ep("10.1.0.12")])
        );
        assert_eq!(target("Cluster", &[], "n1"), PortTarget::NoEndpoints);
    }

    #[test]
    fn ruleset_dnats_with_even_odds_and_drops_without_local_endpoints() {
        let rules =
            ServiceRules::from_objects(&service("Cluster"), &[slice(&THREE)], "n1").unwrap();
        let text = rules.ruleset();
        let chain = rules.chain();
        assert!(chain.len() <= 28, "{chain}");
        assert!(text.contains(&format!(":{chain} - [0:0]")), "{text}");
        assert!(
            text.contains("--probability 0.5000000000 -j DNAT --to-destination 10.1.0.11:4140"),
            "{text}"
        );
        assert!(
            text.contains("\" -j DNAT --to-destination 10.1.0.12:4140"),
            "{text}"
        );

        let local = ServiceRules::from_objects(&service("Local"), &[slice(&THREE)], "n3").unwrap();
        let text = local.ruleset();
        assert!(!text.contains("DNAT"), "{text}");
        assert!(
            text.contains(
                "-d 10.96.0.20/32 -p tcp -m tcp --dport 4140 -m comment --comment \
                 \"strait-system/strait-proxy:http-proxy has no local endpoints\" -j DROP"
            ),
            "{text}"
        );
    }
}
