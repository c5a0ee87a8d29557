//! The LAPIC timer as a guest programs it (SDM vol. 3, 11.5.4, and KVM's rules
//! where the SDM leaves a choice).
//!
//! - Writing the LVT Timer with another mode disarms the timer and clears the
//!   Initial Count and the TSC deadline (KVM's `apic_update_lvtt`).
//! - One-shot and periodic count down from the Initial Count, at the bus clock
//!   divided by the Divide Configuration; writing 0 stops the count; periodic
//!   reloads. The Current Count is computed from elapsed time. Changing the
//!   divisor while counting keeps the current count and rescales the rest.
//! - TSC-deadline fires when the guest TSC reaches IA32_TSC_DEADLINE; writing 0
//!   disarms; writes outside TSC-deadline mode are ignored and reads give 0; the
//!   Initial Count is ignored and the Current Count reads 0 in that mode.
//! - A periodic timer's period is at least [`KVM_MIN_TIMER_PERIOD_NS`]
//!   (KVM's `min_timer_period_us`, configurable with
//!   [`LapicTimer::with_min_period_ns`]): a guest cannot make the host fire a
//!   timer every few µs, which would hold a host CPU in interrupt delivery.
//!   As in KVM's `limit_periodic_timer_frequency`, only a non-zero periodic
//!   count is raised to the floor; one-shot and TSC-deadline timers are not.
//! - A masked timer counts and reloads but delivers nothing; the expiries
//!   that fall while it is masked are spent, not delivered late when it is
//!   unmasked. The reserved mode (0b11) never counts.
//!
//! Time is the host's (`CLOCK_MONOTONIC` ns), passed in by the caller, so the
//! model is plain, deterministic data; [`GuestTime`] maps the guest TSC onto it.
//! Every value a guest can write is accepted without panic or overflow.

use crate::registers::{
    DIVIDE_WRITABLE, LVT_WRITABLE, LvtTimer, MSR_TSC_DEADLINE, TimerMode, TimerRegister, divisor,
};
use crate::time::GuestTime;

/// KVM's APIC bus clock: one tick per ns (`APIC_BUS_CYCLE_NS`).
pub const DEFAULT_BUS_CYCLE_NS: u64 = 1;
/// KVM's floor on a periodic timer's period: `min_timer_period_us`, 200 µs.
pub const KVM_MIN_TIMER_PERIOD_NS: u64 = 200_000;
/// LVT entries come out of reset masked.
const LVT_RESET: u32 = crate::registers::LVT_MASKED;

/// A register access the timer refuses (the guest gets a #GP where it came
/// through an MSR).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TimerError {
    /// The Current Count is read-only (an x2APIC write to it is a #GP).
    #[error("the {0:?} register is read-only")]
    ReadOnly(TimerRegister),
    /// An x2APIC timer register is 32 bits: bits 63:32 are reserved.
    #[error("MSR {msr:#x} is 32 bits wide; {value:#x} sets reserved bits")]
    Reserved {
        /// The MSR written.
        msr: u32,
        /// The value written.
        value: u64,
    },
    /// Not a timer MSR (neither an x2APIC timer register nor IA32_TSC_DEADLINE).
    #[error("MSR {0:#x} is not a timer register")]
    NotTimer(u32),
}

/// The timer expired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Fired {
    /// The LVT Timer vector.
    pub vector: u8,
    /// Whether it is delivered (false while masked).
    pub deliver: bool,
    /// When it was due, host ns.
    pub due_ns: u64,
}

/// The timer's state as plain data, for snapshots. The running count is kept
/// as time remaining, so it restores on any host clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LapicTimerState {
    /// LVT Timer.
    pub lvt: u32,
    /// Initial Count.
    pub initial_count: u32,
    /// Divide Configuration.
    pub divide_config: u32,
    /// IA32_TSC_DEADLINE (guest TSC; 0 disarmed).
    pub tsc_deadline: u64,
    /// One-shot/periodic: ns until the next expiry, if counting.
    pub remaining_ns: Option<u64>,
}

