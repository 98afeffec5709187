//! Building a [`Worker`]: the [`WorkerBuilder`], its checks of what it is
//! given, and the public defaults and bounds (control timeout, operation
//! timeout factor, the longest timeout).

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::leader::Shared;
use super::{Core, Worker};
use crate::error::{Error, ErrorCode, OperationKind};
use crate::io::lead::os::Os;
use crate::io::process::ThreadPolicy;
use crate::io::spin::{Spin, DEFAULT_SPIN, MAX_SPIN};
use crate::io::sys::ForkMarker;
use crate::io::zygote::TemplateCommand;
use crate::protocol::{
    OwnerToken, Parent, ParentConfig, DEFAULT_RESPAWN_BACKOFF, DEFAULT_RESPAWN_LIMIT,
    DEFAULT_SLOT_CAPACITY,
};
use crate::runtime::Runtime;
use crate::wire::{DEFAULT_MAX_FRAME_BYTES, MIN_MAX_FRAME_BYTES};

/// The default control timeout: 30 seconds.
pub const DEFAULT_CONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest control timeout, operation timeout or respawn back-off a
/// [`WorkerBuilder`] accepts: 10⁹ seconds (about 31 years).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);

/// The default operation timeout, as a multiple of the control timeout
/// ([`WorkerBuilder::operation_timeout`]).
pub const OPERATION_TIMEOUT_FACTOR: u32 = 10;

/// How [`Worker::start`] makes its targets ([`WorkerBuilder::start_method`]).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum StartMethod {
    /// Fork the targets from this process, and the template of
    /// replacements too (the default): fast, and targets inherit this
    /// process's memory, but also any lock another thread holds at the
    /// fork (it stays held in every target).
    #[default]
    Fork,
    /// Run a fresh template process with this command
    /// ([`crate::io::zygote::Zygote::exec`]), which forks every target,
    /// those of the start and every replacement: nothing of this
    /// process's threads, locks or memory reaches a target. Safe from a
    /// threaded process (the thread policy does not apply).
    Forkserver(TemplateCommand),
}

/// Builds a [`Worker`].
pub struct WorkerBuilder<R: Runtime> {
    runtime: Arc<R>,
    targets: u16,
    control_timeout: Duration,
    operation_timeout: Option<Duration>,
    slot_capacity: u16,
    max_frame_bytes: usize,
    fence_on_timeout: bool,
    probe_first: bool,
    respawn_limit: u16,
    respawn_backoff: Duration,
    max_tasks_per_target: u32,
    thread_policy: ThreadPolicy,
    start_method: StartMethod,
    spin: Duration,
}

impl<R: Runtime> WorkerBuilder<R> {
    /// A builder with 1 target, a 30 s control timeout, 64 slots per
    /// target, 16 MiB frames, fencing on, and forking refused in a
    /// multi-threaded process.
    pub fn new(runtime: Arc<R>) -> WorkerBuilder<R> {
        WorkerBuilder {
            runtime,
            targets: 1,
            control_timeout: DEFAULT_CONTROL_TIMEOUT,
            operation_timeout: None,
            slot_capacity: DEFAULT_SLOT_CAPACITY,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            fence_on_timeout: true,
            probe_first: true,
            respawn_limit: DEFAULT_RESPAWN_LIMIT,
            respawn_backoff: Duration::from_micros(DEFAULT_RESPAWN_BACKOFF),
            max_tasks_per_target: 0,
            thread_policy: ThreadPolicy::RefuseIfThreaded,
            start_method: StartMethod::Fork,
            spin: DEFAULT_SPIN,
        }
    }

    /// Number of targets to fork (at least 1).
    pub fn targets(mut self, count: u16) -> Self {
        self.targets = count;
        self
    }

    /// How long a target may stay silent about a register, an unregister
    /// or a cleanup it owes an answer (a target reports alive on receipt
    /// and every quarter of this while the control is queued or running,
    /// `specs/protocol.md`, "Deadlines"), how long it has to answer an
    /// inspection, and how long [`Worker::start`] waits for
    /// every target to be ready, counted from before its first fork (one
    /// deadline for the whole start, not one per target: a target's
    /// runtime start — about 50 ms of CPU for Python — competes with the
    /// others' and with the forks, so allow at least `targets × 50 ms ÷
    /// cores`, with a margin).
    pub fn control_timeout(mut self, timeout: Duration) -> Self {
        self.control_timeout = timeout;
        self
    }

