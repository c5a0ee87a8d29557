//! Small x86-64 guest programs for testing and measuring a VMM on KVM: the
//! programs, their ABI, the boot structures they start on, and PVH images
//! that any VMM boots (QEMU with `-kernel`).
//!
//! Every program is readable assembly in `src/programs/`, assembled by
//! rustc into one position-independent image. Its hot loops run at CPL3:
//! on PVM (software virtualization) CPL0 code is emulated one instruction at
//! a time, CPL3 code runs natively; CPL0 runs only short exception stubs and
//! service calls. Programs report results, failed assertions and completion
//! through [ucalls](ucall) (KVM selftests' convention); the other channels
//! are in [`abi`].
//!
//! Two ways to start a program:
//! - **directly**: write [`boot_memory::segments`] and the parameters into
//!   guest memory, then give each vCPU the long-mode registers of
//!   [`x86::boot`]; it starts at CPL3 with no CPL0 code run first;
//! - **from an image** ([`pvh::Image`]): an ELF file with a PVH entry that
//!   enters long mode itself, for a VMM that boots kernels.
//!
//! # Example
//! ```
//! use test_guests::{find, layout};
//!
//! let hello = find("hello").unwrap();
//! hello.check_run(&[0; layout::PARAMS], 4, 64, None, false).unwrap();
//! let segments = test_guests::boot_memory::segments(4, 64 << 20);
//! assert!(segments.iter().any(|s| s.what == "the guest image"));
//! let image = test_guests::Image::build(hello, 4, 64, [0; layout::PARAMS]).unwrap();
//! assert_eq!(test_guests::Image::parse(image.bytes().to_vec()).unwrap(), image);
//! ```

#![deny(missing_docs)]

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub mod abi;
pub mod apic_script;
pub mod boot_memory;
pub mod layout;
pub mod programs;
pub mod pvh;
pub mod ucall;
pub mod x86;

pub use layout::LayoutError;
pub use programs::{DataArea, GuestProgram, PROGRAMS, Param, ProgramError, find};
pub use pvh::{Image, ImageError};
pub use ucall::{Report, Ucall, UcallError};
