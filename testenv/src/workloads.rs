//! Nodes and Pods without a kubelet.
//!
//! testenv runs no kubelet and no scheduler: a test creates the Node objects,
//! creates a Pod bound to a node (`spec.nodeName`), and marks it Running/Ready
//! with an address through the status subresource, as a kubelet would. The real
//! EndpointSlice controller then publishes it like any other pod. The pod's
//! "container" is whatever process the test runs (often `strait-backend`).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

/// Image name recorded in Pod specs; nothing pulls it.
pub const BACKEND_IMAGE: &str = "strait.dev/testenv/backend:local";

/// Creates a namespace (no error if it exists) and waits until its `default`
/// ServiceAccount exists, because the ServiceAccount admission plugin refuses
/// Pods in a namespace until then.
pub async fn ensure_namespace(client: &Client, name: &str) -> kube::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": name}})).expect("static namespace JSON");
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e),
    }
    wait_for_service_account(client, name, "default", Duration::from_secs(30)).await
}

/// Waits until ServiceAccount `ns/name` exists.
pub async fn wait_for_service_account(
    client: &Client,
    ns: &str,
    name: &str,
    timeout: Duration,
) -> kube::Result<()> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match api.get_opt(name).await? {
            Some(_) => return Ok(()),
            None if tokio::time::Instant::now() >= deadline => {
                return Err(kube::Error::Service(
                    format!("ServiceAccount {ns}/{name} did not appear within {timeout:?}: is the serviceaccount controller running?").into(),
                ));
            }
            None => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Creates (or updates) a Node named `name` with `address` as its InternalIP and
/// a Ready condition, as a kubelet would report.
pub async fn create_node(client: &Client, name: &str, address: IpAddr) -> kube::Result<Node> {
    let api: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "strait.dev/testenv-node": "true"}},
    }))
    .expect("static node JSON");
    match api.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e),
    }
    let now = now_rfc3339();
    let status = json!({"status": {
        "addresses": [
            {"type": "InternalIP", "address": address.to_string()},
            {"type": "Hostname", "address": name},
        ],
        "conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "strait testenv node", "lastHeartbeatTime": now, "lastTransitionTime": now,
        }],
    }});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
}

/// A Pod to create on a node. Build with [`TestPod::new`] and the `with_*` methods.
#[derive(Clone, Debug)]
pub struct TestPod {
    pub namespace: String,
    pub name: String,
    pub node: String,
    pub ip: IpAddr,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub service_account: String,
    /// `spec.hostname` and `spec.subdomain`, as a StatefulSet sets them; with a
    /// headless Service named like the subdomain, the endpoint gets the hostname.
    pub hostname: Option<(String, String)>,
    /// Container ports: (name, port, protocol).
    pub ports: Vec<(String, u16, String)>,
}

impl TestPod {
    pub fn new(namespace: &str, name: &str, node: &str, ip: IpAddr) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            node: node.into(),
            ip,
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            service_account: "default".into(),
            hostname: None,
            ports: Vec::new(),
        }
    }

    pub fn with_label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    pub fn with_annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }

    pub fn with_service_account(mut self, sa: &str) -> Self {
        self.service_account = sa.into();
        self
    }

    pub fn with_hostname(mut self, hostname: &str, subdomain: &str) -> Self {
        self.hostname = Some((hostname.into(), subdomain.into()));
        self
    }

    pub fn with_port(mut self, name: &str, port: u16) -> Self {
        self.ports.push((name.into(), port, "TCP".into()));
        self
    }

    fn manifest(&self) -> serde_json::Value {
        let ports: Vec<_> = self
            .ports
            .iter()
            .map(|(name, port, proto)| json!({"name": name, "containerPort": port, "protocol": proto}))
            .collect();
        let mut manifest = json!({
            "metadata": {
                "name": self.name, "namespace": self.namespace,
                "labels": self.labels, "annotations": self.annotations,
            },
            "spec": {
                "nodeName": self.node,
                "serviceAccountName": self.service_account,
                "containers": [{"name": "app", "image": BACKEND_IMAGE, "ports": ports}],
            },
        });
        if let Some((hostname, subdomain)) = &self.hostname {
            manifest["spec"]["hostname"] = json!(hostname);
            manifest["spec"]["subdomain"] = json!(subdomain);
        }
        manifest
    }
}

/// Creates the pod bound to its node and marks it Running and Ready.
pub async fn create_ready_pod(client: &Client, pod: &TestPod) -> kube::Result<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let object: Pod =
        serde_json::from_value(pod.manifest()).expect("pod manifest is valid JSON for Pod");
    api.create(&PostParams::default(), &object).await?;
    let host_ip = node_address(client, &pod.node).await?;
    set_pod_ready(client, &pod.namespace, &pod.name, pod.ip, host_ip, true).await
}

