//! `memtrack merge`: the ranks of a multi-node job as one job-level
//! `memory_usage.json`.
//!
//! Each rank (one memtrack per node) writes its own file. The merged file
//! keeps every rank's log (entries labelled with `rank` and `host`), GPUs
//! (marked with their host), stages and alerts; its peaks are the maxima
//! over the ranks — the node that needs the most decides the hardware — and
//! `ranks` / `worst_rank` say which rank reached each peak.
//!
//! Ranks' files can hold millions of entries each. They are read with the
//! streaming reader ([`super::read`]); their entries are sorted in chunks
//! of `CHUNK`, each chunk kept in a temporary file, and the merged log is
//! written by merging those sorted chunks: memory stays bounded by the
//! chunk size, and the order is exactly that of a stable sort by time of
//! every rank's log one after the other.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};
use std::path::{Path, PathBuf};

use crate::model::leak;
use crate::model::{
    Document, DocumentOf, Entry, HostInfo, HostSource, Peaks, RankSummary, RunInfo, Summary,
    SCHEMA_VERSION,
};
use crate::model::{RunStatus, StreamError};
use crate::store::entries::EntryLog;

/// Entries sorted in memory at a time; a longer log is sorted in chunks of
/// this many, each kept in a temporary file until the merged log is
/// written.
pub(crate) const CHUNK: usize = 32_768;

/// One rank's file to merge.
#[derive(Debug)]
pub enum MergeSource {
    /// A document already read (downloaded from S3).
    Document(String, Box<Document>),
    /// A file on disk, read as a stream.
    File(String, PathBuf),
}

/// The merged job: its log is written (or collected) from the ranks'
/// sorted chunks.
pub type Merged = DocumentOf<MergedLog>;

/// Which files merge into one job.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Accept {
    /// The ranks of one job: one run name, each rank (its `rank` label,
    /// else its host) once. Anything else is refused before a byte is
    /// written: two unrelated runs merged look like one job.
    #[default]
    OneJob,
    /// Whatever is given (`merge --force`): a rank named twice is told
    /// apart by its position (`1#3`).
    Any,
}

/// A temporary folder removed with its files when dropped, or when a
/// signal ends the merge (see [`remove_on_signals`]). It holds a `lock`
/// file, locked while the merge that made it runs: a folder whose lock
/// anyone can take was left by a merge that died (`kill -9`) and is swept
/// by the next merge.
#[derive(Debug)]
struct TempDir {
    path: PathBuf,
    _lock: std::fs::File,
}

/// The temporary folders' name prefix, in the temporary directory.
const TEMP_PREFIX: &str = "memtrack-merge";

/// A folder of a merge older than this, with no lock file (made before
/// merges locked theirs), is stale.
const UNLOCKED_STALE: std::time::Duration = std::time::Duration::from_secs(3600);

/// The folders of merges running in this process, removed on a signal.
static LIVE: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

impl TempDir {
    /// A private folder (0700) with a random name: never one another user
    /// could have guessed and planted. Stale folders of dead merges go
    /// first.
    fn new() -> std::io::Result<TempDir> {
        let base = std::env::temp_dir();
        sweep_stale(&base);
        remove_on_signals();
        let path = crate::files::create_temp_dir(&base, TEMP_PREFIX)?;
        let lock = crate::files::create(&path.join("lock"), false).and_then(|f| {
            f.try_lock().map_err(std::io::Error::other)?;
            Ok(f)
        });
        let lock = match lock {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&path);
                return Err(e);
            }
        };
        live().push(path.clone());
        Ok(TempDir { path, _lock: lock })
    }
}

fn live() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
        live().retain(|p| p != &self.path);
    }
}

/// Removes this user's merge folders in `base` that no running merge
/// holds: a merge killed with `kill -9` (no signal handler runs) leaves
/// its chunks behind, and they may be hundreds of MiB.
fn sweep_stale(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        if !name.starts_with(&format!("{TEMP_PREFIX}-")) {
            continue;
        }
        let dir = entry.path();
        // Another user's folder is theirs; a link is never followed.
        if !crate::files::owned_by_me(&dir) {
            continue;
        }
        let stale = match crate::files::open_write(&dir.join("lock")) {
            Ok(f) => f.try_lock().is_ok(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::symlink_metadata(&dir)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > UNLOCKED_STALE),
            Err(_) => false,
        };
        if stale && std::fs::remove_dir_all(&dir).is_ok() {
            tracing::info!(
                "removed {} left by a merge that did not finish",
                dir.display()
            );
        }
    }
}

