//! Batches: claim → route → rate-limit → publish → mark, for one partition or for a group of
//! partitions of one worker that asked at the same moment (sharing each statement).
//!
//! The claim is a short read; publishing happens with no database transaction open; the mark is
//! one short transaction guarded by the lease epoch. Nothing is held in memory between batches:
//! a batch that fails part-way leaves its rows pending, and the next claim sees them again.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use metrics::{counter, histogram};

use super::cursor::{Claimed, Cursors, Pass};
use super::ratelimit::{RateLimits, Refused};
use super::route::{Route, Router};
use super::settings::RelaySettings;
use super::settle::{Origin, PartitionCalls, Settlement, failure, settle};
use super::streams::StreamBook;
use crate::metrics as m;
use crate::publish::{Entry, Message, PublishError, Publisher, StreamBatch, StreamOutcome};
use crate::store::{BatchResult, ClaimedEvent, LeaseRef, Store, StoreError};

/// The instant until which this node may still publish: its last lease renewal plus the lease
/// time minus a safety margin, on the monotonic clock. Shared by all partitions of a node.
#[derive(Debug)]
pub struct LeaseDeadline {
    origin: Instant,
    until_ms: AtomicU64,
}

impl LeaseDeadline {
    /// A deadline that has already passed.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
            until_ms: AtomicU64::new(0),
        }
    }

    /// Extends the deadline to `at`.
    pub fn extend_to(&self, at: Instant) {
        let ms = u64::try_from(at.saturating_duration_since(self.origin).as_millis())
            .unwrap_or(u64::MAX);
        self.until_ms.store(ms, Ordering::Release);
    }

    /// True while publishing is allowed.
    pub fn valid(&self) -> bool {
        let now = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        now < self.until_ms.load(Ordering::Acquire)
    }
}

impl Default for LeaseDeadline {
    fn default() -> Self {
        Self::new()
    }
}

/// What every worker of a node shares.
#[derive(Debug)]
pub struct Shared {
    /// Routing rules.
    pub router: Router,
    /// Rate limits.
    pub limits: RateLimits,
    /// Settings.
    pub settings: RelaySettings,
    /// The node's publishing deadline.
    pub deadline: LeaseDeadline,
    /// Streams known to exist and their positions not yet recorded.
    pub streams: StreamBook,
    /// Partitions whose claims move past rows waiting for a rate-limit permit.
    pub cursors: Cursors,
}

/// The resources of one worker arbiter: its own database pool and Redis connection.
#[derive(Debug, Clone)]
pub struct Worker {
    /// Database pool of this worker.
    pub store: Store,
    /// Redis connection of this worker.
    pub publisher: Publisher,
    /// Batch slots (`relay.max_in_flight`): a batch holds one from claim to mark, so at most
    /// that many batches per worker are in memory and talking to the database.
    pub slots: Arc<tokio::sync::Semaphore>,
    /// Batches asked for and not yet taken into a group (see [`Worker::run`]).
    pub queue: BatchQueue,
    /// Node-wide state.
    pub shared: Arc<Shared>,
}

/// How a batch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchOutcome {
    /// Nothing was ready.
    Idle,
    /// The rows found wait for a rate-limit permit: nothing was published, the rows stay
    /// pending, and the partition tries again after `retry_in`.
    Limited {
        /// When the cluster's budget has room for the batch.
        retry_in: Duration,
    },
    /// Rows were handled. `full`: the claim hit its row limit, so more may be ready.
    /// `deferred`: some rows wait for a rate-limit permit, which should come after this long.
    Done {
        /// Rows claimed.
        claimed: usize,
        /// The claim returned `batch_rows` rows.
        full: bool,
        /// Rows of rate-limited streams stayed pending; try again after this long.
        deferred: Option<Duration>,
    },
}

/// Why a batch stopped early.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// Redis or the database is unavailable: back off and try again; nothing was burned.
    #[error("transient failure: {0}")]
    Transient(String),
    /// The lease is gone (refused at the mark, or the local deadline passed): stop working on
    /// the partition.
    #[error("lease lost: {0}")]
    LeaseLost(String),
    /// Redis holds a newer epoch for the partition than ours: another node took it over, or the
    /// database lost history (the supervisor tells which). Nothing was appended or marked.
    #[error("fenced at Redis by epoch {current}")]
    Fenced {
        /// The epoch Redis holds.
        current: i64,
    },
}

impl From<StoreError> for BatchError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::LeaseLost { .. } => {
                counter!(m::FENCED, "at" => "database").increment(1);
                BatchError::LeaseLost(e.to_string())
            }
            other => BatchError::Transient(other.to_string()),
        }
    }
}

