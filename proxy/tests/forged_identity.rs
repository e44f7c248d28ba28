//! `strait-client-id` cannot be forged: on every way into a pod (HTTP/1 and
//! h2c hinted by the sending proxy, CONNECT, an opaque port, a client that
//! speaks after the outbound detection gave up, HTTP a lenient server reads
//! but strict detection does not, a server that speaks first) a caller's own
//! `strait-client-id: …/sa/admin` never reaches the pod: the pod sees the
//! caller's proven identity or no such header. The pod is strait-backend,
//! which echoes the request headers it got. One mesh for every case.

use std::path::Path;
use std::process::{Child, Output, Stdio};

use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use strait_testenv::NetPod;
use strait_testenv::wait::eventually;

mod common;

use common::*;

/// The test world's cluster is `mesh`, trust domain `mesh.clusterset.local`.
const FORGED: &str = "spiffe://mesh.clusterset.local/ns/shop/sa/admin";
const PROVEN: &str = "spiffe://mesh.clusterset.local/ns/shop/sa/client";

/// A raw HTTP/1 request for `host` carrying the forged header, `first_line`
/// and `eol` as given (for near-HTTP a lenient server still reads).
fn forged_request(first_line: &str, eol: &str, host: &str) -> Vec<u8> {
    format!(
        "{first_line}{eol}Host: {host}{eol}strait-client-id: {FORGED}{eol}Connection: close{eol}{eol}"
    )
    .into_bytes()
}

