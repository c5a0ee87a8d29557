//! The CPU features a guest is given, as CPUID's feature-flag words: what
//! a migration carries, so that a destination lacking one refuses the
//! guest by name before the source lets go of it, and what a baseline of
//! several hosts (their intersection) masks a guest's CPUID to, so that it
//! can move anywhere among them.
//!
//! A baseline file is the text [`CpuFeatures`] displays (`reference-vmm
//! cpu-features` prints this host's): one word per line, `leaf subleaf
//! register value` in hex, e.g. `7 0 ebx 0x029c6fbf`.

use std::fmt;
use std::str::FromStr;

use kvm_bindings::{CpuId, kvm_cpuid_entry2};

/// A CPUID register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Register {
    Eax,
    Ebx,
    Ecx,
    Edx,
}

/// The feature-flag words compared and masked: (leaf, subleaf, register).
const WORDS: [(u32, u32, Register); 10] = [
    (1, 0, Register::Ecx),
    (1, 0, Register::Edx),
    (7, 0, Register::Ebx),
    (7, 0, Register::Ecx),
    (7, 0, Register::Edx),
    (7, 1, Register::Eax),
    (0xD, 1, Register::Eax),
    (0x8000_0001, 0, Register::Ecx),
    (0x8000_0001, 0, Register::Edx),
    (0x8000_0008, 0, Register::Ebx),
];

/// Bits of leaf 1 ECX that are state, not features: OSXSAVE (the OS set
/// CR4.OSXSAVE) and the APIC ID's neighbours are left alone.
const LEAF1_ECX_STATE: u32 = 1 << 27;

/// Names of common features, by word (index in [`WORDS`]) and bit.
const NAMES: &[(usize, u32, &str)] = &[
    (0, 0, "sse3"),
    (0, 1, "pclmulqdq"),
    (0, 9, "ssse3"),
    (0, 12, "fma"),
    (0, 13, "cx16"),
    (0, 19, "sse4_1"),
    (0, 20, "sse4_2"),
    (0, 21, "x2apic"),
    (0, 22, "movbe"),
    (0, 23, "popcnt"),
    (0, 24, "tsc_deadline_timer"),
    (0, 25, "aes"),
    (0, 26, "xsave"),
    (0, 28, "avx"),
    (0, 29, "f16c"),
    (0, 30, "rdrand"),
    (1, 0, "fpu"),
    (1, 4, "tsc"),
    (1, 5, "msr"),
    (1, 8, "cx8"),
    (1, 9, "apic"),
    (1, 15, "cmov"),
    (1, 19, "clflush"),
    (1, 23, "mmx"),
    (1, 24, "fxsr"),
    (1, 25, "sse"),
    (1, 26, "sse2"),
    (2, 0, "fsgsbase"),
    (2, 3, "bmi1"),
    (2, 5, "avx2"),
    (2, 7, "smep"),
    (2, 8, "bmi2"),
    (2, 9, "erms"),
    (2, 10, "invpcid"),
    (2, 16, "avx512f"),
    (2, 17, "avx512dq"),
    (2, 18, "rdseed"),
    (2, 19, "adx"),
    (2, 20, "smap"),
    (2, 23, "clflushopt"),
    (2, 24, "clwb"),
    (2, 28, "avx512cd"),
    (2, 29, "sha_ni"),
    (2, 30, "avx512bw"),
    (2, 31, "avx512vl"),
    (3, 1, "avx512vbmi"),
    (3, 2, "umip"),
    (3, 3, "pku"),
    (3, 8, "gfni"),
    (3, 9, "vaes"),
    (3, 10, "vpclmulqdq"),
    (3, 11, "avx512_vnni"),
    (3, 22, "rdpid"),
    (4, 4, "fsrm"),
    (4, 14, "serialize"),
    (4, 22, "amx_bf16"),
    (4, 23, "avx512_fp16"),
    (4, 24, "amx_tile"),
    (4, 25, "amx_int8"),
    (5, 4, "avx_vnni"),
    (5, 5, "avx512_bf16"),
    (6, 0, "xsaveopt"),
    (6, 1, "xsavec"),
    (6, 3, "xsaves"),
    (7, 0, "lahf_lm"),
    (7, 5, "abm"),
    (7, 8, "3dnowprefetch"),
    (8, 11, "syscall"),
    (8, 20, "nx"),
    (8, 26, "pdpe1gb"),
    (8, 27, "rdtscp"),
    (8, 29, "lm"),
];

