//! Replacement targets (`specs/protocol.md` §2.9): the envelopes kept for
//! replays, the template asked for a new process on a spawning thread, the
//! replacement linked (or given up when it is not ready in time), and the
//! [`TargetEvent`]s a Worker records.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::Serialize;

use super::io_loop::{Context, IoLoop, Link, Outbox, Staged};
use super::Core;
#[cfg(doc)]
use super::Worker;
use crate::descriptor::Digest;
use crate::envelope::HEADER_LEN;
use crate::error::ErrorCode;
use crate::io::process::{ProcessError, TargetProcess, TrackedFd};
use crate::io::staging::StagedPayload;
use crate::protocol::{Failure, Lifecycle, StagingId, TargetId, TargetPhase};
use crate::wire::FrameBuffer;

/// A replacement the template forked for `target`, as incarnation
/// `incarnation`, or why it could not.
pub(super) struct Spawned {
    target: TargetId,
    incarnation: u32,
    result: Result<TargetProcess, String>,
    /// The spawn failed because the template process is gone.
    template_gone: bool,
}

/// How long the IO thread waits to reap a template whose request socket
/// closed (it is reaped by [`Zygote::close`] otherwise).
///
/// [`Zygote::close`]: crate::io::zygote::Zygote::close
const TEMPLATE_REAP_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// How many target events a Worker keeps ([`Worker::target_events`]).
pub const TARGET_EVENTS_KEPT: usize = 1024;

/// An envelope kept for replays: a startup-snapshot envelope's bytes until
/// a replay first needs it staged, then (like a post-start register's) its
/// sealed staged payload, sent again to each replacement.
pub(super) struct Kept {
    pub(super) bytes: Option<Arc<Vec<u8>>>,
    pub(super) payload: Option<Arc<StagedPayload>>,
    pub(super) metadata: String,
}

impl Kept {
    pub(super) fn len(&self) -> usize {
        match (&self.payload, &self.bytes) {
            (Some(payload), _) => usize::try_from(payload.size()).unwrap_or(usize::MAX),
            (None, Some(bytes)) => bytes.len(),
            (None, None) => 0,
        }
    }
}

/// What happened to a replaced target (`specs/protocol.md` §2.9), as
/// [`Worker::target_events`] lists it.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum TargetEvent {
    /// A replacement process was started for `target`.
    Spawned {
        /// The target.
        target: TargetId,
        /// The new process's incarnation (the original is 0).
        incarnation: u32,
        /// Its process id.
        pid: i32,
    },
    /// A target's process was lost (with replacements on: what starts a
    /// replacement, or counts against the rate limit if it had not
    /// joined).
    Lost {
        /// The target.
        target: TargetId,
        /// The lost process's incarnation.
        incarnation: u32,
        /// Why it was given up and how it ended, as
        /// [`Worker::target_loss`] says.
        cause: String,
    },
    /// A replacement could not be started (the template process failed
    /// or is gone); it counts as one lost before it joined.
    SpawnFailed {
        /// The target.
        target: TargetId,
        /// The incarnation that was asked for.
        incarnation: u32,
        /// Why.
        reason: String,
    },
    /// A target's process retired: it was sent its
    /// `max_tasks_per_target` tasks, they ended, and it was killed and
    /// reaped; its replacement is started next (`specs/protocol.md`
    /// §2.14).
    Retired {
        /// The target.
        target: TargetId,
        /// The retired process's incarnation.
        incarnation: u32,
        /// The tasks it was sent.
        tasks: u32,
    },
    /// The replacement confirmed every live registration and serves.
    Joined {
        /// The target.
        target: TargetId,
        /// Its incarnation.
        incarnation: u32,
    },
    /// The replacement refused a replayed registration, or missed a
    /// deadline while joining, and was fenced.
    JoinFailed {
        /// The target.
        target: TargetId,
        /// Its incarnation.
        incarnation: u32,
        /// Its answer or the passed deadline.
        failure: Failure,
    },
    /// The template process that forks replacements is gone (it was
    /// killed, or exited): no replacement can be started any more, and
    /// every target lost from now on is abandoned at once
    /// (`specs/protocol.md` §2.9, "Replacements ended").
    TemplateLost {
        /// How it ended (`killed by signal 9`, ...), when known.
        cause: String,
    },
    /// The target stays lost: `failed_joins` replacements in a row were lost
    /// before they joined, or the template process is gone.
    Abandoned {
        /// The target.
        target: TargetId,
        /// Replacements in a row lost before they joined.
        failed_joins: u16,
    },
}

