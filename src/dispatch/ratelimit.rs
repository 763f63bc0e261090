//! Rate limits: global and per stream, for the whole cluster. A limit delays publishing; it
//! never drops or fails an event.
//!
//! Every node takes its permits from one budget per limit kept in Redis, so a limit is the
//! cluster's whatever the number of nodes and however the partitions are spread over them. Each
//! budget is a GCRA bucket (the generic cell rate algorithm, as in `governor`): one key holding
//! the bucket's theoretical arrival time, in microseconds of Redis's clock. One script call per
//! partition's batch asks every bucket the batch needs: each limited stream's bucket grants its
//! permits or not, then the global bucket must grant the sum of what was granted, or nothing is
//! taken at all.
//!
//! Permits are asked for right after the claim and never waited for while holding anything:
//! the rows bound for a stream that has no permit yet, and the rest of their aggregates, stay
//! pending ([`Refused`]); the partition's other rows are published, the group's other
//! partitions are not held up, and the partition tries again when the script says the budget
//! will have room.
//!
//! A batch appends at most a bucket's burst of entries ([`RateLimits::stream_cap`],
//! [`RateLimits::total_cap`]; the plan cuts the aggregates beyond it), so in any stretch of time
//! `t` a limited stream gets at most `burst + rate × t` entries from the whole cluster.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::LazyLock;
use std::time::Duration;

use futures::future::join_all;

use crate::config::RateLimitConfig;
use crate::publish::{PublishError, RedisConn, hash_tag};

/// KEYS: the global bucket when ARGV[1] is `1`, then the buckets of limited streams. ARGV[2]:
/// permits the global bucket owes to streams without a limit of their own; then, three per key:
/// the emission interval and the burst tolerance in microseconds, and the permits wanted (for
/// the global bucket, its burst: it grants what the streams granted add to ARGV[2], at most
/// that).
///
/// Each stream bucket grants its permits or not on its own. Then the global bucket must grant
/// the sum of what was granted; when it cannot, nothing at all is taken. Returns the global
/// wait (0: granted or no global limit), then each stream bucket's wait (0: granted), in
/// microseconds. Nothing is taken from a bucket that refused.
const LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function ask(i, n)
  local interval = tonumber(ARGV[3 * i])
  local tolerance = tonumber(ARGV[3 * i + 1])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  local cost = n * interval
  local wait
  if cost > tolerance then
    wait = tat - now
  else
    wait = tat + cost - tolerance - now
  end
  return math.max(0, math.ceil(wait)), tat + cost
end
local function take(i, nxt)
  local ttl = math.ceil((nxt - now) / 1000) + 1000
  redis.call('SET', KEYS[i], string.format('%.0f', nxt), 'PX', ttl)
end
local global = ARGV[1] == '1'
local first = 1
if global then first = 2 end
local total = tonumber(ARGV[2])
local waits = {}
local nexts = {}
for i = first, #KEYS do
  local wait, nxt = ask(i, tonumber(ARGV[3 * i + 2]))
  waits[i] = wait
  nexts[i] = nxt
  if wait == 0 then total = total + tonumber(ARGV[3 * i + 2]) end
end
local out = {0}
if global then total = math.min(total, tonumber(ARGV[5])) end
if global and total > 0 then
  local wait, nxt = ask(1, total)
  if wait > 0 then
    out[1] = wait
    for i = first, #KEYS do out[#out + 1] = math.max(wait, waits[i]) end
    return out
  end
  take(1, nxt)
end
for i = first, #KEYS do
  if waits[i] == 0 then take(i, nexts[i]) end
  out[#out + 1] = waits[i]
end
return out
";

static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(LUA));

/// One budget: a rate and its burst, as the script's emission interval and tolerance.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Quota {
    interval_us: f64,
    tolerance_us: f64,
    /// The most permits one batch takes: a batch appends no more than this.
    burst: usize,
}

impl Quota {
    fn new(rate: NonZeroU32, burst: NonZeroU32) -> Self {
        let interval_us = 1_000_000.0 / f64::from(rate.get());
        Self {
            interval_us,
            tolerance_us: interval_us * f64::from(burst.get()),
            burst: usize::try_from(burst.get()).unwrap_or(usize::MAX),
        }
    }
}

/// What a partition's batch was told: the streams it may not append to yet (an empty list when
/// every permit was taken or no limit applies).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Refused {
    /// Stream keys whose entries must wait; every stream when the global budget refused.
    pub streams: Vec<String>,
    /// When the longest of those waits ends.
    pub retry_in: Duration,
}

