//! What one client has spent under one policy, in the state of its
//! algorithm, and how a decision is prepared, recorded and reported
//! over it.

use super::bucket::TokenBucket;
use super::calendar::CalendarCount;
use super::counter::SlidingCounter;
use super::fixed::FixedWindow;
use super::lease::Leases;
use super::log::{Log, Window};
use std::time::Duration;

use crate::clock::duration_micros;
use crate::policy::Algorithm;
use crate::store::micros;
use crate::store::{Check, Decision};

/// What one client has spent under one policy, per algorithm.
#[derive(Debug)]
pub(super) enum State {
    Log(Log),
    Counter(SlidingCounter),
    Fixed(FixedWindow),
    Bucket(TokenBucket),
    Leases(Leases),
    Calendar(CalendarCount),
}

impl State {
    pub(super) fn new(algorithm: Algorithm) -> Self {
        match algorithm {
            Algorithm::SlidingLog => Self::Log(Log::default()),
            Algorithm::SlidingCounter => Self::Counter(SlidingCounter::default()),
            Algorithm::FixedWindow => Self::Fixed(FixedWindow::default()),
            Algorithm::TokenBucket => Self::Bucket(TokenBucket::default()),
            Algorithm::Concurrency => Self::Leases(Leases::default()),
            Algorithm::Calendar(_) => Self::Calendar(CalendarCount::default()),
        }
    }

    pub(super) fn is_of(&self, algorithm: Algorithm) -> bool {
        matches!(
            (self, algorithm),
            (Self::Log(_), Algorithm::SlidingLog)
                | (Self::Counter(_), Algorithm::SlidingCounter)
                | (Self::Fixed(_), Algorithm::FixedWindow)
                | (Self::Bucket(_), Algorithm::TokenBucket)
                | (Self::Leases(_), Algorithm::Concurrency)
                | (Self::Calendar(_), Algorithm::Calendar(_))
        )
    }

    /// Brings the counts up to `now` for `check` and says whether its cost
    /// fits; see [`Spent::prepare`].
    pub(super) fn prepare(&mut self, now: u64, check: &Check) -> (bool, Placed) {
        let window = check.window_micros();
        let held_elsewhere = match self {
            Self::Counter(counter) => counter.held_elsewhere(now, window / 1000),
            Self::Fixed(fixed) => fixed.held_elsewhere(now, window),
            Self::Bucket(bucket) => bucket.held_elsewhere(now, check),
            Self::Log(_) | Self::Leases(_) | Self::Calendar(_) => None,
        };
        if let Some(until) = held_elsewhere {
            return (false, Placed::HeldElsewhere(until));
        }
        match self {
            Self::Log(log) => {
                let window = log.prepare(now, window, check.span_micros());
                (window.fits(check.limit(), check.cost), Placed::Log(window))
            }
            Self::Counter(counter) => {
                let before = *counter;
                let moved = counter.roll(now, window / 1000);
                let placed = if moved {
                    Placed::Kept
                } else {
                    Placed::Counter(before)
                };
                (counter.fits(check.limit(), check.cost), placed)
            }
            Self::Fixed(fixed) => {
                let before = *fixed;
                let moved = fixed.roll(now, window);
                let placed = if moved {
                    Placed::Kept
                } else {
                    Placed::Fixed(before)
                };
                (fixed.fits(check.limit(), check.cost), placed)
            }
            Self::Bucket(bucket) => {
                let before = *bucket;
                let moved = bucket.place(now, check);
                let placed = if moved {
                    Placed::Kept
                } else {
                    Placed::Bucket(before)
                };
                (bucket.fits(check), placed)
            }
            Self::Leases(leases) => {
                leases.prepare(now, check);
                (leases.fits(check), Placed::Kept)
            }
            Self::Calendar(quota) => {
                let before = *quota;
                let moved = match check.algorithm() {
                    Algorithm::Calendar(calendar) => quota.place(now, calendar),
                    _ => false,
                };
                // The Redis script writes a count only when it changes.
                let placed = if moved {
                    Placed::Kept
                } else {
                    Placed::Calendar(before)
                };
                (quota.fits(check.limit(), check.cost), placed)
            }
        }
    }

