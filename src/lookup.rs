//! [`Lookup`]: what the layer asks a database or a service while a request
//! waits. One trait serves every question:
//!
//! | question | answer | set with |
//! |---|---|---|
//! | `(&Parts, &Identity)`: a client's tier | `Option<Arc<str>>` | [`RateLimitLayer::with_tier_lookup`] |
//! | `&[u8]`: an API key outside the table | [`ApiKeyStatus`] | [`Header::with_lookup`] |
//! | `(&Key, &Policy)`: a client's own limit | `Option<u32>` | [`RateLimitLayer::with_limit_lookup`] |
//!
//! Any function of the question that returns a future of the answer is a
//! lookup, so a closure will do; so does a type of yours (such as
//! [`Overrides`]). The layer waits for each at most its
//! [lookup timeout](crate::RateLimitLayer::with_lookup_timeout).
//!
//! [`RateLimitLayer::with_tier_lookup`]: crate::RateLimitLayer::with_tier_lookup
//! [`RateLimitLayer::with_limit_lookup`]: crate::RateLimitLayer::with_limit_lookup
//! [`Header::with_lookup`]: crate::Header::with_lookup
//! [`ApiKeyStatus`]: crate::key::ApiKeyStatus
//! [`Overrides`]: crate::limits::Overrides

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::log_lines::OncePerSecond;

/// The future a [`Lookup`] returns.
pub(crate) type LookupFuture<A> = Pin<Box<dyn Future<Output = A> + Send + 'static>>;

/// Answers `Q` asynchronously: see the [module](self) for the questions
/// the layer asks.
///
/// ```
/// use slidegate::lookup::Lookup;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // A closure of the question is a lookup.
/// let even = |n: &u32| {
///     let even = n % 2 == 0;
///     async move { even }
/// };
/// assert!(even.lookup(&4).await);
/// # }
/// ```
pub trait Lookup<Q>: Send + Sync + 'static {
    /// What the lookup answers.
    type Answer;

    /// Starts looking up the answer to `question`; the future must not
    /// borrow the question.
    fn lookup(&self, question: Q) -> Pin<Box<dyn Future<Output = Self::Answer> + Send + 'static>>;
}

impl<'a, F, Fut, A> Lookup<&'a A> for F
where
    A: ?Sized + 'a,
    F: Fn(&A) -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
{
    type Answer = Fut::Output;

    fn lookup(&self, question: &'a A) -> LookupFuture<Fut::Output> {
        Box::pin(self(question))
    }
}

impl<'a, F, Fut, A, B> Lookup<(&'a A, &'a B)> for F
where
    A: ?Sized + 'a,
    B: ?Sized + 'a,
    F: Fn(&A, &B) -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
{
    type Answer = Fut::Output;

    fn lookup(&self, (a, b): (&'a A, &'a B)) -> LookupFuture<Fut::Output> {
        Box::pin(self(a, b))
    }
}

/// What a lookup that timed out warns, at most once a second.
pub(crate) struct TimedOut {
    lines: OncePerSecond,
    /// What happens instead, for the warning.
    message: &'static str,
}

impl TimedOut {
    pub(crate) const fn warning(message: &'static str) -> Self {
        Self {
            lines: OncePerSecond::new(),
            message,
        }
    }
}

/// Tier lookups past the layer's wait.
pub(crate) static TIER_TIMED_OUT: TimedOut =
    TimedOut::warning("tier lookup timed out; base limits apply");

/// API key lookups past the layer's wait.
pub(crate) static API_KEY_TIMED_OUT: TimedOut =
    TimedOut::warning("API key lookup timed out; the key counts as unknown");

/// Limit lookups past the layer's wait.
pub(crate) static LIMIT_TIMED_OUT: TimedOut =
    TimedOut::warning("limit lookup timed out; the last answer or the tier's limits apply");

/// Refreshes of a kept limit past the layer's wait.
pub(crate) static LIMIT_REFRESH_TIMED_OUT: TimedOut =
    TimedOut::warning("limit lookup refresh timed out; the kept answer stays in force");

/// The answer of `lookup` if it comes within `timeout`; `None` past it,
/// warned of as `timed_out` says.
pub(crate) async fn within<A>(
    lookup: LookupFuture<A>,
    timeout: Duration,
    timed_out: &'static TimedOut,
) -> Option<A> {
    let answer = tokio::time::timeout(timeout, lookup).await.ok();
    if answer.is_none()
        && let Some(held_back) = timed_out.lines.admit()
    {
        tracing::warn!(?timeout, held_back, "{}", timed_out.message);
    }
    answer
}
