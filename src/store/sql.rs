//! Small helpers for building statements.

use std::fmt::Display;

/// A Postgres array literal of numbers or booleans, e.g. `{1,2,3}` (bind it as text and cast).
pub(super) fn num_array<T: Display>(values: &[T]) -> String {
    let mut s = String::with_capacity(values.len() * 8 + 2);
    s.push('{');
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&v.to_string());
    }
    s.push('}');
    s
}

/// A Postgres array literal of text, every element quoted and escaped.
pub(super) fn text_array(values: &[&str]) -> String {
    let mut s = String::with_capacity(values.iter().map(|v| v.len() + 3).sum::<usize>() + 2);
    s.push('{');
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push('"');
        for c in v.chars() {
            if c == '"' || c == '\\' {
                s.push('\\');
            }
            s.push(c);
        }
        s.push('"');
    }
    s.push('}');
    s
}

/// The columns an event keeps in `outpost_published`, but for the two the mark adds
/// (`published_at`, `stream_id`).
pub(super) const PUBLISHED_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, \
     aggregate_seq, aggregate_version, event_type, schema_version, occurred_at, recorded_at, \
     payload, headers, destination, partition, txid, attempts";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_literals() {
        assert_eq!(num_array(&[1i64, -2, 3]), "{1,-2,3}");
        assert_eq!(num_array::<i32>(&[]), "{}");
        assert_eq!(
            text_array(&["a", "b\"c", "d\\e", "", "x,y{}"]),
            r#"{"a","b\"c","d\\e","","x,y{}"}"#
        );
    }
}
