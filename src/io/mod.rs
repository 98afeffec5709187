//! The IO layer (cargo feature `io`): runs the pure protocol over real
//! forked targets, POSIX shared memory and pipes (specs/design.md §5).
//!
//! * [`staging`] — staged payloads in POSIX shm;
//! * [`process`] — forking targets, their pipes, fencing and reaping;
//! * [`handoff`] — results from the IO thread to waiting callers;
//! * [`slots`] — a target's slot table shared by its two threads;
//! * [`target`] — the target process: snapshot, control and task threads;
//! * [`worker`] — the [`Worker`]: builder, operations, the IO thread;
//! * [`failpoints`] — fault injection points (cargo feature `failpoints`).
//!
//! The IO layer moves bytes and time into the protocol's state machines and
//! applies the effects they return; it makes no protocol decision itself.

pub mod failpoints;
pub mod handoff;
pub mod process;
pub mod slots;
pub mod staging;
pub mod target;
pub mod worker;

pub use worker::{
    OperationError, PendingOperation, PendingTask, StartReport, TargetTable, TaskError, Worker,
    WorkerBuilder,
};
