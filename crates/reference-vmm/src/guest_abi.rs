//! This VMM's side of the guest kit's channels ([`test_guests::abi`]) that
//! carry measurements: the delivery lead a timer learns from the guest's
//! interrupt record, and guest-side polling through the mailbox. A contract
//! only the kit's programs follow; both are on this VMM's own local APIC
//! (`Irqchip::User`).
//!
//! Both read guest memory that the guest may fill with anything: every value
//! is bounded before use, and nothing a guest writes can panic the VMM or
//! move a lead past [`MAX_LEAD`].

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use halt_poll::{HaltOutcome, PollPolicy};
use lapic_timer::{DeliveryLead, GuestTime};
use test_guests::layout::MAILBOX_RING;
use vm_memory::{Bytes, GuestAddress};

use crate::memory::VmMemory;
use crate::report::bucket_holding;

/// Guest-side polling: a halt-poll policy whose window the guest polls its
/// mailbox for; the guest reports each wait's outcome in the mailbox ring,
/// and the VMM learns from them at the vCPU's next exit and publishes the
/// next window.
pub struct GuestPoll {
    policy: Box<dyn PollPolicy + Send>,
    mailbox: u64,
    tsc_khz: u64,
    /// Outcomes learned so far.
    seen: u64,
    /// The window last published, ticks.
    published: Option<u64>,
}

impl GuestPoll {
    /// Learns for `policy` from the mailbox at guest address `mailbox`, of a
    /// guest whose TSC runs at `tsc_khz`.
    pub fn new(policy: Box<dyn PollPolicy + Send>, mailbox: u64, tsc_khz: u64) -> Self {
        Self {
            policy,
            mailbox,
            tsc_khz,
            seen: 0,
            published: None,
        }
    }

    fn ticks_to(&self, ticks: u64) -> Duration {
        Duration::from_nanos(ticks.saturating_mul(1_000_000) / self.tsc_khz.max(1))
    }

    /// Learns the outcomes the guest reported since the last look (the last
    /// ring's worth at most: a guest may write anything there) and publishes
    /// the policy's window.
    pub fn learn(&mut self, memory: &VmMemory) {
        let word = |offset: u64| {
            memory
                .read_obj::<u64>(GuestAddress(self.mailbox + offset))
                .unwrap_or(0)
        };
        let count = word(16);
        for n in count.saturating_sub(MAILBOX_RING).max(self.seen)..count {
            let at = 32 + (n % MAILBOX_RING) * 16;
            let (polled, waited) = (word(at), word(at + 8));
            let (halt, polled) = (self.ticks_to(waited & !(1 << 63)), self.ticks_to(polled));
            self.policy.learn(&if waited >> 63 == 1 {
                HaltOutcome::woken_after_blocking(polled, halt)
            } else {
                HaltOutcome::woken_while_polling(halt)
            });
        }
        self.seen = count;
        let window = self.policy.plan().window.as_nanos() as u64 * self.tsc_khz / 1_000_000;
        if self.published != Some(window) {
            // The mailbox is in guest memory the VMM laid out: writable.
            let _ = memory.write_obj(window, GuestAddress(self.mailbox));
            self.published = Some(window);
        }
    }
}

/// How far below the shortest recent delivery latency the lead stays: the
/// path's own jitter must not make the guest see an interrupt early.
pub const LEAD_MARGIN: Duration = Duration::from_micros(5);

/// The longest delivery lead: 5 µs shorter than the fastest path from
/// delivery start (`KVM_INTERRUPT`, about 5 µs of it here, then `KVM_RUN`) to
/// the guest's interrupt entry measured on this KVM (18 µs), so host noise in
/// the latencies the lead learns from cannot make a guest see its interrupt
/// early; and all a guest that lies in its interrupt record can buy.
pub const MAX_LEAD: Duration = Duration::from_micros(13);

/// Learns how long delivery takes, from the moment it starts (before
/// `KVM_INTERRUPT`) to the guest's interrupt entry (which records the TSC it
/// ran at), and lets the timer start delivery that much before the deadline
/// (lapic-timer's `DeliveryLead`), never so early that the guest sees it
/// before the deadline.
pub struct TimerLead {
    lead: DeliveryLead,
    time: GuestTime,
    record: u64,
    /// The timer vector just fired, its deadline's guest TSC, and the guest
    /// TSC when its delivery started.
    fired: Option<(u8, u64, u64)>,
    /// Injected: guest TSC at delivery start, the deadline's, the record's count before.
    inflight: Option<(u64, u64, u64)>,
}

