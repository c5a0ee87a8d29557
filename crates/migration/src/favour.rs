//! The destination's stream reader favoured by the scheduler while it reads.
//!
//! At the switch-over the destination's reader must run at once: the guest
//! is paused until it has read the last records and answered. But it has
//! just received a whole guest's memory, more than its fair share of the
//! CPU, and a fair scheduler (EEVDF) has a thread that ran ahead wait
//! behind the other tenants when it wakes: beside two CPU hogs the last
//! records took 30-190 ms to be read, the source long done. A heavier
//! weight (nice -10) while it reads brought the downtime to about 1 ms in
//! most runs. (The source's migration thread at nice -10 as well made it
//! worse again: the two then compete as before.) The old weight comes back
//! when the guard drops, so that threads the caller spawns later (the
//! destination's vCPU threads) inherit their usual one.
//!
//! A weight alone does not make a waking thread run at once: EEVDF lets
//! the thread it would preempt run to the end of its slice (3 ms by
//! default), and post-copy's fault thread and source wake for each page a
//! vCPU waits on. So the favoured thread also asks for a 100 µs slice
//! (`sched_setattr`'s runtime for a fair thread), which gives its wake-ups
//! an earlier deadline than a CPU hog's.
//!
//! Post-copy's page threads, the source's serving thread and the
//! destination's fetch thread, wake for every page a vCPU waits on, and a
//! 100 µs slice still leaves such a wake-up behind a CPU hog's slice now
//! and then: both run `SCHED_FIFO` at priority 1 for post-copy alone
//! ([`Favoured::realtime`]). What bounds them: they sleep while the link
//! is full or nothing is asked; on a link faster than they can copy they
//! do not, and each may then hold a CPU until post-copy ends, within
//! `--migrate-timeout-ms`, less the kernel's real-time throttling
//! (`sched_rt_runtime_us`, 95 % by default). `SCHED_DEADLINE`, which would
//! cap their share, throttles the pushes once the share is spent and the
//! asks wait behind them (BENCHMARKS.md's migrate rows measure the p99).

use vcpu_sched::thread::{SchedAttr, Tid, current_tid, get_attr, set_attr};

/// The nice value of the destination's stream reader.
const STREAM_NICE: i32 = -10;
/// Its slice: short, so that its wake-ups preempt.
const STREAM_SLICE_NS: u64 = 100_000;
/// Post-copy's page threads' `SCHED_FIFO` priority: the lowest, above
/// every fair thread.
const PAGE_THREAD_PRIORITY: u32 = 1;

/// The calling thread at nice -10 with a 100 µs slice until dropped, where
/// the process may raise it (`CAP_SYS_NICE`); otherwise unchanged.
#[derive(Debug)]
pub(crate) struct Favoured {
    /// The thread and its attributes before, if they were changed.
    raised: Option<(Tid, SchedAttr)>,
}

impl Favoured {
    /// Raises the calling thread's weight and shortens its slice.
    pub fn this_thread() -> Self {
        let tid = current_tid();
        let raised = get_attr(tid)
            .ok()
            .filter(|before| before.policy == libc::SCHED_OTHER as u32 && before.nice > STREAM_NICE)
            .filter(|before| set_attr(tid, &favoured(before)).is_ok())
            .map(|before| (tid, before));
        Self { raised }
    }
}

impl Favoured {
    /// The calling thread real-time (`SCHED_FIFO`, priority 1) until
    /// dropped, where the process may (`CAP_SYS_NICE`); otherwise as
    /// [`Self::this_thread`]. For post-copy's page threads, which sleep
    /// until a page is asked for or arrives, and must then run at once.
    pub fn realtime() -> Self {
        let tid = current_tid();
        let Ok(before) = get_attr(tid) else {
            return Self { raised: None };
        };
        let fifo = SchedAttr {
            policy: libc::SCHED_FIFO as u32,
            priority: PAGE_THREAD_PRIORITY,
            nice: 0,
            runtime: 0,
            ..before
        };
        match before.policy == libc::SCHED_OTHER as u32 && set_attr(tid, &fifo).is_ok() {
            true => Self {
                raised: Some((tid, before)),
            },
            false => Self::this_thread(),
        }
    }
}

impl Drop for Favoured {
    fn drop(&mut self) {
        if let Some((tid, before)) = self.raised {
            let _ = set_attr(tid, &before);
        }
    }
}

/// `before`, at nice -10 and a 100 µs slice.
fn favoured(before: &SchedAttr) -> SchedAttr {
    SchedAttr {
        nice: STREAM_NICE,
        runtime: STREAM_SLICE_NS,
        ..*before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thread is raised where the process may (as root), and always
    /// back to its old weight and slice after.
    #[test]
    fn a_thread_is_favoured_while_the_guard_lives() {
        std::thread::spawn(|| {
            let tid = current_tid();
            let before = get_attr(tid).unwrap();
            {
                let favoured = Favoured::this_thread();
                let during = get_attr(tid).unwrap();
                match favoured.raised {
                    Some(_) => assert_eq!(
                        (during.nice, during.runtime),
                        (STREAM_NICE, STREAM_SLICE_NS)
                    ),
                    None => assert_eq!(during, before, "not allowed: unchanged"),
                }
            }
            assert_eq!(get_attr(tid).unwrap(), before);
        })
        .join()
        .unwrap();
    }

    /// A page thread is real-time where the process may (as root), else
    /// favoured as the stream reader is, and back to its old policy after.
    #[test]
    fn a_page_thread_is_real_time_while_the_guard_lives() {
        std::thread::spawn(|| {
            let tid = current_tid();
            let before = get_attr(tid).unwrap();
            let may = vcpu_sched::thread::FifoBoost::new(PAGE_THREAD_PRIORITY)
                .check()
                .is_ok();
            {
                let _realtime = Favoured::realtime();
                let during = get_attr(tid).unwrap();
                let fifo = (libc::SCHED_FIFO as u32, PAGE_THREAD_PRIORITY);
                let fair = (during.nice, during.runtime) == (STREAM_NICE, STREAM_SLICE_NS);
                assert!(
                    (during.policy, during.priority) == fifo || fair || during == before,
                    "{during:?}"
                );
                if may {
                    assert_eq!((during.policy, during.priority), fifo);
                }
            }
            assert_eq!(get_attr(tid).unwrap(), before);
        })
        .join()
        .unwrap();
    }
}
