//! Settlement: what the replies of one group's publish mean for each of its partitions.
//!
//! A group publishes the stream calls of several partitions in one pipeline; Redis answers each
//! call. Every partition owns a run of consecutive calls (one per stream its batch writes), so
//! the replies are split by those counts first, whatever they say: a fenced or lost call
//! ends its partition's batch but never shifts another partition's replies onto it. Then, per
//! partition and call by call, each appended entry's row is published with its own entry id, and
//! the first entry Redis refused is a failure of its own row (permanent or unpublishable) or of
//! the call (transient, a fence that holds no epoch included). A pure function: the caller applies the side effects (metrics, the stream book,
//! the database).

use std::time::Duration;

use super::settings::RelaySettings;
use crate::publish::{ErrorClass, PublishError, StreamBatch, StreamOutcome, parse_entry_id};
use crate::store::{BatchResult, FailedEvent};

/// Where an entry of a stream call came from (its aggregate is the entry's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Origin {
    /// Outbox row id.
    pub id: i64,
    /// Sequence within the aggregate.
    pub seq: i64,
    /// Attempts made before this one.
    pub attempts: i32,
    /// When the row was committed (database clock).
    pub recorded_at: chrono::DateTime<chrono::FixedOffset>,
}

/// One partition's part of a group, as the settlement sees it: the origins of its calls' entries
/// (one list per call, in call order) and what its plan decided before publishing (rows with no
/// destination, rows that could not be routed or encoded).
#[derive(Debug, Clone, Default)]
pub(super) struct PartitionCalls {
    /// Per call, the rows of its entries in order.
    pub origins: Vec<Vec<Origin>>,
    /// What the plan recorded already.
    pub result: BatchResult,
}

/// What became of one partition's batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Settlement {
    /// Every call was answered: `result` is what to record. `transient` is the error that ended
    /// a call early without the event being at fault (its row and the rest stay pending).
    Answered {
        /// Rows to record.
        result: BatchResult,
        /// A transient error that stopped one of the calls.
        transient: Option<PublishError>,
        /// Commit-to-publish time of each published row.
        latencies: Vec<Duration>,
    },
    /// Redis holds a newer epoch for the partition on one of its streams: nothing of the
    /// partition is recorded (what other calls appended is published again by the owner).
    Fenced {
        /// The newest epoch Redis holds.
        current: i64,
    },
    /// A stream the node knew has lost its data: nothing of the partition is recorded until
    /// the loss is handled.
    Lost {
        /// The stream found lost.
        stream: String,
    },
}

/// Settles a group's `replies` (one per call of `calls`, in order) into one [`Settlement`] per
/// partition of `partitions`, in order. Partition `k` owns the next `partitions[k].origins.len()`
/// calls. A call without a reply (a short answer) counts as a transient failure of its
/// partition. `now` is when the replies arrived; `rng` draws the failed rows' retry delays.
pub(super) fn settle(
    settings: &RelaySettings,
    rng: &mut impl rand::Rng,
    partitions: Vec<PartitionCalls>,
    calls: &[StreamBatch],
    replies: Vec<StreamOutcome>,
    now: chrono::DateTime<chrono::Utc>,
) -> Vec<Settlement> {
    let mut calls = calls.iter();
    let mut replies = replies.into_iter();
    partitions
        .into_iter()
        .map(|part| {
            // Take exactly this partition's calls and replies, whatever they say.
            let mine: Vec<(Vec<Origin>, Option<&StreamBatch>, Option<StreamOutcome>)> = part
                .origins
                .into_iter()
                .map(|origins| (origins, calls.next(), replies.next()))
                .collect();
            settle_partition(settings, rng, part.result, mine, now)
        })
        .collect()
}

