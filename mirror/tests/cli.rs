//! The binary starts and explains itself.

use std::process::Command;

#[test]
fn answers_help_and_version() {
    let help = Command::new(env!("CARGO_BIN_EXE_strait-mirror"))
        .arg("--help")
        .output()
        .expect("run strait-mirror --help");
    assert!(help.status.success(), "{help:?}");
    let text = String::from_utf8_lossy(&help.stdout).to_lowercase();
    assert!(text.contains("usage: strait-mirror"), "{text}");
    assert!(
        text.contains("mirror"),
        "help should say what the binary is: {text}"
    );

    let version = Command::new(env!("CARGO_BIN_EXE_strait-mirror"))
        .arg("--version")
        .output()
        .expect("run strait-mirror --version");
    assert!(version.status.success(), "{version:?}");
    assert!(String::from_utf8_lossy(&version.stdout).contains(env!("CARGO_PKG_VERSION")));
}

#[test]
fn rejects_an_unknown_flag_with_a_usage_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_strait-mirror"))
        .arg("--no-such-flag")
        .output()
        .expect("run strait-mirror");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-such-flag"));
}

#[test]
fn without_an_identity_it_refuses_to_start_and_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_strait-mirror"))
        .args(["--admin-addr=127.0.0.1:0", "--trust-anchors"])
        .arg(dir.path().join("missing-ca.crt"))
        .env_remove("KUBECONFIG")
        .output()
        .expect("run strait-mirror");
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("missing-ca.crt") && stderr.contains("--no-gateway-probe"),
        "the error names the missing file and the way out: {stderr}"
    );
}

/// The shipped CRD is what the code generates: a stale file would make the API
/// server prune fields the controller reads (it once spelled `stalenessTtl`
/// while the code reads `stalenessTTL`).
#[test]
fn the_shipped_crds_are_the_generated_ones() {
    for (args, file) in [
        (&["crd"][..], "mirror/crd.yaml"),
        (&["crd", "--mcs"][..], "mcs/crds.yaml"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_strait-mirror"))
            .args(args)
            .output()
            .expect("run strait-mirror crd");
        assert!(out.status.success(), "{out:?}");
        let shipped = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../deploy")
                .join(file),
        )
        .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout) == shipped,
            "deploy/{file} is stale: regenerate it with `cargo run -p strait-mirror -- {} > deploy/{file}`",
            args.join(" ")
        );
    }
}
