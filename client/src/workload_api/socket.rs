//! The Unix socket: binding it safely (parent directory, stale file from a
//! crashed run replaced, a live agent never displaced, mode so workloads of
//! any user can connect) and accepting connections with the caller's
//! credentials recorded for each one.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::attest::{pod_uid_of_caller, PodUidLookup};
use super::per_pod::{Admission, PodSlot};

/// Mode of the socket file: every local user may connect. Who gets which
/// identity is decided per caller (node mode) or by who can reach the
/// socket's directory (pod mode: a shared `emptyDir`).
pub(crate) const SOCKET_MODE: u32 = 0o777;
/// Mode of a socket directory the agent creates.
pub(crate) const SOCKET_DIR_MODE: u32 = 0o755;

/// Why the socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another process answers on the socket.
    #[error("{path} is in use by a running process (another meshca-agent?); stop it or choose another --workload-api-socket")]
    InUse {
        /// The socket path.
        path: PathBuf,
    },
    /// Something that is not a socket is in the way.
    #[error(
        "{path} exists and is not a socket; remove it or choose another --workload-api-socket"
    )]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// An OS call failed.
    #[error("{action} {path}: {cause}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// On which path.
        path: PathBuf,
        /// The OS error.
        cause: io::Error,
    },
}

fn io_error<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> SocketError + 'a {
    move |cause| SocketError::Io {
        action,
        path: path.to_path_buf(),
        cause,
    }
}

/// Binds `path`: creates the parent directory (0755) if missing, replaces a
/// stale socket file that nobody answers on, refuses a live one or a
/// non-socket file, and sets the socket's mode to `SOCKET_MODE` (0777).
pub async fn bind(path: &Path) -> Result<UnixListener, SocketError> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.exists() {
            std::fs::create_dir_all(parent).map_err(io_error("creating the directory", parent))?;
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(SOCKET_DIR_MODE))
                .map_err(io_error("setting the mode of", parent))?;
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => match UnixStream::connect(path).await {
            Ok(_) => {
                return Err(SocketError::InUse {
                    path: path.to_path_buf(),
                })
            }
            // Nobody listens: a crashed run's file.
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                tracing::info!(socket = %path.display(), "replacing a stale socket file");
                std::fs::remove_file(path).map_err(io_error("removing the stale socket", path))?;
            }
            // Anything else (a live agent whose queue is full, no
            // permission) says nothing of staleness: the file stays.
            Err(e) => return Err(io_error("checking whether an agent answers on", path)(e)),
        },
        Ok(_) => {
            return Err(SocketError::NotASocket {
                path: path.to_path_buf(),
            })
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error("inspecting", path)(e)),
    }
    let listener = UnixListener::bind(path).map_err(io_error("binding", path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
        .map_err(io_error("setting the mode of", path))?;
    Ok(listener)
}

/// Who is on the other end of a connection, as seen when it was accepted.
#[derive(Debug, Clone)]
pub(crate) struct CallerInfo {
    /// The peer's process ID (`SO_PEERCRED`), if the OS told us.
    pub(crate) pid: Option<i32>,
    /// The peer's user ID.
    pub(crate) uid: Option<u32>,
    /// Node mode: the pod UID read from the peer's cgroups at accept time
    /// (before the PID could be reused).
    pub(crate) pod_uid: Option<Arc<PodUidLookup>>,
}

/// An accepted connection with its caller's credentials; holds a
/// connection slot (and in node mode one of its pod's) until it closes.
#[derive(Debug)]
pub(crate) struct CallerConnection {
    io: UnixStream,
    info: CallerInfo,
    _slot: OwnedSemaphorePermit,
    _pod_slot: Option<PodSlot>,
}

impl CallerConnection {
    /// Who is on the other end.
    pub(crate) fn info(&self) -> &CallerInfo {
        &self.info
    }
}

impl AsyncRead for CallerConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for CallerConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// File descriptors the connection cap leaves to the agent itself: the
/// token file, the root file, its connections to the CA and the
/// Kubernetes API, the listener, the runtime's own.
pub const FD_RESERVE: u64 = 64;

/// The most connections the socket takes at once: `configured`, but no
/// more than the soft limit of open files (`soft_limit`, `None` if
/// unknown) leaves after [`FD_RESERVE`]; at least 1.
pub fn connection_cap(configured: usize, soft_limit: Option<u64>) -> usize {
    let configured = configured.max(1);
    match soft_limit {
        Some(limit) => {
            let room = usize::try_from(limit.saturating_sub(FD_RESERVE)).unwrap_or(usize::MAX);
            configured.min(room).max(1)
        }
        None => configured,
    }
}

/// Raises the soft limit of open files (`RLIMIT_NOFILE`) to the hard
/// limit, as the Go runtime does for SPIRE's agent, and returns the soft
/// limit in force (`None` if it cannot be read). A failure to raise it
/// keeps the old one.
pub fn raise_open_files_limit() -> Option<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource, RLIM_INFINITY};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    // An infinite hard limit cannot be the soft limit of open files on
    // Linux (it is capped by fs.nr_open): keep the soft one then.
    if hard != RLIM_INFINITY && hard > soft {
        match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => return Some(hard),
            Err(e) => {
                tracing::debug!(error = %e, soft, hard, "cannot raise the open-files limit");
            }
        }
    }
    (soft != RLIM_INFINITY).then_some(soft)
}

