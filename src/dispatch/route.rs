//! Routing: which stream an event goes to, built safely from row text.
//!
//! The stream name comes from a template (`routing.stream`, or a per-event-type override) with
//! `{aggregate_type}`, `{event_type}` and `{partition}` placeholders. Text from rows is
//! percent-encoded outside `[A-Za-z0-9._:-]`, so no row can inject a Redis Cluster hash tag
//! (`{`/`}`), whitespace or control characters into a key, and distinct values stay distinct.

use std::collections::{HashMap, HashSet};

use crate::config::{NO_DESTINATION, RoutingConfig};

/// Where an event goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// This stream name (without the key prefix).
    Stream(String),
    /// Nowhere: the row leaves delivery as `no_destination`.
    NoDestination,
}

/// Why an event cannot be routed (a permanent failure for that event).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot route event: {0}")]
pub struct Unroutable(pub String);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    AggregateType,
    EventType,
    Partition,
}

/// A parsed stream-name template.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Template(Vec<Part>);

/// Longest stream name Outpost will build, in bytes.
const MAX_STREAM_NAME: usize = 1024;

impl Template {
    fn parse(t: &str) -> Self {
        let mut parts = Vec::new();
        let mut rest = t;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Literal(rest[..open].to_owned()));
            }
            let after = &rest[open..];
            let (part, len) = [
                ("{aggregate_type}", Part::AggregateType),
                ("{event_type}", Part::EventType),
                ("{partition}", Part::Partition),
            ]
            .into_iter()
            .find(|(p, _)| after.starts_with(p))
            .map(|(p, part)| (part, p.len()))
            // Configuration validation refuses other placeholders; keep a stray brace literal.
            .unwrap_or_else(|| (Part::Literal("{".to_owned()), 1));
            parts.push(part);
            rest = &after[len..];
        }
        if !rest.is_empty() {
            parts.push(Part::Literal(rest.to_owned()));
        }
        Self(parts)
    }

    fn render(&self, aggregate_type: &str, event_type: &str, partition: i32) -> String {
        let mut out = String::with_capacity(64);
        for p in &self.0 {
            match p {
                Part::Literal(s) => out.push_str(s),
                Part::AggregateType => encode_into(&mut out, aggregate_type),
                Part::EventType => encode_into(&mut out, event_type),
                Part::Partition => out.push_str(&partition.to_string()),
            }
        }
        out
    }
}

/// Percent-encodes every byte outside `[A-Za-z0-9._:-]`.
fn encode_into(out: &mut String, s: &str) {
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
}

/// Routing rules from configuration.
#[derive(Debug, Clone)]
pub struct Router {
    default: Template,
    overrides: HashMap<String, Option<Template>>,
    no_destination: HashSet<String>,
}

impl Router {
    /// Builds the rules. The configuration was validated already.
    pub fn new(config: &RoutingConfig) -> Self {
        let overrides = config
            .overrides
            .iter()
            .map(|(event_type, t)| {
                let t = (t != NO_DESTINATION).then(|| Template::parse(t));
                (event_type.clone(), t)
            })
            .collect();
        Self {
            default: Template::parse(&config.stream),
            overrides,
            no_destination: config.no_destination.iter().cloned().collect(),
        }
    }

    /// Routes one event. An explicit `destination` set by the producer wins over the rules.
    pub fn route(
        &self,
        aggregate_type: &str,
        event_type: &str,
        partition: i32,
        destination: Option<&str>,
    ) -> Result<Route, Unroutable> {
        let name = if let Some(d) = destination {
            let mut s = String::with_capacity(d.len());
            encode_into(&mut s, d);
            s
        } else if self.no_destination.contains(event_type) {
            return Ok(Route::NoDestination);
        } else {
            match self.overrides.get(event_type) {
                Some(None) => return Ok(Route::NoDestination),
                Some(Some(t)) => t.render(aggregate_type, event_type, partition),
                None => self.default.render(aggregate_type, event_type, partition),
            }
        };
        if name.is_empty() {
            return Err(Unroutable("the stream name is empty".to_owned()));
        }
        if name.len() > MAX_STREAM_NAME {
            return Err(Unroutable(format!(
                "the stream name would be {} bytes long; at most {MAX_STREAM_NAME} are allowed",
                name.len()
            )));
        }
        Ok(Route::Stream(name))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn router(stream: &str, overrides: &[(&str, &str)], none: &[&str]) -> Router {
        Router::new(&RoutingConfig {
            stream: stream.to_owned(),
            overrides: overrides
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
            no_destination: none.iter().map(|s| (*s).to_owned()).collect(),
        })
    }

    #[test]
    fn templates_and_overrides() {
        let r = router(
            "events:{aggregate_type}",
            &[
                ("order.audit", "audit:{partition}"),
                ("order.debug", "none"),
            ],
            &["order.internal"],
        );
        let s = |e: &str| r.route("order", e, 7, None);
        assert_eq!(s("order.paid"), Ok(Route::Stream("events:order".into())));
        assert_eq!(s("order.audit"), Ok(Route::Stream("audit:7".into())));
        assert_eq!(s("order.debug"), Ok(Route::NoDestination));
        assert_eq!(s("order.internal"), Ok(Route::NoDestination));
        assert_eq!(
            r.route("order", "order.internal", 7, Some("custom")),
            Ok(Route::Stream("custom".into()))
        );
    }

    #[test]
    fn hostile_text_cannot_inject() {
        let r = router("events:{aggregate_type}:{event_type}", &[], &[]);
        let got = r.route("a{b}\r\n c", "x y", 0, None);
        assert_eq!(
            got,
            Ok(Route::Stream("events:a%7Bb%7D%0D%0A%20c:x%20y".into()))
        );
        let long = "z".repeat(2000);
        assert!(r.route(&long, "t", 0, None).is_err());
    }

    /// Random row text (seeded): the rendered stream name never carries a brace, whitespace or
    /// control character, and distinct aggregate types give distinct names.
    #[test]
    fn random_text_is_encoded_safely_and_injectively() {
        use rand::{Rng, SeedableRng};
        let r = router("events:{aggregate_type}", &[], &[]);
        let alphabet: Vec<char> = "aZ09._:-{}%/ \t\n\r\u{0}\u{7f}é€😀\"'".chars().collect();
        let mut seen = std::collections::HashMap::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(42);
        for _ in 0..5000 {
            let len = rng.random_range(1..12);
            let text: String = (0..len)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                .collect();
            let Ok(Route::Stream(name)) = r.route(&text, "t", 0, None) else {
                panic!("{text:?} did not route");
            };
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_graphic() && c != '{' && c != '}'),
                "{text:?} -> {name:?}"
            );
            if let Some(other) = seen.insert(name.clone(), text.clone()) {
                assert_eq!(other, text, "two types share the stream {name:?}");
            }
        }
    }
}
