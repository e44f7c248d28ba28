//! The node's cgroup in every hierarchy: what holds (and, at tear-down,
//! kills) its daemons, their shims and every container.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::CGROUP_PREFIX;

/// A mounted cgroup hierarchy: its folder and its controllers.
#[derive(Clone, Debug)]
pub(super) struct Hierarchy {
    path: PathBuf,
    pub(super) controllers: Vec<String>,
}

/// The cgroup hierarchies mounted under /sys/fs/cgroup (v1 ones and the
/// hybrid `unified` v2 one), from /proc/self/mountinfo.
pub(super) fn cgroup_hierarchies() -> Vec<Hierarchy> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut out: Vec<Hierarchy> = Vec::new();
    for line in info.lines() {
        let Some((before, after)) = line.split_once(" - ") else {
            continue;
        };
        let mount_point = before.split_whitespace().nth(4).unwrap_or("");
        let mut fields = after.split_whitespace();
        let fstype = fields.next().unwrap_or("");
        let super_options = fields.nth(1).unwrap_or("");
        if !mount_point.starts_with("/sys/fs/cgroup/") || !fstype.starts_with("cgroup") {
            continue;
        }
        let controllers = if fstype == "cgroup2" {
            vec!["unified".to_string()]
        } else {
            super_options
                .split(',')
                .filter(|o| *o != "rw" && *o != "ro")
                .map(str::to_string)
                .collect()
        };
        if !out.iter().any(|h| h.path == Path::new(mount_point)) {
            out.push(Hierarchy {
                path: mount_point.into(),
                controllers,
            });
        }
    }
    out
}

/// One node's cgroup, `/<name>` in every hierarchy.
#[derive(Debug)]
pub(super) struct NodeCgroup {
    pub(super) name: String,
    hierarchies: Vec<Hierarchy>,
}

impl NodeCgroup {
    /// A process of the pod with this UID, from the kubelet's pod cgroup
    /// (the pod's own cgroup holds no tasks: its containers' do).
    pub(super) fn pod_process(&self, uid: &str) -> Option<u32> {
        self.pod_processes(uid).into_iter().next()
    }

    /// Every process of the pod with `uid` (its sandbox's and each
    /// container's), by the pod's cgroups.
    pub(super) fn pod_processes(&self, uid: &str) -> Vec<u32> {
        self.pod_processes_in(uid).unwrap_or_default()
    }

    fn pod_processes_in(&self, uid: &str) -> Option<Vec<u32>> {
        let wanted = format!("pod{uid}");
        let pids = self
            .hierarchies
            .iter()
            .find(|h| h.controllers.iter().any(|c| c == "pids"))?;
        let kubepods = pids.path.join(&self.name).join("kubepods");
        let pod = cgroup_tree(&kubepods)
            .into_iter()
            .find(|d| d.file_name().is_some_and(|n| n.to_string_lossy() == wanted))?;
        Some(
            cgroup_tree(&pod)
                .iter()
                .flat_map(|dir| cgroup_procs(dir))
                .collect(),
        )
    }

    /// Creates the cgroup; one left by an earlier run that was killed outright
    /// (same slot and node number: its network is gone) is emptied first.
    pub(super) fn create(name: &str) -> std::io::Result<Self> {
        let cgroup = Self {
            name: name.into(),
            hierarchies: cgroup_hierarchies(),
        };
        if cgroup.exists() {
            tracing::warn!(
                cgroup = name,
                "removing a node cgroup left by an earlier run"
            );
            cgroup.kill_all(Duration::from_secs(15));
            cgroup.remove();
        }
        for h in &cgroup.hierarchies {
            for dir in [h.path.join(name), h.path.join(name).join("system")] {
                std::fs::create_dir_all(&dir)?;
                if h.controllers.iter().any(|c| c == "cpuset") {
                    // A cpuset cgroup without cpus and mems takes no tasks.
                    let parent = dir.parent().expect("a cgroup below the root");
                    for file in ["cpuset.cpus", "cpuset.mems"] {
                        let value = std::fs::read_to_string(parent.join(file))?;
                        std::fs::write(dir.join(file), value.trim())?;
                    }
                }
            }
        }
        Ok(cgroup)
    }

    pub(super) fn exists(&self) -> bool {
        self.hierarchies
            .iter()
            .any(|h| h.path.join(&self.name).exists())
    }

    /// Moves `pid` (a node daemon) into `/<name>/system` everywhere; what it
    /// starts later (containerd's shims) is born there.
    pub(super) fn adopt(&self, pid: u32) -> std::io::Result<()> {
        for h in &self.hierarchies {
            let procs = h.path.join(&self.name).join("system").join("cgroup.procs");
            std::fs::write(&procs, pid.to_string()).map_err(|e| {
                std::io::Error::other(format!("write {pid} to {}: {e}", procs.display()))
            })?;
        }
        Ok(())
    }

    /// Every process in the cgroup or below it, in any hierarchy.
    pub(super) fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .hierarchies
            .iter()
            .flat_map(|h| cgroup_tree(&h.path.join(&self.name)))
            .flat_map(|dir| cgroup_procs(&dir))
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// SIGKILLs everything in the cgroup until it is empty (or `limit` passes).
    pub(super) fn kill_all(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return true;
            }
            if Instant::now() >= deadline {
                tracing::warn!(cgroup = %self.name, ?pids, "processes survived SIGKILL");
                return false;
            }
            for pid in pids {
                crate::process::kill(pid);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Removes the (empty) cgroup folders, deepest first.
    pub(super) fn remove(&self) {
        for h in &self.hierarchies {
            for dir in cgroup_tree(&h.path.join(&self.name)).iter().rev() {
                // A cgroup whose last task is still exiting is busy for a moment.
                for _ in 0..50 {
                    match std::fs::remove_dir(dir) {
                        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        _ => break,
                    }
                }
            }
        }
    }
}

/// `root` and every folder below it, parents before their children.
fn cgroup_tree(root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            stack.extend(
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
        dirs.push(dir);
    }
    dirs
}

/// The processes directly in cgroup `dir`.
fn cgroup_procs(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// Node cgroups on this host whose cluster network is gone: left behind by a
/// run that was killed outright (its shims and containers may still run).
/// Kills what is in them and removes them; returns their names.
pub fn sweep_stale_cgroups() -> Vec<String> {
    let Some(pids) = cgroup_hierarchies()
        .into_iter()
        .find(|h| h.controllers.iter().any(|c| c == "pids"))
    else {
        return Vec::new();
    };
    let mut swept = Vec::new();
    for entry in std::fs::read_dir(&pids.path)
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(CGROUP_PREFIX) else {
            continue;
        };
        let slot = rest.split('-').next().unwrap_or("");
        let lan = format!("{}{slot}", crate::net::HOST_IF_PREFIX);
        if Path::new("/sys/class/net").join(&lan).exists() {
            continue; // a live cluster network: its owner cleans up
        }
        let cgroup = NodeCgroup {
            name: name.clone(),
            hierarchies: cgroup_hierarchies(),
        };
        cgroup.kill_all(Duration::from_secs(15));
        cgroup.remove();
        swept.push(name);
    }
    swept
}