/// Once per process: SIGINT, SIGTERM or SIGHUP remove the folders of the
/// merges still running and any document being written, then end the
/// process as the signal would have. `memtrack merge` calls it first.
pub fn remove_on_signals() {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("memtrack-merge-signals".into())
            .spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    for dir in live().drain(..) {
                        let _ = std::fs::remove_dir_all(&dir);
                    }
                    crate::model::json::remove_unfinished();
                    let _ = signal_hook::low_level::emulate_default_handler(sig);
                    std::process::exit(128 + sig);
                }
            });
        if let Err(e) = spawned {
            tracing::debug!("no signal handling for merge's temporary folder: {e}");
        }
    });
}

/// Sorted runs of entries: in memory, or in a temporary file.
#[derive(Debug)]
enum Run {
    Memory(Vec<Entry>),
    File(EntryLog),
}

/// The merged log: every rank's sorted chunks, merged by time as it is
/// read; each entry is labelled with its `rank` and `host` on the way.
#[derive(Debug)]
pub struct MergedLog {
    runs: Vec<(usize, Run)>,
    /// `(rank, host)` of each input.
    tags: Vec<(String, String)>,
    len: usize,
    _dir: Option<TempDir>,
}

/// The head of one run in the merge: ordered by time, then by the run's
/// place (earlier ranks and chunks first), as a stable sort orders them.
struct Head {
    entry: Entry,
    run: usize,
}

impl PartialEq for Head {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Head {}

impl PartialOrd for Head {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Head {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: `BinaryHeap` pops its greatest.
        other
            .entry
            .timestamp
            .total_cmp(&self.entry.timestamp)
            .then(other.run.cmp(&self.run))
    }
}

impl MergedLog {
    /// Visits the merged entries in order; stops at the first error.
    pub(crate) fn try_for_each(
        &self,
        mut f: impl FnMut(&Entry) -> Result<(), StreamError>,
    ) -> Result<(), StreamError> {
        type Source<'a> = Box<dyn Iterator<Item = Result<Entry, StreamError>> + 'a>;
        let mut sources: Vec<Source<'_>> = Vec::with_capacity(self.runs.len());
        for (_, run) in &self.runs {
            sources.push(match run {
                Run::Memory(v) => Box::new(v.iter().cloned().map(Ok)),
                Run::File(log) => Box::new(log.read()?.map(|e| e.map_err(StreamError::from))),
            });
        }
        let mut heap = BinaryHeap::with_capacity(sources.len());
        for (run, source) in sources.iter_mut().enumerate() {
            if let Some(entry) = source.next().transpose()? {
                heap.push(Head { entry, run });
            }
        }
        while let Some(Head { mut entry, run }) = heap.pop() {
            let (rank, host) = &self.tags[self.runs[run].0];
            entry.labels.insert("rank".into(), rank.clone());
            entry.labels.insert("host".into(), host.clone());
            f(&entry)?;
            if let Some(next) = sources[run].next().transpose()? {
                heap.push(Head { entry: next, run });
            }
        }
        Ok(())
    }

    /// Every merged entry, owned.
    pub(crate) fn collect(&self) -> Result<Vec<Entry>, StreamError> {
        let mut out = Vec::with_capacity(self.len);
        self.try_for_each(|e| {
            out.push(e.clone());
            Ok(())
        })?;
        Ok(out)
    }
}

impl serde::Serialize for MergedLog {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        crate::model::serialize_streamed(serializer, Some(self.len), |f| self.try_for_each(f))
    }
}

/// Gathers one input's entries into sorted runs.
struct Sorter<'a> {
    input: usize,
    buf: Vec<Entry>,
    runs: &'a mut Vec<(usize, Run)>,
    dir: &'a mut Option<TempDir>,
    in_memory: &'a mut usize,
    len: &'a mut usize,
    error: Option<std::io::Error>,
}

