//! A cluster with real nodes: its control plane, its LAN and its node
//! namespaces (see [`crate::net`]), with the Node and Pod objects to match.

use std::net::IpAddr;

use crate::cluster::{Cluster, ClusterConfig, ClusterError};
use crate::net::{ClusterNetwork, NetError, NetNode, NetPod};
use crate::realnode::{NodeError, NodeSpec, RealNode};
use crate::workloads::{self, TestPod};

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error(transparent)]
    Net(#[from] NetError),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("cluster {cluster}: cannot make certificates for node {node}: {source}")]
    Pki {
        cluster: String,
        node: String,
        source: rcgen::Error,
    },
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
    /// Real-node clusters: the kubelet, containerd and kube-proxy of each node.
    real: Vec<RealNode>,
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
        if config.real_nodes {
            // Before anything starts: say what this host lacks.
            tokio::task::spawn_blocking(crate::realnode::preflight)
                .await
                .expect("preflight task panicked")?;
        }
        let network = {
            let name = name.clone();
            tokio::task::spawn_blocking(move || ClusterNetwork::create(&name))
                .await
                .expect("network set-up task panicked")?
        };
        config.bind_address = IpAddr::V4(network.host_ip());
        // Other clusters may reach the API server through the LAN router
        // (ClusterNetwork::forward_from_router).
        config.extra_sans.push(IpAddr::V4(network.router_ip()));
        let cluster = Cluster::start_with(config).await?;
        let real_nodes = cluster.config().real_nodes;
        let mut topology = Self {
            real: Vec::new(),
            nodes: Vec::new(),
            cluster,
            network,
        };
        let names: Vec<String> = (1..=nodes).map(|n| format!("{name}-node-{n}")).collect();
        if real_nodes {
            topology.add_real_nodes(&names).await?;
        } else {
            for node in &names {
                topology.add_node(node).await?;
            }
        }
        Ok(topology)
    }

    /// Adds real nodes (containerd, kubelet, kube-proxy; see
    /// [`crate::realnode`]) and waits until each is `Ready`; the kubelets
    /// register the Node objects themselves.
    pub async fn add_real_nodes(&mut self, names: &[String]) -> Result<(), TopologyError> {
        let mut started = Vec::new();
        for name in names {
            let net = self.network.add_node(name)?;
            let spec = self.node_spec(name)?;
            let dir = self.cluster.dir().join("nodes").join(name);
            let node_net = net.clone();
            let node = tokio::task::spawn_blocking(move || RealNode::start(&node_net, &spec, &dir))
                .await
                .expect("node start task panicked")?;
            self.nodes.push(net);
            started.push(node);
        }
        let client = self.cluster.client();
        let results =
            futures::future::join_all(started.iter_mut().map(|n| n.wait_ready(&client))).await;
        self.real.extend(started);
        results
            .into_iter()
            .collect::<Result<Vec<()>, NodeError>>()?;
        Ok(())
    }

    fn node_spec(&self, name: &str) -> Result<NodeSpec, TopologyError> {
        let cluster = &self.cluster;
        let pki_error = |source| TopologyError::Pki {
            cluster: cluster.name().into(),
            node: name.into(),
            source,
        };
        let pki = cluster.pki();
        Ok(NodeSpec {
            name: name.into(),
            server: cluster.server_url(),
            ca_pem: cluster.ca_pem().into(),
            kubelet_cert: pki
                .client_cert(&format!("system:node:{name}"), Some("system:nodes"))
                .map_err(pki_error)?,
            kube_proxy_cert: pki
                .client_cert("system:kube-proxy", None)
                .map_err(pki_error)?,
            cluster_dns: cluster.config().service_ip(10),
            cluster_cidr: self.network.cidr(),
            controlplane: cluster.controlplane_binary().to_path_buf(),
            images: cluster.config().node_images.clone(),
        })
    }

    /// A process of the real pod `namespace/name` (see [`RealNode::pod_process`]).
    pub async fn pod_process(&self, namespace: &str, name: &str) -> anyhow::Result<u32> {
        Ok(self.pod_processes(namespace, name).await?[0])
    }

    /// Every process of the real pod `namespace/name`: its sandbox's (pause)
    /// and each container's, to kill the pod outright.
    pub async fn pod_processes(&self, namespace: &str, name: &str) -> anyhow::Result<Vec<u32>> {
        use anyhow::Context as _;
        let pod = kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(
            self.cluster.client(),
            namespace,
        )
        .get(name)
        .await
        .with_context(|| format!("Pod {namespace}/{name}"))?;
        let uid = pod.metadata.uid.unwrap_or_default();
        let node = pod
            .spec
            .and_then(|s| s.node_name)
            .with_context(|| format!("Pod {namespace}/{name} is not on a node yet"))?;
        let real = self
            .real
            .iter()
            .find(|n| n.name() == node)
            .with_context(|| format!("{node} is not a real node of this cluster"))?;
        let pids = real.pod_processes(&uid);
        anyhow::ensure!(
            !pids.is_empty(),
            "no process of Pod {namespace}/{name} (uid {uid}) on {node}"
        );
        Ok(pids)
    }

    /// The real nodes (empty unless the cluster runs them).
    pub fn real_nodes(&self) -> &[RealNode] {
        &self.real
    }

    /// Mutable access to real node `index` (0-based), e.g. to kill its kubelet.
    pub fn real_node_mut(&mut self, index: usize) -> Option<&mut RealNode> {
        self.real.get_mut(index)
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
