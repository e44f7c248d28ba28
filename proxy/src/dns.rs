//! The DNS responder of transparent mode, as ztunnel has one: a pod whose
//! traffic the proxy captures resolves `<svc>.<ns>.svc.<cluster domain>`
//! here, from the proxy's own discovery, so transparent mode works without
//! CoreDNS (and a Service is resolvable the moment the proxy knows it).
//!
//! - A name under `svc.<cluster domain>` is ours: a Service answers its
//!   ClusterIPs (a headless one, its ready endpoints' addresses), `A` records
//!   with a TTL of [`TTL`]; `AAAA` and other types of a known name answer
//!   NOERROR with no records; an unknown Service is NXDOMAIN. Authoritative:
//!   the proxy watches every Service of the cluster.
//! - Any other name is forwarded unchanged to the upstream resolver and its
//!   answer relayed (SERVFAIL when it does not answer within
//!   [`UPSTREAM_TIMEOUT`]; REFUSED when no upstream is configured).
//!
//! The deciding part ([`decide`]) is pure; [`serve_udp`] is the socket loop.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{RData, Record, RecordType};
use tokio::net::UdpSocket;

/// TTL of the records the responder makes (CoreDNS's default for Services).
pub const TTL: u32 = 5;
/// How long a forwarded query may wait for the upstream resolver.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest UDP message read or relayed.
const MAX_MESSAGE: usize = 4096;

/// What the responder needs from discovery.
pub trait ServiceNames: Send + Sync + 'static {
    /// The addresses of the Service named by the full `host`, `None` when no
    /// such Service exists.
    fn lookup(&self, host: &str) -> Option<Vec<IpAddr>>;
    /// The cluster's DNS domain (`cluster.local`).
    fn cluster_domain(&self) -> String;
}

/// What to do with one query.
#[derive(Debug)]
pub enum Decision {
    /// Answer with this message.
    Answer(Message),
    /// Not ours: forward to the upstream resolver.
    Forward,
}

/// Decides one query: a Service name is answered here, anything else goes
/// upstream. Pure.
pub fn decide(request: &Message, names: &dyn ServiceNames) -> Decision {
    let id = request.metadata.id;
    if request.metadata.message_type != MessageType::Query {
        return Decision::Answer(Message::error_msg(
            id,
            request.metadata.op_code,
            ResponseCode::FormErr,
        ));
    }
    if request.metadata.op_code != OpCode::Query {
        return Decision::Answer(Message::error_msg(
            id,
            request.metadata.op_code,
            ResponseCode::NotImp,
        ));
    }
    let [query] = request.queries.as_slice() else {
        // Resolvers send exactly one question; several are not defined in practice.
        return Decision::Answer(Message::error_msg(id, OpCode::Query, ResponseCode::FormErr));
    };
    let name = query.name().to_ascii().to_ascii_lowercase();
    let zone = format!(
        "svc.{}.",
        names
            .cluster_domain()
            .trim_end_matches('.')
            .to_ascii_lowercase()
    );
    // The cluster's zone and the clusterset's (`<svc>.<ns>.svc.clusterset.local`,
    // the MCS API's ClusterSetIPs).
    let clusterset_zone = format!("svc.{}.", strait_mesh::names::CLUSTERSET_DOMAIN);
    let ours = |zone: &str| name.ends_with(&format!(".{zone}")) || name == zone;
    if !(ours(&zone) || ours(&clusterset_zone)) {
        return Decision::Forward;
    }
    let mut response = Message::new(id, MessageType::Response, OpCode::Query);
    response.metadata.authoritative = true;
    response.metadata.recursion_desired = request.metadata.recursion_desired;
    response.metadata.recursion_available = true;
    if request.edns.is_some() {
        response.edns = Some(Edns::new());
    }
    response.add_query(query.clone());
    let Some(ips) = names.lookup(&name) else {
        response.metadata.response_code = ResponseCode::NXDomain;
        return Decision::Answer(response);
    };
    for ip in ips {
        let rdata = match (ip, query.query_type()) {
            (IpAddr::V4(v4), RecordType::A) => RData::A(A(v4)),
            (IpAddr::V6(v6), RecordType::AAAA) => RData::AAAA(AAAA(v6)),
            _ => continue,
        };
        response.add_answer(Record::from_rdata(query.name().clone(), TTL, rdata));
    }
    // A headless Service with many pods can exceed a plain-DNS client's 512
    // bytes: say so (TC) and let it retry over TCP, which goes upstream.
    let limit = usize::from(request.max_payload());
    if response.to_vec().map_or(0, |b| b.len()) > limit {
        response.answers.clear();
        response.metadata.truncation = true;
    }
    Decision::Answer(response)
}