/// One vCPU's LAPIC timer.
///
/// The register model alone, by MSR or xAPIC offset, with time passed in:
/// ```
/// use lapic_timer::{GuestTime, LapicTimer, TimerRegister};
///
/// let mut lapic = LapicTimer::new(GuestTime { tsc_khz: 2_000_000, ns: 0, tsc_at_ns: 0 });
/// lapic.write_msr(0x832, 0x2_0030, 0)?; // periodic, vector 0x30
/// lapic.write_msr(0x83e, 0b1011, 0)?; // divide by 1
/// lapic.write(TimerRegister::InitialCount, 1_000_000, 0)?; // 1 ms at KVM's 1 GHz bus
/// assert_eq!(lapic.read(TimerRegister::CurrentCount, 250_000), 750_000);
/// let fired = lapic.expire(1_000_000).expect("due"); // periodic: reloads
/// assert_eq!((fired.vector, lapic.next_expiry_ns()), (0x30, Some(2_000_000)));
/// # Ok::<(), lapic_timer::TimerError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LapicTimer {
    lvt: u32,
    initial_count: u32,
    divide_config: u32,
    tsc_deadline: u64,
    /// One-shot/periodic: host ns of the next expiry, while counting.
    next_ns: Option<u64>,
    bus_cycle_ns: u64,
    min_period_ns: u64,
    time: GuestTime,
}

impl LapicTimer {
    /// A timer after reset (LVT masked, counts 0), for a guest whose TSC `time` maps.
    pub fn new(time: GuestTime) -> Self {
        Self {
            lvt: LVT_RESET,
            initial_count: 0,
            divide_config: 0,
            tsc_deadline: 0,
            next_ns: None,
            bus_cycle_ns: DEFAULT_BUS_CYCLE_NS,
            min_period_ns: KVM_MIN_TIMER_PERIOD_NS,
            time,
        }
    }

    /// The same timer with another floor on the periodic period (ns; 0: no
    /// floor). The default is KVM's, [`KVM_MIN_TIMER_PERIOD_NS`].
    pub fn with_min_period_ns(mut self, ns: u64) -> Self {
        self.min_period_ns = ns;
        self
    }

    /// The same timer with another bus clock period (ns per tick, at least 1).
    pub fn with_bus_cycle_ns(mut self, ns: u64) -> Self {
        self.bus_cycle_ns = ns.max(1);
        self
    }

    /// The LVT Timer, decoded.
    pub fn lvt(&self) -> LvtTimer {
        LvtTimer::from_raw(self.lvt)
    }

    fn mode(&self) -> TimerMode {
        self.lvt().mode
    }

    /// Ns per count at the current divisor.
    fn tick_ns(&self) -> u64 {
        u64::from(divisor(self.divide_config)).saturating_mul(self.bus_cycle_ns)
    }

    /// The time the count takes to run down; a periodic one raised to the floor.
    fn period_ns(&self) -> u64 {
        let count = u64::from(self.initial_count).saturating_mul(self.tick_ns());
        match self.mode() {
            TimerMode::Periodic if count != 0 => count.max(self.min_period_ns),
            _ => count,
        }
    }

    /// Reads timer MSR `msr` at host time `now_ns`: one entry point for the
    /// x2APIC timer registers (0x832, 0x838, 0x839, 0x83E) and
    /// IA32_TSC_DEADLINE (0x6E0).
    ///
    /// # Errors
    /// [`TimerError::NotTimer`] for any other MSR.
    pub fn read_msr(&self, msr: u32, now_ns: u64) -> Result<u64, TimerError> {
        if msr == MSR_TSC_DEADLINE {
            return Ok(self.tsc_deadline());
        }
        let reg = TimerRegister::from_x2apic_msr(msr).ok_or(TimerError::NotTimer(msr))?;
        Ok(u64::from(self.read(reg, now_ns)))
    }

    /// Writes timer MSR `msr` at host time `now_ns` (see [`Self::read_msr`]).
    ///
    /// # Errors
    /// [`TimerError::NotTimer`] for any other MSR, [`TimerError::ReadOnly`]
    /// for the Current Count, and [`TimerError::Reserved`] for an x2APIC timer
    /// register written with bits 63:32 set (KVM's `kvm_lapic_msr_write`).
    pub fn write_msr(&mut self, msr: u32, value: u64, now_ns: u64) -> Result<(), TimerError> {
        if msr == MSR_TSC_DEADLINE {
            self.write_tsc_deadline(value);
            return Ok(());
        }
        let reg = TimerRegister::from_x2apic_msr(msr).ok_or(TimerError::NotTimer(msr))?;
        let value32 = u32::try_from(value).map_err(|_| TimerError::Reserved { msr, value })?;
        self.write(reg, value32, now_ns)
    }

