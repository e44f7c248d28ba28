//! One real Kubernetes control plane: etcd, kube-apiserver and
//! kube-controller-manager, each its own process, on free ports in a temp folder.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};

mod components;

use crate::controlplane;
use crate::kubeconfig;
use crate::pki::{ClusterPki, PkiFiles};
use crate::process::{ChildProcess, log_tail};

/// Controllers testenv runs. No kubelet and no scheduler exist, so workload
/// controllers (deployment, replicaset, …) would only create Pods nobody runs.
pub const CONTROLLERS: &[&str] = &[
    "endpointslice-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "namespace-controller",
    "garbage-collector-controller",
    "root-ca-certificate-publisher-controller",
];

/// How long a component may take to become ready before start-up fails.
const READY_TIMEOUT: Duration = Duration::from_secs(90);

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Build(#[from] controlplane::BuildError),
    #[error("cluster {cluster}: cannot prepare {what}: {source}")]
    Setup {
        cluster: String,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("cluster {cluster}: cannot make certificates: {source}")]
    Pki {
        cluster: String,
        #[source]
        source: rcgen::Error,
    },
    #[error("cluster {cluster}: cannot start {component}: {source}")]
    Spawn {
        cluster: String,
        component: &'static str,
        source: std::io::Error,
    },
    #[error(
        "cluster {cluster}: {component} exited during start-up ({status}); last lines of {log}:\n{tail}",
        log = .log.display()
    )]
    Exited {
        cluster: String,
        component: &'static str,
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error(
        "cluster {cluster}: {component} not ready after {}s ({what}); last lines of {log}:\n{tail}",
        READY_TIMEOUT.as_secs(), log = .log.display()
    )]
    NotReady {
        cluster: String,
        component: &'static str,
        what: String,
        log: PathBuf,
        tail: String,
    },
    #[error("cluster {cluster}: cannot build a client: {message}")]
    Client { cluster: String, message: String },
}

impl ClusterError {
    /// A port picked as free was taken by someone else before the component bound it.
    fn is_port_race(&self) -> bool {
        match self {
            ClusterError::Exited { tail, .. } | ClusterError::NotReady { tail, .. } => {
                tail.contains("address already in use")
            }
            _ => false,
        }
    }
}

/// What to start. `ClusterConfig::new("east")` gives sensible defaults.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Cluster name: the kubeconfig context, and part of every log line.
    pub name: String,
    /// Address the API server listens on and advertises. 127.0.0.1 by default;
    /// node network namespaces need an address on their bridge instead.
    pub bind_address: IpAddr,
    /// Service ClusterIP range. Linked clusters should not overlap.
    pub service_cidr: String,
    /// Service-account token issuer (`iss` of every token this cluster signs).
    pub service_account_issuer: String,
    /// Extra API server flags (`--flag=value`), appended last so they win.
    pub extra_apiserver_args: Vec<String>,
    /// Run the cluster for real kubelets ([`crate::realnode`]): the Node
    /// authorizer and NodeRestriction, the API server's client certificate
    /// for kubelets, the `kubernetes` Service's endpoints, every controller,
    /// a kube-scheduler and CoreDNS (cluster DNS at the Service range's `.10`).
    /// Needs a `bind_address` that nodes reach (see [`crate::ClusterTopology`]).
    pub real_nodes: bool,
    /// OCI image archives imported into every real node before its kubelet
    /// starts (the pause image first; see [`crate::images::node_archives`]).
    pub node_images: Vec<PathBuf>,
    /// More addresses the API server's certificate names (an endpoint in
    /// front of it, such as the LAN router other clusters reach it at).
    pub extra_sans: Vec<IpAddr>,
}

impl ClusterConfig {
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            bind_address: IpAddr::V4(Ipv4Addr::LOCALHOST),
            service_cidr: "10.96.0.0/16".into(),
            service_account_issuer: "https://kubernetes.default.svc.cluster.local".into(),
            extra_apiserver_args: Vec::new(),
            real_nodes: false,
            node_images: Vec::new(),
            extra_sans: Vec::new(),
        }
    }

    /// The `offset`-th address of the Service range: 1 is the `kubernetes`
    /// Service (the API server's in-cluster address), 10 the cluster DNS.
    pub fn service_ip(&self, offset: u32) -> Ipv4Addr {
        let base = self
            .service_cidr
            .split('/')
            .next()
            .and_then(|ip| ip.parse::<Ipv4Addr>().ok())
            .unwrap_or(Ipv4Addr::new(10, 96, 0, 0));
        Ipv4Addr::from(u32::from(base) + offset)
    }
}

