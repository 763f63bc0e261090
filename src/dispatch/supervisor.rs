//! The node supervisor: membership, leases, wake-ups, and the partition actors.
//!
//! - **Leases.** Every `node.heartbeat_ms` one statement refreshes the node's heartbeat and
//!   renews its leases (database clock). The node then takes its fair share, ⌊partitions / live
//!   nodes⌋ or one more (the first nodes by id take the remainder), so shares differ by at most
//!   one: it acquires free or expired partitions (bumping their epoch) when below it, and
//!   hands extras over — stop the actor, let its batch finish, release the lease — when above it.
//!   A lease missing from the renewal was taken over: its actor is dropped at once (anything it
//!   still tries is fenced). Publishing also stops locally when renewals fail for longer than
//!   the lease minus a margin ([`LeaseDeadline`](super::batch::LeaseDeadline)).
//! - **Wake-ups.** See [`super::wakeup`]: busy polls, each a batch over the idle partitions
//!   (their actors take over a partition that turns out to have a backlog); nudges from
//!   producers while idle; and the heartbeat tick, which also reports which held partitions have
//!   ready rows, as the scheduled poll for missed nudges. An idle node therefore runs one
//!   statement per heartbeat. A partition's batches never overlap: see [`Slot::polling`] and
//!   [`Slot::woken`].
//! - **Shutdown.** Stop polling, ask every actor to stop after its batch, release every lease
//!   (the next owner starts at once), deregister; partitions whose batch does not finish by the
//!   deadline are released anyway — their late publishes are fenced.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::FutureExt;
use metrics::{counter, gauge};
use tokio::sync::oneshot;

use super::batch::{BatchError, BatchOutcome, Claim, Shared, Worker};
use super::partition::{PartitionActor, PartitionReport, Stop, Wake, panic_message};
use super::wakeup::{Action, WakePolicy, Wakeup};
use crate::health::Health;
use crate::metrics as m;
use crate::publish::{Publisher, ServerFacts};
use crate::store::{Lease, LeaseRef, LeaseTick, Nudge, NudgeListener, Store};

/// The supervisor's timing and identity.
#[derive(Debug, Clone)]
pub struct SupervisorSettings {
    /// This node's id.
    pub node_id: String,
    /// Heartbeat and lease renewal period.
    pub heartbeat: Duration,
    /// Lease length (database clock).
    pub lease: Duration,
    /// Wake-up timing.
    pub wake: WakePolicy,
    /// Transient back-off of partition actors: (base, max).
    pub transient_backoff: (Duration, Duration),
    /// Longest graceful shutdown.
    pub shutdown_timeout: Duration,
    /// URL for the LISTEN connection.
    pub database_url: String,
    /// `retention.republish_window_secs`.
    pub republish_window_secs: u64,
    /// `redis.maxmemory_policy_check = "refuse"`.
    pub refuse_eviction: bool,
    /// The Redis run id already checked for lost streams at start (`None`: check at the first
    /// heartbeat).
    pub checked_run_id: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// A batch run is (or may be) in progress.
    Busy,
    /// Drained; waiting for a wake-up.
    Idle,
    /// Paused by an operator: lease kept, no actor.
    Paused,
    /// Asked to stop; then release the lease (`true`) or keep it paused (`false`).
    Stopping { release: bool },
}

#[derive(Debug)]
struct Slot {
    lease: Lease,
    addr: Option<Addr<PartitionActor>>,
    state: SlotState,
    /// The busy poll whose batch covers this (idle) partition right now, by number: its actor
    /// must not run a batch of its own, nor be stopped (its lease released) before that batch
    /// is done with the partition. Only that poll's reports clear it.
    polling: Option<u64>,
    /// Wake-ups sent to the actor; `Idle` means no batch of the actor runs only when its report
    /// names the last of them (the busy poll relies on that).
    woken: u64,
}

/// Ask the supervisor to shut down gracefully; `done` fires when it has.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Shutdown {
    /// Fired once every lease is released and the node deregistered.
    pub done: oneshot::Sender<()>,
}

/// Partitions this node currently owns: `(partition, epoch, paused)`, paused meaning that the
/// node holds the lease but its actor has stopped publishing.
#[derive(Debug, Message)]
#[rtype(result = "Vec<(i32, i64, bool)>")]
pub struct OwnedPartitions;

#[derive(Debug, Message)]
#[rtype(result = "()")]
struct Nudged(Nudge);

/// A busy poll's batch is done: each lease with how its share ended.
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct Polled {
    poll: u64,
    leases: Vec<LeaseRef>,
    outcomes: Vec<Result<BatchOutcome, BatchError>>,
}

/// A busy poll's claim found nothing in these partitions: they are done with it, and the next
/// poll may cover them while its batch goes on with the others.
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct PollFoundNothing {
    poll: u64,
    leases: Vec<LeaseRef>,
}

