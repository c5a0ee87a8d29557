//! A watch on a source's connection while it moves its guest: a thread that
//! cuts the connection the moment the move cannot go on (the guest's run
//! ended, the run was stopped, or a limit passed), so that a read or write
//! blocked on a destination that stopped answering returns at once, and the
//! error it ends with is the reason, named.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::connection::Cutter;
use super::{HANDOVER_MARGIN, MigrationError};
use reference_vmm::PauseError;
use reference_vmm::RunControl;

/// How often the watch looks at the run while nothing wakes it.
const TICK: Duration = Duration::from_millis(10);

/// The limit a deadline stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Limit {
    /// The whole migration's (`MigrateOptions::timeout`).
    Migration(Duration),
    /// The pause's: the downtime limit plus [`HANDOVER_MARGIN`].
    Pause(Duration),
    /// After the commit: RUNNING within [`HANDOVER_MARGIN`].
    Confirmation,
}

/// Why the watch cut the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fired {
    /// A vCPU's run ended: its program finished or failed.
    Ended(u32),
    /// The run was asked to stop.
    Stopped,
    /// The deadline of this limit passed.
    Limit(Limit),
}

/// What the watch and the migration share.
#[derive(Debug)]
pub(crate) struct Watch {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug)]
struct State {
    deadline: Instant,
    limit: Limit,
    /// Past the commit: the guest's end is expected, not a reason to cut.
    committed: bool,
    finished: bool,
    fired: Option<Fired>,
}

/// Runs `body` with a watch on `control`'s run that cuts the connection
/// `cutter` cuts at the first reason, `deadline` (for `limit`) among them.
pub(crate) fn watching<T>(
    control: &RunControl,
    cutter: Cutter,
    deadline: Instant,
    limit: Limit,
    body: impl FnOnce(&Watch) -> T,
) -> T {
    let watch = Watch {
        state: Mutex::new(State {
            deadline,
            limit,
            committed: false,
            finished: false,
            fired: None,
        }),
        changed: Condvar::new(),
    };
    thread::scope(|scope| {
        scope.spawn(|| watch.run(control, &cutter));
        let out = body(&watch);
        watch.lock().finished = true;
        watch.changed.notify_all();
        out
    })
}

impl Watch {
    /// Brings the deadline forward to `deadline`, for `limit`, if that is
    /// sooner.
    pub fn tighten(&self, deadline: Instant, limit: Limit) {
        let mut state = self.lock();
        if deadline < state.deadline {
            (state.deadline, state.limit) = (deadline, limit);
            self.changed.notify_all();
        }
    }

    /// The commit is sent: from now on only a stop or
    /// [`HANDOVER_MARGIN`] ends the wait for RUNNING.
    pub fn committed(&self) {
        let mut state = self.lock();
        state.committed = true;
        state.deadline = Instant::now() + HANDOVER_MARGIN;
        state.limit = Limit::Confirmation;
        self.changed.notify_all();
    }

    /// `e`, or the reason the watch cut the connection (which caused it).
    pub fn explain(&self, e: MigrationError) -> MigrationError {
        match self.lock().fired {
            None => e,
            Some(Fired::Ended(vcpu)) => PauseError::Ended(vcpu).into(),
            Some(Fired::Stopped) => MigrationError::Stopped,
            Some(Fired::Limit(Limit::Migration(t))) => MigrationError::TimedOut(t),
            Some(Fired::Limit(Limit::Pause(downtime))) => MigrationError::PauseLimit {
                downtime,
                margin: HANDOVER_MARGIN,
            },
            Some(Fired::Limit(Limit::Confirmation)) => MigrationError::Unconfirmed(format!(
                "no word from it within {} ms",
                HANDOVER_MARGIN.as_millis()
            )),
        }
    }

    fn run(&self, control: &RunControl, cutter: &Cutter) {
        let mut state = self.lock();
        while !state.finished {
            let now = Instant::now();
            let fired = if control.stopping() {
                Some(Fired::Stopped)
            } else if !state.committed && control.wait_for_end(Duration::ZERO) {
                Some(Fired::Ended(control.ended_vcpu()))
            } else {
                (now >= state.deadline).then_some(Fired::Limit(state.limit))
            };
            if let Some(fired) = fired {
                state.fired = Some(fired);
                cutter.cut();
                return;
            }
            let tick = state.deadline.saturating_duration_since(now).min(TICK);
            state = self
                .changed
                .wait_timeout(state, tick)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
