//! `strait identity`: makes anchors and issuers, and refuses unusable ones with
//! a message that says what to fix.

use std::path::Path;
use std::process::{Command, Output};

fn strait(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strait"))
        .args(args)
        .output()
        .expect("run strait")
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "strait failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn refused(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "should have been refused");
    assert!(
        stderr.contains(needle),
        "error should say {needle:?}; it said: {stderr}"
    );
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn anchor(dir: &Path) {
    ok(&strait(&["identity", "trust-anchor", "--out-dir", p(dir)]));
}

fn issuer(anchor_dir: &Path, out: &Path) -> Output {
    strait(&[
        "identity",
        "issuer",
        "--cluster",
        "east",
        "--anchor-cert",
        p(&anchor_dir.join("ca.crt")),
        "--anchor-key",
        p(&anchor_dir.join("ca.key")),
        "--out-dir",
        p(out),
    ])
}

fn verify(cert: &Path, key: &Path, anchors: &Path) -> Output {
    strait(&[
        "identity",
        "verify",
        "--issuer-cert",
        p(cert),
        "--issuer-key",
        p(key),
        "--trust-anchors",
        p(anchors),
    ])
}

#[test]
fn makes_an_anchor_and_an_issuer_that_verify_and_inspect() {
    let dir = tempfile::tempdir().unwrap();
    let (a, e) = (dir.path().join("anchor"), dir.path().join("east"));
    anchor(&a);
    ok(&issuer(&a, &e));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(e.join("issuer.key"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "keys are private");
    ok(&verify(
        &e.join("issuer.crt"),
        &e.join("issuer.key"),
        &a.join("ca.crt"),
    ));

    let chain = dir.path().join("chain.pem");
    let text = std::fs::read_to_string(e.join("issuer.crt")).unwrap()
        + &std::fs::read_to_string(a.join("ca.crt")).unwrap();
    std::fs::write(&chain, text).unwrap();
    let report = ok(&strait(&["identity", "inspect", p(&chain)]));
    assert!(
        report.contains("intermediate CA (issuer)") && report.contains("root CA (trust anchor)"),
        "{report}"
    );
    assert!(
        report.contains("signed by certificate #2") && report.contains("self-signed"),
        "{report}"
    );
    assert!(report.contains("CN=strait issuer east"), "{report}");

    let secret = ok(&strait(&[
        "identity",
        "issuer",
        "--cluster",
        "west",
        "-o",
        "yaml",
        "--anchor-cert",
        p(&a.join("ca.crt")),
        "--anchor-key",
        p(&a.join("ca.key")),
    ]));
    let doc: serde_yaml::Value = serde_yaml::from_str(&secret).unwrap();
    assert_eq!(doc["kind"], "Secret");
    assert_eq!(doc["type"], "kubernetes.io/tls");
    for key in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(
            doc["data"][key].as_str().is_some_and(|v| !v.is_empty()),
            "{key} missing: {secret}"
        );
    }
}

#[test]
fn refuses_an_issuer_that_cannot_sign() {
    let dir = tempfile::tempdir().unwrap();
    let (a, other, e) = (
        dir.path().join("anchor"),
        dir.path().join("other"),
        dir.path().join("east"),
    );
    anchor(&a);
    anchor(&other);
    ok(&issuer(&a, &e));

    // Key that does not match the certificate.
    refused(
        &verify(&e.join("issuer.crt"), &a.join("ca.key"), &a.join("ca.crt")),
        "private key does not belong",
    );
    // Signed by another anchor.
    refused(
        &verify(
            &e.join("issuer.crt"),
            &e.join("issuer.key"),
            &other.join("ca.crt"),
        ),
        "not signed by any certificate in the trust-anchor bundle",
    );
    // A leaf is not a CA: make one and try to issue with it.
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["leaf.example".to_string()]).unwrap();
    params.is_ca = rcgen::IsCa::ExplicitNoCa;
    let leaf = params.self_signed(&leaf_key).unwrap();
    std::fs::write(dir.path().join("leaf.crt"), leaf.pem()).unwrap();
    std::fs::write(dir.path().join("leaf.key"), leaf_key.serialize_pem()).unwrap();
    refused(
        &verify(
            &dir.path().join("leaf.crt"),
            &dir.path().join("leaf.key"),
            &a.join("ca.crt"),
        ),
        "is not a CA certificate",
    );
    let leaf_as_anchor = strait(&[
        "identity",
        "issuer",
        "--cluster",
        "x",
        "--out-dir",
        p(&dir.path().join("x")),
        "--anchor-cert",
        p(&dir.path().join("leaf.crt")),
        "--anchor-key",
        p(&dir.path().join("leaf.key")),
    ]);
    refused(&leaf_as_anchor, "is not a CA certificate");

    // Expired, and not yet valid, CAs.
    for (name, from, to, needle) in [
        (
            "expired",
            time::Duration::days(-10),
            time::Duration::days(-1),
            "expired at",
        ),
        (
            "future",
            time::Duration::days(1),
            time::Duration::days(10),
            "not valid yet",
        ),
    ] {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now + from;
        params.not_after = now + to;
        let cert = params.self_signed(&key).unwrap();
        let (c, k) = (
            dir.path().join(format!("{name}.crt")),
            dir.path().join(format!("{name}.key")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        refused(&verify(&c, &k, &c), needle);
        let out = strait(&[
            "identity",
            "issuer",
            "--cluster",
            "x",
            "--out-dir",
            p(&dir.path().join(name)),
            "--anchor-cert",
            p(&c),
            "--anchor-key",
            p(&k),
        ]);
        refused(&out, needle);
    }
    // No destination given.
    let out = strait(&[
        "identity",
        "issuer",
        "--cluster",
        "x",
        "--anchor-cert",
        p(&a.join("ca.crt")),
        "--anchor-key",
        p(&a.join("ca.key")),
    ]);
    refused(&out, "--out-dir DIR, or -o yaml|json");
}
