//! The keys of a request's policies that count under a key of their own
//! ([`Policy::per`](crate::Policy::per)), read from its head beside the
//! client's, and what a request without one gets.

use http::request::Parts;
use smallvec::SmallVec;

use crate::key::{Key, KeyRejection};
use crate::limits::Found;
use crate::policy::PerMissing;
use crate::policy::cost::{Cost, Costs};
use crate::policy::plan::Plan;

/// Per policy of a plan, in order, the key its check counts under:
/// `None` for the client's, or for a policy that skips the request.
#[derive(Debug, Default)]
pub(crate) struct PerKeys {
    keys: SmallVec<[Option<Key>; 2]>,
    /// Per policy, whether it skips the request (its extractor found no
    /// key, and it skips such requests).
    skipped: SmallVec<[bool; 2]>,
}

/// Why a request's policies cannot all be keyed.
pub(crate) enum Unkeyed {
    /// A policy that refuses requests without its key found none.
    Missing,
    /// A policy's extractor refused the request's credentials.
    Rejected(KeyRejection),
}

impl PerKeys {
    /// The keys of `plan`'s policies that count under one of their own,
    /// read from `parts`; `None` when every policy counts per client.
    #[inline]
    pub(crate) fn of(plan: &Plan, parts: &Parts) -> Result<Option<Self>, Unkeyed> {
        if !plan.counts_per() {
            return Ok(None);
        }
        Self::read(plan, parts).map(Some)
    }

    fn read(plan: &Plan, parts: &Parts) -> Result<Self, Unkeyed> {
        let mut per_keys = Self::default();
        for policy in &plan.policies {
            let (key, skipped) = match policy.per_extractor() {
                None => (None, false),
                Some(per) => match per.extractor.extract(parts).map_err(Unkeyed::Rejected)? {
                    // An API key a lookup must confirm is not known now.
                    Some(identity) if identity.unconfirmed.is_none() => (Some(identity.key), false),
                    _ if per.missing == PerMissing::Refuse => return Err(Unkeyed::Missing),
                    _ => (None, true),
                },
            };
            per_keys.keys.push(key);
            per_keys.skipped.push(skipped);
        }
        Ok(per_keys)
    }

    /// The key the policy at `index` counts under, when not the client's.
    pub(crate) fn key(&self, index: usize) -> Option<&Key> {
        self.keys.get(index).and_then(Option::as_ref)
    }

    /// `own`, the client's own limits, without those of the policies
    /// that count under another key.
    pub(crate) fn clients_only(&self, own: &Found) -> Found {
        own.iter()
            .zip(&self.keys)
            .map(|(&limit, key)| if key.is_some() { None } else { limit })
            .collect()
    }

    /// `costs` (the policies' own when `None`), with every policy that
    /// skips the request exempting it.
    pub(crate) fn skip_in(&self, costs: Option<Costs>) -> Option<Costs> {
        if !self.skipped.contains(&true) {
            return costs;
        }
        let mut costs =
            costs.unwrap_or_else(|| self.skipped.iter().map(|_| Cost::Policy).collect());
        for (cost, skipped) in costs.iter_mut().zip(&self.skipped) {
            if *skipped {
                *cost = Cost::Exempt;
            }
        }
        Some(costs)
    }
}