/// The feature-flag words of a CPUID (leaves 1, 7, 0xD.1, 0x8000_0001 and
/// 0x8000_0008, as its `Display` lists them; 0 where the
/// CPUID has no such leaf).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuFeatures([u32; WORDS.len()]);

fn register(entry: &mut kvm_cpuid_entry2, register: Register) -> &mut u32 {
    match register {
        Register::Eax => &mut entry.eax,
        Register::Ebx => &mut entry.ebx,
        Register::Ecx => &mut entry.ecx,
        Register::Edx => &mut entry.edx,
    }
}

impl CpuFeatures {
    /// The words `cpuid` gives.
    pub fn from_cpuid(cpuid: &CpuId) -> Self {
        let mut words = [0; WORDS.len()];
        for mut entry in cpuid.as_slice().iter().copied() {
            for (word, &(leaf, subleaf, reg)) in words.iter_mut().zip(&WORDS) {
                if entry.function == leaf && entry.index == subleaf {
                    *word = *register(&mut entry, reg);
                }
            }
        }
        words[0] &= !LEAF1_ECX_STATE;
        Self(words)
    }

    /// What this host's KVM offers a guest, with the APIC features both
    /// interrupt controllers emulate.
    ///
    /// # Errors
    /// `/dev/kvm` cannot be opened or asked.
    pub fn of_this_host() -> Result<Self, crate::Error> {
        let kvm = kvm_ioctls::Kvm::new().map_err(crate::Error::OpenKvm)?;
        let mut cpuid = kvm
            .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .map_err(|source| crate::Error::Kvm {
                op: "KVM_GET_SUPPORTED_CPUID",
                source,
            })?;
        test_guests::x86::boot::advertise_apic_features(&mut cpuid);
        Ok(Self::from_cpuid(&cpuid))
    }

    /// Clears in `cpuid` every feature bit these words do not have.
    pub fn mask(&self, cpuid: &mut CpuId) {
        for entry in cpuid.as_mut_slice() {
            for (&word, &(leaf, subleaf, reg)) in self.0.iter().zip(&WORDS) {
                if entry.function == leaf && entry.index == subleaf {
                    let keep = if (leaf, reg) == (1, Register::Ecx) {
                        word | LEAF1_ECX_STATE
                    } else {
                        word
                    };
                    *register(entry, reg) &= keep;
                }
            }
        }
    }

    /// The features both have.
    pub fn intersection(&self, other: &Self) -> Self {
        let mut words = self.0;
        words.iter_mut().zip(other.0).for_each(|(w, o)| *w &= o);
        Self(words)
    }

    /// The features these words have and `host`'s lack, by name.
    pub fn missing_from(&self, host: &Self) -> Vec<String> {
        let mut missing = Vec::new();
        for (i, (&mine, &theirs)) in self.0.iter().zip(&host.0).enumerate() {
            let lacking = mine & !theirs;
            for bit in (0..32).filter(|b| lacking & 1 << b != 0) {
                missing.push(feature_name(i, bit));
            }
        }
        missing
    }

    /// The words (CPUID registers, in a fixed order), for a saved VM.
    pub fn words(&self) -> &[u32] {
        &self.0
    }

    /// From the words [`words`](Self::words) gave.
    pub fn from_words(words: [u32; FEATURE_WORDS]) -> Self {
        Self(words)
    }
}

/// Words in a [`CpuFeatures`].
pub const FEATURE_WORDS: usize = WORDS.len();

/// Bit `bit` of word `word` by name, or as CPUID's coordinates.
fn feature_name(word: usize, bit: u32) -> String {
    match NAMES.iter().find(|&&(w, b, _)| (w, b) == (word, bit)) {
        Some(&(_, _, name)) => name.to_string(),
        None => {
            let (leaf, subleaf, reg) = WORDS[word];
            let reg = format!("{reg:?}").to_uppercase();
            format!("CPUID.(EAX={leaf:#x},ECX={subleaf}):{reg}[{bit}]")
        }
    }
}

impl fmt::Display for CpuFeatures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (&word, (leaf, subleaf, reg)) in self.0.iter().zip(WORDS) {
            let reg = format!("{reg:?}").to_lowercase();
            writeln!(f, "{leaf:#x} {subleaf} {reg} {word:#010x}")?;
        }
        Ok(())
    }
}

