//! When to poll and when to ask producers for a nudge.
//!
//! One NOTIFY per committing transaction serialises producers' commits, so a node only asks for
//! nudges when it has been idle for a while. The protocol:
//!
//! - **Busy**: the node polls for ready partitions. The pause between polls starts at
//!   `busy_poll` and doubles after every empty poll, up to [`BUSY_CEILING`] × `busy_poll` (and
//!   never past `poll_interval`); any work found resets it. Producers pay nothing, so while busy
//!   the pause is what a new event waits for: the ceiling keeps that wait short under a sparse
//!   flow (commits tens of milliseconds apart never let the node go idle), at the cost of a few
//!   more empty polls before idling.
//! - When polls have found nothing for `idle_after`, the node **enters idle**: it sets
//!   `wants_nudge` (producers start to NOTIFY), then polls once more, so a commit that landed
//!   before the flag was visible is not missed.
//! - **Idle**: the node waits for a nudge or for the scheduled poll (the supervisor's heartbeat
//!   tick; a missed nudge only waits for it). A nudge or a poll that finds work makes it
//!   **leave idle**: it clears `wants_nudge` and is busy again.
//!
//! The state machine is pure: the caller performs the [`Action`]s.

use std::time::{Duration, Instant};

/// Timing of the wake-up protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WakePolicy {
    /// First pause between polls while busy (`relay.busy_poll_ms`).
    pub busy_poll: Duration,
    /// How long without work before asking for nudges (`relay.idle_after_ms`).
    pub idle_after: Duration,
    /// Ceiling of the busy back-off when lower than [`BUSY_CEILING`] × `busy_poll`
    /// (`relay.poll_interval_ms`); while idle, [`Wakeup::next_wait`] returns it, for callers
    /// without a scheduled poll of their own.
    pub poll_interval: Duration,
}

/// The busy back-off stops growing at this multiple of `busy_poll` (16 ms with the default
/// 2 ms). Without it the pause could double up to `poll_interval` (1 s by default) in the gaps
/// of a sparse flow; at 2,000 events/s in transactions of 10 (`docs/benchmarks.md`) p99 was
/// 12–59 ms and the slowest event 33–137 ms, against 10 and 20 ms with it.
pub const BUSY_CEILING: u32 = 8;

/// What the caller must do after an observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing beyond waiting [`Wakeup::next_wait`].
    None,
    /// Set `wants_nudge = true`, then poll again at once.
    AskForNudges,
    /// Set `wants_nudge = false`.
    StopNudges,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Busy {
        since_work: Instant,
        pause: Duration,
    },
    Idle,
}

/// The wake-up state of one node.
#[derive(Debug, Clone)]
pub struct Wakeup {
    policy: WakePolicy,
    mode: Mode,
}

impl Wakeup {
    /// Starts busy: a starting node first looks for work.
    pub fn new(policy: WakePolicy, now: Instant) -> Self {
        Self {
            policy,
            mode: Mode::Busy {
                since_work: now,
                pause: policy.busy_poll,
            },
        }
    }

    /// True while producers are asked to NOTIFY.
    pub fn is_idle(&self) -> bool {
        self.mode == Mode::Idle
    }

    /// Records the outcome of a poll.
    pub fn polled(&mut self, found_work: bool, now: Instant) -> Action {
        match (self.mode, found_work) {
            (Mode::Busy { .. }, true) => {
                self.mode = self.busy(now);
                Action::None
            }
            (Mode::Busy { since_work, pause }, false) => {
                if now.saturating_duration_since(since_work) >= self.policy.idle_after {
                    self.mode = Mode::Idle;
                    Action::AskForNudges
                } else {
                    self.mode = Mode::Busy {
                        since_work,
                        pause: (pause * 2).min(self.busy_ceiling()),
                    };
                    Action::None
                }
            }
            (Mode::Idle, true) => {
                self.mode = self.busy(now);
                Action::StopNudges
            }
            (Mode::Idle, false) => Action::None,
        }
    }

    /// Records a nudge from a producer.
    pub fn nudged(&mut self, now: Instant) -> Action {
        match self.mode {
            Mode::Idle => {
                self.mode = self.busy(now);
                Action::StopNudges
            }
            Mode::Busy { .. } => {
                self.mode = self.busy(now);
                Action::None
            }
        }
    }

