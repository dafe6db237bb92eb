//! The accuracy study: a reproducible synthetic trace of over a million
//! requests (many clients; Poisson, heavy, bursty and abusive senders;
//! weighted costs) replayed through `SlidingCounter` and the exact
//! `SlidingLog` on a fake clock.
//!
//! Three measures, each asserted against the bound measured when it was
//! written (see BENCHMARKS.md):
//! * **Estimate**: every request is counted, and at each request the
//!   counter's estimate and the exact log are asked whether the client is
//!   over the limit (Cloudflare's measure, which reported 0.003%).
//! * **Decisions, same history**: the counter decides; the exact log is
//!   asked whether it would have decided alike on the counter's own
//!   admitted requests.
//! * **Decisions, independent replays**: each algorithm decides the trace
//!   on its own; also how far over the limit the counter ever lets a client
//!   get within one sliding window.
//!
//! `cargo test --release --test it accuracy -- --nocapture`
//! prints the report.

use std::time::Duration;

use crate::support::trace::{Class, trace};
use slidegate::{
    Policy,
    clock::FakeClock,
    key::Key,
    policy::Algorithm,
    store::{Check, Decision, MemoryStore, Store},
};

const SEED: u64 = 2026;
const LIMIT: u32 = 100;
const WINDOW: Duration = Duration::from_secs(60);
/// An hour from a start that is not aligned to any window.
const START: u64 = 1_700_000_000_123_457;
const DURATION_S: u64 = 3600;
/// A limit no client reaches, so that every request is recorded.
const UNBOUNDED: u32 = 1_000_000_000;

/// Bounds a little above what was measured on this trace (2.149%, 13.870%
/// and 9.261% wrongly decided; see BENCHMARKS.md), so that a change that
/// makes the counter worse fails here. The trace is seeded: the figures
/// are the same on every run.
const MAX_ESTIMATE_WRONG: f64 = 0.022;
const MAX_SAME_HISTORY_WRONG: f64 = 0.14;
const MAX_INDEPENDENT_WRONG: f64 = 0.095;
/// The sliding counter's worst case: a burst at the end of one window and
/// another late in the next both count, for up to twice the limit.
const MAX_OVERSHOOT: f64 = 2.0;

/// A `MemoryStore` decision, without a runtime: its answer is ready at once.
fn decide(store: &MemoryStore, check: Check) -> Decision {
    match store.check(&[check]).into_ready() {
        Ok(decisions) => decisions.expect("the memory store answers")[0],
        Err(_) => unreachable!("the memory store decides at once"),
    }
}

/// Decisions of the exact log beside the counter's.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    both_admit: u64,
    both_deny: u64,
    wrongly_admitted: u64,
    wrongly_denied: u64,
}

impl Tally {
    fn add(&mut self, exact: bool, approximate: bool) {
        match (exact, approximate) {
            (true, true) => self.both_admit += 1,
            (false, false) => self.both_deny += 1,
            (false, true) => self.wrongly_admitted += 1,
            (true, false) => self.wrongly_denied += 1,
        }
    }

    fn total(&self) -> f64 {
        (self.both_admit + self.both_deny + self.wrongly_admitted + self.wrongly_denied) as f64
    }

    fn wrong_share(&self) -> f64 {
        (self.wrongly_admitted + self.wrongly_denied) as f64 / self.total()
    }

    fn report(&self, name: &str) {
        let percent = |n: u64| 100.0 * n as f64 / self.total();
        eprintln!(
            "  {name:<24} {:>9} requests, exact denies {:>6.2}%; wrongly admitted {:>7.4}%, \
             wrongly denied {:>7.4}%, wrongly decided {:>7.4}%",
            self.total(),
            percent(self.both_deny + self.wrongly_admitted),
            percent(self.wrongly_admitted),
            percent(self.wrongly_denied),
            100.0 * self.wrong_share(),
        );
    }
}

/// A store on `clock`, with the study's policy for `algorithm` at `limit`.
struct Replay {
    store: MemoryStore,
    policy: Policy,
}

impl Replay {
    fn new(clock: &FakeClock, algorithm: Algorithm, limit: u32) -> Self {
        Self {
            store: MemoryStore::builder().with_clock(clock.clone()).build(),
            policy: Policy::new("study", limit, WINDOW).with_algorithm(algorithm),
        }
    }

    /// Asks for `cost` units for `key`.
    fn spend(&self, key: &Key, cost: u32) -> Decision {
        decide(
            &self.store,
            Check::new(&self.policy.clone().with_cost(cost), key.clone()).unwrap(),
        )
    }

    /// The units counted for `key` now, without recording anything.
    fn counted(&self, key: &Key) -> u32 {
        let mut probe = Check::new(&self.policy, key.clone()).unwrap();
        probe = probe.with_cost(self.policy.limit() + 1);
        self.policy.limit() - decide(&self.store, probe).remaining()
    }
}

const CLASSES: [&str; 4] = ["light", "heavy", "bursty", "abusive"];

