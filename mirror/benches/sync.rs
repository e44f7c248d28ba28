//! Mirror controller benchmarks on real API servers (testenv), with the
//! controller as its own process (`strait-mirror`), so its RSS is its own.
//!
//!     cargo bench -p strait-mirror --bench sync
//!
//! 1. Export → mirror latency over STRAIT_BENCH_LATENCY_N (100) services created
//!    one at a time: p50/p99 from the create call in west to the mirror Service
//!    and its EndpointSlice existing in east.
//! 2. Initial sync of STRAIT_BENCH_SYNC_N (comma list, default "1000,10000")
//!    exported services: time from linking to all mirrors present, and the
//!    controller's peak RSS.
//!    Beside it, the API server's floor for the same writes: a plain client
//!    server-side-applies the same number of Services and EndpointSlices
//!    (one of each per Service, in that order, 16 Services at a time as the
//!    controller writes) into a fresh cluster started as east was, just
//!    before; the sync's ratio to it. For both: CPU by control-plane
//!    component and the API server's requests by resource and verb;
//!    STRAIT_BENCH_PPROF_DIR=DIR also takes a 30 s CPU profile of each API
//!    server (`go tool pprof -top DIR/FILE`).
//! 3. API writes while idle for STRAIT_BENCH_IDLE_SECS (60): counted as changes
//!    of resourceVersion across all mirrors and the Link.
//! 4. West's API server restarted (every watch relists): mirrors rewritten
//!    in the STRAIT_BENCH_IDLE_SECS after it answers again (should be 0).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, CustomResourceExt, ResourceExt};
use serde_json::json;
use strait_mesh::link::Link;
use strait_testenv::apimetrics::{self, Requests};
use strait_testenv::process::{ChildProcess, cpu_seconds, rss_kib};
use strait_testenv::workloads::ensure_namespace;
use strait_testenv::{Cluster, kubeconfig};

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

struct Env {
    east: Cluster,
    west: Cluster,
    controller: ChildProcess,
    dir: tempfile::TempDir,
}