/// The node supervisor actor.
pub struct NodeSupervisor {
    settings: SupervisorSettings,
    store: Store,
    /// The pool the ticks run on (see [`Store::lease_tick`]).
    tick_store: Store,
    /// The last tick found the outbox locked by another session.
    outbox_locked: bool,
    publisher: Publisher,
    workers: Vec<(ArbiterHandle, Worker)>,
    shared: Arc<Shared>,
    slots: BTreeMap<i32, Slot>,
    wake: Wakeup,
    poll_timer: Option<SpawnHandle>,
    /// What `wants_nudge` should say, and whether a write of it is under way. One write at a
    /// time: two in flight could land out of order, leaving an idle node marked as not wanting
    /// nudges (producers would not NOTIFY and its events would wait for the scheduled poll).
    nudge_flag: NudgeFlag,
    health: Arc<Health>,
    restarts: Arc<AtomicU64>,
    ticking: bool,
    /// Busy polls whose batch is under way (at most [`POLLS_PER_WORKER`] per worker).
    polls: usize,
    /// The last busy poll's number; it also picks the worker that runs the poll's batch.
    poll_turn: u64,
    shutdown: Option<oneshot::Sender<()>>,
    to_release: Vec<Lease>,
    worked_since_backlog: bool,
    last_backlog: Instant,
    /// A backlog count is under way (it reads the outbox, and may wait for a lock on it).
    counting: bool,
    /// The Redis run id whose streams were last checked (see [`super::redis_loss`]).
    checked_run_id: Option<String>,
    /// A check of Redis's streams or a recording of positions is under way.
    watching: bool,
}

impl std::fmt::Debug for NodeSupervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeSupervisor")
            .field("node_id", &self.settings.node_id)
            .field("partitions", &self.slots.len())
            .finish()
    }
}

impl NodeSupervisor {
    /// A supervisor over `workers` (one per arbiter).
    pub fn new(
        settings: SupervisorSettings,
        store: Store,
        publisher: Publisher,
        workers: Vec<(ArbiterHandle, Worker)>,
        shared: Arc<Shared>,
        health: Arc<Health>,
        restarts: Arc<AtomicU64>,
    ) -> Self {
        let wake = Wakeup::new(settings.wake, Instant::now());
        let checked_run_id = settings.checked_run_id.clone();
        Self {
            settings,
            tick_store: store.clone(),
            outbox_locked: false,
            store,
            publisher,
            workers,
            shared,
            checked_run_id,
            watching: false,
            slots: BTreeMap::new(),
            wake,
            poll_timer: None,
            nudge_flag: NudgeFlag::default(),
            health,
            restarts,
            ticking: false,
            polls: 0,
            poll_turn: 0,
            shutdown: None,
            to_release: Vec::new(),
            // Refresh the backlog gauges at the first tick, then every `BACKLOG_EVERY`.
            worked_since_backlog: true,
            last_backlog: Instant::now()
                .checked_sub(BACKLOG_EVERY)
                .unwrap_or_else(Instant::now),
            counting: false,
        }
    }

    /// Runs the ticks on `store` instead of the supervisor's own pool: a pool whose sessions
    /// have a `lock_timeout`, so that a lock on the outbox does not hold back lease renewal
    /// ([`Store::lease_tick`]).
    pub fn with_tick_store(mut self, store: Store) -> Self {
        self.tick_store = store;
        self
    }

    fn shutting_down(&self) -> bool {
        self.shutdown.is_some()
    }

    fn lease_ref(&self, lease: &Lease) -> LeaseRef {
        LeaseRef {
            partition: lease.partition,
            node_id: self.settings.node_id.clone(),
            epoch: lease.epoch,
        }
    }

    fn start_actor(&mut self, lease: Lease, ctx: &mut Context<Self>) {
        if lease.paused {
            self.slots.insert(
                lease.partition,
                Slot {
                    lease,
                    addr: None,
                    state: SlotState::Paused,
                    polling: None,
                    woken: 0,
                },
            );
            return;
        }
        let idx = usize::try_from(lease.partition).unwrap_or(0) % self.workers.len().max(1);
        let Some((arbiter, worker)) = self.workers.get(idx) else {
            return;
        };
        let (lease_ref, worker) = (self.lease_ref(&lease), worker.clone());
        let report = ctx.address().recipient();
        let (transient, restarts) = (self.settings.transient_backoff, self.restarts.clone());
        let addr = actix::Supervisor::start_in_arbiter(arbiter, move |_| {
            PartitionActor::new(lease_ref, worker, report, transient, restarts)
        });
        self.slots.insert(
            lease.partition,
            Slot {
                lease,
                addr: Some(addr),
                state: SlotState::Busy,
                polling: None,
                woken: 0,
            },
        );
        // A partition taken on (or resumed) may hold a backlog: its actor claims at once, and
        // the node is busy until it reports idle. This also ends an idle spell in which the
        // node asked for no nudges because it delivered no partition.
        self.record_poll(true, ctx);
    }

    /// Asks a partition's actor to stop; `release` gives the lease back once it has.
    fn stop_slot(&mut self, partition: i32, release: bool) {
        let Some(slot) = self.slots.get_mut(&partition) else {
            return;
        };
        match (&slot.addr, slot.state) {
            (_, SlotState::Stopping { .. }) => slot.state = SlotState::Stopping { release },
            (Some(addr), _) => {
                // While the busy poll's batch covers the partition, the stop waits for it
                // ([`Polled`]): a lease released under a batch in flight would let the next
                // owner publish the same rows again.
                if slot.polling.is_none() {
                    addr.do_send(Stop);
                }
                slot.state = SlotState::Stopping { release };
            }
            (None, _) => {
                if release {
                    let lease = slot.lease;
                    self.slots.remove(&partition);
                    self.to_release.push(lease);
                }
            }
        }
    }

