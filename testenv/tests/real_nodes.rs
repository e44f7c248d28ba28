//! Real nodes (root): containerd, kubelet and kube-proxy per node, a scheduler
//! and CoreDNS per cluster; pods from locally built images, Services through
//! kube-proxy, cluster DNS, `kubectl logs` and `kubectl exec`; nothing left
//! behind afterwards.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use strait_testenv::net::root_or_skip;
use strait_testenv::realnode::CGROUP_PREFIX;
use strait_testenv::{ClusterConfig, ClusterTopology, images, kubectl, kubectl_output};

fn workloads(image: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: shop}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: web, namespace: shop}}
spec:
  replicas: 2
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      containers:
        - name: web
          image: {image}
          args: ["--http", "0.0.0.0:8080"]
          env:
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
          ports: [{{containerPort: 8080}}]
          readinessProbe: {{httpGet: {{path: /, port: 8080}}, periodSeconds: 1}}
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: shop}}
spec:
  selector: {{app: web}}
  ports: [{{port: 80, targetPort: 8080}}]
---
apiVersion: v1
kind: Service
metadata: {{name: db, namespace: shop}}
spec:
  clusterIP: None
  selector: {{app: db}}
  ports: [{{port: 8080}}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {{name: db, namespace: shop}}
spec:
  serviceName: db
  replicas: 1
  selector: {{matchLabels: {{app: db}}}}
  template:
    metadata: {{labels: {{app: db}}}}
    spec:
      containers:
        - name: db
          image: {image}
          args: ["--http", "0.0.0.0:8080"]
          env:
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {{name: agent, namespace: shop}}
spec:
  selector: {{matchLabels: {{app: agent}}}}
  template:
    metadata: {{labels: {{app: agent}}}}
    spec:
      containers:
        - name: agent
          image: {image}
          args: ["--http", "0.0.0.0:9090"]
          env:
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
"#
    )
}