    /// Reads a register at host time `now_ns`.
    pub fn read(&self, reg: TimerRegister, now_ns: u64) -> u32 {
        match reg {
            TimerRegister::LvtTimer => self.lvt,
            TimerRegister::InitialCount => self.initial_count,
            TimerRegister::CurrentCount => self.current_count(now_ns),
            TimerRegister::DivideConfig => self.divide_config,
        }
    }

    /// Writes a register at host time `now_ns`.
    pub fn write(&mut self, reg: TimerRegister, value: u32, now_ns: u64) -> Result<(), TimerError> {
        match reg {
            TimerRegister::LvtTimer => self.write_lvt(value, now_ns),
            TimerRegister::InitialCount => self.write_initial_count(value, now_ns),
            TimerRegister::CurrentCount => return Err(TimerError::ReadOnly(reg)),
            TimerRegister::DivideConfig => self.write_divide(value, now_ns),
        }
        Ok(())
    }

    fn write_lvt(&mut self, value: u32, now_ns: u64) {
        if self.lvt().masked {
            // Spend what expired while masked: it was never delivered.
            let _ = self.expire(now_ns);
        }
        let was_deadline = self.mode() == TimerMode::TscDeadline;
        self.lvt = value & LVT_WRITABLE;
        // Into or out of TSC-deadline mode the timer stops (KVM's
        // `apic_update_lvtt`); between one-shot and periodic it counts on.
        if (self.mode() == TimerMode::TscDeadline) != was_deadline {
            self.initial_count = 0;
            self.next_ns = None;
            self.tsc_deadline = 0;
        }
    }

    fn write_initial_count(&mut self, value: u32, now_ns: u64) {
        if self.mode() == TimerMode::TscDeadline {
            return;
        }
        self.initial_count = value;
        let counts = matches!(self.mode(), TimerMode::OneShot | TimerMode::Periodic);
        self.next_ns = (value != 0 && counts).then(|| now_ns.saturating_add(self.period_ns()));
    }

    fn write_divide(&mut self, value: u32, now_ns: u64) {
        let count = self.current_count(now_ns);
        self.divide_config = value & DIVIDE_WRITABLE;
        if self.next_ns.is_some() {
            self.next_ns =
                Some(now_ns.saturating_add(u64::from(count).saturating_mul(self.tick_ns())));
        }
    }

    /// The Current Count at host time `now_ns`.
    pub fn current_count(&self, now_ns: u64) -> u32 {
        let Some(next) = self.next_ns else { return 0 };
        let period = self.period_ns().max(1);
        let remaining = if now_ns < next {
            next - now_ns
        } else if self.mode() == TimerMode::Periodic {
            // Expired but not yet reloaded: the count has wrapped around.
            period - (now_ns - next) % period
        } else {
            0
        };
        (remaining / self.tick_ns()).min(u64::from(self.initial_count)) as u32
    }

    /// IA32_TSC_DEADLINE as the guest reads it (0 outside TSC-deadline mode).
    pub fn tsc_deadline(&self) -> u64 {
        if self.mode() == TimerMode::TscDeadline {
            self.tsc_deadline
        } else {
            0
        }
    }

    /// Writes IA32_TSC_DEADLINE: arms (0: disarms) in TSC-deadline mode, ignored otherwise.
    pub fn write_tsc_deadline(&mut self, value: u64) {
        if self.mode() == TimerMode::TscDeadline {
            self.tsc_deadline = value;
        }
    }

    /// When the timer next expires (host ns), if it is armed.
    pub fn next_expiry_ns(&self) -> Option<u64> {
        match self.mode() {
            TimerMode::TscDeadline => {
                (self.tsc_deadline != 0).then(|| self.time.ns_at(self.tsc_deadline))
            }
            TimerMode::OneShot | TimerMode::Periodic => self.next_ns,
            TimerMode::Reserved => None,
        }
    }

