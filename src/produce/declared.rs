//! Declared event content: an event is produced only when a field it declares changed.
//!
//! A declaration names an event type and the record fields that make up its content. Given the
//! record before and after a mutation, [`Declaration::diff`] returns the changed declared fields;
//! a change to any other field produces nothing. Field names may use dots to reach into nested
//! objects (`address.city`).

use sea_orm::ConnectionTrait;
use serde::Serialize;
use serde_json::{Map, Value};

use super::{Enqueued, EventFact, ProduceError, Producer};

/// An event type and the fields that make up its content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declaration {
    aggregate_type: String,
    event_type: String,
    schema_version: String,
    fields: Vec<String>,
}

/// The declared fields that changed, with their values before and after.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangeSet {
    /// Names of the changed declared fields, in declaration order.
    pub changed: Vec<String>,
    /// Their values before the mutation (`null` when absent).
    pub before: Map<String, Value>,
    /// Their values after the mutation (`null` when absent).
    pub after: Map<String, Value>,
}

impl ChangeSet {
    /// The event payload: `{"changed": [...], "before": {...}, "after": {...}}`.
    pub fn into_payload(self) -> Value {
        let mut m = Map::new();
        m.insert(
            "changed".to_owned(),
            Value::Array(self.changed.into_iter().map(Value::String).collect()),
        );
        m.insert("before".to_owned(), Value::Object(self.before));
        m.insert("after".to_owned(), Value::Object(self.after));
        Value::Object(m)
    }
}

impl Declaration {
    /// Declares `event_type` on `aggregate_type` with the given content fields.
    pub fn new(
        aggregate_type: impl Into<String>,
        event_type: impl Into<String>,
        fields: &[&str],
    ) -> Self {
        Self {
            aggregate_type: aggregate_type.into(),
            event_type: event_type.into(),
            schema_version: "1".to_owned(),
            fields: fields.iter().map(|f| (*f).to_owned()).collect(),
        }
    }

    /// Sets the schema version of the produced payload.
    pub fn schema_version(mut self, v: impl Into<String>) -> Self {
        self.schema_version = v.into();
        self
    }

    /// The declared fields.
    pub fn fields(&self) -> &[String] {
        &self.fields
    }

    /// Compares two versions of a record. `None` stands for "no record" (before a create, after
    /// a delete). Returns `None` when no declared field changed.
    pub fn diff<T: Serialize + ?Sized>(
        &self,
        before: Option<&T>,
        after: Option<&T>,
    ) -> Result<Option<ChangeSet>, ProduceError> {
        let before = to_object(before)?;
        let after = to_object(after)?;
        let mut set = ChangeSet {
            changed: Vec::new(),
            before: Map::new(),
            after: Map::new(),
        };
        for field in &self.fields {
            let b = lookup(&before, field);
            let a = lookup(&after, field);
            if b != a {
                set.changed.push(field.clone());
                set.before
                    .insert(field.clone(), b.cloned().unwrap_or(Value::Null));
                set.after
                    .insert(field.clone(), a.cloned().unwrap_or(Value::Null));
            }
        }
        Ok((!set.changed.is_empty()).then_some(set))
    }
}

fn to_object<T: Serialize + ?Sized>(record: Option<&T>) -> Result<Value, ProduceError> {
    let Some(r) = record else {
        return Ok(Value::Null);
    };
    let v = serde_json::to_value(r).map_err(ProduceError::Encode)?;
    if v.is_object() {
        Ok(v)
    } else {
        Err(ProduceError::Invalid {
            field: "record",
            problem: "must serialise to a JSON object so its fields can be compared".to_owned(),
        })
    }
}

fn lookup<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |cur, key| cur.get(key))
}

impl Producer {
    /// Enqueues `decl`'s event for the aggregate when a declared field differs between `before`
    /// and `after`; returns `None` (and writes nothing) otherwise.
    pub async fn enqueue_declared<C, T>(
        &self,
        conn: &C,
        decl: &Declaration,
        aggregate_id: &str,
        before: Option<&T>,
        after: Option<&T>,
    ) -> Result<Option<Enqueued>, ProduceError>
    where
        C: ConnectionTrait,
        T: Serialize + ?Sized,
    {
        let Some(changes) = decl.diff(before, after)? else {
            return Ok(None);
        };
        let fact = EventFact::new(
            decl.aggregate_type.clone(),
            aggregate_id,
            decl.event_type.clone(),
            changes.into_payload(),
        )
        .schema_version(decl.schema_version.clone());
        let mut out = self.enqueue_facts(conn, vec![fact]).await?;
        Ok(out.pop())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn only_declared_fields_count() {
        let d = Declaration::new(
            "customer",
            "customer.contact_changed",
            &["email", "address.city"],
        );
        let before = json!({"email": "a@x", "note": "x", "address": {"city": "Oslo"}});
        let note_only = json!({"email": "a@x", "note": "y", "address": {"city": "Oslo"}});
        assert_eq!(d.diff(Some(&before), Some(&note_only)).ok().flatten(), None);

        let moved = json!({"email": "a@x", "note": "x", "address": {"city": "Bergen"}});
        let set = d.diff(Some(&before), Some(&moved)).ok().flatten();
        let set = set.as_ref();
        assert_eq!(
            set.map(|s| s.changed.clone()),
            Some(vec!["address.city".to_owned()])
        );
        assert_eq!(
            set.and_then(|s| s.after.get("address.city")),
            Some(&json!("Bergen"))
        );
    }

    #[test]
    fn create_and_delete() {
        let d = Declaration::new("customer", "customer.contact_changed", &["email"]);
        let rec = json!({"email": "a@x"});
        let created = d.diff(None, Some(&rec)).ok().flatten();
        assert_eq!(
            created.map(|s| s.before.get("email").cloned()),
            Some(Some(Value::Null))
        );
        let deleted = d.diff(Some(&rec), None).ok().flatten();
        assert!(deleted.is_some());
    }

    #[test]
    fn non_object_records_are_refused() {
        let d = Declaration::new("customer", "x", &["email"]);
        assert!(d.diff(Some(&json!(3)), Some(&json!(4))).is_err());
    }
}
