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