async fn setup() -> Env {
    let (east, west) = tokio::join!(
        Cluster::start_with(measured("east")),
        Cluster::start("west")
    );
    let (east, west) = (east.unwrap(), west.unwrap());
    let ec = east.client();
    let crds: Api<CustomResourceDefinition> = Api::all(ec.clone());
    crds.patch(
        "links.multicluster.strait.dev",
        &PatchParams::apply("bench").force(),
        &Patch::Apply(Link::crd()),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure_namespace(&ec, "bench").await.unwrap();
    ensure_namespace(&west.client(), "bench").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let controller = ChildProcess::spawn_with_env(
        "strait-mirror",
        std::path::Path::new(env!("CARGO_BIN_EXE_strait-mirror")),
        &[
            "--admin-addr=127.0.0.1:0".to_string(),
            "--no-gateway-probe".to_string(),
        ],
        &[
            ("KUBECONFIG", east.kubeconfig_path().as_os_str()),
            ("RUST_LOG", std::ffi::OsStr::new("warn")),
        ],
        &dir.path().join("mirror.log"),
    )
    .unwrap();
    Env {
        east,
        west,
        controller,
        dir,
    }
}

/// A cluster whose API server is measured: it serves /debug/pprof, so
/// STRAIT_BENCH_PPROF_DIR can take its CPU profile during the floor and the sync.
fn measured(name: &str) -> strait_testenv::ClusterConfig {
    let mut config = strait_testenv::ClusterConfig::new(name);
    config.extra_apiserver_args.push("--profiling=true".into());
    config
}

async fn link(env: &Env, name: &str) {
    let ec = env.east.client();
    ensure_namespace(&ec, "strait-multicluster").await.unwrap();
    let kc = kubeconfig::to_yaml(env.west.kubeconfig()).unwrap();
    let secret: Secret = serde_json::from_value(
        json!({"metadata": {"name": format!("creds-{name}")}, "stringData": {"kubeconfig": kc}}),
    )
    .unwrap();
    Api::<Secret>::namespaced(ec.clone(), "strait-multicluster")
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let link: Link = serde_json::from_value(json!({
        "apiVersion": "multicluster.strait.dev/v1alpha1", "kind": "Link", "metadata": {"name": name},
        "spec": {"targetClusterName": name, "clusterCredentialsSecret": format!("creds-{name}"), "gatewayAddresses": ["10.77.0.1"],
                 "selector": {"matchLabels": {"bench": name}}},
    }))
    .unwrap();
    Api::<Link>::namespaced(ec, "strait-multicluster")
        .create(&PostParams::default(), &link)
        .await
        .unwrap();
}

/// The API server's floor for an initial sync of `size`: a plain client
/// server-side-applies, 16 Services at a time, each a Service and then its
/// EndpointSlice (one endpoint), as the controller writes a mirror. Seconds.
async fn floor(client: &Client, namespace: &str, size: usize) -> f64 {
    ensure_namespace(client, namespace).await.unwrap();
    let (services, slices) = (
        Api::<Service>::namespaced(client.clone(), namespace),
        Api::<EndpointSlice>::namespaced(client.clone(), namespace),
    );
    let params = PatchParams::apply("bench-floor");
    let start = Instant::now();
    futures::stream::iter(0..size)
        .map(|i| {
            let (services, slices, params) = (services.clone(), slices.clone(), params.clone());
            async move {
                let name = format!("floor-{i}");
                let svc = json!({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": name, "labels": {"strait.dev/mirrored-service": "true", "strait.dev/cluster-name": "floor"}},
                    "spec": {"ports": [{"name": "http", "port": 80}]}});
                services.patch(&name, &params, &Patch::Apply(&svc)).await.unwrap();
                let slice = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"name": name, "labels": {"kubernetes.io/service-name": name, "strait.dev/cluster-name": "floor"}},
                    "addressType": "IPv4", "ports": [{"name": "http", "port": 4143}],
                    "endpoints": [{"addresses": ["10.77.0.1"], "conditions": {"ready": true}}]});
                slices.patch(&name, &params, &Patch::Apply(&slice)).await.unwrap();
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    start.elapsed().as_secs_f64()
}

/// What a cluster's control plane had done by some moment: CPU seconds by
/// component and requests served by resource and verb.
struct Work {
    cpu: BTreeMap<&'static str, f64>,
    requests: Requests,
}

impl Work {
    async fn now(cluster: &Cluster) -> Self {
        Work {
            cpu: cluster
                .components()
                .into_iter()
                .map(|(name, pid)| (name, cpu_seconds(pid)))
                .collect(),
            requests: apimetrics::requests(&cluster.client()).await.unwrap(),
        }
    }

    /// What was done since `before`: JSON for the results, and a line for
    /// people (CPU by component, the most frequent requests).
    fn since(&self, before: &Work) -> (serde_json::Value, String) {
        let cpu: BTreeMap<&str, f64> = self
            .cpu
            .iter()
            .map(|(k, v)| (*k, v - before.cpu.get(k).copied().unwrap_or(0.0)))
            .collect();
        let requests = apimetrics::minus(&self.requests, &before.requests);
        let mut top: Vec<(&String, &f64)> = requests.iter().collect();
        top.sort_by(|a, b| b.1.total_cmp(a.1));
        let line = format!(
            "CPU {}; requests {}",
            cpu.iter()
                .map(|(k, v)| format!("{k} {v:.1} s"))
                .collect::<Vec<_>>()
                .join(", "),
            top.iter()
                .take(10)
                .map(|(k, v)| format!("{k} {v:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        (json!({"cpu_seconds": cpu, "requests": requests}), line)
    }
}

/// With STRAIT_BENCH_PPROF_DIR set: a 30 s CPU profile of `cluster`'s API
/// server, taken 10 s from now, written to `<dir>/<name>.pprof` (read it with
/// `go tool pprof -top FILE`).
fn profile_api_server(cluster: &Cluster, name: &str) -> Option<tokio::task::JoinHandle<()>> {
    let dir = std::path::PathBuf::from(std::env::var_os("STRAIT_BENCH_PPROF_DIR")?);
    let (client, file) = (cluster.client(), dir.join(format!("{name}.pprof")));
    let name = name.to_string();
    Some(tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let request = http::Request::get("/debug/pprof/profile?seconds=30")
            .body(Vec::new())
            .unwrap();
        match client.request_stream(request).await {
            Ok(body) => {
                use futures::AsyncReadExt;
                let mut bytes = Vec::new();
                let mut body = Box::pin(body);
                match body.read_to_end(&mut bytes).await {
                    Ok(_) => {
                        std::fs::create_dir_all(&dir).unwrap();
                        std::fs::write(&file, bytes).unwrap();
                        println!("  API server CPU profile: {}", file.display());
                    }
                    Err(e) => println!("  API server CPU profile {name} failed: {e}"),
                }
            }
            Err(e) => println!("  API server CPU profile {name} failed: {e}"),
        }
    }))
}

fn service(name: &str, label: &str) -> Service {
    serde_json::from_value(json!({"metadata": {"name": name, "labels": {"bench": label}}, "spec": {"ports": [{"name": "http", "port": 80}]}})).unwrap()
}

async fn count_mirrors(client: &Client, cluster: &str) -> usize {
    let lp = ListParams::default().labels(&format!("strait.dev/cluster-name={cluster}"));
    Api::<Service>::namespaced(client.clone(), "bench")
        .list_metadata(&lp)
        .await
        .map(|l| l.items.len())
        .unwrap_or(0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let mut env = setup().await;
    let (ec, wc) = (env.east.client(), env.west.client());
    let west_services: Api<Service> = Api::namespaced(wc.clone(), "bench");

    // 1. Latency.
    let n: usize = env_or("STRAIT_BENCH_LATENCY_N", "100").parse().unwrap();
    link(&env, "lat").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let east_services: Api<Service> = Api::namespaced(ec.clone(), "bench");
    let east_slices: Api<EndpointSlice> = Api::namespaced(ec.clone(), "bench");
    let mut latencies = Vec::new();
    for i in 0..n {
        let name = format!("lat-{i}");
        let start = Instant::now();
        west_services
            .create(&PostParams::default(), &service(&name, "lat"))
            .await
            .unwrap();
        let mirror = format!("{name}-lat");
        loop {
            if east_services.get_opt(&mirror).await.unwrap().is_some()
                && east_slices.get_opt(&mirror).await.unwrap().is_some()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        latencies.push(start.elapsed());
    }
    latencies.sort();
    let pct = |p: f64| {
        latencies[((latencies.len() as f64 * p).ceil() as usize).saturating_sub(1)].as_secs_f64()
            * 1e3
    };
    println!(
        "export → mirror with endpoints (n={n}): p50 {:.0} ms, p99 {:.0} ms",
        pct(0.5),
        pct(0.99)
    );
    let mut results = serde_json::json!({
        "bench": "sync",
        "latency": {"n": n, "p50_ms": pct(0.5), "p99_ms": pct(0.99)},
        "syncs": [],
    });

    // 2. Initial sync.
    for size in env_or("STRAIT_BENCH_SYNC_N", "1000,10000")
        .split(',')
        .map(|s| s.trim().parse::<usize>().unwrap())
    {
        let label = format!("s{size}");
        futures::stream::iter((0..size).map(|i| {
            let (api, label) = (west_services.clone(), label.clone());
            async move {
                api.create(
                    &PostParams::default(),
                    &service(&format!("{label}-{i}"), &label),
                )
                .await
                .unwrap()
            }
        }))
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
        // The floor runs in a cluster of its own, started as east was: a
        // Service create costs the API server time in proportion to the
        // Services already there (its ClusterIP allocator counts every
        // allocated address on each allocation, for a metric), so the floor
        // and the sync must start from the same count, not one after the other
        // in one cluster.
        let floor_cluster = Cluster::start_with(measured("floor")).await.unwrap();
        let before = Work::now(&floor_cluster).await;
        let profiling = profile_api_server(&floor_cluster, &format!("floor-{size}"));
        let floor_secs = floor(&floor_cluster.client(), "floor", size).await;
        if let Some(p) = profiling {
            let _ = p.await;
        }
        let (floor_work, floor_line) = Work::now(&floor_cluster).await.since(&before);
        println!("  the floor's API server ({floor_secs:.1} s): {floor_line}");
        drop(floor_cluster);
        let east_before = Work::now(&env.east).await;
        let rss_before = rss_kib(env.controller.pid().unwrap());
        // Where the time goes: CPU of the controller and of each cluster's
        // control plane (etcd, API server, controller manager) during the sync.
        let cpu = |pids: &[u32]| pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>();
        let cpu_before = (
            cpu(&[env.controller.pid().unwrap()]),
            cpu(&env.east.pids()),
            cpu(&env.west.pids()),
        );
        let start = Instant::now();
        let profiling = profile_api_server(&env.east, &format!("sync-{size}"));
        link(&env, &label).await;
        let mut peak = rss_before;
        // Poll the Link's status (one small GET), not a list of thousands of
        // mirrors: listing every 200 ms would load the API server more than the
        // controller under test does.
        let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
        loop {
            peak = peak.max(rss_kib(env.controller.pid().unwrap()));
            let reported = links
                .get_opt(&label)
                .await
                .ok()
                .flatten()
                .and_then(|l| l.status)
                .map_or(0, |s| s.mirrored_services as usize);
            if reported >= size {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(600),
                "sync of {size} did not finish in 10 minutes"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let took = start.elapsed();
        let cpu_spent = (
            cpu(&[env.controller.pid().unwrap()]) - cpu_before.0,
            cpu(&env.east.pids()) - cpu_before.1,
            cpu(&env.west.pids()) - cpu_before.2,
        );
        let (sync_work, sync_line) = Work::now(&env.east).await.since(&east_before);
        let listed = count_mirrors(&ec, &label).await;
        assert!(
            listed >= size,
            "status says {size} mirrored, the API lists {listed}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        peak = peak.max(rss_kib(env.controller.pid().unwrap()));
        println!(
            "initial sync of {size} exported services: {:.1} s = {:.2}x the API server's floor ({floor_secs:.1} s for the same \
             {size} Services + EndpointSlices from a plain client, 16 at a time), controller RSS peak {} MiB (before {} MiB); \
             CPU during it: controller {:.1} s, east control plane {:.1} s, west control plane {:.1} s",
            took.as_secs_f64(),
            took.as_secs_f64() / floor_secs,
            peak / 1024,
            rss_before / 1024,
            cpu_spent.0,
            cpu_spent.1,
            cpu_spent.2,
        );
        println!("  east during the sync: {sync_line}");
        if let Some(p) = profiling {
            let _ = p.await;
        }
        let ratio = took.as_secs_f64() / floor_secs;
        println!(
            "  sync / floor at {size}: {ratio:.2} (goal ≤ 1.20: {})",
            if ratio <= 1.2 { "met" } else { "NOT met" }
        );
        results["syncs"].as_array_mut().unwrap().push(json!({
            "services": size, "sync_secs": took.as_secs_f64(), "floor_secs": floor_secs,
            "ratio": ratio, "rss_peak_kib": peak, "rss_before_kib": rss_before,
            "cpu_seconds": {"controller": cpu_spent.0, "east": cpu_spent.1, "west": cpu_spent.2},
            "floor_cluster": floor_work, "east_during_sync": sync_work,
        }));
    }

    // 3. Idle writes.
    let idle: u64 = env_or("STRAIT_BENCH_IDLE_SECS", "60").parse().unwrap();
    let versions = || async {
        let mut v: BTreeMap<String, String> = BTreeMap::new();
        for s in east_services
            .list_metadata(&ListParams::default())
            .await
            .unwrap()
            .items
        {
            v.insert(
                format!("svc/{}", s.name_any()),
                s.resource_version().unwrap_or_default(),
            );
        }
        for s in east_slices
            .list_metadata(&ListParams::default())
            .await
            .unwrap()
            .items
        {
            v.insert(
                format!("slice/{}", s.name_any()),
                s.resource_version().unwrap_or_default(),
            );
        }
        for l in Api::<Link>::namespaced(ec.clone(), "strait-multicluster")
            .list_metadata(&ListParams::default())
            .await
            .unwrap()
            .items
        {
            v.insert(
                format!("link/{}", l.name_any()),
                l.resource_version().unwrap_or_default(),
            );
        }
        v
    };
    let before = versions().await;
    tokio::time::sleep(Duration::from_secs(idle)).await;
    let after = versions().await;
    let writes = before
        .iter()
        .filter(|(k, v)| after.get(*k) != Some(*v))
        .count();
    println!(
        "API writes during {idle} s idle ({} objects watched): {writes}",
        before.len()
    );
    results["idle"] = json!({"secs": idle, "objects": before.len(), "writes": writes});

    // 4. West's API server restarted: every watch of it relists.
    let before = versions().await;
    env.west.stop_apiserver();
    tokio::time::sleep(Duration::from_secs(5)).await;
    env.west.start_apiserver().await.unwrap();
    tokio::time::sleep(Duration::from_secs(idle)).await;
    let after = versions().await;
    let rewritten: Vec<&String> = before
        .iter()
        .filter(|(k, v)| !k.starts_with("link/") && after.get(*k) != Some(*v))
        .map(|(k, _)| k)
        .collect();
    println!(
        "west's API server restarted: {} of {} mirror objects rewritten in the {idle} s after ({:?})",
        rewritten.len(),
        before.len(),
        rewritten.iter().take(5).collect::<Vec<_>>()
    );
    results["relist"] = json!({"objects": before.len(), "rewritten": rewritten.len()});
    if let Ok(file) = std::env::var("STRAIT_BENCH_JSON") {
        std::fs::write(&file, serde_json::to_string_pretty(&results).unwrap()).unwrap();
        println!("raw results: {file}");
    }
    let _ = &env.dir;
}
