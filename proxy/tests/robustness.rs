//! Node proxy robustness on testenv nodes (network namespaces, root): graceful
//! drain on SIGTERM, the shutdown delay, pooled and long tunnels at shutdown.
//! (Bad input: `garbage.rs`.)

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use strait_testenv::http_get;
use strait_testenv::wait::eventually;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod common;

use common::*;

/// The drain timeout the fixture gives every proxy (`--drain-timeout=2s`).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the proxy may take to answer or close.
const NO_HANG: Duration = Duration::from_secs(5);

fn sigterm(pid: u32) {
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -TERM {pid}");
}

/// Polls until the client node's proxy exits; returns when, or None by `limit`.
async fn exited_within(mesh: &mut Mesh, limit: Duration) -> Option<(Instant, bool)> {
    node_proxy_exited_within(mesh, 0, limit).await
}

/// Polls until node `node`'s proxy exits; returns when, or None by `limit`.
async fn node_proxy_exited_within(
    mesh: &mut Mesh,
    node: usize,
    limit: Duration,
) -> Option<(Instant, bool)> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(status) = mesh.proxies[node].try_exit_status() {
            return Some((Instant::now(), status.success()));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// curl in the client pod through its node proxy, in the background.
fn curl_in_background(mesh: &Mesh, url: &str) -> Child {
    let client = pod(mesh, "client");
    let proxy = format!("http://{}:4140", client.node().ip());
    client
        .command("curl")
        .args(["-sS", "--max-time", "10", "-x", &proxy])
        .args(["-o", "/dev/null", "-w", "%{http_code}", url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run curl in the client pod")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_requests_in_flight_refuses_new_connections_and_exits() {
    let Some(mut mesh) = small_mesh("1200ms").await else {
        return;
    };
    let node = mesh.topology.nodes()[0].clone();
    let outbound = SocketAddr::new(IpAddr::V4(node.ip()), 4140);
    let admin = SocketAddr::new(IpAddr::V4(node.ip()), 4191);
    assert_eq!(curl_status(&mesh, "http://lazy.shop/"), 200);

    // A kept-alive idle connection (the test is no pod, so the answer is a
    // 403, but the connection stays open): the drain must not wait for it.
    let mut idle = TcpStream::connect(outbound).await.unwrap();
    idle.write_all(b"GET http://web.shop/ HTTP/1.1\r\nHost: web.shop\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = idle.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 403"), "{:?}", &buf[..n]);

    let in_flight = curl_in_background(&mesh, "http://lazy.shop/slow");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let pid = mesh.proxies[0].pid().unwrap();
    let signaled = Instant::now();
    sigterm(pid);

    // New connections are refused once the listener is gone…
    eventually(
        "the outbound listener closed",
        Duration::from_secs(1),
        || async {
            match TcpStream::connect(outbound).await {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    // …the admin server says not ready while the drain runs…
    let ready = http_get(admin, "/ready").await.unwrap();
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    // …and the idle kept-alive connection is closed, not waited for.
    let closed = tokio::time::timeout(Duration::from_secs(1), idle.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "idle keep-alive connection not closed by the drain: {closed:?}"
    );

    // The request in flight is answered.
    let out = in_flight.wait_with_output().unwrap();
    let answered = signaled.elapsed();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "200",
        "in-flight request: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Then the proxy exits by itself, before the drain timeout.
    let (exited, success) = exited_within(&mut mesh, DRAIN_TIMEOUT + Duration::from_secs(1))
        .await
        .expect("the proxy did not exit after the drain");
    let took = exited - signaled;
    eprintln!("in-flight answered {answered:?} after SIGTERM; proxy exited after {took:?}");
    assert!(success, "the proxy's exit status after a drain");
    assert!(
        took < DRAIN_TIMEOUT,
        "the proxy waited {took:?}: longer than needed for the request in flight ({answered:?})"
    );
}

/// One HTTP/1 request on `conn`; the response head, lower-cased.
async fn request_head(conn: &mut TcpStream) -> String {
    conn.write_all(b"GET http://web.shop/ HTTP/1.1\r\nHost: web.shop\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(NO_HANG, conn.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).to_lowercase()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_the_shutdown_delay_connections_are_still_accepted_and_close_after_their_answer() {
    let Some(mut mesh) = small_mesh("10ms").await else {
        return;
    };
    // Node 1's proxy again, with the delay a DaemonSet pod has (shorter).
    let node = mesh.topology.nodes()[0].clone();
    mesh.proxies[0].stop(Duration::from_secs(5));
    mesh.proxies[0] = spawn_proxy_with(
        &mesh,
        &node,
        Path::new(env!("CARGO_BIN_EXE_strait-proxy")),
        &["--shutdown-delay=1500ms"],
    );
    let outbound = SocketAddr::new(IpAddr::V4(node.ip()), 4140);
    let admin = SocketAddr::new(IpAddr::V4(node.ip()), 4191);
    eventually("the restarted proxy is ready", WAIT, || async {
        match http_get(admin, "/ready").await {
            Ok(r) if r.starts_with("HTTP/1.1 200") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // A kept-alive connection (the test is no pod: 403s, but kept alive).
    let mut kept = TcpStream::connect(outbound).await.unwrap();
    let head = request_head(&mut kept).await;
    assert!(
        head.starts_with("http/1.1 403") && !head.contains("connection: close"),
        "{head}"
    );

    let signaled = Instant::now();
    sigterm(mesh.proxies[0].pid().unwrap());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ready = http_get(admin, "/ready").await.unwrap();
    assert!(
        ready.starts_with("HTTP/1.1 503"),
        "not ready at once: {ready}"
    );
    // The kept-alive connection's next answer closes it (the client moves
    // on between two requests, not in the middle of one)…
    let head = request_head(&mut kept).await;
    assert!(head.contains("connection: close"), "{head}");
    let mut buf = [0u8; 64];
    let eof = tokio::time::timeout(NO_HANG, kept.read(&mut buf)).await;
    assert!(matches!(eof, Ok(Ok(0)) | Ok(Err(_))), "{eof:?}");
    // …and a new connection (a stale route to this pod) is still served.
    let mut late = TcpStream::connect(outbound)
        .await
        .expect("accepted during the shutdown delay");
    let head = request_head(&mut late).await;
    assert!(
        head.starts_with("http/1.1 403") && head.contains("connection: close"),
        "{head}"
    );
    assert!(signaled.elapsed() < Duration::from_millis(1500));
    // After the delay the listener stops, then the proxy exits.
    eventually("the outbound listener closed", WAIT, || async {
        match TcpStream::connect(outbound).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let refused_after = signaled.elapsed();
    assert!(
        refused_after >= Duration::from_millis(1500),
        "the listener closed {refused_after:?} after SIGTERM, before the delay"
    );
    let (_, success) = exited_within(&mut mesh, DRAIN_TIMEOUT + Duration::from_secs(3))
        .await
        .expect("the proxy exits after the delay and the drain");
    assert!(success);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_pooled_tunnel_does_not_hold_the_destination_proxys_drain() {
    let Some(mut mesh) = small_mesh("10ms").await else {
        return;
    };
    // The client's node proxy pools the HTTP tunnel into node 2's proxy.
    assert_eq!(curl_status(&mesh, "http://web.shop/pooled"), 200);
    let signaled = Instant::now();
    sigterm(mesh.proxies[1].pid().unwrap());
    let (exited, success) = node_proxy_exited_within(&mut mesh, 1, DRAIN_TIMEOUT * 2)
        .await
        .expect("node 2's proxy did not exit after the drain");
    let took = exited - signaled;
    eprintln!("destination proxy with an idle pooled tunnel exited after {took:?}");
    assert!(success, "the proxy's exit status after a drain");
    // A pooled tunnel is idle between requests: closing it at the drain
    // (the sender opens a new one elsewhere) lets a DaemonSet rollout replace
    // the node's proxy without waiting out the drain timeout.
    assert!(
        took < DRAIN_TIMEOUT / 2,
        "an idle pooled tunnel held the drain for {took:?} (timeout {DRAIN_TIMEOUT:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_that_outlives_the_drain_timeout_is_waited_for_then_cut() {
    let Some(mut mesh) = small_mesh("10ms").await else {
        return;
    };
    // A CONNECT tunnel to the echo port held open far past the drain timeout.
    let client = pod(&mesh, "client");
    let script = format!(
        "exec 3<>/dev/tcp/{}/4140; printf 'CONNECT web.shop:9000 HTTP/1.1\\r\\nHost: web.shop:9000\\r\\n\\r\\n' >&3; head -n1 <&3; sleep 30",
        client.node().ip()
    );
    let mut holder = client
        .command("bash")
        .args(["-c", &script])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    let mut stdout = holder.stdout.take().unwrap();
    let mut byte = [0u8; 1];
    while !first.ends_with('\n') {
        use std::io::Read;
        assert_eq!(
            stdout.read(&mut byte).unwrap(),
            1,
            "tunnel answer: {first:?}"
        );
        first.push(byte[0] as char);
    }
    assert!(first.starts_with("HTTP/1.1 200"), "{first:?}");

    let signaled = Instant::now();
    sigterm(mesh.proxies[0].pid().unwrap());
    let result = exited_within(&mut mesh, DRAIN_TIMEOUT + Duration::from_secs(3)).await;
    let _ = holder.kill();
    let _ = holder.wait();
    let (exited, success) = result.expect("an open tunnel kept the proxy alive past the drain");
    let took = exited - signaled;
    eprintln!("proxy with an open tunnel exited after {took:?}");
    assert!(success, "the proxy's exit status after a drain");
    assert!(
        took >= DRAIN_TIMEOUT - Duration::from_millis(100),
        "the proxy exited after {took:?}: it did not wait for the open tunnel"
    );
    assert!(
        took < DRAIN_TIMEOUT + Duration::from_secs(1),
        "exit took {took:?}"
    );
}