fn settle_partition(
    settings: &RelaySettings,
    rng: &mut impl rand::Rng,
    mut result: BatchResult,
    calls: Vec<(Vec<Origin>, Option<&StreamBatch>, Option<StreamOutcome>)>,
    now: chrono::DateTime<chrono::Utc>,
) -> Settlement {
    let mut fenced: Option<i64> = None;
    let mut lost: Option<String> = None;
    let mut transient: Option<PublishError> = None;
    let mut latencies = Vec::new();
    for (origins, call, reply) in calls {
        let (Some(call), Some(reply)) = (call, reply) else {
            transient.get_or_insert_with(|| {
                PublishError::transient("IO", "Redis answered fewer calls than were sent")
            });
            continue;
        };
        let (ids, error) = match reply {
            StreamOutcome::Published(ids) => (ids, None),
            StreamOutcome::Failed { ids, error } => (ids, Some(error)),
            StreamOutcome::Fenced { current } => {
                fenced = Some(fenced.map_or(current, |f| f.max(current)));
                continue;
            }
            StreamOutcome::Lost => {
                lost.get_or_insert_with(|| call.stream.clone());
                continue;
            }
            StreamOutcome::BadFence { fence, value } => {
                transient.get_or_insert_with(|| {
                    PublishError::bad_fence(&fence, call.partition, value.as_deref())
                });
                continue;
            }
        };
        let appended = ids.len();
        if let Some((ms, seq)) = ids.last().and_then(|id| parse_entry_id(id)) {
            result.positions.push((call.stream.clone(), ms, seq));
        }
        for ((origin, entry), id) in origins.iter().zip(&call.entries).zip(ids) {
            let latency = (now - origin.recorded_at.with_timezone(&chrono::Utc))
                .to_std()
                .unwrap_or_default();
            latencies.push(latency);
            if origin.attempts > 0 {
                let (kind, aggregate) = entry.aggregate();
                result
                    .unblocked
                    .push((kind.to_owned(), aggregate.to_owned(), origin.seq));
            }
            result.published.push((origin.id, id));
        }
        if let (Some(error), Some(origin), Some(entry)) =
            (error, origins.get(appended), call.entries.get(appended))
        {
            match error.class() {
                ErrorClass::Permanent | ErrorClass::Unpublishable => {
                    result
                        .failed
                        .push(failure(settings, rng, origin, entry.aggregate(), &error));
                }
                ErrorClass::Transient => {
                    transient.get_or_insert(error);
                }
            }
        }
    }
    if let Some(current) = fenced {
        return Settlement::Fenced { current };
    }
    if let Some(stream) = lost {
        return Settlement::Lost { stream };
    }
    Settlement::Answered {
        result,
        transient,
        latencies,
    }
}

