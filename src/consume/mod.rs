//! Consumer helpers: process each event of an Outpost stream once, in order per aggregate,
//! inside the consumer's own database transaction.
//!
//! Delivery from Outpost is at least once. [`Consumer`] turns that into exactly-once effects:
//!
//! 1. It reads the stream as a member of a consumer group (created from the start of the stream
//!    when missing, never silently from `$`).
//! 2. For each entry it opens a transaction on the consumer's database, locks the group's
//!    position in the entry's aggregate and checks it: an event already applied (in the inbox, or
//!    at or below the position) is skipped; an event ahead of a gap is held back and tried again;
//!    only the aggregate's next event goes to the [`Handler`].
//! 3. The handler writes its effects through that transaction; the helper adds the event id to
//!    the inbox and moves the position, commits, and only then acknowledges the entry (`XACK`).
//!    A crash anywhere before the acknowledgement delivers the entry again, and the inbox skips
//!    it.
//!
//! Aggregates are processed in parallel (up to `concurrency` at a time), each one's events one
//! after the other in sequence order. An event ahead of a gap is held and released as soon as
//! the group's position reaches it. Members keep a liveness key; the entries left pending by a
//! member that died are taken over after `member_timeout`, and entries pending at a member that
//! is alive but stuck are reclaimed after `claim_idle`. A handler failure is retried with back-off until the group has delivered
//! the entry `max_deliveries` times (or at once, for a permanent failure); then the entry goes to
//! the dead-letter stream with the error and its original fields, the aggregate moves on, and
//! the entry is acknowledged. Entries that leave the stream (trimming) before the group
//! processed them are counted as lost, never as success.
//!
//! Anyone who can `XADD` to the stream can write any entry, so nothing about one is trusted:
//! fields are read as bytes; an entry whose identity does not decode, or whose sequence is more
//! than `max_seq_ahead` past the group's position, goes to the dead-letter stream without moving
//! the position; one whose identity is sound but whose rest is not goes there in its
//! aggregate's order, and the aggregate moves past it. No entry fails a read, a claim or a
//! round. The inbox is keyed by aggregate as well as event id, so an id reused by another
//! aggregate is not a duplicate. `docs/consumers.md` is the guide.

mod apply;
mod delivery;
mod error;
mod handler;
pub(crate) mod stream;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use sea_orm::DatabaseConnection;
use tokio::time::Instant;

pub use delivery::{Delivery, NotAnEvent};
pub use error::ConsumeError;
pub use handler::{Handler, HandlerError};

use apply::{Applier, Outcome};
use stream::{GroupStream, RawEntry};

use crate::metrics as m;
pub use crate::publish::Topology;
use metrics::{counter, gauge};

/// Where a new consumer group starts reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StartFrom {
    /// From the first entry still in the stream (the default: nothing is skipped).
    #[default]
    Beginning,
    /// Only entries added after the group is created. Chosen explicitly, never by default.
    Latest,
}

/// How strictly per-aggregate order is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OrderMode {
    /// Apply only the aggregate's next sequence; hold an event that arrives after a gap until
    /// the missing one is applied (the default). Right when the stream carries every event of
    /// its aggregates.
    #[default]
    Strict,
    /// Apply any sequence above the last applied one, never a lower one. For streams that carry
    /// only some of an aggregate's event types (routing sends the others elsewhere), where gaps
    /// are expected.
    Monotonic,
}

