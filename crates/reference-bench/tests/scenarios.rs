//! Every `bench` scenario in its `--quick` form on real `/dev/kvm`, and what
//! each must get right whatever the speed: every IPI and acknowledgement
//! delivered, every timer fired once and not early, grace periods complete.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;
#[path = "../../reference-vmm/tests/program/mod.rs"]
mod program;

use std::time::Duration;

use common::kvm_available;
use reference_bench::{self as bench, Options, Table};
use reference_vmm::{Irqchip, TimerPlacement};
use reference_vmm_cli::presets::{Boost, Choices, HaltPoll, TimerAdvance};
use vm_memory::{Bytes, GuestAddress};

const QUICK: Options = Options {
    quick: true,
    qemu: None,
    cloud_hypervisor: None,
    firecracker: None,
    patched_cloud_hypervisor: None,
    patched_firecracker: None,
    only: None,
};

/// Every cell that has a number has a finite one: nothing was left unmeasured.
fn all_measured(t: &Table, rows: usize) {
    assert_eq!(t.rows.len(), rows, "{}", t.markdown());
    for row in &t.rows {
        for cell in row {
            assert!(cell.value.is_none_or(f64::is_finite), "{}", t.markdown());
        }
    }
}

/// The rows of QEMU (named in column `column`), after checking that each
/// of its two configurations has a row or, where QEMU is installed but gave
/// no result or was not run, a note that says so.
fn qemu_rows(t: &Table, column: usize) -> usize {
    use reference_bench::peer_run::PeerBinary;
    let installed = reference_bench::qemu::Qemu::find().is_some();
    for apic in ["kernel-irqchip=off", "kernel-irqchip=on"] {
        let row = t.rows.iter().any(|r| r[column].text.contains(apic));
        let failed = t
            .notes
            .iter()
            .any(|n| n.contains(apic) && (n.contains("no result") || n.contains("not run")));
        assert!(
            row || failed || !installed,
            "QEMU with {apic}: {}",
            t.markdown()
        );
    }
    t.rows
        .iter()
        .filter(|r| r[column].text.contains("qemu"))
        .count()
}

/// The rows of Cloud Hypervisor and Firecracker (named in column
/// `column`), after checking that each found has a row, or a note that it
/// gave no result.
fn rust_peer_rows(t: &Table, column: usize) -> usize {
    use reference_bench::cloud_hypervisor::CloudHypervisor;
    use reference_bench::firecracker::Firecracker;
    use reference_bench::peer_run::PeerBinary;
    let found = [
        ("cloud-hypervisor", CloudHypervisor::find().is_some()),
        ("firecracker", Firecracker::find().is_some()),
    ];
    let mut rows = 0;
    for (name, found) in found {
        let theirs = t
            .rows
            .iter()
            .filter(|r| r[column].text.contains(name))
            .count();
        let failed = t
            .notes
            .iter()
            .any(|n| n.contains(name) && n.contains("no result"));
        assert!(theirs > 0 || failed || !found, "{name}: {}", t.markdown());
        rows += theirs;
    }
    rows
}