/// Node mode's attestation of callers: where their `<pid>/cgroup` files
/// are, and the admission of each new connection by its pod's limit
/// (`Callers::admit_connection`).
#[derive(Clone)]
pub(crate) struct NodeAttestation {
    /// Normally `/proc`.
    pub(crate) proc_root: PathBuf,
    /// Admits or refuses a new connection, knowing its caller.
    pub(crate) admit: Arc<dyn Fn(&CallerInfo) -> Admission + Send + Sync>,
}

impl std::fmt::Debug for NodeAttestation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeAttestation")
            .field("proc_root", &self.proc_root)
            .finish_non_exhaustive()
    }
}

/// HTTP/2's ENHANCE_YOUR_CALM error code (RFC 9113, section 7): the peer
/// is told it opened too much.
const ENHANCE_YOUR_CALM: u32 = 0xb;
/// The most bytes of a refusal's reason sent in its GOAWAY.
const MAX_REFUSAL_REASON: usize = 256;

/// What a refused connection is sent before it is closed: an HTTP/2
/// server preface (an empty SETTINGS frame) and a GOAWAY that accepted no
/// stream, with `ENHANCE_YOUR_CALM` and `reason` as its debug data, so an
/// HTTP/2 client can say why instead of only "connection reset".
pub(crate) fn refusal_frames(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REFUSAL_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let debug = &reason.as_bytes()[..end];
    // Frame header: 24-bit length, type, flags, 31-bit stream 0.
    let header = |length: usize, kind: u8| {
        let length = u32::try_from(length).unwrap_or(0).to_be_bytes();
        [length[1], length[2], length[3], kind, 0, 0, 0, 0, 0]
    };
    const SETTINGS: u8 = 0x4;
    const GOAWAY: u8 = 0x7;
    let mut frames = Vec::with_capacity(9 + 9 + 8 + debug.len());
    frames.extend_from_slice(&header(0, SETTINGS));
    frames.extend_from_slice(&header(8 + debug.len(), GOAWAY));
    frames.extend_from_slice(&0u32.to_be_bytes()); // last stream: none
    frames.extend_from_slice(&ENHANCE_YOUR_CALM.to_be_bytes());
    frames.extend_from_slice(debug);
    frames
}

/// Refuses an accepted connection: writes [`refusal_frames`] without
/// waiting (a new socket's send buffer has room; should the write find it
/// not ready, nothing is sent and the caller sees only the close) and
/// closes it. The caller reads the frames before it sees the close (a
/// Unix socket delivers queued data before the reset that closing with
/// the caller's preface unread causes).
fn refuse(io: UnixStream, reason: &str) {
    let _ = io.try_write(&refusal_frames(reason));
    drop(io);
}

