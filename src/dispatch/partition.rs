//! The partition actor: runs batches for one partition it holds a lease on.
//!
//! State lives in the database; the actor only remembers whether a batch is running. It is
//! `Supervised`: a panic inside a batch is caught, the actor stops and its supervisor restarts it
//! with the same lease, and it simply claims again (rows are still pending). It never stops by
//! itself for any other reason: when the lease is lost or a stop is requested, it finishes its
//! batch, reports to the node supervisor and goes quiet; the supervisor then drops its address,
//! which ends it for good.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::FutureExt;
use metrics::counter;

use super::backoff;
use super::batch::{BatchError, BatchOutcome, Worker};
use crate::metrics as m;
use crate::store::LeaseRef;

/// Wake up: there may be rows to publish. Numbered by the supervisor, one after the other per
/// partition, so that it can tell an idle report sent before a wake-up from one sent after.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Wake(pub u64);

/// Finish the batch in flight, then report [`PartitionReport::Stopped`].
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Stop;

/// What a partition actor tells the node supervisor. Every report names the epoch of the lease
/// the actor worked under: a report of an actor of an earlier lease of the partition (one that
/// was lost and taken again meanwhile) is about a slot that no longer exists, and is ignored.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub enum PartitionReport {
    /// Drained: nothing ready right now, and no batch runs until the next wake-up. `(partition,
    /// epoch, number of the last [`Wake`] received)`: a report crossing a later wake-up is stale
    /// (the actor has started another batch meanwhile).
    Idle(i32, i64, u64),
    /// Stopped at the supervisor's request; its batch is finished or abandoned.
    /// `(partition, epoch)`.
    Stopped(i32, i64),
    /// The lease is gone; the actor has stopped working. `(partition, epoch, why)`.
    LeaseLost(i32, i64, String),
    /// Redis refused our epoch: `(partition, our epoch, the epoch Redis holds)`. The actor has
    /// stopped working; the supervisor decides between a takeover and a database that lost
    /// history.
    Fenced(i32, i64, i64),
}

/// One partition's actor.
pub struct PartitionActor {
    lease: LeaseRef,
    worker: Worker,
    report: Recipient<PartitionReport>,
    /// Transient-failure back-off.
    transient_base: Duration,
    transient_max: Duration,
    /// Counts restarts after panics (shared with the supervisor, for tests and status).
    restarts: Arc<AtomicU64>,
    running: bool,
    /// The number of the last wake-up received.
    last_wake: u64,
    /// The last batch was full: the partition has a backlog, so batches run alone at full size
    /// instead of joining a group.
    backlog: bool,
    backing_off: bool,
    /// A batch is scheduled for when a rate-limit budget has room.
    retry: Option<(Instant, SpawnHandle)>,
    again: bool,
    stopping: bool,
    retired: bool,
    failures: u32,
    /// Panics since the last successful batch: restarts back off, so a deterministic panic does
    /// not spin.
    panics: u32,
}

impl std::fmt::Debug for PartitionActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionActor")
            .field("lease", &self.lease)
            .field("running", &self.running)
            .field("stopping", &self.stopping)
            .field("retired", &self.retired)
            .finish()
    }
}

impl PartitionActor {
    /// A new actor for `lease`.
    pub fn new(
        lease: LeaseRef,
        worker: Worker,
        report: Recipient<PartitionReport>,
        transient: (Duration, Duration),
        restarts: Arc<AtomicU64>,
    ) -> Self {
        Self {
            lease,
            worker,
            report,
            transient_base: transient.0,
            transient_max: transient.1,
            restarts,
            running: false,
            last_wake: 0,
            backlog: false,
            backing_off: false,
            retry: None,
            again: false,
            stopping: false,
            retired: false,
            failures: 0,
            panics: 0,
        }
    }

    fn next_batch(&mut self, ctx: &mut Context<Self>) {
        if self.retired {
            return;
        }
        if self.stopping {
            self.finish();
            return;
        }
        self.running = true;
        self.again = false;
        let (worker, lease, alone) = (self.worker.clone(), self.lease.clone(), self.backlog);
        let fut = async move {
            fail::fail_point!("actor-panic");
            if alone {
                worker.run_alone(lease).await
            } else {
                worker.run(lease).await
            }
        };
        let fut = AssertUnwindSafe(fut).catch_unwind();
        ctx.spawn(
            fut.into_actor(self)
                .map(|res, act, ctx| act.after_batch(res, ctx)),
        );
    }

