//! One call of the script: the keys and arguments a check, a peek, a
//! refund or a reset sends, in the script's order.

use deadpool_redis::redis::{RedisWrite, ToRedisArgs};

use super::RedisStore;
use crate::policy::Algorithm;
use crate::store::Check;

/// One script call, prepared from the borrowed checks: the keys and
/// arguments in the script's order.
pub(super) struct Call {
    pub(super) keys: Vec<String>,
    /// Per policy, its arguments and the request's cost (for a lease, its
    /// id: a lease costs 1).
    pub(super) args: Vec<(PolicyArgs, u64)>,
    pub(super) op: Op,
}

/// One policy's arguments: algorithm, limit, window in µs (a calendar's
/// offset from UTC in µs, east), burst, block in µs, delay in µs (which
/// a denial must pass to start a block), and for a sliding log its span
/// in µs (the longest window its policy's tiers count it under; 0
/// otherwise).
pub(super) type PolicyArgs = (&'static str, u32, i64, u32, u64, u64, u64);

/// What a call asks of the script.
pub(super) enum Op {
    Check,
    Peek,
    /// Per policy, the time (µs) its units were recorded at.
    Refund(Vec<u64>),
    /// Per policy, the time (µs) its reservation was recorded at, the
    /// units the request cost in the end, and the reservation's id (0:
    /// none; see `Check::id`).
    Settle(Vec<(u64, u64, u64)>),
    Reset,
    Renew,
}

/// The script's arguments after the time: `peek`, `refund`, `settle`,
/// `reset` or `renew` if the call is one, then each policy's and the cost (with its
/// recorded time, for a refund; and its final cost, for a settlement).
pub(super) struct Arguments<'a>(pub(super) &'a Call);

impl ToRedisArgs for Arguments<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let call = self.0;
        match &call.op {
            Op::Check => {}
            Op::Peek => out.write_arg(b"peek"),
            Op::Refund(_) => out.write_arg(b"refund"),
            Op::Settle(_) => out.write_arg(b"settle"),
            Op::Reset => out.write_arg(b"reset"),
            Op::Renew => out.write_arg(b"renew"),
        }
        for (index, (policy, cost)) in call.args.iter().enumerate() {
            policy.write_redis_args(out);
            cost.write_redis_args(out);
            match &call.op {
                Op::Refund(recorded) => recorded[index].write_redis_args(out),
                Op::Settle(settled) => {
                    let (recorded, cost, id) = settled[index];
                    recorded.write_redis_args(out);
                    cost.write_redis_args(out);
                    id.write_redis_args(out);
                }
                _ => {}
            }
        }
    }
}

impl Call {
    /// The call of `op` for `checks`, keyed as `store` keys them.
    pub(super) fn new(store: &RedisStore, checks: &[Check], op: Op) -> Self {
        let mut call = Self {
            keys: Vec::with_capacity(checks.len() * 2),
            args: Vec::with_capacity(checks.len()),
            op,
        };
        for check in checks {
            let key = |suffix| key_of(&store.inner.prefix, check, suffix);
            let name = match check.algorithm() {
                Algorithm::SlidingLog => {
                    // The header and newest page; the other pages.
                    call.keys.push(key(":l"));
                    call.keys.push(key(":p"));
                    "log"
                }
                Algorithm::SlidingCounter => {
                    call.keys.push(key(":c"));
                    "counter"
                }
                Algorithm::FixedWindow => {
                    call.keys.push(key(":f"));
                    "fixed"
                }
                Algorithm::TokenBucket => {
                    call.keys.push(key(":b"));
                    "bucket"
                }
                Algorithm::Concurrency => {
                    call.keys.push(key(":n"));
                    "lease"
                }
                Algorithm::Calendar(calendar) => {
                    call.keys.push(key(":q"));
                    calendar.period().name()
                }
            };
            let window = match check.algorithm() {
                Algorithm::Calendar(calendar) => {
                    i64::from(calendar.utc_offset_seconds()) * 1_000_000
                }
                // At most 366 days: far below i64::MAX µs.
                _ => i64::try_from(check.window().as_micros()).unwrap_or(i64::MAX),
            };
            let block = check.block_micros();
            if block > 0 {
                call.keys.push(key(":x"));
            }
            if matches!(call.op, Op::Settle(_)) {
                // The reservations settled (see `mark_settled` in
                // `lua/driver.lua`).
                call.keys.push(key(":s"));
            }
            call.args.push((
                (
                    name,
                    check.limit(),
                    window,
                    check.burst,
                    block,
                    check.delay_micros(),
                    match check.algorithm() {
                        Algorithm::SlidingLog => check.span_micros(),
                        _ => 0,
                    },
                ),
                match check.algorithm() {
                    Algorithm::Concurrency => check.id,
                    _ => u64::from(check.cost),
                },
            ));
        }
        call
    }
}

/// The base key of `check` under the store's `prefix`, followed by
/// `suffix`, built in one allocation of its length.
pub(super) fn key_of(prefix: &str, check: &Check, suffix: &str) -> String {
    let namespace = check.namespace.as_deref();
    let (policy, client) = (&**check.policy(), check.key.as_str());
    let length = prefix.len()
        + namespace.map_or(0, |namespace| namespace.len() + 1)
        + policy.len()
        + client.len()
        + suffix.len()
        + 4;
    let mut key = String::with_capacity(length);
    key.push_str(prefix);
    key.push(':');
    if let Some(namespace) = namespace {
        key.push_str(namespace);
        key.push(':');
    }
    key.push_str(policy);
    key.push_str(":{");
    key.push_str(client);
    key.push('}');
    key.push_str(suffix);
    key
}

/// A batch call's arguments after the time: the policies its checks name,
/// each once (a batch's checks mostly share them), then per check its
/// number of policies and, per policy, its place among those named (from
/// 1) and the cost.
pub(super) struct BatchArguments<'a> {
    named: Vec<&'a PolicyArgs>,
    /// Per policy of every check, in order: its place in `named`.
    places: Vec<usize>,
    calls: Vec<&'a Call>,
}

impl<'a> BatchArguments<'a> {
    pub(super) fn new(calls: impl Iterator<Item = &'a Call>) -> Self {
        let mut arguments = Self {
            named: Vec::new(),
            places: Vec::new(),
            calls: calls.collect(),
        };
        for call in &arguments.calls {
            for (policy, _) in &call.args {
                let place = match arguments.named.iter().position(|named| *named == policy) {
                    Some(index) => index + 1,
                    None => {
                        arguments.named.push(policy);
                        arguments.named.len()
                    }
                };
                arguments.places.push(place);
            }
        }
        arguments
    }

    /// How many arguments these are.
    pub(super) fn len(&self) -> usize {
        1 + 7 * self.named.len() + self.calls.len() + 2 * self.places.len()
    }
}

impl ToRedisArgs for BatchArguments<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        self.named.len().write_redis_args(out);
        for policy in &self.named {
            policy.write_redis_args(out);
        }
        let mut places = self.places.iter();
        for call in &self.calls {
            call.args.len().write_redis_args(out);
            for ((_, cost), place) in call.args.iter().zip(&mut places) {
                place.write_redis_args(out);
                cost.write_redis_args(out);
            }
        }
    }
}
