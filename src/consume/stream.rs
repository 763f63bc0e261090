//! The consumer's Redis side: the group, reads that account for entries lost to trimming,
//! reclaiming, acknowledging and the dead-letter stream. Never touches the database.
//!
//! ## Counting entries lost before they were read
//! Redis 7.0 trims without regard for consumer groups, and its `entries-read` counter is not
//! reliable once a stream has been trimmed. The helper keeps its own count instead, in a hash
//! next to the stream (`<prefix>outpost:consumer:{<stream>}`, same hash slot): `pos:<group>` is
//! how many of the stream's entries, counted from the first ever added, the group has read or
//! lost. Each read runs as one script: if more entries have left the stream (`entries-added` −
//! `length`) than the group has passed, the difference left before the group read it — lost —
//! and is added to `lost:<group>`; then it reads with `XREADGROUP` and moves `pos` by what it
//! got. Entries that were read but trimmed while still pending are reported by `XAUTOCLAIM`.
//! The count is exact when entries leave from the head of the stream (`XTRIM`, `MAXLEN`,
//! `MINID`); an entry deleted from the middle with `XDEL` is counted when the head passes it.

use std::collections::HashMap;
use std::time::Duration;

use redis::streams::{StreamAutoClaimOptions, StreamPendingCountReply};
use redis::{Script, Value};

use super::{ConsumeError, ConsumerSettings, StartFrom};
use crate::publish::{RedisConn, companion_key};

/// One field of an entry, name and value as the writer sent them: anyone who can `XADD` to the
/// stream chooses these bytes, so nothing about them is assumed here.
pub(crate) type RawField = (Vec<u8>, Vec<u8>);

/// An entry as read: id, fields in the entry's order, and the group's delivery count.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RawEntry {
    pub id: String,
    pub fields: Vec<RawField>,
    pub deliveries: u32,
}

/// What one read returned.
#[derive(Debug, Default)]
pub(crate) struct Read {
    pub entries: Vec<RawEntry>,
    /// Entries found to have left the stream before the group read them.
    pub lost: u64,
    /// Entries in the stream the group has not read yet.
    pub lag: u64,
    /// The stream's last generated id: a blocking wait looks for anything newer.
    pub last_id: String,
    /// The group (or the stream) no longer exists: it must be created again.
    pub no_group: bool,
}

/// What creating the group found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GroupState {
    /// The group was created now.
    pub created: bool,
    /// The helper's count for this group existed already.
    pub counted: bool,
    /// Entries that had left the stream before now.
    pub gone: u64,
}

const ENSURE_GROUP: &str = r"
local ok = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], ARGV[2], 'MKSTREAM')
local created = 1
if type(ok) == 'table' and ok.err then
  if string.find(ok.err, 'BUSYGROUP', 1, true) then created = 0 else return redis.error_reply(ok.err) end
end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local added, len = 0, 0
for i = 1, #info, 2 do
  if info[i] == 'entries-added' then added = info[i + 1] elseif info[i] == 'length' then len = info[i + 1] end
end
local field = 'pos:' .. ARGV[1]
local had = redis.call('HEXISTS', KEYS[2], field)
if had == 0 or created == 1 then
  local pos = added - len
  if ARGV[2] == '$' then pos = added end
  redis.call('HSET', KEYS[2], field, pos)
end
return {created, had, added - len}
";

const READ: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0, '0-0', {}} end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local added, len, last = 0, 0, '0-0'
for i = 1, #info, 2 do
  local k = info[i]
  if k == 'entries-added' then added = info[i + 1]
  elseif k == 'length' then len = info[i + 1]
  elseif k == 'last-generated-id' then last = info[i + 1] end
end
local field = 'pos:' .. ARGV[1]
local gone = added - len
local pos = tonumber(redis.call('HGET', KEYS[2], field) or gone)
local lost = 0
if gone > pos then
  lost = gone - pos
  pos = gone
  redis.call('HINCRBY', KEYS[2], 'lost:' .. ARGV[1], lost)
end
local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
if type(r) == 'table' and r.err then
  if string.find(r.err, 'NOGROUP', 1, true) then return {-1, 0, last, {}} end
  return redis.error_reply(r.err)
end
local entries = {}
if r then entries = r[1][2] end
pos = pos + #entries
redis.call('HSET', KEYS[2], field, pos)
return {lost, added - pos, last, entries}
";