/// Accepts connections until dropped, at most `max_connections` open at
/// once (accepting waits for a slot), recording each caller's credentials
/// and, in node mode, its pod UID; a connection from a pod that holds its
/// most connections already is told why ([`refusal_frames`]) and closed at
/// once.
pub(crate) fn accept_callers(
    listener: UnixListener,
    max_connections: usize,
    node: Option<NodeAttestation>,
) -> impl Stream<Item = CallerConnection> {
    let slots = Arc::new(Semaphore::new(max_connections.max(1)));
    let accept_failures = Arc::new(meshca_serve::rate_limited_log::RateLimitedLog::new(
        meshca_serve::rate_limited_log::DEFAULT_LOG_INTERVAL,
    ));
    futures::stream::unfold(
        (listener, slots, node, accept_failures),
        |(listener, slots, node, accept_failures)| async move {
            let slot = slots.clone().acquire_owned().await.ok()?;
            loop {
                match listener.accept().await {
                    Ok((io, _)) => {
                        let cred = io.peer_cred().ok();
                        let pid = cred.as_ref().and_then(|c| c.pid());
                        let pod_uid = node.as_ref().map(|node| {
                            Arc::new(match pid {
                                Some(pid) => pod_uid_of_caller(&node.proc_root, pid),
                                None => PodUidLookup::NoPid,
                            })
                        });
                        let info = CallerInfo {
                            pid,
                            uid: cred.map(|c| c.uid()),
                            pod_uid,
                        };
                        let pod_slot = match node.as_ref().map(|node| (node.admit)(&info)) {
                            None => None,
                            Some(Admission::Admitted(slot)) => slot,
                            Some(Admission::Refused { reason }) => {
                                // Closed here; the connection slot serves the next.
                                refuse(io, &reason);
                                continue;
                            }
                        };
                        tracing::debug!(pid = ?info.pid, uid = ?info.uid, "workload connected");
                        let connection = CallerConnection {
                            io,
                            info,
                            _slot: slot,
                            _pod_slot: pod_slot,
                        };
                        return Some((connection, (listener, slots, node, accept_failures)));
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: wait a little
                        // instead of spinning, keep serving the open streams.
                        if let Some(unlogged) = accept_failures.record() {
                            tracing::warn!(error = %e, unlogged, "accepting a workload connection failed");
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;
    use tokio::io::AsyncReadExt;

    use super::super::per_pod::{PerPodLimit, PodKey};
    use super::*;

    const UID: &str = "2c48913c-b29f-11e7-9350-020968147796";
    const OTHER_UID: &str = "7a7b7c7d-aaaa-4bbb-8ccc-dddddddddddd";
    const CONTAINER: &str = "9bca8d63d5fa610783847915bcff0ecac1273e5b4bed3f6fa1b07350e0135961";

    /// Writes the cgroup file that makes this test process run in pod `uid`.
    fn run_in_pod(proc_root: &Path, uid: &str) {
        let own = proc_root.join(std::process::id().to_string());
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(
            own.join("cgroup"),
            format!("0::/kubepods/pod{uid}/{CONTAINER}\n"),
        )
        .unwrap();
    }

    /// Admission by `limit`, keyed by the pod UID the accept loop read.
    fn admit_by(limit: Arc<PerPodLimit>) -> NodeAttestation {
        NodeAttestation {
            proc_root: PathBuf::new(),
            admit: Arc::new(move |caller: &CallerInfo| {
                let key = match caller.pod_uid.as_deref() {
                    Some(PodUidLookup::Pod { uid, .. }) => PodKey::Pod(uid.clone()),
                    _ => PodKey::Unattested,
                };
                match limit.try_take(&key) {
                    Some(slot) => Admission::Admitted(Some(slot)),
                    None => Admission::Refused {
                        reason: format!("{key} holds its most connections (--max-streams-per-pod)"),
                    },
                }
            }),
        }
    }

    /// What `stream` read until the other end closed it (within a few
    /// seconds): the GOAWAY's error code and debug text, after an empty
    /// SETTINGS frame; `None` if it was not closed so, or sent anything else.
    async fn refusal(stream: &mut UnixStream) -> Option<(u32, String)> {
        let mut bytes = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            stream.read_to_end(&mut bytes),
        )
        .await
        .ok()?
        .ok()?;
        let settings = bytes.get(..9)?;
        let goaway = bytes.get(9..).filter(|g| g.len() >= 17)?;
        let length = u32::from_be_bytes([0, goaway[0], goaway[1], goaway[2]]) as usize;
        (settings == [0, 0, 0, 4, 0, 0, 0, 0, 0]
            && goaway.get(3..9)? == [7, 0, 0, 0, 0, 0]
            && goaway.len() == 9 + length
            && goaway.get(9..13)? == [0, 0, 0, 0])
        .then_some(())?;
        let code = u32::from_be_bytes(goaway.get(13..17)?.try_into().ok()?);
        Some((code, String::from_utf8_lossy(&goaway[17..]).into_owned()))
    }

    #[test]
    fn a_long_reason_is_cut_at_a_character_boundary() {
        // One ASCII byte first: the limit falls inside an "é".
        let reason = format!("x{}", "é".repeat(MAX_REFUSAL_REASON));
        let frames = refusal_frames(&reason);
        let debug = &frames[9 + 9 + 8..];
        assert_eq!(debug.len(), MAX_REFUSAL_REASON - 1);
        assert!(std::str::from_utf8(debug).is_ok());
        assert_eq!(
            u32::from_be_bytes([0, frames[9], frames[10], frames[11]]) as usize,
            8 + debug.len()
        );
    }

    #[tokio::test]
    async fn a_pod_beyond_its_connections_is_closed_without_taking_a_slot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let proc_root = tempfile::tempdir().unwrap();
        run_in_pod(proc_root.path(), UID);
        let per_pod = PerPodLimit::new(2);
        let node = NodeAttestation {
            proc_root: proc_root.path().to_path_buf(),
            ..admit_by(per_pod.clone())
        };
        // Three connection slots in all; this process is pod UID.
        let mut incoming = Box::pin(accept_callers(listener, 3, Some(node)));
        let _one = UnixStream::connect(&path).await.unwrap();
        let _two = UnixStream::connect(&path).await.unwrap();
        let first = incoming.next().await.unwrap();
        let _second = incoming.next().await.unwrap();
        assert!(
            matches!(first.info().pod_uid.as_deref(), Some(PodUidLookup::Pod { uid, .. }) if uid == UID)
        );
        assert_eq!(per_pod.held_by(&PodKey::Pod(UID.into())), 2);
        // The pod's third is closed at once.
        let mut third = UnixStream::connect(&path).await.unwrap();
        let accepting = tokio::spawn(async move {
            let next = incoming.next().await;
            (next, incoming)
        });
        let (code, reason) = refusal(&mut third)
            .await
            .expect("the pod's third connection gets a GOAWAY and is closed");
        assert_eq!(code, ENHANCE_YOUR_CALM);
        assert!(
            reason.contains(UID) && reason.contains("--max-streams-per-pod"),
            "{reason}"
        );
        // Another pod still gets the one slot left: the refused connection
        // did not keep it.
        run_in_pod(proc_root.path(), OTHER_UID);
        let _other = UnixStream::connect(&path).await.unwrap();
        let (next, _incoming) = tokio::time::timeout(std::time::Duration::from_secs(10), accepting)
            .await
            .expect("the other pod's connection is accepted")
            .unwrap();
        let other = next.unwrap();
        assert!(
            matches!(other.info().pod_uid.as_deref(), Some(PodUidLookup::Pod { uid, .. }) if uid == OTHER_UID)
        );
        // A connection closed gives its pod's place back.
        drop(first);
        assert_eq!(per_pod.held_by(&PodKey::Pod(UID.into())), 1);
    }

    #[tokio::test]
    async fn pod_mode_reads_no_cgroup() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let mut incoming = Box::pin(accept_callers(listener, 16, None));
        let _one = UnixStream::connect(&path).await.unwrap();
        let connection = incoming.next().await.unwrap();
        assert!(connection.info().pod_uid.is_none());
        assert_eq!(connection.info().pid, Some(std::process::id() as i32));
    }
}
