//! The conformance test catches each of four plausible APIC bugs. Each bug
//! is a mutation of reference-vmm's source, applied to a copy of the
//! workspace only: the library itself carries no trace of them. One build of
//! that copy holds all four, each behind the `APIC_SEEDED_BUG` variable, and
//! `tests/conformance.rs` runs on it once clean and once per bug (`cargo
//! test -p apic-conformance --features seeded-bugs --test seeded_bugs`;
//! `.ci/run` runs it).
#![cfg(feature = "seeded-bugs")]

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::kvm_available;

/// The variable that picks the bug a mutant build shows.
const SELECTOR: &str = "APIC_SEEDED_BUG";

/// The conformance test the mutants run: both modes, the default seeds.
const CONFORMANCE: &str = "this_vmms_apic_answers_as_kvms_through_x2apic_msrs_and_the_xapic_page";

/// One bug: in `file`, the expression `original` right after `before`
/// becomes `buggy`.
struct Mutation {
    name: &'static str,
    file: &'static str,
    before: &'static str,
    original: &'static str,
    buggy: &'static str,
}

const MUTATIONS: [Mutation; 4] = [
    // PPR reports only TPR's priority class, losing its sub-class.
    Mutation {
        name: "PprDropsTprSubclass",
        file: "crates/reference-vmm/src/apic.rs",
        before: "if self.tpr >> 4 >= isrv >> 4 {\n            ",
        original: "self.tpr",
        buggy: "self.tpr & 0xF0",
    },
    // SVR keeps bit 12, EOI-broadcast suppression, which the version
    // register does not offer.
    Mutation {
        name: "SvrKeepsBroadcastSuppression",
        file: "crates/reference-vmm/src/apic.rs",
        before: "self.svr = ",
        original: "value & SVR_WRITABLE",
        buggy: "value & (SVR_WRITABLE | 1 << 12)",
    },
    // An LVT entry written while the APIC is software-disabled keeps the
    // mask bit the guest wrote.
    Mutation {
        name: "LvtUnmaskedWhileDisabled",
        file: "crates/reference-vmm/src/apic.rs",
        before: "fn lvt_forced_mask(&self) -> u32 {\n        if ",
        original: "self.enabled()",
        buggy: "true",
    },
    // Another vCPU's IPI reaches a vCPU whose APIC is software-disabled.
    Mutation {
        name: "DisabledVcpuTakesIpis",
        file: "crates/reference-vmm/src/irq.rs",
        before: "            if ",
        original: "link.accepting.load(SeqCst)",
        buggy: "(link.accepting.load(SeqCst) || t != from)",
    },
];

#[test]
fn the_conformance_test_catches_each_seeded_bug_within_the_default_seeds() {
    if !kvm_available("the_conformance_test_catches_each_seeded_bug_within_the_default_seeds") {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("seeded-bugs");
    let copy = work.join("workspace");
    copy_workspace(&root, &copy);
    for mutation in &MUTATIONS {
        mutation.apply(&copy);
    }

    let clean = conformance_on(&copy, &work.join("target"), None);
    assert!(
        clean.status.success(),
        "the mutant build, no bug selected, failed: {}",
        text(&clean)
    );
    for mutation in &MUTATIONS {
        let run = conformance_on(&copy, &work.join("target"), Some(mutation.name));
        let said = text(&run);
        let caught = said.lines().find(|l| l.contains("differs"));
        eprintln!("{}: first caught at {caught:?}", mutation.name);
        assert!(
            !run.status.success() && caught.is_some(),
            "{} escaped the conformance test: {said}",
            mutation.name
        );
    }
}

impl Mutation {
    /// Writes this bug into the copy at `copy`, behind [`SELECTOR`].
    fn apply(&self, copy: &Path) {
        let path = copy.join(self.file);
        let source = fs::read_to_string(&path).unwrap();
        let site = format!("{}{}", self.before, self.original);
        assert_eq!(
            source.matches(&site).count(),
            1,
            "{}: {} no longer holds `{}` once; update the mutation",
            self.name,
            self.file,
            self.original
        );
        let guarded = format!(
            "{}(if ::std::env::var({SELECTOR:?}).is_ok_and(|b| b == {:?}) {{ {} }} else {{ {} }})",
            self.before, self.name, self.buggy, self.original
        );
        fs::write(&path, source.replacen(&site, &guarded, 1)).unwrap();
    }
}

/// Copies the workspace's manifest, lock file and sources (no build
/// output) to `copy`, keeping modification times so that only the mutated
/// crates rebuild from one run to the next.
fn copy_workspace(root: &Path, copy: &Path) {
    if copy.exists() {
        fs::remove_dir_all(copy).unwrap();
    }
    fs::create_dir_all(copy).unwrap();
    let parts = ["Cargo.toml", "Cargo.lock", "common", "crates"].map(|p| root.join(p));
    let status = Command::new("cp")
        .arg("-a")
        .args(&parts)
        .arg(copy)
        .status()
        .unwrap();
    assert!(status.success(), "copying the workspace failed");
    for target in crate_targets(&copy.join("crates")) {
        fs::remove_dir_all(target).unwrap();
    }
}

/// Build folders inside the crates (fuzz targets keep their own).
fn crate_targets(crates: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in fs::read_dir(crates).unwrap() {
        let dir = entry.unwrap().path();
        found.extend(
            [dir.join("target"), dir.join("fuzz/target")]
                .into_iter()
                .filter(|t| t.is_dir()),
        );
    }
    found
}

/// Runs the conformance test in the copy at `copy`, with `bug` selected.
fn conformance_on(copy: &Path, target: &Path, bug: Option<&str>) -> Output {
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .current_dir(copy)
        .args(["test", "--quiet", "-p", "apic-conformance"])
        .args(["--test", "conformance", "--", "--exact", CONFORMANCE])
        .env("CARGO_TARGET_DIR", target)
        .env_remove(SELECTOR);
    // An instrumented (coverage) run's flags are not this build's.
    for flags in ["RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS", "LLVM_PROFILE_FILE"] {
        cargo.env_remove(flags);
    }
    if let Some(bug) = bug {
        cargo.env(SELECTOR, bug);
    }
    cargo.output().unwrap()
}

fn text(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr)
}
