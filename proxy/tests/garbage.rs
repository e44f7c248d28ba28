//! Node proxy robustness on testenv nodes (network namespaces, root):
//! garbage, oversized input and idle connections on the real ports without a
//! panic, a hang or unbounded memory.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use strait_mesh::identity::SpiffeId;
use strait_mesh::tunnel::{MAGIC, TunnelResponse, VERSION};
use strait_proxy::identity::{TUNNEL_ALPN, server_name_for};
use strait_testenv::process::{is_alive, rss_kib};
use strait_testenv::wait::eventually;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

mod common;

use common::*;

/// How long the proxy may take to answer or close on bad input.
const NO_HANG: Duration = Duration::from_secs(5);

/// Deterministic noise (xorshift), so a failure can be replayed.
fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

/// Writes `bytes` (the peer may close before all are written), then reads
/// until the peer closes; returns what came back. Panics if the peer neither
/// answers nor closes within [`NO_HANG`].
async fn poke<S: AsyncRead + AsyncWrite + Unpin>(
    what: &str,
    mut stream: S,
    bytes: &[u8],
) -> Vec<u8> {
    let exchange = async {
        let _ = stream.write_all(bytes).await;
        let _ = stream.flush().await;
        let mut answer = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
        answer
    };
    let answer = tokio::time::timeout(NO_HANG, exchange)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer and no close within {NO_HANG:?}"));
    eprintln!("{what}: {}", first_line(&answer));
    answer
}

/// The first line of an answer, or "closed" if there was none.
fn first_line(answer: &[u8]) -> String {
    String::from_utf8_lossy(answer)
        .lines()
        .next()
        .unwrap_or("closed")
        .to_string()
}

/// An HTTP client error, or the connection closed without an answer.
fn refused_over_http(what: &str, answer: &[u8]) {
    let line = first_line(answer);
    assert!(
        line == "closed" || line.starts_with("HTTP/1.1 4"),
        "{what}: {line}"
    );
}

/// Nothing, or a TLS alert record (content type 21), then the close.
fn refused_over_tls(what: &str, answer: &[u8]) {
    assert!(
        answer.is_empty() || (answer[0] == 0x15 && answer.len() <= 7 * 2),
        "{what}: {answer:?}"
    );
}

/// A client for the inbound port with the `client` ServiceAccount's identity
/// from the issuer, expecting the server to be `server`.
async fn mtls_config(mesh: &Mesh, server: &SpiffeId) -> Arc<rustls::ClientConfig> {
    let (slot, bundle) = issued_identity(mesh, "shop", "client").await;
    Arc::new(
        strait_mesh::identity::tls::client_config(
            &bundle,
            slot,
            vec![server.clone()],
            &[TUNNEL_ALPN],
        )
        .unwrap(),
    )
}

/// A tunnel header frame: magic, version, kind 1, a body length, then `body`.
fn frame(declared_len: u16, body: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend([VERSION, 1]);
    out.extend(declared_len.to_be_bytes());
    out.extend(body);
    out
}

/// How many of the connections to `addr` from `ports` (this side's local
/// ports) the process `pid` has accepted: in its network namespace's TCP
/// table, an accepted socket has an inode, one still in the listen backlog
/// has none. (Counting the process's file descriptors instead would also
/// count whatever else it opens or closes meanwhile.)
fn accepted_from(pid: u32, addr: SocketAddr, ports: &std::collections::HashSet<u16>) -> usize {
    let port_of = |field: Option<&&str>| {
        field
            .and_then(|f| f.rsplit_once(':'))
            .and_then(|(_, port)| u16::from_str_radix(port, 16).ok())
    };
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let inode = fields.get(9).copied().unwrap_or("0");
            port_of(fields.get(1)) == Some(addr.port())
                && port_of(fields.get(2)).is_some_and(|p| ports.contains(&p))
                && inode != "0"
        })
        .count()
}