/// A partition's batch as routed and encoded: its stream calls (one per stream, each call's
/// entries in order) and the origins of their entries, and what routing decided already.
#[derive(Debug, Default)]
struct Plan {
    batches: Vec<StreamBatch>,
    origins: Vec<Vec<Origin>>,
    result: BatchResult,
}

impl Plan {
    /// Nothing to publish or record.
    fn is_empty(&self) -> bool {
        let r = &self.result;
        self.batches.is_empty()
            && r.failed.is_empty()
            && r.no_destination.is_empty()
            && r.unblocked.is_empty()
    }

    /// Records the failure of `origin`'s row before publishing (unroutable, oversize, not
    /// encodable, not decodable).
    fn fail(
        &mut self,
        settings: &RelaySettings,
        origin: &Origin,
        aggregate: (&str, &str),
        error: &PublishError,
    ) {
        let failed = failure(settings, &mut rand::rng(), origin, aggregate, error);
        self.result.failed.push(failed);
    }
}

/// One partition of a group with rows to deliver.
#[derive(Debug)]
struct Planned {
    /// Its index in the group's leases.
    index: usize,
    plan: Plan,
    /// Rows its claim returned.
    claimed: usize,
    /// Some rows wait for a rate-limit permit, expected after this long.
    deferred: Option<Duration>,
}

type Outcome = Result<BatchOutcome, BatchError>;

/// Batches waiting to be taken into a group: each lease with where to send its outcome.
pub type BatchQueue = Arc<std::sync::Mutex<Vec<(LeaseRef, tokio::sync::oneshot::Sender<Outcome>)>>>;

impl Worker {
    /// Runs a batch for `lease`, together with the batches other partitions of this worker ask
    /// for at the same moment: one claim, one pipelined publish and one mark serve them all.
    /// Under a steady flow each partition has only an event or two ready at a time, and sharing
    /// the statements is what keeps the relay's cost per event low.
    pub async fn run(&self, lease: LeaseRef) -> Outcome {
        let (tx, rx) = tokio::sync::oneshot::channel();
        lock(&self.queue).push((lease, tx));
        // Let the other wake-ups of this moment join before the group is formed.
        tokio::task::yield_now().await;
        let permit = self
            .slots
            .acquire()
            .await
            .map_err(|_| BatchError::Transient("the worker is shutting down".to_owned()))?;
        let group: Vec<_> = {
            let mut queue = lock(&self.queue);
            let take = queue.len().min(GROUP_MAX);
            queue.drain(..take).collect()
        };
        if !group.is_empty() {
            let (leases, senders): (Vec<LeaseRef>, Vec<_>) = group.into_iter().unzip();
            let results = run_group(self, &leases, Claim::PerPartition, |_| {}).await;
            for (tx, result) in senders.into_iter().zip(results) {
                let _ = tx.send(result);
            }
        }
        drop(permit);
        rx.await.unwrap_or_else(|_| {
            Err(BatchError::Transient(
                "the batch was abandoned by the worker".to_owned(),
            ))
        })
    }
}

/// Most partitions in one group: enough to share statements under a steady flow, few enough that
/// a worker draining a backlog keeps `relay.max_in_flight` groups going at once.
const GROUP_MAX: usize = 8;

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while the queue was locked leaves only a Vec behind; it is still usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How a group's rows are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Partitions that asked for a batch, most with rows ready: a bounded read of each.
    PerPartition,
    /// The busy poll over the idle partitions, which mostly finds nothing or a row here and
    /// there: one scan over them all ([`crate::store::Store::claim_polled`]).
    Poll,
}

