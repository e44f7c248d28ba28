//! `strait-testenv`: real local Kubernetes clusters for people.
//!
//! `strait-testenv up --clusters east,west` starts one control plane per name,
//! writes one kubeconfig with a context per cluster and stays up until Ctrl-C or
//! `strait-testenv down`. With `--nodes N` (root) each cluster also gets N
//! nodes as network namespaces on its own LAN.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use strait_testenv::files::write_private;
use strait_testenv::process::wait_for_stop_signal;
use strait_testenv::{
    Cluster, ClusterConfig, ClusterTopology, controlplane, kubeconfig, net, process,
};

#[derive(Debug, Parser)]
#[command(
    name = "strait-testenv",
    version,
    about = "Real local Kubernetes control planes for Strait (no Docker needed)."
)]
struct Cli {
    /// Folder for the pid file and the kubeconfig of `up`.
    #[arg(long, global = true, env = "STRAIT_TESTENV_STATE_DIR", default_value_os_t = default_state_dir())]
    state_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start clusters and stay up until Ctrl-C or `strait-testenv down`.
    Up {
        /// Comma-separated cluster names; each becomes a kubeconfig context.
        #[arg(long, value_delimiter = ',', default_value = "east,west")]
        clusters: Vec<String>,
        /// Where to write the kubeconfig (default: STATE_DIR/kubeconfig).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// Nodes per cluster, each a network namespace on the cluster's LAN
        /// (needs root). 0: control planes only, API servers on 127.0.0.1.
        #[arg(long, default_value_t = 0)]
        nodes: usize,
        /// Real nodes (root): containerd, kubelet and kube-proxy in each node
        /// namespace, plus a kube-scheduler and CoreDNS per cluster. Default
        /// --nodes 2 with it.
        #[arg(long)]
        real_nodes: bool,
        /// With --real-nodes: also import Strait's images (built from the
        /// binaries in this folder, e.g. target/release) into every node.
        #[arg(long, value_name = "BIN_DIR")]
        strait_images: Option<PathBuf>,
    },
    /// Build the OCI image archives (pause and Strait's components from
    /// BIN_DIR, named as `strait install` renders them) and print their paths.
    Images {
        /// Folder with the release binaries (strait-proxy, strait-gateway, …).
        #[arg(long, default_value = "target/release")]
        bin_dir: PathBuf,
        /// Registry of Strait's images (as `strait install --registry`).
        #[arg(long, default_value = strait_testenv::images::DEFAULT_REGISTRY)]
        registry: String,
        /// Tag of Strait's images (as `strait install --tag`).
        #[arg(long, default_value = strait_testenv::images::DEFAULT_TAG)]
        tag: String,
        /// Write the archives here instead of the cache.
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
    /// Stop the clusters a running `up` started.
    Down,
    /// Build the control-plane binary into the cache now (tests do it on first use).
    Build,
    /// The two-cluster demo (root): east and west with Strait's components as
    /// processes on network-namespace nodes, linked with `strait link`, and a
    /// call from an east pod to a west service through the QUIC gateway, shown
    /// hop by hop. Exits when done (non-zero if a hop failed), or stays up with --stay.
    Demo {
        /// Stay up after the demo until Ctrl-C, for poking at it with kubectl.
        #[arg(long)]
        stay: bool,
        /// Requests for the latency measurement.
        #[arg(long, default_value_t = 200)]
        requests: usize,
        /// Keep the kubeconfig, certificates and logs here (default: a temporary
        /// folder removed at the end).
        #[arg(long)]
        work_dir: Option<PathBuf>,
    },
}

fn default_state_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) => PathBuf::from(dir).join("strait-testenv"),
        None => std::env::temp_dir().join("strait-testenv"),
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The client's connection errors while a component starts are expected noise.
    strait_mesh::telemetry::init_tracing(Default::default(), "warn,kube_client=off");
    match cli.command {
        Command::Build => {
            let bin = controlplane::ensure_built()?;
            println!("{}", bin.display());
            Ok(())
        }
        Command::Down => down(&cli.state_dir),
        Command::Images {
            bin_dir,
            registry,
            tag,
            out_dir,
        } => images(&bin_dir, &registry, &tag, out_dir.as_deref()),
        Command::Demo {
            stay,
            requests,
            work_dir,
        } => {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(strait_testenv::demo::run(
                strait_testenv::demo::DemoOptions {
                    stay,
                    requests,
                    work_dir,
                },
            ))
        }
        Command::Up {
            clusters,
            kubeconfig,
            nodes,
            real_nodes,
            strait_images,
        } => {
            let runtime = tokio::runtime::Runtime::new()?;
            let real = real_nodes.then_some(RealNodes { strait_images });
            let nodes = if real_nodes && nodes == 0 { 2 } else { nodes };
            runtime.block_on(up(&cli.state_dir, clusters, kubeconfig, nodes, real))
        }
    }
}

