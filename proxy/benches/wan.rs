//! Cross-cluster benchmark (root; testenv nodes and WAN): east's client pod
//! → east node proxy → west gateway across a shaped WAN (delay each way and
//! loss) → west node proxy → west pod, 100 connections open-loop at several
//! rates (up to ~100 request streams in flight), over QUIC and over the TCP +
//! TLS fallback (HTTP/2-multiplexed), side by side; unshaped, single-stream
//! bulk (iperf3) through the gateway with the CPU of each Strait process on
//! the path, and the connection set-up time of each transport.
//!
//!     bash scripts/bench-wan.sh
//!
//! (release binaries; `STRAIT_BENCH_RATES=200,1000,1800`, `STRAIT_BENCH_SECS=10`,
//! `STRAIT_BENCH_DELAY_MS=25` each way, `STRAIT_BENCH_LOSS=1` percent.) The
//! WAN is shaped by testenv's NFQUEUE delay (this kernel has no netem): every
//! packet crosses user space once, for both transports alike.
//!
//! Then, unshaped, the cost of end-to-end caller identity: the same path with
//! the node proxies at `--end-to-end-identity=strict` (the default: the
//! caller's proxy opens a TLS session as the caller inside the gateway
//! stream) and at `off`, in interleaved rounds (`STRAIT_BENCH_REPEAT`, 3;
//! the order alternates), at `STRAIT_BENCH_E2E_RATES` (1000,10000): CPU of
//! the Strait processes on the path per 1 000 requests, latency, and bulk.
//! `STRAIT_BENCH_RATES=` (empty) runs only the unshaped parts.

// The proxy tests' additions to `strait_testenv::fixture` (transparent pods).
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "support/perf.rs"]
mod perf;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::ca::{self, LeafSigner};
use strait_mesh::identity::tls::{self, TrustBundle};
use strait_mesh::tunnel::quic;
use strait_testenv::net::root_or_skip;
use strait_testenv::process::cpu_seconds;
use strait_testenv::wait::eventually;
use strait_testenv::wan::Wan;
use strait_testenv::workspace_binary;

use common::*;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// socat's port in the client pod.
const SHIM_PORT: u16 = 15201;

const URL: &str = "http://web-west.shop.svc.cluster.local/bench";

fn load(east: &Mesh, rate: u32, secs: u64) -> serde_json::Value {
    let client = &east.pods["client"].0;
    let proxy = SocketAddr::new(IpAddr::V4(client.node().ip()), 4140);
    strait_load(
        client,
        proxy,
        (URL, "web-west.shop.svc.cluster.local"),
        rate,
        secs,
        3,
    )
}

async fn gateway_metric(gw: &strait_testenv::NetPod, name: &str, having: &[&str]) -> f64 {
    let text = strait_testenv::http_get(SocketAddr::new(IpAddr::V4(gw.ip()), 4191), "/metrics")
        .await
        .unwrap_or_default();
    metric_sum(&text, name, having)
}