/// Runs one batch for each lease, sharing the statements; results in the order of `leases`.
/// The group's rows stay within one batch's limits: each partition gets an equal part of
/// `relay.batch_rows` and `relay.batch_bytes`. `claimed` learns, right after the claim, which
/// leases' partitions had no row ready (those are done: their outcome is `Idle`).
pub async fn run_group(
    worker: &Worker,
    leases: &[LeaseRef],
    claim: Claim,
    claimed: impl FnOnce(&[&LeaseRef]),
) -> Vec<Outcome> {
    let settings = &worker.shared.settings;
    let n = u32::try_from(leases.len().max(1)).unwrap_or(u32::MAX);
    let per_rows = (settings.batch_rows / n).max(1);
    let per_bytes = (settings.batch_bytes / u64::from(n)).max(1024);
    let partitions: Vec<i32> = leases.iter().map(|l| l.partition).collect();
    let started = Instant::now();
    let store = &worker.store;
    // With rate limits, a partition may read past rows that wait for a permit (see
    // `dispatch::cursor`); the busy poll covers only partitions without such rows.
    let cursors = (claim == Claim::PerPartition && worker.shared.limits.any()).then(|| {
        let now = Instant::now();
        let cursors = &worker.shared.cursors;
        leases
            .iter()
            .map(|l| (l.partition, cursors.start(l, now)))
            .collect::<Vec<_>>()
    });
    let rows = match (&cursors, claim) {
        (Some(from), _) => store.claim_after(from, per_rows, per_bytes).await,
        (None, Claim::PerPartition) => store
            .claim_many(&partitions, per_rows, per_bytes)
            .await
            .map(|rows| (rows, Vec::new())),
        (None, Claim::Poll) => {
            let cap = settings.batch_rows;
            store
                .claim_polled(&partitions, per_rows, per_bytes, cap)
                .await
                .map(|rows| (rows, Vec::new()))
        }
    };
    let (rows, full) = match rows {
        Ok(found) => found,
        Err(e) => {
            let e = BatchError::from(e);
            return leases.iter().map(|_| Err(e.clone())).collect();
        }
    };
    histogram!(m::CLAIM_SECONDS).record(started.elapsed().as_secs_f64());
    let mut by_partition: HashMap<i32, Vec<ClaimedEvent>> = HashMap::new();
    for row in rows {
        by_partition.entry(row.partition).or_default().push(row);
    }
    let empty: Vec<&LeaseRef> = leases
        .iter()
        .filter(|l| !by_partition.contains_key(&l.partition))
        .collect();
    claimed(&empty);
    let mut outcomes: Vec<Option<Outcome>> = vec![None; leases.len()];
    let found: Vec<(usize, Vec<ClaimedEvent>)> = leases
        .iter()
        .enumerate()
        .filter_map(|(i, lease)| by_partition.remove(&lease.partition).map(|rows| (i, rows)))
        .collect();
    let refusals = permits(worker, leases, &found).await;
    let now = Instant::now();
    let from_of = |i: usize| cursors.as_ref().and_then(|c| c.get(i)).map_or(0, |c| c.1);
    let mut passes = vec![(Pass::None, 0); leases.len()];
    if cursors.is_some() {
        for lease in &empty {
            if let Some(i) = leases.iter().position(|l| std::ptr::eq(l, *lease)) {
                let nothing = Claimed {
                    from: from_of(i),
                    last_id: None,
                    full: false,
                    refused: None,
                };
                passes[i] = (worker.shared.cursors.record(lease, now, nothing), 0);
            }
        }
    }
    let mut plans: Vec<Planned> = Vec::new();
    for ((i, rows), refused) in found.into_iter().zip(refusals) {
        let refused = match refused {
            Ok(r) => r,
            Err(e) => {
                outcomes[i] = Some(Err(e));
                continue;
            }
        };
        let claimed = rows.len();
        if cursors.is_some() {
            let found = Claimed {
                from: from_of(i),
                last_id: rows.last().map(|r| r.id),
                full: full.contains(&leases[i].partition),
                refused: (!refused.streams.is_empty()).then_some(refused.retry_in),
            };
            passes[i] = (
                worker.shared.cursors.record(&leases[i], now, found),
                claimed,
            );
        }
        let plan = plan(
            &worker.shared,
            &worker.publisher,
            rows,
            &leases[i],
            &refused,
        );
        if !refused.streams.is_empty() {
            counter!(m::RATE_LIMITED_WAITS).increment(1);
        }
        if plan.is_empty() {
            // Everything found waits for a permit (or was cut behind a row that does).
            outcomes[i] = Some(Ok(if refused.streams.is_empty() {
                BatchOutcome::Idle
            } else {
                BatchOutcome::Limited {
                    retry_in: refused.retry_in,
                }
            }));
            continue;
        }
        plans.push(Planned {
            index: i,
            plan,
            claimed,
            deferred: (!refused.streams.is_empty()).then_some(refused.retry_in),
        });
    }
    if plans.is_empty() {
        return finish(outcomes, &passes, leases, &worker.shared.cursors);
    }
    fail::fail_point!("after-claim", |_| std::process::abort());
    // A busy poll claims for every idle partition: what it found is published and marked by
    // groups of at most GROUP_MAX partitions at once, each on its own connection, as partition
    // actors' batches are, so a large mark does not hold every partition that had a row.
    let mut groups: Vec<Vec<Planned>> = Vec::new();
    for p in plans {
        match groups.last_mut() {
            Some(g) if g.len() < GROUP_MAX => g.push(p),
            _ => groups.push(vec![p]),
        }
    }
    let delivered = futures::future::join_all(
        groups
            .into_iter()
            .map(|g| deliver(worker, leases, g, per_rows)),
    )
    .await;
    for (i, outcome) in delivered.into_iter().flatten() {
        outcomes[i] = Some(outcome);
    }
    finish(outcomes, &passes, leases, &worker.shared.cursors)
}

