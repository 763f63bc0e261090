//! The fenced append script.

use redis::{Cmd, Value};

use super::{PublishError, StreamOutcome};

/// KEYS[1]: fence hash, KEYS[2]: stream. ARGV[1]: partition, ARGV[2]: epoch, ARGV[3]: `1` when
/// the stream is known to have been written before (its fence hash must exist), then per entry:
/// the number of arguments that follow for it, then `field value ...`.
///
/// A negative epoch skips the fence entirely (only the `fence-off` fault point sends one, to show in
/// tests what the fence prevents).
///
/// Returns `{'lost'}` when a known stream has no fence hash (Redis lost its data: nothing is
/// appended until the loss is handled), `{'fenced', current}` when a newer epoch is recorded;
/// otherwise `{'ok', id...}`, or `{'error', message, id...}` when an `XADD` was refused after the
/// listed ids were appended.
const LUA: &str = r"
local fence = redis.call('HGET', KEYS[1], ARGV[1])
if not fence and ARGV[3] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then
  return {'lost'}
end
local current = tonumber(fence or '0')
local epoch = tonumber(ARGV[2])
if epoch >= 0 and current > epoch then
  return {'fenced', tostring(current)}
end
if current < epoch then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
local out = {'ok'}
local i = 4
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local r = redis.pcall('XADD', KEYS[2], '*', unpack(ARGV, i + 1, i + n))
  if type(r) == 'table' and r.err then
    out[1] = r.err
    table.insert(out, 1, 'error')
    return out
  end
  out[#out + 1] = r
  i = i + n + 1
end
return out
";

fn script() -> redis::Script {
    redis::Script::new(LUA)
}

/// `EVALSHA` of the script for one stream.
pub(super) fn call(
    fence: &str,
    stream: &str,
    partition: i32,
    epoch: i64,
    known: bool,
    entries: &[Vec<(&'static str, String)>],
) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script().get_hash())
        .arg(2)
        .arg(fence)
        .arg(stream)
        .arg(partition)
        .arg(epoch)
        .arg(if known { "1" } else { "0" });
    for fields in entries {
        cmd.arg(fields.len() * 2);
        for (name, value) in fields {
            cmd.arg(*name).arg(value.as_str());
        }
    }
    cmd
}

/// Loads the script (after a `NOSCRIPT`, e.g. when Redis restarted).
pub(super) async fn load<C: redis::aio::ConnectionLike>(c: &mut C) -> Result<(), PublishError> {
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(LUA)
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

/// Reads the script's reply.
pub(super) fn parse_reply(v: Value) -> Result<StreamOutcome, PublishError> {
    let bad = || PublishError::event("PROTOCOL", "unexpected reply from the publish script");
    let Value::Array(items) = v else {
        return Err(bad());
    };
    let mut it = items.iter();
    match it.next().and_then(text).as_deref() {
        Some("ok") => Ok(StreamOutcome::Published(it.filter_map(text).collect())),
        Some("lost") => Ok(StreamOutcome::Lost),
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
