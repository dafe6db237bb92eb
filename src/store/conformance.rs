//! Holding a [`Store`] to the decisions of [`MemoryStore`], the crate's
//! model of every algorithm: a store written outside the crate (on
//! Postgres, DynamoDB, ...) proves itself with [`Conformance`], as the
//! crate's own tests prove [`RedisStore`](crate::store::RedisStore).

use std::fmt;
use std::time::Duration;

use super::{Check, Decisions, MemoryStore, Store, StoreError};
use crate::clock::FakeClock;
use crate::key::Key;
use crate::policy::{Algorithm, Calendar, Period, Policy};

/// A seeded trace of requests, each decided by the store under test and
/// by a [`MemoryStore`] on the same [`FakeClock`], which must agree at
/// every step: every decision, field for field (admitted, remaining,
/// reset, retry-after, delay, block, recorded time).
///
/// The trace moves the clock on by zero to three seconds a step, and sends
/// requests of three clients under any of eight policies at once, one of
/// each algorithm: a sliding log (with a delay), a longer one, a sliding
/// counter, a fixed window, a token bucket (each with a delay), a log that
/// blocks, a calendar day at an offset from UTC, and a concurrency limit;
/// at costs of one to three, some under a tier with windows of its own.
/// Some steps peek instead, and some refund a request admitted earlier
/// (releasing its lease).
///
/// The store under test must read the time from the clock given to
/// [`run`](Self::run), hold no state of the trace's clients when it
/// starts (a fresh key prefix will do), and answer
/// [`peek`](Store::peek) and [`refund`](Store::refund).
///
/// ```
/// use slidegate::clock::FakeClock;
/// use slidegate::store::{MemoryStore, conformance::Conformance};
///
/// # tokio_test();
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn tokio_test() {
/// let clock = FakeClock::new(Conformance::START);
/// // Your store, on `clock`; a memory store here.
/// let store = MemoryStore::builder().with_clock(clock.clone()).build();
/// Conformance::new(7).run(&store, &clock).await.unwrap();
/// # }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Conformance {
    seed: u64,
    steps: usize,
}

/// Where a store under test first decided otherwise than the model.
#[derive(Debug)]
struct Mismatch {
    /// The step, from 0.
    step: usize,
    /// What the step sent: `check`, `peek` or `refund`, and its checks.
    request: String,
    /// The model's answer.
    expected: String,
    /// The store's answer.
    found: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "step {} ({}): the model answered {}, the store {}",
            self.step, self.request, self.expected, self.found
        )
    }
}

/// What one step of the trace does.
enum Step {
    Check(Vec<Check>),
    Peek(Vec<Check>),
    /// Takes back the admitted request of this index (among those not
    /// taken back yet, counted from the newest).
    Refund(usize),
}

impl Conformance {
    /// A time the trace's clock may start at: aligned to no window, with
    /// a part below the millisecond.
    pub const START: u64 = 1_700_000_000_123_457;

    /// A trace of 2,000 steps drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { seed, steps: 2_000 }
    }

    /// The trace's length.
    #[must_use]
    pub fn with_steps(mut self, steps: usize) -> Self {
        self.steps = steps;
        self
    }

    /// Runs the trace against `store`, whose time is `clock`'s, and a
    /// memory store on the same clock. The error tells the first step where
    /// they differ, or where `store` fails: `step 12 (check ...): the model
    /// answered ..., the store ...`.
    pub async fn run<S: Store + ?Sized>(&self, store: &S, clock: &FakeClock) -> Result<(), String> {
        self.traced(store, clock)
            .await
            .map_err(|mismatch| mismatch.to_string())
    }

    async fn traced<S: Store + ?Sized>(
        &self,
        store: &S,
        clock: &FakeClock,
    ) -> Result<(), Mismatch> {
        let model = MemoryStore::builder().with_clock(clock.clone()).build();
        let mut random = SplitMix(self.seed);
        let mut admitted: Vec<(Vec<Check>, Vec<Duration>)> = Vec::new();
        for step in 0..self.steps {
            clock.advance(Duration::from_millis(match random.below(3) {
                0 => 0,
                1 => random.below(50),
                _ => random.below(3_000),
            }));
            match next_step(&mut random, admitted.len()) {
                Step::Check(checks) => {
                    let expected = model.check(&checks).await;
                    let found = store.check(&checks).await;
                    if let Ok(decisions) = &expected {
                        remember(&mut admitted, &checks, decisions);
                    }
                    agree(step, "check", &checks, expected, found)?;
                }
                Step::Peek(checks) => {
                    let expected = model.peek(&checks).await;
                    let found = store.peek(&checks).await;
                    agree(step, "peek", &checks, expected, found)?;
                }
                Step::Refund(back) => {
                    let (checks, times) = admitted.remove(admitted.len() - 1 - back);
                    let expected = model.refund(&checks, &times).await;
                    let found = store.refund(&checks, &times).await;
                    agree(step, "refund", &checks, expected, found)?;
                }
            }
        }
        Ok(())
    }
}

