//! Every shell script of the repository (scripts/, testenv/kind/, any other
//! *.sh) passes shellcheck, following what they `source`. The kind scripts
//! cannot run here (no Docker): this and the manifest dry-run test
//! (link-cli/tests/install/) are what checks them.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every *.sh under `dir`, skipping build output and VCS folders.
fn shell_scripts(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | "corpus" | "artifacts") {
                shell_scripts(&path, out);
            }
        } else if name.ends_with(".sh") {
            out.push(path);
        }
    }
}

#[test]
fn every_shell_script_passes_shellcheck() {
    let root = repo_root();
    let mut scripts = Vec::new();
    shell_scripts(&root, &mut scripts);
    scripts.sort();
    for expected in [
        "scripts/test.sh",
        "testenv/kind/up.sh",
        "testenv/kind/down.sh",
    ] {
        assert!(
            scripts.contains(&root.join(expected)),
            "{expected} not found among {scripts:?}"
        );
    }
    let out = Command::new("shellcheck")
        .args(["--external-sources", "--source-path=SCRIPTDIR"])
        .args(&scripts)
        .current_dir(&root)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "shellcheck could not run ({e}): install it (`apt-get install shellcheck`; scripts/lib.sh lists it, so `bash scripts/test.sh` does)"
            )
        });
    assert!(
        out.status.success(),
        "shellcheck found problems in {} script(s) checked:\n{}{}",
        scripts.len(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
