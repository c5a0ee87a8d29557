//! Where each of the five crates goes in a VMM, with a policy of our own.
//!
//! `cargo run -p reference-vmm --example minimal` runs two guests of the
//! kit (`test-guests`) on `/dev/kvm` and prints what each mechanism did:
//!
//! 1. **halt-poll** decides how a halted vCPU waits. The VMM asks
//!    [`Policies::halt_poll`] for a policy per vCPU and wake source, and its
//!    `HaltPoller` runs it on every `hlt` exit (`src/irqchip/user.rs`).
//!    Ours, [`CountingPoll`], polls a fixed window and counts its plans.
//! 2. **lapic-timer** arms each vCPU's host timer early by an advance and
//!    spins to the deadline before entry ([`Policies::timer_advance`],
//!    `src/irqchip/host_timer.rs`). Ours is a fixed 20 µs.
//! 3. **vcpu-sched** boosts the vCPU an interrupt was delivered to
//!    ([`Policies::boost`], `src/irq.rs`): the family's `DirectedYield`.
//! 4. **rcu-qs** makes the device bus lock-free on the exit path
//!    ([`Policies::bus`]): the vCPU threads are readers, offline while in
//!    the guest (`src/vcpu.rs`), so a writer's grace period never waits for
//!    a vCPU that stays in the guest.
//! 5. **dirty-log** tracks the pages the guest writes, here through KVM's
//!    bitmap over the VM's memory slots (migration uses it, `src/migration`).

use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::thread;
use std::time::Duration;

use dirty_log::{DirtyLog, KvmBitmap, copy_round};
use halt_poll::{HaltOutcome, PollPlan, PollPolicy};
use reference_vmm::{FamilyPolicies, Policies, RunReport, Vm, VmConfig, WakeSource};

/// 1. Our halt-poll policy: poll `window`, then block; counts its plans.
struct CountingPoll {
    window: Duration,
    plans: Arc<AtomicU64>,
}

impl PollPolicy for CountingPoll {
    fn plan(&self) -> PollPlan {
        self.plans.fetch_add(1, Relaxed);
        PollPlan::poll(self.window)
    }

    fn window(&self) -> Duration {
        self.window
    }

    fn learn(&mut self, _outcome: &HaltOutcome) {}
}

/// Our policies: our poller for interrupts, a fixed timer advance, and the
/// family's defaults for the rest (the timer's halts, boosts, the bus).
struct OurPolicies {
    plans: Arc<AtomicU64>,
}

impl Policies for OurPolicies {
    fn halt_poll(&self, vcpu: u32, source: WakeSource) -> Box<dyn PollPolicy + Send> {
        match source {
            WakeSource::Interrupt => Box::new(CountingPoll {
                window: Duration::from_micros(30),
                plans: self.plans.clone(),
            }),
            WakeSource::Timer => FamilyPolicies.halt_poll(vcpu, source),
        }
    }

    /// 2. lapic-timer: arm the host timer 20 µs before each guest deadline.
    fn timer_advance(
        &self,
        _vcpu: u32,
        _tsc_khz: u64,
    ) -> Box<dyn lapic_timer::AdvancePolicy + Send> {
        Box::new(lapic_timer::Fixed(Duration::from_micros(20)))
    }
}

/// What the two runs showed.
struct Summary {
    plans: u64,
    pingpong: RunReport,
    cyclictest: RunReport,
    dirty_pages: u64,
    grace_periods: u64,
}

/// Runs `name` on a VM of `config`, with `params`.
fn vm(config: &VmConfig, params: &[u64]) -> Result<Vm, Box<dyn Error>> {
    let mut config = config.clone();
    config.params[..params.len()].copy_from_slice(params);
    Ok(Vm::new(&config)?)
}

