//! The load generator: writers that drive the mutations with a realistic mix — records created,
//! edited (declared fields, and notes only), linked, unlinked and deleted.
//!
//! Each writer works on records of its own, so writers never wait for each other's row locks;
//! the mix is drawn from a seeded generator, so a run can be repeated.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use uuid::Uuid;

use crate::service::{Action, NewRecord, RecordChange, Records, RecordsError};

/// What the writers do, in shares of 100 operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mix {
    /// Create a record.
    pub create: u32,
    /// Change a record's title or status (declared content: an event).
    pub update_declared: u32,
    /// Change only a record's notes (not declared: audit and history, no event).
    pub update_notes: u32,
    /// Link two of the writer's records.
    pub link: u32,
    /// Remove a link.
    pub unlink: u32,
    /// Delete a record without links.
    pub delete: u32,
}

impl Default for Mix {
    fn default() -> Self {
        Self {
            create: 20,
            update_declared: 30,
            update_notes: 20,
            link: 15,
            unlink: 10,
            delete: 5,
        }
    }
}

/// Counters shared by the writers, read by the progress line.
#[derive(Debug, Default)]
pub struct LoadStats {
    /// Transactions committed, per [`Action`] (in [`Action::ALL`] order).
    pub committed: [AtomicU64; 5],
    /// Committed transactions that wrote an event.
    pub with_event: AtomicU64,
    /// Committed updates that changed only undeclared fields.
    pub undeclared_only: AtomicU64,
    /// Transactions that failed (rolled back; the writer goes on).
    pub failed: AtomicU64,
}

