//! Processing one delivery against the consumer's database: the position check, the handler,
//! the inbox row, the commit — in that order, in one transaction. Acknowledging is the caller's
//! job, after this returns.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use sea_orm::{DatabaseConnection, DatabaseTransaction, TransactionTrait};

use super::stream::GroupStream;
use super::{Delivery, Handler, HandlerError, OrderMode};
use crate::store::inbox::{self, InboxOutcome, InboxPosition};

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The handler applied it and the transaction committed: acknowledge.
    Applied,
    /// The group had applied it already: acknowledge without applying.
    Duplicate,
    /// An earlier event of its aggregate has not been applied yet (`expected` is the sequence
    /// the group waits for, when known): keep it pending and try again shortly.
    Held { expected: Option<i64> },
    /// Try again after a back-off. `counted` failures (the handler's) count a delivery; the
    /// others (the database or Redis was unavailable) do not.
    Retry { reason: String, counted: bool },
    /// Sent to the dead-letter stream: acknowledge.
    DeadLettered,
    /// A fault point stopped the consumer here, as a crash would (tests only).
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    Killed(&'static str),
}

impl Outcome {
    fn unavailable(err: impl std::fmt::Display) -> Self {
        Outcome::Retry {
            reason: err.to_string(),
            counted: false,
        }
    }

    /// Later entries of the same aggregate cannot go before this one.
    pub fn blocks_successors(&self) -> bool {
        matches!(
            self,
            Outcome::Held { .. } | Outcome::Retry { .. } | Outcome::Killed(_)
        )
    }
}

/// Everything processing needs, shared by the tasks of a round.
pub(crate) struct Applier<H> {
    pub db: DatabaseConnection,
    pub handler: Arc<H>,
    pub stream: Arc<GroupStream>,
    pub group: String,
    pub order: OrderMode,
    pub max_deliveries: u32,
    pub max_seq_ahead: i64,
    #[cfg(feature = "failpoints")]
    pub ack_before_commit: bool,
}

impl<H: Handler> Applier<H> {
    /// Processes `d`: applies it if it is its aggregate's next event for the group. An event
    /// ahead of a gap is held, or, with `give_up_gap` (it was held for `claim_idle` after its
    /// last allowed delivery), dead-lettered without moving the group's position.
    pub async fn process(&self, d: &Delivery, give_up_gap: bool) -> Outcome {
        let (txn, pos) = match self.begin_locked(d).await {
            Ok(locked) => locked,
            Err(outcome) => return outcome,
        };
        if pos.seen {
            return rollback(txn, Outcome::Duplicate).await;
        }
        if d.aggregate_seq <= pos.last_seq {
            // A new event id at a sequence the group has passed: the producer's history was
            // rewound (its database restored from a backup, or an asynchronous replica
            // promoted) and the sequence is being used again by a new fact. It is applied, and
            // the group's position follows it back, so the events after it apply in order.
            tracing::warn!(
                event_id = %d.event_id, event_type = %d.event_type,
                aggregate = %format_args!("{}/{}", d.aggregate_type, d.aggregate_id),
                seq = d.aggregate_seq, position = pos.last_seq,
                "a new event reuses a sequence the group has passed (the producer's history \
                 was rewound); applying it and moving the group's position back to it"
            );
        } else {
            let ahead = d.aggregate_seq.saturating_sub(pos.last_seq);
            // In monotonic order, the first event of an aggregate the group has not seen may
            // be anywhere in its history (a group started at the end of the stream): no bound.
            let first_sight = self.order == OrderMode::Monotonic && pos.last_seq == 0;
            if ahead > self.max_seq_ahead && !first_sight {
                // No producer jumps this far: a forged or corrupt entry. Applying it would move
                // the position (monotonic order) or hold it in memory for a gap that never
                // fills (strict order); it goes to the dead-letter stream, the position stays.
                let _ = txn.rollback().await;
                let reason = format!(
                    "sequence {} of {} {} is {ahead} past the group's position {}; at most \
                     {} ahead is accepted (max_seq_ahead): a forged or corrupt entry",
                    d.aggregate_seq,
                    d.aggregate_type,
                    d.aggregate_id,
                    pos.last_seq,
                    self.max_seq_ahead
                );
                return self.dead_letter(d, &reason, false).await;
            }
            let expected = pos.last_seq.saturating_add(1);
            if d.aggregate_seq > expected && self.order == OrderMode::Strict {
                let _ = txn.rollback().await;
                if give_up_gap {
                    let reason = format!(
                        "sequence gap: the group waits for sequence {expected} of {} {}, this \
                         is {} (delivered {} times); replay the missing event, then this one",
                        d.aggregate_type, d.aggregate_id, d.aggregate_seq, d.deliveries
                    );
                    return self.dead_letter(d, &reason, false).await;
                }
                return Outcome::Held {
                    expected: Some(expected),
                };
            }
        }
        if let Some(defect) = &d.defect {
            // Its identity is sound, the rest is not: a permanent failure the handler is
            // spared. The aggregate moves past it.
            let _ = txn.rollback().await;
            return self
                .dead_letter(d, &format!("malformed entry: {defect}"), true)
                .await;
        }
        let handled = AssertUnwindSafe(self.handler.handle(d, &txn))
            .catch_unwind()
            .await
            .unwrap_or_else(|_| Err(HandlerError::retry("the handler panicked")));
        match handled {
            Ok(()) => self.commit(d, txn).await,
            Err(HandlerError::Permanent(reason)) => {
                let _ = txn.rollback().await;
                self.dead_letter(d, &reason, true).await
            }
            Err(HandlerError::Retry(reason)) => {
                let _ = txn.rollback().await;
                if d.deliveries >= self.max_deliveries {
                    let reason = format!("{reason} (gave up after {} deliveries)", d.deliveries);
                    self.dead_letter(d, &reason, true).await
                } else {
                    Outcome::Retry {
                        reason,
                        counted: true,
                    }
                }
            }
        }
    }

