//! A real Prometheus server for tests: the Debian package's `prometheus`
//! (installed by `scripts/lib.sh`), run on the host with a given
//! configuration, asked over its HTTP API.
//!
//! Debian builds Prometheus without Kubernetes service discovery (its
//! client libraries are not packaged): [`pod_targets`] discovers pods as
//! `kubernetes_sd_configs` with `role: pod` does (one target per container
//! port, with its `__meta_kubernetes_*` labels) from the real API's Pods,
//! for a `file_sd_configs` file; the relabeling under test runs unchanged.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

/// A running Prometheus; stopped when dropped.
pub struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts `prometheus` with `config` (a whole prometheus.yml) and waits
    /// until it is ready.
    pub async fn start(config: &str) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("strait-prometheus-")
            .tempdir()?;
        let file = dir.path().join("prometheus.yml");
        std::fs::write(&file, config)?;
        let addr = SocketAddr::from((
            [127, 0, 0, 1],
            crate::cluster::free_port([127, 0, 0, 1].into())?,
        ));
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context(
                "starting prometheus (the Debian package `prometheus`; scripts/lib.sh installs it)",
            )?;
        let prometheus = Self { child, addr, dir };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            match prometheus.get("/-/ready").await {
                Ok((200, _)) => return Ok(prometheus),
                _ if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => anyhow::bail!(
                    "prometheus not ready within 30 s ({other:?}):\n{}",
                    prometheus.log()
                ),
            }
        }
    }

    /// Its base URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Where its configuration, data and log are.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The result of an instant query: `data.result` (for a vector, one
    /// entry per series).
    pub async fn query(&self, promql: &str) -> anyhow::Result<serde_json::Value> {
        let (status, body) = self
            .get(&format!("/api/v1/query?query={}", percent_encode(promql)))
            .await?;
        let answer: serde_json::Value = serde_json::from_str(&body)
            .with_context(|| format!("query {promql}: HTTP {status}: {body}"))?;
        if answer["status"] != "success" {
            anyhow::bail!("query {promql}: {answer}");
        }
        Ok(answer["data"]["result"].clone())
    }

    /// The scrape targets Prometheus knows (`/api/v1/targets` `activeTargets`).
    pub async fn targets(&self) -> anyhow::Result<Vec<serde_json::Value>> {
        let (_, body) = self.get("/api/v1/targets").await?;
        let answer: serde_json::Value = serde_json::from_str(&body)?;
        Ok(answer["data"]["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    async fn get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        let exchange = async {
            let tcp = tokio::net::TcpStream::connect(self.addr).await?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
            tokio::spawn(connection);
            let request = http::Request::get(path)
                .header(http::header::HOST, self.addr.to_string())
                .body(Empty::<Bytes>::new())?;
            let response = sender.send_request(request).await?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, String::from_utf8_lossy(&body).into_owned()))
        };
        tokio::time::timeout(Duration::from_secs(10), exchange)
            .await
            .with_context(|| format!("GET {path} on prometheus: no answer in 10 s"))?
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The targets Prometheus's Kubernetes discovery (`role: pod`) finds in
/// `pods` (a `kubectl get pods -o json` list), in `file_sd` form: one per
/// declared container port, address `<pod IP>:<port>`, with the meta labels
/// relabeling reads. Pods without an IP yet are skipped, as discovery does.
pub fn pod_targets(pods: &serde_json::Value) -> serde_json::Value {
    let mut targets = Vec::new();
    for pod in pods["items"].as_array().into_iter().flatten() {
        let Some(ip) = pod["status"]["podIP"].as_str() else {
            continue;
        };
        let mut common = serde_json::Map::new();
        let mut set = |k: String, v: &serde_json::Value| {
            common.insert(k, v.as_str().unwrap_or("").into());
        };
        let meta = &pod["metadata"];
        set("__meta_kubernetes_namespace".into(), &meta["namespace"]);
        set("__meta_kubernetes_pod_name".into(), &meta["name"]);
        set("__meta_kubernetes_pod_ip".into(), &pod["status"]["podIP"]);
        set(
            "__meta_kubernetes_pod_node_name".into(),
            &pod["spec"]["nodeName"],
        );
        set(
            "__meta_kubernetes_pod_phase".into(),
            &pod["status"]["phase"],
        );
        for (kind, field) in [("label", "labels"), ("annotation", "annotations")] {
            for (k, v) in meta[field].as_object().into_iter().flatten() {
                set(format!("__meta_kubernetes_pod_{kind}_{}", label_name(k)), v);
                set(
                    format!("__meta_kubernetes_pod_{kind}present_{}", label_name(k)),
                    &"true".into(),
                );
            }
        }
        for container in pod["spec"]["containers"].as_array().into_iter().flatten() {
            for port in container["ports"].as_array().into_iter().flatten() {
                let number = port["containerPort"].as_u64().unwrap_or(0);
                let mut labels = common.clone();
                labels.insert(
                    "__meta_kubernetes_pod_container_name".into(),
                    container["name"].as_str().unwrap_or("").into(),
                );
                labels.insert(
                    "__meta_kubernetes_pod_container_port_name".into(),
                    port["name"].as_str().unwrap_or("").into(),
                );
                labels.insert(
                    "__meta_kubernetes_pod_container_port_number".into(),
                    number.to_string().into(),
                );
                labels.insert(
                    "__meta_kubernetes_pod_container_port_protocol".into(),
                    port["protocol"].as_str().unwrap_or("TCP").into(),
                );
                targets.push(serde_json::json!({
                    "targets": [format!("{ip}:{number}")],
                    "labels": labels,
                }));
            }
        }
    }
    targets.into()
}

