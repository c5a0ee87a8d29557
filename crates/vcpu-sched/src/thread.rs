//! Acting on a vCPU's host thread: its scheduling attributes and its CPUs.

use std::collections::HashMap;
use std::io;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;

/// A Linux thread id (`gettid`).
pub type Tid = libc::pid_t;

/// The calling thread's id.
pub fn current_tid() -> Tid {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// `struct sched_attr` (`sched_setattr(2)`), up to the utilization clamps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedAttr {
    /// Size of this struct.
    pub size: u32,
    /// `SCHED_OTHER`, `SCHED_FIFO`, ...
    pub policy: u32,
    /// `SCHED_FLAG_*`.
    pub flags: u64,
    /// Nice value (`SCHED_OTHER`).
    pub nice: i32,
    /// Static priority (`SCHED_FIFO`/`SCHED_RR`).
    pub priority: u32,
    /// Runtime, ns (`SCHED_DEADLINE`; EEVDF's custom slice on `SCHED_OTHER`).
    pub runtime: u64,
    /// Deadline, ns (`SCHED_DEADLINE`).
    pub deadline: u64,
    /// Period, ns (`SCHED_DEADLINE`).
    pub period: u64,
    /// Utilization clamp minimum.
    pub util_min: u32,
    /// Utilization clamp maximum.
    pub util_max: u32,
}