impl std::fmt::Display for TargetEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TargetEvent::Spawned {
                target,
                incarnation,
                pid,
            } => write!(f, "{target}: incarnation {incarnation} started (pid {pid})"),
            TargetEvent::Lost {
                target,
                incarnation,
                cause,
            } => write!(f, "{target}: incarnation {incarnation} lost ({cause})"),
            TargetEvent::SpawnFailed {
                target,
                incarnation,
                reason,
            } => write!(f, "{target}: incarnation {incarnation} could not be started: {reason}"),
            TargetEvent::Retired {
                target,
                incarnation,
                tasks,
            } => write!(f, "{target}: incarnation {incarnation} retired after {tasks} tasks"),
            TargetEvent::Joined {
                target,
                incarnation,
            } => write!(f, "{target}: incarnation {incarnation} joined"),
            TargetEvent::JoinFailed {
                target,
                incarnation,
                failure,
            } => write!(f, "{target}: incarnation {incarnation} failed to join ({failure})"),
            TargetEvent::TemplateLost { cause } => {
                write!(f, "replacements ended: template process lost ({cause})")
            }
            TargetEvent::Abandoned {
                target,
                failed_joins,
            } => write!(
                f,
                "{target}: given up after {failed_joins} replacements in a row were lost before they joined"
            ),
        }
    }
}

impl IoLoop {
    /// Drops the kept envelopes no live registration (or one in flight)
    /// needs any more (`Parent::keeps_envelope`), after the handover.
    pub(super) fn prune_kept(&mut self, core: &mut Core) {
        if core.kept.is_empty() {
            return;
        }
        let unneeded: Vec<Digest> = core
            .kept
            .keys()
            .filter(|d| !core.machine.keeps_envelope(**d))
            .copied()
            .collect();
        for digest in unneeded {
            if let Some(kept) = core.kept.remove(&digest) {
                self.graveyard.push(kept);
            }
        }
    }

    /// Stages the kept envelope of `digest` for a replay (§2.9): the sealed
    /// payload a register staged is sent again; a startup-snapshot
    /// envelope is staged from its bytes the first time.
    pub(super) fn restage(&mut self, core: &mut Core, staging: StagingId, digest: Digest) {
        let staged = match core.kept.get_mut(&digest) {
            Some(kept) => match (&kept.payload, &kept.bytes) {
                (Some(payload), _) => Ok(payload.clone()),
                (None, Some(bytes)) => StagedPayload::create(bytes, HEADER_LEN..bytes.len())
                    .map(|(payload, _)| {
                        let payload = Arc::new(payload);
                        kept.payload = Some(payload.clone());
                        kept.bytes = None;
                        payload
                    })
                    .map_err(|e| Failure::new(e.code(), e.to_string())),
                (None, None) => Err(Failure::new(
                    ErrorCode::IO_FAILED,
                    format!("the envelope of {digest} was not kept"),
                )),
            }
            .map(|payload| Staged {
                payload,
                metadata: kept.metadata.clone(),
            }),
            None => Err(Failure::new(
                ErrorCode::IO_FAILED,
                format!("the envelope of {digest} was not kept"),
            )),
        };
        match staged {
            Ok(staged) => {
                self.staged.insert(staging, staged);
            }
            Err(failure) => {
                let _ = core.machine.stage_failed(staging, failure);
            }
        }
    }

