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
use strait_testenv::process::wait_for_stop_signal;
use strait_testenv::stack::write_private;
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
        } => {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(up(&cli.state_dir, clusters, kubeconfig, nodes))
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
) -> anyhow::Result<()> {
    if nodes > 0 && !net::is_root() {
        bail!("{}", net::NetError::NotRoot);
    }
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
