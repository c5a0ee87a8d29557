//! The peer VMMs in a bench: a bench guest booted by QEMU, Cloud Hypervisor
//! or Firecracker from an image file ([`test_guests::pvh`]), with its
//! parameters in the image.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::Error;
use crate::{Options, Runs, goal};

use crate::cloud_hypervisor::{self, CloudHypervisor};
use crate::firecracker::{self, Firecracker};
use crate::peer_run::{self, PeerBinary, PeerError, PeerRun};
use crate::qemu::{INSTALL_HINT, Qemu, QemuApic};
use test_guests::layout::PARAMS;
use test_guests::pvh::Image;

/// How long one peer's run may take (a peer that does not get through the
/// guest is killed then; `--quick` runs a tenth of the rounds).
fn timeout(opts: Options) -> Duration {
    Duration::from_secs(if opts.quick { 20 } else { 30 })
}

/// A peer VMM that boots the bench's guests.
#[derive(Clone, Copy, Debug)]
pub enum PeerVmm<'a> {
    /// QEMU, with its local APICs where given.
    Qemu(&'a Qemu, QemuApic),
    /// Cloud Hypervisor, on KVM's LAPIC.
    CloudHypervisor(&'a CloudHypervisor),
    /// Firecracker, on KVM's LAPIC.
    Firecracker(&'a Firecracker),
}

impl PeerVmm<'_> {
    /// Its name, in errors.
    pub fn name(self) -> &'static str {
        match self {
            Self::Qemu(..) => "QEMU",
            Self::CloudHypervisor(_) => "Cloud Hypervisor",
            Self::Firecracker(_) => "Firecracker",
        }
    }

    fn run(
        self,
        image: &Path,
        vcpus: u32,
        mem_mib: u64,
        timeout: Duration,
    ) -> Result<PeerRun, PeerError> {
        match self {
            Self::Qemu(qemu, apic) => qemu.run(image, vcpus, mem_mib, apic, timeout),
            Self::CloudHypervisor(ch) => ch.run(image, vcpus, mem_mib, timeout),
            Self::Firecracker(fc) => fc.run(image, vcpus, mem_mib, timeout),
        }
    }
}

/// Runs the built-in `program` on `vcpus` vCPUs with `params` under `vmm`.
pub fn run_image(
    vmm: PeerVmm,
    program: &str,
    vcpus: u32,
    params: &[u64],
    opts: Options,
) -> Result<PeerRun, Error> {
    const MEM_MIB: u64 = 64;
    let image = ImageFile::write(program, vcpus, MEM_MIB, params)?;
    Ok(vmm.run(&image.0, vcpus, MEM_MIB, timeout(opts))?)
}

/// A bench guest's image in a file of the temporary folder, removed when
/// dropped.
pub struct ImageFile(PathBuf);

impl ImageFile {
    /// The built-in `program` on `vcpus` vCPUs in `mem_mib` MiB with
    /// `params` (the rest 0).
    pub fn write(program: &str, vcpus: u32, mem_mib: u64, params: &[u64]) -> Result<Self, Error> {
        static IMAGES: AtomicU32 = AtomicU32::new(0);
        let mut all = [0; PARAMS];
        let n = params.len().min(PARAMS);
        all[..n].copy_from_slice(&params[..n]);
        let program = test_guests::find(program).expect("bench programs are built in");
        let image = Image::build(program, vcpus, mem_mib, all)?;
        let path = std::env::temp_dir().join(format!(
            "reference-vmm-bench-{}-{}-{}.elf",
            std::process::id(),
            IMAGES.fetch_add(1, Ordering::Relaxed),
            program.name
        ));
        std::fs::write(&path, image.bytes()).map_err(|source| Error::WriteImage {
            path: path.clone(),
            source,
        })?;
        Ok(Self(path))
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ImageFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A peer VMM as a scenario's row: which VMM, and how it runs the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerKind {
    /// QEMU, with its own local APICs or KVM's.
    Qemu(QemuApic),
    /// Cloud Hypervisor, on KVM's LAPIC.
    CloudHypervisor,
    /// Firecracker, on KVM's LAPIC.
    Firecracker,
}

impl PeerKind {
    /// Cloud Hypervisor and Firecracker, the peers that run every guest.
    pub const RUST: [Self; 2] = [Self::CloudHypervisor, Self::Firecracker];

    /// Its row's name.
    pub fn row(self) -> &'static str {
        match self {
            Self::Qemu(QemuApic::User) => "qemu, its own APIC (kernel-irqchip=off)",
            Self::Qemu(QemuApic::Kernel) => "qemu, KVM's LAPIC (kernel-irqchip=on)",
            Self::CloudHypervisor => "cloud-hypervisor, KVM's LAPIC",
            Self::Firecracker => "firecracker, KVM's LAPIC",
        }
    }

