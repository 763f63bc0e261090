//! The fenced append script.

use std::sync::LazyLock;

use redis::{Cmd, Value};

use super::entry::{FIXED, OPTIONAL, field};
use super::{PublishError, StreamBatch, StreamOutcome};

/// Epochs in fence hashes, for every script that reads them. A fence holds an epoch as the
/// decimal digits the relay wrote, and the scripts compare epochs as such strings: Lua's numbers
/// are doubles, exact only up to 2^53, and `tostring` writes 1e14 and above in exponent notation.
/// `epoch_of(s)` is `s` without leading zeros when it is an epoch the database can still move
/// past (`0 <= epoch < i64::MAX`), otherwise `nil`: a fence someone else wrote. `epoch_below(a,
/// b)` compares two such strings (halves of at most ten digits are exact as numbers).
pub(super) const LUA_EPOCH: &str = r"
local function epoch_below(a, b)
  if #a ~= #b then return #a < #b end
  local cut = #a - 9
  if cut > 0 then
    local ah, bh = tonumber(string.sub(a, 1, cut)), tonumber(string.sub(b, 1, cut))
    if ah ~= bh then return ah < bh end
    return tonumber(string.sub(a, cut + 1)) < tonumber(string.sub(b, cut + 1))
  end
  return tonumber(a) < tonumber(b)
end
local function epoch_of(s)
  if type(s) ~= 'string' or not string.find(s, '^%d+$') then return nil end
  local t = (string.gsub(s, '^0+', ''))
  if t == '' then return '0' end
  if #t > 19 or not epoch_below(t, '9223372036854775807') then return nil end
  return t
end
";

/// KEYS[1]: fence hash, KEYS[2]: stream. ARGV[1]: partition, ARGV[2]: epoch, ARGV[3]: `1` when
/// the stream is known to have been written before (its fence hash must exist), ARGV[4]: the
/// call's deadline in Redis's milliseconds (`0`: none; `clock`), ARGV[5]: the newest entry id
/// the partition is known to have appended to the stream (empty: none known), then per entry:
/// its shape (which optional fields it has, [`Entry`]'s bits) and the values it brings, in field
/// order. Field names and constant values are literals of the script (generated from
/// [`FIXED`] and [`OPTIONAL`]): Redis turns every argument into a Lua string and back, and
/// sending only the values halves that work.
///
/// A negative epoch skips the fence entirely (only the `fence-off` fault point sends one, to show in
/// tests what the fence prevents).
///
/// The fence hash holds, per partition, its epoch (field `<partition>`) and the newest entry
/// id it appended (field `<partition>:last`), written in the same step as the entries: a Redis
/// restored from a snapshot, or a replica promoted, has both as of the same moment.
///
/// Returns `{'late'}` when the call runs after its deadline (its node gave up on it: nothing is
/// appended), `{'lost'}` when a known stream has no fence hash, or the partition's newest entry
/// at Redis is older than ARGV[5] (Redis lost data: nothing is appended until the loss is
/// handled), `{'badfence', value}` when the partition's field holds something that is not an
/// epoch (its first 64 bytes), `{'badfence'}` when the fence is not a hash (nothing is appended
/// until someone fixes it), `{'fenced', current}` when a newer epoch is recorded; otherwise
/// `{'ok', id...}`, or `{'error', message, id...}` when an `XADD` was refused after the listed
/// ids were appended.
const LUA_FENCE: &str = r"
local deadline = tonumber(ARGV[4])
if deadline > 0 then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > deadline then
    return {'late'}
  end
end
local raw = redis.pcall('HGET', KEYS[1], ARGV[1])
if type(raw) == 'table' and raw.err then
  return {'badfence'}
end
if not raw and ARGV[3] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then
  return {'lost'}
end
local current = '0'
if raw then
  current = epoch_of(raw)
  if not current then
    return {'badfence', string.sub(raw, 1, 64)}
  end
end
local epoch = ARGV[2]
local fenced = string.sub(epoch, 1, 1) ~= '-'
if fenced and epoch_below(epoch, current) then
  return {'fenced', current}
end
if ARGV[5] ~= '' then
  local kept = redis.call('HGET', KEYS[1], ARGV[1] .. ':last')
  local km, ks, em, es
  if kept then km, ks = string.match(kept, '^(%d+)-(%d+)$') end
  em, es = string.match(ARGV[5], '^(%d+)-(%d+)$')
  km, ks, em, es = tonumber(km), tonumber(ks), tonumber(em), tonumber(es)
  if em and (not km or km < em or (km == em and ks < es)) then
    return {'lost'}
  end
end
if fenced and epoch_below(current, epoch) then
  redis.call('HSET', KEYS[1], ARGV[1], epoch)
end
local stream = KEYS[2]
local out = {'ok'}
local i = 6
local last = #ARGV
while i <= last do
  local shape = ARGV[i]
  local r
";

