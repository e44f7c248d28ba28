//! strait-load, the benchmarks' load generator, against a real strait-backend
//! on loopback: every request due in the measured window is sent and timed,
//! late or not, and a request that waits behind a slow answer is timed from
//! when it was due (no coordinated omission).

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use strait_testenv::process::ChildProcess;

fn backend(dir: &Path, extra: &[&str]) -> (ChildProcess, SocketAddr) {
    let addr = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("a free loopback port");
    let mut args = vec![
        "--name".to_string(),
        "web".into(),
        "--http".into(),
        addr.to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let child = ChildProcess::spawn(
        "strait-backend",
        Path::new(env!("CARGO_BIN_EXE_strait-backend")),
        &args,
        &dir.join("backend.log"),
    )
    .expect("start strait-backend");
    for _ in 0..100 {
        if TcpStream::connect(addr).is_ok() {
            return (child, addr);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("strait-backend did not listen on {addr}");
}

fn load(addr: SocketAddr, args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_strait-load"))
        .arg(format!("--connect={addr}"))
        .args(args)
        .output()
        .expect("run strait-load");
    assert!(
        out.status.success(),
        "strait-load failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("strait-load prints JSON")
}

#[test]
fn every_request_due_is_sent_and_timed_with_and_without_a_pacing_window() {
    let dir = tempfile::tempdir().unwrap();
    let (_backend, addr) = backend(dir.path(), &[]);
    for window in ["0s", "200us", "2ms"] {
        let report = load(
            addr,
            &[
                "--rate=400",
                "--connections=10",
                "--duration=1s",
                "--warmup=200ms",
                &format!("--pace-window={window}"),
            ],
        );
        // 400 requests are due in the measured second, whenever they leave.
        assert_eq!(report["requests"], 400, "window {window}: {report}");
        assert_eq!(report["errors"], 0, "window {window}: {report}");
        // Answered within the window: all but those due in its last instant.
        let achieved = report["achieved_rps"].as_f64().unwrap();
        assert!(
            (390.0..=400.0).contains(&achieved),
            "window {window}: {report}"
        );
        assert_eq!(report["saturated"], false, "window {window}: {report}");
        let (p50, max) = (
            report["p50_ms"].as_f64().unwrap(),
            report["max_ms"].as_f64().unwrap(),
        );
        assert!(p50 > 0.0 && p50 <= max, "window {window}: {report}");
    }
}

#[test]
fn a_request_queued_behind_a_slow_answer_counts_from_when_it_was_due() {
    let dir = tempfile::tempdir().unwrap();
    // Each answer takes 50 ms: 2 connections carry at most 40 requests a
    // second, so at 100 a second requests queue and wait longer and longer.
    let (_backend, addr) = backend(dir.path(), &["--delay=50ms"]);
    let report = load(
        addr,
        &[
            "--rate=100",
            "--connections=2",
            "--duration=1s",
            "--warmup=0s",
        ],
    );
    assert_eq!(report["requests"], 100, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    let (p50, max) = (
        report["p50_ms"].as_f64().unwrap(),
        report["max_ms"].as_f64().unwrap(),
    );
    // Timed from the send instead, every latency would be ~50 ms. The last
    // request is due at ~1 s and answered after all 100 (≥ 50 per
    // connection × 50 ms = 2.5 s), so it waited over 1 s.
    assert!(p50 >= 50.0, "p50 below the server's own delay: {report}");
    assert!(max > 1000.0, "the queue's wait is not counted: {report}");
    // The path carried ~40 a second, not the 100 asked: reported as such.
    let achieved = report["achieved_rps"].as_f64().unwrap();
    assert!(
        achieved <= 45.0,
        "the asked rate reported as achieved: {report}"
    );
    assert_eq!(report["saturated"], true, "{report}");
}
