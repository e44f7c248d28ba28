//! The README's main command runs in CI: `strait-testenv demo` (what
//! `scripts/demo.sh` runs: real nodes, Strait installed with `strait
//! install`) in exit mode, its output checked for the facts it must show, and
//! nothing of it left behind. Needs root and the workspace's
//! binaries (`cargo build --bins`; `cargo test --workspace` builds them).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use strait_testenv::installed::GATEWAY_NODE_PORT;
use strait_testenv::net::root_or_skip;

const REQUESTS: usize = 40;
/// About 15 s on a quiet 2-core machine; generous for a loaded CI runner.
const DEADLINE: Duration = Duration::from_secs(300);

/// The number after `+` in the first line containing `needle`.
fn counted(out: &str, needle: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("the demo printed no line with {needle:?}:\n{out}"));
    line.split_once(&format!("{needle} +"))
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no +N count after {needle:?} in: {line}"))
}

#[test]
fn the_demo_calls_west_from_east_through_the_gateway_and_cleans_up() {
    if !root_or_skip("the two-cluster demo") {
        return;
    }
    // Output to files (no pipe to fill), and a deadline: a hung demo fails
    // the test instead of hanging CI (its children die with it: PDEATHSIG).
    let dir = tempfile::tempdir().unwrap();
    let (stdout, stderr) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_strait-testenv"))
        .args(["demo", "--requests", &REQUESTS.to_string()])
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .expect("run strait-testenv demo");
    let deadline = Instant::now() + DEADLINE;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = std::fs::read_to_string(&stdout).unwrap_or_default();
    let err = std::fs::read_to_string(&stderr).unwrap_or_default();
    let status = status
        .unwrap_or_else(|| panic!("the demo did not finish within {DEADLINE:?}:\n{out}\n{err}"));
    assert!(
        status.success(),
        "the demo failed ({status}):\n{out}\n{err}"
    );

    // Strait's components are real pods, installed by `strait install`, Ready.
    assert!(
        out.contains("$ strait install --identity-dir "),
        "installed with strait install:\n{out}"
    );
    for context in ["east", "west"] {
        assert!(
            out.contains(&format!(
                "$ kubectl --context {context} -n strait-system get ds,deploy,pods -o wide"
            )),
            "{out}"
        );
    }
    // What `kubectl get` showed (not what `kubectl apply` said it created).
    let shown: Vec<&str> = out
        .lines()
        .filter(|l| !l.trim_end().ends_with(" created"))
        .collect();
    let ds = shown
        .iter()
        .find(|l| l.contains("daemonset.apps/strait-proxy"))
        .unwrap_or_else(|| panic!("no node-proxy DaemonSet shown:\n{out}"));
    let columns: Vec<&str> = ds.split_whitespace().collect();
    // NAME DESIRED CURRENT READY …: a Ready proxy on each of the 2 nodes.
    assert_eq!(&columns[1..4], ["2", "2", "2"], "{ds}");
    // The mirror controller runs 2 replicas (leader election); the others 1.
    for (deployment, ready) in [
        ("strait-identity", " 1/1 "),
        ("strait-gateway", " 1/1 "),
        ("strait-mirror", " 2/2 "),
    ] {
        let line = shown
            .iter()
            .find(|l| l.contains(&format!("deployment.apps/{deployment} ")))
            .unwrap_or_else(|| panic!("no {deployment} shown:\n{out}"));
        assert!(line.contains(ready), "{deployment} Ready ({ready}): {line}");
    }

    // The mirror the controller wrote, pointing at the west gateway.
    let mirror = out
        .lines()
        .find(|l| l.contains("Service  east shop/web-west  ClusterIP 10."))
        .unwrap_or_else(|| panic!("no mirror Service shown:\n{out}"));
    assert!(mirror.contains("80/TCP"), "{mirror}");
    assert!(
        out.contains("strait.dev/remote-svc-fq-name=web.shop.svc.cluster.local"),
        "{out}"
    );
    let gateway = out
        .lines()
        .find(|l| l.contains("west  strait-gateway on "))
        .and_then(|l| l.split(" at ").nth(1))
        .and_then(|rest| rest.split(':').next())
        .unwrap_or_else(|| panic!("no gateway address shown:\n{out}"))
        .to_string();
    assert!(
        out.contains(&format!(
            "EndpointSlice web-west: {gateway}:{GATEWAY_NODE_PORT} ready=true"
        )),
        "the mirror's endpoint is the gateway's NodePort {gateway}:{GATEWAY_NODE_PORT}:\n{out}"
    );
    assert!(
        out.contains("Link west: Accepted=True ClustersetMember=True CredentialsValid=True GatewayAlive=True RemoteReachable=True"),
        "{out}"
    );

    // strait stat on both sides: east's calls to west's web as east's node
    // proxies and as west's saw them, under the demo's 20 calls a second.
    for (command, from) in [
        ("$ strait stat --window 3s --context east", "*"),
        (
            "$ strait stat --window 3s --from east --context west",
            "east",
        ),
    ] {
        let at = out
            .find(command)
            .unwrap_or_else(|| panic!("no `{command}`:\n{out}"));
        let row: Vec<&str> = out[at..]
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|c| c.len() >= 9 && c[..4] == ["shop", "web", "west", from])
            .unwrap_or_else(|| panic!("`{command}` shows no row for shop/web in west:\n{out}"));
        let rps: f64 = row[4].parse().unwrap_or(0.0);
        assert!(rps > 0.0, "`{command}`: {row:?}");
        assert_eq!(row[5], "100.00%", "`{command}`: {row:?}");
    }

    // Every hop counted the request.
    for needle in [
        "request_total{direction=outbound, src=shop/client}",
        "gateway_streams_total{transport=quic, src=shop/client, dst_service=web}",
        "request_total{direction=inbound, src=shop/client}",
    ] {
        assert!(
            counted(&out, needle) >= 1.0,
            "{needle} did not move:\n{out}"
        );
    }
    assert!(
        out.contains(&format!(
            "QUIC (mTLS) across the WAN  →  west gateway NodePort {gateway}:{GATEWAY_NODE_PORT}"
        )),
        "{out}"
    );
    // The hop crossed the WAN as QUIC (UDP), and encrypted.
    let wan = out
        .lines()
        .find(|l| l.contains("evidence: the WAN's capture holds "))
        .unwrap_or_else(|| panic!("no WAN capture shown:\n{out}"));
    let udp: usize = wan
        .split("holds ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no UDP count in: {wan}"));
    assert!(udp > 0, "no QUIC packet crossed the WAN: {wan}");
    assert!(
        wan.ends_with("in clear text"),
        "plaintext on the WAN: {wan}"
    );
    let answered = out
        .lines()
        .find_map(|l| l.split("the answer names pod \"").nth(1))
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no answering pod shown:\n{out}"));
    assert!(["web-1", "web-2"].contains(&answered), "{answered}");
    assert!(
        out.contains(&format!("\"pod\":\"{answered}\"")),
        "the backend's own answer names {answered}:\n{out}"
    );
    // The west pod saw the east caller's SPIFFE ID.
    assert!(
        out.contains("caller identity seen by the west pod (strait-client-id): spiffe://east.clusterset.local/ns/shop/sa/client"),
        "{out}"
    );
    assert!(
        out.contains("\"strait-client-id\":\"spiffe://east.clusterset.local/ns/shop/sa/client\""),
        "{out}"
    );
    assert!(
        out.contains(&format!("{REQUESTS} ok, 0 failed")),
        "latency run:\n{out}"
    );
    assert!(out.contains("latency p50 "), "{out}");
    // strait check passed (the demo fails otherwise) and saw the live gateway.
    assert!(
        out.contains("$ strait check --wait 30s --context east"),
        "{out}"
    );
    assert!(out.contains("✓ link west: gateway: alive"), "{out}");
    assert!(
        out.contains("✓ mirror endpoints: all 1 mirror Service(s) have ready endpoints"),
        "{out}"
    );
    assert!(out.contains("$ strait gateways --context east"), "{out}");
    let gateways = out
        .lines()
        .find(|l| l.trim_start().starts_with("west ") && l.contains(" yes "))
        .unwrap_or_else(|| panic!("strait gateways shows west alive:\n{out}"));
    assert!(gateways.contains(" 1 "), "one mirrored service: {gateways}");
    assert!(out.contains("demo passed"), "{out}");

    // Nothing left: the demo's processes, namespace anchors and LAN interfaces.
    let teardown = out
        .lines()
        .find(|l| l.starts_with("[demo] torn down:"))
        .unwrap_or_else(|| panic!("no tear-down line:\n{out}"));
    let pids: Vec<u32> = teardown
        .split("(pids ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_default()
        .split(',')
        .filter_map(|p| p.parse().ok())
        .collect();
    assert!(pids.len() > 10, "too few pids listed: {teardown}");
    for pid in pids {
        assert!(
            !strait_testenv::process::is_alive(pid),
            "pid {pid} of the demo is still alive"
        );
    }
    let interfaces = teardown
        .split("interfaces ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap_or_default();
    for name in interfaces.split(',') {
        assert!(name.starts_with("stlan"), "{teardown}");
        assert!(
            !Path::new("/sys/class/net").join(name).exists(),
            "{name} is still there"
        );
    }
}
