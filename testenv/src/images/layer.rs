//! One file-system layer of an image and its tar.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{ImageError, io_err, shared_libraries};

/// One file-system layer: paths in the image and what goes there.
#[derive(Clone, Debug, Default)]
pub struct Layer {
    entries: BTreeMap<PathBuf, Entry>,
}

#[derive(Clone, Debug)]
enum Entry {
    Dir(u32),
    File { data: FileData, mode: u32 },
    Symlink(PathBuf),
}

#[derive(Clone, Debug)]
enum FileData {
    Host(PathBuf),
    Bytes(Vec<u8>),
}

impl Layer {
    fn parents(&mut self, path: &Path) {
        for parent in path.ancestors().skip(1) {
            if parent == Path::new("/") || parent.as_os_str().is_empty() {
                break;
            }
            self.entries
                .entry(parent.to_path_buf())
                .or_insert(Entry::Dir(0o755));
        }
    }

    /// A folder with `mode` (e.g. 0o1777 for /tmp).
    pub fn dir(&mut self, path: impl Into<PathBuf>, mode: u32) -> &mut Self {
        let path = path.into();
        self.parents(&path);
        self.entries.insert(path, Entry::Dir(mode));
        self
    }

    /// The host file `source` (symlinks followed) at `path`.
    pub fn host_file(
        &mut self,
        path: impl Into<PathBuf>,
        source: impl Into<PathBuf>,
        mode: u32,
    ) -> &mut Self {
        let path = path.into();
        self.parents(&path);
        self.entries.insert(
            path,
            Entry::File {
                data: FileData::Host(source.into()),
                mode,
            },
        );
        self
    }

    /// A file with these contents at `path`.
    pub fn bytes(&mut self, path: impl Into<PathBuf>, data: &[u8], mode: u32) -> &mut Self {
        let path = path.into();
        self.parents(&path);
        self.entries.insert(
            path,
            Entry::File {
                data: FileData::Bytes(data.to_vec()),
                mode,
            },
        );
        self
    }

    pub fn symlink(&mut self, path: impl Into<PathBuf>, target: impl Into<PathBuf>) -> &mut Self {
        let path = path.into();
        self.parents(&path);
        self.entries.insert(path, Entry::Symlink(target.into()));
        self
    }

    /// The shared libraries `binary` links (and the dynamic loader), at the
    /// paths the loader looks for them.
    pub fn libraries_of(&mut self, binary: &Path) -> Result<&mut Self, ImageError> {
        for lib in shared_libraries(binary)? {
            self.host_file(lib.clone(), lib, 0o755);
        }
        Ok(self)
    }

    /// The layer as an uncompressed tar (deterministic: sorted, mtime 0, root-owned).
    pub(super) fn to_tar(&self) -> Result<Vec<u8>, ImageError> {
        let mut builder = tar::Builder::new(Vec::new());
        builder.mode(tar::HeaderMode::Deterministic);
        for (path, entry) in &self.entries {
            let relative = path.strip_prefix("/").unwrap_or(path);
            let mut header = tar::Header::new_gnu();
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            let what = || format!("add {} to a layer", path.display());
            match entry {
                Entry::Dir(mode) => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_mode(*mode);
                    header.set_size(0);
                    builder
                        .append_data(&mut header, relative, io::empty())
                        .map_err(io_err(what()))?;
                }
                Entry::File { data, mode } => {
                    let bytes = match data {
                        FileData::Host(source) => std::fs::read(source)
                            .map_err(io_err(format!("read {}", source.display())))?,
                        FileData::Bytes(bytes) => bytes.clone(),
                    };
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_mode(*mode);
                    header.set_size(bytes.len() as u64);
                    builder
                        .append_data(&mut header, relative, bytes.as_slice())
                        .map_err(io_err(what()))?;
                }
                Entry::Symlink(target) => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_mode(0o777);
                    header.set_size(0);
                    builder
                        .append_link(&mut header, relative, target)
                        .map_err(io_err(what()))?;
                }
            }
        }
        builder.into_inner().map_err(io_err("finish a layer"))
    }

    /// What goes into the cache key: paths, modes and the content of each file.
    pub(super) fn hash_into(&self, hasher: &mut Sha256) -> Result<(), ImageError> {
        for (path, entry) in &self.entries {
            hasher.update(path.as_os_str().as_encoded_bytes());
            match entry {
                Entry::Dir(mode) => hasher.update(format!("d{mode}")),
                Entry::Symlink(target) => {
                    hasher.update(b"l");
                    hasher.update(target.as_os_str().as_encoded_bytes());
                }
                Entry::File { data, mode } => {
                    hasher.update(format!("f{mode}"));
                    match data {
                        FileData::Bytes(bytes) => hasher.update(bytes),
                        FileData::Host(source) => {
                            let mut file = std::fs::File::open(source)
                                .map_err(io_err(format!("read {}", source.display())))?;
                            io::copy(&mut file, hasher)
                                .map_err(io_err(format!("read {}", source.display())))?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
