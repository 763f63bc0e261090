//! Stream trimming that never drops an entry a consumer group has not acknowledged.
//!
//! Redis 7.0 trims without regard to consumer groups (`XTRIM … ACKED` arrived later). One script
//! per stream therefore reads, atomically with the trim, every group's last-delivered id and its
//! oldest pending entry, and trims with `MINID` below the lowest of them: what is left is every
//! entry some group has not read, or read and not acknowledged. A stream without groups is only
//! trimmed by age when that is asked for, and the hard `MAXLEN` cap, when set, is applied after
//! the safe trim — everything it drops was unacknowledged, and is counted. One key per call, so
//! it works on Redis Cluster.

use redis::Value;

use super::{PublishError, Publisher};

/// KEYS[1]: stream. ARGV[1]: age in ms beyond which a stream without groups is trimmed (0 =
/// never), ARGV[2]: hard cap on the length (0 = none). Returns `{trimmed, capped, groups,
/// floor}`; `groups` is -1 when the stream does not exist.
const LUA: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0, 0, -1, ''}
end
local function parse(id)
  local a, b = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(a), tonumber(b)
end
local function less(x, y)
  local xm, xs = parse(x)
  local ym, ys = parse(y)
  return xm < ym or (xm == ym and xs < ys)
end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
local floor = nil
for _, g in ipairs(groups) do
  local name, low
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] end
    if g[i] == 'last-delivered-id' then low = g[i + 1] end
  end
  local pending = redis.call('XPENDING', KEYS[1], name)
  if pending[1] > 0 and less(pending[2], low) then
    low = pending[2]
  end
  if floor == nil or less(low, floor) then
    floor = low
  end
end
local age = tonumber(ARGV[1])
if #groups == 0 and age > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  floor = string.format('%d-0', now - age)
end
local trimmed = 0
if floor then
  trimmed = redis.call('XTRIM', KEYS[1], 'MINID', floor)
end
local capped = 0
local cap = tonumber(ARGV[2])
if cap > 0 then
  capped = redis.call('XTRIM', KEYS[1], 'MAXLEN', cap)
end
return {trimmed, capped, #groups, floor or ''}
";

/// What trimming one stream did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrimReport {
    /// Entries removed below every group's position (or by age, for a stream without groups).
    pub trimmed: u64,
    /// Entries dropped by the hard cap: not yet acknowledged by some group (or unread, for a
    /// stream without groups).
    pub capped: u64,
    /// Consumer groups of the stream; `None` when the stream does not exist.
    pub groups: Option<u64>,
    /// The id below which entries were trimmed (`""` when nothing was safe to trim).
    pub floor: String,
}

/// How a stream may be trimmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrimRule {
    /// Streams without consumer groups: trim entries older than this (ms); 0 = never.
    pub ungrouped_after_ms: u64,
    /// Hard cap on a stream's length; 0 = none.
    pub max_len: u64,
}

impl Publisher {
    /// Trims one stream by `rule`, atomically with reading its groups' positions.
    pub async fn trim(&self, stream: &str, rule: TrimRule) -> Result<TrimReport, PublishError> {
        let mut c = self.conn.clone();
        let reply: Value = redis::Script::new(LUA)
            .key(stream)
            .arg(rule.ungrouped_after_ms)
            .arg(rule.max_len)
            .invoke_async(&mut c)
            .await
            .map_err(PublishError::from_redis)?;
        let bad = || PublishError::event("PROTOCOL", "unexpected reply from the trim script");
        let Value::Array(items) = reply else {
            return Err(bad());
        };
        let int = |i: usize| match items.get(i) {
            Some(Value::Int(n)) => Ok(*n),
            _ => Err(bad()),
        };
        let (trimmed, capped, groups) = (int(0)?, int(1)?, int(2)?);
        Ok(TrimReport {
            trimmed: u64::try_from(trimmed).unwrap_or(0),
            capped: u64::try_from(capped).unwrap_or(0),
            groups: u64::try_from(groups).ok(),
            floor: items
                .get(3)
                .and_then(super::script::text)
                .unwrap_or_default(),
        })
    }
}
