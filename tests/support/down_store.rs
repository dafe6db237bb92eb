//! A store whose backend is always down, to exercise fail modes without
//! depending on timing.

use std::time::Duration;

use slidegate::{Check, CheckFuture, Store, StoreError};

/// Every check fails with a timeout, at once.
pub struct DownStore;

impl Store for DownStore {
    fn check(&self, _checks: &[Check]) -> CheckFuture {
        CheckFuture::new(async { Err(StoreError::Timeout(Duration::from_millis(50))) })
    }
}
