//! Range and consistency checks on a typed [`Config`].

use std::net::SocketAddr;

use figment::value::Value;

use super::schema::{FIELDS, Kind};
use super::{Config, NO_DESTINATION, REFUSE, Secret, TEMPLATE_PLACEHOLDERS, WARN};

/// One failed check, before its source is known.
#[derive(Debug, Clone)]
pub(crate) struct Issue {
    /// Path of the offending key.
    pub path: Vec<String>,
    /// What is wrong and how to fix it.
    pub message: String,
    /// Other keys this check depends on (their sources are named in the message,
    /// and the issue is dropped when one of them could not be read at all).
    pub related: Vec<&'static str>,
}

impl Issue {
    fn new(key: &str, message: impl Into<String>) -> Self {
        Self {
            path: key.split('.').map(str::to_owned).collect(),
            message: message.into(),
            related: Vec::new(),
        }
    }

    fn at(path: Vec<String>, message: impl Into<String>) -> Self {
        Self {
            path,
            message: message.into(),
            related: Vec::new(),
        }
    }

    fn related(mut self, keys: &[&'static str]) -> Self {
        self.related.extend_from_slice(keys);
        self
    }

    pub fn key(&self) -> String {
        self.path.join(".")
    }
}

/// Every failed check of `config`.
pub(crate) fn check(config: &Config) -> Vec<Issue> {
    let mut issues = Vec::new();
    check_ranges(config, &mut issues);

    let url_checks = [
        (
            "database.url",
            &config.database.url,
            &["postgres", "postgresql"][..],
            "postgres://user:password@host:5432/dbname",
        ),
        (
            "redis.url",
            &config.redis.url,
            &["redis", "rediss"][..],
            "redis://host:6379 or rediss://:password@host:6380",
        ),
    ];
    for (key, url, schemes, example) in url_checks {
        if let Some(url) = url
            && let Err(message) = check_url(url, schemes, example)
        {
            issues.push(Issue::new(key, message));
        }
    }

    let prefix = &config.redis.key_prefix;
    if prefix.chars().count() > 64 {
        issues.push(Issue::new(
            "redis.key_prefix",
            format!(
                "is {} characters long, the limit is 64; use a shorter prefix such as \"outpost:\"",
                prefix.chars().count()
            ),
        ));
    }
    if prefix.chars().any(char::is_control) {
        issues.push(Issue::new(
            "redis.key_prefix",
            "contains control characters (newline, tab, ...); use printable characters only",
        ));
    }

    if crate::publish::companion_key(prefix, "fence", &format!("{prefix}stream")).is_err() {
        issues.push(Issue::new(
            "redis.key_prefix",
            format!(
                "= {prefix:?} holds braces that are not a Redis Cluster hash tag; use none, or \
                 one non-empty {{tag}} such as \"{{outpost}}:\" (which puts every key in one slot)"
            ),
        ));
    }
    check_cluster(&config.redis, &mut issues);

    let id = &config.node.id;
    if !id.is_empty() {
        if id.chars().count() > 64 {
            issues.push(Issue::new(
                "node.id",
                format!(
                    "is {} characters long, the limit is 64; use a shorter id, or \"\" to \
                     derive it from the hostname and pid",
                    id.chars().count()
                ),
            ));
        }
        if !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            issues.push(Issue::new(
                "node.id",
                format!(
                    "= {id:?} may only contain letters, digits, `.`, `_` and `-`; change it, \
                     or set \"\" to derive it from the hostname and pid"
                ),
            ));
        }
    }

    let node = &config.node;
    if node.lease_ms < node.heartbeat_ms.saturating_mul(3) {
        issues.push(
            Issue::new(
                "node.lease_ms",
                format!(
                    "is {} but must be at least 3 × node.heartbeat_ms = {}, or a node that misses \
                     a couple of heartbeats loses its lease while alive; raise node.lease_ms or \
                     lower node.heartbeat_ms",
                    node.lease_ms,
                    node.heartbeat_ms.saturating_mul(3)
                ),
            )
            .related(&["node.heartbeat_ms"]),
        );
    }

