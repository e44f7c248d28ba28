//! Nodes and pods: network namespaces behind a cluster LAN.

use std::ffi::OsStr;
use std::io;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use super::{Lan, MAX_PODS, NetError, Netns};
use crate::process::ChildProcess;

/// A node: its own network namespace with one address on the cluster LAN.
/// Dropping the last handle (the node and its pods) deletes the namespace.
#[derive(Debug, Clone)]
pub struct NetNode {
    pub(super) inner: Arc<NodeInner>,
}

#[derive(Debug)]
pub(super) struct NodeInner {
    pub(super) name: String,
    pub(super) index: u8,
    pub(super) ip: Ipv4Addr,
    pub(super) next_pod: Mutex<u8>,
    pub(super) netns: Netns,
    // After `netns`: the LAN outlives its nodes.
    pub(super) lan: Arc<Lan>,
}

impl NodeInner {
    pub(super) fn pod_cidr(&self) -> String {
        format!("10.{}.{}.0/24", self.lan.slot, self.index)
    }

    pub(super) fn pod_gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, self.lan.slot, self.index, 1)
    }
}

impl NetNode {
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The node's address on the cluster LAN (its InternalIP).
    pub fn ip(&self) -> Ipv4Addr {
        self.inner.ip
    }

    /// The node's pod range, `10.S.n.0/24`.
    pub fn pod_cidr(&self) -> String {
        self.inner.pod_cidr()
    }

    /// `net:[inode]` of the node's namespace.
    pub fn netns_id(&self) -> String {
        self.inner.netns.id()
    }

    /// Pid of the process holding the namespace (`/proc/<pid>/ns/net`).
    pub fn anchor_pid(&self) -> u32 {
        self.inner.netns.pid
    }

    pub(crate) fn lan(&self) -> &Arc<Lan> {
        &self.inner.lan
    }

    /// `n` of `10.S.n.0/24`: the node's number on its LAN.
    pub fn index(&self) -> u8 {
        self.inner.index
    }

    /// `S`: the host-wide slot of the node's cluster network.
    pub fn slot(&self) -> u8 {
        self.inner.lan.slot
    }

    /// The pod gateway address (`10.S.n.1`), next hop of every pod on the node.
    pub fn pod_gateway(&self) -> Ipv4Addr {
        self.inner.pod_gateway()
    }

    pub(crate) fn netns(&self) -> &Netns {
        &self.inner.netns
    }

    /// A short-lived command run inside the node's namespace.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        self.inner.netns.command(program)
    }

    /// Starts a long-running process (e.g. the node proxy) inside the node's
    /// namespace, output appended to `log`. Dropping it kills it.
    pub fn spawn(
        &self,
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &OsStr)],
        log: &Path,
    ) -> io::Result<ChildProcess> {
        self.inner.netns.spawn(name, program, args, env, log)
    }

    /// A TCP listener on this node's address, made inside its namespace by a
    /// short-lived thread (a socket keeps the namespace it was made in): a
    /// test's own server standing in for a process of the node.
    pub fn listen_tcp(&self, port: u16) -> io::Result<std::net::TcpListener> {
        super::netns::listen_tcp_in(
            self.anchor_pid(),
            std::net::SocketAddr::from((self.ip(), port)),
        )
    }

    /// Adds a pod: its own namespace, a veth to this node, the next address of
    /// the node's pod range and a default route via the node.
    pub fn add_pod(&self, name: &str) -> Result<NetPod, NetError> {
        let node = &self.inner;
        let mut next = node.next_pod.lock().unwrap_or_else(|e| e.into_inner());
        let index = *next;
        if index > MAX_PODS {
            return Err(NetError::Full {
                what: "pods",
                max: MAX_PODS,
                per: "node",
            });
        }
        let ip = Ipv4Addr::new(10, node.lan.slot, node.index, 1 + index);
        let gateway = node.pod_gateway();
        *next += 1; // taken even on failure, as for nodes
        let netns = Netns::new(&format!("pod {name} on {}", node.name))?;
        node.netns.ip(&[
            format!(
                "link add p{index} type veth peer name eth0 netns {}",
                netns.pid
            ),
            format!("link set p{index} up"),
            format!("route add {ip}/32 dev p{index} src {}", node.ip),
        ])?;
        netns.ip(&[
            "link set lo up".into(),
            format!("addr add {ip}/32 dev eth0"),
            "link set eth0 up".into(),
            format!("route add {gateway}/32 dev eth0 scope link"),
            format!("route add default via {gateway} dev eth0"),
        ])?;
        Ok(NetPod {
            name: name.into(),
            ip,
            netns,
            node: self.clone(),
        })
    }
}

/// A pod: its own network namespace behind its node. Processes started with
/// [`NetPod::spawn`] are the pod's containers.
#[derive(Debug)]
pub struct NetPod {
    name: String,
    ip: Ipv4Addr,
    netns: Netns,
    // After `netns`: the node outlives its pods.
    node: NetNode,
}

impl NetPod {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The node this pod runs on.
    pub fn node(&self) -> &NetNode {
        &self.node
    }

    /// `net:[inode]` of the pod's namespace.
    pub fn netns_id(&self) -> String {
        self.netns.id()
    }

    /// Pid of the process holding the namespace.
    pub fn anchor_pid(&self) -> u32 {
        self.netns.pid
    }

    /// A short-lived command run inside the pod's namespace (a client, or
    /// iptables rules for transparent redirection).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        self.netns.command(program)
    }

    /// Starts a long-running process inside the pod's namespace, output
    /// appended to `log`. Dropping it kills it.
    pub fn spawn(
        &self,
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &OsStr)],
        log: &Path,
    ) -> io::Result<ChildProcess> {
        self.netns.spawn(name, program, args, env, log)
    }

    /// The Pod object for this pod (address and node filled in), to refine with
    /// the `with_*` methods and create with [`crate::workloads::create_ready_pod`].
    pub fn test_pod(&self, namespace: &str) -> crate::workloads::TestPod {
        crate::workloads::TestPod::new(
            namespace,
            &self.name,
            self.node.name(),
            std::net::IpAddr::V4(self.ip),
        )
    }
}

/// A running [`ClusterNetwork::forward_from_router`]; dropping it stops it
/// (connections being copied end with the runtime).
#[derive(Debug)]
pub struct RouterForward {
    pub(super) task: tokio::task::JoinHandle<()>,
}

impl RouterForward {
    /// Whether the forwarding task has ended (it should not while held).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for RouterForward {
    fn drop(&mut self) {
        self.task.abort();
    }
}
