//! Container images without Docker, buildah or a registry: OCI image
//! archives written here (an OCI layout is tar + sha256 + three JSON
//! documents), imported into each node's containerd with `ctr images import`
//! (or into kind with `kind load image-archive`).
//!
//! - **pause**: the pod sandbox, 25 lines of C (`testenv/images/pause.c`) built
//!   static with the host's C compiler, user 65535.
//! - **Strait's components**: `<registry>/strait-<component>:<tag>`, the names
//!   `strait install` renders. Each holds its binary and the shared libraries
//!   it links (found with `ldd`: glibc, libgcc_s; what distroless `cc` holds),
//!   `/etc/passwd` with the non-root user 65532 the manifests run as, and `/tmp`.
//!   The proxy's also holds `strait-cni` and `iptables` (nft backend, with its
//!   libraries and extensions), which transparent mode runs inside pods.
//!
//! Archives are cached by a hash of their inputs (binaries, libraries, this
//! module's layout version), so an unchanged build imports without rebuilding.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

mod conformance;
mod layer;

pub use conformance::{
    NETSHOOT_IMAGE, SOCAT_IMAGE, conformance_archives, conformance_images,
    import_conformance_archives,
};
pub use layer::Layer;
use serde_json::json;
use sha2::{Digest, Sha256};

/// Bump when the layout of the images changes, so cached archives are rebuilt.
const LAYOUT_VERSION: &str = "1";

/// The default registry and tag of Strait's images: what `strait install` renders.
pub const DEFAULT_REGISTRY: &str = "ghcr.io/strait-dev";
pub const DEFAULT_TAG: &str = env!("CARGO_PKG_VERSION");

/// Strait's components that ship as images, and the binaries in each.
pub const COMPONENTS: &[(&str, &[&str])] = &[
    ("identity", &["strait-identity"]),
    ("mirror", &["strait-mirror"]),
    ("gateway", &["strait-gateway"]),
    ("proxy", &["strait-proxy", "strait-cni"]),
];

/// A test workload's image: `strait-backend` (the demo's and tests' server)
/// and `strait-load`, for pods of real-node clusters.
pub const BACKEND_IMAGE: &str = "strait.local/strait-backend:local";

const PATH_ENV: &str = "PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "{binary} is not built: run `cargo build --release -p strait-{crate_name}` (or pass --bin-dir with the folder holding it)",
        binary = .0.display(), crate_name = crate_of(.0)
    )]
    MissingBinary(PathBuf),
    #[error("`{command}` failed: {message}; {fix}")]
    Tool {
        command: String,
        message: String,
        fix: &'static str,
    },
}

