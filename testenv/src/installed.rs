//! Strait installed as a user installs it, on two real-node clusters
//! ([`crate::realnode`]) joined by a [`Wan`]: images imported into every
//! node, `strait install | kubectl apply -f -` in each cluster (gateway as a
//! NodePort Service), `strait link | kubectl apply -f -` from east to west.
//!
//! What crosses the WAN, as between two clouds: west's gateway NodePort on
//! its first node, and west's API server through an endpoint on west's LAN
//! router (socat in the LAN namespace forwards to the API server on the host;
//! the certificate names it), which east's mirror controller, a pod, watches.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::net::RouterForward;
use crate::{ClusterConfig, ClusterTopology, Wan, images, kubectl_output};

/// The gateway's NodePort (`strait install --gateway-node-port`'s default).
pub const GATEWAY_NODE_PORT: u16 = 30143;
/// Port of the API endpoint on a LAN router.
pub const API_ENDPOINT_PORT: u16 = 6443;

/// Two clusters, east and west, with Strait installed and east linked to west
/// (and west to east with [`MeshOptions::link_both_ways`]).
/// Fields drop in order: the API endpoints and WAN before the clusters.
pub struct InstalledMesh {
    api_endpoints: Vec<RouterForward>,
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

/// Waits (90 s) until `kubectl wait --for=condition=Ready` succeeds for a
/// pod (`pod/app`), or `rollout status` for a workload (`deploy/web`), in
/// `namespace`.
pub fn wait_ready(kubeconfig: &Path, namespace: &str, target: &str) -> anyhow::Result<String> {
    let args: Vec<&str> = if target.starts_with("pod/") {
        vec![
            "wait",
            "-n",
            namespace,
            target,
            "--for=condition=Ready",
            "--timeout=10s",
        ]
    } else {
        vec![
            "rollout",
            "status",
            "-n",
            namespace,
            target,
            "--timeout=10s",
        ]
    };
    kubectl_until(kubeconfig, &args, Duration::from_secs(90))
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

/// Waits until every Strait workload of the cluster is rolled out and Ready;
/// a pod whose image no node has says which and how to build it.
pub fn wait_installed(kubeconfig: &Path) -> anyhow::Result<()> {
    for (namespace, workload) in [
        ("strait-system", "deploy/strait-identity"),
        ("strait-system", "ds/strait-proxy"),
        ("strait-system", "deploy/strait-gateway"),
        ("strait-multicluster", "deploy/strait-mirror"),
    ] {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let out = kubectl_output(
                kubeconfig,
                &[
                    "rollout",
                    "status",
                    "-n",
                    namespace,
                    workload,
                    "--timeout=10s",
                ],
                None,
            );
            if out.status.success() {
                break;
            }
            if let Some(missing) = missing_images(kubeconfig) {
                bail!(
                    "{workload} cannot start: no node has the image {missing} (there is no registry to pull from): \
                     build the images with `strait-testenv images --bin-dir target/release` and start the \
                     clusters with them (`strait-testenv up --real-nodes --strait-images <bin-dir>`, or \
                     `ClusterConfig::node_images`)"
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{workload} not rolled out within 180s: {}\n{}",
                    String::from_utf8_lossy(&out.stderr),
                    diagnose(kubeconfig, namespace)
                );
            }
        }
    }
    Ok(())
}

/// What an operator looks at when a rollout hangs: the namespace's pods,
/// its recent events, and the last log lines of every pod not Ready.
pub fn diagnose(kubeconfig: &Path, namespace: &str) -> String {
    let text = |args: &[&str]| {
        let out = kubectl_output(kubeconfig, args, None);
        format!(
            "$ kubectl {}\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let mut report = text(&["get", "pods", "-n", namespace, "-o", "wide"]);
    report += &text(&["get", "events", "-n", namespace, "--sort-by=.lastTimestamp"]);
    let not_ready = kubectl_output(
        kubeconfig,
        &[
            "get",
            "pods",
            "-n",
            namespace,
            "-o",
            "jsonpath={range .items[*]}{.metadata.name} {.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}",
        ],
        None,
    );
    for line in String::from_utf8_lossy(&not_ready.stdout).lines() {
        if let Some((pod, ready)) = line.split_once(' ')
            && ready != "True"
        {
            report += &text(&[
                "logs",
                "-n",
                namespace,
                pod,
                "--all-containers",
                "--tail=40",
            ]);
        }
    }
    report
}

/// An image some pod waits for in vain (ErrImagePull, ImagePullBackOff, …).
pub fn missing_images(kubeconfig: &Path) -> Option<String> {
    let out = kubectl_output(
        kubeconfig,
        &[
            "get",
            "pods",
            "-A",
            "-o",
            "jsonpath={range .items[*].status.containerStatuses[*]}{.image} {.state.waiting.reason}{\"\\n\"}{end}",
        ],
        None,
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|line| {
            let (image, reason) = line.split_once(' ')?;
            matches!(
                reason.trim(),
                "ErrImagePull" | "ImagePullBackOff" | "ErrImageNeverPull" | "InvalidImageName"
            )
            .then(|| image.to_string())
        })
}

/// The image archives real nodes of an installed mesh import: pause, the
/// test backend, and Strait's components, from the binaries in `bin_dir`.
pub async fn build_images(bin_dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let bins = bin_dir.to_path_buf();
    Ok(tokio::task::spawn_blocking(move || {
        let mut all = images::node_archives(&bins)?;
        all.extend(images::strait_archives(&bins)?);
        Ok::<_, images::ImageError>(all)
    })
    .await
    .expect("image build task panicked")?)
}

/// East and west as real-node clusters (`nodes` each, Service ranges that do
/// not overlap), every node importing `archives`.
pub async fn start_clusters(
    archives: &[PathBuf],
    nodes: usize,
) -> anyhow::Result<(ClusterTopology, ClusterTopology)> {
    let config = |name: &str, service_cidr: &str| {
        let mut config = ClusterConfig::new(name);
        config.real_nodes = true;
        config.node_images = archives.to_vec();
        config.service_cidr = service_cidr.into();
        config
    };
    Ok(tokio::try_join!(
        async {
            ClusterTopology::start_with(config("east", "10.96.0.0/16"), nodes)
                .await
                .context("start cluster east")
        },
        async {
            ClusterTopology::start_with(config("west", "10.97.0.0/16"), nodes)
                .await
                .context("start cluster west")
        },
    )?)
}

/// What a linked cluster (west, or east when linked both ways) shows the
/// WAN: its gateway's NodePort on its first node (whose address is
/// returned), and its API server behind the LAN router (the returned forward
/// must live as long as the link).
pub fn expose(wan: &Wan, target: &ClusterTopology) -> anyhow::Result<(Ipv4Addr, RouterForward)> {
    let gateway_node = target.node(0)?.clone();
    wan.expose_node(&gateway_node, &[GATEWAY_NODE_PORT])?;
    let api = target
        .cluster()
        .server_url()
        .trim_start_matches("https://")
        .parse::<SocketAddr>()
        .with_context(|| format!("{}'s API server address", target.cluster().name()))?;
    let api_endpoint = target
        .network()
        .forward_from_router(API_ENDPOINT_PORT, api)?;
    wan.expose_router(target.network(), &[API_ENDPOINT_PORT])?;
    Ok((gateway_node.ip(), api_endpoint))
}

/// The arguments of `strait link` for `target` as the other cluster reaches
/// it across the WAN (its kubeconfig's context is named after it).
pub fn link_args(target: &ClusterTopology, gateway: Ipv4Addr) -> Vec<String> {
    let name = target.cluster().name();
    vec![
        "link".into(),
        "--context".into(),
        name.into(),
        "--cluster-name".into(),
        name.into(),
        "--api-server-address".into(),
        format!(
            "https://{}:{API_ENDPOINT_PORT}",
            target.network().router_ip()
        ),
        "--gateway-addresses".into(),
        gateway.to_string(),
    ]
}

/// What an [`InstalledMesh`] has beyond Strait and east linked to west.
#[derive(Clone, Debug, Default)]
pub struct MeshOptions {
    /// Image archives every node imports besides the node's and Strait's
    /// (e.g. [`images::conformance_archives`]).
    pub extra_images: Vec<PathBuf>,
    /// West linked to east too: both clusters see each other's exports, as
    /// in a clusterset.
    pub link_both_ways: bool,
}

impl InstalledMesh {
    /// Builds the images from the binaries in `bin_dir` (debug or release),
    /// starts both clusters with `nodes` real nodes each, installs Strait in
    /// both with the `strait` CLI at `strait`, and links east to west.
    pub async fn start(strait: &Path, bin_dir: &Path, nodes: usize) -> anyhow::Result<Self> {
        Self::start_with(strait, bin_dir, nodes, MeshOptions::default()).await
    }

    /// [`InstalledMesh::start`] with more images or links.
    pub async fn start_with(
        strait: &Path,
        bin_dir: &Path,
        nodes: usize,
        options: MeshOptions,
    ) -> anyhow::Result<Self> {
        let started = Instant::now();
        let mut archives = build_images(bin_dir).await?;
        archives.extend(options.extra_images);
        let (east, west) = start_clusters(&archives, nodes).await?;
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
                    // Pods may opt in to transparent mode (`app_manifests`).
                    "--transparent",
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

        let mut api_endpoints = Vec::new();
        let mut pairs = vec![(&east, &west)];
        if options.link_both_ways {
            pairs.push((&west, &east));
        }
        for (from, to) in pairs {
            let (gateway, api_endpoint) = expose(&wan, to)?;
            api_endpoints.push(api_endpoint);
            let mut args = link_args(to, gateway);
            args.extend([
                "--kubeconfig".into(),
                to.cluster().kubeconfig_path().display().to_string(),
            ]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let link = run_strait(strait, &args)?;
            apply(&from.cluster().kubeconfig_path(), &link)?;
            tracing::info!(
                elapsed = ?started.elapsed(),
                "{} linked to {}",
                from.cluster().name(),
                to.cluster().name()
            );
        }
        Ok(Self {
            api_endpoints,
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

    /// The sample service in west (`replicas` pods of [`web_manifests`]) and
    /// east's client ([`client_manifests`]), both Ready; west's `shop/web`
    /// exported with `strait export`, and its mirror `web-west` written in
    /// east by east's mirror controller.
    pub fn serve_web_to_east(&self, replicas: u32) -> anyhow::Result<()> {
        let east = self.east.cluster().kubeconfig_path();
        let west = self.west.cluster().kubeconfig_path();
        apply(&west, &web_manifests(replicas))?;
        apply(&east, &client_manifests())?;
        wait_ready(&west, "shop", "deploy/web")?;
        wait_ready(&east, "shop", "deploy/client")?;
        self.strait(&[
            "export",
            "svc/web",
            "-n",
            "shop",
            "--kubeconfig",
            &west.display().to_string(),
        ])?;
        kubectl_until(
            &east,
            &["get", "svc", "-n", "shop", "web-west"],
            Duration::from_secs(60),
        )?;
        Ok(())
    }

    /// `strait export --clusterset svc/SERVICE -n NAMESPACE` in the cluster of `kubeconfig`.
    pub fn export_clusterset(
        &self,
        kubeconfig: &Path,
        namespace: &str,
        service: &str,
    ) -> anyhow::Result<String> {
        self.strait(&[
            "export",
            "--clusterset",
            &format!("svc/{service}"),
            "-n",
            namespace,
            "--kubeconfig",
            &kubeconfig.display().to_string(),
        ])
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

    /// Whether the linked clusters' API endpoints still forward (they stop
    /// with the mesh).
    pub fn api_endpoint_running(&self) -> bool {
        self.api_endpoints.iter().all(|e| !e.is_finished())
    }

    /// One kubeconfig file at `path` with both clusters' admin contexts
    /// (`east`, `west`), for tools that take several contexts of one file.
    pub fn write_kubeconfig(&self, path: &Path) -> anyhow::Result<()> {
        let merged = crate::kubeconfig::merge([
            self.east.cluster().kubeconfig().clone(),
            self.west.cluster().kubeconfig().clone(),
        ]);
        std::fs::write(path, crate::kubeconfig::to_yaml(&merged)?)
            .with_context(|| format!("write {}", path.display()))
    }
}

/// The sample service of the installed tests: namespace `shop`, a
/// ServiceAccount and Deployment `web` (`replicas` strait-backend pods: HTTP
/// on 8080, Ready when they answer, and a TCP echo on 9000) and Service `web`
/// (port 80 `http`, port 9000 `echo`).
pub fn web_manifests(replicas: u32) -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: shop}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: web, namespace: shop}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: web, namespace: shop}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      serviceAccountName: web
      containers:
        - name: web
          image: {image}
          args: ["--http", "0.0.0.0:8080", "--echo", "0.0.0.0:9000"]
          env:
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
          ports: [{{containerPort: 8080}}, {{containerPort: 9000}}]
          readinessProbe: {{httpGet: {{path: /, port: 8080}}, periodSeconds: 1}}
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: shop}}
spec:
  selector: {{app: web}}
  ports: [{{name: http, port: 80, targetPort: 8080}}, {{name: echo, port: 9000, targetPort: 9000}}]
"#,
        image = images::BACKEND_IMAGE
    )
}

/// The caller of the installed tests: namespace `shop`, ServiceAccount and
/// Deployment `client` (one strait-backend pod, to `kubectl exec` into) whose
/// app reaches its node proxy as the README says: `http_proxy` = the
/// strait-proxy Service.
pub fn client_manifests() -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: shop}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: client, namespace: shop}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: client, namespace: shop}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: client}}}}
  template:
    metadata: {{labels: {{app: client}}}}
    spec:
      serviceAccountName: client
      containers:
        - name: client
          image: {image}
          args: ["--http", "0.0.0.0:8080"]
          env:
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
            - name: http_proxy
              value: http://strait-proxy.strait-system.svc.cluster.local:4140
