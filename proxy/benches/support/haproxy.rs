//! A pair of haproxy processes as the benchmarks' reference: node 1 takes
//! plain traffic in and speaks TLS with a client certificate to node 2,
//! which requires that certificate and forwards in the clear to the pod.
//! Certificates come from the mesh's own issuer. Each haproxy runs as many
//! threads ([`threads`]) as a node proxy runs workers.
//!
//! [`Mode::Relay`] is the floor instead: the same pair as a null relay (TCP,
//! no TLS, the kernel's `splice` between the sockets, so no byte is copied
//! into either process): what any pair of proxies costs on this machine
//! before it does any work of its own.
// Each benchmark uses one of the modes.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::ca::LeafSigner;
use strait_testenv::process::ChildProcess;

use strait_testenv::fixture::Mesh;

/// What the pair forwards: HTTP requests (kept-alive, reused connections
/// between the two) or plain TCP streams, over TLS; or TCP streams with
/// neither TLS nor copies (the null relay).
#[derive(Clone, Copy)]
pub enum Mode {
    Http,
    Tcp,
    Relay,
}

impl Mode {
    /// Port of the pair's entry on node 1 (plain); each mode has its own,
    /// so pairs of different modes run side by side.
    pub fn entry_port(self) -> u16 {
        match self {
            Mode::Http | Mode::Tcp => 4240,
            Mode::Relay => 4250,
        }
    }

    /// Port of node 2's end (TLS, except for the relay).
    fn inner_port(self) -> u16 {
        self.entry_port() + 3
    }
}

/// Starts the pair in front of `backend`; clients connect to node 1 at
/// [`Mode::entry_port`].
/// Threads of each haproxy: as many as each node proxy's workers (one per
/// CPU, its default), so neither side is measured with more of the machine.
pub fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

pub fn start(mesh: &Mesh, backend: SocketAddr, mode: Mode) -> Vec<ChildProcess> {
    let dir = mesh.dir.path().join(match mode {
        Mode::Relay => "haproxy-relay",
        _ => "haproxy",
    });
    std::fs::create_dir_all(&dir).unwrap();
    let issuer_pem = mesh.issuer_pair.cert_pem.clone();
    let signer = LeafSigner::load(&mesh.issuer_pair, &mesh.anchor.cert_pem).unwrap();
    let write_leaf = |name: &str, id: &str| {
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf = signer
            .sign(
                &key,
                &id.parse::<SpiffeId>().unwrap(),
                Duration::from_secs(3600),
            )
            .unwrap();
        let path = dir.join(format!("{name}.pem"));
        std::fs::write(
            &path,
            format!("{}{}{}", leaf.pem, issuer_pem, key.serialize_pem()),
        )
        .unwrap();
        path
    };
    let client_pem = write_leaf(
        "client",
        &format!("spiffe://{}/ns/bench/sa/haproxy-client", mesh.trust_domain),
    );
    let server_pem = write_leaf(
        "server",
        &format!("spiffe://{}/ns/bench/sa/haproxy-server", mesh.trust_domain),
    );
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, &mesh.anchor.cert_pem).unwrap();
    let nodes = mesh.topology.nodes();
    let (n1, n2) = (nodes[0].ip(), nodes[1].ip());
    let (entry, inner) = (mode.entry_port(), mode.inner_port());
    let (proxy_mode, alpn) = match mode {
        Mode::Http => ("http\n  http-reuse always", " alpn http/1.1"),
        Mode::Tcp => ("tcp", ""),
        Mode::Relay => ("tcp\n  option splice-request\n  option splice-response", ""),
    };
    let (client_tls, server_tls) = match mode {
        Mode::Relay => (String::new(), String::new()),
        _ => (
            format!(
                " ssl verify required ca-file {} crt {}{alpn}",
                ca.display(),
                client_pem.display()
            ),
            format!(
                " ssl crt {} ca-file {} verify required{alpn}",
                server_pem.display(),
                ca.display()
            ),
        ),
    };
    let common = format!(
        "global\n  maxconn 4000\n  nbthread {}\ndefaults\n  mode {proxy_mode}\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n",
        threads()
    );
    let front = format!(
        "{common}frontend f\n  bind {n1}:{entry}\n  default_backend b\nbackend b\n  server s {n2}:{inner}{client_tls}\n"
    );
    let back = format!(
        "{common}frontend f\n  bind {n2}:{inner}{server_tls}\n  default_backend b\nbackend b\n  server s {backend}\n"
    );
    let mut children = Vec::new();
    for (i, (node, cfg)) in [(&nodes[0], front), (&nodes[1], back)]
        .into_iter()
        .enumerate()
    {
        let path = dir.join(format!("haproxy-{i}.cfg"));
        std::fs::write(&path, cfg).unwrap();
        children.push(
            node.spawn(
                &format!("haproxy-{i}"),
                Path::new("/usr/sbin/haproxy"),
                &[
                    "-db".into(),
                    "-f".into(),
                    path.to_string_lossy().into_owned(),
                ],
                &[],
                &dir.join(format!("haproxy-{i}.log")),
            )
            .expect("run haproxy (the bench scripts install it)"),
        );
    }
    std::thread::sleep(Duration::from_secs(1));
    children
}
