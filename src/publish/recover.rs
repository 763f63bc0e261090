//! Reading what Redis still holds of the streams Outpost wrote, and re-creating their fences
//! after Redis lost its data.

use std::collections::HashMap;

use redis::Value;

use super::{PublishError, Publisher, parse_entry_id};

/// What Redis holds of one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPosition {
    /// The stream's fence hash exists. Outpost creates it with the stream's first entry and never
    /// deletes it, so a missing fence means Redis lost the stream's data.
    pub fence: bool,
    /// The stream's `last-generated-id` (survives trimming), `None` when the stream is missing.
    pub last: Option<(i64, i64)>,
}

/// KEYS[1]: fence hash. ARGV: partition, epoch, … Raises each partition's fence to at least the
/// given epoch (never lowers one), comparing epochs as strings of digits
/// ([`LUA_EPOCH`](super::script::LUA_EPOCH)). A field that holds no epoch is left for an
/// operator to fix: the publish script refuses to append past it and says so.
const RAISE_FENCES: &str = r"
for i = 1, #ARGV, 2 do
  local current = epoch_of(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if current and epoch_below(current, ARGV[i + 1]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return 1
";

impl Publisher {
    /// Where each stream stands: its fence and its last generated id, one pipelined call.
    pub async fn stream_positions(
        &self,
        streams: &[String],
    ) -> Result<Vec<StreamPosition>, PublishError> {
        if streams.is_empty() {
            return Ok(Vec::new());
        }
        let mut calls = Vec::with_capacity(streams.len() * 2);
        for s in streams {
            let mut exists = redis::cmd("EXISTS");
            exists.arg(self.fence_key(s)?);
            let mut info = redis::cmd("XINFO");
            info.arg("STREAM").arg(s);
            calls.push(exists);
            calls.push(info);
        }
        let replies = self.conn.run_each(calls, self.limit).await;
        let mut out = Vec::with_capacity(streams.len());
        for pair in replies.chunks(2) {
            let fence = match pair.first() {
                Some(Some(Ok(Value::Int(n)))) => *n > 0,
                Some(Some(Err(e))) => return Err(PublishError::from_redis(e.clone())),
                Some(None) => return Err(PublishError::timed_out(self.limit)),
                _ => false,
            };
            // A missing stream answers "ERR no such key".
            let last = match pair.get(1) {
                Some(Some(Ok(v))) => last_generated_id(v),
                Some(None) => return Err(PublishError::timed_out(self.limit)),
                _ => None,
            };
            out.push(StreamPosition { fence, last });
        }
        Ok(out)
    }

    /// What the fence hash of each stream says of the partitions that appended to it: per
    /// partition, the newest entry id it appended (`<partition>:last`); `None` when the hash is
    /// gone. One pipelined call.
    pub async fn fence_marks(
        &self,
        streams: &[String],
    ) -> Result<Vec<Option<HashMap<i32, (i64, i64)>>>, PublishError> {
        if streams.is_empty() {
            return Ok(Vec::new());
        }
        let mut calls = Vec::with_capacity(streams.len());
        for s in streams {
            let mut all = redis::cmd("HGETALL");
            all.arg(self.fence_key(s)?);
            calls.push(all);
        }
        let replies = self.conn.run_each(calls, self.limit).await;
        let mut out = Vec::with_capacity(streams.len());
        for reply in replies {
            let v = match reply {
                Some(Ok(v)) => v,
                Some(Err(e)) => return Err(PublishError::from_redis(e)),
                None => return Err(PublishError::timed_out(self.limit)),
            };
            let pairs: Vec<(String, String)> = match &v {
                Value::Array(items) => items
                    .chunks(2)
                    .filter_map(|c| {
                        Some((
                            super::script::text(c.first()?)?,
                            super::script::text(c.get(1)?)?,
                        ))
                    })
                    .collect(),
                Value::Map(m) => m
                    .iter()
                    .filter_map(|(k, v)| Some((super::script::text(k)?, super::script::text(v)?)))
                    .collect(),
                _ => Vec::new(),
            };
            if pairs.is_empty() {
                out.push(None);
                continue;
            }
            let marks = pairs
                .into_iter()
                .filter_map(|(field, value)| {
                    let partition = field.strip_suffix(":last")?.parse().ok()?;
                    Some((partition, parse_entry_id(&value)?))
                })
                .collect();
            out.push(Some(marks));
        }
        Ok(out)
    }

    /// Raises the fences of `streams` to at least `epochs` (partition, epoch): after a data loss
    /// this re-creates them, so batches still carrying an epoch from before are refused.
    pub async fn raise_fences(
        &self,
        streams: &[String],
        epochs: &[(i32, i64)],
    ) -> Result<(), PublishError> {
        let script = redis::Script::new(&format!("{}{RAISE_FENCES}", super::script::LUA_EPOCH));
        let mut c = self.conn.clone();
        for s in streams {
            let mut call = script.key(self.fence_key(s)?);
            for (p, e) in epochs {
                call.arg(*p).arg(*e);
            }
            let _: i64 = call
                .invoke_async(&mut c)
                .await
                .map_err(PublishError::from_redis)?;
        }
        Ok(())
    }
}

fn last_generated_id(v: &Value) -> Option<(i64, i64)> {
    let pairs: Vec<(&Value, &Value)> = match v {
        Value::Array(items) => items
            .chunks(2)
            .filter_map(|c| Some((c.first()?, c.get(1)?)))
            .collect(),
        Value::Map(m) => m.iter().map(|(k, v)| (k, v)).collect(),
        _ => return None,
    };
    pairs.into_iter().find_map(|(k, v)| {
        (super::script::text(k).as_deref() == Some("last-generated-id"))
            .then(|| super::script::text(v).and_then(|s| parse_entry_id(&s)))
            .flatten()
    })
}
