//! The tree's Σ Pss: each process's proportional share of the pages it
//! maps (`/proc/PID/smaps_rollup`), summed. The figure where page frame
//! numbers cannot be read (without root, under `attach` as another user)
//! and no memory cgroup holds only the job (cgroup v2, where memtrack
//! creates none).
//!
//! A pass reads the processes one at a time on the reader thread
//! ([`super::own`]), in slices within its budget, and hands back the same
//! [`Pass`] a page pass does: the sum (its `bytes`), and for each process
//! its `statm` figures, with its USS as the pages only it has (`first_seen`).
//! The reader carries it forward between passes by the same rules
//! ([`super::cost`]).
//!
//! Shares are only consistent when every process is read without a fork
//! or an exit in between (a fork halves its parent's share of the pages
//! they now both map; an exit hands its share to the survivors), so the
//! cost reader drops a Σ Pss pass that such a change overlapped and starts
//! another; the figure is carried forward meanwhile.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

use super::pages::{Pass, Seen};
use super::parse::{parse_smaps_rollup, parse_statm_anon, smaps_rollup_pss_shared};

/// What a pass counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum PassKind {
    /// Distinct physical pages (`pagemap`, root).
    #[default]
    Pages,
    /// Σ Pss (`smaps_rollup`, any user who may read the processes).
    Pss,
}

/// Adds one process's Pss to a pass. A process gone meanwhile (or a
/// zombie, whose `smaps_rollup` is empty) is left out; any other error
/// (no permission) is returned.
pub(crate) fn add(
    root: &Path,
    pid: u32,
    page_size: u64,
    out: &mut Pass,
    buf: &mut Vec<u8>,
    text: &mut String,
) -> io::Result<()> {
    let dir = root.join(pid.to_string());
    let before = super::pages::faults(root, pid, text).map(|f| f.0);
    match read_process(&dir, page_size, buf) {
        Ok(Some((rss, anon, pss, uss))) => {
            out.bytes += pss;
            out.shared += std::str::from_utf8(buf).map_or(0, smaps_rollup_pss_shared);
            // Its faults at the read: what it copies from here on is
            // estimated from them (see `cost`).
            let after = super::pages::faults(root, pid, text).map(|f| f.0);
            let faults = super::pages::midway(before, after);
            out.seen.push(Seen {
                pid,
                rss,
                anon,
                first_seen: uss,
                pss: Some(pss),
                uss: None,
                faults,
            });
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(e) if gone(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

fn gone(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ESRCH) | Some(libc::ENOENT))
        || e.kind() == io::ErrorKind::NotFound
}

/// `(rss, anon, pss, uss)` of one process; `None`: it has no memory (a
/// zombie, or one tearing down).
fn read_process(
    dir: &Path,
    page_size: u64,
    buf: &mut Vec<u8>,
) -> io::Result<Option<(u64, u64, u64, u64)>> {
    let statm = std::fs::read_to_string(dir.join("statm"))?;
    let (rss, _) = parse_statm_anon(&statm, page_size).map_err(io::Error::other)?;
    if rss == 0 {
        return Ok(None);
    }
    buf.clear();
    File::open(dir.join("smaps_rollup"))?.read_to_end(buf)?;
    let Some((pss, uss)) = std::str::from_utf8(buf)
        .ok()
        .and_then(|t| parse_smaps_rollup(t).ok())
    else {
        // Empty: the process exited between the two reads.
        return Ok(None);
    };
    // Carried forward from `statm` after the read (as a page pass is): what
    // the process took while it was read is counted once.
    let statm = std::fs::read_to_string(dir.join("statm"))?;
    let (rss, anon) = parse_statm_anon(&statm, page_size).map_err(io::Error::other)?;
    if rss == 0 {
        return Ok(None);
    }
    Ok(Some((rss, anon, pss, uss)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_counts_its_share_and_its_own_pages() {
        let page = crate::sys::page_size();
        let me = std::process::id();
        let mut pass = Pass::default();
        let (mut buf, mut text) = (Vec::new(), String::new());
        add(Path::new("/proc"), me, page, &mut pass, &mut buf, &mut text)
            .expect("own smaps_rollup");
        let seen = pass.seen.first().copied().expect("seen");
        assert!(pass.bytes > 0 && pass.bytes <= seen.rss, "{pass:?}");
        assert!(seen.first_seen <= pass.bytes, "USS ≤ Pss: {pass:?}");
        assert!(
            seen.faults.is_some_and(|f| f > 0),
            "its faults, for estimates: {seen:?}"
        );
        // A process that does not exist is left out, not an error.
        add(
            Path::new("/proc"),
            u32::MAX - 1,
            page,
            &mut pass,
            &mut buf,
            &mut text,
        )
        .expect("gone");
        assert_eq!(pass.seen.len(), 1);
    }
}
