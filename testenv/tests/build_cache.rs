//! The control-plane build is cached by content hash, and parallel processes
//! do not race it: one builds, the other waits on the file lock and reuses it.

use std::process::{Command, Output};

fn build_in(cache: &std::path::Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_strait-testenv"))
        .arg("build")
        .env("STRAIT_CACHE_DIR", cache)
        .env_remove("STRAIT_CONTROLPLANE_BIN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn strait-testenv build")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn two_processes_build_once_and_share_the_cached_binary() {
    let cache = tempfile::tempdir().unwrap();
    // Go's own build cache is warm after the first build on a machine, so this
    // costs a link, not a cold compile.
    let (a, b) = (build_in(cache.path()), build_in(cache.path()));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let ((path_a, err_a), (path_b, err_b)) = (text(&a), text(&b));
    assert!(a.status.success(), "first build failed:\n{err_a}");
    assert!(b.status.success(), "second build failed:\n{err_b}");
    assert_eq!(
        path_a, path_b,
        "both processes must use the same cached binary"
    );
    let builds = [&err_a, &err_b]
        .iter()
        .filter(|e| e.contains("control plane built in"))
        .count();
    assert_eq!(
        builds, 1,
        "exactly one process builds; stderr:\n--- a ---\n{err_a}\n--- b ---\n{err_b}"
    );
    assert!(
        path_a.starts_with(cache.path().to_str().unwrap()),
        "{path_a}"
    );

    let version = Command::new(&path_a).arg("version").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        strait_testenv::controlplane::kubernetes_version(
            &strait_testenv::controlplane::source_dir()
        )
        .unwrap()
    );

    // A third call finds it in the cache and builds nothing.
    let c = build_in(cache.path()).wait_with_output().unwrap();
    let (path_c, err_c) = text(&c);
    assert_eq!(path_c, path_a);
    assert!(
        !err_c.contains("building"),
        "a warm cache must not rebuild:\n{err_c}"
    );
}
