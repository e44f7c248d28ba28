//! Nodes and pods as network namespaces (`strait_testenv::net`): real
//! processes, real sockets, real routes. These need root, as in CI; without it
//! they fail saying so, or print SKIPPED with STRAIT_SKIP_ROOT_TESTS=1.

use std::io::{BufRead, BufReader};
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use strait_testenv::net::{ClusterNetwork, NetPod, NsId, root_or_skip};
use strait_testenv::process::{ChildProcess, is_alive};
use strait_testenv::{ClusterTopology, NetNode};

const ECHO_PORT: u16 = 7000;
const HTTP_PORT: u16 = 8080;

fn backend() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_strait-backend"))
}

fn backend_args(name: &str) -> Vec<String> {
    vec![
        "--name".into(),
        name.into(),
        "--echo".into(),
        format!("0.0.0.0:{ECHO_PORT}"),
        "--http".into(),
        format!("0.0.0.0:{HTTP_PORT}"),
    ]
}

fn start_backend_in_pod(pod: &NetPod, logs: &Path) -> ChildProcess {
    pod.spawn(
        pod.name(),
        backend(),
        &backend_args(pod.name()),
        &[],
        &logs.join(format!("{}.log", pod.name())),
    )
    .expect("start strait-backend in the pod")
}

/// Asks the echo server at `ip` who it is, over TCP from wherever `cmd` runs
/// (a `nsenter` command from `NetPod::command`/`NetNode::command`). One try.
fn whoami_once(mut cmd: Command, ip: Ipv4Addr) -> Result<String, String> {
    let script = format!(
        "exec 3<>/dev/tcp/{ip}/{ECHO_PORT} || exit 1; printf 'WHOAMI\\n' >&3; head -n1 <&3"
    );
    let out = cmd
        .args(["3", "bash", "-c", &script])
        .output()
        .expect("run bash in the namespace");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// As [`whoami_once`], retried for up to 15 s while the server starts.
fn whoami(make: impl Fn() -> Command, ip: Ipv4Addr) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match whoami_once(make(), ip) {
            Ok(name) if !name.is_empty() => return name,
            other if Instant::now() >= deadline => {
                panic!("no answer from {ip}:{ECHO_PORT} within 15s: {other:?}")
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_reach_their_api_server_and_pods_talk_across_nodes() {
    if !root_or_skip("nodes_reach_their_api_server_and_pods_talk_across_nodes") {
        return;
    }
    let topology = ClusterTopology::start("trio", 3)
        .await
        .expect("start a cluster with 3 nodes");
    let cluster = topology.cluster();
    let logs = cluster.dir().join("logs");
    assert!(
        cluster
            .server_url()
            .starts_with(&format!("https://{}:", topology.network().host_ip())),
        "the API server must listen on the LAN: {}",
        cluster.server_url()
    );

    // Every node reaches the API server from inside its namespace, with the stock kubectl.
    for node in topology.nodes() {
        let out = node
            .command("kubectl")
            .arg("--kubeconfig")
            .arg(cluster.kubeconfig_path())
            .args(["get", "--raw", "/readyz", "--request-timeout=10s"])
            .output()
            .expect("run kubectl in the node namespace");
        assert!(
            out.status.success(),
            "kubectl from node {} ({}) failed: {}",
            node.name(),
            node.ip(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The Node objects carry the node addresses.
    let nodes: Api<Node> = Api::all(cluster.client());
    for node in topology.nodes() {
        let object = nodes.get(node.name()).await.expect("Node object exists");
        let addresses = object.status.unwrap().addresses.unwrap();
        assert!(
            addresses
                .iter()
                .any(|a| a.type_ == "InternalIP" && a.address == node.ip().to_string()),
            "{}: {addresses:?}",
            node.name()
        );
    }

    let a = topology
        .add_pod(0, "demo", "a", |p| p.with_port("echo", ECHO_PORT))
        .await
        .expect("pod a on node 1");
    let b = topology
        .add_pod(1, "demo", "b", |p| p.with_port("echo", ECHO_PORT))
        .await
        .expect("pod b on node 2");
    assert_ne!(a.ip(), b.ip());
    let _a_proc = start_backend_in_pod(&a, &logs);
    let _b_proc = start_backend_in_pod(&b, &logs);

    // Pod to pod across nodes, both ways, over real TCP.
    assert_eq!(whoami(|| in_pod(&a), b.ip()), "b");
    assert_eq!(whoami(|| in_pod(&b), a.ip()), "a");
    // A process on node 3 (where a node proxy will run) and the pods reach each other.
    let node3 = topology.node(2).unwrap();
    let _proxy = node3
        .spawn(
            "node-3-echo",
            backend(),
            &backend_args("node-3"),
            &[],
            &logs.join("node-3-echo.log"),
        )
        .expect("start a process in node 3");
    assert_eq!(whoami(|| in_pod(&a), node3.ip()), "node-3");
    assert_eq!(whoami(|| in_node(node3), b.ip()), "b");
    // The test process (on the host) reaches pods too.
    assert_eq!(whoami(|| Command::new("timeout"), a.ip()), "a");
    // Pods reach the API server as well.
    let out = a
        .command("kubectl")
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig_path())
        .args([
            "get",
            "pod",
            "-n",
            "demo",
            "b",
            "-o",
            "jsonpath={.status.podIP}",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl from pod a: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), b.ip().to_string());

    let pods: Api<Pod> = Api::namespaced(cluster.client(), "demo");
    let a_obj = pods.get("a").await.unwrap();
    let status = a_obj.status.unwrap();
    assert_eq!(status.pod_ip.as_deref(), Some(a.ip().to_string().as_str()));
    assert_eq!(
        status.host_ip.as_deref(),
        Some(topology.node(0).unwrap().ip().to_string().as_str())
    );
    assert_eq!(
        a_obj.spec.unwrap().node_name.as_deref(),
        Some("trio-node-1")
    );
}

/// `timeout` inside the pod's namespace; the probe adds the duration and the script.
fn in_pod(pod: &NetPod) -> Command {
    pod.command("timeout")
}

fn in_node(node: &NetNode) -> Command {
    node.command("timeout")
}

/// Two cluster networks with a node and a serving pod each.
struct TwoClusters {
    east_pod: NetPod,
    west_pod: NetPod,
    west_node: NetNode,
    east: ClusterNetwork,
    west: ClusterNetwork,
    _procs: Vec<ChildProcess>,
    _logs: tempfile::TempDir,
}

fn two_clusters() -> TwoClusters {
    let logs = tempfile::tempdir().unwrap();
    let east = ClusterNetwork::create("east").expect("east LAN");
    let west = ClusterNetwork::create("west").expect("west LAN");
    let east_node = east.add_node("east-node-1").expect("east node");
    let west_node = west.add_node("west-node-1").expect("west node");
    let east_pod = east_node.add_pod("east-pod").expect("east pod");
    let west_pod = west_node.add_pod("west-pod").expect("west pod");
    let procs = vec![
        start_backend_in_pod(&east_pod, logs.path()),
        start_backend_in_pod(&west_pod, logs.path()),
        west_node
            .spawn(
                "west-node",
                backend(),
                &backend_args("west-node-1"),
                &[],
                &logs.path().join("west-node.log"),
            )
            .unwrap(),
    ];
    // Positive controls: each address is live and serving, as seen from its own cluster.
    assert_eq!(whoami(|| in_pod(&west_pod), west_node.ip()), "west-node-1");
    assert_eq!(whoami(|| in_node(&west_node), west_pod.ip()), "west-pod");
    assert_eq!(whoami(|| in_pod(&east_pod), east_pod.ip()), "east-pod");
    TwoClusters {
        east_pod,
        west_pod,
        west_node,
        east,
        west,
        _procs: procs,
        _logs: logs,
    }
}

#[test]
fn one_clusters_pods_cannot_reach_another_clusters_nodes_or_pods() {
    if !root_or_skip("one_clusters_pods_cannot_reach_another_clusters_nodes_or_pods") {
        return;
    }
    let t = two_clusters();
    assert_ne!(t.east.cidr(), t.west.cidr());
    for target in [t.west_pod.ip(), t.west_node.ip(), t.west.host_ip()] {
        let result = whoami_once(in_pod(&t.east_pod), target);
        assert!(
            result.is_err(),
            "east's pod reached west's {target}: {result:?}"
        );
        let result = whoami_once(in_node(t.east_pod.node()), target);
        assert!(
            result.is_err(),
            "east's node reached west's {target}: {result:?}"
        );
    }
    // And the other way round.
    let result = whoami_once(in_pod(&t.west_pod), t.east_pod.ip());
    assert!(result.is_err(), "west reached east's pod: {result:?}");
}

/// The isolation check above is not vacuous: with a route between the clusters
/// (the host forwarding between the two LANs) the same probe gets through.
#[test]
fn the_isolation_check_sees_a_route_between_clusters() {
    if !root_or_skip("the_isolation_check_sees_a_route_between_clusters") {
        return;
    }
    let t = two_clusters();
    // Deliberately break isolation, on our own interfaces only (they die with the LANs).
    for net in [&t.east, &t.west] {
        std::fs::write(
            format!(
                "/proc/sys/net/ipv4/conf/{}/forwarding",
                net.host_interface()
            ),
            "1",
        )
        .unwrap();
    }
    for (node, other, host) in [
        (t.east_pod.node(), &t.west, t.east.host_ip()),
        (&t.west_node, &t.east, t.west.host_ip()),
    ] {
        let out = node
            .command("ip")
            .args(["route", "add", &other.cidr(), "via", &host.to_string()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    assert_eq!(whoami(|| in_pod(&t.east_pod), t.west_pod.ip()), "west-pod");
}

/// Everything observable of a topology, to check later that it is all gone.
#[derive(Debug)]
struct Footprint {
    host_interfaces: Vec<String>,
    netns: Vec<NsId>,
    pids: Vec<u32>,
}

/// A LAN with two nodes, a pod with a running process on each.
fn build_small_topology(
    logs: &Path,
) -> (ClusterNetwork, Vec<NetNode>, Vec<NetPod>, Vec<ChildProcess>) {
    let net = ClusterNetwork::create("leak").expect("LAN");
    let nodes: Vec<NetNode> = (1..=2)
        .map(|n| net.add_node(&format!("leak-node-{n}")).expect("node"))
        .collect();
    let pods: Vec<NetPod> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| n.add_pod(&format!("leak-pod-{i}")).expect("pod"))
        .collect();
    let procs = pods.iter().map(|p| start_backend_in_pod(p, logs)).collect();
    (net, nodes, pods, procs)
}

fn footprint(
    net: &ClusterNetwork,
    nodes: &[NetNode],
    pods: &[NetPod],
    procs: &[ChildProcess],
) -> Footprint {
    let mut netns = vec![net.netns_id()];
    netns.extend(nodes.iter().map(NetNode::netns_id));
    netns.extend(pods.iter().map(NetPod::netns_id));
    let mut pids: Vec<u32> = nodes.iter().map(NetNode::anchor_pid).collect();
    pids.extend(pods.iter().map(NetPod::anchor_pid));
    let anchors: Vec<NsId> = pids.iter().map(|p| ns_of(*p)).collect();
    pids.extend(procs.iter().filter_map(ChildProcess::pid));
    // The LAN's anchor is not public: its namespace is found through a holder.
    let holders = netns_holders_by_inode(&netns);
    let netns = netns
        .iter()
        .map(|inode| {
            anchors
                .iter()
                .chain(holders.iter())
                .find(|id| &id.inode == inode)
                .unwrap_or_else(|| panic!("no process found in {inode}"))
                .clone()
        })
        .collect();
    let fp = Footprint {
        host_interfaces: vec![net.host_interface().to_string()],
        netns,
        pids,
    };
    assert!(
        host_links().contains(&format!(" {}@", fp.host_interfaces[0])),
        "{fp:?} not visible while alive"
    );
    assert!(
        !netns_holders(&fp.netns).is_empty(),
        "holders not found while alive"
    );
    fp
}

fn ns_of(pid: u32) -> NsId {
    NsId::of_pid(pid).unwrap_or_else(|| panic!("no network namespace for pid {pid}"))
}

fn host_links() -> String {
    let out = Command::new("ip").args(["-o", "link"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every `/proc/<pid>/ns/net` and `/proc/<pid>/fd/*` link whose target is one
/// of these inodes (`net:[…]`): the processes that hold such a namespace, as
/// their own or as an open file descriptor.
fn links_to(inodes: &[String]) -> Vec<(String, std::path::PathBuf)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let mut links = vec![entry.path().join("ns/net")];
        if let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) {
            links.extend(fds.flatten().map(|f| f.path()));
        }
        for link in links {
            if let Ok(target) = std::fs::read_link(&link)
                && inodes.contains(&target.display().to_string())
            {
                found.push((pid.clone(), link));
            }
        }
    }
    found
}

/// The namespaces (with their cookies) that processes hold under these inodes.
fn netns_holders_by_inode(inodes: &[String]) -> Vec<NsId> {
    links_to(inodes)
        .iter()
        .filter_map(|(_, link)| NsId::of(link))
        .collect()
}

/// Processes (pid, namespace) that hold one of these very namespaces: a
/// namespace made later under a reused inode number is not one of them.
fn netns_holders(ids: &[NsId]) -> Vec<(String, String)> {
    let inodes: Vec<String> = ids.iter().map(|id| id.inode.clone()).collect();
    links_to(&inodes)
        .into_iter()
        .filter_map(|(pid, link)| {
            let id = NsId::of(&link)?;
            ids.contains(&id).then(|| (pid, id.to_string()))
        })
        .collect()
}

/// Waits up to 10 s for every trace of the footprint to vanish.
fn assert_all_gone(fp: &Footprint) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let links = host_links();
        let interfaces: Vec<&String> = fp
            .host_interfaces
            .iter()
            .filter(|i| links.contains(&format!(" {i}@")) || links.contains(&format!(" {i}:")))
            .collect();
        let holders = netns_holders(&fp.netns);
        let alive: Vec<u32> = fp.pids.iter().copied().filter(|p| is_alive(*p)).collect();
        if interfaces.is_empty() && holders.is_empty() && alive.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left behind after 10s: interfaces {interfaces:?}, namespace holders {holders:?}, processes {alive:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // testenv never names namespaces, so none may appear in /run/netns.
    let named: Vec<String> = std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        named.iter().all(|n| !n.contains("strait")),
        "named namespaces left in /run/netns: {named:?}"
    );
}

#[test]
fn dropping_the_topology_leaves_no_namespace_interface_or_process() {
    if !root_or_skip("dropping_the_topology_leaves_no_namespace_interface_or_process") {
        return;
    }
    let logs = tempfile::tempdir().unwrap();
    let (net, nodes, pods, procs) = build_small_topology(logs.path());
    let fp = footprint(&net, &nodes, &pods, &procs);
    // The handles go in any order; the LAN outlives the nodes that use it.
    drop(net);
    drop(nodes);
    drop(procs);
    drop(pods);
    assert_all_gone(&fp);
}

#[test]
fn a_panicking_test_leaves_no_namespace_interface_or_process() {
    if !root_or_skip("a_panicking_test_leaves_no_namespace_interface_or_process") {
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let logs = tempfile::tempdir().unwrap();
        let (net, nodes, pods, procs) = build_small_topology(logs.path());
        tx.send(footprint(&net, &nodes, &pods, &procs)).unwrap();
        panic!("deliberate failure while the topology exists");
    })
    .join();
    assert!(result.is_err(), "the thread was meant to panic");
    assert_all_gone(&rx.recv().expect("the topology was built"));
}

const HOLDER_ENV: &str = "STRAIT_NODES_TEST_HOLDER";

#[test]
fn a_sigkilled_owner_leaves_no_namespace_interface_or_process() {
    // This test runs its own binary again (only this test, HOLDER_ENV set) as
    // the owner of a topology, then SIGKILLs it: no unwinding, no Drop.
    if std::env::var_os(HOLDER_ENV).is_some() {
        hold_a_topology_until_killed();
    }
    if !root_or_skip("a_sigkilled_owner_leaves_no_namespace_interface_or_process") {
        return;
    }
    let mut holder = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_sigkilled_owner_leaves_no_namespace_interface_or_process",
            "--nocapture",
        ])
        .env(HOLDER_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .expect("re-run this test binary as the holder");
    let mut line = String::new();
    let mut stdout = BufReader::new(holder.stdout.take().unwrap());
    while !line.starts_with("HOLDING ") {
        line.clear();
        let n = stdout.read_line(&mut line).unwrap();
        assert!(n > 0, "the holder ended before building its topology");
    }
    let fields: Vec<&str> = line.split_whitespace().collect();
    let split = |s: &str| -> Vec<String> { s.split(',').map(String::from).collect() };
    let fp = Footprint {
        host_interfaces: split(fields[1]),
        netns: fields[2].split(',').map(|id| id.parse().unwrap()).collect(),
        pids: fields[3].split(',').map(|p| p.parse().unwrap()).collect(),
    };
    holder.kill().expect("SIGKILL the holder"); // no unwinding, no Drop
    holder.wait().unwrap();
    assert_all_gone(&fp);
}

/// The holder side of `a_sigkilled_owner_...`: builds a topology, prints its
/// footprint and waits to be killed.
fn hold_a_topology_until_killed() -> ! {
    let logs = tempfile::tempdir().unwrap();
    let (net, nodes, pods, procs) = build_small_topology(logs.path());
    let fp = footprint(&net, &nodes, &pods, &procs);
    println!(
        "HOLDING {} {} {}",
        fp.host_interfaces.join(","),
        fp.netns
            .iter()
            .map(NsId::to_string)
            .collect::<Vec<_>>()
            .join(","),
        fp.pids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    std::thread::sleep(Duration::from_secs(300));
    panic!("the holder was not killed within 300 s");
}

/// `strait-testenv up --nodes 2`: people get nodes too, and a SIGKILLed `up`
/// takes its LAN, nodes and control plane with it.
#[test]
fn up_with_nodes_serves_kubectl_from_a_node_and_leaves_nothing_when_killed() {
    if !root_or_skip("up_with_nodes_serves_kubectl_from_a_node_and_leaves_nothing_when_killed") {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let mut up = Command::new(env!("CARGO_BIN_EXE_strait-testenv"))
        .args(["up", "--clusters", "upnodes", "--nodes", "2", "--state-dir"])
        .arg(state.path())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn strait-testenv up");
    let mut stdout = BufReader::new(up.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("Stop with Ctrl-C") {
        let n = stdout.read_line(&mut seen).unwrap();
        assert!(n > 0, "strait-testenv up ended early; it printed:\n{seen}");
    }
    let host_if = seen
        .split_whitespace()
        .find(|w| w.starts_with("stlan"))
        .unwrap_or_else(|| panic!("no LAN interface printed:\n{seen}"))
        .to_string();
    let anchors: Vec<u32> = seen
        .split("/proc/")
        .skip(1)
        .map(|rest| rest.split('/').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(anchors.len(), 2, "two nodes printed:\n{seen}");
    let node_ns = format!("--net=/proc/{}/ns/net", anchors[1]);
    let out = Command::new("nsenter")
        .args([node_ns.as_str(), "--", "kubectl", "--kubeconfig"])
        .arg(state.path().join("kubeconfig"))
        .args(["get", "nodes", "-o", "name"])
        .output()
        .unwrap();
    let nodes = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && nodes.contains("node/upnodes-node-2"),
        "kubectl from node 2: {nodes} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let netns = anchors.iter().map(|p| ns_of(*p)).collect();
    up.kill().expect("SIGKILL up");
    up.wait().unwrap();
    assert_all_gone(&Footprint {
        host_interfaces: vec![host_if],
        netns,
        pids: anchors,
    });
}
