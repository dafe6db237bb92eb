//! The configuration file as TOML reads it, before validation: spans kept
//! for error positions, names for every closed set of values.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer};
use toml::Spanned;

use super::jwt::RawJwt;
use super::redis::RawRedis;
use super::value::{Cidr, HumanDuration};
use crate::policy::{Algorithm, Count, FailMode};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) redis: Option<RawRedis>,
    #[serde(default)]
    pub(super) limiter: RawLimiter,
    pub(super) memory: Option<RawMemory>,
    pub(super) jwt: Option<Spanned<RawJwt>>,
    pub(super) api_keys: Option<Spanned<BTreeMap<String, Spanned<String>>>>,
    #[serde(default)]
    pub(super) policy: Vec<Spanned<RawPolicy>>,
    pub(super) default: Option<Spanned<RawPolicy>>,
    pub(super) overrides: Option<Spanned<RawOverrides>>,
    pub(super) deny: Option<RawDeny>,
    pub(super) admin: Option<RawAdmin>,
}

/// `[deny]`: clients refused `403` before any limit is counted.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawDeny {
    pub(super) ips: Vec<Cidr>,
    pub(super) api_keys: Vec<Spanned<String>>,
    pub(super) subjects: Vec<Spanned<String>>,
}

/// `[overrides]`: per client (its key in label form), per policy, a limit.
pub(super) type RawOverrides = BTreeMap<String, Spanned<BTreeMap<String, Spanned<u32>>>>;

/// The `[admin]` section: the example server's admin routes.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    pub(super) token: Spanned<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawLimiter {
    pub(super) keys: Spanned<Vec<KeySource>>,
    pub(super) api_key_header: Spanned<String>,
    pub(super) unknown_api_key: UnknownApiKeyName,
    pub(super) trusted_proxies: Vec<Cidr>,
    pub(super) exempt: Vec<Cidr>,
    pub(super) exempt_api_keys: Vec<Spanned<String>>,
    pub(super) forwarded_header: ForwardedHeaderName,
    pub(super) client_ip_header: Option<Spanned<String>>,
    pub(super) ipv6_prefix: Spanned<u8>,
    pub(super) headers: HeaderStyleName,
    pub(super) reset: ResetName,
    pub(super) fail: FailName,
    pub(super) local_share: Spanned<u32>,
    pub(super) shadow: bool,
    pub(super) deny_cache: Option<bool>,
    pub(super) credential_failures: RawCredentialFailures,
    pub(super) max_delayed: Option<Spanned<usize>>,
    pub(super) namespace: Option<Spanned<String>>,
    pub(super) extension_methods: Vec<Spanned<String>>,
}

impl Default for RawLimiter {
    fn default() -> Self {
        Self {
            keys: Spanned::new(0..0, vec![KeySource::Ip]),
            api_key_header: Spanned::new(0..0, "x-api-key".to_owned()),
            unknown_api_key: UnknownApiKeyName::Next,
            trusted_proxies: Vec::new(),
            exempt: Vec::new(),
            exempt_api_keys: Vec::new(),
            forwarded_header: ForwardedHeaderName::XForwardedFor,
            client_ip_header: None,
            ipv6_prefix: Spanned::new(0..0, 64),
            headers: HeaderStyleName::XRatelimit,
            reset: ResetName::Delta,
            fail: FailName::Open,
            local_share: Spanned::new(0..0, 1),
            shadow: false,
            deny_cache: None,
            credential_failures: RawCredentialFailures::default(),
            max_delayed: None,
            namespace: None,
            extension_methods: Vec::new(),
        }
    }
}

/// `limiter.credential_failures`: `false`, `true` (the defaults), or
/// `{ limit = 10, window = "60s" }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RawCredentialFailures {
    Off,
    On { limit: u32, window: Duration },
}

impl Default for RawCredentialFailures {
    fn default() -> Self {
        Self::On {
            limit: 10,
            window: Duration::from_secs(60),
        }
    }
}

impl<'de> Deserialize<'de> for RawCredentialFailures {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Switch;

        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Limits {
            limit: u32,
            window: HumanDuration,
        }

        impl<'de> serde::de::Visitor<'de> for Switch {
            type Value = RawCredentialFailures;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("false, true, or { limit = 10, window = \"60s\" }")
            }

