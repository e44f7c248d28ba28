//! Cross-cluster on installed Strait (root): two real-node clusters, Strait
//! installed in each with `strait install`, east linked to west with `strait
//! link`, west's `shop/web` exported with `strait export`. From an east pod:
//! a call to the mirror `web-west` crosses east's node proxy, QUIC to west's
//! gateway (a NodePort across the WAN), west's node proxy, and reaches a west
//! pod with the caller's identity; CONNECT reaches its TCP echo the same way;
//! h2c from a transparent-mode pod arrives as HTTP/2; `strait stat` on each
//! side shows the calls by cluster under live traffic, and a real Prometheus
//! with deploy/observability/'s scrape configuration answers every query of
//! its Grafana dashboard; UDP blocked → TCP
//! fallback → back to QUIC;
//! the WAN cut fails requests in bounded time and restoring it heals them;
//! the gateway pod deleted is replaced by its Deployment and calls resume;
//! the trust anchor rotated in both clusters with `strait identity rotate`,
//! under traffic, without one failed call.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use strait_testenv::installed::{
    InstalledMesh, app_manifests, apply, get_from_app, get_from_client, proxy_service_ip,
    wait_ready,
};
use strait_testenv::net::root_or_skip;
use strait_testenv::prometheus::Prometheus;
use strait_testenv::stack::metric_sum;
use strait_testenv::wait::eventually;
use strait_testenv::{http_get, kubectl};

const CALLER: &str = "spiffe://east.clusterset.local/ns/shop/sa/client";
const MIRROR_URL: &str = "http://web-west.shop.svc.cluster.local";

/// One GET of `url` from east's client pod through its node proxy; the body,
/// or the error, and how long it took.
fn get(kubeconfig: &Path, url: &str) -> (Result<String, String>, Duration) {
    let started = Instant::now();
    let out = get_from_client(kubeconfig, url, None);
    let took = started.elapsed();
    let body = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() && body.contains("\"pod\":\"web-") {
        (Ok(body), took)
    } else {
        (
            Err(format!("{body}{}", String::from_utf8_lossy(&out.stderr))),
            took,
        )
    }
}

/// A real Prometheus with the shipped scrape configuration scraping both
/// clusters every second (see [`strait_testenv::prometheus::scraping`]).
async fn prometheus_scraping(east: &Path, west: &Path) -> (Prometheus, tempfile::TempDir) {
    strait_testenv::prometheus::scraping(
        include_str!("../../deploy/observability/prometheus.yml"),
        &[("east", east), ("west", west)],
    )
    .await
    .expect("prometheus with deploy/observability/prometheus.yml")
}

/// Every Strait component of both clusters is a healthy target, and every
/// query of every panel of the shipped Grafana dashboard returns data; the
/// request rate shows east's calls to west's `web`.
async fn dashboard_queries_return_data(prometheus: &Prometheus) {
    eventually(
        "Prometheus scrapes every Strait component of both clusters",
        Duration::from_secs(60),
        || async {
            let targets = prometheus.targets().await.map_err(|e| e.to_string())?;
            let mut seen = std::collections::BTreeSet::new();
            for t in &targets {
                if t["health"] != "up" {
                    return Err(format!("a target is not up: {t}"));
                }
                seen.insert(format!(
                    "{} {}",
                    t["labels"]["job"].as_str().unwrap_or(""),
                    t["labels"]["component"].as_str().unwrap_or("")
                ));
            }
            let want: std::collections::BTreeSet<String> = ["east", "west"]
                .iter()
                .flat_map(|c| {
                    [
                        "strait-proxy",
                        "strait-gateway",
                        "strait-mirror",
                        "strait-identity",
                    ]
                    .map(move |n| format!("strait-{c} {n}"))
                })
                .collect();
            if seen == want {
                Ok(())
            } else {
                Err(format!("targets {seen:?}, want {want:?}"))
            }
        },
    )
    .await;
    let dashboard: serde_json::Value = serde_json::from_str(include_str!(
        "../../deploy/observability/grafana-dashboard.json"
    ))
    .unwrap();
    let panels = dashboard["panels"].as_array().expect("panels");
    for panel in panels {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            let title = panel["title"].as_str().unwrap_or("");
            eventually(
                &format!("data for the panel {title:?}"),
                Duration::from_secs(60),
                || async {
                    let result = prometheus.query(expr).await.map_err(|e| e.to_string())?;
                    match result.as_array() {
                        Some(series) if !series.is_empty() => Ok(()),
                        _ => Err(format!("{expr}: {result}")),
                    }
                },
            )
            .await;
        }
    }
    let rate = prometheus
        .query(panels[0]["targets"][0]["expr"].as_str().unwrap())
        .await
        .unwrap();
    let web = rate.as_array().and_then(|series| {
        series.iter().find(|s| {
            s["metric"]["src_cluster"] == "east"
                && s["metric"]["dst_cluster"] == "west"
                && s["metric"]["dst_service"] == "web"
        })
    });
    let value = web
        .and_then(|s| s["value"][1].as_str())
        .and_then(|v| v.parse::<f64>().ok());
    assert!(
        value.is_some_and(|v| v > 0.0),
        "east → west web request rate: {rate}"
    );
    eprintln!(
        "MEASURED Prometheus: {} panels answered; east → west web {:?} rps",
        panels.len(),
        value
    );
}

