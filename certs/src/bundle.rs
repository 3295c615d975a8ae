//! PEM certificate bundles and safe file writing.
//!
//! A bundle is one or more `CERTIFICATE` PEM blocks (a chain, leaf first, or
//! a set of roots). Files that hold CA material are written atomically: a
//! temporary file in the same directory, fsync, rename, fsync of the
//! directory; private keys get mode 0600 before any byte is written.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use x509_parser::prelude::{FromDer, X509Certificate};

/// PEM tag of a certificate.
pub(crate) const CERTIFICATE_TAG: &str = "CERTIFICATE";

/// File mode for private keys.
pub const PRIVATE_KEY_MODE: u32 = 0o600;
/// File mode for public material (certificates, bundles).
pub const PUBLIC_FILE_MODE: u32 = 0o644;

/// Errors reading or writing bundles.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// A file could not be read.
    #[error("cannot read {}: {cause}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error (in the message, so not a `source()`).
        cause: io::Error,
    },
    /// A file could not be written.
    #[error("cannot write {}: {cause}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error (in the message, so not a `source()`).
        cause: io::Error,
    },
    /// The file is binary, not PEM text (usually DER).
    #[error("{}: binary data, not PEM text (a DER file? convert it with `openssl x509 -inform der -in FILE -out FILE.pem` for a certificate, `openssl pkey -inform der` for a key)", path.display())]
    NotText {
        /// The file.
        path: PathBuf,
    },
    /// The path is a symbolic link to nothing.
    #[error("{} is a dangling symbolic link (to {}, which does not exist)", path.display(), target.display())]
    DanglingSymlink {
        /// The link.
        path: PathBuf,
        /// Where it points.
        target: PathBuf,
    },
    /// The text is not valid PEM.
    #[error("not valid PEM: {0}")]
    NotPem(String),
    /// A BEGIN line has no END line (a truncated file), or an END line
    /// has no BEGIN line. The `pem` crate skips such a block silently, so
    /// it is looked for before parsing.
    #[error("line {line}: {problem}")]
    BrokenPem {
        /// 1-based line of the BEGIN (or stray END) line.
        line: usize,
        /// What is wrong.
        problem: String,
    },
    /// The PEM holds no CERTIFICATE block.
    #[error("no CERTIFICATE block found")]
    NoCertificates,
    /// A CERTIFICATE block does not hold a valid X.509 certificate.
    #[error("certificate #{index}: {reason}")]
    BadCertificate {
        /// 1-based position of the block.
        index: usize,
        /// What the parser said.
        reason: String,
    },
}

impl BundleError {
    /// The same error, naming the file it came from.
    pub(crate) fn in_file(self, path: &Path) -> FileError {
        FileError {
            path: path.to_path_buf(),
            cause: self,
        }
    }
}

/// A bundle error with the file it was found in.
///
/// Like every error of the workspace, its message is complete: it says
/// the cause, so the cause is not also a `source()` (`{:#}` in the
/// binaries would print it twice).
#[derive(Debug, thiserror::Error)]
pub struct FileError {
    /// The file.
    pub path: PathBuf,
    /// The problem (in the message, so not a `source()`).
    pub cause: BundleError,
}

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.cause {
            // These name the file already.
            BundleError::Read { .. }
            | BundleError::Write { .. }
            | BundleError::NotText { .. }
            | BundleError::DanglingSymlink { .. } => self.cause.fmt(f),
            other => write!(f, "{}: {other}", self.path.display()),
        }
    }
}

