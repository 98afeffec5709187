//! A target's slot table, shared by its control thread and its task thread.
//!
//! The protocol's [`Target`] machine decides everything (refcounts, pins,
//! tombstones, which slot is free); this table only keeps one deserialized
//! callable per slot the machine uses, and drops it as soon as the machine
//! frees the slot ([`Target::is_slot_used`] turns false). Both threads go
//! through one mutex; a run holds its own reference to the callable, so a
//! slot freed under it cannot pull the callable away mid-call. Checked with
//! loom (`tests/loom_slots.rs`).
//!
//! Runs are begun in frame order between controls (the protocol's rule: a
//! run pins its slot before any later unregister is applied), on the
//! control thread or, while that thread has no frame to handle, on the
//! thread reading the control socket (which knows by the [`ControlGate`]:
//! the task thread or the reader, one at a time, in turns at the intake);
//! they are ended on the task thread. The gate is checked with loom too.

use crate::descriptor::Digest;
use crate::error::Error;
use crate::protocol::{Failure, Seq, Slot, Target, TargetEffect};
use crate::sync::{lock, Arc, Mutex};

struct Inner<C> {
    machine: Target,
    /// `callables[slot]`: the callable deserialized into that slot.
    callables: Vec<Option<Arc<C>>>,
}

/// How a table releases the callables of freed slots: it runs the given
/// closure (which drops them) and reports what their finalizers did
/// ([`crate::runtime::Runtime::finalize`]).
pub type Finalizer = Box<dyn Fn(&mut dyn FnMut()) -> Result<(), String> + Send + Sync>;

/// The machine and its callables behind one mutex.
pub struct SlotTable<C> {
    inner: Mutex<Inner<C>>,
    finalizer: Option<Finalizer>,
    /// What finalizers reported since [`SlotTable::take_finalizer_failures`].
    failures: Mutex<Vec<String>>,
}

/// What a call returns besides its own value: the machine's effects, in
/// order, for the caller to carry out (replies to write, a deserialization
/// to run).
pub type Effects = Vec<TargetEffect>;

impl<C> SlotTable<C> {
    /// A table over `machine`, with the callables of its startup snapshot:
    /// `snapshot[i]` in slot `i` (the order [`Target::new`] fills slots in).
    pub fn new(machine: Target, snapshot: Vec<C>) -> SlotTable<C> {
        let capacity = usize::from(machine.config().slot_capacity);
        let mut callables: Vec<Option<Arc<C>>> = (0..capacity).map(|_| None).collect();
        for (slot, callable) in snapshot.into_iter().enumerate().take(capacity) {
            callables[slot] = Some(Arc::new(callable));
        }
        SlotTable {
            inner: Mutex::new(Inner { machine, callables }),
            finalizer: None,
            failures: Mutex::new(Vec::new()),
        }
    }

    /// Releases freed callables through `finalizer` (without it they are
    /// plain drops).
    pub fn with_finalizer(mut self, finalizer: Finalizer) -> SlotTable<C> {
        self.finalizer = Some(finalizer);
        self
    }

