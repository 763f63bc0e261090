//! Two members of one group killed in turn while writers append: after the writers stop, the
//! group catches up within seconds, each event applied once, in order per aggregate. A member
//! is killed by aborting its task: whatever it had read stays pending under its name, never
//! acknowledged, and it is started again under a new name (as a process restarted with the
//! default name, host and process id). The members run with the default timings.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use outpost::consume::{ConsumeError, Consumer, ConsumerSettings, ConsumerStats};
use rand::{Rng, SeedableRng};
use support::consumer::{Ev, append, applied, check, create_effects, pending, recorder};
use support::{TestDb, TestRedis, redis_url, wait_until};
use tokio::task::JoinHandle;

/// Aggregates (orders) written to.
const AGGREGATES: usize = 60;
/// Writers, each owning every fourth aggregate (one aggregate's events in sequence order).
const WRITERS: usize = 4;
/// Events per second, all writers together.
const RATE: usize = 600;
/// How long the writers write.
const WRITE_FOR: Duration = Duration::from_secs(15);
/// The bound on catching up once the writers stop, beyond the time the backlog left at that
/// moment takes at [`CATCH_UP_RATE`]: on a loaded machine the members fall behind the writers,
/// and working off that backlog measures the machine, not the recovery from the kills.
const CONVERGE_SECS: u64 = 10;
/// Events a second the members are assumed to apply, at the least, when catching up.
const CATCH_UP_RATE: u64 = 100;

type Task = (
    tokio::sync::oneshot::Sender<()>,
    JoinHandle<Result<ConsumerStats, ConsumeError>>,
);

/// Settings as a deployed member has them: only the name and the test's key prefix differ.
fn member_settings(redis: &TestRedis, stream: &str, name: &str) -> ConsumerSettings {
    let mut s = ConsumerSettings::new(redis_url(), stream, "projection");
    s.key_prefix = redis.prefix.clone();
    s.consumer = name.to_owned();
    s
}

async fn start(db: &TestDb, s: ConsumerSettings) -> Task {
    let name = s.consumer.clone();
    let consumer = Consumer::connect(s, db.store.connection().clone(), recorder(&name))
        .await
        .expect("consumer connects");
    let (stop, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(consumer.run_until(async move {
        let _ = rx.await;
    }));
    (stop, task)
}

/// Appends `RATE / WRITERS` events per second over the writer's aggregates, round-robin, until
/// `stop`; returns what it wrote.
async fn writer(
    mut conn: redis::aio::MultiplexedConnection,
    stream: String,
    w: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<Ev> {
    let mine: Vec<String> = (w..AGGREGATES)
        .step_by(WRITERS)
        .map(|a| format!("o{a}"))
        .collect();
    let mut seqs = vec![0i64; mine.len()];
    let mut written = Vec::new();
    let tick = Duration::from_millis(20);
    let per_tick = RATE / WRITERS / 50;
    let mut interval = tokio::time::interval(tick);
    let mut next = 0usize;
    while !*stop.borrow() {
        interval.tick().await;
        let mut batch = Vec::with_capacity(per_tick);
        for _ in 0..per_tick {
            let i = next % mine.len();
            next += 1;
            seqs[i] += 1;
            batch.push(Ev::new(&mine[i], seqs[i], "order.changed"));
        }
        append(&mut conn, &stream, &batch).await;
        written.extend(batch);
    }
    written
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_killed_in_turn_under_writers_converge_within_seconds_once_in_order() {
    let (db, redis) = (TestDb::with_pool(40).await, TestRedis::new());
    create_effects(&db).await;
    let stream = format!("{}events:order", redis.prefix);

    let mut members: [(String, u32, Task); 2] = [
        (
            "a".into(),
            0,
            start(&db, member_settings(&redis, &stream, "a-0")).await,
        ),
        (
            "b".into(),
            0,
            start(&db, member_settings(&redis, &stream, "b-0")).await,
        ),
    ];

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut writers: Vec<JoinHandle<Vec<Ev>>> = Vec::new();
    for w in 0..WRITERS {
        let conn = redis.conn().await;
        writers.push(tokio::spawn(writer(
            conn,
            stream.clone(),
            w,
            stop_rx.clone(),
        )));
    }

    // Kill the members in turn every 2–4 s (seeded), each started again at once under a new name.
    let seed: u64 = std::env::var("OUTPOST_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(13);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let started = tokio::time::Instant::now();
    let mut kills = 0usize;
    let mut conn = redis.conn().await;
    loop {
        let pause = Duration::from_millis(rng.random_range(2_000..=4_000));
        if started.elapsed() + pause >= WRITE_FOR {
            tokio::time::sleep(WRITE_FOR.saturating_sub(started.elapsed())).await;
            break;
        }
        tokio::time::sleep(pause).await;
        let (slot, run, task) = &mut members[kills % 2];
        // Killed while it works: once it holds entries it has not acknowledged (an idle member
        // loses nothing by dying).
        let victim = format!("{slot}-{run}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while pending_at(&mut conn, &stream, &victim).await == 0
            && tokio::time::Instant::now() < deadline
        {
            tokio::task::yield_now().await;
        }
        task.1.abort();
        let _ = (&mut task.1).await;
        *run += 1;
        let name = format!("{slot}-{run}");
        *task = start(&db, member_settings(&redis, &stream, &name)).await;
        kills += 1;
    }
    stop_tx.send(true).unwrap();
    let stopped = tokio::time::Instant::now();
    let mut written = Vec::new();
    for w in writers {
        written.extend(w.await.unwrap());
    }
    let total = written.len() as i64;
    let backlog = total - applied(&db).await;
    println!(
        "seed {seed}: {kills} kills, {total} events written, {backlog} not yet applied when the \
         writers stopped"
    );

    let bound = CONVERGE_SECS + u64::try_from(backlog).unwrap_or(0) / CATCH_UP_RATE;
    wait_until(
        bound,
        "the group to apply and acknowledge every event",
        || async {
            applied(&db).await >= total
                && pending(&mut redis.conn().await, &stream, "projection").await == 0
        },
    )
    .await;
    println!(
        "converged {:.2} s after the writers stopped (bound {bound} s)",
        stopped.elapsed().as_secs_f64()
    );

    for (slot, run, (stop, task)) in members {
        let _ = stop.send(());
        let stats = task.await.unwrap().unwrap();
        println!("member {slot}-{run}: {stats:?}");
    }
    let mut want: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for e in &written {
        want.entry(e.aggregate.clone()).or_default().push(e.seq);
    }
    let result = check(&db, &want).await;
    assert!(result.is_clean(), "{result:?}");
    assert_eq!(
        result.applied as i64, total,
        "each event applied exactly once"
    );
}

/// Entries pending at one member.
async fn pending_at(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    consumer: &str,
) -> usize {
    let reply: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
        .arg(stream)
        .arg("projection")
        .arg("-")
        .arg("+")
        .arg(1)
        .arg(consumer)
        .query_async(conn)
        .await
        .expect("XPENDING");
    reply.ids.len()
}
