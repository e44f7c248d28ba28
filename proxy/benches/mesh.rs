//! Node proxy benchmark (root; testenv nodes as network namespaces), side by side:
//! client → server directly, client → strait-proxy → strait-proxy → server
//! (mTLS between the nodes), and client → haproxy → haproxy → server (TLS with
//! client certificates between the nodes). Open-loop load at fixed rates with
//! `strait-load` (100 connections, 1 KiB request bodies); CPU and RSS of the
//! two proxies of each pair while the load runs, and how long the machine's
//! tasks waited for a CPU (`support/machine.rs`). A fourth path is the floor
//! for any pair of proxies here: the haproxy pair as a null relay (TCP, no
//! TLS, kernel `splice`), two more processes in the path that do nothing but
//! pass bytes on.
//!
//!     bash scripts/bench-proxy.sh
//!
//! (installs haproxy, builds the release binaries, then runs
//! `cargo bench -p strait-proxy --bench mesh` with `STRAIT_PROXY_LOG=warn`, since
//! per-request debug logs would cost what is measured; `STRAIT_BENCH_RATES=1000,10000`,
//! `STRAIT_BENCH_SECS=10`; `STRAIT_BENCH_REPEAT=3` runs three interleaved rounds
//! and adds their medians.)
//!
//! A/B of two proxy builds: `STRAIT_BENCH_PROXY_B=/path/to/strait-proxy` adds
//! a path "strait-proxy B" to every round, the same mesh with every node's
//! proxy restarted from that binary (and back), so both builds meet the same
//! minutes of this shared machine.

#[path = "support/haproxy.rs"]
mod haproxy;
#[path = "support/machine.rs"]
mod machine;
#[path = "support/perf.rs"]
mod perf;

use std::net::{IpAddr, SocketAddr};

use strait_testenv::process::{cpu_seconds, rss_kib, rss_parts_kib};

use strait_testenv::fixture::*;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

struct Run {
    label: String,
    path: String,
    rate: u32,
    /// Which interleaved round (set once the round is done).
    round: usize,
    report: serde_json::Value,
    /// CPU seconds of each measured process (node 1's first).
    cpu: Vec<f64>,
    rss_kib: u64,
    /// RSS by kind, each process's `[anonymous, file-backed, shmem]`.
    rss_parts_kib: Vec<[u64; 3]>,
    machine: machine::Usage,
}

impl Run {
    /// vCPU per 1 000 rps of each process; the CPU window includes
    /// strait-load's 2 s warm-up at the same rate.
    fn per_k(&self, secs: u64) -> Vec<f64> {
        let achieved = self.report["achieved_rps"].as_f64().unwrap_or(0.0);
        if achieved <= 0.0 {
            return Vec::new();
        }
        self.cpu
            .iter()
            .map(|c| c / (secs + 2) as f64 / (achieved / 1000.0))
            .collect()
    }

