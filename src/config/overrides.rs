//! `[overrides]`: per-client limits, `"<key label>" = { <policy> = limit }`,
//! checked against the key sources and policies of the same file.

use std::net::IpAddr;

use ipnet::IpNet;
use toml::Spanned;

use super::error::ConfigError;
use super::raw::{KeySource, RawOverrides};
use crate::key::{Key, PeerIp};
use crate::limits::Overrides;
use crate::policy::Policies;

/// The table of `[overrides]`, each client a key the configured sources
/// can make, each policy one of `policies`, each limit one the policy can count
/// exactly (the validation of the policy's own limits).
pub(super) fn overrides(
    raw: Option<Spanned<RawOverrides>>,
    keys: &[KeySource],
    peer_ip: &PeerIp,
    policies: &Policies,
    source: &str,
) -> Result<Overrides, ConfigError> {
    let mut table = Overrides::new();
    for (client, limits) in raw.map(Spanned::into_inner).into_iter().flatten() {
        // The client's line: where its table of limits starts.
        let offset = limits.span().start;
        let key = client_key(&client, offset, keys, peer_ip, source)?;
        let path = format!("overrides.\"{}\"", key.as_str());
        for (policy, limit) in limits.into_inner() {
            let refuse = |message| {
                ConfigError::at(
                    source,
                    limit.span().start,
                    format!("{path}.{policy}"),
                    message,
                )
            };
            let Some(known) = policies.iter().find(|known| known.name() == policy) else {
                return Err(refuse("names no policy of this file".to_owned()));
            };
            if let Err(invalid) = known.validate_own_limit(*limit.get_ref()) {
                return Err(refuse(format!(
                    "is no limit this policy can count: {invalid}"
                )));
            }
            table = table.with_limit(key.clone(), policy, limit.into_inner());
        }
    }
    Ok(table)
}

/// The key a client label names, refused unless a source of `limiter.keys`
/// makes keys of that form: an override nobody can match is a typo.
fn client_key(
    text: &str,
    offset: usize,
    keys: &[KeySource],
    peer_ip: &PeerIp,
    source: &str,
) -> Result<Key, ConfigError> {
    let refuse = |message: String| ConfigError::at(source, offset, "overrides", message);
    let Some(key) = Key::parse(text) else {
        return Err(refuse(
            "a client is named by its key in label form, such as \"jwt:alice\" or \
             \"ip:203.0.113.9\" (printable ASCII, at most 256 bytes)"
                .to_owned(),
        ));
    };
    let (label, value) = text.split_once(':').unwrap_or((text, ""));
    let made_by = match label {
        "jwt" => KeySource::Jwt,
        "key" => KeySource::ApiKey,
        "ip" => KeySource::Ip,
        "global" if value.is_empty() => KeySource::Global,
        _ => {
            return Err(refuse(format!(
                "`{text}` is no key the limiter makes: write \"jwt:<claim>\", \
                 \"key:#<digest>\" (as /api/whoami shows it), \"ip:<address>\" or \"global\""
            )));
        }
    };
    if !keys.contains(&made_by) {
        return Err(refuse(format!(
            "`{text}` can never match: `limiter.keys` has no source making `{label}` keys"
        )));
    }
    if made_by == KeySource::Ip {
        let address = value
            .parse::<IpAddr>()
            .ok()
            .or_else(|| value.parse::<IpNet>().ok().map(|net| net.addr()));
        let Some(address) = address else {
            return Err(refuse(format!("`{value}` is not an IP address")));
        };
        let counted = peer_ip.key_of(address);
        if counted != key {
            return Err(refuse(format!(
                "clients at {value} are counted as `{counted}`: write that"
            )));
        }
    }
    Ok(key)
}
