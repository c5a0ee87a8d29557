//! The encodings of what a migration carries besides memory: the VM's
//! description and each vCPU's complete state (see [`super::stream`]).

use lapic_timer::LapicTimerState;
use zerocopy::{FromBytes, IntoBytes};

use super::codec::{Decoder, Encoder};
use reference_vmm::ApicState;
use reference_vmm::ChipState;
use reference_vmm::Irqchip;
use reference_vmm::VcpuState;
use reference_vmm::VmDescription;
use reference_vmm::cpu_features::{CpuFeatures, FEATURE_WORDS};
use test_guests::layout::PARAMS;
use test_guests::layout::{check_mem_mib, check_vcpus};

/// A saved part as the stream's record payload.
pub(crate) trait Saved: Sized {
    /// The payload.
    fn encode(&self) -> Vec<u8>;
    /// The part, or what is wrong with the payload.
    fn decode(payload: &[u8]) -> Result<Self, String>;
}

impl Saved for VmDescription {
    fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.str(&self.program).u32(self.vcpus).u64(self.mem_mib);
        self.params.iter().for_each(|&p| {
            e.u64(p);
        });
        e.u8(match self.irqchip {
            Irqchip::User => 0,
            Irqchip::Kernel => 1,
        });
        e.u64(self.min_timer_period_ns).u32(self.tsc_khz);
        self.cpu_features.words().iter().for_each(|&w| {
            e.u32(w);
        });
        e.u32(self.msrs.len() as u32);
        self.msrs.iter().for_each(|&m| {
            e.u32(m);
        });
        e.0
    }

    fn decode(payload: &[u8]) -> Result<Self, String> {
        let mut d = Decoder(payload);
        let program = d.str()?.to_owned();
        let vcpus = check_vcpus(d.u32()?, u32::MAX).map_err(|e| e.to_string())?;
        let mem_mib = check_mem_mib(d.u64()?).map_err(|e| e.to_string())?;
        let mut params = [0; PARAMS];
        for p in &mut params {
            *p = d.u64()?;
        }
        let irqchip = match d.u8()? {
            0 => Irqchip::User,
            1 => Irqchip::Kernel,
            other => {
                return Err(format!(
                    "irqchip {other} is neither 0 (user) nor 1 (kernel)"
                ));
            }
        };
        let description = Self {
            program,
            vcpus,
            mem_mib,
            params,
            irqchip,
            min_timer_period_ns: d.u64()?,
            tsc_khz: d.u32()?,
            cpu_features: {
                let mut words = [0; FEATURE_WORDS];
                for w in &mut words {
                    *w = d.u32()?;
                }
                CpuFeatures::from_words(words)
            },
            msrs: {
                let count = d.u32()?;
                (0..count).map(|_| d.u32()).collect::<Result<_, _>>()?
            },
        };
        d.finish()?;
        Ok(description)
    }
}

fn flag(v: u8) -> Result<bool, String> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(format!("{v} where a flag (0 or 1) belongs")),
    }
}

impl Saved for VcpuState {
    fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.u32(self.index)
            .u8(u8::from(self.halted))
            .u64(self.captured_at_ns);
        e.bytes(self.regs.as_bytes())
            .bytes(self.sregs.as_bytes())
            .bytes(self.xsave.as_bytes())
            .bytes(self.xcrs.as_bytes())
            .bytes(self.events.as_bytes())
            .u32(self.mp_state);
        e.u32(self.msrs.len() as u32);
        for &(index, data) in &self.msrs {
            e.u32(index).u64(data);
        }
        match &self.chip {
            ChipState::Kernel(lapic) => {
                e.u8(0).bytes(lapic.as_bytes());
            }
            ChipState::User { apic, irr } => {
                e.u8(1);
                encode_apic(&mut e, apic);
                irr.iter().for_each(|&w| {
                    e.u64(w);
                });
            }
        }
        e.0
    }

    fn decode(payload: &[u8]) -> Result<Self, String> {
        let mut d = Decoder(payload);
        let index = d.u32()?;
        let halted = flag(d.u8()?)?;
        let captured_at_ns = d.u64()?;
        let regs = raw(&mut d, "registers")?;
        let sregs = raw(&mut d, "segment registers")?;
        let xsave = Box::new(raw(&mut d, "XSAVE state")?);
        let xcrs = raw(&mut d, "XCRs")?;
        let events = raw(&mut d, "vCPU events")?;
        let mp_state = d.u32()?;
        let count = d.u32()? as usize;
        // Each entry is 12 bytes: a count that claims more than are left
        // is refused before anything is allocated for it.
        if count > d.0.len() / 12 {
            return Err(format!("{count} MSRs claimed, {} bytes left", d.0.len()));
        }
        let msrs = (0..count)
            .map(|_| Ok((d.u32()?, d.u64()?)))
            .collect::<Result<_, String>>()?;
        let chip = match d.u8()? {
            0 => ChipState::Kernel(Box::new(raw(&mut d, "the LAPIC page")?)),
            1 => ChipState::User {
                apic: decode_apic(&mut d)?,
                irr: [d.u64()?, d.u64()?, d.u64()?, d.u64()?],
            },
            tag => return Err(format!("interrupt controller kind {tag}")),
        };
        d.finish()?;
        Ok(Self {
            index,
            halted,
            captured_at_ns,
            regs,
            sregs,
            xsave,
            xcrs,
            events,
            mp_state,
            msrs,
            chip,
        })
    }
}

