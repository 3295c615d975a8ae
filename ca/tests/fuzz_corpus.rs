//! Every committed fuzz input, replayed without cargo-fuzz: each file of
//! `fuzz/corpus/<target>/` goes through the body of that fuzz target
//! (`fuzz/src/lib.rs`, included below: the very functions the targets
//! call), which panics on a defect or a broken property. The corpus holds
//! the inputs that once made a target fail (`crash-*`), so those stay
//! fixed, and a minimized set of what fuzzing found (docs/benchmarks-history.md,
//! "Fuzzing").

use std::path::{Path, PathBuf};

#[allow(unreachable_pub, dead_code)]
#[path = "../../fuzz/src/lib.rs"]
mod fuzz_targets;

use fuzz_targets::TARGETS;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The files of a directory, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn every_target_has_a_committed_corpus_and_calls_the_replayed_body() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    // The `name` of every `[[bin]]`.
    let bins: Vec<&str> = manifest
        .split("[[bin]]")
        .skip(1)
        .filter_map(|bin| {
            let line = bin.lines().find(|l| l.trim_start().starts_with("name"))?;
            line.split('"').nth(1)
        })
        .collect();
    let replayed: Vec<&str> = TARGETS.iter().map(|(name, _)| *name).collect();
    assert_eq!(
        bins, replayed,
        "fuzz/Cargo.toml's targets and the ones replayed here (fuzz/src/lib.rs, TARGETS)"
    );
    for name in bins {
        let target = std::fs::read_to_string(fuzz_dir().join(format!("fuzz_targets/{name}.rs")))
            .expect("the target's source");
        assert!(
            target.contains(&format!("meshca_fuzz::{name}(data)")),
            "fuzz_targets/{name}.rs calls meshca_fuzz::{name}, the body replayed here"
        );
        assert!(
            !files(&fuzz_dir().join("corpus").join(name)).is_empty(),
            "fuzz/corpus/{name}/ has seeds"
        );
    }
    for dir in std::fs::read_dir(fuzz_dir().join("corpus")).expect("fuzz/corpus") {
        let dir = dir.expect("a directory entry").file_name();
        let dir = dir.to_string_lossy();
        assert!(
            replayed.contains(&dir.as_ref()),
            "fuzz/corpus/{dir}/ belongs to no target"
        );
    }
}

#[test]
fn every_committed_fuzz_input_passes_its_target() {
    let mut failed = Vec::new();
    let mut replayed = 0;
    for (name, body) in TARGETS {
        for file in files(&fuzz_dir().join("corpus").join(name)) {
            let data = std::fs::read(&file).expect("a corpus file");
            // The panic's message is printed; carry on, to list them all.
            if std::panic::catch_unwind(|| body(&data)).is_err() {
                failed.push(format!("{name}: {}", file.display()));
            }
            replayed += 1;
        }
    }
    assert!(
        failed.is_empty(),
        "inputs that fail their target: {failed:#?}"
    );
    assert!(replayed > 0);
}

#[test]
fn the_former_crash_inputs_are_kept() {
    for (name, prefix) in [
        ("token", "crash-8f0f"),
        ("token_plausibility", "crash-01b6"),
    ] {
        assert!(
            files(&fuzz_dir().join("corpus").join(name)).iter().any(|f| f
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(prefix))),
            "fuzz/corpus/{name}/{prefix}… (a false alarm of the target, fixed in its checks) is a regression seed"
        );
    }
}
