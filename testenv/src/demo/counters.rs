//! What the counters say around one request: metrics of the proxies and
//! gateway before and after, and a packet capture of the WAN.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, ensure};

use super::evidence::PodInfo;
use super::{CALLER_SA, Demo, NAMESPACE, SERVICE};
use crate::installed::GATEWAY_NODE_PORT;
use crate::stack::metric_sum;

/// What a packet capture of the WAN shows about one request.
pub(super) struct WanEvidence {
    pub(super) udp: usize,
    pub(super) tcp: usize,
    pub(super) plaintext: Vec<&'static str>,
}

impl WanEvidence {
    /// Words of the request (path, header, the tunnel header's service
    /// name, SPIFFE IDs of certificates) that mTLS must hide.
    pub(super) const NEEDLES: [&'static str; 4] =
        ["/hello", "strait-client-id", "web.shop.svc", "spiffe://"];

    pub(super) fn read(bytes: Vec<u8>, pcap: &Path, gateway: Ipv4Addr) -> anyhow::Result<Self> {
        let count = |proto: &str| -> anyhow::Result<usize> {
            let out = Command::new("tcpdump")
                .args(["-n", "-r"])
                .arg(pcap)
                .arg(format!(
                    "{proto} and host {gateway} and port {GATEWAY_NODE_PORT}"
                ))
                .output()
                .context("read the WAN capture with tcpdump")?;
            ensure!(
                out.status.success(),
                "tcpdump -r {}: {}",
                pcap.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(String::from_utf8_lossy(&out.stdout).lines().count())
        };
        Ok(Self {
            udp: count("udp")?,
            tcp: count("tcp")?,
            plaintext: Self::NEEDLES
                .into_iter()
                .filter(|n| crate::wan::contains(&bytes, n.as_bytes()))
                .collect(),
        })
    }
}

/// The counters the demo reads before and after requests.
pub(super) struct Snapshot {
    pub(super) east_outbound: f64,
    pub(super) gateway_quic_streams: f64,
    pub(super) gateway_quic_connections: f64,
    /// The mirror controller's probes, which go through the tunnel too.
    pub(super) gateway_probes: f64,
    pub(super) west_inbound: Vec<(String, f64)>,
}

pub(super) struct Delta {
    pub(super) east_outbound: f64,
    pub(super) gateway_quic_streams: f64,
    pub(super) west_inbound: f64,
}

impl Snapshot {
    pub(super) async fn take(demo: &Demo, east_proxy: &PodInfo) -> anyhow::Result<Self> {
        let e = east_proxy.metrics().await?;
        let g = demo.gateway_pod().await?.metrics().await?;
        let mut west_inbound = Vec::new();
        for proxy in PodInfo::find(
            demo.west(),
            "strait-system",
            "app.kubernetes.io/name=strait-proxy",
        )
        .await?
        {
            let m = proxy.metrics().await?;
            west_inbound.push((
                proxy.name.clone(),
                metric_sum(
                    &m,
                    "request_total",
                    &[
                        "direction=\"inbound\"",
                        &format!("src_namespace=\"{NAMESPACE}\""),
                        &format!("src_workload=\"{CALLER_SA}\""),
                    ],
                ),
            ));
        }
        Ok(Self {
            east_outbound: metric_sum(
                &e,
                "request_total",
                &[
                    "direction=\"outbound\"",
                    &format!("src_namespace=\"{NAMESPACE}\""),
                    &format!("src_workload=\"{CALLER_SA}\""),
                ],
            ),
            gateway_quic_streams: metric_sum(
                &g,
                "gateway_streams_total",
                &[
                    "transport=\"quic\"",
                    &format!("src_namespace=\"{NAMESPACE}\""),
                    &format!("src_workload=\"{CALLER_SA}\""),
                    &format!("dst_service=\"{SERVICE}\""),
                ],
            ),
            gateway_quic_connections: metric_sum(
                &g,
                "gateway_connections_total",
                &["transport=\"quic\""],
            ),
            gateway_probes: metric_sum(&g, "gateway_probes_total", &[]),
            west_inbound,
        })
    }

    pub(super) fn minus(&self, before: &Snapshot, west_proxy: &PodInfo) -> Delta {
        let inbound = |s: &Snapshot| {
            s.west_inbound
                .iter()
                .find(|(n, _)| *n == west_proxy.name)
                .map(|(_, v)| *v)
                .unwrap_or(0.0)
        };
        Delta {
            east_outbound: self.east_outbound - before.east_outbound,
            gateway_quic_streams: self.gateway_quic_streams - before.gateway_quic_streams,
            west_inbound: inbound(self) - inbound(before),
        }
    }

    pub(super) fn west_inbound_by_proxy(&self, before: &Snapshot) -> Vec<(String, f64)> {
        self.west_inbound
            .iter()
            .zip(&before.west_inbound)
            .map(|((name, after), (_, b))| (name.clone(), after - b))
            .collect()
    }
}