/// Publishes and marks what was claimed for some of `leases`; each partition's outcome with its
/// index in `leases`, saying when rows left waiting for a rate-limit permit should be tried.
async fn deliver(
    worker: &Worker,
    leases: &[LeaseRef],
    plans: Vec<Planned>,
    per_rows: u32,
) -> Vec<(usize, Outcome)> {
    let deferred: Vec<(usize, Duration)> = plans
        .iter()
        .filter_map(|p| p.deferred.map(|d| (p.index, d)))
        .collect();
    let mut out = settle_and_mark(worker, leases, plans, per_rows).await;
    for (i, outcome) in &mut out {
        if let Ok(BatchOutcome::Done { deferred: d, .. }) = outcome {
            *d = deferred.iter().find(|(j, _)| j == i).map(|(_, d)| *d);
        }
    }
    out
}

/// Publishes and marks what was claimed for some of `leases`: [`deliver`] without the rate
/// limits' bookkeeping.
async fn settle_and_mark(
    worker: &Worker,
    leases: &[LeaseRef],
    mut plans: Vec<Planned>,
    per_rows: u32,
) -> Vec<(usize, Outcome)> {
    let settings = &worker.shared.settings;
    let mut out: Vec<(usize, Outcome)> = Vec::with_capacity(plans.len());

    if !worker.shared.deadline.valid() {
        let e = BatchError::LeaseLost(
            "the lease may have expired (no renewal in time); not publishing".to_owned(),
        );
        for p in &plans {
            out.push((p.index, Err(e.clone())));
        }
        return out;
    }
    fail::fail_point!("before-publish", |_| std::process::abort());
    let all: Vec<StreamBatch> = plans
        .iter_mut()
        .flat_map(|p| std::mem::take(&mut p.plan.batches))
        .collect();
    let started = Instant::now();
    let published = publish(worker, &all).await;
    histogram!(m::PUBLISH_SECONDS).record(started.elapsed().as_secs_f64());
    let replies = match published {
        Ok(o) => o,
        Err(e) => {
            counter!(m::FAILURES, "kind" => "transient", "code" => e.code().to_owned())
                .increment(1);
            let e = BatchError::Transient(e.to_string());
            for p in &plans {
                out.push((p.index, Err(e.clone())));
            }
            return out;
        }
    };
    fail::fail_point!("after-publish", |_| std::process::abort());
    note_replies(&worker.shared.streams, &all, &replies);

    let mut parts = Vec::with_capacity(plans.len());
    let mut heads = Vec::with_capacity(plans.len());
    for p in plans {
        heads.push((p.index, p.claimed));
        parts.push(PartitionCalls {
            origins: p.plan.origins,
            result: p.plan.result,
        });
    }
    let settled = settle(
        settings,
        &mut rand::rng(),
        parts,
        &all,
        replies,
        chrono::Utc::now(),
    );
    let commit_to_publish = histogram!(m::COMMIT_TO_PUBLISH_SECONDS);
    // Partitions whose batch only published go to one shared mark; the others (failures,
    // no-destination rows, released holds) are recorded one by one.
    let mut simple: Vec<(usize, usize)> = Vec::new();
    let mut shared_published: Vec<(i64, String)> = Vec::new();
    let mut shared_leases: Vec<(i32, i64)> = Vec::new();
    let mut shared_positions: Vec<(i32, String, i64, i64)> = Vec::new();
    let mut detailed: Vec<(usize, usize, BatchResult, Option<PublishError>)> = Vec::new();
    for ((i, claimed), settlement) in heads.into_iter().zip(settled) {
        let (result, transient) = match settlement {
            Settlement::Fenced { current } => {
                out.push((i, Err(BatchError::Fenced { current })));
                continue;
            }
            Settlement::Lost { stream } => {
                out.push((
                    i,
                    Err(BatchError::Transient(format!(
                        "stream {stream} is known to exist but Redis has lost it; nothing \
                         appended until the loss is handled"
                    ))),
                ));
                continue;
            }
            Settlement::Answered {
                result,
                transient,
                latencies,
            } => {
                for l in latencies {
                    commit_to_publish.record(l.as_secs_f64());
                }
                (result, transient)
            }
        };
        counter!(m::PUBLISHED).increment(result.published.len() as u64);
        counter!(m::NO_DESTINATION).increment(result.no_destination.len() as u64);
        for f in &result.failed {
            let kind = if f.unpublishable {
                "unpublishable"
            } else {
                "permanent"
            };
            counter!(m::FAILURES, "kind" => kind, "code" => f.code.clone()).increment(1);
        }
        let only_published = result.failed.is_empty()
            && result.no_destination.is_empty()
            && result.unblocked.is_empty();
        if only_published && transient.is_none() {
            shared_leases.push((leases[i].partition, leases[i].epoch));
            shared_published.extend(result.published);
            shared_positions.extend(
                result
                    .positions
                    .into_iter()
                    .map(|(s, ms, seq)| (leases[i].partition, s, ms, seq)),
            );
            simple.push((i, claimed));
        } else {
            detailed.push((i, claimed, result, transient));
        }
    }

    fail::fail_point!("before-mark", |_| std::process::abort());
    let started = Instant::now();
    if !shared_leases.is_empty() {
        let positions: Vec<(i32, &str, i64, i64)> = shared_positions
            .iter()
            .map(|(p, s, ms, seq)| (*p, s.as_str(), *ms, *seq))
            .collect();
        match worker
            .store
            .mark_published_many(
                &leases[simple[0].0].node_id,
                &shared_leases,
                &shared_published,
                &positions,
                settings.delete_published,
            )
            .await
        {
            Ok(held) => {
                for (i, claimed) in &simple {
                    out.push((
                        *i,
                        if held.contains(&leases[*i].partition) {
                            Ok(done(*claimed, per_rows))
                        } else {
                            counter!(m::FENCED, "at" => "database").increment(1);
                            Err(BatchError::LeaseLost(format!(
                                "lease on partition {} at epoch {} was lost to another node",
                                leases[*i].partition, leases[*i].epoch
                            )))
                        },
                    ));
                }
            }
            Err(e) => {
                let e = BatchError::from(e);
                for (i, _) in &simple {
                    out.push((*i, Err(e.clone())));
                }
            }
        }
    }
    for (i, claimed, result, transient) in detailed {
        let lease = &leases[i];
        let outcome = match worker
            .store
            .record_batch(
                lease,
                &result,
                settings.delete_published,
                settings.max_attempts,
            )
            .await
        {
            Ok(recorded) => {
                counter!(m::RETRIES).increment(recorded.retrying);
                counter!(m::QUARANTINED).increment(recorded.quarantined);
                if recorded.quarantined > 0 {
                    tracing::error!(
                        partition = lease.partition,
                        quarantined = recorded.quarantined,
                        "events quarantined (after relay.max_attempts, or at their first \
                         attempt when they can never be published as they are: WRONGTYPE, \
                         OVERSIZE, UNROUTABLE, ENCODING, UNDECODABLE, KEY); list them with \
                         `outpost dead-letter list`, fix the cause, then `outpost dead-letter \
                         replay`"
                    );
                }
                match transient {
                    Some(e) => {
                        counter!(m::FAILURES, "kind" => "transient", "code" => e.code().to_owned())
                            .increment(1);
                        Err(BatchError::Transient(e.to_string()))
                    }
                    None => Ok(done(claimed, per_rows)),
                }
            }
            Err(e) => Err(BatchError::from(e)),
        };
        out.push((i, outcome));
    }
    histogram!(m::MARK_SECONDS).record(started.elapsed().as_secs_f64());
    fail::fail_point!("after-mark", |_| std::process::abort());
    out
}

