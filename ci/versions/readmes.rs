//! Each crate's README examples, as doctests of the version-set crate that
//! includes this file as its library: they name the `kvm_ioctls` and
//! `vm_memory` that set pins, so they compile only if no
//! crate's API takes another version's `VmFd`, `VcpuFd` or memory, and
//! they run on `/dev/kvm`.

#[doc = include_str!("../../crates/halt-poll/README.md")]
pub struct HaltPollReadme;
#[doc = include_str!("../../crates/dirty-log/README.md")]
pub struct DirtyLogReadme;
#[doc = include_str!("../../crates/lapic-timer/README.md")]
pub struct LapicTimerReadme;
#[doc = include_str!("../../crates/vcpu-sched/README.md")]
pub struct VcpuSchedReadme;
#[doc = include_str!("../../crates/rcu-qs/README.md")]
pub struct RcuQsReadme;
