//! TOML configuration (feature `config`): the file format of the example
//! server, usable by any application.
//!
//! ```
//! use slidegate::config::Config;
//!
//! let config = Config::from_toml_str(r#"
//!     [limiter]
//!     keys = ["api_key", "ip"]
//!
//!     [[policy]]
//!     name = "search"
//!     route = "GET /api/search"
//!     limit = 5
//!     window = "60s"
//!     fail = "closed"
//!
//!     [default]
//!     limit = 100
//!     window = "1m"
//! "#).unwrap();
//! assert_eq!(config.policies().iter().count(), 2);
//!
//! let error = Config::from_toml_str("[[policy]]\nname = \"p\"\nlimit = 5\nwindow = \"1s\"\ncost = 6\n").unwrap_err();
//! assert_eq!(error.line(), Some(5));
//! assert!(error.to_string().contains("cost"));
//! ```

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use ipnet::IpNet;
use toml::Spanned;

use crate::headers::{HeaderStyle, ResetFormat};
#[cfg(feature = "jwt")]
use crate::key::JwtClaim;
use crate::key::{Global, Header, Key, KeyExtractor, PeerIp, digest};
use crate::layer::remembered::credential_failures::CredentialFailures;
use crate::layer::remembered::deny_cache::{DEFAULT_CAPACITY as DEFAULT_DENY_CACHE, DenyCache};
use crate::layer::{DenyList, RateLimitLayer};
use crate::limits::Overrides;
use crate::policy::{FailMode, Policies};
use crate::store::{MemoryStore, Store};

mod error;
#[cfg(feature = "jwt")]
mod jwt;
#[cfg(not(feature = "jwt"))]
#[path = "no_jwt.rs"]
mod jwt;
mod overrides;
mod per;
mod policies;
mod raw;
mod redis;
#[cfg(feature = "redis")]
mod redis_pool;
mod value;

pub use error::ConfigError;

use error::{not_utf8, syntax_error};
use per::PerSources;
use raw::{
    ForwardedHeaderName, HeaderStyleName, KeySource, RawConfig, RawCredentialFailures, RawDeny,
    ResetName, UnknownApiKeyName,
};

pub use redis::{RedisSettings, RedisTls};

#[cfg(not(feature = "jwt"))]
use jwt::JwtClaim;
use jwt::jwt_claim;
use redis::redis_settings;

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    redis: Option<RedisSettings>,
    /// `memory.max_keys`, when set.
    max_keys: Option<usize>,
    keys: Vec<KeySource>,
    jwt: Option<JwtClaim>,
    /// The API-key extractor with its table of known keys and their tiers
    /// (hashed on the way in).
    api_key: Header,
    peer_ip: PeerIp,
    /// `limiter.exempt`: client networks the limiter leaves alone.
    exempt: Arc<[IpNet]>,
    /// `limiter.exempt_api_keys`, by digest, and the header they come in.
    exempt_api_keys: Arc<HashSet<[u8; 16]>>,
    api_key_header: HeaderName,
    policies: Policies,
    fail_mode: FailMode,
    /// `limiter.local_share`: the instances a local limit is shared by.
    local_share: u32,
    /// `limiter.shadow`: every policy in shadow mode.
    shadow: bool,
    header_style: HeaderStyle,
    reset_format: ResetFormat,
    /// `Some(on)` when `limiter.deny_cache` was set; otherwise the layer's
    /// default (on for Redis).
    deny_cache: Option<bool>,
    credential_failures: RawCredentialFailures,
    /// `[overrides]`: clients' own limits.
    overrides: Overrides,
    /// `limiter.max_delayed`, when set.
    max_delayed: Option<usize>,
    /// `limiter.namespace`, when set.
    namespace: Option<String>,
    /// `[admin] token`, when set.
    admin_token: Option<Arc<str>>,
    /// `[deny]`, with the addresses and API keys read as the limiter reads
    /// them.
    deny_list: DenyList,
}

