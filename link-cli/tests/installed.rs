//! Strait installed the way a user installs it (root): real nodes (kubelet,
//! containerd, kube-proxy; see testenv's `realnode`), images built here and
//! imported into each node, `strait install | kubectl apply -f -`, every
//! component Ready as a real pod (the node-proxy DaemonSet on every node), a
//! meshed request through the `strait-proxy` Service to the caller's node proxy carrying
//! the caller's identity to the destination pod; transparent mode
//! (`--transparent`): the proxy chains `strait-cni` into each node's CNI
//! configuration, a pod that opted in is captured through the real CNI chain
//! and enrolled again by the new proxy after a DaemonSet rollout (never
//! recreated); then `strait uninstall | kubectl delete -f -` removing all of
//! it (CNI entry, plugin, the captured pod's rules included) and nothing else.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use strait_testenv::installed::{
    self, app_manifests, client_manifests, get_from_app, get_from_client, proxy_service_ip,
    run_strait, wait_installed, wait_ready, web_manifests,
};
use strait_testenv::net::root_or_skip;
use strait_testenv::{ClusterConfig, ClusterTopology, images, kubectl, kubectl_output};

fn strait(args: &[&str]) -> String {
    run_strait(Path::new(env!("CARGO_BIN_EXE_strait")), args).unwrap()
}

fn kubectl_until(kubeconfig: &Path, args: &[&str], limit: Duration) -> String {
    installed::kubectl_until(kubeconfig, args, limit).unwrap()
}

