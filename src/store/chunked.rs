//! An append-only log whose clone is cheap.
//!
//! A store without an entries file (see [`super::entries`]) keeps its
//! event entries here, possibly many thousands. Checkpoints are written
//! off the engine thread from a clone of the store; cloning a plain `Vec`
//! of that size would itself stall sampling. Here full chunks are sealed behind an `Arc` and shared
//! by every clone, so a clone copies at most one open chunk.
//!
//! It serializes as a flat sequence, the same JSON as a `Vec`.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Entries per sealed chunk.
const CHUNK: usize = 4096;

/// The log.
#[derive(Debug, Clone)]
pub(crate) struct ChunkLog<T> {
    sealed: Vec<Arc<Vec<T>>>,
    open: Vec<T>,
}

impl<T> Default for ChunkLog<T> {
    fn default() -> Self {
        ChunkLog {
            sealed: Vec::new(),
            open: Vec::new(),
        }
    }
}

impl<T> ChunkLog<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn push(&mut self, value: T) {
        self.open.push(value);
        if self.open.len() >= CHUNK {
            let full = std::mem::take(&mut self.open);
            self.sealed.push(Arc::new(full));
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.sealed.len() * CHUNK + self.open.len()
    }

    /// Every entry, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.sealed
            .iter()
            .flat_map(|c| c.iter())
            .chain(self.open.iter())
    }
}

impl<'a, T> IntoIterator for &'a ChunkLog<T> {
    type Item = &'a T;
    type IntoIter = Box<dyn Iterator<Item = &'a T> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl<T: Serialize> Serialize for ChunkLog<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for ChunkLog<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Seq<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Seq<T> {
            type Value = ChunkLog<T>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence of log entries")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut log = ChunkLog::new();
                while let Some(v) = seq.next_element()? {
                    log.push(v);
                }
                Ok(log)
            }
        }
        deserializer.deserialize_seq(Seq(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_order_and_length_across_chunks() {
        let mut log = ChunkLog::new();
        for i in 0..(CHUNK * 2 + 7) {
            log.push(i);
        }
        assert_eq!(log.len(), CHUNK * 2 + 7);
        assert!(log.iter().copied().eq(0..CHUNK * 2 + 7));
    }

    #[test]
    fn a_clone_shares_the_sealed_chunks() {
        let mut log = ChunkLog::new();
        for i in 0..(CHUNK * 3 + 1) {
            log.push(i);
        }
        let copy = log.clone();
        assert!(Arc::ptr_eq(&log.sealed[2], &copy.sealed[2]));
        // The original goes on; the copy keeps what it had.
        log.push(7);
        assert_eq!((log.len(), copy.len()), (CHUNK * 3 + 2, CHUNK * 3 + 1));
    }

    #[test]
    fn serializes_as_a_plain_sequence() {
        let mut log = ChunkLog::new();
        for i in 0..(CHUNK + 3) {
            log.push(i as u32);
        }
        let text = serde_json::to_string(&log).unwrap();
        let plain: Vec<u32> = serde_json::from_str(&text).unwrap();
        assert!(plain.iter().copied().eq(0..(CHUNK + 3) as u32));
        let back: ChunkLog<u32> = serde_json::from_str(&text).unwrap();
        assert!(back.iter().eq(log.iter()));
        assert_eq!(back.len(), log.len());
    }
}