    fn on_tick(&mut self, tick: LeaseTick, ctx: &mut Context<Self>) {
        let LeaseTick {
            held,
            ready,
            outbox_locked,
            live_nodes: live,
            rank,
            partitions,
        } = tick;
        if outbox_locked != self.outbox_locked {
            self.outbox_locked = outbox_locked;
            if outbox_locked {
                tracing::warn!(
                    "another session holds a lock on outpost_event (an ALTER TABLE, a VACUUM \
                     FULL, or one waiting behind a long query): publishing waits for it; the \
                     leases are kept"
                );
            } else {
                tracing::info!("the lock on outpost_event is gone");
            }
        }
        let held_now: BTreeMap<i32, Lease> = held.iter().map(|l| (l.partition, *l)).collect();
        // Leases taken over by another node: drop the actor; anything it still does is fenced.
        let lost: Vec<i32> = self
            .slots
            .keys()
            .filter(|p| {
                held_now.get(p).map(|l| l.epoch) != self.slots.get(p).map(|s| s.lease.epoch)
            })
            .copied()
            .collect();
        for p in lost {
            tracing::warn!(
                partition = p,
                "lease taken over by another node (or its epoch moved by a recovery from a Redis \
                 data loss)"
            );
            self.slots.remove(&p);
        }
        // Leases the database still gives this node but no actor serves (an actor that retired
        // on a lost lease whose row still names us): give them back, so they do not stay renewed
        // and unserved; fair share takes them again, with a new epoch.
        let orphans: Vec<Lease> = held_now
            .values()
            .filter(|l| !self.slots.contains_key(&l.partition))
            .filter(|l| !self.to_release.iter().any(|r| r.partition == l.partition))
            .copied()
            .collect();
        if !orphans.is_empty() {
            self.to_release.extend(orphans);
            self.release_pending(ctx);
        }
        // Pause and resume, as recorded in the database.
        let changes: Vec<(i32, bool)> = held_now
            .values()
            .filter_map(|l| {
                self.slots
                    .get(&l.partition)
                    .map(|s| (l.partition, l.paused, s.state))
            })
            .filter_map(|(p, paused, state)| match (paused, state) {
                (true, SlotState::Busy | SlotState::Idle) => Some((p, true)),
                (false, SlotState::Paused) => Some((p, false)),
                _ => None,
            })
            .collect();
        for (p, pause) in changes {
            if let Some(slot) = self.slots.get_mut(&p) {
                slot.lease.paused = pause;
            }
            if pause {
                tracing::info!(partition = p, "partition paused");
                self.stop_slot(p, false);
            } else if let Some(slot) = self.slots.remove(&p) {
                tracing::info!(partition = p, "partition resumed");
                self.start_actor(slot.lease, ctx);
            }
        }
        if self.shutting_down() {
            return;
        }
        // The tick is also the idle node's scheduled poll: it catches missed nudges.
        if !ready.is_empty() {
            for p in &ready {
                self.wake_partition(*p);
            }
            let action = self.wake.polled(true, Instant::now());
            self.apply(action, ctx);
            if let Some(wait) = self.wake.next_wait() {
                self.schedule_poll(ctx, wait);
            }
        }
        // Fair share: ⌊partitions / live⌋, one more for the first `partitions mod live` nodes by
        // id, so shares differ by at most one.
        let live = live.max(1);
        let target = (partitions / live + u32::from(rank < partitions % live)) as usize;
        let mine = self.slots.len();
        if mine > target {
            let extras: Vec<i32> = self
                .slots
                .keys()
                .rev()
                .take(mine - target)
                .copied()
                .collect();
            for p in extras {
                tracing::info!(partition = p, "handing partition over (fair share)");
                self.stop_slot(p, true);
            }
        } else if mine < target {
            let holding: Vec<i32> = self.slots.keys().copied().collect();
            let want = u32::try_from(target - mine).unwrap_or(u32::MAX);
            let (store, node, lease_ms) = (
                self.store.clone(),
                self.settings.node_id.clone(),
                ms(self.settings.lease),
            );
            let (publisher, shared) = (self.publisher.clone(), self.shared.clone());
            // No tick may start before the new leases are in `slots`: it would take them for lost.
            self.ticking = true;
            ctx.spawn(
                async move {
                    let leases = store
                        .acquire_partitions(&node, lease_ms, &holding, want)
                        .await?;
                    fence_known_streams(&store, &publisher, &shared, &leases).await;
                    Ok::<_, crate::store::StoreError>(leases)
                }
                .into_actor(self)
                .map(|res, act, ctx| match res {
                    Ok(leases) => {
                        act.ticking = false;
                        for l in leases {
                            if act.shutting_down() {
                                act.to_release.push(l);
                            } else {
                                tracing::info!(
                                    partition = l.partition,
                                    epoch = l.epoch,
                                    "lease acquired"
                                );
                                act.start_actor(l, ctx);
                            }
                        }
                        act.slots_changed(ctx);
                    }
                    Err(e) => {
                        act.ticking = false;
                        tracing::warn!(error = %e, "acquiring partitions failed");
                    }
                }),
            );
        }
        self.slots_changed(ctx);
    }

    /// After partitions were taken on, lost, paused or handed over: the gauges, and whether the
    /// node still wants nudges ([`Self::sync_nudge_flag`]).
    fn slots_changed(&mut self, ctx: &mut Context<Self>) {
        self.update_gauges();
        self.sync_nudge_flag(ctx);
    }

