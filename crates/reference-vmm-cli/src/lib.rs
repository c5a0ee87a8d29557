//! The `reference-vmm` command line's side of the reference VMM: the
//! policies by the names its switches take ([`presets`]). The binary
//! composes the VMM library ([`reference_vmm`]) and its migration crate
//! ([`migration`]); the bench and the tests drive the VMM by the same names.

#![deny(missing_docs)]

pub mod presets;

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