impl Config {
    /// Reads and validates the file at `path`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| {
            ConfigError {
                file: None,
                line: None,
                key: None,
                message: format!("cannot read the file: {e}"),
            }
            .in_file(path)
        })?;
        let text = String::from_utf8(bytes).map_err(|e| not_utf8(&e).in_file(path))?;
        let base = path.parent().unwrap_or(Path::new(""));
        Self::parse(&text, base).map_err(|e| e.in_file(path))
    }

    /// Parses and validates TOML text; `[jwt] public_key_pem` paths are
    /// relative to the working directory (to the file's directory with
    /// [`Config::from_file`]).
    pub fn from_toml_str(source: &str) -> Result<Self, ConfigError> {
        Self::parse(source, Path::new(""))
    }

    fn parse(source: &str, base: &Path) -> Result<Self, ConfigError> {
        let deserializer =
            toml::Deserializer::parse(source).map_err(|e| syntax_error(source, &e))?;
        let raw: RawConfig = serde_path_to_error::deserialize(deserializer)
            .map_err(|e| error::unreadable(source, e))?;
        Self::validate(raw, source, base)
    }

    fn validate(raw: RawConfig, source: &str, base: &Path) -> Result<Self, ConfigError> {
        let redis = raw
            .redis
            .map(|r| redis_settings(r, source, base))
            .transpose()?;
        let max_keys = match raw.memory.and_then(|memory| memory.max_keys) {
            Some(max_keys) if *max_keys.get_ref() == 0 => {
                return Err(ConfigError::at(
                    source,
                    max_keys.span().start,
                    "memory.max_keys",
                    "must be at least 1",
                ));
            }
            max_keys => max_keys.map(Spanned::into_inner),
        };
        let limiter = raw.limiter;

        if limiter.keys.get_ref().is_empty() {
            return Err(ConfigError::at(
                source,
                limiter.keys.span().start,
                "limiter.keys",
                "needs at least one key source (jwt, api_key, ip, global)",
            ));
        }
        if let Some(empty) = limiter
            .exempt_api_keys
            .iter()
            .find(|key| key.get_ref().is_empty())
        {
            // An empty key would exempt every request with an empty header.
            return Err(ConfigError::at(
                source,
                empty.span().start,
                "limiter.exempt_api_keys",
                "API keys must not be empty",
            ));
        }
        let keys = limiter.keys.get_ref();
        let keys_offset = limiter.keys.span().start;
        let per_claims = per::names_a_claim(&raw.policy, raw.default.as_ref());
        let jwt = match raw.jwt {
            Some(jwt) if keys.contains(&KeySource::Jwt) || per_claims => {
                Some(jwt_claim(jwt, source, base)?)
            }
            Some(jwt) => {
                return Err(ConfigError::at(
                    source,
                    jwt.span().start,
                    "jwt",
                    "is configured but neither `limiter.keys` nor a policy's `per` names \"jwt\"",
                ));
            }
            None if keys.contains(&KeySource::Jwt) => {
                return Err(ConfigError::at(
                    source,
                    keys_offset,
                    "limiter.keys",
                    "lists \"jwt\" but there is no [jwt] section",
                ));
            }
            None => None,
        };
        let api_key_header = HeaderName::from_bytes(limiter.api_key_header.get_ref().as_bytes())
            .map_err(|_| {
                ConfigError::at(
                    source,
                    limiter.api_key_header.span().start,
                    "limiter.api_key_header",
                    "is not a valid header name",
                )
            })?;
        let mut api_key = Header::new(api_key_header.clone()).with_tiers(api_key_tiers(
            raw.api_keys,
            keys.contains(&KeySource::ApiKey),
            source,
        )?);
        if limiter.unknown_api_key == UnknownApiKeyName::Reject {
            api_key = api_key.with_unknown_rejected(true);
        }
        let local_share = *limiter.local_share.get_ref();
        if local_share == 0 {
            return Err(ConfigError::at(
                source,
                limiter.local_share.span().start,
                "limiter.local_share",
                "must be at least 1 (the number of instances sharing the store)",
            ));
        }
        let ipv6_prefix = *limiter.ipv6_prefix.get_ref();
        if ipv6_prefix > 128 {
            return Err(ConfigError::at(
                source,
                limiter.ipv6_prefix.span().start,
                "limiter.ipv6_prefix",
                "must be at most 128",
            ));
        }
        let trusts_proxies = !limiter.trusted_proxies.is_empty();
        let mut peer_ip = PeerIp::new()
            .with_trusted_proxies(limiter.trusted_proxies.into_iter().map(|c| c.0))
            .with_forwarded_header(match limiter.forwarded_header {
                ForwardedHeaderName::XForwardedFor => crate::key::ForwardedHeader::XForwardedFor,
                ForwardedHeaderName::Forwarded => crate::key::ForwardedHeader::Forwarded,
            })
            .with_ipv6_prefix(ipv6_prefix);
        if let Some(header) = &limiter.client_ip_header {
            let refuse = |message: &str| {
                ConfigError::at(
                    source,
                    header.span().start,
                    "limiter.client_ip_header",
                    message,
                )
            };
            let name = HeaderName::from_bytes(header.get_ref().as_bytes())
                .map_err(|_| refuse("is not a valid header name"))?;
            if !trusts_proxies {
                return Err(refuse(
                    "is read from trusted proxies only: list the proxies that set it in \
                     `limiter.trusted_proxies`",
                ));
            }
            peer_ip = peer_ip.with_client_ip_header(name);
        }

        if let Some(namespace) = &limiter.namespace
            && !crate::policy::is_valid_name(namespace.get_ref())
        {
            return Err(ConfigError::at(
                source,
                namespace.span().start,
                "limiter.namespace",
                "must be 1-64 ASCII letters, digits, `-` or `_`",
            ));
        }

        let extension_methods = extension_methods(&limiter.extension_methods, source)?;
        let sources = PerSources {
            peer_ip: &peer_ip,
            api_key: &api_key,
            jwt: jwt.as_ref(),
        };
        let policies = policies::build_policies(
            raw.policy,
            raw.default,
            &extension_methods,
            &sources,
            source,
        )?;
        let overrides = overrides::overrides(
            raw.overrides,
            limiter.keys.get_ref(),
            &peer_ip,
            &policies,
            source,
        )?;
        let deny_list = deny_list(raw.deny, &peer_ip, &api_key_header, source)?;
        let admin_token = match raw.admin {
            Some(admin) => {
                let token = admin.token.get_ref();
                if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(ConfigError::at(
                        source,
                        admin.token.span().start,
                        "admin.token",
                        "must be printable ASCII without spaces, and not empty",
                    ));
                }
                Some(Arc::from(admin.token.into_inner()))
            }
            None => None,
        };

        Ok(Self {
            redis,
            max_keys,
            keys: limiter.keys.into_inner(),
            jwt,
            api_key,
            peer_ip,
            exempt: limiter.exempt.into_iter().map(|cidr| cidr.0).collect(),
            exempt_api_keys: Arc::new(
                limiter
                    .exempt_api_keys
                    .iter()
                    .map(|key| digest(key.get_ref().as_bytes()))
                    .collect(),
            ),
            api_key_header,
            policies,
            fail_mode: limiter.fail.into(),
            local_share,
            shadow: limiter.shadow,
            header_style: match limiter.headers {
                HeaderStyleName::XRatelimit => HeaderStyle::XRateLimit,
                HeaderStyleName::Ietf => HeaderStyle::Ietf,
                HeaderStyleName::Both => HeaderStyle::Both,
                HeaderStyleName::None => HeaderStyle::None,
            },
            deny_cache: limiter.deny_cache,
            credential_failures: limiter.credential_failures,
            overrides,
            max_delayed: limiter.max_delayed.map(Spanned::into_inner),
            namespace: limiter.namespace.map(Spanned::into_inner),
            admin_token,
            deny_list,
            reset_format: match limiter.reset {
                ResetName::Delta => ResetFormat::DeltaSeconds,
                ResetName::Unix => ResetFormat::UnixSeconds,
            },
        })
    }

    /// The `[redis]` section, if present.
    pub fn redis(&self) -> Option<&RedisSettings> {
        self.redis.as_ref()
    }

    /// A [`MemoryStore`] bounded by `memory.max_keys` (default a million
    /// tracked (policy, client) pairs).
    ///
    /// ```
    /// use slidegate::config::Config;
    ///
    /// let config = Config::from_toml_str("[memory]\nmax_keys = 50000\n").unwrap();
    /// let store = config.memory_store();
    /// assert!(store.is_empty());
    /// ```
    pub fn memory_store(&self) -> MemoryStore {
        let builder = MemoryStore::builder();
        match self.max_keys {
            Some(max_keys) => builder.with_max_keys(max_keys).build(),
            None => builder.build(),
        }
    }

    /// The validated policies.
    pub fn policies(&self) -> &Policies {
        &self.policies
    }

    /// The clients' own limits of `[overrides]` (empty without it).
    ///
    /// ```
    /// use slidegate::{config::Config, key::Key};
    ///
    /// let config = Config::from_toml_str(r#"
    ///     [limiter]
    ///     keys = ["jwt", "ip"]
    ///     [jwt]
    ///     secret = "change-me"
    ///     [[policy]]
    ///     name = "search"
    ///     limit = 5
    ///     window = "60s"
    ///     [overrides]
    ///     "jwt:alice" = { search = 50 }
    /// "#).unwrap();
    /// let alice = Key::parse("jwt:alice").unwrap();
    /// assert_eq!(config.overrides().get(&alice, "search"), Some(50));
    /// ```
    pub fn overrides(&self) -> &Overrides {
        &self.overrides
    }

    /// The clients `[deny]` refuses (empty without it), as
    /// [`layer`](Self::layer) sets them; give it to
    /// [`Changes::replace_deny_list`](crate::layer::Changes::replace_deny_list)
    /// when the file is read again.
    pub fn deny_list(&self) -> &DenyList {
        &self.deny_list
    }

    /// The `[admin] token` an application's admin routes are to ask for,
    /// if the file sets one.
    pub fn admin_token(&self) -> Option<&str> {
        self.admin_token.as_deref()
    }

    /// The key chain of `limiter.keys`, in order.
    pub fn key_extractor(&self) -> Box<dyn KeyExtractor> {
        let mut chain: Option<Box<dyn KeyExtractor>> = None;
        for source in self.keys.iter().rev() {
            let extractor: Box<dyn KeyExtractor> = match source {
                KeySource::Jwt => jwt::boxed(
                    self.jwt
                        .as_ref()
                        .expect("validation ensures [jwt] when keys list jwt"),
                ),
                KeySource::ApiKey => Box::new(self.api_key.clone()),
                KeySource::Ip => Box::new(self.peer_ip.clone()),
                KeySource::Global => Box::new(Global),
            };
            chain = Some(match chain {
                Some(next) => Box::new(extractor.or(next)),
                None => extractor,
            });
        }
        chain.expect("validation ensures at least one key source")
    }

    /// A layer with this configuration's keys, policies and options on
    /// `store`.
    pub fn layer(&self, store: impl Store) -> RateLimitLayer {
        let mut layer = RateLimitLayer::new(store, self.key_extractor(), self.policies.clone())
            .with_fail_mode(self.fail_mode)
            .with_local_share(self.local_share)
            .with_shadow(self.shadow)
            .with_header_style(self.header_style)
            .with_reset_format(self.reset_format);
        if !self.exempt.is_empty() || !self.exempt_api_keys.is_empty() {
            let (networks, keys) = (self.exempt.clone(), self.exempt_api_keys.clone());
            let (addresses, header) = (self.peer_ip.clone(), self.api_key_header.clone());
            layer = layer.with_exemption(move |parts| {
                let exempt_address = || {
                    addresses
                        .client(parts)
                        .is_some_and(|ip| networks.iter().any(|net| net.contains(&ip)))
                };
                let exempt_key = || {
                    parts
                        .headers
                        .get(&header)
                        .is_some_and(|key| keys.contains(&digest(key.as_bytes())))
                };
                (!networks.is_empty() && exempt_address()) || (!keys.is_empty() && exempt_key())
            });
        }
        if let RawCredentialFailures::On { limit, window } = self.credential_failures {
            layer = layer.with_credential_failures(
                CredentialFailures::new(limit, window).with_peer_ip(self.peer_ip.clone()),
            );
        }
        if !self.overrides.is_empty() {
            layer = layer.with_limit_lookup(self.overrides.clone());
        }
        if let Some(max) = self.max_delayed {
            layer = layer.with_max_delayed(max);
        }
        // Even empty: clients denied at run time are found by its address
        // resolver, behind the trusted proxies.
        layer = layer
            .with_deny_list(self.deny_list.clone())
            .with_runtime_changes(RUNTIME_CHANGES_READ_EVERY);
        if let Some(namespace) = &self.namespace {
            layer = layer.with_namespace(namespace);
        }
        match self.deny_cache {
            Some(true) => layer.with_deny_cache(DenyCache::new(DEFAULT_DENY_CACHE)),
            Some(false) => layer.with_deny_cache(None),
            None => layer,
        }
    }
}