    if let Err(e) = config.admin.listen.parse::<SocketAddr>() {
        issues.push(Issue::new(
            "admin.listen",
            format!(
                "= {:?} is not an IP address with a port ({e}); write it as \"127.0.0.1:9400\" or \
                 \"[::1]:9400\" (a host name is not accepted)",
                config.admin.listen
            ),
        ));
    }

    let relay = &config.relay;
    if relay.backoff_max_ms < relay.backoff_base_ms {
        issues.push(
            Issue::new(
                "relay.backoff_max_ms",
                format!(
                    "is {} but must be at least relay.backoff_base_ms = {}; raise \
                     relay.backoff_max_ms or lower relay.backoff_base_ms",
                    relay.backoff_max_ms, relay.backoff_base_ms
                ),
            )
            .related(&["relay.backoff_base_ms"]),
        );
    }

    check_routing(config, &mut issues);
    check_retention(config, &mut issues);

    let level = config.log.level.trim();
    if level.is_empty() {
        issues.push(Issue::new(
            "log.level",
            "is empty; set a tracing filter such as \"info\" or \"outpost=debug,info\"",
        ));
    } else if let Err(e) = tracing_subscriber::EnvFilter::try_new(level) {
        issues.push(Issue::new(
            "log.level",
            format!(
                "= {level:?} is not a valid tracing filter ({e}); use a level (error, warn, info, \
                 debug, trace) or directives such as \"outpost=debug,info\""
            ),
        ));
    }
    if !matches!(config.log.format.as_str(), "text" | "json") {
        issues.push(Issue::new(
            "log.format",
            format!(
                "= {:?} is not a log format; use \"text\" or \"json\"",
                config.log.format
            ),
        ));
    }
    issues
}

/// Every integer key against its range in the schema.
fn check_ranges(config: &Config, issues: &mut Vec<Issue>) {
    let (current, defaults) = match (
        Value::serialize(config),
        Value::serialize(Config::default()),
    ) {
        (Ok(c), Ok(d)) => (c, d),
        (Err(e), _) | (_, Err(e)) => {
            // Plain structs of integers and strings always serialize.
            issues.push(Issue::new(
                "",
                format!("internal error while checking ranges: {e}"),
            ));
            return;
        }
    };
    for field in FIELDS {
        let Kind::UInt { min, max } = field.kind else {
            continue;
        };
        let key = field.key();
        let Some(value) = current.find_ref(&key).and_then(Value::to_u128) else {
            continue;
        };
        if value < u128::from(min) || value > u128::from(max) {
            let default = defaults
                .find_ref(&key)
                .and_then(Value::to_u128)
                .map(|d| d.to_string())
                .unwrap_or_default();
            let unit = if field.unit.is_empty() {
                String::new()
            } else {
                format!(" {}", field.unit)
            };
            issues.push(Issue::new(
                &key,
                format!(
                    "is {value}, outside its range: it must be between {min} and {max}{unit}; \
                     set a value in that range, or remove it to use the default {default}"
                ),
            ));
        }
    }
}

fn check_url(url: &Secret, schemes: &[&str], example: &str) -> Result<(), String> {
    // Never echo any part of the value: even its "scheme" may be a password when
    // the URL was mistyped.
    let parsed = url::Url::parse(url.expose())
        .map_err(|e| format!("is not a valid URL ({e}); write it as {example}"))?;
    if !schemes.contains(&parsed.scheme()) {
        let wanted: Vec<String> = schemes.iter().map(|s| format!("{s}://")).collect();
        return Err(format!(
            "must start with {}; write it as {example}",
            wanted.join(" or ")
        ));
    }
    Ok(())
}

