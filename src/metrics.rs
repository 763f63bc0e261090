//! Metrics: names, descriptions and the Prometheus exporter.
//!
//! Labels are low-cardinality only (failure kind and code, backlog state); never ids, streams or
//! aggregate names. Every metric is described here so `/metrics` explains itself.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Events appended to a stream.
pub const PUBLISHED: &str = "outpost_events_published_total";
/// Publishing failures, labelled `kind` (`transient`|`permanent`|`unpublishable`) and `code`
/// (Redis error code or Outpost's own: `IO`, `FENCE`, `OVERSIZE`, `UNROUTABLE`, `ENCODING`, …).
pub const FAILURES: &str = "outpost_publish_failures_total";
/// Publish calls refused because the partition's fence at Redis holds no epoch (a value someone
/// else wrote): nothing is appended for the partition until an operator fixes the fence.
pub const FENCE_INVALID: &str = "outpost_fence_invalid_total";
/// Events scheduled for another attempt.
pub const RETRIES: &str = "outpost_retries_total";
/// Events quarantined: after `relay.max_attempts`, or at the first attempt when they can never
/// be published as they are.
pub const QUARANTINED: &str = "outpost_events_quarantined_total";
/// Events that routing sends nowhere.
pub const NO_DESTINATION: &str = "outpost_events_no_destination_total";
/// Batches deferred because the cluster's rate-limit budget had no room for them yet.
pub const RATE_LIMITED_WAITS: &str = "outpost_rate_limited_waits_total";
/// Rows by state (`state` label), refreshed by the supervisor.
pub const BACKLOG: &str = "outpost_backlog_events";
/// Age of the oldest undelivered event: the alert.
pub const OLDEST_PENDING_AGE: &str = "outpost_oldest_pending_age_seconds";
/// Claim query latency.
pub const CLAIM_SECONDS: &str = "outpost_claim_duration_seconds";
/// Publish (pipelined script calls) latency.
pub const PUBLISH_SECONDS: &str = "outpost_publish_duration_seconds";
/// Mark transaction latency.
pub const MARK_SECONDS: &str = "outpost_mark_duration_seconds";
/// From insert (database clock) to Redis acknowledgement.
pub const COMMIT_TO_PUBLISH_SECONDS: &str = "outpost_commit_to_publish_seconds";
/// Partition leases held by this node.
pub const LEASES_HELD: &str = "outpost_leases_held";
/// Paused partitions owned by this node.
pub const PARTITIONS_PAUSED: &str = "outpost_partitions_paused";
/// Publishes or marks rejected because the lease was lost (`at` = `redis`|`database`).
pub const FENCED: &str = "outpost_fenced_total";
/// Partition actors restarted after a panic.
pub const ACTOR_RESTARTS: &str = "outpost_partition_restarts_total";
/// Nudges received from producers.
pub const NUDGES: &str = "outpost_nudges_total";
/// Rows deleted by the janitor (`state` = `published`|`no_destination`|`discarded`).
pub const RETENTION_DELETED: &str = "outpost_retention_deleted_total";
/// Stream entries trimmed (`reason` = `acknowledged`|`age`|`cap`; `cap` dropped unacknowledged
/// entries).
pub const STREAM_TRIMMED: &str = "outpost_stream_trimmed_entries_total";
/// Data losses of Redis noticed (restart without persistence, lagging failover, eviction).
pub const REDIS_DATA_LOSS: &str = "outpost_redis_data_loss_total";
/// Events set back to pending to be re-published after a Redis data loss.
pub const REPUBLISHED: &str = "outpost_republished_events_total";
/// 1 when Redis's `maxmemory-policy` may evict keys (anything but `noeviction`).
pub const REDIS_MAY_EVICT: &str = "outpost_redis_may_evict";
/// 1 when Redis has append-only persistence on.
pub const REDIS_AOF: &str = "outpost_redis_aof_enabled";
/// Operator actions refused (`action`, `reason` = `role`|`state`|`count`|`input`|`not_found`).
pub const ADMIN_REFUSED: &str = "outpost_admin_refused_total";
/// Size of the outbox table (heap, TOAST, free space map), bytes.
pub const TABLE_BYTES: &str = "outpost_outbox_table_bytes";
/// Size of the outbox table's indexes, bytes.
pub const INDEX_BYTES: &str = "outpost_outbox_index_bytes";
/// Dead row versions in the outbox table not yet vacuumed.
pub const DEAD_TUPLES: &str = "outpost_outbox_dead_tuples";
/// Live rows in the outbox table (statistics).
pub const LIVE_TUPLES: &str = "outpost_outbox_live_tuples";
/// Age in transactions of the oldest snapshot or prepared transaction holding back vacuum.
pub const XMIN_AGE: &str = "outpost_db_xmin_age_transactions";
/// Age in seconds of the oldest transaction holding back vacuum.
pub const OLDEST_XACT: &str = "outpost_db_oldest_transaction_seconds";
/// Prepared (two-phase) transactions in the database.
pub const PREPARED_XACTS: &str = "outpost_db_prepared_transactions";
/// Size of `outpost_published`, the history of published events, with its indexes, bytes.
pub const PUBLISHED_BYTES: &str = "outpost_published_bytes";

