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

/// The whole machine's CPU time so far, from the first line of
/// `/proc/stat`, in clock ticks.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MachineCpu {
    /// All CPU time (user, nice, system, idle, iowait, irq, softirq, steal).
    pub(crate) total_ticks: u64,
    /// Time a virtual machine's CPUs wanted to run but the hypervisor ran
    /// something else (other guests): numbers measured while it is high
    /// say more about the host than about the code.
    pub(crate) steal_ticks: u64,
}

/// Reads the machine's CPU time, or `None` if `/proc/stat` cannot tell.
pub(crate) fn read_machine() -> Option<MachineCpu> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|v| v.parse().ok())
        .collect::<Option<Vec<u64>>>()?;
    Some(MachineCpu {
        total_ticks: fields.iter().sum(),
        steal_ticks: fields.get(7).copied().unwrap_or(0),
    })
}

/// The share of CPU time stolen between two readings, in percent.
pub(crate) fn steal_percent(before: MachineCpu, after: MachineCpu) -> f64 {
    let total = after.total_ticks.saturating_sub(before.total_ticks);
    let steal = after.steal_ticks.saturating_sub(before.steal_ticks);
    if total == 0 {
        0.0
    } else {
        100.0 * steal as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_this_process() {
        let stats = super::read(std::process::id()).expect("/proc");
        assert!(stats.peak_rss_bytes > 0);
        assert!(stats.peak_rss_bytes >= stats.rss_bytes);
    }

    #[test]
    fn reads_the_machine() {
        let before = super::read_machine().expect("/proc/stat");
        assert!(before.total_ticks > 0 && before.steal_ticks <= before.total_ticks);
        let after = super::MachineCpu {
            total_ticks: before.total_ticks + 200,
            steal_ticks: before.steal_ticks + 50,
        };
        assert_eq!(super::steal_percent(before, after), 25.0);
        assert_eq!(super::steal_percent(before, before), 0.0);
    }
}
