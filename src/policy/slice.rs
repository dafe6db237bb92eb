//! Slices: units of a client's limit an instance takes from the store
//! ahead, and answers the client's requests from in memory.

use super::{Algorithm, Policy, PolicyError};

impl Policy {
    /// Takes `slice` units of a client's limit from a remote store
    /// ([`RedisStore`](crate::store::RedisStore)) at a time, and answers
    /// that client's requests from them in this process, with no store
    /// call, while they last: for a hot key (one tenant at tens of
    /// thousands of requests a second, one global limit), whose decisions
    /// would otherwise all wait on one Redis slot, or on a link across
    /// regions. Config `slice = n`. From 2 to the limit (the burst, for a
    /// token bucket); a tier or a client's own limit below it takes
    /// slices of its limit.
    ///
    /// Concurrent requests of a client that find no units wait for one
    /// store call, not one each (up to a slice's worth of them), and share
    /// its denial or failure; those a short slice (what the store had
    /// left) cannot serve, and any past a slice's worth, ask the store
    /// alone at once, so none waits behind call after call. The call runs apart from the
    /// request that made it: a request dropped meanwhile (its client gone)
    /// leaves the slice to the others, not stranded in the store. A slice
    /// asks for what the store had left at its last answer when that is
    /// less than `slice`; when the store has fewer units than asked, the
    /// slice is what it has left, and a request that finds even that
    /// short is asked for at its own cost, so that its denial and
    /// `Retry-After` are the store's. A slice is spent only under the terms
    /// it was taken under: after a reload, or for a request of another
    /// limit, it is given back and a new one taken. A slice lives a tenth
    /// of the window, at most one second; then, or when the layer is
    /// dropped, the units it did not use are given back
    /// ([`Store::settle`](crate::store::Store::settle): the units used are
    /// counted again at that time). A store that cannot take them back (it
    /// names no times, or takes no settlement) is asked request by request
    /// from then on. A refund of a [`Count`](super::Count) policy goes back
    /// where the units came from: into the slice while it lives (later,
    /// the request stays counted), to the store for a request it decided
    /// alone. A [reset](crate::RateLimitLayer::reset) drops the slice of
    /// the instance that resets; other instances spend theirs.
    ///
    /// # The bound
    ///
    /// With `I` instances sharing the store, a slice of `n` and a limit
    /// (burst) of `L`:
    ///
    /// * **over**: any window admits at most `L + I × (n − 1)` units
    ///   (sliding log, fixed window; the sliding counter's estimate
    ///   likewise), and a token bucket over any time `t` at most
    ///   `burst + rate × t + I × (n − 1)`. Each instance holds one slice
    ///   of a client at a time, and only its units unused when a window
    ///   starts can pass uncounted by it.
    /// * **under**: at any moment at most `I × n` units sit unused in
    ///   slices, and at most `I × n` more are counted late (a give-back
    ///   counts the units used at its own time), so a client that keeps
    ///   every instance asking loses at most `2 × I × n` units of a
    ///   window's `L`: over `k` whole windows it is admitted at least
    ///   `k × (L − 2 × I × n)`. Units sit unused in a slice at most its
    ///   lifetime. A slice's call that fails after the store recorded it
    ///   (a timeout) leaves its `n` units counted until they leave the
    ///   window: fewer admitted, never more.
    ///
    /// `I` counts layers: each [`RateLimitLayer::new`](crate::RateLimitLayer::new)
    /// holds its own slices (clones of a layer share them). In the window
    /// of a [reset](crate::RateLimitLayer::reset), each other layer may
    /// admit what its slice held: up to `n` per other layer beyond the
    /// bound. Its give-back takes nothing from the fresh count (the count
    /// is born after the slice was taken, and a give-back names a time
    /// before it).
    ///
    /// A policy without a slice stays exact. The rate-limit headers say
    /// what the instance knows: `X-RateLimit-Remaining` is what the store
    /// had left when the slice was taken, plus what is left of the slice.
    /// On the memory store (one process) a slice changes nothing.
    ///
    /// A slice does not combine with a [concurrency
    /// limit](Self::concurrency), a [delay](Self::with_delay), a
    /// [block](Self::with_block), a [calendar](Self::calendar) or a cost
    /// [settled after the response](Self::with_settlement):
    /// [`PolicyError::SliceWith`].
    ///
    /// ```
    /// use slidegate::{Policies, Policy, policy::PolicyError};
    /// use std::time::Duration;
    ///
    /// let tenant = Policy::new("tenant", 50_000, Duration::from_secs(1)).with_slice(100);
    /// assert_eq!(tenant.slice(), Some(100));
    /// assert!(Policies::single(tenant).is_ok());
    ///
    /// let held = Policy::new("held", 100, Duration::from_secs(1))
    ///     .with_delay(Duration::from_millis(500))
    ///     .with_slice(10);
    /// assert!(matches!(Policies::single(held), Err(PolicyError::SliceWith { other: "delay", .. })));
    /// ```
    #[must_use]
    pub fn with_slice(mut self, slice: u32) -> Self {
        self.slice = Some(slice);
        self
    }

    /// The units an instance takes at a time ([`with_slice`](Self::with_slice)), if set.
    pub fn slice(&self) -> Option<u32> {
        self.slice
    }

    /// Refuses a slice out of its range, or beside what it cannot serve.
    pub(super) fn validate_slice(&self) -> Result<(), PolicyError> {
        let Some(slice) = self.slice else {
            return Ok(());
        };
        let other = match self.algorithm {
            Algorithm::Concurrency => Some("concurrency"),
            Algorithm::Calendar(_) => Some("calendar"),
            _ if self.delay.is_some() => Some("delay"),
            _ if self.block.is_some() => Some("block"),
            _ if self.settlement.is_some() => Some("settled"),
            _ => None,
        };
        let name = self.name.to_string();
        if let Some(other) = other {
            return Err(PolicyError::SliceWith { name, other });
        }
        let limit = self.limits_for(None).burst;
        if slice < 2 || slice > limit {
            return Err(PolicyError::InvalidSlice { name, slice, limit });
        }
        Ok(())
    }
}