fn pid_file(state_dir: &std::path::Path) -> PathBuf {
    state_dir.join("up.pid")
}

fn running_pid(state_dir: &std::path::Path) -> Option<u32> {
    let text = std::fs::read_to_string(pid_file(state_dir)).ok()?;
    let pid: u32 = text.trim().parse().ok()?;
    process::is_alive(pid).then_some(pid)
}

async fn up(
    state_dir: &std::path::Path,
    names: Vec<String>,
    kubeconfig_path: Option<PathBuf>,
    nodes: usize,
    real: Option<RealNodes>,
) -> anyhow::Result<()> {
    if nodes > 0 && !net::is_root() {
        bail!("{}", net::NetError::NotRoot);
    }
    let node_images = match &real {
        Some(real) => real_node_images(real)?,
        None => Vec::new(),
    };
    if names.is_empty() || names.iter().any(|n| n.is_empty()) {
        bail!("--clusters needs one or more names, e.g. --clusters east,west");
    }
    if let Some(pid) = running_pid(state_dir) {
        bail!(
            "testenv is already up (pid {pid}); run `strait-testenv down` first, or pass another --state-dir"
        );
    }
    std::fs::create_dir_all(state_dir)
        .with_context(|| format!("create {}", state_dir.display()))?;
    let kubeconfig_path = kubeconfig_path.unwrap_or_else(|| state_dir.join("kubeconfig"));

    let binary = tokio::task::spawn_blocking(controlplane::ensure_built).await??;
    let version = controlplane::kubernetes_version(&controlplane::source_dir()).unwrap_or_default();
    eprintln!(
        "[testenv] starting {} (Kubernetes {version}, {})…",
        names.join(", "),
        binary.display()
    );
    let started = Instant::now();
    let configs = names.iter().enumerate().map(|(i, name)| {
        let mut config = ClusterConfig::new(name);
        // Linked clusters must not share service ranges.
        config.service_cidr = format!("10.{}.0.0/16", 96 + i);
        config.real_nodes = real.is_some();
        config.node_images = node_images.clone();
        config
    });
    // Ctrl-C during start-up drops the half-started clusters, which stops them.
    let clusters: Vec<Running> = tokio::select! {
        started = futures::future::try_join_all(configs.map(|c| Running::start(c, nodes))) => started?,
        stop = wait_for_stop_signal() => {
            stop?;
            bail!("interrupted during start-up; nothing is left running");
        }
    };
    let elapsed = started.elapsed();

    let merged = kubeconfig::merge(clusters.iter().map(|c| c.cluster().kubeconfig().clone()));
    write_private(&kubeconfig_path, &kubeconfig::to_yaml(&merged)?)?;
    std::fs::write(pid_file(state_dir), std::process::id().to_string())?;

    let first = &names[0];
    println!(
        "testenv is up in {:.1}s: {} (Kubernetes {version})",
        elapsed.as_secs_f64(),
        names.join(", ")
    );
    for running in &clusters {
        let c = running.cluster();
        println!(
            "  {:<8} {}   logs: {}",
            c.name(),
            c.server_url(),
            c.dir().join("logs").display()
        );
        if let Running::WithNodes(topology) = running {
            let lan = topology.network();
            println!(
                "    lan  {:<16} host {} on {}",
                lan.cidr(),
                lan.host_ip(),
                lan.host_interface()
            );
            for node in topology.nodes() {
                println!(
                    "    node {:<16} {:<13} pods {:<15} shell: nsenter --net=/proc/{}/ns/net bash",
                    node.name(),
                    node.ip(),
                    node.pod_cidr(),
                    node.anchor_pid()
                );
            }
        }
    }
    println!();
    println!("  export KUBECONFIG={}", kubeconfig_path.display());
    println!(
        "  kubectl --kubeconfig {} --context {first} get ns",
        kubeconfig_path.display()
    );
    println!();
    println!("Stop with Ctrl-C or `strait-testenv down`.");

    wait_for_stop_signal().await?;
    eprintln!("[testenv] stopping…");
    drop(clusters);
    let _ = std::fs::remove_file(pid_file(state_dir));
    let _ = std::fs::remove_file(&kubeconfig_path);
    eprintln!("[testenv] down");
    Ok(())
}