    fn update_gauges(&self) {
        let paused = self.slots.values().filter(|s| s.lease.paused).count();
        gauge!(m::LEASES_HELD).set(self.slots.len() as f64);
        gauge!(m::PARTITIONS_PAUSED).set(paused as f64);
        self.health
            .leases
            .store(self.slots.len() as u64, Ordering::Relaxed);
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if self.ticking {
            return;
        }
        // A callback here freezes the supervisor's thread, as a stopped process would (tests).
        fail::fail_point!("lease-tick", |_| ());
        self.ticking = true;
        let (store, publisher) = (self.tick_store.clone(), self.publisher.clone());
        let node = self.settings.node_id.clone();
        let lease_ms = ms(self.settings.lease);
        let started = Instant::now();
        ctx.spawn(
            async move {
                let facts = publisher.server_facts().await;
                (store.lease_tick(&node, lease_ms, lease_ms).await, facts)
            }
            .into_actor(self)
            .map(move |(res, facts), act, ctx| {
                act.ticking = false;
                act.health.redis.store(facts.is_ok(), Ordering::Relaxed);
                if let Ok(facts) = facts {
                    act.watch_redis(facts, ctx);
                }
                match res {
                    Ok(tick) => {
                        act.health.database.store(true, Ordering::Relaxed);
                        // Keep a margin of one heartbeat plus a fifth of the lease.
                        let margin = act.settings.heartbeat + act.settings.lease / 5;
                        let until = started + act.settings.lease.saturating_sub(margin);
                        for (_, w) in &act.workers {
                            w.shared.deadline.extend_to(until);
                        }
                        act.on_tick(tick, ctx);
                    }
                    Err(e) => {
                        act.health.database.store(false, Ordering::Relaxed);
                        tracing::warn!(error = %e, "heartbeat and lease renewal failed");
                    }
                }
                act.refresh_backlog(ctx);
            }),
        );
    }

    /// After each heartbeat: when Redis has a run id not yet checked, or a batch found a known
    /// stream's fence missing, checks every recorded stream and recovers from a data loss
    /// ([`super::redis_loss::check`]); otherwise records the stream positions noted since the
    /// last heartbeat (one statement, only while publishing). One at a time.
    fn watch_redis(&mut self, facts: ServerFacts, ctx: &mut Context<Self>) {
        let run_id = facts.run_id.clone();
        self.health
            .set_redis(facts, None, self.settings.refuse_eviction);
        if self.watching {
            return;
        }
        let lost = self.shared.streams.take_lost();
        let check = lost || self.checked_run_id.as_deref() != Some(run_id.as_str());
        self.watching = true;
        let (store, publisher, shared) = (
            self.store.clone(),
            self.publisher.clone(),
            self.shared.clone(),
        );
        let window = self.settings.republish_window_secs;
        ctx.spawn(
            async move {
                if check {
                    super::redis_loss::check(
                        &store,
                        &publisher,
                        &shared.streams,
                        &run_id,
                        window,
                    )
                    .await
                    .map(|w| Some((run_id, w)))
                } else {
                    super::redis_loss::record_positions(&store, &shared.streams)
                        .await
                        .map(|()| None)
                        .map_err(Into::into)
                }
            }
            .into_actor(self)
            .map(move |res, act, _ctx| {
                act.watching = false;
                match res {
                    Ok(Some((run_id, watch))) => {
                        tracing::debug!(?watch, "Redis streams checked");
                        act.checked_run_id = Some(run_id);
                    }
                    Ok(None) => {}
                    Err(e) => {
                        if lost {
                            act.shared.streams.flag_lost();
                        }
                        tracing::warn!(error = %e, "checking or recording Redis streams failed; retrying at the next heartbeat");
                    }
                }
            }),
        );
    }

    /// Backlog gauges: refreshed at most every 15 s, and only after work was done, so an idle
    /// node stays within its query budget.
    fn refresh_backlog(&mut self, ctx: &mut Context<Self>) {
        // One count at a time: a count waiting for a lock on the outbox must not be joined by
        // another every period until the supervisor's pool has no connection left for its ticks.
        if self.counting || self.last_backlog.elapsed() < BACKLOG_EVERY {
            return;
        }
        // Counting scans the outbox, so the nodes take turns: one node counts per period (a
        // node that has not worked since its last look leaves it to the others) and the others
        // read its figures.
        let may_count = std::mem::take(&mut self.worked_since_backlog);
        self.last_backlog = Instant::now();
        let store = self.store.clone();
        self.counting = true;
        ctx.spawn(
            async move { store.shared_backlog(BACKLOG_EVERY, may_count).await }
                .into_actor(self)
                .map(|res, act, _ctx| {
                    act.counting = false;
                    if let Ok(b) = res {
                        for s in [
                            "pending",
                            "retry_wait",
                            "held",
                            "published",
                            "quarantined",
                            "discarded",
                            "no_destination",
                        ] {
                            let rows = b
                                .by_status
                                .iter()
                                .find(|c| c.status == s)
                                .map_or(0, |c| c.rows);
                            gauge!(m::BACKLOG, "state" => s).set(rows as f64);
                        }
                        gauge!(m::OLDEST_PENDING_AGE).set(b.oldest_pending_age_secs.unwrap_or(0.0));
                    }
                }),
        );
    }

    fn schedule_poll(&mut self, ctx: &mut Context<Self>, after: Duration) {
        if let Some(h) = self.poll_timer.take() {
            ctx.cancel_future(h);
        }
        if self.shutting_down() {
            return;
        }
        self.poll_timer = Some(ctx.run_later(after, |act, ctx| {
            act.poll_timer = None;
            act.poll(ctx);
        }));
    }

