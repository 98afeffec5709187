//! Loom model of a target's slot table (`callreg::io::slots`): the control
//! thread (unregister, register) and the task thread (ending a run) race on
//! one slot; the callable must stay alive while a run holds it, be dropped
//! exactly once, and never be confused with the callable of a later
//! register that reuses the slot (specs/design.md §4.4 invariant 4). And
//! the control gate (`callreg::io::slots::ControlGate`): a task the reader
//! reads behind an unregister pins its slot after the unregister applied,
//! whether the reader pins it (the gate idle) or the control thread does.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --features io
//! --test loom_slots --release`. Without `--cfg loom` this file is empty.
#![cfg(all(loom, feature = "io"))]

use callreg::descriptor::Digest;
use callreg::io::slots::{ControlGate, SlotTable};
use callreg::protocol::{Seq, Target, TargetConfig, TargetEffect, TargetId};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

const OLD: Digest = Digest([1; 32]);
const NEW: Digest = Digest([2; 32]);

/// A callable that counts its drops.
struct Counted {
    name: &'static str,
    drops: Arc<AtomicUsize>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

fn table_with_old(capacity: u16, drops: &Arc<AtomicUsize>) -> SlotTable<Counted> {
    let config = TargetConfig {
        id: TargetId(0),
        slot_capacity: capacity,
    };
    let machine = Target::new(config, &[(OLD, 1)]).unwrap();
    SlotTable::new(
        machine,
        vec![Counted {
            name: "old",
            drops: drops.clone(),
        }],
    )
}

#[test]
fn a_run_keeps_its_callable_across_a_concurrent_last_unregister() {
    loom::model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let table = Arc::new(table_with_old(2, &drops));
        // The control thread begins the run (frame order), then the task
        // thread runs it while the control thread applies the unregister.
        let run = table.begin_task(Seq(10), OLD).unwrap();
        let task = {
            let table = table.clone();
            let drops = drops.clone();
            thread::spawn(move || {
                assert_eq!(run.name, "old");
                assert_eq!(
                    drops.load(Ordering::SeqCst),
                    0,
                    "dropped while a run holds it"
                );
                drop(run);
                table.end_task(Seq(10)).unwrap();
            })
        };
        let effects = table.on_unregister(Seq(11), OLD);
        assert!(matches!(&effects[..], [TargetEffect::Reply(r)] if r.result.is_ok()));
        task.join().unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert_eq!(table.callables_held(), 0);
        assert_eq!(table.table(), (vec![], 0));
    });
}

#[test]
fn a_reused_slot_never_loses_the_new_callable_to_the_old_run() {
    loom::model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        // One slot: the new register can only proceed once the old run
        // released the tombstoned slot.
        let table = Arc::new(table_with_old(1, &drops));
        let run = table.begin_task(Seq(10), OLD).unwrap();
        let task = {
            let table = table.clone();
            thread::spawn(move || {
                drop(run);
                table.end_task(Seq(10)).unwrap();
            })
        };
        table.on_unregister(Seq(11), OLD);
        let effects = table.on_register(Seq(12), NEW, Ok(NEW));
        let installed_now = match &effects[..] {
            // The slot was already free: deserialize into it.
            [TargetEffect::Deserialize { seq, slot, .. }] => {
                let new_drops = Arc::new(AtomicUsize::new(0));
                let new = Counted {
                    name: "new",
                    drops: new_drops,
                };
                let replies = table.on_deserialized(*seq, *slot, Ok(new)).unwrap();
                assert!(matches!(&replies[..], [TargetEffect::Reply(r)] if r.result.is_ok()));
                true
            }
            // Still tombstoned and pinned: no free slot, nothing installed.
            [TargetEffect::Reply(r)] => {
                assert_eq!(
                    r.result.as_ref().unwrap_err().code,
                    callreg::error::ErrorCode::LOCAL_SLOT_EXHAUSTED
                );
                false
            }
            other => panic!("unexpected effects {other:?}"),
        };
        task.join().unwrap();
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "the old callable is dropped exactly once"
        );
        if installed_now {
            assert_eq!(table.table(), (vec![(NEW, 1)], 0));
            let run = table.begin_task(Seq(13), NEW).unwrap();
            assert_eq!(run.name, "new");
            drop(run);
            table.end_task(Seq(13)).unwrap();
            assert_eq!(table.callables_held(), 1);
        } else {
            assert_eq!(table.table(), (vec![], 0));
            assert_eq!(table.callables_held(), 0);
        }
    });
}

#[test]
fn a_task_read_behind_an_unregister_pins_after_it_on_either_path() {
    loom::model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let table = Arc::new(table_with_old(2, &drops));
        let gate = Arc::new(ControlGate::new());
        // What the reader hands the control thread: the unregister, and
        // the task when the gate is not idle.
        let (frames, incoming) = loom::sync::mpsc::channel::<u64>();
        let control = {
            let (table, gate) = (table.clone(), gate.clone());
            thread::spawn(move || {
                // Seq 0 ends the stream (loom's channel has no disconnect).
                loop {
                    let seq = incoming.recv().unwrap();
                    if seq == 0 {
                        break;
                    }
                    if seq == 11 {
                        let effects = table.on_unregister(Seq(11), OLD);
                        assert!(
                            matches!(&effects[..], [TargetEffect::Reply(r)] if r.result.is_ok())
                        );
                    } else {
                        assert!(
                            table.begin_task(Seq(seq), OLD).is_err(),
                            "pinned on the control thread before the unregister"
                        );
                    }
                    gate.done();
                }
            })
        };
        // The reader: unregister (seq 11), then the task (seq 12).
        gate.hand();
        frames.send(11).unwrap();
        if gate.is_idle() {
            assert!(
                table.begin_task(Seq(12), OLD).is_err(),
                "pinned by the reader before the unregister"
            );
        } else {
            gate.hand();
            frames.send(12).unwrap();
        }
        frames.send(0).unwrap();
        control.join().unwrap();
        assert!(gate.is_idle());
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert_eq!(table.table(), (vec![], 0));
    });
}
