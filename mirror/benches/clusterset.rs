//! ServiceExport → ServiceImport latency across two real API servers:
//!
//!     cargo bench -p strait-mirror --bench clusterset
//!
//! East and west linked both ways, each running its controllers (mirror +
//! MCS) in this process, as `strait-mirror --cluster-name` does. For each of
//! STRAIT_BENCH_EXPORTS (100) Services created in west one at a time: the
//! time from creating its ServiceExport in west to the ServiceImport in east
//! carrying its ClusterSetIP (`spec.ips`: what cluster DNS answers and the
//! node proxies route), seen by a watch. Prints p50/p99/max (goal: p99 under
//! 1 s; the conformance suite allows 20 s).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use strait_mesh::mcs::{ServiceExport, ServiceImport};
use strait_mirror::mcs::ClustersetFeed;
use strait_testenv::Cluster;
use strait_testenv::workloads::ensure_namespace;

fn start_controllers(client: &Client, name: &str) {
    let feed = ClustersetFeed::default();
    let config = strait_mirror::MirrorConfig {
        clusterset: Some((name.to_string(), feed.clone())),
        ..Default::default()
    };
    tokio::spawn(strait_mirror::mcs::run(client.clone(), name.into(), feed));
    tokio::spawn(strait_mirror::run(client.clone(), config));
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).saturating_sub(1);
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::var("STRAIT_BENCH_EXPORTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    let (ec, wc) = (east.client(), west.client());
    for c in [&ec, &wc] {
        common::install_crd(c).await;
        for crd in strait_mesh::mcs::crds() {
            common::apply_crd(c, crd).await;
        }
        ensure_namespace(c, "bench").await.unwrap();
    }
    start_controllers(&ec, "east");
    start_controllers(&wc, "west");
    common::link(&ec, "west", Some(&common::admin_kubeconfig(&west))).await;
    common::link(&wc, "east", Some(&common::admin_kubeconfig(&east))).await;

    // When each import first carried its ClusterSetIP in east.
    let seen: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    {
        let seen = seen.clone();
        let imports: Api<ServiceImport> = Api::namespaced(ec.clone(), "bench");
        tokio::spawn(async move {
            let mut events = watcher(imports, watcher::Config::default())
                .applied_objects()
                .boxed();
            while let Some(Ok(import)) = events.next().await {
                if !import.spec.spec.ips.is_empty() {
                    seen.lock()
                        .unwrap()
                        .entry(import.name_any())
                        .or_insert_with(Instant::now);
                }
            }
        });
    }
    let services: Api<Service> = Api::namespaced(wc.clone(), "bench");
    let exports: Api<ServiceExport> = Api::namespaced(wc.clone(), "bench");
    let pp = PostParams::default();
    // One export first, not measured: the Link workers and watches warm up.
    let mut latencies = Vec::with_capacity(n);
    for i in 0..=n {
        let name = format!("svc-{i}");
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
        }))
        .unwrap();
        services.create(&pp, &svc).await.unwrap();
        let started = Instant::now();
        exports
            .create(&pp, &ServiceExport::new(&name, Default::default()))
            .await
            .unwrap();
        let deadline = started + Duration::from_secs(if i == 0 { 60 } else { 20 });
        let at = loop {
            if let Some(at) = seen.lock().unwrap().get(&name) {
                break *at;
            }
            assert!(
                Instant::now() < deadline,
                "ServiceImport bench/{name} never carried its ClusterSetIP in east"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        if i > 0 {
            latencies.push(at.saturating_duration_since(started));
        }
    }
    latencies.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "MEASURED ServiceExport in west → ServiceImport with its ClusterSetIP in east, {n} exports one at a time: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms (goal p99 < 1000 ms)",
        ms(percentile(&latencies, 0.50)),
        ms(percentile(&latencies, 0.99)),
        ms(*latencies.last().unwrap()),
    );
}
