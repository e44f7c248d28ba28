//! The fuzzer's seed corpus stays meaningful: the valid seeds parse, the broken
//! ones are refused for the reason they were written to show.

use strait_mesh::identity::protocol::parse_request;

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
        parse_request(&seed("valid_self.json"))
            .unwrap()
            .pod
            .is_none()
    );
    assert_eq!(
        parse_request(&seed("valid_pod.json"))
            .unwrap()
            .pod
            .unwrap()
            .name,
        "web-0"
    );
    assert_eq!(
        parse_request(&seed("bad_pod.json")).unwrap_err().reason(),
        "bad_pod_ref"
    );
    assert_eq!(
        parse_request(&seed("not_pem.json")).unwrap_err().reason(),
        "bad_csr"
    );
}