/// Ports handed out in this process, so two clusters of one test never draw the same one.
static HANDED_OUT: Mutex<Vec<u16>> = Mutex::new(Vec::new());

/// A free TCP port on `ip`, never one handed out before in this process.
pub fn free_port(ip: IpAddr) -> std::io::Result<u16> {
    let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..64 {
        let port = TcpListener::bind(SocketAddr::new(ip, 0))?
            .local_addr()?
            .port();
        if !handed.contains(&port) {
            handed.push(port);
            return Ok(port);
        }
    }
    Err(std::io::Error::other("no free port after 64 tries"))
}

#[derive(Clone, Copy, Debug)]
struct Ports {
    etcd_client: u16,
    etcd_peer: u16,
    apiserver: u16,
    controller_manager: u16,
    scheduler: u16,
    coredns_ready: u16,
}

/// A running cluster. Dropping it kills every process it started; if the
/// current thread is panicking (a failed test) it first prints the tail of each
/// component's log and keeps the folder for inspection.
pub struct Cluster {
    config: ClusterConfig,
    binary: PathBuf,
    dir: Option<tempfile::TempDir>,
    root: PathBuf,
    pki_files: PkiFiles,
    pki: ClusterPki,
    ports: Ports,
    etcd: Option<ChildProcess>,
    apiserver: Option<ChildProcess>,
    controller_manager: Option<ChildProcess>,
    /// Real-node clusters only.
    scheduler: Option<ChildProcess>,
    coredns: Option<ChildProcess>,
    /// Copies the `kube-system/coredns` ConfigMap to CoreDNS's Corefile.
    corefile_sync: Option<tokio::task::JoinHandle<()>>,
    admin_kubeconfig: Kubeconfig,
    client: Client,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("name", &self.config.name)
            .field("server", &self.server_url())
            .field("dir", &self.root)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Starts a cluster named `name` with default settings.
    pub async fn start(name: &str) -> Result<Self, ClusterError> {
        Self::start_with(ClusterConfig::new(name)).await
    }