#[test]
fn every_scenario_runs_quick_and_measures_every_variant() {
    if !kvm_available("every_scenario_runs_quick_and_measures_every_variant") {
        return;
    }
    let mut quiet = |_: &str| {};
    // 65 rows of this VMM's; each peer's where it was found and gave a result.
    let halt = bench::halt::run(QUICK, &mut quiet).unwrap();
    all_measured(&halt, 65 + qemu_rows(&halt, 1) + rust_peer_rows(&halt, 1));
    let timer = bench::timer::run(QUICK, &mut quiet).unwrap();
    all_measured(
        &timer,
        20 + qemu_rows(&timer, 1) + rust_peer_rows(&timer, 1),
    );
    let sched = bench::sched::run(QUICK, &mut quiet).unwrap();
    all_measured(
        &sched,
        12 + qemu_rows(&sched, 0) + rust_peer_rows(&sched, 0),
    );
    // Each has its goals against the peers, measured or saying why not:
    // QEMU's own APIC on both xAPIC ping-pongs and the Rust peers; each
    // period against every peer; QEMU's own APIC and the Rust peers.
    for (t, goals) in [(&halt, 3), (&timer, 2), (&sched, 2)] {
        assert_eq!(t.peer_goals.len(), goals, "{}", t.markdown());
    }
    all_measured(&bench::rcu::run(QUICK, &mut quiet).unwrap(), 8);
    // Each backend at both rates; each without and with the dirty limit
    // over the link beside two hogs at both rates; over the link, the ring
    // without it and each with it at both rates; manual protect in plain
    // text and in TLS at the lower; post-copy after pre-copy and at once
    // over the link beside two hogs at both rates, where userfaultfd(2) is
    // allowed; and Cloud Hypervisor's three ways at both rates where it
    // was found.
    let migrate = bench::migrate::run(QUICK, &mut quiet).unwrap();
    let ch = {
        use reference_bench::peer_run::PeerBinary;
        reference_bench::cloud_hypervisor::CloudHypervisor::find().is_some()
    };
    let postcopy = migration::postcopy::userfaultfd_available().is_ok();
    let postcopy_rows = if postcopy { 4 } else { 0 };
    all_measured(
        &migrate,
        6 + 12 + postcopy_rows + 8 + 2 + if ch { 6 } else { 0 },
    );
    // Post-copy at once always faults: its stall columns have figures.
    let at_once = migrate
        .rows
        .iter()
        .filter(|r| r[0].text.starts_with("post-copy (immediate)"));
    for row in at_once {
        assert!(
            row[11..14].iter().all(|c| c.value.is_some()),
            "{}",
            migrate.markdown()
        );
    }
    assert_eq!(migrate.peer_goals.len(), 2, "{}", migrate.markdown());
    // This VMM's full snapshot, and its full and incremental ones; Cloud
    // Hypervisor's;
    // Firecracker's full and diff, each way, where each was found; every
    // restored guest checked every page.
    let snapshot = bench::snapshot::run(QUICK, &mut quiet).unwrap();
    let fc = {
        use reference_bench::peer_run::PeerBinary;
        reference_bench::firecracker::Firecracker::find().is_some()
    };
    let peer_rows = usize::from(ch) + if fc { 4 } else { 0 };
    all_measured(&snapshot, 3 + peer_rows);
    for row in snapshot.rows.iter().filter(|r| r[5].text != "-") {
        let (checked, of) = row[5].text.split_once(" of ").unwrap();
        let expected = of.split(' ').next();
        assert_eq!(Some(checked), expected, "{}", snapshot.markdown());
    }
    assert_eq!(snapshot.peer_goals.len(), 2, "{}", snapshot.markdown());
    let dirty = bench::dirty::run(QUICK, &mut quiet).unwrap();
    assert_eq!(dirty.rows.len(), 4);
    let report = bench::report(
        &[dirty],
        "bench dirty --quick",
        Duration::from_secs(1),
        "Host: -",
        &[("dirty".to_owned(), Duration::from_secs(1))],
        "dirty-plots",
        "",
    );
    assert!(report.contains("`bench dirty --quick` (1 s)") && report.contains("### dirty"));
}

#[test]
fn without_an_advance_a_halted_vcpu_wakes_itself_at_each_deadline() {
    if !kvm_available("without_an_advance_a_halted_vcpu_wakes_itself_at_each_deadline") {
        return;
    }
    // The guest halts between 1 ms timers and takes no other interrupt. With
    // no timer thread (the signal timer, blocked while halted) and no advance,
    // only the halt poller's timer source ends each halt: its wait ends at
    // the delivery time (a halt that waited for another thread would never
    // end). Nothing else wakes the vCPU, and the timer's policy never sleeps
    // to poll before a deadline (`HaltPoll::timer_policy`, unit-tested).
    let period = (1000.0 * bench::ticks_per_us()) as u64;
    let m = Choices::default().with_timer_advance(TimerAdvance::None);
    assert_eq!(m.timer_placement, TimerPlacement::VcpuThread);
    let (report, _) = program::run("cyclictest", 1, m, &[200, period]).unwrap();
    assert_eq!(report.value(0, "irqs"), Some(200));
    let st = &report.stats;
    assert_eq!(st.wakes, 0, "no other thread woke it: {st:?}");
    assert!(st.blocked_ns > 0, "{st:?}");
    eprintln!(
        "{} of 200 halts planned a poll, {} ended while polling ({:.2} ms polled), {:.2} ms blocked",
        st.attempted_polls,
        st.successful_polls,
        st.polled_ns as f64 / 1e6,
        st.blocked_ns as f64 / 1e6
    );
}

