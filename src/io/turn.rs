//! Turns at a shared reader's state that no thread waits for: the
//! target's control socket is read by whichever of its task thread and
//! reader the kernel wakes (`specs/threads.md`, "Who reads the control
//! socket"), one at a time; a thread that finds the other reading leaves
//! its turn to it rather than wait for it. Checked with loom
//! (`tests/loom_turn.rs`).

use crate::sync::{lock, Mutex};

/// Who has the turn, and whether a thread asked for one meanwhile.
struct Flags {
    busy: bool,
    asked: bool,
}

/// State that one thread at a time works on (the intake's frame buffer),
/// where a thread asking for a turn while another has it never waits for
/// it: the thread that has it takes one more turn for it.
///
/// The rule: a thread asking for a turn while another has it records the
/// ask and returns; the thread that has it looks at the asks after each
/// turn and takes one more when there was one. So every ask is followed
/// by a turn that begins after it, by the asker or by the thread that had
/// the turn. Why it matters: the turn reads what a socket holds, and an
/// ask means something arrived; a turn that began before the ask could
/// have missed it.
///
/// The flags are under a lock held for a few instructions, never during a
/// turn; the state under one only the thread that has the turn locks, so
/// it is never contended.
pub struct Turns<T> {
    flags: Mutex<Flags>,
    state: Mutex<T>,
}

impl<T> Turns<T> {
    /// Turns at `state`.
    pub fn new(state: T) -> Turns<T> {
        Turns {
            flags: Mutex::new(Flags {
                busy: false,
                asked: false,
            }),
            state: Mutex::new(state),
        }
    }

    /// Runs `turn` on the state, now in this thread, or, when another
    /// thread has the turn, in that thread once its turn is over (`turn`
    /// is then not called here). Never waits for another thread's turn.
    /// A turn that panics gives the turn up all the same (and the asks
    /// with it), and the state is taken as it is then (turns leave it
    /// consistent between statements).
    pub fn take(&self, mut turn: impl FnMut(&mut T)) {
        {
            let mut flags = lock(&self.flags);
            if flags.busy {
                flags.asked = true;
                return;
            }
            flags.busy = true;
        }
        let give_up = GiveUp(self);
        loop {
            turn(&mut lock(&self.state));
            let mut flags = lock(&self.flags);
            if !std::mem::replace(&mut flags.asked, false) {
                flags.busy = false;
                drop(flags);
                std::mem::forget(give_up);
                return;
            }
        }
    }
}

/// Gives the turn up when a turn panics.
struct GiveUp<'a, T>(&'a Turns<T>);

impl<T> Drop for GiveUp<'_, T> {
    fn drop(&mut self) {
        let mut flags = lock(&self.0.flags);
        flags.busy = false;
        flags.asked = false;
    }
}