    /// Starts a cluster; retries with new ports if another process took one of
    /// the free ports first (parallel test processes).
    pub async fn start_with(config: ClusterConfig) -> Result<Self, ClusterError> {
        let binary = tokio::task::spawn_blocking(controlplane::ensure_built)
            .await
            .expect("control-plane build task panicked")?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::start_once(config.clone(), binary.clone()).await {
                Err(e) if attempt < 3 && e.is_port_race() => {
                    tracing::warn!(cluster = %config.name, "port taken during start-up, retrying with new ports");
                }
                other => return other,
            }
        }
    }

    async fn start_once(config: ClusterConfig, binary: PathBuf) -> Result<Self, ClusterError> {
        let started = Instant::now();
        let name = config.name.clone();
        let setup = |what: &'static str| {
            let cluster = name.clone();
            move |source| ClusterError::Setup {
                cluster,
                what,
                source,
            }
        };
        let dir = tempfile::Builder::new()
            .prefix(&format!("strait-testenv-{name}-"))
            .tempdir()
            .map_err(setup("a temp folder"))?;
        let root = dir.path().to_path_buf();
        std::fs::create_dir_all(root.join("logs")).map_err(setup("the logs folder"))?;

        let ip = config.bind_address;
        let ports = Ports {
            etcd_client: free_port(IpAddr::V4(Ipv4Addr::LOCALHOST)).map_err(setup("ports"))?,
            etcd_peer: free_port(IpAddr::V4(Ipv4Addr::LOCALHOST)).map_err(setup("ports"))?,
            apiserver: free_port(ip).map_err(setup("ports"))?,
            controller_manager: free_port(IpAddr::V4(Ipv4Addr::LOCALHOST))
                .map_err(setup("ports"))?,
            scheduler: free_port(IpAddr::V4(Ipv4Addr::LOCALHOST)).map_err(setup("ports"))?,
            coredns_ready: free_port(IpAddr::V4(Ipv4Addr::LOCALHOST)).map_err(setup("ports"))?,
        };
        // Pods reach the API server at the `kubernetes` Service's address.
        let mut ips = vec![
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V4(config.service_ip(1)),
        ];
        for extra in std::iter::once(ip).chain(config.extra_sans.iter().copied()) {
            if !ips.contains(&extra) {
                ips.push(extra);
            }
        }
        let pki = ClusterPki::generate(&name, &ips).map_err(|source| ClusterError::Pki {
            cluster: name.clone(),
            source,
        })?;
        let pki_files = pki
            .write_to(&root.join("pki"))
            .map_err(setup("certificate files"))?;
        if config.real_nodes {
            // The API server's client identity towards kubelets (logs, exec).
            let kubelet_client = pki
                .client_cert("kube-apiserver-kubelet-client", Some("system:masters"))
                .map_err(|source| ClusterError::Pki {
                    cluster: name.clone(),
                    source,
                })?;
            let path = root.join("pki").join("kubelet-client");
            std::fs::write(path.with_extension("crt"), &kubelet_client.cert_pem)
                .map_err(setup("certificate files"))?;
            crate::files::write_private(&path.with_extension("key"), &kubelet_client.key_pem)
                .map_err(|e| std::io::Error::other(e.to_string()))
                .map_err(setup("certificate files"))?;
        }

        let server = format!("https://{}", SocketAddr::new(ip, ports.apiserver));
        let admin_kubeconfig = kubeconfig::with_client_cert(
            &name,
            &server,
            &pki.ca.cert_pem,
            &pki.admin.cert_pem,
            &pki.admin.key_pem,
        );
        let kcm_kubeconfig = kubeconfig::with_client_cert(
            &name,
            &server,
            &pki.ca.cert_pem,
            &pki.controller_manager.cert_pem,
            &pki.controller_manager.key_pem,
        );
        for (file, config) in [
            ("admin.kubeconfig", &admin_kubeconfig),
            ("controller-manager.kubeconfig", &kcm_kubeconfig),
        ] {
            let yaml = kubeconfig::to_yaml(config).map_err(|e| ClusterError::Client {
                cluster: name.clone(),
                message: e.to_string(),
            })?;
            std::fs::write(root.join(file), yaml).map_err(setup("kubeconfig files"))?;
        }
        let client = client_from(&name, admin_kubeconfig.clone()).await?;

        let mut cluster = Cluster {
            config,
            binary,
            dir: Some(dir),
            root,
            pki_files,
            pki,
            ports,
            etcd: None,
            apiserver: None,
            controller_manager: None,
            scheduler: None,
            coredns: None,
            corefile_sync: None,
            admin_kubeconfig,
            client,
        };
        cluster.start_etcd().await?;
        cluster.start_apiserver().await?;
        cluster.start_controller_manager().await?;
        if cluster.config.real_nodes {
            cluster.start_scheduler()?;
            cluster.start_coredns().await?;
        }
        tracing::info!(cluster = %name, server = %cluster.server_url(), elapsed_ms = started.elapsed().as_millis() as u64, "cluster ready");
        Ok(cluster)
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// What the cluster was started with.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// The cluster's certificates (to sign client certificates for nodes).
    pub fn pki(&self) -> &ClusterPki {
        &self.pki
    }

    /// The `strait-controlplane` binary the cluster runs (also kubelets').
    pub fn controlplane_binary(&self) -> &Path {
        &self.binary
    }

    /// A kubeconfig file in the cluster folder for user `common_name` (in
    /// group `organization`) with a fresh client certificate.
    pub fn write_client_kubeconfig(
        &self,
        file: &str,
        common_name: &str,
        organization: Option<&str>,
    ) -> Result<PathBuf, ClusterError> {
        let cert = self
            .pki
            .client_cert(common_name, organization)
            .map_err(|source| ClusterError::Pki {
                cluster: self.config.name.clone(),
                source,
            })?;
        let config = kubeconfig::with_client_cert(
            &self.config.name,
            &self.server_url(),
            &self.pki.ca.cert_pem,
            &cert.cert_pem,
            &cert.key_pem,
        );
        let yaml = kubeconfig::to_yaml(&config).map_err(|e| ClusterError::Client {
            cluster: self.config.name.clone(),
            message: e.to_string(),
        })?;
        let path = self.root.join(file);
        crate::files::write_private(&path, &yaml).map_err(|e| ClusterError::Setup {
            cluster: self.config.name.clone(),
            what: "a kubeconfig file",
            source: std::io::Error::other(e.to_string()),
        })?;
        Ok(path)
    }

    /// A client with cluster-admin rights.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The admin kubeconfig (one context, named after the cluster).
    pub fn kubeconfig(&self) -> &Kubeconfig {
        &self.admin_kubeconfig
    }

    /// Path of the admin kubeconfig file, for `kubectl --kubeconfig`.
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.root.join("admin.kubeconfig")
    }

    /// `https://IP:PORT` of the API server.
    pub fn server_url(&self) -> String {
        format!(
            "https://{}",
            SocketAddr::new(self.config.bind_address, self.ports.apiserver)
        )
    }

    /// PEM of the CA that signed the API server's certificate (also the client CA).
    pub fn ca_pem(&self) -> &str {
        &self.pki.ca.cert_pem
    }

    /// A client that authenticates with a bearer token (e.g. a ServiceAccount's).
    pub async fn client_with_token(&self, token: &str) -> Result<Client, ClusterError> {
        client_from(
            &self.config.name,
            kubeconfig::with_token(&self.config.name, &self.server_url(), self.ca_pem(), token),
        )
        .await
    }

    /// The folder holding this cluster's data, PKI and logs.
    pub fn dir(&self) -> &Path {
        &self.root
    }

    /// The component log files, for people and for failing tests.
    pub fn log_files(&self) -> Vec<PathBuf> {
        let mut components = vec!["etcd", "kube-apiserver", "kube-controller-manager"];
        if self.config.real_nodes {
            components.extend(["kube-scheduler", "coredns"]);
        }
        components
            .iter()
            .map(|c| self.root.join("logs").join(format!("{c}.log")))
            .collect()
    }

    /// Process ids of the running components (for leak checks).
    pub fn pids(&self) -> Vec<u32> {
        self.components().into_iter().map(|(_, pid)| pid).collect()
    }

    /// The running components by name (`etcd`, `kube-apiserver`, …) and
    /// process id: where a benchmark's control-plane CPU goes.
    pub fn components(&self) -> Vec<(&'static str, u32)> {
        [
            ("etcd", &self.etcd),
            ("kube-apiserver", &self.apiserver),
            ("kube-controller-manager", &self.controller_manager),
            ("kube-scheduler", &self.scheduler),
            ("coredns", &self.coredns),
        ]
        .into_iter()
        .filter_map(|(name, c)| Some((name, c.as_ref().and_then(ChildProcess::pid)?)))
        .collect()
    }

    /// Stops every component and removes the folder (unless kept for a failure).
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        if let Some(sync) = self.corefile_sync.take() {
            sync.abort();
        }
        // Clients first, then the store.
        for child in [
            &mut self.coredns,
            &mut self.scheduler,
            &mut self.controller_manager,
            &mut self.apiserver,
            &mut self.etcd,
        ] {
            if let Some(mut c) = child.take() {
                c.stop(Duration::ZERO);
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let keep = std::thread::panicking() || std::env::var_os("STRAIT_TESTENV_KEEP").is_some();
        if std::thread::panicking() {
            for log in self.log_files() {
                eprintln!(
                    "──── cluster {} · {} (last 30 lines) ────\n{}",
                    self.config.name,
                    log.display(),
                    log_tail(&log, 30)
                );
            }
        }
        self.stop_all();
        if keep && let Some(dir) = self.dir.take() {
            let path = dir.keep();
            eprintln!(
                "[testenv] kept cluster {} files in {}",
                self.config.name,
                path.display()
            );
        }
    }
}

