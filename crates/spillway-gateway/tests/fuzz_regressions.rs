//! Replays the fuzzers' findings without the fuzzer, on stable Rust: every
//! crash input kept under `fuzz/regressions/<target>/` and every seed under
//! `fuzz/corpus-seeds/<target>/` goes through the same check its fuzz target
//! runs (`fuzz/src/lib.rs`, included here). The seeds are also compared with
//! what `seeds()` makes, and each must still reach what it was made for.
//! `SPILLWAY_REGENERATE_FUZZ_SEEDS=1` rewrites them.

// Outcome fields exist for their `Debug` text, which dead-code analysis ignores.
#[allow(dead_code)]
#[path = "../../../fuzz/src/lib.rs"]
mod fuzz_checks;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// The files of `fuzz/<kind>/<target>/`, sorted; none if the directory is
/// missing.
fn cases(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join(kind).join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
}

/// Runs `target`'s check on one file; the panic message if it failed.
fn replay(target: &str, path: &Path) -> Result<String, String> {
    let data = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    match catch_unwind(AssertUnwindSafe(|| fuzz_checks::run(target, &data))) {
        Ok(Some(outcome)) => Ok(outcome),
        Ok(None) => Err(format!("{}: no fuzz target {target}", path.display())),
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("{}: {message}", path.display()))
        }
    }
}

#[test]
fn every_kept_crash_passes_its_check() {
    let mut failures = Vec::new();
    let mut replayed = 0;
    for target in fuzz_checks::TARGETS {
        for path in cases("regressions", target) {
            replayed += 1;
            if let Err(failure) = replay(target, &path) {
                failures.push(failure);
            }
        }
    }
    // Directories other than the targets' would be skipped silently.
    if let Ok(entries) = std::fs::read_dir(fuzz_dir().join("regressions")) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            assert!(
                fuzz_checks::TARGETS.contains(&name.as_str()) || !entry.path().is_dir(),
                "fuzz/regressions/{name} is not a fuzz target"
            );
        }
    }
    assert!(
        replayed > 0,
        "no regression case found under fuzz/regressions"
    );
    assert!(
        failures.is_empty(),
        "failing cases:\n{}",
        failures.join("\n")
    );
}

#[test]
fn committed_seeds_are_current_and_reach_what_they_were_made_for() {
    let regenerate = std::env::var_os("SPILLWAY_REGENERATE_FUZZ_SEEDS").is_some();
    let mut problems = Vec::new();
    let seeds = fuzz_checks::seeds();
    for target in fuzz_checks::TARGETS {
        assert!(
            seeds.iter().any(|seed| seed.target == target),
            "no seed for {target}"
        );
    }
    for seed in &seeds {
        let path = fuzz_dir()
            .join("corpus-seeds")
            .join(seed.target)
            .join(seed.name);
        if regenerate {
            if let Some(dir) = path.parent() {
                if let Err(error) = std::fs::create_dir_all(dir) {
                    problems.push(format!("{}: {error}", dir.display()));
                }
            }
            if let Err(error) = std::fs::write(&path, &seed.bytes) {
                problems.push(format!("{}: {error}", path.display()));
            }
        }
        match std::fs::read(&path) {
            Ok(committed) if committed == seed.bytes => {}
            Ok(_) => problems.push(format!(
                "{} is stale: run with SPILLWAY_REGENERATE_FUZZ_SEEDS=1",
                path.display()
            )),
            Err(error) => problems.push(format!("{}: {error}", path.display())),
        }
        match replay(seed.target, &path) {
            Ok(outcome) if outcome.contains(seed.expect) => {}
            Ok(outcome) => problems.push(format!(
                "{}: expected {:?} in {outcome}",
                path.display(),
                seed.expect
            )),
            Err(failure) => problems.push(failure),
        }
    }
    // A committed seed that seeds() no longer makes is left over.
    for target in fuzz_checks::TARGETS {
        for path in cases("corpus-seeds", target) {
            let known = seeds
                .iter()
                .any(|seed| seed.target == target && path.file_name() == Some(seed.name.as_ref()));
            if !known {
                problems.push(format!("{} is not made by seeds()", path.display()));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
