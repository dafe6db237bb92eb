//! An instance's copy of the changes kept in the store: who is denied
//! until when, and clients' own limits.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use smallvec::SmallVec;

use super::deny_list::{canonical, network_of};
use crate::key::Key;

/// One client's own limits, by policy name.
type OwnLimits = SmallVec<[(Arc<str>, u32); 2]>;

/// The changes as last read (and as this instance has made them since).
#[derive(Debug, Clone, Default)]
pub(super) struct Snapshot {
    /// Denied keys, each until a Unix time in ms (0: until removed).
    denied: HashMap<Key, u64>,
    /// Denied networks (`ip:` entries with a prefix), likewise.
    networks: Vec<(IpNet, u64)>,
    /// Clients' own limits, per key, per policy.
    limits: HashMap<Key, OwnLimits>,
}

/// How long past its end a denial's entry stays in the store: an instance
/// whose clock runs ahead by less never removes a denial early for the
/// others.
const KEPT_PAST_ITS_END_MS: u64 = 60_000;

/// Whether an entry that ends at `until` (0: never) stands at `now`.
fn stands(until: u64, now: u64) -> bool {
    until == 0 || until > now
}

impl Snapshot {
    /// The copy of the store's `denied` and `limits` tables at `now`
    /// (Unix ms), with the entries (field and value) of denials that ended
    /// over a minute ago. Entries no layer could have written are passed
    /// over.
    pub(super) fn read(
        denied: &[(String, String)],
        limits: &[(String, String)],
        now: u64,
    ) -> (Self, Vec<(String, String)>) {
        let mut snapshot = Self::default();
        let mut ended = Vec::new();
        for (field, until) in denied {
            let (Some(key), Ok(ends)) = (Key::parse(field), until.parse::<u64>()) else {
                continue;
            };
            if stands(ends, now) {
                snapshot.deny(&canonical(&key), ends);
            } else if ends.saturating_add(KEPT_PAST_ITS_END_MS) <= now {
                // Removed while it holds the value as read, byte for byte.
                ended.push((field.clone(), until.clone()));
            }
        }
        for (field, limit) in limits {
            let Some((policy, key)) = field.split_once(':') else {
                continue;
            };
            if let (Some(key), Ok(limit)) = (Key::parse(key), limit.parse::<u32>()) {
                snapshot.set_limit(&Arc::from(policy), &canonical(&key), limit);
            }
        }
        (snapshot, ended)
    }

    pub(super) fn denies_nothing(&self) -> bool {
        self.denied.is_empty() && self.networks.is_empty()
    }

    pub(super) fn sets_limits(&self) -> bool {
        !self.limits.is_empty()
    }

    /// Whether `key` is denied at `now`.
    pub(super) fn denies(&self, key: &Key, now: u64) -> bool {
        self.denied
            .get(key)
            .is_some_and(|&until| stands(until, now))
    }

    /// Whether a denied network holds `ip` at `now`.
    pub(super) fn denies_address(&self, ip: IpAddr, now: u64) -> bool {
        self.networks
            .iter()
            .any(|(net, until)| stands(*until, now) && net.contains(&ip))
    }

    /// `key`'s own limit under `policy`, if one is set.
    pub(super) fn limit(&self, policy: &str, key: &Key) -> Option<u32> {
        let limits = self.limits.get(key)?;
        limits
            .iter()
            .find(|(name, _)| &**name == policy)
            .map(|&(_, limit)| limit)
    }

    pub(super) fn deny(&mut self, key: &Key, until: u64) {
        match network_of(key) {
            Some(net) => {
                self.networks.retain(|(listed, _)| *listed != net);
                self.networks.push((net, until));
            }
            None => {
                self.denied.insert(key.clone(), until);
            }
        }
    }

    pub(super) fn remove_denial(&mut self, key: &Key) {
        match network_of(key) {
            Some(net) => self.networks.retain(|(listed, _)| *listed != net),
            None => {
                self.denied.remove(key);
            }
        }
    }

    pub(super) fn set_limit(&mut self, policy: &Arc<str>, key: &Key, limit: u32) {
        let limits = self.limits.entry(key.clone()).or_default();
        match limits.iter_mut().find(|(name, _)| name == policy) {
            Some(entry) => entry.1 = limit,
            None => limits.push((policy.clone(), limit)),
        }
    }

    pub(super) fn clear_limit(&mut self, policy: &str, key: &Key) {
        if let Some(limits) = self.limits.get_mut(key) {
            limits.retain(|(name, _)| &**name != policy);
            if limits.is_empty() {
                self.limits.remove(key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_denial_stands_until_it_ends_and_a_network_holds_its_addresses() {
        let denied = [
            ("jwt:mallory".to_owned(), "0".to_owned()),
            ("ip:198.51.100.7".to_owned(), "2000".to_owned()),
            ("ip:203.0.113.0/24".to_owned(), "0".to_owned()),
            ("jwt:gone".to_owned(), "500".to_owned()),
            ("jwt:just-gone".to_owned(), "900".to_owned()),
            ("{bad}".to_owned(), "0".to_owned()),
        ];
        let limits = [
            ("search:jwt:alice".to_owned(), "50".to_owned()),
            ("nonsense".to_owned(), "1".to_owned()),
        ];
        let (snapshot, ended) = Snapshot::read(&denied, &limits, 60_600);
        assert_eq!(
            ended,
            [("jwt:gone".to_owned(), "500".to_owned())],
            "a minute past its end"
        );
        assert!(!snapshot.denies(&Key::parse("jwt:just-gone").unwrap(), 60_600));
        let key = |text| Key::parse(text).unwrap();
        assert!(snapshot.denies(&key("jwt:mallory"), u64::MAX - 1));
        let (snapshot, _) = Snapshot::read(&denied, &limits, 1000);
        assert!(snapshot.denies(&key("ip:198.51.100.7"), 1999));
        assert!(!snapshot.denies(&key("ip:198.51.100.7"), 2000));
        assert!(snapshot.denies_address("203.0.113.9".parse().unwrap(), 1000));
        assert!(!snapshot.denies_address("203.0.114.9".parse().unwrap(), 1000));
        assert_eq!(snapshot.limit("search", &key("jwt:alice")), Some(50));
        assert_eq!(snapshot.limit("other", &key("jwt:alice")), None);
    }
}