/// The scheduling attributes of thread `tid`.
pub fn get_attr(tid: Tid) -> io::Result<SchedAttr> {
    let mut attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        ..Default::default()
    };
    // SAFETY: sched_getattr writes at most `size` bytes into `attr`, which we own.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            tid,
            &mut attr as *mut SchedAttr,
            attr.size,
            0,
        )
    };
    if ret == 0 {
        Ok(attr)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sets the scheduling attributes of thread `tid`.
pub fn set_attr(tid: Tid, attr: &SchedAttr) -> io::Result<()> {
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        ..*attr
    };
    // SAFETY: sched_setattr reads `size` bytes from `attr`, which lives for the call.
    let ret = unsafe { libc::syscall(libc::SYS_sched_setattr, tid, &attr as *const SchedAttr, 0) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// How boosting acts on a host thread. Implementations must make `restore`
/// undo `boost` exactly.
pub trait ThreadControl: Send + Sync {
    /// Raises thread `tid`'s scheduling priority.
    fn boost(&self, tid: Tid) -> io::Result<()>;
    /// Restores what `boost` changed on `tid`. A thread that has exited is
    /// not an error. The revoker calls it while `boost` may be running on
    /// another thread, and may call it twice for one boost: it must be
    /// idempotent and never wait for anything `boost` holds (the booster can
    /// be kept off its CPU by the very thread it boosted).
    fn restore(&self, tid: Tid) -> io::Result<()>;
    /// Gives up the calling thread's CPU.
    fn yield_now(&self) {
        std::thread::yield_now();
    }
    /// How many revoker threads a booster acting through this control runs:
    /// each ends every boost at its deadline, so a boost ends on time while
    /// any of them gets its CPU. 1 by default.
    fn revokers(&self) -> usize {
        1
    }
    /// Raises thread `tid`, the booster's revoker number `revoker` (from 0),
    /// above every boost, so that it runs even on a CPU a boosted thread
    /// holds. The default does nothing: right for a control whose boosts
    /// cannot starve other threads.
    fn prepare_revoker(&self, _tid: Tid, _revoker: usize) -> io::Result<()> {
        Ok(())
    }
    /// The CPU time thread `tid` has run so far, if this control can tell.
    /// The booster reads it at each boost's two ends to report how much CPU
    /// the boost ran ([`crate::SchedEvents::boost_ran`]): what it took from
    /// other threads, which a host that takes the CPU away does not add to.
    /// `None` (the default): not reported.
    fn cpu_time(&self, _tid: Tid) -> Option<Duration> {
        None
    }
}

impl<T: ThreadControl + ?Sized> ThreadControl for std::sync::Arc<T> {
    fn boost(&self, tid: Tid) -> io::Result<()> {
        (**self).boost(tid)
    }
    fn restore(&self, tid: Tid) -> io::Result<()> {
        (**self).restore(tid)
    }
    fn revokers(&self) -> usize {
        (**self).revokers()
    }
    fn prepare_revoker(&self, tid: Tid, revoker: usize) -> io::Result<()> {
        (**self).prepare_revoker(tid, revoker)
    }
    fn yield_now(&self) {
        (**self).yield_now()
    }
    fn cpu_time(&self, tid: Tid) -> Option<Duration> {
        (**self).cpu_time(tid)
    }
}

/// `SCHED_DEADLINE`, which the libc crate does not name.
const SCHED_DEADLINE: u32 = 6;

/// Boosts to `SCHED_FIFO` at a priority, saving each thread's original
/// attributes and putting them back on `restore`. Needs `CAP_SYS_NICE` (or an
/// `RLIMIT_RTPRIO`): without it `boost` fails with `PermissionDenied`, which the
/// caller sees; nothing is silently skipped.
#[derive(Debug)]
pub struct FifoBoost {
    priority: u32,
    /// Each boosted thread's attributes from before its latest boost, kept
    /// after the restore: read without a lock (a booster preempted while
    /// updating it must not hold up the revoker), and still there for a
    /// restore that comes twice or before the boost took effect.
    originals: ArcSwap<HashMap<Tid, SchedAttr>>,
    /// Where a second revoker runs; empty: there is none.
    revoker_cpus: Vec<usize>,
}

impl FifoBoost {
    /// Boosts to `SCHED_FIFO` at `priority` (1 is the lowest real-time priority).
    pub fn new(priority: u32) -> Self {
        Self {
            priority,
            originals: ArcSwap::default(),
            revoker_cpus: Vec::new(),
        }
    }

    /// Adds a second revoker, kept on `cpus` at `SCHED_FIFO` 99 (a deadline
    /// task may not have a narrower affinity than the machine). Give it CPUs
    /// the boosted threads do not run on. The first revoker mostly sleeps
    /// on the CPU of the boost it ends, and is stopped with the boosted
    /// thread whenever the host takes that CPU away (a virtual machine's
    /// steal time, a timer interrupt the host delivers late); the second
    /// still ends the boost on time, unless its own CPU stalls at once.
    /// An empty list (the default) means no second revoker.
    pub fn with_revoker_cpus(mut self, cpus: &[usize]) -> Self {
        self.revoker_cpus = cpus.to_vec();
        self
    }
}

impl FifoBoost {
    /// The attributes this boosts threads to.
    fn boosted(&self) -> SchedAttr {
        SchedAttr {
            policy: libc::SCHED_FIFO as u32,
            priority: self.priority,
            ..Default::default()
        }
    }

    /// Saves `tid`'s attributes as its original unless they are the boost's
    /// own (a thread still boosted keeps the original saved before).
    fn save_original(&self, tid: Tid) -> io::Result<()> {
        let current = get_attr(tid)?;
        let fifo = self.boosted();
        if (current.policy, current.priority) == (fifo.policy, fifo.priority)
            || self.originals.load().get(&tid) == Some(&current)
        {
            return Ok(());
        }
        self.originals.rcu(|originals| {
            let mut originals = HashMap::clone(originals);
            originals.insert(tid, current);
            originals
        });
        Ok(())
    }

    /// Checks, before relying on it, that this process may boost: boosts the
    /// calling thread and puts it back. A VMM calls it at start-up to fail
    /// (or choose a policy that does not boost) with a clear reason.
    ///
    /// # Errors
    /// `PermissionDenied`, naming what is missing, without `CAP_SYS_NICE`.
    pub fn check(&self) -> io::Result<()> {
        let tid = current_tid();
        self.boost(tid)?;
        self.restore(tid)
    }
}

impl Default for FifoBoost {
    fn default() -> Self {
        Self::new(1)
    }
}

fn exited(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ESRCH)
}

impl ThreadControl for FifoBoost {
    fn boost(&self, tid: Tid) -> io::Result<()> {
        self.save_original(tid)?;
        set_attr(tid, &self.boosted()).map_err(|e| {
            let hint = if e.kind() == io::ErrorKind::PermissionDenied {
                " (needs CAP_SYS_NICE, or an RLIMIT_RTPRIO of at least the priority)"
            } else {
                ""
            };
            io::Error::new(
                e.kind(),
                format!(
                    "cannot boost thread {tid} to SCHED_FIFO {}: {e}{hint}",
                    self.priority
                ),
            )
        })
    }

    /// `SCHED_DEADLINE` with 200 µs every 1 ms, on every online CPU: above
    /// every `SCHED_FIFO` thread, and above the kernel's fair server, which
    /// runs starved `SCHED_OTHER` threads for up to 50 ms a second above
    /// real-time ones (a `SCHED_FIFO` revoker was seen waiting that long
    /// behind it). Where the kernel refuses a deadline task (its admission
    /// control, a cpuset narrower than the machine), the revoker runs
    /// `SCHED_FIFO` one priority above the boosts and the refusal is the
    /// error returned. The second revoker of
    /// [`FifoBoost::with_revoker_cpus`]: `SCHED_FIFO` 99 on those CPUs.
    fn revokers(&self) -> usize {
        1 + usize::from(!self.revoker_cpus.is_empty())
    }

    fn prepare_revoker(&self, tid: Tid, revoker: usize) -> io::Result<()> {
        if revoker > 0 {
            pin(tid, &self.revoker_cpus)?;
            let top = SchedAttr {
                policy: libc::SCHED_FIFO as u32,
                priority: 99,
                ..Default::default()
            };
            return set_attr(tid, &top);
        }
        // A deadline task must be allowed on every CPU of its root domain;
        // the revoker may have inherited a narrower affinity.
        let _ = online_cpus().and_then(|all| pin(tid, &all));
        let deadline = SchedAttr {
            policy: SCHED_DEADLINE,
            // A pass (wake-up, a restore per expired boost, each a
            // sched_setattr that interrupts the thread's CPU) was traced at
            // 40 µs median, 121 µs p99 on this 2-CPU VM: at 50 µs most
            // passes were throttled to the next period.
            runtime: 200_000,
            deadline: 1_000_000,
            period: 1_000_000,
            ..Default::default()
        };
        let Err(e) = set_attr(tid, &deadline) else {
            return Ok(());
        };
        let fifo = SchedAttr {
            policy: libc::SCHED_FIFO as u32,
            priority: (self.priority + 1).min(99),
            ..Default::default()
        };
        set_attr(tid, &fifo)?;
        Err(io::Error::new(
            e.kind(),
            format!(
                "the boost revoker cannot be SCHED_DEADLINE ({e}); it runs SCHED_FIFO {}, \
                 which the kernel's fair server can hold back for up to 50 ms",
                fifo.priority
            ),
        ))
    }

    fn restore(&self, tid: Tid) -> io::Result<()> {
        let original = self.originals.load().get(&tid).copied();
        match original.map(|attr| set_attr(tid, &attr)) {
            Some(Err(e)) if !exited(&e) => Err(e),
            _ => Ok(()),
        }
    }

    /// From the thread's CPU clock (one `clock_gettime`).
    fn cpu_time(&self, tid: Tid) -> Option<Duration> {
        thread_cpu_time(tid).ok()
    }
}

/// The CPU time thread `tid` of this process has used (one
/// `clock_gettime`).
pub(crate) fn thread_cpu_time(tid: Tid) -> io::Result<Duration> {
    read_cpu_clock(thread_cpu_clock(tid))
}

pub(crate) fn read_cpu_clock(clock: libc::clockid_t) -> io::Result<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to write.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

/// The CPU clock of thread `tid` (the kernel's `MAKE_THREAD_CPUCLOCK(tid,
/// CPUCLOCK_SCHED)`, which glibc's `pthread_getcpuclockid` builds from a
/// `pthread_t`; a VMM knows its vCPU threads by tid).
pub(crate) fn thread_cpu_clock(tid: Tid) -> libc::clockid_t {
    const CPUCLOCK_PERTHREAD: libc::clockid_t = 4;
    const CPUCLOCK_SCHED: libc::clockid_t = 2;
    (!tid << 3) | CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED
}

/// The CPUs the calling thread may run on, from `sched_getaffinity`.
pub fn available_cpus() -> io::Result<Vec<usize>> {
    affinity(0)
}

/// The host's online CPUs (`/sys/devices/system/cpu/online`).
pub fn online_cpus() -> io::Result<Vec<usize>> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online")?;
    parse_cpu_list(&text).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected CPU list {:?}", text.trim()),
        )
    })
}

