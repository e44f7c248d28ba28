//! `strait dashboard` in a real browser (root): two real-node clusters with
//! Strait installed, east linked to west, west's `shop/web` exported, east's
//! client calling its mirror. Debian's headless Chromium, driven over
//! WebDriver (chromedriver), reads what the page shows: both clusters, the
//! link alive, the exported Service with its rate and success rate from
//! east; west's gateway killed turns the link red within the probe's failure
//! window, and green again when it is back. The same page fed by a real
//! Prometheus (`--prometheus`) shows the same calls. Screenshots of each
//! view are saved under `$CARGO_TARGET_TMPDIR/dashboard/`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use strait_testenv::installed::{InstalledMesh, get_from_client};
use strait_testenv::net::root_or_skip;
use strait_testenv::wait::eventually;
use strait_testenv::{http_get, kubectl};

const MIRROR_URL: &str = "http://web-west.shop.svc.cluster.local";
/// The page's refresh and the dashboard's (both 2 s by default).
const REFRESH: Duration = Duration::from_secs(2);

/// A child process killed when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `strait dashboard` on a free port of 127.0.0.1, once its state is up.
async fn dashboard(strait: &Path, kubeconfig: &Path, extra: &[&str]) -> (Process, String) {
    let port = strait_testenv::cluster::free_port([127, 0, 0, 1].into()).unwrap();
    let child = Command::new(strait)
        .args(["dashboard", "--kubeconfig"])
        .arg(kubeconfig)
        .args(["--port", &port.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .spawn()
        .expect("strait dashboard");
    let process = Process(child);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    eventually(
        "the dashboard serves its state",
        Duration::from_secs(60),
        || async {
            let state = state_of(addr).await?;
            state["cluster"]
                .is_string()
                .then_some(())
                .ok_or(state.to_string())
        },
    )
    .await;
    (process, format!("http://127.0.0.1:{port}"))
}

/// The dashboard's state, as JSON.
async fn state_of(addr: std::net::SocketAddr) -> Result<serde_json::Value, String> {
    let answer = http_get(addr, "/api/state").await?;
    let (head, body) = answer.split_once("\r\n\r\n").ok_or(answer.clone())?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(answer);
    }
    serde_json::from_str(body).map_err(|e| format!("{e}: {body}"))
}

/// Debian's chromedriver and a headless Chromium session through it.
async fn browser() -> (Process, Client) {
    let port = strait_testenv::cluster::free_port([127, 0, 0, 1].into()).unwrap();
    let driver = Process(
        Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (Debian's chromium-driver; scripts/lib.sh installs it)"),
    );
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1440,1900", "--hide-scrollbars"],
        }),
    );
    let client = eventually(
        "chromedriver starts a Chromium session",
        Duration::from_secs(60),
        || {
            let caps = caps.clone();
            async move {
                // Plain HTTP to the local chromedriver: no TLS stack of its own.
                ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                    .capabilities(caps)
                    .connect(&format!("http://127.0.0.1:{port}"))
                    .await
                    .map_err(|e| e.to_string())
            }
        },
    )
    .await;
    (driver, client)
}

/// The text of every element matching `css`.
async fn texts(page: &Client, css: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for e in page
        .find_all(Locator::Css(css))
        .await
        .map_err(|e| e.to_string())?
    {
        out.push(e.text().await.map_err(|e| e.to_string())?);
    }
    Ok(out)
}

/// Saves a screenshot of the page (`name.png`) under the test's folder.
async fn screenshot(page: &Client, name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{name}.png"));
    std::fs::write(&file, page.screenshot().await.expect("screenshot")).unwrap();
    eprintln!("SCREENSHOT {}", file.display());
    file
}

/// East's client calling the mirror until stopped; the failures.
fn traffic(east: &Path) -> (Arc<AtomicBool>, std::thread::JoinHandle<Vec<String>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let handle = {
        let (stop, east) = (stop.clone(), east.to_path_buf());
        std::thread::spawn(move || {
            let mut failed = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let out = get_from_client(&east, &format!("{MIRROR_URL}/dashboard"), None);
                if !out.status.success() {
                    failed.push(String::from_utf8_lossy(&out.stderr).into_owned());
                }
            }
            failed
        })
    };
    (stop, handle)
}

