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
//! `STRAIT_BENCH_SECS=10`.)

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
const LOOPBACK_PORT: u16 = 5202;
/// socat's copy buffer (its default is 8 KiB), so the shim is not the limit.
const SOCAT_BUFFER: &str = "131072";

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
    let mut mesh = start_mesh(2, Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await;
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
    let socat = |name: &str, to: String| {
        spawn(
            client,
            &mesh,
            name,
            "/usr/bin/socat",
            &[
                "-b".into(),
                SOCAT_BUFFER.into(),
                format!("TCP-LISTEN:{SHIM_PORT},bind=127.0.0.1,fork,reuseaddr"),
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

    let mut runs = Vec::new();
    runs.push(measured("loopback (one netns)", &[], None, || {
        iperf(client, "127.0.0.1", LOOPBACK_PORT, secs)
    }));
    runs.push(measured("pod → pod direct", &[], None, || {
        iperf(client, &server_ip.to_string(), IPERF_PORT, secs)
    }));
    {
        let shim = socat(
            "socat-direct",
            format!("TCP:{server_ip}:{IPERF_PORT},nodelay"),
        );
        std::thread::sleep(Duration::from_millis(300));
        runs.push(measured("pod → socat → pod", &[], shim.pid(), || {
            iperf(client, "127.0.0.1", SHIM_PORT, secs)
        }));
    }
    {
        let shim = socat(
            "socat-connect",
            format!(
                "PROXY:{node_ip}:iperf.shop.svc.cluster.local:{IPERF_PORT},proxyport=4140,nodelay"
            ),
        );
        std::thread::sleep(Duration::from_millis(300));
        eventually("iperf3 answers through CONNECT", WAIT, || async {
            iperf(client, "127.0.0.1", SHIM_PORT, 1)
        })
        .await;
        runs.push(measured(
            "socat → CONNECT proxy pair",
            &proxy_pids,
            shim.pid(),
            || iperf(client, "127.0.0.1", SHIM_PORT, secs),
        ));
    }
    {
        // iperf3 itself speaks CONNECT (proxychains hooks its connect()), so
        // no shim process sits in the path: what the proxy pair alone costs.
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
        // `reverse`: the server sends (iperf3 -R), so bulk flows back
        // through the pair: the TLS client side reads it.
        let iperf_connect = |secs, reverse: bool| {
            let mut command = client.command("/usr/bin/proxychains4");
            command.arg("-q").arg("-f").arg(&conf).arg("iperf3");
            if reverse {
                command.arg("-R");
            }
            iperf_with(command, "iperf.shop.svc.cluster.local", IPERF_PORT, secs)
        };
        eventually("iperf3 answers through proxychains", WAIT, || async {
            iperf_connect(1, false)
        })
        .await;
        runs.push(measured(
            "iperf3 CONNECT → proxy pair",
            &proxy_pids,
            None,
            || iperf_connect(secs, false),
        ));
        runs.push(measured(
            "the same, server sending",
            &proxy_pids,
            None,
            || iperf_connect(secs, true),
        ));
    }

    // The reference: a pair of haproxy (TCP mode, TLS with client
    // certificates between the nodes), which iperf3 reaches directly; then
    // the floor, the same pair as a null relay.
    for (mode, label, reverse_label) in [
        (
            haproxy::Mode::Tcp,
            "haproxy+TLS pair (TCP)",
            "haproxy+TLS, server sending",
        ),
        (
            haproxy::Mode::Relay,
            "null relay pair (splice)",
            "null relay, server sending",
        ),
    ] {
        let pair = haproxy::start(
            &mesh,
            std::net::SocketAddr::new(server_ip.into(), IPERF_PORT),
            mode,
        );
        let pids: Vec<u32> = pair.iter().filter_map(|p| p.pid()).collect();
        let entry = node_ip.to_string();
        let iperf_pair = |secs, reverse: bool| {
            let mut command = client.command("iperf3");
            if reverse {
                command.arg("-R");
            }
            iperf_with(command, &entry, mode.entry_port(), secs)
        };
        eventually("iperf3 answers through the haproxy pair", WAIT, || async {
            iperf_pair(1, false)
        })
        .await;
        runs.push(measured(label, &pids, None, || iperf_pair(secs, false)));
        runs.push(measured(reverse_label, &pids, None, || {
            iperf_pair(secs, true)
        }));
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
    println!(
        "({secs} s each; CPU seconds over the run; {} CPUs)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
}
