//! Transparent mode on testenv nodes (network namespaces, root): a pod that
//! knows nothing of the mesh (no `http_proxy`) resolves a Service name and
//! connects to it; the rules in its own namespace bring the connection to
//! the node proxy's socket there, which carries it over mutual TLS like the
//! HTTP proxy's traffic. Enrollment goes through the proxy's Unix socket, as
//! a CNI plugin would.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use strait_proxy::transparent::{EnrollRequest, enroll};
use strait_testenv::wait::eventually;

mod common;

use common::*;

fn netns_of(pod: &strait_testenv::NetPod) -> PathBuf {
    PathBuf::from(format!("/proc/{}/ns/net", pod.anchor_pid()))
}

fn run(pod: &strait_testenv::NetPod, program: &str, args: &[&str]) -> Output {
    pod.command(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program} in {}: {e}", pod.name()))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Plain curl in the pod: no proxy settings at all.
fn tcurl(pod: &strait_testenv::NetPod, args: &[&str]) -> Output {
    let mut all = vec!["-sS", "--noproxy", "*", "--max-time", "5"];
    all.extend_from_slice(args);
    run(pod, "curl", &all)
}

/// A TCP exchange from the pod with python (in the pod's namespace): connect,
/// optionally send, read what comes within 3 s.
fn tcp_exchange(pod: &strait_testenv::NetPod, host: &str, port: u16, send: &str) -> Output {
    let script = format!(
        "import socket\n\
         s = socket.create_connection(({host:?}, {port}), timeout=5)\n\
         data = {send:?}.encode()\n\
         if data: s.sendall(data)\n\
         s.settimeout(3)\n\
         print(s.recv(200).decode(errors='replace'))\n"
    );
    run(pod, "python3", &["-c", &script])
}

/// Runs the chained CNI plugin as a container runtime does: the pod in
/// CNI_ARGS, its namespace in CNI_NETNS, the network config (with the
/// previous plugin's result) on stdin.
fn strait_cni(command: &str, pod: &strait_testenv::NetPod, socket: &Path) -> Output {
    use std::io::Write;
    let conf = json!({
        "cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "strait-cni",
        "enrollSocket": socket,
        "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": format!("{}/32", pod.ip())}]},
    });
    let mut cni = std::process::Command::new(strait_testenv::workspace_binary("strait-cni"))
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", "test")
        .env("CNI_NETNS", netns_of(pod))
        .env("CNI_IFNAME", "eth0")
        .env(
            "CNI_ARGS",
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME={}",
                pod.name()
            ),
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run strait-cni");
    cni.stdin
        .take()
        .unwrap()
        .write_all(conf.to_string().as_bytes())
        .unwrap();
    cni.wait_with_output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enrolled_pod_reaches_services_by_name_with_no_proxy_settings() {
    let Some(mut mesh) = mesh(Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await else {
        return;
    };
    let client = mesh.topology.cluster().client();
    // A Service whose server speaks first, marked opaque so nothing waits
    // for the client's first bytes.
    let banner: Service = serde_json::from_value(json!({
        "metadata": {"name": "greeter", "namespace": "shop",
                     "annotations": {"strait.dev/opaque-ports": "2525"}},
        "spec": {"selector": {"app": "web"},
                 "ports": [{"name": "banner", "port": 2525, "targetPort": "banner"}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &banner)
        .await
        .unwrap();
    let app = mesh
        .topology
        .add_pod(0, "shop", "app", |p| {
            p.with_service_account("client")
                .with_annotation("strait.dev/transparent", "enabled")
        })
        .await
        .unwrap();
    let node = app.node().clone();
    let socket = enroll_socket(&mesh, &node);

    // Before enrollment the ClusterIP goes nowhere (testenv has no kube-proxy).
    let web: Service = Api::namespaced(client.clone(), "shop")
        .get("web")
        .await
        .unwrap();
    let cluster_ip = web.spec.unwrap().cluster_ip.unwrap();
    let before = tcurl(&app, &["--max-time", "2", &format!("http://{cluster_ip}/")]);
    assert!(
        !before.status.success(),
        "without the mesh the ClusterIP must not answer: {}",
        text(&before)
    );

    // Enrolled the way a container runtime does it: the chained CNI plugin
    // with the pod in CNI_ARGS, the previous plugin's result passed through.
    let out = strait_cni("ADD", &app, &socket);
    assert!(out.status.success(), "strait-cni ADD: {}", text(&out));
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        result["ips"][0]["address"],
        format!("{}/32", app.ip()),
        "the previous result passes through"
    );
    let rules = text(&run(&app, "iptables", &["-w", "-t", "nat", "-S"]));
    assert!(
        rules.contains("-A OUTPUT -j STRAIT_OUTPUT") && rules.contains("--to-ports 15001"),
        "redirection rules in the pod's namespace: {rules}"
    );

    // DNS: the proxy's responder answers Service names from discovery.
    let resolved = eventually("the Service name resolves in the pod", WAIT, || async {
        let out = run(&app, "getent", &["ahostsv4", "web.shop.svc.cluster.local"]);
        let t = text(&out);
        if out.status.success() && t.contains(&cluster_ip) {
            Ok(t)
        } else {
            Err(t)
        }
    })
    .await;
    assert!(resolved.contains(&cluster_ip), "{resolved}");
    let missing = run(&app, "getent", &["ahostsv4", "nope.shop.svc.cluster.local"]);
    assert!(
        !missing.status.success(),
        "an unknown Service is NXDOMAIN: {}",
        text(&missing)
    );

    // HTTP/1 by name, balanced per request over the pods on both other nodes.
    let mut seen = BTreeMap::new();
    for i in 0..30 {
        let out = tcurl(
            &app,
            &[
                "--parallel",
                "--parallel-max",
                "10",
                &format!("http://web.shop.svc.cluster.local/t/{i}/a"),
                &format!("http://web.shop.svc.cluster.local/t/{i}/b"),
            ],
        );
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let v: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {}", text(&out)));
            *seen
                .entry(v["pod"].as_str().unwrap().to_string())
                .or_insert(0) += 1;
        }
    }
    assert_eq!(seen.values().sum::<i32>(), 60, "{seen:?}");
    assert_eq!(
        seen.keys().cloned().collect::<Vec<_>>(),
        ["web-1", "web-2"],
        "both pods served: {seen:?}"
    );

    // The pod that served it learns who called, from the proxy that
    // delivered it: a caller's own claim is replaced.
    let out = tcurl(
        &app,
        &[
            "-H",
            &format!(
                "strait-client-id: spiffe://{}/ns/shop/sa/admin",
                mesh.trust_domain
            ),
            "http://web.shop.svc.cluster.local/who",
        ],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["headers"]["strait-client-id"],
        format!("spiffe://{}/ns/shop/sa/client", mesh.trust_domain),
        "{v}"
    );

    // The ClusterIP directly, and HTTP/2 with prior knowledge (stays HTTP/2).
    let out = tcurl(&app, &[&format!("http://{cluster_ip}/by-ip")]);
    assert!(answered_by(&out).is_ok(), "{}", text(&out));
    let out = tcurl(
        &app,
        &[
            "--http2-prior-knowledge",
            "-w",
            "\nversion=%{http_version}",
            "http://web.shop.svc.cluster.local/h2",
        ],
    );
    let t = text(&out);
    assert!(
        t.contains("\"pod\"") && t.contains("version=2"),
        "h2c end to end: {t}"
    );

    // Opaque TCP: an echo, and a server-speaks-first banner on an opaque port.
    let out = tcp_exchange(&app, "web.shop.svc.cluster.local", 9000, "ping-opaque\n");
    assert!(
        text(&out).contains("ping-opaque"),
        "echo through the tunnel: {}",
        text(&out)
    );
    let out = tcp_exchange(&app, "greeter.shop.svc.cluster.local", 2525, "");
    assert!(
        text(&out).contains("220"),
        "banner arrives without the client speaking: {}",
        text(&out)
    );

    // Not the mesh: passes through unchanged (another node's admin port).
    let other = mesh.topology.node(1).unwrap().ip();
    let out = tcurl(&app, &[&format!("http://{other}:4191/live")]);
    assert!(out.status.success(), "passthrough: {}", text(&out));

    // The node proxy counted the pod's requests under its identity, and the
    // peers saw it as the caller.
    let metrics = proxy_metrics(&node).await;
    let requests = metric_sum(
        &metrics,
        "request_total",
        &["direction=\"outbound\"", "src_workload=\"client\""],
    );
    assert!(
        requests >= 62.0,
        "outbound requests counted: {requests}\n{metrics}"
    );
    let (mut inbound, mut inbound_requests) = (0.0, 0.0);
    for n in 1..3 {
        let m = proxy_metrics(mesh.topology.node(n).unwrap()).await;
        let caller = ["direction=\"inbound\"", "src_workload=\"client\""];
        inbound += metric_sum(&m, "tcp_open_total", &caller);
        inbound_requests += metric_sum(&m, "request_total", &caller);
    }
    assert!(inbound >= 1.0, "peers saw the caller's identity");
    // HTTP tunnels are served as HTTP on the receiving side too (the header's
    // protocol hint; no second detection): each request counted there.
    assert!(
        inbound_requests >= 62.0,
        "inbound requests per caller: {inbound_requests}"
    );

    // Removal (CNI DEL): rules gone, the pod is on its own again.
    let out = strait_cni("DEL", &app, &socket);
    assert!(out.status.success(), "strait-cni DEL: {}", text(&out));
    let rules = text(&run(&app, "iptables", &["-w", "-t", "nat", "-S"]));
    assert!(!rules.contains("STRAIT_OUTPUT"), "rules removed: {rules}");
    let after = tcurl(&app, &["--max-time", "2", &format!("http://{cluster_ip}/")]);
    assert!(!after.status.success(), "{}", text(&after));
    mesh.pods.insert("app".into(), (app, None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrollment_refuses_bad_requests_and_keeps_serving() {
    let Some(mut mesh) = mesh(Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await else {
        return;
    };
    let node = mesh.topology.node(0).unwrap().clone();
    let socket = enroll_socket(&mesh, &node);
    let mode = std::fs::metadata(&socket).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o600,
        "only root on the node may enroll pods"
    );
    // Garbage on the socket: an answer that says what to send.
    let mut stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    stream.write_all(b"{\"op\":\"explode\"}\n").await.unwrap();
    let mut line = String::new();
    tokio::io::BufReader::new(&mut stream)
        .read_line(&mut line)
        .await
        .unwrap();
    assert!(
        line.contains("\"ok\":false") && line.contains("op"),
        "{line}"
    );
    // A pod that did not ask for transparent mode is left alone.
    let plain = mesh
        .topology
        .add_pod(0, "shop", "plain", |p| p.with_service_account("client"))
        .await
        .unwrap();
    let captured = enroll(
        &socket,
        &EnrollRequest::Add {
            namespace: "shop".into(),
            name: "plain".into(),
            netns: netns_of(&plain),
        },
    )
    .await
    .expect("enroll answers");
    assert!(!captured, "not annotated: not captured");
    let rules = text(&run(&plain, "iptables", &["-w", "-t", "nat", "-S"]));
    assert!(!rules.contains("STRAIT_OUTPUT"), "{rules}");
    // A pod the proxy does not know on its node: refused, saying why.
    let err = enroll(
        &socket,
        &EnrollRequest::Add {
            namespace: "shop".into(),
            name: "elsewhere".into(),
            netns: netns_of(&plain),
        },
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("not scheduled to node"), "{err}");
    mesh.pods.insert("plain".into(), (plain, None));

    // Enrolling twice replaces the first enrollment (the ports are reused).
    let app = mesh
        .topology
        .add_pod(0, "shop", "again", |p| {
            p.with_service_account("client")
                .with_annotation("strait.dev/transparent", "enabled")
        })
        .await
        .unwrap();
    // A network namespace that does not exist: a clear error, nothing half-done.
    let err = enroll(
        &socket,
        &EnrollRequest::Add {
            namespace: "shop".into(),
            name: "again".into(),
            netns: "/proc/nonexistent/ns/net".into(),
        },
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("network namespace"), "{err}");
    for _ in 0..2 {
        let captured = enroll(
            &socket,
            &EnrollRequest::Add {
                namespace: "shop".into(),
                name: "again".into(),
                netns: netns_of(&app),
            },
        )
        .await
        .expect("enroll (again)");
        assert!(captured);
    }
    let rules = text(&run(&app, "iptables", &["-w", "-t", "nat", "-S", "OUTPUT"]));
    assert_eq!(
        rules.matches("STRAIT_OUTPUT").count(),
        1,
        "one jump, not two: {rules}"
    );
    let out = eventually("the re-enrolled pod is served", WAIT, || async {
        let out = tcurl(&app, &["http://web.shop.svc.cluster.local/again"]);
        answered_by(&out).map_err(|e| format!("{e}: {}", text(&out)))
    })
    .await;
    assert!(out.starts_with("web-"), "{out}");
    mesh.pods.insert("again".into(), (app, None));
}
