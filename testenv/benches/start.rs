//! Warm start time and idle memory of one testenv cluster.
//!
//!     cargo bench -p strait-testenv --bench start
//!
//! Starts a cluster STRAIT_BENCH_RUNS times (default 5) with the control plane
//! already built, reports p50/max time to "ready" (API server /readyz ok and the
//! controller manager's controllers visibly running), then RSS per component
//! after 10 s idle.

use std::time::{Duration, Instant};

use strait_testenv::Cluster;
use strait_testenv::process::rss_kib;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runs: usize = std::env::var("STRAIT_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    tokio::task::spawn_blocking(strait_testenv::controlplane::ensure_built)
        .await
        .unwrap()
        .expect("build");
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..runs {
        drop(last.take());
        let start = Instant::now();
        let cluster = Cluster::start("bench").await.expect("start");
        times.push(start.elapsed());
        last = Some(cluster);
    }
    times.sort();
    println!(
        "warm start of one cluster (n={runs}): p50 {:.2} s, max {:.2} s",
        times[times.len() / 2].as_secs_f64(),
        times[times.len() - 1].as_secs_f64()
    );
    let cluster = last.expect("at least one run");
    tokio::time::sleep(Duration::from_secs(10)).await;
    let names = ["etcd", "kube-apiserver", "kube-controller-manager"];
    let mut total = 0;
    for (name, pid) in names.iter().zip(cluster.pids()) {
        let kib = rss_kib(pid);
        total += kib;
        println!("idle RSS {name}: {} MiB", kib / 1024);
    }
    println!("idle RSS one cluster: {} MiB", total / 1024);
}
