//! Symmetry reduction over targets.
//!
//! Targets are interchangeable: no decision of either machine depends on a
//! target's id (ids only appear in messages). So a state and the same state
//! with its targets renumbered behave alike, and the checker needs to
//! explore only one of them. [`State::representative`] renumbers targets in
//! the order of a key made of everything the model sees of each target
//! (its machine renamed to id 0, the frames to it, the replies from it, its
//! end of file, the driver's bookkeeping, whether the parent counts it
//! live and which of its in-transit answers the parent awaits).
//!
//! Soundness does not depend on the key being complete: the representative
//! is always a renumbering of the state itself, so two states with the same
//! representative are renumberings of each other. An incomplete key only
//! leaves some symmetric states unmerged. Stateright 0.31 applies symmetry
//! in its depth-first checker only; `callreg-model check --symmetry`
//! therefore runs depth-first.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use callreg::protocol::TargetId;
use stateright::Representative;

use crate::model::State;

impl State {
    fn target_key(&self, id: TargetId) -> u64 {
        let index = usize::from(id.0);
        let mut hasher = DefaultHasher::new();
        self.targets[index]
            .as_ref()
            .map(|t| t.relabeled(TargetId(0)))
            .hash(&mut hasher);
        for (t, frame) in &self.frames {
            if *t == id {
                frame.hash(&mut hasher);
            }
        }
        for (t, reply) in &self.replies {
            if *t == id {
                reply.hash(&mut hasher);
                self.parent.awaits_reply(id, reply.seq).hash(&mut hasher);
            }
        }
        self.eof[index].hash(&mut hasher);
        self.sides[index].hash(&mut hasher);
        self.parent.is_target_live(id).hash(&mut hasher);
        hasher.finish()
    }

    /// This state with target `old` renamed `permutation[old]`.
    pub fn relabeled(&self, permutation: &[TargetId]) -> State {
        let map = |t: TargetId| permutation[usize::from(t.0)];
        let n = self.targets.len();
        let mut targets = vec![None; n];
        let mut eof = vec![false; n];
        let mut sides = vec![Default::default(); n];
        for (old, renamed) in permutation.iter().enumerate().take(n) {
            let new = usize::from(renamed.0);
            targets[new] = self.targets[old].as_ref().map(|t| t.relabeled(*renamed));
            eof[new] = self.eof[old];
            sides[new] = self.sides[old].clone();
        }
        let mut frames: Vec<_> = self
            .frames
            .iter()
            .map(|(t, f)| (map(*t), f.clone()))
            .collect();
        // Stable: keeps each target's FIFO order.
        frames.sort_by_key(|(t, _)| *t);
        let mut replies: Vec<_> = self
            .replies
            .iter()
            .map(|(t, r)| (map(*t), r.clone()))
            .collect();
        replies.sort_by_key(|(t, _)| *t);
        State {
            parent: self.parent.relabel_targets(permutation),
            targets,
            frames,
            replies,
            eof,
            sides,
            staged: self.staged.clone(),
            client: self.client.clone(),
            tasks: self.tasks.clone(),
            now: self.now,
            budgets: self.budgets,
            seen: self.seen,
        }
    }
}

impl Representative for State {
    fn representative(&self) -> State {
        let n = self.targets.len();
        let mut order: Vec<(u64, usize)> = (0..n)
            .map(|i| (self.target_key(TargetId(i as u16)), i))
            .collect();
        order.sort();
        let mut permutation = vec![TargetId(0); n];
        for (new, (_, old)) in order.iter().enumerate() {
            permutation[*old] = TargetId(new as u16);
        }
        self.relabeled(&permutation)
    }
}