    /// The VMM's name, in goals.
    pub fn vmm(self) -> &'static str {
        match self {
            Self::Qemu(QemuApic::User) => "QEMU's own APIC",
            Self::Qemu(QemuApic::Kernel) => "QEMU",
            Self::CloudHypervisor => "Cloud Hypervisor",
            Self::Firecracker => "Firecracker",
        }
    }

    /// Why it has no rows where its binary was not found, and how to get it.
    pub fn absent(self) -> String {
        match self {
            Self::Qemu(_) => format!(
                "no qemu-system-x86_64 was on PATH when this scenario started (install it with \
                 `{INSTALL_HINT}`, or give --qemu)"
            ),
            Self::CloudHypervisor => format!(
                "no cloud-hypervisor was found when this scenario started ({}, or give \
                 --cloud-hypervisor)",
                cloud_hypervisor::HINT
            ),
            Self::Firecracker => format!(
                "no firecracker was found when this scenario started ({}, or give --firecracker)",
                firecracker::HINT
            ),
        }
    }
}

/// The peer VMMs found when a scenario started.
pub struct Peers {
    qemu: Option<Qemu>,
    /// Why QEMU's own APIC cannot run a guest that halts here, if it
    /// cannot: probed when such a row is first asked for.
    qemu_own_apic: std::sync::OnceLock<Option<&'static str>>,
    cloud_hypervisor: Option<CloudHypervisor>,
    firecracker: Option<Firecracker>,
}

/// How long the probe of QEMU's own APIC may take (its round trips end in
/// well under a second where it works).
pub const OWN_APIC_PROBE: Duration = Duration::from_secs(10);

/// Whether QEMU's own APIC runs a guest that halts, tried once per process
/// and binary with a thousand round trips (a few may miss their halt, not all): on a
/// host where KVM emulates the guest's kernel mode (PVM), QEMU 7.2's
/// userspace APIC stops at a halted vCPU's wake-up, and every row of it
/// whose guest halts would spend its whole timeout to say so. Its guests
/// that spin run.
fn probe_own_apic(qemu: &Qemu) -> Option<&'static str> {
    // Each binary's answer, once per process (the strings live as long).
    type Probed = std::collections::HashMap<PathBuf, Option<&'static str>>;
    static PROBED: std::sync::Mutex<Option<Probed>> = std::sync::Mutex::new(None);
    // pingpong through the xAPIC page (QEMU's own APIC has no x2APIC),
    // halting between round trips.
    const PING_PONG: [u64; 7] = [1000, 0, 0, 0, 0, 1, 0];
    let mut probed = PROBED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let answers = probed.get_or_insert_with(Default::default);
    *answers.entry(qemu.binary().to_owned()).or_insert_with(|| {
        let ran = ImageFile::write("pingpong", 2, 64, &PING_PONG).and_then(|image| {
            let run = qemu.run(image.path(), 2, 64, QemuApic::User, OWN_APIC_PROBE);
            Ok(run?)
        });
        ran.err().map(|e| {
            let why = format!(
                "a ping-pong through the xAPIC page, halting between round trips, did not run \
                 on it here (a {}-second probe: {e})",
                OWN_APIC_PROBE.as_secs()
            );
            &*Box::leak(why.into_boxed_str())
        })
    })
}

impl Peers {
    /// Each peer from the options, else found ([`Options::qemu`] and the
    /// others).
    pub fn find(opts: Options) -> Self {
        Self {
            qemu: opts.qemu(),
            qemu_own_apic: std::sync::OnceLock::new(),
            cloud_hypervisor: opts.cloud_hypervisor(),
            firecracker: opts.firecracker(),
        }
    }