/// The online CPUs as last read: `pin` may run often (a policy that moves
/// threads), and reading sysfs costs more than the move itself.
static ONLINE: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Checks that every CPU in `cpus` is online, re-reading the list only when
/// one is missing from the last reading (a CPU may have come online since).
fn check_online(cpus: &[usize]) -> io::Result<()> {
    let mut online = ONLINE.lock().unwrap_or_else(PoisonError::into_inner);
    if cpus.iter().any(|c| !online.contains(c)) {
        *online = online_cpus()?;
    }
    if let Some(bad) = cpus.iter().find(|c| !online.contains(c)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("CPU {bad} does not exist or is not online (online: {online:?})"),
        ));
    }
    match cpus.iter().find(|&&c| c >= libc::CPU_SETSIZE as usize) {
        Some(big) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "CPU {big} is beyond what a cpu_set_t holds ({})",
                libc::CPU_SETSIZE
            ),
        )),
        None => Ok(()),
    }
}

/// Parses a kernel CPU list such as "0-3,6,8-9".
fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for range in text.trim().split(',') {
        let (first, last) = range.split_once('-').unwrap_or((range, range));
        let (first, last): (usize, usize) = (first.parse().ok()?, last.parse().ok()?);
        if first > last {
            return None;
        }
        cpus.extend(first..=last);
    }
    Some(cpus)
}