/// Parses every `CERTIFICATE` block of a PEM text into DER, checking that
/// each is a valid X.509 certificate. Other blocks are ignored.
pub fn parse_certs_pem(text: &str) -> Result<Vec<Vec<u8>>, BundleError> {
    check_pem_framing(text)?;
    let blocks = pem::parse_many(text).map_err(|e| BundleError::NotPem(e.to_string()))?;
    let mut certs = Vec::new();
    for block in blocks.into_iter().filter(|b| b.tag() == CERTIFICATE_TAG) {
        let der = block.into_contents();
        let index = certs.len() + 1;
        match X509Certificate::from_der(&der) {
            Ok(([], _)) => certs.push(der),
            Ok(_) => {
                return Err(BundleError::BadCertificate {
                    index,
                    reason: "trailing bytes after the certificate".into(),
                })
            }
            Err(e) => {
                return Err(BundleError::BadCertificate {
                    index,
                    reason: describe_x509_error(&e),
                })
            }
        }
    }
    if certs.is_empty() {
        return Err(BundleError::NoCertificates);
    }
    Ok(certs)
}

/// Checks that every `-----BEGIN …-----` line is closed by an
/// `-----END …-----` line before the next BEGIN or the end of the text,
/// and that no END line comes without a BEGIN. `pem::parse_many` drops an
/// unterminated block without a word, so a truncated bundle would lose its
/// last certificate silently. Text outside the blocks (`openssl x509
/// -text` output, comments) is still allowed.
fn check_pem_framing(text: &str) -> Result<(), BundleError> {
    let mut open: Option<(usize, &str)> = None;
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("-----BEGIN ") {
            let label = rest.trim_end_matches('-');
            if let Some((begin, open_label)) = open {
                return Err(BundleError::BrokenPem {
                    line: begin,
                    problem: format!(
                        "BEGIN {open_label} has no END line before the next BEGIN at line {line_no} (truncated or damaged PEM)"
                    ),
                });
            }
            open = Some((line_no, label));
        } else if let Some(rest) = line.strip_prefix("-----END ") {
            if open.take().is_none() {
                return Err(BundleError::BrokenPem {
                    line: line_no,
                    problem: format!(
                        "END {} without a BEGIN line (damaged PEM)",
                        rest.trim_end_matches('-')
                    ),
                });
            }
        }
    }
    match open {
        Some((begin, label)) => Err(BundleError::BrokenPem {
            line: begin,
            problem: format!("BEGIN {label} has no END line: the file is truncated or damaged"),
        }),
        None => Ok(()),
    }
}

/// Reads a PEM file of certificates.
pub fn read_certs_file(path: &Path) -> Result<Vec<Vec<u8>>, FileError> {
    let text = read_text(path).map_err(|e| e.in_file(path))?;
    parse_certs_pem(&text).map_err(|e| e.in_file(path))
}

/// Reads a text file; the error names the file.
/// A file that is not UTF-8 (a DER certificate or key) is
/// [`BundleError::NotText`], a link to nothing [`BundleError::DanglingSymlink`].
pub(crate) fn read_text(path: &Path) -> Result<String, BundleError> {
    let bytes = fs::read(path).map_err(|cause| {
        if cause.kind() == io::ErrorKind::NotFound {
            if let Ok(target) = fs::read_link(path) {
                return BundleError::DanglingSymlink {
                    path: path.to_path_buf(),
                    target,
                };
            }
        }
        BundleError::Read {
            path: path.to_path_buf(),
            cause,
        }
    })?;
    String::from_utf8(bytes).map_err(|_| BundleError::NotText {
        path: path.to_path_buf(),
    })
}

