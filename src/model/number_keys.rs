//! Maps keyed by a number (a PID, a GPU index), read from JSON.
//!
//! JSON writes such keys as strings. serde_json turns them back into
//! numbers when it reads the map itself, but a map inside a
//! `#[serde(flatten)]`ed struct is read from serde's buffered copy of the
//! object, which hands each key over as the string it was, and a plain
//! `BTreeMap<u32, _>` refuses it. Maps that can be reached that way (the
//! store's state in a checkpoint) read their keys with [`deserialize`]:
//! a number or a string that holds one.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, MapAccess, Unexpected, Visitor};
use serde::Deserialize;

/// A `BTreeMap<u32, V>` whose keys are numbers or strings of digits.
pub(crate) fn deserialize<'de, D, V>(deserializer: D) -> Result<BTreeMap<u32, V>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    deserializer.deserialize_map(Entries(PhantomData))
}

struct Entries<V>(PhantomData<V>);

impl<'de, V: Deserialize<'de>> Visitor<'de> for Entries<V> {
    type Value = BTreeMap<u32, V>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map keyed by numbers")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = BTreeMap::new();
        while let Some((Key(k), v)) = map.next_entry::<Key, V>()? {
            out.insert(k, v);
        }
        Ok(out)
    }
}

struct Key(u32);

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Key, D::Error> {
        deserializer.deserialize_any(KeyVisitor)
    }
}

struct KeyVisitor;

impl Visitor<'_> for KeyVisitor {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key from 0 to 4294967295 (a number, or a string of one)")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Key, E> {
        u32::try_from(v)
            .map(Key)
            .map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Key, E> {
        u32::try_from(v)
            .map(Key)
            .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
        v.parse()
            .map(Key)
            .map_err(|_| E::invalid_value(Unexpected::Str(v), &self))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Serialize};

    #[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
    struct Inner {
        #[serde(deserialize_with = "super::deserialize")]
        by_pid: BTreeMap<u32, u64>,
        #[serde(default)]
        plain: BTreeMap<u32, u64>,
    }

    #[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
    struct Outer {
        seq: u64,
        #[serde(flatten)]
        inner: Inner,
    }

    #[test]
    fn keys_read_back_through_a_flattened_struct() {
        let outer = Outer {
            seq: 7,
            inner: Inner {
                by_pid: BTreeMap::from([(0, 1), (10, u64::MAX), (u32::MAX, 3)]),
                plain: BTreeMap::new(),
            },
        };
        let text = serde_json::to_string(&outer).unwrap();
        let back: Outer = serde_json::from_str(&text).unwrap();
        assert_eq!(back, outer);
        // Without it, the buffered copy's string keys are refused.
        let err =
            serde_json::from_str::<Outer>(r#"{"seq":1,"by_pid":{},"plain":{"10":1}}"#).unwrap_err();
        assert!(err.to_string().contains("expected u32"), "{err}");
    }

    #[test]
    fn keys_are_numbers_or_strings_of_one_and_fit_in_u32() {
        let read = |text: &str| {
            let mut d = serde_json::Deserializer::from_str(text);
            super::deserialize::<_, u8>(&mut d)
        };
        assert_eq!(
            read(r#"{"3":1,"40":2}"#).unwrap(),
            BTreeMap::from([(3, 1), (40, 2)])
        );
        for bad in [r#"{"-1":1}"#, r#"{"4294967296":1}"#, r#"{"gpu0":1}"#] {
            let err = read(bad).unwrap_err().to_string();
            assert!(err.contains("a key from 0 to 4294967295"), "{bad}: {err}");
        }
        let buffered: serde_json::Value = serde_json::json!({"7": 1});
        let from_value = super::deserialize::<_, u8>(buffered).unwrap();
        assert_eq!(from_value, BTreeMap::from([(7, 1)]));
    }
}
