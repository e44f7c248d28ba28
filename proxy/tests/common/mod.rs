//! The node-proxy fixture shared by the tests and the benchmark: a testenv
//! cluster whose nodes are network namespaces, the real issuer, and a real
//! `strait-proxy` process on every node.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::Output;

use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;
use std::time::Duration;
use strait_mesh::identity::ca::{self, PemPair};
use strait_mesh::names::TOKEN_AUDIENCE;
use strait_testenv::issuer::{self, RunningIssuer, http_get, token, workload_token};
use strait_testenv::net::root_or_skip;
use strait_testenv::process::{ChildProcess, log_tail};
use strait_testenv::wait::eventually;
use strait_testenv::workloads::set_pod_ready;
use strait_testenv::{ClusterTopology, NetNode, NetPod, kubeconfig, workspace_binary};

const DAY: Duration = Duration::from_secs(24 * 3600);
pub const WAIT: Duration = Duration::from_secs(30);
pub const TRUST_DOMAIN: &str = "cluster.local";

pub struct Mesh {
    /// The cluster's name (`--cluster-name` of its proxies and gateway).
    pub name: String,
    pub topology: ClusterTopology,
    pub issuer: RunningIssuer,
    pub anchor: PemPair,
    /// The cluster's issuer (certificate and key), for benchmarks that need
    /// certificates of their own under the same anchor.
    pub issuer_pair: PemPair,
    pub proxies: Vec<ChildProcess>,
    pub pods: BTreeMap<String, (NetPod, Option<ChildProcess>)>,
    pub dir: tempfile::TempDir,
}

impl Drop for Mesh {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for p in &self.proxies {
                eprintln!(
                    "──── {} ({}) ────\n{}",
                    p.name(),
                    p.log_path().display(),
                    log_tail(p.log_path(), 40)
                );
            }
        }
    }
}

/// A Pod object for the proxy on `node` with the DaemonSet's labels and ports
/// (deploy/proxy), Running, and Ready once [`mark_proxy_ready`] says so (as its
/// readiness probe would), so the `strait-proxy` Service publishes it. The
/// process runs in the node's namespace, so the Pod says `hostNetwork` with
/// podIP = node IP (the DaemonSet's pods have their own IP on the node, with
/// hostPorts: the same node either way). Its token is bound to this pod on that
/// node, as a DaemonSet pod's projected token is. Then the proxy process.
pub async fn start_proxy(mesh: &Mesh, node: &NetNode, binary: &Path) -> ChildProcess {
    let client = mesh.topology.cluster().client();
    let name = format!("strait-proxy-{}", node.name());
    let pod = strait_testenv::stack::node_proxy_pod(node.name());
    let pod = Api::<Pod>::namespaced(client.clone(), "strait-system")
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    let uid = pod.metadata.uid.clone().unwrap();
    let ip = IpAddr::V4(node.ip());
    set_pod_ready(&client, "strait-system", &name, ip, Some(ip), false)
        .await
        .unwrap();
    let dir = mesh.dir.path().join(node.name());
    write_credentials(mesh, &dir, "strait-proxy", &name, &uid).await;
    spawn_proxy(mesh, node, binary)
}

/// The proxy process for `node` (its Pod and credentials made by
/// [`start_proxy`]): to start it again, or another build of it.
pub fn spawn_proxy(mesh: &Mesh, node: &NetNode, binary: &Path) -> ChildProcess {
    spawn_proxy_with(mesh, node, binary, &[])
}

