//! Exponential backoff with jitter.

use std::time::Duration;

/// The delay before retry number `attempt` (1 for the first retry): `base · 2^(attempt-1)`,
/// capped at `max`, then jittered uniformly into its upper half so that retries of many events
/// or partitions spread out.
pub fn delay(attempt: u32, base: Duration, max: Duration, rng: &mut impl rand::Rng) -> Duration {
    let exp = attempt.saturating_sub(1).min(32);
    let full = base
        .checked_mul(1u32 << exp.min(31))
        .unwrap_or(max)
        .min(max);
    let half = full / 2;
    let jitter_ms = u64::try_from(half.as_millis()).unwrap_or(u64::MAX);
    half + Duration::from_millis(if jitter_ms == 0 {
        0
    } else {
        rng.random_range(0..=jitter_ms)
    })
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn grows_then_caps_and_stays_in_the_upper_half() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (base, max) = (Duration::from_millis(100), Duration::from_secs(10));
        for attempt in 1..=40 {
            let full = (base * 2u32.pow((attempt - 1).min(20))).min(max);
            for _ in 0..50 {
                let d = delay(attempt, base, max, &mut rng);
                assert!(
                    d >= full / 2 && d <= full,
                    "attempt {attempt}: {d:?} vs {full:?}"
                );
            }
        }
    }
}
