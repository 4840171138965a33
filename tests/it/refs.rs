//! Every reference resolves inside the repository: no tracked file points
//! a reader at planning notes that are not part of it. Features are
//! described by what they do; formats and rules live in docs/.

use std::path::Path;
use std::process::Command;

/// Tracked files that must keep a historical name (paths from the
/// repository root). Keep it empty unless a fixture cannot do without one.
const ALLOWED: &[&str] = &[];

/// How a reference to the planning notes looks, in lower case. Built from
/// pieces so that this file does not match itself.
const NEEDLES: [&str; 7] = [
    concat!("..", "/shared"),
    concat!("seed", " 00"),
    concat!("seed", "_00"),
    concat!("seed", "-00"),
    concat!("seed", "-shaped"),
    concat!("the seed", "'s "),
    concat!("spec", " §"),
];

/// Each needle found in `text` (case-insensitive), with its line number.
fn outside_refs(text: &[u8]) -> Vec<(usize, &'static str)> {
    let lower = text.to_ascii_lowercase();
    let mut found = Vec::new();
    for (i, line) in lower.split(|&b| b == b'\n').enumerate() {
        for needle in NEEDLES {
            if line.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                found.push((i + 1, needle));
            }
        }
    }
    found
}

/// The repository's tracked files, relative to its root.
fn tracked_files(root: &Path) -> Vec<String> {
    let out = Command::new("git")
        .args(["-c", "safe.directory=*", "ls-files", "-z"])
        .current_dir(root)
        .output()
        .expect("git must be installed to list the tracked files");
    assert!(
        out.status.success(),
        "git ls-files failed in {}: {}",
        root.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("tracked file names are UTF-8")
        .split('\0')
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn no_tracked_file_points_outside_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = tracked_files(root);
    // An empty or partial listing must not pass for a clean one.
    for must in ["Cargo.toml", "README.md", "src/lib.rs"] {
        assert!(
            files.iter().any(|f| f == must),
            "git ls-files did not list {must}"
        );
    }
    let mut hits = Vec::new();
    for file in &files {
        if ALLOWED.contains(&file.as_str()) {
            continue;
        }
        let text = match std::fs::read(root.join(file)) {
            Ok(t) => t,
            // Deleted in the working tree but not yet in the index.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => panic!("cannot read {file}: {e}"),
        };
        for (line, needle) in outside_refs(&text) {
            hits.push(format!("{file}:{line}: `{needle}`"));
        }
    }
    assert!(
        hits.is_empty(),
        "these lines point at documents that are not in the repository; \
         say what the feature does, or cite a file in docs/:\n{}",
        hits.join("\n")
    );
}

#[test]
fn the_check_sees_every_form_and_nothing_else() {
    let bad = [
        format!(
            "see [the contract]({}/clearml-contract.md)",
            concat!("..", "/shared")
        ),
        format!("in the format of {}2's tracker", concat!("Se", "ed 00")),
        format!("fn memory_info_has_{}0_fields()", concat!("se", "ed_00")),
        format!("the {}4 pipeline", concat!("SE", "ED-00")),
        format!("the schema ({}5)", concat!("SP", "EC §")),
        format!(
            "// A {} file without a log reads.",
            concat!("seed", "-shaped")
        ),
        format!("keeps {} keys", concat!("the Seed", "'s")),
    ];
    for text in &bad {
        assert_eq!(outside_refs(text.as_bytes()).len(), 1, "{text}");
    }
    let lines = format!("ok\nok\n{}\n", bad[1]);
    assert_eq!(outside_refs(lines.as_bytes())[0].0, 3);
    for fine in [
        "Output roots are often shared (`/shared/outputs`)",
        "fuzz/seeds/report/bare.json",
        "let seed: u64 = 1; for seed in 0..5 {}",
        "version = \"1.2.1+spec-1.1.0\"",
        "nvml-wrapper issue #56",
    ] {
        assert!(outside_refs(fine.as_bytes()).is_empty(), "{fine}");
    }
}