/// The re-publish window must still be in the outbox when Redis loses data.
fn check_retention(config: &Config, issues: &mut Vec<Issue>) {
    let policy = &config.redis.maxmemory_policy_check;
    if policy != REFUSE && policy != WARN {
        issues.push(Issue::new(
            "redis.maxmemory_policy_check",
            format!("= {policy:?} is not a choice; use \"{REFUSE}\" or \"{WARN}\""),
        ));
    }
    let r = &config.retention;
    if r.republish_window_secs == 0 {
        return;
    }
    if config.relay.delete_published {
        issues.push(
            Issue::new(
                "retention.republish_window_secs",
                format!(
                    "is {} but relay.delete_published = true keeps no published rows to \
                     re-publish after Redis loses data; set retention.republish_window_secs = 0 \
                     (alert only) or relay.delete_published = false",
                    r.republish_window_secs
                ),
            )
            .related(&["relay.delete_published"]),
        );
    } else if r.enabled && r.published_secs < r.republish_window_secs {
        issues.push(
            Issue::new(
                "retention.published_secs",
                format!(
                    "is {} but must be at least retention.republish_window_secs = {}: the rows \
                     to re-publish after Redis loses data must still be in the outbox; raise \
                     retention.published_secs or lower retention.republish_window_secs",
                    r.published_secs, r.republish_window_secs
                ),
            )
            .related(&["retention.republish_window_secs"]),
        );
    }
}

fn check_routing(config: &Config, issues: &mut Vec<Issue>) {
    let routing = &config.routing;
    if let Err(message) = check_template(&routing.stream) {
        issues.push(Issue::new("routing.stream", message));
    }
    for (event_type, template) in &routing.overrides {
        let path = vec![
            "routing".to_owned(),
            "overrides".to_owned(),
            event_type.clone(),
        ];
        if event_type.trim().is_empty() {
            issues.push(Issue::at(
                path.clone(),
                "has an empty event type as key; name the event type this override applies to",
            ));
        }
        if template == NO_DESTINATION {
            continue;
        }
        if let Err(message) = check_template(template) {
            issues.push(Issue::at(
                path,
                format!("{message} (or use \"{NO_DESTINATION}\" for no destination)"),
            ));
        }
    }
    for (i, event_type) in routing.no_destination.iter().enumerate() {
        if event_type.trim().is_empty() {
            issues.push(Issue::new(
                "routing.no_destination",
                format!("entry {} is empty; remove it or name an event type", i + 1),
            ));
        } else if routing
            .overrides
            .get(event_type)
            .is_some_and(|t| t != NO_DESTINATION)
        {
            issues.push(
                Issue::new(
                    "routing.no_destination",
                    format!(
                        "lists {event_type:?}, which routing.overrides routes to a stream; remove \
                         it from one of the two"
                    ),
                )
                .related(&["routing.overrides"]),
            );
        }
    }
}

/// Cluster seeds are `host:port`, and only mean something on a cluster.
fn check_cluster(redis: &super::RedisConfig, issues: &mut Vec<Issue>) {
    if !redis.cluster && !redis.cluster_seeds.is_empty() {
        issues.push(Issue::new(
            "redis.cluster_seeds",
            "is set but redis.cluster is false; set redis.cluster = true if redis.url names a \
             Redis Cluster node, or remove the seeds",
        ));
    }
    for seed in &redis.cluster_seeds {
        if let Err(message) = crate::publish::parse_seed(seed) {
            issues.push(Issue::new("redis.cluster_seeds", message));
        }
    }
    if redis.cluster
        && let Some(url) = &redis.url
        && url.expose().starts_with("rediss:")
        && !redis.cluster_seeds.is_empty()
    {
        issues.push(Issue::new(
            "redis.cluster_seeds",
            "cannot be combined with a rediss:// URL; list the nodes' addresses through the \
             cluster's own discovery (redis.url alone)",
        ));
    }
}

