//! The store a layer calls: the one it was given, or, once a policy takes
//! slices of a remote store's limits ([`Policy::with_slice`](crate::Policy::with_slice)),
//! the [`Sliced`] store that serves them in front of it. A layer whose
//! policies take no slice never passes through it.

use std::sync::{Arc, OnceLock};

use crate::policy::Policies;
use crate::store::{Sliced, Store};

/// A layer's store, shared by its clones and its [`PoliciesHandle`](super::PoliciesHandle).
pub(crate) struct LayerStore {
    /// The store as the layer was given it.
    given: Arc<dyn Store>,
    /// The slices' store in front of `given`, made when policies that take
    /// slices are first put in force (at the start, or by a reload); from
    /// then on every call goes through it, so that a refund or a reset
    /// finds the slices it concerns.
    sliced: OnceLock<Arc<dyn Store>>,
}

impl LayerStore {
    /// `store`, with slices served in front of it if `policies` take any.
    pub(crate) fn new(store: Arc<dyn Store>, policies: &Policies) -> Self {
        let stores = Self {
            given: store,
            sliced: OnceLock::new(),
        };
        stores.serve(policies);
        stores
    }

    /// Serves slices from now on if `policies` take any and the store is
    /// remote (the memory store has no use for them).
    pub(crate) fn serve(&self, policies: &Policies) {
        if self.given.is_remote() && policies.iter().any(|policy| policy.slice().is_some()) {
            self.sliced
                .get_or_init(|| Arc::new(Sliced::new(self.given.clone())));
        }
    }

    /// The store to call now.
    pub(crate) fn get(&self) -> &Arc<dyn Store> {
        self.sliced.get().unwrap_or(&self.given)
    }

    /// The store as the layer was given it.
    pub(crate) fn given(&self) -> &Arc<dyn Store> {
        &self.given
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::Policy;
    use crate::store::MemoryStore;

    /// A remote store that answers nothing: only where calls go is seen.
    struct Remote;

    impl Store for Remote {
        fn check(&self, _: &[crate::store::Check]) -> crate::store::StoreFuture {
            crate::store::StoreFuture::ready(Ok(crate::store::Decisions::new()))
        }

        fn is_remote(&self) -> bool {
            true
        }
    }

    fn policies(slice: Option<u32>) -> Policies {
        let mut policy = Policy::new("api", 100, Duration::from_secs(60));
        if let Some(slice) = slice {
            policy = policy.with_slice(slice);
        }
        Policies::single(policy).unwrap()
    }

    #[test]
    fn slices_are_served_only_once_a_policy_takes_them_on_a_remote_store() {
        let remote: Arc<dyn Store> = Arc::new(Remote);
        let stores = LayerStore::new(remote.clone(), &policies(None));
        assert!(Arc::ptr_eq(stores.get(), &remote), "a plain policy");
        stores.serve(&policies(Some(10)));
        assert!(
            !Arc::ptr_eq(stores.get(), &remote),
            "a reload brought slices"
        );
        stores.serve(&policies(None));
        assert!(!Arc::ptr_eq(stores.get(), &remote), "and they are kept");

        let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let stores = LayerStore::new(memory.clone(), &policies(Some(10)));
        assert!(Arc::ptr_eq(stores.get(), &memory), "in memory, no slices");
    }
}
