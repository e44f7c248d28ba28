//! A cluster with real nodes: its control plane, its LAN and its node
//! namespaces (see [`crate::net`]), with the Node and Pod objects to match.

use std::net::IpAddr;

use crate::cluster::{Cluster, ClusterConfig, ClusterError};
use crate::net::{ClusterNetwork, NetError, NetNode, NetPod};
use crate::workloads::{self, TestPod};

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error(transparent)]
    Net(#[from] NetError),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error("cluster {cluster}: cannot write {what}: {source}")]
    Api {
        cluster: String,
        what: String,
        source: kube::Error,
    },
    #[error("cluster {cluster} has no node {index} (it has {count})")]
    NoSuchNode {
        cluster: String,
        index: usize,
        count: usize,
    },
}

/// A cluster whose API server listens on its LAN, with `nodes` node namespaces
/// named `<cluster>-node-<n>` (n from 1) registered as Ready Nodes.
///
/// Fields drop in order: nodes, then the control plane, then the LAN (the API
/// server's address lives on it).
#[derive(Debug)]
pub struct ClusterTopology {
    nodes: Vec<NetNode>,
    cluster: Cluster,
    network: ClusterNetwork,
}

impl ClusterTopology {
    pub async fn start(name: &str, nodes: usize) -> Result<Self, TopologyError> {
        Self::start_with(ClusterConfig::new(name), nodes).await
    }

    /// Starts the cluster from `config`, except that its API server binds the
    /// host's address on the new LAN so that nodes can reach it.
    pub async fn start_with(
        mut config: ClusterConfig,
        nodes: usize,
    ) -> Result<Self, TopologyError> {
        let name = config.name.clone();
        let network = {
            let name = name.clone();
            tokio::task::spawn_blocking(move || ClusterNetwork::create(&name))
                .await
                .expect("network set-up task panicked")?
        };
        config.bind_address = IpAddr::V4(network.host_ip());
        let cluster = Cluster::start_with(config).await?;
        let mut topology = Self {
            nodes: Vec::new(),
            cluster,
            network,
        };
        for n in 1..=nodes {
            topology.add_node(&format!("{name}-node-{n}")).await?;
        }
        Ok(topology)
    }

    /// Adds a node namespace and its Ready Node object (InternalIP = node IP).
    pub async fn add_node(&mut self, node_name: &str) -> Result<&NetNode, TopologyError> {
        let node = self.network.add_node(node_name)?;
        workloads::create_node(&self.cluster.client(), node_name, IpAddr::V4(node.ip()))
            .await
            .map_err(|source| self.api_error(format!("Node {node_name}"), source))?;
        self.nodes.push(node);
        Ok(self.nodes.last().expect("just pushed"))
    }

    /// Adds a pod namespace on node `node` (0-based) and creates its Pod,
    /// bound to that node, Running and Ready with the pod's address. `customize`
    /// adds labels, ports, a ServiceAccount…; start the pod's process with
    /// [`NetPod::spawn`] before relying on the Pod being Ready.
    pub async fn add_pod(
        &self,
        node: usize,
        namespace: &str,
        name: &str,
        customize: impl FnOnce(TestPod) -> TestPod,
    ) -> Result<NetPod, TopologyError> {
        let net_node = self.node(node)?;
        let pod = net_node.add_pod(name)?;
        let client = self.cluster.client();
        workloads::ensure_namespace(&client, namespace)
            .await
            .map_err(|source| self.api_error(format!("Namespace {namespace}"), source))?;
        workloads::create_ready_pod(&client, &customize(pod.test_pod(namespace)))
            .await
            .map_err(|source| self.api_error(format!("Pod {namespace}/{name}"), source))?;
        Ok(pod)
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Mutable access, e.g. for [`Cluster::stop_apiserver`].
    pub fn cluster_mut(&mut self) -> &mut Cluster {
        &mut self.cluster
    }

    pub fn network(&self) -> &ClusterNetwork {
        &self.network
    }

    pub fn nodes(&self) -> &[NetNode] {
        &self.nodes
    }

    /// Node `index` (0-based).
    pub fn node(&self, index: usize) -> Result<&NetNode, TopologyError> {
        self.nodes.get(index).ok_or(TopologyError::NoSuchNode {
            cluster: self.cluster.name().into(),
            index,
            count: self.nodes.len(),
        })
    }

    fn api_error(&self, what: String, source: kube::Error) -> TopologyError {
        TopologyError::Api {
            cluster: self.cluster.name().into(),
            what,
            source,
        }
    }
}