"#,
        image = images::BACKEND_IMAGE
    )
}

/// A bare Pod `shop/app` (ServiceAccount `client`, so the same identity as
/// the `client` Deployment) in transparent mode: no `http_proxy`, its
/// traffic redirected to its node proxy inside its own network namespace
/// (Strait installed with `--transparent`). Bare, so that a test can tell
/// it was never recreated (same UID).
pub fn app_manifests() -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: app
  namespace: shop
  labels: {{app: app}}
  annotations: {{strait.dev/transparent: enabled}}
spec:
  serviceAccountName: client
  containers:
    - name: app
      image: {image}
      args: ["--http", "0.0.0.0:8080"]
      env:
        - name: POD_NAME
          valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
"#,
        image = images::BACKEND_IMAGE
    )
}

/// `strait-backend --get URL` (`--http2`: h2c, prior knowledge) in the
/// transparent-mode `app` pod: no proxy settings at all.
pub fn get_from_app(kubeconfig: &Path, url: &str, http2: bool) -> std::process::Output {
    let mut args = vec![
        "exec",
        "-n",
        "shop",
        "app",
        "--",
        "/usr/local/bin/strait-backend",
        "--get",
        url,
    ];
    if http2 {
        args.push("--http2");
    }
    kubectl_output(kubeconfig, &args, None)
}

