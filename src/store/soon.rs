//! [`StoreFuture`], a store's answer, and the [`Soon`] it is made of: a
//! value known now or to come.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::{Decisions, StoreError};

/// A value known now, which costs no allocation and lets the caller go on
/// without a second poll, or a boxed future of it. The layer's own steps
/// are one; a store's answer is one inside [`StoreFuture`].
#[must_use = "nothing happens until the future is polled"]
pub(crate) struct Soon<T>(Value<T>);

enum Value<T> {
    /// Known now; `None` once taken by a poll.
    Now(Option<T>),
    /// Known when the future ends.
    Later(Pin<Box<dyn Future<Output = T> + Send + 'static>>),
}

impl<T> Soon<T> {
    /// `value`, known now.
    pub(crate) fn ready(value: T) -> Self {
        Self(Value::Now(Some(value)))
    }

    /// The value `future` gives, later.
    pub(crate) fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self(Value::Later(Box::pin(future)))
    }

    /// The value if it was known at once, or this back to wait for.
    pub(crate) fn into_ready(self) -> Result<T, Self> {
        match self.0 {
            Value::Now(Some(value)) => Ok(value),
            value => Err(Self(value)),
        }
    }
}

impl<T> Future for Soon<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match &mut self.0 {
            Value::Now(value) => Poll::Ready(value.take().expect("polled after completion")),
            Value::Later(future) => future.as_mut().poll(cx),
        }
    }
}

// The future is pinned on the heap, so the value moves freely.
impl<T> Unpin for Soon<T> {}

impl<T> fmt::Debug for Soon<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.0 {
            Value::Now(Some(_)) => "ready",
            Value::Now(None) => "taken",
            Value::Later(_) => "later",
        };
        f.debug_tuple("Soon").field(&state).finish()
    }
}

/// The future a [`Store`](super::Store) returns: an answer already known,
/// as from [`MemoryStore`](super::MemoryStore), which costs no allocation
/// and lets the layer go on without a second poll, or a boxed future, as
/// from a network store. A check's answer is its [`Decisions`]; a
/// refund's, `()`.
///
/// ```
/// use slidegate::store::{StoreFuture, Decisions, StoreError};
/// use std::time::Duration;
///
/// let known = StoreFuture::ready(Ok(Decisions::new()));
/// assert!(known.into_ready().is_ok());
///
/// let later: StoreFuture = StoreFuture::new(async { Err(StoreError::Timeout(Duration::from_millis(50))) });
/// assert!(later.into_ready().is_err(), "a boxed future is never taken as ready");
/// ```
#[must_use = "nothing happens until the future is polled"]
pub struct StoreFuture<T = Decisions>(Soon<Result<T, StoreError>>);

impl<T> StoreFuture<T> {
    /// `answer`, known now.
    pub fn ready(answer: Result<T, StoreError>) -> Self {
        Self(Soon::ready(answer))
    }

    /// The answer `future` gives, later.
    pub fn new(future: impl Future<Output = Result<T, StoreError>> + Send + 'static) -> Self {
        Self(Soon::new(future))
    }

    /// The answer if it was known at once, or this back to wait for.
    pub fn into_ready(self) -> Result<Result<T, StoreError>, Self> {
        self.0.into_ready().map_err(Self)
    }
}

impl<T> Future for StoreFuture<T> {
    type Output = Result<T, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> fmt::Debug for StoreFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("StoreFuture").field(&self.0).finish()
    }
}