fn done(claimed: usize, per_rows: u32) -> BatchOutcome {
    BatchOutcome::Done {
        claimed,
        full: claimed >= per_rows as usize,
        deferred: None,
    }
}

/// Each lease's outcome (`Idle` when nothing was found), as its cursor says what it does next
/// (`passes`: each lease's [`Pass`] and rows claimed). A failed batch drops its cursor.
fn finish(
    outcomes: Vec<Option<Outcome>>,
    passes: &[(Pass, usize)],
    leases: &[LeaseRef],
    cursors: &Cursors,
) -> Vec<Outcome> {
    outcomes
        .into_iter()
        .zip(passes)
        .zip(leases)
        .map(|((o, &(pass, rows)), lease)| {
            let outcome = o.unwrap_or(Ok(BatchOutcome::Idle));
            if outcome.is_err() && pass != Pass::None {
                cursors.forget(lease);
            }
            with_pass(outcome, pass, rows)
        })
        .collect()
}

/// `outcome` of a partition whose cursor is at `pass` after claiming `rows` rows: a pass still
/// moving runs again at once; a pass that has reached the newest rows waits for the budget and
/// is never idle (the busy poll would read the refused rows again).
fn with_pass(outcome: Outcome, pass: Pass, rows: usize) -> Outcome {
    let Ok(outcome) = outcome else {
        return outcome;
    };
    Ok(match (pass, outcome) {
        (Pass::None, o) => o,
        (Pass::Moving, BatchOutcome::Done { deferred, .. }) => BatchOutcome::Done {
            claimed: rows,
            full: true,
            deferred,
        },
        (Pass::Moving, BatchOutcome::Idle | BatchOutcome::Limited { .. }) => BatchOutcome::Done {
            claimed: rows,
            full: true,
            deferred: None,
        },
        (Pass::Waiting(wait), BatchOutcome::Done { claimed, full, .. }) => BatchOutcome::Done {
            claimed,
            full,
            deferred: Some(wait),
        },
        (Pass::Waiting(wait), BatchOutcome::Idle | BatchOutcome::Limited { .. }) => {
            BatchOutcome::Limited { retry_in: wait }
        }
    })
}

