//! `strait-testenv demo` (what `bash scripts/demo.sh` runs): two clusters,
//! east and west, with Strait's whole stack as processes on network-namespace
//! nodes ([`crate::stack`]), linked with the real `strait link` and kubectl,
//! and one service called from east to west through the QUIC gateway. It
//! prints what happened with the evidence for each hop, and fails (non-zero
//! exit) when a hop shows no evidence, so CI can run it
//! (`testenv/tests/demo.rs`).

use std::io::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use serde_json::json;
use strait_mesh::link::Link;

use crate::stack::{Binaries, MeshCluster, metric_sum};
use crate::{ClusterConfig, ClusterTopology, Wan, kubeconfig, net};

const NAMESPACE: &str = "shop";
const SERVICE: &str = "web";
const MIRROR: &str = "web-west";
const CALLER_SA: &str = "client";
const NODES: usize = 2;
const BINARIES: &[&str] = &[
    "strait",
    "strait-identity",
    "strait-proxy",
    "strait-gateway",
    "strait-mirror",
    "strait-backend",
];

/// What `strait-testenv demo` was asked for.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// Stay up after the demo until Ctrl-C.
    pub stay: bool,
    /// Requests for the latency measurement.
    pub requests: usize,
    /// Where the kubeconfig, certificates and logs go (kept with `stay`).
    pub work_dir: Option<PathBuf>,
}

/// Prints numbered steps with the time since the start.
struct Narrator {
    start: Instant,
    step: usize,
}

impl Narrator {
    fn step(&mut self, title: &str) {
        self.step += 1;
        println!(
            "\n\x1b[1m== {}. {title}\x1b[0m  ({:.1}s)",
            self.step,
            self.start.elapsed().as_secs_f64()
        );
        let _ = std::io::stdout().flush();
    }
}

fn say(line: impl AsRef<str>) {
    println!("   {}", line.as_ref());
    let _ = std::io::stdout().flush();
}

/// Runs the demo. With `stay`, waits for Ctrl-C before tearing down.
pub async fn run(options: DemoOptions) -> anyhow::Result<()> {
    if !net::is_root() {
        bail!(
            "{} (the demo's nodes and pods are network namespaces)",
            net::NetError::NotRoot
        );
    }
    ensure!(options.requests > 0, "--requests must be at least 1");
    let binaries = Binaries::next_to_this_executable(BINARIES)?;
    let work = match &options.work_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            Workdir::Given(dir.clone())
        }
        None => Workdir::Temp(
            tempfile::Builder::new()
                .prefix("strait-demo-")
                .tempdir()
                .context("create the demo's folder")?,
        ),
    };
    let mut demo = Demo::new(binaries, work.path())?;
    // Ctrl-C while it runs: stop, and still tear down in order.
    let result = tokio::select! {
        result = demo.play(&options) => result,
        stop = wait_for_stop_signal() => {
            stop?;
            Err(anyhow::anyhow!("interrupted"))
        }
    };
    let stay = options.stay && result.is_ok();
    if stay {
        demo.stay().await?;
    }
    let outcome = demo.tear_down();
    if let Err(e) = &result {
        // Keep the components' logs for whoever looks into the failure.
        let kept = match work {
            Workdir::Temp(t) => t.keep(),
            Workdir::Given(p) => p,
        };
        eprintln!(
            "\n[demo] failed; the components' logs are kept in {}",
            kept.display()
        );
        return Err(anyhow::anyhow!("{e:#}"));
    }
    outcome
}

enum Workdir {
    Given(PathBuf),
    Temp(tempfile::TempDir),
}

impl Workdir {
    fn path(&self) -> &Path {
        match self {
            Workdir::Given(p) => p,
            Workdir::Temp(t) => t.path(),
        }
    }
}

/// The demo's state. Fields drop in order: the WAN, then the clusters.
struct Demo {
    wan: Option<Wan>,
    east: Option<MeshCluster>,
    west: Option<MeshCluster>,
    binaries: Binaries,
    dir: PathBuf,
    kubeconfig: PathBuf,
    narrator: Narrator,
    /// What to check once everything is gone.
    leftovers: Leftovers,
}