    fn ms(&self, key: &str) -> f64 {
        self.report[key].as_f64().unwrap_or(0.0)
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Runs strait-load in the client pod against `connect` with request target `uri`.
fn load(
    mesh: &Mesh,
    connect: SocketAddr,
    uri: &str,
    host: &str,
    rate: u32,
    secs: u64,
) -> serde_json::Value {
    strait_load(&mesh.pods["client"].0, connect, (uri, host), rate, secs, 2)
}

/// One path at one rate, with the CPU and RSS of `pids`; with
/// `STRAIT_BENCH_PERF_DIR` set, `profile: Some(secs)` also records `pids`
/// with `perf` for that long (the first round's runs).
fn measured(
    path: &str,
    rate: u32,
    pids: &[u32],
    profile: Option<u64>,
    run: impl FnOnce() -> serde_json::Value,
) -> Run {
    let before: Vec<f64> = pids.iter().map(|p| cpu_seconds(*p)).collect();
    let machine_before = machine::Reading::now();
    let perf = perf::dir()
        .zip(profile.filter(|_| !pids.is_empty()))
        .map(|(dir, secs)| perf::record(&dir, &format!("{path} {rate}"), pids, secs));
    let report = run();
    if let Some(mut perf) = perf {
        let _ = perf.wait();
    }
    let machine = machine_before.since();
    let cpu = pids
        .iter()
        .zip(before)
        .map(|(p, b)| cpu_seconds(*p) - b)
        .collect();
    Run {
        label: format!("{path} {rate:>6} rps"),
        path: path.into(),
        rate,
        round: 0,
        report,
        cpu,
        rss_kib: pids.iter().map(|p| rss_kib(*p)).sum(),
        rss_parts_kib: pids.iter().map(|p| rss_parts_kib(*p)).collect(),
        machine,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    uniform_runtimes();
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if !strait_testenv::net::root_or_skip("proxy benchmark") {
        return;
    }
    let rates: Vec<u32> = env_or("STRAIT_BENCH_RATES", "1000,10000")
        .split(',')
        .map(|r| r.trim().parse().unwrap())
        .collect();
    let secs: u64 = env_or("STRAIT_BENCH_SECS", "10").parse().unwrap();
    let proxy_a = &strait_testenv::workspace_binary("strait-proxy");
    let proxy_b = std::env::var_os("STRAIT_BENCH_PROXY_B").map(std::path::PathBuf::from);
    if let Some(b) = &proxy_b {
        assert!(b.is_file(), "STRAIT_BENCH_PROXY_B: no file {}", b.display());
    }
    let mut mesh = start_mesh(2, proxy_a).await;
    backend(&mut mesh, 1, "web-1", "web", &[]).await;
    add_client(&mut mesh, 0).await;
    service(&mesh.topology.cluster().client(), "web").await;
    let server = SocketAddr::new(IpAddr::V4(mesh.pods["web-1"].0.ip()), 8080);
    let node1 = mesh.topology.nodes()[0].ip();
    let strait_entry = SocketAddr::new(IpAddr::V4(node1), 4140);
    let pids = |mesh: &Mesh| -> Vec<u32> { mesh.proxies.iter().filter_map(|p| p.pid()).collect() };
    // Wait until the mesh path answers (discovery has the new service).
    let url = "http://web.shop.svc.cluster.local/bench";
    let _ = load(&mesh, strait_entry, url, "web.shop", 50, 3);
    let haproxy = haproxy::start(&mesh, server, haproxy::Mode::Http);
    let haproxy_pids: Vec<u32> = haproxy.iter().filter_map(|p| p.pid()).collect();
    let relay = haproxy::start(&mesh, server, haproxy::Mode::Relay);
    let relay_pids: Vec<u32> = relay.iter().filter_map(|p| p.pid()).collect();
    let through_haproxy =
        |mesh: &Mesh, label: &str, pids: &[u32], mode: haproxy::Mode, rate, round| {
            let entry = SocketAddr::new(IpAddr::V4(node1), mode.entry_port());
            measured(
                label,
                rate,
                pids,
                (round == 0).then_some(secs.saturating_sub(1).max(1)),
                || load(mesh, entry, "/bench", "web.shop", rate, secs),
            )
        };

    let repeat: usize = env_or("STRAIT_BENCH_REPEAT", "1").parse().unwrap();
    let mut runs = Vec::new();
    // Rounds interleave the paths, so a slow minute of this shared machine
    // hits all of them; the summary takes medians over the rounds.
    for round in 0..repeat {
        let first_of_round = runs.len();
        for &rate in &rates {
            runs.push(measured("direct", rate, &[], None, || {
                load(&mesh, server, "/bench", "web.shop", rate, secs)
            }));
            let through_strait = |mesh: &Mesh, label: &str| {
                measured(
                    label,
                    rate,
                    &pids(mesh),
                    (round == 0).then_some(secs.saturating_sub(1).max(1)),
                    || load(mesh, strait_entry, url, "web.shop", rate, secs),
                )
            };
            runs.push(through_strait(&mesh, "strait-proxy"));
            if let Some(b) = &proxy_b {
                restart_proxies(&mut mesh, b).await;
                runs.push(through_strait(&mesh, "strait-proxy B"));
                restart_proxies(&mut mesh, proxy_a).await;
            }
            runs.push(through_haproxy(
                &mesh,
                "haproxy+TLS",
                &haproxy_pids,
                haproxy::Mode::Http,
                rate,
                round,
            ));
            runs.push(through_haproxy(
                &mesh,
                "null relay",
                &relay_pids,
                haproxy::Mode::Relay,
                rate,
                round,
            ));
        }
        for r in &mut runs[first_of_round..] {
            r.round = round;
        }
    }
    stop_proxies(&mut mesh);
    // A broken comparison must say why, not print zeros.
    if runs.iter().any(|r| {
        (r.label.starts_with("haproxy") || r.label.starts_with("null"))
            && r.report["errors"].as_u64() != Some(0)
    }) {
        for h in haproxy.iter().chain(&relay) {
            eprintln!(
                "──── {} ────\n{}",
                h.name(),
                strait_testenv::process::log_tail(h.log_path(), 20)
            );
        }
    }
    println!(
        "\n{:<26} {:>9} {:>8} {:>8} {:>8} {:>8} {:>7} {:>11} {:>15} {:>8} {:>6} {:>6}",
        "path",
        "achieved",
        "p50 ms",
        "p99 ms",
        "p99.9",
        "max",
        "errors",
        "CPU/1k rps",
        "node 1 + node 2",
        "RSS MiB",
        "wait%",
        "steal%"
    );
    for r in &runs {
        let each = r.per_k(secs);
        let (total, split) = if each.is_empty() {
            ("-".to_string(), "-".to_string())
        } else {
            (
                format!("{:.3}", each.iter().sum::<f64>()),
                each.iter()
                    .map(|c| format!("{c:.3}"))
                    .collect::<Vec<_>>()
                    .join(" + "),
            )
        };
        let saturated = if r.report["saturated"] == true {
            "!"
        } else {
            ""
        };
        println!(
            "{:<26} {:>8.0}{:1} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>7} {:>11} {:>15} {:>8.1} {:>6} {:>6.1}",
            r.label,
            r.report["achieved_rps"].as_f64().unwrap_or(0.0),
            saturated,
            r.ms("p50_ms"),
            r.ms("p99_ms"),
            r.ms("p999_ms"),
            r.ms("max_ms"),
            r.report["errors"],
            total,
            split,
            r.rss_kib as f64 / 1024.0,
            machine::percent_text(r.machine.cpu_wait),
            r.machine.steal
        );
    }
    if runs.iter().any(|r| r.report["saturated"] == true) {
        println!(
            "! saturated: the path answered under 95 % of the asked rate within the window; its latencies are a queue's"
        );
    }
    println!(
        "threads: {} per haproxy (nbthread), {} workers per node proxy",
        haproxy::threads(),
        haproxy::threads()
    );
    if let Ok(file) = std::env::var("STRAIT_BENCH_JSON") {
        let raw: Vec<serde_json::Value> = runs
            .iter()
            .map(|r| {
                serde_json::json!({
                    "path": r.path, "rate": r.rate, "round": r.round, "load": r.report, "cpu_seconds": r.cpu,
                    "cpu_per_1k_rps": r.per_k(secs), "rss_kib": r.rss_kib,
                    "rss_anon_file_shmem_kib": r.rss_parts_kib,
                    "cpu_wait": r.machine.cpu_wait, "steal": r.machine.steal,
                })
            })
            .collect();
        let doc = serde_json::json!({"bench": "mesh", "secs": secs, "repeat": repeat,
            "threads": haproxy::threads(), "runs": raw, "goals": goals(&runs, &rates, secs)});
        std::fs::write(&file, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
        println!("raw results: {file}");
    }
    if repeat > 1 {
        // Medians over the rounds; "added" is against the direct path of
        // the same round.
        println!(
            "\nmedians of {repeat} rounds: {:<22} {:>11} {:>15} {:>12} {:>12} {:>17} {:>6}",
            "path",
            "CPU/1k rps",
            "node 1 / node 2",
            "added p50",
            "added p99",
            "added p99 min–max",
            "wait%"
        );
        // Each rate's paths in a round: direct first, as pushed above.
        let per_round = runs.len() / repeat;
        let paths = per_round / rates.len();
        for (i, first) in runs.iter().take(per_round).enumerate() {
            let same: Vec<&Run> = runs.iter().skip(i).step_by(per_round).collect();
            let direct: Vec<&Run> = runs.iter().skip(i - i % paths).step_by(per_round).collect();
            let each_added = |key: &str| -> Vec<f64> {
                same.iter()
                    .zip(&direct)
                    .map(|(r, d)| r.ms(key) - d.ms(key))
                    .collect()
            };
            let added = |key: &str| median(each_added(key));
            let p99s = each_added("p99_ms");
            let spread = format!(
                "{:.2}–{:.2} ms",
                p99s.iter().copied().fold(f64::INFINITY, f64::min),
                p99s.iter().copied().fold(f64::NEG_INFINITY, f64::max)
            );
            let node = |n: usize| {
                median(
                    same.iter()
                        .filter_map(|r| r.per_k(secs).get(n).copied())
                        .collect(),
                )
            };
            let (cpu, split) = if first.cpu.is_empty() {
                ("-".to_string(), "-".to_string())
            } else {
                let total = median(same.iter().map(|r| r.per_k(secs).iter().sum()).collect());
                (
                    format!("{total:.3}"),
                    format!("{:.3} / {:.3}", node(0), node(1)),
                )
            };
            let waits: Vec<f64> = same.iter().filter_map(|r| r.machine.cpu_wait).collect();
            let wait = (!waits.is_empty()).then(|| median(waits));
            println!(
                "{:>28}{:<22} {:>11} {:>15} {:>9.2} ms {:>9.2} ms {:>17} {:>6}",
                "",
                first.label,
                cpu,
                split,
                added("p50_ms"),
                added("p99_ms"),
                spread,
                machine::percent_text(wait)
            );
        }
    }
    print_goals(&goals(&runs, &rates, secs));
    drop(haproxy);
    drop(relay);
}

/// One path at one rate, medians over the rounds.
struct Medians {
    /// vCPU per 1 000 rps of each proxy (node 1's first).
    cpu_per_node: Vec<f64>,
    /// p99 over the same round's direct path.
    added_p99_ms: f64,
    rss_kib: f64,
}

fn medians(runs: &[Run], path: &str, rate: u32, secs: u64) -> Option<Medians> {
    let same: Vec<&Run> = runs
        .iter()
        .filter(|r| r.path == path && r.rate == rate)
        .collect();
    if same.is_empty() {
        return None;
    }
    let direct = |round: usize| {
        runs.iter()
            .find(|d| d.path == "direct" && d.rate == rate && d.round == round)
            .map_or(0.0, |d| d.ms("p99_ms"))
    };
    let nodes = same.iter().map(|r| r.cpu.len()).min().unwrap_or(0);
    Some(Medians {
        cpu_per_node: (0..nodes)
            .map(|n| median(same.iter().map(|r| r.per_k(secs)[n]).collect()))
            .collect(),
        added_p99_ms: median(
            same.iter()
                .map(|r| r.ms("p99_ms") - direct(r.round))
                .collect(),
        ),
        rss_kib: median(same.iter().map(|r| r.rss_kib as f64).collect()),
    })
}

/// The goals for the node proxy pair, as ratios against the
/// references of the same run (medians over the rounds): CPU per 1 000 rps of
/// each proxy against the haproxy TLS pair's proxy on the same node, added p99
/// against the null relay's, RSS of the pair against the haproxy pair's.
fn goals(runs: &[Run], rates: &[u32], secs: u64) -> serde_json::Value {
    let mut out = Vec::new();
    // An A/B run (`STRAIT_BENCH_PROXY_B`) gets B's ratios against the same references too.
    for (path, &rate) in ["strait-proxy", "strait-proxy B"]
        .iter()
        .flat_map(|p| rates.iter().map(move |r| (p, r)))
    {
        let (Some(strait), Some(haproxy), Some(relay)) = (
            medians(runs, path, rate, secs),
            medians(runs, "haproxy+TLS", rate, secs),
            medians(runs, "null relay", rate, secs),
        ) else {
            continue;
        };
        let cpu: Vec<f64> = strait
            .cpu_per_node
            .iter()
            .zip(&haproxy.cpu_per_node)
            .map(|(s, h)| s / h)
            .collect();
        out.push(serde_json::json!({
            "path": path,
            "rate": rate,
            "cpu_per_proxy_vs_haproxy_tls": cpu,
            "cpu_per_proxy_goal": 0.9,
            "added_p99_ms": strait.added_p99_ms,
            "null_relay_added_p99_ms": relay.added_p99_ms,
            "added_p99_vs_null_relay": strait.added_p99_ms / relay.added_p99_ms,
            "added_p99_goal": 1.25,
            "rss_vs_haproxy_tls": strait.rss_kib / haproxy.rss_kib,
            "rss_goal": 1.0,
        }));
    }
    serde_json::Value::Array(out)
}

fn print_goals(goals: &serde_json::Value) {
    let Some(goals) = goals.as_array().filter(|g| !g.is_empty()) else {
        return;
    };
    println!(
        "
goals (medians; ratio of each strait-proxy path to its reference in this run):"
    );
    let mark = |ok: bool| if ok { "met" } else { "NOT met" };
    for g in goals {
        let f = |k: &str| g[k].as_f64().unwrap_or(f64::NAN);
        let cpu: Vec<f64> = g["cpu_per_proxy_vs_haproxy_tls"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default();
        let worst = cpu.iter().copied().fold(f64::NAN, f64::max);
        println!(
            "  {:<14} {:>6} rps  CPU per proxy / haproxy+TLS: {} (≤ 0.90: {})   added p99 / null relay: {:.2} ({:.2} / {:.2} ms; ≤ 1.25: {})   RSS / haproxy+TLS: {:.2} (≤ 1.00: {})",
            g["path"].as_str().unwrap_or("?"),
            g["rate"],
            cpu.iter()
                .map(|c| format!("{c:.2}"))
                .collect::<Vec<_>>()
                .join(" / "),
            mark(worst <= 0.9),
            f("added_p99_vs_null_relay"),
            f("added_p99_ms"),
            f("null_relay_added_p99_ms"),
            mark(f("added_p99_vs_null_relay") <= 1.25),
            f("rss_vs_haproxy_tls"),
            mark(f("rss_vs_haproxy_tls") <= 1.0),
        );
    }
}
