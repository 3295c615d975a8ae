//! Writing credentials to a directory with Istio's file names:
//! `cert-chain.pem` (leaf and intermediates), `key.pem` (0600) and
//! `root-cert.pem` (every root of the CA answer's last element: both roots
//! during a root rotation), replaced together as one.
//!
//! The layout is Kubernetes' `AtomicWriter` (what projected volumes, Istio's
//! agent and cert-manager's csi-driver use), so readers built for a mounted
//! Secret read it unchanged:
//!
//! ```text
//! out/..2025_01_02_03_04_05.123456789/{key.pem,cert-chain.pem,root-cert.pem}
//! out/..data -> ..2025_01_02_03_04_05.123456789
//! out/key.pem -> ..data/key.pem         (and the same for the two others)
//! ```
//!
//! A write puts the three files in a new generation directory and syncs
//! them and it; only then does it switch `..data` to it, with one rename of
//! a symlink (atomic). So every generation directory holds a matching key
//! and chain, and `..data` only ever names a complete one: whatever step
//! fails (or the process dies), `..data` names the old generation or the new
//! one. The file names users read (`key.pem`, …) are symlinks through
//! `..data`, created once and never changed.
//!
//! What a reader can rely on: the switch of `..data` is the one point where
//! the credentials change. A reader that opens `key.pem` and then
//! `cert-chain.pem` may straddle a switch (old key, new chain); it must
//! either resolve `..data` once (`readlink`) and read both files from that
//! generation directory, which stays in place until two more writes have
//! replaced it (the current and the previous generation are kept, older
//! ones are removed), or re-read both when the chain's key does not match.
//!
//! One writer at a time: a write holds an exclusive `flock` on the output
//! directory itself, so two processes (or two agents given the same
//! `--output-dir` by mistake) never interleave their switches and clean-ups;
//! a second writer waits up to [`LOCK_WAIT`] and then fails with
//! [`OutputError::Busy`], the directory unchanged.
//!
//! A directory holding plain files from an older meshca-agent is migrated
//! without a visible change: their contents are copied into a generation,
//! `..data` is pointed at it, and each plain file is replaced (rename) by
//! its symlink, which reads the same bytes. Then the new credentials are
//! written as above.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use meshca_certs::bundle;

use crate::issuer::Svid;

/// Chain file name.
pub const CERT_CHAIN_FILE: &str = "cert-chain.pem";
/// Key file name.
pub(crate) const KEY_FILE: &str = "key.pem";
/// Root bundle file name.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
/// The symlink naming the current generation directory.
pub const DATA_LINK: &str = "..data";
/// The name `..data`'s replacement is made under before it is renamed over it.
const DATA_LINK_TMP: &str = "..data_tmp";
/// How long a write waits for another writer of the same directory to
/// finish (see the module documentation) before it fails.
pub const LOCK_WAIT: Duration = Duration::from_secs(5);

/// Why credentials could not be written. Whatever the error, the directory
/// still shows a matching key and chain (the old ones, or the new ones when
/// only something after the switch failed).
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// A file-system call failed.
    #[error("cannot {action} {}: {cause}", path.display())]
    Io {
        /// What was being done ("write", "rename", …).
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The OS error (in the message, so not a `source()`).
        cause: io::Error,
    },
    /// Where a credential file or `..data` must be, there is something the
    /// agent does not replace (a directory, a device).
    #[error("{} is not a file or the agent's symlink; move it away so that the credentials can be written", path.display())]
    Occupied {
        /// The path in the way.
        path: PathBuf,
    },
    /// Another process held the directory's write lock for longer than
    /// [`LOCK_WAIT`].
    #[error("another process is writing credentials to {} (it held the directory's lock for {}s); give each agent its own output directory", path.display(), LOCK_WAIT.as_secs())]
    Busy {
        /// The output directory.
        path: PathBuf,
    },
}