/// One DER certificate as PEM: LF line endings, 64 base64 characters per
/// line, the same text as the `pem` crate writes.
///
/// Written here rather than with `pem::encode_config` because the CA does
/// this once per certificate it issues: one allocation of the exact size
/// and base64 straight into it, where the `pem` crate copies the DER,
/// encodes to a second string and formats each line (docs/benchmarks-history.md has
/// the instruction counts of both).
pub fn encode_cert_pem(der: &[u8]) -> String {
    use base64::Engine;
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----\n";
    const END: &str = "-----END CERTIFICATE-----\n";
    /// 48 bytes are exactly one 64-character line.
    const BYTES_PER_LINE: usize = 48;
    const CHARS_PER_LINE: usize = BYTES_PER_LINE / 3 * 4;
    // One encoder pass over the whole DER, then cut into lines: an encoder
    // call per line costs about three times as much (a leaf per issuance).
    let encoded = base64::engine::general_purpose::STANDARD.encode(der);
    let lines = der.len().div_ceil(BYTES_PER_LINE);
    let mut pem = String::with_capacity(BEGIN.len() + encoded.len() + lines + END.len());
    pem.push_str(BEGIN);
    let mut rest = encoded.as_str();
    while !rest.is_empty() {
        // Base64 is ASCII, so every index is a character boundary.
        let (line, tail) = rest.split_at(rest.len().min(CHARS_PER_LINE));
        pem.push_str(line);
        pem.push('\n');
        rest = tail;
    }
    pem.push_str(END);
    pem
}

/// Several DER certificates as one PEM text, in order.
pub fn encode_certs_pem<D: AsRef<[u8]>>(ders: &[D]) -> String {
    ders.iter().map(|d| encode_cert_pem(d.as_ref())).collect()
}

/// Writes `contents` to `path` atomically with the given mode: a temporary
/// file in the same directory (created with `mode`), fsync, rename over
/// `path`, fsync of the directory. A reader sees the old file or the new
/// one, never a mix.
pub fn write_file_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<(), BundleError> {
    stage_file(path, contents, mode)?.commit()
}

/// A file written and synced next to its destination, not yet renamed into
/// place. Several staged files can be committed back to back, so the window
/// in which a reader sees some new and some old files is a few renames.
/// Dropping it uncommitted removes the temporary file.
#[derive(Debug)]
pub struct StagedFile {
    tmp: PathBuf,
    path: PathBuf,
    dir: PathBuf,
    committed: bool,
}