fn crate_of(binary: &Path) -> String {
    let name = binary
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match name.as_str() {
        "strait-cni" => "proxy".into(),
        "strait-backend" | "strait-load" => "testenv".into(),
        other => other.trim_start_matches("strait-").into(),
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
    let what = what.into();
    move |source| ImageError::Io { what, source }
}

/// An image: layers and how to run it.
#[derive(Clone, Debug)]
pub struct Image {
    /// Full reference, e.g. `ghcr.io/strait-dev/strait-proxy:0.1.0`.
    pub name: String,
    pub entrypoint: Vec<String>,
    /// `uid:gid` the image runs as unless the pod says otherwise.
    pub user: String,
    pub layers: Vec<Layer>,
}

impl Image {
    /// Hash of everything in the archive (the cache key).
    pub fn input_hash(&self) -> Result<String, ImageError> {
        let mut hasher = Sha256::new();
        hasher.update(LAYOUT_VERSION);
        hasher.update(&self.name);
        hasher.update(self.entrypoint.join("\0"));
        hasher.update(&self.user);
        for layer in &self.layers {
            hasher.update(b"layer");
            layer.hash_into(&mut hasher)?;
        }
        Ok(hex::encode(&hasher.finalize()[..12]))
    }

    /// Writes the image as an OCI archive (`oci-layout`, `index.json`,
    /// `blobs/sha256/…` in one tar) to `out`.
    pub fn write_archive(&self, out: &Path) -> Result<(), ImageError> {
        let mut blobs: Vec<(String, Vec<u8>)> = Vec::new();
        let mut layer_descriptors = Vec::new();
        let mut diff_ids = Vec::new();
        for layer in &self.layers {
            let tar = layer.to_tar()?;
            let digest = sha256(&tar);
            layer_descriptors.push(json!({
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": digest,
                "size": tar.len(),
            }));
            diff_ids.push(digest.clone());
            blobs.push((digest, tar));
        }
        let config = serde_json::to_vec(&json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "User": self.user,
                "Env": [PATH_ENV],
                "Entrypoint": self.entrypoint,
                "WorkingDir": "/",
            },
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }))
        .expect("JSON");
        let config_digest = sha256(&config);
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config.len(),
            },
            "layers": layer_descriptors,
        }))
        .expect("JSON");
        let manifest_digest = sha256(&manifest);
        let tag = self
            .name
            .rsplit_once(':')
            .map(|(_, t)| t)
            .unwrap_or("latest");
        let index = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest.len(),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    // containerd (ctr import, kind load) names the image after this one.
                    "io.containerd.image.name": self.name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }],
        }))
        .expect("JSON");
        blobs.push((config_digest, config));
        blobs.push((manifest_digest, manifest));

        let partial = out.with_extension("partial");
        let file = std::fs::File::create(&partial)
            .map_err(io_err(format!("create {}", partial.display())))?;
        let mut archive = tar::Builder::new(io::BufWriter::new(file));
        archive.mode(tar::HeaderMode::Deterministic);
        let mut add = |path: &str, data: &[u8]| -> Result<(), ImageError> {
            let mut header = tar::Header::new_gnu();
            header.set_mode(0o644);
            header.set_size(data.len() as u64);
            header.set_mtime(0);
            archive
                .append_data(&mut header, path, data)
                .map_err(io_err(format!("write {path} into {}", partial.display())))
        };
        add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        add("index.json", &index)?;
        for (digest, data) in &blobs {
            let hex = digest.trim_start_matches("sha256:");
            add(&format!("blobs/sha256/{hex}"), data)?;
        }
        let mut writer = archive
            .into_inner()
            .map_err(io_err(format!("finish {}", partial.display())))?;
        writer
            .flush()
            .map_err(io_err(format!("write {}", partial.display())))?;
        drop(writer);
        std::fs::rename(&partial, out).map_err(io_err(format!("write {}", out.display())))
    }
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// The shared libraries (and loader) a dynamically linked program needs, from `ldd`.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, ImageError> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|e| ImageError::Tool {
            command: format!("ldd {}", binary.display()),
            message: e.to_string(),
            fix: "install libc-bin (ldd ships with glibc)",
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // A static binary needs nothing.
        if text.contains("not a dynamic executable")
            || String::from_utf8_lossy(&out.stderr).contains("not a dynamic executable")
        {
            return Ok(Vec::new());
        }
        return Err(ImageError::Tool {
            command: format!("ldd {}", binary.display()),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            fix: "check that the binary is a Linux executable of this machine's architecture",
        });
    }
    Ok(parse_ldd(&text))
}

fn parse_ldd(text: &str) -> Vec<PathBuf> {
    let mut libs: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let path = match line.split_once("=>") {
                Some((_, rest)) => rest.trim(),
                None => line,
            };
            let path = path.split_whitespace().next()?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect();
    libs.sort();
    libs.dedup();
    libs
}

/// The base every Strait image starts from: users, /tmp, name resolution.
fn base_layer() -> Layer {
    let mut layer = Layer::default();
    layer
        .dir("/tmp", 0o1777)
        .dir("/home/nonroot", 0o755)
        .bytes(
            "/etc/passwd",
            b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
            0o644,
        )
        .bytes("/etc/group", b"root:x:0:\nnonroot:x:65532:\n", 0o644)
        .bytes("/etc/nsswitch.conf", b"hosts: files dns\n", 0o644);
    if Path::new("/etc/protocols").exists() {
        layer.host_file("/etc/protocols", "/etc/protocols", 0o644);
    }
    layer
}