    /// What the finalizer reported for the callables released since the
    /// last call (the caller says which operation freed them).
    pub fn take_finalizer_failures(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.failures))
    }

    /// Runs `input` on the machine under the lock, drains its effects, and
    /// drops (after unlocking) every callable whose slot the machine freed.
    /// With `only_frees` (an input that never makes a slot used: a run's
    /// end), the slots are looked through only when fewer are used after
    /// it than before.
    fn apply<R>(
        &self,
        only_frees: bool,
        input: impl FnOnce(&mut Target, &mut [Option<Arc<C>>]) -> R,
    ) -> (R, Effects) {
        let mut freed = Vec::new();
        let (result, effects) = {
            let mut inner = lock(&self.inner);
            let Inner { machine, callables } = &mut *inner;
            let used_before = machine.slots_in_use();
            let result = input(machine, callables);
            let mut effects = Vec::new();
            while let Some(effect) = machine.poll_effect() {
                effects.push(effect);
            }
            if !only_frees || machine.slots_in_use() < used_before {
                for (index, entry) in callables.iter_mut().enumerate() {
                    let slot = Slot(u16::try_from(index).unwrap_or(u16::MAX));
                    if entry.is_some() && !machine.is_slot_used(slot) {
                        freed.push(entry.take());
                    }
                }
            }
            (result, effects)
        };
        // A callable's destructor may be slow (or need an interpreter lock):
        // never run it while holding the table. It runs before the caller
        // carries out the effects (the reply of the operation that freed
        // it), through the runtime's finalizer.
        if !freed.is_empty() {
            match &self.finalizer {
                Some(finalize) => {
                    let mut freed = Some(freed);
                    if let Err(failure) = finalize(&mut || drop(freed.take())) {
                        lock(&self.failures).push(failure);
                    }
                }
                None => drop(freed),
            }
        }
        (result, effects)
    }

    /// A register control; see [`Target::on_register`].
    pub fn on_register(
        &self,
        seq: Seq,
        requested: Digest,
        verified: Result<Digest, Failure>,
    ) -> Effects {
        self.apply(false, |m, _| m.on_register(seq, requested, verified))
            .1
    }

    /// The result of a [`TargetEffect::Deserialize`]: stores the callable
    /// in its slot on success, then reports to the machine; see
    /// [`Target::on_deserialized`].
    ///
    /// # Errors
    /// The machine's error when no deserialization for `seq` is in progress
    /// (the callable is then dropped).
    pub fn on_deserialized(
        &self,
        seq: Seq,
        slot: Slot,
        result: Result<C, Failure>,
    ) -> Result<Effects, Error> {
        let (outcome, effects) = self.apply(false, |machine, callables| {
            let report = match result {
                Ok(callable) => {
                    // Stored first: the slot is reserved for this seq, and a
                    // refused report frees it again in `apply`'s sweep.
                    if let Some(entry) = callables.get_mut(usize::from(slot.0)) {
                        *entry = Some(Arc::new(callable));
                    }
                    Ok(())
                }
                Err(failure) => Err(failure),
            };
            machine.on_deserialized(seq, report)
        });
        outcome.map(|()| effects)
    }

    /// An unregister control; see [`Target::on_unregister`].
    pub fn on_unregister(&self, seq: Seq, digest: Digest) -> Effects {
        self.apply(false, |m, _| m.on_unregister(seq, digest)).1
    }

    /// Begins run `seq` of `digest`: pins its slot and returns the callable
    /// (the run's own reference); see [`Target::begin_task`].
    ///
    /// # Errors
    /// The machine's error (`DIGEST_NOT_INSTALLED`, `FRAME_INVALID`).
    pub fn begin_task(&self, seq: Seq, digest: Digest) -> Result<Arc<C>, Error> {
        let mut inner = lock(&self.inner);
        let slot = inner.machine.begin_task(seq, digest)?;
        match inner
            .callables
            .get(usize::from(slot.0))
            .and_then(Clone::clone)
        {
            Some(callable) => Ok(callable),
            None => {
                // A resolvable slot always holds its callable; keep the
                // machine consistent rather than leave the slot pinned.
                let _ = inner.machine.end_task(seq);
                Err(Error::new(
                    crate::error::ErrorCode::DIGEST_NOT_INSTALLED,
                    crate::error::OperationKind::Task,
                    format!("{digest} resolves to a slot without a callable"),
                )
                .with_digest(digest)
                .with_seq(seq))
            }
        }
    }

    /// The task thread is about to run `seq`: `Ok(false)` if a cancel
    /// came first (it must not run); see [`Target::start_task`].
    ///
    /// # Errors
    /// The machine's `FRAME_INVALID` when no run `seq` is in progress or it
    /// already started.
    pub fn start_task(&self, seq: Seq) -> Result<bool, Error> {
        lock(&self.inner).machine.start_task(seq)
    }

    /// A cancel control for task `seq`; see [`Target::on_cancel`].
    pub fn on_cancel(&self, seq: Seq, digest: Digest) -> Effects {
        self.apply(false, |m, _| m.on_cancel(seq, digest)).1
    }

    /// Ends run `seq`: unpins its slot, freeing a tombstoned slot at its
    /// last release; see [`Target::end_task`].
    ///
    /// # Errors
    /// The machine's `FRAME_INVALID` when no run `seq` is in progress.
    pub fn end_task(&self, seq: Seq) -> Result<(), Error> {
        self.apply(true, |m, _| m.end_task(seq)).0
    }

    /// The machine's public table: installed digests with refcounts (digest
    /// order) and the number of tombstoned slots. Never a slot.
    pub fn table(&self) -> (Vec<(Digest, u32)>, usize) {
        let inner = lock(&self.inner);
        (inner.machine.installed(), inner.machine.tombstones())
    }

    /// Number of slots that hold a callable (tests: it must follow the
    /// machine's used slots).
    pub fn callables_held(&self) -> usize {
        lock(&self.inner)
            .callables
            .iter()
            .filter(|c| c.is_some())
            .count()
    }
}

/// Frames a target's reading thread handed to its control thread that the
/// control thread has not finished handling. Only the thread reading the
/// control socket hands frames (one at a time: the intake's turns), so when
/// it finds none ([`ControlGate::is_idle`]) no control is queued or
/// running, and none starts before the reading thread hands the next one:
/// a run the reading thread begins meanwhile pins its slot in frame order,
/// after every control before it was applied and before every control
/// after it.
pub struct ControlGate {
    handed: Mutex<usize>,
}

impl Default for ControlGate {
    fn default() -> Self {
        ControlGate::new()
    }
}

impl ControlGate {
    /// A gate with nothing handed.
    pub fn new() -> ControlGate {
        ControlGate {
            handed: Mutex::new(0),
        }
    }

    /// The reader is about to hand a frame to the control thread.
    pub fn hand(&self) {
        *lock(&self.handed) += 1;
    }

    /// The control thread finished a frame: every effect on the table
    /// applied and every reply written.
    pub fn done(&self) {
        let mut handed = lock(&self.handed);
        *handed = handed.saturating_sub(1);
    }

    /// Whether every frame handed so far is done (the reader's view; what
    /// the control thread did before [`ControlGate::done`] is visible to a
    /// reader that sees `true`).
    pub fn is_idle(&self) -> bool {
        *lock(&self.handed) == 0
    }
}
