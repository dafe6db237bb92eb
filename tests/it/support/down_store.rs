//! A store whose backend is always down, to exercise fail modes without
//! depending on timing.

use std::time::Duration;

use slidegate::store::{Check, Store, StoreError, StoreFuture};

/// Every check fails with a timeout, at once.
pub struct DownStore;

impl Store for DownStore {
    fn check(&self, _checks: &[Check]) -> StoreFuture {
        StoreFuture::new(async { Err(StoreError::Timeout(Duration::from_millis(50))) })
    }
}

/// A store that answers through `inner` or fails, as `down` says for
/// each call (numbered from 0).
pub struct FlakyStore<D> {
    inner: std::sync::Arc<dyn Store>,
    calls: std::sync::atomic::AtomicU64,
    down: D,
}

impl<D: Fn(u64) -> bool + Send + Sync + 'static> FlakyStore<D> {
    pub fn new(inner: impl Store, down: D) -> Self {
        Self {
            inner: std::sync::Arc::new(inner),
            calls: std::sync::atomic::AtomicU64::new(0),
            down,
        }
    }
}

impl<D: Fn(u64) -> bool + Send + Sync + 'static> Store for FlakyStore<D> {
    fn check(&self, checks: &[Check]) -> StoreFuture {
        let call = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if (self.down)(call) {
            return StoreFuture::ready(Err(StoreError::Timeout(Duration::from_millis(50))));
        }
        self.inner.check(checks)
    }

    fn peek(&self, checks: &[Check]) -> StoreFuture {
        self.inner.peek(checks)
    }

    fn refund(&self, checks: &[Check], recorded_at: &[Duration]) -> StoreFuture<()> {
        self.inner.refund(checks, recorded_at)
    }

    fn is_remote(&self) -> bool {
        self.inner.is_remote()
    }
}
