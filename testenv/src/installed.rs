//! Strait installed as a user installs it, on two real-node clusters
//! ([`crate::realnode`]) joined by a [`Wan`]: images imported into every
//! node, `strait install | kubectl apply -f -` in each cluster (gateway as a
//! NodePort Service), `strait link | kubectl apply -f -` from east to west.
//!
//! What crosses the WAN, as between two clouds: west's gateway NodePort on
//! its first node, and west's API server through an endpoint on west's LAN
//! router (socat in the LAN namespace forwards to the API server on the host;
//! the certificate names it), which east's mirror controller, a pod, watches.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::process::ChildProcess;
use crate::{ClusterConfig, ClusterTopology, Wan, images, kubectl_output};

/// The gateway's NodePort (`strait install --gateway-node-port`'s default).
pub const GATEWAY_NODE_PORT: u16 = 30143;
/// Port of the API endpoint on a LAN router.
pub const API_ENDPOINT_PORT: u16 = 6443;

/// Two clusters, east and west, with Strait installed and east linked to west.
/// Fields drop in order: the API endpoint and WAN before the clusters.
pub struct InstalledMesh {
    api_endpoint: ChildProcess,
    pub wan: Wan,
    pub east: ClusterTopology,
    pub west: ClusterTopology,
    strait: PathBuf,
    work: tempfile::TempDir,
}

