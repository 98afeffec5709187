//! Symmetry reduction over targets.
//!
//! Targets are interchangeable: no decision of either machine depends on a
//! target's id (ids only appear in messages). So a state and the same state
//! with its targets renumbered behave alike, and the checker needs to
//! explore only one of them. [`State::representative`] renumbers targets in
//! the order of a key made of what the model sees of each target (its
//! installed digests with refcounts, tombstoned slots, slot, run and
//! deserialization counts, the frames to it, the replies and task results
//! from it, its end of file, the driver's bookkeeping, whether the parent counts it live and
//! which of its in-transit answers the parent awaits, its
//! replacement phase, incarnation and failed joins, and a replacement the
//! driver was asked for), ties broken by id.
//!
//! Soundness does not depend on the key being complete: the representative
//! is always a renumbering of the state itself, so two states with the same
//! representative are renumberings of each other. An incomplete key only
//! leaves some symmetric states unmerged. Stateright 0.31 applies symmetry
//! in its depth-first checker only; `callreg-model check --symmetry`
//! therefore runs depth-first.

use std::hash::{Hash, Hasher};

use callreg::protocol::TargetId;
use stateright::Representative;

use crate::model::{State, StepStatus, TaskNote};

/// A small multiplicative hasher for the sort keys: their quality only
/// affects how many symmetric states get merged, never soundness, and
/// SipHash dominated the cost of the reduction.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = (self.0.rotate_left(5) ^ value).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl State {
    fn target_key(&self, id: TargetId) -> u64 {
        let index = usize::from(id.0);
        let mut hasher = KeyHasher::default();
        // The target's observable table, without its id (which differs
        // between symmetric states by definition).
        match &self.targets[index] {
            None => 0u8.hash(&mut hasher),
            Some(target) => {
                1u8.hash(&mut hasher);
                target.installed().hash(&mut hasher);
                target.tombstoned_slots().hash(&mut hasher);
                target.slots_in_use().hash(&mut hasher);
                target.runs_in_progress().hash(&mut hasher);
                target.is_deserializing().hash(&mut hasher);
            }
        }
        for (t, frame) in &self.frames {
            if *t == id {
                frame.hash(&mut hasher);
            }
        }
        for (t, reply) in &self.replies {
            if *t == id {
                reply.seq.hash(&mut hasher);
                reply.result.is_ok().hash(&mut hasher);
                self.parent.awaits_reply(id, reply.seq).hash(&mut hasher);
            }
        }
        for (t, result) in &self.results {
            if *t == id {
                result.hash(&mut hasher);
            }
        }
        for (t, incarnation, reply) in &self.stale_replies {
            if *t == id {
                incarnation.hash(&mut hasher);
                reply.seq.hash(&mut hasher);
                reply.result.is_ok().hash(&mut hasher);
            }
        }
        self.eof[index].hash(&mut hasher);
        self.sides[index].hash(&mut hasher);
        self.parent.is_target_live(id).hash(&mut hasher);
        // Its replacement state (`specs/protocol.md` §2.9).
        self.parent.target_phase(id).hash(&mut hasher);
        self.parent.incarnation(id).hash(&mut hasher);
        self.parent.failed_joins(id).hash(&mut hasher);
        self.spawns[index].hash(&mut hasher);
        self.spawn_due[index].hash(&mut hasher);
        hasher.finish()
    }

    /// This state with target `old` renamed `permutation[old]`.
    pub fn relabeled(&self, permutation: &[TargetId]) -> State {
        let map = |t: TargetId| permutation[usize::from(t.0)];
        let n = self.targets.len();
        let mut targets = vec![None; n];
        let mut eof = vec![false; n];
        let mut sides = vec![Default::default(); n];
        let mut spawns = vec![None; n];
        let mut spawn_due = vec![None; n];
        for (old, renamed) in permutation.iter().enumerate().take(n) {
            let new = usize::from(renamed.0);
            targets[new] = self.targets[old].as_ref().map(|t| t.relabeled(*renamed));
            eof[new] = self.eof[old];
            sides[new] = self.sides[old].clone();
            spawns[new] = self.spawns[old];
            spawn_due[new] = self.spawn_due[old];
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
        let mut results: Vec<_> = self.results.iter().map(|(t, r)| (map(*t), *r)).collect();
        results.sort_by_key(|(t, _)| *t);
        let mut stale: Vec<_> = self.stale.iter().map(|(t, r)| (map(*t), *r)).collect();
        stale.sort();
        let mut stale_replies: Vec<_> = self
            .stale_replies
            .iter()
            .map(|(t, i, r)| (map(*t), *i, r.clone()))
            .collect();
        stale_replies.sort_by_key(|(t, i, r)| (*t, *i, r.seq));
        let task_log = self
            .task_log
            .iter()
            .map(|n| TaskNote {
                target: map(n.target),
                ..*n
            })
            .collect();
        let client = self
            .client
            .iter()
            .map(|step| match step {
                StepStatus::InFlight {
                    op,
                    scope,
                    issued,
                    refused,
                    probing,
                    confirmed,
                } => {
                    let rename = |mask: u32| {
                        let mut renamed = 0u32;
                        for (old, new) in permutation.iter().enumerate().take(n) {
                            if mask & (1u32 << old) != 0 {
                                renamed |= 1u32 << new.0;
                            }
                        }
                        renamed
                    };
                    StepStatus::InFlight {
                        op: *op,
                        scope: rename(*scope),
                        issued: *issued,
                        refused: rename(*refused),
                        probing: *probing,
                        confirmed: *confirmed,
                    }
                }
                other => *other,
            })
            .collect();
        State {
            parent: self.parent.relabel_targets(permutation),
            targets,
            frames,
            replies,
            eof,
            sides,
            staged: self.staged.clone(),
            pre: self.pre.clone(),
            client,
            tasks: self.tasks.clone(),
            results,
            stale,
            stale_replies,
            task_log,
            delivering: self.delivering,
            now: self.now,
            budgets: self.budgets,
            seen: self.seen,
            contract: self.contract,
            settling: self.settling,
            proven: self.proven.clone(),
            spawns,
            spawn_due,
            replays: self.replays.clone(),
            refused_probes: self.refused_probes.clone(),
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
        if order.iter().enumerate().all(|(new, (_, old))| new == *old) {
            return self.clone();
        }
        let mut permutation = vec![TargetId(0); n];
        for (new, (_, old)) in order.iter().enumerate() {
            permutation[*old] = TargetId(new as u16);
        }
        self.relabeled(&permutation)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashSet, VecDeque};

    use stateright::Model;

    use super::*;
    use crate::model::{ModelConfig, RegistrationModel};

    /// Up to `limit` states of the standard configuration, breadth first.
    fn some_states(limit: usize) -> (RegistrationModel, Vec<State>) {
        let model = RegistrationModel::new(ModelConfig::standard()).unwrap();
        let mut seen = HashSet::new();
        let mut queue: VecDeque<State> = model.init_states().into();
        let mut states = Vec::new();
        while let Some(state) = queue.pop_front() {
            if states.len() == limit {
                break;
            }
            if !seen.insert(state.clone()) {
                continue;
            }
            queue.extend(model.next_states(&state));
            states.push(state);
        }
        (model, states)
    }

    fn permutations() -> Vec<Vec<TargetId>> {
        [[2, 1, 0], [1, 2, 0], [0, 2, 1]]
            .iter()
            .map(|p| p.iter().map(|i| TargetId(*i)).collect())
            .collect()
    }

    fn inverse(permutation: &[TargetId]) -> Vec<TargetId> {
        let mut inverse = vec![TargetId(0); permutation.len()];
        for (old, new) in permutation.iter().enumerate() {
            inverse[usize::from(new.0)] = TargetId(old as u16);
        }
        inverse
    }

    #[test]
    fn renumbering_round_trips_and_keeps_every_verdict() {
        let (model, states) = some_states(3000);
        assert_eq!(states.len(), 3000);
        for state in &states {
            for permutation in permutations() {
                let renamed = state.relabeled(&permutation);
                assert_eq!(&renamed.relabeled(&inverse(&permutation)), state);
                assert_eq!(
                    model.check_invariants(&renamed).is_ok(),
                    model.check_invariants(state).is_ok()
                );
                assert_eq!(model.is_terminal(&renamed), model.is_terminal(state));
            }
        }
    }

    #[test]
    fn symmetric_states_with_distinct_keys_share_one_representative() {
        let (_, states) = some_states(3000);
        let mut compared = 0;
        for state in &states {
            let keys: HashSet<u64> = (0..3).map(|i| state.target_key(TargetId(i))).collect();
            if keys.len() < 3 {
                continue;
            }
            for permutation in permutations() {
                let renamed = state.relabeled(&permutation);
                assert_eq!(renamed.representative(), state.representative());
                compared += 1;
            }
        }
        assert!(compared > 1000, "only {compared} comparisons");
    }
}
