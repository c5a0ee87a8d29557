//! The thread's timer slack, which decides how late a hybrid poll's sleep ends.

use std::io;
use std::time::Duration;

/// Sets the calling thread's timer slack (`PR_SET_TIMERSLACK`).
///
/// A normal thread's timed waits may end up to 50 µs late by default; a thread
/// that uses hybrid polling (sleep, then poll) wants its sleeps to end on time.
pub fn set_timer_slack(slack: Duration) -> io::Result<()> {
    let ns = slack.as_nanos().clamp(1, libc::c_ulong::MAX as u128) as libc::c_ulong;
    // SAFETY: PR_SET_TIMERSLACK takes an integer and changes only this thread.
    match unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, ns, 0, 0, 0) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_slack_can_be_set() {
        std::thread::spawn(|| {
            set_timer_slack(Duration::from_nanos(1)).unwrap();
            // SAFETY: PR_GET_TIMERSLACK takes no arguments.
            let slack = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
            assert_eq!(slack, 1);
        })
        .join()
        .unwrap();
    }
}
