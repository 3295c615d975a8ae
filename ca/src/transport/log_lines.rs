//! Where the log lines go: standard error, one `write` per line from most
//! threads, and one `write` per turn of work on the event loops.
//!
//! Every certificate adds an audit line (`meshca::audit`). Written one by
//! one, the lines would cost a `write` system call per certificate (and,
//! into a pipe as under Kubernetes, a wake-up of the reader each). On an
//! event loop ([`gather_on_this_thread`]) lines are gathered in a buffer of
//! the thread and written together ([`write_gathered`]); when, so that an
//! audit line is always out before its answer, is described once, in the
//! documentation of the `transport` module. Each `write` is whole lines, at
//! most [`GATHERED_BYTES_MAX`] bytes (the size a pipe writes without
//! interleaving), under the process's lock on standard error.
//!
//! The binary installs the writer (`meshca_ca::log_writer`):
//!
//! ```no_run
//! tracing_subscriber::fmt()
//!     .with_writer(meshca_ca::log_writer)
//!     .init();
//! ```

use std::cell::{Cell, RefCell};
use std::io::{self, Write};

/// Most bytes of lines gathered before they are written (`PIPE_BUF` on
/// Linux: a pipe writes this much without interleaving other writers).
pub(crate) const GATHERED_BYTES_MAX: usize = 4096;

/// The lines gathered on one thread.
struct GatheredLines {
    gathering: Cell<bool>,
    bytes: RefCell<Vec<u8>>,
}

impl GatheredLines {
    /// Keeps `line` for later; `false` if this thread does not gather.
    fn keep(&self, line: &[u8]) -> bool {
        if !self.gathering.get() {
            return false;
        }
        let Ok(mut bytes) = self.bytes.try_borrow_mut() else {
            return false;
        };
        if bytes.len() + line.len() > GATHERED_BYTES_MAX {
            write_out(&mut bytes);
        }
        if line.len() > GATHERED_BYTES_MAX {
            return false;
        }
        bytes.extend_from_slice(line);
        true
    }

    fn write_gathered(&self) {
        if let Ok(mut bytes) = self.bytes.try_borrow_mut() {
            write_out(&mut bytes);
        }
    }
}

impl Drop for GatheredLines {
    fn drop(&mut self) {
        write_out(self.bytes.get_mut());
    }
}

thread_local! {
    static GATHERED: GatheredLines = const {
        GatheredLines {
            gathering: Cell::new(false),
            bytes: RefCell::new(Vec::new()),
        }
    };
}

/// Writes `bytes` to standard error in one call (under its lock) and
/// empties them. A failed write drops the lines: there is nowhere left to
/// report it.
fn write_out(bytes: &mut Vec<u8>) {
    if bytes.is_empty() {
        return;
    }
    let _ = write_to_stderr(bytes);
    bytes.clear();
}

/// One `write_all` to standard error, under its lock.
#[cfg(not(test))]
fn write_to_stderr(bytes: &[u8]) -> io::Result<()> {
    io::stderr().lock().write_all(bytes)
}

/// In unit tests: each call that would have gone to standard error.
#[cfg(test)]
static WRITES: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

#[cfg(test)]
fn write_to_stderr(bytes: &[u8]) -> io::Result<()> {
    WRITES.lock().unwrap().push(bytes.to_vec());
    Ok(())
}

/// From now on, log lines written on this thread are gathered and written
/// by [`write_gathered`] (or when the buffer is full, or when the thread
/// ends). For the event loops.
pub(crate) fn gather_on_this_thread() {
    GATHERED.with(|gathered| gathered.gathering.set(true));
}

/// Writes out the lines gathered on this thread, if any.
pub(crate) fn write_gathered() {
    let _ = GATHERED.try_with(GatheredLines::write_gathered);
}

/// The log writer: `tracing_subscriber::fmt().with_writer(meshca_ca::log_writer)`.
pub fn stderr() -> LogLineWriter {
    LogLineWriter
}

/// Writes one formatted log line (the `fmt` layer writes each event with
/// one `write_all`): gathered on an event loop, else straight to standard
/// error.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogLineWriter;

impl Write for LogLineWriter {
    fn write(&mut self, line: &[u8]) -> io::Result<usize> {
        self.write_all(line).map(|()| line.len())
    }

    fn write_all(&mut self, line: &[u8]) -> io::Result<()> {
        if GATHERED.try_with(|gathered| gathered.keep(line)) == Ok(true) {
            return Ok(());
        }
        write_to_stderr(line)
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gathered_len() -> usize {
        GATHERED.with(|gathered| gathered.bytes.borrow().len())
    }

    /// The writes so far whose text starts with `test` (tests run in
    /// parallel; each marks its lines with its name).
    fn writes(test: &str) -> Vec<Vec<u8>> {
        let mut all = WRITES.lock().unwrap();
        let (mine, others) = all.drain(..).partition(|w| w.starts_with(test.as_bytes()));
        *all = others;
        mine
    }

    #[test]
    fn lines_are_written_at_once_unless_the_thread_gathers() {
        std::thread::spawn(|| {
            let t = "at-once";
            stderr().write_all(b"at-once line\n").unwrap();
            assert_eq!(writes(t), [b"at-once line\n".to_vec()]);
            gather_on_this_thread();
            stderr().write_all(b"at-once one\n").unwrap();
            stderr().write_all(b"at-once two\n").unwrap();
            assert!(writes(t).is_empty());
            write_gathered();
            assert_eq!(writes(t), [b"at-once one\nat-once two\n".to_vec()]);
            write_gathered();
            assert!(writes(t).is_empty(), "nothing left to write");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn writes_are_whole_lines_of_at_most_the_limit() {
        std::thread::spawn(|| {
            let t = "whole";
            gather_on_this_thread();
            let line = [t.as_bytes(), &[b'x'; 94], b"\n"].concat();
            assert_eq!(line.len(), 100);
            for _ in 0..41 {
                stderr().write_all(&line).unwrap();
            }
            // The 41st line would have passed 4096 bytes: the 40 before it
            // went out in one write.
            assert_eq!(writes(t), [line.repeat(40)]);
            assert_eq!(gathered_len(), 100);
            // A line longer than the limit goes out on its own, after what
            // was gathered before it.
            let long = [t.as_bytes(), &vec![b'y'; GATHERED_BYTES_MAX], b"\n"].concat();
            stderr().write_all(&long).unwrap();
            assert_eq!(writes(t), [line.clone(), long]);
            assert_eq!(gathered_len(), 0);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_that_ends_writes_what_it_gathered() {
        let t = "ends";
        std::thread::spawn(|| {
            gather_on_this_thread();
            stderr().write_all(b"ends: last words\n").unwrap();
            assert!(writes("ends").is_empty());
        })
        .join()
        .unwrap();
        assert_eq!(writes(t), [b"ends: last words\n".to_vec()]);
    }
}