/// The row of the mirror's calls from east, as the page shows it: its
/// cells' text.
async fn mirror_row(page: &Client) -> Result<Vec<String>, String> {
    let row = page
        .find(Locator::Css(
            "tr[data-service='shop/web-west'][data-from='east']",
        ))
        .await
        .map_err(|e| format!("no row of shop/web-west's calls from east yet: {e}"))?;
    let mut cells = Vec::new();
    for cell in row
        .find_all(Locator::Css("td"))
        .await
        .map_err(|e| e.to_string())?
    {
        cells.push(cell.text().await.map_err(|e| e.to_string())?);
    }
    Ok(cells)
}

/// The requests per second and success shown in a mirror row.
fn rate_and_success(cells: &[String]) -> Result<(f64, String), String> {
    let rps = cells
        .get(5)
        .and_then(|c| c.strip_suffix(" rps"))
        .and_then(|c| c.parse::<f64>().ok())
        .ok_or_else(|| format!("no rate in {cells:?}"))?;
    Ok((rps, cells.get(6).cloned().unwrap_or_default()))
}

/// The link to west as the page shows it: (data-alive, its text).
async fn link_row(page: &Client) -> Result<(String, String), String> {
    let row = page
        .find(Locator::Css("tr[data-link='west']"))
        .await
        .map_err(|e| format!("no link row for west: {e}"))?;
    let alive = row
        .attr("data-alive")
        .await
        .map_err(|e| e.to_string())?
        .unwrap_or_default();
    Ok((alive, row.text().await.map_err(|e| e.to_string())?))
}