impl Worker {
    /// Runs one batch for `lease` alone, with a full batch's limits: for a partition with a
    /// backlog, whose batches are large enough on their own.
    pub async fn run_alone(&self, lease: LeaseRef) -> Outcome {
        let lease = std::slice::from_ref(&lease);
        self.run_together(lease, Claim::PerPartition, |_| {})
            .await
            .pop()
            .unwrap_or(Ok(BatchOutcome::Idle))
    }

    /// Runs one group batch for `leases` in a batch slot of this worker: the supervisor's busy
    /// poll, whose claim over the idle partitions is the poll itself (`claim` [`Claim::Poll`]),
    /// or a partition's batch alone. Results in the order of `leases`; `claimed` as in
    /// [`run_group`].
    pub async fn run_together(
        &self,
        leases: &[LeaseRef],
        claim: Claim,
        claimed: impl FnOnce(&[&LeaseRef]),
    ) -> Vec<Outcome> {
        let Ok(_permit) = self.slots.acquire().await else {
            let e = BatchError::Transient("the worker is shutting down".to_owned());
            return leases.iter().map(|_| Err(e.clone())).collect();
        };
        run_group(self, leases, claim, claimed).await
    }
}

/// Publishes the plan. With fault points compiled in, the batch is published in two calls with
/// the `mid-batch` point between them, so a crash can land half-way through a batch.
async fn publish(
    worker: &Worker,
    batches: &[StreamBatch],
) -> Result<Vec<StreamOutcome>, PublishError> {
    #[cfg(feature = "failpoints")]
    if batches.len() > 1 {
        let (a, b) = batches.split_at(batches.len() / 2);
        let mut out = worker.publisher.publish(a).await?;
        fail::fail_point!("mid-batch", |_| std::process::abort());
        // What the first call appended stays published when the second gets nowhere.
        match worker.publisher.publish(b).await {
            Ok(more) => out.extend(more),
            Err(error) => out.extend(b.iter().map(|_| StreamOutcome::Failed {
                ids: Vec::new(),
                error: error.clone(),
            })),
        }
        return Ok(out);
    }
    worker.publisher.publish(batches).await
}

/// What every reply says regardless of the partition it belongs to: the newest entry id of
/// each stream written, a stream found lost, a fence met.
fn note_replies(book: &StreamBook, calls: &[StreamBatch], replies: &[StreamOutcome]) {
    for (call, reply) in calls.iter().zip(replies) {
        match reply {
            StreamOutcome::Published(ids) | StreamOutcome::Failed { ids, .. } => {
                if let Some(last) = ids.last() {
                    book.published(&call.stream, call.partition, last);
                }
            }
            StreamOutcome::Lost => book.flag_lost(),
            StreamOutcome::Fenced { .. } => {
                counter!(m::FENCED, "at" => "redis").increment(1);
            }
            StreamOutcome::BadFence { fence, value } => {
                counter!(m::FENCE_INVALID).increment(1);
                let error = PublishError::bad_fence(fence, call.partition, value.as_deref());
                tracing::error!(
                    fence = %fence,
                    partition = call.partition,
                    "{error}"
                );
            }
        }
    }
}

/// The rate-limit permits of each partition's rows in `found` (index in `leases`, rows): the
/// streams each may not append to yet. Rows are counted per stream as routing sends them (an
/// upper bound of what the batch appends: rows cut or failed in the plan take permits too).
async fn permits(
    worker: &Worker,
    leases: &[LeaseRef],
    found: &[(usize, Vec<ClaimedEvent>)],
) -> Vec<Result<Refused, BatchError>> {
    let limits = &worker.shared.limits;
    if !limits.any() {
        return found.iter().map(|_| Ok(Refused::default())).collect();
    }
    let wants: Vec<Vec<(String, usize)>> = found
        .iter()
        .map(|(i, rows)| {
            let mut routes: Vec<(RouteKey, Option<String>)> = Vec::new();
            let mut counts: Vec<(String, usize)> = Vec::new();
            for row in rows.iter().filter(|r| r.undecodable.is_none()) {
                let stream = route_cached(&mut routes, row, || {
                    stream_for(
                        &worker.shared.router,
                        &worker.publisher,
                        row,
                        leases[*i].partition,
                    )
                    .ok()
                    .flatten()
                });
                let Some(stream) = stream else { continue };
                match counts.iter_mut().find(|(s, _)| *s == stream) {
                    Some(c) => c.1 += 1,
                    None => counts.push((stream, 1)),
                }
            }
            counts
        })
        .collect();
    let calls: Vec<Vec<(&str, usize)>> = wants
        .iter()
        .map(|w| w.iter().map(|(s, n)| (s.as_str(), *n)).collect())
        .collect();
    limits
        .take(worker.publisher.connection(), &calls)
        .await
        .into_iter()
        .map(|r| {
            r.map_err(|e| {
                counter!(m::FAILURES, "kind" => "transient", "code" => e.0.code().to_owned())
                    .increment(1);
                BatchError::Transient(e.to_string())
            })
        })
        .collect()
}

