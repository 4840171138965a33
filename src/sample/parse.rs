//! Parsers of the kernel's procfs text files: pure functions over `&str`,
//! each naming the file in its error.

/// A procfs file that did not parse: which file and what was wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{file}: {what}")]
pub struct ParseError {
    pub(crate) file: &'static str,
    pub(crate) what: String,
}

pub(crate) fn bad(file: &'static str, what: impl Into<String>) -> ParseError {
    ParseError {
        file,
        what: what.into(),
    }
}

/// The fields of `/proc/PID/stat` memtrack uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stat {
    pub(crate) pid: u32,
    pub(crate) comm: String,
    pub(crate) state: char,
    pub(crate) ppid: u32,
    /// Clock ticks after boot.
    pub(crate) start_ticks: u64,
    /// Field 52 (Linux ≥ 3.5): the wait status of a zombie, when readable.
    pub(crate) exit_code: Option<i32>,
}

/// Parses `/proc/PID/stat`. The command name sits in parentheses and may
/// itself contain spaces and parentheses, so fields are counted from the
/// last `)`.
pub(crate) fn parse_stat(text: &str) -> Result<Stat, ParseError> {
    let open = text.find('(').ok_or_else(|| bad("stat", "no `(`"))?;
    let close = text.rfind(')').ok_or_else(|| bad("stat", "no `)`"))?;
    if close < open {
        return Err(bad("stat", "`)` before `(`"));
    }
    let pid = text[..open]
        .trim()
        .parse()
        .map_err(|_| bad("stat", "pid is not a number"))?;
    let comm = text[open + 1..close].to_string();
    // Fields after the comm, numbered from 3 (state) as in proc(5).
    let rest: Vec<&str> = text[close + 1..].split_ascii_whitespace().collect();
    let field = |n: usize| rest.get(n - 3).copied();
    let state = field(3)
        .and_then(|s| s.chars().next())
        .ok_or_else(|| bad("stat", "no state"))?;
    let ppid = field(4)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("stat", "no ppid"))?;
    let start_ticks = field(22)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("stat", "no starttime"))?;
    let exit_code = field(52).and_then(|s| s.parse().ok());
    Ok(Stat {
        pid,
        comm,
        state,
        ppid,
        start_ticks,
        exit_code,
    })
}

/// Parses `/proc/PID/statm` into resident bytes.
pub(crate) fn parse_statm(text: &str, page_size: u64) -> Result<u64, ParseError> {
    let mut fields = text.split_ascii_whitespace();
    let _size = fields.next().ok_or_else(|| bad("statm", "empty"))?;
    let resident: u64 = fields
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("statm", "no resident field"))?;
    Ok(resident * page_size)
}

/// `(resident, anonymous resident)` bytes from `/proc/PID/statm`: its
/// third field counts the resident file and shared-memory pages.
pub(crate) fn parse_statm_anon(text: &str, page_size: u64) -> Result<(u64, u64), ParseError> {
    let mut fields = text.split_ascii_whitespace().skip(1);
    let mut next = |what: &'static str| {
        fields
            .next()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| bad("statm", format!("no {what} field")))
    };
    let resident = next("resident")?;
    let shared = next("shared")?;
    Ok((
        resident * page_size,
        resident.saturating_sub(shared) * page_size,
    ))
}

/// The fields of `/proc/PID/status` memtrack uses (sizes in bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ProcStatus {
    /// `Name:` (the command name; it changes when the process execs).
    pub(crate) name: String,
    pub(crate) tgid: u32,
    pub(crate) ppid: u32,
    pub(crate) vm_rss: u64,
    pub(crate) vm_hwm: u64,
}

/// Parses `/proc/PID/status`. A zombie has no `Vm*` lines: they read as 0.
pub(crate) fn parse_status(text: &str) -> Result<ProcStatus, ParseError> {
    let mut s = ProcStatus::default();
    let mut saw_tgid = false;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        let kib = || -> Result<u64, ParseError> {
            value
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .map(|v| v * 1024)
                .map_err(|_| bad("status", format!("{key} is not a size")))
        };
        match key {
            "Name" => s.name = value.to_string(),
            "Tgid" => {
                s.tgid = value.parse().map_err(|_| bad("status", "bad Tgid"))?;
                saw_tgid = true;
            }
            "PPid" => s.ppid = value.parse().map_err(|_| bad("status", "bad PPid"))?,
            "VmRSS" => s.vm_rss = kib()?,
            "VmHWM" => s.vm_hwm = kib()?,
            _ => {}
        }
    }
    if !saw_tgid {
        return Err(bad("status", "no Tgid line"));
    }
    Ok(s)
}

/// The last PID handed out, from `/proc/loadavg`
/// (`0.00 0.01 0.05 1/76 2103`).
pub(crate) fn parse_loadavg_last_pid(text: &str) -> Result<u32, ParseError> {
    text.split_ascii_whitespace()
        .nth(4)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("loadavg", "no last-pid field"))
}

/// `btime` from `/proc/stat`: boot time in Unix seconds.
pub(crate) fn parse_btime(text: &str) -> Result<u64, ParseError> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| bad("stat", "no btime line"))
}

/// `(pss, uss)` in bytes from `/proc/PID/smaps_rollup`; USS is the private
/// (clean + dirty) memory.
pub(crate) fn parse_smaps_rollup(text: &str) -> Result<(u64, u64), ParseError> {
    let mut pss = None;
    let mut private = 0u64;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let kib = || {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .map(|v| v * 1024)
                .map_err(|_| bad("smaps_rollup", format!("{key} is not a size")))
        };
        match key {
            "Pss" => pss = Some(kib()?),
            "Private_Clean" | "Private_Dirty" => private += kib()?,
            _ => {}
        }
    }
    Ok((
        pss.ok_or_else(|| bad("smaps_rollup", "no Pss line"))?,
        private,
    ))
}

/// The file and shared-memory part of a `smaps_rollup`'s Pss
/// (`Pss_File + Pss_Shmem`, Linux ≥ 5.0), in bytes; 0 where the kernel
/// does not split it.
pub(crate) fn smaps_rollup_pss_shared(text: &str) -> u64 {
    smaps_rollup_sum(text, &["Pss_File", "Pss_Shmem"])
}

/// A `smaps_rollup`'s resident bytes (`Rss`): what the process mapped when
/// its own cost was read.
pub(crate) fn smaps_rollup_rss(text: &str) -> u64 {
    smaps_rollup_sum(text, &["Rss"])
}

fn smaps_rollup_sum(text: &str, keys: &[&str]) -> u64 {
    text.lines()
        .filter_map(|line| line.split_once(':'))
        .filter(|(key, _)| keys.contains(key))
        .filter_map(|(_, v)| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .sum()
}

/// `/proc/PID/cmdline`: NUL-separated arguments.
pub(crate) fn parse_cmdline(bytes: &[u8]) -> Vec<String> {
    bytes
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}