/// `strait stat` in both clusters while east's client calls `web-west`:
/// east's node proxies count the calls to west's `web` (the remote Service
/// and cluster, not the gateway), west's count the same calls coming in from
/// east, each with a rate, a success rate and latencies.
fn stat_shows_the_cross_cluster_calls(mesh: &InstalledMesh, east: &Path, west: &Path) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let traffic = {
        let (stop, east) = (stop.clone(), east.to_path_buf());
        std::thread::spawn(move || {
            let (mut ok, mut failed) = (0, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                match get(&east, &format!("{MIRROR_URL}/stat")).0 {
                    Ok(_) => ok += 1,
                    Err(e) => failed.push(e),
                }
            }
            (ok, failed)
        })
    };
    let stat = |kubeconfig: &Path, extra: &[&str]| -> serde_json::Value {
        let kubeconfig = kubeconfig.display().to_string();
        let mut args = vec![
            "stat",
            "--kubeconfig",
            &kubeconfig,
            "--window",
            "5s",
            "-o",
            "json",
        ];
        args.extend(extra);
        let out = mesh.strait(&args).expect("strait stat");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("strait stat -o json: {e}: {out}"))
    };
    let from_east = stat(east, &[]);
    let into_west = stat(west, &["--from", "east"]);
    stop.store(true, Ordering::Relaxed);
    let (ok, failed) = traffic.join().unwrap();
    assert!(
        failed.is_empty(),
        "calls failed during the windows: {failed:?}"
    );
    eprintln!("MEASURED strait stat: east {from_east}; west --from east {into_west} ({ok} calls)");
    for (rows, side) in [
        (&from_east, "east's outbound"),
        (&into_west, "west's inbound"),
    ] {
        let row = rows
            .as_array()
            .and_then(|rows| {
                rows.iter().find(|r| {
                    r["namespace"] == "shop" && r["service"] == "web" && r["cluster"] == "west"
                })
            })
            .unwrap_or_else(|| panic!("{side}: no row for shop/web in west: {rows}"));
        assert!(row["requests"].as_u64().unwrap_or(0) >= 1, "{side}: {row}");
        assert!(
            row["requestsPerSecond"].as_f64().unwrap_or(0.0) > 0.0,
            "{side}: {row}"
        );
        assert_eq!(row["successRate"], 1.0, "{side}: {row}");
        assert!(
            row["latencyP99Ms"].as_f64().is_some_and(|ms| ms > 0.0),
            "{side}: {row}"
        );
    }
    assert_eq!(into_west[0]["from"], "east", "{into_west}");
}

