//! A tiny authoritative DNS server on a loopback UDP port whose A/AAAA records
//! tests can change while it runs (gateway hostnames that move, for example).
//!
//! Answers carry a short TTL so resolvers see changes quickly; unknown names
//! get NXDOMAIN. Not a general-purpose server: one question per message.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use tokio::net::UdpSocket;

type Records = Arc<Mutex<HashMap<String, Vec<IpAddr>>>>;

/// A running test DNS server. Stops when dropped.
pub struct TestDns {
    addr: SocketAddr,
    records: Records,
    queries: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestDns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// TTL of every answer, in seconds.
pub const TTL: u32 = 1;

fn key(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

impl TestDns {
    /// Starts a server on 127.0.0.1 with a free port.
    pub async fn start() -> io::Result<Self> {
        let socket = UdpSocket::bind("127.0.0.1:0").await?;
        let addr = socket.local_addr()?;
        let records: Records = Arc::default();
        let queries = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let task = tokio::spawn(serve(socket, records.clone(), queries.clone()));
        Ok(Self {
            addr,
            records,
            queries,
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets (replaces) the addresses of `name`; an empty list removes it.
    pub fn set(&self, name: &str, ips: &[IpAddr]) {
        let mut records = self.records.lock().unwrap_or_else(|e| e.into_inner());
        if ips.is_empty() {
            records.remove(&key(name));
        } else {
            records.insert(key(name), ips.to_vec());
        }
    }

    /// Questions answered so far.
    pub fn queries(&self) -> u64 {
        self.queries.load(std::sync::atomic::Ordering::Relaxed)
    }
}

async fn serve(socket: UdpSocket, records: Records, queries: Arc<std::sync::atomic::AtomicU64>) {
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok((n, peer)) = socket.recv_from(&mut buf).await else {
            continue;
        };
        let Ok(request) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        queries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let response = answer(&request, &records);
        if let Ok(bytes) = response.to_vec() {
            let _ = socket.send_to(&bytes, peer).await;
        }
    }
}

fn answer(request: &Message, records: &Records) -> Message {
    let id = request.metadata.id;
    let Some(query) = request.queries.first() else {
        return Message::error_msg(id, OpCode::Query, ResponseCode::FormErr);
    };
    let mut response = Message::new(id, MessageType::Response, OpCode::Query);
    response.metadata.authoritative = true;
    response.metadata.recursion_desired = request.metadata.recursion_desired;
    response.add_query(query.clone());
    let name: &Name = query.name();
    let ips = records
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key(&name.to_string()))
        .cloned();
    let Some(ips) = ips else {
        response.metadata.response_code = ResponseCode::NXDomain;
        return response;
    };
    for ip in ips {
        let rdata = match (ip, query.query_type()) {
            (IpAddr::V4(v4), RecordType::A) => RData::A(A(v4)),
            (IpAddr::V6(v6), RecordType::AAAA) => RData::AAAA(AAAA(v6)),
            _ => continue,
        };
        response.add_answer(Record::from_rdata(name.clone(), TTL, rdata));
    }
    response
}
