//! The list of every configuration key: its type, range and unit.
//!
//! Used to detect unknown keys (serde's `deny_unknown_fields` stops at the first
//! one), to decide how a string from an environment variable or `--set` flag is
//! typed, to check integer ranges, and to word error messages. A unit test checks
//! that it lists exactly the fields of [`Config`](super::Config).

/// The type of a key, as far as messages and range checks are concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A string.
    Str,
    /// A URL that may carry a password: its value is never echoed.
    Secret,
    /// An unsigned integer within `min..=max`.
    UInt { min: u64, max: u64 },
    /// `true` or `false`.
    Bool,
    /// A table of string values (`routing.overrides`).
    StrMap,
    /// A table of unsigned integers within `min..=max` (`rate_limit.streams`).
    UIntMap { min: u64, max: u64 },
    /// A list of strings (`routing.no_destination`).
    StrList,
}

/// One configuration key.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Field {
    pub section: &'static str,
    pub name: &'static str,
    pub kind: Kind,
    /// What the number counts, for messages ("milliseconds"); empty otherwise.
    pub unit: &'static str,
}

impl Field {
    pub fn key(&self) -> String {
        format!("{}.{}", self.section, self.name)
    }

    /// How a correct value is described in messages.
    pub fn expected(&self) -> String {
        match self.kind {
            Kind::Str => "a string".to_owned(),
            Kind::Secret => "a URL string".to_owned(),
            Kind::UInt { min, max } => {
                let unit = if self.unit.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", self.unit)
                };
                format!("a whole number from {min} to {max}{unit}")
            }
            Kind::Bool => "true or false".to_owned(),
            Kind::StrMap => "a table of event type = stream template strings".to_owned(),
            Kind::UIntMap { min, max } => {
                format!("a table of stream name = whole number from {min} to {max}")
            }
            Kind::StrList => "a list of strings".to_owned(),
        }
    }
}

const MS: &str = "milliseconds";
const SECS: &str = "seconds";
/// Upper bound of the retention windows.
const TEN_YEARS: u64 = 315_360_000;

const fn uint(
    section: &'static str,
    name: &'static str,
    min: u64,
    max: u64,
    unit: &'static str,
) -> Field {
    Field {
        section,
        name,
        kind: Kind::UInt { min, max },
        unit,
    }
}

const fn field(section: &'static str, name: &'static str, kind: Kind) -> Field {
    Field {
        section,
        name,
        kind,
        unit: "",
    }
}

/// The sections, in the order they are printed.
pub(crate) const SECTIONS: &[&str] = &[
    "database",
    "redis",
    "node",
    "admin",
    "producer",
    "relay",
    "routing",
    "rate_limit",
    "retention",
    "log",
];

