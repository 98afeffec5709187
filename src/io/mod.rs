//! The IO layer (cargo feature `io`): runs the pure protocol over real
//! forked targets, sealed `memfd` staging, control sockets and reply sockets
//! (specs/design.md §5, `specs/staging.md`).
//!
//! * [`staging`] — staged payloads in sealed `memfd`s (`specs/staging.md`);
//! * [`process`] — forking targets, their channels and pidfds, fencing,
//!   reaping, processes forked inside a target;
//! * [`handoff`] — results from whoever reads a reply to the waiting caller;
//! * [`lead`] — who reads the targets' replies: the IO thread or a waiting
//!   caller (leader/followers);
//! * [`slots`] — a target's slot table shared by its threads;
//! * [`target`] — the target process: snapshot, control and task threads;
//! * [`turn`] — turns at a target's intake that no thread waits for;
//! * [`worker`] — the [`Worker`]: builder, operations, the IO thread;
//! * [`zygote`] — the template process: thread-free, it forks replacement
//!   targets after start (and, started by `exec` for
//!   [`StartMethod::Forkserver`], every target);
//! * [`failpoints`] — fault injection points (cargo feature `failpoints`).
//!
//! The IO layer moves bytes and time into the protocol's state machines and
//! applies the effects they return; it makes no protocol decision itself.
//!
//! A Worker over 3 forked targets with the test runtime
//! ([`crate::runtime::testing`]: a payload is an instruction; Python targets
//! work the same way with `runtime::python::PythonRuntime`, see
//! `examples/python_worker.rs`). A register that one target cannot install
//! fails everywhere and is rolled back; the Worker keeps serving:
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use callreg::envelope::encode;
//! use callreg::error::ErrorCode;
//! use callreg::io::Worker;
//! use callreg::protocol::{TargetId, TargetOutcome};
//! use callreg::runtime::{testing::TestRuntime, TaskEncoding};
//!
//! let worker = Worker::builder(Arc::new(TestRuntime))
//!     .targets(3)
//!     .control_timeout(Duration::from_secs(10))
//!     .build()?;
//! let report = worker.start()?; // forks: call it before starting threads
//! assert_eq!(report.outcomes.len(), 3);
//!
//! let echo = worker.register(&encode(b"echo"))?; // staged, confirmed by all 3
//! let input = br#"{"args": ["hi"]}"#;
//! for (target, result) in worker.submit_to_every(&echo, TaskEncoding::Json, input) {
//!     assert_eq!(result?, input, "{target}");
//! }
//!
//! let failed = worker.register(&encode(b"bad no such callable")).unwrap_err();
//! assert_eq!(failed.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
//! assert!(failed
//!     .outcomes
//!     .iter()
//!     .all(|(_, outcome)| matches!(outcome, TargetOutcome::Failed { .. })));
//!
//! worker.unregister(&echo)?;
//! let gone = worker.submit(&echo, TargetId(0), TaskEncoding::Json, input).unwrap_err();
//! assert_eq!(gone.error.code, ErrorCode::HANDLE_STALE);
//! worker.close();
//! assert!(worker.live_targets().is_empty());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod failpoints;
pub mod handoff;
pub mod lead;
pub mod process;
pub mod slots;
pub mod spin;
pub mod staging;
pub(crate) mod sys;
pub mod target;
pub mod turn;
pub mod worker;
pub mod zygote;
mod zygote_link;

pub use worker::{
    forked_child_error, OperationError, PendingOperation, PendingTask, StartMethod, StartReport,
    TargetTable, TaskError, TaskKey, Worker, WorkerBuilder,
};