/// The ClusterIP of the `strait-system/strait-proxy` Service (the node
/// proxies' HTTP proxy port, 4140, as pods reach it).
pub fn proxy_service_ip(kubeconfig: &Path) -> anyhow::Result<IpAddr> {
    let out = crate::kubectl(
        kubeconfig,
        &[
            "get",
            "svc",
            "-n",
            "strait-system",
            "strait-proxy",
            "-o",
            "jsonpath={.spec.clusterIP}",
        ],
        None,
    );
    out.trim()
        .parse()
        .with_context(|| format!("the strait-proxy Service's ClusterIP: {out:?}"))
}

/// GETs `url` from the `client` pod ([`get_from_client`]) until a `web` pod
/// answers, at most `limit`: its answer and how long it took.
pub fn until_web_answers(
    kubeconfig: &Path,
    url: &str,
    limit: Duration,
) -> anyhow::Result<(String, Duration)> {
    let started = Instant::now();
    loop {
        let out = get_from_client(kubeconfig, url, None);
        let body = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && body.contains("\"pod\":\"web-") {
            return Ok((body, started.elapsed()));
        }
        if started.elapsed() >= limit {
            bail!(
                "{url} from the client pod: no web pod answered within {limit:?}: {body}{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `strait-backend --get URL` run in the `client` pod (`kubectl exec`):
/// through its node proxy by its `http_proxy`, or `via` another proxy.
pub fn get_from_client(kubeconfig: &Path, url: &str, via: Option<&str>) -> std::process::Output {
    let mut args = vec![
        "exec",
        "-n",
        "shop",
        "deploy/client",
        "--",
        "/usr/local/bin/strait-backend",
        "--get",
        url,
    ];
    if let Some(proxy) = via {
        args.extend(["--proxy", proxy]);
    }
    kubectl_output(kubeconfig, &args, None)
}
