//! Failover of one clusterset service served by two clusters, on installed
//! Strait (root): `bash scripts/bench-failover.sh`.
//!
//! Two real-node clusters, Strait installed in each, east linked to west;
//! `shop/web` (2 pods) in both, exported to the clusterset from both (east's
//! export first, so its affinity rules). From east's `client` pod,
//! `strait-load` sends GETs to `web.shop.svc.clusterset.local` through its
//! node proxy, open-loop at `STRAIT_BENCH_RATE` (default 1000/s), one run per
//! phase; a change happens `CHANGE_AT` into each phase:
//!
//! 1. `steady`: both clusters serve; affinity `local` keeps every call in east.
//! 2. `local-pods-killed`: east's pods force-deleted (and scaled to 0): calls
//!    move to west's gateway.
//! 3. `local-pods-back`: scaled back to 2: calls return to east.
//! 4. `remote-gateway-killed`: affinity `none` (both clusters serve), then
//!    west's gateway pod force-deleted (its Deployment starts another).
//! 5. `gateway-replica-deleted`: west's gateway scaled to 2 replicas,
//!    affinity `remote` (every call crosses it), then one gateway pod deleted
//!    (an ordinary delete: it drains); visible when west's gateway Service
//!    has one ready endpoint (east's mirror endpoints are west's node
//!    addresses, which do not change: kube-proxy in west moves the flow).
//!
//! Per phase: requests, failed requests (goal 0), p50/p99, when the change
//! became visible in east's API (the clusterset slice's ready count), and
//! when the traffic had moved (the last call the east node proxy sent to the
//! side it left, from its `request_total`, polled every 50 ms).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use strait_testenv::installed::{
    InstalledMesh, apply, client_manifests, kubectl_until, proxy_service_ip, until_web_answers,
    wait_ready, web_manifests,
};
use strait_testenv::stack::metric_sum;
use strait_testenv::{http_get, kubectl};

const URL: &str = "http://web.shop.svc.clusterset.local/";
/// How far into a phase its change happens (the load's warm-up is 1 s).
const CHANGE_AT: Duration = Duration::from_secs(4);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Which way the east node proxy sends the clusterset calls.
#[derive(Clone, Copy, Debug)]
enum Side {
    /// To east's own pods (`dst_workload="web"`).
    Local,
    /// To west's gateway (`dst_workload="strait-gateway"`).
    Remote,
}

impl Side {
    /// The label of calls to this side on east's node proxy.
    fn cluster(self) -> &'static str {
        match self {
            Side::Local => "dst_cluster=\"east\"",
            Side::Remote => "dst_cluster=\"west\"",
        }
    }
}

/// Whether a phase's change is visible in the API yet.
type Visible = Box<dyn Fn() -> bool + Send>;

/// Visible in east's API when `cluster`'s clusterset slice has a ready count
/// for which `done` holds.
fn slice_shows(east: &Path, cluster: &'static str, done: fn(usize) -> bool) -> Visible {
    let east = east.to_path_buf();
    Box::new(move || slice_ready(&east, cluster).is_some_and(done))
}

/// The ready endpoints of west's gateway Service (its pods).
fn gateway_ready(west: &Path) -> Option<usize> {
    let out = kubectl(
        west,
        &[
            "get",
            "endpointslices",
            "-n",
            "strait-system",
            "-l",
            "kubernetes.io/service-name=strait-gateway",
            "-o",
            "json",
        ],
        None,
    );
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    Some(
        v["items"]
            .as_array()?
            .iter()
            .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
            .filter(|e| e["conditions"]["ready"] != false)
            .count(),
    )
}

struct Phase {
    name: &'static str,
    /// What the change does (run `CHANGE_AT` into the phase).
    change: Box<dyn Fn() + Send>,
    /// When east's API shows the change.
    visible: Option<Visible>,
    /// The side traffic leaves, if it moves.
    leaves: Option<Side>,
}

struct Outcome {
    load: serde_json::Value,
    visible_after: Option<Duration>,
    /// The last call to the side left, after the change.
    last_left: Option<Duration>,
    /// Calls to each side over the phase (from the node proxy).
    local: f64,
    remote: f64,
}

/// The ready endpoints of the clusterset slice for `cluster` in east.
fn slice_ready(east: &Path, cluster: &str) -> Option<usize> {
    let out = kubectl(
        east,
        &[
            "get",
            "endpointslices",
            "-n",
            "shop",
            "-l",
            &format!(
                "multicluster.kubernetes.io/service-name=web,multicluster.kubernetes.io/source-cluster={cluster}"
            ),
            "-o",
            "json",
        ],
        None,
    );
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    let items = v["items"].as_array()?;
    let slice = items.first()?;
    if cluster != "east" {
        // A linked cluster's slice says how many are ready behind its gateway.
        let n = slice["metadata"]["annotations"]["multicluster.strait.dev/ready-endpoints"]
            .as_str()?
            .parse()
            .ok()?;
        let gateway_ready = slice["endpoints"]
            .as_array()?
            .iter()
            .any(|e| e["conditions"]["ready"] != false);
        return Some(if gateway_ready { n } else { 0 });
    }
    Some(
        slice["endpoints"]
            .as_array()
            .map(|eps| {
                eps.iter()
                    .filter(|e| e["conditions"]["ready"] != false)
                    .count()
            })
            .unwrap_or(0),
    )
}

