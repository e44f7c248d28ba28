//! The WAN between cluster LANs (`strait_testenv::wan`): only exposed gateway
//! ports cross it, and its link can be shaped, UDP-blocked, cut and captured.
//! These need root, as in CI; without it they fail saying so, or print
//! SKIPPED with STRAIT_SKIP_ROOT_TESTS=1.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use strait_testenv::net::{ClusterNetwork, NetPod, root_or_skip};
use strait_testenv::process::{ChildProcess, is_alive};
use strait_testenv::wan::{self, Wan};
use strait_testenv::{ClusterTopology, NetNode};

/// The gateway port of issue 6 (QUIC on UDP, TCP+TLS fallback on TCP).
const GATEWAY_PORT: u16 = 4143;
/// A port the gateway node also serves but the WAN does not expose.
const OTHER_PORT: u16 = 7000;

/// strait-backend answering `WHOAMI` with `name` on both ports, TCP and UDP.
fn start_backend(
    name: &str,
    spawn: impl FnOnce(&str, &Path, &[String], &Path) -> std::io::Result<ChildProcess>,
    logs: &Path,
) -> ChildProcess {
    let mut args = vec!["--name".to_string(), name.into()];
    for port in [GATEWAY_PORT, OTHER_PORT] {
        for flag in ["--echo", "--udp-echo"] {
            args.extend([flag.into(), format!("0.0.0.0:{port}")]);
        }
    }
    spawn(
        name,
        Path::new(env!("CARGO_BIN_EXE_strait-backend")),
        &args,
        &logs.join(format!("{name}.log")),
    )
    .expect("start strait-backend")
}

fn on_node(node: &NetNode, logs: &Path) -> ChildProcess {
    start_backend(node.name(), |n, p, a, l| node.spawn(n, p, a, &[], l), logs)
}

fn on_pod(pod: &NetPod, logs: &Path) -> ChildProcess {
    start_backend(pod.name(), |n, p, a, l| pod.spawn(n, p, a, &[], l), logs)
}