/// Every metric Outpost exports (histograms also as `_bucket`, `_sum`, `_count`).
pub const ALL: &[&str] = &[
    PUBLISHED,
    FAILURES,
    RETRIES,
    QUARANTINED,
    NO_DESTINATION,
    RATE_LIMITED_WAITS,
    BACKLOG,
    OLDEST_PENDING_AGE,
    CLAIM_SECONDS,
    PUBLISH_SECONDS,
    MARK_SECONDS,
    COMMIT_TO_PUBLISH_SECONDS,
    LEASES_HELD,
    PARTITIONS_PAUSED,
    FENCED,
    FENCE_INVALID,
    ACTOR_RESTARTS,
    NUDGES,
    RETENTION_DELETED,
    STREAM_TRIMMED,
    REDIS_DATA_LOSS,
    REPUBLISHED,
    REDIS_MAY_EVICT,
    REDIS_AOF,
    TABLE_BYTES,
    INDEX_BYTES,
    DEAD_TUPLES,
    LIVE_TUPLES,
    XMIN_AGE,
    OLDEST_XACT,
    PREPARED_XACTS,
    PUBLISHED_BYTES,
    CONSUMER_PROCESSED,
    CONSUMER_DUPLICATES,
    CONSUMER_HELD,
    CONSUMER_RECLAIMED,
    CONSUMER_TAKEN_OVER,
    CONSUMER_RELEASED,
    CONSUMER_DEAD_LETTERED,
    CONSUMER_RETRIES,
    CONSUMER_LOST,
    CONSUMER_LAG,
];

/// Consumer helper: events applied by a handler (label `group`, as for every consumer metric).
pub const CONSUMER_PROCESSED: &str = "outpost_consumer_processed_total";
/// Consumer helper: deliveries skipped because the group had applied the event already.
pub const CONSUMER_DUPLICATES: &str = "outpost_consumer_duplicates_total";
/// Consumer helper: deliveries held back because an earlier event of the aggregate is missing.
pub const CONSUMER_HELD: &str = "outpost_consumer_held_total";
/// Consumer helper: entries reclaimed from members idle longer than the claim time.
pub const CONSUMER_RECLAIMED: &str = "outpost_consumer_reclaimed_total";
/// Consumer helper: entries taken over from dead members (no liveness for `member_timeout`).
pub const CONSUMER_TAKEN_OVER: &str = "outpost_consumer_taken_over_total";
/// Consumer helper: held entries released because the gap ahead of them filled.
pub const CONSUMER_RELEASED: &str = "outpost_consumer_released_total";
/// Consumer helper: entries moved to the dead-letter stream.
pub const CONSUMER_DEAD_LETTERED: &str = "outpost_consumer_dead_lettered_total";
/// Consumer helper: handler attempts that asked to be retried.
pub const CONSUMER_RETRIES: &str = "outpost_consumer_retries_total";
/// Consumer helper: entries that left the stream before the group processed them.
pub const CONSUMER_LOST: &str = "outpost_consumer_lost_total";
/// Consumer helper: entries in the stream not yet delivered to the group.
pub const CONSUMER_LAG: &str = "outpost_consumer_lag_entries";

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];