    pub(super) fn unroll(&mut self, placed: Placed) {
        match (self, placed) {
            (Self::Counter(counter), Placed::Counter(before)) => *counter = before,
            (Self::Fixed(fixed), Placed::Fixed(before)) => *fixed = before,
            (Self::Bucket(bucket), Placed::Bucket(before)) => *bucket = before,
            (Self::Calendar(quota), Placed::Calendar(before)) => *quota = before,
            _ => {}
        }
    }

    /// Whether the request fits at `pass`, later than now, after
    /// [`prepare`](Self::prepare) (see [`Spent::held_until`]).
    pub(super) fn fits_at(&self, check: &Check, pass: u64) -> bool {
        let (limit, cost) = (check.limit(), check.cost);
        match self {
            // The window only loses units as time passes.
            Self::Log(_) => cost <= limit,
            Self::Counter(counter) => counter.fits_at(limit, cost, pass),
            Self::Fixed(fixed) => fixed.fits_at(limit, cost, pass),
            Self::Bucket(bucket) => bucket.fits_at(check, pass),
            // Never held: its lease would be taken now, and its time would
            // run while the request waits; a calendar quota takes no delay.
            Self::Leases(_) | Self::Calendar(_) => false,
        }
    }

    /// Records `cost` units of `check` (its own cost, or a settlement's),
    /// passing at `pass` (now, or later for a held request); a lease is
    /// taken at `now`.
    pub(super) fn record(
        &mut self,
        (now, pass): (u64, u64),
        check: &Check,
        cost: u32,
        placed: &mut Placed,
    ) -> Option<u64> {
        match self {
            Self::Log(log) => match placed {
                Placed::Log(window) => log.record(pass, cost, window),
                _ => unreachable!("a log is prepared with its window"),
            },
            Self::Counter(counter) => Some(counter.record(cost, pass)),
            Self::Fixed(fixed) => Some(fixed.record(cost, pass)),
            Self::Bucket(bucket) => Some(bucket.record(cost, pass, pass > now)),
            Self::Leases(leases) => Some(leases.record(now, check.id)),
            Self::Calendar(quota) => Some(quota.record(cost, now)),
        }
    }

    pub(super) fn refund(&mut self, now: u64, at: u64, check: &Check) -> Refunded {
        let cost = check.cost;
        let changed = match self {
            Self::Log(log) => {
                let found = log.refund(at, cost);
                return Refunded {
                    changed: true,
                    named: found || in_window(now, at, check),
                };
            }
            Self::Counter(counter) => counter.refund(at, cost),
            Self::Fixed(fixed) => fixed.refund(at, cost),
            Self::Bucket(bucket) => bucket.refund(at, cost),
            Self::Leases(leases) => {
                leases.release(check.id);
                true
            }
            Self::Calendar(quota) => match check.algorithm() {
                Algorithm::Calendar(calendar) => quota.refund(at, cost, calendar),
                _ => false,
            },
        };
        Refunded {
            changed,
            named: true,
        }
    }

    /// Counts `units` more at `now`, past the limit if need be, after
    /// [`prepare`](Self::prepare): what a request settled after its
    /// response cost (see [`Store::settle`](crate::store::Store::settle)). As in the Redis script, a
    /// log, a fixed window and a calendar count at most the burst (a
    /// record of the whole limit already denies every request until it
    /// leaves); a sliding counter and a bucket as their arithmetic allows.
    /// Returns whether it counted any.
    pub(super) fn charge(
        &mut self,
        now: u64,
        check: &Check,
        units: u64,
        placed: &mut Placed,
    ) -> bool {
        let units = match self {
            Self::Leases(_) => return false,
            Self::Bucket(bucket) => bucket.chargeable(units),
            Self::Counter(counter) => counter.chargeable(units, check.limit()),
            _ => u32::try_from(units.min(u64::from(check.burst))).unwrap_or(u32::MAX),
        };
        if units == 0 {
            return false;
        }
        self.record((now, now), check, units, placed).is_some()
    }