    /// When the timer next interrupts the guest (host ns): its next expiry,
    /// unless it is masked. A VMM arms its host timer for this, so a masked
    /// timer costs no wake-ups.
    pub fn next_delivery_ns(&self) -> Option<u64> {
        self.next_expiry_ns().filter(|_| !self.lvt().masked)
    }

    /// Expires the timer if it is due at `now_ns`: one-shot and TSC-deadline
    /// disarm, periodic reloads (missed periods coalesce into one interrupt, as
    /// the interrupt request register holds one per vector).
    pub fn expire(&mut self, now_ns: u64) -> Option<Fired> {
        let due = self.next_expiry_ns().filter(|&due| due <= now_ns)?;
        match self.mode() {
            TimerMode::TscDeadline => self.tsc_deadline = 0,
            TimerMode::OneShot => self.next_ns = None,
            TimerMode::Periodic => {
                let period = self.period_ns().max(1);
                let missed = (now_ns - due) / period;
                self.next_ns = Some(due.saturating_add(period.saturating_mul(missed + 1)));
            }
            TimerMode::Reserved => return None,
        }
        let lvt = self.lvt();
        Some(Fired {
            vector: lvt.vector,
            deliver: !lvt.masked,
            due_ns: due,
        })
    }

    /// The state at host time `now_ns`, as plain data.
    pub fn save(&self, now_ns: u64) -> LapicTimerState {
        LapicTimerState {
            lvt: self.lvt,
            initial_count: self.initial_count,
            divide_config: self.divide_config,
            tsc_deadline: self.tsc_deadline,
            remaining_ns: self.next_ns.map(|n| n.saturating_sub(now_ns)),
        }
    }

    /// Restores a saved state at host time `now_ns` (values are masked as a
    /// write would mask them).
    pub fn restore(&mut self, state: &LapicTimerState, now_ns: u64) {
        self.lvt = state.lvt & LVT_WRITABLE;
        self.initial_count = state.initial_count;
        self.divide_config = state.divide_config & DIVIDE_WRITABLE;
        self.tsc_deadline = state.tsc_deadline;
        self.next_ns = state.remaining_ns.map(|r| now_ns.saturating_add(r));
    }

    /// The guest-time mapping (for the TSC deadline).
    pub fn guest_time(&self) -> GuestTime {
        self.time
    }