    /// Why `kind` cannot run a guest that halts here, if it cannot:
    /// QEMU's own APIC, probed once per process on a thousand halting
    /// round trips through the xAPIC page.
    pub fn halting_fails(&self, kind: PeerKind) -> Option<&'static str> {
        match kind {
            PeerKind::Qemu(QemuApic::User) => *self
                .qemu_own_apic
                .get_or_init(|| self.qemu.as_ref().and_then(probe_own_apic)),
            _ => None,
        }
    }

    /// `kind` for a row whose guest halts (`halts`), if its binary was
    /// found and can run that here.
    pub fn vmm_for(&self, kind: PeerKind, halts: bool) -> Option<PeerVmm<'_>> {
        match halts && self.halting_fails(kind).is_some() {
            true => None,
            false => self.vmm(kind),
        }
    }

    /// `kind`, if its binary was found.
    pub fn vmm(&self, kind: PeerKind) -> Option<PeerVmm<'_>> {
        match kind {
            PeerKind::Qemu(apic) => self.qemu.as_ref().map(|q| PeerVmm::Qemu(q, apic)),
            PeerKind::CloudHypervisor => {
                self.cloud_hypervisor.as_ref().map(PeerVmm::CloudHypervisor)
            }
            PeerKind::Firecracker => self.firecracker.as_ref().map(PeerVmm::Firecracker),
        }
    }

    /// A note naming each peer that was found, its version and binary,
    /// and each that was not.
    pub fn note(&self) -> String {
        let each = [
            ("QEMU", self.qemu.as_ref().map(|b| b.binary())),
            (
                "Cloud Hypervisor",
                self.cloud_hypervisor.as_ref().map(|b| b.binary()),
            ),
            ("Firecracker", self.firecracker.as_ref().map(|b| b.binary())),
        ];
        let described: Vec<String> = each
            .iter()
            .map(|(vmm, binary)| match binary {
                Some(binary) => format!("{vmm}: {}", peer_run::describe(binary)),
                None => format!("{vmm}: not found"),
            })
            .collect();
        // Where the scenario asked for QEMU's own APIC.
        let unable = self.qemu_own_apic.get().copied().flatten();
        let own_apic = unable.map_or(String::new(), |why| {
            format!(
                " QEMU's own APIC (kernel-irqchip=off): rows whose guest halts not run, as {why}."
            )
        });
        format!("Peers in this run: {}.{own_apic}", described.join("; "))
    }

    /// Cloud Hypervisor, if it was found.
    pub fn cloud_hypervisor(&self) -> Option<&CloudHypervisor> {
        self.cloud_hypervisor.as_ref()
    }

    /// Firecracker, if it was found.
    pub fn firecracker(&self) -> Option<&Firecracker> {
        self.firecracker.as_ref()
    }

    /// What the scenario saw of `kind`, whose run failed with `failure`
    /// (or, where the row's guest halts, `halts`, was not run: why).
    pub fn seen<'a>(&self, kind: PeerKind, failure: Option<&'a str>, halts: bool) -> PeerSeen<'a> {
        let not_run = halts.then(|| self.qemu_own_apic.get().copied().flatten());
        PeerSeen {
            kind,
            found: self.vmm(kind).is_some(),
            failure: failure.or(not_run.flatten()),
        }
    }
}

/// What a scenario saw of a peer's run of one variant, for a goal against
/// it that has no figure: only what happened in this run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerSeen<'a> {
    /// Which peer.
    pub kind: PeerKind,
    /// Whether its binary was found when the scenario started.
    pub found: bool,
    /// The error of its run, if it failed (it was not run again).
    pub failure: Option<&'a str>,
}

impl PeerSeen<'_> {
    /// Why there is no figure.
    pub fn why(self) -> String {
        match (self.found, self.failure) {
            (false, _) => self.kind.absent(),
            (true, Some(e)) => format!("{} failed in this run: {e}", self.kind.vmm()),
            (true, None) => format!("{} ran but reported nothing", self.kind.vmm()),
        }
    }
}

/// The goal `what` of this VMM's runs `ours` against a peer's (`theirs`),
/// met where `met` holds for the ratio; says what this run saw where the
/// peer gave no result (`seen`).
pub fn goal_against_peer(
    seen: PeerSeen,
    what: &str,
    ours: &Runs,
    theirs: &Runs,
    met: impl Fn(f64) -> bool,
) -> String {
    if theirs.0.is_empty() {
        return format!("Goal: {what}. Not measured: {}.", seen.why());
    }
    let ratio = ours.ratio_to(theirs);
    goal(
        what,
        &format!("{} {}'s", ratio.ratio_text(), seen.kind.vmm()),
        met(ratio.median()),
        &ratio.each(met),
    )
}

/// A peer's part in a goal against several peers: what was measured of
/// it, or why there is no figure.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerFigure {
    /// The peer, as goals name it ([`PeerKind::vmm`]).
    pub vmm: &'static str,
    /// Its figure, or why there is none.
    pub outcome: Result<Figure, String>,
}

/// What was measured against one peer.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    /// The figures, as the goal line gives them.
    pub measured: String,
    /// Whether the median met the goal.
    pub met: bool,
    /// Whether each run met it on its own.
    pub runs_met: Vec<bool>,
}

