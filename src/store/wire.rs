//! The journal's line format, kept apart from the in-memory types.
//!
//! Every line is `{"v":2,"seq":N,"record":{…}}`. A sample record — the
//! bulk of a journal, one per tick — is written through [`SampleLine`]:
//! each process's figures as one array, `[pid, rss, hwm, pss, uss,
//! own_read, hwm_rise]` (bytes; `pss`/`uss` `null` when not read;
//! `own_read` 1 for a read, 2 for an estimate), instead
//! of an object whose keys would be repeated for every process at every
//! tick. The other records keep the form of [`Record`] (tagged by
//! `record`). Renaming a field of [`Sample`] or [`HostProcessReading`]
//! therefore does not change the journal: the conversions here decide it.
//!
//! Version 1 lines (written before the version existed: no `v`, and the
//! sample's processes as objects) are read as they always were, so a
//! journal an older memtrack left behind recovers whole. A line of a later
//! version is not understood and is counted as unreadable.

use serde::de::{self, SeqAccess, Visitor};
use serde::ser::SerializeTuple;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{Record, SampleKind};
use crate::sample::footprint::SourceInfo;
use crate::sample::gpu::{GpuSample, Status};
use crate::sample::host::{Described, Footprint, HostProcessReading, HostSample, Joined, Left};
use crate::sample::{HostMemory, Sample};

/// The version of the lines this memtrack writes.
pub(super) const VERSION: u32 = 2;

/// A line as written.
#[derive(Serialize)]
pub(super) struct LineOut<'a> {
    v: u32,
    seq: u64,
    record: RecordOut<'a>,
}

impl<'a> LineOut<'a> {
    pub(super) fn new(seq: u64, record: &'a Record) -> LineOut<'a> {
        let record = match record {
            Record::Sample { kind, sample } => RecordOut::Sample(SampleLine {
                record: SampleTag::Sample,
                kind: *kind,
                sample: SampleOut::from(&**sample),
            }),
            other => RecordOut::Other(other),
        };
        LineOut {
            v: VERSION,
            seq,
            record,
        }
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum RecordOut<'a> {
    Sample(SampleLine<SampleOut<'a>>),
    Other(&'a Record),
}

/// A line as read: its version (absent in version 1), its sequence number
/// and its record.
#[derive(Deserialize)]
struct LineIn {
    #[serde(default = "version_1")]
    v: u32,
    seq: u64,
    record: RecordIn,
}

fn version_1() -> u32 {
    1
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RecordIn {
    Sample(Box<SampleLine<SampleIn>>),
    Other(Record),
}

/// The tag a sample record carries (`"record": "sample"`), so that no
/// other record is read as one.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum SampleTag {
    Sample,
}

#[derive(Serialize, Deserialize)]
struct SampleLine<S> {
    record: SampleTag,
    kind: SampleKind,
    sample: S,
}

/// Reads one journal line: its sequence number and record, or `None`
/// when it is not a line of a version this memtrack reads.
pub(super) fn read_line(line: &[u8]) -> Option<(u64, Record)> {
    let l: LineIn = serde_json::from_slice(line).ok()?;
    let record = match (l.v, l.record) {
        // (A version-1 sample reads so only when it followed no process.)
        (1 | VERSION, RecordIn::Sample(s)) => Record::Sample {
            kind: s.kind,
            sample: Box::new(s.sample.into()),
        },
        // Version 1 wrote a sample as the in-memory `Sample` was then:
        // `Record`'s own form reads it. A version-2 sample is never read
        // in that form.
        (VERSION, RecordIn::Other(Record::Sample { .. })) => return None,
        (1 | VERSION, RecordIn::Other(r)) => r,
        _ => return None,
    };
    Some((l.seq, record))
}

/// A sample as written.
#[derive(Serialize)]
struct SampleOut<'a> {
    timestamp: f64,
    host: HostOut<'a>,
    gpu: &'a GpuSample,
    gpu_status: &'a Status,
    memory: HostMemory,
    #[serde(skip_serializing_if = "Option::is_none")]
    host_source: Option<&'a SourceInfo>,
}

impl<'a> From<&'a Sample> for SampleOut<'a> {
    fn from(s: &'a Sample) -> SampleOut<'a> {
        let h = &s.host;
        SampleOut {
            timestamp: s.timestamp,
            host: HostOut {
                processes: Readings(&h.processes),
                joined: &h.joined,
                described: &h.described,
                left: &h.left,
                errors: h.errors,
                fd_fallbacks: h.fd_fallbacks,
                footprint: h.footprint.as_ref(),
            },
            gpu: &s.gpu,
            gpu_status: &s.gpu_status,
            memory: s.memory,
            host_source: s.host_source.as_ref(),
        }
    }
}

#[derive(Serialize)]
struct HostOut<'a> {
    processes: Readings<'a>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    joined: &'a [Joined],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    described: &'a [Described],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    left: &'a [Left],
    #[serde(skip_serializing_if = "is_zero")]
    errors: u32,
    #[serde(skip_serializing_if = "is_zero")]
    fd_fallbacks: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    footprint: Option<&'a Footprint>,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// A sample as read.
#[derive(Deserialize)]
struct SampleIn {
    timestamp: f64,
    host: HostIn,
    gpu: GpuSample,
    gpu_status: Status,
    memory: HostMemory,
    #[serde(default)]
    host_source: Option<SourceInfo>,
}

#[derive(Deserialize)]
struct HostIn {
    processes: Vec<Reading>,
    #[serde(default)]
    joined: Vec<Joined>,
    #[serde(default)]
    described: Vec<Described>,
    #[serde(default)]
    left: Vec<Left>,
    #[serde(default)]
    errors: u32,
    #[serde(default)]
    fd_fallbacks: u32,
    #[serde(default)]
    footprint: Option<Footprint>,
}

impl From<SampleIn> for Sample {
    fn from(s: SampleIn) -> Sample {
        let h = s.host;
        Sample {
            timestamp: s.timestamp,
            host: HostSample {
                processes: h.processes.into_iter().map(|r| r.0).collect(),
                joined: h.joined,
                described: h.described,
                left: h.left,
                errors: h.errors,
                fd_fallbacks: h.fd_fallbacks,
                footprint: h.footprint,
            },
            gpu: s.gpu,
            gpu_status: s.gpu_status,
            memory: s.memory,
            host_source: s.host_source,
            ..Sample::default()
        }
    }
}

/// The processes' figures, each written as one array.
struct Readings<'a>(&'a [HostProcessReading]);

impl Serialize for Readings<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(ReadingOut))
    }
}