/// A Kubernetes label or annotation name as a Prometheus label name (every
/// character outside `[a-zA-Z0-9_]` an underscore).
fn label_name(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus with `shipped` (a prometheus.yml whose first job discovers
/// pods with `kubernetes_sd_configs`, `role: pod`), one job per cluster
/// (`strait-<name>`), scraping every second. Debian's Prometheus has no
/// Kubernetes discovery: each cluster's pods, of the namespaces the shipped
/// discovery names, are discovered as it would ([`pod_targets`]) into a file
/// the job reads instead; the shipped relabeling is used as it is. The
/// directory holds the discovery files.
pub async fn scraping(
    shipped: &str,
    clusters: &[(&str, &Path)],
) -> anyhow::Result<(Prometheus, tempfile::TempDir)> {
    let shipped: serde_yaml::Value = serde_yaml::from_str(shipped)?;
    let job = shipped["scrape_configs"][0].clone();
    let discovery = &job["kubernetes_sd_configs"][0];
    anyhow::ensure!(
        discovery["role"] == "pod",
        "not pod discovery: {discovery:?}"
    );
    let namespaces: Vec<String> = discovery["namespaces"]["names"]
        .as_sequence()
        .context("the shipped discovery names its namespaces")?
        .iter()
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect();
    let dir = tempfile::Builder::new().prefix("strait-sd-").tempdir()?;
    let mut jobs = Vec::new();
    for (cluster, kubeconfig) in clusters {
        let mut items = Vec::new();
        for namespace in &namespaces {
            let listed = crate::kubectl(
                kubeconfig,
                &["get", "pods", "-n", namespace, "-o", "json"],
                None,
            );
            let listed: serde_json::Value = serde_json::from_str(&listed)?;
            items.extend(listed["items"].as_array().cloned().unwrap_or_default());
        }
        let targets = pod_targets(&serde_json::json!({"items": items}));
        let file = dir.path().join(format!("{cluster}.json"));
        std::fs::write(&file, targets.to_string())?;
        let mut job = job.clone();
        job["job_name"] = format!("strait-{cluster}").into();
        let mapping = job.as_mapping_mut().context("a job is a mapping")?;
        mapping.remove("kubernetes_sd_configs");
        mapping.insert(
            "file_sd_configs".into(),
            serde_yaml::to_value(serde_json::json!([{"files": [file.display().to_string()]}]))?,
        );
        jobs.push(job);
    }
    let mut config = shipped;
    config["global"]["scrape_interval"] = "1s".into();
    config["scrape_configs"] = jobs.into();
    let prometheus = Prometheus::start(&serde_yaml::to_string(&config)?).await?;
    Ok((prometheus, dir))
}

#[cfg(test)]
mod tests {
    #[test]
    fn pods_become_one_target_per_container_port() {
        let pods = serde_json::json!({"items": [
            {"metadata": {"namespace": "strait-system", "name": "gw-1",
                          "labels": {"app.kubernetes.io/name": "strait-gateway"},
                          "annotations": {"prometheus.io/scrape": "true"}},
             "spec": {"nodeName": "n1", "containers": [{"name": "gateway", "ports": [
                 {"name": "tunnel", "containerPort": 4143, "protocol": "UDP"},
                 {"name": "admin", "containerPort": 4191}]}]},
             "status": {"podIP": "10.1.0.5", "phase": "Running"}},
            {"metadata": {"namespace": "strait-system", "name": "pending"},
             "spec": {"containers": [{"name": "x", "ports": [{"containerPort": 1}]}]},
             "status": {"phase": "Pending"}}
        ]});
        let targets = super::pod_targets(&pods);
        let targets = targets.as_array().unwrap();
        assert_eq!(targets.len(), 2, "{targets:?}");
        let admin = &targets[1];
        assert_eq!(admin["targets"][0], "10.1.0.5:4191");
        let labels = &admin["labels"];
        assert_eq!(labels["__meta_kubernetes_pod_container_port_name"], "admin");
        assert_eq!(
            labels["__meta_kubernetes_pod_container_port_protocol"],
            "TCP"
        );
        assert_eq!(
            labels["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
            "strait-gateway"
        );
        assert_eq!(
            labels["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
            "true"
        );
        assert_eq!(labels["__meta_kubernetes_pod_node_name"], "n1");
        assert_eq!(
            targets[0]["labels"]["__meta_kubernetes_pod_container_port_protocol"],
            "UDP"
        );
    }

    #[test]
    fn queries_are_percent_encoded() {
        assert_eq!(
            super::percent_encode(r#"sum(rate(a{b="c d"}[1m]))"#),
            "sum%28rate%28a%7Bb%3D%22c%20d%22%7D%5B1m%5D%29%29"
        );
    }
}
