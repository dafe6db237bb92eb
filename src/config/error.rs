//! [`ConfigError`]: where a configuration file went wrong, to the key and
//! line.

use std::fmt;
use std::path::{Path, PathBuf};

/// A configuration file that could not be used: where, which key, and why.
///
/// ```
/// use slidegate::config::Config;
///
/// let error = Config::from_toml_str("[[policy]]\nname = \"search\"\nlimit = 0\nwindow = \"60s\"\n")
///     .unwrap_err();
/// assert_eq!(error.line(), Some(3));
/// assert_eq!(error.key(), Some("policy[0].limit"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub(super) file: Option<PathBuf>,
    pub(super) line: Option<usize>,
    pub(super) key: Option<String>,
    pub(super) message: String,
}

impl ConfigError {
    /// The 1-based line of the offending key, when known.
    pub fn line(&self) -> Option<usize> {
        self.line
    }

    /// The offending key, e.g. `policy[1].cost`, when known.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    pub(super) fn at(
        source: &str,
        offset: usize,
        key: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            file: None,
            line: Some(line_of(source, offset)),
            key: Some(key.into()),
            message: message.into(),
        }
    }

    /// An error of `key` found as the settings are used (building a Redis
    /// store), not as the file is read.
    #[cfg(feature = "redis")]
    pub(super) fn of(key: &str, message: impl Into<String>) -> Self {
        Self {
            file: None,
            line: None,
            key: Some(key.to_owned()),
            message: message.into(),
        }
    }

    pub(super) fn in_file(mut self, file: &Path) -> Self {
        self.file = Some(file.to_owned());
        self
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.file {
            Some(file) => write!(f, "{}", file.display())?,
            None => f.write_str("config")?,
        }
        if let Some(line) = self.line {
            write!(f, ", line {line}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ", key `{key}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ConfigError {}

pub(super) fn line_of(source: &str, offset: usize) -> usize {
    source[..offset.min(source.len())].matches('\n').count() + 1
}

/// The step a path takes into a `toml::Spanned` value, which is not a key
/// of the file.
pub(super) const SPANNED_STEP: &str = ".$__serde_spanned_private_value";

/// The field a "missing field `name`" error names.
pub(super) fn missing_field(message: &str) -> Option<&str> {
    message.strip_prefix("missing field `")?.split('`').next()
}

/// A file that is not TOML at all: the line is exact, the key the one
/// written on it, if any (the table only, in `[api_keys]`, whose keys are
/// secrets).
pub(super) fn syntax_error(source: &str, error: &toml::de::Error) -> ConfigError {
    let offset = error.span().map_or(0, |span| span.start);
    let key = error.span().and_then(|_| key_to_name(source, offset));
    ConfigError {
        file: None,
        line: error.span().map(|_| line_of(source, offset)),
        key,
        message: error.message().trim().to_owned(),
    }
}

/// A file that is not UTF-8 text: the line of its first byte that is
/// not, and the key written on it (as [`syntax_error`] names it).
pub(super) fn not_utf8(error: &std::string::FromUtf8Error) -> ConfigError {
    let text = String::from_utf8_lossy(error.as_bytes());
    // The text before the first bad byte is the same in `text`.
    let offset = error.utf8_error().valid_up_to();
    ConfigError {
        file: None,
        line: Some(line_of(&text, offset)),
        key: key_to_name(&text, offset),
        message: "is not UTF-8 text (TOML files are UTF-8)".to_owned(),
    }
}

/// The key an error on the line at `offset` names: the one written there,
/// or only the table in `[api_keys]`, whose keys are secrets.
fn key_to_name(source: &str, offset: usize) -> Option<String> {
    let key = key_on_line(source, offset)?;
    Some(if section_of(source, offset) == Some("api_keys") {
        "api_keys".to_owned()
    } else {
        key
    })
}

/// The key written on the line at `offset`: `name` of `name = value`, or
/// the table of a `[table]` header.
pub(super) fn key_on_line(source: &str, offset: usize) -> Option<String> {
    let offset = offset.min(source.len());
    let start = source[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line = source[start..].lines().next()?.trim();
    if let Some((key, _)) = line.split_once('=') {
        return Some(key.trim().trim_matches('"').to_owned());
    }
    line.starts_with('[').then(|| {
        line.trim_matches(|c| c == '[' || c == ']')
            .trim()
            .to_owned()
    })
}

/// The `[table]` that the line at `offset` belongs to.
pub(super) fn section_of(source: &str, offset: usize) -> Option<&str> {
    source[..offset.min(source.len())]
        .lines()
        .rev()
        .map(str::trim)
        .find_map(|line| line.strip_prefix('['))
        .and_then(|header| header.split(']').next())
        .map(str::trim)
}

/// A file TOML reads but the configuration's types refuse: the key by
/// the exact path serde took to it (a missing field's name included),
/// the line, and serde's message, which never quotes a secret or a
/// password in a URL.
pub(super) fn unreadable(
    source: &str,
    e: serde_path_to_error::Error<toml::de::Error>,
) -> ConfigError {
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