/// The next step: mostly a check, sometimes a peek, and a refund of one
/// of `admitted` earlier requests when there is one.
fn next_step(random: &mut SplitMix, admitted: usize) -> Step {
    let kind = random.below(100);
    if kind < 8 && admitted > 0 {
        return Step::Refund(random.below(admitted as u64) as usize);
    }
    let client = Key::new(format!("conformance-client{}", random.below(3)));
    let cost = 1 + random.below(3) as u32;
    let tier = (random.below(5) == 0).then_some("other");
    let mut mask = 1 + random.below(255);
    if random.below(2) == 0 {
        // One policy alone, as most requests are.
        mask = 1 << random.below(8);
    }
    let checks = policies()
        .iter()
        .enumerate()
        .filter(|(index, _)| mask & (1 << index) != 0)
        .map(|(_, policy)| {
            Check::for_tier(policy, client.clone(), tier)
                .expect("the trace's policies are valid")
                .with_cost(cost)
        })
        .collect();
    if kind < 16 {
        Step::Peek(checks)
    } else {
        Step::Check(checks)
    }
}

/// The trace's policies, one of each algorithm and mode; a tier named
/// `other` gives each but the calendar and the concurrency limit a window
/// of its own.
fn policies() -> [Policy; 8] {
    let ms = Duration::from_millis;
    let other = |policy: Policy, window: u64| {
        let limits = crate::policy::TierLimits::new().with_window(ms(window));
        policy.with_tier("other", limits)
    };
    [
        other(
            Policy::new("short", 4, ms(1_500)).with_delay(ms(800)),
            2_500,
        ),
        other(Policy::new("long", 9, ms(10_000)), 4_000),
        other(
            Policy::new("counter", 7, ms(2_000))
                .with_algorithm(Algorithm::SlidingCounter)
                .with_delay(ms(2_500)),
            3_000,
        ),
        other(
            Policy::new("fixed", 5, ms(1_200))
                .with_algorithm(Algorithm::FixedWindow)
                .with_delay(ms(1_000)),
            1_800,
        ),
        other(
            Policy::new("bucket", 3, ms(1_000))
                .with_algorithm(Algorithm::TokenBucket)
                .with_burst(5)
                .with_delay(ms(600)),
            1_700,
        ),
        other(
            Policy::new("blocking", 4, ms(900))
                .with_block(ms(700))
                .with_delay(ms(200)),
            1_300,
        ),
        Policy::calendar(
            "calendar",
            6,
            Calendar::new(Period::Day).with_east_of_utc(Duration::from_secs(106 * 60)),
        ),
        Policy::concurrency("in-flight", 2),
    ]
}

/// Keeps an admitted request's checks and recorded times, for a refund.
fn remember(
    admitted: &mut Vec<(Vec<Check>, Vec<Duration>)>,
    checks: &[Check],
    decisions: &Decisions,
) {
    let times: Option<Vec<Duration>> = decisions.iter().map(|d| d.recorded_at()).collect();
    if let Some(times) = times.filter(|_| decisions.iter().all(|d| d.admitted())) {
        admitted.push((checks.to_vec(), times));
    }
}

/// Whether the two answers to step `step` (`what` on `checks`) agree:
/// both the same value, or both an error of the same message. Written out
/// only when they do not.
fn agree<T: PartialEq + fmt::Debug>(
    step: usize,
    what: &str,
    checks: &[Check],
    expected: Result<T, StoreError>,
    found: Result<T, StoreError>,
) -> Result<(), Mismatch> {
    let same = match (&expected, &found) {
        (Ok(expected), Ok(found)) => expected == found,
        (Err(expected), Err(found)) => expected.to_string() == found.to_string(),
        _ => false,
    };
    if same {
        return Ok(());
    }
    let names: Vec<String> = checks
        .iter()
        .map(|check| {
            format!(
                "{} for {} at cost {}",
                check.policy(),
                check.key(),
                check.cost()
            )
        })
        .collect();
    Err(Mismatch {
        step,
        request: format!("{what} {}", names.join(", ")),
        expected: answer(expected),
        found: answer(found),
    })
}

fn answer<T: fmt::Debug>(outcome: Result<T, StoreError>) -> String {
    match outcome {
        Ok(value) => format!("{value:?}"),
        Err(error) => format!("an error: {error}"),
    }
}

/// SplitMix64: a small, seedable generator, so that a trace is the same
/// on every machine and in every version.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number below `bound` (> 0).
    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }
}