/// Installs the process-wide Prometheus recorder once and returns its handle (`None` when another
/// recorder was installed first, e.g. by an embedding application).
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .ok()?
                .install_recorder()
                .ok()?;
            describe();
            Some(handle)
        })
        .clone()
}

/// Upkeeps run by [`upkeep`] in this process.
static UPKEEPS: AtomicU64 = AtomicU64::new(0);

/// How many times [`upkeep`] has folded the histograms' samples in this process.
pub fn upkeeps() -> u64 {
    UPKEEPS.load(Ordering::Relaxed)
}

/// How often a node runs the exporter's upkeep.
pub const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs the exporter's upkeep every `every`, for as long as the task lives (a task of the
/// node's actix system). Histograms keep every sample in memory until they are folded into
/// their buckets, which a scrape of `/metrics` or the upkeep does: without it, a node nobody
/// scrapes would grow by a few bytes per sample for ever. Returns at once when another recorder
/// than Outpost's is installed (its owner keeps it).
pub async fn upkeep(every: std::time::Duration) {
    let Some(handle) = install() else {
        return;
    };
    loop {
        tokio::time::sleep(every).await;
        handle.run_upkeep();
        UPKEEPS.fetch_add(1, Ordering::Relaxed);
    }
}

fn describe() {
    describe_counter!(PUBLISHED, Unit::Count, "Events appended to a stream.");
    describe_counter!(
        FAILURES,
        Unit::Count,
        "Publishing failures by kind and code."
    );
    describe_counter!(
        RETRIES,
        Unit::Count,
        "Events scheduled for another attempt."
    );
    describe_counter!(
        QUARANTINED,
        Unit::Count,
        "Events quarantined (after max_attempts, or at once when they can never be published)."
    );
    describe_counter!(NO_DESTINATION, Unit::Count, "Events routed nowhere.");
    describe_counter!(
        ADMIN_REFUSED,
        Unit::Count,
        "Operator actions refused, by action and reason; nothing was changed."
    );
    describe_counter!(
        RATE_LIMITED_WAITS,
        Unit::Count,
        "Batches deferred for a rate-limit permit (their rows stay pending)."
    );
    describe_gauge!(BACKLOG, Unit::Count, "Outbox rows by state.");
    describe_gauge!(
        OLDEST_PENDING_AGE,
        Unit::Seconds,
        "Age of the oldest undelivered event."
    );
    describe_histogram!(CLAIM_SECONDS, Unit::Seconds, "Claim query latency.");
    describe_histogram!(
        PUBLISH_SECONDS,
        Unit::Seconds,
        "Publish latency (one pipelined call)."
    );
    describe_histogram!(MARK_SECONDS, Unit::Seconds, "Mark transaction latency.");
    describe_histogram!(
        COMMIT_TO_PUBLISH_SECONDS,
        Unit::Seconds,
        "From insert to Redis acknowledgement."
    );
    describe_gauge!(
        LEASES_HELD,
        Unit::Count,
        "Partition leases held by this node."
    );
    describe_gauge!(
        PARTITIONS_PAUSED,
        Unit::Count,
        "Paused partitions owned by this node."
    );
    describe_counter!(
        FENCED,
        Unit::Count,
        "Publishes or marks rejected after a lost lease."
    );
    describe_counter!(
        FENCE_INVALID,
        Unit::Count,
        "Publish calls refused because a partition's fence at Redis holds no epoch; fix the fence."
    );
    describe_counter!(
        ACTOR_RESTARTS,
        Unit::Count,
        "Partition actors restarted after a panic."
    );
    describe_counter!(NUDGES, Unit::Count, "Nudges received from producers.");
    describe_counter!(
        CONSUMER_PROCESSED,
        Unit::Count,
        "Events applied by a consumer handler."
    );
    describe_counter!(
        CONSUMER_DUPLICATES,
        Unit::Count,
        "Deliveries of events the group had applied already."
    );
    describe_counter!(
        CONSUMER_HELD,
        Unit::Count,
        "Deliveries held back behind a missing earlier event of their aggregate."
    );
    describe_counter!(
        CONSUMER_RECLAIMED,
        Unit::Count,
        "Entries reclaimed from idle group members."
    );
    describe_counter!(
        CONSUMER_TAKEN_OVER,
        Unit::Count,
        "Entries taken over from dead group members."
    );
    describe_counter!(
        CONSUMER_RELEASED,
        Unit::Count,
        "Held entries released because the gap ahead of them filled."
    );
    describe_counter!(
        CONSUMER_DEAD_LETTERED,
        Unit::Count,
        "Entries moved to the consumer dead-letter stream."
    );
    describe_counter!(
        CONSUMER_RETRIES,
        Unit::Count,
        "Handler attempts that asked to be retried."
    );
    describe_counter!(
        CONSUMER_LOST,
        Unit::Count,
        "Entries that left the stream before the group processed them."
    );
    describe_gauge!(
        CONSUMER_LAG,
        Unit::Count,
        "Entries not yet delivered to the group."
    );
    describe_counter!(
        RETENTION_DELETED,
        Unit::Count,
        "Outbox rows deleted by the janitor, by state."
    );
    describe_counter!(
        STREAM_TRIMMED,
        Unit::Count,
        "Stream entries trimmed, by reason (cap = unacknowledged entries dropped)."
    );
    describe_counter!(
        REDIS_DATA_LOSS,
        Unit::Count,
        "Redis data losses noticed (restart without persistence, lagging failover, eviction)."
    );
    describe_counter!(
        REPUBLISHED,
        Unit::Count,
        "Events set back to pending for re-publishing after a Redis data loss."
    );
    describe_gauge!(
        REDIS_MAY_EVICT,
        Unit::Count,
        "1 when Redis maxmemory-policy is not noeviction."
    );
    describe_gauge!(
        REDIS_AOF,
        Unit::Count,
        "1 when Redis append-only persistence is on."
    );
    describe_gauge!(TABLE_BYTES, Unit::Bytes, "Size of the outbox table.");
    describe_gauge!(
        INDEX_BYTES,
        Unit::Bytes,
        "Size of the outbox table's indexes."
    );
    describe_gauge!(
        DEAD_TUPLES,
        Unit::Count,
        "Dead row versions in the outbox table not yet vacuumed."
    );
    describe_gauge!(LIVE_TUPLES, Unit::Count, "Live rows in the outbox table.");
    describe_gauge!(
        XMIN_AGE,
        Unit::Count,
        "Age in transactions of the oldest snapshot holding back vacuum."
    );
    describe_gauge!(
        OLDEST_XACT,
        Unit::Seconds,
        "Age of the oldest transaction holding back vacuum."
    );
    describe_gauge!(
        PREPARED_XACTS,
        Unit::Count,
        "Prepared transactions in the database."
    );
    describe_gauge!(
        PUBLISHED_BYTES,
        Unit::Bytes,
        "Size of the history of published events, with its indexes."
    );
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// Every `outpost_*` name the shipped alert rules use is a metric the code exports.
    #[test]
    fn alert_rules_use_exported_metrics() {
        let rules = include_str!("../deploy/prometheus/outpost-alerts.yml");
        let mut used = BTreeSet::new();
        let mut rest = rules;
        while let Some(i) = rest.find("outpost_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[i + name.len()..];
            used.insert(name);
        }
        assert!(!used.is_empty(), "the rules file uses no metric");
        for name in &used {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|b| super::ALL.contains(b))
                .unwrap_or(name);
            assert!(
                super::ALL.contains(&base),
                "{name} is used by deploy/prometheus/outpost-alerts.yml but not exported"
            );
        }
    }
}
