//! Who watches what (leader/followers): the bookkeeping that lets a caller
//! waiting for its own result read the targets' replies itself, so that a
//! round trip wakes no thread but the caller and the target.
//!
//! A started Worker has two kinds of reader of its targets' reply sockets:
//!
//! * the IO thread, which always watches the wake pipe and every target's
//!   pidfd, the control socket of every target with unsent bytes, and the
//!   earliest deadline; and the reply sockets when a reply is expected and
//!   no leader reads them;
//! * at most one **leader**: a caller waiting for its own result that found
//!   no leader. It reads the reply sockets of every target live when it began
//!   to lead, and handles the deadlines up to the one it polls with, until
//!   its result is there (or its wait times out); then it steps down.
//!
//! Every other waiting caller is a follower: it sleeps on its completion
//! hand-off ([`super::handoff`]) until whoever reads its reply hands the
//! result over.
//!
//! The rule that makes this safe: whenever a thread other than the IO
//! thread leaves the state lock, it checks [`Watch::io_must_wake`] with
//! what it leaves behind and writes the wake pipe if it says so. So every
//! reply that is expected is read by someone, every deadline is handled
//! by someone, and no follower waits for a reply nobody reads.
//!
//! Results are decided under the state lock and handed over after it is
//! released, and a caller tells that its result is there by its hand-off.
//! So a thread that decided results while not leading (the IO thread, a
//! caller whose request ended a target) hands them over first and only
//! then, under the lock again, wakes the leader if one leads: a leader
//! that began before that check is woken and finds its hand-off complete;
//! one that began after it finds its hand-off complete before it first
//! polls. (Woken before the hand-over, a leader could find its hand-off
//! incomplete and poll again for a reply already read.)
//!
//! The state lock guards a `Watch`; it has no IO of its own. The rule
//! itself, the leader's wait ([`lead`]), stepping down ([`step_down`]),
//! leaving the lock ([`release`]) and what is owed after it ([`finish`]),
//! is code generic over the state lock ([`StateLock`], [`Locked`]) and the
//! OS pieces ([`Poller`]: `poll`, a wake pipe's drain and ring). The
//! Worker runs it with `poll(2)` over its pipes and sockets; loom checks
//! the same functions (`tests/loom_lead.rs`) with a model of `poll` over
//! level-triggered pipes.
//!
//! Every thread's part in each event (submit, reply, deadline, loss,
//! close, callback, cancel), with its locks and wake-ups: `specs/threads.md`.

use std::time::Instant;

use nix::unistd::Pid;

pub(crate) mod os;
mod run;

#[doc(hidden)]
pub use run::Mutation;
pub use run::{
    finish, lead, release, step_down, Locked, Owed, PollFailed, Poller, Readiness, StateLock,
};

/// A link to one target's process, named by the target's index and the
/// process id: a link lost and replaced (a new process for the same
/// target) is a different link.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct LinkId {
    /// The target's index.
    pub index: usize,
    /// The process id of the target's current process.
    pub pid: Pid,
}

impl LinkId {
    /// The link to process `pid` of the target at `index`.
    pub const fn new(index: usize, pid: Pid) -> Self {
        LinkId { index, pid }
    }
}

/// Per target index: the process whose socket is watched, if any.
type Watched = Vec<Option<Pid>>;

/// What the IO thread and the leader each watch, per target index: the
/// process (the link, [`LinkId`]) whose socket is watched, if any.
#[derive(Debug, Default)]
pub struct Watch {
    /// Per index: the process whose reply socket the IO thread's current
    /// `poll` reads, if any.
    io_replies: Watched,
    /// Per index: the process whose control socket the IO thread's current
    /// `poll` waits to write, if any.
    io_controls: Watched,
    /// When the IO thread's current `poll` returns at the latest (`None`:
    /// only an event ends it).
    io_deadline: Option<Instant>,
    leader: Option<Leader>,
}

#[derive(Debug)]
struct Leader {
    /// Per index: the process whose reply socket the leader reads, if any.
    replies: Watched,
    /// When the leader's current `poll` returns at the latest.
    deadline: Option<Instant>,
}

/// What a thread leaving the state lock leaves for others to watch.
#[derive(Clone, Copy, Debug)]
pub struct Left<'a> {
    /// Every live link.
    pub live: &'a [LinkId],
    /// Whether any reply is expected from any target (a task, a control,
    /// an inspection, a ready report).
    pub expecting: bool,
    /// Links with control bytes not yet written.
    pub unsent: &'a [LinkId],
    /// The earliest deadline anything waits on.
    pub deadline: Option<Instant>,
    /// Whether the IO thread has work of its own queued (payloads to free
    /// off the callers' path).
    pub chores: bool,
}