/// Checks a stream template: not empty, balanced braces, known placeholders.
pub(crate) fn check_template(template: &str) -> Result<(), String> {
    if template.trim().is_empty() {
        return Err(
            "is empty; set a stream name or template such as \"events:{aggregate_type}\""
                .to_owned(),
        );
    }
    let allowed = TEMPLATE_PLACEHOLDERS
        .iter()
        .map(|p| format!("{{{p}}}"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut unknown = Vec::new();
    let mut rest = template;
    while let Some(i) = rest.find(['{', '}']) {
        if rest[i..].starts_with('}') {
            return Err(format!(
                "= {template:?} has a `}}` without a matching `{{`; placeholders are written \
                 {allowed}"
            ));
        }
        let after = &rest[i + 1..];
        let Some(end) = after.find('}') else {
            return Err(format!(
                "= {template:?} has a `{{` that is never closed; placeholders are written {allowed}"
            ));
        };
        let name = &after[..end];
        if !TEMPLATE_PLACEHOLDERS.contains(&name) {
            unknown.push(format!("{{{name}}}"));
        }
        rest = &after[end + 1..];
    }
    if unknown.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "= {template:?} uses unknown placeholder(s) {}; the allowed placeholders are {allowed}",
            unknown.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates() {
        assert!(check_template("events:{aggregate_type}").is_ok());
        assert!(check_template("e:{aggregate_type}:{event_type}:{partition}").is_ok());
        assert!(check_template("plain").is_ok());
        assert!(check_template("").is_err());
        assert!(check_template("e:{aggregate_type").is_err());
        assert!(check_template("e:}").is_err());
        let err = check_template("e:{tenant}:{x}").expect_err("unknown placeholders");
        assert!(err.contains("{tenant}") && err.contains("{x}"), "{err}");
    }

    #[test]
    fn retention_covers_the_republish_window() {
        let mut c = Config::default();
        c.retention.published_secs = 60;
        c.retention.republish_window_secs = 120;
        let keys: Vec<String> = check(&c).iter().map(Issue::key).collect();
        assert_eq!(keys, ["retention.published_secs"]);
        c.retention.published_secs = 120;
        assert!(check(&c).is_empty());
        c.relay.delete_published = true;
        let keys: Vec<String> = check(&c).iter().map(Issue::key).collect();
        assert_eq!(keys, ["retention.republish_window_secs"]);
        c.retention.republish_window_secs = 0;
        assert!(check(&c).is_empty());
        c.redis.maxmemory_policy_check = "maybe".to_owned();
        let keys: Vec<String> = check(&c).iter().map(Issue::key).collect();
        assert_eq!(keys, ["redis.maxmemory_policy_check"]);
    }

    #[test]
    fn cluster_settings() {
        let mut c = Config::default();
        c.redis.cluster_seeds = vec!["10.0.0.2:7000".to_owned()];
        let keys: Vec<String> = check(&c).iter().map(Issue::key).collect();
        assert_eq!(keys, ["redis.cluster_seeds"], "seeds without cluster");
        c.redis.cluster = true;
        assert!(check(&c).is_empty());
        c.redis.cluster_seeds.push("10.0.0.3".to_owned());
        let issues = check(&c);
        assert_eq!(issues.len(), 1);
        assert!(issues[0].message.contains("host:port"), "{:?}", issues[0]);
    }

    #[test]
    fn key_prefix_braces_must_be_a_hash_tag() {
        let mut c = Config::default();
        for ok in ["", "outpost:", "{outpost}:", "app:{orders}:"] {
            c.redis.key_prefix = ok.to_owned();
            assert!(check(&c).is_empty(), "{ok}");
        }
        for bad in ["a}b:", "a{b:", "{}:"] {
            c.redis.key_prefix = bad.to_owned();
            let keys: Vec<String> = check(&c).iter().map(Issue::key).collect();
            assert_eq!(keys, ["redis.key_prefix"], "{bad}");
        }
    }

    #[test]
    fn defaults_pass() {
        let issues = check(&Config::default());
        assert!(issues.is_empty(), "{issues:?}");
    }
}