/// Settings of a [`Consumer`]. Start from [`ConsumerSettings::new`] and change what you need.
#[derive(Clone)]
pub struct ConsumerSettings {
    /// `redis://` URL. Never logged.
    pub redis_url: String,
    /// Prefix of the helper's own keys (its loss count), as `redis.key_prefix` for the relay.
    pub key_prefix: String,
    /// The stream's full key.
    pub stream: String,
    /// The consumer group; also the inbox's and positions' key in the database.
    pub group: String,
    /// This member's name within the group. Give a restarted member the same name to have it
    /// pick up its own pending entries at once; otherwise they are reclaimed after `claim_idle`.
    pub consumer: String,
    /// Where a group created by this helper starts.
    pub start: StartFrom,
    /// Entries read per round (1..=10,000).
    pub batch: usize,
    /// Aggregates processed at the same time (1..=1,024); each holds a database connection
    /// while its handler runs.
    pub concurrency: usize,
    /// Longest wait for new entries when idle.
    pub block: Duration,
    /// Entries pending this long at a member are taken over by another (`XAUTOCLAIM`).
    pub claim_idle: Duration,
    /// How often to look for such entries.
    pub claim_interval: Duration,
    /// Deliveries after which a failing entry goes to the dead-letter stream (≥ 1).
    pub max_deliveries: u32,
    /// First back-off after a failure worth retrying; doubles per delivery, with jitter, up to
    /// `claim_idle`.
    pub retry_backoff: Duration,
    /// How per-aggregate order is enforced.
    pub order: OrderMode,
    /// How far past the group's position in its aggregate an event's sequence may be (≥ 1). An
    /// event further ahead is taken for forged or corrupt: it goes to the dead-letter stream at
    /// once and the position does not move. (In monotonic order the first event the group sees
    /// of an aggregate is not bounded: it may be anywhere in the aggregate's history.)
    pub max_seq_ahead: i64,
    /// How often an event held ahead of a gap is claimed again by its member, so that no other
    /// member reclaims it (a delivery is counted once per `claim_idle` of holding; held for
    /// `claim_idle` after its `max_deliveries`-th delivery, it goes to the dead-letter stream as
    /// a gap). Held events are released as soon as their gap fills. Shorter than `claim_idle`.
    pub order_wait: Duration,
    /// A member that has not renewed its liveness key for this long (it renews every third of
    /// it) and has not read or claimed meanwhile is dead: its pending entries are taken over by
    /// the others at once, oldest first, instead of after `claim_idle`. Shorter than
    /// `claim_idle`; at least 300 ms.
    pub member_timeout: Duration,
    /// The dead-letter stream (default: the stream's key followed by `:dead`).
    pub dead_letter: Option<String>,
    /// Redis connect timeout.
    pub connect_timeout: Duration,
    /// Redis per-request timeout (blocking waits add `block` to it).
    pub response_timeout: Duration,
    /// A single Redis or a Redis Cluster (`redis_url` then names one of its nodes).
    pub topology: Topology,
    /// Acknowledge before committing: deliberately wrong, kept only so the tests can show that
    /// their checker catches the loss it causes.
    #[cfg(feature = "failpoints")]
    #[doc(hidden)]
    pub ack_before_commit: bool,
}

impl std::fmt::Debug for ConsumerSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerSettings")
            .field("redis_url", &"<redacted>")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("start", &self.start)
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .field("claim_idle", &self.claim_idle)
            .field("max_deliveries", &self.max_deliveries)
            .field("order", &self.order)
            .field("max_seq_ahead", &self.max_seq_ahead)
            .field("order_wait", &self.order_wait)
            .field("member_timeout", &self.member_timeout)
            .finish_non_exhaustive()
    }
}

impl ConsumerSettings {
    /// Defaults for reading `stream` as a member of `group`, named after this host and process.
    pub fn new(
        redis_url: impl Into<String>,
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        Self {
            redis_url: redis_url.into(),
            key_prefix: String::new(),
            stream: stream.into(),
            group: group.into(),
            consumer: default_consumer_name(),
            start: StartFrom::Beginning,
            batch: 100,
            concurrency: 16,
            block: Duration::from_secs(2),
            claim_idle: Duration::from_secs(30),
            claim_interval: Duration::from_secs(5),
            max_deliveries: 5,
            retry_backoff: Duration::from_millis(500),
            order: OrderMode::Strict,
            max_seq_ahead: 1_000_000,
            order_wait: Duration::from_secs(5),
            member_timeout: Duration::from_secs(1),
            dead_letter: None,
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(5),
            topology: Topology::Single,
            #[cfg(feature = "failpoints")]
            ack_before_commit: false,
        }
    }

    /// The dead-letter stream's key.
    pub fn dead_letter_stream(&self) -> String {
        self.dead_letter
            .clone()
            .unwrap_or_else(|| format!("{}:dead", self.stream))
    }

    /// Checks every setting; the error names the first one out of range and what is allowed.
    pub fn validate(&self) -> Result<(), ConsumeError> {
        let bad = |m: String| Err(ConsumeError::Settings(m));
        for (name, v) in [
            ("stream", &self.stream),
            ("group", &self.group),
            ("consumer", &self.consumer),
        ] {
            if v.is_empty() || v.chars().any(|c| c.is_control() || c.is_whitespace()) {
                return bad(format!(
                    "{name} {v:?} must be non-empty, without spaces or control characters"
                ));
            }
        }
        if !(1..=10_000).contains(&self.batch) {
            return bad(format!("batch is {}; allowed 1..=10000", self.batch));
        }
        if !(1..=1024).contains(&self.concurrency) {
            return bad(format!(
                "concurrency is {}; allowed 1..=1024",
                self.concurrency
            ));
        }
        if self.max_deliveries == 0 {
            return bad("max_deliveries is 0; at least 1 is needed".into());
        }
        if self.max_seq_ahead < 1 {
            return bad(format!(
                "max_seq_ahead is {}; at least 1 (the next sequence must be accepted)",
                self.max_seq_ahead
            ));
        }
        if self.block < Duration::from_millis(10) {
            return bad(format!("block is {:?}; at least 10 ms", self.block));
        }
        if self.claim_idle < Duration::from_secs(1) {
            return bad(format!("claim_idle is {:?}; at least 1 s", self.claim_idle));
        }
        if self.order_wait >= self.claim_idle {
            return bad(format!(
                "order_wait ({:?}) must be shorter than claim_idle ({:?}), or held entries would \
                 be reclaimed while still held",
                self.order_wait, self.claim_idle
            ));
        }
        if self.member_timeout < Duration::from_millis(300) {
            return bad(format!(
                "member_timeout is {:?}; at least 300 ms (members renew their liveness every \
                 third of it)",
                self.member_timeout
            ));
        }
        if self.member_timeout >= self.claim_idle {
            return bad(format!(
                "member_timeout ({:?}) must be shorter than claim_idle ({:?}): a dead member's \
                 entries are taken over after member_timeout, and claim_idle is only the \
                 fallback for a member that is alive but stuck; shorten member_timeout or \
                 lengthen claim_idle",
                self.member_timeout, self.claim_idle
            ));
        }
        if self.dead_letter_stream() == self.stream {
            return bad("dead_letter must not be the stream itself".into());
        }
        Ok(())
    }
}