/// How often a layer built from a file reads the changes made at run time
/// (see [`RateLimitLayer::with_runtime_changes`]).
const RUNTIME_CHANGES_READ_EVERY: Duration = Duration::from_secs(1);

/// `[deny]` as a [`DenyList`] (empty without it), its addresses behind
/// `peer_ip`'s proxies and its API keys in `api_key_header`: the list that
/// also finds the clients denied at run time.
fn deny_list(
    raw: Option<RawDeny>,
    peer_ip: &PeerIp,
    api_key_header: &HeaderName,
    source: &str,
) -> Result<DenyList, ConfigError> {
    let list = DenyList::new()
        .with_peer_ip(peer_ip.clone())
        .with_api_key_header(api_key_header.clone());
    let Some(raw) = raw else {
        return Ok(list);
    };
    if let Some(empty) = raw.api_keys.iter().find(|key| key.get_ref().is_empty()) {
        return Err(ConfigError::at(
            source,
            empty.span().start,
            "deny.api_keys",
            "API keys must not be empty",
        ));
    }
    let mut subjects = Vec::with_capacity(raw.subjects.len());
    for subject in &raw.subjects {
        let key = Key::parse(subject.get_ref()).ok_or_else(|| {
            ConfigError::at(
                source,
                subject.span().start,
                "deny.subjects",
                format!(
                    "`{}` is not a key in label form (jwt:mallory, ip:203.0.113.9)",
                    subject.get_ref()
                ),
            )
        })?;
        subjects.push(key);
    }
    Ok(list
        .with_networks(raw.ips.into_iter().map(|cidr| cidr.0))
        .with_api_keys(raw.api_keys.iter().map(|key| key.get_ref().as_bytes()))
        .with_keys(subjects))
}