impl Sorter<'_> {
    fn push(&mut self, e: Entry) {
        *self.len += 1;
        self.buf.push(e);
        if self.buf.len() >= CHUNK {
            self.spill();
        }
    }

    fn sorted(&mut self) -> Vec<Entry> {
        let mut v = std::mem::take(&mut self.buf);
        v.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
        v
    }

    fn spill(&mut self) {
        let v = self.sorted();
        if self.error.is_some() {
            return;
        }
        let result = (|| {
            if self.dir.is_none() {
                *self.dir = Some(TempDir::new()?);
            }
            let dir = self
                .dir
                .as_ref()
                .map_or(Path::new("."), |d| d.path.as_path());
            let mut log = EntryLog::new();
            log.create_file(&dir.join(format!("run-{}.jsonl", self.runs.len())))
                .map_err(std::io::Error::other)?;
            for e in &v {
                log.push(e)?;
            }
            log.flush()?;
            self.runs.push((self.input, Run::File(log)));
            Ok(())
        })();
        if let Err(e) = result {
            self.error = Some(e);
        }
    }

    /// The input's last entries: kept in memory while the merge holds
    /// fewer than [`CHUNK`] there.
    fn finish(mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            if *self.in_memory + self.buf.len() <= CHUNK {
                *self.in_memory += self.buf.len();
                let v = self.sorted();
                self.runs.push((self.input, Run::Memory(v)));
            } else {
                self.spill();
            }
        }
        match self.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The rank name of a file: its `rank` label, else its host, else its
/// position.
fn rank_of(doc: &Document, i: usize) -> String {
    doc.run
        .labels
        .get("rank")
        .cloned()
        .or_else(|| (!doc.run.host.is_empty()).then(|| doc.run.host.clone()))
        .unwrap_or_else(|| i.to_string())
}

/// Each input's rank name, checked to be the ranks of one job unless
/// `accept` is [`Accept::Any`]: one run name (a file without one, written
/// by hand or by an old build, goes with any), and no rank twice.
fn rank_names<'a>(
    docs: impl Iterator<Item = (&'a str, &'a Document)>,
    accept: Accept,
) -> anyhow::Result<Vec<String>> {
    let mut names: Vec<String> = Vec::new();
    let mut seen: BTreeMap<String, &str> = BTreeMap::new();
    let mut run: Option<(&str, &str)> = None;
    for (i, (source, doc)) in docs.enumerate() {
        let name = doc.run.name.as_str();
        if let (Some((first_source, first)), false) = (run, name.is_empty()) {
            anyhow::ensure!(
                accept == Accept::Any || first == name,
                "{first_source:?} is run {first:?} but {source:?} is run {name:?}: merge joins \
                 the ranks of one job, which share a run name (`memtrack run --name`); pass \
                 --force to merge other runs anyway"
            );
        } else if !name.is_empty() {
            run = Some((source, name));
        }
        let mut rank = rank_of(doc, i);
        if let Some(earlier) = seen.get(&rank) {
            anyhow::ensure!(
                accept == Accept::Any,
                "{earlier:?} and {source:?} are both rank {rank:?}: the same file twice, or \
                 runs of two jobs; label each rank of a job (`--label rank=N`), or pass \
                 --force to merge them anyway"
            );
            rank = format!("{rank}#{i}");
        }
        seen.insert(rank.clone(), source);
        names.push(rank);
    }
    Ok(names)
}

/// The job's host block: how its ranks measured. A job's ranks run alike
/// and agree; where they differ the block names the least exact source
/// (Σ RSS, then Σ Pss, then distinct pages or a cgroup, which count every
/// page once) and its reason says which rank used which. A rank whose file
/// has no block (an older build) summed RSS. `None` when no rank has one.
fn merge_hosts(ranks: &[(&str, Option<&HostInfo>)]) -> Option<HostInfo> {
    let exactness = |s: HostSource| match s {
        HostSource::Rss => 0,
        HostSource::Pss => 1,
        HostSource::Pages | HostSource::Cgroup => 2,
    };
    let source_of = |h: Option<&HostInfo>| h.map_or(HostSource::Rss, |h| h.source);
    let first = ranks.iter().find_map(|(_, h)| *h)?;
    let source = ranks
        .iter()
        .map(|(_, h)| source_of(*h))
        .min_by_key(|s| exactness(*s))
        .unwrap_or(first.source);
    let alike = ranks
        .iter()
        .all(|(_, h)| h.is_some_and(|h| h.source == first.source && h.reason == first.reason));
    let reason = if alike {
        first.reason.clone()
    } else {
        let each: Vec<String> = ranks
            .iter()
            .map(|(rank, h)| format!("rank {rank} {}", source_of(*h).as_str()))
            .collect();
        format!("the ranks measured differently: {}", each.join(", "))
    };
    let blocks = ranks.iter().filter_map(|(_, h)| *h);
    let max = |f: fn(&HostInfo) -> Option<f64>| blocks.clone().filter_map(f).reduce(f64::max);
    let sum_u = |f: fn(&HostInfo) -> Option<u64>| blocks.clone().filter_map(f).reduce(|a, b| a + b);
    let same_version = blocks
        .clone()
        .all(|h| h.cgroup_version == first.cgroup_version);
    Some(HostInfo {
        source,
        reason,
        cgroup_version: first.cgroup_version.filter(|_| same_version),
        rss_sum_peak_mb: max(|h| Some(h.rss_sum_peak_mb)).unwrap_or(0.0),
        kernel_peak_mb: max(|h| h.kernel_peak_mb),
        oom_kills: sum_u(|h| h.oom_kills),
        pss_reads: sum_u(|h| h.pss_reads),
        pss_read_s: blocks
            .clone()
            .filter_map(|h| h.pss_read_s)
            .reduce(|a, b| a + b),
        ..HostInfo::default()
    })
}