impl TimerLead {
    /// A lead of 0 for a guest whose time `time` maps and whose interrupt
    /// record is at guest address `record`.
    pub fn new(time: GuestTime, record: u64) -> Self {
        Self {
            lead: DeliveryLead::new(LEAD_MARGIN),
            time,
            record,
            fired: None,
            inflight: None,
        }
    }

    /// Re-anchors the guest-time mapping the deadlines convert through.
    pub fn set_guest_time(&mut self, time: GuestTime) {
        self.time = time;
    }

    /// The lead in force.
    pub fn current(&self) -> Duration {
        self.lead.lead().min(MAX_LEAD)
    }

    /// The timer's `vector`, due at host `due_ns`, was posted at `start_ns`.
    pub fn fired(&mut self, vector: u8, due_ns: u64, start_ns: u64) {
        let tsc = |ns| self.time.tsc_at(ns);
        self.fired = Some((vector, tsc(due_ns), tsc(start_ns)));
    }

    fn read(&self, memory: &VmMemory) -> Option<(u64, u64)> {
        let tsc = memory.read_obj(GuestAddress(self.record)).ok()?;
        let count = memory.read_obj(GuestAddress(self.record + 8)).ok()?;
        Some((tsc, count))
    }

    /// `vector` was injected: if it is the timer's, watch the record for
    /// the guest's entry.
    pub fn injected(&mut self, vector: u8, memory: &VmMemory) {
        if let Some((_, deadline, start)) = self.fired.take_if(|(v, ..)| *v == vector) {
            self.inflight = self.read(memory).map(|(_, count)| (start, deadline, count));
        }
    }

    /// After an exit: if the guest took the timer interrupt, learn from it,
    /// record its delivery in `path`, and return the new lead.
    pub fn learn(&mut self, memory: &VmMemory, path: &DeliveryPath) -> Option<Duration> {
        let (started, deadline, count) = self.inflight?;
        let (entry_tsc, now_count) = self.read(memory)?;
        if now_count == count {
            return None;
        }
        self.inflight = None;
        let ns = |ticks: u64| {
            Duration::from_nanos(ticks.saturating_mul(1_000_000) / self.time.tsc_khz.max(1))
        };
        if entry_tsc < deadline {
            self.lead.learn_early(ns(deadline - entry_tsc));
        } else {
            let latency = ns(entry_tsc.saturating_sub(started));
            self.lead.learn_latency(latency);
            path.record(latency);
        }
        Some(self.current())
    }
}

/// Buckets of [`DeliveryPath`], 1 µs each; the last takes everything longer.
pub const DELIVERY_BUCKETS: usize = 64;

/// How long timer deliveries took, from their start (before `KVM_INTERRUPT`)
/// to the guest's interrupt entry, in 1 µs buckets: the lead covers up to
/// [`MAX_LEAD`] of it, and the rest is lateness no advance removes.
#[derive(Debug)]
pub struct DeliveryPath {
    per_us: [AtomicU64; DELIVERY_BUCKETS],
}

impl Default for DeliveryPath {
    fn default() -> Self {
        Self {
            per_us: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl DeliveryPath {
    /// Counts one delivery that took `latency`.
    pub fn record(&self, latency: Duration) {
        let bucket = usize::try_from(latency.as_micros())
            .map_or(DELIVERY_BUCKETS - 1, |us| us.min(DELIVERY_BUCKETS - 1));
        self.per_us[bucket].fetch_add(1, Relaxed);
    }

    /// The median delivery, whole µs (`None`: none recorded).
    pub fn median_us(&self) -> Option<u64> {
        bucket_holding(&self.per_us, 1, 2).map(|us| us as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delivery_path_median_is_in_whole_us_and_caps_its_last_bucket() {
        let path = DeliveryPath::default();
        assert_eq!(path.median_us(), None);
        for us in [19, 19, 29, 29, 29] {
            path.record(Duration::from_micros(us) + Duration::from_nanos(999));
        }
        assert_eq!(path.median_us(), Some(29));
        for _ in 0..6 {
            path.record(Duration::from_secs(u64::MAX));
        }
        assert_eq!(path.median_us(), Some(DELIVERY_BUCKETS as u64 - 1));
    }
}