/// This VMM's runs `ours` against a peer's `theirs` (seen as `seen`), met
/// where `met` holds for the ratio.
pub fn figure_against(
    seen: PeerSeen,
    ours: &Runs,
    theirs: &Runs,
    met: impl Fn(f64) -> bool,
) -> PeerFigure {
    let outcome = match theirs.0.is_empty() {
        true => Err(seen.why()),
        false => {
            let ratio = ours.ratio_to(theirs);
            Ok(Figure {
                measured: format!("{} {}'s", ratio.ratio_text(), seen.kind.vmm()),
                met: met(ratio.median()),
                runs_met: ratio.each(met),
            })
        }
    };
    PeerFigure {
        vmm: seen.kind.vmm(),
        outcome,
    }
}

/// One goal, `asks`, against each peer in `figures` (one line in the
/// report's summary for the whole comparison): met where every peer with
/// a figure met it, and not measured where none has one.
pub fn goal_against_each(asks: &str, figures: &[PeerFigure]) -> String {
    let measured: Vec<(&str, &Figure)> = figures
        .iter()
        .filter_map(|f| Some((f.vmm, f.outcome.as_ref().ok()?)))
        .collect();
    let missing: Vec<String> = figures
        .iter()
        .filter_map(|f| Some(format!("{}: {}", f.vmm, f.outcome.as_ref().err()?)))
        .collect();
    if measured.is_empty() {
        return format!("Goal: {asks}. Not measured: {}.", missing.join("; "));
    }
    let met = measured.iter().all(|(_, f)| f.met);
    let runs = measured
        .iter()
        .map(|(_, f)| f.runs_met.len())
        .min()
        .unwrap_or(0);
    let each: Vec<bool> = (0..runs)
        .map(|i| measured.iter().all(|(_, f)| f.runs_met[i]))
        .collect();
    let parts: Vec<String> = measured
        .iter()
        .map(|(vmm, f)| {
            let verdict = if f.met { "met" } else { "missed" };
            format!("{vmm}: {} ({verdict})", f.measured)
        })
        .collect();
    let mut line = goal(asks, &parts.join("; "), met, &each);
    if !missing.is_empty() {
        line += &format!(" Without a figure: {}.", missing.join("; "));
    }
    line
}

