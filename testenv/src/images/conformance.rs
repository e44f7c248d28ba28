//! The images the MCS API conformance suite (`third_party/mcs-api-conformance`,
//! see [`crate::conformance`]) runs its pods from, under the names its pod
//! specs give, built from the host's Debian packages instead of pulled:
//!
//! - **`docker.io/alpine/socat:1.7.4.4`** (the `hello` Deployment and
//!   StatefulSet): `/bin/sh -c <script>` that reads `$MY_POD_IPS` with `grep
//!   -E`, `tr` and `awk`, then `socat -v -v TCP-LISTEN:42,…,fork
//!   SYSTEM:'echo "pod ip …"'` (and `UDP-LISTEN`, or `TCP6-`/`UDP6-`). Holds
//!   the userland below and socat 1.7.4.4 (Debian's, the version of the
//!   tag) with its libraries; runs as root, as upstream does (port 42 needs it).
//! - **`docker.io/nicolaka/netshoot:v0.15`** (the `request` Pod): `/bin/sh -ec
//!   'while :; do echo .; sleep 5; done'`, and through `exec`: `sh -c "echo hi
//!   | nc -v -w 2 -4 <fqdn> <port> 2>&1"`, `sh -c "nslookup -type=A|AAAA|SRV
//!   <fqdn>."` (its output parsed in BIND's format), and for IPv6 `nslookup …
//!   | grep | tail | awk` before `nc`. Holds the userland below, OpenBSD `nc`
//!   (as netshoot), BIND's `nslookup`, `dig` and `host` (the suite parses
//!   BIND's output), with their libraries. No entrypoint: the suite passes
//!   only `args`, which then run as the command.
//!
//! The userland of both: `/bin/sh` is dash, the other tools static busybox's
//! applets (as in Alpine). Not busybox's sh: Debian builds busybox-static to
//! prefer its own applets over `PATH`, so `sh -c "nc …"` would run busybox's
//! `nc`, which has no `-v`.
//!
//! The suite leaves `imagePullPolicy` unset and neither tag is `latest`, so
//! the API server defaults it to `IfNotPresent`: the kubelet uses the imported
//! image and never asks a registry.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{Image, ImageError, Layer, base_layer, cached_archive};
use crate::realnode::{NodeError, RealNode};

/// The hello pods' image (listeners), as containerd names `alpine/socat:1.7.4.4`.
pub const SOCAT_IMAGE: &str = "docker.io/alpine/socat:1.7.4.4";
/// The request pod's image (client tools), as containerd names `nicolaka/netshoot:v0.15`.
pub const NETSHOOT_IMAGE: &str = "docker.io/nicolaka/netshoot:v0.15";

const BUSYBOX: &str = "/bin/busybox";
const DASH: &str = "/bin/dash";
const SOCAT: &str = "/usr/bin/socat";
const NC: &str = "/usr/bin/nc.openbsd";
const BIND_TOOLS: &[&str] = &["/usr/bin/nslookup", "/usr/bin/dig", "/usr/bin/host"];

/// The two images, built from the host's binaries.
pub fn conformance_images() -> Result<Vec<Image>, ImageError> {
    let userland = userland_layer()?;

    let mut socat = Layer::default();
    host_tool(&mut socat, SOCAT, SOCAT)?;

    let mut netshoot = Layer::default();
    host_tool(&mut netshoot, "/usr/bin/nc", NC)?;
    for tool in BIND_TOOLS {
        host_tool(&mut netshoot, tool, tool)?;
    }

    Ok(vec![
        Image {
            name: SOCAT_IMAGE.into(),
            entrypoint: vec![SOCAT.into()],
            user: "0:0".into(),
            layers: vec![base_layer(), userland.clone(), socat],
        },
        Image {
            name: NETSHOOT_IMAGE.into(),
            entrypoint: Vec::new(),
            user: "0:0".into(),
            layers: vec![base_layer(), userland, netshoot],
        },
    ])
}

/// The two images as cached archives, for `ClusterConfig::node_images`
/// (imported when each node starts) or [`import_conformance_archives`].
pub fn conformance_archives() -> Result<Vec<PathBuf>, ImageError> {
    conformance_images()?.iter().map(cached_archive).collect()
}