/// `iptables` (nft backend) with its libraries and extensions, for the proxy's
/// transparent mode, which runs it inside pods' network namespaces.
fn iptables_layer() -> Result<Layer, ImageError> {
    let multi = Path::new("/usr/sbin/xtables-nft-multi");
    if !multi.exists() {
        return Err(ImageError::Tool {
            command: "find /usr/sbin/xtables-nft-multi".into(),
            message: "not found".into(),
            fix: "apt-get install iptables (the proxy image carries it for transparent mode)",
        });
    }
    let mut layer = Layer::default();
    layer.host_file(multi, multi, 0o755).libraries_of(multi)?;
    for name in ["iptables", "iptables-restore", "iptables-save"] {
        layer.symlink(format!("/usr/sbin/{name}"), "xtables-nft-multi");
    }
    let extensions = Path::new("/usr/lib/x86_64-linux-gnu/xtables");
    let mut found = std::fs::read_dir(extensions)
        .map_err(io_err(format!("list {}", extensions.display())))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "so"))
        .collect::<Vec<_>>();
    found.sort();
    for ext in found {
        layer.host_file(ext.clone(), ext.clone(), 0o644);
        layer.libraries_of(&ext)?;
    }
    Ok(layer)
}

/// One image per Strait component, from the binaries in `bin_dir`.
pub fn strait_images(bin_dir: &Path, registry: &str, tag: &str) -> Result<Vec<Image>, ImageError> {
    let mut images = Vec::new();
    for (component, binaries) in COMPONENTS {
        let mut libs = Layer::default();
        let mut bins = Layer::default();
        for binary in *binaries {
            let path = bin_dir.join(binary);
            if !path.exists() {
                return Err(ImageError::MissingBinary(path));
            }
            libs.libraries_of(&path)?;
            bins.host_file(format!("/usr/local/bin/{binary}"), &path, 0o755);
        }
        let mut layers = vec![base_layer(), libs];
        if *component == "proxy" {
            layers.push(iptables_layer()?);
        }
        layers.push(bins);
        images.push(Image {
            name: format!(
                "{}/strait-{component}:{tag}",
                registry.trim_end_matches('/')
            ),
            entrypoint: vec![format!("/usr/local/bin/{}", binaries[0])],
            user: "65532:65532".into(),
            layers,
        });
    }
    Ok(images)
}

/// The test workload image: `strait-backend` and `strait-load` from `bin_dir`.
pub fn backend_image(bin_dir: &Path) -> Result<Image, ImageError> {
    let mut libs = Layer::default();
    let mut bins = Layer::default();
    for binary in ["strait-backend", "strait-load"] {
        let path = bin_dir.join(binary);
        if !path.exists() {
            return Err(ImageError::MissingBinary(path));
        }
        libs.libraries_of(&path)?;
        bins.host_file(format!("/usr/local/bin/{binary}"), &path, 0o755);
    }
    Ok(Image {
        name: BACKEND_IMAGE.into(),
        entrypoint: vec!["/usr/local/bin/strait-backend".into()],
        user: "65532:65532".into(),
        layers: vec![base_layer(), libs, bins],
    })
}

/// The pause image, from `testenv/images/pause.c` built static with `cc`.
pub fn pause_image(work: &Path) -> Result<Image, ImageError> {
    let source = work.join("pause.c");
    let binary = work.join("pause");
    std::fs::create_dir_all(work).map_err(io_err(format!("create {}", work.display())))?;
    std::fs::write(&source, include_str!("../../images/pause.c"))
        .map_err(io_err(format!("write {}", source.display())))?;
    let out = Command::new("cc")
        .args(["-Os", "-static", "-s", "-o"])
        .arg(&binary)
        .arg(&source)
        .output()
        .map_err(|e| ImageError::Tool {
            command: "cc".into(),
            message: e.to_string(),
            fix: "apt-get install gcc libc6-dev (the pause image is built from C)",
        })?;
    if !out.status.success() {
        return Err(ImageError::Tool {
            command: format!("cc -static {}", source.display()),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            fix: "apt-get install gcc libc6-dev (static glibc, for the pause image)",
        });
    }
    let mut layer = Layer::default();
    layer.host_file("/pause", &binary, 0o755);
    Ok(Image {
        name: crate::realnode::PAUSE_IMAGE.into(),
        entrypoint: vec!["/pause".into()],
        user: "65535:65535".into(),
        layers: vec![layer],
    })
}