fn class_index(class: Class) -> usize {
    match class {
        Class::Light => 0,
        Class::Heavy => 1,
        Class::Bursty => 2,
        Class::Abusive => 3,
    }
}

#[test]
fn sliding_counter_decides_like_the_exact_log() {
    let (requests, classes) = trace(SEED, LIMIT, START, DURATION_S);
    assert!(requests.len() >= 1_000_000, "{} requests", requests.len());
    let keys: Vec<Key> = (0..classes.len())
        .map(|c| Key::new(format!("client-{c}")))
        .collect();
    let clock = FakeClock::new(START);

    // Estimate: every request recorded by both.
    let every_log = Replay::new(&clock, Algorithm::SlidingLog, UNBOUNDED);
    let every_counter = Replay::new(&clock, Algorithm::SlidingCounter, UNBOUNDED);
    // Same history: the counter decides; a log records what it admitted.
    let deciding_counter = Replay::new(&clock, Algorithm::SlidingCounter, LIMIT);
    let admitted_log = Replay::new(&clock, Algorithm::SlidingLog, UNBOUNDED);
    // Independent: each decides alone.
    let exact = Replay::new(&clock, Algorithm::SlidingLog, LIMIT);

    let mut estimate = [Tally::default(); 4];
    let mut same = [Tally::default(); 4];
    let mut independent = Tally::default();
    let mut admitted_units = [0u64; 2];
    let mut worst_overshoot = 0u32;
    for request in &requests {
        clock.set(request.at);
        let key = &keys[request.client as usize];
        let class = class_index(classes[request.client as usize]);
        let cost = request.cost;

        // With no limit in reach, what is left after recording gives what
        // was counted before it, plus this request's cost.
        let with_request = |replay: &Replay| UNBOUNDED - replay.spend(key, cost).remaining();
        let over_exact = with_request(&every_log) > LIMIT;
        let over_estimate = with_request(&every_counter) > LIMIT;
        estimate[class].add(!over_exact, !over_estimate);

        let fits_exactly = admitted_log.counted(key) + cost <= LIMIT;
        let counter_admits = deciding_counter.spend(key, cost).admitted();
        same[class].add(fits_exactly, counter_admits);
        if counter_admits {
            let in_window = UNBOUNDED - admitted_log.spend(key, cost).remaining();
            worst_overshoot = worst_overshoot.max(in_window);
        }

        let log_admits = exact.spend(key, cost).admitted();
        independent.add(log_admits, counter_admits);
        admitted_units[0] += u64::from(cost) * u64::from(log_admits);
        admitted_units[1] += u64::from(cost) * u64::from(counter_admits);
    }

    let sum = |tallies: &[Tally; 4]| {
        tallies.iter().fold(Tally::default(), |a, t| Tally {
            both_admit: a.both_admit + t.both_admit,
            both_deny: a.both_deny + t.both_deny,
            wrongly_admitted: a.wrongly_admitted + t.wrongly_admitted,
            wrongly_denied: a.wrongly_denied + t.wrongly_denied,
        })
    };
    let (estimate_all, same_all) = (sum(&estimate), sum(&same));
    let overshoot = f64::from(worst_overshoot) / f64::from(LIMIT);
    let units_ratio = admitted_units[1] as f64 / admitted_units[0] as f64;
    eprintln!(
        "accuracy study: {} requests from {} clients over {DURATION_S} s, limit {LIMIT} per {}s, seed {SEED}",
        requests.len(),
        keys.len(),
        WINDOW.as_secs()
    );
    eprintln!(" estimate (every request counted):");
    estimate_all.report("all");
    for (name, tally) in CLASSES.iter().zip(&estimate) {
        tally.report(name);
    }
    eprintln!(" decisions, same history:");
    same_all.report("all");
    for (name, tally) in CLASSES.iter().zip(&same) {
        tally.report(name);
    }
    eprintln!(" decisions, independent replays:");
    independent.report("all");
    eprintln!(
        "  units admitted: log {}, counter {} ({units_ratio:.4}x); the counter's worst sliding \
         window held {worst_overshoot} units ({overshoot:.2}x the limit)",
        admitted_units[0], admitted_units[1]
    );

    assert!(
        estimate_all.wrong_share() <= MAX_ESTIMATE_WRONG,
        "estimate wrong on {:.4}% of requests",
        100.0 * estimate_all.wrong_share()
    );
    assert_eq!(
        estimate[0].wrong_share(),
        0.0,
        "light clients are never misjudged"
    );
    assert!(
        same_all.wrong_share() <= MAX_SAME_HISTORY_WRONG,
        "same-history decisions wrong on {:.4}%",
        100.0 * same_all.wrong_share()
    );
    assert!(
        independent.wrong_share() <= MAX_INDEPENDENT_WRONG,
        "independent replays disagree on {:.4}%",
        100.0 * independent.wrong_share()
    );
    assert!(
        overshoot <= MAX_OVERSHOOT,
        "a client reached {overshoot:.2}x the limit"
    );
    assert!(
        (0.97..=1.03).contains(&units_ratio),
        "the counter admitted {units_ratio:.4}x what the log did"
    );
}
