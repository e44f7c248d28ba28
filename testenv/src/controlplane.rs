//! Builds the control-plane binary (etcd, kube-apiserver, kube-controller-manager)
//! from the Go module in `testenv/controlplane/`, once, into a cache keyed by a
//! hash of everything that goes into it.
//!
//! A cold build compiles most of Kubernetes and takes many minutes on two cores,
//! so: the result is cached by content hash (a second run, or a fresh clone on the
//! same machine, reuses it); parallel test processes serialise on a file lock and
//! the losers reuse the winner's binary; progress is printed while it builds.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// Name of the binary in the cache.
pub const BINARY_NAME: &str = "strait-controlplane";

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(
        "the `go` command was not found ({0}): install Go 1.26 or newer (it is on every machine of this project's kind), or set STRAIT_CONTROLPLANE_BIN to a prebuilt control plane"
    )]
    GoMissing(std::io::Error),
    #[error(
        "control-plane sources not found at {0}: set STRAIT_CONTROLPLANE_SRC to the testenv/controlplane folder of a Strait checkout"
    )]
    SourcesMissing(PathBuf),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot prepare the cache at {path}: {source}; set STRAIT_CACHE_DIR to a writable folder"
    )]
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`go {step}` failed ({status}); its output:\n{output}")]
    Go {
        step: &'static str,
        status: String,
        output: String,
    },
    #[error("no `k8s.io/kubernetes vX.Y.Z` requirement in {0}")]
    NoKubernetesVersion(PathBuf),
}

/// Where the Go module lives: `STRAIT_CONTROLPLANE_SRC`, else this crate's folder.
pub fn source_dir() -> PathBuf {
    std::env::var_os("STRAIT_CONTROLPLANE_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("controlplane"))
}

/// Root of Strait's build cache: `STRAIT_CACHE_DIR`, else `$XDG_CACHE_HOME/strait`,
/// else `~/.cache/strait`.
pub fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("STRAIT_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("strait");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("strait")
}

/// The Kubernetes release the Go module pins, e.g. `v1.36.3`.
pub fn kubernetes_version(src: &Path) -> Result<String, BuildError> {
    let go_mod = src.join("go.mod");
    let text = std::fs::read_to_string(&go_mod).map_err(|source| BuildError::Read {
        path: go_mod.clone(),
        source,
    })?;
    parse_kubernetes_version(&text).ok_or(BuildError::NoKubernetesVersion(go_mod))
}

fn parse_kubernetes_version(go_mod: &str) -> Option<String> {
    go_mod.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("k8s.io/kubernetes"), Some(v)) if v.starts_with('v') => Some(v.to_string()),
            (Some("require"), Some("k8s.io/kubernetes")) => words.next().map(str::to_string),
            _ => None,
        }
    })
}

/// The `-ldflags` that stamp the release into `/version`, as Kubernetes' own
/// build (hack/lib/version.sh) does.
fn ldflags(version: &str) -> String {
    let trimmed = version.trim_start_matches('v');
    let mut parts = trimmed.split('.');
    let major = parts.next().unwrap_or("0");
    let minor = parts.next().unwrap_or("0");
    let mut flags = vec!["-s".to_string(), "-w".to_string()];
    for pkg in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        flags.push(format!("-X {pkg}.gitVersion={version}"));
        flags.push(format!("-X {pkg}.gitMajor={major}"));
        flags.push(format!("-X {pkg}.gitMinor={minor}"));
        flags.push(format!("-X {pkg}.gitTreeState=clean"));
    }
    flags.join(" ")
}

fn go_version() -> Result<String, BuildError> {
    let out = Command::new("go")
        .arg("version")
        .output()
        .map_err(BuildError::GoMissing)?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Hash of every input of the build: Go sources, go.mod, go.sum, toolchain and flags.
pub fn input_hash(src: &Path) -> Result<String, BuildError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(src)
        .map_err(|_| BuildError::SourcesMissing(src.to_path_buf()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name == "go.mod" || name == "go.sum" || name.ends_with(".go")
        })
        .collect();
    files.sort();
    if !files.iter().any(|p| p.ends_with("go.mod")) {
        return Err(BuildError::SourcesMissing(src.to_path_buf()));
    }
    let mut hasher = Sha256::new();
    for file in &files {
        let bytes = std::fs::read(file).map_err(|source| BuildError::Read {
            path: file.clone(),
            source,
        })?;
        hasher.update(file.file_name().unwrap_or_default().as_encoded_bytes());
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(&bytes);
    }
    hasher.update(go_version()?.as_bytes());
    hasher.update(ldflags(&kubernetes_version(src)?).as_bytes());
    hasher.update(std::env::consts::ARCH.as_bytes());
    Ok(hex::encode(&hasher.finalize()[..12]))
}