impl Refused {
    /// Whether `stream` must wait.
    pub fn holds(&self, stream: &str) -> bool {
        self.streams.iter().any(|s| s == stream)
    }
}

/// Why permits could not be asked for.
#[derive(Debug, Clone, thiserror::Error)]
#[error("cannot take rate-limit permits: {0}")]
pub struct LimitError(pub PublishError);

/// The cluster's limits as this node applies them.
#[derive(Debug)]
pub struct RateLimits {
    global: Option<Quota>,
    per_stream: Option<Quota>,
    /// Limits of named streams, by stream key; `None` when the stream is unlimited.
    streams: HashMap<String, Option<Quota>>,
    /// The buckets' key names start with this (one hash slot on a Redis Cluster).
    key_base: String,
}

impl RateLimits {
    /// The limits of `config`, for streams under `key_prefix`; `stream_key` makes a stream's key
    /// from its name.
    pub fn new(
        config: &RateLimitConfig,
        key_prefix: &str,
        stream_key: impl Fn(&str) -> String,
    ) -> Self {
        let quota = |rate: Option<NonZeroU32>| rate.map(|r| Quota::new(r, config.burst_for(r)));
        // Every bucket in one hash slot, so one script call can take several: the prefix's own
        // tag when it has one, otherwise a tag of the limits' own.
        let key_base = if hash_tag(key_prefix).is_some() {
            format!("{key_prefix}outpost:rate:")
        } else {
            format!("{key_prefix}outpost:rate:{{limits}}:")
        };
        Self {
            global: quota(config.global()),
            per_stream: quota(config.per_stream()),
            streams: config
                .streams
                .iter()
                .map(|(name, rate)| (stream_key(name), quota(NonZeroU32::new(*rate))))
                .collect(),
            key_base,
        }
    }

    /// The limit of `stream`: its own in `rate_limit.streams`, or `per_stream_per_sec`.
    fn quota_of(&self, stream: &str) -> Option<Quota> {
        match self.streams.get(stream) {
            Some(q) => *q,
            None => self.per_stream,
        }
    }

    /// The most entries one batch may append to `stream` (the burst of its bucket), or `None`
    /// when no limit applies to the stream itself.
    pub fn stream_cap(&self, stream: &str) -> Option<usize> {
        self.quota_of(stream).map(|q| q.burst)
    }

    /// The most entries one batch may append over all streams (the global burst).
    pub fn total_cap(&self) -> Option<usize> {
        self.global.map(|q| q.burst)
    }

    /// Whether any limit applies.
    pub fn any(&self) -> bool {
        self.global.is_some()
            || self.per_stream.is_some()
            || self.streams.values().any(Option::is_some)
    }

    /// What a batch of `(stream key, entries)` calls asks of the buckets.
    fn wants<'a>(&self, calls: &[(&'a str, usize)]) -> Wants<'a> {
        let mut wants = Wants {
            global: None,
            base: 0,
            streams: Vec::new(),
        };
        for &(stream, n) in calls.iter().filter(|c| c.1 > 0) {
            match self.quota_of(stream) {
                None => wants.base += n,
                Some(q) => match wants.streams.iter_mut().find(|w| w.0 == stream) {
                    Some(w) => w.2 = (w.2 + n).min(q.burst),
                    None => wants.streams.push((stream, q, n.min(q.burst))),
                },
            }
        }
        if wants.base + wants.streams.iter().map(|w| w.2).sum::<usize>() > 0 {
            wants.global = self.global;
        }
        wants
    }

    /// The key of a stream's bucket.
    fn stream_bucket(&self, stream: &str) -> String {
        format!("{}stream:{stream}", self.key_base)
    }

    /// Takes the permits of each partition's batch, given as the `(stream key, entries)` it
    /// would append; answers in the order of `batches`. The calls go out together.
    pub async fn take(
        &self,
        conn: &RedisConn,
        batches: &[Vec<(&str, usize)>],
    ) -> Vec<Result<Refused, LimitError>> {
        join_all(batches.iter().map(|calls| async move {
            let wants = self.wants(calls);
            if wants.global.is_none() && wants.streams.is_empty() {
                return Ok(Refused::default());
            }
            let mut invocation = SCRIPT.prepare_invoke();
            invocation
                .arg(if wants.global.is_some() { "1" } else { "0" })
                .arg(wants.base);
            if let Some(q) = wants.global {
                invocation
                    .key(format!("{}global", self.key_base))
                    .arg(q.interval_us)
                    .arg(q.tolerance_us)
                    .arg(q.burst);
            }
            for (stream, q, n) in &wants.streams {
                invocation
                    .key(self.stream_bucket(stream))
                    .arg(q.interval_us)
                    .arg(q.tolerance_us)
                    .arg(*n);
            }
            let reply: Vec<i64> = invocation
                .invoke_async(&mut conn.clone())
                .await
                .map_err(|e| LimitError(PublishError::from_redis(e)))?;
            Ok(wants.refused(calls, &reply))
        }))
        .await
    }
}