/// The most frequent warnings and errors in the logs under `dir` (timestamps
/// cut), so the table's errors come with their causes.
fn log_problems(dir: &std::path::Path) -> Vec<(usize, String)> {
    let mut counts: std::collections::HashMap<String, usize> = Default::default();
    for entry in walk(dir) {
        if entry.extension().is_none_or(|e| e != "log") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&entry) else {
            continue;
        };
        let file = entry.file_name().unwrap().to_string_lossy().into_owned();
        for line in text.lines() {
            if let Some(at) = line.find(" WARN ").or_else(|| line.find(" ERROR ")) {
                let msg: String = line[at..].chars().take(220).collect();
                *counts.entry(format!("{file}:{msg}")).or_default() += 1;
            }
        }
    }
    let mut v: Vec<_> = counts.into_iter().map(|(m, n)| (n, m)).collect();
    v.sort_by(|a, b| b.cmp(a));
    v.truncate(12);
    v
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    uniform_runtimes();
    if !root_or_skip("the WAN benchmark") {
        return;
    }
    // Rates: 200 rps keeps ~10 requests in flight across a 50 ms RTT; 1 800
    // keeps ~100 (the "100 concurrent streams" of the goal) when nothing queues.
    // An empty list skips the shaped runs (bulk and set-up only).
    let rates: Vec<u32> = std::env::var("STRAIT_BENCH_RATES")
        .unwrap_or_else(|_| "200,1000,1800".into())
        .split(',')
        .filter(|r| !r.trim().is_empty())
        .map(|r| {
            r.trim()
                .parse()
                .expect("STRAIT_BENCH_RATES: rates, comma-separated")
        })
        .collect();
    let secs: u64 = env_or("STRAIT_BENCH_SECS", 10);
    let delay = Duration::from_millis(env_or("STRAIT_BENCH_DELAY_MS", 25));
    let loss: f64 = env_or("STRAIT_BENCH_LOSS", 1.0);
    let proxy = workspace_binary("strait-proxy");
    let anchor = ca::new_trust_anchor("strait trust anchor", Duration::from_secs(86400)).unwrap();
    let (mut east, mut west) = tokio::join!(
        start_mesh_named("east", 2, &proxy, &anchor),
        start_mesh_named("west", 2, &proxy, &anchor)
    );
    let west_api = west.topology.cluster().client();
    backend(&mut west, 0, "web-1", "web", &[]).await;
    backend(&mut west, 1, "web-2", "web", &[]).await;
    service(&west_api, "web").await;
    export(&west_api, "web", true).await;
    let (gw_pod, gw) = start_gateway(&mut west, 1, &[]).await;
    let gw_pid = gw.pid().unwrap();
    west.proxies.push(gw);
    let wan = Wan::connect(&[east.topology.network(), west.topology.network()]).unwrap();
    wan.expose_pod(&gw_pod, &[4143]).unwrap();
    let east_api = east.topology.cluster().client();
    add_client(&mut east, 0).await;
    mirror_service(
        &east_api,
        "web",
        "west",
        IpAddr::V4(gw_pod.ip()),
        &west.trust_domain,
    )
    .await;
    eventually("east reaches west", WAIT, || async {
        answered_by(&curl(&east, &[URL]))
    })
    .await;

    // Connection set-up, unshaped, from the host (on the west LAN): a QUIC
    // handshake vs TCP + TLS, each with mutual TLS as a node proxy.
    let signer = LeafSigner::load(&west.issuer_pair, &west.anchor.cert_pem).unwrap();
    let bundle = TrustBundle::from_pem(west.anchor.cert_pem.as_bytes()).unwrap();
    let me: SpiffeId = format!(
        "spiffe://{}/ns/strait-system/sa/strait-proxy",
        west.trust_domain
    )
    .parse()
    .unwrap();
    let gateway_id: SpiffeId = format!(
        "spiffe://{}/ns/strait-system/sa/strait-gateway",
        west.trust_domain
    )
    .parse()
    .unwrap();
    let cert = signer.new_identity(&me, Duration::from_secs(3600)).unwrap();
    let gw_addr = SocketAddr::new(IpAddr::V4(gw_pod.ip()), 4143);
    let client_tls = tls::client_config(
        &bundle,
        cert.clone(),
        vec![gateway_id.clone()],
        &[strait_mesh::tunnel::TUNNEL_ALPN],
    )
    .unwrap();
    let quic_config = quic::client_config(client_tls.clone()).unwrap();
    let endpoint = quic::endpoint("0.0.0.0:0".parse().unwrap(), None).unwrap();
    let server_name = "strait-gateway.strait-system.identity.strait.internal";
    let (mut quic_setup, mut tcp_setup) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        let t = Instant::now();
        let c = endpoint
            .connect_with(quic_config.clone(), gw_addr, server_name)
            .unwrap()
            .await
            .unwrap();
        quic_setup.push(t.elapsed());
        c.close(0u32.into(), b"");
        let t = Instant::now();
        let tcp = tokio::net::TcpStream::connect(gw_addr).await.unwrap();
        let _tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(client_tls.clone()))
            .connect(strait_mesh::tunnel::server_name_for(&gateway_id), tcp)
            .await
            .unwrap();
        tcp_setup.push(t.elapsed());
    }

    // Bulk, unshaped: one iperf3 stream from east's client pod through CONNECT
    // on its node proxy, over QUIC to the west gateway, to an iperf3 pod in
    // west. (socat is the CONNECT shim in the client pod, as in bench-bulk.)
    let (iperf_pod, _iperf_server) = iperf_server(&west, 0, ("echo", 9000)).await;
    export(&west_api, "iperf", true).await;
    mirror_service(
        &east_api,
        "iperf",
        "west",
        IpAddr::V4(gw_pod.ip()),
        &west.trust_domain,
    )
    .await;
    let client_pod = &east.pods["client"].0;
    let _shim = client_pod
        .spawn(
            "socat-connect",
            std::path::Path::new("/usr/bin/socat"),
            &[
                "-b".to_string(),
                "131072".to_string(),
                format!("TCP-LISTEN:{SHIM_PORT},bind=127.0.0.1,fork,reuseaddr"),
                format!(
                    "PROXY:{}:iperf-west.shop.svc.cluster.local:9000,proxyport=4140,nodelay",
                    client_pod.node().ip()
                ),
            ],
            &[],
            &east.dir.path().join("socat.log"),
        )
        .expect("socat (scripts/bench-wan.sh installs it)");
    // The same from a transparent-mode pod: iperf3 calls the mirror by name,
    // its node proxy catches the connection (no shim in the path).
    let app = add_transparent_pod(&east, 0, "shop", "bulk", "client").await;
    // CPU of the three Strait processes on the path: east's node proxy (the
    // client pods are on node 0), the gateway, west's node proxy on node 0.
    let path_pids = [
        east.proxies[0].pid().unwrap(),
        gw_pid,
        west.proxies[0].pid().unwrap(),
    ];
    println!("pids on the bulk path (east proxy, gateway, west proxy): {path_pids:?}");
    let path_cpu = || path_pids.map(cpu_seconds);
    const MIRROR: &str = "iperf-west.shop.svc.cluster.local";
    let bulk = |label: &'static str, transparent: bool| {
        let before = path_cpu();
        let (gbits, _) = if transparent {
            iperf(&app, MIRROR, 9000, secs)
        } else {
            iperf(client_pod, "127.0.0.1", SHIM_PORT, secs)
        }
        .unwrap_or_else(|e| panic!("bulk over {label}: {e}"));
        let after = path_cpu();
        let cpu: Vec<f64> = (0..3).map(|i| after[i] - before[i]).collect();
        (label, gbits, cpu)
    };
    eventually("iperf3 answers through the gateway", WAIT, || async {
        iperf(client_pod, "127.0.0.1", SHIM_PORT, 1)?;
        iperf(&app, MIRROR, 9000, 1)
    })
    .await;
    let path = BulkPath {
        gateway: &gw_pod,
        app: &app,
        iperf: &iperf_pod,
        pids: path_pids,
    };
    let goal_results = goals(&mut west, &east, &wan, path, secs).await;
    // Each run with the gateway's streams by transport during it: a QUIC run
    // that fell back to TCP (or the reverse) measured the other transport.
    let streams = || gateway_streams(&gw_pod);
    // Each bulk run with the gateway's streams by transport during it.
    let mut bulk_runs = Vec::new();
    for (label, transparent) in [
        ("QUIC, CONNECT + socat", false),
        ("QUIC, transparent", true),
    ] {
        let before = streams().await;
        let (label, gbits, cpu) = bulk(label, transparent);
        let after = streams().await;
        bulk_runs.push((label, gbits, cpu, (after.0 - before.0, after.1 - before.1)));
    }

    // The shaped WAN: TCP fallback first (UDP blocked before the QUIC
    // connection is remade), then QUIC.
    wan.shape(delay, loss).unwrap();
    wan.block_udp().unwrap();
    eventually(
        "the fallback carries the traffic",
        Duration::from_secs(60),
        || async {
            answered_by(&curl(&east, &["--max-time", "10", URL]))?;
            if gateway_metric(&gw_pod, "gateway_connections_total", &["transport=\"tcp\""]).await
                >= 1.0
            {
                Ok(())
            } else {
                Err("not on TCP yet".into())
            }
        },
    )
    .await;
    let (east_ref, rates_ref, streams_ref) = (&east, &rates, &streams);
    let runs = |what: &'static str| async move {
        let (east, rates, streams) = (east_ref, rates_ref, streams_ref);
        let mut out = Vec::new();
        for &rate in rates {
            let before = streams().await;
            let cpu = cpu_seconds(gw_pid);
            let r = load(east, rate, secs);
            let cpu = cpu_seconds(gw_pid) - cpu;
            let after = streams().await;
            out.push((what, rate, r, cpu, (after.0 - before.0, after.1 - before.1)));
        }
        out
    };
    let tcp_runs = runs("TCP+TLS (HTTP/2 mux)").await;
    let tcp_conns =
        gateway_metric(&gw_pod, "gateway_connections_total", &["transport=\"tcp\""]).await;
    // Bulk over the fallback, unshaped (UDP still blocked).
    wan.unshape().unwrap();
    let before = streams().await;
    let (label, gbits, cpu) = bulk("TCP+TLS, transparent", true);
    let after = streams().await;
    bulk_runs.push((label, gbits, cpu, (after.0 - before.0, after.1 - before.1)));
    wan.shape(delay, loss).unwrap();
    wan.unblock_udp().unwrap();
    eventually("back on QUIC", Duration::from_secs(60), || async {
        let before =
            gateway_metric(&gw_pod, "gateway_streams_total", &["transport=\"quic\""]).await;
        answered_by(&curl(&east, &["--max-time", "10", URL]))?;
        let after = gateway_metric(&gw_pod, "gateway_streams_total", &["transport=\"quic\""]).await;
        if after > before {
            Ok(())
        } else {
            Err("not on QUIC yet".into())
        }
    })
    .await;
    let quic_runs = runs("QUIC").await;
    wan.unshape().unwrap();

    println!(
        "\ncross-cluster, 100 connections, 1 KiB bodies, WAN {delay:?} each way, {loss}% loss, {secs} s per run"
    );
    println!(
        "{:<22} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>10} {:>17}",
        "transport",
        "rps",
        "achieved",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "errors",
        "gw CPU s",
        "gw streams q/tcp"
    );
    let mut all: Vec<_> = quic_runs.iter().chain(&tcp_runs).collect();
    all.sort_by_key(|(_, rate, ..)| *rate);
    for (label, rate, r, cpu, (quic, tcp)) in &all {
        let saturated = if r["saturated"] == true { "!" } else { "" };
        println!(
            "{:<22} {:>6} {:>8.0}{:1} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>7} {:>10.2} {:>17}",
            label,
            rate,
            r["achieved_rps"].as_f64().unwrap_or(0.0),
            saturated,
            r["p50_ms"].as_f64().unwrap_or(0.0),
            r["p90_ms"].as_f64().unwrap_or(0.0),
            r["p99_ms"].as_f64().unwrap_or(0.0),
            r["max_ms"].as_f64().unwrap_or(0.0),
            r["errors"],
            cpu,
            format!("{quic:.0}/{tcp:.0}")
        );
    }
    for (label, rate, _, _, (quic, tcp)) in &all {
        let wrong = if label.starts_with("QUIC") {
            *tcp
        } else {
            *quic
        };
        if wrong > 0.0 {
            println!(
                "WARNING {label} at {rate} rps: {wrong:.0} gateway streams on the other transport during the run: not a clean measurement"
            );
        }
    }
    if all.iter().any(|(_, _, r, ..)| r["saturated"] == true) {
        println!("! saturated: under 95 % of the asked rate answered within the window");
    }
    for (label, rate, r, ..) in &all {
        if r["errors"].as_u64().unwrap_or(0) > 0 || r["server_closes"].as_u64().unwrap_or(0) > 0 {
            println!(
                "{label} at {rate} rps: errors by kind {}, answers with Connection: close {}",
                r["error_kinds"], r["server_closes"]
            );
        }
    }
    println!("(TCP connections accepted by the gateway during the fallback run: {tcp_conns})");
    println!(
        "\nbulk, one TCP stream through the gateway, unshaped WAN, {secs} s; CPU seconds of east proxy, gateway, west proxy"
    );
    println!(
        "{:<26} {:>8} {:>7} {:>8} {:>8} {:>8} {:>17}",
        "transport, way in", "Gbit/s", "GiB/s", "east px", "gateway", "west px", "gw streams q/tcp"
    );
    for (label, gbits, cpu, (quic, tcp)) in &bulk_runs {
        println!(
            "{label:<26} {gbits:>8.2} {:>7.2} {:>8.2} {:>8.2} {:>8.2} {:>17}",
            gbits * 1e9 / 8.0 / (1u64 << 30) as f64,
            cpu[0],
            cpu[1],
            cpu[2],
            format!("{quic:.0}/{tcp:.0}")
        );
        let wrong = if label.starts_with("QUIC") {
            *tcp
        } else {
            *quic
        };
        if wrong > 0.0 {
            println!(
                "WARNING {label}: {wrong:.0} gateway streams on the other transport during the run"
            );
        }
    }
    for (side, mesh) in [("east", &east), ("west", &west)] {
        // `STRAIT_BENCH_LOGS=DIR` keeps every component's log for a closer look.
        if let Ok(keep) = std::env::var("STRAIT_BENCH_LOGS") {
            for log in walk(mesh.dir.path()) {
                if log.extension().is_some_and(|e| e == "log") {
                    let name = log
                        .strip_prefix(mesh.dir.path())
                        .unwrap()
                        .to_string_lossy()
                        .replace('/', "_");
                    let dest = std::path::Path::new(&keep).join(format!("{side}_{name}"));
                    let _ = std::fs::create_dir_all(&keep);
                    let _ = std::fs::copy(&log, dest);
                }
            }
        }
        for (n, msg) in log_problems(mesh.dir.path()) {
            println!("{side} log x{n}: {msg}");
        }
    }
    println!(
        "connection set-up (unshaped, median of 20, mutual TLS): QUIC {:?}, TCP + TLS {:?}",
        median(quic_setup),
        median(tcp_setup)
    );
    // `STRAIT_BENCH_E2E=0` skips the end-to-end identity A/B.
    let e2e = if env_or("STRAIT_BENCH_E2E", 1) == 0 {
        serde_json::Value::Null
    } else {
        end_to_end_cost(&mut east, &mut west, gw_pid, secs).await
    };
    if let Ok(file) = std::env::var("STRAIT_BENCH_JSON") {
        let doc = serde_json::json!({
            "bench": "wan", "secs": secs, "goals": goal_results,
            "shaped": all.iter().map(|(label, rate, r, cpu, (quic, tcp))| serde_json::json!({
                "transport": label, "rate": rate, "load": r, "gateway_cpu_seconds": cpu,
                "gateway_streams": {"quic": quic, "tcp": tcp},
            })).collect::<Vec<_>>(),
            "end_to_end": e2e,
        });
        std::fs::write(&file, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
        println!("raw results: {file}");
    }
    stop_proxies(&mut east);
    stop_proxies(&mut west);
}