    /// Asks the template for incarnation `incarnation` of `target`
    /// (§2.9), on a thread of its own: the answer comes back through
    /// `core.spawned` and the wake pipe ([`IoLoop::link_spawned`]).
    pub(super) fn spawn(&mut self, core: &mut Core, target: TargetId, incarnation: u32) {
        self.spawners.retain(|spawner| !spawner.is_finished());
        let Some(zygote) = self.zygote.clone() else {
            return self.link_spawned(
                core,
                Spawned {
                    target,
                    incarnation,
                    result: Err("this Worker has no template process".to_owned()),
                    template_gone: false,
                },
            );
        };
        let queue = self.spawned.clone();
        // The spawning thread's own end of the wake pipe.
        let wake = core.wake.as_ref().map(|wake| {
            nix::fcntl::fcntl(&**wake, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(0)).map(|fd| {
                // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that
                // nothing else owns.
                let owned =
                    unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
                TrackedFd::new(owned)
            })
        });
        let asked = std::thread::Builder::new()
            .name("callreg-spawn".to_owned())
            .spawn(move || {
                let result = zygote.spawn(usize::from(target.0));
                let template_gone = matches!(result, Err(ProcessError::ZygoteGone));
                queue
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push_back(Spawned {
                        target,
                        incarnation,
                        result: result.map_err(|e| e.to_string()),
                        template_gone,
                    });
                if let Some(Ok(wake)) = &wake {
                    let _ = nix::unistd::write(wake, &[1]);
                }
            });
        match asked {
            Ok(spawner) => self.spawners.push(spawner),
            Err(e) => self.link_spawned(
                core,
                Spawned {
                    target,
                    incarnation,
                    result: Err(format!("starting a spawning thread: {e}")),
                    template_gone: false,
                },
            ),
        }
    }

    /// The template process is gone: it is reaped (not left a zombie until
    /// close), the event recorded, and the machine told that no
    /// replacement can start any more (§2.9), once.
    pub(super) fn template_lost(&mut self, core: &mut Core) {
        if core.machine.are_replacements_ended() {
            return;
        }
        let reaped = self
            .zygote
            .as_ref()
            .and_then(|z| z.reap_if_ended(TEMPLATE_REAP_WAIT));
        let cause = match reaped {
            Some(exit) => format!("it {exit}"),
            None => "its request socket closed".to_owned(),
        };
        core.record(TargetEvent::TemplateLost { cause });
        core.machine.replacements_ended();
    }

    /// Links a replacement the template forked, or tells the machine it
    /// could not be started; one the machine no longer waits for (closed)
    /// is dropped, which kills and reaps it.
    pub(super) fn link_spawned(&mut self, core: &mut Core, spawned: Spawned) {
        let Spawned {
            target,
            incarnation,
            result,
            template_gone,
        } = spawned;
        if template_gone {
            self.template_lost(core);
        }
        let index = usize::from(target.0);
        let awaited = core.machine.lifecycle() == Lifecycle::Started
            && core.machine.target_phase(target) == TargetPhase::Spawning
            && core.machine.incarnation(target) == incarnation;
        if !awaited {
            return;
        }
        let linked = result.and_then(|process| {
            FrameBuffer::new(self.max_frame_bytes)
                .map(|input| (process, input))
                .map_err(|e| e.to_string())
        });
        match linked {
            Ok((process, input)) => {
                let pid = process.pid().as_raw();
                if let Some(entry) = core.pids.get_mut(index) {
                    *entry = pid;
                }
                if let Some(entry) = self.links.get_mut(index) {
                    *entry = Some(Link {
                        process,
                        input,
                        outbox: Outbox::default(),
                        outbox_fds: VecDeque::new(),
                        incarnation,
                    });
                }
                // Its ready deadline is the machine's (§2.9).
                self.starting.insert(index, incarnation);
                core.record(TargetEvent::Spawned {
                    target,
                    incarnation,
                    pid,
                });
            }
            Err(reason) => {
                core.record(TargetEvent::SpawnFailed {
                    target,
                    incarnation,
                    reason: reason.clone(),
                });
                let cause = format!("its replacement could not be started: {reason}");
                let _ = core.machine.target_died(target, &cause, self.now());
            }
        }
        self.drain(core, &mut Context::default());
    }
}