/// The responder: discovery for Service names, an upstream for the rest.
pub struct DnsResponder {
    pub names: Arc<dyn ServiceNames>,
    /// Where other names go (the node's resolver); `None`: refuse them.
    pub upstream: Option<SocketAddr>,
}

impl DnsResponder {
    /// The answer to one UDP query, or `None` for a message that is not DNS
    /// (dropped: answering garbage only helps reflection attacks).
    pub async fn respond(&self, query: &[u8]) -> Option<Vec<u8>> {
        let request = Message::from_vec(query).ok()?;
        let answer = match decide(&request, &*self.names) {
            Decision::Answer(message) => message,
            Decision::Forward => match self.upstream {
                Some(upstream) => match forward(upstream, query, request.metadata.id).await {
                    Ok(bytes) => return Some(bytes),
                    Err(e) => {
                        tracing::debug!(%upstream, "DNS upstream: {e}");
                        error_answer(&request, ResponseCode::ServFail)
                    }
                },
                None => error_answer(&request, ResponseCode::Refused),
            },
        };
        answer.to_vec().ok()
    }
}

fn error_answer(request: &Message, code: ResponseCode) -> Message {
    let mut message = Message::error_msg(request.metadata.id, OpCode::Query, code);
    message.queries = request.queries.clone();
    message.metadata.recursion_desired = request.metadata.recursion_desired;
    message
}

/// Sends `query` to `upstream` from a fresh socket and returns its answer.
async fn forward(upstream: SocketAddr, query: &[u8], id: u16) -> std::io::Result<Vec<u8>> {
    let bind: SocketAddr = if upstream.is_ipv4() {
        "0.0.0.0:0".parse().expect("valid")
    } else {
        "[::]:0".parse().expect("valid")
    };
    let socket = UdpSocket::bind(bind).await?;
    socket.connect(upstream).await?;
    socket.send(query).await?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
    loop {
        let n = tokio::time::timeout_at(deadline, socket.recv(&mut buf))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))??;
        // Ignore stray datagrams: only the answer to this query counts.
        if n >= 2 && u16::from_be_bytes([buf[0], buf[1]]) == id {
            buf.truncate(n);
            return Ok(buf);
        }
    }
}