/// Pins thread `tid` (0: the caller) to `cpus`. Any online CPU may be named,
/// not only those the caller itself runs on: a VMM thread pinned to one CPU
/// still places vCPU threads on the others.
///
/// # Errors
/// `InvalidInput` if `cpus` is empty or names a CPU that is not online; the
/// kernel's error otherwise (`EINVAL` when a cpuset allows none of `cpus`).
pub fn pin(tid: Tid, cpus: &[usize]) -> io::Result<()> {
    check_online(cpus)?;
    if cpus.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "an empty CPU set",
        ));
    }
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET only write inside it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `check_online` rejected every CPU at or above CPU_SETSIZE.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: passes the set we own and its size; the result is checked.
    let ret = unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The CPUs thread `tid` (0: the caller) may run on, as the kernel reports them.
pub fn affinity(tid: Tid) -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data, filled by sched_getaffinity.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: passes the set we own and its size; the result is checked.
    let ret =
        unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: CPU_ISSET reads inside the set for every index below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_of_the_calling_thread_can_be_read() {
        let attr = get_attr(current_tid()).unwrap();
        assert_eq!(attr.policy, libc::SCHED_OTHER as u32);
    }

    /// Drops `CAP_SYS_NICE` from the calling thread's effective set
    /// (capabilities are per thread).
    fn drop_cap_sys_nice() {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const VERSION_3: u32 = 0x2008_0522;
        const CAP_SYS_NICE: u32 = 23;
        let mut header = Header {
            version: VERSION_3,
            pid: 0,
        };
        let mut data = [Data::default(); 2];
        // SAFETY: capget writes two `Data` for version 3 into `data`, which we own.
        let got = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
        assert_eq!(got, 0, "capget: {}", io::Error::last_os_error());
        data[0].effective &= !(1 << CAP_SYS_NICE);
        // SAFETY: capset reads the header and two `Data`, which live for the call.
        let set = unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) };
        assert_eq!(set, 0, "capset: {}", io::Error::last_os_error());
    }

    #[test]
    fn without_cap_sys_nice_boosting_fails_with_the_reason() {
        std::thread::spawn(|| {
            drop_cap_sys_nice();
            let limit = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
            let rtprio = limit
                .lines()
                .find(|l| l.starts_with("Max realtime priority"));
            if rtprio.is_some_and(|l| l.split_whitespace().nth(3) != Some("0")) {
                eprintln!("SKIPPED: RLIMIT_RTPRIO lets this thread boost without CAP_SYS_NICE");
                return;
            }
            let err = FifoBoost::default().check().unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
            assert!(err.to_string().contains("CAP_SYS_NICE"), "{err}");
            let attr = get_attr(current_tid()).unwrap();
            assert_eq!(attr.policy, libc::SCHED_OTHER as u32, "nothing changed");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn fifo_boost_is_restored_exactly() {
        std::thread::spawn(|| {
            let tid = current_tid();
            let before = get_attr(tid).unwrap();
            let fifo = FifoBoost::default();
            match fifo.boost(tid) {
                Ok(()) => {}
                // Without CAP_SYS_NICE the error is clear, not a silent no-op.
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                    eprintln!("SKIPPED: no CAP_SYS_NICE: {e}");
                    return;
                }
                Err(e) => panic!("{e}"),
            }
            assert_eq!(get_attr(tid).unwrap().policy, libc::SCHED_FIFO as u32);
            fifo.restore(tid).unwrap();
            assert_eq!(get_attr(tid).unwrap(), before);
            fifo.restore(tid).unwrap();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn restoring_a_thread_that_exited_is_not_an_error() {
        let fifo = FifoBoost::default();
        let tid = std::thread::spawn(current_tid).join().unwrap();
        let originals = HashMap::from([(tid, SchedAttr::default())]);
        fifo.originals.store(std::sync::Arc::new(originals));
        fifo.restore(tid).unwrap();
    }

    #[test]
    fn a_boost_that_lands_after_its_restore_is_restored_again() {
        std::thread::spawn(|| {
            let tid = current_tid();
            let before = get_attr(tid).unwrap();
            let fifo = FifoBoost::default();
            if let Err(e) = fifo.check() {
                eprintln!("SKIPPED: cannot boost: {e}");
                return;
            }
            // The revoker restored while the booster was still applying;
            // then the booster's set_attr lands.
            fifo.boost(tid).unwrap();
            fifo.restore(tid).unwrap();
            set_attr(tid, &fifo.boosted()).unwrap();
            fifo.restore(tid).unwrap();
            assert_eq!(get_attr(tid).unwrap(), before);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0-1\n"), Some(vec![0, 1]));
        assert_eq!(parse_cpu_list("0,2-4,7"), Some(vec![0, 2, 3, 4, 7]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a"), None);
        assert_eq!(parse_cpu_list(""), None);
    }

    #[test]
    fn a_thread_pinned_to_one_cpu_can_pin_another_elsewhere() {
        let online = online_cpus().unwrap();
        let (Some(&first), Some(&last)) = (online.first(), online.last()) else {
            unreachable!("a running thread has a CPU");
        };
        if first == last {
            eprintln!("SKIPPED: one online CPU, nowhere else to pin");
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            tx.send(current_tid()).unwrap();
            done_rx.recv().unwrap();
        });
        let tid = rx.recv().unwrap();
        std::thread::spawn(move || {
            pin(0, &[first]).unwrap();
            pin(tid, &[last]).unwrap();
            assert_eq!(affinity(tid).unwrap(), [last]);
        })
        .join()
        .unwrap();
        done_tx.send(()).unwrap();
        other.join().unwrap();
    }

    #[test]
    fn pinning_reads_back_and_rejects_missing_cpus() {
        std::thread::spawn(|| {
            let cpus = available_cpus().unwrap();
            pin(0, &cpus[..1]).unwrap();
            assert_eq!(affinity(0).unwrap(), cpus[..1]);
            let err = pin(0, &[4096]).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
            assert!(err.to_string().contains("CPU 4096 does not exist"), "{err}");
            assert!(err.to_string().contains("online"), "{err}");
            assert_eq!(pin(0, &[]).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        })
        .join()
        .unwrap();
    }
}