impl StagedFile {
    /// Renames the staged file over its destination and syncs the directory.
    pub(crate) fn commit(mut self) -> Result<(), BundleError> {
        fs::rename(&self.tmp, &self.path).map_err(|cause| BundleError::Write {
            path: self.path.clone(),
            cause,
        })?;
        self.committed = true;
        if let Ok(d) = fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for StagedFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// Commits several staged files with their renames back to back and one
/// directory sync after them all, so the window in which a reader sees some
/// new and some old files is as short as the OS makes two renames.
pub fn commit_all(files: Vec<StagedFile>) -> Result<(), BundleError> {
    let mut dirs = Vec::new();
    for mut file in files {
        fs::rename(&file.tmp, &file.path).map_err(|cause| BundleError::Write {
            path: file.path.clone(),
            cause,
        })?;
        file.committed = true;
        if !dirs.contains(&file.dir) {
            dirs.push(file.dir.clone());
        }
    }
    for dir in dirs {
        if let Ok(d) = fs::File::open(&dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// Writes and syncs `contents` to a temporary file next to `path` (with
/// `mode` from creation on) without touching `path` yet.
pub fn stage_file(path: &Path, contents: &[u8], mode: u32) -> Result<StagedFile, BundleError> {
    let err = |cause| BundleError::Write {
        path: path.to_path_buf(),
        cause,
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| err(io::Error::new(io::ErrorKind::InvalidInput, "no file name")))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp.{}.{}", std::process::id(), unique_suffix()));
    let staged = StagedFile {
        tmp: dir.join(tmp_name),
        path: path.to_path_buf(),
        dir,
        committed: false,
    };
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(mode);
    }
    let mut file = options.open(&staged.tmp).map_err(err)?;
    #[cfg(unix)]
    {
        // The umask may have cleared bits we want (0644); set exactly.
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(fs::Permissions::from_mode(mode))
            .map_err(err)?;
    }
    file.write_all(contents).map_err(err)?;
    file.sync_all().map_err(err)?;
    Ok(staged)
}

fn unique_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// An x509-parser error in plain words: what the parser said is a nom
/// error with DER tags in Debug form, which tells a person nothing.
pub(crate) fn describe_x509_error(
    e: &x509_parser::nom::Err<x509_parser::error::X509Error>,
) -> String {
    match e {
        x509_parser::nom::Err::Incomplete(_) => {
            "the DER is cut short (a truncated or damaged certificate)".into()
        }
        x509_parser::nom::Err::Error(x) | x509_parser::nom::Err::Failure(x) => match x {
            x509_parser::error::X509Error::Der(_) => {
                "not a DER-encoded X.509 certificate (damaged, or another kind of object in a CERTIFICATE block)".into()
            }
            other => format!("not a valid X.509 certificate ({other})"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cert_pem_is_the_text_the_pem_crate_writes() {
        let config = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
        // Every remainder modulo 3 (padding) and 48 (line length), empty,
        // one full line, and a certificate-sized body.
        for len in (0..=200).chain([479, 480, 481, 1500]) {
            let der: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let expected = pem::encode_config(&pem::Pem::new(CERTIFICATE_TAG, der.clone()), config);
            assert_eq!(encode_cert_pem(&der), expected, "{len} bytes");
            let parsed = pem::parse(expected.as_bytes()).unwrap();
            assert_eq!(parsed.contents(), &der[..]);
        }
    }

    #[test]
    fn atomic_write_sets_mode_and_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.pem");
        write_file_atomic(&path, b"one", PRIVATE_KEY_MODE).unwrap();
        write_file_atomic(&path, b"two", PRIVATE_KEY_MODE).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        // No temporary files left behind.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn parse_errors_are_specific() {
        assert!(matches!(
            parse_certs_pem("nothing"),
            Err(BundleError::NoCertificates)
        ));
        let bad = encode_cert_pem(&[0x30, 0x01, 0x00]);
        assert!(matches!(
            parse_certs_pem(&bad),
            Err(BundleError::BadCertificate { index: 1, .. })
        ));
        // A truncated last block is an error, not a shorter bundle.
        let one = encode_cert_pem(&[0x30, 0x01, 0x00]);
        let two = format!("{one}{}", &one[..40]);
        let err = parse_certs_pem(&two).unwrap_err();
        assert!(
            matches!(err, BundleError::BrokenPem { line, .. } if line == one.lines().count() + 1),
            "{err:?}"
        );
        assert!(err.to_string().contains("no END line"), "{err}");
        let cut = one.find("-----END").unwrap();
        let no_end_then_begin = format!("{}{one}", &one[..cut]);
        assert!(matches!(
            parse_certs_pem(&no_end_then_begin),
            Err(BundleError::BrokenPem { line: 1, .. })
        ));
        let stray_end = format!("{one}-----END CERTIFICATE-----\n");
        assert!(matches!(
            parse_certs_pem(&stray_end),
            Err(BundleError::BrokenPem { .. })
        ));
        // DER and dangling links say what they are.
        let dir = tempfile::tempdir().unwrap();
        let der = dir.path().join("ca.der");
        fs::write(&der, [0x30, 0x82, 0x01, 0xff, 0xa0, 0x03]).unwrap();
        let err = read_certs_file(&der).unwrap_err().to_string();
        assert!(
            err.contains("ca.der") && err.contains("not PEM") && err.contains("DER"),
            "{err}"
        );
        #[cfg(unix)]
        {
            let link = dir.path().join("ca-key.pem");
            std::os::unix::fs::symlink(dir.path().join("gone.pem"), &link).unwrap();
            let err = read_certs_file(&link).unwrap_err().to_string();
            assert!(
                err.contains("dangling symbolic link") && err.contains("gone.pem"),
                "{err}"
            );
        }
        let missing = Path::new("/nonexistent/meshca/root.pem");
        let err = read_certs_file(missing).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/meshca/root.pem"));
    }
}