/// The stream key `row` goes to in `partition` (`None`: no destination), or why it cannot be
/// routed.
fn stream_for(
    router: &Router,
    publisher: &Publisher,
    row: &ClaimedEvent,
    partition: i32,
) -> Result<Option<String>, String> {
    match router.route(
        &row.aggregate_type,
        &row.event_type,
        partition,
        row.destination.as_deref(),
    ) {
        Ok(Route::NoDestination) => Ok(None),
        Ok(Route::Stream(name)) => Ok(Some(publisher.stream_key(&name))),
        Err(e) => Err(e.to_string()),
    }
}

/// `make`'s value for the route of `row`, computed once per (aggregate type, event type,
/// destination) in `cache`: most rows of a batch share them.
fn route_cached<T: Clone>(
    cache: &mut Vec<(RouteKey, T)>,
    row: &ClaimedEvent,
    make: impl FnOnce() -> T,
) -> T {
    let known = cache.iter().find(|((t, e, d), _)| {
        *t == row.aggregate_type && *e == row.event_type && *d == row.destination
    });
    if let Some((_, value)) = known {
        return value.clone();
    }
    let value = make();
    let key = (
        row.aggregate_type.clone(),
        row.event_type.clone(),
        row.destination.clone(),
    );
    cache.push((key, value.clone()));
    value
}

/// `(aggregate type, event type, destination)`: what routing depends on.
type RouteKey = (String, String, Option<String>);
/// Where a route's rows go, or why they cannot be routed.
type RouteResult = Result<Target, String>;

/// Where a route's rows go in a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// Nowhere: no destination.
    Nowhere,
    /// The plan's stream batch at this index.
    Batch(usize),
    /// A stream that has no rate-limit permit yet: the row and the rest of its aggregate wait.
    Waiting,
}

