//! Shared by the integration tests: fail, or skip loudly where the user allows it,
//! where the machine has no usable KVM ([`test_support::kvm`]).

/// Whether `/dev/kvm` can be used by `test`; where it cannot, the test
/// fails or skips, saying so.
pub fn kvm_available(test: &str) -> bool {
    test_support::kvm::available(env!("CARGO_PKG_NAME"), test)
}

/// Says that `test` skips and why; returns false. (Not every test binary
/// skips for a reason of its own.)
#[allow(dead_code)]
pub fn skip(test: &str, reason: &str) -> bool {
    test_support::kvm::skip(env!("CARGO_PKG_NAME"), test, reason)
}
