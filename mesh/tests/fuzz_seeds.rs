//! The fuzzer's seed corpus stays meaningful: the valid seeds parse, the broken
//! ones are refused for the reason they were written to show.

use strait_mesh::identity::protocol::parse_request;
use strait_mesh::policy::parse_allowed;
use strait_mesh::tunnel::{
    HeaderError, Protocol, ResponseStatus, Target, TunnelHeader, TunnelResponse,
};

fn seed(name: &str) -> Vec<u8> {
    std::fs::read(format!(
        "{}/../fuzz/seeds/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("seed file")
}

#[test]
fn seeds_parse_as_intended() {
    assert!(
        parse_request(&seed("issuer_request/valid_self.json"))
            .unwrap()
            .pod
            .is_none()
    );
    assert_eq!(
        parse_request(&seed("issuer_request/valid_pod.json"))
            .unwrap()
            .pod
            .unwrap()
            .name,
        "web-0"
    );
    assert_eq!(
        parse_request(&seed("issuer_request/bad_pod.json"))
            .unwrap_err()
            .reason(),
        "bad_pod_ref"
    );
    assert_eq!(
        parse_request(&seed("issuer_request/not_pem.json"))
            .unwrap_err()
            .reason(),
        "bad_csr"
    );
}

#[test]
fn tunnel_header_seeds_decode_as_intended() {
    let header = |name: &str| TunnelHeader::decode(&seed(&format!("tunnel_header/{name}")));
    let response = |name: &str| TunnelResponse::decode(&seed(&format!("tunnel_header/{name}")));

    let (pod, n) = header("pod_v4.bin").unwrap();
    assert_eq!(pod.target.to_string(), "pod 10.1.2.3:8080");
    assert_eq!((pod.protocol, n), (Protocol::Http1, 21));
    let (multiplexed, n) = header("pod_http1_multiplexed.bin").unwrap();
    assert_eq!((multiplexed.protocol, n), (Protocol::Http1Multiplexed, 24));
    let (pod, _) = header("pod_v6.bin").unwrap();
    assert_eq!(pod.target.to_string(), "pod [fd00::1]:443");
    let (svc, _) = header("service_with_source.bin").unwrap();
    assert!(matches!(&svc.target, Target::Service { port: 8080, .. }));
    assert_eq!(
        svc.source.unwrap().to_string(),
        "spiffe://east.local/ns/shop/sa/web"
    );
    assert_eq!(
        header("unknown_optional_field.bin").unwrap().0.target,
        header("pod_v4.bin").unwrap().0.target
    );
    assert!(matches!(
        header("unknown_critical_field.bin"),
        Err(HeaderError::UnknownCriticalField { ty: 0x9f, .. })
    ));
    assert!(matches!(
        header("future_version.bin"),
        Err(HeaderError::UnsupportedVersion { peer: 2 })
    ));
    // The application's bytes after the header are not the header's.
    let with_payload = seed("tunnel_header/with_payload.bin");
    let (_, n) = header("with_payload.bin").unwrap();
    assert!(with_payload[n..].starts_with(b"GET / HTTP/1.1"));

    assert!(response("response_ok.bin").unwrap().0.is_ok());
    assert_eq!(
        response("response_denied.bin").unwrap().0.status,
        ResponseStatus::Denied
    );
}

#[test]
fn policy_seeds_parse_as_intended() {
    let value = |name: &str| String::from_utf8(seed(&format!("policy/{name}"))).unwrap();
    let counts = |name: &str| {
        let (patterns, errors) = parse_allowed(&value(name));
        (patterns.len(), errors.len())
    };
    assert_eq!(counts("exact.txt"), (1, 0));
    assert_eq!(counts("wildcards.txt"), (1, 0));
    assert_eq!(counts("list_with_spaces.txt"), (2, 0));
    assert_eq!(counts("bad_entries.txt"), (0, 4));
    assert_eq!(counts("carriers.txt"), (3, 0));
}