/// Answers queries on `socket` until the task is dropped. Each query is
/// handled in its own task (a slow upstream holds up nobody else).
pub async fn serve_udp(socket: UdpSocket, responder: Arc<DnsResponder>) {
    let socket = Arc::new(socket);
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let (n, peer) = match socket.recv_from(&mut buf).await {
            Ok(got) => got,
            Err(e) => {
                tracing::debug!("DNS receive: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let query = buf[..n].to_vec();
        let (socket, responder) = (socket.clone(), responder.clone());
        tokio::spawn(async move {
            if let Some(answer) = responder.respond(&query).await {
                let _ = socket.send_to(&answer, peer).await;
            }
        });
    }
}

/// The first `nameserver` of a resolv.conf text that can serve the proxy's
/// own network namespace (a loopback stub such as systemd-resolved's
/// 127.0.0.53 is not reachable from where queries are forwarded).
pub fn upstream_from_resolv_conf(text: &str) -> Option<SocketAddr> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<IpAddr>().ok())
        .find(|ip| !ip.is_loopback())
        .map(|ip| SocketAddr::new(ip, 53))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::Name;
    use std::str::FromStr;

    struct Names;
    impl ServiceNames for Names {
        fn lookup(&self, host: &str) -> Option<Vec<IpAddr>> {
            match host.trim_end_matches('.') {
                "web.shop.svc.cluster.local" => Some(vec!["10.96.0.10".parse().unwrap()]),
                "web.shop.svc.clusterset.local" => Some(vec!["10.96.0.30".parse().unwrap()]),
                "db.shop.svc.cluster.local" => {
                    Some((1..=60).map(|i| IpAddr::from([10, 244, 1, i])).collect())
                }
                _ => None,
            }
        }
        fn cluster_domain(&self) -> String {
            "cluster.local".into()
        }
    }

    fn query(name: &str, kind: RecordType) -> Message {
        let mut m = Message::new(7, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_str(name).unwrap(), kind));
        m
    }

    fn answer(m: &Message) -> Message {
        match decide(m, &Names) {
            Decision::Answer(a) => a,
            Decision::Forward => panic!("expected an answer, got forward"),
        }
    }

    #[test]
    fn services_answer_their_addresses_authoritatively() {
        let a = answer(&query("Web.Shop.svc.cluster.local.", RecordType::A));
        assert_eq!(a.metadata.id, 7);
        assert_eq!(a.metadata.response_code, ResponseCode::NoError);
        assert!(a.metadata.authoritative);
        assert_eq!(a.answers.len(), 1);
        assert_eq!(a.answers[0].ttl, TTL);
        assert_eq!(
            a.answers[0].data,
            RData::A(A("10.96.0.10".parse().unwrap()))
        );
        // The question is echoed.
        assert!(
            a.queries[0]
                .name()
                .to_ascii()
                .eq_ignore_ascii_case("web.shop.svc.cluster.local.")
        );
    }

    #[test]
    fn clusterset_names_are_answered_too() {
        let a = answer(&query("web.shop.svc.clusterset.local.", RecordType::A));
        assert_eq!(
            a.answers[0].data,
            RData::A(A("10.96.0.30".parse().unwrap()))
        );
        let missing = answer(&query("nope.shop.svc.clusterset.local.", RecordType::A));
        assert_eq!(missing.metadata.response_code, ResponseCode::NXDomain);
    }

    #[test]
    fn known_names_without_records_of_a_type_are_nodata_and_unknown_are_nxdomain() {
        let aaaa = answer(&query("web.shop.svc.cluster.local.", RecordType::AAAA));
        assert_eq!(aaaa.metadata.response_code, ResponseCode::NoError);
        assert!(aaaa.answers.is_empty());
        let missing = answer(&query("nope.shop.svc.cluster.local.", RecordType::A));
        assert_eq!(missing.metadata.response_code, ResponseCode::NXDomain);
        let zone = answer(&query("svc.cluster.local.", RecordType::A));
        assert_eq!(zone.metadata.response_code, ResponseCode::NXDomain);
    }

    #[test]
    fn other_names_are_forwarded() {
        for name in [
            "example.com.",
            "web.shop.svc.cluster.local.example.com.",
            "cluster.local.",
            "web.shop.svc.other.",
        ] {
            assert!(
                matches!(
                    decide(&query(name, RecordType::A), &Names),
                    Decision::Forward
                ),
                "{name}"
            );
        }
    }

    #[test]
    fn an_answer_too_big_for_plain_udp_is_truncated_and_fits_with_edns() {
        let plain = answer(&query("db.shop.svc.cluster.local.", RecordType::A));
        assert!(plain.metadata.truncation);
        assert!(plain.answers.is_empty());
        let mut big = query("db.shop.svc.cluster.local.", RecordType::A);
        let mut edns = Edns::new();
        edns.set_max_payload(4096);
        big.edns = Some(edns);
        let full = answer(&big);
        assert!(!full.metadata.truncation);
        assert_eq!(full.answers.len(), 60);
    }

    #[test]
    fn not_a_query_is_an_error_answer() {
        let mut m = query("web.shop.svc.cluster.local.", RecordType::A);
        m.metadata.op_code = OpCode::Update;
        assert_eq!(answer(&m).metadata.response_code, ResponseCode::NotImp);
        let mut two = query("web.shop.svc.cluster.local.", RecordType::A);
        two.add_query(Query::query(
            Name::from_str("example.com.").unwrap(),
            RecordType::A,
        ));
        assert_eq!(answer(&two).metadata.response_code, ResponseCode::FormErr);
    }

    #[test]
    fn upstream_is_the_first_non_loopback_nameserver() {
        let conf = "# generated\nsearch example\nnameserver 127.0.0.53\nnameserver 10.0.0.2\nnameserver 10.0.0.3\n";
        assert_eq!(
            upstream_from_resolv_conf(conf),
            Some("10.0.0.2:53".parse().unwrap())
        );
        assert_eq!(upstream_from_resolv_conf("nameserver 127.0.0.1\n"), None);
    }
}
