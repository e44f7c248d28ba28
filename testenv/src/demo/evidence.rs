//! The demo's evidence: what it reads from the clusters, the components'
//! metrics and the WAN to show (and check) what happened to a request.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::ListParams;
use strait_mesh::link::Link;

use super::counters::{Snapshot, WanEvidence};
use super::{CALLER_SA, Demo, MIRROR, NAMESPACE, NODES, SERVICE, say};
use crate::ClusterTopology;
use crate::installed::GATEWAY_NODE_PORT;
use crate::stack::metric_sum;

/// A running pod of Strait (or the app): what the evidence names.
#[derive(Clone, Debug)]
pub(super) struct PodInfo {
    pub name: String,
    pub ip: IpAddr,
    pub node: String,
}

impl PodInfo {
    /// The running pods matching `selector` in `namespace`.
    pub async fn find(
        cluster: &ClusterTopology,
        namespace: &str,
        selector: &str,
    ) -> anyhow::Result<Vec<Self>> {
        let pods = Api::<Pod>::namespaced(cluster.cluster().client(), namespace)
            .list(&ListParams::default().labels(selector))
            .await
            .with_context(|| format!("pods {selector} in {namespace}"))?;
        let mut out: Vec<Self> = pods
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| {
                let status = p.status?;
                (status.phase.as_deref() == Some("Running")).then_some(())?;
                Some(Self {
                    name: p.metadata.name?,
                    ip: status.pod_ip?.parse().ok()?,
                    node: p.spec?.node_name?,
                })
            })
            .collect();
        out.sort_by(|a, b| a.node.cmp(&b.node));
        Ok(out)
    }

    /// The component's metrics (admin port 4191, which the host reaches).
    pub async fn metrics(&self) -> anyhow::Result<String> {
        crate::http_get(SocketAddr::new(self.ip, 4191), "/metrics")
            .await
            .map_err(|e| anyhow::anyhow!("metrics of {}: {e}", self.name))
    }
}

impl Demo {
    /// Evidence that certificates came from the issuers, not from files.
    pub(super) async fn issuance_evidence(&self) -> anyhow::Result<()> {
        for c in [self.east(), self.west()] {
            let issuer =
                PodInfo::find(c, "strait-system", "app.kubernetes.io/name=strait-identity")
                    .await?
                    .into_iter()
                    .next()
                    .context("the issuer pod")?;
            let m = issuer.metrics().await?;
            let issued = metric_sum(&m, "identity_issuance_total", &["result=\"issued\""])
                + metric_sum(&m, "identity_issuance_total", &["result=\"success\""]);
            let all = metric_sum(&m, "identity_issuance_total", &[]);
            say(format!(
                "{:<5} issuer: identity_issuance_total = {all} ({issued} issued)",
                c.cluster().name()
            ));
            ensure!(
                all >= NODES as f64,
                "{}'s issuer issued {all} certificates, but {NODES} node proxies are ready: where did their certificates come from?\n{m}",
                c.cluster().name()
            );
        }
        Ok(())
    }

