//! When to poll and when to ask producers for a nudge.
//!
//! One NOTIFY per committing transaction serialises producers' commits, so a node only asks for
//! nudges when it has found no work for a while. The protocol:
//!
//! - **Busy**: the node polls for ready rows every `busy_poll` (the supervisor counts the pause
//!   from the start of the previous poll). Producers pay nothing; the pause is what a new event
//!   waits for.
//! - When polls have found nothing for `idle_after`, the node **enters idle**: it sets
//!   `wants_nudge` (producers start to NOTIFY), then polls once more, so a commit that landed
//!   before the flag was visible is not missed.
//! - **Idle**: the node waits for a nudge or for the scheduled poll (the supervisor's heartbeat
//!   tick; a missed nudge only waits for it). A nudge or a poll that finds work makes it
//!   **leave idle**: it clears `wants_nudge` and is busy again.
//!
//! Under a dense flow the node stays busy and producers never notify; under a sparse one (gaps
//! longer than `idle_after` between events) each event is nudged, which costs producers nothing
//! measurable at such rates and reaches the node sooner than a poll would.
//!
//! A flow whose pauses are only just longer than `idle_after` (producers writing large
//! transactions stall together on their commits' WAL flushes for tens of milliseconds) would
//! make the node go idle and come back at every pause, and each time the transactions under way
//! NOTIFY. So the wait before going idle **adapts**: when an idle spell ends sooner than the
//! wait that led to it, the node went idle too early and the next wait doubles, up to
//! [`MAX_IDLE_AFTER_FACTOR`] × `idle_after`; when a spell lasts longer than the wait, the wait
//! halves back towards `idle_after`. A sparse flow keeps the short wait, a dense one with pauses
//! stops flapping after a few spells. The state machine is pure: the caller performs the
//! [`Action`]s.

use std::time::{Duration, Instant};

/// Timing of the wake-up protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WakePolicy {
    /// Pause between polls while busy (`relay.busy_poll_ms`).
    pub busy_poll: Duration,
    /// How long without work before asking for nudges (`relay.idle_after_ms`).
    pub idle_after: Duration,
}

/// What the caller must do after an observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing beyond waiting [`Wakeup::next_wait`].
    None,
    /// Set `wants_nudge = true` (the supervisor does only while it delivers some partition),
    /// then poll again at once.
    AskForNudges,
    /// Set `wants_nudge = false`.
    StopNudges,
}

/// How far the wait before going idle may grow, as a multiple of `idle_after`.
pub const MAX_IDLE_AFTER_FACTOR: u32 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Busy { since_work: Instant },
    Idle { since: Instant },
}

/// The wake-up state of one node.
#[derive(Debug, Clone)]
pub struct Wakeup {
    policy: WakePolicy,
    mode: Mode,
    /// The current wait before going idle: `idle_after`, or more while the flow's pauses keep
    /// ending idle spells early.
    idle_after: Duration,
}

impl Wakeup {
    /// Starts busy: a starting node first looks for work.
    pub fn new(policy: WakePolicy, now: Instant) -> Self {
        Self {
            policy,
            mode: Mode::Busy { since_work: now },
            idle_after: policy.idle_after,
        }
    }

    /// True while producers are asked to NOTIFY.
    pub fn is_idle(&self) -> bool {
        matches!(self.mode, Mode::Idle { .. })
    }

    /// The current wait without work before going idle (see the module's notes).
    pub fn idle_after(&self) -> Duration {
        self.idle_after
    }

    /// Leaves idle at `now`, adapting the wait before the next idle spell to how long this one
    /// lasted.
    fn wake(&mut self, now: Instant) -> Action {
        let Mode::Idle { since } = self.mode else {
            self.mode = Mode::Busy { since_work: now };
            return Action::None;
        };
        let spell = now.saturating_duration_since(since);
        let base = self.policy.idle_after;
        self.idle_after = if spell < self.idle_after {
            (self.idle_after * 2).min(base * MAX_IDLE_AFTER_FACTOR)
        } else {
            (self.idle_after / 2).max(base)
        };
        self.mode = Mode::Busy { since_work: now };
        Action::StopNudges
    }

