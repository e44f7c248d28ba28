//! `strait-testenv demo` (what `bash scripts/demo.sh` runs): two clusters,
//! east and west, with Strait's whole stack as processes on network-namespace
//! nodes ([`crate::stack`]), linked with the real `strait link` and kubectl,
//! and one service called from east to west through the QUIC gateway. It
//! prints what happened with the evidence for each hop, and fails (non-zero
//! exit) when a hop shows no evidence, so CI can run it
//! (`testenv/tests/demo.rs`).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use serde_json::json;

mod evidence;

use crate::process::wait_for_stop_signal;
use crate::stack::{Binaries, MeshCluster};
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