    /// Re-anchors the guest-time mapping (the TSC deadline's host time
    /// follows): a VMM refreshes it from a fresh (TSC, clock) pair before a
    /// deadline is armed, so that an error in the TSC frequency only scales
    /// the time to the deadline, not the time since the mapping was made.
    pub fn set_guest_time(&mut self, time: GuestTime) {
        self.time = time;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TimerRegister::*;

    /// A guest TSC of 1 tick per ns, equal to host ns.
    const TIME: GuestTime = GuestTime {
        tsc_khz: 1_000_000,
        ns: 0,
        tsc_at_ns: 0,
    };
    const ONE_SHOT: u32 = 0x20;
    const PERIODIC: u32 = 0x2_0020;
    const DEADLINE: u32 = 0x4_0020;

    fn timer(lvt: u32) -> LapicTimer {
        let mut t = LapicTimer::new(TIME);
        t.write(LvtTimer, lvt, 0).unwrap();
        t
    }

    #[test]
    fn re_anchoring_the_guest_time_moves_the_deadline_with_it() {
        let mut t = timer(DEADLINE);
        t.write_tsc_deadline(10_000);
        assert_eq!(t.next_expiry_ns(), Some(10_000));
        // The TSC read 9_000 at host ns 9_100: the deadline is 1 µs away.
        t.set_guest_time(GuestTime {
            ns: 9_100,
            tsc_at_ns: 9_000,
            ..TIME
        });
        assert_eq!(t.next_expiry_ns(), Some(10_100));
        assert_eq!(t.guest_time().ns, 9_100);
    }

    #[test]
    fn reset_state_is_masked_and_disarmed() {
        let t = LapicTimer::new(TIME);
        assert!(t.lvt().masked);
        assert_eq!(
            (
                t.read(InitialCount, 0),
                t.read(CurrentCount, 0),
                t.next_expiry_ns()
            ),
            (0, 0, None)
        );
    }

    #[test]
    fn one_shot_counts_down_fires_once_and_stops() {
        let mut t = timer(ONE_SHOT);
        t.write(DivideConfig, 0b0000, 0).unwrap(); // divide by 2
        t.write(InitialCount, 1000, 100).unwrap();
        assert_eq!(t.next_expiry_ns(), Some(100 + 2000));
        assert_eq!(t.read(CurrentCount, 100), 1000);
        assert_eq!(t.read(CurrentCount, 1100), 500);
        assert_eq!(t.expire(2099), None, "not yet due");
        assert_eq!(
            t.expire(2100),
            Some(Fired {
                vector: 0x20,
                deliver: true,
                due_ns: 2100
            })
        );
        assert_eq!(
            (
                t.read(CurrentCount, 3000),
                t.next_expiry_ns(),
                t.expire(5000)
            ),
            (0, None, None)
        );
    }

    #[test]
    fn writing_zero_stops_the_count() {
        let mut t = timer(ONE_SHOT);
        t.write(InitialCount, 1000, 0).unwrap();
        t.write(InitialCount, 0, 10).unwrap();
        assert_eq!((t.next_expiry_ns(), t.read(CurrentCount, 20)), (None, 0));
    }

    #[test]
    fn periodic_reloads_and_coalesces_missed_periods() {
        let mut t = timer(PERIODIC).with_min_period_ns(0);
        t.write(DivideConfig, 0b1011, 0).unwrap(); // divide by 1
        t.write(InitialCount, 100, 0).unwrap();
        assert_eq!(t.expire(100).map(|f| f.due_ns), Some(100));
        assert_eq!(t.next_expiry_ns(), Some(200));
        assert_eq!(t.read(CurrentCount, 150), 50);
        // Late by 3.5 periods: one interrupt, next expiry on the period grid.
        assert_eq!(t.read(CurrentCount, 550), 50, "wrapped while not reloaded");
        assert_eq!(t.expire(550).map(|f| f.due_ns), Some(200));
        assert_eq!(t.next_expiry_ns(), Some(600));
    }

    #[test]
    fn changing_the_divisor_keeps_the_current_count() {
        let mut t = timer(ONE_SHOT);
        t.write(DivideConfig, 0b1011, 0).unwrap(); // by 1
        t.write(InitialCount, 1000, 0).unwrap();
        t.write(DivideConfig, 0b0001, 400).unwrap(); // by 4, 600 counts left
        assert_eq!(t.read(CurrentCount, 400), 600);
        assert_eq!(t.next_expiry_ns(), Some(400 + 600 * 4));
        assert_eq!(t.read(DivideConfig, 0), 0b0001);
    }

    #[test]
    fn masked_timers_count_and_reload_but_do_not_deliver() {
        let mut t = timer(PERIODIC | 0x1_0000).with_min_period_ns(0);
        t.write(InitialCount, 10, 0).unwrap();
        let f = t.expire(20).unwrap();
        assert!(!f.deliver);
        assert!(t.next_expiry_ns().is_some());
        assert_eq!(t.next_delivery_ns(), None, "nothing to wake up for");
    }

    #[test]
    fn unmasking_spends_the_expiries_that_fell_while_masked() {
        let mut t = timer(PERIODIC | 0x1_0000).with_min_period_ns(0);
        t.write(DivideConfig, 0b1011, 0).unwrap(); // divide by 1
        t.write(InitialCount, 100, 0).unwrap();
        t.write(LvtTimer, PERIODIC, 350).unwrap();
        assert_eq!(
            t.next_delivery_ns(),
            Some(400),
            "the next tick, not one now"
        );
        assert_eq!(t.expire(399), None);
        let mut d = timer(DEADLINE | 0x1_0000);
        d.write_tsc_deadline(100);
        d.write(LvtTimer, DEADLINE, 200).unwrap();
        assert_eq!(
            (d.next_delivery_ns(), d.expire(300)),
            (None, None),
            "a deadline that passed while masked is not delivered late"
        );
    }

    #[test]
    fn a_periodic_period_below_kvms_floor_is_raised_to_it() {
        // The hostile guest's timer: divide by 1, 9 204 counts = 9.2 µs.
        let mut t = timer(PERIODIC);
        t.write(DivideConfig, 0b1011, 0).unwrap();
        t.write(InitialCount, 9_204, 1_000).unwrap();
        assert_eq!(t.next_expiry_ns(), Some(1_000 + KVM_MIN_TIMER_PERIOD_NS));
        assert_eq!(
            t.expire(1_000 + KVM_MIN_TIMER_PERIOD_NS).map(|f| f.deliver),
            Some(true)
        );
        assert_eq!(
            t.next_expiry_ns(),
            Some(1_000 + 2 * KVM_MIN_TIMER_PERIOD_NS)
        );
        assert!(t.read(CurrentCount, 1_000 + KVM_MIN_TIMER_PERIOD_NS + 1) <= 9_204);
        // At the floor exactly, and above it, the count is the period.
        let at = |count| {
            let mut t = timer(PERIODIC);
            t.write(DivideConfig, 0b1011, 0).unwrap();
            t.write(InitialCount, count, 0).unwrap();
            t.next_expiry_ns()
        };
        assert_eq!(at(200_000), Some(200_000));
        assert_eq!(at(200_001), Some(200_001));
        assert_eq!(at(199_999), Some(200_000));
    }

    #[test]
    fn the_floor_leaves_one_shot_and_a_stopped_count_alone_and_is_configurable() {
        let mut o = timer(ONE_SHOT);
        o.write(DivideConfig, 0b1011, 0).unwrap();
        o.write(InitialCount, 30, 0).unwrap();
        assert_eq!(o.next_expiry_ns(), Some(30), "one-shot is not floored");
        let mut p = timer(PERIODIC);
        p.write(InitialCount, 0, 0).unwrap();
        assert_eq!(p.next_expiry_ns(), None, "count 0 stops, it is not floored");
        let mut c = timer(PERIODIC).with_min_period_ns(50_000);
        c.write(DivideConfig, 0b1011, 0).unwrap();
        c.write(InitialCount, 30_000, 0).unwrap();
        assert_eq!(c.next_expiry_ns(), Some(50_000));
    }

    #[test]
    fn tsc_deadline_arms_fires_and_disarms() {
        let mut t = timer(DEADLINE);
        t.write_tsc_deadline(5_000);
        assert_eq!((t.tsc_deadline(), t.next_expiry_ns()), (5_000, Some(5_000)));
        assert_eq!(t.expire(4_999), None);
        assert_eq!(t.expire(5_000).map(|f| f.vector), Some(0x20));
        assert_eq!((t.tsc_deadline(), t.next_expiry_ns()), (0, None));
        t.write_tsc_deadline(9_000);
        t.write_tsc_deadline(0);
        assert_eq!(t.next_expiry_ns(), None, "writing 0 disarms");
    }

    #[test]
    fn tsc_deadline_mode_ignores_the_counter_registers_and_vice_versa() {
        let mut t = timer(DEADLINE);
        t.write(InitialCount, 1000, 0).unwrap();
        assert_eq!(
            (
                t.read(InitialCount, 0),
                t.read(CurrentCount, 0),
                t.next_expiry_ns()
            ),
            (0, 0, None)
        );
        let mut c = timer(ONE_SHOT);
        c.write_tsc_deadline(1_000);
        assert_eq!(
            (c.tsc_deadline(), c.next_expiry_ns()),
            (0, None),
            "ignored outside TSC-deadline mode"
        );
    }

    #[test]
    fn switching_into_or_out_of_tsc_deadline_mode_disarms() {
        let mut t = timer(ONE_SHOT);
        t.write(InitialCount, 1000, 0).unwrap();
        t.write(LvtTimer, PERIODIC, 10).unwrap();
        assert_eq!(
            t.read(InitialCount, 10),
            1000,
            "one-shot to periodic counts on"
        );
        assert!(t.next_expiry_ns().is_some());
        t.write(LvtTimer, DEADLINE, 20).unwrap();
        assert_eq!((t.read(InitialCount, 20), t.next_expiry_ns()), (0, None));
        let mut d = timer(DEADLINE);
        d.write_tsc_deadline(100);
        d.write(LvtTimer, DEADLINE | 0x1_0000, 0).unwrap();
        assert_eq!(d.tsc_deadline(), 100, "masking is not a mode switch");
        d.write(LvtTimer, ONE_SHOT, 0).unwrap();
        d.write(LvtTimer, DEADLINE, 0).unwrap();
        assert_eq!(d.tsc_deadline(), 0);
    }

    #[test]
    fn the_reserved_mode_never_counts_and_reserved_bits_read_as_zero() {
        let mut t = timer(0x6_0020);
        t.write(InitialCount, 10, 0).unwrap();
        assert_eq!((t.next_expiry_ns(), t.expire(1_000_000)), (None, None));
        let mut u = LapicTimer::new(TIME);
        u.write(LvtTimer, u32::MAX, 0).unwrap();
        assert_eq!(u.read(LvtTimer, 0), LVT_WRITABLE);
        u.write(DivideConfig, u32::MAX, 0).unwrap();
        assert_eq!(u.read(DivideConfig, 0), 0b1011);
    }

    #[test]
    fn current_count_is_read_only() {
        let mut t = timer(ONE_SHOT);
        assert_eq!(
            t.write(CurrentCount, 5, 0),
            Err(TimerError::ReadOnly(CurrentCount))
        );
    }

    #[test]
    fn one_msr_entry_point_covers_the_x2apic_registers_and_the_tsc_deadline() {
        let mut t = LapicTimer::new(TIME);
        t.write_msr(0x832, u64::from(DEADLINE), 0).unwrap();
        t.write_msr(0x6e0, 5_000, 0).unwrap();
        assert_eq!(t.read_msr(0x6e0, 0), Ok(5_000));
        assert_eq!(t.next_expiry_ns(), Some(5_000));
        t.write_msr(0x832, u64::from(ONE_SHOT), 0).unwrap();
        t.write_msr(0x83e, 0b1011, 0).unwrap();
        t.write_msr(0x838, 100, 0).unwrap();
        assert_eq!(t.read_msr(0x839, 40), Ok(60));
        assert_eq!(t.read_msr(0x832, 0), Ok(u64::from(ONE_SHOT)));
        assert_eq!(
            t.write_msr(0x839, 1, 0),
            Err(TimerError::ReadOnly(CurrentCount))
        );
        let wide = 1 << 32 | 100;
        assert_eq!(
            t.write_msr(0x838, wide, 0),
            Err(TimerError::Reserved {
                msr: 0x838,
                value: wide
            })
        );
        assert_eq!(
            t.read(InitialCount, 0),
            100,
            "a refused write changes nothing"
        );
        assert_eq!(t.write_msr(0x830, 0, 0), Err(TimerError::NotTimer(0x830)));
        assert_eq!(t.read_msr(0x1b, 0), Err(TimerError::NotTimer(0x1b)));
    }

    #[test]
    fn extreme_values_neither_panic_nor_overflow() {
        let mut t = timer(PERIODIC).with_bus_cycle_ns(u64::MAX);
        t.write(DivideConfig, 0b1010, 0).unwrap(); // by 128
        t.write(InitialCount, u32::MAX, u64::MAX - 5).unwrap();
        assert_eq!(t.next_expiry_ns(), Some(u64::MAX));
        assert!(t.expire(u64::MAX).is_some());
        let count = t.read(CurrentCount, u64::MAX);
        assert!(count <= t.read(InitialCount, 0));
        let mut d = timer(DEADLINE);
        d.write_tsc_deadline(u64::MAX);
        assert_eq!(d.next_expiry_ns(), Some(u64::MAX));
        d.write_tsc_deadline(1); // in the past: due at once
        assert!(d.expire(10).is_some());
    }

    #[test]
    fn state_round_trips_through_plain_data() {
        let mut t = timer(PERIODIC);
        t.write(DivideConfig, 0b0010, 0).unwrap();
        t.write(InitialCount, 500, 1_000).unwrap();
        let saved = t.save(2_000);
        let mut r = LapicTimer::new(TIME);
        r.restore(&saved, 50_000);
        assert_eq!(r.read(CurrentCount, 50_000), t.read(CurrentCount, 2_000));
        assert_eq!(
            r.next_expiry_ns(),
            Some(50_000 + (t.next_expiry_ns().unwrap() - 2_000))
        );
        assert_eq!(r.save(50_000), saved);
    }
}
