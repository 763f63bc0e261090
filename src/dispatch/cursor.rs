//! Cursors past rows that wait for a rate-limit permit.
//!
//! A claim reads a partition's oldest ready rows. When a rate-limited stream has a backlog in a
//! partition it shares with other streams, its rows stay at the head of the partition (they wait
//! for permits) and would fill every claim: the other streams' rows behind them would wait for
//! the limited stream's backlog to drain. So when some of a claim's rows are refused a permit,
//! the partition gets a cursor: its next claims read only rows past the last row claimed
//! ([`crate::store::Store::claim_after`]), skipping every row whose aggregate still has a
//! pending row at or before the cursor, so that no aggregate's events overtake one another.
//!
//! A **pass** starts at the partition's oldest row and moves the cursor on to the last row of
//! each claim, claim after claim, as long as claims come back full; a claim that is not full has
//! reached the newest rows. Until the budget has room again (the `retry_in` the limiter
//! answered), claims go on reading past the cursor: rows that arrive meanwhile are published at
//! once. Then one claim reads the oldest rows again, which takes the permits the budget has for
//! the limited stream, and the pass goes on from where the cursor was. When the budget has room
//! for all of them, the cursor is dropped.
//!
//! Rows at or before the cursor that become ready later (an aggregate whose waiting row has since
//! been published, a transaction that committed late with a smaller id) are read by the next
//! **full pass**, which starts again from the oldest row and leaves the cursor behind. Full passes
//! come at least [`RESCAN`] apart, and further apart when one takes long (the waiting backlog is
//! read again each time), so they cost at most a fifth of the partition's time. Due retries are
//! read whatever the cursor says (an aggregate's rows after a retry are held, never pending). A
//! batch that fails drops its partition's cursor, so rows whose publishing failed are read again
//! at once.
//!
//! Nothing here is durable: a cursor belongs to one lease epoch of one node, and a lost cursor
//! costs one pass.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::store::LeaseRef;

/// The least time between two full passes over a partition.
pub const RESCAN: Duration = Duration::from_secs(1);

/// A partition's position past its refused rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cursor {
    /// The lease the cursor belongs to.
    epoch: i64,
    /// Claims read rows with a larger id.
    after_id: i64,
    /// When the budget should have room again: the next claim after it reads the oldest rows.
    retry_at: Instant,
    /// The pass has reached the partition's newest rows.
    traversed: bool,
    /// When the full pass under way started (`None`: it has reached the newest rows).
    full_pass: Option<Instant>,
    /// When the next full pass may start.
    rescan_at: Instant,
}

/// Where a partition stands after a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// No cursor: the partition's claims read from the oldest row.
    None,
    /// The pass is moving past refused rows: claim again at once.
    Moving,
    /// The pass has reached the newest rows: claim again after this long (sooner on a wake-up,
    /// which reads only rows past the cursor).
    Waiting(Duration),
}

/// What a claim found for one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimed {
    /// Where the claim started ([`Cursors::start`]; 0: at the oldest row).
    pub from: i64,
    /// The largest id claimed, if any row was.
    pub last_id: Option<i64>,
    /// The claim stopped at its row or byte limit: more rows may be ready.
    pub full: bool,
    /// Some rows wait for a permit, which the limiter expects after this long.
    pub refused: Option<Duration>,
}

/// The cursors of a node's partitions.
#[derive(Debug, Default)]
pub struct Cursors {
    map: std::sync::Mutex<HashMap<i32, Cursor>>,
}

impl Cursors {
    /// Where `lease`'s next claim at `now` starts: past this row id, or at the oldest row (0).
    pub fn start(&self, lease: &LeaseRef, now: Instant) -> i64 {
        let mut map = self.lock();
        match map.get(&lease.partition) {
            Some(c) if c.epoch == lease.epoch => {
                if !c.traversed || now < c.retry_at {
                    c.after_id
                } else {
                    if now >= c.rescan_at {
                        // A full pass: the cursor starts over from this claim's rows.
                        map.remove(&lease.partition);
                    }
                    0
                }
            }
            Some(_) => {
                map.remove(&lease.partition);
                0
            }
            None => 0,
        }
    }

