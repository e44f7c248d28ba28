//! The binary starts and explains itself.

use std::process::Command;

#[test]
fn answers_help_and_version() {
    let help = Command::new(env!("CARGO_BIN_EXE_strait-proxy"))
        .arg("--help")
        .output()
        .expect("run strait-proxy --help");
    assert!(help.status.success(), "{help:?}");
    let text = String::from_utf8_lossy(&help.stdout).to_lowercase();
    assert!(text.contains("usage: strait-proxy"), "{text}");
    assert!(
        text.contains("proxy"),
        "help should say what the binary is: {text}"
    );

    let version = Command::new(env!("CARGO_BIN_EXE_strait-proxy"))
        .arg("--version")
        .output()
        .expect("run strait-proxy --version");
    assert!(version.status.success(), "{version:?}");
    assert!(String::from_utf8_lossy(&version.stdout).contains(env!("CARGO_PKG_VERSION")));
}

#[test]
fn rejects_an_unknown_flag_with_a_usage_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_strait-proxy"))
        .arg("--no-such-flag")
        .output()
        .expect("run strait-proxy");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-such-flag"));
}

#[test]
fn without_its_trust_anchors_it_refuses_to_start_and_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_strait-proxy"))
        .args([
            "--node-name=n1",
            "--admin-addr=127.0.0.1:0",
            "--trust-anchors",
        ])
        .arg(dir.path().join("missing-ca.crt"))
        .output()
        .expect("run strait-proxy");
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("missing-ca.crt"), "{stderr}");
}
