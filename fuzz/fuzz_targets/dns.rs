//! Fuzzes the transparent-mode DNS responder on any datagram a pod sends it.
#![no_main]

use std::net::IpAddr;
use std::sync::Arc;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{RData, RecordType};
use libfuzzer_sys::fuzz_target;
use strait_proxy::dns::{Decision, DnsResponder, ServiceNames, TTL, decide};

/// Discovery with a Service of each kind the responder distinguishes.
struct Names;

impl ServiceNames for Names {
    fn lookup(&self, host: &str) -> Option<Vec<IpAddr>> {
        match host.trim_end_matches('.') {
            "web.shop.svc.cluster.local" => Some(vec![
                "10.96.0.10".parse().unwrap(),
                "fd00::10".parse().unwrap(),
            ]),
            "web.shop.svc.clusterset.local" => Some(vec!["10.96.0.30".parse().unwrap()]),
            // Headless, with more addresses than 512 bytes hold.
            "db.shop.svc.cluster.local" => Some(
                (1..=60)
                    .map(|i| IpAddr::from([10, 244, 1, i]))
                    .chain((1..=60).map(|i| IpAddr::from([0xfd00, 0, 0, 0, 0, 0, 0, i])))
                    .collect(),
            ),
            _ => None,
        }
    }
    fn cluster_domain(&self) -> String {
        "cluster.local".into()
    }
}

fuzz_target!(|data: &[u8]| {
    // No upstream: a forwarded query is refused, so nothing leaves the process.
    let responder = DnsResponder {
        names: Arc::new(Names),
        upstream: None,
    };
    let reply = futures::executor::block_on(responder.respond(data));
    let Ok(request) = Message::from_vec(data) else {
        // Garbage is dropped: answering it only helps reflection attacks.
        assert!(reply.is_none(), "answered bytes that are not DNS");
        return;
    };
    let Some(reply) = reply else {
        // A DNS message the responder cannot answer: the client times out.
        panic!("no answer to a DNS message: {request:?}");
    };
    let answer = Message::from_vec(&reply).expect("the answer is DNS");
    assert_eq!(answer.metadata.id, request.metadata.id);
    assert_eq!(answer.metadata.message_type, MessageType::Response);
    let ours = is_ours(&request);
    match decide(&request, &Names) {
        Decision::Forward => {
            assert!(!ours.unwrap_or(true), "forwarded {request:?}");
            assert_eq!(answer.metadata.response_code, ResponseCode::Refused);
            assert!(answer.answers.is_empty());
        }
        Decision::Answer(_) if ours == Some(true) => check_ours(&request, &answer, reply.len()),
        Decision::Answer(_) => {
            // Not a plain question: refused as malformed or not implemented.
            assert!(ours.is_none(), "answered here {request:?}");
            assert!(matches!(
                answer.metadata.response_code,
                ResponseCode::FormErr | ResponseCode::NotImp
            ));
            assert!(answer.answers.is_empty());
        }
    }
});

/// `None` for what is not one standard question; else whether the name is
/// in the cluster's or the clusterset's `svc` zone (a plain re-reading).
fn is_ours(request: &Message) -> Option<bool> {
    if request.metadata.message_type != MessageType::Query
        || request.metadata.op_code != OpCode::Query
        || request.queries.len() != 1
    {
        return None;
    }
    let name = request.queries[0].name().to_ascii().to_ascii_lowercase();
    let labels: Vec<&str> = name.trim_end_matches('.').split('.').collect();
    let zone = |domain: &[&str]| {
        labels.len() >= domain.len() + 1
            && labels[labels.len() - domain.len() - 1] == "svc"
            && labels.ends_with(domain)
    };
    Some(zone(&["cluster", "local"]) || zone(&["clusterset", "local"]))
}

fn check_ours(request: &Message, answer: &Message, size: usize) {
    let query = &request.queries[0];
    assert!(answer.metadata.authoritative);
    assert_eq!(answer.queries, request.queries, "the question is echoed");
    let host = query.name().to_ascii().to_ascii_lowercase();
    let known = Names.lookup(&host);
    match (&known, answer.metadata.response_code) {
        (None, ResponseCode::NXDomain) | (Some(_), ResponseCode::NoError) => {}
        (known, code) => panic!("{host}: {code:?} though discovery says {known:?}"),
    }
    if answer.metadata.truncation {
        // Too big for the client: nothing but the flag, so it retries over TCP.
        assert!(answer.answers.is_empty());
    } else {
        assert!(size <= usize::from(request.max_payload()), "{size} bytes");
    }
    for record in &answer.answers {
        assert_eq!(&record.name, query.name());
        assert_eq!(record.ttl, TTL);
        let ip = match (&record.data, query.query_type()) {
            (RData::A(a), RecordType::A) => IpAddr::V4(a.0),
            (RData::AAAA(a), RecordType::AAAA) => IpAddr::V6(a.0),
            (data, asked) => panic!("{data:?} in answer to {asked:?}"),
        };
        assert!(known.as_ref().is_some_and(|ips| ips.contains(&ip)));
    }
}