    /// Records what `lease`'s claim found at `now`, and says what the partition does next.
    pub fn record(&self, lease: &LeaseRef, now: Instant, claimed: Claimed) -> Pass {
        let mut map = self.lock();
        let current = map
            .get(&lease.partition)
            .copied()
            .filter(|c| c.epoch == lease.epoch);
        let next = match (current, claimed.refused) {
            // The budget had room for what the oldest rows needed: claims read from them again.
            (_, None) if claimed.from == 0 => None,
            (None, None) => None,
            // Past rows that were all published: the cursor moves on too, so the next claim
            // does not read again through the rows this one skipped.
            (Some(c), None) => Some(Cursor {
                after_id: c.after_id.max(claimed.last_id.unwrap_or(0)),
                traversed: c.traversed || !claimed.full,
                ..c
            }),
            (current, Some(retry_in)) => {
                let c = current.unwrap_or(Cursor {
                    epoch: lease.epoch,
                    after_id: 0,
                    retry_at: now,
                    traversed: false,
                    full_pass: Some(now),
                    rescan_at: now,
                });
                Some(Cursor {
                    after_id: c.after_id.max(claimed.last_id.unwrap_or(0)),
                    retry_at: now + retry_in,
                    traversed: !claimed.full,
                    ..c
                })
            }
        };
        let Some(mut c) = next else {
            map.remove(&lease.partition);
            return Pass::None;
        };
        if c.traversed
            && let Some(started) = c.full_pass.take()
        {
            // A full pass is over: the next one after a while, the longer the longer this one
            // took.
            c.rescan_at = now + RESCAN.max(now.saturating_duration_since(started) * 4);
        }
        map.insert(lease.partition, c);
        if c.traversed {
            Pass::Waiting(c.retry_at.saturating_duration_since(now))
        } else {
            Pass::Moving
        }
    }