const LUA_END: &str = r"
  if type(r) == 'table' and r.err then
    if #out > 1 then redis.call('HSET', KEYS[1], ARGV[1] .. ':last', out[#out]) end
    out[1] = r.err
    table.insert(out, 1, 'error')
    return out
  end
  out[#out + 1] = r
end
if #out > 1 then redis.call('HSET', KEYS[1], ARGV[1] .. ':last', out[#out]) end
return out
";

/// The script's text: [`LUA_FENCE`], the `XADD` of one entry with the field names written in,
/// [`LUA_END`].
fn lua() -> String {
    // `XADD stream * name value ...` over FIXED, taking the varying values from ARGV[i + 1...].
    let mut fixed = String::new();
    let mut arg = 0;
    for (name, constant) in FIXED {
        let value = match constant {
            Some(c) => format!("'{c}'"),
            None => {
                arg += 1;
                format!("ARGV[i + {arg}]")
            }
        };
        fixed.push_str(&format!(", '{name}', {value}"));
    }
    let data = field::DATA;
    let after = arg + 1;
    let mut lines = vec![
        "  if shape == '0' then".to_owned(),
        format!("    r = redis.pcall('XADD', stream, '*'{fixed}, '{data}', ARGV[i + {after}])"),
        format!("    i = i + {}", after + 1),
        "  else".to_owned(),
        "    shape = tonumber(shape)".to_owned(),
        format!("    local a = {{'XADD', stream, '*'{fixed}}}"),
        format!("    local j = i + {after}"),
    ];
    for (bit, name) in OPTIONAL.iter().enumerate() {
        let (low, high) = (1u32 << bit, 2u32 << bit);
        lines.push(format!(
            "    if shape % {high} >= {low} then a[#a + 1] = '{name}'; a[#a + 1] = ARGV[j]; j = j + 1 end"
        ));
    }
    lines.extend([
        format!("    a[#a + 1] = '{data}'; a[#a + 1] = ARGV[j]"),
        "    r = redis.pcall(unpack(a))".to_owned(),
        "    i = j + 1".to_owned(),
        "  end".to_owned(),
    ]);
    format!("{LUA_EPOCH}{LUA_FENCE}{}{LUA_END}", lines.join("\n"))
}

static SCRIPT: LazyLock<(String, redis::Script)> = LazyLock::new(|| {
    let text = lua();
    let script = redis::Script::new(&text);
    (text, script)
});

/// `EVALSHA` of the script for one stream's batch, checked against `fence` and `deadline`.
pub(super) fn call(fence: &str, batch: &StreamBatch, deadline: i64) -> Cmd {
    let StreamBatch {
        stream,
        partition,
        epoch,
        known,
        expect,
        entries,
    } = batch;
    // Sized up front: a call carries a whole batch (hundreds of kilobytes when draining), and
    // growing the buffer would copy it several times over.
    let (args, bytes) = entries
        .iter()
        .fold((10, 184 + stream.len() * 2), |(a, b), e| {
            e.values()
                .fold((a + 1, b + 1), |(a, b), v| (a + 1, b + v.len()))
        });
    let mut cmd = Cmd::with_capacity(args, bytes);
    cmd.arg("EVALSHA")
        .arg(SCRIPT.1.get_hash())
        .arg(2)
        .arg(fence)
        .arg(stream)
        .arg(partition)
        .arg(epoch)
        .arg(if *known { "1" } else { "0" })
        .arg(deadline);
    match expect {
        Some((ms, seq)) => cmd.arg(format!("{ms}-{seq}")),
        None => cmd.arg(""),
    };
    for entry in entries {
        cmd.arg(entry.shape());
        for value in entry.values() {
            cmd.arg(value);
        }
    }
    cmd
}

/// Loads the script (after a `NOSCRIPT`, e.g. when Redis restarted).
pub(super) async fn load<C: redis::aio::ConnectionLike>(c: &mut C) -> Result<(), PublishError> {
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(SCRIPT.0.as_str())
        .query_async::<String>(c)
        .await
        .map_err(PublishError::from_redis)?;
    Ok(())
}

pub(super) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

/// Reads the script's reply to a call fenced by `fence`.
pub(super) fn parse_reply(v: Value, fence: &str) -> Result<StreamOutcome, PublishError> {
    let bad = || PublishError::event("PROTOCOL", "unexpected reply from the publish script");
    let Value::Array(items) = v else {
        return Err(bad());
    };
    let mut it = items.iter();
    match it.next().and_then(text).as_deref() {
        Some("ok") => Ok(StreamOutcome::Published(it.filter_map(text).collect())),
        Some("lost") => Ok(StreamOutcome::Lost),
        Some("late") => Ok(StreamOutcome::Failed {
            ids: Vec::new(),
            error: PublishError::late(),
        }),
        Some("badfence") => Ok(StreamOutcome::BadFence {
            fence: fence.to_owned(),
            value: it.next().and_then(text),
        }),
        Some("fenced") => {
            let current = it
                .next()
                .and_then(text)
                .and_then(|s| s.parse().ok())
                .ok_or_else(bad)?;
            Ok(StreamOutcome::Fenced { current })
        }
        Some("error") => {
            let message = it.next().and_then(text).ok_or_else(bad)?;
            Ok(StreamOutcome::Failed {
                ids: it.filter_map(text).collect(),
                error: PublishError::from_reply(&message),
            })
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names and constants are pasted into the script between single quotes.
    #[test]
    fn names_and_constants_are_safe_lua_literals() {
        let plain = |s: &str| {
            s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b))
        };
        for (name, constant) in FIXED {
            assert!(plain(name) && constant.is_none_or(plain), "{name}");
        }
        assert!(OPTIONAL.iter().all(|n| plain(n)) && plain(field::DATA));
        assert!(lua().contains("'content-type', 'application/json', 'data', ARGV[i + 9]"));
    }
}