#[derive(Default)]
struct Leftovers {
    pids: Vec<u32>,
    interfaces: Vec<String>,
}

impl Demo {
    fn new(binaries: Binaries, dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            wan: None,
            east: None,
            west: None,
            binaries,
            dir: dir.to_path_buf(),
            kubeconfig: dir.join("kubeconfig"),
            narrator: Narrator {
                start: Instant::now(),
                step: 0,
            },
            leftovers: Leftovers::default(),
        })
    }

    fn east(&self) -> &MeshCluster {
        self.east.as_ref().expect("east is up")
    }

    fn west(&self) -> &MeshCluster {
        self.west.as_ref().expect("west is up")
    }

    /// A command with the demo's kubeconfig, so printed commands are the real ones.
    fn command(&self, program: &str) -> Command {
        let path = if program == "kubectl" {
            PathBuf::from("kubectl")
        } else {
            self.binaries.path(program)
        };
        let mut cmd = Command::new(path);
        cmd.env("KUBECONFIG", &self.kubeconfig)
            .current_dir(crate::stack::repository_root());
        cmd
    }

    /// Runs `program args` showing the command line and its output; fails on
    /// a non-zero exit.
    fn shown(&self, program: &str, args: &[&str]) -> anyhow::Result<String> {
        say(format!("$ {program} {}", args.join(" ")));
        let out = self
            .command(program)
            .args(args)
            .output()
            .with_context(|| format!("run {program}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        for line in stdout.lines() {
            say(format!("  {line}"));
        }
        ensure!(
            out.status.success(),
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(stdout)
    }

    /// `left | right`, both real processes, the pipeline shown.
    fn piped(&self, left: (&str, &[&str]), right: (&str, &[&str])) -> anyhow::Result<()> {
        say(format!(
            "$ {} {} | {} {}",
            left.0,
            left.1.join(" "),
            right.0,
            right.1.join(" ")
        ));
        let mut producer = self
            .command(left.0)
            .args(left.1)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("run {}", left.0))?;
        let stdin = producer.stdout.take().context("a pipe")?;
        let consumer = self
            .command(right.0)
            .args(right.1)
            .stdin(stdin)
            .output()
            .with_context(|| format!("run {}", right.0))?;
        let produced = producer.wait_with_output()?;
        ensure!(
            produced.status.success(),
            "`{} {}` failed ({}): {}",
            left.0,
            left.1.join(" "),
            produced.status,
            String::from_utf8_lossy(&produced.stderr)
        );
        for line in String::from_utf8_lossy(&consumer.stdout).lines() {
            say(format!("  {line}"));
        }
        ensure!(
            consumer.status.success(),
            "`{} {}` failed ({}): {}",
            right.0,
            right.1.join(" "),
            consumer.status,
            String::from_utf8_lossy(&consumer.stderr)
        );
        Ok(())
    }

    async fn play(&mut self, options: &DemoOptions) -> anyhow::Result<()> {
        let anchor_dir = self.dir.join("anchor");
        self.narrator
            .step("Trust: one trust anchor for both clusters (the real CLI)");
        self.shown(
            "strait",
            &[
                "identity",
                "trust-anchor",
                "--out-dir",
                &anchor_dir.to_string_lossy(),
            ],
        )?;

        self.narrator.step(&format!(
            "Two clusters, east and west, {NODES} nodes each (real kube-apiserver, etcd, controller-manager; nodes and pods are network namespaces)"
        ));
        let (east, west) = tokio::join!(start_cluster("east", 0), start_cluster("west", 1));
        let (east, west) = (east?, west?);
        let merged = kubeconfig::merge([
            east.cluster().kubeconfig().clone(),
            west.cluster().kubeconfig().clone(),
        ]);
        crate::stack::write_private(&self.kubeconfig, &kubeconfig::to_yaml(&merged)?)?;
        for t in [&east, &west] {
            let lan = t.network();
            self.leftovers.interfaces.push(lan.host_interface().into());
            say(format!(
                "{:<5} API {}  LAN {} (host {})",
                t.cluster().name(),
                t.cluster().server_url(),
                lan.cidr(),
                lan.host_interface()
            ));
            for node in t.nodes() {
                say(format!(
                    "      node {:<12} {:<12} pods {}",
                    node.name(),
                    node.ip(),
                    node.pod_cidr()
                ));
            }
        }
        say(format!("export KUBECONFIG={}", self.kubeconfig.display()));
        self.east = Some(MeshCluster::new(east, self.binaries.clone(), &self.dir)?);
        self.west = Some(MeshCluster::new(west, self.binaries.clone(), &self.dir)?);

        self.narrator.step(
            "Identity: an issuer per cluster signed by the anchor, and the real strait-identity process",
        );
        let ns_manifest = "deploy/namespace.yaml";
        for name in ["east", "west"] {
            self.shown("kubectl", &["--context", name, "apply", "-f", ns_manifest])?;
            let anchor_cert = anchor_dir.join("ca.crt").to_string_lossy().into_owned();
            let anchor_key = anchor_dir.join("ca.key").to_string_lossy().into_owned();
            self.shown(
                "kubectl",
                &[
                    "--context",
                    name,
                    "-n",
                    "strait-system",
                    "create",
                    "configmap",
                    "strait-trust-anchors",
                    &format!("--from-file=ca.crt={anchor_cert}"),
                ],
            )?;
            self.piped(
                (
                    "strait",
                    &[
                        "identity",
                        "issuer",
                        "--anchor-cert",
                        &anchor_cert,
                        "--anchor-key",
                        &anchor_key,
                        "--cluster",
                        name,
                        "-o",
                        "yaml",
                    ],
                ),
                ("kubectl", &["--context", name, "apply", "-f", "-"]),
            )?;
        }
        {
            let (east, west) = (self.east.as_mut().unwrap(), self.west.as_mut().unwrap());
            let (a, b) = tokio::join!(east.start_issuer(), west.start_issuer());
            a?;
            b?;
        }
        for c in [self.east(), self.west()] {
            let issuer = c.issuer().expect("started");
            say(format!(
                "{:<5} strait-identity on {} (TokenReview, node binding; mounts Secret strait-system/strait-identity-issuer)",
                c.name(),
                issuer.addr
            ));
        }

        self.narrator.step(
            "Node proxies on every node; each gets its certificate from its cluster's issuer with a pod-bound projected token",
        );
        {
            let (east, west) = (self.east.as_mut().unwrap(), self.west.as_mut().unwrap());
            let (a, b) = tokio::join!(east.start_node_proxies(), west.start_node_proxies());
            a?;
            b?;
        }
        for c in [self.east(), self.west()] {
            for node in c.topology().nodes() {
                say(format!(
                    "{:<5} strait-proxy on {:<12} outbound {}:4140, inbound {}:4143 (mTLS), ready",
                    c.name(),
                    node.name(),
                    node.ip(),
                    node.ip()
                ));
            }
        }
        self.issuance_evidence().await?;

        self.narrator.step(
            "West: the gateway (QUIC + mTLS on 4143) as a pod, reachable from east only across the WAN",
        );
        let gateway_ip = self.west.as_mut().unwrap().start_gateway(NODES - 1).await?;
        let wan = Wan::connect(&[
            self.east().topology().network(),
            self.west().topology().network(),
        ])?;
        wan.expose_pod(
            self.west()
                .pod("strait-gateway-0")
                .context("the gateway pod")?,
            &[4143],
        )?;
        self.wan = Some(wan);
        say(format!(
            "west  strait-gateway on {} at {gateway_ip}:4143 (udp QUIC, tcp TLS fallback); Service strait-system/strait-gateway LoadBalancer {gateway_ip}",
            self.west().topology().nodes()[NODES - 1].name()
        ));
        say("WAN   east and west LANs joined by a router that forwards only to the gateway's 4143");

        self.narrator.step(&format!(
            "West: the sample service {NAMESPACE}/{SERVICE} (strait-backend on both nodes); east: the caller pod"
        ));
        {
            let west = self.west.as_mut().unwrap();
            for (node, pod) in [(0, "web-1"), (1, "web-2")] {
                west.add_pod(
                    node,
                    NAMESPACE,
                    pod,
                    "web",
                    Some(SERVICE),
                    &[("http", 8080)],
                )
                .await?;
                west.run_in_pod(pod, "strait-backend", |ip| {
                    vec![format!("--name={pod}"), format!("--http={ip}:8080")]
                })?;
            }
            let svc: Service = serde_json::from_value(json!({
                "metadata": {"name": SERVICE, "namespace": NAMESPACE},
                "spec": {"selector": {"app": SERVICE},
                         "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
            }))?;
            Api::<Service>::namespaced(west.client(), NAMESPACE)
                .create(&Default::default(), &svc)
                .await
                .context("create Service shop/web in west")?;
        }
        for pod in ["web-1", "web-2"] {
            let p = self.west().pod(pod).context("a backend pod")?;
            say(format!(
                "west  pod {NAMESPACE}/{pod} {} on {}: strait-backend (answers with its pod name)",
                p.ip(),
                p.node().name()
            ));
        }
        say(format!(
            "west  Service {NAMESPACE}/{SERVICE} port 80 → http (8080)"
        ));
        self.east
            .as_mut()
            .unwrap()
            .add_pod(0, NAMESPACE, CALLER_SA, CALLER_SA, None, &[])
            .await?;
        let caller = self.east().pod(CALLER_SA).context("the caller pod")?;
        say(format!(
            "east  pod {NAMESPACE}/{CALLER_SA} {} on {} (ServiceAccount {CALLER_SA}), http_proxy=http://{}:4140",
            caller.ip(),
            caller.node().name(),
            caller.node().ip()
        ));

        self.narrator.step(
            "East: the mirror controller (its identity from east's issuer, for gateway probes)",
        );
        self.east
            .as_mut()
            .unwrap()
            .start_mirror_controller()
            .await?;
        say(
            "east  strait-mirror running on the host (it must reach west's API server, which testenv serves on the host; nodes cannot), Link CRD + RBAC from deploy/mirror",
        );

        self.narrator
            .step("Link: west's credentials and gateway into east, with the real CLI");
        self.piped(
            (
                "strait",
                &["link", "--context", "west", "--cluster-name", "west"],
            ),
            ("kubectl", &["--context", "east", "apply", "-f", "-"]),
        )?;

        self.narrator.step("Export: west's web service");
        let exported_at = Instant::now();
        self.export_service(SERVICE)?;

        self.narrator
            .step("Mirror: the controller writes web-west in east, endpoints at west's gateway");
        let mirror = self.wait_for_mirror(gateway_ip).await?;
        say(format!(
            "mirror ready {:.1}s after the export label was set",
            exported_at.elapsed().as_secs_f64()
        ));
        for line in mirror {
            say(line);
        }

        self.narrator
            .step("One request from east's pod to web-west, hop by hop");
        self.traced_request(gateway_ip).await?;

        self.narrator.step(&format!(
            "Latency: {} requests east → west through the gateway",
            options.requests
        ));
        self.latency(options.requests).await?;

        self.narrator
            .step("strait check and strait gateways (east)");
        // The mirror controller's first probes are seconds old: let check wait for them.
        self.strait_report(&["check", "--wait", "30s"])?;
        self.strait_report(&["gateways"])?;

        println!(
            "\n\x1b[1mdemo passed\x1b[0m in {:.1}s",
            self.narrator.start.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Evidence that certificates came from the issuers, not from files.
    async fn issuance_evidence(&self) -> anyhow::Result<()> {
        for c in [self.east(), self.west()] {
            let m = c.issuer().expect("started").metrics().await;
            let issued = metric_sum(&m, "identity_issuance_total", &["result=\"issued\""])
                + metric_sum(&m, "identity_issuance_total", &["result=\"success\""]);
            let all = metric_sum(&m, "identity_issuance_total", &[]);
            say(format!(
                "{:<5} issuer: identity_issuance_total = {all} ({issued} issued)",
                c.name()
            ));
            ensure!(
                all >= NODES as f64,
                "{}'s issuer issued {all} certificates, but {NODES} node proxies are ready: where did their certificates come from?\n{m}",
                c.name()
            );
        }
        Ok(())
    }

    /// Exports west's Service with the real CLI (it sets the export label).
    fn export_service(&self, service: &str) -> anyhow::Result<()> {
        self.shown(
            "strait",
            &[
                "export",
                &format!("svc/{service}"),
                "-n",
                NAMESPACE,
                "--context",
                "west",
            ],
        )?;
        Ok(())
    }

    /// Waits for the mirror Service and a ready endpoint at the gateway;
    /// returns lines describing them and the Link's status.
    async fn wait_for_mirror(&self, gateway_ip: Ipv4Addr) -> anyhow::Result<Vec<String>> {
        let client = self.east().client();
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
                    "no ready mirror {NAMESPACE}/{MIRROR} in east after 60s (Service: {}, EndpointSlice: {:?}); Link west status: {:?}; see {}",
                    svc.is_some(),
                    slice.map(|s| s.endpoints),
                    link.and_then(|l| l.status),
                    self.east()
                        .component("strait-mirror-0")
                        .map(|c| c.process.log_path().display().to_string())
                        .unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The caller pod's curl through its node proxy (`http_proxy`).
    fn curl(&self, args: &[&str]) -> anyhow::Result<std::process::Output> {
        let caller = self.east().pod(CALLER_SA).context("the caller pod")?;
        let proxy = format!("http://{}:4140", caller.node().ip());
        caller
            .command("curl")
            .args(["-sS", "-x", &proxy])
            .args(args)
            .output()
            .context("run curl in the caller pod (package curl)")
    }

    async fn traced_request(&self, gateway_ip: Ipv4Addr) -> anyhow::Result<()> {
        let east = self.east();
        let west = self.west();
        let caller = east.pod(CALLER_SA).context("the caller pod")?;
        let east_proxy = format!("strait-proxy-{}", caller.node().name());
        let before = Snapshot::take(east, west, &east_proxy).await?;
        let pcap = self.dir.join("wan.pcap");
        let capture = self
            .wan
            .as_ref()
            .context("the WAN")?
            .capture(&pcap)
            .context("capture the WAN (tcpdump)")?;
        let url = format!("http://{MIRROR}.{NAMESPACE}.svc.cluster.local/hello");
        say(format!(
            "$ curl -x http://{}:4140 {url}     (in pod {NAMESPACE}/{CALLER_SA})",
            caller.node().ip()
        ));
        let mut failures = Vec::new();
        let answer = loop {
            let out = self.curl(&["--max-time", "10", &url])?;
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
        let backend = west
            .pod(&pod_name)
            .with_context(|| format!("the answer names pod {pod_name}, which west does not run"))?;
        let west_proxy = format!("strait-proxy-{}", backend.node().name());
        let after = Snapshot::take(east, west, &east_proxy).await?;
        let wan = WanEvidence::read(capture.stop()?, &pcap, gateway_ip)?;
        let d = after.minus(&before, &west_proxy);

        say("");
        say("path (each hop with its evidence):");
        say(format!(
            "  1. pod {NAMESPACE}/{CALLER_SA} ({}) on {}  →  east node proxy on {} ({}:4140)",
            caller.ip(),
            caller.node().name(),
            caller.node().name(),
            caller.node().ip()
        ));
        say(format!(
            "     evidence: {east_proxy} request_total{{direction=outbound, dst=strait-system/strait-gateway}} +{}",
            d.east_outbound
        ));
        say(format!(
            "  2. east node proxy  →  QUIC (mTLS) across the WAN  →  west gateway {gateway_ip}:4143"
        ));
        say(format!(
            "     evidence: strait-gateway-0 gateway_streams_total{{transport=quic, src=shop/client, dst_service=web}} +{} (QUIC connections accepted so far: {}; tunnel probes answered: {})",
            d.gateway_quic_streams, after.gateway_quic_connections, after.gateway_probes
        ));
        say(format!(
            "     evidence: the WAN's capture holds {} UDP and {} TCP packets to/from {gateway_ip}:4143, and none of {:?} in clear text{}",
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
            "  3. west gateway  →  west node proxy on {} ({}:4143, mTLS, carrying the caller's identity)",
            backend.node().name(),
            backend.node().ip()
        ));
        say(format!(
            "     evidence: {west_proxy} request_total{{direction=inbound, src=shop/client}} +{}",
            d.west_inbound
        ));
        say(format!(
            "  4. west node proxy  →  pod {NAMESPACE}/{pod_name} ({}:8080)",
            backend.ip()
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
        let expected = format!(
            "spiffe://{}/ns/{NAMESPACE}/sa/{CALLER_SA}",
            crate::stack::TRUST_DOMAIN
        );
        let mut broken = Vec::new();
        if d.east_outbound < 1.0 {
            broken.push("east node proxy: no outbound request to the gateway counted");
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
        for c in [east, west] {
            let m = c.issuer().expect("started").metrics().await;
            say(format!(
                "{:<5} issuer has signed {} certificates so far (node proxies, their pods' identities, {})",
                c.name(),
                metric_sum(&m, "identity_issuance_total", &[]),
                if c.name() == "west" {
                    "the gateway"
                } else {
                    "the mirror controller"
                }
            ));
        }
        Ok(())
    }

    async fn latency(&self, n: usize) -> anyhow::Result<()> {
        let east = self.east();
        let west = self.west();
        let caller = east.pod(CALLER_SA).context("the caller pod")?;
        let east_proxy = format!("strait-proxy-{}", caller.node().name());
        let before = Snapshot::take(east, west, &east_proxy).await?;
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
        let out = self.curl(&arg_refs)?;
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
        let after = Snapshot::take(east, west, &east_proxy).await?;
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

    /// Runs `strait <args…> --context east`, prints what it says, and fails
    /// on a non-zero exit (after printing it).
    fn strait_report(&self, args: &[&str]) -> anyhow::Result<()> {
        let mut all = args.to_vec();
        all.extend(["--context", "east"]);
        say(format!("$ strait {}", all.join(" ")));
        let out = self
            .command("strait")
            .args(&all)
            .output()
            .context("run strait")?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        for line in String::from_utf8_lossy(&out.stdout)
            .lines()
            .chain(stderr.lines())
        {
            say(format!("  {line}"));
        }
        ensure!(
            out.status.success(),
            "`strait {}` failed ({}): see its output above",
            all.join(" "),
            out.status
        );
        Ok(())
    }

    /// Waits for Ctrl-C, refreshing the identity tokens meanwhile.
    async fn stay(&self) -> anyhow::Result<()> {
        let caller = self.east().pod(CALLER_SA).context("the caller pod")?;
        println!("\n\x1b[1mThe demo stays up until Ctrl-C.\x1b[0m Try:");
        println!("  export KUBECONFIG={}", self.kubeconfig.display());
        println!("  kubectl --context east -n {NAMESPACE} get svc,endpointslices");
        println!("  kubectl --context east -n strait-multicluster get links");
        println!("  kubectl --context west get pods -A -o wide");
        println!(
            "  nsenter --net=/proc/{}/ns/net curl -x http://{}:4140 http://{MIRROR}.{NAMESPACE}.svc.cluster.local/   # as east's pod",
            caller.anchor_pid(),
            caller.node().ip()
        );
        println!(
            "  {} unlink --context east --target-context west --cluster-name west",
            self.binaries.path("strait").display()
        );
        println!("  logs and certificates: {}", self.dir.display());
        let mut refresh = tokio::time::interval(crate::stack::IDENTITY_TOKEN_TTL.mul_f64(0.5));
        refresh.tick().await;
        loop {
            tokio::select! {
                stop = wait_for_stop_signal() => { stop?; break; }
                _ = refresh.tick() => {
                    for c in [self.east(), self.west()] {
                        if let Err(e) = c.refresh_tokens().await {
                            eprintln!("[demo] {}: refreshing identity tokens: {e:#}", c.name());
                        }
                    }
                }
            }
        }
        println!("\n[demo] stopping…");
        Ok(())
    }

    /// Stops everything and checks that nothing is left.
    fn tear_down(&mut self) -> anyhow::Result<()> {
        for c in self.east.iter().chain(self.west.iter()) {
            self.leftovers.pids.extend(c.pids());
        }
        if let Some(wan) = &self.wan {
            self.leftovers.pids.push(wan.anchor_pid());
        }
        self.wan = None;
        self.east = None;
        self.west = None;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let alive: Vec<u32> = self
                .leftovers
                .pids
                .iter()
                .copied()
                .filter(|p| crate::process::is_alive(*p))
                .collect();
            let links: Vec<&String> = self
                .leftovers
                .interfaces
                .iter()
                .filter(|i| Path::new("/sys/class/net").join(i).exists())
                .collect();
            if alive.is_empty() && links.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                bail!("after tear-down still alive: pids {alive:?}, interfaces {links:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let pids: Vec<String> = self.leftovers.pids.iter().map(u32::to_string).collect();
        println!(
            "[demo] torn down: {} processes and namespace anchors gone (pids {}), interfaces {} removed",
            pids.len(),
            pids.join(","),
            self.leftovers.interfaces.join(",")
        );
        Ok(())
    }
}

async fn start_cluster(name: &str, index: usize) -> anyhow::Result<ClusterTopology> {
    let mut config = ClusterConfig::new(name);
    // Linked clusters must not share service ranges.
    config.service_cidr = format!("10.{}.0.0/16", 96 + index);
    ClusterTopology::start_with(config, NODES)
        .await
        .with_context(|| format!("start cluster {name}"))
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
        let conditions: Vec<String> = status
            .conditions
            .iter()
            .map(|c| format!("{}={}", c.type_, c.status))
            .collect();
        lines.push(format!("Link west: {}", conditions.join(" ")));
    }
    lines
}

/// What a packet capture of the WAN shows about one request.
struct WanEvidence {
    udp: usize,
    tcp: usize,
    plaintext: Vec<&'static str>,
}

impl WanEvidence {
    /// Words of the request (path, header, the tunnel header's service
    /// name, SPIFFE IDs of certificates) that mTLS must hide.
    const NEEDLES: [&'static str; 4] = ["/hello", "strait-client-id", "web.shop.svc", "spiffe://"];

    fn read(bytes: Vec<u8>, pcap: &Path, gateway: Ipv4Addr) -> anyhow::Result<Self> {
        let count = |proto: &str| -> anyhow::Result<usize> {
            let out = Command::new("tcpdump")
                .args(["-n", "-r"])
                .arg(pcap)
                .arg(format!("{proto} and host {gateway} and port 4143"))
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
struct Snapshot {
    east_outbound: f64,
    gateway_quic_streams: f64,
    gateway_quic_connections: f64,
    /// The mirror controller's probes, which go through the tunnel too.
    gateway_probes: f64,
    west_inbound: Vec<(String, f64)>,
}

struct Delta {
    east_outbound: f64,
    gateway_quic_streams: f64,
    west_inbound: f64,
}

impl Snapshot {
    async fn take(
        east: &MeshCluster,
        west: &MeshCluster,
        east_proxy: &str,
    ) -> anyhow::Result<Self> {
        let e = east.metrics(east_proxy).await?;
        let g = west.metrics("strait-gateway-0").await?;
        let mut west_inbound = Vec::new();
        for node in west.topology().nodes() {
            let name = format!("strait-proxy-{}", node.name());
            let m = west.metrics(&name).await?;
            west_inbound.push((
                name,
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
                    "dst_namespace=\"strait-system\"",
                    "dst_workload=\"strait-gateway\"",
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

    fn minus(&self, before: &Snapshot, west_proxy: &str) -> Delta {
        let inbound = |s: &Snapshot| {
            s.west_inbound
                .iter()
                .find(|(n, _)| n == west_proxy)
                .map(|(_, v)| *v)
                .unwrap_or(0.0)
        };
        Delta {
            east_outbound: self.east_outbound - before.east_outbound,
            gateway_quic_streams: self.gateway_quic_streams - before.gateway_quic_streams,
            west_inbound: inbound(self) - inbound(before),
        }
    }

    fn west_inbound_by_proxy(&self, before: &Snapshot) -> Vec<(String, f64)> {
        self.west_inbound
            .iter()
            .zip(&before.west_inbound)
            .map(|((name, after), (_, b))| (name.clone(), after - b))
            .collect()
    }
}

async fn wait_for_stop_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut hangup = signal(SignalKind::hangup())?;
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
        _ = hangup.recv() => {}
    }
    Ok(())
}
