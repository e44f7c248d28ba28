//! Child processes that never outlive the test that started them.
//!
//! Two guarantees, because orphaned API servers would poison every later test:
//! - `Drop` of a [`ChildProcess`] kills and reaps it (also while a test unwinds
//!   from a panic);
//! - each child is started with `PR_SET_PDEATHSIG = SIGKILL`, so the kernel kills
//!   it even when the test process itself dies without unwinding (abort, SIGKILL).
//!
//! The kernel delivers the parent-death signal when the *thread* that forked the
//! child exits, not the process. Test threads come and go, so every child is
//! forked from one spawner thread that lives as long as the process.
//!
//! This is the one module of Strait's test environment that needs `unsafe`
//! (`pre_exec`, `prctl`, `kill`); everything else is safe code.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("testenv-spawner".into())
            .spawn(move || {
                // This thread never returns while the process lives: the children's
                // parent-death signal is tied to it.
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("start the testenv spawner thread");
        Mutex::new(tx)
    })
}

/// A running child process, its stdout and stderr going to one log file.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    child: Option<Child>,
    log_path: PathBuf,
}

impl ChildProcess {
    /// Starts `program args…` with output appended to `log_path`.
    pub fn spawn(name: &str, program: &Path, args: &[String], log_path: &Path) -> io::Result<Self> {
        Self::spawn_with_env(name, program, args, &[], log_path)
    }

    /// As [`ChildProcess::spawn`], with extra environment variables.
    pub fn spawn_with_env(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &std::ffi::OsStr)],
        log_path: &Path,
    ) -> io::Result<Self> {
        let log = File::options().create(true).append(true).open(log_path)?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (*k, *v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: the closure runs in the forked child before exec and only calls
        // async-signal-safe functions (prctl, getppid, setpgid, kill).
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
                // Own process group: a Ctrl-C in the terminal reaches only the
                // parent, which then tears the cluster down in order.
                if libc::setpgid(0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The parent may have died between fork and prctl: then go now.
                if libc::getppid() == 1 {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
                Ok(())
            });
        }
        let (tx, rx) = mpsc::channel();
        spawner()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send((cmd, tx))
            .map_err(|_| io::Error::other("testenv spawner thread is gone"))?;
        let child = rx
            .recv()
            .map_err(|_| io::Error::other("testenv spawner thread is gone"))??;
        Ok(Self {
            name: name.to_string(),
            child: Some(child),
            log_path: log_path.to_path_buf(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The exit status if the process has already exited.
    pub fn try_exit_status(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Stops the process: SIGTERM, then SIGKILL after `grace`, and reaps it.
    pub fn stop(&mut self, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        if !grace.is_zero() {
            // SAFETY: plain kill(2) on a pid we own and have not reaped yet.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}

/// The last `lines` lines of a log file, for error messages and failed tests.
pub fn log_tail(path: &Path, lines: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Whether a process with this pid exists and has not exited. A zombie (exited,
/// not yet reaped by its parent) counts as gone.
pub fn is_alive(pid: u32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks for existence and permission.
    let exists = unsafe { libc::kill(pid as libc::pid_t, 0) == 0 };
    exists && !is_zombie(pid)
}

fn is_zombie(pid: u32) -> bool {
    // /proc/PID/stat: "pid (comm) state …"; comm may hold spaces, so split after ')'.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Sends SIGTERM to `pid`, waits up to `grace` for it to exit, then SIGKILLs it.
/// Returns true if the process is gone afterwards.
pub fn terminate(pid: u32, grace: Duration) -> bool {
    // SAFETY: kill(2) on a pid the caller names; no memory is touched.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if !is_alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(100));
    !is_alive(pid)
}

/// Sends SIGKILL to `pid` (a node's container, say) without waiting.
pub fn kill(pid: u32) {
    // SAFETY: kill(2) on a pid the caller names; no memory is touched.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
}

/// Resident memory of a process in KiB (0 if it is gone), from /proc.
pub fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS")
}

/// What a process's RSS is made of, in KiB: `[anonymous, file-backed,
/// shared memory]` (`RssAnon`, `RssFile`, `RssShmem` of /proc; 0 if it is
/// gone). File-backed pages are the binary's and libraries' code and data
/// that were touched.
pub fn rss_parts_kib(pid: u32) -> [u64; 3] {
    ["RssAnon", "RssFile", "RssShmem"].map(|field| status_kib(pid, field))
}

/// A `field:  N kB` line of /proc/`pid`/status, 0 if absent.
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))
                .map(str::to_string)
        })
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// CPU time (user + system) a process has used so far, in seconds (0 if it
/// is gone), from /proc. Clock ticks are 100 per second on Linux.
pub fn cpu_seconds(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // Fields after the command name (which may hold spaces) in parentheses.
            let rest = s.rsplit_once(')')?.1;
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = fields.get(11)?.parse().ok()?;
            let stime: f64 = fields.get(12)?.parse().ok()?;
            Some((utime + stime) / 100.0)
        })
        .unwrap_or(0.0)
}

/// Waits for SIGINT, SIGTERM or SIGHUP (Ctrl-C, `kill`, a closed terminal).
pub async fn wait_for_stop_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut hangup = signal(SignalKind::hangup())?;
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
        _ = hangup.recv() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_parts_add_up_to_rss() {
        let me = std::process::id();
        let [anon, file, shmem] = rss_parts_kib(me);
        let rss = rss_kib(me);
        assert!(anon > 0 && file > 0, "anon {anon}, file {file} KiB");
        // Read a moment apart: within a MiB of each other.
        assert!(
            (anon + file + shmem).abs_diff(rss) < 1024,
            "{anon}+{file}+{shmem} vs {rss}"
        );
        assert_eq!(rss_parts_kib(u32::MAX), [0, 0, 0]);
    }
}
