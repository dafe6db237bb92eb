//! [`Listed`]: which deny list refused a request.

use crate::key::Key;

/// Which list refused a request: the label of its metric
/// (`slidegate_deny_list_total{list}`) and of its
/// [`Rejection::DenyListed`](crate::Rejection::DenyListed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Listed {
    /// The client's address, or a network it is in (`ips`).
    Address,
    /// The API key it sent (`api_keys`).
    ApiKey,
    /// The key the layer identified it by: a token's subject, say
    /// (`subjects`).
    Subject,
}

impl Listed {
    /// The list's name: `ips`, `api_keys` or `subjects`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Address => "ips",
            Self::ApiKey => "api_keys",
            Self::Subject => "subjects",
        }
    }

    /// The list a key in label form belongs to: `ip:` keys to the
    /// addresses, `key:` keys to the API keys, every other to the
    /// subjects.
    pub(crate) fn of(key: &Key) -> Self {
        let text = key.as_str();
        if text.starts_with("ip:") {
            Self::Address
        } else if text.starts_with("key:") {
            Self::ApiKey
        } else {
            Self::Subject
        }
    }
}