/// Routes and encodes claimed rows into per-stream batches, keeping each aggregate's order:
/// an aggregate whose rows in this batch would go to two streams is cut before the second one
/// (the rest waits for the next batch), and an aggregate with a failed row stops there.
fn plan(
    shared: &Shared,
    publisher: &Publisher,
    rows: Vec<ClaimedEvent>,
    lease: &LeaseRef,
    refused: &Refused,
) -> Plan {
    let (router, book, settings, limits) = (
        &shared.router,
        &shared.streams,
        &shared.settings,
        &shared.limits,
    );
    let mut plan = Plan::default();
    // Routes of this batch: most rows share an aggregate type, event type and destination, so
    // each distinct combination is routed once.
    let mut routes: Vec<(RouteKey, RouteResult)> = Vec::new();
    // Aggregate → the batch its rows go to, or None once it is cut or failed. Keyed by a hash
    // of the aggregate (randomly keyed, so collisions are as good as impossible; one would
    // only make two aggregates wait for the next batch together, never reorder either).
    let mut aggregates: HashMap<u64, Option<usize>> = HashMap::new();
    let keys = std::collections::hash_map::RandomState::new();
    // Entries in the plan's stream batches.
    let mut entries = 0usize;
    // The most entries the plan may append (rate-limit bursts): per stream batch, and in all.
    let mut caps: Vec<Option<usize>> = Vec::new();
    let total_cap = limits.total_cap();
    for row in rows {
        let key = keys.hash_one((&row.aggregate_type, &row.aggregate_id));
        if matches!(aggregates.get(&key), Some(None)) {
            continue;
        }
        let aggregate = (row.aggregate_type.as_str(), row.aggregate_id.as_str());
        let origin = Origin {
            id: row.id,
            seq: row.aggregate_seq,
            attempts: row.attempts,
            recorded_at: row.recorded_at,
        };
        if let Some(size) = row.oversize {
            let err = PublishError::event(
                "OVERSIZE",
                format!(
                    "OVERSIZE payload of {size} bytes as JSON text is over the limit of {} \
                     bytes (outpost_max_payload_bytes()) and can never be published: store \
                     large content elsewhere and put its reference in the event",
                    crate::store::MAX_PAYLOAD_BYTES
                ),
            );
            plan.fail(settings, &origin, aggregate, &err);
            aggregates.insert(key, None);
            continue;
        }
        if let Some(why) = &row.undecodable {
            let err = PublishError::event(
                "UNDECODABLE",
                format!("a column of row {} cannot be read: {why}", row.id),
            );
            plan.fail(settings, &origin, aggregate, &err);
            aggregates.insert(key, None);
            continue;
        }
        let route = route_cached(&mut routes, &row, || {
            match stream_for(router, publisher, &row, lease.partition) {
                Ok(None) => Ok(Target::Nowhere),
                Ok(Some(stream)) if refused.holds(&stream) => Ok(Target::Waiting),
                Ok(Some(stream)) => {
                    // Several routes may name one stream: they share its batch, so an
                    // aggregate's entries in a stream stay in one call, in order.
                    match plan.batches.iter().position(|b| b.stream == stream) {
                        Some(idx) => Ok(Target::Batch(idx)),
                        None => {
                            caps.push(limits.stream_cap(&stream));
                            plan.batches.push(StreamBatch {
                                known: book.is_known(&stream),
                                expect: book.expected(&stream, lease.partition),
                                stream,
                                partition: lease.partition,
                                epoch: fence_epoch(lease.epoch),
                                entries: Vec::new(),
                            });
                            plan.origins.push(Vec::new());
                            Ok(Target::Batch(plan.batches.len() - 1))
                        }
                    }
                }
                Err(e) => Err(e),
            }
        });
        let idx = match route {
            Ok(Target::Waiting) => {
                aggregates.insert(key, None);
                continue;
            }
            Ok(Target::Nowhere) => {
                plan.result.no_destination.push(row.id);
                if origin.attempts > 0 {
                    // An event that failed before and is now routed nowhere (an operator's fix
                    // for a poison type): its aggregate's hold ends here.
                    plan.result.unblocked.push((
                        row.aggregate_type.clone(),
                        row.aggregate_id.clone(),
                        row.aggregate_seq,
                    ));
                }
                continue;
            }
            Ok(Target::Batch(idx)) => idx,
            Err(e) => {
                plan.fail(
                    settings,
                    &origin,
                    aggregate,
                    &PublishError::event("UNROUTABLE", e),
                );
                aggregates.insert(key, None);
                continue;
            }
        };
        match aggregates.get(&key) {
            // Two streams for one aggregate in one batch: the rest waits for the next batch.
            Some(Some(other)) if *other != idx => {
                aggregates.insert(key, None);
                continue;
            }
            _ => {}
        }
        // A batch appends no more than a rate limit's burst: the rest waits for the next one.
        let full = |cap: Option<usize>, n: usize| cap.is_some_and(|c| n >= c);
        if full(caps[idx], plan.batches[idx].entries.len()) || full(total_cap, entries) {
            aggregates.insert(key, None);
            continue;
        }
        entries += 1;
        let message = Message {
            event_id: row.event_id.to_string(),
            event_type: row.event_type,
            aggregate_type: row.aggregate_type,
            aggregate_id: row.aggregate_id,
            aggregate_seq: row.aggregate_seq,
            schema_version: row.schema_version,
            time: row
                .occurred_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            payload: row.payload,
            headers: row.headers,
        };
        let entry = match Entry::try_new(message) {
            Ok(e) => e,
            Err(failed) => {
                let (e, m) = *failed;
                let aggregate = (m.aggregate_type.as_str(), m.aggregate_id.as_str());
                plan.fail(settings, &origin, aggregate, &e);
                aggregates.insert(key, None);
                continue;
            }
        };
        aggregates.insert(key, Some(idx));
        plan.batches[idx].entries.push(entry);
        plan.origins[idx].push(origin);
    }
    // A route whose rows were all cut or failed leaves an empty batch: nothing to send.
    let (batches, origins): (Vec<_>, Vec<_>) = plan
        .batches
        .into_iter()
        .zip(plan.origins)
        .filter(|(b, _)| !b.entries.is_empty())
        .unzip();
    plan.batches = batches;
    plan.origins = origins;
    plan
}

/// The epoch a publish is fenced with. The `fence-off` fault point (tests only) sends none, to
/// show what the Redis fence prevents.
fn fence_epoch(epoch: i64) -> i64 {
    #[cfg(feature = "failpoints")]
    if fail::eval("fence-off", |_| ()).is_some() {
        return crate::publish::UNFENCED;
    }
    epoch
}