    /// Drops `lease`'s cursor: its batch failed, and rows it had moved past may still be
    /// pending for reasons of their own; the next claim starts a full pass.
    pub fn forget(&self, lease: &LeaseRef) {
        let mut map = self.lock();
        if map
            .get(&lease.partition)
            .is_some_and(|c| c.epoch == lease.epoch)
        {
            map.remove(&lease.partition);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, Cursor>> {
        // The map holds plain values; a panic elsewhere while it was locked leaves it usable.
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(epoch: i64) -> LeaseRef {
        LeaseRef {
            partition: 3,
            node_id: "n".to_owned(),
            epoch,
        }
    }

    const MS: Duration = Duration::from_millis(1);

    /// A claim from `from` whose last row is `last_id` (0: none).
    fn claimed(from: i64, last_id: i64, full: bool, refused_ms: Option<u32>) -> Claimed {
        Claimed {
            from,
            last_id: (last_id > 0).then_some(last_id),
            full,
            refused: refused_ms.map(|ms| MS * ms),
        }
    }

    #[test]
    fn without_refusals_claims_read_from_the_oldest_row() {
        let c = Cursors::default();
        let now = Instant::now();
        assert_eq!(c.start(&lease(1), now), 0);
        assert_eq!(
            c.record(&lease(1), now, claimed(0, 40, true, None)),
            Pass::None
        );
        assert_eq!(c.start(&lease(1), now), 0);
    }

    #[test]
    fn a_pass_moves_past_full_refused_claims_then_waits_for_the_budget() {
        let c = Cursors::default();
        let t0 = Instant::now();
        let l = lease(1);
        assert_eq!(
            c.record(&l, t0, claimed(0, 100, true, Some(200))),
            Pass::Moving
        );
        assert_eq!(c.start(&l, t0), 100);
        // A full claim past the cursor with nothing refused: the pass goes on past it.
        assert_eq!(
            c.record(&l, t0, claimed(100, 150, true, None)),
            Pass::Moving
        );
        assert_eq!(c.start(&l, t0), 150);
        // Refused again: the cursor moves; the limiter's latest answer says when to come back.
        let t1 = t0 + 10 * MS;
        assert_eq!(
            c.record(&l, t1, claimed(100, 300, true, Some(200))),
            Pass::Moving
        );
        assert_eq!(c.start(&l, t1), 300);
        // A claim that is not full has reached the newest rows: wait for the budget, reading
        // only new rows meanwhile.
        let t2 = t1 + 10 * MS;
        assert_eq!(
            c.record(&l, t2, claimed(300, 0, false, None)),
            Pass::Waiting(190 * MS)
        );
        assert_eq!(c.start(&l, t2 + 100 * MS), 300);
        // When the budget has room, one claim reads the oldest rows (the permits go to them);
        // refused again, the pass goes on from the cursor, not from the start.
        let t3 = t1 + 200 * MS;
        assert_eq!(c.start(&l, t3), 0);
        assert_eq!(
            c.record(&l, t3, claimed(0, 100, true, Some(50))),
            Pass::Moving
        );
        assert_eq!(c.start(&l, t3), 300);
        assert_eq!(
            c.record(&l, t3, claimed(300, 0, false, None)),
            Pass::Waiting(50 * MS)
        );
    }

    #[test]
    fn full_passes_come_at_most_once_a_rescan_and_less_often_when_they_take_long() {
        let c = Cursors::default();
        let t0 = Instant::now();
        let l = lease(1);
        c.record(&l, t0, claimed(0, 100, true, Some(10)));
        // The full pass takes 400 ms to reach the newest rows.
        let t1 = t0 + 400 * MS;
        c.record(&l, t1, claimed(100, 0, false, Some(10)));
        // Within 4 × 400 ms, claims from the oldest row keep the cursor.
        let t2 = t1 + 1_000 * MS;
        assert_eq!(c.start(&l, t2), 0);
        c.record(&l, t2, claimed(0, 50, true, Some(10)));
        assert_eq!(c.start(&l, t2), 100);
        c.record(&l, t2, claimed(100, 0, false, Some(10)));
        // After it, a full pass starts over from the claim's own rows.
        let t3 = t1 + 1_600 * MS;
        assert_eq!(c.start(&l, t3), 0);
        assert_eq!(
            c.record(&l, t3, claimed(0, 50, true, Some(10))),
            Pass::Moving
        );
        assert_eq!(c.start(&l, t3), 50, "the old cursor is left behind");
    }

    #[test]
    fn room_in_the_budget_at_the_oldest_rows_drops_the_cursor() {
        let c = Cursors::default();
        let t0 = Instant::now();
        let l = lease(1);
        c.record(&l, t0, claimed(0, 100, false, Some(20)));
        let t1 = t0 + 20 * MS;
        assert_eq!(c.start(&l, t1), 0);
        assert_eq!(c.record(&l, t1, claimed(0, 100, false, None)), Pass::None);
        assert_eq!(c.start(&l, t1), 0);
        assert_eq!(c.record(&l, t1, claimed(0, 0, false, None)), Pass::None);
    }

    #[test]
    fn a_pass_that_is_still_moving_keeps_its_cursor_past_the_budget_time() {
        let c = Cursors::default();
        let t0 = Instant::now();
        let l = lease(1);
        assert_eq!(
            c.record(&l, t0, claimed(0, 100, true, Some(5))),
            Pass::Moving
        );
        assert_eq!(c.start(&l, t0 + 50 * MS), 100);
    }

    #[test]
    fn a_refused_claim_that_is_not_full_waits_at_once() {
        let c = Cursors::default();
        let t0 = Instant::now();
        let l = lease(1);
        assert_eq!(
            c.record(&l, t0, claimed(0, 7, false, Some(40))),
            Pass::Waiting(40 * MS)
        );
        assert_eq!(c.start(&l, t0), 7);
        assert_eq!(c.start(&l, t0 + 40 * MS), 0);
    }

    #[test]
    fn the_cursor_never_moves_back() {
        let c = Cursors::default();
        let t0 = Instant::now();
        let l = lease(1);
        c.record(&l, t0, claimed(0, 500, true, Some(100)));
        // Refused with nothing claimed (only the limiter's answer is new).
        c.record(&l, t0, claimed(500, 0, false, Some(100)));
        assert_eq!(c.start(&l, t0), 500);
    }

    #[test]
    fn a_cursor_belongs_to_its_lease() {
        let c = Cursors::default();
        let t0 = Instant::now();
        c.record(&lease(1), t0, claimed(0, 100, true, Some(100)));
        assert_eq!(
            c.start(&lease(2), t0),
            0,
            "a new epoch reads from the oldest row"
        );
        assert_eq!(c.start(&lease(1), t0), 0, "and the old cursor is gone");
        c.record(&lease(2), t0, claimed(0, 100, true, Some(100)));
        c.forget(&lease(1));
        assert_eq!(c.start(&lease(2), t0), 100, "another lease's cursor stays");
        c.forget(&lease(2));
        assert_eq!(c.start(&lease(2), t0), 0);
    }
}
