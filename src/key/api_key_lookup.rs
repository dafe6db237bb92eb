//! API keys that live in a database, confirmed asynchronously by a
//! [`Lookup`] before they count as a client.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::{Extracted, Identity, KeyRejection};
use crate::lookup::{API_KEY_TIMED_OUT, Lookup, LookupFuture, within};

/// What an API key's lookup ([`Header::with_lookup`](crate::Header::with_lookup))
/// says of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApiKeyStatus {
    /// The key exists: it is the client, with this tier (or none, for the
    /// policies' base limits).
    Known(Option<Arc<str>>),
    /// No such key: it is no identity.
    Unknown,
}

/// Says whether an API key that is not in a [`Header`](crate::Header)'s
/// table exists (in a database, say), and its tier: a [`Lookup`] of the
/// header's raw value. Set with [`Header::with_lookup`](crate::Header::with_lookup).
pub(crate) type ApiKeyLookup = dyn for<'a> Lookup<&'a [u8], Answer = ApiKeyStatus>;

/// An API key outside the table, waiting for its lookup, and what the
/// request is should the key be unknown.
pub(crate) struct Unconfirmed {
    /// Behind a lock only so that an [`Identity`] is `Sync`, as request
    /// extensions must be; it is never contended.
    pub(crate) lookup: Mutex<LookupFuture<ApiKeyStatus>>,
    pub(crate) otherwise: Otherwise,
}

impl fmt::Debug for Unconfirmed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Unconfirmed")
            .field("otherwise", &self.otherwise)
            .finish_non_exhaustive()
    }
}

impl Unconfirmed {
    /// The stand-in for a copy of an identity still waiting for its
    /// lookup: it can only turn out unknown, with no fallback, so a copy
    /// never counts as a confirmed key.
    pub(crate) fn lost() -> Self {
        Self {
            lookup: Mutex::new(Box::pin(std::future::ready(ApiKeyStatus::Unknown))),
            otherwise: Otherwise {
                reject: None,
                fallback: None,
            },
        }
    }
}

/// What a request whose API key turned out unknown is.
#[derive(Debug)]
pub(crate) struct Otherwise {
    /// Refuse the key (`401`), rather than fall back.
    pub(crate) reject: Option<KeyRejection>,
    /// What the extractors after the key's found; `None` until asked.
    pub(crate) fallback: Option<Box<Extracted>>,
}

impl Otherwise {
    /// Lets the extractors after the key's decide, should the key be
    /// unknown: `next` is asked only if no earlier extractor already
    /// answered for this case.
    pub(crate) fn fall_back_to(&mut self, next: impl FnOnce() -> Extracted) {
        if self.reject.is_some() {
            // Unknown means refused: nothing after this extractor matters.
            return;
        }
        match self.fallback.as_deref_mut() {
            None | Some(Ok(None)) => self.fallback = Some(Box::new(next())),
            Some(Ok(Some(identity))) => {
                if let Some(unconfirmed) = identity.unconfirmed.as_mut() {
                    unconfirmed.otherwise.fall_back_to(next);
                }
            }
            Some(Err(_)) => {}
        }
    }

    /// What the request is once the key turned out unknown.
    pub(crate) fn unknown(self) -> Extracted {
        match (self.reject, self.fallback) {
            (Some(rejection), _) => Err(rejection),
            (None, Some(fallback)) => *fallback,
            (None, None) => Ok(None),
        }
    }
}

/// The future of a confirmed identity: see [`confirmed`].
pub(crate) type Confirming = Pin<Box<dyn Future<Output = Extracted> + Send + 'static>>;

/// Resolves `identity`'s API key with its lookup, waiting at most
/// `timeout` (past it, the key counts as unknown): the identity with the
/// tier the lookup named, or, for an unknown key, what the rest of the
/// chain said, looked up in turn if it is an API key too.
pub(crate) fn confirmed(mut identity: Identity, timeout: Duration) -> Confirming {
    Box::pin(async move {
        loop {
            let Some(unconfirmed) = identity.unconfirmed.take() else {
                return Ok(Some(identity));
            };
            let Unconfirmed { lookup, otherwise } = *unconfirmed;
            let lookup = lookup.into_inner().unwrap_or_else(PoisonError::into_inner);
            if let Some(ApiKeyStatus::Known(tier)) =
                within(lookup, timeout, &API_KEY_TIMED_OUT).await
            {
                identity.tier = tier;
                return Ok(Some(identity));
            }
            match otherwise.unknown()? {
                Some(next) => identity = next,
                None => return Ok(None),
            }
        }
    })
}
