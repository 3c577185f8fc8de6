//! `spillway-sim`: runs seeds of the storage group's simulation
//! (`make sim SEEDS=N`), or replays one (`--seed S`), and prints a failing
//! seed with how to replay it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Parser;
use spillway_sim::{run_seed, Settings};

#[derive(Parser)]
#[command(about = "Deterministic simulation of Spillway's storage group under seeded faults")]
struct Args {
    /// How many seeds to run, from --first on.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 1)]
    first: u64,
    /// Run this one seed only, and print its history (a replay).
    #[arg(long)]
    seed: Option<u64>,
    /// Seeds run at once (each on its own thread and runtime).
    #[arg(long, default_value_t = 2)]
    threads: u64,
    /// Simulated seconds of faults per seed.
    #[arg(long, default_value_t = 20)]
    fault_seconds: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let settings = Settings {
        faults_for: Duration::from_secs(args.fault_seconds),
        ..Settings::default()
    };
    if let Some(seed) = args.seed {
        return match run_seed(seed, &settings) {
            Ok(report) => {
                println!("{report:?}");
                Ok(())
            }
            Err(failure) => bail!("{failure}"),
        };
    }
    let started = Instant::now();
    let next = Arc::new(AtomicU64::new(args.first));
    let end = args.first.saturating_add(args.seeds);
    let failed = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..args.threads.max(1))
        .map(|_| {
            let (next, failed, settings) = (next.clone(), failed.clone(), settings.clone());
            std::thread::spawn(move || {
                let mut passed = 0u64;
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= end || failed.load(Ordering::Relaxed) {
                        return passed;
                    }
                    match run_seed(seed, &settings) {
                        Ok(report) => {
                            passed += 1;
                            println!(
                                "seed {seed}: ok, digest {:016x}, {} faults, {} leases, {} confirmed, {} refused, {} added, {} removed, log at {} ({})",
                                report.digest,
                                report.faults,
                                report.leases,
                                report.confirmed,
                                report.refused,
                                report.members_added,
                                report.members_removed,
                                report.applied_index,
                                report.weather
                            );
                        }
                        Err(failure) => {
                            failed.store(true, Ordering::Relaxed);
                            eprintln!("{failure}");
                            return passed;
                        }
                    }
                }
            })
        })
        .collect();
    let mut passed = 0;
    for worker in workers {
        passed += worker.join().unwrap_or(0);
    }
    println!(
        "{passed} seeds passed in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if failed.load(Ordering::Relaxed) {
        bail!("a seed failed (above)");
    }
    Ok(())
}
