//! [`Unsettled`]: the reservations of policies settled after the response
//! ([`Policy::with_max_unsettled`](crate::Policy::with_max_unsettled))
//! that each client holds at once in this process, bounded per policy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::key::Key;
use crate::store::Check;

/// Per policy and client, the reservations held now, unsettled. A client
/// holds an entry only while it holds a reservation.
#[derive(Debug, Default)]
pub(crate) struct Unsettled {
    held: Mutex<HashMap<(Arc<str>, Key), u32>>,
}

/// One reservation's place, given back when dropped (its request was
/// settled, or never admitted).
#[derive(Debug)]
pub(crate) struct Place {
    unsettled: Arc<Unsettled>,
    policy: Arc<str>,
    key: Key,
}

impl Unsettled {
    /// A place for a reservation of `check`'s policy and client, if it
    /// holds fewer than `max`.
    pub(crate) fn take(self: &Arc<Self>, check: &Check, max: u32) -> Option<Place> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let client = (check.policy().clone(), check.key.clone());
        let count = held.get(&client).copied().unwrap_or(0);
        if count >= max {
            return None;
        }
        held.insert(client, count + 1);
        Some(Place {
            unsettled: self.clone(),
            policy: check.policy().clone(),
            key: check.key.clone(),
        })
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut held = self
            .unsettled
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = (std::mem::take(&mut self.policy), self.key.clone());
        if let Some(count) = held.get_mut(&entry) {
            *count -= 1;
            if *count == 0 {
                held.remove(&entry);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_client_holds_at_most_max_places_and_gets_them_back() {
        let unsettled = Arc::new(Unsettled::default());
        let policy = crate::Policy::new("tokens", 100, Duration::from_secs(60));
        let alice = Check::new(&policy, Key::new("alice")).unwrap();
        let bob = Check::new(&policy, Key::new("bob")).unwrap();
        let first = unsettled.take(&alice, 2).unwrap();
        let second = unsettled.take(&alice, 2).unwrap();
        assert!(unsettled.take(&alice, 2).is_none());
        assert!(unsettled.take(&bob, 2).is_some(), "another client's own");
        drop(first);
        let third = unsettled.take(&alice, 2).unwrap();
        drop((second, third));
        assert!(
            unsettled.held.lock().unwrap().is_empty(),
            "nothing left held"
        );
    }
}
