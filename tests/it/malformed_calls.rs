//! Calls of the Redis library with malformed arguments, as a client other
//! than this crate's (or a bug) might send them: each fails with an error
//! that names what is wrong, and a refund, settlement or reset of several
//! policies checks them all before it writes anything, so a malformed
//! policy leaves every other one as it was.

use std::time::Duration;

use crate::support::RedisServer;
use crate::support::stores::START;
use slidegate::{
    Policy,
    clock::{Clock, FakeClock},
    key::Key,
    policy::Algorithm,
    store::{Check, RedisStore, Store},
};

const HOUR_MICROS: &str = "3600000000";

/// Two policies on one client, each with 10 units counted, the raw
/// library call's parts, and the store and clock they were counted with.
struct Counted {
    server: RedisServer,
    clock: FakeClock,
    store: RedisStore,
    checks: [Check; 2],
    /// The library's check function.
    function: String,
    /// The fixed window's key and the counter's.
    keys: [String; 2],
    /// When the 10 units were recorded, in µs.
    recorded: String,
}

impl Counted {
    async fn new() -> Self {
        let server = RedisServer::start();
        let clock = FakeClock::new(START);
        let store = RedisStore::builder(server.pool(2))
            .with_clock(clock.clone())
            .with_timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let policy = |name: &str, algorithm| {
            Policy::new(name, 100, Duration::from_secs(3600)).with_algorithm(algorithm)
        };
        let checks = [
            policy("fixed", Algorithm::FixedWindow),
            policy("counter", Algorithm::SlidingCounter),
        ]
        .map(|policy| {
            Check::new(&policy, Key::new("client"))
                .unwrap()
                .with_cost(10)
        });
        let decisions = store.check(&checks).await.unwrap();
        assert!(decisions.iter().all(|decision| decision.admitted()));
        let recorded = decisions[0].recorded_at().unwrap().as_micros().to_string();
        let functions = server.cli(&["FUNCTION", "LIST"]);
        let function = functions
            .split_whitespace()
            .find(|word| word.starts_with("slidegate_check_"))
            .unwrap_or_else(|| panic!("no check function in {functions}"))
            .to_owned();
        let keys = [
            format!("{}:f", store.base_key(&checks[0])),
            format!("{}:c", store.base_key(&checks[1])),
        ];
        Self {
            server,
            clock,
            store,
            checks,
            function,
            keys,
            recorded,
        }
    }

    /// The time argument of a raw call: the store's clock, in µs.
    fn now(&self) -> String {
        self.clock.now_micros().to_string()
    }

    /// Runs the raw call with `keys`, then `args`; Redis's answer.
    fn raw_on(&self, keys: &[&str], args: &[&str]) -> String {
        let count = keys.len().to_string();
        let mut command = vec!["FCALL", self.function.as_str(), count.as_str()];
        command.extend_from_slice(keys);
        command.extend_from_slice(args);
        self.server.cli(&command)
    }

    /// [`raw_on`](Self::raw_on) the fixed window's key, then the counter's.
    fn raw(&self, args: &[&str]) -> String {
        let [fixed, counter] = &self.keys;
        self.raw_on(&[fixed, counter], args)
    }

    /// [`raw`](Self::raw) for a settlement, whose keys name each
    /// policy's settlement marks after its own.
    fn raw_settlement(&self, args: &[&str]) -> String {
        let marks = |key: &str| format!("{}:s", &key[..key.len() - 2]);
        let [fixed, counter] = &self.keys;
        let (fixed_marks, counter_marks) = (marks(fixed), marks(counter));
        self.raw_on(&[fixed, &fixed_marks, counter, &counter_marks], args)
    }

    /// Each policy's remaining units, as a peek finds them.
    async fn remaining(&self) -> [u32; 2] {
        let decisions = self.store.peek(&self.checks).await.unwrap();
        [decisions[0].remaining(), decisions[1].remaining()]
    }
}

/// One policy's arguments as the library takes them, with cost 10.
fn policy_args(algorithm: &str) -> [&str; 8] {
    [algorithm, "100", HOUR_MICROS, "100", "0", "0", "0", "10"]
}

/// The ways the second policy of a call may be malformed: which argument
/// (its index among the policy's) and the bad value.
const MALFORMED: [(usize, &str); 8] = [
    (0, "nope"),
    (1, "x"),
    (2, "0"),
    (2, "-3600000000"),
    (3, "1.5"),
    (5, "inf"),
    (6, "nan"),
    (7, "-5"),
];

