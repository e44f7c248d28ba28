//! Real Kubernetes worker nodes: containerd + runc, a kubelet and kube-proxy
//! inside a node's network namespace ([`crate::net`]), as on a machine of its own.
//!
//! ```text
//!  node netns (eth0 10.S.0.(10+n), pods 10.S.n.0/24)
//!  └─ own mount namespace (held by an anchor process; its mounts shared among
//!     themselves and the node's containers, as systemd leaves a host)
//!     /run              tmpfs            (containerd's shim sockets, pods' /run/netns,
//!                                        iptables lock)
//!     /etc /var /opt    overlays         lower: the host's, upper: <node dir>/overlay/…
//!     /var/lib/containerd  bind <node dir>/containerd (ext4: the overlayfs snapshotter
//!                                        cannot put its layers on an overlay)
//!     /proc/sys/{vm,kernel}/…  bind-mounted files: the kubelet's host-global sysctls
//!     containerd, kubelet, kube-proxy, containerd-shim-runc-v2 and every container
//!  cgroups: /strait-node-S-n in every v1 hierarchy (+ unified): `system/` holds the
//!  daemons (and so the shims they start), `kubepods/` the kubelet's pods
//! ```
//!
//! Why each piece (the facts behind them are in `shared/notes/real-nodes.md`):
//! - the node's writes to `/etc`, `/var`, `/opt` and `/run` land in its own
//!   folder, so two nodes on one host never share CNI state, kubelet state or
//!   logs, and nothing is written outside the work folder;
//! - the kubelet writes host-global sysctls (`vm.overcommit_memory`,
//!   `kernel.panic`, …) at start; the bind-mounted files hold the values it wants,
//!   so it reads them, finds nothing to change and the host keeps its own;
//! - this kind of machine lacks CAP_SYS_RESOURCE: containerd's CRI
//!   `restrict_oom_score_adj` keeps runc from lowering `oom_score_adj`;
//! - the cgroup tree is what tear-down kills: containerd's shims re-parent to
//!   init and outlive containerd, but never leave the node's cgroup.
//!
//! Pods get addresses from the CNI `ptp` plugin (veth per pod, `/32` routes, the
//! node's pod gateway `10.S.n.1`), as kind's kindnet does, with host-local IPAM
//! over the node's pod range; `portmap` serves hostPorts.

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};

use crate::net::{NetNode, is_root};
use crate::process::{ChildProcess, log_tail};

/// The sandbox ("pause") image every pod starts with; built by [`crate::images`]
/// and imported into each node before its kubelet starts.
pub const PAUSE_IMAGE: &str = "strait.local/pause:3.10";

/// Where Debian's `containernetworking-plugins` puts the CNI plugins.
const CNI_PLUGIN_DIR: &str = "/usr/lib/cni";
const CNI_PLUGINS: &[&str] = &["ptp", "host-local", "portmap", "loopback", "bridge"];

/// Prefix of every node's cgroup (`/strait-node-<slot>-<n>`).
pub const CGROUP_PREFIX: &str = "strait-node-";

/// How long a node may take from its kubelet's start to `Ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// The values the kubelet wants for the host-global sysctls it sets at start
/// (`setupKernelTunables`): given to it in files bind-mounted over
/// `/proc/sys/...` in the node's mount namespace, so the host's stay.
const KUBELET_SYSCTLS: &[(&str, &str)] = &[
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("real nodes need {what}, which is missing: {fix}")]
    Missing { what: String, fix: String },
    #[error("node {node}: cannot {what}: {message}")]
    Setup {
        node: String,
        what: String,
        message: String,
    },
    #[error(
        "node {node}: {component} exited ({status}); last lines of {log}:\n{tail}",
        log = .log.display()
    )]
    Exited {
        node: String,
        component: String,
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error(
        "node {node}: not Ready after {}s ({what}); last lines of the kubelet's log {log}:\n{tail}",
        READY_TIMEOUT.as_secs(), log = .log.display()
    )]
    NotReady {
        node: String,
        what: String,
        log: PathBuf,
        tail: String,
    },
    #[error(
        "port {port}/{protocol} is taken on every address of this host{holder}: real-node clusters run \
         {component} on port {port} of their LAN address; stop that program, or make it listen on \
         specific addresses only (dnsmasq: `bind-interfaces`; systemd-resolved's 127.0.0.53 is fine)"
    )]
    PortInUse {
        port: u16,
        protocol: &'static str,
        component: &'static str,
        /// `, by <ss output>` when `ss` names the socket's owner.
        holder: String,
    },
}