/// `up --real-nodes`: what to import besides pause and the backend.
struct RealNodes {
    strait_images: Option<PathBuf>,
}

/// Checks the host, cleans up after killed runs, and builds the images every
/// real node imports.
fn real_node_images(real: &RealNodes) -> anyhow::Result<Vec<PathBuf>> {
    strait_testenv::realnode::preflight()?;
    let swept = strait_testenv::realnode::sweep_stale_cgroups();
    if !swept.is_empty() {
        eprintln!(
            "[testenv] cleaned up node cgroups of an earlier run: {}",
            swept.join(", ")
        );
    }
    let exe = std::env::current_exe()?;
    let bin_dir = exe.parent().context("the folder of strait-testenv")?;
    eprintln!("[testenv] building images (pause, strait-backend)…");
    let mut archives = strait_testenv::images::node_archives(bin_dir)?;
    if let Some(dir) = &real.strait_images {
        eprintln!("[testenv] building Strait's images from {}…", dir.display());
        archives.extend(strait_testenv::images::strait_archives(dir)?);
    }
    Ok(archives)
}

fn images(
    bin_dir: &std::path::Path,
    registry: &str,
    tag: &str,
    out_dir: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    use strait_testenv::images;
    let work = controlplane::cache_root().join("images").join("pause-src");
    let mut all = vec![images::pause_image(&work)?];
    all.extend(images::strait_images(bin_dir, registry, tag)?);
    for image in &all {
        let path = match out_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                let file = image
                    .name
                    .rsplit('/')
                    .next()
                    .unwrap_or("image")
                    .replace(':', "_");
                let path = dir.join(format!("{file}.tar"));
                image.write_archive(&path)?;
                path
            }
            None => images::cached_archive(image)?,
        };
        eprintln!("[testenv] {} → {}", image.name, path.display());
        println!("{}", path.display());
    }
    Ok(())
}

/// A cluster `up` runs: a control plane alone, or one with node namespaces.
enum Running {
    Plain(Cluster),
    WithNodes(ClusterTopology),
}

impl Running {
    async fn start(config: ClusterConfig, nodes: usize) -> anyhow::Result<Self> {
        Ok(if nodes == 0 {
            Running::Plain(Cluster::start_with(config).await?)
        } else {
            Running::WithNodes(ClusterTopology::start_with(config, nodes).await?)
        })
    }

    fn cluster(&self) -> &Cluster {
        match self {
            Running::Plain(c) => c,
            Running::WithNodes(t) => t.cluster(),
        }
    }
}

fn down(state_dir: &std::path::Path) -> anyhow::Result<()> {
    let Some(pid) = running_pid(state_dir) else {
        let _ = std::fs::remove_file(pid_file(state_dir));
        println!(
            "testenv is not up (no live pid in {})",
            pid_file(state_dir).display()
        );
        return Ok(());
    };
    if !process::terminate(pid, Duration::from_secs(60)) {
        bail!(
            "testenv (pid {pid}) did not stop; its components die with it, check `ps` for leftovers"
        );
    }
    let _ = std::fs::remove_file(pid_file(state_dir));
    println!("testenv is down (pid {pid} stopped)");
    Ok(())
}
