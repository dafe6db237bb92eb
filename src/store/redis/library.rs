//! The check library (`lua/`) as a Redis function library, and the errors that say
//! it is missing or refused.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use deadpool_redis::redis::{ErrorKind, RedisError, Script, ServerErrorKind, Value};

use super::script;

/// The check library as a Redis function library. Its functions are defined
/// once, when the library loads, instead of on every `EVALSHA`: in
/// `benches/redis_cpu.rs`, a quarter to two fifths less Redis CPU per
/// decision.
///
/// Library and function are named after the script's SHA-1, so that two
/// versions of the crate, side by side in a rolling deploy, each call
/// their own.
pub(super) struct Library {
    pub(super) source: String,
    pub(super) function: String,
    /// The function deciding several requests at once.
    pub(super) batch_function: String,
    /// `function` for clients already tracked, allowed to run when Redis
    /// is out of memory (`allow-oom`); see `NOT_HELD` in `lua/driver.lua`.
    pub(super) held_function: String,
    /// `batch_function`'s twin of `held_function`.
    pub(super) held_batch_function: String,
    /// Set once Redis has refused functions (an ACL without `FUNCTION`
    /// or `FCALL`, a renamed command): every call is an `EVALSHA` then.
    refused: AtomicBool,
    /// Loads of the library under way (see [`LOAD_TIMEOUT`]).
    loads: AtomicUsize,
}

/// How long a call that finds the library missing (a fresh or restarted
/// Redis, a new node, `FUNCTION FLUSH`) waits for it to load and for its
/// own answer, when the store's timeout is shorter: Redis compiles the
/// library once per server, and the checks that meet it (the call that
/// loads it, and those queued meanwhile) wait for it rather than fail as
/// though Redis were down, where a policy that fails open would admit
/// them uncounted.
pub(super) const LOAD_TIMEOUT: Duration = Duration::from_secs(2);

/// A load of the library under way, counted while it lives.
pub(super) struct Loading<'a>(&'a AtomicUsize);

impl Drop for Loading<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Library {
    pub(super) fn new(script: &Script) -> Self {
        let hash = script.get_hash();
        let body = script::source()
            .strip_prefix("#!lua\n")
            .and_then(|body| body.strip_suffix("return main(KEYS, ARGV)\n"))
            .expect("the library opens with `#!lua` and ends by returning main(KEYS, ARGV)");
        let function = format!("slidegate_check_{hash}");
        let batch_function = format!("slidegate_batch_{hash}");
        let held_function = format!("slidegate_held_{hash}");
        let held_batch_function = format!("slidegate_held_batch_{hash}");
        let allow_oom = "flags = { 'allow-oom' }";
        Self {
            source: format!(
                "#!lua name=slidegate_{hash}\n{body}\n\
                 redis.register_function('{function}', main)\n\
                 redis.register_function('{batch_function}', check_batch)\n\
                 redis.register_function{{ function_name = '{held_function}', callback = held_main, {allow_oom} }}\n\
                 redis.register_function{{ function_name = '{held_batch_function}', callback = held_batch, {allow_oom} }}\n"
            ),
            function,
            batch_function,
            held_function,
            held_batch_function,
            refused: AtomicBool::new(false),
            loads: AtomicUsize::new(0),
        }
    }

    /// Counts a load of the library (and the call sent again after it)
    /// as under way until the guard drops.
    pub(super) fn loading(&self) -> Loading<'_> {
        self.loads.fetch_add(1, Ordering::Relaxed);
        Loading(&self.loads)
    }

    /// Whether a load of the library is under way: checks queued
    /// meanwhile wait for it (see [`LOAD_TIMEOUT`]).
    pub(super) fn is_loading(&self) -> bool {
        self.loads.load(Ordering::Relaxed) > 0
    }

    /// The deadline of a call from when it finds the library missing: at
    /// least [`LOAD_TIMEOUT`] from now.
    pub(super) fn load_deadline(deadline: tokio::time::Instant) -> tokio::time::Instant {
        deadline.max(tokio::time::Instant::now() + LOAD_TIMEOUT)
    }

    pub(super) fn refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// Notes that Redis refused functions, once.
    pub(super) fn refuse(&self) {
        if !self.refused.swap(true, Ordering::Relaxed) {
            tracing::warn!("Redis refuses functions; rate-limit checks run by EVALSHA from now on");
        }
    }

    /// Whether `error` says this Redis does not let us use functions.
    pub(super) fn refuses(error: &RedisError) -> bool {
        matches!(error.kind(), ErrorKind::Server(ServerErrorKind::NoPerm))
            || error
                .detail()
                .is_some_and(|detail| detail.starts_with("unknown command"))
    }

    /// Whether `error` is Redis refusing a call that writes because it is
    /// out of memory (`maxmemory` with nothing left to evict).
    pub(super) fn out_of_memory(error: &RedisError) -> bool {
        error.code() == Some("OOM")
    }

    /// Whether a batch call left this request undecided, having done its
    /// share of work (`DEFERRED` in `lua/driver.lua`): it is sent again.
    pub(super) fn deferred(reply: &Value) -> bool {
        matches!(reply, Value::ServerError(error) if error.code() == "DEFERRED")
    }

    /// Whether a batch call's reply for one request is an error of the
    /// script's own running (a key of another type, say), which a batch
    /// call catches and so cannot place, rather than one it answers on
    /// purpose (`DEFERRED`, or out of memory).
    pub(super) fn failed_in_batch(reply: &Value) -> bool {
        matches!(reply, Value::ServerError(error) if !matches!(error.code(), "DEFERRED" | "OOM"))
    }

    /// Whether `error` says the library is not loaded where the call ran
    /// (a restarted server, a new node, `FUNCTION FLUSH`).
    pub(super) fn missing(error: &RedisError) -> bool {
        error.detail() == Some("Function not found")
    }
}