    pub(super) fn decision(
        &self,
        now: u64,
        check: &Check,
        admitted: bool,
        placed: &Placed,
    ) -> Decision {
        let (limit, cost) = (check.limit(), check.cost);
        match (self, placed) {
            (_, &Placed::HeldElsewhere(until)) => {
                let wait = Duration::from_micros(until.saturating_sub(now));
                Decision::new_denied(check.burst, 0, wait, Some(wait))
            }
            (Self::Log(log), Placed::Log(window)) => {
                log.decision(now, limit, cost, admitted, window)
            }
            (Self::Log(_), _) => unreachable!("a log is prepared with its window"),
            (Self::Counter(counter), _) => counter.decision(now, limit, cost, admitted),
            (Self::Fixed(fixed), _) => fixed.decision(now, limit, cost, admitted),
            (Self::Bucket(bucket), _) => bucket.decision(now, check, admitted),
            (Self::Leases(leases), _) => leases.decision(check, admitted),
            (Self::Calendar(quota), _) => quota.decision(now, limit, cost, admitted),
        }
    }

    pub(super) fn is_idle(&self, now: u64) -> bool {
        match self {
            Self::Log(log) => log.is_idle(now),
            Self::Counter(counter) => counter.is_idle(now),
            Self::Fixed(fixed) => fixed.is_idle(now),
            Self::Bucket(bucket) => bucket.is_idle(now),
            Self::Leases(leases) => leases.is_idle(now),
            Self::Calendar(quota) => quota.is_idle(now),
        }
    }
}

/// What one client has spent under one policy, and until when a denial
/// blocks it.
#[derive(Debug)]
pub(super) struct Spent {
    pub(super) state: State,
    /// The end of the client's block (µs); 0 when never blocked.
    blocked_until: u64,
    /// When the state was made (µs), as the Redis script keeps it in a
    /// counter's or fixed window's key (`b`): a refund that
    /// names an earlier time names units of a state since forgotten (a
    /// reset), and takes nothing from this one.
    born: u64,
}

impl Spent {
    /// A new state for `check`'s pair, brought up to `now`.
    pub(super) fn fresh(now: u64, check: &Check) -> (Self, Prepared) {
        let mut spent = Self {
            state: State::new(check.algorithm()),
            blocked_until: 0,
            born: now,
        };
        let (_, prepared) = spent.prepare(now, check);
        (spent, prepared)
    }

    /// Brings the state up to `now` for `check` (starting afresh if the
    /// policy changed algorithm) and says whether the request may be
    /// admitted: its cost fits, and the client is not blocked. A counter
    /// or bucket is only placed at `now` for this decision: what
    /// [`unroll`](Self::unroll) is given puts it back unless it had to
    /// move (as the Redis script writes it only then).
    pub(super) fn prepare(&mut self, now: u64, check: &Check) -> (bool, Prepared) {
        if !self.state.is_of(check.algorithm()) {
            // On Redis each algorithm has a key of its own, made now.
            self.state = State::new(check.algorithm());
            self.born = now;
        }
        let (fits, placed) = self.state.prepare(now, check);
        let blocked = self.is_blocked(now, check);
        (fits && !blocked, Prepared { placed, fits })
    }

    /// Puts a counter back as it was before [`prepare`](Self::prepare),
    /// for a decision that counted nothing.
    pub(super) fn unroll(&mut self, prepared: Prepared) {
        self.state.unroll(prepared.placed);
    }

    /// Records `cost`, for a request that passes at `pass` (`now`, or
    /// later for a held one), and returns the time it was recorded at
    /// (none for a log given a cost of 0).
    pub(super) fn record(
        &mut self,
        now: u64,
        pass: u64,
        check: &Check,
        prepared: &mut Prepared,
    ) -> Option<u64> {
        self.state
            .record((now, pass), check, check.cost, &mut prepared.placed)
    }

    /// When a request that does not fit now would fit within the delay of
    /// `check`'s policy, and no block holds it: the time its policy fits
    /// it, after [`prepare`](Self::prepare). `None` when it must be denied.
    pub(super) fn held_until(&self, now: u64, check: &Check, prepared: &Prepared) -> Option<u64> {
        if prepared.fits {
            return (!self.is_blocked(now, check)).then_some(now);
        }
        if check.delay_micros() == 0 || self.is_blocked(now, check) {
            return None;
        }
        let retry = self
            .state
            .decision(now, check, false, &prepared.placed)
            .retry_after()
            .map_or(0, duration_micros);
        (retry <= check.delay_micros()).then_some(now + retry)
    }

    /// Whether the request fits at `pass` (see [`held_until`](Self::held_until)).
    pub(super) fn fits_at(&self, check: &Check, pass: u64, prepared: &Prepared) -> bool {
        !matches!(prepared.placed, Placed::HeldElsewhere(_)) && self.state.fits_at(check, pass)
    }

