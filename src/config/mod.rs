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
use crate::key::{Global, Header, KeyExtractor, PeerIp, digest};
use crate::layer::RateLimitLayer;
use crate::layer::credential_failures::CredentialFailures;
use crate::layer::deny_cache::{DEFAULT_CAPACITY as DEFAULT_DENY_CACHE, DenyCache};
use crate::limits::Overrides;
use crate::policy::{Calendar, FailMode, Period, Policies, Policy, Route, TierLimits};
use crate::store::{MemoryStore, Store};

mod error;
#[cfg(feature = "jwt")]
mod jwt;
#[cfg(not(feature = "jwt"))]
#[path = "no_jwt.rs"]
mod jwt;
mod overrides;
mod raw;
mod redis;
#[cfg(feature = "redis")]
mod redis_pool;
mod value;

pub use error::ConfigError;

use error::{SPANNED_STEP, line_of, missing_field, not_utf8, syntax_error};
use raw::{
    ForwardedHeaderName, HeaderStyleName, KeySource, RawConfig, RawCredentialFailures, RawPolicy,
    RawPolicyBody, ResetName, UnknownApiKeyName,
};

#[cfg(feature = "redis")]
pub use redis::RedisSettingsError;
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
        let raw: RawConfig = serde_path_to_error::deserialize(deserializer).map_err(|e| {
            // The path serde took to the value, exact: `policy[0].limit`
            // (less the step into a `Spanned`), and a missing field's name.
            let mut path = e.path().to_string().replace(SPANNED_STEP, "");
            let error = e.into_inner();
            if let Some(field) = missing_field(error.message()) {
                path = if path == "." {
                    field.to_owned()
                } else {
                    format!("{path}.{field}")
                };
            }
            let key = match path.as_str() {
                "" | "." => None,
                // Keys of [api_keys] are secrets: name the table only.
                path if path.starts_with("api_keys") => Some("api_keys".to_owned()),
                path => Some(path.to_owned()),
            };
            // serde quotes a value of the wrong type: of a key that holds
            // a secret, only what was expected is said.
            let message = if holds_secret(&path) {
                let expected = error.message().rsplit_once(", expected ");
                format!(
                    "expected {} (the value is not shown: it may be a secret)",
                    expected.map_or("another value", |(_, expected)| expected.trim())
                )
            } else {
                // A Redis URL given as the wrong type is quoted by serde:
                // never with its password.
                without_passwords(error.message().trim())
            };
            ConfigError {
                file: None,
                line: error.span().map(|span| line_of(source, span.start)),
                key,
                message,
            }
        })?;
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
        let jwt = match raw.jwt {
            Some(jwt) if keys.contains(&KeySource::Jwt) => Some(jwt_claim(jwt, source, base)?),
            Some(jwt) => {
                return Err(ConfigError::at(
                    source,
                    jwt.span().start,
                    "jwt",
                    "is configured but `limiter.keys` does not list \"jwt\"",
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
        let mut api_key = Header::new(api_key_header.clone()).tiers(api_key_tiers(
            raw.api_keys,
            keys.contains(&KeySource::ApiKey),
            source,
        )?);
        if limiter.unknown_api_key == UnknownApiKeyName::Reject {
            api_key = api_key.reject_unknown();
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
        let policies = build_policies(raw.policy, raw.default, &extension_methods, source)?;
        let overrides = overrides::overrides(
            raw.overrides,
            limiter.keys.get_ref(),
            &peer_ip,
            &policies,
            source,
        )?;
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
            layer = layer.exempt(move |parts| {
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
        if let Some(namespace) = &self.namespace {
            layer = layer.with_namespace(namespace);
        }
        match self.deny_cache {
            Some(true) => layer.with_deny_cache(DenyCache::new(DEFAULT_DENY_CACHE)),
            Some(false) => layer.without_deny_cache(),
            None => layer,
        }
    }
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

fn build_policies(
    raw: Vec<Spanned<RawPolicy>>,
    default: Option<Spanned<RawPolicyBody>>,
    extension_methods: &[http::Method],
    source: &str,
) -> Result<Policies, ConfigError> {
    let mut builder = Policies::builder();
    for method in extension_methods {
        builder = builder.extension_method(method.clone());
    }
    let mut seen = std::collections::HashSet::new();
    for (index, raw) in raw.into_iter().enumerate() {
        let prefix = format!("policy[{index}]");
        let table_offset = raw.span().start;
        let (name, route, body) = raw.into_inner().split();
        let name_span = name.span();
        let name = name.into_inner();
        if !seen.insert(name.clone()) {
            return Err(ConfigError::at(
                source,
                name_span.start,
                format!("{prefix}.name"),
                format!("`{name}` is used by another policy"),
            ));
        }
        let offsets = (table_offset, name_span.start);
        let policy = policy_from(&name, &body, &prefix, offsets, source)?;
        builder = match route {
            Some(route) => {
                Route::parse_allowing(route.get_ref(), extension_methods).map_err(|e| {
                    ConfigError::at(
                        source,
                        route.span().start,
                        format!("{prefix}.route"),
                        e.to_string(),
                    )
                })?;
                builder.route(route.into_inner(), policy)
            }
            None => builder.every_route(policy),
        };
    }
    if let Some(body) = default {
        let offset = body.span().start;
        if seen.contains("default") {
            return Err(ConfigError::at(
                source,
                offset,
                "default",
                "a [[policy]] is already named `default`",
            ));
        }
        let policy = policy_from(
            "default",
            body.get_ref(),
            "default",
            (offset, offset),
            source,
        )?;
        builder = builder.default_policy(policy);
    }
    builder.build().map_err(|e| ConfigError {
        file: None,
        line: None,
        key: None,
        message: e.to_string(),
    })
}

/// Where a setting of `body` is written, if it is.
fn offset_of<T>(value: Option<&Spanned<T>>) -> Option<usize> {
    value.map(|value| value.span().start)
}

/// A policy's kind from its table: a rate (`limit` per `window`), a
/// concurrency limit (`concurrency`, with an optional `lease`), or a
/// calendar quota (`limit` per `calendar` period, at an optional
/// `utc_offset`).
fn kind_of(
    name: &str,
    body: &RawPolicyBody,
    prefix: &str,
    table_offset: usize,
    source: &str,
) -> Result<Policy, ConfigError> {
    let refuse = |offset: usize, key: &str, message: &str| {
        ConfigError::at(source, offset, format!("{prefix}.{key}"), message)
    };
    if let Some(period) = &body.calendar {
        return calendar_of(name, period, body, refuse);
    }
    if let Some(offset) = &body.utc_offset {
        return Err(refuse(
            offset.span().start,
            "utc_offset",
            "applies only to a `calendar` quota",
        ));
    }
    match (&body.concurrency, &body.limit, &body.window) {
        (Some(in_flight), None, None) => {
            if body.algorithm.is_some() {
                return Err(refuse(
                    offset_of(Some(in_flight)).unwrap_or(table_offset),
                    "algorithm",
                    "does not apply to a concurrency limit",
                ));
            }
            let policy = Policy::concurrency(name, *in_flight.get_ref());
            Ok(match &body.lease {
                Some(lease) => policy.with_lease(lease.get_ref().0),
                None => policy,
            })
        }
        (Some(_), limit, window) => Err(refuse(
            offset_of(limit.as_ref())
                .or(offset_of(window.as_ref()))
                .unwrap_or(table_offset),
            "concurrency",
            "replaces `limit` and `window`: give one or the other",
        )),
        (None, Some(limit), Some(window)) => match &body.lease {
            Some(lease) => Err(refuse(
                lease.span().start,
                "lease",
                "applies only to a `concurrency` limit",
            )),
            None => Ok(Policy::new(name, *limit.get_ref(), window.get_ref().0)),
        },
        (None, None, _) => Err(refuse(
            table_offset,
            "limit",
            "missing: give `limit` and `window`, or `concurrency`",
        )),
        (None, Some(_), None) => Err(refuse(
            table_offset,
            "window",
            "missing: give `window` with `limit`",
        )),
    }
}

/// A calendar quota's policy from its table: `limit` per `period`, at
/// its `utc_offset`; `refuse` words an error.
fn calendar_of(
    name: &str,
    period: &Spanned<String>,
    body: &RawPolicyBody,
    refuse: impl Fn(usize, &str, &str) -> ConfigError,
) -> Result<Policy, ConfigError> {
    let in_place = [
        ("window", offset_of(body.window.as_ref())),
        ("algorithm", body.algorithm.map(|_| period_offset(body))),
        ("concurrency", offset_of(body.concurrency.as_ref())),
        ("lease", offset_of(body.lease.as_ref())),
    ];
    if let Some((key, Some(offset))) = in_place.into_iter().find(|(_, offset)| offset.is_some()) {
        return Err(refuse(
            offset,
            key,
            "does not go with `calendar`, which replaces it",
        ));
    }
    let named = [Period::Day, Period::Week, Period::Month, Period::Year]
        .into_iter()
        .find(|named| named.name() == period.get_ref());
    let Some(period) = named else {
        return Err(refuse(
            period.span().start,
            "calendar",
            "must be day, week, month or year",
        ));
    };
    let Some(limit) = &body.limit else {
        return Err(refuse(
            period_offset(body),
            "limit",
            "missing: give `limit` with `calendar`",
        ));
    };
    let mut calendar = Calendar::new(period);
    if let Some(offset) = &body.utc_offset {
        calendar = utc_offset(calendar, offset.get_ref()).ok_or_else(|| {
            refuse(
                offset.span().start,
                "utc_offset",
                "must be \"+HH:MM\" or \"-HH:MM\", under 24 hours",
            )
        })?;
    }
    Ok(Policy::calendar(name, *limit.get_ref(), calendar))
}

/// Where a policy's `calendar` is written.
fn period_offset(body: &RawPolicyBody) -> usize {
    body.calendar
        .as_ref()
        .map_or(0, |period| period.span().start)
}

/// `calendar` at the offset `text` says: `+HH:MM` or `-HH:MM` (`Z` for
/// UTC), hours 0 to 23 and minutes 0 to 59.
fn utc_offset(calendar: Calendar, text: &str) -> Option<Calendar> {
    if text == "Z" {
        return Some(calendar);
    }
    let (east, rest) = match text.as_bytes().first()? {
        b'+' => (true, &text[1..]),
        b'-' => (false, &text[1..]),
        _ => return None,
    };
    let (hours, minutes) = rest.split_once(':')?;
    let two_digits = |part: &str, below: u64| {
        (part.len() == 2 && part.bytes().all(|b| b.is_ascii_digit()))
            .then(|| part.parse::<u64>().ok())
            .flatten()
            .filter(|&value| value < below)
    };
    let offset = Duration::from_secs(two_digits(hours, 24)? * 3600 + two_digits(minutes, 60)? * 60);
    Some(if east {
        calendar.east_of_utc(offset)
    } else {
        calendar.west_of_utc(offset)
    })
}

/// `policy`, settled after the response as `body` says: `settled = true`
/// for the handle alone, `usage_header` for a header (or trailer) too.
fn settled(
    policy: Policy,
    body: &RawPolicyBody,
    prefix: &str,
    source: &str,
) -> Result<Policy, ConfigError> {
    let refuse = |offset: usize, key: &str, message: &str| {
        ConfigError::at(source, offset, format!("{prefix}.{key}"), message)
    };
    let settled = body.settled.as_ref().map(|settled| *settled.get_ref());
    match (&body.usage_header, settled) {
        (Some(_), Some(false)) => Err(refuse(
            offset_of(body.settled.as_ref()).unwrap_or_default(),
            "settled",
            "is false, but `usage_header` settles the cost after the response",
        )),
        (Some(header), _) => match HeaderName::from_bytes(header.get_ref().as_bytes()) {
            Ok(name) => Ok(policy.with_usage_header(name)),
            Err(_) => Err(refuse(
                header.span().start,
                "usage_header",
                "is not a valid header name",
            )),
        },
        (None, Some(true)) => Ok(policy.settled_after_response()),
        (None, _) => Ok(policy),
    }
    .and_then(|policy| match &body.max_unsettled {
        Some(max) if !policy.is_settled_after_response() => Err(refuse(
            max.span().start,
            "max_unsettled",
            "bounds reservations of a policy settled after the response: set `usage_header` \
             or `settled = true`",
        )),
        Some(max) => Ok(policy.with_max_unsettled(*max.get_ref())),
        None => Ok(policy),
    })
}

fn policy_from(
    name: &str,
    body: &RawPolicyBody,
    prefix: &str,
    (table_offset, name_offset): (usize, usize),
    source: &str,
) -> Result<Policy, ConfigError> {
    let mut policy = kind_of(name, body, prefix, table_offset, source)?;
    if let Some(algorithm) = body.algorithm {
        policy = policy.with_algorithm(algorithm.into());
    }
    if let Some(cost) = &body.cost {
        policy = policy.with_cost(*cost.get_ref());
    }
    if let Some(fail) = body.fail {
        policy = policy.with_fail_mode(fail.into());
    }
    if let Some(count) = body.count {
        policy = policy.with_count(count.into());
    }
    if let Some(shadow) = body.shadow {
        policy = policy.with_shadow(shadow);
    }
    if let Some(burst) = &body.burst {
        policy = policy.with_burst(*burst.get_ref());
    }
    if let Some(block) = &body.block {
        policy = policy.with_block(block.get_ref().0);
    }
    if let Some(delay) = &body.delay {
        policy = policy.with_delay(delay.get_ref().0);
    }
    policy = settled(policy, body, prefix, source)?;
    Policies::single(policy.clone()).map_err(|error| {
        let key = error.field();
        let offset = match key {
            "limit" => offset_of(body.limit.as_ref()).or(offset_of(body.concurrency.as_ref())),
            "window" => offset_of(body.window.as_ref()).or(offset_of(body.lease.as_ref())),
            "cost" => offset_of(body.cost.as_ref()),
            "burst" => offset_of(body.burst.as_ref()),
            "block" => offset_of(body.block.as_ref()),
            "delay" => offset_of(body.delay.as_ref()),
            "concurrency" => offset_of(body.concurrency.as_ref()),
            "calendar" => offset_of(body.calendar.as_ref()),
            "utc_offset" => offset_of(body.utc_offset.as_ref()),
            "settled" => offset_of(body.settled.as_ref()).or(offset_of(body.usage_header.as_ref())),
            "max_unsettled" => offset_of(body.max_unsettled.as_ref()),
            "name" => Some(name_offset),
            _ => None,
        }
        .unwrap_or(table_offset);
        // A concurrency limit's `limit` and `window` are written
        // `concurrency` and `lease`.
        let key = match (key, body.concurrency.is_some()) {
            ("limit", true) => "concurrency",
            ("window", true) => "lease",
            (key, _) => key,
        };
        ConfigError::at(source, offset, format!("{prefix}.{key}"), error.to_string())
    })?;
    for (tier, raw) in body.tiers.iter().flatten() {
        let tier_offset = raw.span().start;
        let raw = raw.get_ref();
        let mut limits = TierLimits::new();
        if let Some(limit) = &raw.limit {
            limits = limits.with_limit(*limit.get_ref());
        }
        if let Some(window) = &raw.window {
            limits = limits.with_window(window.get_ref().0);
        }
        if let Some(cost) = &raw.cost {
            limits = limits.with_cost(*cost.get_ref());
        }
        if let Some(burst) = &raw.burst {
            limits = limits.with_burst(*burst.get_ref());
        }
        let with_tier = policy.clone().with_tier(tier.as_str(), limits);
        Policies::single(with_tier.clone()).map_err(|error| {
            // The tier's own setting, else its limit, else the tier.
            let key = error.field();
            let own = match key {
                "limit" => raw.limit.as_ref().map(|limit| limit.span().start),
                "window" => raw.window.as_ref().map(|window| window.span().start),
                "burst" => raw.burst.as_ref().map(|burst| burst.span().start),
                _ => raw.cost.as_ref().map(|cost| cost.span().start),
            };
            let offset = own
                .or(raw.limit.as_ref().map(|limit| limit.span().start))
                .unwrap_or(tier_offset);
            ConfigError::at(
                source,
                offset,
                format!("{prefix}.tiers.{tier}.{key}"),
                error.to_string(),
            )
        })?;
        policy = with_tier;
    }
    Ok(policy)
}

/// Whether the key at `path` holds a secret: API keys (as `[api_keys]`
/// keys or `limiter.exempt_api_keys`), JWT secrets, the admin token.
fn holds_secret(path: &str) -> bool {
    path.starts_with("api_keys")
        || path.starts_with("limiter.exempt_api_keys")
        || path == "jwt.secret"
        || (path.starts_with("jwt.keys") && path.ends_with(".secret"))
        || path == "admin.token"
}

/// `message` with the user information of every URL in it (`scheme://user:password@`)
/// written as `***`.
fn without_passwords(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("://") {
        out.push_str(&rest[..at + 3]);
        rest = &rest[at + 3..];
        let end = rest
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '/' | ','))
            .unwrap_or(rest.len());
        if let Some(user_end) = rest[..end].rfind('@') {
            out.push_str("***");
            rest = &rest[user_end..];
        }
    }
    out.push_str(rest);
    out
}