/// Every key. Ranges with `u32::MAX`/`u64::MAX` as upper bound are only bounded
/// by their type; cross-key rules live in `validate.rs`.
pub(crate) const FIELDS: &[Field] = &[
    field("database", "url", Kind::Secret),
    uint("database", "pool_size", 1, 512, "connections"),
    uint("database", "connect_timeout_ms", 100, 600_000, MS),
    field("redis", "url", Kind::Secret),
    field("redis", "key_prefix", Kind::Str),
    uint("redis", "connect_timeout_ms", 100, 600_000, MS),
    uint("redis", "response_timeout_ms", 100, 600_000, MS),
    field("redis", "maxmemory_policy_check", Kind::Str),
    field("redis", "cluster", Kind::Bool),
    field("redis", "cluster_seeds", Kind::StrList),
    field("node", "id", Kind::Str),
    uint("node", "heartbeat_ms", 100, 60_000, MS),
    uint("node", "lease_ms", 300, 3_600_000, MS),
    field("admin", "listen", Kind::Str),
    uint(
        "admin",
        "requests_per_sec",
        1,
        100_000,
        "requests per second",
    ),
    uint("admin", "burst", 1, 100_000, "requests"),
    uint("admin", "max_body_bytes", 1024, 16_777_216, "bytes"),
    field("admin", "cookie_secure", Kind::Bool),
    // At most the database's limit, which no configuration raises.
    uint(
        "producer",
        "max_payload_bytes",
        1,
        crate::store::MAX_PAYLOAD_BYTES as u64,
        "bytes",
    ),
    uint("producer", "max_header_bytes", 1, 65_536, "bytes"),
    uint("relay", "batch_rows", 1, 10_000, "rows"),
    uint("relay", "batch_bytes", 1024, 67_108_864, "bytes"),
    uint("relay", "max_in_flight", 1, 256, "batches per worker"),
    uint("relay", "workers", 0, 64, "workers, 0 = number of cores"),
    uint("relay", "busy_poll_ms", 1, 1000, MS),
    uint("relay", "idle_after_ms", 1, 60_000, MS),
    uint("relay", "max_attempts", 1, 1000, "attempts"),
    uint("relay", "backoff_base_ms", 1, 3_600_000, MS),
    uint("relay", "backoff_max_ms", 1, 86_400_000, MS),
    uint("relay", "transient_backoff_max_ms", 10, 600_000, MS),
    field("relay", "delete_published", Kind::Bool),
    uint("relay", "shutdown_timeout_ms", 100, 600_000, MS),
    field("routing", "stream", Kind::Str),
    field("routing", "overrides", Kind::StrMap),
    field("routing", "no_destination", Kind::StrList),
    uint(
        "rate_limit",
        "global_per_sec",
        0,
        u32::MAX as u64,
        "events per second, 0 = unlimited",
    ),
    uint(
        "rate_limit",
        "per_stream_per_sec",
        0,
        u32::MAX as u64,
        "events per second per stream, 0 = unlimited",
    ),
    uint(
        "rate_limit",
        "burst",
        0,
        u32::MAX as u64,
        "events, 0 = same as the rate",
    ),
    Field {
        section: "rate_limit",
        name: "streams",
        kind: Kind::UIntMap {
            min: 0,
            max: u32::MAX as u64,
        },
        unit: "events per second, 0 = unlimited",
    },
    field("retention", "enabled", Kind::Bool),
    uint("retention", "published_secs", 1, TEN_YEARS, SECS),
    uint("retention", "no_destination_secs", 1, TEN_YEARS, SECS),
    uint("retention", "discarded_secs", 1, TEN_YEARS, SECS),
    uint("retention", "batch_rows", 1, 100_000, "rows"),
    uint("retention", "batch_pause_ms", 0, 60_000, MS),
    uint("retention", "interval_ms", 100, 86_400_000, MS),
    field("retention", "vacuum", Kind::Bool),
    uint(
        "retention",
        "republish_window_secs",
        0,
        TEN_YEARS,
        "seconds, 0 = alert only",
    ),
    field("retention", "trim_streams", Kind::Bool),
    uint("retention", "trim_interval_ms", 100, 86_400_000, MS),
    uint(
        "retention",
        "trim_ungrouped_after_secs",
        0,
        TEN_YEARS,
        "seconds, 0 = never",
    ),
    uint(
        "retention",
        "stream_max_len",
        0,
        u64::MAX,
        "entries, 0 = no cap",
    ),
    field("log", "level", Kind::Str),
    field("log", "format", Kind::Str),
];

pub(crate) fn is_section(name: &str) -> bool {
    SECTIONS.contains(&name)
}

pub(crate) fn lookup(section: &str, name: &str) -> Option<&'static Field> {
    FIELDS
        .iter()
        .find(|f| f.section == section && f.name == name)
}

/// The known key closest to `unknown` (a dotted path), if it is close enough to
/// be a likely typo or a key put in the wrong section.
pub(crate) fn suggest(unknown: &str) -> Option<String> {
    let unknown_leaf = unknown.rsplit('.').next().unwrap_or(unknown);
    let mut candidates: Vec<String> = FIELDS.iter().map(Field::key).collect();
    candidates.extend(SECTIONS.iter().map(|s| (*s).to_owned()));
    // The same key name in another section is the most likely mistake.
    if unknown.contains('.')
        && let Some(f) = FIELDS.iter().find(|f| f.name == unknown_leaf)
    {
        return Some(f.key());
    }
    candidates
        .into_iter()
        .map(|c| (levenshtein(&c, unknown), c))
        .filter(|(d, c)| *d <= 3.min(c.len() / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.chars().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions() {
        assert_eq!(
            suggest("relay.batch_row").as_deref(),
            Some("relay.batch_rows")
        );
        assert_eq!(
            suggest("relay.heartbeat_ms").as_deref(),
            Some("node.heartbeat_ms")
        );
        assert_eq!(suggest("rellay").as_deref(), Some("relay"));
        assert_eq!(suggest("something_else_entirely"), None);
    }
}