            fn visit_bool<E: serde::de::Error>(self, on: bool) -> Result<Self::Value, E> {
                Ok(if on {
                    RawCredentialFailures::default()
                } else {
                    RawCredentialFailures::Off
                })
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<Self::Value, A::Error> {
                let limits =
                    Limits::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                if limits.limit == 0 {
                    return Err(serde::de::Error::custom("`limit` must be at least 1"));
                }
                if limits.window.0 < Duration::from_millis(1) {
                    return Err(serde::de::Error::custom("`window` must be at least 1ms"));
                }
                Ok(RawCredentialFailures::On {
                    limit: limits.limit,
                    window: limits.window.0,
                })
            }
        }

        deserializer.deserialize_any(Switch)
    }
}

/// The `[memory]` section: the in-process store.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMemory {
    pub(super) max_keys: Option<Spanned<usize>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum KeySource {
    Jwt,
    ApiKey,
    Ip,
    Global,
}

/// What an API key outside `[api_keys]` gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum UnknownApiKeyName {
    /// No identity: the next key source decides.
    Next,
    /// `401` with reason `unknown_api_key`.
    Reject,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum ForwardedHeaderName {
    XForwardedFor,
    Forwarded,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum HeaderStyleName {
    XRatelimit,
    Ietf,
    Both,
    None,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum ResetName {
    Delta,
    Unix,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum FailName {
    Open,
    Closed,
    Local,
}

impl From<FailName> for FailMode {
    fn from(name: FailName) -> Self {
        match name {
            FailName::Open => FailMode::Open,
            FailName::Closed => FailMode::Closed,
            FailName::Local => FailMode::Local,
        }
    }
}

/// A policy's `count`: which responses count.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum CountName {
    All,
    Failures,
    Successes,
}

impl From<CountName> for Count {
    fn from(name: CountName) -> Self {
        match name {
            CountName::All => Count::All,
            CountName::Failures => Count::Failures,
            CountName::Successes => Count::Successes,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum AlgorithmName {
    SlidingLog,
    SlidingCounter,
    FixedWindow,
    TokenBucket,
}

impl From<AlgorithmName> for Algorithm {
    fn from(name: AlgorithmName) -> Self {
        match name {
            AlgorithmName::SlidingLog => Self::SlidingLog,
            AlgorithmName::SlidingCounter => Self::SlidingCounter,
            AlgorithmName::FixedWindow => Self::FixedWindow,
            AlgorithmName::TokenBucket => Self::TokenBucket,
        }
    }
}

/// A `[[policy]]` table, or the `[default]` table, which has neither a
/// name nor a route (see `policies::build_policies`). Every key a policy
/// takes is a field here, once.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    pub(super) name: Option<Spanned<String>>,
    pub(super) route: Option<Spanned<String>>,
    pub(super) limit: Option<Spanned<u32>>,
    pub(super) window: Option<Spanned<HumanDuration>>,
    pub(super) concurrency: Option<Spanned<u32>>,
    pub(super) lease: Option<Spanned<HumanDuration>>,
    pub(super) algorithm: Option<AlgorithmName>,
    pub(super) cost: Option<Spanned<u32>>,
    pub(super) fail: Option<FailName>,
    pub(super) count: Option<CountName>,
    pub(super) shadow: Option<bool>,
    pub(super) tiers: Option<BTreeMap<String, Spanned<RawTier>>>,
    pub(super) burst: Option<Spanned<u32>>,
    pub(super) block: Option<Spanned<HumanDuration>>,
    pub(super) delay: Option<Spanned<HumanDuration>>,
    pub(super) calendar: Option<Spanned<String>>,
    pub(super) utc_offset: Option<Spanned<String>>,
    pub(super) settled: Option<Spanned<bool>>,
    pub(super) usage_header: Option<Spanned<String>>,
    pub(super) max_unsettled: Option<Spanned<u32>>,
    pub(super) slice: Option<Spanned<u32>>,
    pub(super) per: Option<Spanned<String>>,
    pub(super) per_missing: Option<Spanned<PerMissingName>>,
    pub(super) messages: Option<Spanned<RawMessages>>,
}

/// `messages = { limit = 20, window = "10s" }`: the messages a client sends
/// over the route's upgraded connections.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMessages {
    pub(super) limit: u32,
    pub(super) window: HumanDuration,
    pub(super) per_socket: Option<u32>,
    pub(super) close_code: Option<u16>,
}

/// `per_missing`: what a request without a policy's `per` key gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum PerMissingName {
    Skip,
    Refuse,
}

/// A tier's overrides in `tiers = { pro = { limit = 50 } }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTier {
    pub(super) limit: Option<Spanned<u32>>,
    pub(super) window: Option<Spanned<HumanDuration>>,
    pub(super) cost: Option<Spanned<u32>>,
    pub(super) burst: Option<Spanned<u32>>,
}