/// A KVM structure, from exactly its size in bytes.
fn raw<T: FromBytes>(d: &mut Decoder<'_>, what: &str) -> Result<T, String> {
    let bytes = d.bytes()?;
    T::read_from_bytes(bytes).map_err(|_| {
        format!(
            "{what}: {} bytes where KVM's structure has {}",
            bytes.len(),
            std::mem::size_of::<T>()
        )
    })
}

fn encode_apic(e: &mut Encoder, a: &ApicState) {
    e.u8(u8::from(a.x2apic)).u8(a.tpr).u32(a.svr);
    a.isr.iter().for_each(|&w| {
        e.u64(w);
    });
    e.u32(a.esr).u32(a.esr_pending).u64(a.icr).u32(a.icr_high);
    a.lvt.iter().for_each(|&l| {
        e.u32(l);
    });
    let t = &a.timer;
    e.u32(t.lvt)
        .u32(t.initial_count)
        .u32(t.divide_config)
        .u64(t.tsc_deadline)
        .u8(u8::from(t.remaining_ns.is_some()))
        .u64(t.remaining_ns.unwrap_or(0));
}

fn decode_apic(d: &mut Decoder<'_>) -> Result<ApicState, String> {
    let x2apic = flag(d.u8()?)?;
    let tpr = d.u8()?;
    let svr = d.u32()?;
    let isr = [d.u64()?, d.u64()?, d.u64()?, d.u64()?];
    let (esr, esr_pending, icr, icr_high) = (d.u32()?, d.u32()?, d.u64()?, d.u32()?);
    let lvt = [d.u32()?, d.u32()?, d.u32()?, d.u32()?, d.u32()?];
    let (t_lvt, initial_count, divide_config, tsc_deadline) =
        (d.u32()?, d.u32()?, d.u32()?, d.u64()?);
    let counting = flag(d.u8()?)?;
    let remaining = d.u64()?;
    Ok(ApicState {
        x2apic,
        tpr,
        svr,
        isr,
        esr,
        esr_pending,
        icr,
        icr_high,
        lvt,
        timer: LapicTimerState {
            lvt: t_lvt,
            initial_count,
            divide_config,
            tsc_deadline,
            remaining_ns: counting.then_some(remaining),
        },
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// IA32_TSC.
    const MSR_TSC: u32 = 0x10;
    use kvm_bindings::{kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs};

    pub(crate) fn description(vcpus: u32) -> VmDescription {
        VmDescription {
            program: "migrate".into(),
            vcpus,
            mem_mib: 32,
            params: [7; PARAMS],
            irqchip: Irqchip::Kernel,
            min_timer_period_ns: 200_000,
            tsc_khz: 2_900_000,
            cpu_features: CpuFeatures::from_words(std::array::from_fn(|i| 0x100 * i as u32 + 1)),
            msrs: vec![0x10, 0xc000_0080],
        }
    }

    pub(crate) fn user_vcpu(index: u32) -> VcpuState {
        let regs = kvm_regs {
            rip: 0x10_0000 + u64::from(index),
            ..kvm_regs::default()
        };
        VcpuState {
            index,
            halted: index % 2 == 1,
            captured_at_ns: 42,
            regs,
            sregs: kvm_sregs::default(),
            xsave: Box::default(),
            xcrs: kvm_xcrs::default(),
            events: kvm_vcpu_events::default(),
            mp_state: 0,
            msrs: vec![(MSR_TSC, 1 << 40), (0xc000_0080, 0x501)],
            chip: ChipState::User {
                apic: ApicState {
                    x2apic: true,
                    tpr: 3,
                    svr: 0x1ff,
                    isr: [0, 1 << 2, 0, 0],
                    lvt: [0x10000; 5],
                    timer: LapicTimerState {
                        lvt: 0x40050,
                        tsc_deadline: 1 << 41,
                        remaining_ns: Some(5000),
                        ..LapicTimerState::default()
                    },
                    ..ApicState::default()
                },
                irr: [0, 1 << 3, 0, 1 << 63],
            },
        }
    }

    #[test]
    fn descriptions_and_states_decode_to_what_was_encoded() {
        let d = description(4);
        assert_eq!(VmDescription::decode(&d.encode()), Ok(d));
        let v = user_vcpu(1);
        assert_eq!(VcpuState::decode(&v.encode()).unwrap().encode(), v.encode());
        let mut k = user_vcpu(0);
        k.chip = ChipState::Kernel(Box::default());
        assert_eq!(VcpuState::decode(&k.encode()).unwrap().encode(), k.encode());
        assert_eq!(k.tsc(), Some(1 << 40));
    }

    #[test]
    fn malformed_payloads_are_errors_never_panics() {
        let good = user_vcpu(0).encode();
        for len in 0..good.len() {
            assert!(VcpuState::decode(&good[..len]).is_err(), "cut at {len}");
        }
        let mut long = good.clone();
        long.push(0);
        assert_eq!(VcpuState::decode(&long).unwrap_err(), "1 bytes left over");
        let d = description(1).encode();
        for len in 0..d.len() {
            assert!(VmDescription::decode(&d[..len]).is_err(), "cut at {len}");
        }
        let mut bad = description(1);
        bad.vcpus = 0;
        assert!(
            VmDescription::decode(&bad.encode())
                .unwrap_err()
                .contains("vCPUs")
        );
        // The irqchip byte, before the timer period (u64), the TSC (u32),
        // the CPU features and the MSR list (a count and two).
        let mut bytes = description(1).encode();
        let at = bytes.len() - 13 - 4 * FEATURE_WORDS - 12;
        assert_eq!(bytes[at], 1, "the kernel irqchip");
        bytes[at] = 2;
        let err = VmDescription::decode(&bytes).unwrap_err();
        assert!(err.contains("irqchip 2"), "{err}");
    }

    #[test]
    fn bad_flags_kinds_and_structure_sizes_are_named() {
        let mut bytes = user_vcpu(0).encode();
        bytes[4] = 2; // the halted flag
        assert_eq!(
            VcpuState::decode(&bytes).unwrap_err(),
            "2 where a flag (0 or 1) belongs"
        );
        let mut bytes = user_vcpu(0).encode();
        let mut apic = Encoder::default();
        encode_apic(&mut apic, &ApicState::default());
        let chip_tag = bytes.len() - 4 * 8 - apic.0.len() - 1;
        assert_eq!(bytes[chip_tag], 1);
        bytes[chip_tag] = 7;
        assert_eq!(
            VcpuState::decode(&bytes).unwrap_err(),
            "interrupt controller kind 7"
        );
        // Registers one byte short: the length says so, the size does not fit.
        let mut e = Encoder::default();
        e.u32(0).u8(0).u64(0).bytes(&[0; 143]);
        assert_eq!(
            VcpuState::decode(&e.0).unwrap_err(),
            "registers: 143 bytes where KVM's structure has 144"
        );
    }

    #[test]
    fn an_msr_count_past_the_payload_is_refused_before_allocating() {
        let mut bytes = user_vcpu(0).encode();
        // The count follows the index, flag, time, five structures and mp_state.
        let v = user_vcpu(0);
        let at = 4
            + 1
            + 8
            + [
                v.regs.as_bytes().len(),
                v.sregs.as_bytes().len(),
                v.xsave.as_bytes().len(),
                v.xcrs.as_bytes().len(),
                v.events.as_bytes().len(),
            ]
            .iter()
            .map(|n| 4 + n)
            .sum::<usize>()
            + 4;
        assert_eq!(bytes[at..at + 4], 2u32.to_le_bytes());
        bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            VcpuState::decode(&bytes)
                .unwrap_err()
                .contains("MSRs claimed")
        );
    }
}