    /// How long a register, an unregister or a cleanup may take in all,
    /// counted from its send, even from a target that keeps reporting
    /// alive (`specs/protocol.md`, "Deadlines"); past it the target is
    /// fenced like a silent one. Default: [`OPERATION_TIMEOUT_FACTOR`]
    /// times the control timeout; at least the control timeout (else
    /// [`WorkerBuilder::build`] refuses it).
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = Some(timeout);
        self
    }

    /// Slots per target (callables a target holds at once).
    pub fn slot_capacity(mut self, slots: u16) -> Self {
        self.slot_capacity = slots;
        self
    }

    /// Maximum frame size in bytes, header included, both directions (at
    /// least [`MIN_MAX_FRAME_BYTES`]). Bounds task inputs and results.
    pub fn max_frame_bytes(mut self, bytes: usize) -> Self {
        self.max_frame_bytes = bytes;
        self
    }

    /// Whether a target that misses a deadline is fenced (killed, reaped,
    /// reported lost: the default) or left running with the digest marked
    /// uncertain.
    pub fn fence_on_timeout(mut self, fence: bool) -> Self {
        self.fence_on_timeout = fence;
        self
    }

    /// Replacement targets (`specs/protocol.md` §2.9): a lost target (it
    /// crashed, was killed or fenced) is replaced by a new process, forked
    /// from a template process made at start, with the same target id and
    /// the next incarnation; it is given every live registration and
    /// serves tasks once it confirmed them all. `limit` replacements of
    /// one target in a row may be lost before they join (a callable that
    /// kills every new process); then the target stays lost, and
    /// [`Worker::target_loss`] says so. Default 3; 0 switches replacements
    /// off (and no template process is made).
    pub fn respawn_limit(mut self, limit: u16) -> Self {
        self.respawn_limit = limit;
        self
    }

    /// At most `tasks` tasks per target process (default 0: no bound;
    /// `specs/protocol.md` §2.14): a process sent its last one takes no
    /// more, and once they ended it is retired (killed and reaped,
    /// [`TargetEvent::Retired`](super::TargetEvent::Retired)) and
    /// replaced, which counts against no limit. Tasks that no target can
    /// take meanwhile wait in the Worker
    /// and go to the replacement when it joins. Needs replacements on
    /// ([`WorkerBuilder::respawn_limit`] above 0); once replacements end
    /// (the template process is gone) the processes serve on.
    pub fn max_tasks_per_target(mut self, tasks: u32) -> Self {
        self.max_tasks_per_target = tasks;
        self
    }

    /// The back-off before the second replacement in a row of one target,
    /// doubling for each further one (default 100 ms; `specs/protocol.md`
    /// §2.9). The first replacement after a target that had joined is
    /// lost is started at once.
    pub fn respawn_backoff(mut self, backoff: Duration) -> Self {
        self.respawn_backoff = backoff;
        self
    }

    /// Whether a register of a callable no target has installed since
    /// start goes to one target first and to the others only once that
    /// target confirmed it (the default; `specs/protocol.md` §2.8). Then a
    /// payload whose deserialization kills its target (`os._exit`, a
    /// segfault) costs that one target, and the callable is refused from
    /// then on with `REGISTER_POISONED`. `false`: every register goes to
    /// every live target at once (one round trip less for a new callable;
    /// `BENCHMARKS.md` measures the difference).
    pub fn probe_first(mut self, probe: bool) -> Self {
        self.probe_first = probe;
        self
    }

    /// Forks even if the process already runs other threads (a thread that
    /// holds a lock at fork time leaves it held forever in the targets).
    pub fn accept_thread_risk(mut self) -> Self {
        self.thread_policy = ThreadPolicy::AcceptRisk;
        self
    }

    /// How [`Worker::start`] makes the targets (default
    /// [`StartMethod::Fork`]). With [`StartMethod::Forkserver`] the
    /// template process is always made (also with replacements off:
    /// `respawn_limit(0)`), since it is the targets' parent.
    pub fn start_method(mut self, method: StartMethod) -> Self {
        self.start_method = method;
        self
    }

    /// How long a caller waiting for its own result polls its targets'
    /// replies without blocking before it sleeps, and how long a target's
    /// task thread, its queue empty, looks for its next task before it
    /// sleeps, at most (default [`DEFAULT_SPIN`], 50 µs; zero never spins;
    /// `specs/threads.md`, "The leader's spin" and "The target's spin").
    /// Whether a wait spins is measured per Worker for its leaders and per
    /// target for its task thread ([`crate::io::spin`]): every 4,096
    /// waits, a stretch that spins against one that does not, and
    /// spinning until the next measure only if it was clearly faster.
    pub fn spin(mut self, budget: Duration) -> Self {
        self.spin = budget;
        self
    }

    /// The Worker, not started: registrations go into the startup snapshot.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` for 0 targets, 0 slots, a zero control timeout,
    /// a control timeout, operation timeout or respawn back-off above
    /// [`MAX_TIMEOUT`], an operation timeout shorter than the control
    /// timeout, a maximum frame size below [`MIN_MAX_FRAME_BYTES`], a
    /// spin budget above [`MAX_SPIN`], or a task bound per target with
    /// replacements off;
    /// `IO_FAILED`
    /// when no random owner token can be drawn.
    pub fn build(self) -> Result<Worker<R>, Error> {
        let invalid = |message: String| {
            Error::new(ErrorCode::LIFECYCLE_INVALID, OperationKind::Start, message)
        };
        if self.targets == 0 || self.slot_capacity == 0 {
            return Err(invalid(
                "a Worker needs at least one target and one slot".to_owned(),
            ));
        }
        // The protocol counts time in whole microseconds: a shorter timeout
        // would become zero there.
        if self.control_timeout < Duration::from_micros(1) {
            return Err(invalid(
                "the control timeout must be at least 1 microsecond".to_owned(),
            ));
        }
        // Deadlines are instants from now: a longer time would overflow.
        for (what, time) in [
            ("the control timeout", Some(self.control_timeout)),
            ("the operation timeout", self.operation_timeout),
            ("the respawn back-off", Some(self.respawn_backoff)),
        ] {
            if time.is_some_and(|t| t > MAX_TIMEOUT) {
                return Err(invalid(format!(
                    "{what} must be at most {} seconds",
                    MAX_TIMEOUT.as_secs()
                )));
            }
        }
        if self.spin > MAX_SPIN {
            return Err(invalid(format!(
                "the spin budget must be at most {} microseconds",
                MAX_SPIN.as_micros()
            )));
        }
        if self.max_tasks_per_target > 0 && self.respawn_limit == 0 {
            return Err(invalid(format!(
                "max_tasks_per_target ({}) needs replacement targets: a respawn_limit above 0",
                self.max_tasks_per_target
            )));
        }
        if self.max_frame_bytes < MIN_MAX_FRAME_BYTES {
            return Err(invalid(format!(
                "the maximum frame size must be at least {MIN_MAX_FRAME_BYTES} bytes"
            )));
        }
        // An operation bound shorter than a control timeout would fence a
        // target that reports alive before its silence could ever count,
        // and count that as evidence against a probed digest
        // (specs/protocol.md §2.7, §2.8).
        if let Some(bound) = self.operation_timeout {
            if bound < self.control_timeout {
                return Err(invalid(format!(
                    "the operation timeout ({} s) must be at least the control timeout ({} s)",
                    bound.as_secs_f64(),
                    self.control_timeout.as_secs_f64()
                )));
            }
        }
        let owner = OwnerToken(random_token()?);
        let config = ParentConfig {
            targets: self.targets,
            control_timeout: u64::try_from(self.control_timeout.as_micros()).unwrap_or(u64::MAX),
            operation_timeout: u64::try_from(
                self.operation_timeout
                    .unwrap_or(
                        self.control_timeout
                            .saturating_mul(OPERATION_TIMEOUT_FACTOR),
                    )
                    .as_micros(),
            )
            .unwrap_or(u64::MAX),
            fence_on_timeout: self.fence_on_timeout,
            owner,
            slot_capacity: self.slot_capacity,
            probe_first: self.probe_first,
            respawn_limit: self.respawn_limit,
            respawn_backoff: u64::try_from(self.respawn_backoff.as_micros()).unwrap_or(u64::MAX),
            // Targets are forked here: a replacement that is not ready in
            // time is fenced (§2.9).
            unbounded_spawn: false,
            max_tasks_per_target: self.max_tasks_per_target,
        };
        let machine = Parent::new(config);
        Ok(Worker {
            runtime: self.runtime,
            targets: self.targets,
            control_timeout: self.control_timeout,
            slot_capacity: self.slot_capacity,
            max_frame_bytes: self.max_frame_bytes,
            spin: self.spin,
            thread_policy: self.thread_policy,
            start_method: self.start_method,
            respawn: self.respawn_limit > 0,
            clock: Instant::now(),
            config,
            shared: Arc::new(Shared {
                process: std::process::id(),
                fork_marker: ForkMarker::new(),
                poller: Os::new(Spin::new(self.spin)),
                core: Mutex::new(Core {
                    machine,
                    envelopes: BTreeMap::new(),
                    metadata: BTreeMap::new(),
                    closing: false,
                    requests: VecDeque::new(),
                    io: None,
                    io_running: false,
                    wake: None,
                    pids: Vec::new(),
                    kept: BTreeMap::new(),
                    events: VecDeque::new(),
                    exits: BTreeMap::new(),
                    losses: BTreeMap::new(),
                }),
            }),
            io_thread: Mutex::new(None),
            forker: Mutex::new(None),
        })
    }
}

fn random_token() -> Result<u64, Error> {
    let mut bytes = [0u8; 8];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| {
            Error::new(
                ErrorCode::IO_FAILED,
                OperationKind::Start,
                format!("/dev/urandom: {e}"),
            )
        })?;
    Ok(u64::from_le_bytes(bytes))
}
