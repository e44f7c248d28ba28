//! The detection fuzzer's seeds stay meaningful: each classifies as the name
//! says, so the fuzzer starts from every branch of the classifier.

use strait_proxy::detect::{Detection, Protocol, classify};

const SEEDS: &[(&str, Detection)] = &[
    ("http1_get.bin", Detection::Protocol(Protocol::Http1)),
    ("http1_post_1_0.bin", Detection::Protocol(Protocol::Http1)),
    ("http1_connect.bin", Detection::Protocol(Protocol::Http1)),
    (
        "http1_absolute_form.bin",
        Detection::Protocol(Protocol::Http1),
    ),
    (
        "http1_options_star.bin",
        Detection::Protocol(Protocol::Http1),
    ),
    (
        "h2_preface_settings.bin",
        Detection::Protocol(Protocol::Http2),
    ),
    ("h2_preface_partial.bin", Detection::NeedMore),
    (
        "h2_preface_broken.bin",
        Detection::Protocol(Protocol::Opaque),
    ),
    (
        "tls_client_hello.bin",
        Detection::Protocol(Protocol::Opaque),
    ),
    (
        "postgres_ssl_request.bin",
        Detection::Protocol(Protocol::Opaque),
    ),
    ("redis_inline.bin", Detection::Protocol(Protocol::Opaque)),
    ("memcached_get.bin", Detection::Protocol(Protocol::Opaque)),
    (
        "lowercase_method.bin",
        Detection::Protocol(Protocol::Opaque),
    ),
    (
        "http2_request_line.bin",
        Detection::Protocol(Protocol::Opaque),
    ),
];

#[test]
fn detect_seeds_classify_as_named() {
    let dir = format!("{}/../fuzz/seeds/detect", env!("CARGO_MANIFEST_DIR"));
    for (name, want) in SEEDS {
        let bytes = std::fs::read(format!("{dir}/{name}")).expect("seed file");
        assert_eq!(classify(&bytes), *want, "{name}");
    }
    // Every seed in the folder is in the table, so none goes stale unseen.
    let on_disk = std::fs::read_dir(&dir).expect("seed folder").count();
    assert_eq!(
        on_disk,
        SEEDS.len(),
        "a seed in {dir} is missing from SEEDS"
    );
}

fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = format!("{}/../fuzz/seeds/{target}", env!("CARGO_MANIFEST_DIR"));
    let mut all: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .expect("seed folder")
        .map(|e| {
            let path = e.expect("entry").path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).expect("seed file"))
        })
        .collect();
    all.sort();
    all
}

/// What the DNS fuzzer's seeds are written to reach in the responder.
#[test]
fn dns_seeds_decide_as_named() {
    use hickory_proto::op::{Message, ResponseCode};
    use std::net::IpAddr;
    use strait_proxy::dns::{Decision, ServiceNames, decide};

    struct Names;
    impl ServiceNames for Names {
        fn lookup(&self, host: &str) -> Option<Vec<IpAddr>> {
            match host.trim_end_matches('.') {
                "web.shop.svc.cluster.local" | "web.shop.svc.clusterset.local" => {
                    Some(vec!["10.96.0.10".parse().unwrap()])
                }
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
    let all = seeds("dns");
    assert_eq!(
        all.len(),
        11,
        "a seed was added or removed: update this table"
    );
    for (name, bytes) in all {
        let request = Message::from_vec(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = match decide(&request, &Names) {
            Decision::Forward => "forward".to_string(),
            Decision::Answer(a) if a.metadata.truncation => "truncated".to_string(),
            Decision::Answer(a) => format!("{:?} {}", a.metadata.response_code, a.answers.len()),
        };
        let want = match name.as_str() {
            "a_service.bin" | "a_clusterset.bin" => format!("{:?} 1", ResponseCode::NoError),
            "aaaa_service_edns.bin" | "txt_service.bin" => format!("{:?} 0", ResponseCode::NoError),
            "a_headless_truncated.bin" => "truncated".into(),
            "a_headless_edns_4096.bin" => format!("{:?} 60", ResponseCode::NoError),
            "a_unknown_service.bin" => format!("{:?} 0", ResponseCode::NXDomain),
            "a_external.bin" => "forward".into(),
            "notify_opcode.bin" => format!("{:?} 0", ResponseCode::NotImp),
            "two_questions.bin" | "response_not_query.bin" => {
                format!("{:?} 0", ResponseCode::FormErr)
            }
            other => panic!("seed {other} is not in this table"),
        };
        assert_eq!(got, want, "{name}");
    }
}

/// What the enrollment fuzzer's seeds are written to show.
#[test]
fn enroll_seeds_parse_as_named() {
    use strait_proxy::transparent::{EnrollError, EnrollRequest, parse_request};

    for (name, bytes) in seeds("enroll") {
        let got = parse_request(std::str::from_utf8(&bytes).expect("UTF-8"));
        match name.as_str() {
            "add.json" => assert!(matches!(got, Ok(EnrollRequest::Add { .. })), "{name}"),
            "remove.json" => assert!(matches!(got, Ok(EnrollRequest::Remove { .. })), "{name}"),
            "unknown_op.json" => assert!(matches!(got, Err(EnrollError::NotARequest(_))), "{name}"),
            "no_newline.json" => assert!(matches!(got, Err(EnrollError::TooLong)), "{name}"),
            n if n.starts_with("add_invalid_name") || n.starts_with("remove_outside_state") => {
                assert!(
                    matches!(got, Err(EnrollError::InvalidName { .. })),
                    "{name}: {got:?}"
                )
            }
            other => panic!("seed {other} is not in this table"),
        }
    }
}
