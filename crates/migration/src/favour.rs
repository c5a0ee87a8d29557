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

use vcpu_sched::thread::{SchedAttr, Tid, current_tid, get_attr, set_attr};

/// The nice value of the destination's stream reader.
const STREAM_NICE: i32 = -10;
/// Its slice: short, so that its wake-ups preempt.
const STREAM_SLICE_NS: u64 = 100_000;

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
}
