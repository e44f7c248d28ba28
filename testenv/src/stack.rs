//! Strait's whole stack on a [`ClusterTopology`]: the issuer, a node proxy on
//! every node, the gateway as a pod, the mirror controller, and workload pods,
//! each a real process started from the workspace's binaries.
//!
//! Components get their identities the way the deployment gives them: each
//! has a Pod object, its ServiceAccount's RBAC comes from `deploy/`, and the
//! files a kubelet would mount are written to its folder — an API token for
//! its kubeconfig, a projected identity token (audience `strait.dev/identity`,
//! bound to its Pod, refreshed by [`MeshCluster::refresh_tokens`] as a kubelet
//! refreshes it) and the trust anchors from the `strait-trust-anchors`
//! ConfigMap. The certificates themselves come from
//! the cluster's `strait-identity` process over `--issuer-addr`/`--token-file`.
//! Nothing here signs a certificate.
//!
//! Used by `strait-testenv demo` (`crate::demo`).

use std::ffi::OsStr;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;
use strait_mesh::identity::ca::PemPair;
use strait_mesh::names::TOKEN_AUDIENCE;

use crate::issuer::{self, RunningIssuer, http_get};
use crate::process::{ChildProcess, log_tail};
use crate::workloads::{ensure_namespace, set_pod_ready, wait_for_service_account};
use crate::{ClusterTopology, NetNode, NetPod};

/// Trust domain of every identity in the stack (both clusters share it, as
/// clusters under one anchor usually do).
pub const TRUST_DOMAIN: &str = "cluster.local";
/// How long components and pods get to become ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Lifetime of the identity tokens (a projected token's usual hour); the
/// demo refreshes them at half of it.
pub const IDENTITY_TOKEN_TTL: Duration = Duration::from_secs(3600);
/// Lifetime of the components' API tokens (their kubeconfigs are read once).
const API_TOKEN_TTL: Duration = Duration::from_secs(48 * 3600);

/// The checkout this crate was built from (its `deploy/` manifests are applied).
pub fn repository_root() -> PathBuf {
    let testenv = Path::new(env!("CARGO_MANIFEST_DIR"));
    testenv.parent().unwrap_or(testenv).to_path_buf()
}

/// A file of the repository's `deploy/` (manifests the stack applies).
pub fn deploy_file(relative: &str) -> PathBuf {
    repository_root().join("deploy").join(relative)
}

/// The workspace binaries the stack runs, found in one folder.
#[derive(Clone, Debug)]
pub struct Binaries {
    dir: PathBuf,
}

