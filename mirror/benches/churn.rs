//! Churn and scale of the mirror controller, in the shape of Istio's scale
//! test, on real API servers with `strait-mirror` as its own process:
//!
//!     cargo bench -p strait-mirror --bench churn [-- --json FILE]
//!
//! West holds STRAIT_CHURN_SERVICES (500) exported Services with one
//! EndpointSlice of 20 endpoints each (10,000 remote "pods": slices written
//! directly, no nodes) and as many unexported Services with slices (noise the
//! controller must not cache). East links west. Then for STRAIT_CHURN_SECS
//! (600) seconds: one scale event per second, alternately one that changes
//! what east sees (every endpoint of a Service turns ready / not ready) and
//! one that does not (a Service's ready endpoints go 20 ↔ 15), and one relabel
//! of an exported Service per minute; then a burst of 1,000 export-label
//! flips (the 500 unexported Services exported, then unexported again).
//!
//! Reports: controller restarts (process exits, restarted like a kubelet
//! would), its RSS (VmRSS sampled every second, VmHWM), east's API writes
//! (requests from `apiserver_request_total`, and object changes seen by a
//! watch) per remote change, and the delay from a remote change to east's
//! mirror showing it (p50/p99, seen by a watch). STRAIT_CHURN_MIRROR_BIN runs
//! another `strait-mirror` build instead (A/B); STRAIT_CHURN_NOISE sets how
//! many unexported Services there are (default: as many as exported).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, CustomResourceExt, ResourceExt};
use serde_json::json;
use strait_mesh::link::Link;
use strait_testenv::apimetrics::{self, Requests};
use strait_testenv::process::{ChildProcess, rss_kib};
use strait_testenv::workloads::ensure_namespace;
use strait_testenv::{Cluster, kubeconfig};

const NS: &str = "bench";
const SELECTOR: (&str, &str) = ("bench", "churn");
const ENDPOINTS: usize = 20;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The controller under test, restarted when it exits (each exit counted).
struct Controller {
    process: ChildProcess,
    kubeconfig: std::path::PathBuf,
    log: std::path::PathBuf,
    restarts: u64,
    peak_rss_kib: u64,
}

impl Controller {
    fn spawn(kubeconfig: &std::path::Path, log: &std::path::Path) -> ChildProcess {
        // STRAIT_CHURN_MIRROR_BIN: another build to compare (e.g. one from before a change).
        let program = std::env::var_os("STRAIT_CHURN_MIRROR_BIN")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_strait-mirror").into());
        ChildProcess::spawn_with_env(
            "strait-mirror",
            &program,
            &[
                "--admin-addr=127.0.0.1:0".to_string(),
                "--no-gateway-probe".to_string(),
            ],
            &[
                ("KUBECONFIG", kubeconfig.as_os_str()),
                ("RUST_LOG", std::ffi::OsStr::new("warn")),
            ],
            log,
        )
        .expect("start strait-mirror")
    }

    /// Samples RSS; restarts the process if it exited.
    fn check(&mut self) {
        if let Some(status) = self.process.try_exit_status() {
            eprintln!("strait-mirror exited ({status}); restarting it");
            self.restarts += 1;
            self.process = Self::spawn(&self.kubeconfig, &self.log);
        }
        if let Some(pid) = self.process.pid() {
            self.peak_rss_kib = self.peak_rss_kib.max(rss_kib(pid));
        }
    }

    fn rss_kib(&self) -> u64 {
        self.process.pid().map_or(0, rss_kib)
    }

    /// The high-water mark of the current process's RSS (VmHWM).
    fn hwm_kib(&self) -> u64 {
        let Some(pid) = self.process.pid() else {
            return 0;
        };
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmHWM:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0)
    }
}

/// What east's mirrors should come to show, by mirror name, and since when.
#[derive(Default)]
struct Expectations {
    ready: HashMap<String, (Instant, bool)>,
    label: HashMap<String, (Instant, String)>,
    scale_delays: Vec<Duration>,
    relabel_delays: Vec<Duration>,
}

/// East as a watch sees it: mirror Services present, mirror slices' readiness,
/// and how many objects changed.
#[derive(Default)]
struct East {
    services: Mutex<HashSet<String>>,
    slices_ready: Mutex<HashMap<String, bool>>,
    expect: Mutex<Expectations>,
    service_changes: AtomicU64,
    slice_changes: AtomicU64,
    /// Each mirror slice's readiness as written, in order (rewrites show here).
    slice_history: Mutex<HashMap<String, Vec<bool>>>,
}