/// A step of a write, as the fault-injection hook of the tests sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Creating a generation directory.
    CreateGeneration,
    /// Creating and writing a file in a generation directory.
    WriteFile(&'static str),
    /// Syncing that file.
    SyncFile(&'static str),
    /// Syncing the generation directory.
    SyncGeneration,
    /// Creating the user-visible symlink of a file (or replacing a plain
    /// file by it).
    Link(&'static str),
    /// Switching `..data` to the new generation.
    SwitchData,
    /// Syncing the output directory.
    SyncDir,
    /// Removing a generation older than the previous one.
    Cleanup,
}

/// One credential file: its name, contents and mode.
struct OutFile<'a> {
    name: &'static str,
    contents: &'a [u8],
    mode: u32,
}

/// Writes the credentials into `dir` (created if needed), replacing key,
/// chain and roots as one (see the module documentation for the layout and
/// what a reader can rely on).
pub fn write_credentials(dir: &Path, svid: &Svid) -> Result<(), OutputError> {
    let roots = svid.bundle.to_pem();
    let key = svid.key.to_pkcs8_pem();
    let chain = chain_pem(svid);
    let files = [
        OutFile {
            name: ROOT_CERT_FILE,
            contents: roots.as_bytes(),
            mode: bundle::PUBLIC_FILE_MODE,
        },
        OutFile {
            name: KEY_FILE,
            contents: key.as_bytes(),
            mode: bundle::PRIVATE_KEY_MODE,
        },
        OutFile {
            name: CERT_CHAIN_FILE,
            contents: chain.as_bytes(),
            mode: bundle::PUBLIC_FILE_MODE,
        },
    ];
    write_files(dir, &files, &mut |_| Ok(()))
}

/// `cert-chain.pem`: every element of the CA's answer but the last (the
/// roots), as Istio's agent writes it; the leaf alone if that is all there is.
pub fn chain_pem(svid: &Svid) -> String {
    let n = svid.chain_pem.len();
    let keep = if n > 1 { n - 1 } else { n };
    svid.chain_pem[..keep].concat()
}

type Hook<'h> = &'h mut dyn FnMut(Step) -> io::Result<()>;

fn io_err<'p>(action: &'static str, path: &'p Path) -> impl FnOnce(io::Error) -> OutputError + 'p {
    move |cause| OutputError::Io {
        action,
        path: path.to_path_buf(),
        cause,
    }
}

/// What is at a user-visible name.
enum Visible {
    Absent,
    /// The agent's symlink to `..data/<name>`.
    OurLink,
    /// A plain file (or a symlink elsewhere): an older agent's, migrated.
    Plain,
}

fn visible(dir: &Path, name: &str) -> Result<Visible, OutputError> {
    let path = dir.join(name);
    match fs::symlink_metadata(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Visible::Absent),
        Err(e) => Err(io_err("inspect", &path)(e)),
        Ok(meta) if meta.file_type().is_symlink() => {
            let target = fs::read_link(&path).map_err(io_err("read the link", &path))?;
            if target == Path::new(DATA_LINK).join(name) {
                Ok(Visible::OurLink)
            } else {
                Ok(Visible::Plain)
            }
        }
        Ok(meta) if meta.file_type().is_file() => Ok(Visible::Plain),
        Ok(_) => Err(OutputError::Occupied { path }),
    }
}

/// The generation `..data` names now, if any.
fn current_generation(dir: &Path) -> Result<Option<PathBuf>, OutputError> {
    let path = dir.join(DATA_LINK);
    match fs::symlink_metadata(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err("inspect", &path)(e)),
        Ok(meta) if meta.file_type().is_symlink() => fs::read_link(&path)
            .map(Some)
            .map_err(io_err("read the link", &path)),
        Ok(_) => Err(OutputError::Occupied { path }),
    }
}

/// Holds `dir`'s exclusive write lock until dropped (see the module
/// documentation).
#[derive(Debug)]
struct DirLock {
    _dir: fs::File,
}