/// Ports a real-node cluster's own services bind on the host, at the
/// cluster's LAN address (the API server's port is picked free).
const HOST_PORTS: &[(u16, &str)] = &[(53, "CoreDNS (cluster DNS)")];

/// Fails if a socket bound to every address (0.0.0.0, or a dual-stack `::`)
/// holds one of [`HOST_PORTS`]: the cluster's bind to its LAN address would
/// then fail half-way through `up`. The probe binds a documentation address
/// (RFC 5737) with IP_FREEBIND, which the kernel refuses exactly when it would
/// refuse the LAN address, and needs no address of the host.
pub fn check_host_ports() -> Result<(), NodeError> {
    use socket2::{Domain, Protocol, Socket, Type};
    for &(port, component) in HOST_PORTS {
        let probe = std::net::SocketAddr::from(([192, 0, 2, 1], port));
        for (ty, proto, protocol) in [
            (Type::STREAM, Protocol::TCP, "tcp"),
            (Type::DGRAM, Protocol::UDP, "udp"),
        ] {
            let setup = |e: std::io::Error| NodeError::Setup {
                node: "(host)".into(),
                what: format!("probe port {port}/{protocol}"),
                message: e.to_string(),
            };
            let socket = Socket::new(Domain::IPV4, ty, Some(proto)).map_err(setup)?;
            socket.set_freebind_v4(true).map_err(setup)?;
            match socket.bind(&probe.into()) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                    return Err(NodeError::PortInUse {
                        port,
                        protocol,
                        component,
                        holder: port_holder(port, protocol),
                    });
                }
                Err(e) => return Err(setup(e)),
            }
        }
    }
    Ok(())
}

/// Who holds a port, as `ss` tells it (best effort: empty if it cannot).
fn port_holder(port: u16, protocol: &str) -> String {
    let flag = if protocol == "tcp" {
        "-Hlnpt"
    } else {
        "-Hlnpu"
    };
    let out = Command::new("ss")
        .args([flag, &format!("sport = :{port}")])
        .output();
    match out {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            let lines: Vec<&str> = text
                .lines()
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
                .filter_map(|words| {
                    // One protocol, no header: state, queues, local, peer, process.
                    let local = words.get(3)?;
                    let wildcard = ["0.0.0.0:", "*:", "[::]:"]
                        .iter()
                        .any(|p| local.starts_with(p));
                    wildcard.then(|| words.get(5).copied()).flatten()
                })
                .collect();
            if lines.is_empty() {
                String::new()
            } else {
                format!(", by {}", lines.join(" "))
            }
        }
        _ => String::new(),
    }
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path)
            .any(|dir| std::fs::metadata(dir.join(program)).is_ok_and(|m| m.is_file()))
    })
}

/// Checks, before anything starts, that this host can run real nodes; the
/// error names what to install or change.
pub fn preflight() -> Result<(), NodeError> {
    let missing = |what: &str, fix: &str| NodeError::Missing {
        what: what.into(),
        fix: fix.into(),
    };
    if !is_root() {
        return Err(missing(
            "root",
            "run as root (containerd, the kubelet and network namespaces need it), as CI does",
        ));
    }
    for (program, package) in [
        ("containerd", "containerd"),
        ("ctr", "containerd"),
        ("runc", "runc"),
        ("iptables", "iptables"),
        ("iptables-restore", "iptables"),
        ("conntrack", "conntrack"),
        ("nsenter", "util-linux"),
        ("unshare", "util-linux"),
        ("mount", "mount"),
    ] {
        if !on_path(program) {
            return Err(missing(
                &format!("`{program}`"),
                &format!(
                    "apt-get install {package} (scripts/lib.sh installs it with the other packages)"
                ),
            ));
        }
    }
    for plugin in CNI_PLUGINS {
        let path = Path::new(CNI_PLUGIN_DIR).join(plugin);
        if !path.exists() {
            return Err(missing(
                &format!("the CNI plugin {}", path.display()),
                "apt-get install containernetworking-plugins",
            ));
        }
    }
    let hierarchies = cgroup_hierarchies();
    for controller in ["memory", "cpu", "cpuset", "pids", "freezer", "devices"] {
        if !hierarchies
            .iter()
            .any(|h| h.controllers.iter().any(|c| c == controller))
        {
            return Err(missing(
                &format!("the cgroup v1 `{controller}` hierarchy under /sys/fs/cgroup"),
                "testenv's kubelet runs on cgroup v1 (hybrid hosts such as this project's machines); \
                 on a cgroup-v2-only host use kind (testenv/kind/up.sh)",
            ));
        }
    }
    // The node's writes go to overlays on these (mkdir of a missing one would
    // write on the host).
    for top in ["/etc", "/var", "/opt"] {
        if !Path::new(top).is_dir() {
            return Err(missing(
                &format!("the folder {top}"),
                &format!("create {top} (a standard folder; real nodes overlay it with their own)"),
            ));
        }
    }
    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !filesystems.lines().any(|l| l.ends_with("\toverlay")) {
        return Err(missing(
            "the overlay filesystem",
            "a kernel with overlayfs (containerd's snapshotter and the node's /etc, /var overlays use it)",
        ));
    }
    check_host_ports()
}