fn run_phase(
    east: &Path,
    proxy: IpAddr,
    metrics: SocketAddr,
    rate: u64,
    secs: u64,
    phase: &Phase,
) -> Outcome {
    let load = {
        let east = east.to_path_buf();
        let args = vec![
            "exec".to_string(),
            "-n".into(),
            "shop".into(),
            "deploy/client".into(),
            "--".into(),
            "/usr/local/bin/strait-load".into(),
            "--connect".into(),
            format!("{proxy}:4140"),
            "--uri".into(),
            URL.into(),
            "--host".into(),
            "web.shop.svc.clusterset.local".into(),
            "--rate".into(),
            rate.to_string(),
            "--connections".into(),
            "50".into(),
            "--body".into(),
            "0".into(),
            "--warmup".into(),
            "1s".into(),
            "--duration".into(),
            format!("{secs}s"),
        ];
        std::thread::spawn(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            strait_testenv::kubectl_output(&east, &args, None)
        })
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let scrape = |side: Side| {
        let text = rt
            .block_on(http_get(metrics, "/metrics"))
            .unwrap_or_default();
        metric_sum(
            &text,
            "request_total",
            &["direction=\"outbound\"", side.cluster()],
        )
    };
    let started = Instant::now();
    let (local0, remote0) = (scrape(Side::Local), scrape(Side::Remote));
    let mut changed_at = None;
    let mut visible_after = None;
    let mut last_left = None;
    let mut left_count = phase.leaves.map(scrape);
    while !load.is_finished() {
        std::thread::sleep(Duration::from_millis(50));
        if changed_at.is_none() && started.elapsed() >= CHANGE_AT {
            (phase.change)();
            changed_at = Some(Instant::now());
        }
        let Some(at) = changed_at else { continue };
        if let (None, Some(v)) = (visible_after, &phase.visible)
            && v()
        {
            visible_after = Some(at.elapsed());
        }
        if let Some(side) = phase.leaves {
            let now = scrape(side);
            if Some(now) != left_count {
                last_left = Some(at.elapsed());
                left_count = Some(now);
            }
        }
    }
    let out = load.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let load: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "strait-load in phase {}: {e}: {text}{}",
            phase.name,
            String::from_utf8_lossy(&out.stderr)
        )
    });
    Outcome {
        load,
        visible_after,
        last_left,
        local: scrape(Side::Local) - local0,
        remote: scrape(Side::Remote) - remote0,
    }
}

/// Sets east's export's `strait.dev/affinity` (which side serves).
fn set_affinity(east: &Path, affinity: &str) {
    kubectl(
        east,
        &[
            "annotate",
            "--overwrite",
            "serviceexport",
            "-n",
            "shop",
            "web",
            &format!("strait.dev/affinity={affinity}"),
        ],
        None,
    );
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{} ms", d.as_millis()))
}