    /// How long to wait before the next poll (a nudge may end the wait early).
    pub fn next_wait(&self) -> Duration {
        match self.mode {
            Mode::Busy { pause, .. } => pause,
            Mode::Idle => self.policy.poll_interval,
        }
    }

    fn busy_ceiling(&self) -> Duration {
        (self.policy.busy_poll * BUSY_CEILING)
            .min(self.policy.poll_interval)
            .max(self.policy.busy_poll)
    }

    fn busy(&self, now: Instant) -> Mode {
        Mode::Busy {
            since_work: now,
            pause: self.policy.busy_poll,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> WakePolicy {
        WakePolicy {
            busy_poll: Duration::from_millis(2),
            idle_after: Duration::from_millis(200),
            poll_interval: Duration::from_millis(500),
        }
    }

    #[test]
    fn busy_node_never_asks_for_nudges() {
        let t0 = Instant::now();
        let mut w = Wakeup::new(policy(), t0);
        for i in 0..10_000u64 {
            let now = t0 + Duration::from_millis(i * 2);
            assert_eq!(w.polled(true, now), Action::None);
            assert_eq!(w.next_wait(), Duration::from_millis(2));
        }
        assert!(!w.is_idle());
    }

    #[test]
    fn empty_polls_back_off_then_go_idle_once() {
        let t0 = Instant::now();
        let mut w = Wakeup::new(policy(), t0);
        let mut now = t0;
        let mut waits = Vec::new();
        let mut asked = 0;
        for _ in 0..20 {
            now += w.next_wait();
            waits.push(w.next_wait());
            if w.polled(false, now) == Action::AskForNudges {
                asked += 1;
            }
        }
        assert_eq!(asked, 1, "asks for nudges exactly once");
        assert!(w.is_idle());
        assert_eq!(
            &waits[..6],
            &[2, 4, 8, 16, 16, 16].map(Duration::from_millis)
        );
        // Idle: the scheduled poll, at most 2 per second.
        assert_eq!(w.next_wait(), Duration::from_millis(500));
    }

    #[test]
    fn nudge_or_found_work_leaves_idle() {
        let t0 = Instant::now();
        let mut w = Wakeup::new(policy(), t0);
        let later = t0 + Duration::from_secs(1);
        assert_eq!(w.polled(false, later), Action::AskForNudges);
        assert_eq!(w.nudged(later), Action::StopNudges);
        assert!(!w.is_idle());
        assert_eq!(
            w.polled(false, later + Duration::from_secs(1)),
            Action::AskForNudges
        );
        assert_eq!(
            w.polled(true, later + Duration::from_secs(2)),
            Action::StopNudges
        );
        assert_eq!(w.next_wait(), Duration::from_millis(2));
    }

    /// Random schedules of polls and nudges (seeded, so a failure replays): producers are asked
    /// for nudges only on the way from busy to idle and released only on the way back, the two
    /// alternate, and the wait always stays within the policy's bounds.
    #[test]
    fn random_schedules_keep_the_protocol() {
        use rand::{Rng, SeedableRng};
        for seed in 0..200u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let p = policy();
            let mut now = Instant::now();
            let mut w = Wakeup::new(p, now);
            let mut asking = false;
            for _ in 0..500 {
                now += Duration::from_millis(rng.random_range(0..300));
                let was_idle = w.is_idle();
                let action = if rng.random_bool(0.2) {
                    w.nudged(now)
                } else {
                    w.polled(rng.random_bool(0.3), now)
                };
                match action {
                    Action::AskForNudges => {
                        assert!(!was_idle && w.is_idle() && !asking, "seed {seed}");
                        asking = true;
                    }
                    Action::StopNudges => {
                        assert!(was_idle && !w.is_idle() && asking, "seed {seed}");
                        asking = false;
                    }
                    Action::None => assert_eq!(was_idle, w.is_idle(), "seed {seed}"),
                }
                assert_eq!(asking, w.is_idle(), "seed {seed}");
                let wait = w.next_wait();
                let ceiling = if w.is_idle() {
                    p.poll_interval
                } else {
                    p.busy_poll * BUSY_CEILING
                };
                assert!(wait >= p.busy_poll && wait <= ceiling, "seed {seed}");
            }
        }
    }
}