/// Returns the path of a built control-plane binary, building it first if the
/// cache has none for the current inputs. `STRAIT_CONTROLPLANE_BIN` overrides.
pub fn ensure_built() -> Result<PathBuf, BuildError> {
    if let Some(bin) = std::env::var_os("STRAIT_CONTROLPLANE_BIN") {
        return Ok(PathBuf::from(bin));
    }
    // Threads of one process wait here; processes wait on the file lock below.
    static IN_PROCESS: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut cached = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = cached.as_ref() {
        return Ok(path.clone());
    }

    let src = source_dir();
    let hash = input_hash(&src)?;
    let root = cache_root().join("controlplane");
    let dir = root.join(&hash);
    let bin = dir.join(BINARY_NAME);
    if !bin.exists() {
        std::fs::create_dir_all(&dir).map_err(|source| BuildError::Cache {
            path: dir.clone(),
            source,
        })?;
        let lock_path = root.join("build.lock");
        let lock = File::create(&lock_path).map_err(|source| BuildError::Cache {
            path: lock_path.clone(),
            source,
        })?;
        if lock.try_lock().is_err() {
            eprintln!(
                "[testenv] another process is building the control plane; waiting for it ({})",
                lock_path.display()
            );
            lock.lock().map_err(|source| BuildError::Cache {
                path: lock_path.clone(),
                source,
            })?;
        }
        // The winner of the lock may have built it while we waited.
        if !bin.exists() {
            build(&src, &bin)?;
        }
        drop(lock);
    }
    *cached = Some(bin.clone());
    Ok(bin)
}

fn run_go(step: &'static str, src: &Path, args: &[&str]) -> Result<String, BuildError> {
    let out = go_command(src)
        .args(args)
        .output()
        .map_err(BuildError::GoMissing)?;
    if !out.status.success() {
        return Err(BuildError::Go {
            step,
            status: out.status.to_string(),
            output: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn go_command(src: &Path) -> Command {
    let mut cmd = Command::new("go");
    cmd.current_dir(src)
        .env("CGO_ENABLED", "0")
        .env("GOFLAGS", "-buildvcs=false -mod=readonly")
        .env(
            "GOTOOLCHAIN",
            std::env::var("GOTOOLCHAIN").unwrap_or_else(|_| "local".into()),
        );
    cmd
}

fn build(src: &Path, bin: &Path) -> Result<(), BuildError> {
    let started = Instant::now();
    let version = kubernetes_version(src)?;
    eprintln!(
        "[testenv] building the control plane (Kubernetes {version}, etcd) into {}\n[testenv] a cold build takes many minutes on 2 cores; later runs reuse it",
        bin.display()
    );
    eprintln!("[testenv] downloading Go modules…");
    run_go("mod download", src, &["mod", "download"])?;
    let total = run_go("list -deps", src, &["list", "-deps", "."])?
        .lines()
        .count()
        .max(1);
    eprintln!("[testenv] compiling up to {total} Go packages (cached ones are skipped)…");

    let tmp = bin.with_extension("partial");
    let tmp_str = tmp.to_string_lossy().into_owned();
    let flags = ldflags(&version);
    let mut child = go_command(src)
        .args([
            "build",
            "-v",
            "-trimpath",
            "-ldflags",
            &flags,
            "-o",
            &tmp_str,
            ".",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(BuildError::GoMissing)?;
    let stderr = child.stderr.take().expect("piped stderr");
    let mut compiled = 0usize;
    let mut output = String::new();
    let mut last_report = Instant::now();
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        // `go build -v` names each package as it compiles it; anything else is an error text.
        if line.contains(' ') || line.starts_with('#') {
            output.push_str(&line);
            output.push('\n');
            continue;
        }
        compiled += 1;
        if last_report.elapsed() >= Duration::from_secs(10) {
            last_report = Instant::now();
            eprintln!(
                "[testenv] control plane: {compiled}/{total} packages ({}%), {}s elapsed, now {line}",
                (compiled * 100 / total).min(99),
                started.elapsed().as_secs()
            );
        }
    }
    let status = child.wait().map_err(BuildError::GoMissing)?;
    if !status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(BuildError::Go {
            step: "build",
            status: status.to_string(),
            output,
        });
    }
    std::fs::rename(&tmp, bin).map_err(|source| BuildError::Cache {
        path: bin.to_path_buf(),
        source,
    })?;
    eprintln!(
        "[testenv] control plane built in {}s: {}",
        started.elapsed().as_secs(),
        bin.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_kubernetes_version_in_go_mod() {
        let go_mod = "module x\n\nrequire (\n\tgo.etcd.io/etcd/server/v3 v3.6.8\n\tk8s.io/kubernetes v1.36.3\n)\n";
        assert_eq!(parse_kubernetes_version(go_mod).as_deref(), Some("v1.36.3"));
        assert_eq!(
            parse_kubernetes_version("require k8s.io/kubernetes v1.35.4\n").as_deref(),
            Some("v1.35.4")
        );
        assert_eq!(parse_kubernetes_version("module x\n"), None);
    }

    #[test]
    fn ldflags_stamp_major_minor_and_version() {
        let flags = ldflags("v1.36.3");
        assert!(
            flags.contains("-X k8s.io/component-base/version.gitVersion=v1.36.3"),
            "{flags}"
        );
        assert!(
            flags.contains("-X k8s.io/component-base/version.gitMajor=1"),
            "{flags}"
        );
        assert!(
            flags.contains("-X k8s.io/component-base/version.gitMinor=36"),
            "{flags}"
        );
    }

    #[test]
    fn input_hash_changes_when_a_source_changes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("go.mod"),
            "module x\nrequire k8s.io/kubernetes v1.36.3\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("main.go"), "package main\n").unwrap();
        let a = input_hash(dir.path()).unwrap();
        assert_eq!(a, input_hash(dir.path()).unwrap(), "hash must be stable");
        std::fs::write(dir.path().join("main.go"), "package main\n// changed\n").unwrap();
        assert_ne!(
            a,
            input_hash(dir.path()).unwrap(),
            "hash must follow the sources"
        );
    }
}
