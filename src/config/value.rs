//! Values the configuration file writes as text: durations and CIDRs.

use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer};

/// A humantime duration such as `"60s"` or `"1h 30m"`.
#[derive(Debug, Clone, Copy)]
pub(super) struct HumanDuration(pub(super) Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        humantime::parse_duration(&text)
            .map(HumanDuration)
            .map_err(|e| {
                serde::de::Error::custom(format!(
                    "`{text}` is not a duration ({e}); write e.g. \"60s\" or \"1h\""
                ))
            })
    }
}

/// A CIDR such as `"10.0.0.0/8"`, or one address.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cidr(pub(super) IpNet);

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse::<IpNet>()
            .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
            .map(Cidr)
            .map_err(|_| {
                serde::de::Error::custom(format!("`{text}` is not a CIDR range or an IP address"))
            })
    }
}