/// Scales west's gateway Deployment to `replicas`.
fn scale_gateway(west: &Path, replicas: &str) {
    kubectl(
        west,
        &[
            "scale",
            "deploy",
            "-n",
            "strait-system",
            "strait-gateway",
            &format!("--replicas={replicas}"),
        ],
        None,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_a_real_browser_shows_the_clusterset() {
    if !root_or_skip("dashboard_in_a_real_browser_shows_the_clusterset") {
        return;
    }
    let strait = Path::new(env!("CARGO_BIN_EXE_strait"));
    let mesh = InstalledMesh::start(strait, strait.parent().unwrap(), 1)
        .await
        .expect("Strait installed in two real-node clusters");
    let east = mesh.east.cluster().kubeconfig_path();
    let west = mesh.west.cluster().kubeconfig_path();
    mesh.serve_web_to_east(1).unwrap();
    let (stop, calls) = traffic(&east);

    let (_dashboard, url) = dashboard(strait, &east, &[]).await;
    let (_driver, page) = browser().await;
    page.goto(&url).await.expect("the page loads");

    // Both clusters, the link alive, the mirror's calls from east.
    let shown = eventually(
        "the page shows both clusters, the link alive and east's calls to web",
        Duration::from_secs(90),
        || async {
            let clusters = texts(&page, "tr[data-cluster] td:first-child").await?;
            if clusters != ["east", "west"] {
                return Err(format!("clusters shown: {clusters:?}"));
            }
            let (alive, text) = link_row(&page).await?;
            if alive != "yes" || !text.contains("alive") {
                return Err(format!("link: {alive} {text}"));
            }
            let cells = mirror_row(&page).await?;
            let (rps, success) = rate_and_success(&cells)?;
            if rps <= 0.0 || success != "100.00%" || !cells[4].contains("east → west") {
                return Err(format!("the mirror's row: {cells:?}"));
            }
            let edges = texts(&page, "svg text[data-edge='east->west']").await?;
            if edges.is_empty() {
                return Err("the topology shows no east → west calls".into());
            }
            Ok((text, cells, edges))
        },
    )
    .await;
    eprintln!(
        "MEASURED dashboard: link {:?}; mirror row {:?}; topology {:?}",
        shown.0, shown.1, shown.2
    );
    let services = texts(&page, "tr[data-service]").await.unwrap();
    assert!(
        services
            .iter()
            .any(|r| r.contains("mirrored") && r.contains("shop/web-west") && r.contains("1/1")),
        "the mirror with its one ready endpoint: {services:?}"
    );
    let gateways = texts(&page, "tr[data-component='strait-gateway']")
        .await
        .unwrap();
    assert!(
        !gateways.is_empty() && gateways.iter().all(|g| g.contains("ready")),
        "east's gateways: {gateways:?}"
    );
    screenshot(&page, "overview").await;
    for (id, name) in [
        ("topology", "topology"),
        ("links", "links"),
        ("services", "services"),
    ] {
        let section = page.find(Locator::Id(id)).await.unwrap();
        let file = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join("dashboard")
            .join(format!("{name}.png"));
        std::fs::write(&file, section.screenshot().await.unwrap()).unwrap();
        eprintln!("SCREENSHOT {}", file.display());
    }

    // The same calls through a real Prometheus scraping both clusters.
    let (prometheus, _discovered) = strait_testenv::prometheus::scraping(
        include_str!("../../deploy/observability/prometheus.yml"),
        &[("east", &east), ("west", &west)],
    )
    .await
    .expect("prometheus");
    let (_from_prometheus, prom_url) =
        dashboard(strait, &east, &["--prometheus", &prometheus.url()]).await;
    page.goto(&prom_url).await.unwrap();
    let cells = eventually(
        "the page fed by Prometheus shows east's calls to web",
        Duration::from_secs(60),
        || async {
            let meta = texts(&page, "#meta").await?.concat();
            if !meta.contains(&prometheus.url()) {
                return Err(format!("metrics source: {meta}"));
            }
            let cells = mirror_row(&page).await?;
            let (rps, success) = rate_and_success(&cells)?;
            (rps > 0.0 && success == "100.00%")
                .then_some(cells.clone())
                .ok_or(format!("{cells:?}"))
        },
    )
    .await;
    eprintln!("MEASURED dashboard --prometheus: mirror row {cells:?}");
    screenshot(&page, "prometheus").await;
    drop(prometheus);

    stop.store(true, Ordering::Relaxed);
    let failed = calls.join().unwrap();
    assert!(failed.is_empty(), "calls failed: {failed:?}");

    // West's gateway killed (scaled to zero and its processes SIGKILLed):
    // the link turns red within the probe's failure window, as the page shows it.
    page.goto(&url).await.unwrap();
    let replicas = kubectl(
        &west,
        &[
            "get",
            "deploy",
            "-n",
            "strait-system",
            "strait-gateway",
            "-o",
            "jsonpath={.spec.replicas}",
        ],
        None,
    );
    let pods = kubectl(
        &west,
        &[
            "get",
            "pods",
            "-n",
            "strait-system",
            "-l",
            "app.kubernetes.io/name=strait-gateway",
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ],
        None,
    );
    let mut pids = Vec::new();
    for pod in pods.split_whitespace() {
        // Every process of the pod: the first one found may be its sandbox's.
        pids.extend(mesh.west.pod_processes("strait-system", pod).await.unwrap());
    }
    // No replacement (scaled to zero), no restart by the kubelet and no
    // graceful drain (the pods force-deleted first: a container killed
    // before its kubelet saw the deletion was restarted, then drained while
    // still answering probes, 41 s in a CI run), then the processes killed.
    scale_gateway(&west, "0");
    let mut delete = vec![
        "delete",
        "pod",
        "-n",
        "strait-system",
        "--grace-period=0",
        "--force",
        "--wait=false",
    ];
    delete.extend(pods.split_whitespace());
    kubectl(&west, &delete, None);
    let killed = Instant::now();
    for pid in &pids {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    let link: serde_json::Value = serde_json::from_str(&kubectl(
        &east,
        &[
            "get",
            "links.multicluster.strait.dev",
            "-n",
            "strait-multicluster",
            "-o",
            "json",
        ],
        None,
    ))
    .unwrap();
    let probe = &link["items"][0]["spec"]["probe"];
    let secs =
        |v: &serde_json::Value| humantime::parse_duration(v.as_str().unwrap_or("0s")).unwrap();
    let window = secs(&probe["period"]) * probe["failureThreshold"].as_u64().unwrap_or(3) as u32
        + secs(&probe["timeout"]);
    let (down, text) = eventually(
        "the page shows the link down",
        Duration::from_secs(60),
        || async {
            let (alive, text) = link_row(&page).await?;
            (alive == "no" && text.contains("down"))
                .then(|| (killed.elapsed(), text.clone()))
                .ok_or(format!("{alive}: {text}"))
        },
    )
    .await;
    eprintln!(
        "MEASURED gateway killed → the page shows the link down after {down:?} (probe failure window {window:?}): {text}"
    );
    screenshot(&page, "link-down").await;
    let bound = window + 2 * REFRESH + Duration::from_secs(2);
    assert!(
        down <= bound,
        "the link turned red after {down:?}, beyond the probe's failure window {window:?} + the refreshes ({bound:?})"
    );

    scale_gateway(&west, replicas.trim());
    let up = Instant::now();
    eventually(
        "the page shows the link alive again",
        Duration::from_secs(120),
        || async {
            let (alive, text) = link_row(&page).await?;
            (alive == "yes")
                .then_some(())
                .ok_or(format!("{alive}: {text}"))
        },
    )
    .await;
    eprintln!(
        "MEASURED gateway back → the page shows the link alive after {:?}",
        up.elapsed()
    );
    let _ = page.close().await;
}

/// A clusterset of 10 clusters and 1,000 Services as one cluster's
/// dashboard sees it (a real API server: 9 Links, 100 exported Services
/// and 900 mirrored, each with an EndpointSlice of 3 endpoints): what the
/// first load and each refresh cost the API server, counted by the API
/// server itself (its requests with the dashboard running, less the same
/// time without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_at_ten_clusters_and_a_thousand_services() {
    use futures::{StreamExt, TryStreamExt};
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service};
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::Api;
    use kube::api::{Patch, PatchParams, PostParams};
    use strait_mesh::link::Link;
    use strait_testenv::apimetrics::{self, minus, requests};

    let cluster = strait_testenv::Cluster::start("east").await.unwrap();
    let client = cluster.client();
    let kubeconfig = cluster.kubeconfig_path();
    let crd = strait_testenv::stack::deploy_file("mirror/crd.yaml");
    kubectl(&kubeconfig, &["apply", "-f", &crd.to_string_lossy()], None);
    kubectl(
        &kubeconfig,
        &[
            "wait",
            "--for=condition=Established",
            "crd/links.multicluster.strait.dev",
        ],
        None,
    );
    for ns in ["strait-system", "strait-multicluster", "shop"] {
        let namespace: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": ns}})).unwrap();
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .unwrap();
    }
    let anchors: ConfigMap = serde_json::from_value(serde_json::json!({"metadata": {
        "name": "strait-trust-anchors", "labels": {"strait.dev/cluster-name": "east"}}, "data": {"ca.crt": ""}}))
    .unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), "strait-system")
        .create(&PostParams::default(), &anchors)
        .await
        .unwrap();
    let links = Api::<Link>::namespaced(client.clone(), "strait-multicluster");
    for c in 1..=9 {
        let name = format!("c{c}");
        let link: Link = serde_json::from_value(serde_json::json!({
            "apiVersion": "multicluster.strait.dev/v1alpha1", "kind": "Link",
            "metadata": {"name": name},
            "spec": {"targetClusterName": name, "clusterCredentialsSecret": format!("cluster-credentials-{name}"),
                     "gatewayAddresses": [format!("10.9.0.{c}")]}}))
        .unwrap();
        links.create(&PostParams::default(), &link).await.unwrap();
        let status = serde_json::json!({"status": {"mirroredServices": 100, "conditions": [{"type": "GatewayAlive", "status": "True",
            "reason": "Probed", "message": "ok", "lastTransitionTime": "2026-12-06T00:00:00Z"}]}});
        links
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    }
    let services = Api::<Service>::namespaced(client.clone(), "shop");
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), "shop");
    let made = Instant::now();
    futures::stream::iter(0..1000)
        .map(|i| {
            let (services, slices) = (services.clone(), slices.clone());
            async move {
                let (name, labels) = if i < 100 {
                    (format!("svc{i}"), serde_json::json!({"strait.dev/exported": "true"}))
                } else {
                    let c = format!("c{}", i / 100);
                    (format!("svc{i}-{c}"), serde_json::json!({"strait.dev/mirrored-service": "true", "strait.dev/cluster-name": c}))
                };
                let svc: Service = serde_json::from_value(serde_json::json!({"metadata": {"name": name, "labels": labels},
                    "spec": {"ports": [{"name": "http", "port": 80}]}}))
                .unwrap();
                services.create(&PostParams::default(), &svc).await?;
                let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": format!("{name}-1"), "labels": {"kubernetes.io/service-name": name}},
                    "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
                    "endpoints": (1..=3).map(|e| serde_json::json!({"addresses": [format!("10.{}.{}.{e}", i / 250, i % 250)],
                        "conditions": {"ready": e != 3}})).collect::<Vec<_>>()}))
                .unwrap();
                slices.create(&PostParams::default(), &slice).await.map(|_| ())
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await
        .unwrap();
    eprintln!(
        "MEASURED 1,000 Services and EndpointSlices written in {:?}",
        made.elapsed()
    );

    // The same span without and with the dashboard: what it costs.
    let span = Duration::from_secs(20);
    let before = requests(&client).await.unwrap();
    tokio::time::sleep(span).await;
    let baseline = minus(&requests(&client).await.unwrap(), &before);

    let before = requests(&client).await.unwrap();
    let started = Instant::now();
    let strait = Path::new(env!("CARGO_BIN_EXE_strait"));
    let (_dashboard, url) = dashboard(strait, &kubeconfig, &["--check-interval", "1h"]).await;
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let state: serde_json::Value = eventually(
        "the dashboard shows 1,000 Services",
        Duration::from_secs(60),
        || async {
            let state = state_of(addr).await?;
            let n = state["services"].as_array().map_or(0, Vec::len);
            (n == 1000)
                .then_some(state.clone())
                .ok_or(format!("{n} services"))
        },
    )
    .await;
    let first = started.elapsed();
    let startup = minus(&requests(&client).await.unwrap(), &before);
    assert_eq!(
        state["clusters"].as_array().map(Vec::len),
        Some(10),
        "{}",
        state["clusters"]
    );
    let ready: u64 = state["services"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["readyEndpoints"].as_u64().unwrap())
        .sum();
    assert_eq!(ready, 2000, "2 of 3 endpoints ready in each");

    let before = requests(&client).await.unwrap();
    let (mut json_bytes, mut served, mut refresh_ms) = (0, Vec::new(), Vec::new());
    let steady = Instant::now();
    while steady.elapsed() < span {
        let asked = Instant::now();
        let state = state_of(addr).await.unwrap();
        served.push(asked.elapsed());
        json_bytes = state.to_string().len();
        refresh_ms.push(state["metrics"]["refreshMillis"].as_f64().unwrap());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let steady_cost = minus(
        &minus(&requests(&client).await.unwrap(), &before),
        &baseline,
    );
    served.sort();
    refresh_ms.sort_by(f64::total_cmp);
    eprintln!(
        "MEASURED dashboard at 10 clusters × 1,000 Services: first state in {first:?} with API requests {startup:?}; \
         steady {span:?} ({} refreshes, {} page loads) cost API requests beyond the baseline {steady_cost:?} (baseline {baseline:?}); \
         refresh median {} ms, max {} ms; /api/state {json_bytes} bytes served in median {:?}",
        span.as_secs() / 2,
        served.len(),
        refresh_ms[refresh_ms.len() / 2],
        refresh_ms[refresh_ms.len() - 1],
        served[served.len() / 2],
    );
    // A refresh and a page load list nothing: the objects are watched. (The
    // one GET a refresh makes per node proxy is absent here: these nodes
    // have no node proxies.)
    let lists: f64 = apimetrics::verb(&steady_cost, "LIST").values().sum();
    assert_eq!(lists, 0.0, "the steady dashboard listed: {steady_cost:?}");
}