#[test]
fn with_a_timer_advance_halts_block_until_the_early_host_timer() {
    if !kvm_available("with_a_timer_advance_halts_block_until_the_early_host_timer") {
        return;
    }
    // The advance covers the halted thread's wake-up, so polling for the timer
    // would only burn the CPU while the host timer's wake-up is on its way.
    let period = (1000.0 * bench::ticks_per_us()) as u64;
    let (report, _) = program::run("cyclictest", 1, Choices::default(), &[200, period]).unwrap();
    assert_eq!(report.value(0, "irqs"), Some(200));
    assert_eq!(report.stats.polled_ns, 0, "{:?}", report.stats);
    assert!(report.stats.blocked_ns > 0, "{:?}", report.stats);
}

#[test]
fn a_deadline_already_past_fires_at_the_next_entry_without_a_kick() {
    if !kvm_available("a_deadline_already_past_fires_at_the_next_entry_without_a_kick") {
        return;
    }
    // One tick apart, every deadline is past when the guest writes it: the
    // vCPU fires it on its way back into the guest, as KVM does, instead of
    // waiting for a timer thread to wake up and kick it.
    let m = Choices::default().with_timer_placement(TimerPlacement::VcpuCpu);
    let (report, _) = program::run("cyclictest", 1, m, &[300, 1]).unwrap();
    assert_eq!(report.value(0, "irqs"), Some(300));
    assert_eq!(report.stats.kicks, 0, "{:?}", report.stats);
}

#[test]
fn every_timer_fires_once_in_order_and_never_before_its_deadline() {
    if !kvm_available("every_timer_fires_once_in_order_and_never_before_its_deadline") {
        return;
    }
    const SAMPLES: u64 = 200;
    let period = (500.0 * bench::ticks_per_us()) as u64;
    let user = |timer_advance| Choices::default().with_timer_advance(timer_advance);
    let kernel = Choices::on(Irqchip::Kernel);
    for m in [
        user(TimerAdvance::None),
        user(TimerAdvance::Kvm),
        user(TimerAdvance::Percentile),
        user(TimerAdvance::PercentileAt(99)),
        Choices::default().with_timer_placement(TimerPlacement::VcpuCpu),
        Choices::default().with_timer_placement(TimerPlacement::Anywhere),
        // The halted vCPU polls and fires its own timer at the deadline.
        Choices::default().with_halt_poll(HaltPoll::Always),
        kernel,
    ] {
        let variant = format!(
            "{} / {} / {} / {}",
            m.irqchip, m.presets.timer_advance, m.timer_placement, m.presets.halt_poll
        );
        let (report, memory) = program::run("cyclictest", 1, m, &[SAMPLES, period]).unwrap();
        assert_eq!(report.value(0, "samples"), Some(SAMPLES), "{variant}");
        assert_eq!(
            report.value(0, "irqs"),
            Some(SAMPLES),
            "{variant}: one interrupt per timer"
        );
        let mut bytes = vec![0u8; SAMPLES as usize * 8];
        memory
            .read_slice(&mut bytes, GuestAddress(test_guests::layout::SAMPLES_ADDR))
            .unwrap();
        let early = bytes
            .chunks_exact(8)
            .filter(|c| i64::from_le_bytes((*c).try_into().unwrap()) < 0)
            .count();
        // KVM's own adaptive advance was seen here delivering about one timer
        // in 2000 up to 5 µs early: the never-early promise is this VMM's.
        if m.irqchip == Irqchip::User {
            assert_eq!(
                early, 0,
                "{variant}: {early} interrupts before their deadline"
            );
        }
    }
}

#[test]
fn every_overcommitted_vcpu_acknowledges_every_ipi_under_every_boost() {
    if !kvm_available("every_overcommitted_vcpu_acknowledges_every_ipi_under_every_boost") {
        return;
    }
    const ROUNDS: u64 = 200;
    for boost in [Boost::None, Boost::Ready, Boost::DirectedYield] {
        let m = Choices::default().with_boost(boost);
        let (report, _) = program::run("sched-ipi", 4, m, &[ROUNDS, 200]).unwrap();
        assert_eq!(report.value(0, "acks"), Some(ROUNDS * 3), "{boost}");
    }
}
