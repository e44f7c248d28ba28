//! `strait-testenv demo` (what `bash scripts/demo.sh` runs): two clusters,
//! east and west, on real nodes ([`crate::realnode`]: kubelet, containerd,
//! kube-proxy, a scheduler and CoreDNS), Strait installed in each with
//! `strait install | kubectl apply -f -` from images built here
//! ([`crate::images`]), linked with `strait link | kubectl apply -f -`, and
//! one service called from east to west through the QUIC gateway. It prints
//! what happened with the evidence for each hop, and fails (non-zero exit)
//! when a hop shows no evidence, so CI can run it (`testenv/tests/demo.rs`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};

mod counters;
mod evidence;
mod manifests;
mod shell;

use manifests::{caller_manifests, web_manifests};
use shell::{Narrator, say};

use crate::installed;
use crate::process::wait_for_stop_signal;
use crate::stack::Binaries;
use crate::{ClusterTopology, Wan, kubeconfig, net};

const NAMESPACE: &str = "shop";
const SERVICE: &str = "web";
const MIRROR: &str = "web-west";
const CALLER_SA: &str = "client";
const NODES: usize = 2;
/// Built into images (and the CLI run on the host).
const BINARIES: &[&str] = &[
    "strait",
    "strait-identity",
    "strait-proxy",
    "strait-gateway",
    "strait-mirror",
    "strait-cni",
    "strait-backend",
    "strait-load",
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

/// The demo's state. Fields drop in order: the API endpoint and the WAN,
/// then the clusters.
struct Demo {
    api_endpoint: Option<crate::net::RouterForward>,
    wan: Option<Wan>,
    east: Option<ClusterTopology>,
    west: Option<ClusterTopology>,
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
            api_endpoint: None,
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

    fn east(&self) -> &ClusterTopology {
        self.east.as_ref().expect("east is up")
    }

    fn west(&self) -> &ClusterTopology {
        self.west.as_ref().expect("west is up")
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

        self.narrator.step(
            "Images: Strait's components, the pause image and the sample app as OCI archives (no Docker, no registry)",
        );
        let archives = installed::build_images(self.binaries.dir()).await?;
        for archive in &archives {
            let size = std::fs::metadata(archive).map(|m| m.len()).unwrap_or(0);
            say(format!(
                "{:<58} {:>6.1} MiB",
                archive
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                size as f64 / (1 << 20) as f64
            ));
        }

        self.narrator.step(&format!(
            "Two clusters, east and west, {NODES} real nodes each (kubelet, containerd + runc, kube-proxy; a scheduler and CoreDNS per cluster), every image imported into every node"
        ));
        let (east, west) = installed::start_clusters(&archives, NODES).await?;
        let merged = kubeconfig::merge([
            east.cluster().kubeconfig().clone(),
            west.cluster().kubeconfig().clone(),
        ]);
        crate::files::write_private(&self.kubeconfig, &kubeconfig::to_yaml(&merged)?)?;
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
        }
        self.east = Some(east);
        self.west = Some(west);
        say(format!("export KUBECONFIG={}", self.kubeconfig.display()));
        self.shown(
            "kubectl",
            &["--context", "east", "get", "nodes", "-o", "wide"],
        )?;

        self.narrator.step(
            "Install: an issuer per cluster signed by the anchor, then `strait install | kubectl apply -f -`",
        );
        let anchor_cert = anchor_dir.join("ca.crt").to_string_lossy().into_owned();
        let anchor_key = anchor_dir.join("ca.key").to_string_lossy().into_owned();
        for name in ["east", "west"] {
            let identity = self.dir.join(name).to_string_lossy().into_owned();
            self.shown(
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
                    "--out-dir",
                    &identity,
                ],
            )?;
            self.piped(
                (
                    "strait",
                    &[
                        "install",
                        "--identity-dir",
                        &identity,
                        "--gateway-service-type",
                        "NodePort",
                    ],
                ),
                ("kubectl", &["--context", name, "apply", "-f", "-"]),
            )?;
        }
        let installing = Instant::now();
        for t in [self.east(), self.west()] {
            let kubeconfig = t.cluster().kubeconfig_path();
            tokio::task::spawn_blocking(move || installed::wait_installed(&kubeconfig))
                .await
                .expect("wait task panicked")
                .with_context(|| format!("Strait's pods in {}", t.cluster().name()))?;
        }
        say(format!(
            "every component rolled out and Ready {:.1}s after the apply",
            installing.elapsed().as_secs_f64()
        ));
        for name in ["east", "west"] {
            self.shown(
                "kubectl",
                &[
                    "--context",
                    name,
                    "-n",
                    "strait-system",
                    "get",
                    "ds,deploy,pods",
                    "-o",
                    "wide",
                ],
            )?;
        }
        self.shown(
            "kubectl",
            &[
                "--context",
                "east",
                "-n",
                "strait-multicluster",
                "get",
                "deploy,pods",
                "-o",
                "wide",
            ],
        )?;
        self.issuance_evidence().await?;

        self.narrator.step(
            "WAN: the clusters' LANs joined by a router that forwards only to west's gateway NodePort and API endpoint",
        );
        let wan = Wan::connect(&[self.east().network(), self.west().network()])?;
        let (gateway_ip, api_endpoint) = installed::expose(&wan, self.west())?;
        self.wan = Some(wan);
        self.api_endpoint = Some(api_endpoint);
        let gateway_pod = self.gateway_pod().await?;
        say(format!(
            "west  strait-gateway on {} at {gateway_ip}:{} (the NodePort of Service strait-system/strait-gateway; udp QUIC, tcp TLS fallback) → pod {} ({}) on {}",
            self.west().node(0)?.name(),
            installed::GATEWAY_NODE_PORT,
            gateway_pod.name,
            gateway_pod.ip,
            gateway_pod.node,
        ));
        say(format!(
            "west  API server reachable across the WAN at https://{}:{} (LAN router endpoint, as a cloud load balancer)",
            self.west().network().router_ip(),
            installed::API_ENDPOINT_PORT
        ));

        self.narrator.step(&format!(
            "West: the sample service {NAMESPACE}/{SERVICE} (strait-backend, a pod on each node); east: the caller pod"
        ));
        self.apply_shown("west", &web_manifests())?;
        self.apply_shown("east", &caller_manifests())?;
        let caller_pod = format!("pod/{CALLER_SA}");
        for (context, pods) in [
            ("west", vec!["pod/web-1", "pod/web-2"]),
            ("east", vec![caller_pod.as_str()]),
        ] {
            let mut args = vec![
                "--context",
                context,
                "-n",
                NAMESPACE,
                "wait",
                "--for=condition=Ready",
            ];
            args.extend(pods);
            args.push("--timeout=120s");
            self.shown("kubectl", &args)?;
        }
        self.shown(
            "kubectl",
            &[
                "--context",
                "west",
                "-n",
                NAMESPACE,
                "get",
                "pods,svc",
                "-o",
                "wide",
            ],
        )?;

        self.narrator
            .step("Link: west's credentials and gateway into east, with the real CLI");
        let gateway = installed::link_args(self.west(), gateway_ip);
        let gateway: Vec<&str> = gateway.iter().map(String::as_str).collect();
        self.piped(
            ("strait", &gateway),
            ("kubectl", &["--context", "east", "apply", "-f", "-"]),
        )?;

        self.narrator.step("Export: west's web service");
        let exported_at = Instant::now();
        self.export_service(SERVICE)?;

        self.narrator.step(
            "Mirror: the controller (a pod in east, watching west's API across the WAN) writes web-west, endpoints at west's gateway",
        );
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

        self.narrator.step(
            "strait stat: golden metrics from each side's node proxies while east's pod calls web-west (20/s)",
        );
        let mut calls = self.calls_in_background(20).await?;
        let stats = self
            .strait_report(&["stat", "--window", "3s"])
            .and_then(|()| {
                self.strait_report_in("west", &["stat", "--window", "3s", "--from", "east"])
            });
        let _ = calls.kill();
        let _ = calls.wait();
        stats?;

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

    /// West's gateway pod: its name, address and node.
    async fn gateway_pod(&self) -> anyhow::Result<evidence::PodInfo> {
        evidence::PodInfo::find(
            self.west(),
            "strait-system",
            "app.kubernetes.io/name=strait-gateway",
        )
        .await?
        .into_iter()
        .next()
        .context("no gateway pod in west")
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

    /// Waits for Ctrl-C.
    async fn stay(&self) -> anyhow::Result<()> {
        println!("\n\x1b[1mThe demo stays up until Ctrl-C.\x1b[0m Try:");
        println!("  export KUBECONFIG={}", self.kubeconfig.display());
        println!("  kubectl --context east -n strait-system get ds,deploy,pods -o wide");
        println!("  kubectl --context east -n {NAMESPACE} get svc,endpointslices");
        println!("  kubectl --context east -n strait-multicluster get links");
        println!("  kubectl --context west -n strait-system logs deploy/strait-gateway");
        if let Ok(pid) = self.east().pod_process(NAMESPACE, CALLER_SA).await {
            println!(
                "  nsenter --net=/proc/{pid}/ns/net curl -x http://{}:4140 http://{MIRROR}.{NAMESPACE}.svc.cluster.local/   # as east's pod",
                self.node_proxy_service().await.unwrap_or_default()
            );
        }
        println!(
            "  {} dashboard --context east   # then open http://localhost:8084",
            self.binaries.path("strait").display()
        );
        println!(
            "  {} unlink --context east --target-context west --cluster-name west",
            self.binaries.path("strait").display()
        );
        println!("  logs and certificates: {}", self.dir.display());
        wait_for_stop_signal().await?;
        println!("\n[demo] stopping…");
        Ok(())
    }

    /// Stops everything and checks that nothing is left.
    fn tear_down(&mut self) -> anyhow::Result<()> {
        for t in self.east.iter().chain(self.west.iter()) {
            self.leftovers.pids.extend(t.cluster().pids());
            for node in t.real_nodes() {
                // Daemons, shims and containers: everything of the node.
                self.leftovers.pids.extend(node.pids());
                self.leftovers.pids.extend(node.all_pids());
            }
        }
        if let Some(wan) = &self.wan {
            self.leftovers.pids.push(wan.anchor_pid());
        }
        self.leftovers.pids.sort_unstable();
        self.leftovers.pids.dedup();
        self.api_endpoint = None;
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
