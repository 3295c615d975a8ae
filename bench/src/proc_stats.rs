//! A process's CPU time and peak memory, from `/proc/<pid>` (Linux).

/// CPU seconds (user + system) and peak resident set size of a process.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ProcStats {
    /// User + system CPU seconds so far.
    pub(crate) cpu_seconds: f64,
    /// Peak resident set size (VmHWM), bytes.
    pub(crate) peak_rss_bytes: u64,
    /// Current resident set size (VmRSS), bytes.
    pub(crate) rss_bytes: u64,
}

/// Clock ticks per second of `/proc/<pid>/stat` (USER_HZ: 100 on every
/// Linux architecture meshca runs on).
const TICKS_PER_SECOND: f64 = 100.0;

/// Reads the stats of `pid`, or `None` if `/proc` cannot tell.
pub(crate) fn read(pid: u32) -> Option<ProcStats> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start after ')'.
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the full line: 12 and 13 here.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    Some(ProcStats {
        cpu_seconds: (utime + stime) / TICKS_PER_SECOND,
        peak_rss_bytes: kib("VmHWM:"),
        rss_bytes: kib("VmRSS:"),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_this_process() {
        let stats = super::read(std::process::id()).expect("/proc");
        assert!(stats.peak_rss_bytes > 0);
        assert!(stats.peak_rss_bytes >= stats.rss_bytes);
    }
}