impl Binaries {
    /// The binaries next to the running executable (`target/<profile>/`, also
    /// from a test's `target/<profile>/deps/`). Fails naming every missing one
    /// and the command that builds them.
    pub fn next_to_this_executable(needed: &[&str]) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("the running executable's path")?;
        let mut dir = exe
            .parent()
            .context("the executable has no folder")?
            .to_path_buf();
        if dir.file_name() == Some(OsStr::new("deps")) {
            dir.pop();
        }
        let missing: Vec<&str> = needed
            .iter()
            .copied()
            .filter(|n| !dir.join(n).exists())
            .collect();
        if !missing.is_empty() {
            bail!(
                "{} not built in {}: run `cargo build --bins` first (scripts/demo.sh does)",
                missing.join(", "),
                dir.display()
            );
        }
        Ok(Self { dir })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The folder holding them (`target/<profile>`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// An identity token file a kubelet would keep fresh: which ServiceAccount,
/// which Pod it is bound to.
#[derive(Clone, Debug)]
struct ProjectedToken {
    path: PathBuf,
    namespace: String,
    service_account: String,
    pod: String,
    uid: String,
}

/// A running component: its process and where to look at it.
#[derive(Debug)]
pub struct Component {
    pub name: String,
    /// Admin address (`/ready`, `/metrics`).
    pub admin: SocketAddr,
    pub process: ChildProcess,
}

/// One cluster of the stack. Fields drop in order: processes, pods, the
/// issuer, then the cluster and its nodes.
pub struct MeshCluster {
    components: Vec<Component>,
    pods: Vec<(NetPod, Option<ChildProcess>)>,
    issuer: Option<RunningIssuer>,
    topology: ClusterTopology,
    name: String,
    tokens: Vec<ProjectedToken>,
    dir: PathBuf,
    binaries: Binaries,
}

impl MeshCluster {
    /// Wraps a started topology; `dir` holds the components' files and logs.
    pub fn new(topology: ClusterTopology, binaries: Binaries, dir: &Path) -> anyhow::Result<Self> {
        let name = topology.cluster().name().to_string();
        let dir = dir.join(&name);
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        Ok(Self {
            components: Vec::new(),
            pods: Vec::new(),
            issuer: None,
            topology,
            name,
            tokens: Vec::new(),
            dir,
            binaries,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn topology(&self) -> &ClusterTopology {
        &self.topology
    }

    pub fn client(&self) -> Client {
        self.topology.cluster().client()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn components(&self) -> &[Component] {
        &self.components
    }

    pub fn component(&self, name: &str) -> Option<&Component> {
        self.components.iter().find(|c| c.name == name)
    }

    pub fn issuer(&self) -> Option<&RunningIssuer> {
        self.issuer.as_ref()
    }

    pub fn pod(&self, name: &str) -> Option<&NetPod> {
        self.pods.iter().map(|(p, _)| p).find(|p| p.name() == name)
    }

    /// Every pid this cluster's stack runs (processes and namespace anchors,
    /// control plane included), for "nothing is left" checks.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = self.topology.cluster().pids();
        pids.extend(self.components.iter().filter_map(|c| c.process.pid()));
        for (pod, process) in &self.pods {
            pids.push(pod.anchor_pid());
            pids.extend(process.as_ref().and_then(ChildProcess::pid));
        }
        pids.extend(self.topology.nodes().iter().map(NetNode::anchor_pid));
        pids
    }

    /// Starts `strait-identity` with the issuer certificate and key of the
    /// cluster's `strait-system/strait-identity-issuer` Secret (as its
    /// Deployment mounts it), listening on the host's LAN address so nodes
    /// reach it.
    pub async fn start_issuer(&mut self) -> anyhow::Result<()> {
        let secret: k8s_openapi::api::core::v1::Secret =
            Api::namespaced(self.client(), "strait-system")
                .get("strait-identity-issuer")
                .await
                .context("read Secret strait-system/strait-identity-issuer (apply the output of `strait identity issuer -o yaml` first)")?;
        let field = |key: &str| -> anyhow::Result<String> {
            let bytes = secret
                .data
                .as_ref()
                .and_then(|d| d.get(key))
                .with_context(|| format!("Secret strait-identity-issuer has no {key}"))?;
            String::from_utf8(bytes.0.clone())
                .with_context(|| format!("Secret strait-identity-issuer: {key} is not PEM text"))
        };
        let pair = PemPair {
            cert_pem: field("tls.crt")?,
            key_pem: field("tls.key")?,
        };
        let bundle = field("ca.crt")?;
        let issuer = issuer::start_issuer_on(
            &self.binaries.path("strait-identity"),
            self.topology.cluster(),
            &pair,
            &bundle,
            TRUST_DOMAIN,
            "24h",
            IpAddr::V4(self.topology.network().host_ip()),
        )
        .await;
        self.issuer = Some(issuer);
        Ok(())
    }

    fn issuer_addr(&self) -> anyhow::Result<SocketAddr> {
        Ok(self
            .issuer
            .as_ref()
            .context("start the issuer before the components that need it")?
            .addr)
    }

    /// A token from the TokenRequest API (`audiences` empty: the API server's).
    async fn token(
        &self,
        namespace: &str,
        service_account: &str,
        audiences: &[&str],
        bound_pod: Option<(&str, &str)>,
        ttl: Duration,
    ) -> anyhow::Result<String> {
        let mut spec = json!({"expirationSeconds": ttl.as_secs()});
        if !audiences.is_empty() {
            spec["audiences"] = json!(audiences);
        }
        if let Some((name, uid)) = bound_pod {
            spec["boundObjectRef"] =
                json!({"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid});
        }
        let request: TokenRequest = serde_json::from_value(json!({"spec": spec}))?;
        Api::<ServiceAccount>::namespaced(self.client(), namespace)
            .create_token_request(service_account, &PostParams::default(), &request)
            .await
            .with_context(|| format!("TokenRequest for {namespace}/{service_account}"))?
            .status
            .and_then(|s| s.token)
            .context("TokenRequest answered without a token")
    }

    /// Writes what the kubelet would mount for a component running as
    /// `namespace/sa` in Pod `pod`: `kubeconfig` (API token), `token` (the
    /// projected identity token, bound to the Pod) and `ca.crt` (trust anchors).
    async fn mount_credentials(
        &mut self,
        dir: &Path,
        namespace: &str,
        sa: &str,
        pod: &Pod,
    ) -> anyhow::Result<()> {
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let uid = pod.metadata.uid.clone().context("a Pod without uid")?;
        wait_for_service_account(&self.client(), namespace, sa, READY_TIMEOUT)
            .await
            .with_context(|| format!("ServiceAccount {namespace}/{sa}"))?;
        let api_token = self.token(namespace, sa, &[], None, API_TOKEN_TTL).await?;
        let cluster = self.topology.cluster();
        let kubeconfig = crate::kubeconfig::with_token(
            cluster.name(),
            &cluster.server_url(),
            cluster.ca_pem(),
            &api_token,
        );
        std::fs::create_dir_all(dir)?;
        write_private(
            &dir.join("kubeconfig"),
            &crate::kubeconfig::to_yaml(&kubeconfig)?,
        )?;
        std::fs::write(dir.join("ca.crt"), self.trust_anchors().await?)?;
        let projected = ProjectedToken {
            path: dir.join("token"),
            namespace: namespace.into(),
            service_account: sa.into(),
            pod: pod_name,
            uid,
        };
        self.write_token(&projected).await?;
        self.tokens.push(projected);
        Ok(())
    }

    async fn write_token(&self, t: &ProjectedToken) -> anyhow::Result<()> {
        let token = self
            .token(
                &t.namespace,
                &t.service_account,
                &[TOKEN_AUDIENCE],
                Some((&t.pod, &t.uid)),
                IDENTITY_TOKEN_TTL,
            )
            .await?;
        // Replaced atomically: components re-read it on every refresh.
        let tmp = t.path.with_extension("new");
        write_private(&tmp, &token)?;
        std::fs::rename(&tmp, &t.path)?;
        Ok(())
    }

    /// Renews every identity token (the kubelet's job for projected tokens).
    pub async fn refresh_tokens(&self) -> anyhow::Result<()> {
        for t in &self.tokens {
            self.write_token(t).await?;
        }
        Ok(())
    }

    /// `ca.crt` of ConfigMap `strait-system/strait-trust-anchors`, which
    /// components mount as their trust anchors (as `strait install` sets up).
    pub async fn trust_anchors(&self) -> anyhow::Result<String> {
        let map: k8s_openapi::api::core::v1::ConfigMap =
            Api::namespaced(self.client(), "strait-system")
                .get("strait-trust-anchors")
                .await
                .context("read ConfigMap strait-system/strait-trust-anchors (create it from the anchor's ca.crt first)")?;
        map.data
            .and_then(|d| d.get("ca.crt").cloned())
            .context("ConfigMap strait-system/strait-trust-anchors has no ca.crt")
    }

    /// The identity flags every component takes.
    fn identity_args(&self, dir: &Path) -> anyhow::Result<Vec<String>> {
        Ok(vec![
            format!("--issuer-addr={}", self.issuer_addr()?),
            format!("--issuer-name={}", issuer::ISSUER_DNS),
            format!("--trust-anchors={}", dir.join("ca.crt").display()),
            format!("--token-file={}", dir.join("token").display()),
        ])
    }

    /// A node proxy on every node: RBAC from deploy/proxy, a Pod object per
    /// node (hostNetwork: the process runs in the node's namespace), Ready
    /// once its `/ready` says so.
    pub async fn start_node_proxies(&mut self) -> anyhow::Result<()> {
        crate::kubectl_apply(
            self.topology.cluster(),
            &deploy_file("proxy/rbac.yaml").to_string_lossy(),
        );
        let nodes: Vec<NetNode> = self.topology.nodes().to_vec();
        for node in &nodes {
            let name = format!("strait-proxy-{}", node.name());
            let ip = IpAddr::V4(node.ip());
            let pod = node_proxy_pod(node.name());
            let pod = self.create_pod("strait-system", &pod).await?;
            set_pod_ready(&self.client(), "strait-system", &name, ip, Some(ip), false).await?;
            let dir = self.dir.join(&name);
            self.mount_credentials(&dir, "strait-system", "strait-proxy", &pod)
                .await?;
            let mut args = vec![
                format!("--node-name={}", node.name()),
                format!("--cluster-name={}", self.name),
                format!("--trust-domain={TRUST_DOMAIN}"),
                "--drain-timeout=1s".into(),
                // Nothing here routes by EndpointSlices to a stopping proxy.
                "--shutdown-delay=0s".into(),
            ];
            args.extend(self.identity_args(&dir)?);
            let process = node.spawn(
                &name,
                &self.binaries.path("strait-proxy"),
                &args,
                &env_refs(&component_env(&dir, "info")),
                &dir.join("proxy.log"),
            )?;
            self.components.push(Component {
                name: name.clone(),
                admin: SocketAddr::new(ip, 4191),
                process,
            });
        }
        for node in &nodes {
            let name = format!("strait-proxy-{}", node.name());
            self.wait_ready(&name).await?;
            let ip = IpAddr::V4(node.ip());
            set_pod_ready(&self.client(), "strait-system", &name, ip, Some(ip), true).await?;
        }
        Ok(())
    }

    /// The gateway as a pod on node `node` (0-based), RBAC from deploy/gateway,
    /// and the `strait-gateway` Service a cloud would give a LoadBalancer
    /// address: here the pod's own address, written into the Service's status
    /// (testenv plays the load balancer), annotated with the gateway's
    /// identity, so `strait link` finds both there. Returns the pod's address.
    pub async fn start_gateway(&mut self, node: usize) -> anyhow::Result<Ipv4Addr> {
        crate::kubectl_apply(
            self.topology.cluster(),
            &deploy_file("gateway/rbac.yaml").to_string_lossy(),
        );
        wait_for_service_account(
            &self.client(),
            "strait-system",
            "strait-gateway",
            READY_TIMEOUT,
        )
        .await?;
        let name = "strait-gateway-0";
        let pod = self
            .topology
            .add_pod(node, "strait-system", name, |p| {
                p.with_service_account("strait-gateway")
                    .with_label("app.kubernetes.io/name", "strait-gateway")
                    .with_port("quic", 4143)
                    .with_port("admin", 4191)
            })
            .await?;
        let object = Api::<Pod>::namespaced(self.client(), "strait-system")
            .get(name)
            .await?;
        let dir = self.dir.join(name);
        self.mount_credentials(&dir, "strait-system", "strait-gateway", &object)
            .await?;
        let mut args = vec![
            format!("--cluster-name={}", self.name),
            format!("--trust-domain={TRUST_DOMAIN}"),
            "--drain-timeout=1s".into(),
        ];
        args.extend(self.identity_args(&dir)?);
        let process = pod.spawn(
            name,
            &self.binaries.path("strait-gateway"),
            &args,
            &env_refs(&component_env(&dir, "info")),
            &dir.join("gateway.log"),
        )?;
        let ip = pod.ip();
        self.components.push(Component {
            name: name.into(),
            admin: SocketAddr::new(IpAddr::V4(ip), 4191),
            process,
        });
        self.pods.push((pod, None));
        self.wait_ready(name).await?;
        self.gateway_service(ip).await?;
        Ok(ip)
    }

    async fn gateway_service(&self, ip: Ipv4Addr) -> anyhow::Result<()> {
        use kube::api::{Patch, PatchParams};
        let services: Api<k8s_openapi::api::core::v1::Service> =
            Api::namespaced(self.client(), "strait-system");
        let svc = serde_json::from_value(json!({
            "metadata": {"name": "strait-gateway", "namespace": "strait-system",
                "annotations": {"strait.dev/gateway-identity":
                    format!("spiffe://{TRUST_DOMAIN}/ns/strait-system/sa/strait-gateway")}},
            "spec": {"type": "LoadBalancer",
                     "selector": {"app.kubernetes.io/name": "strait-gateway"},
                     "ports": [{"name": "quic", "port": 4143, "protocol": "UDP", "targetPort": 4143},
                               {"name": "tls", "port": 4143, "protocol": "TCP", "targetPort": 4143}]},
        }))?;
        services.create(&PostParams::default(), &svc).await?;
        services
            .patch_status(
                "strait-gateway",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"status": {"loadBalancer": {"ingress": [{"ip": ip.to_string()}]}}}),
                ),
            )
            .await?;
        Ok(())
    }

    /// The mirror controller, with RBAC and the Link CRD from deploy/mirror.
    /// It runs on the host, not in a node namespace: it must reach the linked
    /// clusters' API servers, and in testenv those listen on the host's LAN
    /// addresses, which only the host reaches (nodes see their own LAN only).
    /// Its Pod object (unscheduled) exists so its identity token is bound to a
    /// Pod as a projected token is.
    pub async fn start_mirror_controller(&mut self) -> anyhow::Result<()> {
        for file in ["mirror/crd.yaml", "mirror/rbac.yaml"] {
            crate::kubectl_apply(
                self.topology.cluster(),
                &deploy_file(file).to_string_lossy(),
            );
        }
        let name = "strait-mirror-0";
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "strait-multicluster", "labels": {
                "app.kubernetes.io/name": "strait-mirror", "app.kubernetes.io/part-of": "strait"}},
            "spec": {"serviceAccountName": "strait-mirror", "hostNetwork": true,
                     "containers": [{"name": "mirror", "image": "strait-mirror"}]},
        }))?;
        wait_for_service_account(
            &self.client(),
            "strait-multicluster",
            "strait-mirror",
            READY_TIMEOUT,
        )
        .await?;
        let pod = self.create_pod("strait-multicluster", &pod).await?;
        let dir = self.dir.join(name);
        self.mount_credentials(&dir, "strait-multicluster", "strait-mirror", &pod)
            .await?;
        let admin = issuer::free_addr();
        let mut args = vec![format!("--admin-addr={admin}")];
        args.extend(self.identity_args(&dir)?);
        let process = ChildProcess::spawn_with_env(
            name,
            &self.binaries.path("strait-mirror"),
            &args,
            &env_refs(&component_env(&dir, "info")),
            &dir.join("mirror.log"),
        )?;
        self.components.push(Component {
            name: name.into(),
            admin,
            process,
        });
        self.wait_ready(name).await?;
        // Running and Ready as its readiness probe would say, at the host's
        // LAN address (hostNetwork), though bound to no node.
        let ip = IpAddr::V4(self.topology.network().host_ip());
        set_pod_ready(&self.client(), "strait-multicluster", name, ip, None, true).await?;
        Ok(())
    }