/// The figures whose worst rank is named.
fn figures(p: &Peaks) -> [(&'static str, f64); 4] {
    [
        (
            "host_ram",
            p.figures.cpu_ram_used_mb.max(p.figures.cpu_ram_hwm_mb),
        ),
        ("gpu_used", p.figures.gpu_ram_used_mb),
        ("gpu_peak", p.figures.gpu_ram_peak_mb),
        ("gpu_process", p.figures.gpu_process_used_mb),
    ]
}

/// Merges per-rank documents (`(source, document)`), the merged log held
/// in memory.
pub fn merge(inputs: Vec<(String, Document)>, accept: Accept) -> anyhow::Result<Document> {
    let merged = merge_inputs(
        inputs
            .into_iter()
            .map(|(source, doc)| MergeSource::Document(source, Box::new(doc)))
            .collect(),
        accept,
    )?;
    let log = merged.detailed_log.collect()?;
    Ok(merged.map_log(|_| log))
}

/// Merges ranks' files or documents; the merged log is read from sorted
/// chunks as it is written, so memory stays bounded however long the
/// ranks' logs are. Files that are not the ranks of one job are refused
/// unless `accept` says otherwise ([`Accept`]).
pub fn merge_inputs(inputs: Vec<MergeSource>, accept: Accept) -> anyhow::Result<Merged> {
    anyhow::ensure!(!inputs.is_empty(), "nothing to merge");
    let mut runs: Vec<(usize, Run)> = Vec::new();
    let mut dir: Option<TempDir> = None;
    let mut in_memory = 0usize;
    let mut len = 0usize;
    let mut docs = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.into_iter().enumerate() {
        let mut series = leak::LeakSeries::default();
        let mut sorter = Sorter {
            input: i,
            buf: Vec::new(),
            runs: &mut runs,
            dir: &mut dir,
            in_memory: &mut in_memory,
            len: &mut len,
            error: None,
        };
        let (source, mut doc) = match input {
            MergeSource::Document(source, mut doc) => {
                for e in std::mem::take(&mut doc.detailed_log) {
                    series.push(&e);
                    sorter.push(e);
                }
                (source, *doc)
            }
            MergeSource::File(source, path) => {
                let doc = super::read::read_complete(&path, |e| {
                    series.push(&e);
                    sorter.push(e);
                })?;
                (source, doc)
            }
        };
        sorter
            .finish()
            .map_err(|e| anyhow::anyhow!("cannot keep the sorted log of {source}: {e}"))?;
        if doc.leak.is_none() {
            doc.leak = Some(
                series
                    .analyze(&doc.targets, doc.schema, &leak::LeakConfig::default())
                    .to_value(),
            );
        }
        docs.push((source, doc));
    }
    let ranks = rank_names(docs.iter().map(|(s, d)| (s.as_str(), d)), accept)?;
    let tags = ranks
        .iter()
        .zip(&docs)
        .map(|(rank, (_, doc))| (rank.clone(), doc.run.host.clone()))
        .collect();
    let out = merge_documents(docs, ranks)?;
    Ok(out.map_log(|_| MergedLog {
        runs,
        tags,
        len,
        _dir: dir,
    }))
}

/// Everything but the log: peaks, ranks, stages, GPUs, alerts, verdicts.
fn merge_documents(
    inputs: Vec<(String, Document)>,
    ranks: Vec<String>,
) -> anyhow::Result<Document> {
    anyhow::ensure!(!inputs.is_empty(), "nothing to merge");
    let mut out = Document {
        schema: SCHEMA_VERSION,
        run: merged_run(&inputs[0].1.run),
        host: merge_hosts(
            &ranks
                .iter()
                .zip(&inputs)
                .map(|(rank, (_, doc))| (rank.as_str(), doc.host.as_ref()))
                .collect::<Vec<_>>(),
        ),
        ..Document::default()
    };
    let mut hosts: Vec<String> = Vec::new();
    let mut best: BTreeMap<&'static str, (f64, String)> = BTreeMap::new();
    let mut leaks: Vec<(String, leak::LeakReport)> = Vec::new();

    for ((source, mut doc), rank) in inputs.into_iter().zip(ranks) {
        let host = doc.run.host.clone();
        if !hosts.contains(&host) {
            hosts.push(host.clone());
        }
        fold_run(&mut out.run, &doc.run);
        for (figure, value) in figures(&doc.peak_usage) {
            if value > best.get(figure).map_or(0.0, |b| b.0) {
                best.insert(figure, (value, rank.clone()));
            }
        }
        out.peak_usage.merge(&doc.peak_usage);
        for (c, p) in &doc.peaks_by_component {
            out.peaks_by_component
                .entry(c.clone())
                .or_default()
                .merge(p);
        }
        // Each rank's own verdict: the merged log mixes the ranks' samples,
        // so a trend over it would mean nothing.
        let verdict = match &doc.leak {
            Some(block) => leak::LeakReport::from_value(block),
            None => leak::analyze(&doc, &leak::LeakConfig::default()),
        };
        leaks.push((rank.clone(), verdict));
        append_rank_parts(&mut out, &mut doc, &rank, &host);
        fold_summary(&mut out.summary, &doc.summary);
        out.ranks.push(RankSummary {
            rank,
            host,
            host_source: doc.host.as_ref().map(|h| h.source),
            source,
            exit: doc.run.exit,
            peak_usage: doc.peak_usage,
            summary: doc.summary,
        });
    }
    if !out.run.start.is_finite() {
        out.run.start = 0.0;
    }
    out.summary.duration_s = out.run.end.unwrap_or(out.run.start) - out.run.start;
    out.run.host = hosts.join(",");
    out.ranks.sort_by_key(|r| natural(&r.rank));
    out.worst_rank = best
        .into_iter()
        .map(|(k, (_, rank))| (k.to_string(), rank))
        .collect();
    out.leak = Some(merge_leaks(leaks).to_value());
    Ok(out)
}

/// The merged job's run before any rank is folded in: the first rank's
/// name, command and labels, mode and status `merged`.
fn merged_run(first: &RunInfo) -> RunInfo {
    RunInfo {
        name: first.name.clone(),
        mode: "merged".into(),
        status: RunStatus::Merged,
        memtrack_version: env!("CARGO_PKG_VERSION").into(),
        interval_s: first.interval_s,
        gpu_backend: first.gpu_backend.clone(),
        command: first.command.clone(),
        // Labels every rank shares (the job's, not a node's).
        labels: first.labels.clone(),
        start: f64::INFINITY,
        ..RunInfo::default()
    }
}

/// Folds a rank's run into the job's: the labels all share, the earliest
/// start, the latest end, and a failed exit over a clean one.
fn fold_run(out: &mut RunInfo, run: &RunInfo) {
    out.labels.retain(|k, v| run.labels.get(k) == Some(v));
    if run.start > 0.0 {
        out.start = out.start.min(run.start);
    }
    out.end = match (out.end, run.end) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    // The job failed if any rank did.
    if let Some(e) = run.exit {
        if out.exit.is_none_or(|cur| cur.code == 0 && e.code != 0) {
            out.exit = Some(e);
        }
    }
}

/// Moves a rank's stages (labelled with its rank and host), GPUs (and
/// how their figures were attributed), alerts (named with its host),
/// processes and flight-recorder windows into the job.
fn append_rank_parts(out: &mut Document, doc: &mut Document, rank: &str, host: &str) {
    let tag = |labels: &mut BTreeMap<String, String>| {
        labels.insert("rank".into(), rank.to_string());
        labels.insert("host".into(), host.to_string());
    };
    for mut s in std::mem::take(&mut doc.stages) {
        tag(&mut s.labels);
        out.stages.push(s);
    }
    for mut g in std::mem::take(&mut doc.gpus) {
        g.host = Some(host.to_string());
        out.gpus.push(g);
    }
    if let Some(a) = doc.gpu_attribution.take() {
        match &mut out.gpu_attribution {
            Some(job) => job.merge(&a),
            None => out.gpu_attribution = Some(a),
        }
    }
    for mut a in std::mem::take(&mut doc.alerts) {
        a.resource = format!("{host}:{}", a.resource);
        out.alerts.push(a);
    }
    out.targets.append(&mut doc.targets);
    out.flight_recorder.append(&mut doc.flight_recorder);
}

/// Folds a rank's summary into the job's: the largest peak and minimum
/// needs; the headroom ratio is the last rank's.
fn fold_summary(out: &mut Summary, rank: &Summary) {
    out.peak_host_ram_mb = out.peak_host_ram_mb.max(rank.peak_host_ram_mb);
    out.min_host_ram_mb = out.min_host_ram_mb.max(rank.min_host_ram_mb);
    out.min_gpu_mb = out.min_gpu_mb.max(rank.min_gpu_mb);
    out.headroom_ratio = rank.headroom_ratio;
}

/// The job's leak verdict from its ranks': suspected when any rank is, the
/// suspects named with their rank, `host` and `gpu` the verdicts of the
/// rank that looks worst (suspected first, then the fastest growth), and
/// every rank's whole verdict under `ranks`.
fn merge_leaks(leaks: Vec<(String, leak::LeakReport)>) -> leak::LeakReport {
    let worst = |part: fn(&leak::LeakReport) -> Option<&leak::Verdict>| {
        leaks
            .iter()
            .filter_map(|(_, l)| part(l))
            .max_by(|a, b| {
                a.suspected
                    .cmp(&b.suspected)
                    .then(a.rate_mib_per_hour.total_cmp(&b.rate_mib_per_hour))
            })
            .cloned()
    };
    let mut suspects = Vec::new();
    for (rank, l) in &leaks {
        for s in &l.suspects {
            suspects.push(format!("rank {rank}: {s}"));
        }
    }
    let host = worst(|l| l.host.as_ref());
    let gpu = worst(|l| l.gpu.as_ref());
    leak::LeakReport {
        suspected: !suspects.is_empty(),
        suspects,
        host,
        gpu,
        ranks: Some(leaks.into_iter().collect()),
        ..leak::LeakReport::default()
    }
}

/// Orders `2` before `10`, `rank2` before `rank10`, and a repeated
/// rank's `0#1` after its `0`: the text before the first digit, then the
/// number those digits make, then the whole name.
fn natural(s: &str) -> (String, Option<u64>, String) {
    let digits_at = s.find(|c: char| c.is_ascii_digit()).unwrap_or(s.len());
    let (prefix, rest) = s.split_at(digits_at);
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    (
        prefix.to_string(),
        rest[..digits].parse().ok(),
        s.to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Figures;

    fn rank(r: &str, host_mb: f64, gpu_mb: f64) -> (String, Document) {
        let mut d = Document::default();
        d.run.name = "job".into();
        d.run.host = format!("node{r}");
        d.run.labels.insert("rank".into(), r.into());
        d.run.labels.insert("slurm_job_id".into(), "42".into());
        d.run.start = 100.0;
        d.run.end = Some(200.0);
        d.peak_usage.figures.cpu_ram_used_mb = host_mb;
        d.peak_usage.figures.gpu_process_used_mb = gpu_mb;
        d.detailed_log.push(crate::model::Entry {
            timestamp: 150.0,
            figures: Figures {
                cpu_ram_used_mb: host_mb,
                ..Figures::default()
            },
            ..Default::default()
        });
        (format!("rank{r}.json"), d)
    }

    #[test]
    fn peaks_are_the_worst_rank_and_it_is_named() {
        let m = merge(
            vec![
                rank("0", 100.0, 9000.0),
                rank("1", 400.0, 1000.0),
                rank("10", 50.0, 2000.0),
            ],
            Accept::OneJob,
        )
        .unwrap();
        assert_eq!(m.peak_usage.figures.cpu_ram_used_mb, 400.0);
        assert_eq!(m.peak_usage.figures.gpu_process_used_mb, 9000.0);
        assert_eq!(m.worst_rank["host_ram"], "1");
        assert_eq!(m.worst_rank["gpu_process"], "0");
        let order: Vec<&str> = m.ranks.iter().map(|r| r.rank.as_str()).collect();
        assert_eq!(order, ["0", "1", "10"]);
        assert_eq!(
            m.run.labels.get("slurm_job_id").map(String::as_str),
            Some("42"),
            "shared labels kept"
        );
        assert!(
            !m.run.labels.contains_key("rank"),
            "per-rank labels dropped"
        );
        assert_eq!(m.detailed_log.len(), 3);
        assert!(m.detailed_log.iter().all(|e| e.labels.contains_key("rank")));
    }

    #[test]
    fn long_unordered_logs_merge_in_the_order_of_a_stable_sort() {
        // Chunks spill to temporary files; ties and out-of-order entries
        // must still come out as concatenating and sorting would put them.
        let ranks: Vec<(String, Document)> = (0..3u64)
            .map(|r| {
                let (src, mut d) = rank(&r.to_string(), 1.0, 0.0);
                d.detailed_log.clear();
                let mut x = 88172645463325252u64 ^ r;
                for i in 0..(CHUNK as u64 * 2 + 77 * (r + 1)) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    d.detailed_log.push(crate::model::Entry {
                        timestamp: (i / 3 + x % 5) as f64,
                        iteration: Some(i),
                        ..Default::default()
                    });
                }
                (src, d)
            })
            .collect();
        let mut expected: Vec<(u64, String)> = Vec::new();
        let mut all: Vec<crate::model::Entry> = Vec::new();
        for (_, d) in &ranks {
            all.extend(d.detailed_log.iter().cloned().map(|mut e| {
                e.labels.insert("rank".into(), d.run.labels["rank"].clone());
                e
            }));
        }
        all.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
        expected.extend(
            all.iter()
                .map(|e| (e.iteration.unwrap(), e.labels["rank"].clone())),
        );
        // Half of them from files, read as streams.
        let dir = tempfile::tempdir().unwrap();
        let inputs: Vec<MergeSource> = ranks
            .into_iter()
            .enumerate()
            .map(|(i, (src, d))| {
                if i % 2 == 0 {
                    let path = dir.path().join(&src);
                    std::fs::write(&path, serde_json::to_vec(&d).unwrap()).unwrap();
                    MergeSource::File(src, path)
                } else {
                    MergeSource::Document(src, Box::new(d))
                }
            })
            .collect();
        let m = merge_inputs(inputs, Accept::OneJob).unwrap();
        assert!(m.detailed_log.runs.len() > 3, "chunks were spilled");
        let got: Vec<(u64, String)> = m
            .detailed_log
            .collect()
            .unwrap()
            .iter()
            .map(|e| (e.iteration.unwrap(), e.labels["rank"].clone()))
            .collect();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the merged order differs");
        // Written as JSON, it reads back as the same log.
        let text = serde_json::to_vec(&m).unwrap();
        let back: Document = serde_json::from_slice(&text).unwrap();
        assert_eq!(back.detailed_log.len(), expected.len());
    }

    #[test]
    fn a_failed_rank_fails_the_job() {
        let mut bad = rank("1", 1.0, 0.0);
        bad.1.run.exit = Some(crate::model::Exit::signal(9));
        let mut good = rank("0", 1.0, 0.0);
        good.1.run.exit = Some(crate::model::Exit::code(0));
        let m = merge(vec![good, bad], Accept::OneJob).unwrap();
        assert_eq!(m.run.exit.unwrap().code, 137);
    }

    #[test]
    fn the_leak_verdict_is_each_ranks_own_not_a_trend_over_the_mix() {
        // Rank 1 grows steadily for a minute; rank 0 is flat at a higher
        // level. Interleaved, the mixed log would look like noise.
        let series = |r: &str, f: &dyn Fn(f64) -> f64| {
            let (src, mut d) = rank(r, 0.0, 0.0);
            d.detailed_log.clear();
            for i in 0..120 {
                let t = 100.0 + f64::from(i) * 0.5;
                d.detailed_log.push(crate::model::Entry {
                    component: "system".into(),
                    operation: "timer".into(),
                    kind: crate::model::EntryKind::Timer,
                    timestamp: t,
                    figures: Figures {
                        cpu_ram_used_mb: f(t - 100.0),
                        ..Figures::default()
                    },
                    ..Default::default()
                });
            }
            (src, d)
        };
        let m = merge(
            vec![
                series("0", &|_| 5000.0),
                series("1", &|t| 1000.0 + 10.0 * t),
            ],
            Accept::OneJob,
        )
        .unwrap();
        let leak = m.leak.unwrap();
        assert_eq!(leak["suspected"], true, "{leak:#}");
        assert!(
            leak["suspects"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s.as_str().unwrap().starts_with("rank 1: host")),
            "{leak:#}"
        );
        let rate = leak["host"]["rate_mib_per_hour"].as_f64().unwrap();
        assert!((rate - 36_000.0).abs() < 3_600.0, "{rate}");
        assert_eq!(leak["ranks"]["0"]["suspected"], false);
    }

    #[test]
    fn other_runs_and_a_rank_twice_are_refused_unless_forced() {
        let mut other = rank("1", 1.0, 0.0);
        other.1.run.name = "another-job".into();
        let err = merge(vec![rank("0", 1.0, 0.0), other.clone()], Accept::OneJob)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"job\"") && err.contains("\"another-job\""),
            "{err}"
        );
        assert!(err.contains("--force"), "{err}");
        // Two files of rank 0: the same file twice, or two jobs.
        let err = merge(
            vec![rank("0", 1.0, 0.0), rank("0", 2.0, 0.0)],
            Accept::OneJob,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("both rank \"0\""), "{err}");
        // Two runs on one host with no rank label: the host names both.
        let bare = |mb| {
            let (src, mut d) = rank("0", mb, 0.0);
            d.run.labels.remove("rank");
            d.run.host = "node".into();
            (src, d)
        };
        assert!(merge(vec![bare(1.0), bare(2.0)], Accept::OneJob).is_err());
        // A file without a run name goes with any.
        let mut nameless = rank("1", 1.0, 0.0);
        nameless.1.run.name.clear();
        assert!(merge(vec![rank("0", 1.0, 0.0), nameless], Accept::OneJob).is_ok());
        // Forced: merged, the repeated rank told apart by its position.
        let m = merge(vec![bare(1.0), bare(2.0), other], Accept::Any).unwrap();
        let names: Vec<&str> = m.ranks.iter().map(|r| r.rank.as_str()).collect();
        assert_eq!(names, ["1", "node", "node#1"]);
    }

    #[test]
    fn the_host_block_says_how_the_ranks_measured() {
        let with = |r: &str, source, reason: &str, rss: f64| {
            let (src, mut d) = rank(r, 1.0, 0.0);
            d.host = Some(HostInfo {
                source,
                reason: reason.into(),
                cgroup: Some(format!("/memtrack/{r}")),
                rss_sum_peak_mb: rss,
                kernel_peak_mb: Some(rss / 2.0),
                oom_kills: Some(1),
                ..HostInfo::default()
            });
            (src, d)
        };
        let m = merge(
            vec![
                with("0", HostSource::Cgroup, "job cgroup", 10.0),
                with("1", HostSource::Cgroup, "job cgroup", 30.0),
            ],
            Accept::OneJob,
        )
        .unwrap();
        let h = m.host.unwrap();
        assert_eq!(h.source, HostSource::Cgroup);
        assert_eq!(h.reason, "job cgroup");
        assert_eq!(h.cgroup, None, "a node's cgroup is not the job's");
        assert_eq!((h.rss_sum_peak_mb, h.kernel_peak_mb), (30.0, Some(15.0)));
        assert_eq!(h.oom_kills, Some(2));
        assert_eq!(m.ranks[1].host_source, Some(HostSource::Cgroup));

        // Mixed: the least exact source, each rank's named.
        let (src, old) = rank("2", 1.0, 0.0);
        let m = merge(
            vec![
                with("0", HostSource::Pages, "root", 10.0),
                with("1", HostSource::Pss, "no root", 10.0),
                (src, old),
            ],
            Accept::OneJob,
        )
        .unwrap();
        let h = m.host.unwrap();
        assert_eq!(h.source, HostSource::Rss);
        assert_eq!(
            h.reason,
            "the ranks measured differently: rank 0 pages, rank 1 pss, rank 2 rss"
        );
        // No rank says: no block, as before.
        let m = merge(
            vec![rank("0", 1.0, 0.0), rank("1", 1.0, 0.0)],
            Accept::OneJob,
        )
        .unwrap();
        assert!(m.host.is_none());
    }
}
