//! A network namespace held by an anchor process.

use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::{NetError, is_root, run};
use crate::process::ChildProcess;

fn ns_id(path: &Path) -> Option<PathBuf> {
    std::fs::read_link(path).ok()
}

/// A network namespace that lives exactly as long as its anchor process.
#[derive(Debug)]
pub(crate) struct Netns {
    anchor: ChildProcess,
    pub(crate) pid: u32,
    path: PathBuf,
}

impl Netns {
    pub(crate) fn new(what: &str) -> Result<Self, NetError> {
        if !is_root() {
            return Err(NetError::NotRoot);
        }
        let args = ["--net", "sleep", "infinity"].map(String::from);
        let mut anchor =
            ChildProcess::spawn(what, Path::new("unshare"), &args, Path::new("/dev/null"))
                .map_err(|source| NetError::Missing {
                    command: "unshare --net sleep infinity".into(),
                    package: "util-linux",
                    source,
                })?;
        let pid = anchor.pid().expect("a just-spawned child has a pid");
        let path = PathBuf::from(format!("/proc/{pid}/ns/net"));
        // Until unshare(2) has run, the anchor is still in our namespace:
        // configuring it then would change the host's network.
        let host = ns_id(Path::new("/proc/self/ns/net"));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = anchor.try_exit_status() {
                return Err(NetError::Anchor {
                    what: what.into(),
                    message: format!("`unshare --net sleep infinity` exited ({status})"),
                });
            }
            match ns_id(&path) {
                Some(id) if Some(&id) != host.as_ref() => break,
                _ if Instant::now() >= deadline => {
                    return Err(NetError::Anchor {
                        what: what.into(),
                        message: "unshare did not enter a new namespace within 10s".into(),
                    });
                }
                _ => std::thread::sleep(Duration::from_millis(2)),
            }
        }
        Ok(Self { anchor, pid, path })
    }

    /// `nsenter --net=<this> -- program`: a command that runs inside the namespace.
    pub(crate) fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(self.nsenter_arg()).arg("--").arg(program);
        cmd
    }

    fn nsenter_arg(&self) -> String {
        format!("--net={}", self.path.display())
    }

    /// Runs `ip -batch -` with these lines inside the namespace.
    pub(crate) fn ip(&self, lines: &[String]) -> Result<(), NetError> {
        let mut cmd = self.command("ip");
        cmd.args(["-batch", "-"]);
        run(cmd, Some(&(lines.join("\n") + "\n"))).map(drop)
    }

    pub(crate) fn sysctl(&self, setting: &str) -> Result<(), NetError> {
        let mut cmd = self.command("sysctl");
        cmd.args(["-qw", setting]);
        run(cmd, None).map(drop)
    }

    /// Spawns a long-running process inside the namespace. `nsenter` execs the
    /// program in place, so the child keeps its parent-death signal and pid.
    pub(crate) fn spawn(
        &self,
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &OsStr)],
        log: &Path,
    ) -> io::Result<ChildProcess> {
        let mut full = vec![self.nsenter_arg(), "--".into()];
        full.push(program.to_string_lossy().into_owned());
        full.extend(args.iter().cloned());
        ChildProcess::spawn_with_env(name, Path::new("nsenter"), &full, env, log)
    }

    /// `net:[inode]` of the namespace, to check later that it is gone.
    pub(crate) fn id(&self) -> String {
        ns_id(&self.path)
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    }
}

/// A non-blocking TCP listener on `addr` inside the network namespace of
/// process `pid`, made by a short-lived thread that enters it (a socket keeps
/// the namespace it was made in; the thread's namespace ends with the thread).
pub(crate) fn listen_tcp_in(
    pid: u32,
    addr: std::net::SocketAddr,
) -> io::Result<std::net::TcpListener> {
    let namespace = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> io::Result<std::net::TcpListener> {
                use std::os::fd::AsFd as _;
                rustix::thread::move_into_link_name_space(
                    namespace.as_fd(),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )?;
                let listener = std::net::TcpListener::bind(addr)?;
                listener.set_nonblocking(true)?;
                Ok(listener)
            })
            .join()
            .map_err(|_| io::Error::other("the namespace thread panicked"))?
    })
}

impl Drop for Netns {
    fn drop(&mut self) {
        // The kernel frees the namespace (and its interfaces) once the last
        // process in it is gone; processes spawned into it are owned by callers.
        self.anchor.stop(Duration::ZERO);
    }
}
