//! Which network namespace a process or descriptor is in, told apart from any
//! later namespace.
//!
//! `/proc/<pid>/ns/net` reads `net:[inode]`, and the kernel hands a freed
//! namespace's inode number to the next namespace made (by a test running
//! beside this one, say): a check that a namespace is gone cannot go by the
//! inode alone. The namespace's cookie (`SO_NETNS_COOKIE`, Linux 5.14) is never
//! reused. Reading it is a `getsockopt` that neither rustix nor socket2 wraps:
//! the module's one `unsafe` block.
#![allow(unsafe_code)]

use std::fmt;
use std::os::fd::{AsFd as _, AsRawFd as _};
use std::path::Path;

/// A network namespace: its inode and its never-reused cookie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NsId {
    pub inode: String,
    pub cookie: u64,
}

impl NsId {
    /// The namespace `link` points to (`/proc/<pid>/ns/net`, or a descriptor
    /// under `/proc/<pid>/fd/`), if it is a network namespace that still exists.
    pub fn of(link: &Path) -> Option<NsId> {
        let inode = std::fs::read_link(link).ok()?.display().to_string();
        if !inode.starts_with("net:[") {
            return None;
        }
        Some(NsId {
            inode,
            cookie: cookie(link)?,
        })
    }

    /// The network namespace of process `pid`, if it is still running.
    pub fn of_pid(pid: u32) -> Option<NsId> {
        NsId::of(Path::new(&format!("/proc/{pid}/ns/net")))
    }
}

/// `net:[inode]#cookie`, parsed back by `FromStr`.
impl fmt::Display for NsId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.inode, self.cookie)
    }
}

impl std::str::FromStr for NsId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (inode, cookie) = s
            .split_once('#')
            .ok_or(format!("`{s}` is not `net:[inode]#cookie`"))?;
        Ok(NsId {
            inode: inode.into(),
            cookie: cookie.parse().map_err(|e| format!("`{s}`: {e}"))?,
        })
    }
}

/// `SO_NETNS_COOKIE` of a socket made in the namespace `link` points to, by a
/// short-lived thread that enters it (a socket keeps the namespace it was made
/// in; the thread's namespace ends with the thread).
fn cookie(link: &Path) -> Option<u64> {
    let namespace = std::fs::File::open(link).ok()?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                rustix::thread::move_into_link_name_space(
                    namespace.as_fd(),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )
                .ok()?;
                let socket =
                    socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None).ok()?;
                let mut cookie = 0u64;
                let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
                // SAFETY: the kernel writes at most `len` bytes to `cookie`,
                // a live u64 of that size, and the descriptor is open.
                let rc = unsafe {
                    libc::getsockopt(
                        socket.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_NETNS_COOKIE,
                        (&raw mut cookie).cast(),
                        &mut len,
                    )
                };
                (rc == 0 && len as usize == std::mem::size_of::<u64>()).then_some(cookie)
            })
            .join()
            .ok()
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_text() {
        let id = NsId {
            inode: "net:[4026532174]".into(),
            cookie: 42,
        };
        assert_eq!(id.to_string().parse::<NsId>().unwrap(), id);
        assert!("net:[1]".parse::<NsId>().is_err());
    }
}