impl FromStr for CpuFeatures {
    type Err = String;

    /// The text [`Display`](fmt::Display) writes: every word, once.
    fn from_str(text: &str) -> Result<Self, String> {
        let mut words = [None; WORDS.len()];
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let bad = || {
                format!(
                    "line {}: want `leaf subleaf register value`: {line:?}",
                    n + 1
                )
            };
            let [leaf, subleaf, reg, value] = fields[..] else {
                return Err(bad());
            };
            let number = |s: &str| match s.strip_prefix("0x") {
                Some(hex) => u32::from_str_radix(hex, 16).ok(),
                None => s.parse().ok(),
            };
            let (Some(leaf), Some(subleaf), Some(value)) =
                (number(leaf), number(subleaf), number(value))
            else {
                return Err(bad());
            };
            let at = WORDS
                .iter()
                .position(|&(l, s, r)| {
                    (l, s) == (leaf, subleaf) && format!("{r:?}").eq_ignore_ascii_case(reg)
                })
                .ok_or_else(|| {
                    format!("line {}: no feature word {leaf:#x} {subleaf} {reg}", n + 1)
                })?;
            words[at] = Some(value);
        }
        let mut out = [0; WORDS.len()];
        for (i, (o, w)) in out.iter_mut().zip(words).enumerate() {
            let (leaf, subleaf, reg) = WORDS[i];
            *o = w.ok_or_else(|| format!("no line for {leaf:#x} {subleaf} {reg:?}"))?;
        }
        Ok(Self(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpuid(entries: &[(u32, u32, u32, u32)]) -> CpuId {
        let entries: Vec<kvm_cpuid_entry2> = entries
            .iter()
            .map(|&(function, index, ebx, ecx)| kvm_cpuid_entry2 {
                function,
                index,
                ebx,
                ecx,
                ..Default::default()
            })
            .collect();
        CpuId::from_entries(&entries).unwrap()
    }

    #[test]
    fn missing_features_are_named_and_a_mask_clears_them() {
        let host =
            CpuFeatures::from_cpuid(&cpuid(&[(1, 0, 0, 1 << 28 | 1 << 27), (7, 0, 1 << 5, 0)]));
        let guest = CpuFeatures::from_cpuid(&cpuid(&[
            (1, 0, 0, 1 << 28),
            (7, 0, 1 << 5 | 1 << 16 | 1 << 12, 0),
        ]));
        assert_eq!(
            guest.missing_from(&host),
            ["CPUID.(EAX=0x7,ECX=0):EBX[12]", "avx512f"]
        );
        assert!(host.missing_from(&guest).is_empty(), "OSXSAVE is state");
        let mut masked = cpuid(&[
            (1, 0, 0, 1 << 28 | 1 << 27),
            (7, 0, 1 << 5 | 1 << 16, 0),
            (2, 0, 7, 7),
        ]);
        host.mask(&mut masked);
        let e = masked.as_slice();
        assert_eq!((e[0].ecx, e[1].ebx), (1 << 28 | 1 << 27, 1 << 5));
        assert_eq!((e[2].ebx, e[2].ecx), (7, 7), "other leaves untouched");
        assert_eq!(guest.intersection(&host), CpuFeatures::from_cpuid(&masked));
    }

    #[test]
    fn a_baseline_reads_back_what_it_printed_and_bad_text_is_an_error() {
        let f = CpuFeatures::from_cpuid(&cpuid(&[
            (7, 0, 0x29c_6fbf, 0x40_0000),
            (0x8000_0001, 0, 0, 0x121),
        ]));
        assert_eq!(f.to_string().parse::<CpuFeatures>(), Ok(f));
        assert!(f.to_string().contains("0x7 0 ebx 0x029c6fbf"));
        let short: String = f
            .to_string()
            .lines()
            .skip(1)
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(
            short
                .parse::<CpuFeatures>()
                .unwrap_err()
                .contains("no line for 0x1 0 Ecx")
        );
        assert!(
            "7 0 ebx"
                .parse::<CpuFeatures>()
                .unwrap_err()
                .contains("line 1")
        );
        assert!(
            "5 0 eax 0x1"
                .parse::<CpuFeatures>()
                .unwrap_err()
                .contains("no feature word")
        );
    }
}
