//! Node mode: which pod a calling process runs in, read from
//! `<proc-root>/<pid>/cgroup` the way SPIRE's Kubernetes workload attestor
//! reads it.
//!
//! Every cgroup path of the process (cgroup v1: one line per hierarchy,
//! `ID:controllers:path`; v2: the single `0::path` line) is searched for a
//! `pod<UID>` segment followed by a container ID, which covers the cgroupfs
//! driver (`/kubepods/burstable/pod<uid>/<container>`), the systemd driver
//! (`/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid
//! with _>.slice/cri-containerd-<container>.scope`) and paths seen through a
//! cgroup namespace (`/../../pod<uid>/<container>`). The UID's punctuation
//! is normalised to `-`. A process whose paths name two different pods or
//! containers is refused.

use std::path::Path;
use std::sync::OnceLock;

use regex::Regex;

/// What the cgroups of a process say about its pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PodUidLookup {
    /// The process runs in the pod with this UID, in this container.
    Pod {
        /// The pod's UID, canonical (`-`-separated).
        uid: String,
        /// The container ID.
        container: String,
    },
    /// No cgroup of the process is a pod's container.
    NotInPod,
    /// The peer credentials carried no PID.
    NoPid,
    /// The cgroups name more than one pod or container.
    Ambiguous(String),
    /// The cgroup file could not be read (the process exited?).
    Unreadable(String),
}

/// The pod-UID-then-container pattern of SPIRE's attestor, applied to a
/// cgroup path with any `.scope` suffix trimmed.
fn cgroup_pattern() -> &'static Regex {
    static PATTERN: OnceLock<Regex> = OnceLock::new();
    PATTERN.get_or_init(|| {
        Regex::new(concat!(
            r"[[:punct:]]pod([[:xdigit:]]{8}[[:punct:]][[:xdigit:]]{4}[[:punct:]]",
            r"[[:xdigit:]]{4}[[:punct:]][[:xdigit:]]{4}[[:punct:]][[:xdigit:]]{12})[[:punct:]]",
            r"(?:[[:^punct:]]+[[:punct:]])*",
            r"([[:^punct:]]+)$",
        ))
        .expect("the cgroup pattern is a valid regular expression")
    })
}

/// The pod UID and container ID in one cgroup path, if it is a pod's.
pub(crate) fn parse_cgroup_path(path: &str) -> Option<(String, String)> {
    let path = path.strip_suffix(".scope").unwrap_or(path);
    let captures = cgroup_pattern().captures(path)?;
    let uid = captures
        .get(1)?
        .as_str()
        .chars()
        .map(|c| if c.is_ascii_punctuation() { '-' } else { c })
        .collect();
    Some((uid, captures.get(2)?.as_str().to_string()))
}

/// The pod of a process from the text of its `/proc/PID/cgroup`.
pub(crate) fn parse_cgroup_file(text: &str) -> PodUidLookup {
    let mut found: Option<(String, String)> = None;
    for line in text.lines() {
        // `hierarchy-ID:controller-list:cgroup-path`; the path may hold ':'.
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        let Some((uid, container)) = parse_cgroup_path(path) else {
            continue;
        };
        match &found {
            None => found = Some((uid, container)),
            Some((u, c)) if *u != uid || *c != container => {
                return PodUidLookup::Ambiguous(format!(
                    "cgroups name pod {u} container {c} and pod {uid} container {container}"
                ))
            }
            Some(_) => {}
        }
    }
    match found {
        Some((uid, container)) => PodUidLookup::Pod { uid, container },
        None => PodUidLookup::NotInPod,
    }
}

/// The pod of the process `pid` that connected, as [`pod_uid_of_pid`]
/// reads it: the process holding the PID at accept is pinned (a pidfd)
/// before its cgroup file is read and must still be running after, so a
/// PID reused while the file is read (the caller exited, leaving its
/// socket to a child, and a process of another pod took its number) is
/// not read as the caller's. A caller that exited is refused as one whose
/// cgroups cannot be read. What this cannot see is a reuse between the
/// caller's connect and the accept (SECURITY.md, "What is not
/// defended"). Where pidfds are missing (Linux before 5.3, or a seccomp
/// profile that forbids them), the file is read as it is.
pub(crate) fn pod_uid_of_caller(proc_root: &Path, pid: i32) -> PodUidLookup {
    use rustix::process::{pidfd_open, Pid, PidfdFlags};
    let Some(process) = Pid::from_raw(pid) else {
        return PodUidLookup::NoPid;
    };
    let pinned = match pidfd_open(process, PidfdFlags::empty()) {
        Ok(pidfd) => Some(pidfd),
        Err(rustix::io::Errno::SRCH) => {
            return PodUidLookup::Unreadable(format!(
                "process {pid} exited before it could be identified"
            ))
        }
        Err(_) => None,
    };
    let lookup = pod_uid_of_pid(proc_root, pid);
    if pinned.as_ref().is_some_and(has_exited) {
        return PodUidLookup::Unreadable(format!(
            "process {pid} exited while it was identified (its PID may be another process's now)"
        ));
    }
    lookup
}

