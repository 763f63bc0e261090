//! Commit → stream latency, measured from outside the relay: when each event's commit returned
//! to its producer, and when a reader blocked on the stream first saw its entry.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::Value;
use redis::streams::StreamReadOptions;

use crate::produce::load::Committed;

/// Per load index: nanoseconds since `base` (plus one; 0 = not yet) at commit and at arrival.
pub(super) struct Arrivals {
    base: Instant,
    committed: Vec<AtomicU64>,
    seen: Vec<AtomicU64>,
}

/// Percentiles of the commit → stream latencies, in seconds.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Percentiles {
    /// Events both committed and seen in the stream.
    pub events: usize,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Arrivals {
    /// Room for load indexes `0..count`.
    pub fn new(count: u64) -> Arc<Self> {
        let slots = || (0..count).map(|_| AtomicU64::new(0)).collect();
        Arc::new(Self {
            base: Instant::now(),
            committed: slots(),
            seen: slots(),
        })
    }

    /// Stamps `index` now unless it was stamped before; whether it was new.
    fn stamp(&self, slots: &[AtomicU64], index: u64) -> bool {
        let ns = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX - 1) + 1;
        usize::try_from(index)
            .ok()
            .and_then(|i| slots.get(i))
            .is_some_and(|slot| {
                slot.compare_exchange(0, ns, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            })
    }

    /// The load's progress callback: stamps the commit of every event of a transaction.
    pub fn on_commit(self: &Arc<Self>) -> Arc<dyn Fn(Committed) + Send + Sync> {
        let me = self.clone();
        Arc::new(move |c: Committed| {
            for i in c.first..c.first + c.count {
                me.stamp(&me.committed, i);
            }
        })
    }

    /// (commit time in nanoseconds since `base`, latency in nanoseconds) of every event both
    /// committed and seen; an entry seen a few microseconds before its producer heard of the
    /// commit counts as 0.
    fn latencies(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.committed.iter().zip(&self.seen).filter_map(|(c, s)| {
            let (c, s) = (c.load(Ordering::Relaxed), s.load(Ordering::Relaxed));
            (c > 0 && s > 0).then(|| (c, s.saturating_sub(c)))
        })
    }

    /// Latency of every event both committed and seen.
    pub fn percentiles(&self) -> Percentiles {
        Percentiles::of(self.latencies().map(|(_, l)| l).collect())
    }

    /// The same percentiles for each second of commits, from the first commit on: tells a tail
    /// spread evenly over the run from one made by a few stalls.
    pub fn per_second(&self) -> Vec<Percentiles> {
        let first = self.latencies().map(|(c, _)| c).min().unwrap_or(0);
        let mut seconds: Vec<Vec<u64>> = Vec::new();
        for (c, l) in self.latencies() {
            // `first` is the earliest commit, so `c - first` cannot underflow; a steady run lasts
            // seconds to minutes, so the vector stays small.
            let Ok(i) = usize::try_from((c - first) / 1_000_000_000) else {
                continue;
            };
            if i >= seconds.len() {
                seconds.resize_with(i + 1, Vec::new);
            }
            if let Some(v) = seconds.get_mut(i) {
                v.push(l);
            }
        }
        seconds.into_iter().map(Percentiles::of).collect()
    }
}

impl Percentiles {
    /// Percentiles of latencies in nanoseconds.
    fn of(mut lat: Vec<u64>) -> Self {
        lat.sort_unstable();
        let at = |q: f64| {
            let last = lat.len().checked_sub(1)?;
            let i = ((last as f64) * q).round() as usize;
            lat.get(i.min(last)).map(|ns| *ns as f64 / 1e9)
        };
        Self {
            events: lat.len(),
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

/// Reads `key` from its start (each steady run begins with the stream deleted), stamping each entry's arrival by the load index in its
/// payload (`"n"`), until every index was seen or `stop` is set and the stream is quiet.
pub(super) async fn watch(
    client: redis::Client,
    key: String,
    arrivals: Arc<Arrivals>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let config =
        redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(10)));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    let mut last = "0-0".to_owned();
    let total = arrivals.seen.len();
    let mut seen = 0usize;
    loop {
        let opts = StreamReadOptions::default().count(1000).block(100);
        let entries = super::tail::read_after(&mut conn, &key, &last, &opts).await?;
        if entries.is_empty() {
            if stop.load(Ordering::Relaxed) || seen >= total {
                return Ok(());
            }
            continue;
        }
        for e in entries {
            if let Some(n) = e.map.get("data").and_then(load_index)
                && arrivals.stamp(&arrivals.seen, n)
            {
                seen += 1;
            }
            last = e.id;
        }
    }
}

/// The `"n"` of a load payload (`{"n":123,"pad":"…"}`), without parsing the rest.
fn load_index(data: &Value) -> Option<u64> {
    let Value::BulkString(bytes) = data else {
        return None;
    };
    let at = bytes.windows(4).position(|w| w == b"\"n\":")? + 4;
    let digits: Vec<u8> = bytes[at..]
        .iter()
        .copied()
        .skip_while(|b| *b == b' ')
        .take_while(u8::is_ascii_digit)
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_load_index() {
        let v = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert_eq!(load_index(&v(r#"{"n":123,"pad":"xx"}"#)), Some(123));
        assert_eq!(load_index(&v(r#"{"n": 7}"#)), Some(7));
        assert_eq!(load_index(&v(r#"{"pad":"x"}"#)), None);
    }

    #[test]
    fn percentiles_of_committed_and_seen_events() {
        let a = Arrivals::new(4);
        for i in 0..3 {
            a.committed[i].store(1_000_000, Ordering::Relaxed);
            a.seen[i].store(1_000_000 + (i as u64 + 1) * 1_000_000, Ordering::Relaxed);
        }
        let p = a.percentiles();
        assert_eq!(p.events, 3);
        assert_eq!(p.p50, Some(0.002));
        assert_eq!(p.max, Some(0.003));
    }

    #[test]
    fn percentiles_per_second_of_commit() {
        let a = Arrivals::new(3);
        // Two events committed in the first second, one 2.5 s later; none in between.
        for (i, (c, l)) in [
            (1_000, 1_000_000),
            (500_000_000, 3_000_000),
            (2_500_000_000, 40_000_000),
        ]
        .into_iter()
        .enumerate()
        {
            a.committed[i].store(c, Ordering::Relaxed);
            a.seen[i].store(c + l, Ordering::Relaxed);
        }
        let s = a.per_second();
        assert_eq!(s.len(), 3);
        assert_eq!((s[0].events, s[0].max), (2, Some(0.003)));
        assert_eq!(s[1].events, 0);
        assert_eq!((s[2].events, s[2].p50), (1, Some(0.04)));
    }
}
