//! The integrations' scenarios with the release builds standing in for the
//! patched ones: every row runs, and each goal fails where the patch is
//! missing. An unpatched Cloud Hypervisor meters no polling, so its budget
//! goals cannot be met; an unpatched Firecracker ignores `FC_DIRTY_LOG`, so
//! its "dirty-log" diffs are its mincore ones.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::path::Path;

use common::skip;
use reference_bench::cloud_hypervisor::{self, CloudHypervisor};
use reference_bench::firecracker::{self, Firecracker};
use reference_bench::integrations;
use reference_bench::peer_run::PeerBinary;
use reference_bench::{Options, Table};

/// `--quick`, with `ch` and `fc` as the patched builds.
fn quick<'a>(ch: Option<&'a Path>, fc: Option<&'a Path>) -> Options<'a> {
    Options {
        quick: true,
        qemu: None,
        cloud_hypervisor: None,
        firecracker: None,
        patched_cloud_hypervisor: ch,
        patched_firecracker: fc,
        only: None,
    }
}

fn cloud_hypervisor(test: &str) -> Option<CloudHypervisor> {
    if !common::kvm_available(test) {
        return None;
    }
    let found = CloudHypervisor::find();
    if found.is_none() {
        skip(
            test,
            &format!("no cloud-hypervisor ({})", cloud_hypervisor::HINT),
        );
    }
    found
}

/// The column's numbers, by row.
fn column(t: &Table, i: usize) -> Vec<f64> {
    t.rows
        .iter()
        .map(|r| r[i].value.unwrap_or(f64::NAN))
        .collect()
}

#[test]
fn an_unpatched_cloud_hypervisor_meters_no_polling_and_misses_the_budget_goals() {
    let test = "an_unpatched_cloud_hypervisor_meters_no_polling_and_misses_the_budget_goals";
    let Some(ch) = cloud_hypervisor(test) else {
        return;
    };
    let t = integrations::ch_halt(quick(Some(ch.binary()), None), &mut |_| {}).unwrap();
    // Three workloads, four builds each: every row has a latency.
    let latency = column(&t, 2);
    assert_eq!(latency.len(), 12);
    assert!(latency.iter().all(|l| l.is_finite() && *l > 0.0), "{t:?}");
    assert_eq!(t.peer_goals.len(), 2);
    for goal in &t.peer_goals {
        assert!(
            goal.ends_with("not met.") || goal.contains("not met on"),
            "{goal}"
        );
    }
}

#[test]
fn an_unpatched_cloud_hypervisor_moves_the_guest_at_both_rates() {
    let test = "an_unpatched_cloud_hypervisor_moves_the_guest_at_both_rates";
    let Some(ch) = cloud_hypervisor(test) else {
        return;
    };
    if ch.ch_remote().is_none() {
        skip(test, "no ch-remote beside cloud-hypervisor");
        return;
    }
    let t = integrations::ch_migrate(quick(Some(ch.binary()), None), &mut |_| {}).unwrap();
    assert_eq!(
        t.rows.len(),
        11,
        "four builds, two rates; three over the link"
    );
    assert!(
        t.rows
            .iter()
            .all(|r| r[2].text == "1 of 1" || r[2].text == "0 of 1"),
        "{t:?}"
    );
    assert_eq!(t.peer_goals.len(), 2, "manual protect, the ring");
    let failures: Vec<_> = t
        .notes
        .iter()
        .filter(|n| n.starts_with("no result"))
        .collect();
    assert!(failures.is_empty(), "{failures:?}");
    assert!(t.peer_goals[0].ends_with(": met."), "{}", t.peer_goals[0]);
}

#[test]
fn an_unpatched_cloud_hypervisor_completes_every_virtio_request_and_logs_no_boost() {
    let test = "an_unpatched_cloud_hypervisor_completes_every_virtio_request_and_logs_no_boost";
    let Some(ch) = cloud_hypervisor(test) else {
        return;
    };
    let t = integrations::ch_boost(quick(Some(ch.binary()), None), &mut |_| {}).unwrap();
    // Spinning and halting, two builds each: every row has its round trips.
    let (mean, longest) = (column(&t, 2), column(&t, 4));
    assert_eq!(mean.len(), 4);
    for (m, l) in mean.iter().zip(&longest) {
        assert!(m.is_finite() && *m > 0.0 && l >= m, "{t:?}");
    }
    // The release build has no boost to log.
    assert!(t.rows[1][5].value.is_none_or(f64::is_nan), "{t:?}");
    assert_eq!(t.peer_goals.len(), 2);
}

#[test]
fn an_unpatched_firecracker_diffs_from_mincore_and_misses_the_goal() {
    let test = "an_unpatched_firecracker_diffs_from_mincore_and_misses_the_goal";
    if !common::kvm_available(test) {
        return;
    }
    let Some(fc) = Firecracker::find() else {
        skip(test, &format!("no firecracker ({})", firecracker::HINT));
        return;
    };
    let t = integrations::fc_snapshot(quick(None, Some(fc.binary())), &mut |_| {}).unwrap();
    let bytes = column(&t, 1);
    assert_eq!(bytes.len(), 5, "mincore, KVM's log, three backends");
    assert!(
        bytes[1] < bytes[0] / 2.0,
        "KVM's log diffs only the tenth: {bytes:?}"
    );
    for ignored in &bytes[2..] {
        assert!(
            *ignored > bytes[0] / 2.0,
            "FC_DIRTY_LOG ignored: mincore's size {bytes:?}"
        );
    }
    assert!(t.peer_goals[0].contains("not met"), "{}", t.peer_goals[0]);
}

#[test]
fn without_the_patched_builds_each_goal_says_how_to_build_them() {
    let none = quick(None, None);
    let goals = [
        integrations::ch_migrate(none, &mut |_| {}).unwrap(),
        integrations::ch_boost(none, &mut |_| {}).unwrap(),
        integrations::fc_snapshot(none, &mut |_| {}).unwrap(),
    ];
    for t in goals {
        assert!(t.rows.is_empty());
        assert!(t.peer_goals[0].contains("apply.sh"), "{}", t.peer_goals[0]);
    }
}