    /// Waits for the mirror Service and a ready endpoint at the gateway;
    /// returns lines describing them and the Link's status.
    pub(super) async fn wait_for_mirror(
        &self,
        gateway_ip: Ipv4Addr,
    ) -> anyhow::Result<Vec<String>> {
        let client = self.east().cluster().client();
        let services: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
        let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NAMESPACE);
        let links: Api<Link> = Api::namespaced(client, "strait-multicluster");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let svc = services.get_opt(MIRROR).await?;
            let slice = slices.get_opt(MIRROR).await?;
            if let (Some(svc), Some(slice)) = (&svc, &slice) {
                let ready: Vec<String> = slice
                    .endpoints
                    .iter()
                    .flatten()
                    .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
                    .flat_map(|e| e.addresses.clone())
                    .collect();
                if ready.contains(&gateway_ip.to_string()) {
                    return Ok(describe_mirror(svc, slice, links.get_opt("west").await?));
                }
            }
            if Instant::now() > deadline {
                let link = links.get_opt("west").await?;
                bail!(
                    "no ready mirror {NAMESPACE}/{MIRROR} in east after 60s (Service: {}, EndpointSlice: {:?}); Link west status: {:?}; see `kubectl --context east -n strait-multicluster logs deploy/strait-mirror`",
                    svc.is_some(),
                    slice.map(|s| s.endpoints),
                    link.and_then(|l| l.status),
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The strait-proxy Service's address in east (`internalTrafficPolicy:
    /// Local`: a pod's connection goes to its own node's proxy).
    pub(super) async fn node_proxy_service(&self) -> anyhow::Result<String> {
        Api::<Service>::namespaced(self.east().cluster().client(), "strait-system")
            .get("strait-proxy")
            .await?
            .spec
            .and_then(|s| s.cluster_ip)
            .context("the strait-proxy Service has no ClusterIP")
    }

    /// curl in the caller pod's network namespace (the pod's address, so its
    /// identity) through its node proxy, as the app's `http_proxy` says.
    async fn curl(&self, args: &[&str]) -> anyhow::Result<std::process::Output> {
        let pid = self.east().pod_process(NAMESPACE, CALLER_SA).await?;
        let proxy = format!("http://{}:4140", self.node_proxy_service().await?);
        Command::new("nsenter")
            .arg(format!("--net=/proc/{pid}/ns/net"))
            .args(["--", "curl", "-sS", "-x", &proxy])
            .args(args)
            .output()
            .context("run curl in the caller pod's network namespace (package curl)")
    }

    /// East's caller pod calling web-west `rate` times a second (for up to a
    /// minute) until the returned curl is killed: traffic for `strait stat`.
    pub(super) async fn calls_in_background(
        &self,
        rate: u32,
    ) -> anyhow::Result<std::process::Child> {
        let pid = self.east().pod_process(NAMESPACE, CALLER_SA).await?;
        let proxy = format!("http://{}:4140", self.node_proxy_service().await?);
        let mut curl = Command::new("nsenter");
        // nsenter execs curl: the child is curl itself.
        curl.arg(format!("--net=/proc/{pid}/ns/net")).args([
            "--",
            "curl",
            "-sS",
            "-x",
            &proxy,
            "--rate",
            &format!("{rate}/s"),
        ]);
        for i in 0..rate * 60 {
            curl.args([
                "-o",
                "/dev/null",
                &format!("http://{MIRROR}.{NAMESPACE}.svc.cluster.local/stat/{i}"),
            ]);
        }
        curl.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("run curl in the caller pod's network namespace (package curl)")
    }

    pub(super) async fn traced_request(&self, gateway_ip: Ipv4Addr) -> anyhow::Result<()> {
        let caller = PodInfo::find(self.east(), NAMESPACE, "")
            .await?
            .into_iter()
            .find(|p| p.name == CALLER_SA)
            .context("the caller pod")?;
        let east_proxy = self.node_proxy_on(&caller.node).await?;
        let before = Snapshot::take(self, &east_proxy).await?;
        let pcap = self.dir.join("wan.pcap");
        let capture = self
            .wan
            .as_ref()
            .context("the WAN")?
            .capture(&pcap)
            .context("capture the WAN (tcpdump)")?;
        let url = format!("http://{MIRROR}.{NAMESPACE}.svc.cluster.local/hello");
        say(format!(
            "$ curl -x http://strait-proxy.strait-system:4140 {url}     (in pod {NAMESPACE}/{CALLER_SA}'s network namespace)"
        ));
        let mut failures = Vec::new();
        let answer = loop {
            let out = self.curl(&["--max-time", "10", &url]).await?;
            let body = String::from_utf8_lossy(&out.stdout).to_string();
            match serde_json::from_str::<serde_json::Value>(&body) {
                Ok(v) if out.status.success() && v["pod"].is_string() => break v,
                _ => failures.push(format!(
                    "{body}{}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )),
            }
            if failures.len() >= 20 {
                bail!(
                    "east's pod could not reach {url} through its node proxy in {} attempts; the last said: {}",
                    failures.len(),
                    failures
                        .last()
                        .map(String::as_str)
                        .unwrap_or_default()
                        .trim()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        if !failures.is_empty() {
            say(format!(
                "({} attempt(s) failed first while east's proxy learned the mirror: {:?})",
                failures.len(),
                failures.last()
            ));
        }
        say(format!("  {answer}"));
        let pod_name = answer["pod"].as_str().unwrap_or_default().to_string();
        let backend = PodInfo::find(self.west(), NAMESPACE, &format!("app={SERVICE}"))
            .await?
            .into_iter()
            .find(|p| p.name == pod_name)
            .with_context(|| format!("the answer names pod {pod_name}, which west does not run"))?;
        let west_proxy = self.west_proxy_on(&backend.node).await?;
        let gateway = self.gateway_pod().await?;
        let after = Snapshot::take(self, &east_proxy).await?;
        let wan = WanEvidence::read(capture.stop()?, &pcap, gateway_ip)?;
        let d = after.minus(&before, &west_proxy);

        say("");
        say("path (each hop with its evidence):");
        say(format!(
            "  1. pod {NAMESPACE}/{CALLER_SA} ({}) on {}  →  east node proxy {} ({}:4140, via the strait-proxy Service)",
            caller.ip, caller.node, east_proxy.name, east_proxy.ip
        ));
        say(format!(
            "     evidence: {} request_total{{direction=outbound, src=shop/client}} +{}",
            east_proxy.name, d.east_outbound
        ));
        say(format!(
            "  2. east node proxy  →  QUIC (mTLS) across the WAN  →  west gateway NodePort {gateway_ip}:{GATEWAY_NODE_PORT}  →  pod {} on {}",
            gateway.name, gateway.node
        ));
        say(format!(
            "     evidence: {} gateway_streams_total{{transport=quic, src=shop/client, dst_service=web}} +{} (QUIC connections accepted so far: {}; tunnel probes answered: {})",
            gateway.name,
            d.gateway_quic_streams,
            after.gateway_quic_connections,
            after.gateway_probes
        ));
        say(format!(
            "     evidence: the WAN's capture holds {} UDP and {} TCP packets to/from {gateway_ip}:{GATEWAY_NODE_PORT}, and none of {:?} in clear text{}",
            wan.udp,
            wan.tcp,
            WanEvidence::NEEDLES,
            if wan.plaintext.is_empty() {
                String::new()
            } else {
                format!(" — FOUND {:?}", wan.plaintext)
            }
        ));
        say(format!(
            "  3. west gateway  →  west node proxy {} on {} ({}:4143, mTLS, carrying the caller's identity)",
            west_proxy.name, backend.node, west_proxy.ip
        ));
        say(format!(
            "     evidence: {} request_total{{direction=inbound, src=shop/client}} +{}",
            west_proxy.name, d.west_inbound
        ));
        say(format!(
            "  4. west node proxy  →  pod {NAMESPACE}/{pod_name} ({}:8080)",
            backend.ip
        ));
        say(format!(
            "     evidence: the answer names pod \"{pod_name}\""
        ));
        let client_id = answer["headers"]["strait-client-id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        say("");
        say(format!(
            "caller identity seen by the west pod (strait-client-id): {client_id}"
        ));
        // `strait identity issuer --cluster east` gives east its own trust domain.
        let expected = format!(
            "spiffe://{}/ns/{NAMESPACE}/sa/{CALLER_SA}",
            strait_mesh::names::cluster_trust_domain("east", strait_mesh::names::CLUSTERSET_DOMAIN)
        );
        let mut broken = Vec::new();
        if d.east_outbound < 1.0 {
            broken.push("east node proxy: no outbound request from shop/client counted");
        }
        if d.gateway_quic_streams < 1.0 {
            broken.push("west gateway: no QUIC stream for shop/client → web counted");
        }
        if d.west_inbound < 1.0 {
            broken.push("west node proxy: no inbound request from shop/client counted");
        }
        if wan.udp == 0 {
            broken.push("WAN: no UDP (QUIC) packet to the gateway was captured");
        }
        if !wan.plaintext.is_empty() {
            broken.push("WAN: the request's words crossed the WAN in clear text");
        }
        if client_id != expected {
            broken.push("west pod: strait-client-id is not the east caller's SPIFFE ID");
        }
        ensure!(
            broken.is_empty(),
            "the request was answered, but a hop shows no evidence: {}; expected caller {expected}",
            broken.join("; ")
        );
        say("hops verified: east proxy → QUIC → west gateway → west proxy → pod");
        for c in [self.east(), self.west()] {
            let issuer =
                PodInfo::find(c, "strait-system", "app.kubernetes.io/name=strait-identity")
                    .await?
                    .into_iter()
                    .next()
                    .context("the issuer pod")?;
            let m = issuer.metrics().await?;
            let name = c.cluster().name();
            say(format!(
                "{name:<5} issuer has signed {} certificates so far (node proxies, their pods' identities, {})",
                metric_sum(&m, "identity_issuance_total", &[]),
                if name == "west" {
                    "the gateway"
                } else {
                    "the mirror controller"
                }
            ));
        }
        Ok(())
    }

    /// The node proxy pod on east's node `node`.
    async fn node_proxy_on(&self, node: &str) -> anyhow::Result<PodInfo> {
        proxy_on(self.east(), node).await
    }

    /// The node proxy pod on west's node `node`.
    async fn west_proxy_on(&self, node: &str) -> anyhow::Result<PodInfo> {
        proxy_on(self.west(), node).await
    }

    pub(super) async fn latency(&self, n: usize) -> anyhow::Result<()> {
        let caller = PodInfo::find(self.east(), NAMESPACE, "")
            .await?
            .into_iter()
            .find(|p| p.name == CALLER_SA)
            .context("the caller pod")?;
        let east_proxy = self.node_proxy_on(&caller.node).await?;
        let before = Snapshot::take(self, &east_proxy).await?;
        // One curl, one keep-alive connection to the node proxy, n requests in a row.
        let mut args: Vec<String> = vec![
            "--max-time".into(),
            "120".into(),
            "-w".into(),
            "%{http_code} %{time_total}\\n".into(),
        ];
        for i in 0..n {
            args.push("-o".into());
            args.push("/dev/null".into());
            args.push(format!(
                "http://{MIRROR}.{NAMESPACE}.svc.cluster.local/latency/{i}"
            ));
        }
        let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let started = Instant::now();
        let out = self.curl(&arg_refs).await?;
        let wall = started.elapsed();
        let mut times = Vec::new();
        let mut failed = 0;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut parts = line.split_whitespace();
            let (Some(code), Some(t)) = (parts.next(), parts.next()) else {
                continue;
            };
            if code == "200" {
                times.push(t.parse::<f64>().unwrap_or(f64::NAN) * 1000.0);
            } else {
                failed += 1;
            }
        }
        let after = Snapshot::take(self, &east_proxy).await?;
        ensure!(
            !times.is_empty(),
            "no request succeeded: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        times.sort_by(f64::total_cmp);
        let pct =
            |p: f64| times[((times.len() as f64 * p).ceil() as usize).clamp(1, times.len()) - 1];
        say(format!(
            "{} ok, {failed} failed in {:.2}s; latency p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms (curl's time_total per request, one keep-alive connection to the node proxy, sequential)",
            times.len(),
            wall.as_secs_f64(),
            pct(0.50),
            pct(0.90),
            pct(0.99),
            times[times.len() - 1]
        ));
        let streams = after.gateway_quic_streams - before.gateway_quic_streams;
        say(format!(
            "gateway: +{streams} new QUIC streams for shop/client → web (east's proxy keeps its pooled HTTP/1 connection, one stream, open between requests; the gateway chose a pod per stream)"
        ));
        for (name, count) in after.west_inbound_by_proxy(&before) {
            say(format!(
                "west  {name}: +{count} inbound requests from shop/client"
            ));
        }
        ensure!(
            failed == 0,
            "{failed} of {n} requests failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}

fn describe_mirror(svc: &Service, slice: &EndpointSlice, link: Option<Link>) -> Vec<String> {
    let spec = svc.spec.clone().unwrap_or_default();
    let labels = svc.metadata.labels.clone().unwrap_or_default();
    let annotations = svc.metadata.annotations.clone().unwrap_or_default();
    let ports: Vec<String> = spec
        .ports
        .unwrap_or_default()
        .iter()
        .map(|p| format!("{}/{}", p.port, p.protocol.as_deref().unwrap_or("TCP")))
        .collect();
    let mut lines = vec![
        format!(
            "Service  east {NAMESPACE}/{MIRROR}  ClusterIP {}  ports {}",
            spec.cluster_ip.unwrap_or_default(),
            ports.join(",")
        ),
        format!(
            "         labels strait.dev/mirrored-service={} strait.dev/cluster-name={}",
            labels
                .get("strait.dev/mirrored-service")
                .map(String::as_str)
                .unwrap_or("?"),
            labels
                .get("strait.dev/cluster-name")
                .map(String::as_str)
                .unwrap_or("?")
        ),
        format!(
            "         strait.dev/remote-svc-fq-name={}",
            annotations
                .get("strait.dev/remote-svc-fq-name")
                .map(String::as_str)
                .unwrap_or("?")
        ),
    ];
    let slice_ports: Vec<String> = slice
        .ports
        .iter()
        .flatten()
        .filter_map(|p| p.port.map(|n| n.to_string()))
        .collect();
    for e in slice.endpoints.iter().flatten() {
        lines.push(format!(
            "EndpointSlice {MIRROR}: {}:{} ready={} (the west gateway; identity {})",
            e.addresses.join(","),
            slice_ports.join(","),
            e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false),
            slice
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("strait.dev/gateway-identity"))
                .map(String::as_str)
                .unwrap_or("?")
        ));
    }
    if let Some(status) = link.and_then(|l| l.status) {
        // By type: the controller appends conditions in whatever order they
        // were first set, which varies from run to run.
        let mut conditions: Vec<String> = status
            .conditions
            .iter()
            .map(|c| format!("{}={}", c.type_, c.status))
            .collect();
        conditions.sort();
        lines.push(format!("Link west: {}", conditions.join(" ")));
    }
    lines
}

/// The node proxy pod on `node`.
async fn proxy_on(cluster: &ClusterTopology, node: &str) -> anyhow::Result<PodInfo> {
    PodInfo::find(
        cluster,
        "strait-system",
        "app.kubernetes.io/name=strait-proxy",
    )
    .await?
    .into_iter()
    .find(|p| p.node == node)
    .with_context(|| format!("no node proxy pod on {node}"))
}
