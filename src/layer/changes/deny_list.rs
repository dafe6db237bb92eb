//! [`DenyList`]: clients refused `403` before any limit is counted, as
//! written in code or the config file's `[deny]`.

use std::collections::HashSet;
use std::net::IpAddr;

use http::HeaderName;
use http::request::Parts;
use ipnet::IpNet;

use crate::key::{Key, PeerIp, digest};
use crate::rejection::Listed;

/// The network an `ip:` key names with a prefix (`ip:203.0.113.0/24`,
/// and an IPv6 client's group, `ip:2001:db8::/64`).
pub(super) fn network_of(key: &Key) -> Option<IpNet> {
    let text = key.as_str().strip_prefix("ip:")?;
    text.contains('/').then(|| text.parse().ok()).flatten()
}

/// The address an `ip:` key names: its own, or its network's first.
pub(super) fn address_of(key: &Key) -> Option<IpAddr> {
    let text = key.as_str().strip_prefix("ip:")?;
    text.parse()
        .ok()
        .or_else(|| text.parse::<IpNet>().ok().map(|net| net.network()))
}

/// `key` as the layer writes it: an `ip:` key's address or network in its
/// one canonical form (`ip:2001:DB8::1` is `ip:2001:db8::1`, and
/// `ip:203.0.113.9/24` is `ip:203.0.113.0/24`), any other as it is; so
/// that a change names the key requests are matched by.
pub(crate) fn canonical(key: &Key) -> Key {
    let Some(text) = key.as_str().strip_prefix("ip:") else {
        return key.clone();
    };
    if let Ok(address) = text.parse::<IpAddr>() {
        return Key::formatted("ip", address.to_canonical());
    }
    match text.parse::<IpNet>() {
        Ok(network) => Key::formatted("ip", network.trunc()),
        Err(_) => key.clone(),
    }
}

/// Clients the layer refuses with `403 Forbidden` before any limit is
/// counted, on the routes it limits: addresses and networks, API keys,
/// and keys in their label form (a token's subject, `jwt:mallory`).
/// Set with [`RateLimitLayer::with_deny_list`](crate::RateLimitLayer::with_deny_list);
/// the config file's `[deny]` fills one. Entries added and removed while
/// the layer serves are the [`Changes`](crate::layer::Changes) handle's.
///
/// Addresses are the client's as [`PeerIp`] resolves it (behind the
/// trusted proxies of [`with_peer_ip`](Self::with_peer_ip)); API keys are
/// read from their header whether the layer knows them or not (a leaked
/// key taken out of the table is still refused), and kept hashed.
///
/// ```
/// use slidegate::{Global, Policies, Policy, RateLimitLayer, key::Key, layer::DenyList, store::MemoryStore};
/// use std::time::Duration;
///
/// let deny = DenyList::new()
///     .with_networks(["203.0.113.0/24".parse()?])
///     .with_api_keys(["leaked-key"])
///     .with_keys([Key::parse("jwt:mallory").expect("a key in label form")]);
/// let policies = Policies::single(Policy::new("all", 100, Duration::from_secs(60)))?;
/// let layer = RateLimitLayer::new(MemoryStore::new(), Global, policies).with_deny_list(deny);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct DenyList {
    networks: Vec<IpNet>,
    api_keys: HashSet<[u8; 16]>,
    api_key_header: HeaderName,
    keys: HashSet<Key>,
    peer_ip: PeerIp,
}

impl Default for DenyList {
    fn default() -> Self {
        Self {
            networks: Vec::new(),
            api_keys: HashSet::new(),
            api_key_header: HeaderName::from_static("x-api-key"),
            keys: HashSet::new(),
            peer_ip: PeerIp::new(),
        }
    }
}

impl DenyList {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Refuses clients whose address is in one of `networks` (a single
    /// address is a `/32` or `/128`).
    #[must_use]
    pub fn with_networks(mut self, networks: impl IntoIterator<Item = IpNet>) -> Self {
        self.networks.extend(networks);
        self
    }

    /// Refuses requests that send one of `keys` in the API-key header
    /// ([`with_api_key_header`](Self::with_api_key_header), `x-api-key`
    /// by default). The keys are kept hashed.
    #[must_use]
    pub fn with_api_keys<K: AsRef<[u8]>>(mut self, keys: impl IntoIterator<Item = K>) -> Self {
        self.api_keys
            .extend(keys.into_iter().map(|key| digest(key.as_ref())));
        self
    }

    /// The header API keys come in.
    #[must_use]
    pub fn with_api_key_header(mut self, header: HeaderName) -> Self {
        self.api_key_header = header;
        self
    }

    /// Refuses clients the layer identifies by one of `keys` (in label
    /// form: `jwt:mallory`, `ip:198.51.100.7`); an `ip:` key that names a
    /// network (`ip:203.0.113.0/24`) refuses every address in it.
    #[must_use]
    pub fn with_keys(mut self, keys: impl IntoIterator<Item = Key>) -> Self {
        for key in keys.into_iter().map(|key| canonical(&key)) {
            match network_of(&key) {
                Some(network) => self.networks.push(network),
                None => {
                    self.keys.insert(key);
                }
            }
        }
        self
    }

    /// How the client's address is found: behind which trusted proxies,
    /// from which header ([`PeerIp::new`] by default: the peer's address).
    #[must_use]
    pub fn with_peer_ip(mut self, peer_ip: PeerIp) -> Self {
        self.peer_ip = peer_ip;
        self
    }

    /// Whether the list refuses no one.
    pub fn is_empty(&self) -> bool {
        self.networks.is_empty() && self.api_keys.is_empty() && self.keys.is_empty()
    }

    /// The client's address, as the list resolves it.
    pub(crate) fn client(&self, parts: &Parts) -> Option<IpAddr> {
        self.peer_ip.client(parts)
    }

    /// The keys an address is listed under: its own, and its group's
    /// (an IPv6 client's `/64`).
    pub(crate) fn address_keys(&self, ip: IpAddr) -> [Key; 2] {
        [Key::formatted("ip", ip), self.peer_ip.key_of(ip)]
    }

    /// Which of the list's entries, read before the client is identified,
    /// refuses the request: its address's networks or its API key.
    pub(crate) fn refuses(&self, parts: &Parts, client: Option<IpAddr>) -> Option<Listed> {
        if let Some(ip) = client
            && self.holds(ip)
        {
            return Some(Listed::Address);
        }
        if !self.api_keys.is_empty()
            && parts
                .headers
                .get_all(&self.api_key_header)
                .iter()
                .any(|key| self.api_keys.contains(&digest(key.as_bytes())))
        {
            return Some(Listed::ApiKey);
        }
        None
    }

    /// Whether the list names keys (beside networks and API keys).
    pub(crate) fn names_keys(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Whether one of the list's networks holds `ip`.
    pub(crate) fn holds(&self, ip: IpAddr) -> bool {
        self.networks.iter().any(|net| net.contains(&ip))
    }

    /// Whether the list names `key`.
    pub(crate) fn names(&self, key: &Key) -> bool {
        self.keys.contains(key)
    }

    /// The label of the API key the request sends, if it sends one.
    pub(crate) fn api_key(&self, parts: &Parts) -> Option<Key> {
        let value = parts.headers.get(&self.api_key_header)?;
        Some(crate::key::api_key_of(&digest(value.as_bytes())))
    }
}
