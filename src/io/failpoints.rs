//! Fault injection points (the `fail` crate, cargo feature `failpoints`).
//!
//! Points (each a `&'static str` constant below) are configured with the
//! `fail` crate's action syntax (`off`, `return(ARG)`, `sleep(MS)`,
//! `delay(MS)`, `panic(MSG)`, `pause`, `N*action`, `P%action`, chained with
//! `->`) from environment variables read by [`configure_from_env`]:
//!
//! * `FAILPOINTS=name=actions;name=actions` — in the parent when a Worker
//!   starts; forked targets inherit that configuration;
//! * `CALLREG_FAILPOINTS_TARGET_<index>=name=actions;…` — applied in target
//!   `<index>` only, right after `fork`, so a test can fail one target.
//!
//! A `return(ARG)` action is mapped by [`hit`]: `return(exit)` ends the
//! process at once with `_exit(`[`ABRUPT_EXIT_CODE`]`)` (no destructor, no
//! reply: a crash), `return(abort)` calls `abort()` (SIGABRT), and any other
//! `return(MESSAGE)` makes the point fail with that message — except at the
//! points that come after a decision was made (`target.after_install`,
//! `target.reply_delay`, `parent.before_publish`), where a refusal would lie
//! to the other side, so any `return(…)` ends the process there.
//!
//! Without the feature every point is a no-op that the compiler removes.

/// Target: a register control was validated, before it is installed
/// (deserialized or refcounted); also before each startup snapshot entry.
/// `return(MESSAGE)`: the register is refused with `IO_FAILED`.
pub const TARGET_BEFORE_INSTALL: &str = "target.before_install";
/// Target: a register (or snapshot entry) was installed, before its reply.
/// The install already happened, so any `return(…)` ends the target.
pub const TARGET_AFTER_INSTALL: &str = "target.after_install";
/// Target: an unregister control arrived, before it is applied.
/// `return(MESSAGE)`: the target refuses it with `IO_FAILED`, changing
/// nothing (the parent then marks the digest uncertain).
pub const TARGET_BEFORE_UNREGISTER: &str = "target.before_unregister";
/// Target: deserializing a payload; `return(MESSAGE)` makes the runtime's
/// deserialization fail with `DESERIALIZE_FAILED` and MESSAGE.
pub const TARGET_DESERIALIZE: &str = "target.deserialize";
/// Target: before any frame is written to the parent (Ready, replies, task
/// results); `sleep(MS)` delays it, any `return(…)` ends the target.
pub const TARGET_REPLY_DELAY: &str = "target.reply_delay";
/// Parent: a payload was staged, before its register controls are sent.
/// `return(MESSAGE)`: staging is reported failed (`IO_FAILED`) and the
/// register completes with that error, no target involved.
pub const PARENT_AFTER_STAGE: &str = "parent.after_stage";
/// Parent: every target in scope confirmed a register, before the handle is
/// handed to the caller; `sleep(MS)` delays it, any `return(…)` ends the
/// parent process (the machine already published).
pub const PARENT_BEFORE_PUBLISH: &str = "parent.before_publish";
/// Parent: the IO thread's `poll` returned, before it takes the state
/// lock; `pause` or `sleep(MS)` holds it there (requests left to it wait
/// in its queue, callers carry out their own meanwhile); a `return(…)` is
/// ignored (there is nothing to refuse).
pub const PARENT_IO_TURN: &str = "parent.io_turn";

/// Every fail point, for tests that iterate over them.
pub const ALL: &[&str] = &[
    TARGET_BEFORE_INSTALL,
    TARGET_AFTER_INSTALL,
    TARGET_BEFORE_UNREGISTER,
    TARGET_DESERIALIZE,
    TARGET_REPLY_DELAY,
    PARENT_AFTER_STAGE,
    PARENT_BEFORE_PUBLISH,
    PARENT_IO_TURN,
];

/// Exit status of a process ended by a `return(exit)` action.
pub const ABRUPT_EXIT_CODE: i32 = 86;

/// Environment variable with the per-target configuration of target
/// `index` (see the module documentation).
pub fn target_env_var(index: usize) -> String {
    format!("CALLREG_FAILPOINTS_TARGET_{index}")
}

/// Evaluates point `name`: `Ok(())` when it is off (or only delays),
/// `Err(message)` for `return(message)`; ends the process for
/// `return(exit)` and `return(abort)`.
///
/// # Errors
/// The configured message, which the caller reports as the operation's
/// failure.
pub fn hit(name: &'static str) -> Result<(), String> {
    match eval(name) {
        None => Ok(()),
        Some(action) if action == "exit" => {
            // SAFETY: `_exit` ends the process without running any Rust or C
            // destructor: the crash this action simulates.
            unsafe { libc::_exit(ABRUPT_EXIT_CODE) }
        }
        Some(action) if action == "abort" => std::process::abort(),
        Some(message) => Err(format!("fail point {name}: {message}")),
    }
}

#[cfg(feature = "failpoints")]
fn eval(name: &'static str) -> Option<String> {
    fail::fail_point!(name, |arg: Option<String>| Some(arg.unwrap_or_default()));
    None
}

#[cfg(not(feature = "failpoints"))]
fn eval(_name: &'static str) -> Option<String> {
    None
}

/// Applies the fail point configuration in environment variable `var`
/// (`name=actions;name=actions`), if it is set.
///
/// # Errors
/// The first entry that is not `name=actions` or whose actions the `fail`
/// crate rejects, as a message naming the variable. Without the
/// `failpoints` feature a set, non-empty variable is an error too, so a
/// test never silently runs without its faults.
pub fn configure_from_env(var: &str) -> Result<(), String> {
    let Ok(spec) = std::env::var(var) else {
        return Ok(());
    };
    for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let Some((name, actions)) = entry.split_once('=') else {
            return Err(format!("{var}: entry {entry:?} is not name=actions"));
        };
        configure(name.trim(), actions.trim()).map_err(|e| format!("{var}: {name}: {e}"))?;
    }
    Ok(())
}

#[cfg(feature = "failpoints")]
fn configure(name: &str, actions: &str) -> Result<(), String> {
    fail::cfg(name, actions)
}

#[cfg(not(feature = "failpoints"))]
fn configure(_name: &str, _actions: &str) -> Result<(), String> {
    Err("this build has no fail points (cargo feature `failpoints`)".to_owned())
}
