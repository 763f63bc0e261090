//! [`Secret`]: a connection URL that may carry credentials.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What a redacted password (or a whole unparsable URL) is replaced with.
pub const REDACTED: &str = "***";

/// A connection URL (`database.url`, `redis.url`) that may carry a password.
///
/// `Debug` and `Display` print the URL with the password (and any `password`
/// query parameter) replaced by `***`; a value that does not parse as a URL is
/// printed as `***` altogether, because there is no way to tell which part of it
/// is the password. [`Secret::expose`] returns the real value, for the one place
/// that opens the connection.
///
/// It serializes and deserializes as a plain string so that figment can carry
/// it; never serialize a [`Config`](super::Config) holding real secrets to show it
/// to anyone: use [`Config::to_redacted_toml`](super::Config::to_redacted_toml).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a URL.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The real value, password included. Use it only to open the connection.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with its password replaced by `***`.
    pub fn redacted(&self) -> String {
        redact_url(&self.0)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.redacted(), f)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// Replaces the password of `raw` (userinfo and `password=` query parameters)
/// with `***`. Returns `***` when `raw` is not a URL.
fn redact_url(raw: &str) -> String {
    let Ok(mut url) = url::Url::parse(raw) else {
        return REDACTED.to_owned();
    };
    if url.password().is_some() && url.set_password(Some(REDACTED)).is_err() {
        // A URL that has a password but cannot have one set is not something the
        // url crate produces; be safe rather than print it.
        return REDACTED.to_owned();
    }
    let has_secret_param = url
        .query_pairs()
        .any(|(k, _)| k.to_ascii_lowercase().contains("password"));
    if has_secret_param {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if k.to_ascii_lowercase().contains("password") {
                    REDACTED.to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
    }
    url.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_userinfo_password() {
        let s = Secret::new("postgres://app:hunter2@db:5432/outpost");
        assert_eq!(s.to_string(), "postgres://app:***@db:5432/outpost");
        assert_eq!(format!("{s:?}"), "\"postgres://app:***@db:5432/outpost\"");
        assert_eq!(s.expose(), "postgres://app:hunter2@db:5432/outpost");
    }

    #[test]
    fn redacts_redis_password_without_user() {
        let s = Secret::new("rediss://:hunter2@cache:6380/0");
        assert_eq!(s.to_string(), "rediss://:***@cache:6380/0");
    }

    #[test]
    fn keeps_url_without_password() {
        let s = Secret::new("redis://127.0.0.1:6379");
        assert_eq!(s.to_string(), "redis://127.0.0.1:6379");
    }

    #[test]
    fn redacts_password_query_parameter() {
        let s = Secret::new("postgresql://db/outpost?user=app&password=hunter2");
        let shown = s.to_string();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("user=app"), "{shown}");
    }

    #[test]
    fn unparsable_value_is_hidden_entirely() {
        let s = Secret::new("hunter2 not a url");
        assert_eq!(s.to_string(), REDACTED);
    }
}
