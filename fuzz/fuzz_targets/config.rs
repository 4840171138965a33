//! Fuzzes the configuration reader: any TOML a user can write. Parsing and
//! resolving must never panic; a resolved configuration must be valid.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memtrack::config::{resolve, Layer};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(layer) = Layer::from_toml("fuzz", text) else {
        return;
    };
    if let Ok(config) = resolve(&[layer]) {
        config.validate("fuzz").expect("a resolved config is valid");
    }
});