/// Writes `image` as an archive in the image cache unless one with the same
/// inputs is there; returns its path.
pub fn cached_archive(image: &Image) -> Result<PathBuf, ImageError> {
    let hash = image.input_hash()?;
    let dir = crate::controlplane::cache_root().join("images");
    std::fs::create_dir_all(&dir).map_err(io_err(format!("create {}", dir.display())))?;
    let file_name: String = image
        .name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let path = dir.join(format!("{file_name}-{hash}.tar"));
    if !path.exists() {
        image.write_archive(&path)?;
        // Archives of this image from older inputs (earlier builds) are of no
        // more use: the cache keeps one per image name.
        let prefix = format!("{file_name}-");
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let stale = name.starts_with(&prefix)
                && name.ends_with(".tar")
                && entry.path() != path
                && name[prefix.len()..].len() == hash.len() + ".tar".len();
            if stale {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    Ok(path)
}

/// The archives every real node needs: pause, and the test backend from `bin_dir`.
pub fn node_archives(bin_dir: &Path) -> Result<Vec<PathBuf>, ImageError> {
    let work = crate::controlplane::cache_root()
        .join("images")
        .join("pause-src");
    [pause_image(&work)?, backend_image(bin_dir)?]
        .iter()
        .map(cached_archive)
        .collect()
}

/// Strait's images from `bin_dir`, named as `strait install` renders them by
/// default, as cached archives.
pub fn strait_archives(bin_dir: &Path) -> Result<Vec<PathBuf>, ImageError> {
    strait_images(bin_dir, DEFAULT_REGISTRY, DEFAULT_TAG)?
        .iter()
        .map(cached_archive)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_library_and_loader_paths() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(text),
            vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }

    #[test]
    fn archive_is_an_oci_layout_whose_digests_match() {
        let dir = tempfile::tempdir().unwrap();
        let mut layer = Layer::default();
        layer
            .bytes("/etc/hello", b"hi\n", 0o644)
            .dir("/tmp", 0o1777);
        let image = Image {
            name: "strait.local/test:1".into(),
            entrypoint: vec!["/bin/true".into()],
            user: "65532:65532".into(),
            layers: vec![layer],
        };
        let path = dir.path().join("x.tar");
        image.write_archive(&path).unwrap();
        let mut files = std::collections::BTreeMap::new();
        let mut archive = tar::Archive::new(std::fs::File::open(&path).unwrap());
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().display().to_string();
            let mut data = Vec::new();
            io::Read::read_to_end(&mut entry, &mut data).unwrap();
            files.insert(name, data);
        }
        assert!(files.contains_key("oci-layout"));
        for (name, data) in &files {
            if let Some(hex) = name.strip_prefix("blobs/sha256/") {
                assert_eq!(sha256(data), format!("sha256:{hex}"), "blob {name}");
            }
        }
        let index: serde_json::Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let manifest = &index["manifests"][0];
        assert_eq!(
            manifest["annotations"]["io.containerd.image.name"],
            "strait.local/test:1"
        );
        let digest = manifest["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:");
        let manifest: serde_json::Value =
            serde_json::from_slice(&files[&format!("blobs/sha256/{digest}")]).unwrap();
        assert_eq!(manifest["layers"].as_array().unwrap().len(), 1);
        // Same inputs, same hash; another file, another.
        let again = image.input_hash().unwrap();
        assert_eq!(again, image.input_hash().unwrap());
        let mut other = image.clone();
        other.layers[0].bytes("/etc/hello", b"bye\n", 0o644);
        assert_ne!(again, other.input_hash().unwrap());
    }
}