    /// Takes back `cost` units recorded at `at`, after
    /// [`prepare`](Self::prepare); says whether a counter changed.
    pub(super) fn refund(&mut self, now: u64, at: u64, check: &Check) -> Refunded {
        let aggregate = matches!(self.state, State::Counter(_) | State::Fixed(_));
        if aggregate && at < self.born {
            return Refunded {
                changed: false,
                named: true,
            };
        }
        self.state.refund(now, at, check)
    }

    /// The decision of a request recorded at `at`, passing at `pass`.
    pub(super) fn recorded(
        &self,
        now: u64,
        pass: u64,
        check: &Check,
        at: Option<u64>,
        prepared: &Prepared,
    ) -> Decision {
        let mut decision = self.decision(now, check, true, prepared);
        if pass > now {
            decision = decision.with_delayed_for(Duration::from_micros(pass - now));
        }
        match at {
            Some(at) => decision.with_recorded_at(Duration::from_micros(at)),
            None => decision,
        }
    }

    /// The decision of a denied request, which records nothing; a policy
    /// that blocks, denied by its own count, blocks the client from now.
    pub(super) fn denied(&mut self, now: u64, check: &Check, prepared: Prepared) -> Decision {
        let mut decision = self.decision(now, check, false, &prepared);
        // A denial the delay can hold is no denial for the block.
        let beyond_delay = check.delay_micros() == 0
            || decision
                .retry_after()
                .is_some_and(|retry| duration_micros(retry) > check.delay_micros());
        if check.block_micros() > 0 && !prepared.fits && self.blocked_until <= now && beyond_delay {
            self.blocked_until = now + check.block_micros();
            decision = self.decision(now, check, false, &prepared);
        }
        self.unroll(prepared);
        decision
    }

    pub(super) fn decision(
        &self,
        now: u64,
        check: &Check,
        admitted: bool,
        prepared: &Prepared,
    ) -> Decision {
        let mut decision = self.state.decision(now, check, admitted, &prepared.placed);
        if self.is_blocked(now, check) {
            let left = Duration::from_micros(self.blocked_until - now);
            decision.remaining = 0;
            decision.retry_after_us =
                micros(decision.retry_after().map_or(left, |wait| wait.max(left)));
            decision.blocked_for_us = micros(left);
        }
        decision
    }

    /// Whether the client is blocked under `check` at `now`: a block set
    /// by a policy that no longer blocks (reloaded without `block`) is
    /// lifted, as the Redis script no longer reads its key.
    pub(super) fn is_blocked(&self, now: u64, check: &Check) -> bool {
        check.block_micros() > 0 && self.blocked_until > now
    }

    pub(super) fn is_idle(&self, now: u64) -> bool {
        self.blocked_until <= now && self.state.is_idle(now)
    }
}

/// Whether units recorded at `at` are still in `check`'s window at `now`.
pub(super) fn in_window(now: u64, at: u64, check: &Check) -> bool {
    at.saturating_add(check.window_micros()) > now
}

/// What a refund did: whether it changed the counts, and whether a
/// settlement then counts all its final units: not for a log's reserved
/// units that have left its window, which a late settlement would count
/// again (it counts only those beyond them, as in the Redis script).
#[derive(Debug, Clone, Copy)]
pub(super) struct Refunded {
    pub(super) changed: bool,
    pub(super) named: bool,
}

/// What [`Spent::prepare`] found for one decision: whether the request's
/// cost fits the counts, and what it placed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Prepared {
    pub(super) placed: Placed,
    pub(super) fits: bool,
}

/// A log's window, or a counter's or bucket's state before it was placed
/// at the time of the decision, to put back if the decision counts
/// nothing.
#[derive(Debug, Clone, Copy)]
pub(super) enum Placed {
    Kept,
    /// Counts that hold units of requests held for their delay, counted
    /// now under another window length, which could not keep those units
    /// until their requests pass: left as they are, they decide nothing
    /// and every request is denied until this time (µs), when the last
    /// of those requests has passed. The Redis script does the same.
    HeldElsewhere(u64),
    Log(Window),
    Counter(SlidingCounter),
    Fixed(FixedWindow),
    Bucket(TokenBucket),
    Calendar(CalendarCount),
}
