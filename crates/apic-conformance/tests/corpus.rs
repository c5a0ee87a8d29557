//! reference-vmm's `local_apic` fuzz corpus replayed on its APIC alone,
//! each input's answers against KVM's committed ones (no KVM needed).

use apic_conformance::fuzz_corpus;

#[test]
fn replays_the_local_apic_corpus_against_kvms_answers() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../reference-vmm");
    let text = std::fs::read_to_string(format!("{root}/{}", fuzz_corpus::EXPECTATIONS))
        .expect("KVM's answers are committed");
    let answers = fuzz_corpus::parse(&text).unwrap();
    let dir = format!("{root}/fuzz-corpus/local_apic");
    let mut inputs = 0;
    for entry in std::fs::read_dir(&dir).expect("the corpus is committed") {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let kvm = answers.by_input.get(&name).unwrap_or_else(|| {
            panic!(
                "{name} has no KVM answers: record them with `reference-vmm conformance \\
                 --record-fuzz-corpus {dir} > {root}/{}`",
                fuzz_corpus::EXPECTATIONS
            )
        });
        let data = std::fs::read(&path).unwrap();
        if let Some(difference) = fuzz_corpus::check(&data, kvm, answers.phys_bits) {
            panic!("corpus input {name}: {difference}");
        }
        reference_vmm::invariants::local_apic(&data);
        inputs += 1;
    }
    assert!(inputs >= 8, "{dir} has only {inputs} inputs");
}
