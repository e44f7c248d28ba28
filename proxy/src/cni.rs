//! Chaining `strait-cni` into the node's CNI configuration, as istio-cni's
//! installer does: the node proxy (transparent mode, with the host's CNI
//! folders mounted) copies the plugin binary into the node's CNI `bin`
//! folder and appends the plugin to the node's primary network
//! configuration, the file the container runtime uses (the first
//! `*.conf`, `*.conflist` or `*.json` of the folder in name order, as
//! libcni picks it). The primary CNI may rewrite its file at any time
//! (kindnet, Calico and Cilium do at start), so the proxy checks it again
//! every [`RECHECK`] and puts the entry back.
//!
//! Undone only when Strait is uninstalled (the proxy's DaemonSet or
//! Namespace is gone or being deleted when the proxy stops), never on a
//! rollout: a node without the entry would start transparent pods outside
//! the mesh.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use strait_mesh::names::SYSTEM_NAMESPACE;

/// The `type` of the chained entry (and the binary's name).
pub const PLUGIN: &str = "strait-cni";
/// How often the chain is checked again.
pub const RECHECK: Duration = Duration::from_secs(10);

/// Why strait-cni could not be chained (or unchained).
#[derive(Debug, thiserror::Error)]
pub enum CniError {
    #[error("reading the plugin {path}: {source}")]
    ReadPlugin { path: PathBuf, source: io::Error },
    #[error(
        "no network configuration in {dir} yet (the node's CNI writes one; strait-cni chains after it)"
    )]
    NoConfiguration { dir: PathBuf },
    #[error("{path} is not JSON: {source}")]
    NotJson {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: {source}")]
    NotANetwork { path: PathBuf, source: NotANetwork },
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

impl CniError {
    fn io(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CniError {
        let path = path.to_path_buf();
        move |source| CniError::Io {
            action,
            path,
            source,
        }
    }
}

/// A JSON document that is no network configuration.
#[derive(Debug, thiserror::Error)]
pub enum NotANetwork {
    #[error("not a JSON object")]
    NotAnObject,
    #[error("neither a conflist (\"plugins\": […]) nor a plugin configuration (\"type\")")]
    NoPluginsOrType,
}

/// Where the node's CNI configuration lives (host folders mounted into the
/// proxy) and what to chain.
#[derive(Clone, Debug)]
pub struct CniChain {
    /// The node's network configuration folder (`/etc/cni/net.d`).
    pub conf_dir: PathBuf,
    /// The node's plugin folder (`/opt/cni/bin`).
    pub bin_dir: PathBuf,
    /// The plugin binary to copy there (the proxy image's `strait-cni`).
    pub plugin: PathBuf,
    /// The enrollment socket as the node sees it (the plugin runs on the
    /// node, not in the proxy's container).
    pub enroll_socket: PathBuf,
}

/// The node's primary network configuration: the first file of `dir`, by
/// name, ending in `.conf`, `.conflist` or `.json`.
pub fn primary_config(dir: &Path) -> io::Result<Option<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .is_some_and(|e| e == "conf" || e == "conflist" || e == "json")
        })
        .collect();
    files.sort();
    Ok(files.into_iter().next())
}

/// `config` (a conflist, or a single plugin's `.conf` object) as a conflist
/// whose last plugin is `entry`, any earlier `strait-cni` entry removed.
pub fn chained(config: &Value, entry: &Value) -> Result<Value, NotANetwork> {
    let mut list = as_conflist(config)?;
    let plugins = list["plugins"].as_array_mut().expect("as_conflist");
    plugins.retain(|p| p["type"] != PLUGIN);
    plugins.push(entry.clone());
    Ok(list)
}

/// `config` without its `strait-cni` entry; `None` when it has none.
pub fn unchained(config: &Value) -> Option<Value> {
    let plugins = config["plugins"].as_array()?;
    if !plugins.iter().any(|p| p["type"] == PLUGIN) {
        return None;
    }
    let mut config = config.clone();
    config["plugins"]
        .as_array_mut()
        .expect("checked")
        .retain(|p| p["type"] != PLUGIN);
    Some(config)
}