/// Removes a dead member from the group, only if it still holds no pending entry, has no
/// liveness key and has not read or claimed for ARGV[3] ms (a member that came back in between
/// is left alone). Removing a member that holds entries would drop them from the group's
/// pending list: that is never done.
const FORGET: &str = r"
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local list = redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
for _, c in ipairs(list) do
  local name, pending, idle = nil, -1, -1
  for i = 1, #c, 2 do
    if c[i] == 'name' then name = c[i + 1]
    elseif c[i] == 'pending' then pending = c[i + 1]
    elseif c[i] == 'idle' then idle = c[i + 1] end
  end
  if name == ARGV[2] then
    if pending == 0 and idle >= tonumber(ARGV[3]) then
      return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
    end
    return 0
  end
end
return 0
";

/// Claims a dead member's (ARGV[2]) pending entries idle for ARGV[3] ms, up to ARGV[4], oldest
/// first, for ARGV[5]. Entries no longer in the stream are acknowledged and counted (lost);
/// returns `{lost, claimed entries}`.
const TAKE_OVER: &str = r"
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], '-', '+', ARGV[4], ARGV[2])
local ids, gone = {}, {}
for _, e in ipairs(pending) do
  if #redis.call('XRANGE', KEYS[1], e[1], e[1]) == 0 then gone[#gone + 1] = e[1] else ids[#ids + 1] = e[1] end