/// The `[api_keys]` table as (API key, tier) pairs.
fn api_key_tiers(
    raw: Option<Spanned<BTreeMap<String, Spanned<String>>>>,
    keys_use_api_key: bool,
    source: &str,
) -> Result<Vec<(String, Arc<str>)>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    if !keys_use_api_key {
        return Err(ConfigError::at(
            source,
            raw.span().start,
            "api_keys",
            "is configured but `limiter.keys` does not list \"api_key\"",
        ));
    }
    raw.into_inner()
        .into_iter()
        .map(|(key, tier)| {
            if key.is_empty() || tier.get_ref().is_empty() {
                // Name the tier, never the key: it is a secret.
                return Err(ConfigError::at(
                    source,
                    tier.span().start,
                    "api_keys",
                    "API keys and tier names must not be empty",
                ));
            }
            Ok((key, Arc::from(tier.into_inner())))
        })
        .collect()
}

/// `limiter.extension_methods`: methods beyond HTTP's standard nine that
/// routes may name.
fn extension_methods(
    methods: &[Spanned<String>],
    source: &str,
) -> Result<Vec<http::Method>, ConfigError> {
    methods
        .iter()
        .map(|method| {
            let text = method.get_ref();
            let refuse = |message: String| {
                ConfigError::at(
                    source,
                    method.span().start,
                    "limiter.extension_methods",
                    message,
                )
            };
            if text.bytes().any(|b| b.is_ascii_lowercase()) {
                return Err(refuse(format!(
                    "methods are case-sensitive: `{text}` would be a method of its own; write `{}`",
                    text.to_ascii_uppercase()
                )));
            }
            http::Method::from_bytes(text.as_bytes())
                .map_err(|_| refuse(format!("`{text}` is not a valid HTTP method")))
        })
        .collect()
}
