//! Fuzzes what `memtrack report`, `merge`, `plot` and the leak verdict do
//! with any JSON file: reading, rendering, judging and merging must never
//! panic (timestamps past year 9999, negative ones, absurd figures), the
//! rendered report must carry no control character but its own newlines,
//! and plot sizes outside the documented bounds must be refused.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memtrack::model::Document;
use memtrack::model::leak;
use memtrack::report::{merge, plot, text};

fuzz_target!(|data: &[u8]| {
    // Any two u32s as a plot size: refused outside the bounds, accepted
    // inside, never a panic.
    if data.len() >= 8 {
        let w = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        let h = u32::from_le_bytes([data[4], data[5], data[6], data[7]]);
        let inside = (plot::MIN_WIDTH..=plot::MAX_SIDE).contains(&w)
            && (plot::MIN_HEIGHT..=plot::MAX_SIDE).contains(&h);
        assert_eq!(plot::check_size(w, h).is_ok(), inside, "{w}x{h}");
    }
    let Ok(doc) = serde_json::from_slice::<Document>(data) else {
        return;
    };
    let report = text::render(&doc);
    assert!(
        !report.chars().any(|c| c.is_control() && c != '\n'),
        "a control character reaches the terminal"
    );
    let _ = leak::analyze(&doc, &leak::LeakConfig::default());
    let _ = merge::merge(
        vec![("a".into(), doc.clone()), ("b".into(), doc)],
        merge::Accept::Any,
    );
});