async fn client_from(name: &str, config: Kubeconfig) -> Result<Client, ClusterError> {
    let err = |message: String| ClusterError::Client {
        cluster: name.to_string(),
        message,
    };
    let options = KubeConfigOptions {
        context: Some(name.to_string()),
        ..Default::default()
    };
    let mut config = kube::Config::from_custom_kubeconfig(config, &options)
        .await
        .map_err(|e| err(e.to_string()))?;
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(60));
    Client::try_from(config).map_err(|e| err(e.to_string()))
}

/// Polls `probe` until it succeeds, the process exits, or [`READY_TIMEOUT`] passes.
async fn wait_ready<F, Fut>(
    cluster: &str,
    component: &'static str,
    child: &mut ChildProcess,
    mut probe: F,
) -> Result<(), ClusterError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut delay = Duration::from_millis(20);
    loop {
        if let Some(status) = child.try_exit_status() {
            return Err(ClusterError::Exited {
                cluster: cluster.to_string(),
                component,
                status: status.to_string(),
                log: child.log_path().to_path_buf(),
                tail: log_tail(child.log_path(), 40),
            });
        }
        let last = match probe().await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Err(ClusterError::NotReady {
                cluster: cluster.to_string(),
                component,
                what: last,
                log: child.log_path().to_path_buf(),
                tail: log_tail(child.log_path(), 40),
            });
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(200));
    }
}