end
for i = 1, #gone, 500 do
  redis.call('XACK', KEYS[1], ARGV[1], unpack(gone, i, math.min(i + 499, #gone)))
end
local claimed = {}
for i = 1, #ids, 500 do
  local part = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[5], ARGV[3], unpack(ids, i, math.min(i + 499, #ids)))
  for _, c in ipairs(part) do claimed[#claimed + 1] = c end
end
return {#gone, claimed}
";

/// The consumer's connections and scripts.
pub(crate) struct GroupStream {
    conn: RedisConn,
    /// Blocking waits get a connection of their own, so they never hold up acknowledgements or
    /// dead-letter appends.
    wait_conn: RedisConn,
    stream: String,
    state: String,
    /// Prefix of the members' liveness keys (`<members>:<group>:<consumer>`), in the stream's
    /// hash slot.
    members: String,
    group: String,
    consumer: String,
    dead_letter: String,
    ensure: Script,
    read: Script,
    forget: Script,
    take_over: Script,
}

impl GroupStream {
    pub async fn connect(s: &ConsumerSettings) -> Result<Self, ConsumeError> {
        let state =
            companion_key(&s.key_prefix, "consumer", &s.stream).map_err(ConsumeError::Settings)?;
        let connect = async |timeout: Duration| {
            RedisConn::connect(&s.redis_url, &s.topology, s.connect_timeout, timeout)
                .await
                .map_err(|e| {
                    if e.kind() == redis::ErrorKind::InvalidClientConfig {
                        ConsumeError::Settings(format!("redis_url is not usable: {e}"))
                    } else {
                        ConsumeError::redis(e)
                    }
                })
        };
        let members =
            companion_key(&s.key_prefix, "member", &s.stream).map_err(ConsumeError::Settings)?;
        let conn = connect(s.response_timeout).await?;
        let wait_conn = connect(s.block + s.response_timeout).await?;
        Ok(Self {
            conn,
            wait_conn,
            state,
            members,
            stream: s.stream.clone(),
            group: s.group.clone(),
            consumer: s.consumer.clone(),
            dead_letter: s.dead_letter_stream(),
            ensure: Script::new(ENSURE_GROUP),
            read: Script::new(READ),
            forget: Script::new(FORGET),
            take_over: Script::new(TAKE_OVER),
        })
    }

    fn alive_key(&self, consumer: &str) -> String {
        format!("{}:{}:{consumer}", self.members, self.group)
    }

    /// Says this member is alive for `ttl` more.
    pub async fn heartbeat(&self, ttl: Duration) -> Result<(), ConsumeError> {
        redis::cmd("SET")
            .arg(self.alive_key(&self.consumer))
            .arg(1)
            .arg("PX")
            .arg(millis(ttl).max(1))
            .query_async::<Value>(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        Ok(())
    }

    /// Says this member is gone (a graceful stop): its pending entries may be taken at once.
    pub async fn leave(&self) -> Result<(), ConsumeError> {
        redis::cmd("DEL")
            .arg(self.alive_key(&self.consumer))
            .query_async::<i64>(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        Ok(())
    }

    /// The group's other members that are dead: no liveness key, and no read or claim for at
    /// least `timeout`. Returns those holding pending entries; those holding none are removed
    /// from the group (atomically, only while they still hold none and are still dead), so the
    /// names of restarted processes do not pile up.
    pub async fn dead_members(&self, timeout: Duration) -> Result<Vec<String>, ConsumeError> {
        let reply: Value = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&self.stream)
            .arg(&self.group)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        let quiet: Vec<(String, i64)> = parse_consumers(&reply)
            .ok_or_else(|| {
                ConsumeError::Redis(format!("unexpected reply to XINFO CONSUMERS: {reply:?}"))
            })?
            .into_iter()
            .filter(|c| c.name != self.consumer && c.idle_ms >= millis(timeout))
            .map(|c| (c.name, c.pending))
            .collect();
        if quiet.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for (name, _) in &quiet {
            pipe.cmd("EXISTS").arg(self.alive_key(name));
        }
        let alive: Vec<i64> = pipe
            .query_async(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        let mut dead = Vec::new();
        for ((name, pending), alive) in quiet.into_iter().zip(alive) {
            if alive != 0 {
                continue;
            }
            if pending > 0 {
                dead.push(name);
            } else {
                self.forget
                    .key(&self.stream)
                    .key(self.alive_key(&name))
                    .arg(&self.group)
                    .arg(&name)
                    .arg(millis(timeout))
                    .invoke_async::<i64>(&mut self.conn.clone())
                    .await
                    .map_err(ConsumeError::redis)?;
            }
        }
        Ok(dead)
    }

    /// Claims for this member up to `count` of `dead`'s pending entries, oldest first. Only
    /// entries idle for `min_idle` are taken, so when two members take over from the same dead
    /// one, each entry goes to one of them. Entries that left the stream meanwhile (trimmed)
    /// are removed from the group's pending list and counted as lost; returns the entries and
    /// how many were lost.
    pub async fn take_over(
        &self,
        dead: &str,
        min_idle: Duration,
        count: usize,
    ) -> Result<(Vec<RawEntry>, u64), ConsumeError> {
        let reply: Value = self
            .take_over
            .key(&self.stream)
            .arg(&self.group)
            .arg(dead)
            .arg(millis(min_idle))
            .arg(count)
            .arg(&self.consumer)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        let bad = || {
            ConsumeError::Redis(format!(
                "unexpected reply to the take-over script: {reply:?}"
            ))
        };
        let Value::Array(parts) = &reply else {
            return Err(bad());
        };
        let [Value::Int(gone), claimed] = parts.as_slice() else {
            return Err(bad());
        };
        let lost = u64::try_from(*gone).unwrap_or(0);
        if lost > 0 {
            self.count_lost(lost).await?;
        }
        let claimed = parse_entries(claimed, 1).ok_or_else(bad)?;
        let entries = self.with_counts(claimed).await?;
        Ok((entries, lost))
    }

    /// Creates the group when it does not exist, reading from `start`.
    pub async fn ensure_group(&self, start: StartFrom) -> Result<GroupState, ConsumeError> {
        let from = match start {
            StartFrom::Beginning => "0",
            StartFrom::Latest => "$",
        };
        let (created, counted, gone): (i64, i64, i64) = self
            .ensure
            .key(&self.stream)
            .key(&self.state)
            .arg(&self.group)
            .arg(from)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        Ok(GroupState {
            created: created == 1,
            counted: counted == 1,
            gone: u64::try_from(gone).unwrap_or(0),
        })
    }

    /// Reads up to `count` entries never delivered to the group, counting entries lost before.
    pub async fn read_new(&self, count: usize) -> Result<Read, ConsumeError> {
        let reply: Value = self
            .read
            .key(&self.stream)
            .key(&self.state)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(count)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        let bad = || ConsumeError::Redis(format!("unexpected reply to the read script: {reply:?}"));
        let Value::Array(parts) = &reply else {
            return Err(bad());
        };
        let [lost, lag, last, entries] = parts.as_slice() else {
            return Err(bad());
        };
        let (Value::Int(lost), Value::Int(lag)) = (lost, lag) else {
            return Err(bad());
        };
        let last_id: String = redis::from_redis_value_ref(last).map_err(|_| bad())?;
        if *lost < 0 {
            return Ok(Read {
                no_group: true,
                last_id,
                ..Read::default()
            });
        }
        Ok(Read {
            entries: parse_entries(entries, 1).ok_or_else(bad)?,
            lost: u64::try_from(*lost).unwrap_or(0),
            lag: u64::try_from(*lag).unwrap_or(0),
            last_id,
            no_group: false,
        })
    }

    /// Waits up to `timeout` for an entry newer than `last_id` to arrive (without reading it).
    pub async fn wait_for_new(&self, last_id: &str, timeout: Duration) -> Result<(), ConsumeError> {
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        redis::cmd("XREAD")
            .arg("COUNT")
            .arg(1)
            .arg("BLOCK")
            .arg(ms)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(last_id)
            .query_async::<Value>(&mut self.wait_conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        Ok(())
    }

    /// Claims, for this consumer, up to `count` entries idle for at least `min_idle` from any
    /// member, scanning from `cursor`. Returns the next cursor (`0-0` after a full pass), the
    /// entries with their delivery counts, and how many pending entries had left the stream.
    pub async fn reclaim(
        &self,
        cursor: &str,
        min_idle: Duration,
        count: usize,
    ) -> Result<(String, Vec<RawEntry>, u64), ConsumeError> {
        let mut c = self.conn.clone();
        let reply: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(millis(min_idle))
            .arg(cursor)
            .arg(StreamAutoClaimOptions::default().count(count))
            .query_async(&mut c)
            .await
            .map_err(ConsumeError::redis)?;
        let (next, claimed, lost) = parse_autoclaim(&reply).ok_or_else(|| {
            ConsumeError::Redis(format!("unexpected reply to XAUTOCLAIM: {reply:?}"))
        })?;
        if lost > 0 {
            self.count_lost(lost).await?;
        }
        let entries = self.with_counts(claimed).await?;
        Ok((next, entries, lost))
    }

    /// Entries pending for this very consumer name (left by an earlier run), claimed again.
    pub async fn own_pending(&self, count: usize) -> Result<Vec<RawEntry>, ConsumeError> {
        let mut c = self.conn.clone();
        let pending: StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(&self.group)
            .arg("-")
            .arg("+")
            .arg(count)
            .arg(&self.consumer)
            .query_async(&mut c)
            .await
            .map_err(ConsumeError::redis)?;
        let ids: Vec<String> = pending.ids.into_iter().map(|p| p.id).collect();
        self.claim(&ids).await
    }

    /// Delivers `ids` to this consumer again (their delivery counts go up by one). Entries that
    /// were acknowledged meanwhile, or left the stream, are not returned.
    pub async fn claim(&self, ids: &[String]) -> Result<Vec<RawEntry>, ConsumeError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut c = self.conn.clone();
        let reply: Value = redis::cmd("XCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(0)
            .arg(ids)
            .query_async(&mut c)
            .await
            .map_err(ConsumeError::redis)?;
        let claimed = parse_entries(&reply, 1)
            .ok_or_else(|| ConsumeError::Redis(format!("unexpected reply to XCLAIM: {reply:?}")))?;
        self.with_counts(claimed).await
    }

    /// Claims `ids` for this consumer again without counting a delivery (`JUSTID`): resets
    /// their idle time, so no other member reclaims them. Returns those still pending.
    pub async fn touch(&self, ids: &[String]) -> Result<Vec<String>, ConsumeError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        redis::cmd("XCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(0)
            .arg(ids)
            .arg("JUSTID")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)
    }

    /// Adds the group's delivery counts to claimed entries.
    async fn with_counts(&self, claimed: Vec<RawEntry>) -> Result<Vec<RawEntry>, ConsumeError> {
        if claimed.is_empty() {
            return Ok(Vec::new());
        }
        // One exact-range XPENDING per entry, pipelined: a range over all of them would also
        // list this member's other pending entries and could cut some of these off.
        let mut pipe = redis::pipe();
        for RawEntry { id, .. } in &claimed {
            pipe.cmd("XPENDING")
                .arg(&self.stream)
                .arg(&self.group)
                .arg(id)
                .arg(id)
                .arg(1)
                .arg(&self.consumer);
        }
        let replies: Vec<StreamPendingCountReply> = pipe
            .query_async(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        let counts: HashMap<String, usize> = replies
            .into_iter()
            .flat_map(|r| r.ids)
            .map(|p| (p.id, p.times_delivered))
            .collect();
        Ok(claimed
            .into_iter()
            .map(|e| RawEntry {
                deliveries: counts
                    .get(&e.id)
                    .map_or(1, |n| u32::try_from(*n).unwrap_or(u32::MAX)),
                ..e
            })
            .collect())
    }

    /// Acknowledges `ids` for the group.
    pub async fn ack(&self, ids: &[String]) -> Result<(), ConsumeError> {
        if ids.is_empty() {
            return Ok(());
        }
        redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(ids)
            .query_async::<i64>(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        Ok(())
    }

    /// Appends an entry's original fields to the dead-letter stream, with why and where it came
    /// from (`dead_*` fields). Returns the new entry's id.
    pub async fn dead_letter(
        &self,
        stream_id: &str,
        raw: &[RawField],
        reason: &str,
        deliveries: u32,
    ) -> Result<String, ConsumeError> {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.dead_letter).arg("*");
        for (k, v) in raw {
            cmd.arg(k.as_slice()).arg(v.as_slice());
        }
        cmd.arg("dead_reason")
            .arg(reason)
            .arg("dead_stream")
            .arg(&self.stream)
            .arg("dead_stream_id")
            .arg(stream_id)
            .arg("dead_group")
            .arg(&self.group)
            .arg("dead_consumer")
            .arg(&self.consumer)
            .arg("dead_deliveries")
            .arg(deliveries)
            .arg("dead_at")
            .arg(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
        cmd.query_async(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)
    }

    /// Adds to the group's count of lost entries.
    async fn count_lost(&self, n: u64) -> Result<(), ConsumeError> {
        redis::cmd("HINCRBY")
            .arg(&self.state)
            .arg(format!("lost:{}", self.group))
            .arg(n)
            .query_async::<i64>(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        Ok(())
    }

    /// The group's count of entries lost so far, by every member.
    pub async fn lost_total(&self) -> Result<u64, ConsumeError> {
        let n: Option<u64> = redis::cmd("HGET")
            .arg(&self.state)
            .arg(format!("lost:{}", self.group))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(ConsumeError::redis)?;
        Ok(n.unwrap_or(0))
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// One member as `XINFO CONSUMERS` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MemberInfo {
    name: String,
    pending: i64,
    /// Milliseconds since it last read or claimed.
    idle_ms: u64,
}

/// Parses `XINFO CONSUMERS` (a list of maps, or of flat field/value lists under RESP2).
fn parse_consumers(v: &Value) -> Option<Vec<MemberInfo>> {
    let Value::Array(items) = v else {
        return None;
    };
    items
        .iter()
        .map(|item| {
            let pairs: Vec<(&Value, &Value)> = match item {
                Value::Map(kv) => kv.iter().map(|(k, v)| (k, v)).collect(),
                Value::Array(flat) => flat.chunks_exact(2).map(|c| (&c[0], &c[1])).collect(),
                _ => return None,
            };
            let (mut name, mut pending, mut idle) = (None, None, None);
            for (k, v) in pairs {
                let k: String = redis::from_redis_value_ref(k).ok()?;
                match k.as_str() {
                    "name" => name = redis::from_redis_value_ref::<String>(v).ok(),
                    "pending" => pending = redis::from_redis_value_ref::<i64>(v).ok(),
                    "idle" => idle = redis::from_redis_value_ref::<i64>(v).ok(),
                    _ => {}
                }
            }
            Some(MemberInfo {
                name: name?,
                pending: pending?,
                idle_ms: u64::try_from(idle?).unwrap_or(0),
            })
        })
        .collect()
}

/// Parses `[[id, [field, value, …]], …]` (`XREADGROUP`, `XCLAIM`, the take-over script).
/// Field names and values are kept as bytes, whatever they hold: an entry's content never makes
/// the reply fail to parse (which would leave a whole batch pending and stall reclaiming on it).
/// An entry that left the stream (`nil`, or `nil` fields, from older servers) is skipped.
pub(crate) fn parse_entries(v: &Value, deliveries: u32) -> Option<Vec<RawEntry>> {
    let items = match v {
        Value::Array(items) => items.as_slice(),
        Value::Nil => &[],
        _ => return None,
    };
    let mut entries = Vec::with_capacity(items.len());
    for item in items {
        let pair = match item {
            Value::Array(pair) => pair,
            Value::Nil => continue,
            _ => return None,
        };
        let [id, fields] = pair.as_slice() else {
            return None;
        };
        let id: String = redis::from_redis_value_ref(id).ok()?;
        let kv = match fields {
            Value::Array(kv) => kv,
            Value::Nil => continue,
            _ => return None,
        };
        let fields = kv
            .chunks_exact(2)
            .map(|c| Some((bytes(&c[0])?, bytes(&c[1])?)))
            .collect::<Option<Vec<RawField>>>()?;
        entries.push(RawEntry {
            id,
            fields,
            deliveries,
        });
    }
    Some(entries)
}

/// Parses `XAUTOCLAIM`'s reply: the next cursor, the claimed entries, and how many of the
/// scanned pending entries had left the stream (Redis 7 lists them; older servers do not).
fn parse_autoclaim(v: &Value) -> Option<(String, Vec<RawEntry>, u64)> {
    let Value::Array(parts) = v else {
        return None;
    };
    let (next, claimed, deleted) = match parts.as_slice() {
        [next, claimed] => (next, claimed, None),
        [next, claimed, deleted] => (next, claimed, Some(deleted)),
        _ => return None,
    };
    let next: String = redis::from_redis_value_ref(next).ok()?;
    let lost = match deleted {
        Some(Value::Array(ids)) => ids.len() as u64,
        Some(Value::Nil) | None => 0,
        Some(_) => return None,
    };
    Some((next, parse_entries(claimed, 1)?, lost))
}

/// The bytes of a field name or value (Redis sends bulk strings; the rest is tolerated).
fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        Value::VerbatimString { text, .. } => Some(text.clone().into_bytes()),
        Value::Int(i) => Some(i.to_string().into_bytes()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn entries_parse_whatever_bytes_they_hold() {
        let raw = |b: &[u8]| Value::BulkString(b.to_vec());
        let entry = Value::Array(vec![
            bulk("1-0"),
            Value::Array(vec![
                raw(b"\xff\xfe"),
                raw(b"\x00\x1b[2J"),
                bulk("ce_id"),
                bulk("x"),
            ]),
        ]);
        let reply = Value::Array(vec![entry.clone(), Value::Nil]);
        let parsed = parse_entries(&reply, 1).unwrap();
        assert_eq!(parsed.len(), 1, "an entry that left the stream is skipped");
        assert_eq!(
            parsed[0].fields,
            vec![
                (b"\xff\xfe".to_vec(), b"\x00\x1b[2J".to_vec()),
                (b"ce_id".to_vec(), b"x".to_vec())
            ]
        );
        let autoclaim = Value::Array(vec![
            bulk("0-0"),
            Value::Array(vec![entry]),
            Value::Array(vec![bulk("2-0"), bulk("3-0")]),
        ]);
        let (next, claimed, lost) = parse_autoclaim(&autoclaim).unwrap();
        assert_eq!((next.as_str(), claimed.len(), lost), ("0-0", 1, 2));
        assert!(parse_entries(&Value::Int(3), 1).is_none());
    }

    #[test]
    fn members_parse_from_resp2_lists_and_resp3_maps() {
        let flat = Value::Array(vec![Value::Array(vec![
            bulk("name"),
            bulk("m1"),
            bulk("pending"),
            Value::Int(3),
            bulk("idle"),
            Value::Int(4500),
            bulk("inactive"),
            Value::Int(4500),
        ])]);
        let map = Value::Array(vec![Value::Map(vec![
            (bulk("name"), bulk("m2")),
            (bulk("pending"), Value::Int(0)),
            (bulk("idle"), Value::Int(12)),
        ])]);
        assert_eq!(
            parse_consumers(&flat).unwrap(),
            vec![MemberInfo {
                name: "m1".into(),
                pending: 3,
                idle_ms: 4500
            }]
        );
        assert_eq!(parse_consumers(&map).unwrap()[0].name, "m2");
        assert!(parse_consumers(&Value::Int(1)).is_none());
        assert!(parse_consumers(&Value::Array(vec![Value::Array(vec![bulk("name")])])).is_none());
    }
}