    /// Records the outcome of a poll.
    pub fn polled(&mut self, found_work: bool, now: Instant) -> Action {
        match (self.mode, found_work) {
            (Mode::Busy { .. }, true) => {
                self.mode = Mode::Busy { since_work: now };
                Action::None
            }
            (Mode::Busy { since_work }, false) => {
                if now.saturating_duration_since(since_work) >= self.idle_after {
                    self.mode = Mode::Idle { since: now };
                    Action::AskForNudges
                } else {
                    Action::None
                }
            }
            (Mode::Idle { .. }, true) => self.wake(now),
            (Mode::Idle { .. }, false) => Action::None,
        }
    }

    /// Records a nudge from a producer.
    pub fn nudged(&mut self, now: Instant) -> Action {
        self.wake(now)
    }

    /// The request for nudges ([`Action::AskForNudges`]) failed: producers will not NOTIFY, so
    /// the node is busy again at `now`, polling, and asks again after the wait before going
    /// idle, doubled (up to [`MAX_IDLE_AFTER_FACTOR`] × `idle_after`), so a request that keeps
    /// failing is not repeated at every short pause.
    pub fn ask_failed(&mut self, now: Instant) {
        if self.is_idle() {
            self.mode = Mode::Busy { since_work: now };
            self.idle_after =
                (self.idle_after * 2).min(self.policy.idle_after * MAX_IDLE_AFTER_FACTOR);
        }
    }