fn as_conflist(config: &Value) -> Result<Value, NotANetwork> {
    if config["plugins"].is_array() {
        return Ok(config.clone());
    }
    if !config["type"].is_string() {
        return Err(NotANetwork::NoPluginsOrType);
    }
    // A single plugin's .conf: the same network as a list of one.
    let mut plugin = config.clone();
    let object = plugin.as_object_mut().ok_or(NotANetwork::NotAnObject)?;
    let version = object.remove("cniVersion").unwrap_or(json!("0.3.1"));
    let name = object.remove("name").unwrap_or(json!("k8s-pod-network"));
    Ok(json!({"cniVersion": version, "name": name, "plugins": [plugin]}))
}

/// Writes `bytes` to `path` by a rename from a sibling: the runtime never
/// reads half a file.
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("no file name"))?;
    let tmp = path.with_file_name(format!(".{}.strait-tmp", name.to_string_lossy()));
    std::fs::write(&tmp, bytes)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, path)
}

impl CniChain {
    /// The entry chained into the node's configuration.
    pub fn entry(&self) -> Value {
        json!({
            "type": PLUGIN,
            "enrollSocket": self.enroll_socket,
            "excludeNamespaces": ["kube-system", SYSTEM_NAMESPACE],
        })
    }

    /// Copies the plugin (when it differs) and chains it; returns the
    /// configuration file, and whether it was changed.
    pub fn install(&self) -> Result<(PathBuf, bool), CniError> {
        let binary = std::fs::read(&self.plugin).map_err(|source| CniError::ReadPlugin {
            path: self.plugin.clone(),
            source,
        })?;
        let target = self.bin_dir.join(PLUGIN);
        if std::fs::read(&target).ok().as_deref() != Some(&binary[..]) {
            write_atomic(&target, &binary, 0o755).map_err(CniError::io("writing", &target))?;
        }
        let Some(path) =
            primary_config(&self.conf_dir).map_err(CniError::io("reading", &self.conf_dir))?
        else {
            return Err(CniError::NoConfiguration {
                dir: self.conf_dir.clone(),
            });
        };
        let text = std::fs::read_to_string(&path).map_err(CniError::io("reading", &path))?;
        let config: Value = serde_json::from_str(&text).map_err(|source| CniError::NotJson {
            path: path.clone(),
            source,
        })?;
        let updated = chained(&config, &self.entry()).map_err(|source| CniError::NotANetwork {
            path: path.clone(),
            source,
        })?;
        if updated == config {
            return Ok((path, false));
        }
        let mut bytes = serde_json::to_vec_pretty(&updated).expect("serializable");
        bytes.push(b'\n');
        if path.extension().is_some_and(|e| e == "conflist") {
            write_atomic(&path, &bytes, 0o644).map_err(CniError::io("writing", &path))?;
            Ok((path, true))
        } else {
            // libcni reads a `.conf`/`.json` as one plugin: the list goes
            // into a `.conflist` of the same name (same place in the order).
            let list = path.with_extension("conflist");
            write_atomic(&list, &bytes, 0o644).map_err(CniError::io("writing", &list))?;
            std::fs::remove_file(&path).map_err(CniError::io("removing", &path))?;
            Ok((list, true))
        }
    }