/// Whether `watched` watches `link` (its index, with its process).
fn watches(watched: &[Option<Pid>], link: LinkId) -> bool {
    watched.get(link.index).copied().flatten() == Some(link.pid)
}

/// `watched` watches `link` (in place of any other process at its index).
fn watch(watched: &mut Watched, link: LinkId) {
    if watched.len() <= link.index {
        watched.resize(link.index + 1, None);
    }
    watched[link.index] = Some(link.pid);
}

fn earlier(a: Option<Instant>, than: Option<Instant>) -> bool {
    match (a, than) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(a), Some(b)) => a < b,
    }
}

impl Watch {
    /// Whether a leader reads the reply socket of `link`.
    pub fn leader_reads(&self, link: LinkId) -> bool {
        self.leader
            .as_ref()
            .is_some_and(|l| watches(&l.replies, link))
    }

    /// Whether the IO thread's current `poll` reads the reply socket of
    /// `link`.
    pub fn io_reads(&self, link: LinkId) -> bool {
        watches(&self.io_replies, link)
    }

    /// Whether the IO thread's current `poll` reads the reply socket of every
    /// link of `live` (and there is one): a caller then follows rather
    /// than lead, or both would be woken by every reply.
    pub fn io_reads_all(&self, live: &[LinkId]) -> bool {
        !live.is_empty() && live.iter().all(|&link| self.io_reads(link))
    }

    /// Whether someone (the IO thread's current `poll` or the leader)
    /// reads the reply socket of `link`.
    pub fn reads(&self, link: LinkId) -> bool {
        self.io_reads(link) || self.leader_reads(link)
    }

    /// Whether a leader leads.
    pub fn has_leader(&self) -> bool {
        self.leader.is_some()
    }

    /// The IO thread's plan for its next `poll`, recorded: it reads the
    /// reply socket of every live link no leader reads when a reply is
    /// expected, writes every link with unsent bytes, and returns by
    /// `deadline` at the latest. Returns which links' reply sockets to read.
    pub fn plan_io(
        &mut self,
        live: &[LinkId],
        expecting: bool,
        unsent: &[LinkId],
        deadline: Option<Instant>,
    ) -> Vec<LinkId> {
        self.io_replies.fill(None);
        self.io_controls.fill(None);
        let mut reads = Vec::new();
        if expecting {
            for &link in live {
                if !self.leader_reads(link) {
                    watch(&mut self.io_replies, link);
                    reads.push(link);
                }
            }
        }
        for &link in unsent {
            watch(&mut self.io_controls, link);
        }
        self.io_deadline = deadline;
        reads
    }

    /// Makes the calling thread the leader, reading every link of `live`,
    /// unless a leader leads already (`false`: follow).
    pub fn try_lead(&mut self, live: &[LinkId]) -> bool {
        if self.leader.is_some() {
            return false;
        }
        self.leader = Some(Leader {
            replies: Vec::new(),
            deadline: None,
        });
        self.relead(live);
        true
    }

    /// The leader's links changed (one lost, one replaced): it now reads
    /// every link of `live`.
    pub fn relead(&mut self, live: &[LinkId]) {
        if let Some(leader) = &mut self.leader {
            leader.replies.fill(None);
            for &link in live {
                watch(&mut leader.replies, link);
            }
        }
    }

    /// Whether the leader reads exactly the links of `live`.
    pub fn leads_over(&self, live: &[LinkId]) -> bool {
        let Some(leader) = &self.leader else {
            return false;
        };
        let count = leader.replies.iter().flatten().count();
        count == live.len() && live.iter().all(|&link| watches(&leader.replies, link))
    }

    /// The leader's next `poll` returns by `deadline` at the latest.
    pub fn set_leader_deadline(&mut self, deadline: Option<Instant>) {
        if let Some(leader) = &mut self.leader {
            leader.deadline = deadline;
        }
    }

    /// The leader stops leading.
    pub fn step_down(&mut self) {
        self.leader = None;
    }