/// [`spawn_proxy`] with more arguments. The fixture's proxies stop without
/// a shutdown delay (`STRAIT_SHUTDOWN_DELAY=0s`, so drain timings are what
/// the tests measure); `--shutdown-delay=…` in `extra` overrides it.
pub fn spawn_proxy_with(
    mesh: &Mesh,
    node: &NetNode,
    binary: &Path,
    extra: &[&str],
) -> ChildProcess {
    let index = mesh
        .topology
        .nodes()
        .iter()
        .position(|n| n.name() == node.name());
    let name = format!("strait-proxy-{}", node.name());
    let dir = mesh.dir.path().join(node.name());
    let s = |p: &Path| p.to_string_lossy().into_owned();
    let args = vec![
        format!("--node-name={}", node.name()),
        format!("--cluster-name={}", mesh.name),
        format!("--trust-domain={TRUST_DOMAIN}"),
        format!("--issuer-addr={}", mesh.issuer.addr),
        format!("--issuer-name={}", issuer::ISSUER_DNS),
        format!("--trust-anchors={}", s(&dir.join("ca.crt"))),
        format!("--token-file={}", s(&dir.join("token"))),
        "--drain-timeout=2s".to_string(),
        format!("--enroll-socket={}", s(&enroll_socket(mesh, node))),
    ];
    let mut args = args;
    // Tests run the second node's proxy on one thread and the third's on
    // the shared work-stealing runtime, the first's per core (the default),
    // so every test with three nodes covers all three (benchmarks keep the
    // default).
    if MIXED_RUNTIMES.load(std::sync::atomic::Ordering::Relaxed) {
        match index {
            Some(1) => args.push("--workers=1".to_string()),
            Some(2) => args.push("--runtime=shared".to_string()),
            _ => {}
        }
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    let kubeconfig_path = dir.join("kubeconfig");
    // Tests want the proxy's debug logs; the benchmark sets STRAIT_PROXY_LOG=warn.
    let log_filter = std::env::var("STRAIT_PROXY_LOG").unwrap_or("strait_proxy=debug,info".into());
    node.spawn(
        &name,
        binary,
        &args,
        &[
            ("KUBECONFIG", kubeconfig_path.as_os_str()),
            ("RUST_LOG", std::ffi::OsStr::new(&log_filter)),
            ("STRAIT_SHUTDOWN_DELAY", std::ffi::OsStr::new("0s")),
        ],
        &dir.join("proxy.log"),
    )
    .unwrap()
}

/// What a Strait component of `strait-system` running as ServiceAccount `sa`
/// in pod `pod` (uid `uid`) gets, written to `dir`: `kubeconfig` (an API token
/// of the ServiceAccount), `token` (the identity token, audience
/// `strait.dev/identity`, bound to the pod, as a projected token is) and
/// `ca.crt` (the trust anchor).
pub async fn write_credentials(mesh: &Mesh, dir: &Path, sa: &str, pod: &str, uid: &str) {
    let cluster = mesh.topology.cluster();
    let client = cluster.client();
    let identity_token = token(
        &client,
        "strait-system",
        sa,
        &[TOKEN_AUDIENCE],
        Some((pod, uid)),
    )
    .await;
    let api_token = token(&client, "strait-system", sa, &[], None).await;
    std::fs::create_dir_all(dir).unwrap();
    let kc = kubeconfig::with_token(
        cluster.name(),
        &cluster.server_url(),
        cluster.ca_pem(),
        &api_token,
    );
    std::fs::write(dir.join("kubeconfig"), kubeconfig::to_yaml(&kc).unwrap()).unwrap();
    std::fs::write(dir.join("token"), identity_token).unwrap();
    std::fs::write(dir.join("ca.crt"), &mesh.anchor.cert_pem).unwrap();
}

/// A certificate for `spiffe://<trust domain>/ns/strait-system/sa/<sa>`
/// signed by the mesh's issuer (as a component would hold), and the trust
/// bundle to go with it.
pub fn component_identity(
    mesh: &Mesh,
    sa: &str,
) -> (
    std::sync::Arc<strait_mesh::identity::tls::CertSlot>,
    strait_mesh::identity::tls::TrustBundle,
) {
    let signer = ca::LeafSigner::load(&mesh.issuer_pair, &mesh.anchor.cert_pem).unwrap();
    let id = format!("spiffe://{TRUST_DOMAIN}/ns/strait-system/sa/{sa}")
        .parse()
        .unwrap();
    let cert = signer.new_identity(&id, Duration::from_secs(3600)).unwrap();
    let bundle =
        strait_mesh::identity::tls::TrustBundle::from_pem(mesh.anchor.cert_pem.as_bytes()).unwrap();
    (cert, bundle)
}

/// The proxy's transparent-mode enrollment socket on `node`.
pub fn enroll_socket(mesh: &Mesh, node: &NetNode) -> std::path::PathBuf {
    mesh.dir.path().join(node.name()).join("enroll.sock")
}

/// A pod on `node` (index) in `namespace`, running as ServiceAccount `sa`,
/// annotated `strait.dev/transparent: enabled` and enrolled with its node's
/// proxy as the CNI plugin would (retried until the proxy's discovery has
/// seen the pod and it is captured).
pub async fn add_transparent_pod(
    mesh: &Mesh,
    node: usize,
    namespace: &str,
    name: &str,
    sa: &str,
) -> NetPod {
    use strait_proxy::transparent::{EnrollRequest, enroll};
    let pod = mesh
        .topology
        .add_pod(node, namespace, name, |p| {
            p.with_service_account(sa)
                .with_annotation("strait.dev/transparent", "enabled")
        })
        .await
        .unwrap();
    let socket = enroll_socket(mesh, pod.node());
    let netns = std::path::PathBuf::from(format!("/proc/{}/ns/net", pod.anchor_pid()));
    eventually(&format!("{namespace}/{name} is enrolled"), WAIT, || async {
        let request = EnrollRequest::Add {
            namespace: namespace.into(),
            name: name.into(),
            netns: netns.clone(),
        };
        match enroll(&socket, &request).await {
            Ok(true) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    pod
}

/// Marks the proxy Pod on `node` Ready (its `/ready` answered 200), so the
/// `strait-proxy` Service's EndpointSlice lists it.
pub async fn mark_proxy_ready(mesh: &Mesh, node: &NetNode, ready: bool) {
    let ip = IpAddr::V4(node.ip());
    set_pod_ready(
        &mesh.topology.cluster().client(),
        "strait-system",
        &format!("strait-proxy-{}", node.name()),
        ip,
        Some(ip),
        ready,
    )
    .await
    .unwrap();
}

/// A pod on `node` running strait-backend as SA `web` with label `app`:
/// HTTP on 8080, echo on 9000, a server-speaks-first banner on 2525, plus `extra` flags.
pub async fn backend(mesh: &mut Mesh, node: usize, name: &str, app: &str, extra: &[&str]) {
    let pod = mesh
        .topology
        .add_pod(node, "shop", name, |p| {
            p.with_label("app", app)
                .with_service_account("web")
                .with_port("http", 8080)
                .with_port("echo", 9000)
                .with_port("banner", 2525)
        })
        .await
        .unwrap();
    let ip = pod.ip();
    let mut args = vec![
        format!("--name={name}"),
        format!("--http={ip}:8080"),
        format!("--echo={ip}:9000"),
        format!("--banner={ip}:2525"),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let child = pod
        .spawn(
            name,
            &workspace_binary("strait-backend"),
            &args,
            &[],
            &mesh.dir.path().join(format!("{name}.log")),
        )
        .unwrap();
    mesh.pods.insert(name.into(), (pod, Some(child)));
}

pub async fn service(client: &Client, name: &str) {
    let annotations = if name == "sleepy" {
        json!({"strait.dev/timeout": "200ms"})
    } else {
        json!({})
    };
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "shop", "annotations": annotations},
        "spec": {"selector": {"app": name}, "ports": [
            {"name": "http", "port": 80, "targetPort": "http"},
            {"name": "echo", "port": 9000, "targetPort": "echo"},
            {"name": "banner", "port": 2525, "targetPort": "banner"}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
}

pub async fn ensure_sa(client: &Client, ns: &str, sa: &str) {
    let _ = workload_token(client, ns, sa).await;
}

/// A cluster of `nodes` network-namespace nodes, the issuer, and a node proxy
/// (`proxy` binary) ready on every node; no workloads yet.
/// Whether [`start_proxy`] runs the second node's proxy single-threaded
/// (`--workers=1`) and the third's on the shared runtime; benchmarks call
/// [`uniform_runtimes`].
static MIXED_RUNTIMES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Every proxy on the default runtime (for benchmarks; the proxies also
/// inherit `STRAIT_PROXY_WORKERS` from the environment).
pub fn uniform_runtimes() {
    MIXED_RUNTIMES.store(false, std::sync::atomic::Ordering::Relaxed);
}

pub async fn start_mesh(nodes: usize, proxy: &Path) -> Mesh {
    let anchor = ca::new_trust_anchor("strait trust anchor", 2 * DAY).unwrap();
    start_mesh_named("mesh", nodes, proxy, &anchor).await
}

/// As [`start_mesh`], for cluster `name` under the trust anchor `anchor`
/// (which may be shared with other clusters, DESIGN.md "Trust"): the cluster
/// gets an issuer of its own signed by the anchor.
pub async fn start_mesh_named(name: &str, nodes: usize, proxy: &Path, anchor: &PemPair) -> Mesh {
    let topology = ClusterTopology::start(name, nodes).await.unwrap();
    let client = topology.cluster().client();
    let anchor = anchor.clone();
    let issuer_pair = ca::new_issuer(&anchor, name, DAY).unwrap();
    let issuer = issuer::start_issuer_on(
        &workspace_binary("strait-identity"),
        topology.cluster(),
        &issuer_pair,
        &anchor.cert_pem,
        TRUST_DOMAIN,
        "1h",
        IpAddr::V4(topology.network().host_ip()),
    )
    .await;
    strait_testenv::kubectl_apply(
        topology.cluster(),
        concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/proxy/rbac.yaml"),
    );
    // The second way to reach the proxy (`internalTrafficPolicy: Local`).
    strait_testenv::kubectl_apply(
        topology.cluster(),
        concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/proxy/service.yaml"),
    );
    for sa in ["web", "client"] {
        ensure_sa(&client, "shop", sa).await;
    }
    strait_testenv::workloads::wait_for_service_account(
        &client,
        "strait-system",
        "strait-proxy",
        WAIT,
    )
    .await
    .unwrap();
    let mut mesh = Mesh {
        name: name.to_string(),
        topology,
        issuer,
        anchor,
        issuer_pair,
        proxies: Vec::new(),
        pods: BTreeMap::new(),
        dir: tempfile::tempdir().unwrap(),
    };
    let nodes: Vec<NetNode> = mesh.topology.nodes().to_vec();
    for node in &nodes {
        let child = start_proxy(&mesh, node, proxy).await;
        mesh.proxies.push(child);
    }
    for node in &nodes {
        proxy_ready(node).await;
        mark_proxy_ready(&mesh, node, true).await;
    }
    mesh
}

/// Waits for the proxy on `node` to answer `/ready`.
pub async fn proxy_ready(node: &NetNode) {
    let admin = SocketAddr::new(IpAddr::V4(node.ip()), 4191);
    admin_ready(admin, &format!("proxy on {} ready", node.name())).await;
}

/// Waits for a component's admin port (`admin`) to answer `/ready`.
pub async fn admin_ready(admin: SocketAddr, what: &str) {
    eventually(what, WAIT, || async {
        let out = http_get(admin, "/ready").await?;
        if out.starts_with("HTTP/1.1 200") {
            Ok(())
        } else {
            Err(out)
        }
    })
    .await;
}

/// Replaces every node's proxy process with one of `binary` (benchmarks
/// compare two builds on the same mesh), ready when this returns.
pub async fn restart_proxies(mesh: &mut Mesh, binary: &Path) {
    let nodes: Vec<NetNode> = mesh.topology.nodes().to_vec();
    for proxy in &mut mesh.proxies {
        proxy.stop(std::time::Duration::from_secs(3));
    }
    mesh.proxies = nodes
        .iter()
        .map(|node| spawn_proxy(mesh, node, binary))
        .collect();
    for node in &nodes {
        proxy_ready(node).await;
    }
}

/// The client pod (SA `client`) on node `node`.
pub async fn add_client(mesh: &mut Mesh, node: usize) {
    add_client_named(mesh, node, "client").await;
}

/// A client pod `name` (SA `client`) on node `node`.
pub async fn add_client_named(mesh: &mut Mesh, node: usize, name: &str) {
    let client_pod = mesh
        .topology
        .add_pod(node, "shop", name, |p| p.with_service_account("client"))
        .await
        .unwrap();
    mesh.pods.insert(name.into(), (client_pod, None));
}

/// The standard test mesh: 3 nodes; each service has a pod on node 2 and one
/// on node 3 (or one, for `sleepy`); the caller is on node 1.
pub async fn mesh(proxy: &Path) -> Option<Mesh> {
    if !root_or_skip("proxy node tests") {
        return None;
    }
    let mut mesh = start_mesh(3, proxy).await;
    let client = mesh.topology.cluster().client();
    backend(&mut mesh, 1, "web-1", "web", &[]).await;
    backend(&mut mesh, 2, "web-2", "web", &[]).await;
    backend(&mut mesh, 1, "slow-1", "slow", &["--delay=150ms"]).await;
    backend(&mut mesh, 2, "slow-2", "slow", &[]).await;
    backend(&mut mesh, 1, "flaky-1", "flaky", &["--status=503"]).await;
    backend(&mut mesh, 2, "flaky-2", "flaky", &[]).await;
    backend(&mut mesh, 1, "broken-1", "broken", &["--status=503"]).await;
    backend(&mut mesh, 2, "broken-2", "broken", &["--status=503"]).await;
    backend(&mut mesh, 1, "sleepy-1", "sleepy", &["--delay=3s"]).await;
    add_client(&mut mesh, 0).await;
    for name in ["web", "slow", "flaky", "broken", "sleepy"] {
        service(&client, name).await;
    }
    Some(mesh)
}

pub fn pod<'a>(mesh: &'a Mesh, name: &str) -> &'a NetPod {
    &mesh.pods[name].0
}

/// curl in the client pod through its node's proxy (`http_proxy=http://$NODE_IP:4140`).
pub fn curl(mesh: &Mesh, args: &[&str]) -> Output {
    let client = pod(mesh, "client");
    let proxy = format!("http://{}:4140", client.node().ip());
    curl_via(client, &proxy, args)
}

/// curl in `pod` with `proxy` as its HTTP proxy.
pub fn curl_via(pod: &NetPod, proxy: &str, args: &[&str]) -> Output {
    pod.command("curl")
        .args(["-sS", "--max-time", "5", "-x", proxy])
        .args(args)
        .output()
        .expect("run curl in the pod")
}

/// The JSON answer's pod name (strait-backend answers `{"pod": …}`).
pub fn answered_by(out: &Output) -> Result<String, String> {
    let body = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| {
        format!(
            "not JSON ({e}): {body} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    v["pod"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("no pod in {v}"))
}

pub fn curl_status(mesh: &Mesh, url: &str) -> u16 {
    let out = curl(mesh, &["-o", "/dev/null", "-w", "%{http_code}", url]);
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

pub async fn proxy_metrics(node: &NetNode) -> String {
    http_get(SocketAddr::new(IpAddr::V4(node.ip()), 4191), "/metrics")
        .await
        .unwrap()
}

/// Sum of a metric's samples whose line contains every one of `having`.
pub fn metric_sum(text: &str, name: &str, having: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && having.iter().all(|h| l.contains(h)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The gateway as a pod on node `node` (its own address, as a Deployment's pod
/// has): RBAC and ServiceAccount from deploy/gateway, a token bound to the
/// pod for its identity, and the `strait-gateway` process. Returns the pod
/// (keep it) and the process.
pub async fn start_gateway(mesh: &mut Mesh, node: usize, extra: &[&str]) -> (NetPod, ChildProcess) {
    let cluster = mesh.topology.cluster();
    strait_testenv::kubectl_apply(
        cluster,
        concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/gateway/rbac.yaml"),
    );
    let client = cluster.client();
    strait_testenv::workloads::wait_for_service_account(
        &client,
        "strait-system",
        "strait-gateway",
        WAIT,
    )
    .await
    .unwrap();
    let name = format!("strait-gateway-{node}");
    let pod = mesh
        .topology
        .add_pod(node, "strait-system", &name, |p| {
            p.with_service_account("strait-gateway")
                .with_label("app.kubernetes.io/name", "strait-gateway")
        })
        .await
        .unwrap();
    let child = spawn_gateway(mesh, &pod, extra).await;
    (pod, child)
}

/// Runs the `strait-gateway` process in the gateway pod `pod` (made by
/// [`start_gateway`]) and waits until it is ready: for starting it again
/// after a test has stopped it.
pub async fn spawn_gateway(mesh: &Mesh, pod: &NetPod, extra: &[&str]) -> ChildProcess {
    let name = pod.name().to_string();
    let cluster = mesh.topology.cluster();
    let client = cluster.client();
    let uid = Api::<Pod>::namespaced(client.clone(), "strait-system")
        .get(&name)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let dir = mesh.dir.path().join(&name);
    write_credentials(mesh, &dir, "strait-gateway", &name, &uid).await;
    let s = |p: &Path| p.to_string_lossy().into_owned();
    let mut args = vec![
        format!("--cluster-name={}", mesh.name),
        format!("--trust-domain={TRUST_DOMAIN}"),
        format!("--issuer-addr={}", mesh.issuer.addr),
        format!("--issuer-name={}", issuer::ISSUER_DNS),
        format!("--trust-anchors={}", s(&dir.join("ca.crt"))),
        format!("--token-file={}", s(&dir.join("token"))),
        "--drain-timeout=2s".to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let log_filter = std::env::var("STRAIT_PROXY_LOG")
        .unwrap_or("strait_gateway=debug,strait_mesh=debug,info".into());
    let child = pod
        .spawn(
            &name,
            &workspace_binary("strait-gateway"),
            &args,
            &[
                ("KUBECONFIG", dir.join("kubeconfig").as_os_str()),
                ("RUST_LOG", std::ffi::OsStr::new(&log_filter)),
            ],
            &dir.join("gateway.log"),
        )
        .unwrap();
    admin_ready(
        SocketAddr::new(IpAddr::V4(pod.ip()), 4191),
        "the gateway is ready",
    )
    .await;
    child
}

/// A mirror of `service` as the mirror controller writes it: `<service>-<cluster>`
/// with the mirror labels and remote name, and an EndpointSlice pointing at
/// the gateway (`gateway_ip:4143`, its identity annotated).
pub async fn mirror_service(client: &Client, service: &str, cluster: &str, gateway_ip: IpAddr) {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let name = format!("{service}-{cluster}");
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "shop",
            "labels": {"strait.dev/mirrored-service": "true", "strait.dev/cluster-name": cluster},
            "annotations": {"strait.dev/remote-svc-fq-name": format!("{service}.shop.svc.cluster.local")}},
        "spec": {"ports": [
            {"name": "http", "port": 80}, {"name": "echo", "port": 9000}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": format!("{name}-gateway"), "namespace": "shop",
            "labels": {"kubernetes.io/service-name": name,
                       "endpointslice.kubernetes.io/managed-by": "mirror.strait.dev"},
            "annotations": {"strait.dev/gateway-identity":
                format!("spiffe://{TRUST_DOMAIN}/ns/strait-system/sa/strait-gateway")}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 4143, "protocol": "TCP"},
                  {"name": "echo", "port": 4143, "protocol": "TCP"}],
        "endpoints": [{"addresses": [gateway_ip.to_string()], "conditions": {"ready": true}}],
    }))
    .unwrap();
    Api::<EndpointSlice>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &slice)
        .await
        .unwrap();
}

/// Labels `service` exported (or not).
pub async fn export(client: &Client, service: &str, exported: bool) {
    use kube::api::{Patch, PatchParams};
    let value = if exported {
        json!("true")
    } else {
        serde_json::Value::Null
    };
    Api::<Service>::namespaced(client.clone(), "shop")
        .patch(
            service,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"strait.dev/exported": value}}})),
        )
        .await
        .unwrap();
}

/// The port iperf3 serves on in its pod (named `iperf`).
pub const IPERF_PORT: u16 = 5201;

/// An iperf3 server for bulk measurements: pod `shop/iperf-1` on `node`
/// (label `app=iperf`, port `iperf` = [`IPERF_PORT`]), Service `shop/iperf`
/// with `service_port` (name, port) → `iperf`, and `iperf3 -s` running in
/// the pod.
pub async fn iperf_server(
    mesh: &Mesh,
    node: usize,
    service_port: (&str, u16),
) -> (NetPod, ChildProcess) {
    let pod = mesh
        .topology
        .add_pod(node, "shop", "iperf-1", |p| {
            p.with_label("app", "iperf")
                .with_service_account("web")
                .with_port("iperf", IPERF_PORT)
        })
        .await
        .unwrap();
    let (port_name, port) = service_port;
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "iperf", "namespace": "shop"},
        "spec": {"selector": {"app": "iperf"},
                 "ports": [{"name": port_name, "port": port, "targetPort": "iperf"}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(mesh.topology.cluster().client(), "shop")
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let args = [
        "-s",
        "-B",
        &pod.ip().to_string(),
        "-p",
        &IPERF_PORT.to_string(),
    ]
    .map(String::from);
    let server = pod
        .spawn(
            "iperf3-server",
            Path::new("/usr/bin/iperf3"),
            &args,
            &[],
            &mesh.dir.path().join("iperf3-server.log"),
        )
        .unwrap_or_else(|e| panic!("run iperf3 (the bench scripts install it): {e}"));
    (pod, server)
}

/// `iperf3 -c host -p port` in the client pod; received Gbit/s and retransmits.
pub fn iperf(client: &NetPod, host: &str, port: u16, secs: u64) -> Result<(f64, u64), String> {
    iperf_with(client.command("iperf3"), host, port, secs)
}

/// [`iperf`] with `iperf3` started by `command` (e.g. under proxychains).
pub fn iperf_with(
    mut command: std::process::Command,
    host: &str,
    port: u16,
    secs: u64,
) -> Result<(f64, u64), String> {
    let out = command
        .args(["-c", host, "-p", &port.to_string(), "-t", &secs.to_string()])
        .args(["-J", "--connect-timeout", "3000"])
        .output()
        .map_err(|e| format!("run iperf3: {e}"))?;
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("iperf3 JSON: {e}: {}", String::from_utf8_lossy(&out.stderr)))?;
    if let Some(error) = report["error"].as_str() {
        return Err(error.to_string());
    }
    let end = &report["end"];
    let bits = end["sum_received"]["bits_per_second"]
        .as_f64()
        .ok_or_else(|| format!("no sum_received in {end}"))?;
    Ok((
        bits / 1e9,
        end["sum_sent"]["retransmits"].as_u64().unwrap_or(0),
    ))
}