    /// How long to wait before the next poll: `busy_poll` while busy; `None` while idle, when
    /// only a nudge or the caller's scheduled poll ends the wait.
    pub fn next_wait(&self) -> Option<Duration> {
        match self.mode {
            Mode::Busy { .. } => Some(self.policy.busy_poll),
            Mode::Idle { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> WakePolicy {
        WakePolicy {
            busy_poll: Duration::from_millis(2),
            idle_after: Duration::from_millis(20),
        }
    }

    #[test]
    fn busy_node_never_asks_for_nudges() {
        let t0 = Instant::now();
        let mut w = Wakeup::new(policy(), t0);
        for i in 0..10_000u64 {
            let now = t0 + Duration::from_millis(i * 2);
            assert_eq!(w.polled(true, now), Action::None);
            assert_eq!(w.next_wait(), Some(Duration::from_millis(2)));
        }
        assert!(!w.is_idle());
    }

    #[test]
    fn empty_polls_keep_the_pace_then_go_idle_once() {
        let t0 = Instant::now();
        let mut w = Wakeup::new(policy(), t0);
        let mut now = t0;
        let mut asked = Vec::new();
        for i in 0..30 {
            let Some(wait) = w.next_wait() else { break };
            assert_eq!(wait, Duration::from_millis(2), "poll {i}");
            now += wait;
            if w.polled(false, now) == Action::AskForNudges {
                asked.push(now - t0);
            }
        }
        assert_eq!(
            asked,
            [Duration::from_millis(20)],
            "asks for nudges once, after idle_after"
        );
        assert!(w.is_idle());
        assert_eq!(
            w.next_wait(),
            None,
            "idle: only a nudge or the scheduled poll"
        );
        assert_eq!(w.polled(false, now + Duration::from_secs(1)), Action::None);
    }

    #[test]
    fn a_failed_request_for_nudges_keeps_polling_and_asks_again() {
        let t0 = Instant::now();
        let mut w = Wakeup::new(policy(), t0);
        let went_idle = t0 + Duration::from_millis(20);
        assert_eq!(w.polled(false, went_idle), Action::AskForNudges);
        w.ask_failed(went_idle);
        assert!(!w.is_idle(), "busy again: producers were not asked");
        assert_eq!(w.next_wait(), Some(Duration::from_millis(2)));
        assert_eq!(w.idle_after(), Duration::from_millis(40), "a longer wait");
        assert_eq!(
            w.polled(false, went_idle + Duration::from_millis(39)),
            Action::None
        );
        assert_eq!(
            w.polled(false, went_idle + Duration::from_millis(40)),
            Action::AskForNudges,
            "asks again after the longer wait"
        );
        let mut now = went_idle + Duration::from_millis(40);
        w.ask_failed(now);
        for _ in 0..10 {
            now += Duration::from_secs(1);
            assert_eq!(w.polled(false, now), Action::AskForNudges);
            w.ask_failed(now);
        }
        assert_eq!(
            w.idle_after(),
            Duration::from_millis(20) * MAX_IDLE_AFTER_FACTOR,
            "up to the cap"
        );
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
        assert_eq!(w.next_wait(), Some(Duration::from_millis(2)));
        // Work or a nudge while busy restarts the count towards idle.
        let t = later + Duration::from_secs(2);
        assert_eq!(w.nudged(t + Duration::from_millis(15)), Action::None);
        assert_eq!(w.polled(false, t + Duration::from_millis(30)), Action::None);
        assert_eq!(
            w.polled(false, t + Duration::from_millis(35)),
            Action::AskForNudges
        );
    }

    /// Goes idle after `w.idle_after()` without work from `start` (polling every `busy_poll`),
    /// then is nudged `pause` after that: returns when it went idle.
    fn spell(w: &mut Wakeup, start: Instant, pause: Duration) -> Instant {
        assert_eq!(w.polled(true, start), Action::None);
        let mut now = start;
        loop {
            now += w.next_wait().expect("busy");
            if w.polled(false, now) == Action::AskForNudges {
                break;
            }
        }
        assert_eq!(w.nudged(now + pause), Action::StopNudges);
        now
    }

    #[test]
    fn idle_spells_cut_short_lengthen_the_wait_and_long_ones_shorten_it() {
        let t0 = Instant::now();
        let base = policy().idle_after;
        let mut w = Wakeup::new(policy(), t0);
        // Pauses of 25 ms in a dense flow: each idle spell ends 5 ms in, sooner than the wait
        // before it, so the wait doubles until the pauses no longer make the node idle.
        let mut t = t0;
        let mut waits = Vec::new();
        for _ in 0..3 {
            let went_idle = spell(&mut w, t, Duration::from_millis(5));
            waits.push(went_idle - t);
            t = went_idle + Duration::from_millis(5);
        }
        assert_eq!(
            waits,
            [base, base * 2, base * 4],
            "went idle after 20, 40, 80 ms"
        );
        assert_eq!(w.idle_after(), base * 8);
        // Now 25 ms pauses keep it busy: no spell.
        assert_eq!(w.polled(true, t), Action::None);
        assert_eq!(w.polled(false, t + Duration::from_millis(25)), Action::None);
        // It never grows past the cap.
        for _ in 0..10 {
            let went_idle = spell(&mut w, t, Duration::ZERO);
            t = went_idle + Duration::from_millis(1);
        }
        assert_eq!(w.idle_after(), base * MAX_IDLE_AFTER_FACTOR);
        // A sparse flow (spells longer than the wait) brings it back down to `idle_after`.
        for _ in 0..10 {
            let went_idle = spell(&mut w, t, Duration::from_secs(1));
            t = went_idle + Duration::from_secs(1);
        }
        assert_eq!(w.idle_after(), base);
    }

    /// Random schedules of polls and nudges (seeded, so a failure replays): producers are asked
    /// for nudges only on the way from busy to idle and released only on the way back, the two
    /// alternate, and a busy node always polls again after `busy_poll`.
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
                now += Duration::from_millis(rng.random_range(0..30));
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
                let want = (!w.is_idle()).then_some(p.busy_poll);
                assert_eq!(w.next_wait(), want, "seed {seed}");
            }
        }
    }
}