fn all_ready(slice: &EndpointSlice) -> Option<bool> {
    let ready: Vec<bool> = slice
        .endpoints
        .iter()
        .flatten()
        .map(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false))
        .collect();
    if ready.is_empty() {
        None
    } else {
        Some(ready.iter().all(|r| *r))
    }
}

fn watch_east(client: &Client, east: Arc<East>) {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let e = east.clone();
    tokio::spawn(async move {
        let mut events = watcher::watcher(slices, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = events.next().await {
            let now = Instant::now();
            let (slice, counted) = match event {
                Ok(Event::Apply(s)) => (s, true),
                Ok(Event::InitApply(s)) => (s, false),
                Ok(Event::Delete(s)) => {
                    e.slice_changes.fetch_add(1, Ordering::Relaxed);
                    e.slices_ready.lock().unwrap().remove(&s.name_any());
                    continue;
                }
                _ => continue,
            };
            if counted {
                e.slice_changes.fetch_add(1, Ordering::Relaxed);
            }
            let name = slice.name_any();
            let Some(ready) = all_ready(&slice) else {
                continue;
            };
            if counted {
                e.slice_history
                    .lock()
                    .unwrap()
                    .entry(name.clone())
                    .or_default()
                    .push(ready);
            }
            e.slices_ready.lock().unwrap().insert(name.clone(), ready);
            let mut expect = e.expect.lock().unwrap();
            if let Some((since, want)) = expect.ready.get(&name).cloned()
                && want == ready
            {
                expect.ready.remove(&name);
                expect.scale_delays.push(now - since);
            }
        }
    });
    tokio::spawn(async move {
        let mut events = watcher::watcher(services, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = events.next().await {
            let now = Instant::now();
            let (svc, counted) = match event {
                Ok(Event::Apply(s)) => (s, true),
                Ok(Event::InitApply(s)) => (s, false),
                Ok(Event::Delete(s)) => {
                    east.service_changes.fetch_add(1, Ordering::Relaxed);
                    east.services.lock().unwrap().remove(&s.name_any());
                    continue;
                }
                _ => continue,
            };
            if counted {
                east.service_changes.fetch_add(1, Ordering::Relaxed);
            }
            let name = svc.name_any();
            east.services.lock().unwrap().insert(name.clone());
            let mut expect = east.expect.lock().unwrap();
            if let Some((since, want)) = expect.label.get(&name).cloned()
                && svc.labels().get("churn-gen") == Some(&want)
            {
                expect.label.remove(&name);
                expect.relabel_delays.push(now - since);
            }
        }
    });
}

/// East's write requests so far, by "resource[/subresource] VERB", from the
/// API server's own counter.
async fn writes(client: &Client) -> Requests {
    apimetrics::writes(&apimetrics::requests(client).await.expect("east /metrics"))
}

/// Writes to mirrors (Services and EndpointSlices) among `writes`.
fn mirror_writes(writes: &Requests) -> u64 {
    writes
        .iter()
        .filter(|(k, _)| k.starts_with("services ") || k.starts_with("endpointslices "))
        .map(|(_, v)| v)
        .sum::<f64>() as u64
}

fn service(name: &str, exported: bool) -> serde_json::Value {
    let mut labels = json!({"app": name});
    if exported {
        labels[SELECTOR.0] = json!(SELECTOR.1);
    }
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "labels": labels},
           "spec": {"ports": [{"name": "http", "port": 80}]}})
}

/// Service `name`'s one slice: `count` endpoints, all `ready` or not.
fn slice(name: &str, index: usize, count: usize, ready: bool) -> serde_json::Value {
    let endpoints: Vec<_> = (0..count)
        .map(|k| {
            json!({"addresses": [format!("10.{}.{}.{}", 100 + index / 250, index % 250, k + 1)],
                   "conditions": {"ready": ready, "serving": ready, "terminating": false}})
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": format!("{name}-x"),
                        "labels": {"kubernetes.io/service-name": name,
                                   "endpointslice.kubernetes.io/managed-by": "bench.strait.dev"}},
           "addressType": "IPv4",
           "endpoints": endpoints,
           "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})
}

async fn apply<K>(api: &Api<K>, name: &str, body: serde_json::Value)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &PatchParams::apply("bench").force(),
        &Patch::Apply(body),
    )
    .await
    .unwrap_or_else(|e| panic!("apply {name} in west: {e}"));
}

