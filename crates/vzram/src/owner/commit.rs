//! The source's commit rule, in one place: once the destination holds
//! every page, what the sender has seen decides whether the move commits
//! (the destination serves, this end drops its pages), aborts (the
//! destination drops its copy) or waits. Only positive evidence that the
//! VM runs on the destination commits: its frontend started the rings
//! (it says so on the stream), or an operator's `vzram migrate --commit`
//! given after the last delta. A pause, a disconnect or a QEMU exit here
//! commits nothing. ARCHITECTURE.md ("Migration states") lists every
//! event and what it does.

use std::time::{Duration, Instant};

use vzram_store::cells::Ask;
use vzram_store::migrate::Verdict;

/// How long the verdict stays open after the frontend here has gone
/// without the destination's VM starting: a QEMU that exits after a
/// migration does so once the destination runs (libvirt's Confirm comes
/// after its Finish), so a longer silence means a save, a shutdown or a
/// crash, and the VM's pages stay here.
pub const GONE_GRACE: Duration = Duration::from_secs(10);

/// What the sender sees at one look, while the verdict is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// Rings the frontend here has started so far.
    pub starts: u64,
    /// Nothing here can write (no ring running, or no frontend).
    pub quiet: bool,
    /// The frontend here has gone.
    pub gone: bool,
    /// What the operator asked.
    pub ask: Ask,
    /// The destination said its frontend started the rings.
    pub started_there: bool,
}

/// The verdict's state, from the last delta on.
#[derive(Debug)]
pub struct Commitment {
    /// Ring starts counted when the device went quiet for the last delta:
    /// any later start means the VM ran here after it.
    at_quiet: u64,
    /// No frontend was here when the send began (a cold move): its
    /// absence is no QEMU exit, and only the destination's start or the
    /// operator ends the wait.
    cold: bool,
    /// When the frontend here was first seen gone.
    gone_since: Option<Instant>,
    grace: Duration,
}

impl Commitment {
    pub fn new(at_quiet: u64, cold: bool, grace: Duration) -> Commitment {
        Commitment {
            at_quiet,
            cold,
            gone_since: None,
            grace,
        }
    }

    /// The verdict on what was seen at `now`.
    pub fn decide(&mut self, s: &Seen, now: Instant) -> Verdict {
        if s.ask == Ask::Cancel {
            return Verdict::Abort(CANCELLED.into());
        }
        // Whichever side's rings start first wins; a start here counts
        // even if the rings stopped again before this look.
        if s.starts != self.at_quiet || !s.quiet {
            return Verdict::Abort(STARTED_HERE.into());
        }
        if s.started_there || s.ask == Ask::Commit {
            return Verdict::Commit;
        }
        if s.gone && !self.cold {
            let since = *self.gone_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= self.grace {
                return Verdict::Abort(format!(
                    "the VM's frontend left here and the destination's did not start its rings within {:?} (a save, a shutdown, a crash: not a migration): this end keeps every page",
                    self.grace
                ));
            }
        }
        Verdict::Wait
    }
}

/// Why a send ends on the operator's `--cancel`.
pub const CANCELLED: &str = "cancelled by the operator (`vzram migrate --cancel`): the VM runs here, and this end keeps every page";

/// Why a send ends when the rings here start after the last delta.
pub const STARTED_HERE: &str = "the VM's rings started again here after the last delta (a `cont`, a cancelled or failed migration, a reboot): it runs here, and this end keeps every page";

#[cfg(test)]
mod tests {
    use super::*;

    fn seen() -> Seen {
        Seen {
            starts: 3,
            quiet: true,
            gone: false,
            ask: Ask::None,
            started_there: false,
        }
    }

    #[test]
    fn only_the_destination_start_or_the_operator_commits() {
        let now = Instant::now();
        let mut c = Commitment::new(3, false, GONE_GRACE);
        assert_eq!(c.decide(&seen(), now), Verdict::Wait);
        let there = Seen {
            started_there: true,
            ..seen()
        };
        assert_eq!(c.decide(&there, now), Verdict::Commit);
        let asked = Seen {
            ask: Ask::Commit,
            ..seen()
        };
        assert_eq!(c.decide(&asked, now), Verdict::Commit);
    }

    #[test]
    fn a_start_here_wins_even_if_the_rings_stopped_again() {
        let now = Instant::now();
        let mut c = Commitment::new(3, false, GONE_GRACE);
        // Started and stopped again before this look, the destination
        // meanwhile started too, and the operator asked to commit.
        let s = Seen {
            starts: 4,
            started_there: true,
            ask: Ask::Commit,
            ..seen()
        };
        assert!(matches!(c.decide(&s, now), Verdict::Abort(_)));
    }

    #[test]
    fn a_frontend_that_leaves_aborts_after_the_grace_unless_the_move_was_cold() {
        let t0 = Instant::now();
        let gone = Seen {
            gone: true,
            ..seen()
        };
        let mut c = Commitment::new(3, false, GONE_GRACE);
        assert_eq!(c.decide(&gone, t0), Verdict::Wait);
        assert_eq!(c.decide(&gone, t0 + GONE_GRACE / 2), Verdict::Wait);
        assert!(matches!(
            c.decide(&gone, t0 + GONE_GRACE),
            Verdict::Abort(_)
        ));
        let mut cold = Commitment::new(3, true, GONE_GRACE);
        assert_eq!(cold.decide(&gone, t0), Verdict::Wait);
        assert_eq!(cold.decide(&gone, t0 + GONE_GRACE * 10), Verdict::Wait);
    }
}