/// A mounted cgroup hierarchy: its folder and its controllers.
#[derive(Clone, Debug)]
struct Hierarchy {
    path: PathBuf,
    controllers: Vec<String>,
}

/// The cgroup hierarchies mounted under /sys/fs/cgroup (v1 ones and the
/// hybrid `unified` v2 one), from /proc/self/mountinfo.
fn cgroup_hierarchies() -> Vec<Hierarchy> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut out: Vec<Hierarchy> = Vec::new();
    for line in info.lines() {
        let Some((before, after)) = line.split_once(" - ") else {
            continue;
        };
        let mount_point = before.split_whitespace().nth(4).unwrap_or("");
        let mut fields = after.split_whitespace();
        let fstype = fields.next().unwrap_or("");
        let super_options = fields.nth(1).unwrap_or("");
        if !mount_point.starts_with("/sys/fs/cgroup/") || !fstype.starts_with("cgroup") {
            continue;
        }
        let controllers = if fstype == "cgroup2" {
            vec!["unified".to_string()]
        } else {
            super_options
                .split(',')
                .filter(|o| *o != "rw" && *o != "ro")
                .map(str::to_string)
                .collect()
        };
        if !out.iter().any(|h| h.path == Path::new(mount_point)) {
            out.push(Hierarchy {
                path: mount_point.into(),
                controllers,
            });
        }
    }
    out
}

/// One node's cgroup, `/<name>` in every hierarchy.
#[derive(Debug)]
struct NodeCgroup {
    name: String,
    hierarchies: Vec<Hierarchy>,
}

impl NodeCgroup {
    /// Creates the cgroup; one left by an earlier run that was killed outright
    /// (same slot and node number: its network is gone) is emptied first.
    fn create(name: &str) -> std::io::Result<Self> {
        let cgroup = Self {
            name: name.into(),
            hierarchies: cgroup_hierarchies(),
        };
        if cgroup.exists() {
            tracing::warn!(
                cgroup = name,
                "removing a node cgroup left by an earlier run"
            );
            cgroup.kill_all(Duration::from_secs(15));
            cgroup.remove();
        }
        for h in &cgroup.hierarchies {
            for dir in [h.path.join(name), h.path.join(name).join("system")] {
                std::fs::create_dir_all(&dir)?;
                if h.controllers.iter().any(|c| c == "cpuset") {
                    // A cpuset cgroup without cpus and mems takes no tasks.
                    let parent = dir.parent().expect("a cgroup below the root");
                    for file in ["cpuset.cpus", "cpuset.mems"] {
                        let value = std::fs::read_to_string(parent.join(file))?;
                        std::fs::write(dir.join(file), value.trim())?;
                    }
                }
            }
        }
        Ok(cgroup)
    }

    fn exists(&self) -> bool {
        self.hierarchies
            .iter()
            .any(|h| h.path.join(&self.name).exists())
    }

    /// Moves `pid` (a node daemon) into `/<name>/system` everywhere; what it
    /// starts later (containerd's shims) is born there.
    fn adopt(&self, pid: u32) -> std::io::Result<()> {
        for h in &self.hierarchies {
            let procs = h.path.join(&self.name).join("system").join("cgroup.procs");
            std::fs::write(&procs, pid.to_string()).map_err(|e| {
                std::io::Error::other(format!("write {pid} to {}: {e}", procs.display()))
            })?;
        }
        Ok(())
    }