    /// The group's positions in `aggregates`, read without a lock.
    pub async fn positions(
        &self,
        aggregates: &[(&str, &str)],
    ) -> Result<Vec<(String, String, i64)>, crate::store::StoreError> {
        inbox::positions_of(&self.db, &self.group, aggregates).await
    }

    /// Opens a transaction and locks the group's position in `d`'s aggregate.
    async fn begin_locked(
        &self,
        d: &Delivery,
    ) -> Result<(DatabaseTransaction, InboxPosition), Outcome> {
        let txn = self.db.begin().await.map_err(Outcome::unavailable)?;
        match inbox::lock_position(
            &txn,
            &self.group,
            &d.aggregate_type,
            &d.aggregate_id,
            d.event_id,
        )
        .await
        {
            Ok(pos) => Ok((txn, pos)),
            Err(e) => Err(rollback(txn, Outcome::unavailable(e)).await),
        }
    }

    /// Records `d` in the inbox with `outcome` and moves the position to its sequence.
    async fn record(
        &self,
        txn: &DatabaseTransaction,
        d: &Delivery,
        outcome: InboxOutcome,
    ) -> Result<bool, crate::store::StoreError> {
        inbox::record_processed(
            txn,
            &self.group,
            &d.aggregate_type,
            &d.aggregate_id,
            d.aggregate_seq,
            d.event_id,
            outcome,
        )
        .await
    }

    async fn commit(&self, d: &Delivery, txn: DatabaseTransaction) -> Outcome {
        match self.record(&txn, d, InboxOutcome::Applied).await {
            Ok(true) => {}
            Ok(false) => return rollback(txn, Outcome::Duplicate).await,
            Err(e) => return rollback(txn, Outcome::unavailable(e)).await,
        }
        #[cfg(feature = "failpoints")]
        if self.ack_before_commit {
            // The deliberately wrong order, kept to show that the checker catches it.
            if let Err(e) = self.stream.ack(std::slice::from_ref(&d.stream_id)).await {
                return rollback(txn, Outcome::unavailable(e)).await;
            }
            fail::fail_point!("consume-after-ack", |_| Outcome::Killed(
                "consume-after-ack"
            ));
        }
        if let Err(e) = txn.commit().await {
            // The commit's outcome is unknown: the next attempt finds the event in the inbox if
            // it did commit.
            return Outcome::unavailable(e);
        }
        fail::fail_point!("consume-after-commit", |_| Outcome::Killed(
            "consume-after-commit"
        ));
        Outcome::Applied
    }

    /// Sends `d` to the dead-letter stream. With `advance`, the group then moves past it in its
    /// aggregate, so later events flow; without (a sequence gap), the aggregate stays where it
    /// is. The dead-letter append comes first: a crash before the position moves delivers the
    /// entry again and appends it again, but never loses it.
    pub async fn dead_letter(&self, d: &Delivery, reason: &str, advance: bool) -> Outcome {
        if let Err(e) = self
            .stream
            .dead_letter(&d.stream_id, &d.raw, reason, d.deliveries)
            .await
        {
            return Outcome::unavailable(e);
        }
        tracing::warn!(
            event_id = %d.event_id, event_type = %d.event_type,
            aggregate = %format_args!("{}/{}", d.aggregate_type, d.aggregate_id),
            seq = d.aggregate_seq, deliveries = d.deliveries, reason,
            "event moved to the dead-letter stream"
        );
        if advance {
            let (txn, pos) = match self.begin_locked(d).await {
                Ok(locked) => locked,
                Err(outcome) => return outcome,
            };
            // Its place is the group's next (or, in monotonic order, any later), or a sequence
            // the group has passed that a new event reuses (see `process`).
            let next = self.order == OrderMode::Monotonic
                || d.aggregate_seq <= pos.last_seq.saturating_add(1);
            if !pos.seen
                && next
                && let Err(e) = self.record(&txn, d, InboxOutcome::DeadLettered).await
            {
                return rollback(txn, Outcome::unavailable(e)).await;
            }
            if let Err(e) = txn.commit().await {
                return Outcome::unavailable(e);
            }
        }
        Outcome::DeadLettered
    }
}

async fn rollback(txn: DatabaseTransaction, outcome: Outcome) -> Outcome {
    // A failed rollback leaves nothing behind: the connection goes back to the pool reset.
    let _ = txn.rollback().await;
    outcome
}
