//! [`Soon`]: a value known now, or a boxed future of it.
//!
//! A store in process, a cached lookup or the deny cache answer at once;
//! a store across the network or a lookup in a database answer later.
//! Code that goes on at once when it can asks [`Soon::into_now`]; code
//! that already waits simply awaits it, which costs nothing when the
//! value is known.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A value known now, or a future of it, boxed.
pub(crate) enum Soon<T> {
    /// Known now; `None` once taken by a poll.
    Now(Option<T>),
    /// Known when the future ends.
    Later(Pin<Box<dyn Future<Output = T> + Send + 'static>>),
}

impl<T> Soon<T> {
    /// `value`, known now.
    pub(crate) fn now(value: T) -> Self {
        Self::Now(Some(value))
    }

    /// The value `future` gives.
    pub(crate) fn later(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self::Later(Box::pin(future))
    }

    /// The value if it is known now, or this back to wait for.
    pub(crate) fn into_now(self) -> Result<T, Self> {
        match self {
            Self::Now(Some(value)) => Ok(value),
            later => Err(later),
        }
    }
}

impl<T> Future for Soon<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match &mut *self {
            Self::Now(value) => Poll::Ready(value.take().expect("polled after completion")),
            Self::Later(future) => future.as_mut().poll(cx),
        }
    }
}

// The future is pinned on the heap, so the value moves freely.
impl<T> Unpin for Soon<T> {}

impl<T> fmt::Debug for Soon<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Now(Some(_)) => "now",
            Self::Now(None) => "taken",
            Self::Later(_) => "later",
        })
    }
}