/// The gateway pod's address and metrics (admin port 4191, reachable from the host).
async fn gateway_metrics(kubeconfig: &Path) -> String {
    let ip = kubectl(
        kubeconfig,
        &[
            "get",
            "pods",
            "-n",
            "strait-system",
            "-l",
            "app.kubernetes.io/name=strait-gateway",
            "--field-selector",
            "status.phase=Running",
            "-o",
            "jsonpath={.items[0].status.podIP}",
        ],
        None,
    );
    let Ok(ip) = ip.trim().parse::<IpAddr>() else {
        return String::new();
    };
    http_get(SocketAddr::new(ip, 4191), "/metrics")
        .await
        .unwrap_or_default()
}

/// GETs until one is answered by a west pod and `done` holds of the
/// gateway's metrics; the time it took.
async fn until_answered(
    what: &str,
    east: &Path,
    west: &Path,
    limit: Duration,
    done: impl Fn(&str) -> bool,
) -> Duration {
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed() < limit {
        match get(east, &format!("{MIRROR_URL}/{what}")).0 {
            Ok(_) if done(&gateway_metrics(west).await) => return started.elapsed(),
            Ok(_) => last = "answered; the gateway's metrics do not show it yet".into(),
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    panic!("{what}: not within {limit:?}; last: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn east_calls_west_through_installed_strait() {
    if !root_or_skip("east_calls_west_through_installed_strait") {
        return;
    }
    let strait = Path::new(env!("CARGO_BIN_EXE_strait"));
    let started = Instant::now();
    let mesh = InstalledMesh::start(strait, strait.parent().unwrap(), 2)
        .await
        .expect("Strait installed in two real-node clusters");
    eprintln!(
        "MEASURED two real-node clusters, Strait installed and linked: {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let east = mesh.east.cluster().kubeconfig_path();
    let west = mesh.west.cluster().kubeconfig_path();

    // West's web exported; the mirror the controller (a pod in east) writes
    // from west's API, which it watches across the WAN.
    mesh.serve_web_to_east(2).unwrap();

    // 1. HTTP/1 through the gateway over QUIC, with the caller's identity.
    let took = until_answered("first", &east, &west, Duration::from_secs(60), |m| {
        metric_sum(m, "gateway_streams_total", &["transport=\"quic\""]) >= 1.0
    })
    .await;
    eprintln!("MEASURED export → first answer through the gateway: {took:?}");
    let (body, _) = get(&east, &format!("{MIRROR_URL}/hello"));
    let body = body.expect("answered");
    assert!(
        body.contains(CALLER),
        "the west pod saw the caller's identity: {body}"
    );

    // Opaque TCP: CONNECT through the node proxy to the mirror's echo port,
    // from the client pod's own network namespace (bash's /dev/tcp; the
    // image has no shell, the pod's address is what counts).
    let client_pod = kubectl(
        &east,
        &[
            "get",
            "pods",
            "-n",
            "shop",
            "-l",
            "app=client",
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ],
        None,
    );
    let pid = mesh
        .east
        .pod_process("shop", client_pod.trim())
        .await
        .unwrap();
    let proxy = proxy_service_ip(&east).unwrap();
    let script = format!(
        "exec 3<>/dev/tcp/{proxy}/4140; printf 'CONNECT web-west.shop.svc.cluster.local:9000 HTTP/1.1\\r\\nHost: web-west.shop.svc.cluster.local:9000\\r\\n\\r\\nWHOAMI\\n' >&3; timeout 3 cat <&3"
    );
    let streams_before = metric_sum(&gateway_metrics(&west).await, "gateway_streams_total", &[]);
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net=/proc/{pid}/ns/net"))
        .args(["--", "bash", "-c", &script])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(" 200") && said.contains("web-"),
        "CONNECT to west's echo through the gateway, answered by a west pod: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        metric_sum(&gateway_metrics(&west).await, "gateway_streams_total", &[]) > streams_before,
        "the CONNECT tunnel crossed the gateway"
    );

    // h2c (HTTP/2 with prior knowledge, as gRPC speaks it) from a
    // transparent-mode pod (no proxy settings; Strait installed with
    // --transparent): detected as HTTP/2 by its node proxy, carried over the
    // gateway as HTTP/2, answered by a west pod that sees the caller.
    apply(&east, &app_manifests()).unwrap();
    wait_ready(&east, "shop", "pod/app").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let h2 = loop {
        let out = get_from_app(&east, &format!("{MIRROR_URL}/h2"), true);
        let body = String::from_utf8_lossy(&out.stdout).into_owned();
        match serde_json::from_str::<serde_json::Value>(body.trim()) {
            Ok(v) if out.status.success() => break v,
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(500)),
            other => panic!(
                "h2c from the transparent pod to the mirror: {other:?} {body}{}",
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    };
    assert_eq!(h2["version"], "HTTP/2.0", "HTTP/2 end to end: {h2}");
    assert!(
        h2["pod"].as_str().is_some_and(|p| p.starts_with("web-")),
        "{h2}"
    );
    assert_eq!(h2["headers"]["strait-client-id"], CALLER, "{h2}");

    let (prometheus, _discovered) = prometheus_scraping(&east, &west).await;
    stat_shows_the_cross_cluster_calls(&mesh, &east, &west);
    dashboard_queries_return_data(&prometheus).await;
    drop(prometheus);

    // 2. UDP blocked: the proxies fall back to TCP + TLS; unblocked: back to QUIC.
    mesh.wan.block_udp().unwrap();
    let blocked = until_answered("blocked", &east, &west, Duration::from_secs(30), |m| {
        metric_sum(m, "gateway_connections_total", &["transport=\"tcp\""]) >= 1.0
    })
    .await;
    mesh.wan.unblock_udp().unwrap();
    let quic_before = metric_sum(
        &gateway_metrics(&west).await,
        "gateway_streams_total",
        &["transport=\"quic\""],
    );
    let unblocked = until_answered("unblocked", &east, &west, Duration::from_secs(60), |m| {
        metric_sum(m, "gateway_streams_total", &["transport=\"quic\""]) > quic_before
    })
    .await;
    eprintln!(
        "MEASURED block_udp → first TCP answer {blocked:?}; unblock → first QUIC stream {unblocked:?}"
    );

    // 3. The WAN cut: requests fail in bounded time; restored, they heal.
    mesh.wan.cut().unwrap();
    let (cut, cut_took) = get(&east, &format!("{MIRROR_URL}/cut"));
    assert!(cut.is_err(), "answered across a cut WAN: {cut:?}");
    mesh.wan.restore().unwrap();
    let restored =
        until_answered("restored", &east, &west, Duration::from_secs(60), |_| true).await;
    eprintln!(
        "MEASURED cut WAN → request failed after {cut_took:?}; restore → first answer {restored:?}"
    );
    assert!(
        cut_took < Duration::from_secs(15),
        "a request over the cut WAN hung for {cut_took:?}"
    );

    // 4. The gateway pod deleted (it drains, then exits): its Deployment
    // replaces it, and calls resume through the new pod.
    let selector = "app.kubernetes.io/name=strait-gateway";
    let old = kubectl(
        &west,
        &[
            "get",
            "pods",
            "-n",
            "strait-system",
            "-l",
            selector,
            "-o",
            "name",
        ],
        None,
    );
    let deleted = Instant::now();
    kubectl(
        &west,
        &[
            "delete",
            "pod",
            "-n",
            "strait-system",
            "-l",
            selector,
            "--wait=true",
            "--timeout=90s",
        ],
        None,
    );
    let gone = deleted.elapsed();
    let now = kubectl(
        &west,
        &[
            "get",
            "pods",
            "-n",
            "strait-system",
            "-l",
            selector,
            "-o",
            "name",
        ],
        None,
    );
    assert!(
        !now.trim().is_empty() && now.trim() != old.trim(),
        "a new gateway pod replaced {old}: {now}"
    );
    let replaced = until_answered("replaced", &east, &west, Duration::from_secs(120), |m| {
        // The new pod's own counters: it carried the call.
        metric_sum(m, "gateway_streams_total", &[]) >= 1.0
    })
    .await;
    eprintln!(
        "MEASURED gateway pod deleted → old pod gone after {gone:?} (drain) → first answer through its replacement {replaced:?}"
    );

    // 5. A trust-anchor rotation of both clusters with `strait identity
    // rotate`, three steps, each on both clusters before the next, while east
    // keeps calling west: the kubelets update the mounted bundles and Secrets,
    // the components reload them live, and no call fails.
    rotate_under_traffic(&mesh, &east, &west).await;
}

/// The Strait pods' metrics (admin port 4191) in `strait-system` and
/// `strait-multicluster`, by `namespace/pod`.
async fn strait_pods_metrics(kubeconfig: &Path) -> Vec<(String, String)> {
    let listed = kubectl(
        kubeconfig,
        &[
            "get",
            "pods",
            "-A",
            "--field-selector",
            "status.phase=Running",
            "-o",
            "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name} {.status.podIP}{\"\\n\"}{end}",
        ],
        None,
    );
    let mut out = Vec::new();
    for line in listed.lines() {
        let Some((name, ip)) = line.split_once(' ') else {
            continue;
        };
        if !(name.starts_with("strait-system/") || name.starts_with("strait-multicluster/")) {
            continue;
        }
        let Ok(ip) = ip.trim().parse::<IpAddr>() else {
            continue;
        };
        if let Ok(text) = http_get(SocketAddr::new(ip, 4191), "/metrics").await {
            out.push((name.to_string(), text));
        }
    }
    out
}

/// Whether every Strait pod of the cluster that holds certificates trusts
/// exactly `anchors` (SHA-256 fingerprints, active first) and holds only
/// certificates under the active one; what is still missing, if not.
async fn settled(kubeconfig: &Path, anchors: &[String], nodes: usize) -> Result<(), String> {
    let pods = strait_pods_metrics(kubeconfig).await;
    let mut holders = 0;
    for (pod, text) in &pods {
        let info: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("identity_trust_anchor_info{"))
            .collect();
        if info.is_empty() {
            continue;
        }
        holders += 1;
        for (i, fp) in anchors.iter().enumerate() {
            let active = if i == 0 { "true" } else { "false" };
            if !info
                .iter()
                // The metric is labelled with the first 16 hex digits.
                .any(|l| l.contains(&fp[..16]) && l.contains(&format!("active=\"{active}\"")))
            {
                return Err(format!("{pod} does not trust {fp} (active={active}) yet"));
            }
        }
        if info.len() != anchors.len() {
            return Err(format!(
                "{pod} trusts {} anchors, not {}",
                info.len(),
                anchors.len()
            ));
        }
        let chains: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("identity_cert_chains_to_active_anchor{"))
            .collect();
        if chains.is_empty() || chains.iter().any(|l| !l.ends_with(" 1")) {
            return Err(format!(
                "{pod}: certificates not all under the active anchor: {chains:?}"
            ));
        }
    }
    // Every node proxy, the gateway and the mirror controller, at least.
    if holders < nodes + 2 {
        return Err(format!(
            "only {holders} Strait pods answered with identity metrics"
        ));
    }
    Ok(())
}

/// What a failed rotation step needs to be understood: the bundle the API
/// server holds, and the recent log of the pod named first in `problem`.
fn rotation_diagnostics(kubeconfig: &Path, problem: &str) -> String {
    let stored = kubectl(
        kubeconfig,
        &[
            "get",
            "configmap",
            "-n",
            "strait-system",
            "strait-trust-anchors",
            "-o",
            "jsonpath={.data.ca\\.crt}",
        ],
        None,
    );
    let stored: Vec<String> =
        strait_mesh::identity::certs::parse_certs("stored bundle", stored.as_bytes())
            .map(|certs| {
                certs
                    .iter()
                    .map(|c| strait_mesh::identity::trust::fingerprint(c))
                    .collect()
            })
            .unwrap_or_else(|e| vec![e.to_string()]);
    let pod = problem.split_whitespace().next().unwrap_or_default();
    let (ns, name) = pod.split_once('/').unwrap_or(("strait-system", pod));
    let log =
        strait_testenv::kubectl_output(kubeconfig, &["logs", "-n", ns, name, "--tail", "30"], None);
    format!(
        "ConfigMap strait-system/strait-trust-anchors holds {stored:?}\nlog of {pod}:\n{}{}",
        String::from_utf8_lossy(&log.stdout),
        String::from_utf8_lossy(&log.stderr)
    )
}

async fn rotate_under_traffic(mesh: &InstalledMesh, east: &Path, west: &Path) {
    use strait_mesh::identity::{certs, trust::fingerprint};
    let dir = mesh.identity_dir();
    let s = |p: &Path| p.display().to_string();
    mesh.strait(&[
        "identity",
        "trust-anchor",
        "--out-dir",
        &s(&dir.join("new-anchor")),
    ])
    .unwrap();
    for cluster in ["east", "west"] {
        mesh.strait(&[
            "identity",
            "issuer",
            "--anchor-cert",
            &s(&dir.join("new-anchor/ca.crt")),
            "--anchor-key",
            &s(&dir.join("new-anchor/ca.key")),
            "--cluster",
            cluster,
            "--out-dir",
            &s(&dir.join(format!("new-{cluster}"))),
        ])
        .unwrap();
    }
    let old = std::fs::read_to_string(dir.join("anchor/ca.crt")).unwrap();
    let new = std::fs::read_to_string(dir.join("new-anchor/ca.crt")).unwrap();
    let fp = |pem: &str| fingerprint(&certs::parse_certs("anchor", pem.as_bytes()).unwrap()[0]);
    let (old_fp, new_fp) = (fp(&old), fp(&new));

    // Calls from east to west for as long as the rotation runs.
    let calls = std::sync::Arc::new(std::sync::Mutex::new((0usize, Vec::<String>::new())));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (calls, stop, east) = (calls.clone(), stop.clone(), east.to_path_buf());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let (result, _) = get(&east, &format!("{MIRROR_URL}/rotation"));
                let mut c = calls.lock().unwrap();
                c.0 += 1;
                if let Err(e) = result {
                    c.1.push(e);
                }
                drop(c);
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };

    let steps: [(&str, Vec<&str>, Vec<String>, bool); 3] = [
        (
            "old+new",
            vec![&old, &new],
            vec![old_fp.clone(), new_fp.clone()],
            false,
        ),
        (
            "new+old, re-issued",
            vec![&new, &old],
            vec![new_fp.clone(), old_fp.clone()],
            true,
        ),
        ("new", vec![&new], vec![new_fp.clone()], false),
    ];
    for (name, pems, fps, reissue) in steps {
        let bundle = dir.join(format!("bundle-{}.pem", fps.len()));
        std::fs::write(&bundle, pems.concat()).unwrap();
        let started = Instant::now();
        for (cluster, kubeconfig) in [("east", east), ("west", west)] {
            let issuer = dir.join(format!("new-{cluster}"));
            let mut args = vec![
                "identity".to_string(),
                "rotate".into(),
                "--kubeconfig".into(),
                s(kubeconfig),
                "--trust-anchors".into(),
                s(&bundle),
            ];
            if reissue {
                args.extend(["--issuer-dir".into(), s(&issuer)]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            mesh.strait(&args)
                .unwrap_or_else(|e| panic!("rotate {cluster} ({name}): {e:#}"));
        }
        let mut last = String::new();
        for (cluster, kubeconfig) in [("east", east), ("west", west)] {
            loop {
                match settled(kubeconfig, &fps, 2).await {
                    Ok(()) => break,
                    Err(e) if started.elapsed() < Duration::from_secs(300) => last = e,
                    Err(e) => panic!(
                        "rotation step {name}: {cluster} not settled in 300 s: {e} (before: {last})\n{}",
                        rotation_diagnostics(kubeconfig, &e)
                    ),
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
        eprintln!(
            "MEASURED rotation step {name}: both clusters settled {:?} after `strait identity rotate`",
            started.elapsed()
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    traffic.join().unwrap();
    let (made, failed) = calls.lock().unwrap().clone();
    eprintln!(
        "MEASURED calls east → west during the rotation: {made}, failed: {}",
        failed.len()
    );
    assert!(
        made >= 10,
        "traffic kept running during the rotation: {made} calls"
    );
    assert!(
        failed.is_empty(),
        "calls failed during the rotation: {failed:?}"
    );
    // And after it, under the new anchor only.
    get(east, &format!("{MIRROR_URL}/rotated"))
        .0
        .expect("answered after the rotation");
}
