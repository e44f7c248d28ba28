//! Slow and hostile peers on real processes (testenv nodes, root): 5,000
//! connections to each of the gateway's QUIC and TCP ports and to a node
//! proxy's inbound port that never complete a handshake, plus 1,000 QUIC
//! streams that never finish their tunnel header. Each is closed at its
//! time-out, the processes' memory stays bounded (reported per connection),
//! and real traffic keeps flowing meanwhile (its p99 reported beside an
//! undisturbed run of the same load). Its own test binary: it needs some
//! 10,000 sockets in this process.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::tls::TrustBundle;
use strait_mesh::tunnel::quic::GatewayClient;
use strait_testenv::process::rss_kib;
use strait_testenv::wait::eventually;
use strait_testenv::workspace_binary;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

mod common;

use common::*;

/// Hostile connections per listener.
const HOSTILE: usize = 5_000;
/// QUIC streams that send one byte of a tunnel header and stop.
const SILENT_STREAMS: usize = 1_000;
/// The servers' handshake time-out for TCP + TLS (gateway and inbound).
const TLS_ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Raises a process's open-file limit to its hard limit (this sandbox may
/// not raise the hard one): the hostile sockets must not run this process
/// or the servers out of descriptors. Fails saying so when even that is
/// short of `needed`.
fn raise_nofile(pid: u32, needed: u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let hard: u64 = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4))
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX);
    let hard = hard.min(1 << 20);
    let status = std::process::Command::new("prlimit")
        .args([
            "--pid",
            &pid.to_string(),
            &format!("--nofile={hard}:{hard}"),
        ])
        .status()
        .expect("run prlimit");
    assert!(status.success(), "prlimit on {pid}");
    assert!(
        hard >= needed,
        "process {pid} may open only {hard} files, the test needs {needed}: raise the hard limit (ulimit -Hn)"
    );
}

