//! Rate limits: global and per stream (governor). A limit delays publishing; it never drops or
//! fails an event.

use std::num::NonZeroU32;

use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};

use crate::config::RateLimitConfig;

/// The node's limits, shared by every partition actor.
#[derive(Debug)]
pub struct RateLimits {
    global: Option<(DefaultDirectRateLimiter, NonZeroU32)>,
    per_stream: Option<(DefaultKeyedRateLimiter<String>, NonZeroU32)>,
}

impl RateLimits {
    /// Builds the limiters from configuration (0 = unlimited).
    pub fn new(config: &RateLimitConfig) -> Self {
        let make = |rate: Option<NonZeroU32>| {
            rate.map(|r| {
                let burst = config.burst_for(r);
                (Quota::per_second(r).allow_burst(burst), burst)
            })
        };
        Self {
            global: make(config.global()).map(|(q, b)| (RateLimiter::direct(q), b)),
            per_stream: make(config.per_stream()).map(|(q, b)| (RateLimiter::keyed(q), b)),
        }
    }

    /// Waits until `n` entries may be appended to `stream`. Returns true when it had to wait.
    pub async fn acquire(&self, stream: &str, n: usize) -> bool {
        let mut waited = false;
        let mut left = u32::try_from(n).unwrap_or(u32::MAX);
        while left > 0 {
            // Take at most one burst at a time: governor refuses more than its burst at once.
            let cap = [
                self.global.as_ref().map(|g| g.1),
                self.per_stream.as_ref().map(|p| p.1),
            ]
            .into_iter()
            .flatten()
            .map(NonZeroU32::get)
            .min()
            .unwrap_or(left);
            let take = left.min(cap);
            let Some(cells) = NonZeroU32::new(take) else {
                break;
            };
            if let Some((l, _)) = &self.per_stream {
                let key = stream.to_owned();
                if l.check_key_n(&key, cells)
                    .map(|r| r.is_err())
                    .unwrap_or(true)
                {
                    waited = true;
                    let _ = l.until_key_n_ready(&key, cells).await;
                }
            }
            if let Some((l, _)) = &self.global
                && l.check_n(cells).map(|r| r.is_err()).unwrap_or(true)
            {
                waited = true;
                let _ = l.until_n_ready(cells).await;
            }
            left -= take;
        }
        waited
    }
}