/// Takes `dir`'s write lock, waiting up to [`LOCK_WAIT`] for another writer.
fn lock_dir(dir: &Path, wait: Duration) -> Result<DirLock, OutputError> {
    use rustix::fs::{flock, FlockOperation};
    let file = fs::File::open(dir).map_err(io_err("open", dir))?;
    let deadline = Instant::now() + wait;
    loop {
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(DirLock { _dir: file }),
            Err(rustix::io::Errno::WOULDBLOCK) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(OutputError::Busy {
                    path: dir.to_path_buf(),
                })
            }
            Err(e) => return Err(io_err("lock", dir)(e.into())),
        }
    }
}

fn write_files(dir: &Path, files: &[OutFile<'_>], hook: Hook<'_>) -> Result<(), OutputError> {
    fs::create_dir_all(dir).map_err(io_err("create", dir))?;
    let _lock = lock_dir(dir, LOCK_WAIT)?;
    // Anything in the way is refused before anything changes.
    let mut plain = Vec::new();
    for file in files {
        if let Visible::Plain = visible(dir, file.name)? {
            plain.push(file.name);
        }
    }
    let mut previous = current_generation(dir)?;
    if !plain.is_empty() {
        migrate(dir, files, &plain, hook)?;
        previous = current_generation(dir)?;
    }

    let generation = write_generation(dir, files, hook)?;
    let switched = link_and_switch(dir, files, &generation, hook);
    if let Err(e) = switched {
        // `..data` still names the old generation: drop the new one.
        let _ = fs::remove_dir_all(dir.join(&generation));
        let _ = fs::remove_file(dir.join(DATA_LINK_TMP));
        return Err(e);
    }
    // The new credentials are in place: what fails now is logged, not
    // returned (a retry would change nothing a reader sees).
    if let Err(e) = sync_dir(dir, hook) {
        tracing::warn!(dir = %dir.display(), error = %e, "syncing the output directory failed");
    }
    if let Err(e) = clean_up(dir, &generation, previous.as_deref(), hook) {
        tracing::warn!(dir = %dir.display(), error = %e, "removing old credential generations failed; retried at the next write");
    }
    Ok(())
}

/// Makes a generation of the plain files' contents and puts the agent's
/// symlinks in their place, so that a reader sees the same bytes throughout.
fn migrate(
    dir: &Path,
    files: &[OutFile<'_>],
    plain: &[&'static str],
    hook: Hook<'_>,
) -> Result<(), OutputError> {
    let mut old: Vec<(&'static str, Vec<u8>, u32)> = Vec::new();
    for file in files {
        let path = dir.join(file.name);
        // Only a regular file an older agent wrote is kept. A symlink that
        // is not ours is never followed: whoever can write the directory
        // could point it at a file only the agent may read, whose bytes
        // would then be copied out readable.
        match fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_file() => {}
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err("inspect", &path)(e)),
        }
        match fs::read(&path) {
            Ok(contents) => old.push((file.name, contents, file.mode)),
            // Gone meanwhile: nothing to keep.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("read", &path)(e)),
        }
    }
    let old_files: Vec<OutFile<'_>> = old
        .iter()
        .map(|(name, contents, mode)| OutFile {
            name,
            contents,
            mode: *mode,
        })
        .collect();
    let generation = write_generation(dir, &old_files, hook)?;
    let mut migrated = || -> Result<(), OutputError> {
        // The links that exist already read the old generation, whose
        // files these copies are; the plain files are not links yet.
        switch_data(dir, &generation, hook)?;
        sync_dir(dir, hook)?;
        for name in plain {
            link(dir, name, hook)?;
        }
        Ok(())
    };
    let result = migrated();
    if result.is_err() && current_generation(dir).ok().flatten() != Some(generation.clone()) {
        let _ = fs::remove_dir_all(dir.join(&generation));
    }
    if result.is_ok() {
        tracing::info!(dir = %dir.display(), files = ?plain, "credential files of an older agent moved into a generation directory");
    }
    result
}

/// Creates a new generation directory holding `files`, each written and
/// synced, and syncs the directory. Returns its name (relative to `dir`).
fn write_generation(
    dir: &Path,
    files: &[OutFile<'_>],
    hook: Hook<'_>,
) -> Result<PathBuf, OutputError> {
    let stamp = time::OffsetDateTime::now_utc();
    let base = format!(
        "..{:04}_{:02}_{:02}_{:02}_{:02}_{:02}.{:09}",
        stamp.year(),
        u8::from(stamp.month()),
        stamp.day(),
        stamp.hour(),
        stamp.minute(),
        stamp.second(),
        stamp.nanosecond()
    );
    hook(Step::CreateGeneration).map_err(io_err("create", &dir.join(&base)))?;
    let mut attempt = 0u32;
    let name = loop {
        let name = if attempt == 0 {
            PathBuf::from(&base)
        } else {
            PathBuf::from(format!("{base}_{attempt}"))
        };
        match fs::create_dir(dir.join(&name)) {
            Ok(()) => {
                use std::os::unix::fs::PermissionsExt;
                // 0755 whatever the umask (as Kubernetes' AtomicWriter):
                // the chain and root stay readable to other users, the key
                // is protected by its own 0600.
                let path = dir.join(&name);
                fs::set_permissions(&path, fs::Permissions::from_mode(0o755))
                    .map_err(io_err("set the mode of", &path))?;
                break name;
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 100 => attempt += 1,
            Err(e) => return Err(io_err("create", &dir.join(&name))(e)),
        }
    };
    let path = dir.join(&name);
    let written = (|| {
        for file in files {
            write_synced(&path, file, hook)?;
        }
        hook(Step::SyncGeneration).map_err(io_err("sync", &path))?;
        fs::File::open(&path)
            .and_then(|d| d.sync_all())
            .map_err(io_err("sync", &path))
    })();
    if let Err(e) = written {
        let _ = fs::remove_dir_all(&path);
        return Err(e);
    }
    Ok(name)
}

fn write_synced(generation: &Path, file: &OutFile<'_>, hook: Hook<'_>) -> Result<(), OutputError> {
    let path = generation.join(file.name);
    hook(Step::WriteFile(file.name)).map_err(io_err("write", &path))?;
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(file.mode);
    }
    let mut out = options.open(&path).map_err(io_err("create", &path))?;
    #[cfg(unix)]
    {
        // The umask may have cleared bits we want (0644); set exactly.
        use std::os::unix::fs::PermissionsExt;
        out.set_permissions(fs::Permissions::from_mode(file.mode))
            .map_err(io_err("set the mode of", &path))?;
    }
    out.write_all(file.contents)
        .map_err(io_err("write", &path))?;
    hook(Step::SyncFile(file.name)).map_err(io_err("sync", &path))?;
    out.sync_all().map_err(io_err("sync", &path))
}

/// Creates the symlinks that do not exist yet (a first write), then switches
/// `..data` to `generation`.
fn link_and_switch(
    dir: &Path,
    files: &[OutFile<'_>],
    generation: &Path,
    hook: Hook<'_>,
) -> Result<(), OutputError> {
    for file in files {
        match visible(dir, file.name)? {
            Visible::OurLink => {}
            // Before the switch, a new link reads what `..data` names now:
            // nothing (a first write) or the current generation.
            Visible::Absent | Visible::Plain => link(dir, file.name, hook)?,
        }
    }
    switch_data(dir, generation, hook)
}

/// Puts the symlink `name -> ..data/name` in place, over a plain file if
/// there is one (rename: a reader sees the file or the link).
fn link(dir: &Path, name: &'static str, hook: Hook<'_>) -> Result<(), OutputError> {
    let path = dir.join(name);
    hook(Step::Link(name)).map_err(io_err("link", &path))?;
    let tmp = dir.join(format!(".{name}.link.{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    symlink(&Path::new(DATA_LINK).join(name), &tmp).map_err(io_err("link", &tmp))?;
    fs::rename(&tmp, &path).map_err(|cause| {
        let _ = fs::remove_file(&tmp);
        io_err("rename a link over", &path)(cause)
    })
}

/// Points `..data` at `generation`: a new symlink renamed over the old one.
fn switch_data(dir: &Path, generation: &Path, hook: Hook<'_>) -> Result<(), OutputError> {
    let path = dir.join(DATA_LINK);
    hook(Step::SwitchData).map_err(io_err("switch", &path))?;
    let tmp = dir.join(DATA_LINK_TMP);
    let _ = fs::remove_file(&tmp);
    symlink(generation, &tmp).map_err(io_err("link", &tmp))?;
    fs::rename(&tmp, &path).map_err(io_err("rename a link over", &path))
}

fn sync_dir(dir: &Path, hook: Hook<'_>) -> Result<(), OutputError> {
    hook(Step::SyncDir).map_err(io_err("sync", dir))?;
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("sync", dir))
}

/// Removes every generation directory but `current` and `previous`, and
/// what failed writes left behind.
fn clean_up(
    dir: &Path,
    current: &Path,
    previous: Option<&Path>,
    hook: Hook<'_>,
) -> Result<(), OutputError> {
    let entries = fs::read_dir(dir).map_err(io_err("list", dir))?;
    for entry in entries {
        let entry = entry.map_err(io_err("list", dir))?;
        let name = PathBuf::from(entry.file_name());
        let keep = name == current || Some(name.as_path()) == previous;
        let path = entry.path();
        let file_type = entry.file_type().map_err(io_err("inspect", &path))?;
        if file_type.is_symlink() && name.to_str().is_some_and(is_stray_link) {
            // A link a killed write left (the directory is locked: no
            // other write is using it now).
            hook(Step::Cleanup).map_err(io_err("remove", &path))?;
            fs::remove_file(&path).map_err(io_err("remove", &path))?;
            continue;
        }
        let ours = name.to_str().is_some_and(|n| {
            n.starts_with("..")
                && n != DATA_LINK
                && n.as_bytes().get(2).is_some_and(u8::is_ascii_digit)
        });
        if keep || !ours || !file_type.is_dir() {
            continue;
        }
        hook(Step::Cleanup).map_err(io_err("remove", &path))?;
        fs::remove_dir_all(&path).map_err(io_err("remove", &path))?;
    }
    Ok(())
}

/// `.<credential file>.link.<pid>`: the temporary name [`link`] gives a
/// symlink before renaming it into place.
fn is_stray_link(name: &str) -> bool {
    [ROOT_CERT_FILE, KEY_FILE, CERT_CHAIN_FILE]
        .iter()
        .any(|file| {
            name.strip_prefix('.')
                .and_then(|rest| rest.strip_prefix(file))
                .and_then(|rest| rest.strip_prefix(".link."))
                .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        })
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(not(unix))]
fn symlink(_target: &Path, _link: &Path) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "the credential output needs symbolic links",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const NAMES: [&str; 3] = [ROOT_CERT_FILE, KEY_FILE, CERT_CHAIN_FILE];

    /// The three files of generation `tag`: each holds `<name>:<tag>`.
    fn contents(tag: &str) -> Vec<(&'static str, String, u32)> {
        NAMES
            .iter()
            .map(|&name| {
                let mode = if name == KEY_FILE {
                    bundle::PRIVATE_KEY_MODE
                } else {
                    bundle::PUBLIC_FILE_MODE
                };
                (name, format!("{name}:{tag}"), mode)
            })
            .collect()
    }

    fn write(dir: &Path, tag: &str, hook: Hook<'_>) -> Result<(), OutputError> {
        let owned = contents(tag);
        let files: Vec<OutFile<'_>> = owned
            .iter()
            .map(|(name, text, mode)| OutFile {
                name,
                contents: text.as_bytes(),
                mode: *mode,
            })
            .collect();
        write_files(dir, &files, hook)
    }

    /// What a reader of `dir` sees.
    #[derive(Debug, PartialEq, Eq)]
    enum Seen {
        /// No file readable (before the first write).
        Nothing,
        /// All three files of one generation.
        All(String),
    }

    /// Reads the three files by the names users read, and the generation
    /// `..data` names: both must show one generation whole.
    fn seen(dir: &Path) -> Seen {
        let read = |path: PathBuf, name: &str| -> Option<String> {
            let text = fs::read_to_string(path).ok()?;
            let tag = text
                .strip_prefix(&format!("{name}:"))
                .unwrap_or_else(|| panic!("{name} holds {text:?}"));
            Some(tag.to_string())
        };
        let tags: Vec<Option<String>> = NAMES.iter().map(|n| read(dir.join(n), n)).collect();
        // Once `..data` exists (not yet in an older agent's layout), the
        // names read what it names, links or not yet.
        if let Ok(generation) = fs::read_link(dir.join(DATA_LINK)) {
            let through_data: Vec<Option<String>> = NAMES
                .iter()
                .map(|n| read(dir.join(&generation).join(n), n))
                .collect();
            assert_eq!(tags, through_data, "the names read what ..data names");
        }
        match tags.as_slice() {
            [None, None, None] => Seen::Nothing,
            [Some(a), Some(b), Some(c)] if a == b && b == c => Seen::All(a.clone()),
            mixed => panic!("a mixed pair: {mixed:?}"),
        }
    }

    /// Every step a write of `tag` over `dir` as it is takes.
    fn steps_of(dir: &Path, tag: &str) -> Vec<Step> {
        let mut steps = Vec::new();
        write(dir, tag, &mut |s| {
            steps.push(s);
            Ok(())
        })
        .unwrap();
        steps
    }

    /// Entries of `dir` that are generation directories.
    fn generations(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("..") && n != DATA_LINK)
            .collect();
        names.sort();
        names
    }

    fn injected() -> io::Error {
        io::Error::other("injected failure")
    }

    /// Fails the write of "new" over a directory `prepare` made at each of
    /// its steps in turn; checks what a reader sees at every step and after
    /// the failure (`old` whole or "new" whole, never a mix), then that the
    /// next write succeeds and leaves at most two generations.
    fn fail_each_step(prepare: impl Fn(&Path), old: Seen, expected_steps: &[Step]) {
        let probe = tempfile::tempdir().unwrap();
        prepare(probe.path());
        let steps = steps_of(probe.path(), "new");
        for step in expected_steps {
            assert!(steps.contains(step), "{step:?} in {steps:?}");
        }
        let switch = steps.iter().rposition(|s| *s == Step::SwitchData).unwrap();
        for (at, step) in steps.iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            prepare(dir.path());
            let mut n = 0;
            let result = write(dir.path(), "new", &mut |s| {
                // What a reader sees just before each step.
                let now = seen(dir.path());
                assert!(
                    now == old || now == Seen::All("new".into()),
                    "before {s:?}: {now:?}"
                );
                n += 1;
                if n - 1 == at {
                    Err(injected())
                } else {
                    Ok(())
                }
            });
            let after = seen(dir.path());
            if at <= switch {
                let err = result.expect_err("a failure before the switch is an error");
                assert!(err.to_string().contains("injected failure"), "{err}");
                assert_eq!(after, old, "failed at {step:?}: the old files stay");
            } else {
                // Syncing the directory or removing old generations failed:
                // the new files are in place, and that is not an error.
                result.unwrap_or_else(|e| panic!("failed at {step:?}: {e}"));
                assert_eq!(after, Seen::All("new".into()), "failed at {step:?}");
            }
            write(dir.path(), "next", &mut |_| Ok(())).unwrap();
            assert_eq!(seen(dir.path()), Seen::All("next".into()), "after {step:?}");
            let left = generations(dir.path());
            assert!(left.len() <= 2, "after {step:?}: {left:?}");
        }
    }

    #[test]
    fn a_rotation_failing_at_any_step_leaves_the_old_or_the_new_files_whole() {
        fail_each_step(
            |dir| write(dir, "old", &mut |_| Ok(())).unwrap(),
            Seen::All("old".into()),
            &[
                Step::CreateGeneration,
                Step::WriteFile(KEY_FILE),
                Step::WriteFile(CERT_CHAIN_FILE),
                Step::WriteFile(ROOT_CERT_FILE),
                Step::SyncFile(KEY_FILE),
                Step::SyncFile(CERT_CHAIN_FILE),
                Step::SyncGeneration,
                Step::SwitchData,
                Step::SyncDir,
            ],
        );
    }

    #[test]
    fn a_rotation_after_two_writes_fails_at_cleanup_too() {
        // Two generations exist, so the third write removes one.
        fail_each_step(
            |dir| {
                write(dir, "older", &mut |_| Ok(())).unwrap();
                write(dir, "old", &mut |_| Ok(())).unwrap();
            },
            Seen::All("old".into()),
            &[Step::Cleanup, Step::SwitchData],
        );
    }

    #[test]
    fn a_first_write_failing_at_any_step_shows_nothing_or_everything() {
        fail_each_step(
            |_| {},
            Seen::Nothing,
            &[
                Step::Link(KEY_FILE),
                Step::Link(CERT_CHAIN_FILE),
                Step::SwitchData,
            ],
        );
    }

    /// What meshca-agent before the generation layout left: plain files.
    fn plain_files(dir: &Path) {
        for (name, text, mode) in contents("old") {
            bundle::write_file_atomic(&dir.join(name), text.as_bytes(), mode).unwrap();
        }
    }

    #[test]
    fn plain_files_of_an_older_agent_are_migrated_without_a_visible_change() {
        fail_each_step(
            plain_files,
            Seen::All("old".into()),
            &[
                Step::Link(KEY_FILE),
                Step::Link(CERT_CHAIN_FILE),
                Step::Link(ROOT_CERT_FILE),
                Step::SwitchData,
            ],
        );
        let dir = tempfile::tempdir().unwrap();
        plain_files(dir.path());
        write(dir.path(), "new", &mut |_| Ok(())).unwrap();
        for name in NAMES {
            assert_eq!(
                fs::read_link(dir.path().join(name)).unwrap(),
                Path::new(DATA_LINK).join(name)
            );
        }
        // The old files are kept as the previous generation.
        let generation = generations(dir.path());
        assert_eq!(generation.len(), 2, "{generation:?}");
        let previous = dir.path().join(&generation[0]).join(KEY_FILE);
        assert_eq!(fs::read_to_string(previous).unwrap(), "key.pem:old");
    }

    #[test]
    fn a_foreign_symlink_is_replaced_never_followed_and_generations_are_0755() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("only-the-agent-reads-this");
        fs::write(&secret, "the agent's own token").unwrap();
        plain_files(dir.path());
        fs::remove_file(dir.path().join(ROOT_CERT_FILE)).unwrap();
        std::os::unix::fs::symlink(&secret, dir.path().join(ROOT_CERT_FILE)).unwrap();
        write(dir.path(), "new", &mut |_| Ok(())).unwrap();
        for generation in generations(dir.path()) {
            let path = dir.path().join(&generation);
            let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o755, "{generation}");
            for name in NAMES {
                let copied = fs::read_to_string(path.join(name)).unwrap_or_default();
                assert!(!copied.contains("token"), "{generation}/{name}: {copied}");
            }
        }
        assert_eq!(
            fs::read_to_string(dir.path().join(ROOT_CERT_FILE)).unwrap(),
            "root-cert.pem:new"
        );
        assert_eq!(
            fs::read_to_string(&secret).unwrap(),
            "the agent's own token"
        );
    }

    #[test]
    fn something_in_the_way_is_refused_before_anything_changes() {
        // The old layout, with a directory where the chain must go (what
        // left a new key beside an old chain before).
        let dir = tempfile::tempdir().unwrap();
        plain_files(dir.path());
        fs::remove_file(dir.path().join(CERT_CHAIN_FILE)).unwrap();
        fs::create_dir(dir.path().join(CERT_CHAIN_FILE)).unwrap();
        let err = write(dir.path(), "new", &mut |_| Ok(())).unwrap_err();
        assert!(matches!(err, OutputError::Occupied { .. }), "{err}");
        assert_eq!(
            fs::read_to_string(dir.path().join(KEY_FILE)).unwrap(),
            "key.pem:old"
        );
        assert!(!dir.path().join(DATA_LINK).exists());
        assert!(generations(dir.path()).is_empty());
        // The same in the new layout.
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "old", &mut |_| Ok(())).unwrap();
        fs::remove_file(dir.path().join(CERT_CHAIN_FILE)).unwrap();
        fs::create_dir(dir.path().join(CERT_CHAIN_FILE)).unwrap();
        let before = fs::read_link(dir.path().join(DATA_LINK)).unwrap();
        assert!(write(dir.path(), "new", &mut |_| Ok(())).is_err());
        assert_eq!(fs::read_link(dir.path().join(DATA_LINK)).unwrap(), before);
        assert_eq!(
            fs::read_to_string(dir.path().join(KEY_FILE)).unwrap(),
            "key.pem:old"
        );
        // Once it is moved away, the write goes through.
        fs::remove_dir(dir.path().join(CERT_CHAIN_FILE)).unwrap();
        write(dir.path(), "new", &mut |_| Ok(())).unwrap();
        assert_eq!(seen(dir.path()), Seen::All("new".into()));
    }

    #[test]
    fn the_key_is_0600_and_at_most_two_generations_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..5 {
            write(dir.path(), &i.to_string(), &mut |_| Ok(())).unwrap();
            assert_eq!(seen(dir.path()), Seen::All(i.to_string()));
            let kept = generations(dir.path());
            assert_eq!(kept.len(), (i + 1).min(2), "{kept:?}");
        }
        let mode = |name: &str| {
            fs::metadata(dir.path().join(name))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode(KEY_FILE), 0o600);
        assert_eq!(mode(CERT_CHAIN_FILE), 0o644);
        assert_eq!(mode(ROOT_CERT_FILE), 0o644);
        // Nothing else is left behind: the three links, `..data` and two
        // generations.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 3 + 1 + 2);
    }

    #[test]
    fn links_a_killed_write_left_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "1", &mut |_| Ok(())).unwrap();
        let stray = dir.path().join(".key.pem.link.4242");
        symlink(&Path::new(DATA_LINK).join(KEY_FILE), &stray).unwrap();
        // Someone else's names that only look alike stay.
        let foreign = [
            "key.pem.link.1",
            ".key.pem.link.",
            ".key.pem.link.12x",
            ".notes.link.1",
        ];
        for name in foreign {
            symlink(Path::new("elsewhere"), &dir.path().join(name)).unwrap();
        }
        write(dir.path(), "2", &mut |_| Ok(())).unwrap();
        assert!(
            fs::symlink_metadata(&stray).is_err(),
            "the stray link is gone"
        );
        for name in foreign {
            assert!(
                fs::symlink_metadata(dir.path().join(name)).is_ok(),
                "{name} stays"
            );
        }
        assert_eq!(seen(dir.path()), Seen::All("2".into()));
    }

    #[test]
    fn a_second_writer_waits_for_the_lock_and_then_fails_leaving_the_directory_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "1", &mut |_| Ok(())).unwrap();
        let held = lock_dir(dir.path(), LOCK_WAIT).unwrap();
        let started = Instant::now();
        let refused = lock_dir(dir.path(), Duration::from_millis(200));
        assert!(
            matches!(refused, Err(OutputError::Busy { .. })),
            "{refused:?}"
        );
        assert!(started.elapsed() >= Duration::from_millis(200));
        let message = refused.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            message.contains(&dir.path().display().to_string()),
            "{message}"
        );
        // A writer that comes once the lock is given back goes ahead.
        let waiting = {
            let dir = dir.path().to_path_buf();
            std::thread::spawn(move || write(&dir, "2", &mut |_| Ok(())))
        };
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            seen(dir.path()),
            Seen::All("1".into()),
            "nothing changes while the lock is held"
        );
        drop(held);
        waiting.join().unwrap().unwrap();
        assert_eq!(seen(dir.path()), Seen::All("2".into()));
    }
}
