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

/// The nice value of the destination's stream reader.
const STREAM_NICE: libc::c_int = -10;

/// The calling thread at nice -10 until dropped, where the process may
/// raise it (`CAP_SYS_NICE`); otherwise unchanged.
#[derive(Debug)]
pub(crate) struct Favoured {
    /// The thread and its nice value before, if it was raised.
    raised: Option<(libc::id_t, libc::c_int)>,
}

impl Favoured {
    /// Raises the calling thread's weight.
    pub fn this_thread() -> Self {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as libc::id_t;
        let raised = nice_of(tid)
            .filter(|&before| before > STREAM_NICE)
            .filter(|_| set_nice(tid, STREAM_NICE))
            .map(|before| (tid, before));
        Self { raised }
    }
}

impl Drop for Favoured {
    fn drop(&mut self) {
        if let Some((tid, before)) = self.raised {
            set_nice(tid, before);
        }
    }
}

/// Thread `tid`'s nice value.
fn nice_of(tid: libc::id_t) -> Option<libc::c_int> {
    // SAFETY: clears this thread's errno, so that a -1 that is a nice
    // value can be told from an error.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: getpriority on one of this process's threads reads a value.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
    match nice == -1 && std::io::Error::last_os_error().raw_os_error() != Some(0) {
        true => None,
        false => Some(nice),
    }
}

/// Sets thread `tid`'s nice value; whether it took.
fn set_nice(tid: libc::id_t, nice: libc::c_int) -> bool {
    // SAFETY: setpriority on one of this process's threads.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thread is raised where the process may (as root), and always
    /// back to its old weight after.
    #[test]
    fn a_thread_is_favoured_while_the_guard_lives() {
        std::thread::spawn(|| {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() } as libc::id_t;
            let before = nice_of(tid).unwrap();
            {
                let favoured = Favoured::this_thread();
                let during = nice_of(tid).unwrap();
                match favoured.raised {
                    Some(_) => assert_eq!(during, STREAM_NICE),
                    None => assert_eq!(during, before, "not allowed: unchanged"),
                }
            }
            assert_eq!(nice_of(tid).unwrap(), before);
        })
        .join()
        .unwrap();
    }
}