/// The number of fields of a process's array.
const READING_FIELDS: usize = 7;

struct ReadingOut<'a>(&'a HostProcessReading);

impl Serialize for ReadingOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let r = self.0;
        let mut t = s.serialize_tuple(READING_FIELDS)?;
        t.serialize_element(&r.pid)?;
        t.serialize_element(&r.rss)?;
        t.serialize_element(&r.hwm)?;
        t.serialize_element(&r.pss)?;
        t.serialize_element(&r.uss)?;
        t.serialize_element(&(u8::from(r.own_read) + u8::from(r.own_read && r.own_estimated)))?;
        t.serialize_element(&r.hwm_rise)?;
        t.end()
    }
}

/// One process's figures, read from its array.
struct Reading(HostProcessReading);

impl<'de> Deserialize<'de> for Reading {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Reading, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = Reading;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(
                    f,
                    "a process's figures: [pid, rss, hwm, pss, uss, own_read, hwm_rise]"
                )
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Reading, A::Error> {
                let missing = |i| de::Error::invalid_length(i, &self);
                let mut r = HostProcessReading {
                    pid: a.next_element()?.ok_or_else(|| missing(0))?,
                    rss: a.next_element()?.ok_or_else(|| missing(1))?,
                    hwm: a.next_element()?.ok_or_else(|| missing(2))?,
                    pss: a.next_element()?.ok_or_else(|| missing(3))?,
                    uss: a.next_element()?.ok_or_else(|| missing(4))?,
                    own_read: false,
                    own_estimated: false,
                    hwm_rise: 0,
                };
                let own = a.next_element::<u8>()?.ok_or_else(|| missing(5))?;
                r.own_read = own != 0;
                r.own_estimated = own == 2;
                r.hwm_rise = a.next_element()?.ok_or_else(|| missing(6))?;
                if a.next_element::<de::IgnoredAny>()?.is_some() {
                    return Err(de::Error::invalid_length(READING_FIELDS + 1, &self));
                }
                Ok(Reading(r))
            }
        }
        d.deserialize_tuple(READING_FIELDS, Fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Sample {
        let mut s = Sample {
            timestamp: 100.25,
            ..Sample::default()
        };
        s.host.processes = vec![
            HostProcessReading {
                pid: 10,
                rss: 200 << 20,
                hwm: 210 << 20,
                pss: Some(150 << 20),
                uss: Some(120 << 20),
                own_read: true,
                own_estimated: true,
                hwm_rise: 4096,
            },
            HostProcessReading {
                pid: 11,
                rss: 50 << 20,
                hwm: 50 << 20,
                ..HostProcessReading::default()
            },
        ];
        s.host.errors = 2;
        s.memory = HostMemory {
            total: 16 << 30,
            available: 8 << 30,
        };
        s
    }

    fn line(record: &Record) -> String {
        serde_json::to_string(&LineOut::new(7, record)).unwrap()
    }

    #[test]
    fn a_sample_is_written_compactly_and_read_back_whole() {
        let record = Record::Sample {
            kind: SampleKind::Timer,
            sample: Box::new(sample()),
        };
        let text = line(&record);
        assert!(text.starts_with(r#"{"v":2,"seq":7,"record":{"record":"sample","kind":"timer""#));
        assert!(
            text.contains(r#""processes":[[10,209715200,220200960,157286400,125829120,2,4096],[11,52428800,52428800,null,null,0,0]]"#),
            "{text}"
        );
        let (seq, back) = read_line(text.as_bytes()).unwrap();
        assert_eq!(seq, 7);
        let Record::Sample { kind, sample: back } = back else {
            panic!("not a sample: {back:?}");
        };
        assert_eq!(kind, SampleKind::Timer);
        let want = sample();
        assert_eq!(back.timestamp, want.timestamp);
        assert_eq!(back.host.processes, want.host.processes);
        assert_eq!(back.host.errors, 2);
        assert_eq!(back.memory, want.memory);
        // Written again, the same line: nothing was lost on the way.
        assert_eq!(line(&Record::Sample { kind, sample: back }), text);
    }

    #[test]
    fn other_records_keep_their_form_under_the_version() {
        let record = Record::Finish {
            timestamp: 5.0,
            exit: None,
        };
        let text = line(&record);
        assert_eq!(
            text,
            r#"{"v":2,"seq":7,"record":{"record":"finish","timestamp":5.0,"exit":null}}"#
        );
        assert!(matches!(
            read_line(text.as_bytes()),
            Some((7, Record::Finish { timestamp, .. })) if timestamp == 5.0
        ));
    }

    /// The journal an older memtrack wrote (version 1, committed as a
    /// fixture: see `journal::tests::old_checkpoint`) reads line for line.
    #[test]
    fn an_old_journal_reads_whole() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/old_checkpoint/journal.jsonl");
        let text = std::fs::read_to_string(path).unwrap();
        let lines: Vec<&str> = text.lines().filter(|l| !l.is_empty()).collect();
        assert!(lines.len() >= 4, "{} lines", lines.len());
        let mut samples = 0;
        for l in &lines {
            let (_, r) = read_line(l.as_bytes()).unwrap_or_else(|| panic!("unread: {l}"));
            if let Record::Sample { sample, .. } = &r {
                samples += 1;
                assert!(!sample.host.processes.is_empty() || sample.host.left.is_empty());
            }
            // Each reads back the same through this version's form.
            let again = line(&r);
            let (_, r2) = read_line(again.as_bytes()).unwrap();
            assert_eq!(line(&r2), again);
        }
        assert!(samples > 0);
    }

    #[test]
    fn a_version_1_line_is_read_as_before_and_a_later_one_not_at_all() {
        let v1 = r#"{"seq":27,"record":{"record":"sample","kind":"timer","sample":{"timestamp":103.5,"host":{"processes":[{"pid":10,"rss":209715200,"hwm":209715200,"pss":null,"uss":null}],"joined":[],"left":[],"errors":0},"gpu":{"devices":[],"processes":[]},"gpu_status":"Unavailable","memory":{"total":1,"available":1}}}}"#;
        let (seq, r) = read_line(v1.as_bytes()).unwrap();
        assert_eq!(seq, 27);
        let Record::Sample { sample, .. } = r else {
            panic!("not a sample");
        };
        assert_eq!(sample.host.processes[0].rss, 209715200);
        let v3 = r#"{"v":3,"seq":1,"record":{"record":"finish","timestamp":5.0,"exit":null}}"#;
        assert!(read_line(v3.as_bytes()).is_none());
        // A version-2 sample whose process lacks a field is unreadable,
        // never read as a version-1 one.
        let short = r#"{"v":2,"seq":1,"record":{"record":"sample","kind":"timer","sample":{"timestamp":1.0,"host":{"processes":[[10,1,1]]},"gpu":{"devices":[],"processes":[]},"gpu_status":"Unavailable","memory":{"total":1,"available":1}}}}"#;
        assert!(read_line(short.as_bytes()).is_none());
    }
}