/// `gw`'s `gateway_streams_total`: (QUIC, TCP).
async fn gateway_streams(gw: &strait_testenv::NetPod) -> (f64, f64) {
    (
        gateway_metric(gw, "gateway_streams_total", &["transport=\"quic\""]).await,
        gateway_metric(gw, "gateway_streams_total", &["transport=\"tcp\""]).await,
    )
}

/// Bulk through the gateway: the gateway's pod, east's transparent client
/// pod, west's iperf3 pod and the Strait processes on the path (east proxy,
/// gateway, west proxy).
struct BulkPath<'a> {
    gateway: &'a strait_testenv::NetPod,
    app: &'a strait_testenv::NetPod,
    iperf: &'a strait_testenv::NetPod,
    pids: [u32; 3],
}

/// The goals for the gateway, unshaped, in interleaved rounds
/// (`STRAIT_BENCH_REPEAT`, 3), with the gateway's streams by transport
/// checked for every run:
/// - bulk: one iperf3 stream from a transparent pod in east through its node
///   proxy, the gateway and west's node proxy to the iperf3 pod, over QUIC and
///   over the TCP+TLS fallback (UDP blocked), beside pod to pod directly in
///   west (client on node 1 → iperf3 pod on node 0);
/// - latency at `STRAIT_BENCH_GOAL_RATE` (1 000) rps, 100 connections, 1 KiB
///   bodies, to one pod (`solo-1`, west node 0) from west's client pod
///   (node 1): directly, through west's node proxy pair, and from east's
///   client pod through east's proxy, the gateway (QUIC) and west's proxy.
///   Added p99 = p99 − the same round's direct p99.
///
/// `STRAIT_BENCH_GATEWAY_B="--workers=0"` (flags, space-separated) adds an A/B
/// of the gateway's settings in the same rounds: a second gateway (node 0)
/// with those flags, mirrors `iperf-westb` and `solo-westb` through it, and
/// paths "QUIC B" (bulk) and "cross-cluster B" (latency) run next to "QUIC"
/// and "cross-cluster", B first in odd rounds.
async fn goals(
    west: &mut Mesh,
    east: &Mesh,
    wan: &Wan,
    path: BulkPath<'_>,
    secs: u64,
) -> serde_json::Value {
    let BulkPath {
        gateway: gw_pod,
        app,
        iperf: iperf_pod,
        pids: path_pids,
    } = path;
    let rounds: usize = env_or("STRAIT_BENCH_REPEAT", 3);
    let perf_dir = perf::dir();
    let rate: u32 = env_or("STRAIT_BENCH_GOAL_RATE", 1000);
    let west_api = west.topology.cluster().client();
    let east_api = east.topology.cluster().client();
    backend(west, 0, "solo-1", "solo", &[]).await;
    service(&west_api, "solo").await;
    export(&west_api, "solo", true).await;
    mirror_service(
        &east_api,
        "solo",
        "west",
        IpAddr::V4(gw_pod.ip()),
        &west.trust_domain,
    )
    .await;
    let gateway_b = match std::env::var("STRAIT_BENCH_GATEWAY_B") {
        Ok(flags) => {
            let flags: Vec<&str> = flags.split_whitespace().collect();
            let (pod, child) = start_gateway(west, 0, &flags).await;
            west.proxies.push(child);
            wan.expose_pod(&pod, &[4143]).unwrap();
            for service in ["iperf", "solo"] {
                mirror_service(
                    &east_api,
                    service,
                    "westb",
                    IpAddr::V4(pod.ip()),
                    &west.trust_domain,
                )
                .await;
            }
            println!("gateway B: {}", flags.join(" "));
            Some(pod)
        }
        Err(_) => None,
    };
    add_client_named(west, 1, "west-client").await;
    let west_client = &west.pods["west-client"].0;
    let solo = west.pods["solo-1"].0.ip();
    let east_client = &east.pods["client"].0;
    let solo_west = "http://solo-west.shop.svc.cluster.local/bench";
    let solo_local = "http://solo.shop.svc.cluster.local/bench";
    let solo_westb = "http://solo-westb.shop.svc.cluster.local/bench";
    eventually("solo answers from west and from east", WAIT, || async {
        answered_by(&curl(east, &[solo_west]))?;
        if gateway_b.is_some() {
            answered_by(&curl(east, &[solo_westb]))?;
        }
        answered_by(&curl_via(
            west_client,
            &format!("http://{}:4140", west_client.node().ip()),
            &[solo_local],
        ))
    })
    .await;
    // The gateway and the iperf3 mirror of a path (B's on B's paths).
    let gw_of = |path: &str| match (&gateway_b, path.ends_with(" B")) {
        (Some(b), true) => b,
        _ => gw_pod,
    };
    let mirror_of = |path: &str| {
        if path.ends_with(" B") {
            MIRROR_B
        } else {
            MIRROR
        }
    };
    // Paths of a round, B next to A (first in odd rounds).
    let with_b = |paths: &[&'static str], a: &'static str, b: &'static str, round: usize| {
        let mut out = paths.to_vec();
        if gateway_b.is_some() {
            let at = out.iter().position(|p| *p == a).unwrap();
            out.insert(if round % 2 == 1 { at } else { at + 1 }, b);
        }
        out
    };
    const MIRROR: &str = "iperf-west.shop.svc.cluster.local";
    const MIRROR_B: &str = "iperf-westb.shop.svc.cluster.local";
    // Until a new tunnel through the gateway of `path` (B's for a B path)
    // goes on `tcp` (true) or QUIC: a one-second iperf3 from the
    // transparent pod (opaque connections, a new stream each; pooled HTTP
    // tunnels would not show a switch).
    let on = |tcp: bool, path: &'static str| async move {
        let (gw, mirror) = (gw_of(path), mirror_of(path));
        eventually(
            if tcp {
                "on the TCP fallback"
            } else {
                "back on QUIC"
            },
            Duration::from_secs(60),
            || async {
                let before = gateway_streams(gw).await;
                iperf(app, mirror, 9000, 1)?;
                let after = gateway_streams(gw).await;
                let (quic, tcp_streams) = (after.0 - before.0, after.1 - before.1);
                let moved = if tcp {
                    tcp_streams > 0.0 && quic == 0.0
                } else {
                    quic > 0.0 && tcp_streams == 0.0
                };
                if moved {
                    Ok(())
                } else {
                    Err(format!("streams: {quic} QUIC, {tcp_streams} TCP"))
                }
            },
        )
        .await;
    };
    let mut bulk: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
    let mut latency: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
    let mut raw = Vec::new();
    for round in 0..rounds {
        for path in with_b(&["QUIC", "TCP+TLS", "direct"], "QUIC", "QUIC B", round) {
            match path {
                "TCP+TLS" => {
                    wan.block_udp().unwrap();
                    on(true, path).await;
                }
                "QUIC" | "QUIC B" => on(false, path).await,
                _ => {}
            }
            let before = gateway_streams(gw_of(path)).await;
            // STRAIT_BENCH_PERF_DIR: the first round's bulk through the
            // gateway profiled (the three Strait processes on the path).
            let perf = perf_dir
                .as_ref()
                .filter(|_| round == 0 && path != "direct" && path != "QUIC B")
                .map(|dir| {
                    let name = format!("bulk {path}");
                    perf::record(dir, &name, &path_pids, secs.saturating_sub(2).max(1))
                });
            let (gbits, _) = if path == "direct" {
                iperf(west_client, &iperf_pod.ip().to_string(), IPERF_PORT, secs)
            } else {
                iperf(app, mirror_of(path), 9000, secs)
            }
            .unwrap_or_else(|e| panic!("bulk over {path}: {e}"));
            if let Some(mut perf) = perf {
                let _ = perf.wait();
            }
            let after = gateway_streams(gw_of(path)).await;
            let (quic, tcp) = (after.0 - before.0, after.1 - before.1);
            let wrong = match path {
                "QUIC" | "QUIC B" => tcp,
                "TCP+TLS" => quic,
                _ => 0.0,
            };
            assert!(
                wrong == 0.0,
                "bulk over {path}: {wrong} gateway streams on the other transport"
            );
            bulk.entry(path).or_default().push(gbits);
            raw.push(
                serde_json::json!({"round": round, "bulk": path, "gbits": gbits,
                "gateway_streams": {"quic": quic, "tcp": tcp}}),
            );
            if path == "TCP+TLS" {
                wan.unblock_udp().unwrap();
            }
        }
        on(false, "QUIC").await;
        if gateway_b.is_some() {
            on(false, "QUIC B").await;
        }
        for path in with_b(
            &["direct", "node proxy pair", "cross-cluster"],
            "cross-cluster",
            "cross-cluster B",
            round,
        ) {
            let before = gateway_streams(gw_of(path)).await;
            let (client, connect, target) = match path {
                "direct" => (
                    west_client,
                    SocketAddr::new(IpAddr::V4(solo), 8080),
                    ("/bench", "solo.shop"),
                ),
                "node proxy pair" => (
                    west_client,
                    SocketAddr::new(IpAddr::V4(west_client.node().ip()), 4140),
                    (solo_local, "solo.shop.svc.cluster.local"),
                ),
                _ => (
                    east_client,
                    SocketAddr::new(IpAddr::V4(east_client.node().ip()), 4140),
                    if path.ends_with(" B") {
                        (solo_westb, "solo-westb.shop.svc.cluster.local")
                    } else {
                        (solo_west, "solo-west.shop.svc.cluster.local")
                    },
                ),
            };
            let r = strait_load(client, connect, target, rate, secs, 3);
            let after = gateway_streams(gw_of(path)).await;
            assert_eq!(r["errors"].as_u64(), Some(0), "{path} at {rate} rps: {r}");
            if path.starts_with("cross-cluster") {
                assert!(after.1 == before.1, "cross-cluster run went over TCP");
            }
            latency
                .entry(path)
                .or_default()
                .push(r["p99_ms"].as_f64().unwrap_or(f64::NAN));
            raw.push(serde_json::json!({"round": round, "latency": path, "rate": rate, "load": r}));
        }
    }
    let med = |v: &Vec<f64>| median_f(v.clone());
    let spread = |v: &Vec<f64>| {
        format!(
            "{:.2}–{:.2}",
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
        )
    };
    println!(
        "
gateway goals, unshaped, {rounds} interleaved rounds, {secs} s per run (medians, min–max)"
    );
    for (path, v) in &bulk {
        println!("  bulk {path:<10} {:>6.2} Gbit/s ({})", med(v), spread(v));
    }
    let quic_vs_tcp = med(&bulk["QUIC"]) / med(&bulk["TCP+TLS"]);
    let quic_vs_direct = med(&bulk["QUIC"]) / med(&bulk["direct"]);
    println!(
        "  bulk QUIC / TCP+TLS fallback: {quic_vs_tcp:.2} (goal ≥ 1.00: {}); QUIC / pod-to-pod direct: {quic_vs_direct:.2} (goal ≥ 0.50: {})",
        if quic_vs_tcp >= 1.0 { "met" } else { "NOT met" },
        if quic_vs_direct >= 0.5 {
            "met"
        } else {
            "NOT met"
        }
    );
    // Added p99 per round, against the same round's direct run.
    let added = |path: &str| -> Vec<f64> {
        latency[path]
            .iter()
            .zip(&latency["direct"])
            .map(|(p, d)| p - d)
            .collect()
    };
    for path in [
        "direct",
        "node proxy pair",
        "cross-cluster",
        "cross-cluster B",
    ]
    .into_iter()
    .filter(|p| latency.contains_key(p))
    {
        println!(
            "  {rate} rps p99 {path:<16} {:>7.2} ms ({}); added {:>6.2} ms",
            med(&latency[path]),
            spread(&latency[path]),
            med(&added(path))
        );
    }
    let latency_ratio = med(&added("cross-cluster")) / med(&added("node proxy pair"));
    println!(
        "  added p99 cross-cluster / node proxy pair: {latency_ratio:.2} (goal ≤ 2.00: {})",
        if latency_ratio <= 2.0 {
            "met"
        } else {
            "NOT met"
        }
    );
    let b = gateway_b.as_ref().map(|_| {
        let quic_b_vs_tcp = med(&bulk["QUIC B"]) / med(&bulk["TCP+TLS"]);
        let quic_b_vs_a: Vec<f64> = bulk["QUIC B"].iter().zip(&bulk["QUIC"]).map(|(b, a)| b / a).collect();
        let latency_b = med(&added("cross-cluster B")) / med(&added("node proxy pair"));
        println!(
            "  gateway B: bulk QUIC B / TCP+TLS fallback {quic_b_vs_tcp:.2}; QUIC B / QUIC per round {}; added p99 cross-cluster B / pair {latency_b:.2}",
            quic_b_vs_a.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", ")
        );
        serde_json::json!({
            "flags": std::env::var("STRAIT_BENCH_GATEWAY_B").unwrap_or_default(),
            "bulk_quic_vs_tcp": quic_b_vs_tcp, "bulk_quic_b_vs_a_per_round": quic_b_vs_a,
            "added_p99_cross_vs_pair": latency_b,
            "added_p99_ms": med(&added("cross-cluster B")),
        })
    });
    serde_json::json!({
        "rounds": rounds, "rate": rate, "runs": raw,
        "bulk_quic_vs_tcp": quic_vs_tcp, "bulk_quic_vs_direct": quic_vs_direct,
        "added_p99_cross_vs_pair": latency_ratio,
        "added_p99_ms": {
            "node proxy pair": med(&added("node proxy pair")),
            "cross-cluster": med(&added("cross-cluster")),
        },
        "gateway_b": b,
    })
}

