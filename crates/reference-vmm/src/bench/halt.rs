//! `bench halt`: two vCPUs ping-pong an IPI, each halting between messages
//! (the seed's contextswitch); the halted side waits through each halt-poll
//! policy in turn, then the guest polls its mailbox itself first, and last
//! KVM's in-kernel LAPIC does it all (its halt polling as configured).

use crate::bench::{Cell, Options, Runs, Table, goal, measure, ticks_per_us};
use crate::error::Error;
use crate::mechanisms::{HaltPoll, Irqchip, Mechanisms};

/// Round trips per run, without `--quick`.
const ROUNDS: u64 = 3000;

/// One way to wait for the other vCPU's message.
#[derive(Clone, Copy)]
enum Variant {
    /// The userspace APIC, the VMM polling with this policy.
    Vmm(HaltPoll),
    /// The userspace APIC, the guest polling its mailbox for predictive's window.
    GuestSide,
    /// KVM's LAPIC, halts and IPIs in the kernel, with KVM's halt polling.
    Kernel,
}

/// The variants, baselines first.
const VARIANTS: [Variant; 8] = [
    Variant::Vmm(HaltPoll::Off),
    Variant::Vmm(HaltPoll::Always),
    Variant::Vmm(HaltPoll::Kvm),
    Variant::Vmm(HaltPoll::Haltpoll),
    Variant::Vmm(HaltPoll::Aio),
    Variant::Vmm(HaltPoll::Predictive),
    Variant::GuestSide,
    Variant::Kernel,
];
const OFF: usize = 0;
const ALWAYS: usize = 1;
const PREDICTIVE: usize = 5;
const GUEST_SIDE: usize = 6;

impl Variant {
    fn name(self) -> String {
        match self {
            Self::Vmm(HaltPoll::Off) => "off (block-only)".into(),
            Self::Vmm(HaltPoll::Always) => "always (poll 10 ms)".into(),
            Self::Vmm(p) => p.to_string(),
            Self::GuestSide => "guest-side polling, predictive window".into(),
            Self::Kernel => "--irqchip kernel (KVM's halt polling)".into(),
        }
    }

    fn mechanisms(self) -> Mechanisms {
        let m = Mechanisms::default();
        match self {
            Self::Vmm(halt_poll) => Mechanisms { halt_poll, ..m },
            Self::GuestSide => Mechanisms {
                guest_poll: true,
                ..m
            },
            Self::Kernel => Mechanisms {
                irqchip: Irqchip::Kernel,
                halt_poll: HaltPoll::Kvm,
                ..m
            },
        }
    }
}

/// Runs the scenario; `progress` hears about each run.
pub fn run(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let rounds = opts.rounds(ROUNDS);
    let mut rt = vec![Runs::new(); VARIANTS.len()];
    let mut cpu = vec![Runs::new(); VARIANTS.len()];
    let mut poll = vec![Runs::new(); VARIANTS.len()];
    for rep in 0..opts.reps() {
        for (i, variant) in VARIANTS.into_iter().enumerate() {
            progress(&format!(
                "halt: {} ({}/{})",
                variant.name(),
                rep + 1,
                opts.reps()
            ));
            let m = variant.mechanisms();
            let run = measure("pingpong", 2, m, &[rounds, u64::from(m.guest_poll)], |_| {})?;
            let ticks = run.report.value(0, "ticks").unwrap_or(0) as f64;
            rt[i].push(ticks / ticks_per_us() / rounds as f64);
            cpu[i].push(run.cpu.as_secs_f64() * 1e6 / rounds as f64);
            poll[i].push(run.report.stats.polled_ns as f64 / 1e3 / rounds as f64);
        }
    }
    let mut t = Table::new(
        "halt: IPI ping-pong between two halting vCPUs",
        &[
            "variant",
            "round trip (µs)",
            "vs block-only",
            "polling per round trip (µs)",
            "polling vs always-poll",
            "process CPU per round trip (µs)",
        ],
    );
    for (i, variant) in VARIANTS.into_iter().enumerate() {
        t.row(vec![
            Cell::text(variant.name()),
            Cell::num(rt[i].median(), 1),
            Cell::ratio(&rt[i].ratio_to(&rt[OFF])),
            Cell::num(poll[i].median(), 1),
            Cell::ratio(&poll[i].ratio_to(&poll[ALWAYS])),
            Cell::num(cpu[i].median(), 1),
        ]);
    }
    t.better("a shorter round trip, less polling, less process CPU");
    t.note(format!(
        "{rounds} round trips per run, {} runs per variant, alternating. Polling is the time the halted vCPU threads spent polling (halt-poll's halt_poll_success_ns + halt_poll_fail_ns): the CPU the policy spends. Process CPU also counts the guest (its CPL0 code is emulated on this KVM) and the VMM's exit handling.",
        opts.reps()
    ));
    t.note(format!(
        "--irqchip kernel runs the same guest on KVM's LAPIC: IPIs, EOIs and halts never leave the kernel, which polls up to halt_poll_ns ({}). It is the floor a userspace APIC pays its exits above, not a policy to match; its polling is KVM's own (halt_poll_success_ns + halt_poll_fail_ns from the vCPUs' binary statistics).",
        kvm_halt_poll_ns()
    ));
    let better = rt[OFF].zip(&rt[ALWAYS], f64::min);
    let predictive_rt = rt[PREDICTIVE].ratio_to(&better);
    let predictive_poll = poll[PREDICTIVE].ratio_to(&poll[ALWAYS]);
    let meets = |rt: f64, poll: f64| rt <= 1.1 && poll <= 0.5;
    t.note(goal(
        "predictive round trip at most 1.1x the better of block-only and always-poll, at no more than half of always-poll's polling",
        &format!(
            "{} of the round trip, at {} of always-poll's polling",
            predictive_rt.ratio_text(),
            predictive_poll.ratio_text()
        ),
        meets(predictive_rt.median(), predictive_poll.median()),
        &predictive_rt.0.iter().zip(&predictive_poll.0).map(|(&r, &p)| meets(r, p)).collect::<Vec<_>>(),
    ));
    let speedup = rt[OFF].ratio_to(&rt[GUEST_SIDE]);
    t.note(goal(
        "guest-side polling at least 3x faster than block-only, as in the seed (its polling is the guest's, at CPL3, outside the VMM's accounting)",
        &format!("{} faster", speedup.ratio_text()),
        speedup.median() >= 3.0,
        &speedup.each(|s| s >= 3.0),
    ));
    Ok(t)
}

/// KVM's module-wide halt-polling window, as the kernel reports it.
fn kvm_halt_poll_ns() -> String {
    std::fs::read_to_string("/sys/module/kvm/parameters/halt_poll_ns")
        .map(|ns| format!("{} ns here", ns.trim()))
        .unwrap_or_else(|_| "not readable here".into())
}
