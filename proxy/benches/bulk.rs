//! Single-stream bulk throughput (root; testenv nodes as network namespaces):
//! iperf3 over loopback in one network namespace (the ceiling), pod to pod
//! directly, pod to pod through socat alone (what the CONNECT shim costs), and
//! through CONNECT on the node proxy pair (mTLS between the nodes): client pod
//! on node 1 → socat (`PROXY:` = CONNECT) → strait-proxy → strait-proxy on
//! node 2 → iperf3 server pod. Both of iperf3's connections, control and data,
//! go through CONNECT. The same again with iperf3 speaking CONNECT itself
//! (proxychains), no shim in the path. Last, the reference: a pair of haproxy
//! in TCP mode with TLS (client certificates) between the nodes; and the
//! floor for any pair of proxies, the same pair as a null relay (no TLS, the
//! kernel's `splice` between the sockets: no byte enters either process).
//! Reports Gbit/s, the proxies' CPU seconds (for the last rows, haproxy's)
//! and how long the machine's tasks waited for a CPU (`support/machine.rs`).
//!
//!     bash scripts/bench-bulk.sh
//!
//! (installs iperf3, socat, proxychains4 and haproxy, builds the release binaries, then runs
//! `cargo bench -p strait-proxy --bench bulk` with `STRAIT_PROXY_LOG=warn`;
//! `STRAIT_BENCH_SECS=10`; `STRAIT_BENCH_REPEAT=3` interleaved rounds of every
//! path, medians with their spread and the ratios of the medians;
//! `STRAIT_BENCH_JSON=FILE` writes every run.)

#[path = "support/haproxy.rs"]
mod haproxy;
#[path = "support/machine.rs"]
mod machine;

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use strait_testenv::NetPod;
use strait_testenv::process::{ChildProcess, cpu_seconds};
use strait_testenv::wait::eventually;

use strait_testenv::fixture::*;

/// Where socat listens in the client pod (loopback) and the loopback server.
const SHIM_PORT: u16 = 15201;
/// Where the CONNECT shim (socat speaking CONNECT to the node proxy) listens.
const CONNECT_SHIM_PORT: u16 = 15202;
const LOOPBACK_PORT: u16 = 5202;
/// socat's copy buffer (its default is 8 KiB), so the shim is not the limit.
const SOCAT_BUFFER: &str = "131072";

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

struct Run {
    label: &'static str,
    gbits: f64,
    retransmits: u64,
    proxy_cpu: f64,
    shim_cpu: f64,
    machine: machine::Usage,
}

fn spawn(pod: &NetPod, mesh: &Mesh, name: &str, program: &str, args: &[String]) -> ChildProcess {
    pod.spawn(
        name,
        Path::new(program),
        args,
        &[],
        &mesh.dir.path().join(format!("{name}.log")),
    )
    .unwrap_or_else(|e| panic!("run {program} (scripts/bench-bulk.sh installs it): {e}"))
}

fn measured(
    label: &'static str,
    proxies: &[u32],
    shim: Option<u32>,
    run: impl FnOnce() -> Result<(f64, u64), String>,
) -> Run {
    let cpu = |pids: &[u32]| pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>();
    let shim: Vec<u32> = shim.into_iter().collect();
    let (proxy_before, shim_before) = (cpu(proxies), cpu(&shim));
    let machine_before = machine::Reading::now();
    let (gbits, retransmits) = run().unwrap_or_else(|e| panic!("{label}: {e}"));
    let machine = machine_before.since();
    // socat reaps its per-connection children once they are done.
    std::thread::sleep(Duration::from_millis(300));
    Run {
        label,
        gbits,
        retransmits,
        proxy_cpu: cpu(proxies) - proxy_before,
        // socat forks a child per connection: the listener's CPU plus its
        // children's is in the children's own /proc entries, so count them too.
        shim_cpu: cpu(&shim) - shim_before + children_cpu(&shim),
        machine,
    }
}