async fn link(east: &Cluster, west: &Cluster) {
    let ec = east.client();
    ensure_namespace(&ec, "strait-multicluster").await.unwrap();
    let kc = kubeconfig::to_yaml(west.kubeconfig()).unwrap();
    let secret: Secret = serde_json::from_value(
        json!({"metadata": {"name": "creds-west"}, "stringData": {"kubeconfig": kc}}),
    )
    .unwrap();
    Api::<Secret>::namespaced(ec.clone(), "strait-multicluster")
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let link: Link = serde_json::from_value(json!({
        "apiVersion": "multicluster.strait.dev/v1alpha1", "kind": "Link", "metadata": {"name": "west"},
        "spec": {"targetClusterName": "west", "clusterCredentialsSecret": "creds-west", "gatewayAddresses": ["10.77.0.1"],
                 "selector": {"matchLabels": {SELECTOR.0: SELECTOR.1}}},
    }))
    .unwrap();
    Api::<Link>::namespaced(ec, "strait-multicluster")
        .create(&PostParams::default(), &link)
        .await
        .unwrap();
}

/// Waits (up to `limit`) for `done`, sampling the controller every second.
async fn until(
    what: &str,
    limit: Duration,
    controller: &Mutex<Controller>,
    done: impl Fn() -> bool,
) -> Duration {
    let start = Instant::now();
    let mut last_check = start;
    while !done() {
        assert!(start.elapsed() < limit, "{what}: not done in {limit:?}");
        if last_check.elapsed() >= Duration::from_secs(1) {
            controller.lock().unwrap().check();
            last_check = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).saturating_sub(1);
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let json_out = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1).cloned());
    let n: usize = env_or("STRAIT_CHURN_SERVICES", 500);
    let secs: u64 = env_or("STRAIT_CHURN_SECS", 600);
    // Unexported Services (noise); the burst flips the first n of them.
    let noise: usize = env_or("STRAIT_CHURN_NOISE", n);
    assert!(
        noise >= n,
        "STRAIT_CHURN_NOISE ({noise}) must be at least STRAIT_CHURN_SERVICES ({n}): the burst flips n of them"
    );

    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    let (ec, wc) = (east.client(), west.client());
    Api::<CustomResourceDefinition>::all(ec.clone())
        .patch(
            "links.multicluster.strait.dev",
            &PatchParams::apply("bench").force(),
            &Patch::Apply(Link::crd()),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure_namespace(&ec, NS).await.unwrap();
    ensure_namespace(&wc, NS).await.unwrap();

    // West: n exported Services and `noise` unexported ones, each with its slice.
    let west_services: Api<Service> = Api::namespaced(wc.clone(), NS);
    let west_slices: Api<EndpointSlice> = Api::namespaced(wc.clone(), NS);
    let started = Instant::now();
    futures::stream::iter((0..n + noise).map(|i| {
        let (services, slices) = (west_services.clone(), west_slices.clone());
        async move {
            let (name, exported) = if i < n {
                (format!("svc-{i}"), true)
            } else {
                (format!("noise-{}", i - n), false)
            };
            apply(&services, &name, service(&name, exported)).await;
            apply(
                &slices,
                &format!("{name}-x"),
                slice(&name, i, ENDPOINTS, true),
            )
            .await;
        }
    }))
    .buffer_unordered(16)
    .collect::<Vec<_>>()
    .await;
    eprintln!(
        "west: {n} exported and {noise} unexported Services with {ENDPOINTS} endpoints each, in {:.0} s",
        started.elapsed().as_secs_f64()
    );

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mirror.log");
    let controller = Mutex::new(Controller {
        process: Controller::spawn(&east.kubeconfig_path(), &log),
        kubeconfig: east.kubeconfig_path().to_path_buf(),
        log: log.clone(),
        restarts: 0,
        peak_rss_kib: 0,
    });
    let seen = Arc::new(East::default());
    watch_east(&ec, seen.clone());
    link(&east, &west).await;
    let mirror = |name: &str| format!("{name}-west");
    let synced = until(
        "initial sync",
        Duration::from_secs(600),
        &controller,
        || {
            let ready = seen.slices_ready.lock().unwrap();
            (0..n).all(|i| ready.get(&mirror(&format!("svc-{i}"))) == Some(&true))
        },
    )
    .await;
    let rss_synced = controller.lock().unwrap().rss_kib();
    eprintln!(
        "initial sync of {n} mirrors: {:.1} s, controller RSS {} MiB",
        synced.as_secs_f64(),
        rss_synced / 1024
    );
    tokio::time::sleep(Duration::from_secs(3)).await;

    // Churn.
    let before = writes(&ec).await;
    let (svc0, slc0) = (
        seen.service_changes.load(Ordering::Relaxed),
        seen.slice_changes.load(Ordering::Relaxed),
    );
    let half = n / 2;
    let mut ready_now = vec![true; n];
    let mut count_now = vec![ENDPOINTS; n];
    let (mut visible, mut invisible, mut relabels) = (0u64, 0u64, 0u64);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let churn_started = Instant::now();
    for t in 0..secs {
        tick.tick().await;
        controller.lock().unwrap().check();
        if t % 2 == 0 {
            // Visible: every endpoint of a Service turns (not) ready.
            let i = (t / 2) as usize % half;
            ready_now[i] = !ready_now[i];
            let name = format!("svc-{i}");
            seen.expect
                .lock()
                .unwrap()
                .ready
                .insert(mirror(&name), (Instant::now(), ready_now[i]));
            apply(
                &west_slices,
                &format!("{name}-x"),
                slice(&name, i, ENDPOINTS, ready_now[i]),
            )
            .await;
            visible += 1;
        } else {
            // Invisible: ready endpoints 20 ↔ 15 (the mirror, one gateway
            // address, stays ready).
            let i = half + (t / 2) as usize % (n - half);
            count_now[i] = if count_now[i] == ENDPOINTS {
                15
            } else {
                ENDPOINTS
            };
            let name = format!("svc-{i}");
            apply(
                &west_slices,
                &format!("{name}-x"),
                slice(&name, i, count_now[i], true),
            )
            .await;
            invisible += 1;
        }
        if t % 60 == 30 {
            let i = (t / 60) as usize % n;
            let name = format!("svc-{i}");
            let generation = format!("g{t}");
            seen.expect
                .lock()
                .unwrap()
                .label
                .insert(mirror(&name), (Instant::now(), generation.clone()));
            let mut body = service(&name, true);
            body["metadata"]["labels"]["churn-gen"] = json!(generation);
            apply(&west_services, &name, body).await;
            relabels += 1;
        }
    }
    // Let the last changes land.
    until(
        "last changes mirrored",
        Duration::from_secs(30),
        &controller,
        || {
            let e = seen.expect.lock().unwrap();
            e.ready.is_empty() && e.label.is_empty()
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let churn_secs = churn_started.elapsed().as_secs_f64();
    let churn_writes = apimetrics::minus(&writes(&ec).await, &before);
    let churn_service_changes = seen.service_changes.load(Ordering::Relaxed) - svc0;
    let churn_slice_changes = seen.slice_changes.load(Ordering::Relaxed) - slc0;
    let rss_after_churn = controller.lock().unwrap().rss_kib();

    // Burst: the n unexported Services exported, then unexported again.
    let before = writes(&ec).await;
    let (svc0, slc0) = (
        seen.service_changes.load(Ordering::Relaxed),
        seen.slice_changes.load(Ordering::Relaxed),
    );
    let flip = |exported: bool| {
        let services = west_services.clone();
        futures::stream::iter((0..n).map(move |i| {
            let services = services.clone();
            async move {
                let name = format!("noise-{i}");
                apply(&services, &name, service(&name, exported)).await;
            }
        }))
        .buffer_unordered(16)
        .collect::<Vec<_>>()
    };
    seen.slice_history.lock().unwrap().clear();
    let burst_started = Instant::now();
    flip(true).await;
    until(
        "burst: all exported mirrored",
        Duration::from_secs(300),
        &controller,
        || {
            let ready = seen.slices_ready.lock().unwrap();
            (0..n).all(|i| ready.get(&mirror(&format!("noise-{i}"))) == Some(&true))
        },
    )
    .await;
    let all_mirrored = burst_started.elapsed();
    let rewritten: Vec<(String, Vec<bool>)> = seen
        .slice_history
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, h)| h.len() > 1)
        .map(|(k, h)| (k.clone(), h.clone()))
        .collect();
    let rss_burst = controller.lock().unwrap().rss_kib();
    let unexport_started = Instant::now();
    flip(false).await;
    until(
        "burst: all unexported removed",
        Duration::from_secs(300),
        &controller,
        || {
            let services = seen.services.lock().unwrap();
            (0..n).all(|i| !services.contains(&mirror(&format!("noise-{i}"))))
        },
    )
    .await;
    let all_removed = unexport_started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let burst_writes = apimetrics::minus(&writes(&ec).await, &before);
    let burst_service_changes = seen.service_changes.load(Ordering::Relaxed) - svc0;
    let burst_slice_changes = seen.slice_changes.load(Ordering::Relaxed) - slc0;

    let mut c = controller.into_inner().unwrap();
    c.check();
    let (restarts, peak, end, hwm) = (c.restarts, c.peak_rss_kib, c.rss_kib(), c.hwm_kib());
    let expect = seen.expect.lock().unwrap();
    let mut scale = expect.scale_delays.clone();
    let mut relabel = expect.relabel_delays.clone();
    scale.sort();
    relabel.sort();
    let churn_mirror = mirror_writes(&churn_writes);
    let remote_changes = visible + invisible + relabels;
    let mib = |k: u64| k as f64 / 1024.0;
    println!(
        "== churn: {n} exported Services × {ENDPOINTS} endpoints (+{noise} unexported), {secs} s, then {} export-label flips",
        2 * n
    );
    println!("controller restarts: {restarts} (goal 0)");
    println!(
        "controller RSS: after initial sync {:.0} MiB, after churn {:.0} MiB, during burst {:.0} MiB, end {:.0} MiB; peak sampled {:.0} MiB, VmHWM {:.0} MiB (goal < 200 MiB at {} remote pods)",
        mib(rss_synced),
        mib(rss_after_churn),
        mib(rss_burst),
        mib(end),
        mib(peak),
        mib(hwm),
        n * ENDPOINTS
    );
    println!(
        "churn: {remote_changes} remote changes in {churn_secs:.0} s ({visible} visible scale events, {invisible} invisible ones, {relabels} relabels)"
    );
    println!(
        "  east write requests to mirrors: {churn_mirror} = {:.2} per visible change (goal 1: proportional, no rewrites); object changes seen: {} slices, {} services",
        churn_mirror as f64 / (visible + relabels).max(1) as f64,
        churn_slice_changes,
        churn_service_changes
    );
    println!("  all east write requests: {churn_writes:?}");
    println!(
        "  remote change → east mirror: scale (readiness) n={} p50 {:.0} ms p99 {:.0} ms max {:.0} ms; relabel n={} p50 {:.0} ms p99 {:.0} ms",
        scale.len(),
        percentile(&scale, 0.5),
        percentile(&scale, 0.99),
        percentile(&scale, 1.0),
        relabel.len(),
        percentile(&relabel, 0.5),
        percentile(&relabel, 0.99),
    );
    let burst_mirror = mirror_writes(&burst_writes);
    println!(
        "burst: {n} exported → all mirrored ready in {:.1} s; unexported → all removed in {:.1} s; east write requests to mirrors {burst_mirror} = {:.2} per flip; object changes seen: {burst_slice_changes} slices, {burst_service_changes} services",
        all_mirrored.as_secs_f64(),
        all_removed.as_secs_f64(),
        burst_mirror as f64 / (2 * n) as f64,
    );
    println!(
        "  new mirror slices written more than once while exporting: {}{}",
        rewritten.len(),
        rewritten
            .first()
            .map(|(k, h)| format!(" (e.g. {k}: ready {h:?})"))
            .unwrap_or_default()
    );
    println!("  all east write requests: {burst_writes:?}");
    if let Some(path) = json_out {
        let report = json!({
            "services": n, "endpoints_per_service": ENDPOINTS, "unexported_services": noise, "churn_secs": secs,
            "restarts": restarts,
            "rss_mib": {"after_sync": mib(rss_synced), "after_churn": mib(rss_after_churn), "burst": mib(rss_burst),
                        "end": mib(end), "peak_sampled": mib(peak), "hwm": mib(hwm)},
            "churn": {"visible": visible, "invisible": invisible, "relabels": relabels,
                      "mirror_write_requests": churn_mirror, "write_requests": churn_writes,
                      "slice_changes": churn_slice_changes, "service_changes": churn_service_changes,
                      "scale_delay_ms": {"n": scale.len(), "p50": percentile(&scale, 0.5), "p99": percentile(&scale, 0.99), "max": percentile(&scale, 1.0)},
                      "relabel_delay_ms": {"n": relabel.len(), "p50": percentile(&relabel, 0.5), "p99": percentile(&relabel, 0.99)}},
            "burst": {"flips": 2 * n, "mirrored_s": all_mirrored.as_secs_f64(), "removed_s": all_removed.as_secs_f64(),
                      "mirror_write_requests": burst_mirror, "write_requests": burst_writes,
                      "slices_rewritten_on_export": rewritten.len(),
                      "slice_changes": burst_slice_changes, "service_changes": burst_service_changes},
        });
        std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap())
            .expect("write --json file");
    }
    let _ = (&dir, &log);
}