/// Runs `strait args…`; its stdout, or an error with its stderr.
pub fn run_strait(strait: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(strait)
        .args(args)
        .output()
        .with_context(|| format!("run {}", strait.display()))?;
    if !out.status.success() {
        bail!(
            "strait {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs kubectl until it succeeds or `limit` passes; its stdout.
pub fn kubectl_until(kubeconfig: &Path, args: &[&str], limit: Duration) -> anyhow::Result<String> {
    let deadline = Instant::now() + limit;
    loop {
        let out = kubectl_output(kubeconfig, args, None);
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        if Instant::now() >= deadline {
            let pods = kubectl_output(kubeconfig, &["get", "pods", "-A", "-o", "wide"], None);
            bail!(
                "kubectl {} did not succeed within {limit:?}: {}{}\npods:\n{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&pods.stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `kubectl apply -f -` of `manifests`.
pub fn apply(kubeconfig: &Path, manifests: &str) -> anyhow::Result<()> {
    let out = kubectl_output(kubeconfig, &["apply", "-f", "-"], Some(manifests));
    if !out.status.success() {
        bail!("kubectl apply: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Waits until every Strait workload of the cluster is rolled out and Ready.
pub fn wait_installed(kubeconfig: &Path) -> anyhow::Result<()> {
    for (namespace, workload) in [
        ("strait-system", "deploy/strait-identity"),
        ("strait-system", "ds/strait-proxy"),
        ("strait-system", "deploy/strait-gateway"),
        ("strait-multicluster", "deploy/strait-mirror"),
    ] {
        kubectl_until(
            kubeconfig,
            &[
                "rollout",
                "status",
                "-n",
                namespace,
                workload,
                "--timeout=10s",
            ],
            Duration::from_secs(180),
        )?;
    }
    Ok(())
}

impl InstalledMesh {
    /// Builds the images from the binaries in `bin_dir` (debug or release),
    /// starts both clusters with `nodes` real nodes each, installs Strait in
    /// both with the `strait` CLI at `strait`, and links east to west.
    pub async fn start(strait: &Path, bin_dir: &Path, nodes: usize) -> anyhow::Result<Self> {
        let started = Instant::now();
        let bins = bin_dir.to_path_buf();
        let archives = tokio::task::spawn_blocking(move || {
            let mut all = images::node_archives(&bins)?;
            all.extend(images::strait_archives(&bins)?);
            Ok::<_, images::ImageError>(all)
        })
        .await
        .expect("image build task panicked")?;
        let config = |name: &str, service_cidr: &str| {
            let mut config = ClusterConfig::new(name);
            config.real_nodes = true;
            config.node_images = archives.clone();
            config.service_cidr = service_cidr.into();
            config
        };
        let (east, west) = tokio::try_join!(
            ClusterTopology::start_with(config("east", "10.96.0.0/16"), nodes),
            ClusterTopology::start_with(config("west", "10.97.0.0/16"), nodes),
        )?;
        let wan = Wan::connect(&[east.network(), west.network()])?;
        tracing::info!(elapsed = ?started.elapsed(), "real-node clusters up");

        let work = tempfile::Builder::new()
            .prefix("strait-installed-")
            .tempdir()?;
        let path = |p: &str| work.path().join(p).display().to_string();
        run_strait(
            strait,
            &["identity", "trust-anchor", "--out-dir", &path("anchor")],
        )?;
        for cluster in [&east, &west] {
            let name = cluster.cluster().name();
            run_strait(
                strait,
                &[
                    "identity",
                    "issuer",
                    "--anchor-cert",
                    &path("anchor/ca.crt"),
                    "--anchor-key",
                    &path("anchor/ca.key"),
                    "--cluster",
                    name,
                    "--out-dir",
                    &path(name),
                ],
            )?;
            let manifests = run_strait(
                strait,
                &[
                    "install",
                    "--identity-dir",
                    &path(name),
                    "--gateway-service-type",
                    "NodePort",
                ],
            )?;
            apply(&cluster.cluster().kubeconfig_path(), &manifests)?;
        }
        for cluster in [&east, &west] {
            let kubeconfig = cluster.cluster().kubeconfig_path();
            tokio::task::spawn_blocking(move || wait_installed(&kubeconfig))
                .await
                .expect("wait task panicked")
                .with_context(|| format!("installing Strait in {}", cluster.cluster().name()))?;
        }
        tracing::info!(elapsed = ?started.elapsed(), "Strait installed in east and west");

        // What west shows the WAN: its gateway's NodePort on its first node,
        // and its API server behind the LAN router.
        let gateway_node = west.node(0)?.clone();
        wan.expose_node(&gateway_node, &[GATEWAY_NODE_PORT])?;
        let api = west
            .cluster()
            .server_url()
            .trim_start_matches("https://")
            .parse::<SocketAddr>()
            .context("west's API server address")?;
        let api_endpoint = west.network().forward_from_router(
            API_ENDPOINT_PORT,
            api,
            &west.cluster().dir().join("logs").join("api-endpoint.log"),
        )?;
        wan.expose_router(west.network(), &[API_ENDPOINT_PORT])?;

        let link = run_strait(
            strait,
            &[
                "link",
                "--kubeconfig",
                &west.cluster().kubeconfig_path().display().to_string(),
                "--context",
                "west",
                "--cluster-name",
                "west",
                "--api-server-address",
                &format!("https://{}:{API_ENDPOINT_PORT}", west.network().router_ip()),
                "--gateway-addresses",
                &gateway_node.ip().to_string(),
            ],
        )?;
        apply(&east.cluster().kubeconfig_path(), &link)?;
        tracing::info!(elapsed = ?started.elapsed(), "east linked to west");
        Ok(Self {
            api_endpoint,
            wan,
            east,
            west,
            strait: strait.to_path_buf(),
            work,
        })
    }

    /// The `strait` CLI this mesh was installed with.
    pub fn strait(&self, args: &[&str]) -> anyhow::Result<String> {
        run_strait(&self.strait, args)
    }

    /// The trust anchor and issuers' files.
    pub fn identity_dir(&self) -> &Path {
        self.work.path()
    }

    /// West's gateway address as linked clusters dial it.
    pub fn gateway_address(&self) -> anyhow::Result<SocketAddr> {
        Ok(SocketAddr::new(
            IpAddr::V4(self.west.node(0)?.ip()),
            GATEWAY_NODE_PORT,
        ))
    }

    /// Pid of the API endpoint process (for leak checks).
    pub fn api_endpoint_pid(&self) -> Option<u32> {
        self.api_endpoint.pid()
    }
}