    /// The busy poll: one batch over every idle partition, run by one worker (in turn), whose
    /// claim is the poll. Under a steady flow it finds an event or two in a few partitions and
    /// publishes and marks them at once, without a query to find them first or a wake-up of
    /// their actors; a partition whose share of the batch came back full has a backlog, and its
    /// actor takes over ([`Polled`]). While busy the next poll is due `busy_poll` after this one
    /// starts, whether or not this one's batch is done by then: it covers the idle partitions
    /// the batches under way do not.
    fn poll(&mut self, ctx: &mut Context<Self>) {
        if self.shutting_down() {
            return;
        }
        if let Some(wait) = self.wake.next_wait() {
            self.schedule_poll(ctx, wait);
        }
        if self.polls >= POLLS_PER_WORKER * self.workers.len() {
            // The batches under way report what they found.
            return;
        }
        let poll = self.poll_turn.wrapping_add(1);
        let Some((arbiter, worker)) = self
            .workers
            .get(usize::try_from(poll).unwrap_or(0) % self.workers.len().max(1))
            .cloned()
        else {
            return;
        };
        let node = &self.settings.node_id;
        let idle: Vec<LeaseRef> = self
            .slots
            .values_mut()
            .filter(|s| s.state == SlotState::Idle && s.addr.is_some() && s.polling.is_none())
            .map(|s| {
                s.polling = Some(poll);
                LeaseRef {
                    partition: s.lease.partition,
                    node_id: node.clone(),
                    epoch: s.lease.epoch,
                }
            })
            .collect();
        if idle.is_empty() {
            // With a poll under way holding the partitions, it reports what it found when it
            // ends. Counting it as work here would keep a node whose claims take longer than
            // `busy_poll` from ever going idle, polling an empty outbox every `busy_poll`.
            if self.polls == 0 {
                let busy = self.slots.values().any(|s| s.state == SlotState::Busy);
                self.record_poll(busy, ctx);
            }
            return;
        }
        self.poll_turn = poll;
        self.polls += 1;
        let me = ctx.address();
        let leases = idle.clone();
        let job = async move {
            let found_nothing = |empty: &[&LeaseRef]| {
                if !empty.is_empty() {
                    me.do_send(PollFoundNothing {
                        poll,
                        leases: empty.iter().map(|l| (*l).clone()).collect(),
                    });
                }
            };
            let outcomes = match AssertUnwindSafe(worker.run_together(
                &leases,
                Claim::Poll,
                found_nothing,
            ))
            .catch_unwind()
            .await
            {
                Ok(outcomes) => outcomes,
                Err(panic) => {
                    let what = panic_message(panic.as_ref());
                    tracing::error!(panic = %what, "the busy poll's batch panicked; the partitions' actors take over");
                    let e = BatchError::Transient(format!("the batch panicked: {what}"));
                    leases.iter().map(|_| Err(e.clone())).collect()
                }
            };
            me.do_send(Polled {
                poll,
                leases,
                outcomes,
            });
        };
        if !arbiter.spawn(job) {
            // The worker's arbiter is gone (the node is stopping): nothing ran.
            let outcomes = idle
                .iter()
                .map(|_| Err(BatchError::Transient("the worker is gone".to_owned())))
                .collect();
            self.on_polled(
                Polled {
                    poll,
                    leases: idle,
                    outcomes,
                },
                ctx,
            );
        }
    }

    /// Ends a poll's hold on a partition (when that poll still holds it), passing on a stop
    /// asked for meanwhile. Returns whether it held it.
    fn end_poll_hold(&mut self, poll: u64, lease: &LeaseRef) -> bool {
        let Some(slot) = self.slots.get_mut(&lease.partition) else {
            return false;
        };
        if slot.lease.epoch != lease.epoch || slot.polling != Some(poll) {
            return false;
        }
        slot.polling = None;
        if let (SlotState::Stopping { .. }, Some(addr)) = (slot.state, &slot.addr) {
            addr.do_send(Stop);
        }
        true
    }

    /// A busy poll's batch is done: partitions go back to idle, or to their actors when their
    /// share came back full (a backlog) or failed (the actor retries, backs off or reports a lost
    /// lease as it does for its own batches).
    fn on_polled(&mut self, msg: Polled, ctx: &mut Context<Self>) {
        self.polls = self.polls.saturating_sub(1);
        let mut found = false;
        let mut wake = Vec::new();
        for (lease, outcome) in msg.leases.iter().zip(msg.outcomes) {
            if !self.end_poll_hold(msg.poll, lease) {
                continue;
            }
            match outcome {
                Ok(BatchOutcome::Idle) => {}
                Ok(BatchOutcome::Done { full, deferred, .. }) => {
                    found = true;
                    // A partition with rows waiting for a rate-limit permit goes to its actor,
                    // which tries them again when the budget has room.
                    if full || deferred.is_some() {
                        wake.push(lease.partition);
                    }
                }
                Ok(BatchOutcome::Limited { .. }) => {
                    // The actor waits for the permit (and keeps waiting for it on its own).
                    found = true;
                    wake.push(lease.partition);
                }
                Err(e) => {
                    tracing::debug!(partition = lease.partition, error = %e, "the busy poll's batch failed; the actor takes over");
                    wake.push(lease.partition);
                }
            }
        }
        if found {
            self.worked_since_backlog = true;
        }
        for p in wake {
            self.wake_partition(p);
        }
        let busy = self.slots.values().any(|s| s.state == SlotState::Busy);
        self.record_poll(found || busy, ctx);
    }

