//! Looking at and resetting one client's count under one policy:
//! [`RateLimitLayer::peek`] and [`RateLimitLayer::reset`]; and the
//! [`Changes`](crate::layer::Changes) handle.

use std::sync::Arc;

use crate::RateLimitLayer;
use crate::key::Key;
use crate::layer::changes;
use crate::policy::Policy;
use crate::store::{Check, Decision, StoreError};

/// Why [`RateLimitLayer::peek`] or [`RateLimitLayer::reset`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LimitError {
    /// The layer has no policy of this name.
    #[error("no policy is named `{0}`")]
    UnknownPolicy(String),
    /// A limit the policy cannot count, given to
    /// [`Changes::set_limit`](crate::layer::Changes::set_limit).
    #[error("{0}")]
    InvalidLimit(String),
    /// The store could not answer.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl RateLimitLayer {
    /// The check of `key` of `tier` under `policy`, at the client's own
    /// limit when the layer looks limits up.
    async fn check_of(&self, policy: &Arc<Policy>, key: &Key, tier: Option<&str>) -> Check {
        let own = match &self.shared.client_limits {
            Some(limits) => {
                let policies = std::slice::from_ref(policy);
                let timeout = self.shared.settings.lookup_timeout;
                match limits.known(key, policies, timeout) {
                    Some(found) => found[0],
                    None => limits.look_up(key, policies, timeout).await[0],
                }
            }
            None => None,
        };
        let own = changes::limit_set(&self.shared, policy, key).or(own);
        let limits = policy.limits_with(tier, own);
        let mut check = Check::of_limits(policy, key, limits);
        self.shared.in_namespace(&mut check);
        check
    }

    /// Where the client `key` (of `tier`, for a tier's limits) stands
    /// under the policy named `policy`, recording nothing: its limit (its
    /// own, when the layer has a [limit lookup](Self::with_limit_lookup)
    /// or one [set at run time](crate::layer::Changes::set_limit)),
    /// the units left, and when capacity next grows (`reset`). `admitted`
    /// says whether a request of the policy's cost would fit now.
    ///
    /// A key is named in its label form, as the example server's
    /// `/api/whoami` shows it: `Key::parse("ip:203.0.113.9")`,
    /// `Key::parse("jwt:alice")`. [`Store::peek`](crate::store::Store::peek)
    /// and [`Store::reset`](crate::store::Store::reset) do what `peek` and
    /// [`reset`](Self::reset) do for a store of your own. The example
    /// server serves both as `GET` and `DELETE /admin/limits/{policy}/{key}`
    /// when its configuration has an `[admin]` token.
    ///
    /// ```
    /// use slidegate::{Global, Policies, Policy, RateLimitLayer, key::Key, store::MemoryStore};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let policies = Policies::single(Policy::new("search", 5, Duration::from_secs(60)))?;
    /// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies);
    /// let alice = Key::parse("jwt:alice").expect("a key in its label form");
    /// let now = layer.peek("search", &alice, None).await?;
    /// println!("{} of {} left, more in {:?}", now.remaining(), now.limit(), now.reset());
    /// assert_eq!((now.limit(), now.remaining()), (5, 5));
    /// layer.reset("search", &alice).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownPolicy`] if no policy of the layer has that
    /// name; [`LimitError::Store`] if the store could not answer.
    pub async fn peek(
        &self,
        policy: &str,
        key: &Key,
        tier: Option<&str>,
    ) -> Result<Decision, LimitError> {
        let policy = self.shared.policy_named(policy)?;
        let check = self.check_of(&policy, key, tier).await;
        let decisions = self
            .shared
            .store()
            .peek(std::slice::from_ref(&check))
            .await?;
        decisions
            .first()
            .copied()
            .ok_or_else(|| StoreError::Protocol("a peek without a decision".to_owned()).into())
    }

    /// Forgets what the client `key` has spent under the policy named
    /// `policy`, its block included, in the store (so on every instance
    /// that shares it). Denials of the client this instance's deny cache
    /// holds are forgotten too; other instances' deny caches may still
    /// answer the client until its retry time. See [`peek`](Self::peek)
    /// for naming a key and for an example.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownPolicy`] if no policy of the layer has that
    /// name; [`LimitError::Store`] if the store could not answer.
    pub async fn reset(&self, policy: &str, key: &Key) -> Result<(), LimitError> {
        let policy = self.shared.policy_named(policy)?;
        let mut check = Check::of_limits(&policy, key, policy.limits_for(None));
        self.shared.in_namespace(&mut check);
        self.shared
            .store()
            .reset(std::slice::from_ref(&check))
            .await?;
        if let Some(cache) = &self.shared.deny_cache {
            cache.forget(&check);
        }
        Ok(())
    }
}