fn default_consumer_name() -> String {
    let host: String = crate::health::hostname()
        .chars()
        .filter(|c| !c.is_whitespace() && !c.is_control())
        .collect();
    format!("{host}-{}", std::process::id())
}

/// Counts of what a consumer did (also exported as metrics, labelled by group).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Events applied by the handler.
    pub processed: u64,
    /// Deliveries skipped because the group had applied the event already.
    pub duplicates: u64,
    /// Deliveries held back behind a missing earlier event of their aggregate.
    pub held: u64,
    /// Handler attempts that asked to be retried (and infrastructure failures).
    pub retries: u64,
    /// Entries reclaimed from idle members (pending longer than `claim_idle`).
    pub reclaimed: u64,
    /// Entries taken over from dead members (after `member_timeout`).
    pub taken_over: u64,
    /// Held entries released because their gap filled.
    pub released: u64,
    /// Entries moved to the dead-letter stream.
    pub dead_lettered: u64,
    /// Entries that left the stream before the group processed them.
    pub lost: u64,
}

/// How often a member holding entries ahead of a gap reads the group's positions in their
/// aggregates (one statement for all of them) to release those whose gap filled.
const HOLD_POLL: Duration = Duration::from_millis(20);

/// When a held entry was last claimed again (its idle time reset) and last counted a delivery.
#[derive(Debug, Clone, Copy)]
struct Hold {
    renewed: Instant,
    counted: Instant,
}

/// An entry kept for another try.
struct Later {
    delivery: Delivery,
    due: Instant,
    /// A handler failure: claimed again (counting a delivery) before the next try.
    reclaim: bool,
}

/// A member of a consumer group applying a stream's events through a [`Handler`].
pub struct Consumer<H> {
    settings: ConsumerSettings,
    stream: Arc<GroupStream>,
    applier: Arc<Applier<H>>,
    later: Vec<Later>,
    /// Entries held ahead of a gap, released when the group's position reaches them.
    held: Vec<Delivery>,
    /// When each held entry (by stream id) was last renewed and last counted a delivery.
    holds: HashMap<String, Hold>,
    /// When to read the positions of the held entries' aggregates next.
    next_hold_check: Instant,
    claim_cursor: String,
    next_claim: Instant,
    /// When to look for dead members next.
    next_dead_check: Instant,
    /// Renews this member's liveness key; stops when the consumer is dropped.
    _heartbeat: AbortOnDrop<()>,
    last_id: String,
    stats: ConsumerStats,
}

impl<H> std::fmt::Debug for Consumer<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("settings", &self.settings)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<H: Handler> Consumer<H> {
    /// Connects to Redis and creates the group when it does not exist. `db` is the consumer's
    /// database, migrated with `outpost migrate up` (it needs `outpost_inbox` and
    /// `outpost_consumer_position`).
    pub async fn connect(
        settings: ConsumerSettings,
        db: DatabaseConnection,
        handler: H,
    ) -> Result<Self, ConsumeError> {
        settings.validate()?;
        let stream = Arc::new(GroupStream::connect(&settings).await?);
        let heartbeat = {
            let (stream, ttl) = (stream.clone(), settings.member_timeout);
            AbortOnDrop(tokio::spawn(async move {
                loop {
                    if let Err(e) = stream.heartbeat(ttl).await {
                        tracing::warn!(error = %e, "could not renew this member's liveness key");
                    }
                    tokio::time::sleep(ttl / 3).await;
                }
            }))
        };
        let consumer = Self {
            applier: Arc::new(Applier {
                db,
                handler: Arc::new(handler),
                stream: stream.clone(),
                group: settings.group.clone(),
                order: settings.order,
                max_deliveries: settings.max_deliveries,
                max_seq_ahead: settings.max_seq_ahead,
                #[cfg(feature = "failpoints")]
                ack_before_commit: settings.ack_before_commit,
            }),
            stream,
            later: Vec::new(),
            held: Vec::new(),
            holds: HashMap::new(),
            next_hold_check: Instant::now(),
            claim_cursor: "0-0".to_owned(),
            next_claim: Instant::now(),
            next_dead_check: Instant::now(),
            _heartbeat: heartbeat,
            last_id: "0-0".to_owned(),
            stats: ConsumerStats::default(),
            settings,
        };
        consumer.ensure_group().await?;
        Ok(consumer)
    }