fn cgroups_left(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/sys/fs/cgroup/pids")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_nodes_run_pods_services_dns_logs_and_exec() {
    if !root_or_skip("real_nodes_run_pods_services_dns_logs_and_exec") {
        return;
    }
    let backend = strait_testenv::workspace_binary("strait-backend");
    let bin_dir = backend.parent().expect("target dir").to_path_buf();
    let archives = tokio::task::spawn_blocking(move || images::node_archives(&bin_dir))
        .await
        .unwrap()
        .expect("build the images");
    let mut config = ClusterConfig::new("rn");
    config.real_nodes = true;
    config.node_images = archives;
    let started = Instant::now();
    let topology = ClusterTopology::start_with(config, 2)
        .await
        .expect("a real-node cluster");
    eprintln!(
        "2 real nodes Ready in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let cluster = topology.cluster();
    let kubeconfig = cluster.kubeconfig_path();
    let node_cgroups: Vec<String> = topology
        .real_nodes()
        .iter()
        .map(|n| format!("{CGROUP_PREFIX}{}-{}", n.net().slot(), n.net().index()))
        .collect();

    let nodes: Api<Node> = Api::all(cluster.client());
    let listed = nodes.list(&Default::default()).await.unwrap();
    assert_eq!(listed.items.len(), 2, "both kubelets registered their Node");

    kubectl(
        &kubeconfig,
        &["apply", "-f", "-"],
        Some(&workloads(images::BACKEND_IMAGE)),
    );
    for selector in ["app=web", "app=db", "app=agent"] {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let out = kubectl_output(
                &kubeconfig,
                &[
                    "wait",
                    "-n",
                    "shop",
                    "--for=condition=Ready",
                    "pod",
                    "-l",
                    selector,
                    "--timeout=5s",
                ],
                None,
            );
            if out.status.success() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "pods {selector} not Ready: {}\n{}",
                String::from_utf8_lossy(&out.stderr),
                kubectl_output(&kubeconfig, &["get", "pods", "-A", "-o", "wide"], None)
                    .stdout
                    .escape_ascii()
            );
        }
    }
    let agents = kubectl(
        &kubeconfig,
        &[
            "get",
            "pods",
            "-n",
            "shop",
            "-l",
            "app=agent",
            "-o",
            "jsonpath={.items[*].spec.nodeName}",
        ],
        None,
    );
    let mut agent_nodes: Vec<&str> = agents.split_whitespace().collect();
    agent_nodes.sort();
    assert_eq!(
        agent_nodes,
        ["rn-node-1", "rn-node-2"],
        "one DaemonSet pod per node"
    );

    // From a real pod: cluster DNS (full name, search domain, a StatefulSet
    // pod's own name under its headless Service) and a ClusterIP through kube-proxy.
    // kube-proxy programs a new Service within a few seconds of its creation.
    for url in [
        "http://web.shop.svc.cluster.local/",
        "http://web/",
        "http://db-0.db.shop.svc.cluster.local:8080/",
    ] {
        let deadline = Instant::now() + Duration::from_secs(20);
        let body = loop {
            let out = kubectl_output(
                &kubeconfig,
                &[
                    "exec",
                    "-n",
                    "shop",
                    "deploy/web",
                    "--",
                    "/usr/local/bin/strait-backend",
                    "--get",
                    url,
                ],
                None,
            );
            let body = String::from_utf8_lossy(&out.stdout).into_owned();
            if out.status.success() {
                break body;
            }
            assert!(
                Instant::now() < deadline,
                "GET {url} from a pod: {body}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let expect = if url.contains("db-0") { "db-0" } else { "web-" };
        assert!(body.contains(expect), "GET {url} answered {body}");
    }
    let logs = kubectl(&kubeconfig, &["logs", "-n", "shop", "deploy/web"], None);
    assert!(logs.contains("serving HTTP"), "kubectl logs: {logs}");

    // An image no node has: the pod waits, and testenv says which image and
    // how to build it (no registry to pull from).
    kubectl(
        &kubeconfig,
        &[
            "run",
            "-n",
            "shop",
            "ghost",
            "--image=ghcr.io/strait-dev/strait-ghost:0.1.0",
        ],
        None,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let missing = loop {
        if let Some(image) = strait_testenv::installed::missing_images(&kubeconfig) {
            break image;
        }
        assert!(
            Instant::now() < deadline,
            "the ghost pod never reported its image missing"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(missing, "ghcr.io/strait-dev/strait-ghost:0.1.0");

    // A node whose kubelet dies: the control plane marks it NotReady (its
    // lease expires), and tear-down still removes everything of it.
    let mut topology = topology;
    topology.real_node_mut(1).expect("node 2").kill_kubelet();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let node = nodes.get("rn-node-2").await.unwrap();
        let ready = node
            .status
            .and_then(|s| s.conditions)
            .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status)
            .unwrap_or_default();
        if ready != "True" {
            eprintln!("rn-node-2 Ready={ready} after its kubelet died");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rn-node-2 still Ready 60s after its kubelet died"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    drop(topology);
    let left = cgroups_left(CGROUP_PREFIX);
    for cgroup in &node_cgroups {
        assert!(!left.contains(cgroup), "node cgroup {cgroup} left behind");
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains("strait-node-"),
        "node mounts visible on the host: {mounts}"
    );
    // What a node writes stays in its folder: none of a real node's paths
    // appear on the host.
    for path in [
        "/etc/cni",
        "/opt/cni",
        "/var/lib/cni",
        "/var/lib/kubelet",
        "/var/lib/containerd",
        "/run/containerd",
        "/var/log/pods",
    ] {
        assert!(
            !std::path::Path::new(path).exists(),
            "{path} exists on the host after real nodes ran"
        );
    }
}

/// In a network namespace of its own (so the host's port 53 is untouched): a
/// socket on 0.0.0.0:53 (UDP) or a dual-stack [::]:53 (TCP) makes the
/// preflight fail with a message naming the port and its holder; once they are
/// closed it passes. The process holding them is this test, which `ss` names.
#[test]
fn preflight_refuses_a_port_a_node_cluster_needs_that_is_taken_on_every_address() {
    use std::os::fd::AsFd;
    use strait_testenv::realnode::{NodeError, check_host_ports};
    if !root_or_skip("preflight_refuses_a_port_…") {
        return;
    }
    let mut anchor = std::process::Command::new("unshare")
        .args(["--net", "sleep", "infinity"])
        .spawn()
        .expect("unshare");
    // unshare execs sleep once the namespace exists: wait until it differs from ours.
    let ns_path = format!("/proc/{}/ns/net", anchor.id());
    let ours = std::fs::read_link("/proc/self/ns/net").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_link(&ns_path)
        .ok()
        .is_none_or(|ns| ns == ours)
    {
        assert!(Instant::now() < deadline, "unshare --net did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let ns = std::fs::File::open(&ns_path).unwrap();
    let outcome = std::thread::spawn(move || {
        rustix::thread::move_into_link_name_space(
            ns.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .expect("setns");
        let free = check_host_ports().map_err(|e| e.to_string());
        let udp = std::net::UdpSocket::bind("0.0.0.0:53").unwrap();
        let udp_taken = check_host_ports();
        drop(udp);
        let tcp = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None).unwrap();
        tcp.set_only_v6(false).unwrap();
        tcp.bind(&"[::]:53".parse::<std::net::SocketAddr>().unwrap().into())
            .unwrap();
        tcp.listen(8).unwrap();
        let tcp_taken = check_host_ports();
        drop(tcp);
        let free_again = check_host_ports().map_err(|e| e.to_string());
        (free, udp_taken, tcp_taken, free_again)
    })
    .join()
    .unwrap();
    anchor.kill().unwrap();
    anchor.wait().unwrap();
    let (free, udp_taken, tcp_taken, free_again) = outcome;
    assert_eq!(free, Ok(()), "nothing holds port 53 in a fresh namespace");
    let test_binary = std::env::current_exe().unwrap();
    let test_binary = test_binary.file_name().unwrap().to_string_lossy();
    for (result, protocol) in [(udp_taken, "udp"), (tcp_taken, "tcp")] {
        let err = result.expect_err("a wildcard socket on port 53 must fail the preflight");
        let message = err.to_string();
        assert!(
            matches!(err, NodeError::PortInUse { port: 53, protocol: p, .. } if p == protocol),
            "{message}"
        );
        // ss names the holder by its command name (at most 15 characters of it).
        let short: String = test_binary.chars().take(15).collect();
        assert!(
            message.contains(&format!("port 53/{protocol}")) && message.contains(&short),
            "the message names the port and who holds it: {message}"
        );
    }
    assert_eq!(free_again, Ok(()), "closed sockets free the port again");
}