    /// A pod `namespace/name` on node `node` running as ServiceAccount `sa`
    /// (created if missing), labelled `app=<app>` when given, with named
    /// container ports. Start its process with [`MeshCluster::run_in_pod`].
    pub async fn add_pod(
        &mut self,
        node: usize,
        namespace: &str,
        name: &str,
        sa: &str,
        app: Option<&str>,
        ports: &[(&str, u16)],
    ) -> anyhow::Result<&NetPod> {
        let client = self.client();
        ensure_namespace(&client, namespace).await?;
        let _ = Api::<ServiceAccount>::namespaced(client.clone(), namespace)
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": sa}}))?,
            )
            .await;
        let pod = self
            .topology
            .add_pod(node, namespace, name, |mut p| {
                p = p.with_service_account(sa);
                if let Some(app) = app {
                    p = p.with_label("app", app);
                }
                for (port_name, port) in ports {
                    p = p.with_port(port_name, *port);
                }
                p
            })
            .await?;
        self.pods.push((pod, None));
        Ok(&self.pods.last().expect("just pushed").0)
    }

    /// Runs workspace binary `program` as the process of pod `name`; `args`
    /// gets the pod's address (to bind to).
    pub fn run_in_pod(
        &mut self,
        name: &str,
        program: &str,
        args: impl FnOnce(Ipv4Addr) -> Vec<String>,
    ) -> anyhow::Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        let binary = self.binaries.path(program);
        let (pod, process) = self
            .pods
            .iter_mut()
            .find(|(p, _)| p.name() == name)
            .with_context(|| format!("no pod {name}"))?;
        *process = Some(pod.spawn(name, &binary, &args(pod.ip()), &[], &log)?);
        Ok(())
    }

    async fn create_pod(&self, namespace: &str, pod: &Pod) -> anyhow::Result<Pod> {
        ensure_namespace(&self.client(), namespace).await?;
        Api::<Pod>::namespaced(self.client(), namespace)
            .create(&PostParams::default(), pod)
            .await
            .with_context(|| {
                format!(
                    "create Pod {namespace}/{}",
                    pod.metadata.name.as_deref().unwrap_or("?")
                )
            })
    }

    /// Waits for a component's `/ready`; on failure says why with its log.
    async fn wait_ready(&mut self, name: &str) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        let component = self
            .components
            .iter_mut()
            .find(|c| c.name == name)
            .with_context(|| format!("no component {name}"))?;
        loop {
            if let Some(status) = component.process.try_exit_status() {
                bail!(
                    "{name} exited ({status}); last lines of {}:\n{}",
                    component.process.log_path().display(),
                    log_tail(component.process.log_path(), 30)
                );
            }
            let last = match http_get(component.admin, "/ready").await {
                Ok(out) if out.starts_with("HTTP/1.1 200") => return Ok(()),
                Ok(out) => out.lines().next().unwrap_or_default().to_string(),
                Err(e) => e,
            };
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "{name} not ready after {}s ({last}); last lines of {}:\n{}",
                    READY_TIMEOUT.as_secs(),
                    component.process.log_path().display(),
                    log_tail(component.process.log_path(), 30)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A component's `/metrics` text.
    pub async fn metrics(&self, name: &str) -> anyhow::Result<String> {
        let c = self
            .component(name)
            .with_context(|| format!("no component {name}"))?;
        http_get(c.admin, "/metrics")
            .await
            .map_err(|e| anyhow::anyhow!("{name} metrics: {e}"))
    }
}