fn main() {
    if !strait_testenv::net::is_root() {
        eprintln!(
            "bench failover: needs root (real nodes); run `sudo bash scripts/bench-failover.sh`"
        );
        std::process::exit(1);
    }
    strait_mesh::telemetry::init_tracing(strait_mesh::telemetry::LogFormat::Plain, "info");
    let rate = env_u64("STRAIT_BENCH_RATE", 1000);
    let secs = env_u64("STRAIT_BENCH_SECS", 15);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let strait = Path::new(env!("CARGO_BIN_EXE_strait"));
    let mesh = rt
        .block_on(InstalledMesh::start(strait, strait.parent().unwrap(), 1))
        .expect("Strait installed in two real-node clusters, east linked to west");
    let east: PathBuf = mesh.east.cluster().kubeconfig_path();
    let west: PathBuf = mesh.west.cluster().kubeconfig_path();
    for kc in [&east, &west] {
        apply(kc, &web_manifests(2)).unwrap();
    }
    apply(&east, &client_manifests()).unwrap();
    for kc in [&east, &west] {
        wait_ready(kc, "shop", "deployment/web").unwrap();
    }
    wait_ready(&east, "shop", "deployment/client").unwrap();
    // East's export first (creation times have one-second resolution): the
    // oldest export's shape and affinity rule.
    for kc in [&east, &west] {
        mesh.export_clusterset(kc, "shop", "web").unwrap();
        std::thread::sleep(Duration::from_millis(1100));
    }
    kubectl_until(
        &east,
        &[
            "get",
            "serviceimport",
            "-n",
            "shop",
            "web",
            "-o",
            "jsonpath={.status.clusters[*].cluster}",
        ],
        Duration::from_secs(60),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while slice_ready(&east, "west").unwrap_or(0) < 2 || slice_ready(&east, "east").unwrap_or(0) < 2
    {
        assert!(
            Instant::now() < deadline,
            "east's clusterset slices never showed both clusters' pods"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    until_web_answers(&east, URL, Duration::from_secs(60)).unwrap();
    let get = |kc: &Path, args: &[&str]| kubectl(kc, args, None).trim().to_string();
    let proxy = proxy_service_ip(&east).unwrap();
    let proxy_pod: IpAddr = get(
        &east,
        &[
            "get",
            "pods",
            "-n",
            "strait-system",
            "-l",
            "app.kubernetes.io/name=strait-proxy",
            "-o",
            "jsonpath={.items[0].status.podIP}",
        ],
    )
    .parse()
    .expect("east's node proxy pod address");
    let metrics = SocketAddr::new(proxy_pod, 4191);

    let (e1, e2, w, w2) = (east.clone(), east.clone(), west.clone(), west.clone());
    let phases = vec![
        Phase {
            name: "steady",
            change: Box::new(|| {}),
            visible: None,
            leaves: None,
        },
        Phase {
            name: "local-pods-killed",
            change: Box::new(move || {
                kubectl(
                    &e1,
                    &["scale", "-n", "shop", "deployment/web", "--replicas=0"],
                    None,
                );
                kubectl(
                    &e1,
                    &[
                        "delete",
                        "pods",
                        "-n",
                        "shop",
                        "-l",
                        "app=web",
                        "--grace-period=0",
                        "--force",
                        "--wait=false",
                    ],
                    None,
                );
            }),
            visible: Some(slice_shows(&east, "east", |n| n == 0)),
            leaves: Some(Side::Local),
        },
        Phase {
            name: "local-pods-back",
            change: Box::new(move || {
                kubectl(
                    &e2,
                    &["scale", "-n", "shop", "deployment/web", "--replicas=2"],
                    None,
                );
            }),
            visible: Some(slice_shows(&east, "east", |n| n >= 1)),
            leaves: Some(Side::Remote),
        },
        Phase {
            name: "remote-gateway-killed",
            change: Box::new(move || {
                kubectl(
                    &w,
                    &[
                        "delete",
                        "pods",
                        "-n",
                        "strait-system",
                        "-l",
                        "app.kubernetes.io/name=strait-gateway",
                        "--grace-period=0",
                        "--force",
                        "--wait=false",
                    ],
                    None,
                );
            }),
            visible: Some(slice_shows(&east, "west", |n| n == 0)),
            leaves: None,
        },
        Phase {
            name: "gateway-replica-deleted",
            change: Box::new(move || {
                let pod = kubectl(
                    &w2,
                    &[
                        "get",
                        "pods",
                        "-n",
                        "strait-system",
                        "-l",
                        "app.kubernetes.io/name=strait-gateway",
                        "-o",
                        "jsonpath={.items[0].metadata.name}",
                    ],
                    None,
                );
                // An ordinary delete: SIGTERM, the gateway drains.
                kubectl(
                    &w2,
                    &[
                        "delete",
                        "pod",
                        "-n",
                        "strait-system",
                        pod.trim(),
                        "--wait=false",
                    ],
                    None,
                );
            }),
            visible: Some({
                let west = west.clone();
                Box::new(move || gateway_ready(&west) == Some(1))
            }),
            leaves: None,
        },
    ];
    let mut lines = Vec::new();
    for phase in &phases {
        if phase.name == "remote-gateway-killed" {
            // Both clusters serve from here on.
            set_affinity(&east, "none");
            std::thread::sleep(Duration::from_secs(3));
        }
        if phase.name == "gateway-replica-deleted" {
            // Every call crosses west's gateway, which runs two replicas.
            kubectl(
                &west,
                &[
                    "scale",
                    "-n",
                    "strait-system",
                    "deployment/strait-gateway",
                    "--replicas=2",
                ],
                None,
            );
            wait_ready(&west, "strait-system", "deployment/strait-gateway").unwrap();
            let deadline = Instant::now() + Duration::from_secs(60);
            while gateway_ready(&west) != Some(2) {
                assert!(
                    Instant::now() < deadline,
                    "west's gateway never had 2 ready pods"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            set_affinity(&east, "remote");
            std::thread::sleep(Duration::from_secs(3));
        }
        let o = run_phase(&east, proxy, metrics, rate, secs, phase);
        let line = format!(
            "MEASURED failover {}: {} requests, {} failed {}, p50 {} ms, p99 {} ms, max {} ms; change visible in the API after {}, last call to the side left {} after the change; calls local {} / remote {}",
            phase.name,
            o.load["requests"],
            o.load["errors"],
            o.load["error_kinds"],
            o.load["p50_ms"],
            o.load["p99_ms"],
            o.load["max_ms"],
            ms(o.visible_after),
            ms(o.last_left),
            o.local,
            o.remote,
        );
        println!("{line}");
        lines.push(line);
    }
    assert!(
        mesh.api_endpoint_running(),
        "the linked API endpoint stopped"
    );
    println!("── failover summary ({rate} rps, {secs} s per phase, change {CHANGE_AT:?} in) ──");
    for l in lines {
        println!("{l}");
    }
}
