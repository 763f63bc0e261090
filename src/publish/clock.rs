//! What a node knows of Redis's clock, so that every publish call carries a deadline in Redis's
//! own time.
//!
//! A call the node gave up on (no answer within its time limit) is not cancelled: its bytes sit
//! in a socket, in a proxy or in a paused Redis, and run whenever they get through. Without a
//! deadline, every call a node sent during a partition ran when the partition healed — each one
//! a claim of its partition's ready rows — so a three-second partition appended hundreds of
//! copies, some of them after later events of their aggregates. With one, the script refuses a
//! call that runs too late for its answer to reach the node while it waits (a failed outcome with
//! the transient `LATE`): a call either runs while its node still waits for the answer, or not at
//! all. The node sends a partition's next call only after giving up on the previous one, so no
//! call runs after a later call of its partition, and a lost answer costs at most that call's
//! entries once more.
//!
//! The deadline is the Redis time of the moment half of the node's wait has passed: a call must
//! run in the first half, and the second half is for its answer to come back. The answer can lag
//! well behind the run: a server that catches up on held calls (a paused Redis, a healed
//! partition) runs every call a connection queued before writing any of their answers, and a
//! call run just before the moment the node gives up would have its answer lost, appending its
//! entries for nothing. The half also covers the truncation of `TIME` to milliseconds and the
//! drift of the two clocks between readings (NTP slews a clock by at most 500 µs per second:
//! 5 ms over [`REFRESH`]). The node reads Redis's clock with `TIME` (on a cluster, the clock of
//! the primary holding the stream's slot) and keeps the lowest offset the reading allows
//! (`TIME`'s answer minus the moment the answer arrived: the true offset is no lower), so a
//! deadline is never later than the true one by more than that drift. A reading is
//! taken again after [`REFRESH`] and after a call was refused as late (Redis's clock may have
//! been stepped, or a failover brought a server with another clock). A Redis clock stepped back
//! by more than half the wait weakens the deadline until the next reading; stepped forward,
//! calls are refused as late until then.
//!
//! A server that refuses `TIME` itself (a proxy in front of several Redis servers that does not
//! pass it on, an ACL without it) leaves its calls without a deadline, as before deadlines
//! existed; the node says so once in its log and asks again at each refresh.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use redis::cluster_routing::Slot;

/// How long a reading of Redis's clock is used before it is taken again.
pub(super) const REFRESH: Duration = Duration::from_secs(10);

/// Whose clock: the single Redis (`None`), or the cluster primary holding a slot.
pub(super) type Source = Option<Slot>;

/// A reading: Redis's time in milliseconds minus the node's at the moment the answer came
/// (`None`: the server refused `TIME`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Reading {
    offset_ms: Option<i64>,
    taken: Instant,
}

/// The node's readings of Redis's clocks; shared by a publisher's clones.
#[derive(Debug)]
pub(super) struct RedisClock {
    /// The node's zero: local times are milliseconds since it.
    anchor: Instant,
    readings: Mutex<HashMap<Source, Reading>>,
    /// The node said once that a server refuses `TIME`.
    pub(super) warned: AtomicBool,
}

impl RedisClock {
    pub(super) fn new() -> Self {
        Self {
            anchor: Instant::now(),
            readings: Mutex::new(HashMap::new()),
            warned: AtomicBool::new(false),
        }
    }

    fn local_ms(&self, t: Instant) -> i64 {
        i64::try_from(t.saturating_duration_since(self.anchor).as_millis()).unwrap_or(i64::MAX)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Source, Reading>> {
        // A panic while holding the lock leaves only a map of readings behind, each one whole.
        self.readings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `source`'s reading when it is fresh at `now`.
    pub(super) fn fresh(&self, source: Source, now: Instant) -> Option<Reading> {
        self.lock()
            .get(&source)
            .filter(|r| now.saturating_duration_since(r.taken) < REFRESH)
            .copied()
    }

    /// Records `TIME`'s answer (`redis_ms`; `None` when the server refused the command) that
    /// arrived at `received`.
    pub(super) fn record(
        &self,
        source: Source,
        redis_ms: Option<i64>,
        received: Instant,
    ) -> Reading {
        let reading = Reading {
            offset_ms: redis_ms.map(|ms| ms.saturating_sub(self.local_ms(received))),
            taken: received,
        };
        self.lock().insert(source, reading);
        reading
    }

    /// Forgets `source`'s reading (a call was refused as late): the next call reads it again.
    pub(super) fn forget(&self, source: Source) {
        self.lock().remove(&source);
    }

    /// The deadline, in the milliseconds of the clock `reading` is of, of a call sent no earlier
    /// than `sent` that the node gives up on `limit` after sending it: half of `limit` after
    /// `sent`; `0` (none) when the server refused `TIME`.
    pub(super) fn deadline(&self, reading: Reading, sent: Instant, limit: Duration) -> i64 {
        let Some(offset_ms) = reading.offset_ms else {
            return 0;
        };
        let run_by =
            self.local_ms(sent) + i64::try_from((limit / 2).as_millis()).unwrap_or(i64::MAX / 2);
        run_by.saturating_add(offset_ms)
    }
}

/// Milliseconds from `TIME`'s answer: `[seconds, microseconds]`.
pub(super) fn time_ms(reply: &[String]) -> Option<i64> {
    let [s, us] = reply else { return None };
    let (s, us): (i64, i64) = (s.parse().ok()?, us.parse().ok()?);
    s.checked_mul(1000)?.checked_add(us / 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_half_the_wait_in_redis_time() {
        let clock = RedisClock::new();
        let start = clock.anchor + Duration::from_secs(1);
        assert!(clock.fresh(None, start).is_none());
        // Redis says 1,000,000 ms when the answer arrives at local 1,000 ms.
        let reading = clock.record(None, Some(1_000_000), start);
        assert!(clock.fresh(None, start + Duration::from_secs(9)).is_some());
        assert!(clock.fresh(None, start + REFRESH).is_none());
        let sent = start + Duration::from_millis(500);
        assert_eq!(
            clock.deadline(reading, sent, Duration::from_secs(2)),
            1_000_000 + 500 + 1_000
        );
        // A server that refuses TIME: no deadline.
        let slot = Some(Slot::for_key("orders"));
        let refused = clock.record(slot, None, start);
        assert_eq!(clock.deadline(refused, sent, Duration::from_secs(2)), 0);
        // Each source has its own clock.
        assert!(
            clock
                .fresh(Some(Slot::for_key("payments")), start)
                .is_none()
        );
        clock.forget(None);
        assert!(clock.fresh(None, start).is_none());
    }

    #[test]
    fn time_replies() {
        let t = |a: &str, b: &str| time_ms(&[a.to_owned(), b.to_owned()]);
        assert_eq!(t("1764800000", "123456"), Some(1_764_800_000_123));
        assert_eq!(t("x", "1"), None);
        assert_eq!(time_ms(&["1".to_owned()]), None);
    }
}