    /// Records a poll's outcome in the wake-up state. Found work while idle makes the node busy
    /// again, and its polls start over; going idle ends them (the heartbeat tick is then the
    /// scheduled poll, and a nudge ends the idleness).
    fn record_poll(&mut self, found_work: bool, ctx: &mut Context<Self>) {
        let was_idle = self.wake.is_idle();
        let action = self.wake.polled(found_work, Instant::now());
        self.apply(action, ctx);
        if was_idle
            && self.poll_timer.is_none()
            && let Some(wait) = self.wake.next_wait()
        {
            self.schedule_poll(ctx, wait);
        }
    }

    fn wake_partition(&mut self, p: i32) {
        if let Some(slot) = self.slots.get_mut(&p)
            && slot.polling.is_none()
            && let (Some(addr), SlotState::Idle | SlotState::Busy) = (&slot.addr, slot.state)
        {
            slot.woken += 1;
            addr.do_send(Wake(slot.woken));
            slot.state = SlotState::Busy;
            self.worked_since_backlog = true;
        }
    }

    fn apply(&mut self, action: Action, ctx: &mut Context<Self>) {
        if action != Action::None {
            self.sync_nudge_flag(ctx);
        }
    }

    /// Whether some held partition is delivered by this node (not paused, not being stopped).
    fn delivers_a_partition(&self) -> bool {
        self.slots
            .values()
            .any(|s| matches!(s.state, SlotState::Busy | SlotState::Idle))
    }

    /// Asks for nudges while idle and delivering some partition; stops asking otherwise. A
    /// node without a partition to deliver (a standby node of a cluster with more nodes than
    /// partitions, every partition paused, a node starting before its first leases) has
    /// nothing a nudge could wake, and producers would pay a `NOTIFY` per commit for it.
    fn sync_nudge_flag(&mut self, ctx: &mut Context<Self>) {
        self.nudge_flag.wanted = self.wake.is_idle() && self.delivers_a_partition();
        self.write_nudge_flag(ctx);
    }