/// Imports `archives` (from [`conformance_archives`]) into every node of a
/// running real-node cluster (`ClusterTopology::real_nodes`).
pub fn import_conformance_archives(
    nodes: &[RealNode],
    archives: &[PathBuf],
) -> Result<(), NodeError> {
    for node in nodes {
        for archive in archives {
            node.import_image(archive)?;
        }
    }
    Ok(())
}

fn missing(path: &str) -> ImageError {
    ImageError::Tool {
        command: format!("find {path}"),
        message: "not found".into(),
        fix: "apt-get install busybox-static dash socat netcat-openbsd bind9-dnsutils (scripts/lib.sh installs them; the MCS conformance images are made of them)",
    }
}

/// The host binary `source` at `path`, with the libraries it links.
fn host_tool(layer: &mut Layer, path: &str, source: &str) -> Result<(), ImageError> {
    if !Path::new(source).exists() {
        return Err(missing(source));
    }
    layer
        .host_file(path, source, 0o755)
        .libraries_of(Path::new(source))?;
    Ok(())
}

/// dash as `/bin/sh`, and static busybox with a link per applet at the path
/// busybox gives it (as Alpine has them), except for the shell and the tools
/// the images carry the real thing of.
fn userland_layer() -> Result<Layer, ImageError> {
    if !Path::new(BUSYBOX).exists() {
        return Err(missing(BUSYBOX));
    }
    let mut layer = Layer::default();
    host_tool(&mut layer, "/bin/sh", DASH)?;
    layer.symlink("/bin/dash", "sh");
    let out = Command::new(BUSYBOX)
        .arg("--list-full")
        .output()
        .map_err(|e| ImageError::Tool {
            command: format!("{BUSYBOX} --list-full"),
            message: e.to_string(),
            fix: "reinstall busybox-static",
        })?;
    if !out.status.success() {
        return Err(ImageError::Tool {
            command: format!("{BUSYBOX} --list-full"),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            fix: "install busybox-static (the dynamic busybox package may lack --list-full)",
        });
    }
    layer.host_file(BUSYBOX, BUSYBOX, 0o755);
    for applet in applets(&String::from_utf8_lossy(&out.stdout)) {
        layer.symlink(applet, BUSYBOX);
    }
    Ok(layer)
}

/// Applet paths from `busybox --list-full` (`bin/sh`, `usr/bin/awk`, …),
/// absolute, without those the images hold real binaries for.
fn applets(list: &str) -> Vec<String> {
    const REAL: &[&str] = &["busybox", "sh", "nc", "nslookup", "socat"];
    list.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .filter(|line| {
            let name = line.rsplit('/').next().unwrap_or(line);
            !REAL.contains(&name)
        })
        .map(|line| format!("/{}", line.trim_start_matches('/')))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applets_keep_busybox_paths_and_leave_out_the_real_tools() {
        let list = "bin/sh\nbin/ash\nusr/bin/awk\nusr/bin/nc\nusr/bin/nslookup\n\nsbin/ip\n";
        assert_eq!(applets(list), ["/bin/ash", "/usr/bin/awk", "/sbin/ip"]);
    }

    #[test]
    fn names_are_what_containerd_makes_of_the_suites_images() {
        // k8s_objects.go: "alpine/socat:1.7.4.4", "nicolaka/netshoot:v0.15".
        let suite = include_str!("../../../third_party/mcs-api-conformance/k8s_objects.go");
        for (short, full) in [
            ("alpine/socat:1.7.4.4", SOCAT_IMAGE),
            ("nicolaka/netshoot:v0.15", NETSHOOT_IMAGE),
        ] {
            assert!(suite.contains(&format!("\"{short}\"")), "{short}");
            assert_eq!(full, format!("docker.io/{short}"));
        }
        // No other image: every `Image:` of the suite is one of the two.
        let images = suite.matches("Image:").count();
        let known = suite.matches("Image: \"alpine/socat:1.7.4.4\"").count()
            + suite.matches("Image: \"nicolaka/netshoot:v0.15\"").count();
        assert_eq!(
            images, known,
            "the suite uses an image testenv does not build"
        );
    }
}