/// `strait-load` from the client pod to web through the node proxies, in a
/// thread of its own (1 s warm-up, then 6 s measured): its JSON report.
fn load(mesh: &Mesh) -> std::thread::JoinHandle<serde_json::Value> {
    let client = pod(mesh, "client");
    let proxy = SocketAddr::new(IpAddr::V4(client.node().ip()), 4140);
    let mut command = client.command(workspace_binary("strait-load"));
    command.args([
        format!("--connect={proxy}"),
        "--uri=http://web.shop/".into(),
        "--host=web.shop".into(),
        "--rate=200".into(),
        "--connections=10".into(),
        "--duration=6s".into(),
        "--warmup=1s".into(),
    ]);
    std::thread::spawn(move || {
        let out = command.output().expect("run strait-load in the client pod");
        assert!(
            out.status.success(),
            "strait-load: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("strait-load prints JSON")
    })
}

/// The highest RSS (KiB) of each of `pids` until `stop` turns true, sampled
/// every 100 ms.
fn sample_rss(
    pids: Vec<u32>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<u64>> {
    std::thread::spawn(move || {
        let mut peak = vec![0; pids.len()];
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            for (p, pid) in peak.iter_mut().zip(&pids) {
                *p = (*p).max(rss_kib(*pid));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        peak
    })
}

/// Probes through the gateway's tunnel every 20 ms for `for_`: the p99 in ms
/// and the failures.
async fn probe_loop(
    client: &std::sync::Arc<GatewayClient>,
    addr: SocketAddr,
    id: &SpiffeId,
    for_: Duration,
) -> (f64, usize) {
    let end = Instant::now() + for_;
    let (mut took, mut failed) = (Vec::new(), 0);
    while Instant::now() < end {
        match client.probe(addr, id).await {
            Ok((t, _)) => took.push(t.as_secs_f64() * 1000.0),
            Err(_) => failed += 1,
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    took.sort_by(f64::total_cmp);
    let p99 = took
        .get(((took.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
        .copied()
        .unwrap_or(f64::NAN);
    (p99, failed)
}

/// `n` TCP connections to `addr` that never send a byte, opened 100 at a
/// time; each is watched until the server closes it: how long after its own
/// connect that was (`None`: not within `TLS_ACCEPT_TIMEOUT` + 20 s).
async fn open_silent(addr: SocketAddr, n: usize) -> Vec<tokio::task::JoinHandle<Option<Duration>>> {
    let mut watched = Vec::with_capacity(n);
    while watched.len() < n {
        let batch = (n - watched.len()).min(100);
        let opened = futures::future::join_all((0..batch).map(|_| async {
            let socket = TcpStream::connect(addr).await.unwrap();
            (socket, Instant::now())
        }))
        .await;
        for (mut socket, connected) in opened {
            watched.push(tokio::spawn(async move {
                let mut buf = [0u8; 1];
                let read = tokio::time::timeout(
                    TLS_ACCEPT_TIMEOUT + Duration::from_secs(20),
                    socket.read(&mut buf),
                )
                .await;
                match read {
                    Ok(Ok(0)) | Ok(Err(_)) => Some(connected.elapsed()),
                    _ => None,
                }
            }));
        }
    }
    watched
}

/// Starts `n` QUIC handshakes to `addr` from one socket and goes silent
/// (its runtime dropped after the Initials left): half-open handshakes.
fn half_open_quic(addr: SocketAddr, n: usize, tls: rustls::ClientConfig) {
    {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let config = strait_mesh::tunnel::quic::client_config(tls).unwrap();
        rt.block_on(async {
            let endpoint =
                strait_mesh::tunnel::quic::endpoint("0.0.0.0:0".parse().unwrap(), None).unwrap();
            let mut connecting = Vec::with_capacity(n);
            for _ in 0..n {
                connecting.push(
                    endpoint
                        .connect_with(config.clone(), addr, "gateway.strait.internal")
                        .unwrap(),
                );
                if connecting.len() % 100 == 0 {
                    // Let the endpoint send what is queued.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            std::mem::forget(connecting);
            std::mem::forget(endpoint);
        });
        rt.shutdown_background();
    }
}

/// One real QUIC connection with [`SILENT_STREAMS`] streams that send the
/// first byte of a tunnel header and nothing more.
#[allow(clippy::type_complexity)]
async fn silent_streams(
    bundle: &TrustBundle,
    cert: &std::sync::Arc<strait_mesh::identity::tls::CertSlot>,
    gateway_id: &SpiffeId,
    gw_addr: SocketAddr,
) -> (
    quinn::Endpoint,
    quinn::Connection,
    Vec<(quinn::SendStream, quinn::RecvStream)>,
) {
    // A plain QUIC connection (a GatewayClient would send whole headers).
    let endpoint = strait_mesh::tunnel::quic::endpoint("0.0.0.0:0".parse().unwrap(), None).unwrap();
    let tls = strait_mesh::identity::tls::client_config(
        bundle,
        cert.clone(),
        vec![gateway_id.clone()],
        &[strait_mesh::tunnel::TUNNEL_ALPN],
    )
    .unwrap();
    let connection = endpoint
        .connect_with(
            strait_mesh::tunnel::quic::client_config(tls).unwrap(),
            gw_addr,
            "strait-gateway.strait-system.identity.strait.internal",
        )
        .unwrap()
        .await
        .unwrap();
    let mut streams = Vec::new();
    for _ in 0..SILENT_STREAMS {
        let (mut send, recv) = connection.open_bi().await.unwrap();
        send.write_all(&[0xF5]).await.unwrap();
        streams.push((send, recv));
    }
    (endpoint, connection, streams)
}

async fn gauge(addr: IpAddr, listener: &str) -> f64 {
    let text = strait_testenv::http_get(SocketAddr::new(addr, 4191), "/metrics")
        .await
        .unwrap();
    metric_sum(
        &text,
        "listener_connections",
        &[&format!("listener=\"{listener}\"")],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_peers_are_closed_at_their_timeouts_in_bounded_memory_while_traffic_flows() {
    let Some(mut mesh) = small_mesh("0s").await else {
        return;
    };
    let (gw_pod, gw) = start_gateway(&mut mesh, 1, &[]).await;
    let gw_pid = gw.pid().unwrap();
    mesh.proxies.push(gw);
    let proxy_pid = mesh.proxies[1].pid().unwrap();
    raise_nofile(std::process::id(), 2 * HOSTILE as u64 + 1_000);
    raise_nofile(gw_pid, HOSTILE as u64 + 1_000);
    raise_nofile(proxy_pid, HOSTILE as u64 + 1_000);
    let gw_ip = IpAddr::V4(gw_pod.ip());
    let gw_addr = SocketAddr::new(gw_ip, 4143);
    let node_ip = IpAddr::V4(mesh.topology.nodes()[1].ip());
    let inbound = SocketAddr::new(node_ip, 4143);
    let gateway_id: SpiffeId = format!(
        "spiffe://{}/ns/strait-system/sa/strait-gateway",
        mesh.trust_domain
    )
    .parse()
    .unwrap();
    let bundle = TrustBundle::from_pem(mesh.anchor.cert_pem.as_bytes()).unwrap();
    let (cert, _) = component_identity(&mesh, "strait-proxy");
    let prober = GatewayClient::new(bundle.clone(), cert.clone()).unwrap();
    prober.probe(gw_addr, &gateway_id).await.unwrap();

    // Undisturbed.
    let quiet_load = load(&mesh);
    let quiet_probes = probe_loop(&prober, gw_addr, &gateway_id, Duration::from_secs(6)).await;
    let quiet = tokio::task::block_in_place(|| quiet_load.join().unwrap());
    let (gw_base, proxy_base) = (rss_kib(gw_pid), rss_kib(proxy_pid));

    // The same traffic, and the hostile peers arriving 1 s into it.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = sample_rss(vec![gw_pid, proxy_pid], stop.clone());
    let busy_load = load(&mesh);
    let tls = strait_mesh::identity::tls::client_config(
        &bundle,
        cert.clone(),
        vec![gateway_id.clone()],
        &[strait_mesh::tunnel::TUNNEL_ALPN],
    )
    .unwrap();
    let hostile = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let opened = Instant::now();
        let (gw_silent, inbound_silent) =
            tokio::join!(open_silent(gw_addr, HOSTILE), open_silent(inbound, HOSTILE));
        let tcp_opened = opened.elapsed();
        let (tcp_held, inbound_held) = (gauge(gw_ip, "tcp").await, gauge(node_ip, "inbound").await);
        let flood_started = Instant::now();
        let flood = std::thread::spawn(move || half_open_quic(gw_addr, HOSTILE, tls));
        let mut quic_held = 0.0f64;
        while !flood.is_finished() {
            quic_held = quic_held.max(gauge(gw_ip, "quic").await);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let flood_took = flood_started.elapsed();
        // When the gateway is down to its callers' QUIC connections again
        // (the prober's and the silent streams' one), from the flood's end.
        let half_open_closed = tokio::spawn(async move {
            let ended = Instant::now();
            let mut seen = Vec::new();
            while ended.elapsed() < Duration::from_secs(120) {
                let held = gauge(gw_ip, "quic").await;
                seen.push((ended.elapsed().as_secs(), held));
                if held <= 2.0 {
                    return (Some(ended.elapsed()), seen);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            (None, seen)
        });
        let streams = silent_streams(&bundle, &cert, &gateway_id, gw_addr).await;
        eprintln!(
            "MEASURED hostile peers: {HOSTILE} + {HOSTILE} silent TCP opened in {tcp_opened:?} (then held: gateway {tcp_held}, inbound {inbound_held}); \
             {HOSTILE} QUIC handshakes sent in {flood_took:?} (gateway held at most {quic_held} at once); {SILENT_STREAMS} header-less streams"
        );
        (opened, gw_silent, inbound_silent, streams, half_open_closed)
    };
    let (busy_probes, (opened, gw_silent, inbound_silent, streams, half_open_closed)) = tokio::join!(
        probe_loop(&prober, gw_addr, &gateway_id, Duration::from_secs(6)),
        hostile,
    );
    let busy = tokio::task::block_in_place(|| busy_load.join().unwrap());

    // Everything hostile is closed at its time-out: the silent TCP
    // connections read EOF, the listeners' gauges fall back.
    // Each silent connection was held, then closed at the server's TLS
    // handshake time-out counted from its own connect (not refused early,
    // not kept).
    let mut lifetimes = Vec::new();
    for watcher in gw_silent.into_iter().chain(inbound_silent) {
        lifetimes.push(watcher.await.unwrap());
    }
    let kept = lifetimes.iter().filter(|l| l.is_none()).count();
    let mut lifetimes: Vec<Duration> = lifetimes.into_iter().flatten().collect();
    lifetimes.sort();
    let (shortest, longest) = (lifetimes[0], lifetimes[lifetimes.len() - 1]);
    eprintln!(
        "MEASURED silent TCP connections closed {shortest:?} … {longest:?} after their connect ({kept} not closed)"
    );
    assert_eq!(kept, 0, "silent connections still open");
    assert!(
        shortest >= TLS_ACCEPT_TIMEOUT / 2,
        "a silent connection was closed after {shortest:?}: refused, not held to the handshake time-out"
    );
    assert!(
        // The servers' timers fire late only as far as the flood starves
        // them of CPU (two cores, the QUIC flood's crypto on both sides).
        longest <= TLS_ACCEPT_TIMEOUT + Duration::from_secs(10),
        "a silent connection was held {longest:?}"
    );
    let closed_after = opened.elapsed();
    let streams_closed = {
        let (_endpoint, _connection, mut streams) = streams;
        let mut closed = 0;
        for (_, recv) in &mut streams {
            let mut buf = [0u8; 64];
            // The gateway answers a header it waited 5 s for, then ends the stream.
            if tokio::time::timeout(Duration::from_secs(10), recv.read(&mut buf))
                .await
                .is_ok()
            {
                closed += 1;
            }
        }
        closed
    };
    // Initials queued while the gateway was busy are each handled (and time
    // out 5 s later) in turn: in a debug build on a loaded machine, the tail
    // takes up to a minute.
    eventually(
        "the gateway back to its callers",
        Duration::from_secs(120),
        || async {
            let (quic, tcp) = (gauge(gw_ip, "quic").await, gauge(gw_ip, "tcp").await);
            // The prober's connection (the silent streams' one is closed).
            if quic <= 1.0 && tcp == 0.0 {
                Ok(())
            } else {
                Err(format!("quic {quic}, tcp {tcp}"))
            }
        },
    )
    .await;
    let (closed_in, seen) = half_open_closed.await.unwrap();
    // Once a second: (seconds after the flood ended, QUIC connections held).
    let trace: Vec<_> = seen.iter().step_by(4).collect();
    eprintln!(
        "MEASURED half-open QUIC handshakes all closed {closed_in:?} after the flood ended (held: {trace:?})"
    );
    // Each is closed 5 s after its peer fell silent (the handshake time-out,
    // then the gateway's silence watchdog), however the flood inflated its RTT
    // (which stretched QUIC's own idle timeout to ~25 s before the watchdog).
    let bound = strait_mesh::tunnel::quic::IDLE_TIMEOUT + Duration::from_secs(10);
    assert!(
        closed_in.is_some_and(|d| d <= bound),
        "half-open QUIC connections held {closed_in:?} after the flood (bound {bound:?}): {seen:?}"
    );
    let text = strait_testenv::http_get(SocketAddr::new(gw_ip, 4191), "/metrics")
        .await
        .unwrap();
    eprintln!(
        "MEASURED the gateway held only its callers' connections again {:?} after the hostile peers arrived \
         ({} QUIC handshakes completed, {} asked to Retry)",
        opened.elapsed(),
        metric_sum(&text, "gateway_connections_total", &["transport=\"quic\""]),
        metric_sum(&text, "gateway_quic_retries_total", &[]),
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let peaks = tokio::task::block_in_place(|| sampler.join().unwrap());
    let (gw_peak, proxy_peak) = (peaks[0], peaks[1]);
    let (gw_after, proxy_after) = (rss_kib(gw_pid), rss_kib(proxy_pid));

    let per = |peak: u64, base: u64, n: usize| (peak.saturating_sub(base) as f64) / n as f64;
    eprintln!(
        "MEASURED hostile: gateway RSS {} → {} → {} MiB ({:.1} KiB per hostile connection), \
         node proxy RSS {} → {} → {} MiB ({:.1} KiB per connection); all closed {:?} after opening; \
         {streams_closed}/{SILENT_STREAMS} silent header streams ended",
        gw_base / 1024,
        gw_peak / 1024,
        gw_after / 1024,
        per(gw_peak, gw_base, 2 * HOSTILE + SILENT_STREAMS),
        proxy_base / 1024,
        proxy_peak / 1024,
        proxy_after / 1024,
        per(proxy_peak, proxy_base, HOSTILE),
        closed_after,
    );
    eprintln!(
        "MEASURED traffic through the proxies p99 {} ms undisturbed, {} ms beside the hostile peers (errors {} / {}); \
         gateway probe p99 {:.2} ms undisturbed, {:.2} ms beside them (failed {} / {})",
        quiet["p99_ms"],
        busy["p99_ms"],
        quiet["errors"],
        busy["errors"],
        quiet_probes.0,
        busy_probes.0,
        quiet_probes.1,
        busy_probes.1
    );
    assert_eq!(busy["errors"], 0, "real traffic failed: {busy}");
    assert_eq!(busy_probes.1, 0, "probes through the gateway failed");
    assert_eq!(
        streams_closed, SILENT_STREAMS,
        "every silent header stream ended"
    );
    // Bounded: within the memory limits of the DaemonSet and the Deployment
    // (sized for their connection caps, ARCHITECTURE.md "Limits").
    assert!(gw_peak < 1536 * 1024, "gateway RSS {gw_peak} KiB");
    assert!(proxy_peak < 512 * 1024, "node proxy RSS {proxy_peak} KiB");
}
