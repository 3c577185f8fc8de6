//! The simulation in CI: a few hundred seeds keep every guarantee, and a
//! seed replays exactly. More seeds: `make sim SEEDS=N`.

use std::time::Duration;

use spillway_sim::{run_seed, Report, Settings};

/// Seeds per `make test`; `SPILLWAY_SIM_SEEDS` sets another number.
const CI_SEEDS: u64 = 400;

fn seeds() -> u64 {
    std::env::var("SPILLWAY_SIM_SEEDS")
        .ok()
        .and_then(|seeds| seeds.parse().ok())
        .unwrap_or(CI_SEEDS)
}

/// Runs seeds `first..first + count` on two threads; the first failure.
fn run_all(first: u64, count: u64, settings: &Settings) -> Result<Vec<Report>, String> {
    let half = count / 2;
    let ranges = [(first, half), (first + half, count - half)];
    let handles: Vec<_> = ranges
        .into_iter()
        .map(|(from, count)| {
            let settings = settings.clone();
            std::thread::spawn(move || {
                (from..from + count)
                    .map(|seed| run_seed(seed, &settings).map_err(|failure| failure.to_string()))
                    .collect::<Result<Vec<_>, String>>()
            })
        })
        .collect();
    let mut reports = Vec::new();
    for handle in handles {
        reports.extend(
            handle
                .join()
                .map_err(|_| "a seed's thread panicked".to_string())??,
        );
    }
    Ok(reports)
}

/// How many of `reports` show `what`.
fn seeds_where(reports: &[Report], what: impl Fn(&Report) -> bool) -> usize {
    reports.iter().filter(|report| what(report)).count()
}

#[test]
fn every_seed_keeps_every_guarantee() {
    let count = seeds();
    let reports = match run_all(1, count, &Settings::default()) {
        Ok(reports) => reports,
        Err(failure) => panic!("{failure}"),
    };
    assert_eq!(reports.len() as u64, count);
    // The runs did something: faults happened, engines took over from
    // each other, and writes were confirmed through them.
    let faults: usize = reports.iter().map(|report| report.faults).sum();
    let takeovers = seeds_where(&reports, |report| report.leases > 1);
    let refused = seeds_where(&reports, |report| report.refused > 0);
    let confirmed: usize = reports.iter().map(|report| report.confirmed).sum();
    println!(
        "{count} seeds: {faults} faults, {takeovers} with a lease taken over, {refused} with a deposed engine refused, {confirmed} writes confirmed"
    );
    assert!(
        faults as u64 > count * 10,
        "{faults} faults in {count} seeds"
    );
    assert!(
        takeovers as u64 > count / 4,
        "only {takeovers} seeds saw a takeover"
    );
    assert!(
        refused as u64 > count / 10,
        "only {refused} seeds refused a deposed engine"
    );
    assert!(
        confirmed as u64 > count * 50,
        "{confirmed} writes confirmed in {count} seeds"
    );
    let added = seeds_where(&reports, |report| report.members_added > 0);
    let removed = seeds_where(&reports, |report| report.members_removed > 0);
    println!("{added} seeds added a member, {removed} removed one");
    assert!(
        added as u64 > count / 2,
        "only {added} seeds added a member"
    );
    assert!(
        removed as u64 > count / 4,
        "only {removed} seeds removed a member"
    );
    let idle = seeds_where(&reports, |report| report.confirmed == 0);
    assert!(idle as u64 <= count / 20, "{idle} seeds confirmed nothing");
}

#[test]
fn a_seed_replays_exactly() {
    let settings = Settings {
        faults_for: Duration::from_secs(10),
        ..Settings::default()
    };
    for seed in [7, 4242] {
        let first = run_seed(seed, &settings).map_err(|failure| failure.to_string());
        let again = run_seed(seed, &settings).map_err(|failure| failure.to_string());
        let (first, again) = match (first, again) {
            (Ok(first), Ok(again)) => (first, again),
            (first, again) => panic!("seed {seed}: {first:?} / {again:?}"),
        };
        assert_eq!(
            (first.digest, first.confirmed, first.applied_index),
            (again.digest, again.confirmed, again.applied_index),
            "seed {seed} ran differently the second time"
        );
    }
    // And another seed runs differently.
    let other = run_seed(8, &settings).map_err(|failure| failure.to_string());
    let seven = run_seed(7, &settings).map_err(|failure| failure.to_string());
    match (other, seven) {
        (Ok(other), Ok(seven)) => assert_ne!(other.digest, seven.digest),
        (other, seven) => panic!("{other:?} / {seven:?}"),
    }
}