    /// Whether the IO thread must be woken to rebuild its `poll` for what a
    /// thread leaving the state lock leaves behind: an expected reply on a
    /// link nobody reads, unsent bytes the IO thread does not wait to
    /// write, a deadline earlier than both the IO thread's and the
    /// leader's, or chores of its own.
    pub fn io_must_wake(&self, left: Left<'_>) -> bool {
        if left.chores {
            return true;
        }
        if left.expecting && left.live.iter().any(|&link| !self.reads(link)) {
            return true;
        }
        if left
            .unsent
            .iter()
            .any(|&link| !watches(&self.io_controls, link))
        {
            return true;
        }
        let watched = match (&self.leader, self.io_deadline) {
            (
                Some(Leader {
                    deadline: Some(l), ..
                }),
                Some(io),
            ) => Some((*l).min(io)),
            (
                Some(Leader {
                    deadline: Some(l), ..
                }),
                None,
            ) => Some(*l),
            (_, io) => io,
        };
        earlier(left.deadline, watched)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The link to process `pid` of target `index`.
    const fn link(index: usize, pid: i32) -> LinkId {
        LinkId::new(index, Pid::from_raw(pid))
    }

    const LIVE: &[LinkId] = &[link(0, 100), link(1, 101)];

    fn left(expecting: bool, deadline: Option<Instant>) -> Left<'static> {
        Left {
            live: LIVE,
            expecting,
            unsent: &[],
            deadline,
            chores: false,
        }
    }

    #[test]
    fn nothing_expected_needs_no_reader() {
        let watch = Watch::default();
        assert!(!watch.io_must_wake(left(false, None)));
    }

    #[test]
    fn an_expected_reply_nobody_reads_wakes_the_io_thread() {
        let mut watch = Watch::default();
        assert!(watch.io_must_wake(left(true, None)));
        // The IO thread's plan with nothing expected reads no reply socket.
        assert_eq!(watch.plan_io(LIVE, false, &[], None), vec![]);
        assert!(watch.io_must_wake(left(true, None)));
        assert_eq!(watch.plan_io(LIVE, true, &[], None), LIVE.to_vec());
        assert!(!watch.io_must_wake(left(true, None)));
    }

    #[test]
    fn a_leader_reads_every_link_live_when_it_began() {
        let mut watch = Watch::default();
        assert!(watch.try_lead(LIVE));
        assert!(!watch.try_lead(LIVE), "a second leader");
        assert!(!watch.io_must_wake(left(true, None)));
        // The IO thread leaves the leader's links alone.
        assert_eq!(watch.plan_io(LIVE, true, &[], None), vec![]);
        // A replacement for target 1 is a link the leader does not read.
        let replaced = [link(0, 100), link(1, 202)];
        let after = Left {
            live: &replaced,
            ..left(true, None)
        };
        assert!(watch.io_must_wake(after));
        assert!(!watch.leads_over(&replaced));
        watch.relead(&replaced);
        assert!(watch.leads_over(&replaced));
        assert!(!watch.io_must_wake(after));
        // Stepping down hands everything back to the IO thread.
        watch.step_down();
        assert!(watch.io_must_wake(after));
        assert!(watch.try_lead(&replaced));
    }

    #[test]
    fn an_earlier_deadline_than_any_poller_watches_wakes_the_io_thread() {
        let now = Instant::now();
        let soon = now + Duration::from_secs(1);
        let later = now + Duration::from_secs(2);
        let mut watch = Watch::default();
        assert!(watch.io_must_wake(left(false, Some(later))));
        watch.plan_io(LIVE, false, &[], Some(later));
        assert!(!watch.io_must_wake(left(false, Some(later))));
        assert!(watch.io_must_wake(left(false, Some(soon))));
        assert!(watch.try_lead(LIVE));
        watch.set_leader_deadline(Some(soon));
        assert!(!watch.io_must_wake(left(false, Some(soon))));
        assert!(watch.io_must_wake(left(false, Some(now))));
    }

    #[test]
    fn unsent_bytes_wake_the_io_thread_unless_it_waits_to_write_them() {
        let mut watch = Watch::default();
        let unsent = [link(1, 101)];
        let with_unsent = Left {
            unsent: &unsent,
            ..left(false, None)
        };
        assert!(watch.io_must_wake(with_unsent));
        watch.plan_io(LIVE, false, &unsent, None);
        assert!(!watch.io_must_wake(with_unsent));
        // Another process for that target is another socket.
        let other = [link(1, 202)];
        assert!(watch.io_must_wake(Left {
            unsent: &other,
            ..left(false, None)
        }));
    }

    #[test]
    fn a_caller_follows_while_the_io_thread_reads_every_link() {
        let mut watch = Watch::default();
        assert!(!watch.io_reads_all(LIVE));
        watch.plan_io(LIVE, true, &[], None);
        assert!(watch.io_reads_all(LIVE));
        assert!(!watch.io_reads_all(&[]));
        // A link it does not read (a replacement) is one to lead for.
        assert!(!watch.io_reads_all(&[link(0, 100), link(1, 202)]));
        watch.plan_io(LIVE, false, &[], None);
        assert!(!watch.io_reads_all(LIVE));
    }

    #[test]
    fn chores_always_wake_the_io_thread() {
        let watch = Watch::default();
        assert!(watch.io_must_wake(Left {
            chores: true,
            ..left(false, None)
        }));
    }
}
