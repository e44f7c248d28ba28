//! `strait-backend`: the program tests run as a pod's process.
//!
//! It answers HTTP/1.1 and HTTP/2 prior-knowledge (h2c) on each `--http`
//! address with a JSON body naming the pod, and echoes raw TCP on each `--echo`
//! address. On the echo port a connection whose first bytes are `WHOAMI\n`
//! gets the pod name and a newline back first, then plain echo. Each
//! `--udp-echo` address answers a datagram `WHOAMI\n` with the pod name and a
//! newline, and echoes any other datagram.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use clap::Parser;
use http_body_util::Full;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// A test backend: HTTP/1.1 + h2c answering with its pod name, and a TCP echo.
#[derive(Debug, Parser)]
#[command(name = "strait-backend", version)]
struct Args {
    /// The pod name to answer with.
    #[arg(long, env = "POD_NAME", default_value = "")]
    name: String,
    /// Instead of serving: one HTTP/1.1 GET of this `http://host:port/path`
    /// URL, the host resolved as the system resolver does (a pod's
    /// /etc/resolv.conf: cluster DNS and search domains); prints the body,
    /// fails on an error or a non-2xx status. For `kubectl exec` in real pods.
    #[arg(long, conflicts_with_all = ["http", "echo", "banner", "udp_echo"])]
    get: Option<http::Uri>,
    /// With --get: send the request through this HTTP proxy (absolute form),
    /// which resolves the destination; default: `http_proxy`, as apps do.
    #[arg(long, env = "http_proxy", requires = "get")]
    proxy: Option<String>,
    /// With --get: HTTP/2 with prior knowledge (h2c, as gRPC speaks it),
    /// directly to the host (no proxy: for transparent-mode pods).
    #[arg(long, requires = "get")]
    http2: bool,
    /// Address to serve HTTP/1.1 and h2c on (repeatable).
    #[arg(long)]
    http: Vec<SocketAddr>,
    /// Address to serve the TCP echo on (repeatable).
    #[arg(long)]
    echo: Vec<SocketAddr>,
    /// Address of a server-speaks-first service (like SMTP or MySQL): it sends
    /// `220 <pod> ready` on connect, then echoes (repeatable).
    #[arg(long)]
    banner: Vec<SocketAddr>,
    /// Address of a UDP echo (repeatable): `WHOAMI\n` gets the pod name back.
    #[arg(long)]
    udp_echo: Vec<SocketAddr>,
    /// Answer HTTP requests only after this long (a slow endpoint), e.g. `100ms`.
    #[arg(long, value_parser = humantime::parse_duration)]
    delay: Option<std::time::Duration>,
    /// Answer HTTP requests with this status (a failing endpoint), e.g. 503.
    #[arg(long, default_value_t = 200)]
    status: u16,
}

/// How the HTTP side answers.
#[derive(Clone, Copy, Debug)]
struct Behaviour {
    delay: Option<std::time::Duration>,
    status: hyper::StatusCode,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(uri) = args.get {
        let proxy = args.proxy.filter(|p| !p.is_empty() && !args.http2);
        return get(uri, proxy, args.http2).await;
    }
    strait_mesh::telemetry::init_tracing(Default::default(), "info");
    anyhow::ensure!(!args.name.is_empty(), "give --name (or POD_NAME)");
    anyhow::ensure!(
        !args.http.is_empty()
            || !args.echo.is_empty()
            || !args.banner.is_empty()
            || !args.udp_echo.is_empty(),
        "give at least one --http, --echo, --banner or --udp-echo address"
    );
    let behaviour = Behaviour {
        delay: args.delay,
        status: hyper::StatusCode::from_u16(args.status)
            .map_err(|e| anyhow::anyhow!("--status {}: {e}", args.status))?,
    };
    let name: Arc<str> = args.name.into();
    let mut tasks = tokio::task::JoinSet::new();
    for addr in args.http {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("bind HTTP {addr}: {e}"))?;
        tracing::info!(%addr, "serving HTTP/1.1 and h2c");
        tasks.spawn(serve_http(listener, name.clone(), behaviour));
    }
    for addr in args.echo {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("bind echo {addr}: {e}"))?;
        tracing::info!(%addr, "serving TCP echo");
        tasks.spawn(serve_echo(listener, name.clone(), false));
    }
    for addr in args.banner {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("bind banner {addr}: {e}"))?;
        tracing::info!(%addr, "serving a server-speaks-first banner + echo");
        tasks.spawn(serve_echo(listener, name.clone(), true));
    }
    for addr in args.udp_echo {
        let socket = UdpSocket::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("bind UDP echo {addr}: {e}"))?;
        tracing::info!(%addr, "serving UDP echo");
        tasks.spawn(serve_udp_echo(socket, name.clone()));
    }
    // Listeners run until the process is killed; a failing accept loop ends it.
    while let Some(result) = tasks.join_next().await {
        result??;
    }
    Ok(())
}

async fn serve_http(
    listener: TcpListener,
    name: Arc<str>,
    behaviour: Behaviour,
) -> anyhow::Result<()> {
    loop {
        let (stream, peer) = listener.accept().await?;
        let name = name.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req| answer(req, name.clone(), peer, behaviour));
            if let Err(e) = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, "HTTP connection ended: {e}");
            }
        });
    }
}

/// The largest request body the backend reads (it answers 400 beyond).
const MAX_BODY: usize = 1 << 20;