/// Opens `n` connections to `addr` that send nothing; returns once the proxy
/// has accepted them all.
async fn idle_connections(pid: u32, addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    let ports: std::collections::HashSet<u16> = held
        .iter()
        .map(|c| c.local_addr().unwrap().port())
        .collect();
    eventually(
        &format!("the proxy accepted {n} connections on {addr}"),
        WAIT,
        || async {
            let accepted = accepted_from(pid, addr, &ports);
            if accepted == n {
                Ok(())
            } else {
                // What the proxy is doing, should it never accept them.
                let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|s| {
                        Some(s.rsplit_once(')')?.1.split_whitespace().next()?.to_string())
                    });
                Err(format!("{accepted} of {n} (process state {state:?})"))
            }
        },
    )
    .await;
    // Let every connection's task run its first read.
    tokio::time::sleep(Duration::from_millis(500)).await;
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_oversized_input_and_idle_connections_neither_crash_hang_nor_bloat_the_proxy() {
    let Some(mesh) = small_mesh("10ms").await else {
        return;
    };
    let node = mesh.topology.nodes()[0].clone();
    let outbound = SocketAddr::new(IpAddr::V4(node.ip()), 4140);
    let inbound = SocketAddr::new(IpAddr::V4(node.ip()), 4143);
    let pid = mesh.proxies[0].pid().unwrap();
    // Warm up the paths measured below, then take the baseline.
    for _ in 0..20 {
        assert_eq!(curl_status(&mesh, "http://web.shop/"), 200);
    }
    let baseline = rss_kib(pid);
    let connect = |addr| async move { TcpStream::connect(addr).await.unwrap() };

    // ── Outbound (4140): HTTP/1 from the node's pods ──
    for seed in 1..=8 {
        let answer = poke(
            "4140 noise",
            connect(outbound).await,
            &noise(64 * 1024, seed),
        )
        .await;
        refused_over_http("4140 noise", &answer);
    }
    let mut long_line = b"GET http://web.shop/".to_vec();
    long_line.extend(std::iter::repeat_n(b'a', 1 << 20));
    long_line.extend(b" HTTP/1.1\r\nHost: web.shop\r\n\r\n");
    let answer = poke(
        "4140 1 MiB request line",
        connect(outbound).await,
        &long_line,
    )
    .await;
    refused_over_http("4140 1 MiB request line", &answer);
    let mut big_head = b"GET http://web.shop/ HTTP/1.1\r\nHost: web.shop\r\n".to_vec();
    for i in 0..1024 {
        big_head.extend(format!("x-pad-{i}: {}\r\n", "b".repeat(1000)).as_bytes());
    }
    big_head.extend(b"\r\n");
    let answer = poke(
        "4140 1 MiB header block",
        connect(outbound).await,
        &big_head,
    )
    .await;
    refused_over_http("4140 1 MiB header block", &answer);
    let mut many = b"GET http://web.shop/ HTTP/1.1\r\nHost: web.shop\r\n".to_vec();
    for i in 0..500 {
        many.extend(format!("x-{i}: 1\r\n").as_bytes());
    }
    many.extend(b"\r\n");
    let answer = poke("4140 500 headers", connect(outbound).await, &many).await;
    refused_over_http("4140 500 headers", &answer);
    let answer = poke(
        "4140 CONNECT to nowhere",
        connect(outbound).await,
        b"CONNECT 10.255.255.1:1 HTTP/1.1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(first_line(&answer).starts_with("HTTP/1.1 403"), "not a pod");

    // ── Inbound (4143): mutual TLS from node proxies ──
    let answer = poke(
        "4143 plain HTTP",
        connect(inbound).await,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    refused_over_tls("4143 plain HTTP", &answer);
    for seed in 1..=4 {
        let answer = poke(
            "4143 noise",
            connect(inbound).await,
            &noise(16 * 1024, seed),
        )
        .await;
        refused_over_tls("4143 noise", &answer);
    }
    let here: SpiffeId = format!("spiffe://{}/ns/shop/sa/client", mesh.trust_domain)
        .parse()
        .unwrap();
    let config = mtls_config(&mesh, &here).await;
    let tls = tokio_rustls::TlsConnector::from(config.clone());
    for bogus in ["bogus.example.com", "nobody.shop.identity.strait.internal"] {
        let name = rustls::pki_types::ServerName::try_from(bogus.to_string()).unwrap();
        let handshake = tokio::time::timeout(NO_HANG, tls.connect(name, connect(inbound).await))
            .await
            .unwrap_or_else(|_| panic!("4143 SNI {bogus}: handshake hung"));
        assert!(handshake.is_err(), "4143 SNI {bogus}: handshake succeeded");
    }
    let tunnel_inputs: [(&str, Vec<u8>, bool); 4] = [
        ("truncated header, then EOF", frame(64, &[0x01, 0x00]), true),
        (
            "oversized header length",
            frame(u16::MAX, &[0u8; 8192]),
            false,
        ),
        ("wrong magic", noise(4096, 9), false),
        ("truncated magic, then EOF", MAGIC[..2].to_vec(), true),
    ];
    for (what, bytes, half_close) in tunnel_inputs {
        let mut stream = tls
            .connect(server_name_for(&here), connect(inbound).await)
            .await
            .expect("mTLS with the node proxy");
        let answer = if half_close {
            stream.write_all(&bytes).await.unwrap();
            stream.shutdown().await.unwrap();
            poke(&format!("4143 {what}"), stream, b"").await
        } else {
            poke(&format!("4143 {what}"), stream, &bytes).await
        };
        // Nothing, or a refusal that says why; never a tunnel.
        if !answer.is_empty() {
            let (response, _) = TunnelResponse::decode(&answer)
                .unwrap_or_else(|e| panic!("4143 {what}: {e}: {answer:?}"));
            assert!(!response.is_ok(), "4143 {what}: {response:?}");
            eprintln!("4143 {what}: {response:?}");
        }
    }
    assert!(is_alive(pid), "the proxy died of bad input");
    assert_eq!(curl_status(&mesh, "http://web.shop/"), 200);
    let after_garbage = rss_kib(pid);

    // ── Idle connections: 2000 on each port ──
    let n = 2000;
    let idle_out = idle_connections(pid, outbound, n).await;
    let with_outbound = rss_kib(pid);
    let idle_in = idle_connections(pid, inbound, n).await;
    let with_inbound = rss_kib(pid);
    assert_eq!(curl_status(&mesh, "http://web.shop/"), 200);
    let per_out = (with_outbound as f64 - after_garbage as f64) / n as f64;
    let per_in = (with_inbound as f64 - with_outbound as f64) / n as f64;
    eprintln!(
        "RSS KiB: baseline {baseline}, after bad input {after_garbage}, +{n} idle outbound {with_outbound} \
         ({per_out:.1} KiB each), +{n} idle inbound {with_inbound} ({per_in:.1} KiB each)"
    );
    drop((idle_out, idle_in));
    assert!(is_alive(pid), "the proxy died with idle connections");
    // Bad input may cost a connection's bounded buffers once (64 KiB each way),
    // never the 1 MiB it was sent; an idle connection costs a task and a read
    // buffer, well under 32 KiB.
    assert!(
        after_garbage < baseline + 16 * 1024,
        "RSS grew from {baseline} to {after_garbage} KiB on bad input"
    );
    assert!(
        with_outbound < after_garbage + 64 * 1024 && with_inbound < with_outbound + 64 * 1024,
        "RSS with {n} idle connections per port: {after_garbage} → {with_outbound} → {with_inbound} KiB"
    );
    eventually("a request after the idle connections", WAIT, || async {
        match curl_status(&mesh, "http://web.shop/") {
            200 => Ok(()),
            other => Err(format!("status {other}")),
        }
    })
    .await;
}