impl LoadStats {
    /// Committed transactions of every kind.
    pub fn total(&self) -> u64 {
        self.committed
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    fn count(&self, action: Action, event: bool) {
        let i = Action::ALL.iter().position(|a| *a == action).unwrap_or(0);
        self.committed[i].fetch_add(1, Ordering::Relaxed);
        if event {
            self.with_event.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// How the writers run.
#[derive(Debug, Clone)]
pub struct LoadSettings {
    /// Concurrent writers.
    pub writers: usize,
    /// Transactions per second over all writers; 0 for as fast as they go.
    pub rate: u32,
    /// The mix.
    pub mix: Mix,
    /// Seed of the writers' generators (writer `i` uses `seed + i`).
    pub seed: u64,
}

/// Runs the writers until `stop` is set. A failed transaction (a deadlock, a lost connection)
/// is counted and the writer goes on; nothing of it was written.
pub async fn run(
    records: Records,
    settings: LoadSettings,
    stats: Arc<LoadStats>,
    stop: Arc<AtomicBool>,
) {
    let mut tasks = Vec::with_capacity(settings.writers);
    for i in 0..settings.writers {
        let writer = Writer {
            records: records.clone(),
            actor: format!("writer-{i}"),
            rng: StdRng::seed_from_u64(settings.seed.wrapping_add(i as u64)),
            mix: settings.mix,
            own: Vec::new(),
            links: Vec::new(),
        };
        let per_writer = (settings.rate > 0)
            .then(|| Duration::from_secs_f64(settings.writers as f64 / f64::from(settings.rate)));
        tasks.push(tokio::spawn(writer.run(
            per_writer,
            stats.clone(),
            stop.clone(),
        )));
    }
    for t in tasks {
        if let Err(e) = t.await {
            tracing::error!(error = %e, "a writer task failed");
        }
    }
}

/// A record of the writer's own and how many links it has (from or to it).
#[derive(Debug)]
struct Owned {
    id: Uuid,
    links: u32,
}

#[derive(Debug)]
struct Link {
    id: Uuid,
    from: Uuid,
    to: Uuid,
}

struct Writer {
    records: Records,
    actor: String,
    rng: StdRng,
    mix: Mix,
    own: Vec<Owned>,
    links: Vec<Link>,
}

const KINDS: [&str; 4] = ["account", "contact", "deal", "ticket"];
const STATUSES: [&str; 4] = ["new", "open", "won", "closed"];

impl Writer {
    async fn run(mut self, pace: Option<Duration>, stats: Arc<LoadStats>, stop: Arc<AtomicBool>) {
        let mut tick = pace.map(|p| {
            let mut i = tokio::time::interval(p);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        while !stop.load(Ordering::Relaxed) {
            if let Some(t) = tick.as_mut() {
                t.tick().await;
            }
            match self.step().await {
                Ok((action, event, undeclared_only)) => {
                    stats.count(action, event);
                    if undeclared_only {
                        stats.undeclared_only.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(e) => {
                    stats.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(writer = %self.actor, error = %e, "transaction rolled back");
                }
            }
        }
    }

    /// One transaction of the mix: what it was, whether it wrote an event, and whether it was
    /// an update of undeclared fields only.
    async fn step(&mut self) -> Result<(Action, bool, bool), RecordsError> {
        let m = self.mix;
        let total = m.create + m.update_declared + m.update_notes + m.link + m.unlink + m.delete;
        let mut pick = self.rng.random_range(0..total.max(1));
        let mut next = |share: u32| {
            let hit = pick < share;
            pick = pick.saturating_sub(share);
            hit
        };
        let (create, declared, notes, link, unlink) = (
            next(m.create),
            next(m.update_declared),
            next(m.update_notes),
            next(m.link),
            next(m.unlink),
        );
        if self.own.len() < 2 || create {
            return self.create().await;
        }
        let i = self.rng.random_range(0..self.own.len());
        let id = self.own[i].id;
        if declared || notes {
            let change = if declared {
                if self.rng.random_bool(0.5) {
                    RecordChange {
                        title: Some(format!("title {}", self.rng.random_range(0..1_000_000))),
                        ..RecordChange::default()
                    }
                } else {
                    RecordChange {
                        status: Some(STATUSES[self.rng.random_range(0..STATUSES.len())].to_owned()),
                        notes: Some(self.note()),
                        ..RecordChange::default()
                    }
                }
            } else {
                RecordChange {
                    notes: Some(self.note()),
                    ..RecordChange::default()
                }
            };
            let done = self.records.update(&self.actor, id, change).await?;
            let event = done.event_id.is_some();
            return Ok((Action::RecordUpdate, event, !event));
        }
        if link {
            let j = self.rng.random_range(0..self.own.len());
            let to = self.own[j].id;
            let done = self.records.link(&self.actor, id, to, "relates-to").await?;
            self.own[i].links += 1;
            self.own[j].links += 1;
            self.links.push(Link {
                id: done.target_id,
                from: id,
                to,
            });
            return Ok((Action::LinkCreate, done.event_id.is_some(), false));
        }
        if unlink && !self.links.is_empty() {
            let k = self.rng.random_range(0..self.links.len());
            let gone = self.links.swap_remove(k);
            let done = self.records.unlink(&self.actor, gone.id).await?;
            for o in self
                .own
                .iter_mut()
                .filter(|o| o.id == gone.from || o.id == gone.to)
            {
                o.links = o
                    .links
                    .saturating_sub(if gone.from == gone.to { 2 } else { 1 });
            }
            return Ok((Action::LinkDelete, done.event_id.is_some(), false));
        }
        match self.own.iter().position(|o| o.links == 0) {
            Some(free) => {
                let gone = self.own.swap_remove(free);
                let done = self.records.delete(&self.actor, gone.id).await?;
                Ok((Action::RecordDelete, done.event_id.is_some(), false))
            }
            None => self.create().await,
        }
    }

    async fn create(&mut self) -> Result<(Action, bool, bool), RecordsError> {
        let new = NewRecord {
            kind: KINDS[self.rng.random_range(0..KINDS.len())].to_owned(),
            title: format!("title {}", self.rng.random_range(0..1_000_000)),
            status: STATUSES[0].to_owned(),
            notes: self.note(),
        };
        let done = self.records.create(&self.actor, new).await?;
        self.own.push(Owned {
            id: done.target_id,
            links: 0,
        });
        Ok((Action::RecordCreate, done.event_id.is_some(), false))
    }

    fn note(&mut self) -> String {
        format!("note {}", self.rng.random_range(0..1_000_000_000u64))
    }
}
