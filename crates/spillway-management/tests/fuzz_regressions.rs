//! Replays the `http_api` fuzz target's findings without the fuzzer, on
//! stable Rust: every crash input kept under `fuzz/regressions/http_api/`
//! and every seed under `fuzz/corpus-seeds/http_api/` goes through the
//! target's check (`fuzz/src/http_api.rs`, included here). The seeds are
//! compared with what `seeds()` makes; `SPILLWAY_REGENERATE_FUZZ_SEEDS=1`
//! rewrites them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../../fuzz/src/http_api.rs"]
mod http_api;

use std::path::{Path, PathBuf};

fn dir(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz")
        .join(kind)
        .join("http_api")
}

fn files(kind: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir(kind)) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn http_api_seeds_are_current_and_pass_the_check() {
    let seeds = http_api::seeds();
    if std::env::var_os("SPILLWAY_REGENERATE_FUZZ_SEEDS").is_some() {
        std::fs::create_dir_all(dir("corpus-seeds")).unwrap();
        for (name, bytes) in &seeds {
            std::fs::write(dir("corpus-seeds").join(name), bytes).unwrap();
        }
    }
    for (name, bytes) in &seeds {
        let stored = std::fs::read(dir("corpus-seeds").join(name))
            .unwrap_or_else(|_| panic!("seed {name} missing: SPILLWAY_REGENERATE_FUZZ_SEEDS=1"));
        assert_eq!(&stored, bytes, "seed {name} is stale");
        http_api::check_http_api(bytes);
    }
    assert_eq!(files("corpus-seeds").len(), seeds.len());
}

#[test]
fn http_api_saved_crashes_pass_the_check() {
    for path in files("regressions") {
        http_api::check_http_api(&std::fs::read(&path).unwrap());
    }
}