async fn answer(
    req: Request<hyper::body::Incoming>,
    name: Arc<str>,
    peer: SocketAddr,
    behaviour: Behaviour,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    if let Some(delay) = behaviour.delay {
        tokio::time::sleep(delay).await;
    }
    let headers: serde_json::Map<String, serde_json::Value> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned().into(),
            )
        })
        .collect();
    let (method, path, version) = (
        req.method().to_string(),
        req.uri().path().to_string(),
        format!("{:?}", req.version()),
    );
    // The request body is read before answering, as an application does: a
    // server that answers first and then closes with the body unread makes
    // its kernel reset the connection, which can destroy the answer in flight.
    use http_body_util::BodyExt as _;
    let body_bytes = match http_body_util::Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
    {
        Ok(body) => body.to_bytes().len(),
        Err(e) => {
            let response = Response::builder()
                .status(hyper::StatusCode::BAD_REQUEST)
                .body(Full::new(Bytes::from(format!("request body: {e}\n"))))
                .expect("static response parts are valid");
            return Ok(response);
        }
    };
    let body = serde_json::json!({
        "pod": &*name,
        "method": method,
        "path": path,
        "version": version,
        "peer": peer.to_string(),
        "headers": headers,
        "body_bytes": body_bytes,
    });
    let response = Response::builder()
        .status(behaviour.status)
        .header("content-type", "application/json")
        .header("x-strait-pod", &*name)
        .body(Full::new(Bytes::from(format!("{body}\n"))))
        .expect("static response parts are valid");
    Ok(response)
}

async fn serve_echo(listener: TcpListener, name: Arc<str>, banner: bool) -> anyhow::Result<()> {
    loop {
        let (mut stream, peer) = listener.accept().await?;
        let name = name.clone();
        tokio::spawn(async move {
            if banner
                && let Err(e) = stream
                    .write_all(format!("220 {name} ready\r\n").as_bytes())
                    .await
            {
                tracing::debug!(%peer, "banner: {e}");
                return;
            }
            if let Err(e) = echo(stream, &name).await {
                tracing::debug!(%peer, "echo connection ended: {e}");
            }
        });
    }
}

async fn serve_udp_echo(socket: UdpSocket, name: Arc<str>) -> anyhow::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    let whoami = format!("{name}\n");
    loop {
        let (n, peer) = socket.recv_from(&mut buf).await?;
        let answer = if &buf[..n] == b"WHOAMI\n" {
            whoami.as_bytes()
        } else {
            &buf[..n]
        };
        if let Err(e) = socket.send_to(answer, peer).await {
            tracing::debug!(%peer, "UDP echo: {e}");
        }
    }
}

async fn echo(mut stream: TcpStream, name: &str) -> std::io::Result<()> {
    let mut buf = vec![0u8; 16 * 1024];
    let n = stream.read(&mut buf).await?;
    if n == 0 {
        return Ok(());
    }
    let mut first = &buf[..n];
    if let Some(rest) = first.strip_prefix(b"WHOAMI\n") {
        stream.write_all(format!("{name}\n").as_bytes()).await?;
        first = rest;
    }
    stream.write_all(first).await?;
    let (mut reader, mut writer) = stream.split();
    tokio::io::copy(&mut reader, &mut writer).await?;
    writer.shutdown().await
}

/// `--get`: one GET with the system resolver, body to stdout. Through a
/// proxy (`--proxy`, or `http_proxy` as a meshed app has it) the request goes
/// in absolute form, and the proxy resolves the destination.
async fn get(uri: http::Uri, proxy: Option<String>, http2: bool) -> anyhow::Result<()> {
    use http_body_util::{BodyExt, Empty};
    let host = uri
        .host()
        .ok_or_else(|| anyhow::anyhow!("--get {uri}: no host"))?
        .to_string();
    let port = uri.port_u16().unwrap_or(80);
    let (connect_host, connect_port, target) = match &proxy {
        Some(p) => {
            let p: http::Uri = p
                .parse()
                .map_err(|e| anyhow::anyhow!("http_proxy {p:?}: {e}"))?;
            let h = p
                .host()
                .ok_or_else(|| anyhow::anyhow!("http_proxy {p}: no host"))?
                .to_string();
            (h, p.port_u16().unwrap_or(80), uri.to_string())
        }
        None => (
            host.clone(),
            port,
            uri.path_and_query()
                .map(|p| p.as_str().to_string())
                .unwrap_or_else(|| "/".into()),
        ),
    };
    let addr = tokio::net::lookup_host((connect_host.as_str(), connect_port))
        .await
        .map_err(|e| anyhow::anyhow!("resolve {connect_host}: {e}"))?
        .next()
        .ok_or_else(|| anyhow::anyhow!("resolve {connect_host}: no address"))?;
    let stream = tokio::time::timeout(std::time::Duration::from_secs(10), TcpStream::connect(addr))
        .await
        .map_err(|_| anyhow::anyhow!("connect {addr} ({connect_host}): timed out"))?
        .map_err(|e| anyhow::anyhow!("connect {addr} ({connect_host}): {e}"))?;
    let answer = async {
        if http2 {
            let (mut sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                    .await?;
            tokio::spawn(conn);
            // h2 carries the authority in the URI (`:authority`).
            let request = Request::get(uri.clone()).body(Empty::<Bytes>::new())?;
            Ok::<_, anyhow::Error>(sender.send_request(request).await?)
        } else {
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(conn);
            let request = Request::get(target)
                .header(hyper::header::HOST, format!("{host}:{port}"))
                .body(Empty::<Bytes>::new())?;
            Ok(sender.send_request(request).await?)
        }
    };
    let response = tokio::time::timeout(std::time::Duration::from_secs(10), answer)
        .await
        .map_err(|_| anyhow::anyhow!("GET {uri}: no answer within 10s"))??;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    println!("{}", String::from_utf8_lossy(&body));
    anyhow::ensure!(status.is_success(), "GET {uri}: {status}");
    Ok(())
}