    async fn ensure_group(&self) -> Result<(), ConsumeError> {
        let s = &self.settings;
        let state = self.stream.ensure_group(s.start).await?;
        if state.created {
            tracing::info!(stream = %s.stream, group = %s.group, start = ?s.start, "consumer group created");
            if state.gone > 0 && s.start == StartFrom::Beginning {
                tracing::warn!(
                    stream = %s.stream, group = %s.group, trimmed = state.gone,
                    "the stream had lost its first entries before this group existed; they are \
                     not counted as lost for the group"
                );
            }
        } else if !state.counted {
            tracing::warn!(
                stream = %s.stream, group = %s.group,
                "this group was created without Outpost's helper: entries lost before now cannot \
                 be counted"
            );
        }
        Ok(())
    }

    /// What this consumer has done so far.
    pub fn stats(&self) -> ConsumerStats {
        self.stats
    }

    /// The group's count of lost entries, by every member.
    pub async fn lost_total(&self) -> Result<u64, ConsumeError> {
        self.stream.lost_total().await
    }

    /// Runs until `shutdown` completes, then finishes the round in flight (its commits and
    /// acknowledgements), deletes its liveness key (the others take its pending entries once it
    /// has been quiet for `member_timeout`) and returns what it did. Redis or database outages are waited out; only a fault point
    /// (tests) ends it early with an error.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, ConsumeError> {
        let stream = self.stream.clone();
        // `run` consumes the consumer: its heartbeat has stopped when the key is deleted.
        let result = self.run(shutdown).await;
        if result.is_ok()
            && let Err(e) = stream.leave().await
        {
            tracing::warn!(error = %e, "could not delete this member's liveness key");
        }
        result
    }

    async fn run(
        mut self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, ConsumeError> {
        tokio::pin!(shutdown);
        let mut backoff = Duration::from_millis(100);
        // Entries this member name left pending in an earlier run go first. Should that fail,
        // they stay pending and come back with a reclaim.
        let own = async {
            let own = self.stream.own_pending(self.settings.batch).await?;
            if !own.is_empty() {
                tracing::info!(
                    entries = own.len(),
                    "picking up this member's pending entries"
                );
                let deliveries = self.decode(own).await?;
                self.process_deliveries(deliveries).await?;
            }
            Ok::<_, ConsumeError>(())
        };
        match own.await {
            Ok(()) => {}
            Err(ConsumeError::Fault(point)) => return Err(ConsumeError::Fault(point)),
            Err(e) => tracing::warn!(error = %e, "could not process this member's pending entries"),
        }
        loop {
            if futures::poll!(&mut shutdown).is_ready() {
                return Ok(self.stats);
            }
            match self.round().await {
                Ok(true) => backoff = Duration::from_millis(100),
                Ok(false) => {
                    let wait = self.idle_wait();
                    tokio::select! {
                        () = &mut shutdown => return Ok(self.stats),
                        r = self.stream.wait_for_new(&self.last_id, wait) => {
                            if let Err(e) = r {
                                tracing::warn!(error = %e, "waiting for new entries failed");
                                tokio::time::sleep(backoff).await;
                            }
                        }
                    }
                }
                Err(ConsumeError::Fault(point)) => return Err(ConsumeError::Fault(point)),
                Err(ConsumeError::NoGroup) => {
                    tracing::warn!(stream = %self.settings.stream, group = %self.settings.group,
                        "the stream or the group is gone (was Redis restarted empty?); creating it again");
                    if let Err(e) = self.ensure_group().await {
                        tracing::warn!(error = %e, "could not create the group; retrying");
                        tokio::time::sleep(backoff).await;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, wait = ?backoff, "consumer round failed; backing off");
                    tokio::select! {
                        () = &mut shutdown => return Ok(self.stats),
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// How long an idle consumer may block: until the next entry kept for later is due, the
    /// next reclaim pass, or `block`.
    fn idle_wait(&self) -> Duration {
        let now = Instant::now();
        let mut until = (now + self.settings.block)
            .min(self.next_claim)
            .min(self.next_dead_check);
        if let Some(due) = self.later.iter().map(|l| l.due).min() {
            until = until.min(due);
        }
        if !self.held.is_empty() {
            until = until.min(self.next_hold_check);
            if let Some(renewed) = self.holds.values().map(|h| h.renewed).min() {
                until = until.min(renewed + self.settings.order_wait);
            }
        }
        until
            .saturating_duration_since(now)
            .max(Duration::from_millis(10))
    }

    /// One round: entries due again, held entries whose gap filled, entries of dead members,
    /// reclaimed ones and new ones, processed and acknowledged. Returns whether there was
    /// anything to do.
    pub async fn round(&mut self) -> Result<bool, ConsumeError> {
        let now = Instant::now();
        let mut batch: Vec<RawEntry> = Vec::new();
        let mut ready: Vec<Delivery> = Vec::new();
        let mut reclaim_ids = Vec::new();
        let mut kept = Vec::new();
        for l in std::mem::take(&mut self.later) {
            if l.due > now {
                kept.push(l);
            } else if l.reclaim {
                reclaim_ids.push(l.delivery.stream_id);
            } else {
                ready.push(l.delivery);
            }
        }
        self.later = kept;
        if !reclaim_ids.is_empty() {
            match self.stream.claim(&reclaim_ids).await {
                Ok(entries) => batch.extend(entries),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "could not claim entries to retry; they stay pending and are reclaimed later"
                    );
                }
            }
        }
        let mut give_up = Vec::new();
        if !self.held.is_empty() {
            let (released, expired) = self.release_held(now).await;
            ready.extend(released);
            give_up = self.renew_expired(expired).await;
        }
        if now >= self.next_dead_check {
            self.next_dead_check = now + self.settings.member_timeout / 3;
            let taken = self.take_over_dead().await?;
            if !taken.is_empty() {
                self.forget_local(&taken, &mut ready);
                batch.extend(taken);
            }
        }
        if now >= self.next_claim {
            self.next_claim = now + self.settings.claim_interval;
            let (next, entries, lost) = self
                .stream
                .reclaim(
                    &self.claim_cursor,
                    self.settings.claim_idle,
                    self.settings.batch,
                )
                .await?;
            self.claim_cursor = next;
            self.count_lost(
                lost,
                "pending entries left the stream before they were processed",
            );
            if !entries.is_empty() {
                self.stats.reclaimed += entries.len() as u64;
                counter!(m::CONSUMER_RECLAIMED, "group" => self.settings.group.clone())
                    .increment(entries.len() as u64);
                self.forget_local(&entries, &mut ready);
                batch.extend(entries);
            }
        }
        let room = self
            .settings
            .batch
            .saturating_sub(batch.len() + ready.len());
        // Entries kept in memory are bounded: with too many waiting, read nothing new.
        if room > 0 && self.later.len() + self.held.len() < self.settings.batch * 10 {
            let read = self.stream.read_new(room).await?;
            if read.no_group {
                return Err(ConsumeError::NoGroup);
            }
            self.last_id = read.last_id;
            self.count_lost(
                read.lost,
                "entries left the stream before the group read them",
            );
            gauge!(m::CONSUMER_LAG, "group" => self.settings.group.clone()).set(read.lag as f64);
            batch.extend(read.entries);
        }
        if batch.is_empty() && ready.is_empty() && give_up.is_empty() {
            return Ok(false);
        }
        if !give_up.is_empty() {
            self.give_up_on_gaps(give_up).await?;
        }
        let mut deliveries = ready;
        deliveries.extend(self.decode(batch).await?);
        self.process_deliveries(deliveries).await?;
        Ok(true)
    }

    /// Drops from memory what was just claimed afresh (it comes back with `entries`).
    fn forget_local(&mut self, entries: &[RawEntry], ready: &mut Vec<Delivery>) {
        let ids: HashSet<&str> = entries.iter().map(|e| e.id.as_str()).collect();
        self.later
            .retain(|l| !ids.contains(l.delivery.stream_id.as_str()));
        self.held.retain(|d| !ids.contains(d.stream_id.as_str()));
        ready.retain(|d| !ids.contains(d.stream_id.as_str()));
    }

    /// Reads the group's positions in the held entries' aggregates (at most every
    /// [`HOLD_POLL`], or at once after this member applied something) and takes out the held
    /// entries whose gap filled. Also takes out those held for `order_wait` (second list).
    async fn release_held(&mut self, now: Instant) -> (Vec<Delivery>, Vec<Delivery>) {
        let mut released = Vec::new();
        if now >= self.next_hold_check {
            self.next_hold_check = now + HOLD_POLL;
            let aggregates: BTreeSet<(&str, &str)> = self
                .held
                .iter()
                .map(|d| (d.aggregate_type.as_str(), d.aggregate_id.as_str()))
                .collect();
            let aggregates: Vec<(&str, &str)> = aggregates.into_iter().collect();
            match self.applier.positions(&aggregates).await {
                Ok(rows) => {
                    let at: HashMap<(String, String), i64> =
                        rows.into_iter().map(|(t, i, s)| ((t, i), s)).collect();
                    // Of each aggregate, the held entries at or below the position (a
                    // duplicate, or a rewound history: `process` decides) go, and the run of
                    // consecutive sequences from the one right after it, as one chain; the
                    // entries beyond the next gap stay held.
                    let mut reach: HashMap<(String, String), i64> = at
                        .into_iter()
                        .map(|(k, last)| (k, last.saturating_add(1)))
                        .collect();
                    let mut held = std::mem::take(&mut self.held);
                    held.sort_by_key(|d| d.aggregate_seq);
                    for d in held {
                        let key = (d.aggregate_type.clone(), d.aggregate_id.clone());
                        match reach.get_mut(&key) {
                            Some(next) if d.aggregate_seq <= *next => {
                                if d.aggregate_seq == *next {
                                    *next = next.saturating_add(1);
                                }
                                released.push(d);
                            }
                            _ => self.held.push(d),
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the positions of held entries");
                }
            }
        }
        if !released.is_empty() {
            self.stats.released += released.len() as u64;
            counter!(m::CONSUMER_RELEASED, "group" => self.settings.group.clone())
                .increment(released.len() as u64);
        }
        let wait = self.settings.order_wait;
        let holds = &self.holds;
        let (expired, stay): (Vec<Delivery>, Vec<Delivery>) =
            std::mem::take(&mut self.held).into_iter().partition(|d| {
                holds
                    .get(&d.stream_id)
                    .is_some_and(|h| now >= h.renewed + wait)
            });
        self.held = stay;
        (released, expired)
    }

    /// Held entries whose hold ran out (`order_wait`): claimed again by this member, which
    /// resets their idle time so no other member reclaims them, and held again. The claim
    /// counts a delivery only once the entry has been held for `claim_idle` since it last
    /// counted one (as a reclaim would have); an entry due to count one that has already been
    /// delivered `max_deliveries` times is returned instead, to be given up on.
    async fn renew_expired(&mut self, expired: Vec<Delivery>) -> Vec<Delivery> {
        let now = Instant::now();
        let claim_idle = self.settings.claim_idle;
        let mut give_up = Vec::new();
        let (mut count, mut touch) = (Vec::new(), Vec::new());
        for d in expired {
            let due = self
                .holds
                .get(&d.stream_id)
                .is_none_or(|h| now >= h.counted + claim_idle);
            if !due {
                touch.push(d);
            } else if d.deliveries >= self.settings.max_deliveries {
                give_up.push(d);
            } else {
                count.push(d);
            }
        }
        if !count.is_empty() {
            let ids: Vec<String> = count.iter().map(|d| d.stream_id.clone()).collect();
            let counts = match self.stream.claim(&ids).await {
                Ok(entries) => Some(
                    entries
                        .into_iter()
                        .map(|e| (e.id, e.deliveries))
                        .collect::<HashMap<_, _>>(),
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "could not claim held entries again; holding them on");
                    None
                }
            };
            for mut d in count {
                match counts.as_ref().map(|c| c.get(&d.stream_id)) {
                    // Acknowledged meanwhile (another member applied a copy): done.
                    Some(None) => {
                        self.holds.remove(&d.stream_id);
                    }
                    Some(Some(n)) => {
                        d.deliveries = *n;
                        self.holds.insert(
                            d.stream_id.clone(),
                            Hold {
                                renewed: now,
                                counted: now,
                            },
                        );
                        self.held.push(d);
                    }
                    None => {
                        if let Some(h) = self.holds.get_mut(&d.stream_id) {
                            h.renewed = now;
                        }
                        self.held.push(d);
                    }
                }
            }
        }
        if !touch.is_empty() {
            let ids: Vec<String> = touch.iter().map(|d| d.stream_id.clone()).collect();
            let still = match self.stream.touch(&ids).await {
                Ok(still) => Some(still.into_iter().collect::<HashSet<String>>()),
                Err(e) => {
                    tracing::warn!(error = %e, "could not renew held entries; holding them on");
                    None
                }
            };
            for d in touch {
                if still.as_ref().is_some_and(|s| !s.contains(&d.stream_id)) {
                    self.holds.remove(&d.stream_id);
                    continue;
                }
                if let Some(h) = self.holds.get_mut(&d.stream_id) {
                    h.renewed = now;
                }
                self.held.push(d);
            }
        }
        give_up
    }

    /// Processes entries held for `claim_idle` after their last allowed delivery: still ahead
    /// of a gap, they go to the dead-letter stream; otherwise they are applied.
    async fn give_up_on_gaps(&mut self, entries: Vec<Delivery>) -> Result<(), ConsumeError> {
        let mut acks = Vec::new();
        for d in entries {
            let outcome = self.applier.process(&d, true).await;
            self.settle(d, outcome, &mut acks)?;
        }
        self.stream.ack(&acks).await
    }

    /// Takes over the pending entries of dead members, oldest first, up to a batch.
    async fn take_over_dead(&mut self) -> Result<Vec<RawEntry>, ConsumeError> {
        let timeout = self.settings.member_timeout;
        let mut taken = Vec::new();
        for dead in self.stream.dead_members(timeout).await? {
            let room = self.settings.batch.saturating_sub(taken.len());
            if room == 0 {
                // More next round.
                self.next_dead_check = Instant::now();
                break;
            }
            let (entries, lost) = self.stream.take_over(&dead, timeout, room).await?;
            self.count_lost(
                lost,
                "pending entries of a dead member left the stream before they were processed",
            );
            if !entries.is_empty() {
                tracing::info!(
                    member = %dead, entries = entries.len(),
                    "took over the pending entries of a dead member"
                );
            }
            taken.extend(entries);
        }
        if taken.len() >= self.settings.batch {
            self.next_dead_check = Instant::now();
        }
        if !taken.is_empty() {
            self.stats.taken_over += taken.len() as u64;
            counter!(m::CONSUMER_TAKEN_OVER, "group" => self.settings.group.clone())
                .increment(taken.len() as u64);
        }
        Ok(taken)
    }

    /// Decodes entries; one that is not an Outpost event goes to the dead-letter stream at once.
    async fn decode(&mut self, entries: Vec<RawEntry>) -> Result<Vec<Delivery>, ConsumeError> {
        let mut deliveries = Vec::with_capacity(entries.len());
        for e in entries {
            match Delivery::decode(e.id, e.fields, e.deliveries) {
                Ok(d) => deliveries.push(d),
                Err(bad) => {
                    if self.dead_letter_foreign(&bad).await == Outcome::DeadLettered {
                        self.stream
                            .ack(std::slice::from_ref(&bad.stream_id))
                            .await?;
                    }
                }
            }
        }
        Ok(deliveries)
    }

    async fn dead_letter_foreign(&mut self, bad: &NotAnEvent) -> Outcome {
        tracing::warn!(stream_id = %bad.stream_id, reason = %bad.reason,
            "entry is not an Outpost event; moving it to the dead-letter stream");
        match self
            .stream
            .dead_letter(&bad.stream_id, &bad.raw, &bad.to_string(), 1)
            .await
        {
            Ok(_) => {
                self.note(&Outcome::DeadLettered);
                Outcome::DeadLettered
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not write to the dead-letter stream");
                Outcome::Retry {
                    reason: e.to_string(),
                    counted: false,
                }
            }
        }
    }

    /// Processes deliveries: aggregates in parallel, each one's in sequence order; then
    /// acknowledges what is done and keeps the rest for later.
    async fn process_deliveries(&mut self, deliveries: Vec<Delivery>) -> Result<(), ConsumeError> {
        let chains = chains(deliveries);
        let applier = self.applier.clone();
        let results: Vec<Vec<(Delivery, Outcome)>> = futures::stream::iter(chains)
            .map(|chain| {
                let applier = applier.clone();
                let ids: Vec<Delivery> = chain.clone();
                async move {
                    // Aborted when this future is dropped (the consumer dropped mid-round, as a
                    // process killed): a chain never runs on detached from its member.
                    match AbortOnDrop(tokio::spawn(run_chain(applier, chain))).await {
                        Ok(done) => done,
                        // Processing itself failed (not the handler, whose panics are caught):
                        // every entry of the chain is tried again.
                        Err(e) => ids
                            .into_iter()
                            .map(|d| {
                                let reason = format!("processing failed: {e}");
                                (
                                    d,
                                    Outcome::Retry {
                                        reason,
                                        counted: false,
                                    },
                                )
                            })
                            .collect(),
                    }
                }
            })
            .buffer_unordered(self.settings.concurrency)
            .collect()
            .await;
        let mut acks = Vec::new();
        let mut moved = false;
        for (d, outcome) in results.into_iter().flatten() {
            moved |= matches!(outcome, Outcome::Applied | Outcome::DeadLettered);
            self.settle(d, outcome, &mut acks)?;
        }
        if moved && !self.held.is_empty() {
            // A gap this member held entries behind may have just filled.
            self.next_hold_check = Instant::now();
        }
        self.stream.ack(&acks).await
    }

    /// Records what became of `d`: to acknowledge, to hold, or to retry later.
    fn settle(
        &mut self,
        d: Delivery,
        outcome: Outcome,
        acks: &mut Vec<String>,
    ) -> Result<(), ConsumeError> {
        let now = Instant::now();
        self.note(&outcome);
        if !matches!(outcome, Outcome::Held { .. }) {
            self.holds.remove(&d.stream_id);
        }
        match outcome {
            Outcome::Applied | Outcome::Duplicate | Outcome::DeadLettered => {
                acks.push(d.stream_id);
            }
            Outcome::Held { .. } => {
                self.holds.entry(d.stream_id.clone()).or_insert(Hold {
                    renewed: now,
                    counted: now,
                });
                self.held.push(d);
            }
            Outcome::Retry { reason, counted } => {
                let wait = retry_wait(self.settings.retry_backoff, d.deliveries)
                    .min(self.settings.claim_idle);
                tracing::debug!(stream_id = %d.stream_id, %reason, ?wait, "retrying later");
                self.later.push(Later {
                    delivery: d,
                    due: now + wait,
                    reclaim: counted,
                });
            }
            Outcome::Killed(point) => return Err(ConsumeError::Fault(point)),
        }
        Ok(())
    }

    fn note(&mut self, outcome: &Outcome) {
        let group = self.settings.group.clone();
        let (stat, name) = match outcome {
            Outcome::Applied => (&mut self.stats.processed, m::CONSUMER_PROCESSED),
            Outcome::Duplicate => (&mut self.stats.duplicates, m::CONSUMER_DUPLICATES),
            Outcome::Held { .. } => (&mut self.stats.held, m::CONSUMER_HELD),
            Outcome::Retry { .. } => (&mut self.stats.retries, m::CONSUMER_RETRIES),
            Outcome::DeadLettered => (&mut self.stats.dead_lettered, m::CONSUMER_DEAD_LETTERED),
            Outcome::Killed(_) => return,
        };
        *stat += 1;
        counter!(name, "group" => group).increment(1);
    }

    fn count_lost(&mut self, lost: u64, what: &str) {
        if lost == 0 {
            return;
        }
        self.stats.lost += lost;
        counter!(m::CONSUMER_LOST, "group" => self.settings.group.clone()).increment(lost);
        tracing::error!(
            stream = %self.settings.stream, group = %self.settings.group, lost,
            "{what}: lost for this group (trim only below every group's acknowledged position)"
        );
    }
}

/// Deliveries grouped by aggregate, each group in sequence order (one entry per stream id).
fn chains(deliveries: Vec<Delivery>) -> Vec<Vec<Delivery>> {
    let mut seen = HashSet::new();
    let mut by_aggregate: BTreeMap<(String, String), Vec<Delivery>> = BTreeMap::new();
    for d in deliveries {
        if seen.insert(d.stream_id.clone()) {
            by_aggregate
                .entry((d.aggregate_type.clone(), d.aggregate_id.clone()))
                .or_default()
                .push(d);
        }
    }
    by_aggregate
        .into_values()
        .map(|mut chain| {
            chain.sort_by_key(|d| d.aggregate_seq);
            chain
        })
        .collect()
}

/// Processes one aggregate's deliveries in order; once one cannot be applied now, the later
/// ones wait too.
async fn run_chain<H: Handler>(
    applier: Arc<Applier<H>>,
    chain: Vec<Delivery>,
) -> Vec<(Delivery, Outcome)> {
    let mut out = Vec::with_capacity(chain.len());
    let mut blocked = false;
    for d in chain {
        let outcome = if blocked {
            Outcome::Held { expected: None }
        } else {
            applier.process(&d, false).await
        };
        blocked = blocked || outcome.blocks_successors();
        out.push((d, outcome));
    }
    out
}

/// A spawned task that is aborted when its handle is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.get_mut().0).poll(cx)
    }
}

/// Back-off before the next delivery: `base` doubled per delivery so far, with up to 50% jitter.
fn retry_wait(base: Duration, deliveries: u32) -> Duration {
    let exp = base.saturating_mul(1u32 << deliveries.saturating_sub(1).min(16));
    let jitter = rand::random::<f64>() * 0.5;
    exp.mul_f64(1.0 + jitter)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn settings() -> ConsumerSettings {
        ConsumerSettings::new("redis://127.0.0.1:6379", "events:order", "billing")
    }

    fn refused(s: &ConsumerSettings) -> String {
        match s.validate() {
            Err(ConsumeError::Settings(m)) => m,
            other => panic!("expected a settings error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid() {
        settings().validate().expect("defaults validate");
    }

    #[test]
    fn max_seq_ahead_must_accept_the_next_sequence() {
        let mut s = settings();
        s.max_seq_ahead = 0;
        let m = refused(&s);
        assert!(m.contains("max_seq_ahead is 0; at least 1"), "{m}");
    }

    #[test]
    fn member_timeout_is_bounded_and_the_error_says_how_to_fix_it() {
        let mut s = settings();
        s.member_timeout = Duration::from_millis(100);
        let m = refused(&s);
        assert!(
            m.contains("member_timeout") && m.contains("at least 300 ms"),
            "{m}"
        );
        s.member_timeout = s.claim_idle;
        let m = refused(&s);
        assert!(
            m.contains("member_timeout") && m.contains("shorter than claim_idle"),
            "{m}"
        );
        assert!(m.contains("lengthen claim_idle"), "{m}");
        s.member_timeout = Duration::from_millis(300);
        s.validate().expect("300 ms is allowed");
    }
}