    /// Writes `wants_nudge` as [`NudgeFlag::wanted`] says, unless a write is under way (that
    /// write's end writes again if the wish changed meanwhile).
    fn write_nudge_flag(&mut self, ctx: &mut Context<Self>) {
        if self.nudge_flag.writing || self.nudge_flag.written == Some(self.nudge_flag.wanted) {
            return;
        }
        let wants = self.nudge_flag.wanted;
        self.nudge_flag.writing = true;
        let (store, node) = (self.store.clone(), self.settings.node_id.clone());
        let ttl_ms = ms(self.settings.lease);
        ctx.spawn(
            async move { store.set_wants_nudge(&node, wants, ttl_ms).await }
                .into_actor(self)
                .map(move |res, act, ctx| {
                    act.nudge_flag.writing = false;
                    let still_wanted = act.nudge_flag.wanted == wants;
                    match res {
                        Ok(()) => {
                            act.nudge_flag.written = Some(wants);
                            if still_wanted && wants {
                                // Entering idle: poll once more, so a commit that raced with
                                // the flag is not left waiting for the scheduled poll.
                                act.schedule_poll(ctx, Duration::ZERO);
                            }
                            // The wish changed meanwhile: write the new one.
                            act.write_nudge_flag(ctx);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "updating wants_nudge failed");
                            // What the row says is unknown now: the next write goes through.
                            act.nudge_flag.written = None;
                            if !still_wanted {
                                act.write_nudge_flag(ctx);
                            } else if wants {
                                // Producers were not asked to NOTIFY: keep polling, and ask
                                // again after the next spell without work. (A failed write is
                                // not retried at once: the database may be down.)
                                act.nudge_flag.wanted = false;
                                act.wake.ask_failed(Instant::now());
                                if let Some(wait) = act.wake.next_wait() {
                                    act.schedule_poll(ctx, wait);
                                }
                            }
                        }
                    }
                }),
        );
    }

    /// The LISTEN loop runs as a future of this actor, so it is dropped with the actor, inside
    /// the runtime (its connection's destructor needs one).
    fn spawn_listener(&self, ctx: &mut Context<Self>) {
        let url = self.settings.database_url.clone();
        let me = ctx.address();
        let fut = async move {
            loop {
                match NudgeListener::connect(&url).await {
                    Ok(mut listener) => {
                        me.do_send(Nudged(Nudge::MaybeMissed));
                        loop {
                            match listener.recv().await {
                                Ok(n) => me.do_send(Nudged(n)),
                                Err(e) => {
                                    tracing::warn!(error = %e, "nudge listener lost its connection");
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot listen for nudges; polling only"),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        };
        ctx.spawn(actix::fut::wrap_future::<_, Self>(fut));
    }

    fn maybe_finish_shutdown(&mut self, ctx: &mut Context<Self>) {
        if !self.shutting_down() {
            return;
        }
        let stopping = self
            .slots
            .values()
            .any(|s| matches!(s.state, SlotState::Stopping { .. }));
        if stopping {
            return;
        }
        let mut leases: Vec<Lease> = std::mem::take(&mut self.to_release);
        leases.extend(
            std::mem::take(&mut self.slots)
                .into_values()
                .map(|s| s.lease),
        );
        self.finish_shutdown(leases, ctx);
    }

    fn finish_shutdown(&mut self, leases: Vec<Lease>, ctx: &mut Context<Self>) {
        let (store, node) = (self.store.clone(), self.settings.node_id.clone());
        ctx.wait(
            async move {
                if let Err(e) = store.release_partitions(&node, &leases).await {
                    tracing::warn!(error = %e, "releasing leases failed; they will expire");
                }
                if let Err(e) = store.deregister_node(&node).await {
                    tracing::warn!(error = %e, "deregistering the node failed");
                }
                leases.len()
            }
            .into_actor(self)
            .map(|released, act, ctx| {
                tracing::info!(released, "shutdown complete: leases released");
                act.update_gauges();
                if let Some(done) = act.shutdown.take() {
                    let _ = done.send(());
                }
                ctx.stop();
            }),
        );
    }

    /// Redis refused our epoch. If the database still names us as owner at that epoch, Redis
    /// has seen epochs the database never handed out: the database lost history. Jump past the
    /// fence and go on; otherwise another node took the partition over.
    fn on_fenced(&mut self, p: i32, ours: i64, seen: i64, ctx: &mut Context<Self>) {
        let (store, node, lease_ms) = (
            self.store.clone(),
            self.settings.node_id.clone(),
            ms(self.settings.lease),
        );
        ctx.spawn(
            async move { store.advance_epoch(&node, p, ours, seen, lease_ms).await }
                .into_actor(self)
                .map(move |res, act, ctx| {
                    let current = act.slots.get(&p).map(|s| s.lease);
                    if current.map(|l| l.epoch) != Some(ours) {
                        return;
                    }
                    act.slots.remove(&p);
                    match res {
                        Ok(Some(epoch)) if !act.shutting_down() => {
                            tracing::error!(
                                partition = p,
                                ours,
                                redis = seen,
                                new = epoch,
                                "Redis holds a fencing epoch the database never handed out: the \
                                 database lost history (restored from a backup or recreated?) or \
                                 another Outpost database shares this Redis key prefix \
                                 (redis.key_prefix); moving past it"
                            );
                            let paused = current.is_some_and(|l| l.paused);
                            act.start_actor(Lease { partition: p, epoch, paused }, ctx);
                        }
                        Ok(_) => tracing::warn!(
                            partition = p,
                            "partition taken over by another node (or its epoch moved by a \
                             recovery from a Redis data loss)"
                        ),
                        Err(e) => tracing::warn!(error = %e, partition = p, "checking a fenced lease failed"),
                    }
                    act.slots_changed(ctx);
                }),
        );
    }

    fn release_pending(&mut self, ctx: &mut Context<Self>) {
        if self.to_release.is_empty() || self.shutting_down() {
            return;
        }
        let leases = std::mem::take(&mut self.to_release);
        let (store, node) = (self.store.clone(), self.settings.node_id.clone());
        ctx.spawn(
            async move { store.release_partitions(&node, &leases).await }
                .into_actor(self)
                .map(|res, _act, _ctx| {
                    if let Err(e) = res {
                        tracing::warn!(error = %e, "releasing a lease failed; it will expire");
                    }
                }),
        );
    }
}

impl Actor for NodeSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.health.running.store(true, Ordering::Relaxed);
        self.tick(ctx);
        ctx.run_interval(self.settings.heartbeat, |act, ctx| act.tick(ctx));
        self.spawn_listener(ctx);
        self.schedule_poll(ctx, self.settings.wake.busy_poll);
    }

    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        self.health.running.store(false, Ordering::Relaxed);
    }
}

impl Handler<PartitionReport> for NodeSupervisor {
    type Result = ();

    fn handle(&mut self, report: PartitionReport, ctx: &mut Context<Self>) {
        let (p, epoch) = match &report {
            PartitionReport::Idle(p, epoch, _)
            | PartitionReport::Stopped(p, epoch)
            | PartitionReport::LeaseLost(p, epoch, _)
            | PartitionReport::Fenced(p, epoch, _) => (*p, *epoch),
        };
        if self.slots.get(&p).is_some_and(|s| s.lease.epoch != epoch) {
            // From the actor of an earlier lease of a partition taken again since: that actor
            // has stopped, and its report says nothing of the slot that holds the new lease.
            tracing::debug!(partition = p, epoch, "report of an earlier lease ignored");
            return;
        }
        match report {
            PartitionReport::Idle(p, _, wake) => {
                if let Some(slot) = self.slots.get_mut(&p)
                    && slot.state == SlotState::Busy
                    && slot.woken == wake
                {
                    slot.state = SlotState::Idle;
                }
            }
            PartitionReport::LeaseLost(p, _, _) => {
                self.slots.remove(&p);
                self.slots_changed(ctx);
            }
            PartitionReport::Fenced(p, ours, seen) => self.on_fenced(p, ours, seen, ctx),
            PartitionReport::Stopped(p, _) => {
                if let Some(slot) = self.slots.get_mut(&p) {
                    slot.addr = None;
                    match slot.state {
                        SlotState::Stopping { release: true } => {
                            if let Some(slot) = self.slots.remove(&p) {
                                self.to_release.push(slot.lease);
                            }
                        }
                        _ => slot.state = SlotState::Paused,
                    }
                }
                self.release_pending(ctx);
                self.maybe_finish_shutdown(ctx);
            }
        }
    }
}

impl Handler<Polled> for NodeSupervisor {
    type Result = ();

    fn handle(&mut self, msg: Polled, ctx: &mut Context<Self>) {
        self.on_polled(msg, ctx);
    }
}

impl Handler<PollFoundNothing> for NodeSupervisor {
    type Result = ();

    fn handle(&mut self, msg: PollFoundNothing, _ctx: &mut Context<Self>) {
        for lease in &msg.leases {
            self.end_poll_hold(msg.poll, lease);
        }
    }
}

impl Handler<Nudged> for NodeSupervisor {
    type Result = ();

    fn handle(&mut self, msg: Nudged, ctx: &mut Context<Self>) {
        if self.shutting_down() {
            return;
        }
        match msg.0 {
            Nudge::Partitions(ps) => {
                counter!(m::NUDGES).increment(1);
                for p in ps {
                    self.wake_partition(p);
                }
                let action = self.wake.nudged(Instant::now());
                self.apply(action, ctx);
                if let Some(wait) = self.wake.next_wait() {
                    self.schedule_poll(ctx, wait);
                }
            }
            Nudge::MaybeMissed => self.schedule_poll(ctx, Duration::ZERO),
        }
    }
}

impl Handler<Shutdown> for NodeSupervisor {
    type Result = ();

    fn handle(&mut self, msg: Shutdown, ctx: &mut Context<Self>) {
        if self.shutting_down() {
            let _ = msg.done.send(());
            return;
        }
        tracing::info!("shutting down: finishing in-flight batches");
        self.health.running.store(false, Ordering::Relaxed);
        self.shutdown = Some(msg.done);
        if let Some(h) = self.poll_timer.take() {
            ctx.cancel_future(h);
        }
        let partitions: Vec<i32> = self.slots.keys().copied().collect();
        for p in partitions {
            self.stop_slot(p, true);
        }
        ctx.run_later(self.settings.shutdown_timeout, |act, ctx| {
            if act.shutdown.is_some() {
                tracing::warn!("shutdown deadline reached; releasing leases of unfinished batches");
                let mut leases: Vec<Lease> = std::mem::take(&mut act.to_release);
                leases.extend(
                    std::mem::take(&mut act.slots)
                        .into_values()
                        .map(|s| s.lease),
                );
                act.finish_shutdown(leases, ctx);
            }
        });
        self.maybe_finish_shutdown(ctx);
    }
}

impl Handler<OwnedPartitions> for NodeSupervisor {
    type Result = MessageResult<OwnedPartitions>;

    fn handle(&mut self, _: OwnedPartitions, _: &mut Context<Self>) -> Self::Result {
        MessageResult(
            self.slots
                .values()
                .map(|s| {
                    (
                        s.lease.partition,
                        s.lease.epoch,
                        s.state == SlotState::Paused,
                    )
                })
                .collect(),
        )
    }
}

/// Raises the fences of every stream the node knows to the epochs of partitions it has just
/// taken, before their actors publish anything. A node that lost these partitions and still
/// runs is then refused on those streams at once; otherwise a stream the new owner had not
/// written yet would still hold the old epoch (or none for the partition) and take the old
/// owner's late appends. A stream nobody wrote before has nothing such an append could come
/// after. When Redis cannot be reached the leases are taken all the same: the first append of
/// each partition to each stream raises its fence.
///
/// It also loads what the partitions appended to each stream, as recorded with their marks
/// (`outpost_stream_position`): the first append of each to each stream then tells a Redis that
/// lost entries of the partition since (restored from a snapshot, say) and refuses to append
/// past the gap (`super::redis_loss`). When the database cannot answer, the partitions start
/// without it and the check at the next change of Redis's run id is what remains.
async fn fence_known_streams(
    store: &Store,
    publisher: &Publisher,
    shared: &Shared,
    leases: &[Lease],
) {
    if leases.is_empty() {
        return;
    }
    let parts: Vec<i32> = leases.iter().map(|l| l.partition).collect();
    match store.stream_marks(Some(&parts)).await {
        Ok(marks) => {
            for p in parts {
                let mine = marks
                    .iter()
                    .filter(|m| m.partition == p)
                    .map(|m| (m.stream.clone(), m.last))
                    .collect();
                shared.streams.take_partition(p, mine);
            }
        }
        Err(e) => {
            for p in parts {
                shared.streams.take_partition(p, Vec::new());
            }
            tracing::warn!(
                error = %e,
                "reading the newly taken partitions' stream positions failed; their appends are \
                 not checked against them"
            );
        }
    }
    let streams = shared.streams.known();
    let epochs: Vec<(i32, i64)> = leases.iter().map(|l| (l.partition, l.epoch)).collect();
    if let Err(e) = publisher.raise_fences(&streams, &epochs).await {
        tracing::warn!(
            error = %e,
            streams = streams.len(),
            "raising the fences of newly taken partitions failed; their first appends raise them"
        );
    }
}

/// The node's wish for nudges and what it last wrote of it (`outpost_node.wants_nudge`).
#[derive(Debug, Default)]
struct NudgeFlag {
    /// What the row should say: idle and delivering some partition ([`NodeSupervisor::sync_nudge_flag`]).
    wanted: bool,
    /// What the last write that went through wrote (`None`: nothing yet, or the last write
    /// failed and the row may say either).
    written: Option<bool>,
    /// A write is under way.
    writing: bool,
}

/// Busy polls whose batches may be under way at once, per worker: a poll is due every
/// `relay.busy_poll_ms` even when the previous one's batch is still running (under load a batch
/// takes longer than the pause), each over the idle partitions the others do not cover.
const POLLS_PER_WORKER: usize = 2;

/// How often the backlog gauges are refreshed (and, across the cluster, counted).
pub const BACKLOG_EVERY: Duration = Duration::from_secs(15);

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