/// The InternalIP of a node, if it reports one.
async fn node_address(client: &Client, node: &str) -> kube::Result<Option<IpAddr>> {
    let api: Api<Node> = Api::all(client.clone());
    let Some(node) = api.get_opt(node).await? else {
        return Ok(None);
    };
    Ok(node
        .status
        .and_then(|s| s.addresses)
        .unwrap_or_default()
        .into_iter()
        .find(|a| a.type_ == "InternalIP")
        .and_then(|a| a.address.parse().ok()))
}

/// Writes a kubelet-like status: phase Running, the pod IP, and Ready as given.
/// Flip `ready` to false to take a pod out of its Service's ready endpoints.
pub async fn set_pod_ready(
    client: &Client,
    ns: &str,
    name: &str,
    ip: IpAddr,
    host_ip: Option<IpAddr>,
    ready: bool,
) -> kube::Result<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let now = now_rfc3339();
    let ready_str = if ready { "True" } else { "False" };
    let mut status = json!({
        "phase": "Running",
        "podIP": ip.to_string(),
        "podIPs": [{"ip": ip.to_string()}],
        "startTime": now,
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": ready_str, "lastTransitionTime": now},
            {"type": "Ready", "status": ready_str, "lastTransitionTime": now},
        ],
        "containerStatuses": [{
            "name": "app", "image": BACKEND_IMAGE, "imageID": "", "ready": ready, "started": true,
            "restartCount": 0, "state": {"running": {"startedAt": now}},
        }],
    });
    if let Some(host) = host_ip {
        status["hostIP"] = json!(host.to_string());
        status["hostIPs"] = json!([{"ip": host.to_string()}]);
    }
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": status})),
    )
    .await
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .unwrap_or_default()
        .to_string()
}

/// CoreDNS's ConfigMap and ServiceAccount in `kube-system`, as kubeadm names them.
pub const COREDNS_CONFIGMAP: &str = "coredns";
/// The user CoreDNS authenticates as: its ServiceAccount's.
pub const COREDNS_USER: &str = "system:serviceaccount:kube-system:coredns";

/// Cluster DNS for real-node clusters: CoreDNS runs on the host at
/// `server` (port 53), and the selector-less Service `kube-system/kube-dns` at
/// `cluster_ip` points there through an EndpointSlice testenv manages, so
/// kube-proxy on each node translates `cluster_ip:53` as in any cluster. Also
/// the RBAC CoreDNS's ServiceAccount needs (kubeadm's `system:coredns`), and
/// its Corefile as the ConfigMap `kube-system/coredns`.
pub async fn create_cluster_dns(
    client: &Client,
    server: IpAddr,
    cluster_ip: std::net::Ipv4Addr,
    corefile: &str,
) -> kube::Result<()> {
    use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    fn typed<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> T {
        serde_json::from_value(value).expect("a well-formed built-in object")
    }
    let pp = PostParams::default();
    let role: ClusterRole = typed(json!({
        "metadata": {"name": "system:coredns"},
        "rules": [
            {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"], "verbs": ["list", "watch"]},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        ],
    }));
    let binding: ClusterRoleBinding = typed(json!({
        "metadata": {"name": "system:coredns"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
        "subjects": [{"kind": "ServiceAccount", "name": COREDNS_CONFIGMAP, "namespace": "kube-system"}],
    }));
    let account: ServiceAccount = typed(json!({
        "metadata": {"name": COREDNS_CONFIGMAP, "namespace": "kube-system"},
    }));
    let config: ConfigMap = typed(json!({
        "metadata": {"name": COREDNS_CONFIGMAP, "namespace": "kube-system"},
        "data": {"Corefile": corefile},
    }));
    let ports = json!([
        {"name": "dns", "port": 53, "protocol": "UDP"},
        {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
    ]);
    let service: Service = typed(json!({
        "metadata": {"name": "kube-dns", "namespace": "kube-system",
                     "labels": {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"}},
        "spec": {"clusterIP": cluster_ip.to_string(), "ports": ports},
    }));
    let slice: EndpointSlice = typed(json!({
        "metadata": {"name": "kube-dns-testenv", "namespace": "kube-system",
                     "labels": {"kubernetes.io/service-name": "kube-dns",
                                "endpointslice.kubernetes.io/managed-by": "testenv.strait.dev"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [server.to_string()], "conditions": {"ready": true}}],
        "ports": ports,
    }));
    Api::<ClusterRole>::all(client.clone())
        .create(&pp, &role)
        .await?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&pp, &binding)
        .await?;
    Api::<ServiceAccount>::namespaced(client.clone(), "kube-system")
        .create(&pp, &account)
        .await?;
    Api::<ConfigMap>::namespaced(client.clone(), "kube-system")
        .create(&pp, &config)
        .await?;
    Api::<Service>::namespaced(client.clone(), "kube-system")
        .create(&pp, &service)
        .await?;
    Api::<EndpointSlice>::namespaced(client.clone(), "kube-system")
        .create(&pp, &slice)
        .await?;
    Ok(())
}