/// The failure of `origin`'s row with `error`: an attempt counted, a retry after a backoff, or
/// quarantine at once when the row can never be published as it is.
pub(super) fn failure(
    settings: &RelaySettings,
    rng: &mut impl rand::Rng,
    origin: &Origin,
    (aggregate_type, aggregate_id): (&str, &str),
    error: &PublishError,
) -> FailedEvent {
    let attempt = u32::try_from(origin.attempts.max(0)).unwrap_or(0) + 1;
    let delay = super::backoff::delay(attempt, settings.backoff_base, settings.backoff_max, rng);
    FailedEvent {
        id: origin.id,
        aggregate_type: aggregate_type.to_owned(),
        aggregate_id: aggregate_id.to_owned(),
        aggregate_seq: origin.seq,
        code: error.code().to_owned(),
        // `last_error` starts with the code, for operators and the status output.
        error: if error.to_string().starts_with(error.code()) {
            error.to_string()
        } else {
            format!("{} {error}", error.code())
        },
        retry_in_ms: i64::try_from(delay.as_millis()).unwrap_or(i64::MAX),
        unpublishable: error.class() == ErrorClass::Unpublishable,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::publish::{Entry, Message};

    fn settings() -> RelaySettings {
        RelaySettings {
            batch_rows: 1000,
            batch_bytes: 1 << 20,
            max_attempts: 5,
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            delete_published: false,
        }
    }

    fn entry(aggregate: &str, seq: i64) -> Entry {
        let message = Message {
            event_id: uuid::Uuid::new_v4().to_string(),
            event_type: "t.happened".to_owned(),
            aggregate_type: "t".to_owned(),
            aggregate_id: aggregate.to_owned(),
            aggregate_seq: seq,
            schema_version: "1".to_owned(),
            time: "2026-12-06T00:00:00.000000Z".to_owned(),
            payload: "{}".to_owned(),
            headers: "{}".to_owned(),
        };
        match Entry::try_new(message) {
            Ok(e) => e,
            Err(_) => panic!("a plain test entry encodes"),
        }
    }

    fn origin(id: i64, seq: i64, attempts: i32) -> Origin {
        Origin {
            id,
            seq,
            attempts,
            recorded_at: chrono::DateTime::UNIX_EPOCH.fixed_offset(),
        }
    }

    /// A call of `n` entries of aggregate `agg` in `partition`, rows `first_id..`.
    fn call(
        stream: &str,
        partition: i32,
        agg: &str,
        first_id: i64,
        n: i64,
    ) -> (StreamBatch, Vec<Origin>) {
        let batch = StreamBatch {
            stream: stream.to_owned(),
            partition,
            epoch: 1,
            known: true,
            expect: None,
            entries: (0..n).map(|k| entry(agg, k + 1)).collect(),
        };
        let origins = (0..n).map(|k| origin(first_id + k, k + 1, 0)).collect();
        (batch, origins)
    }

    fn ids(stream: &str, n: usize) -> Vec<String> {
        (0..n).map(|k| format!("{stream}-{k}")).collect()
    }

    fn run(
        partitions: Vec<Vec<(StreamBatch, Vec<Origin>)>>,
        replies: Vec<StreamOutcome>,
    ) -> Vec<Settlement> {
        let mut calls = Vec::new();
        let parts = partitions
            .into_iter()
            .map(|p| PartitionCalls {
                origins: p
                    .into_iter()
                    .map(|(b, o)| {
                        calls.push(b);
                        o
                    })
                    .collect(),
                result: BatchResult::default(),
            })
            .collect();
        let mut rng = StdRng::seed_from_u64(1);
        settle(
            &settings(),
            &mut rng,
            parts,
            &calls,
            replies,
            chrono::Utc::now(),
        )
    }

    fn answered(s: &Settlement) -> &BatchResult {
        match s {
            Settlement::Answered { result, .. } => result,
            other => panic!("expected an answered settlement, got {other:?}"),
        }
    }

    #[test]
    fn a_fenced_first_stream_does_not_shift_the_next_partitions_replies() {
        // Partition 1 writes streams a and b; partition 2 writes c, whose call failed for its
        // first entry. Before settlement split replies by partition, partition 2 took the reply
        // of partition 1's stream b and marked its row published with b's entry id.
        let wrongtype = PublishError::event("WRONGTYPE", "WRONGTYPE not a stream");
        let out = run(
            vec![
                vec![call("a", 1, "x", 10, 1), call("b", 1, "y", 11, 1)],
                vec![call("c", 2, "z", 20, 1)],
            ],
            vec![
                StreamOutcome::Fenced { current: 9 },
                StreamOutcome::Published(ids("b", 1)),
                StreamOutcome::Failed {
                    ids: Vec::new(),
                    error: wrongtype,
                },
            ],
        );
        assert_eq!(out[0], Settlement::Fenced { current: 9 });
        let second = answered(&out[1]);
        assert!(second.published.is_empty(), "{second:?}");
        assert_eq!(second.failed.len(), 1);
        assert_eq!(second.failed[0].id, 20);
        assert_eq!(second.failed[0].aggregate_id, "z");
        assert_eq!(second.failed[0].code, "WRONGTYPE");
    }

    #[test]
    fn a_lost_stream_ends_only_its_own_partition() {
        let out = run(
            vec![
                vec![call("a", 1, "x", 10, 2), call("b", 1, "y", 12, 1)],
                vec![call("c", 2, "z", 20, 2)],
            ],
            vec![
                StreamOutcome::Lost,
                StreamOutcome::Published(ids("b", 1)),
                StreamOutcome::Published(ids("c", 2)),
            ],
        );
        assert_eq!(
            out[0],
            Settlement::Lost {
                stream: "a".to_owned()
            }
        );
        assert_eq!(
            answered(&out[1]).published,
            vec![(20, "c-0".to_owned()), (21, "c-1".to_owned())]
        );
    }

    #[test]
    fn a_failure_part_way_publishes_the_prefix_and_fails_its_own_row() {
        let out = run(
            vec![vec![call("a", 1, "x", 10, 3)]],
            vec![StreamOutcome::Failed {
                ids: ids("a", 1),
                error: PublishError::event("WRONGTYPE", "WRONGTYPE"),
            }],
        );
        let r = answered(&out[0]);
        assert_eq!(r.published, vec![(10, "a-0".to_owned())]);
        assert_eq!(r.failed.len(), 1);
        assert_eq!((r.failed[0].id, r.failed[0].aggregate_seq), (11, 2));
    }

    #[test]
    fn a_transient_failure_records_the_prefix_and_reports_the_error() {
        let out = run(
            vec![vec![call("a", 1, "x", 10, 3)]],
            vec![StreamOutcome::Failed {
                ids: ids("a", 2),
                error: PublishError::transient("OOM", "OOM command not allowed"),
            }],
        );
        match &out[0] {
            Settlement::Answered {
                result, transient, ..
            } => {
                assert_eq!(result.published.len(), 2);
                assert!(result.failed.is_empty());
                assert_eq!(transient.as_ref().map(PublishError::code), Some("OOM"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_bad_fence_fails_the_call_transiently_and_blames_no_row() {
        let out = run(
            vec![
                vec![call("a", 1, "x", 10, 2), call("b", 1, "y", 12, 1)],
                vec![call("c", 2, "z", 20, 1)],
            ],
            vec![
                StreamOutcome::BadFence {
                    fence: "fence-a".to_owned(),
                    value: Some("abc".to_owned()),
                },
                StreamOutcome::Published(ids("b", 1)),
                StreamOutcome::Published(ids("c", 1)),
            ],
        );
        match &out[0] {
            Settlement::Answered {
                result, transient, ..
            } => {
                assert_eq!(result.published, vec![(12, "b-0".to_owned())]);
                assert!(result.failed.is_empty(), "{result:?}");
                let e = transient.as_ref().map(|e| (e.code(), e.class()));
                assert_eq!(e, Some(("FENCE", ErrorClass::Transient)));
                assert!(
                    transient
                        .as_ref()
                        .is_some_and(|e| e.to_string().contains("fence-a"))
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(answered(&out[1]).published.len(), 1);
    }

    #[test]
    fn an_unpublishable_row_is_marked_for_quarantine_and_a_permanent_one_for_retry() {
        for (error, now) in [
            (
                PublishError::from_reply("WRONGTYPE Operation against a key"),
                true,
            ),
            (PublishError::from_reply("NOPERM no permissions"), false),
        ] {
            let out = run(
                vec![vec![call("a", 1, "x", 10, 1)]],
                vec![StreamOutcome::Failed {
                    ids: Vec::new(),
                    error,
                }],
            );
            let r = answered(&out[0]);
            assert_eq!(r.failed.len(), 1);
            assert_eq!(r.failed[0].unpublishable, now, "{:?}", r.failed[0]);
        }
    }

    #[test]
    fn a_short_answer_is_a_transient_failure_of_the_partitions_left_unanswered() {
        let out = run(
            vec![
                vec![call("a", 1, "x", 10, 1)],
                vec![call("b", 2, "y", 20, 1)],
            ],
            vec![StreamOutcome::Published(ids("a", 1))],
        );
        assert_eq!(answered(&out[0]).published.len(), 1);
        match &out[1] {
            Settlement::Answered {
                result, transient, ..
            } => {
                assert!(result.published.is_empty());
                assert!(transient.is_some());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_retried_row_published_releases_its_aggregate_at_its_sequence() {
        let (batch, mut origins) = call("a", 1, "x", 10, 1);
        origins[0].attempts = 2;
        let out = run(
            vec![vec![(batch, origins)]],
            vec![StreamOutcome::Published(ids("a", 1))],
        );
        assert_eq!(
            answered(&out[0]).unblocked,
            vec![("t".to_owned(), "x".to_owned(), 1)]
        );
    }

    /// Random groups: partitions of one to four calls, every kind of reply. Whatever the replies
    /// say, a row is only ever published with the id its own call's reply gave it, and only a
    /// row of a call that failed for it is failed.
    #[test]
    fn random_groups_never_give_a_row_another_calls_reply() {
        for seed in 0..500u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut next_id = 1i64;
            let mut partitions = Vec::new();
            let mut replies = Vec::new();
            // row id -> the entry id its own call gave it, if appended
            let mut truth: HashMap<i64, Option<String>> = HashMap::new();
            // partitions expected fenced or lost
            let mut cut: HashSet<usize> = HashSet::new();
            let mut failing: HashSet<i64> = HashSet::new();
            for p in 0..rng.random_range(1..6usize) {
                let mut calls = Vec::new();
                for c in 0..rng.random_range(1..5usize) {
                    let n = rng.random_range(1..4i64);
                    let stream = format!("s{p}-{c}");
                    let agg = format!("agg{p}-{c}");
                    let (b, o) = call(&stream, p as i32, &agg, next_id, n);
                    next_id += n;
                    let all = ids(&stream, n as usize);
                    let reply = match rng.random_range(0..5) {
                        0 => StreamOutcome::Fenced { current: 7 },
                        1 => StreamOutcome::Lost,
                        2 => {
                            let k = rng.random_range(0..n as usize);
                            StreamOutcome::Failed {
                                ids: all[..k].to_vec(),
                                error: PublishError::event("WRONGTYPE", "WRONGTYPE"),
                            }
                        }
                        _ => StreamOutcome::Published(all.clone()),
                    };
                    for (k, origin) in o.iter().enumerate() {
                        let appended = match &reply {
                            StreamOutcome::Published(_) => Some(all[k].clone()),
                            StreamOutcome::Failed { ids, .. } => ids.get(k).cloned(),
                            _ => None,
                        };
                        if let StreamOutcome::Failed { ids, .. } = &reply
                            && ids.len() == k
                        {
                            failing.insert(origin.id);
                        }
                        truth.insert(origin.id, appended);
                    }
                    if matches!(reply, StreamOutcome::Fenced { .. } | StreamOutcome::Lost) {
                        cut.insert(p);
                    }
                    replies.push(reply);
                    calls.push((b, o));
                }
                partitions.push(calls);
            }
            let out = run(partitions, replies);
            for (p, s) in out.iter().enumerate() {
                match s {
                    Settlement::Answered { result, .. } => {
                        assert!(!cut.contains(&p), "seed {seed}: partition {p} settled");
                        for (id, sid) in &result.published {
                            assert_eq!(
                                truth.get(id).cloned().flatten().as_ref(),
                                Some(sid),
                                "seed {seed}: row {id} published with another call's id"
                            );
                        }
                        for f in &result.failed {
                            assert!(failing.contains(&f.id), "seed {seed}: row {} failed", f.id);
                        }
                    }
                    _ => assert!(cut.contains(&p), "seed {seed}: partition {p} cut"),
                }
            }
        }
    }
}
