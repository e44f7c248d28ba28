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

mod cgroup;
mod config;
mod error;
mod preflight;

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};

use crate::net::NetNode;
use crate::process::{ChildProcess, log_tail};
use cgroup::NodeCgroup;
pub use cgroup::sweep_stale_cgroups;
use config::{cni_conflist, containerd_config, kube_proxy_config, kubeconfig_yaml, kubelet_config};
pub use error::NodeError;
pub use preflight::{check_host_ports, preflight};

/// The sandbox ("pause") image every pod starts with; built by [`crate::images`]
/// and imported into each node before its kubelet starts.
pub const PAUSE_IMAGE: &str = "strait.local/pause:3.10";

/// Where Debian's `containernetworking-plugins` puts the CNI plugins.
const CNI_PLUGIN_DIR: &str = "/usr/lib/cni";
const CNI_PLUGINS: &[&str] = &["ptp", "host-local", "portmap", "loopback", "bridge"];

/// Prefix of every node's cgroup (`/strait-node-<slot>-<n>`).
pub const CGROUP_PREFIX: &str = "strait-node-";

/// How long a node may take from its kubelet's start to `Ready`.
pub(super) const READY_TIMEOUT: Duration = Duration::from_secs(90);

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
        self.cgroup.pod_process(uid)
    }

    /// Every process of the pod with `uid` (sandbox and containers).
    pub fn pod_processes(&self, uid: &str) -> Vec<u32> {
        self.cgroup.pod_processes(uid)
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
            crate::files::write_private(&dir.join(name), &text)
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
