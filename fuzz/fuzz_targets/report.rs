//! Fuzzes what `memtrack report`, `merge` and the leak verdict do with any
//! JSON file: reading, rendering, judging and merging must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memtrack::model::Document;
use memtrack::report::{leak, merge, text};

fuzz_target!(|data: &[u8]| {
    let Ok(doc) = serde_json::from_slice::<Document>(data) else {
        return;
    };
    let _ = text::render(&doc);
    let _ = leak::analyze(&doc, &leak::LeakConfig::default());
    let _ = merge::merge(vec![("a".into(), doc.clone()), ("b".into(), doc)]);
});
