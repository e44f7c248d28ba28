//! Profiles for benchmarks: with `STRAIT_BENCH_PERF_DIR` set, a benchmark
//! records chosen runs with `perf` (flat, sampled at 499 Hz: where the CPU
//! goes by function, which is what a per-request or per-byte cost needs).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// Where profiles go, when asked for.
pub fn dir() -> Option<PathBuf> {
    std::env::var_os("STRAIT_BENCH_PERF_DIR").map(PathBuf::from)
}

/// Starts `perf record` of `pids` for `secs` into `<dir>/<name>.data`; wait
/// on the child for the file. Read it with
/// `perf report -i FILE --no-children --sort comm,dso,sym`.
pub fn record(dir: &std::path::Path, name: &str, pids: &[u32], secs: u64) -> Child {
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join(format!("{}.data", name.replace(['+', ' ', '/'], "-")));
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    println!("perf record of {name}: {}", file.display());
    Command::new("perf")
        .args(["record", "-q", "-F", "499", "-o"])
        .arg(&file)
        .args(["-p", &pids.join(","), "--", "sleep", &secs.to_string()])
        .stdout(Stdio::null())
        .spawn()
        .expect("perf (linux-perf) for STRAIT_BENCH_PERF_DIR")
}