    /// Every process in the cgroup or below it, in any hierarchy.
    fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .hierarchies
            .iter()
            .flat_map(|h| cgroup_tree(&h.path.join(&self.name)))
            .flat_map(|dir| cgroup_procs(&dir))
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// SIGKILLs everything in the cgroup until it is empty (or `limit` passes).
    fn kill_all(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return true;
            }
            if Instant::now() >= deadline {
                tracing::warn!(cgroup = %self.name, ?pids, "processes survived SIGKILL");
                return false;
            }
            for pid in pids {
                crate::process::kill(pid);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Removes the (empty) cgroup folders, deepest first.
    fn remove(&self) {
        for h in &self.hierarchies {
            for dir in cgroup_tree(&h.path.join(&self.name)).iter().rev() {
                // A cgroup whose last task is still exiting is busy for a moment.
                for _ in 0..50 {
                    match std::fs::remove_dir(dir) {
                        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        _ => break,
                    }
                }
            }
        }
    }
}

/// `root` and every folder below it, parents before their children.
fn cgroup_tree(root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            stack.extend(
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
        dirs.push(dir);
    }
    dirs
}

/// The processes directly in cgroup `dir`.
fn cgroup_procs(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// Node cgroups on this host whose cluster network is gone: left behind by a
/// run that was killed outright (its shims and containers may still run).
/// Kills what is in them and removes them; returns their names.
pub fn sweep_stale_cgroups() -> Vec<String> {
    let Some(pids) = cgroup_hierarchies()
        .into_iter()
        .find(|h| h.controllers.iter().any(|c| c == "pids"))
    else {
        return Vec::new();
    };
    let mut swept = Vec::new();
    for entry in std::fs::read_dir(&pids.path)
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(CGROUP_PREFIX) else {
            continue;
        };
        let slot = rest.split('-').next().unwrap_or("");
        let lan = format!("{}{slot}", crate::net::HOST_IF_PREFIX);
        if Path::new("/sys/class/net").join(&lan).exists() {
            continue; // a live cluster network: its owner cleans up
        }
        let cgroup = NodeCgroup {
            name: name.clone(),
            hierarchies: cgroup_hierarchies(),
        };
        cgroup.kill_all(Duration::from_secs(15));
        cgroup.remove();
        swept.push(name);
    }
    swept
}

/// What a node needs from its cluster.
#[derive(Clone, Debug)]
pub struct NodeSpec {
    /// Node name (also its hostname for the kubelet).
    pub name: String,
    /// `https://IP:PORT` of the API server, reachable from the node.
    pub server: String,
    /// PEM of the cluster CA (API server certificate and client certificates).
    pub ca_pem: String,
    /// Client certificate and key for `system:node:<name>` in `system:nodes`.
    pub kubelet_cert: crate::pki::CertPair,
    /// Client certificate and key for `system:kube-proxy`.
    pub kube_proxy_cert: crate::pki::CertPair,
    /// The cluster DNS Service address (kubelet `clusterDNS`).
    pub cluster_dns: Ipv4Addr,
    /// Every pod and node address of the cluster (kube-proxy `clusterCIDR`).
    pub cluster_cidr: String,
    /// The `strait-controlplane` binary (kubelet, kube-proxy).
    pub controlplane: PathBuf,
    /// Image archives (OCI) to import before the kubelet starts; the pause
    /// image must be one of them.
    pub images: Vec<PathBuf>,
}

/// A running real node. Dropping it stops the kubelet and kube-proxy, kills
/// containerd, every shim and every container (by cgroup), and with the last
/// process its mount namespace and every mount in it.
#[derive(Debug)]
pub struct RealNode {
    name: String,
    net: NetNode,
    dir: PathBuf,
    cgroup: NodeCgroup,
    mounts: Option<ChildProcess>,
    containerd: Option<ChildProcess>,
    kubelet: Option<ChildProcess>,
    kube_proxy: Option<ChildProcess>,
}

impl RealNode {
    /// Starts containerd, imports `spec.images`, starts the kubelet and
    /// kube-proxy in `net`'s namespace, with files under `dir`. Blocking; does
    /// not wait for `Ready` (see [`RealNode::wait_ready`]).
    pub fn start(net: &NetNode, spec: &NodeSpec, dir: &Path) -> Result<Self, NodeError> {
        preflight()?;
        let name = spec.name.clone();
        let setup = |what: &str| {
            let node = name.clone();
            let what = what.to_string();
            move |e: std::io::Error| NodeError::Setup {
                node,
                what,
                message: e.to_string(),
            }
        };
        std::fs::create_dir_all(dir.join("logs")).map_err(setup("make the node folder"))?;
        let cgroup = NodeCgroup::create(&format!("{CGROUP_PREFIX}{}-{}", net.slot(), net.index()))
            .map_err(setup("make the node cgroup"))?;
        let mut node = RealNode {
            name: name.clone(),
            net: net.clone(),
            dir: dir.to_path_buf(),
            cgroup,
            mounts: None,
            containerd: None,
            kubelet: None,
            kube_proxy: None,
        };
        node.start_mount_namespace()?;
        node.write_configs(spec)
            .map_err(setup("write the node's configuration"))?;
        node.start_containerd()?;
        for image in &spec.images {
            node.import_image(image)?;
        }
        node.kubelet = Some(node.spawn(
            "kubelet",
            &spec.controlplane,
            &[
                "kubelet".into(),
                format!("--config={}", dir.join("kubelet.yaml").display()),
                format!("--kubeconfig={}", dir.join("kubelet.kubeconfig").display()),
                format!("--hostname-override={name}"),
                format!("--node-ip={}", net.ip()),
                "--v=1".into(),
            ],
        )?);
        node.kube_proxy = Some(node.spawn(
            "kube-proxy",
            &spec.controlplane,
            &[
                "kube-proxy".into(),
                format!("--config={}", dir.join("kube-proxy.yaml").display()),
                "--v=1".into(),
            ],
        )?);
        Ok(node)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn net(&self) -> &NetNode {
        &self.net
    }

    /// The node's folder (configuration, logs, containerd's store).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// containerd's socket, for `ctr --address` from the host.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// Log files of the node's daemons.
    pub fn log_files(&self) -> Vec<PathBuf> {
        ["containerd", "kubelet", "kube-proxy"]
            .iter()
            .map(|c| self.dir.join("logs").join(format!("{c}.log")))
            .collect()
    }

    /// Pids of the node's daemons (not of its containers).
    pub fn pids(&self) -> Vec<u32> {
        [
            &self.containerd,
            &self.kubelet,
            &self.kube_proxy,
            &self.mounts,
        ]
        .into_iter()
        .filter_map(|c| c.as_ref().and_then(ChildProcess::pid))
        .collect()
    }

    /// Every process of the node, containers and shims included.
    pub fn all_pids(&self) -> Vec<u32> {
        self.cgroup.pids()
    }

    /// A process of the pod with this UID (its sandbox's or a container's),
    /// found in the kubelet's pod cgroup: its namespaces are the pod's, e.g.
    /// `nsenter --net=/proc/<pid>/ns/net` runs a host tool as the pod.
    pub fn pod_process(&self, uid: &str) -> Option<u32> {
        let wanted = format!("pod{uid}");
        let pids = self
            .cgroup
            .hierarchies
            .iter()
            .find(|h| h.controllers.iter().any(|c| c == "pids"))?;
        let kubepods = pids.path.join(&self.cgroup.name).join("kubepods");
        let pod = cgroup_tree(&kubepods)
            .into_iter()
            .find(|d| d.file_name().is_some_and(|n| n.to_string_lossy() == wanted))?;
        // The pod's own cgroup holds no tasks: its containers' do.
        cgroup_tree(&pod)
            .iter()
            .find_map(|dir| cgroup_procs(dir).into_iter().next())
    }

    /// A file as the node sees it (its own `/etc`, `/opt`, `/run`…), e.g.
    /// the CNI configuration a DaemonSet wrote through a hostPath; `None`
    /// when the node has no such file.
    pub fn read_file(&self, path: &Path) -> Option<Vec<u8>> {
        let pid = self.mounts.as_ref()?.pid()?;
        // /proc/<pid>/root: the anchor's root, inside its mount namespace.
        let relative = path.strip_prefix("/").unwrap_or(path);
        std::fs::read(Path::new(&format!("/proc/{pid}/root")).join(relative)).ok()
    }

    /// Kills the kubelet (as a node failure would): the node's pods keep
    /// running, and the control plane marks the node NotReady after its grace
    /// period.
    pub fn kill_kubelet(&mut self) {
        if let Some(mut kubelet) = self.kubelet.take() {
            kubelet.stop(Duration::ZERO);
        }
    }

    /// Imports an OCI image archive into the node's containerd (namespace
    /// `k8s.io`, where the kubelet looks).
    pub fn import_image(&self, archive: &Path) -> Result<(), NodeError> {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(self.containerd_socket())
            .args(["-n", "k8s.io", "images", "import"])
            .arg(archive);
        self.run(cmd, &format!("import image {}", archive.display()))
            .map(drop)
    }

    /// Waits until the API server shows the node `Ready`.
    pub async fn wait_ready(&mut self, client: &Client) -> Result<(), NodeError> {
        let nodes: Api<Node> = Api::all(client.clone());
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            for (child, component) in [
                (&mut self.containerd, "containerd"),
                (&mut self.kubelet, "kubelet"),
                (&mut self.kube_proxy, "kube-proxy"),
            ] {
                if let Some(c) = child.as_mut()
                    && let Some(status) = c.try_exit_status()
                {
                    return Err(NodeError::Exited {
                        node: self.name.clone(),
                        component: component.into(),
                        status: status.to_string(),
                        log: c.log_path().to_path_buf(),
                        tail: log_tail(c.log_path(), 40),
                    });
                }
            }
            let what = match nodes.get_opt(&self.name).await {
                Ok(Some(node)) if is_ready(&node) => return Ok(()),
                Ok(Some(node)) => format!("Ready is {}", ready_message(&node)),
                Ok(None) => "the kubelet has not registered the Node".into(),
                Err(e) => format!("reading the Node: {e}"),
            };
            if Instant::now() >= deadline {
                let log = self.dir.join("logs").join("kubelet.log");
                return Err(NodeError::NotReady {
                    node: self.name.clone(),
                    what,
                    tail: log_tail(&log, 40),
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The anchor of the node's private mount namespace, and its mounts.
    fn start_mount_namespace(&mut self) -> Result<(), NodeError> {
        let args: Vec<String> = [
            &format!("--net=/proc/{}/ns/net", self.net.anchor_pid()),
            "--",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sleep",
            "infinity",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let anchor = ChildProcess::spawn(
            "mount namespace",
            Path::new("nsenter"),
            &args,
            &self.dir.join("logs").join("mounts.log"),
        )
        .map_err(|e| self.error("start the mount namespace", e))?;
        let pid = anchor.pid().expect("a just-spawned child has a pid");
        self.mounts = Some(anchor);
        let ours = std::fs::read_link("/proc/self/ns/mnt").ok();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok() == ours {
            if Instant::now() >= deadline {
                return Err(self.error(
                    "start the mount namespace",
                    "unshare --mount did not enter a new namespace within 10s",
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        self.cgroup
            .adopt(pid)
            .map_err(|e| self.error("move the mount namespace into the node cgroup", e))?;

        let dir = &self.dir;
        let mut script = vec![
            "set -eu".to_string(),
            "mount -t tmpfs -o mode=0755 strait-node-run /run".into(),
        ];
        for top in ["etc", "var", "opt"] {
            let upper = dir.join("overlay").join(top).join("upper");
            let work = dir.join("overlay").join(top).join("work");
            std::fs::create_dir_all(&upper)
                .and_then(|()| std::fs::create_dir_all(&work))
                .map_err(|e| self.error("make the overlay folders", e))?;
            script.push(format!(
                "mount -t overlay strait-node-{top} -o lowerdir=/{top},upperdir={},workdir={} /{top}",
                upper.display(),
                work.display()
            ));
        }
        let containerd = dir.join("containerd");
        std::fs::create_dir_all(&containerd)
            .map_err(|e| self.error("make containerd's folder", e))?;
        script.extend([
            "mkdir -p /var/lib/containerd /etc/cni/net.d /opt/cni/bin /var/lib/kubelet /var/log/pods"
                .to_string(),
            format!("mount --bind {} /var/lib/containerd", containerd.display()),
        ]);
        for plugin in CNI_PLUGINS {
            script.push(format!(
                "ln -sf {CNI_PLUGIN_DIR}/{plugin} /opt/cni/bin/{plugin}"
            ));
        }
        let sysctls = dir.join("sysctl");
        std::fs::create_dir_all(&sysctls).map_err(|e| self.error("make the sysctl files", e))?;
        for (key, value) in KUBELET_SYSCTLS {
            let file = sysctls.join(key.replace('/', "."));
            std::fs::write(&file, format!("{value}\n"))
                .map_err(|e| self.error("write the sysctl files", e))?;
            script.push(format!("mount --bind {} /proc/sys/{key}", file.display()));
        }
        // As systemd leaves a host: mounts shared, so a pod's hostPath with
        // HostToContainer propagation sees what is mounted later (the
        // network namespaces of pods the node proxy captures). The peer
        // groups are this namespace's own: nothing reaches the host's.
        script.push("mount --make-rshared /".into());
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--mount=/proc/{pid}/ns/mnt"))
            .args(["--", "sh", "-c"])
            .arg(script.join("\n"));
        self.run(cmd, "mount the node's filesystems").map(drop)
    }

    fn write_configs(&self, spec: &NodeSpec) -> std::io::Result<()> {
        let dir = &self.dir;
        let net = &self.net;
        let write = |name: &str, text: String| std::fs::write(dir.join(name), text);
        let private = |name: &str, text: String| {
            crate::stack::write_private(&dir.join(name), &text)
                .map_err(|e| std::io::Error::other(e.to_string()))
        };
        private(
            "kubelet.kubeconfig",
            kubeconfig_yaml(&spec.server, &spec.ca_pem, &spec.kubelet_cert)?,
        )?;
        private(
            "kube-proxy.kubeconfig",
            kubeconfig_yaml(&spec.server, &spec.ca_pem, &spec.kube_proxy_cert)?,
        )?;
        write("ca.crt", spec.ca_pem.clone())?;
        write("containerd.toml", containerd_config(dir))?;
        // No host resolver for pods: ClusterFirst pods get the cluster DNS only.
        write(
            "resolv.conf",
            "# pods of testenv nodes use the cluster DNS only\n".into(),
        )?;
        write(
            "kubelet.yaml",
            kubelet_config(dir, net, spec, &self.cgroup.name),
        )?;
        write("kube-proxy.yaml", kube_proxy_config(dir, &spec.name, spec))?;
        let conflist = cni_conflist(net);
        // Into the node's /etc/cni/net.d (the overlay's upper layer).
        let net_d = dir.join("overlay/etc/upper/cni/net.d");
        std::fs::create_dir_all(&net_d)?;
        std::fs::write(net_d.join("10-testenv.conflist"), conflist)
    }

    fn start_containerd(&mut self) -> Result<(), NodeError> {
        let config = self.dir.join("containerd.toml");
        let child = self.spawn(
            "containerd",
            Path::new("containerd"),
            &["--config".into(), config.display().to_string()],
        )?;
        self.containerd = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut cmd = Command::new("ctr");
            cmd.arg("--address")
                .arg(self.containerd_socket())
                .arg("version");
            match self.run(cmd, "reach containerd") {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => {}
            }
            if let Some(c) = self.containerd.as_mut()
                && let Some(status) = c.try_exit_status()
            {
                return Err(NodeError::Exited {
                    node: self.name.clone(),
                    component: "containerd".into(),
                    status: status.to_string(),
                    log: c.log_path().to_path_buf(),
                    tail: log_tail(c.log_path(), 40),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts a node daemon in the node's network and mount namespaces and
    /// cgroup, output to `logs/<component>.log`.
    fn spawn(
        &self,
        component: &str,
        program: &Path,
        args: &[String],
    ) -> Result<ChildProcess, NodeError> {
        let mounts = self
            .mounts
            .as_ref()
            .and_then(ChildProcess::pid)
            .expect("the mount namespace starts first");
        let mut full = vec![
            format!("--net=/proc/{}/ns/net", self.net.anchor_pid()),
            format!("--mount=/proc/{mounts}/ns/mnt"),
            "--".into(),
            program.display().to_string(),
        ];
        full.extend(args.iter().cloned());
        let log = self.dir.join("logs").join(format!("{component}.log"));
        let env: [(&str, &OsStr); 0] = [];
        let child =
            ChildProcess::spawn_with_env(component, Path::new("nsenter"), &full, &env, &log)
                .map_err(|e| self.error(&format!("start {component}"), e))?;
        if let Some(pid) = child.pid() {
            self.cgroup
                .adopt(pid)
                .map_err(|e| self.error(&format!("move {component} into the node cgroup"), e))?;
        }
        Ok(child)
    }

    fn run(&self, mut cmd: Command, what: &str) -> Result<String, NodeError> {
        let out = cmd.output().map_err(|e| self.error(what, e))?;
        if !out.status.success() {
            return Err(self.error(
                what,
                format!(
                    "{} ({}): {}",
                    crate::net::describe(&cmd),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn error(&self, what: &str, message: impl std::fmt::Display) -> NodeError {
        NodeError::Setup {
            node: self.name.clone(),
            what: what.into(),
            message: message.to_string(),
        }
    }

    fn stop_all(&mut self) {
        // The kubelet first, so it restarts nothing while the rest goes.
        for child in [&mut self.kubelet, &mut self.kube_proxy] {
            if let Some(mut c) = child.take() {
                c.stop(Duration::ZERO);
            }
        }
        // containerd, its shims, every container, and the mount anchor.
        self.cgroup.kill_all(Duration::from_secs(15));
        for child in [&mut self.containerd, &mut self.mounts] {
            if let Some(mut c) = child.take() {
                c.stop(Duration::ZERO);
            }
        }
        self.cgroup.remove();
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for log in self.log_files() {
                eprintln!(
                    "──── node {} · {} (last 20 lines) ────\n{}",
                    self.name,
                    log.display(),
                    log_tail(&log, 20)
                );
            }
        }
        self.stop_all();
    }
}

fn is_ready(node: &Node) -> bool {
    ready_message(node) == "True"
}

fn ready_message(node: &Node) -> String {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .map(|c| {
            if c.status == "True" {
                "True".to_string()
            } else {
                format!("{} ({})", c.status, c.message.clone().unwrap_or_default())
            }
        })
        .unwrap_or_else(|| "not reported yet".into())
}

fn kubeconfig_yaml(
    server: &str,
    ca_pem: &str,
    cert: &crate::pki::CertPair,
) -> std::io::Result<String> {
    let config =
        crate::kubeconfig::with_client_cert("node", server, ca_pem, &cert.cert_pem, &cert.key_pem);
    crate::kubeconfig::to_yaml(&config).map_err(std::io::Error::other)
}

/// containerd 1.6 (Debian's), with the CRI settings this kind of machine needs.
fn containerd_config(dir: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{d}/containerd.sock"

[ttrpc]
  address = "{d}/containerd.ttrpc.sock"

[debug]
  address = ""
  level = "warn"

[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # runc may not lower oom_score_adj here: no CAP_SYS_RESOURCE on this kind of machine.
  restrict_oom_score_adj = true
  # Pod network namespaces in /var/run/netns (the node's own /run), as on kind
  # and most distributions: where transparent mode's hostPath finds them.
  enable_selinux = false
  disable_apparmor = true
  max_container_log_line_size = 16384

[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "/run/containerd/runc"

[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/opt/cni/bin"
  conf_dir = "/etc/cni/net.d"
"#
    )
}

fn kubelet_config(dir: &Path, net: &NetNode, spec: &NodeSpec, cgroup: &str) -> String {
    let d = dir.display();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 is deprecated in the kubelet and refused by default; this kind of machine has only v1 controllers.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
containerRuntimeEndpoint: unix://{d}/containerd.sock
address: {ip}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {d}/ca.crt
authorization:
  mode: Webhook
clusterDomain: cluster.local
clusterDNS: ["{dns}"]
resolvConf: {d}/resolv.conf
podCIDR: {pod_cidr}
serializeImagePulls: false
failSwapOn: false
rotateCertificates: false
serverTLSBootstrap: false
# Nodes share the host's disk and memory: evict only when they are nearly gone.
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
maxPods: 110
shutdownGracePeriod: 0s
nodeStatusReportFrequency: 10s
"#,
        ip = net.ip(),
        dns = spec.cluster_dns,
        pod_cidr = net.pod_cidr(),
    )
}

fn kube_proxy_config(dir: &Path, node: &str, spec: &NodeSpec) -> String {
    let d = dir.display();
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
hostnameOverride: {node}
clusterCIDR: {cidr}
clientConnection:
  kubeconfig: {d}/kube-proxy.kubeconfig
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# nf_conntrack_max and the TCP timeouts are host-wide or read-only outside
# the host's namespace: leave them as they are.
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
        cidr = spec.cluster_cidr,
    )
}

fn cni_conflist(net: &NetNode) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "testenv",
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": false,
                "mtu": 1500,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{
                        "subnet": net.pod_cidr(),
                        "gateway": net.pod_gateway().to_string(),
                    }]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": true}},
        ],
    })
    .to_string()
}
