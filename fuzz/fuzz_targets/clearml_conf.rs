//! Fuzzes the `clearml.conf` (HOCON subset) parser: never a panic, and every
//! error names a line inside the text.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memtrack::export::clearml::hocon::parse;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = parse(text) {
        let _ = e.to_string();
    }
});