/// Runs `script` under `timeout <secs> bash -c` where `cmd` runs
/// (`NetNode::command("timeout")`, `NetPod::command("timeout")`).
fn bash(mut cmd: Command, secs: u32, script: &str) -> Result<String, String> {
    let out = cmd
        .args([&secs.to_string(), "bash", "-c", script])
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

/// Who answers on TCP `ip:port`; one try, 2 s.
fn tcp_whoami(cmd: Command, ip: Ipv4Addr, port: u16) -> Result<String, String> {
    bash(
        cmd,
        2,
        &format!("exec 3<>/dev/tcp/{ip}/{port} || exit 1; printf 'WHOAMI\\n' >&3; head -n1 <&3"),
    )
}

/// Who answers a UDP datagram to `ip:port`; one try, 1 s.
fn udp_whoami(cmd: Command, ip: Ipv4Addr, port: u16) -> Result<String, String> {
    bash(
        cmd,
        1,
        &format!("exec 3<>/dev/udp/{ip}/{port} || exit 1; printf 'WHOAMI\\n' >&3; head -n1 <&3"),
    )
}

/// Whether a TCP connection to `ip:port` opens; one try, 2 s.
fn tcp_connect(cmd: Command, ip: Ipv4Addr, port: u16) -> Result<String, String> {
    bash(cmd, 2, &format!("exec 3<>/dev/tcp/{ip}/{port}"))
}

/// Retries `probe` for up to 15 s until it answers `expected`.
fn eventually_answers(
    what: &str,
    expected: &str,
    mut probe: impl FnMut() -> Result<String, String>,
) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = probe();
        if got.as_deref() == Ok(expected) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: no answer {expected:?} within 15s, last: {got:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn assert_blocked(what: &str, result: Result<String, String>) {
    assert!(result.is_err(), "{what} got through: {result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_exposed_gateway_ports_are_reachable_across_the_wan() {
    if !root_or_skip("only_the_exposed_gateway_ports_are_reachable_across_the_wan") {
        return;
    }
    let (east, west) = tokio::join!(
        ClusterTopology::start("east", 2),
        ClusterTopology::start("west", 2)
    );
    let (east, west) = (east.expect("east cluster"), west.expect("west cluster"));
    let logs = tempfile::tempdir().unwrap();
    let wan = Wan::connect(&[east.network(), west.network()]).expect("WAN between east and west");
    let gateway = west.node(0).unwrap();
    let west_other = west.node(1).unwrap();
    let west_pod = gateway.add_pod("west-pod").expect("west pod");
    let east_pod = east.node(1).unwrap().add_pod("east-pod").expect("east pod");
    let _procs = [
        on_node(gateway, logs.path()),
        on_node(west_other, logs.path()),
        on_pod(&west_pod, logs.path()),
        on_pod(&east_pod, logs.path()),
    ];
    wan.expose_node(gateway, &[GATEWAY_PORT])
        .expect("expose west's gateway");
    let gw = gateway.ip();
    let east_node = east.node(0).unwrap();
    let from_node = || east_node.command("timeout");
    let from_pod = || east_pod.command("timeout");

    // East's nodes and pods reach the gateway port, TCP and UDP.
    let name = gateway.name();
    eventually_answers("TCP east node → gateway", name, || {
        tcp_whoami(from_node(), gw, GATEWAY_PORT)
    });
    eventually_answers("TCP east pod → gateway", name, || {
        tcp_whoami(from_pod(), gw, GATEWAY_PORT)
    });
    eventually_answers("UDP east node → gateway", name, || {
        udp_whoami(from_node(), gw, GATEWAY_PORT)
    });
    eventually_answers("UDP east pod → gateway", name, || {
        udp_whoami(from_pod(), gw, GATEWAY_PORT)
    });

    // Nothing else of west, though every one of these listens.
    let api = west.network().host_ip();
    let api_port: u16 = west
        .cluster()
        .server_url()
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .expect("the API server URL has a port");
    let sources: [(&str, &dyn Fn() -> Command); 2] = [("node", &from_node), ("pod", &from_pod)];
    for (what, make) in sources {
        for (target, ip, port) in [
            ("the gateway's other port", gw, OTHER_PORT),
            ("west's other node", west_other.ip(), GATEWAY_PORT),
            ("west's pod", west_pod.ip(), GATEWAY_PORT),
            ("west's API server", api, api_port),
        ] {
            assert_blocked(
                &format!("TCP east {what} → {target} {ip}:{port}"),
                tcp_connect(make(), ip, port),
            );
        }
        assert_blocked(
            &format!("UDP east {what} → the gateway's other port"),
            udp_whoami(make(), gw, OTHER_PORT),
        );
        assert_blocked(
            &format!("UDP east {what} → west's other node"),
            udp_whoami(make(), west_other.ip(), GATEWAY_PORT),
        );
    }
    // The gateway's return route opens nothing towards east.
    assert_blocked(
        "TCP west gateway → east pod",
        tcp_connect(gateway.command("timeout"), east_pod.ip(), GATEWAY_PORT),
    );
    assert_blocked(
        "TCP west other node → east pod",
        tcp_connect(west_other.command("timeout"), east_pod.ip(), GATEWAY_PORT),
    );

    // The probes are not vacuous: exposing west's other node and west's pod
    // lets the very same probes through.
    wan.expose_node(west_other, &[GATEWAY_PORT]).unwrap();
    wan.expose_pod(&west_pod, &[GATEWAY_PORT]).unwrap();
    eventually_answers(
        "TCP east node → newly exposed node",
        west_other.name(),
        || tcp_whoami(from_node(), west_other.ip(), GATEWAY_PORT),
    );
    eventually_answers(
        "TCP east pod → newly exposed pod",
        west_pod.name(),
        || tcp_whoami(from_pod(), west_pod.ip(), GATEWAY_PORT),
    );
    tcp_connect(from_pod(), west_other.ip(), GATEWAY_PORT)
        .expect("the connect probe sees an exposed address");
}

/// Two LANs (no control planes) joined by a WAN, west's node 1 a gateway.
struct Pair {
    wan: Wan,
    gateway: NetNode,
    east_node: NetNode,
    east: ClusterNetwork,
    west: ClusterNetwork,
    _procs: Vec<ChildProcess>,
    logs: tempfile::TempDir,
}

fn pair() -> Pair {
    let logs = tempfile::tempdir().unwrap();
    let east = ClusterNetwork::create("east").expect("east LAN");
    let west = ClusterNetwork::create("west").expect("west LAN");
    let east_node = east.add_node("east-node-1").expect("east node");
    let gateway = west.add_node("west-gateway").expect("west node");
    let wan = Wan::connect(&[&east, &west]).expect("WAN");
    wan.expose_node(&gateway, &[GATEWAY_PORT]).expect("expose");
    let procs = vec![on_node(&gateway, logs.path())];
    let p = Pair {
        wan,
        gateway,
        east_node,
        east,
        west,
        _procs: procs,
        logs,
    };
    p.eventually_tcp();
    p.eventually_udp();
    p
}

impl Pair {
    fn tcp(&self) -> Result<String, String> {
        tcp_whoami(
            self.east_node.command("timeout"),
            self.gateway.ip(),
            GATEWAY_PORT,
        )
    }

    fn udp(&self) -> Result<String, String> {
        udp_whoami(
            self.east_node.command("timeout"),
            self.gateway.ip(),
            GATEWAY_PORT,
        )
    }

    fn eventually_tcp(&self) {
        eventually_answers("TCP east → gateway", self.gateway.name(), || self.tcp());
    }

    fn eventually_udp(&self) {
        eventually_answers("UDP east → gateway", self.gateway.name(), || self.udp());
    }

    /// Wall time of one TCP WHOAMI exchange (connect + request/reply: two round trips).
    fn tcp_exchange_time(&self) -> Duration {
        let start = Instant::now();
        let answer = self.tcp();
        assert_eq!(answer.as_deref(), Ok(self.gateway.name()));
        start.elapsed()
    }
}

#[test]
fn blocking_udp_and_cutting_the_link_then_undoing_it() {
    if !root_or_skip("blocking_udp_and_cutting_the_link_then_undoing_it") {
        return;
    }
    let p = pair();

    p.wan.block_udp().expect("block UDP");
    p.wan.block_udp().expect("blocking twice is fine");
    assert_blocked("UDP with UDP blocked", p.udp());
    assert_eq!(p.tcp().as_deref(), Ok(p.gateway.name()), "TCP still works");
    p.wan.unblock_udp().expect("unblock UDP");
    p.eventually_udp();

    p.wan.cut().expect("cut the link");
    let start = Instant::now();
    assert_blocked("TCP over a cut link", p.tcp());
    assert!(
        start.elapsed() >= Duration::from_millis(1900),
        "a cut link is a blackhole (the probe times out), not a refusal: {:?}",
        start.elapsed()
    );
    assert_blocked("UDP over a cut link", p.udp());
    p.wan.restore().expect("restore the link");
    p.wan.restore().expect("restoring twice is fine");
    p.eventually_tcp();
    p.eventually_udp();

    // A node added after the gateway was exposed is routed to it too.
    let late = p.east.add_node("east-node-late").expect("late node");
    eventually_answers("TCP late east node → gateway", p.gateway.name(), || {
        tcp_whoami(late.command("timeout"), p.gateway.ip(), GATEWAY_PORT)
    });
    // West's LAN is unchanged for its own nodes.
    assert_eq!(p.west.cluster(), "west");
}

#[test]
fn shaping_the_link_delays_and_drops_packets() {
    if !root_or_skip("shaping_the_link_delays_and_drops_packets") {
        return;
    }
    let p = pair();
    let fastest = |n| (0..n).map(|_| p.tcp_exchange_time()).min().unwrap();
    let before = fastest(5);
    assert!(
        before < Duration::from_millis(100),
        "unshaped exchange already slow: {before:?}"
    );

    p.wan.shape(Duration::from_millis(25), 0.0).expect("shape");
    // Two round trips of at least 2 × 25 ms each.
    let shaped = fastest(2);
    assert!(
        shaped >= Duration::from_millis(100),
        "25 ms each way must make two round trips take ≥ 100 ms: {shaped:?} (before: {before:?})"
    );

    assert!(
        shaped < Duration::from_millis(500),
        "the delay line holds packets for about the delay, not much longer: {shaped:?}"
    );
    // The benchmarks' WAN: 25 ms each way, 1 % loss; traffic still flows.
    p.wan
        .shape(Duration::from_millis(25), 1.0)
        .expect("shape with loss");
    p.eventually_tcp();

    p.wan.shape(Duration::ZERO, 100.0).expect("shape: drop all");
    assert_blocked("UDP with 100 % loss", p.udp());
    assert!(p.wan.shape(Duration::ZERO, 101.0).is_err(), "loss > 100 %");

    p.wan.unshape().expect("unshape");
    p.wan.unshape().expect("unshaping twice is fine");
    p.eventually_udp();
    let after = fastest(5);
    assert!(
        after < Duration::from_millis(100),
        "unshaped again: {after:?}"
    );
}

#[test]
fn a_capture_on_the_wan_sees_the_bytes_that_cross_it_and_only_those() {
    if !root_or_skip("a_capture_on_the_wan_sees_the_bytes_that_cross_it_and_only_those") {
        return;
    }
    let p = pair();
    let west_node = p.west.add_node("west-node-2").expect("second west node");
    let capture = p
        .wan
        .capture(&p.logs.path().join("wan.pcap"))
        .expect("capture on the WAN");
    let crossing = b"plaintext-across-the-wan-4f1c";
    let local = b"plaintext-inside-west-9b2e";
    let send = |cmd: Command, payload: &[u8]| {
        let payload = String::from_utf8_lossy(payload);
        bash(
            cmd,
            2,
            &format!(
                "exec 3<>/dev/tcp/{}/{GATEWAY_PORT} || exit 1; printf '{payload}\\n' >&3; head -n1 <&3",
                p.gateway.ip()
            ),
        )
        .expect("echo through the gateway")
    };
    assert_eq!(
        send(p.east_node.command("timeout"), crossing).as_bytes(),
        crossing
    );
    assert_eq!(send(west_node.command("timeout"), local).as_bytes(), local);

    let pcap = capture.stop().expect("stop the capture");
    assert!(pcap.len() > 24, "a pcap with packets: {} bytes", pcap.len());
    assert!(
        wan::contains(&pcap, crossing),
        "the capture must see plaintext that crossed the WAN"
    );
    assert!(
        !wan::contains(&pcap, local),
        "traffic inside west never crosses the WAN"
    );
}

#[test]
fn dropping_the_wan_removes_its_namespace_links_and_capture() {
    if !root_or_skip("dropping_the_wan_removes_its_namespace_links_and_capture") {
        return;
    }
    let p = pair();
    let capture = p.wan.capture(&p.logs.path().join("drop.pcap")).unwrap();
    let anchor = p.wan.anchor_pid();
    let link = |net: &ClusterNetwork| {
        net.lan_command("ip")
            .args(["link", "show", "wan"])
            .output()
            .unwrap()
            .status
            .success()
    };
    assert!(link(&p.east) && link(&p.west), "both LANs have a WAN link");
    let Pair {
        wan,
        east,
        west,
        east_node,
        gateway,
        ..
    } = p;
    drop(capture);
    drop(wan);
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_alive(anchor) || link(&east) || link(&west) {
        assert!(
            Instant::now() < deadline,
            "left after 10 s: anchor alive {}, east link {}, west link {}",
            is_alive(anchor),
            link(&east),
            link(&west)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // And with it every path between the clusters.
    assert_blocked(
        "TCP east → gateway without a WAN",
        tcp_connect(east_node.command("timeout"), gateway.ip(), GATEWAY_PORT),
    );
}
