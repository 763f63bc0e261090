//! An operator polling the overview while a benchmark runs: every period, the figures that the
//! panel's overview page and `GET /api/v1/status` show ([`Store::overview`]) are read on a
//! connection of the benchmark's pool, and each answer's time is kept.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::store::Store;

/// A running poller; [`OverviewPoller::finish`] stops it and hands back the answer times.
pub(super) struct OverviewPoller {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<anyhow::Result<Vec<Duration>>>,
}

impl OverviewPoller {
    /// Starts reading the overview every `every`, the first time at once.
    pub fn start(store: Store, every: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut times = Vec::new();
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !flag.load(Ordering::Relaxed) {
                tick.tick().await;
                let t = Instant::now();
                store.overview().await.context("reading the overview")?;
                times.push(t.elapsed());
            }
            Ok(times)
        });
        Self { stop, task }
    }

    /// Stops the poller and returns its answer times, sorted.
    pub async fn finish(self) -> anyhow::Result<Vec<Duration>> {
        self.stop.store(true, Ordering::Relaxed);
        let mut times = self.task.await.context("the overview poller failed")??;
        times.sort();
        Ok(times)
    }
}

/// The `q` quantile of sorted durations, in milliseconds (`None` when there are none).
pub(super) fn quantile_ms(sorted: &[Duration], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    Some(sorted[i].as_secs_f64() * 1000.0)
}

/// "N polls, p50 X ms, p99 Y ms, max Z ms".
pub(super) fn describe(sorted: &[Duration]) -> String {
    match (
        quantile_ms(sorted, 0.5),
        quantile_ms(sorted, 0.99),
        quantile_ms(sorted, 1.0),
    ) {
        (Some(p50), Some(p99), Some(max)) => format!(
            "{} overview reads: p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms",
            sorted.len()
        ),
        _ => "no overview read finished".to_owned(),
    }
}

/// The median of `values` (the mean of the middle two for an even count); `None` when empty.
pub(super) fn median(values: &[f64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if !n.is_multiple_of(2) => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_medians() {
        let ms = |v: u64| Duration::from_millis(v);
        let sorted = [ms(1), ms(2), ms(3), ms(4)];
        assert_eq!(quantile_ms(&sorted, 0.5), Some(2.0));
        assert_eq!(quantile_ms(&sorted, 0.99), Some(4.0));
        assert_eq!(quantile_ms(&[], 0.5), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }
}