/// Whether the process of `pidfd` has exited (a pidfd polls readable then).
fn has_exited(pidfd: &std::os::fd::OwnedFd) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&now)), Ok(ready) if ready > 0)
}

/// Reads `<proc_root>/<pid>/cgroup` and finds the process's pod.
fn pod_uid_of_pid(proc_root: &Path, pid: i32) -> PodUidLookup {
    let file = proc_root.join(pid.to_string()).join("cgroup");
    match std::fs::read_to_string(&file) {
        Ok(text) => parse_cgroup_file(&text),
        Err(e) => PodUidLookup::Unreadable(format!("{}: {e}", file.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_is_identified_only_while_it_runs() {
        let proc_root = tempfile::tempdir().unwrap();
        let cgroup = format!("0::/kubepods/pod{UID}/{CONTAINER}\n");
        let write_cgroup = |pid: u32| {
            let dir = proc_root.path().join(pid.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cgroup"), &cgroup).unwrap();
        };
        // A running caller (this test's own process).
        let running = std::process::id();
        write_cgroup(running);
        assert_eq!(
            pod_uid_of_caller(proc_root.path(), running as i32),
            PodUidLookup::Pod {
                uid: UID.into(),
                container: CONTAINER.into()
            }
        );
        // A caller that has exited: whatever its PID's cgroup file says now
        // is not the caller's.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let exited = child.id();
        child.wait().unwrap();
        write_cgroup(exited);
        let lookup = pod_uid_of_caller(proc_root.path(), exited as i32);
        assert!(
            matches!(&lookup, PodUidLookup::Unreadable(why) if why.contains("exited")),
            "{lookup:?}"
        );
    }

    const UID: &str = "2c48913c-b29f-11e7-9350-020968147796";
    const CONTAINER: &str = "9bca8d63d5fa610783847915bcff0ecac1273e5b4bed3f6fa1b07350e0135961";

    #[test]
    fn cgroupfs_and_systemd_paths_of_both_versions() {
        let pod = |uid: &str| PodUidLookup::Pod {
            uid: uid.to_string(),
            container: CONTAINER.to_string(),
        };
        // cgroup v1, cgroupfs driver: one line per hierarchy.
        let v1 = format!(
            "12:memory:/kubepods/burstable/pod{UID}/{CONTAINER}\n\
             11:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CONTAINER}\n\
             1:name=systemd:/kubepods/burstable/pod{UID}/{CONTAINER}\n\
             0::/\n"
        );
        assert_eq!(parse_cgroup_file(&v1), pod(UID));
        // cgroup v2, systemd driver: the UID's dashes are underscores.
        let systemd_uid = UID.replace('-', "_");
        let v2 = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd_uid}.slice/cri-containerd-{CONTAINER}.scope\n"
        );
        assert_eq!(parse_cgroup_file(&v2), pod(UID));
        // Docker-in-docker (kind) and a cgroup namespace's relative path.
        let kind = format!("0::/docker/abc123/kubepods/besteffort/pod{UID}/{CONTAINER}\n");
        assert_eq!(parse_cgroup_file(&kind), pod(UID));
        let namespaced = format!("0::/../../pod{UID}/{CONTAINER}\n");
        assert_eq!(parse_cgroup_file(&namespaced), pod(UID));
        // The containerd form with ':' inside the path.
        let colon =
            format!("0::/kubepods-besteffort-pod{systemd_uid}.slice:cri-containerd:{CONTAINER}\n");
        assert_eq!(parse_cgroup_file(&colon), pod(UID));
    }

    #[test]
    fn processes_outside_pods_and_ambiguous_ones() {
        assert_eq!(
            parse_cgroup_file("0::/user.slice/user-1000.slice/session-2.scope\n"),
            PodUidLookup::NotInPod
        );
        assert_eq!(
            parse_cgroup_file("0::/kubepods/burstable/podnot-a-uid/abc\n"),
            PodUidLookup::NotInPod
        );
        assert_eq!(parse_cgroup_file(""), PodUidLookup::NotInPod);
        let other = "11111111-2222-3333-4444-555555555555";
        let two = format!(
            "2:memory:/kubepods/pod{UID}/{CONTAINER}\n1:cpu:/kubepods/pod{other}/{CONTAINER}\n"
        );
        assert!(matches!(
            parse_cgroup_file(&two),
            PodUidLookup::Ambiguous(m) if m.contains(other)
        ));
    }

    #[test]
    fn reads_the_file_under_the_proc_root() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("42")).unwrap();
        std::fs::write(
            dir.path().join("42/cgroup"),
            format!("0::/kubepods/pod{UID}/{CONTAINER}\n"),
        )
        .unwrap();
        assert!(
            matches!(pod_uid_of_pid(dir.path(), 42), PodUidLookup::Pod { uid, .. } if uid == UID)
        );
        assert!(matches!(
            pod_uid_of_pid(dir.path(), 43),
            PodUidLookup::Unreadable(m) if m.contains("43/cgroup")
        ));
    }
}
