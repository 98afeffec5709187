//! The IO layer (cargo feature `io`): runs the pure protocol over real
//! forked targets, sealed `memfd` staging, control sockets and reply pipes
//! (DESIGN.md §5).
//!
//! * [`staging`] — staged payloads in sealed `memfd`s (`specs/staging.md`);
//! * [`process`] — forking targets, their channels and pidfds, fencing,
//!   reaping, processes forked inside a target;
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