/// CPU seconds of the (still running or reaped) children of `pids`, from
/// /proc/PID/stat's cutime + cstime.
fn children_cpu(pids: &[u32]) -> f64 {
    pids.iter()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            let cutime: f64 = fields.get(13)?.parse().ok()?;
            let cstime: f64 = fields.get(14)?.parse().ok()?;
            Some((cutime + cstime) / 100.0)
        })
        .sum()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    uniform_runtimes();
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if !strait_testenv::net::root_or_skip("bulk benchmark") {
        return;
    }
    let secs: u64 = std::env::var("STRAIT_BENCH_SECS")
        .unwrap_or("10".into())
        .parse()
        .unwrap();
    let mut mesh = start_mesh(2, &strait_testenv::workspace_binary("strait-proxy")).await;
    add_client(&mut mesh, 0).await;
    let (server, _iperf_server) = iperf_server(&mesh, 1, ("iperf", IPERF_PORT)).await;
    let server_ip: Ipv4Addr = server.ip();
    let client = pod(&mesh, "client");
    let node_ip = client.node().ip();
    let _loopback_server = spawn(
        client,
        &mesh,
        "iperf3-loopback",
        "/usr/bin/iperf3",
        &[
            "-s".into(),
            "-B".into(),
            "127.0.0.1".into(),
            "-p".into(),
            LOOPBACK_PORT.to_string(),
        ],
    );
    let socat = |name: &str, port: u16, to: String| {
        spawn(
            client,
            &mesh,
            name,
            "/usr/bin/socat",
            &[
                "-b".into(),
                SOCAT_BUFFER.into(),
                format!("TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr"),
                to,
            ],
        )
    };
    let proxy_pids: Vec<u32> = mesh.proxies.iter().filter_map(|p| p.pid()).collect();
    // Let the servers bind and discovery learn the service.
    eventually("iperf3 answers directly", WAIT, || async {
        iperf(client, &server_ip.to_string(), IPERF_PORT, 1)
    })
    .await;

    // Every path is set up first, then measured in interleaved rounds
    // (`STRAIT_BENCH_REPEAT`, 3): a slow minute of this shared machine hits
    // every path alike.
    let direct_shim = socat(
        "socat-direct",
        SHIM_PORT,
        format!("TCP:{server_ip}:{IPERF_PORT},nodelay"),
    );
    let connect_shim = socat(
        "socat-connect",
        CONNECT_SHIM_PORT,
        format!("PROXY:{node_ip}:iperf.shop.svc.cluster.local:{IPERF_PORT},proxyport=4140,nodelay"),
    );
    // iperf3 itself speaks CONNECT (proxychains hooks its connect()), so no
    // shim process sits in the path: what the proxy pair alone costs.
    let conf = mesh.dir.path().join("proxychains.conf");
    std::fs::write(
        &conf,
        format!(
            "strict_chain\nquiet_mode\nproxy_dns\nremote_dns_subnet 224\n\
             tcp_read_time_out 15000\ntcp_connect_time_out 8000\n\
             [ProxyList]\nhttp {node_ip} 4140\n"
        ),
    )
    .unwrap();
    // `reverse`: the server sends (iperf3 -R), so bulk flows back through
    // the pair: the TLS client side reads it.
    let iperf_connect = |secs, reverse: bool| {
        let mut command = client.command("/usr/bin/proxychains4");
        command.arg("-q").arg("-f").arg(&conf).arg("iperf3");
        if reverse {
            command.arg("-R");
        }
        iperf_with(command, "iperf.shop.svc.cluster.local", IPERF_PORT, secs)
    };
    // The reference: a pair of haproxy (TCP mode, TLS with client
    // certificates between the nodes), which iperf3 reaches directly; and
    // the floor, the same pair as a null relay.
    let backend = std::net::SocketAddr::new(server_ip.into(), IPERF_PORT);
    let tls_pair = haproxy::start(&mesh, backend, haproxy::Mode::Tcp);
    let relay_pair = haproxy::start(&mesh, backend, haproxy::Mode::Relay);
    let pids_of =
        |pair: &[ChildProcess]| -> Vec<u32> { pair.iter().filter_map(|p| p.pid()).collect() };
    let (shim_direct, shim_connect) = (direct_shim.pid(), connect_shim.pid());
    let entry = node_ip.to_string();
    let iperf_pair = |mode: haproxy::Mode, secs, reverse: bool| {
        let mut command = client.command("iperf3");
        if reverse {
            command.arg("-R");
        }
        iperf_with(command, &entry, mode.entry_port(), secs)
    };
    type Iperf<'a> = Box<dyn Fn(u64) -> Result<(f64, u64), String> + 'a>;
    let paths: Vec<(&'static str, Vec<u32>, Option<u32>, Iperf)> = vec![
        (
            "loopback (one netns)",
            vec![],
            None,
            Box::new(|secs| iperf(client, "127.0.0.1", LOOPBACK_PORT, secs)),
        ),
        (
            "pod → pod direct",
            vec![],
            None,
            Box::new(|secs| iperf(client, &server_ip.to_string(), IPERF_PORT, secs)),
        ),
        (
            "pod → socat → pod",
            vec![],
            shim_direct,
            Box::new(|secs| iperf(client, "127.0.0.1", SHIM_PORT, secs)),
        ),
        (
            "socat → CONNECT proxy pair",
            proxy_pids.clone(),
            shim_connect,
            Box::new(|secs| iperf(client, "127.0.0.1", CONNECT_SHIM_PORT, secs)),
        ),
        (
            "iperf3 CONNECT → proxy pair",
            proxy_pids.clone(),
            None,
            Box::new(|secs| iperf_connect(secs, false)),
        ),
        (
            "the same, server sending",
            proxy_pids.clone(),
            None,
            Box::new(|secs| iperf_connect(secs, true)),
        ),
        (
            "haproxy+TLS pair (TCP)",
            pids_of(&tls_pair),
            None,
            Box::new(|secs| iperf_pair(haproxy::Mode::Tcp, secs, false)),
        ),
        (
            "haproxy+TLS, server sending",
            pids_of(&tls_pair),
            None,
            Box::new(|secs| iperf_pair(haproxy::Mode::Tcp, secs, true)),
        ),
        (
            "null relay pair (splice)",
            pids_of(&relay_pair),
            None,
            Box::new(|secs| iperf_pair(haproxy::Mode::Relay, secs, false)),
        ),
        (
            "null relay, server sending",
            pids_of(&relay_pair),
            None,
            Box::new(|secs| iperf_pair(haproxy::Mode::Relay, secs, true)),
        ),
    ];
    for (label, _, _, run) in &paths {
        eventually(&format!("iperf3 answers: {label}"), WAIT, || async {
            run(1)
        })
        .await;
    }
    let repeat: usize = std::env::var("STRAIT_BENCH_REPEAT")
        .unwrap_or("3".into())
        .parse()
        .unwrap();
    let mut runs = Vec::new();
    for _ in 0..repeat {
        for (label, pids, shim, run) in &paths {
            runs.push(measured(label, pids, *shim, || run(secs)));
        }
    }

    let raw = runs[0].gbits;
    println!(
        "\n{:<28} {:>8} {:>9} {:>8} {:>16} {:>10} {:>6} {:>6}",
        "path (one TCP stream)",
        "Gbit/s",
        "of raw",
        "retrans",
        "proxies CPU s",
        "socat CPU s",
        "wait%",
        "steal%"
    );
    for r in &runs {
        println!(
            "{:<28} {:>8.2} {:>8.0}% {:>8} {:>16.2} {:>10.2} {:>6} {:>6.1}",
            r.label,
            r.gbits,
            100.0 * r.gbits / raw,
            r.retransmits,
            r.proxy_cpu,
            r.shim_cpu,
            machine::percent_text(r.machine.cpu_wait),
            r.machine.steal
        );
    }
    // Medians over the rounds, with their spread; the ratios the goals are
    // stated in, from the medians of this run.
    let gbits_of = |label: &str| -> Vec<f64> {
        runs.iter()
            .filter(|r| r.label == label)
            .map(|r| r.gbits)
            .collect()
    };
    println!("\nmedians of {repeat} rounds:");
    let mut medians = Vec::new();
    for (label, ..) in &paths {
        let all = gbits_of(label);
        let med = median(all.clone());
        medians.push((*label, med));
        println!(
            "  {label:<28} {med:>8.2} Gbit/s (min {:.2}, max {:.2})",
            all.iter().copied().fold(f64::INFINITY, f64::min),
            all.iter().copied().fold(f64::NEG_INFINITY, f64::max)
        );
    }
    let med = |label: &str| {
        medians
            .iter()
            .find(|(l, _)| *l == label)
            .map_or(0.0, |(_, m)| *m)
    };
    println!(
        "  proxy pair (iperf3 CONNECT) / haproxy+TLS pair: {:.2}; / null relay: {:.2}; / direct: {:.2}",
        med("iperf3 CONNECT → proxy pair") / med("haproxy+TLS pair (TCP)"),
        med("iperf3 CONNECT → proxy pair") / med("null relay pair (splice)"),
        med("iperf3 CONNECT → proxy pair") / med("pod → pod direct"),
    );
    if let Ok(file) = std::env::var("STRAIT_BENCH_JSON") {
        let raw: Vec<serde_json::Value> = runs
            .iter()
            .map(|r| {
                serde_json::json!({"path": r.label, "gbits": r.gbits, "retransmits": r.retransmits,
                    "proxy_cpu_seconds": r.proxy_cpu, "shim_cpu_seconds": r.shim_cpu,
                    "cpu_wait": r.machine.cpu_wait, "steal": r.machine.steal})
            })
            .collect();
        let doc = serde_json::json!({"bench": "bulk", "secs": secs, "repeat": repeat,
            "threads": haproxy::threads(), "medians_gbits": medians.iter().map(|(l, m)| serde_json::json!({"path": l, "gbits": m})).collect::<Vec<_>>(),
            "runs": raw});
        std::fs::write(&file, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
        println!("raw results: {file}");
    }
    println!(
        "({secs} s each; CPU seconds over the run; {} CPUs)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
}