/// Restarts every node proxy of `mesh` (not the gateway, pushed after them)
/// with `--end-to-end-identity=mode`.
async fn proxies_in_mode(mesh: &mut Mesh, mode: &str) {
    let binary = workspace_binary("strait-proxy");
    let nodes: Vec<strait_testenv::NetNode> = mesh.topology.nodes().to_vec();
    let flag = format!("--end-to-end-identity={mode}");
    for (i, node) in nodes.iter().enumerate() {
        mesh.proxies[i].stop(Duration::from_secs(3));
        let child = spawn_proxy_with(mesh, node, &binary, &[flag.as_str()]);
        mesh.proxies[i] = child;
    }
    for node in &nodes {
        proxy_ready(node).await;
    }
}

fn median_f(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Tunnels whose caller proved its identity end to end, on all of `west`'s node proxies.
async fn proven(west: &Mesh) -> f64 {
    let mut sum = 0.0;
    for node in west.topology.nodes() {
        let text = strait_testenv::fixture::proxy_metrics(node).await;
        sum += metric_sum(&text, "inbound_end_to_end_proven_total", &[]);
    }
    sum
}

/// The A/B of end-to-end caller identity (see the module doc).
async fn end_to_end_cost(
    east: &mut Mesh,
    west: &mut Mesh,
    gw_pid: u32,
    secs: u64,
) -> serde_json::Value {
    let rates: Vec<u32> = std::env::var("STRAIT_BENCH_E2E_RATES")
        .unwrap_or_else(|_| "1000,10000".into())
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .collect();
    let rounds: usize = env_or("STRAIT_BENCH_REPEAT", 3);
    // (mode, rate) → per round: vCPU per 1 000 rps of the path, p50, p99, errors, achieved rps.
    let mut runs: std::collections::BTreeMap<(&str, u32), Vec<[f64; 5]>> = Default::default();
    let mut bulk: std::collections::BTreeMap<&str, Vec<(f64, f64)>> = Default::default();
    for round in 0..rounds {
        let order = if round % 2 == 0 {
            ["off", "strict"]
        } else {
            ["strict", "off"]
        };
        for mode in order {
            proxies_in_mode(east, mode).await;
            proxies_in_mode(west, mode).await;
            eventually("east reaches west", WAIT, || async {
                answered_by(&curl(east, &[URL]))
            })
            .await;
            let n = west.topology.nodes().len();
            let mut pids = vec![east.proxies[0].pid().unwrap(), gw_pid];
            pids.extend(west.proxies[..n].iter().map(|p| p.pid().unwrap()));
            let cpu = || pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>();
            let proven_before = proven(west).await;
            for &rate in &rates {
                let before = cpu();
                let r = load(east, rate, secs);
                // The load's warm-up runs before the measured seconds.
                let spent = cpu() - before;
                let achieved = r["achieved_rps"].as_f64().unwrap_or(0.0);
                let per_1k = spent / (secs as f64 + 3.0) / (achieved.max(1.0) / 1000.0);
                runs.entry((mode, rate)).or_default().push([
                    per_1k,
                    r["p50_ms"].as_f64().unwrap_or(0.0),
                    r["p99_ms"].as_f64().unwrap_or(0.0),
                    r["errors"].as_f64().unwrap_or(0.0),
                    achieved,
                ]);
            }
            // The mode took effect: strict requests were proven end to end, off ones not.
            let proven_now = proven(west).await - proven_before;
            assert_eq!(
                proven_now > 0.0,
                mode == "strict",
                "{mode}: {proven_now} tunnels proven end to end on west's node proxies"
            );
            let before = cpu();
            let client_pod = &east.pods["client"].0;
            if let Ok((gbits, _)) = iperf(client_pod, "127.0.0.1", SHIM_PORT, secs) {
                bulk.entry(mode).or_default().push((gbits, cpu() - before));
            }
        }
    }
    println!(
        "\nend-to-end caller identity, unshaped, 100 connections, 1 KiB POSTs, {secs} s per run, {rounds} interleaved rounds (medians; CPU: east proxy + gateway + west proxies)"
    );
    println!(
        "{:<8} {:>6} {:>10} {:>15} {:>8} {:>8} {:>7}",
        "mode", "rps", "achieved", "vCPU s / 1k rq", "p50 ms", "p99 ms", "errors"
    );
    for ((mode, rate), v) in &runs {
        let col = |i: usize| median_f(v.iter().map(|r| r[i]).collect());
        println!(
            "{mode:<8} {rate:>6} {:>10.0} {:>15.3} {:>8.2} {:>8.2} {:>7.0}",
            col(4),
            col(0),
            col(1),
            col(2),
            v.iter().map(|r| r[3]).sum::<f64>()
        );
    }
    for &rate in &rates {
        let med = |mode, i: usize| median_f(runs[&(mode, rate)].iter().map(|r| r[i]).collect());
        println!(
            "ratio strict/off at {rate} rps: CPU per request {:.2}, p50 {:.2}, p99 {:.2}",
            med("strict", 0) / med("off", 0),
            med("strict", 1) / med("off", 1),
            med("strict", 2) / med("off", 2)
        );
    }
    for (mode, v) in &bulk {
        println!(
            "bulk {mode:<7} Gbit/s per round {:?}, median {:.2}; path CPU s median {:.1}",
            v.iter()
                .map(|(g, _)| (g * 100.0).round() / 100.0)
                .collect::<Vec<_>>(),
            median_f(v.iter().map(|(g, _)| *g).collect()),
            median_f(v.iter().map(|(_, c)| *c).collect())
        );
    }
    if let (Some(on), Some(off)) = (bulk.get("strict"), bulk.get("off")) {
        let g = |v: &Vec<(f64, f64)>| median_f(v.iter().map(|(g, _)| *g).collect());
        println!("ratio strict/off bulk: {:.2}", g(on) / g(off));
    }
    serde_json::json!({
        "runs": runs.iter().map(|((mode, rate), v)| serde_json::json!({
            "mode": mode, "rate": rate,
            "rounds": v.iter().map(|r| serde_json::json!({"cpu_per_1k": r[0], "p50_ms": r[1],
                "p99_ms": r[2], "errors": r[3], "achieved_rps": r[4]})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "bulk": bulk.iter().map(|(mode, v)| serde_json::json!({"mode": mode,
            "gbits": v.iter().map(|(g, _)| g).collect::<Vec<_>>()})).collect::<Vec<_>>(),
    })
}