/// The goal `what` of this VMM's runs `ours` against QEMU's own APIC's
/// (`user`), met where `met` holds for the ratio; QEMU on KVM's LAPIC
/// (`kernel`) is given beside it. Says what this run saw where QEMU gave
/// no result (`seen`).
pub fn goal_against_qemu(
    seen: PeerSeen,
    what: &str,
    ours: &Runs,
    user: &Runs,
    kernel: &Runs,
    met: impl Fn(f64) -> bool,
) -> String {
    let beside_kernel = match kernel.0.is_empty() {
        true => String::new(),
        false => format!(
            "; against QEMU on KVM's LAPIC: {}",
            ours.ratio_to(kernel).ratio_text()
        ),
    };
    let line = goal_against_peer(seen, what, ours, user, met);
    match line.strip_suffix('.') {
        Some(line) if !beside_kernel.is_empty() => format!("{line}{beside_kernel}."),
        _ => line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_goal_without_qemus_figure_says_what_this_run_saw() {
        let ours = Runs(vec![1.0]);
        let none = Runs::new();
        let line = |seen| goal_against_qemu(seen, "x", &ours, &none, &none, |_| true);
        let seen = |kind, found, failure| PeerSeen {
            kind,
            found,
            failure,
        };
        let qemu = PeerKind::Qemu(QemuApic::User);
        assert!(line(seen(qemu, false, None)).contains("no qemu-system-x86_64 was on PATH"));
        let failed = line(seen(qemu, true, Some("QEMU did not finish within 30s")));
        assert!(
            failed.contains("failed in this run: QEMU did not finish within 30s"),
            "{failed}"
        );
        assert!(
            !failed.contains("PVM") && !failed.contains("7.2"),
            "{failed}"
        );
        assert!(line(seen(qemu, true, None)).contains("ran but reported nothing"));
        let absent = line(seen(PeerKind::Firecracker, false, None));
        assert!(absent.contains("no firecracker was found"), "{absent}");
    }

    #[test]
    fn peers_not_found_are_named_in_the_note_and_their_goals_say_how_to_get_them() {
        let none = Peers {
            qemu: None,
            qemu_own_apic: Default::default(),
            cloud_hypervisor: None,
            firecracker: None,
        };
        assert_eq!(
            none.note(),
            "Peers in this run: QEMU: not found; Cloud Hypervisor: not found; Firecracker: not \
             found."
        );
        assert!(none.vmm(PeerKind::CloudHypervisor).is_none());
        let seen = none.seen(PeerKind::CloudHypervisor, None, true);
        assert!(seen.why().contains("--cloud-hypervisor"), "{}", seen.why());
        let qemu = Peers {
            qemu: Some(Qemu::at("/bin/true")),
            // Probed, and found able.
            qemu_own_apic: std::sync::OnceLock::from(None),
            ..none
        };
        assert!(
            qemu.note().starts_with("Peers in this run: QEMU: "),
            "{}",
            qemu.note()
        );
        assert_eq!(
            qemu.vmm(PeerKind::Qemu(QemuApic::User)).map(|v| v.name()),
            Some("QEMU")
        );
        // QEMU's own APIC, found unable to run a guest that halts: no
        // such rows, and why; the others run.
        let halting = Peers {
            qemu_own_apic: Some("it stopped at the first HLT").into(),
            ..qemu
        };
        let own = PeerKind::Qemu(QemuApic::User);
        assert!(halting.vmm_for(own, true).is_none());
        assert!(halting.vmm_for(own, false).is_some());
        assert!(
            halting
                .vmm_for(PeerKind::Qemu(QemuApic::Kernel), true)
                .is_some()
        );
        let why = halting.seen(own, None, true).why();
        assert!(why.contains("it stopped at the first HLT"), "{why}");
        assert!(!halting.seen(own, None, false).why().contains("HLT"));
        assert!(
            halting.note().ends_with(
                "(kernel-irqchip=off): rows whose guest halts not run, as it stopped at the first \
                 HLT."
            ),
            "{}",
            halting.note()
        );
    }

    #[test]
    fn one_goal_against_each_peer_is_met_only_where_every_peer_with_a_figure_met_it() {
        let seen = |kind| PeerSeen {
            kind,
            found: true,
            failure: None,
        };
        let ours = Runs(vec![1.0, 1.0]);
        let ch = figure_against(
            seen(PeerKind::CloudHypervisor),
            &ours,
            &Runs(vec![2.0, 2.0]),
            |r| r <= 1.0,
        );
        let fc = figure_against(
            seen(PeerKind::Firecracker),
            &ours,
            &Runs(vec![4.0, 4.0]),
            |r| r <= 1.0,
        );
        let absent = PeerSeen {
            found: false,
            ..seen(PeerKind::Qemu(QemuApic::Kernel))
        };
        let qemu = figure_against(absent, &ours, &Runs::new(), |r| r <= 1.0);
        let line = goal_against_each(
            "at most each peer's",
            &[ch.clone(), fc.clone(), qemu.clone()],
        );
        assert_eq!(
            line,
            "Goal: at most each peer's. Measured: Cloud Hypervisor: 0.50x Cloud Hypervisor's \
             (met); Firecracker: 0.25x Firecracker's (met): met. Without a figure: QEMU: no \
             qemu-system-x86_64 was on PATH when this scenario started (install it with `apt-get \
             install -y --no-install-recommends qemu-system-x86`, or give --qemu)."
        );
        assert_eq!(crate::summary::verdict(&line), crate::summary::Verdict::Met);
        let slower = figure_against(
            seen(PeerKind::Firecracker),
            &Runs(vec![5.0]),
            &Runs(vec![1.0]),
            |r| r <= 1.0,
        );
        let missed = goal_against_each("x", &[ch, slower]);
        assert!(missed.ends_with("(missed): not met."), "{missed}");
        assert_eq!(
            crate::summary::verdict(&missed),
            crate::summary::Verdict::NotMet
        );
        let none = goal_against_each("x", &[qemu]);
        assert_eq!(
            crate::summary::verdict(&none),
            crate::summary::Verdict::NotMeasured
        );
    }

    #[test]
    fn a_goal_against_a_peer_gives_the_ratio_and_qemus_kernel_apic_beside_it() {
        let seen = PeerSeen {
            kind: PeerKind::Qemu(QemuApic::User),
            found: true,
            failure: None,
        };
        let (ours, user, kernel) = (Runs(vec![1.0]), Runs(vec![2.0]), Runs(vec![4.0]));
        let line = goal_against_qemu(seen, "at most QEMU's", &ours, &user, &kernel, |r| r <= 1.0);
        assert_eq!(
            line,
            "Goal: at most QEMU's. Measured: 0.50x QEMU's own APIC's: met; against QEMU on \
             KVM's LAPIC: 0.25x."
        );
        let cloud = PeerSeen {
            kind: PeerKind::CloudHypervisor,
            ..seen
        };
        let line = goal_against_peer(cloud, "x", &user, &ours, |r| r <= 1.0);
        assert!(line.contains("2.00x Cloud Hypervisor's: not met"), "{line}");
    }
}