    /// Takes the entry out of every configuration file and removes the
    /// plugin binary; what it changed.
    pub fn uninstall(&self) -> Result<Vec<PathBuf>, CniError> {
        let mut changed = Vec::new();
        let reading = CniError::io("reading", &self.conf_dir);
        let entries = std::fs::read_dir(&self.conf_dir)
            .and_then(|dir| dir.collect::<io::Result<Vec<_>>>())
            .map_err(reading)?;
        for entry in entries {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "conflist") {
                continue;
            }
            let Some(config) = std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            else {
                continue;
            };
            if let Some(updated) = unchained(&config) {
                let mut bytes = serde_json::to_vec_pretty(&updated).expect("serializable");
                bytes.push(b'\n');
                write_atomic(&path, &bytes, 0o644).map_err(CniError::io("writing", &path))?;
                changed.push(path);
            }
        }
        let plugin = self.bin_dir.join(PLUGIN);
        match std::fs::remove_file(&plugin) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(CniError::io("removing", &plugin)(e));
            }
            _ => {}
        }
        Ok(changed)
    }

    /// Installs, then keeps the entry in place (every [`RECHECK`]) until
    /// `stop` resolves; the first install is retried until it works. An
    /// install in progress finishes before this returns, so a caller that
    /// awaits it may uninstall without a late install putting the entry back.
    pub async fn keep_installed(self, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        let mut warned = false;
        loop {
            let chain = self.clone();
            match tokio::task::spawn_blocking(move || chain.install()).await {
                Ok(Ok((path, true))) => {
                    tracing::info!(config = %path.display(), "strait-cni chained into the node's CNI configuration");
                    warned = false;
                }
                Ok(Ok(_)) => warned = false,
                Ok(Err(e)) if !warned => {
                    tracing::warn!("chaining strait-cni: {e}; retrying every {RECHECK:?}");
                    warned = true;
                }
                _ => {}
            }
            tokio::select! {
                _ = tokio::time::sleep(RECHECK) => {}
                _ = &mut stop => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(dir: &Path) -> CniChain {
        let conf_dir = dir.join("net.d");
        let bin_dir = dir.join("bin");
        std::fs::create_dir_all(&conf_dir).unwrap();
        std::fs::create_dir_all(&bin_dir).unwrap();
        let plugin = dir.join("strait-cni-src");
        std::fs::write(&plugin, b"#!plugin").unwrap();
        CniChain {
            conf_dir,
            bin_dir,
            plugin,
            enroll_socket: "/var/run/strait/cni/enroll.sock".into(),
        }
    }

    #[test]
    fn the_entry_goes_last_once_and_comes_out_again() {
        let dir = tempfile::tempdir().unwrap();
        let c = chain(dir.path());
        let list = json!({"cniVersion": "1.0.0", "name": "kindnet", "plugins": [
            {"type": "ptp"}, {"type": "portmap", "capabilities": {"portMappings": true}}]});
        std::fs::write(c.conf_dir.join("10-kindnet.conflist"), list.to_string()).unwrap();
        std::fs::write(c.conf_dir.join("99-other.conflist"), list.to_string()).unwrap();
        let (path, changed) = c.install().unwrap();
        assert!(changed);
        assert_eq!(path, c.conf_dir.join("10-kindnet.conflist"));
        // Again: nothing to change, and still one entry.
        assert!(!c.install().unwrap().1);
        let now: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let types: Vec<&str> = now["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["ptp", "portmap", "strait-cni"]);
        assert_eq!(
            now["plugins"][2]["enrollSocket"],
            "/var/run/strait/cni/enroll.sock"
        );
        assert_eq!(std::fs::read(c.bin_dir.join(PLUGIN)).unwrap(), b"#!plugin");
        // The later file is not the runtime's: untouched.
        let other = std::fs::read_to_string(c.conf_dir.join("99-other.conflist")).unwrap();
        assert!(!other.contains(PLUGIN));

        assert_eq!(c.uninstall().unwrap(), vec![path.clone()]);
        let back: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back, list);
        assert!(!c.bin_dir.join(PLUGIN).exists());
        assert!(c.uninstall().unwrap().is_empty(), "idempotent");
    }

    #[test]
    fn a_single_plugin_conf_becomes_a_conflist() {
        let dir = tempfile::tempdir().unwrap();
        let c = chain(dir.path());
        std::fs::write(
            c.conf_dir.join("10-bridge.conf"),
            r#"{"cniVersion":"0.4.0","name":"pods","type":"bridge","bridge":"cni0"}"#,
        )
        .unwrap();
        let (path, changed) = c.install().unwrap();
        assert!(changed);
        assert_eq!(path, c.conf_dir.join("10-bridge.conflist"));
        assert!(!c.conf_dir.join("10-bridge.conf").exists());
        let now: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(now["cniVersion"], "0.4.0");
        assert_eq!(now["name"], "pods");
        assert_eq!(
            now["plugins"][0],
            json!({"type": "bridge", "bridge": "cni0"})
        );
        assert_eq!(now["plugins"][1]["type"], PLUGIN);
    }

    #[test]
    fn no_configuration_yet_or_a_broken_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let c = chain(dir.path());
        let e = c.install().unwrap_err().to_string();
        assert!(e.contains("no network configuration"), "{e}");
        std::fs::write(c.conf_dir.join("10-x.conflist"), "{not json").unwrap();
        let e = c.install().unwrap_err().to_string();
        assert!(e.contains("10-x.conflist is not JSON"), "{e}");
        std::fs::write(c.conf_dir.join("10-x.conflist"), r#"{"name":"x"}"#).unwrap();
        let e = c.install().unwrap_err().to_string();
        assert!(e.contains("neither a conflist"), "{e}");
    }
}
