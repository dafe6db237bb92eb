//! The `[[policy]]` tables and the `[default]` table as [`Policies`]: each
//! setting checked where it is written, and a policy's errors named by
//! its key and line.

use std::collections::HashSet;
use std::time::Duration;

use http::HeaderName;
use toml::Spanned;

use super::error::ConfigError;
use super::per::PerSources;
use super::raw::RawPolicy;
use crate::policy::{Calendar, MessageRate, Period, Policies, Policy, Route, TierLimits};

/// The policies of `raw` (`[[policy]]`, in order) and `default`, with
/// routes that may name `extension_methods`.
pub(super) fn build_policies(
    raw: Vec<Spanned<RawPolicy>>,
    default: Option<Spanned<RawPolicy>>,
    extension_methods: &[http::Method],
    sources: &PerSources<'_>,
    source: &str,
) -> Result<Policies, ConfigError> {
    let mut builder = Policies::builder();
    for method in extension_methods {
        builder = builder.with_extension_method(method.clone());
    }
    let mut seen = HashSet::new();
    for (index, raw) in raw.into_iter().enumerate() {
        let prefix = format!("policy[{index}]");
        let table_offset = raw.span().start;
        let mut body = raw.into_inner();
        let (name, route) = (body.name.take(), body.route.take());
        let Some(name) = name else {
            return Err(ConfigError::at(
                source,
                table_offset,
                format!("{prefix}.name"),
                "missing field `name`",
            ));
        };
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
        let policy = policy_from(&name, &body, &prefix, offsets, sources, source)?;
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
                builder.with_route(route.into_inner(), policy)
            }
            None => builder.with_every_route(policy),
        };
    }
    if let Some(body) = default {
        let offset = body.span().start;
        // The policy for routes no other names: no name, no route.
        for (key, value) in [
            ("name", &body.get_ref().name),
            ("route", &body.get_ref().route),
        ] {
            if let Some(value) = value {
                return Err(ConfigError::at(
                    source,
                    value.span().start,
                    format!("default.{key}"),
                    format!(
                        "`[default]` takes no `{key}`: it is the policy of routes no `[[policy]]` names"
                    ),
                ));
            }
        }
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
            sources,
            source,
        )?;
        builder = builder.with_default(policy);
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
    body: &RawPolicy,
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
    body: &RawPolicy,
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
fn period_offset(body: &RawPolicy) -> usize {
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
        calendar.with_east_of_utc(offset)
    } else {
        calendar.with_west_of_utc(offset)
    })
}

/// `policy`, settled after the response as `body` says: `settled = true`
/// for the handle alone, `usage_header` for a header (or trailer) too.
fn settled(
    policy: Policy,
    body: &RawPolicy,
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
        (None, Some(true)) => Ok(policy.with_settlement(true)),
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
    body: &RawPolicy,
    prefix: &str,
    (table_offset, name_offset): (usize, usize),
    sources: &PerSources<'_>,
    source: &str,
) -> Result<Policy, ConfigError> {
    let mut policy = kind_of(name, body, prefix, table_offset, source)?;
    policy = sources.counted_per(policy, body, prefix, source)?;
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
    if let Some(slice) = &body.slice {
        policy = policy.with_slice(*slice.get_ref());
    }
    if let Some(messages) = &body.messages {
        let raw = messages.get_ref();
        let mut rate = MessageRate::new(raw.limit, raw.window.0);
        if let Some(per_socket) = raw.per_socket {
            rate = rate.with_per_socket(per_socket);
        }
        if let Some(code) = raw.close_code {
            rate = rate.with_close_code(code);
        }
        policy = policy.with_messages(rate);
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
            "slice" => offset_of(body.slice.as_ref()),
            "messages" => offset_of(body.messages.as_ref()),
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