/// A python3 TCP client in `pod`: connects to `addr` (`host:port`), through
/// `connect` (`host:port` for a CONNECT to the node proxy at `proxy`) if
/// given, waits `wait_secs`, reads the server's greeting if `greeting`, sends
/// `payload` (then shuts its sending side if `half_close`), and prints what
/// comes back until the server closes (or 5 s).
fn raw_client(
    pod: &NetPod,
    addr: &str,
    connect: Option<&str>,
    wait_secs: f64,
    (greeting, half_close): (bool, bool),
    payload: &[u8],
) -> Child {
    let (host, port) = addr.rsplit_once(':').unwrap();
    let connect = connect.unwrap_or("");
    let hex: String = payload.iter().map(|b| format!("{b:02x}")).collect();
    let script = format!(
        r#"import socket, sys, time
s = socket.create_connection(({host:?}, {port}), timeout=20)
out = b""
if {connect:?}:
    s.sendall(b"CONNECT {connect} HTTP/1.1\r\nHost: {connect}\r\n\r\n")
    while b"\r\n\r\n" not in out:
        c = s.recv(1)
        if not c: break
        out += c
time.sleep({wait_secs})
if {greeting}:
    s.settimeout(5)
    out += s.recv(200)
s.sendall(bytes.fromhex({hex:?}))
if {half_close}:
    s.shutdown(socket.SHUT_WR)
s.settimeout(5)
try:
    while True:
        c = s.recv(65536)
        if not c: break
        out += c
except Exception as e:
    out += ("\n[client: %s]" % e).encode()
sys.stdout.write(out.decode(errors="replace"))
"#,
        greeting = if greeting { "True" } else { "False" },
        half_close = if half_close { "True" } else { "False" },
    );
    pod.command("python3")
        .args(["-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3 in the pod")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// What the backend saw as `strait-client-id`, from its JSON answer in `out`
/// (`None`: no answer or no such header).
fn client_id_seen(out: &str) -> Option<String> {
    let body = &out[out.find('{')?..=out.rfind('}')?];
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    v["headers"]["strait-client-id"]
        .as_str()
        .map(str::to_string)
}

/// The verdict on one forging attempt: the forged value must appear nowhere,
/// and the backend must have answered with the proven identity (`answered`)
/// or, where a refusal is acceptable, the proxy refused (`refused` in `out`).
fn judge(case: &str, out: &str, refusal: Option<&str>, failures: &mut Vec<String>) {
    if out.contains(FORGED) {
        failures.push(format!(
            "{case}: the forged identity reached the pod: {out}"
        ));
        return;
    }
    match (client_id_seen(out), refusal) {
        (Some(id), _) if id == PROVEN => eprintln!("{case}: proven identity"),
        (None, Some(refused)) if out.contains(refused) => eprintln!("{case}: refused"),
        (seen, _) => failures.push(format!(
            "{case}: the pod saw strait-client-id {seen:?}, not {PROVEN}: {out}"
        )),
    }
}

async fn opaque_service(mesh: &Mesh) {
    // web's pods on a port the Service marks opaque: never detected outbound.
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "opaqueweb", "namespace": "shop",
                     "annotations": {"strait.dev/opaque-ports": "8080"}},
        "spec": {"selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 8080, "targetPort": "http"}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(mesh.topology.cluster().client(), "shop")
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_own_strait_client_id_never_reaches_the_pod() {
    if !strait_testenv::net::root_or_skip("forged identity tests") {
        return;
    }
    let mut mesh = start_mesh(2, Path::new(env!("CARGO_BIN_EXE_strait-proxy"))).await;
    backend(&mut mesh, 1, "web-1", "web", &[]).await;
    add_client(&mut mesh, 0).await;
    service(&mesh.topology.cluster().client(), "web").await;
    opaque_service(&mesh).await;
    let app = add_transparent_pod(&mesh, 0, "shop", "app", "client").await;
    eventually("web answers through the proxies", WAIT, || async {
        answered_by(&curl(&mesh, &["http://web.shop/"]))
    })
    .await;
    let client = pod(&mesh, "client");
    let proxy = format!("{}:4140", client.node().ip());
    let web = "web.shop.svc.cluster.local";
    let opaque_web = "opaqueweb.shop.svc.cluster.local:8080";
    let mut failures = Vec::new();

    // The late talker first (it waits out the outbound's 10 s detection,
    // transparent mode, non-opaque port: the sender hints opaque); the other
    // cases run meanwhile.
    let late = raw_client(
        &app,
        &format!("{web}:80"),
        None,
        11.0,
        (false, false),
        &forged_request("GET /late HTTP/1.1", "\r\n", web),
    );
    // The same over CONNECT (no outbound detection: the inbound alone waits).
    let late_connect = raw_client(
        client,
        &proxy,
        Some("web.shop:80"),
        11.0,
        (false, false),
        &forged_request("GET /late-connect HTTP/1.1", "\r\n", web),
    );

    let forged_header = format!("strait-client-id: {FORGED}");
    let curl_text = |args: &[&str]| {
        let mut all = vec!["-H", forged_header.as_str()];
        all.extend_from_slice(args);
        text(&curl(&mesh, &all))
    };
    // HTTP/1 through the outbound proxy (hinted HTTP/1).
    judge(
        "HTTP/1 via http_proxy",
        &curl_text(&["http://web.shop/h1"]),
        None,
        &mut failures,
    );
    // CONNECT, then HTTP/1 and h2c over the tunnel (hinted opaque).
    judge(
        "CONNECT then HTTP/1",
        &curl_text(&["-p", "http://web.shop:80/connect-h1"]),
        None,
        &mut failures,
    );
    judge(
        "CONNECT then h2c",
        &curl_text(&[
            "-p",
            "--http2-prior-knowledge",
            "http://web.shop:80/connect-h2",
        ]),
        None,
        &mut failures,
    );
    // Transparent mode: h2c (hinted HTTP/2), and HTTP/1 to an opaque port.
    let tcurl = |args: &[&str]| {
        let mut all = vec!["-sS", "--noproxy", "*", "--max-time", "5"];
        all.extend(["-H", forged_header.as_str()]);
        all.extend_from_slice(args);
        text(&app.command("curl").args(&all).output().unwrap())
    };
    judge(
        "transparent h2c",
        &tcurl(&["--http2-prior-knowledge", &format!("http://{web}/h2")]),
        None,
        &mut failures,
    );
    judge(
        "transparent HTTP/1 to an opaque port",
        &tcurl(&[&format!("http://{opaque_web}/opaque-port")]),
        None,
        &mut failures,
    );
    // HTTP that strict detection calls opaque but a lenient server (hyper,
    // strait-backend's) reads: over CONNECT and on the opaque port. The
    // proxy's own HTTP server serves it, or refuses it (400).
    let long_path = format!("GET /{} HTTP/1.1", "a".repeat(9000));
    let near_http: [(&str, Vec<u8>); 4] = [
        (
            "lower-case method",
            forged_request("get /lower HTTP/1.1", "\r\n", web),
        ),
        (
            "leading empty line",
            [
                b"\r\n".as_slice(),
                &forged_request("GET /empty-line HTTP/1.1", "\r\n", web),
            ]
            .concat(),
        ),
        (
            "bare LF",
            forged_request("GET /bare-lf HTTP/1.1", "\n", web),
        ),
        (
            "request line over 8 KiB",
            forged_request(&long_path, "\r\n", web),
        ),
    ];
    for (what, payload) in &near_http {
        let out = raw_client(
            client,
            &proxy,
            Some("web.shop:80"),
            0.0,
            (false, false),
            payload,
        )
        .wait_with_output()
        .unwrap();
        judge(
            &format!("CONNECT then {what}"),
            &text(&out),
            Some("HTTP/1.1 400"),
            &mut failures,
        );
        let out = raw_client(&app, opaque_web, None, 0.0, (false, false), payload)
            .wait_with_output()
            .unwrap();
        judge(
            &format!("opaque port, {what}"),
            &text(&out),
            Some("HTTP/1.1 400"),
            &mut failures,
        );
    }

    // A server that speaks first (banner, then echo) still works opaque...
    let out = raw_client(
        client,
        &proxy,
        Some("web.shop:2525"),
        0.0,
        (true, true),
        b"hello-after-the-banner\n",
    )
    .wait_with_output()
    .unwrap();
    let t = text(&out);
    if !(t.contains("220 web-1") && t.contains("hello-after-the-banner")) {
        failures.push(format!("server-first over CONNECT: banner and echo: {t}"));
    }
    // ...and HTTP sent after its greeting never reaches it (the echo would
    // return it): the tunnel is closed instead.
    let out = raw_client(
        client,
        &proxy,
        Some("web.shop:2525"),
        0.0,
        (true, false),
        &forged_request("GET /after-banner HTTP/1.1", "\r\n", web),
    )
    .wait_with_output()
    .unwrap();
    let t = text(&out);
    if !t.contains("220 web-1") || t.contains(FORGED) {
        failures.push(format!(
            "server-first over CONNECT, then forged HTTP: greeting, and no echo: {t}"
        ));
    }

    for (case, child) in [
        ("late talker, transparent", late),
        ("late talker, CONNECT", late_connect),
    ] {
        let out = child.wait_with_output().unwrap();
        judge(case, &text(&out), None, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