    fn after_batch(
        &mut self,
        res: Result<Result<BatchOutcome, BatchError>, Box<dyn std::any::Any + Send>>,
        ctx: &mut Context<Self>,
    ) {
        self.running = false;
        let p = self.lease.partition;
        match res {
            Err(panic) => {
                let what = panic_message(panic.as_ref());
                tracing::error!(partition = p, panic = %what, "partition actor panicked; restarting");
                self.restarts.fetch_add(1, Ordering::Relaxed);
                self.panics = self.panics.saturating_add(1);
                counter!(m::ACTOR_RESTARTS).increment(1);
                ctx.stop();
            }
            Ok(Ok(BatchOutcome::Limited { retry_in })) => {
                // Not a failure: the cluster's budget has no room for the rows found yet. They
                // stay pending; a wake-up meanwhile reads only rows behind them (the partition's
                // cursor, see `dispatch::cursor`), so it may run a batch for other streams.
                self.failures = 0;
                self.panics = 0;
                self.backlog = false;
                if self.stopping {
                    self.finish();
                } else if self.again {
                    self.next_batch(ctx);
                } else {
                    self.retry_after(retry_in, ctx);
                }
            }
            Ok(Ok(outcome)) => {
                self.failures = 0;
                self.panics = 0;
                let more = matches!(outcome, BatchOutcome::Done { full: true, .. });
                self.backlog = more;
                if self.stopping {
                    self.finish();
                } else if more || self.again {
                    // A full batch, or a wake-up during the batch: more rows may be ready.
                    self.next_batch(ctx);
                } else if let BatchOutcome::Done {
                    deferred: Some(wait),
                    ..
                } = outcome
                {
                    // Rows of a rate-limited stream stayed pending: try again when the budget
                    // has room; a wake-up meanwhile runs a batch for the other streams' rows.
                    self.retry_after(wait, ctx);
                } else {
                    self.report
                        .do_send(PartitionReport::Idle(p, self.lease.epoch, self.last_wake));
                }
            }
            Ok(Err(BatchError::LeaseLost(why))) => {
                tracing::warn!(partition = p, %why, "lease lost; stopping work on the partition");
                self.retired = true;
                self.report
                    .do_send(PartitionReport::LeaseLost(p, self.lease.epoch, why));
            }
            Ok(Err(BatchError::Fenced { current })) => {
                self.retired = true;
                self.report
                    .do_send(PartitionReport::Fenced(p, self.lease.epoch, current));
            }
            Ok(Err(BatchError::Transient(why))) => {
                self.failures = self.failures.saturating_add(1);
                let wait = backoff::delay(
                    self.failures,
                    self.transient_base,
                    self.transient_max,
                    &mut rand::rng(),
                );
                tracing::warn!(partition = p, %why, ?wait, "transient failure; backing off");
                if self.stopping {
                    self.finish();
                } else {
                    self.backing_off = true;
                    ctx.run_later(wait, |act, ctx| {
                        act.backing_off = false;
                        act.next_batch(ctx);
                    });
                }
            }
        }
    }

    /// Runs a batch after `wait` (rows wait for a rate-limit permit), unless one is already
    /// scheduled as soon; one timer at a time, however many batches asked meanwhile.
    fn retry_after(&mut self, wait: Duration, ctx: &mut Context<Self>) {
        let at = Instant::now() + wait;
        if let Some((due, handle)) = self.retry {
            if due <= at {
                return;
            }
            ctx.cancel_future(handle);
        }
        let handle = ctx.run_later(wait, |act, ctx| {
            act.retry = None;
            if act.running {
                act.again = true;
            } else if !act.backing_off {
                act.next_batch(ctx);
            }
        });
        self.retry = Some((at, handle));
    }

    fn finish(&mut self) {
        if !self.retired {
            self.retired = true;
            self.report.do_send(PartitionReport::Stopped(
                self.lease.partition,
                self.lease.epoch,
            ));
        }
    }
}

/// What a caught panic said, when it said it with a string.
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

impl Actor for PartitionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Fresh start or restart after a panic: the database says what is ready. After repeated
        // panics, wait a little longer each time before trying again.
        if self.panics > 1 {
            let wait = backoff::delay(
                self.panics - 1,
                self.transient_base,
                self.transient_max,
                &mut rand::rng(),
            );
            self.backing_off = true;
            ctx.run_later(wait, |act, ctx| {
                act.backing_off = false;
                act.next_batch(ctx);
            });
        } else {
            self.next_batch(ctx);
        }
    }
}

impl Supervised for PartitionActor {
    fn restarting(&mut self, _ctx: &mut Context<Self>) {
        self.running = false;
        self.backing_off = false;
        self.retry = None;
        self.again = false;
    }
}

impl Handler<Wake> for PartitionActor {
    type Result = ();

    fn handle(&mut self, wake: Wake, ctx: &mut Context<Self>) {
        self.last_wake = wake.0;
        if self.running {
            self.again = true;
        } else if !self.backing_off {
            self.next_batch(ctx);
        }
    }
}

impl Handler<Stop> for PartitionActor {
    type Result = ();

    fn handle(&mut self, _: Stop, _ctx: &mut Context<Self>) {
        self.stopping = true;
        // A batch in flight finishes first; a back-off wait does not need to.
        if !self.running {
            self.finish();
        }
    }
}