/// GETs `url` from the client pod through its node proxy until it answers
/// (30 s); the body.
fn get_until(kubeconfig: &Path, url: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = get_from_client(kubeconfig, url, None);
        if out.status.success() {
            return String::from_utf8_lossy(&out.stdout).into_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "GET {url} from the client pod: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

const CALLER: &str = "spiffe://east.clusterset.local/ns/shop/sa/client";

/// GETs `url` from the transparent-mode `app` pod until `done` holds for the
/// body (30 s); the body.
fn app_get_until(kubeconfig: &Path, url: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = get_from_app(kubeconfig, url, false);
        let body = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && done(&body) {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "GET {url} from the app pod: {body}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Each node's CNI configuration and whether the plugin is in its bin folder.
fn cni_on_nodes(topology: &ClusterTopology) -> Vec<(String, bool)> {
    topology
        .real_nodes()
        .iter()
        .map(|node| {
            let conf = node
                .read_file(Path::new("/etc/cni/net.d/10-testenv.conflist"))
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            let plugin = node
                .read_file(Path::new("/opt/cni/bin/strait-cni"))
                .is_some();
            (conf, plugin)
        })
        .collect()
}

/// The `app` pod's UID and restart count.
fn app_identity(kubeconfig: &Path) -> String {
    kubectl(
        kubeconfig,
        &[
            "get",
            "pod",
            "-n",
            "shop",
            "app",
            "-o",
            "jsonpath={.metadata.uid}/{.status.containerStatuses[0].restartCount}",
        ],
        None,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strait_installs_on_real_nodes_carries_traffic_and_uninstalls() {
    if !root_or_skip("strait_installs_on_real_nodes_carries_traffic_and_uninstalls") {
        return;
    }
    let bin_dir: PathBuf = Path::new(env!("CARGO_BIN_EXE_strait"))
        .parent()
        .expect("target dir")
        .to_path_buf();
    let archives = tokio::task::spawn_blocking(move || {
        let mut all = images::node_archives(&bin_dir)?;
        all.extend(images::strait_archives(&bin_dir)?);
        Ok::<_, images::ImageError>(all)
    })
    .await
    .unwrap()
    .expect("build the images");
    let mut config = ClusterConfig::new("east");
    config.real_nodes = true;
    config.node_images = archives;
    let topology = ClusterTopology::start_with(config, 2)
        .await
        .expect("a real-node cluster");
    let kubeconfig = topology.cluster().kubeconfig_path();
    let work = tempfile::tempdir().unwrap();
    let dir = |name: &str| work.path().join(name).display().to_string();

    strait(&["identity", "trust-anchor", "--out-dir", &dir("anchor")]);
    strait(&[
        "identity",
        "issuer",
        "--anchor-cert",
        &dir("anchor/ca.crt"),
        "--anchor-key",
        &dir("anchor/ca.key"),
        "--cluster",
        "east",
        "--out-dir",
        &dir("east"),
    ]);
    let manifests = strait(&[
        "install",
        "--identity-dir",
        &dir("east"),
        "--gateway-service-type",
        "NodePort",
        "--transparent",
    ]);
    assert!(
        !manifests.contains(":latest"),
        "no image may be :latest (the kubelet would pull it on every start)"
    );
    let started = Instant::now();
    kubectl(&kubeconfig, &["apply", "-f", "-"], Some(&manifests));

    // Every component as a real pod, Ready; one node proxy per node.
    wait_installed(&kubeconfig).unwrap();
    eprintln!(
        "strait installed and Ready in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let ready = kubectl(
        &kubeconfig,
        &[
            "get",
            "ds",
            "-n",
            "strait-system",
            "strait-proxy",
            "-o",
            "jsonpath={.status.numberReady}",
        ],
        None,
    );
    assert_eq!(ready, "2", "a Ready node proxy on each of the 2 nodes");
    let restarts = kubectl(
        &kubeconfig,
        &[
            "get",
            "pods",
            "-A",
            "-l",
            "app.kubernetes.io/part-of=strait",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name}={.status.containerStatuses[0].restartCount} {end}",
        ],
        None,
    );
    eprintln!("restarts: {restarts}");

    // A meshed call: the client pod's own node proxy (the strait-proxy
    // Service, internalTrafficPolicy: Local) → mTLS → the destination node's
    // proxy → a web pod, which sees the caller's identity.
    kubectl(
        &kubeconfig,
        &["apply", "-f", "-"],
        Some(&format!("{}---\n{}", web_manifests(2), client_manifests())),
    );
    for workload in ["deploy/web", "deploy/client"] {
        kubectl_until(
            &kubeconfig,
            &["rollout", "status", "-n", "shop", workload, "--timeout=10s"],
            Duration::from_secs(90),
        );
    }
    // Transparent mode through the node's real CNI chain: each node proxy
    // chained strait-cni into the node's configuration; a pod that opted in
    // (annotation) is enrolled by the plugin when containerd sets up its
    // network, and its plain GET by name (cluster DNS answered by the
    // proxy, the ClusterIP redirected to it) carries its identity.
    for (conf, plugin) in cni_on_nodes(&topology) {
        assert!(
            conf.contains("\"strait-cni\"") && plugin,
            "strait-cni chained on every node: {conf}"
        );
    }
    kubectl(&kubeconfig, &["apply", "-f", "-"], Some(&app_manifests()));
    wait_ready(&kubeconfig, "shop", "pod/app").unwrap();
    let captured = app_get_until(&kubeconfig, "http://web.shop.svc.cluster.local/", |b| {
        b.contains("\"pod\":\"web-")
    });
    assert!(
        captured.contains(CALLER),
        "a transparent pod's call carries its identity: {captured}"
    );
    let app_before = app_identity(&kubeconfig);

    let body = get_until(&kubeconfig, "http://web.shop.svc.cluster.local/");
    assert!(
        body.contains("\"pod\":\"web-"),
        "answered by a web pod: {body}"
    );
    assert!(
        body.contains(CALLER),
        "the destination saw the caller's identity (through both node proxies): {body}"
    );
    // A DaemonSet rollout of the node proxy (a new image tag) under 200 rps
    // between two pods: how many requests fail, and how long each node's
    // traffic had no proxy. Measured and reported (see ARCHITECTURE.md,
    // "Rolling the DaemonSet"); the test holds that none failed, that the
    // rollout completes and that traffic flows through the new proxies
    // afterwards.
    let next_tag = format!("{}-next", images::DEFAULT_TAG);
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_strait")).parent().unwrap();
    let next = images::strait_images(bin_dir, images::DEFAULT_REGISTRY, &next_tag)
        .unwrap()
        .into_iter()
        .find(|i| i.name.contains("strait-proxy"))
        .unwrap();
    let next_archive = images::cached_archive(&next).unwrap();
    for node in topology.real_nodes() {
        node.import_image(&next_archive).unwrap();
    }
    let proxy_service = proxy_service_ip(&kubeconfig).unwrap();
    let load_kubeconfig = kubeconfig.clone();
    let load = std::thread::spawn(move || {
        kubectl_output(
            &load_kubeconfig,
            &[
                "exec",
                "-n",
                "shop",
                "deploy/client",
                "--",
                "/usr/local/bin/strait-load",
                "--connect",
                &format!("{proxy_service}:4140"),
                "--uri",
                "http://web.shop.svc.cluster.local/",
                "--host",
                "web.shop.svc.cluster.local",
                "--rate",
                "200",
                "--connections",
                "4",
                "--body",
                "0",
                "--warmup",
                "1s",
                "--duration",
                "45s",
            ],
            None,
        )
    });
    std::thread::sleep(Duration::from_secs(5));
    // Per node, how long no node proxy was Ready and not terminating (new
    // connections had nowhere to go), seen from the API every 100 ms.
    let watch_client = topology.cluster().client();
    let (stop_watch, mut stopped) = tokio::sync::watch::channel(false);
    let watcher = tokio::spawn(async move {
        use k8s_openapi::api::core::v1::Pod;
        let pods: kube::Api<Pod> = kube::Api::namespaced(watch_client, "strait-system");
        let params = kube::api::ListParams::default().labels("app.kubernetes.io/name=strait-proxy");
        let mut unserved: std::collections::BTreeMap<String, Duration> = Default::default();
        let mut last = Instant::now();
        loop {
            if let Ok(list) = pods.list(&params).await {
                let now = Instant::now();
                for node in ["east-node-1", "east-node-2"] {
                    let serving = list.items.iter().any(|p| {
                        p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                            && p.metadata.deletion_timestamp.is_none()
                            && p.status
                                .as_ref()
                                .and_then(|s| s.conditions.as_ref())
                                .is_some_and(|c| {
                                    c.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                                })
                    });
                    if !serving {
                        *unserved.entry(node.to_string()).or_default() += now - last;
                    }
                }
                last = now;
            }
            tokio::select! {
                _ = stopped.changed() => return unserved,
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    });
    let rollout_started = Instant::now();
    kubectl(
        &kubeconfig,
        &[
            "set",
            "image",
            "-n",
            "strait-system",
            "ds/strait-proxy",
            &format!("proxy={}", next.name),
        ],
        None,
    );
    let status_kubeconfig = kubeconfig.clone();
    tokio::task::spawn_blocking(move || {
        kubectl_until(
            &status_kubeconfig,
            &[
                "rollout",
                "status",
                "-n",
                "strait-system",
                "ds/strait-proxy",
                "--timeout=10s",
            ],
            Duration::from_secs(150),
        )
    })
    .await
    .unwrap();
    let rollout = rollout_started.elapsed();
    stop_watch.send(true).unwrap();
    let unserved = watcher.await.unwrap();
    let load = tokio::task::spawn_blocking(move || load.join().unwrap())
        .await
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&load.stdout).unwrap_or_else(|e| {
        panic!(
            "strait-load's report ({e}): {}{}",
            String::from_utf8_lossy(&load.stdout),
            String::from_utf8_lossy(&load.stderr)
        )
    });
    eprintln!(
        "MEASURED node-proxy rollout to {next_tag} under 200 rps: rollout {rollout:?}; no Ready proxy per node {unserved:?}; load {report}"
    );
    assert!(
        rollout < Duration::from_secs(40),
        "the rollout ({rollout:?}) outlasted the load it was measured under"
    );
    // Surge (the new proxy Ready before the old one stops), the old one's
    // shutdown delay (still accepting, every answer closing its
    // connection) and the move of peers to the new pod's address: not one
    // idempotent request fails.
    assert_eq!(
        report["errors"], 0,
        "requests failed while the node proxies were rolled: {report}"
    );
    assert!(
        unserved.is_empty(),
        "a node had no Ready proxy during the rollout: {unserved:?}"
    );
    let images_now = kubectl(
        &kubeconfig,
        &[
            "get",
            "pods",
            "-n",
            "strait-system",
            "-l",
            "app.kubernetes.io/name=strait-proxy",
            "-o",
            "jsonpath={.items[*].spec.containers[0].image}",
        ],
        None,
    );
    assert_eq!(
        images_now
            .split_whitespace()
            .filter(|i| i.ends_with(&next_tag))
            .count(),
        2,
        "both nodes run the new proxy: {images_now}"
    );
    let after = get_until(&kubeconfig, "http://web.shop.svc.cluster.local/after");
    assert!(after.contains(CALLER), "through the new proxies: {after}");
    // The transparent pod, running since before the rollout, enrolled again
    // by its node's new proxy (from the captures the old one remembered).
    let after = app_get_until(
        &kubeconfig,
        "http://web.shop.svc.cluster.local/after",
        |b| b.contains("\"pod\":\"web-"),
    );
    assert!(
        after.contains(CALLER),
        "the transparent pod is captured by the new proxy: {after}"
    );
    assert_eq!(
        app_identity(&kubeconfig),
        app_before,
        "the same pod (UID/restarts), not recreated"
    );

    // Uninstall: everything install made goes, the app stays.
    let removal = strait(&[
        "uninstall",
        "--kubeconfig",
        &kubeconfig.display().to_string(),
    ]);
    kubectl(
        &kubeconfig,
        &["delete", "-f", "-", "--wait=true", "--timeout=60s"],
        Some(&removal),
    );
    let namespaces = kubectl(&kubeconfig, &["get", "ns", "-o", "name"], None);
    assert!(
        !namespaces.contains("strait-system") && !namespaces.contains("strait-multicluster"),
        "Strait's namespaces are gone: {namespaces}"
    );
    assert!(
        namespaces.contains("namespace/shop"),
        "the app stays: {namespaces}"
    );
    let leftovers = kubectl(
        &kubeconfig,
        &["get", "clusterroles,clusterrolebindings,crd", "-o", "name"],
        None,
    );
    assert!(
        !leftovers.contains("strait"),
        "cluster-wide objects of Strait left: {leftovers}"
    );
    // On the nodes: the stopping proxies saw their DaemonSet gone and took
    // strait-cni out of the CNI configuration, and gave the captured pod its
    // own network back: its call now goes straight to web (no identity).
    for (conf, plugin) in cni_on_nodes(&topology) {
        assert!(
            !conf.contains("strait-cni") && conf.contains("\"ptp\"") && !plugin,
            "strait-cni taken out of every node's CNI configuration: {conf}"
        );
    }
    let direct = app_get_until(&kubeconfig, "http://web.shop.svc.cluster.local/", |b| {
        b.contains("\"pod\":\"web-")
    });
    assert!(
        !direct.contains("strait-client-id"),
        "the app's own network again, no mesh: {direct}"
    );
    // New pods start on the nodes (no plugin waiting for a proxy).
    kubectl(
        &kubeconfig,
        &["scale", "-n", "shop", "deploy/web", "--replicas=4"],
        None,
    );
    wait_ready(&kubeconfig, "shop", "deploy/web").unwrap();
}