fn run() -> Result<Summary, Box<dyn Error>> {
    let plans = Arc::new(AtomicU64::new(0));
    let config = VmConfig {
        vcpus: 2,
        timeout: Some(Duration::from_secs(120)),
        policies: Arc::new(OurPolicies {
            plans: plans.clone(),
        }),
        ..VmConfig::default()
    };
    // Two vCPUs bounce 500 IPIs, halting between them (1, 3).
    let pingpong = vm(&config, &[500, 0])?;
    // 5. dirty-log: KVM's bitmap over the slots the VM registered.
    let mut log = KvmBitmap::new(&*pingpong.vm_fd(), pingpong.dirty_slots()?)?;
    log.enable()?;
    // 4. rcu-qs: a writer waits for grace periods while the vCPUs run.
    let (domain, stop) = (pingpong.rcu_domain(), Arc::new(AtomicBool::new(false)));
    let writer = thread::spawn({
        let stop = stop.clone();
        move || {
            let mut waited = 0;
            while domain.synchronize().is_ok() {
                waited += 1;
                if stop.load(Relaxed) {
                    break;
                }
                thread::sleep(Duration::from_micros(500));
            }
            waited
        }
    });
    let pingpong = pingpong.run(
        test_guests::find("pingpong").unwrap(),
        Box::new(std::io::sink()),
    )?;
    stop.store(true, Relaxed);
    let grace_periods = writer.join().map_err(|_| "the writer panicked")?;
    let dirty_pages = copy_round(&mut log, |_run| Ok(()))?;
    // One vCPU arms 200 TSC-deadline timers 1 ms apart (2).
    let ms = lapic_timer::TscClock::shared().tsc_khz();
    let one = VmConfig { vcpus: 1, ..config };
    let cyclictest = vm(&one, &[200, ms])?.run(
        test_guests::find("cyclictest").unwrap(),
        Box::new(std::io::sink()),
    )?;
    Ok(Summary {
        plans: plans.load(Relaxed),
        pingpong,
        cyclictest,
        dirty_pages,
        grace_periods,
    })
}

fn print(s: &Summary) {
    let (p, c) = (&s.pingpong.stats, &s.cyclictest.stats);
    let spin_us = c.timer_spin_ns as f64 / 1e3 / c.timer_expiries.max(1) as f64;
    println!(
        "1. halt-poll: our CountingPoll planned {} halts, {} ended while polling\n\
         2. lapic-timer: {} expiries, {spin_us:.1} µs spun per expiry to its deadline\n\
         3. vcpu-sched: {} interrupts delivered, {} boosts\n\
         4. rcu-qs: a writer finished {} grace periods while the vCPUs ran\n\
         5. dirty-log: {} pages dirtied during the ping-pong",
        s.plans,
        p.successful_polls,
        c.timer_expiries,
        p.interrupts,
        p.boosts,
        s.grace_periods,
        s.dirty_pages,
    );
}

fn main() -> Result<(), Box<dyn Error>> {
    if kvm_ioctls::Kvm::new().is_err() && std::env::var_os("VM_LATENCY_ALLOW_NO_KVM").is_some() {
        eprintln!("SKIPPED minimal: /dev/kvm cannot be opened");
        return Ok(());
    }
    print(&run()?);
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_mechanism_acted_and_our_policy_was_called() {
        if kvm_ioctls::Kvm::new().is_err() && std::env::var_os("VM_LATENCY_ALLOW_NO_KVM").is_some()
        {
            eprintln!("SKIPPED every_mechanism_acted_and_our_policy_was_called: no /dev/kvm");
            return;
        }
        let s = super::run().unwrap();
        super::print(&s);
        assert!(s.plans > 0, "our poll policy planned the halts");
        assert_eq!(s.pingpong.value(0, "irqs"), Some(500));
        assert_eq!(s.cyclictest.value(0, "samples"), Some(200));
        assert!(s.cyclictest.stats.timer_expiries > 0);
        assert!(s.grace_periods > 0, "a grace period completed");
        assert!(s.dirty_pages > 0, "the guest wrote memory");
    }
}