/// What one batch asks of the buckets.
#[derive(Debug)]
struct Wants<'a> {
    /// The global budget, when limited and the batch appends anything.
    global: Option<Quota>,
    /// Entries of streams without a limit of their own (they count against the global one).
    base: usize,
    /// Limited streams: key, quota, entries.
    streams: Vec<(&'a str, Quota, usize)>,
}

impl Wants<'_> {
    /// The script's reply (global wait, then each limited stream's) as the refused streams.
    fn refused(&self, calls: &[(&str, usize)], reply: &[i64]) -> Refused {
        let micros = |w: i64| Duration::from_micros(u64::try_from(w).unwrap_or(0));
        let global = reply.first().copied().unwrap_or(0);
        if global > 0 {
            // Nothing was taken: every stream waits, for at least the global budget.
            let longest = reply.iter().copied().max().unwrap_or(global);
            let mut streams: Vec<String> = calls.iter().map(|c| c.0.to_owned()).collect();
            streams.sort();
            streams.dedup();
            return Refused {
                streams,
                retry_in: micros(longest),
            };
        }
        let mut refused = Refused::default();
        for ((stream, _, _), wait) in self.streams.iter().zip(reply.iter().skip(1)) {
            if *wait > 0 {
                refused.streams.push((*stream).to_owned());
                refused.retry_in = refused.retry_in.max(micros(*wait));
            }
        }
        refused
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn config(global: u32, per_stream: u32, streams: &[(&str, u32)]) -> RateLimitConfig {
        RateLimitConfig {
            global_per_sec: global,
            per_stream_per_sec: per_stream,
            burst: 0,
            streams: streams
                .iter()
                .map(|(s, r)| ((*s).to_owned(), *r))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    #[test]
    fn a_batch_asks_each_limited_stream_and_the_global_budget_for_the_rest() {
        let limits = RateLimits::new(&config(1000, 50, &[("b", 0), ("c", 7)]), "p:", |s| {
            format!("p:{s}")
        });
        let calls = [("p:a", 3), ("p:b", 4), ("p:c", 5), ("p:a", 2), ("p:d", 0)];
        let wants = limits.wants(&calls);
        let streams: Vec<(&str, usize)> = wants.streams.iter().map(|w| (w.0, w.2)).collect();
        assert_eq!(
            streams,
            vec![("p:a", 5), ("p:c", 5)],
            "b is named unlimited, a takes the per-stream default, c its own"
        );
        assert_eq!(
            wants.base, 4,
            "b's entries count against the global budget only"
        );
        assert!(wants.global.is_some());
        assert!((wants.streams[1].1.interval_us - 1_000_000.0 / 7.0).abs() < 1e-6);
        assert!((wants.streams[1].1.tolerance_us - 1_000_000.0).abs() < 1e-3);
        assert_eq!(
            limits.stream_bucket("p:a"),
            "p:outpost:rate:{limits}:stream:p:a"
        );

        // The script's answers: c refused alone; then the global budget refusing everything.
        let refused = wants.refused(&calls, &[0, 0, 250_000]);
        assert_eq!(refused.streams, vec!["p:c".to_owned()]);
        assert_eq!(refused.retry_in, Duration::from_millis(250));
        assert!(refused.holds("p:c") && !refused.holds("p:a"));
        let refused = wants.refused(&calls, &[40_000, 0, 250_000]);
        assert_eq!(refused.streams, vec!["p:a", "p:b", "p:c", "p:d"]);
        assert_eq!(refused.retry_in, Duration::from_millis(250));
    }

    #[test]
    fn buckets_share_the_prefix_hash_tag_or_one_of_their_own() {
        let limits = RateLimits::new(&config(10, 1, &[]), "{app}:", |s| format!("{{app}}:{s}"));
        assert_eq!(
            limits.stream_bucket("{app}:s"),
            "{app}:outpost:rate:stream:{app}:s"
        );
        let none = RateLimits::new(&config(0, 0, &[]), "", |s: &str| s.to_owned());
        let wants = none.wants(&[("s", 9)]);
        assert!(wants.global.is_none() && wants.streams.is_empty());
        assert!(!RateLimits::new(&config(0, 0, &[("s", 0)]), "", |s: &str| s.to_owned()).any());
    }
}
