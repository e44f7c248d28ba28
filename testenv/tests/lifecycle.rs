//! testenv leaves nothing behind: not when a test panics, not when the process
//! running the clusters is killed outright, not after `strait-testenv down`.
//! Also checks the people-facing `up` with the stock kubectl, and the backend.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use strait_testenv::Cluster;
use strait_testenv::process::is_alive;

/// Pids of the direct children of `parent`, read from /proc.
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Field 4 is the ppid; the command name (field 2) may hold spaces, so split after ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let ppid = rest
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) {
            out.push(pid);
        }
    }
    out
}

fn wait_until_dead(pids: &[u32], timeout: Duration) -> Vec<u32> {
    let deadline = Instant::now() + timeout;
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|p| is_alive(*p)).collect();
        if alive.is_empty() || Instant::now() >= deadline {
            return alive;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_panicking_test_leaves_no_process_and_keeps_the_logs() {
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let cluster = runtime
            .block_on(Cluster::start("panicky"))
            .expect("start cluster");
        tx.send((cluster.pids(), cluster.dir().to_path_buf()))
            .unwrap();
        panic!("deliberate failure while the cluster runs");
    })
    .join();
    assert!(result.is_err(), "the thread was meant to panic");
    let (pids, dir) = rx.recv().expect("the cluster started");
    assert_eq!(
        pids.len(),
        3,
        "etcd, kube-apiserver, kube-controller-manager: {pids:?}"
    );
    let alive = wait_until_dead(&pids, Duration::from_secs(5));
    assert!(alive.is_empty(), "processes survived the panic: {alive:?}");
    // The failed test's logs are kept for a person to read.
    assert!(
        dir.join("logs").join("kube-apiserver.log").exists(),
        "logs not kept in {}",
        dir.display()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn testenv_bin() -> &'static str {
    env!("CARGO_BIN_EXE_strait-testenv")
}

/// Starts `strait-testenv up` for `clusters` and waits until it printed that it is up.
fn start_up(state_dir: &Path, clusters: &str) -> (Child, PathBuf) {
    let mut child = Command::new(testenv_bin())
        .args(["up", "--clusters", clusters, "--state-dir"])
        .arg(state_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn strait-testenv up");
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while !seen.contains("Stop with Ctrl-C") {
        let n = stdout.read(&mut buf).expect("read up's output");
        assert!(n > 0, "strait-testenv up ended early; it printed:\n{seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(
        seen.contains("kubectl --kubeconfig"),
        "up must say how to use kubectl:\n{seen}"
    );
    // Keep draining stdout so `up` never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    (child, state_dir.join("kubeconfig"))
}

#[test]
fn killing_the_process_that_runs_the_clusters_kills_every_component() {
    let state = tempfile::tempdir().unwrap();
    let (mut up, _) = start_up(state.path(), "orphan-check");
    let components = children_of(up.id());
    assert_eq!(
        components.len(),
        3,
        "etcd, kube-apiserver, kube-controller-manager: {components:?}"
    );
    up.kill().expect("SIGKILL up"); // no unwinding, no Drop: only the kernel can help
    up.wait().unwrap();
    let alive = wait_until_dead(&components, Duration::from_secs(5));
    assert!(
        alive.is_empty(),
        "components outlived a SIGKILLed parent: {alive:?}"
    );
}

#[test]
fn up_works_with_the_stock_kubectl_and_down_stops_everything() {
    let state = tempfile::tempdir().unwrap();
    let (mut up, kubeconfig) = start_up(state.path(), "east,west");
    let components = children_of(up.id());
    assert_eq!(
        components.len(),
        6,
        "three components per cluster: {components:?}"
    );

    for context in ["east", "west"] {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--context", context, "get", "ns", "-o", "name"])
            .output()
            .expect("run kubectl (the stock kubectl is on every machine of this kind; install it if missing)");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "kubectl --context {context} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("namespace/kube-system"),
            "{context}: {stdout}"
        );
    }
    // The contexts really are different clusters.
    let create = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--context", "east", "create", "namespace", "east-only"])
        .output()
        .unwrap();
    assert!(
        create.status.success(),
        "{}",
        String::from_utf8_lossy(&create.stderr)
    );
    let west = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--context", "west", "get", "namespace", "east-only"])
        .output()
        .unwrap();
    assert!(
        !west.status.success(),
        "east's namespace is visible in west"
    );

    // A second `up` on the same state dir refuses instead of clobbering.
    let second = Command::new(testenv_bin())
        .args(["up", "--state-dir"])
        .arg(state.path())
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("already up"),
        "{second:?}"
    );

    let down = Command::new(testenv_bin())
        .args(["down", "--state-dir"])
        .arg(state.path())
        .output()
        .unwrap();
    assert!(
        down.status.success(),
        "down failed: {}",
        String::from_utf8_lossy(&down.stderr)
    );
    let status = up.wait().unwrap();
    assert!(
        status.success(),
        "up should exit cleanly after down: {status}"
    );
    let alive = wait_until_dead(&components, Duration::from_secs(5));
    assert!(alive.is_empty(), "components left after down: {alive:?}");
    assert!(!kubeconfig.exists(), "down removes the admin kubeconfig");
}

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn wait_for_listener(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "backend never listened on {addr}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct KillOnDrop(Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn backend_answers_http1_h2c_and_tcp_echo_with_its_pod_name() {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::TokioIo;

    let (http, echo) = (free_addr(), free_addr());
    let _backend = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_strait-backend"))
            .args([
                "--name",
                "web-0",
                "--http",
                &http.to_string(),
                "--echo",
                &echo.to_string(),
            ])
            .spawn()
            .unwrap(),
    );
    wait_for_listener(http);
    wait_for_listener(echo);

    // HTTP/1.1
    let stream = tokio::net::TcpStream::connect(http).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get("/hello")
        .header("host", "web")
        .body(Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.headers()["x-strait-pod"], "web-0");
    let body: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(
        (
            body["pod"].as_str(),
            body["version"].as_str(),
            body["path"].as_str()
        ),
        (Some("web-0"), Some("HTTP/1.1"), Some("/hello"))
    );

    // HTTP/2 with prior knowledge (h2c)
    let stream = tokio::net::TcpStream::connect(http).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(format!("http://{http}/h2"))
        .body(Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let body: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(
        (body["pod"].as_str(), body["version"].as_str()),
        (Some("web-0"), Some("HTTP/2.0"))
    );

    // Raw TCP: WHOAMI first, then byte-exact echo.
    let mut tcp = TcpStream::connect(echo).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    tcp.write_all(b"WHOAMI\nping").unwrap();
    let mut got = vec![0u8; "web-0\nping".len()];
    tcp.read_exact(&mut got).unwrap();
    assert_eq!(got, b"web-0\nping");
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let mut writer = tcp.try_clone().unwrap();
    let sent = payload.clone();
    let writer_thread = std::thread::spawn(move || writer.write_all(&sent));
    let mut back = vec![0u8; payload.len()];
    tcp.read_exact(&mut back).unwrap();
    writer_thread.join().unwrap().unwrap();
    assert!(back == payload, "echo must be byte-exact");
}