/// Sum of a metric's samples (lines starting with `name`) whose labels
/// contain every one of `having`.
pub fn metric_sum(text: &str, name: &str, having: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| having.iter().all(|h| l.contains(h)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// KUBECONFIG and RUST_LOG of a component whose files are in `dir`.
fn component_env(dir: &Path, log: &str) -> [(&'static str, std::ffi::OsString); 2] {
    [
        ("KUBECONFIG", dir.join("kubeconfig").into_os_string()),
        ("RUST_LOG", log.into()),
    ]
}

fn env_refs<'a>(env: &'a [(&'static str, std::ffi::OsString)]) -> Vec<(&'static str, &'a OsStr)> {
    env.iter().map(|(k, v)| (*k, v.as_os_str())).collect()
}

/// The Pod object of the node proxy on `node` as the DaemonSet (deploy/proxy)
/// would make it: its labels and ports, `strait-proxy-<node>`. The process
/// runs in the node's network namespace, so the Pod says `hostNetwork` (the
/// DaemonSet's pods have their own IP on the node, with hostPorts: the same
/// node either way).
pub fn node_proxy_pod(node: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": format!("strait-proxy-{node}"), "namespace": "strait-system", "labels": {
            "app.kubernetes.io/name": "strait-proxy", "app.kubernetes.io/part-of": "strait"}},
        "spec": {"nodeName": node, "serviceAccountName": "strait-proxy",
                 "hostNetwork": true,
                 "containers": [{"name": "proxy", "image": "strait-proxy", "ports": [
                     {"name": "outbound", "containerPort": 4140, "hostPort": 4140},
                     {"name": "inbound", "containerPort": 4143, "hostPort": 4143},
                     {"name": "admin", "containerPort": 4191}]}]},
    }))
    .expect("a valid Pod")
}

/// Writes a file readable by its owner only (tokens, keys, kubeconfigs).
pub fn write_private(path: &Path, contents: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("write {}", path.display()))?;
    file.write_all(contents.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::metric_sum;

    #[test]
    fn metric_sum_matches_whole_names_and_every_label() {
        let text = "# HELP request_total x\nrequest_total{direction=\"inbound\",src=\"a\"} 2\n\
                    request_total{direction=\"outbound\"} 5\nrequest_total_other{direction=\"inbound\"} 7\n";
        assert_eq!(metric_sum(text, "request_total", &[]), 7.0);
        assert_eq!(
            metric_sum(text, "request_total", &["direction=\"inbound\""]),
            2.0
        );
        assert_eq!(metric_sum(text, "request_total", &["nope"]), 0.0);
    }
}