#[tokio::test]
async fn a_malformed_policy_fails_a_refund_or_settlement_before_any_policy_is_written() {
    let counted = Counted::new().await;
    let now = counted.now();
    for op in ["refund", "settle"] {
        let refunded = |second: [&str; 8], extra: &[&str]| {
            let mut args = vec![now.as_str(), op];
            args.extend_from_slice(&policy_args("fixed"));
            args.push(&counted.recorded);
            if op == "settle" {
                args.extend_from_slice(&["1", "7"]);
            }
            args.extend_from_slice(&second);
            args.extend_from_slice(extra);
            if op == "settle" {
                counted.raw_settlement(&args)
            } else {
                counted.raw(&args)
            }
        };
        let extra: &[&str] = if op == "settle" {
            &[&counted.recorded, "1", "8"]
        } else {
            &[&counted.recorded]
        };
        for (index, bad) in MALFORMED {
            let mut second = policy_args("counter");
            second[index] = bad;
            let answer = refunded(second, extra);
            assert!(answer.contains("ERR"), "{op}, {bad} at {index}: {answer}");
            assert_eq!(
                counted.remaining().await,
                [90, 90],
                "{op}, {bad} at {index}"
            );
        }
        // A malformed recorded time or final cost.
        let bad_extra: &[&[&str]] = if op == "settle" {
            &[
                &["soon", "1", "8"],
                &[&counted.recorded, "-1", "8"],
                &[&counted.recorded, "1", "-8"],
                &[&counted.recorded, "1", "8.5"],
                &[&counted.recorded, "1"],
            ]
        } else {
            &[&["soon"], &[]]
        };
        for extra in bad_extra {
            let answer = refunded(policy_args("counter"), extra);
            assert!(answer.contains("ERR"), "{op}, {extra:?}: {answer}");
            assert_eq!(counted.remaining().await, [90, 90], "{op}, {extra:?}");
        }
    }
    // A settlement well formed replaces both policies' units, once
    // however often it is sent.
    let mut args = vec![now.as_str(), "settle"];
    args.extend_from_slice(&policy_args("fixed"));
    args.extend_from_slice(&[&counted.recorded, "4", "7"]);
    args.extend_from_slice(&policy_args("counter"));
    args.extend_from_slice(&[&counted.recorded, "4", "8"]);
    for _ in 0..2 {
        let answer = counted.raw_settlement(&args);
        assert!(!answer.contains("ERR"), "{answer}");
        assert_eq!(counted.remaining().await, [96, 96]);
    }
    // The same call well formed gives both policies' units back.
    let mut args = vec![now.as_str(), "refund"];
    args.extend_from_slice(&policy_args("fixed"));
    args.push(&counted.recorded);
    args.extend_from_slice(&policy_args("counter"));
    args.push(&counted.recorded);
    let answer = counted.raw(&args);
    assert!(!answer.contains("ERR"), "{answer}");
    assert_eq!(counted.remaining().await, [100, 100]);
}

#[tokio::test]
async fn a_malformed_policy_fails_a_reset_before_any_key_is_deleted() {
    let counted = Counted::new().await;
    let now = counted.now();
    for (index, bad) in MALFORMED.into_iter().take(7) {
        let mut second = policy_args("counter");
        second[index] = bad;
        let mut args = vec![now.as_str(), "reset"];
        args.extend_from_slice(&policy_args("fixed"));
        args.extend_from_slice(&second);
        let answer = counted.raw(&args);
        assert!(answer.contains("ERR"), "{bad} at {index}: {answer}");
        assert_eq!(counted.remaining().await, [90, 90], "{bad} at {index}");
    }
    // One key fewer than the policies name.
    let mut args = vec![now.as_str(), "reset"];
    args.extend_from_slice(&policy_args("fixed"));
    args.extend_from_slice(&policy_args("counter"));
    let answer = counted.raw_on(&[&counted.keys[0]], &args);
    assert!(answer.contains("keys"), "{answer}");
    assert_eq!(counted.remaining().await, [90, 90]);

    let mut args = vec![now.as_str(), "reset"];
    args.extend_from_slice(&policy_args("fixed"));
    args.extend_from_slice(&policy_args("counter"));
    let answer = counted.raw(&args);
    assert!(!answer.contains("ERR"), "{answer}");
    assert_eq!(counted.remaining().await, [100, 100]);
}

/// A check refuses a negative cost (which would take units off the
/// count), a window of 0 and any other malformed number, and counts
/// nothing under any policy.
#[tokio::test]
async fn a_check_with_a_malformed_policy_counts_nothing() {
    let counted = Counted::new().await;
    let now = counted.now();
    for (index, bad) in MALFORMED {
        for first in [true, false] {
            let mut malformed = policy_args(if first { "fixed" } else { "counter" });
            malformed[index] = bad;
            let well_formed = policy_args(if first { "counter" } else { "fixed" });
            let (a, b) = if first {
                (malformed, well_formed)
            } else {
                (well_formed, malformed)
            };
            let mut args = vec![now.as_str()];
            args.extend_from_slice(&a);
            args.extend_from_slice(&b);
            // The keys in the order of the policies.
            let answer = if first {
                counted.raw(&args)
            } else {
                let [fixed, counter] = &counted.keys;
                counted.raw_on(&[counter, fixed], &args)
            };
            assert!(answer.contains("ERR"), "{bad} at {index}: {answer}");
            assert_eq!(counted.remaining().await, [90, 90], "{bad} at {index}");
        }
    }
}
