//! `dirty_log_perf_test`, for every backend in one run: N vCPUs (CPL3 guests)
//! each write every page of their own part of one memory slot once per
//! iteration, and the VMM harvests between iterations. Prints the test's
//! columns: populate, enable, iteration-1 and iteration-N dirty memory time,
//! total get and clear time, disable, and the longest single ioctl.
//!
//! `cargo run --release -p dirty-log --example perf -- [--vcpus N] [--mib-per-vcpu M] [--iterations I] [--thp]`
//!
//! With `--update-results` the table also goes to the crate's RESULTS.md, section "perf, 4 KiB" (or
//! "perf, THP").

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use dirty_log::perf::{self, Mode, RING_BYTES, Row, Tracker};
use dirty_log::{DirtyStats, RingFull, enable_dirty_ring};
use kvm_ioctls::VcpuFd;
use writer_vm::{Stop, Writer, WriterVm, run};

// The workspace's RESULTS.md writer (test-support's), a copy of which ships with the crate.
#[path = "support/results.rs"]
mod results;

// The guest the KVM tests run; this example takes only its writers.
#[allow(dead_code)]
#[path = "../tests/support/kvm.rs"]
mod writer_vm;

#[derive(Clone, Copy, Debug)]
struct Options {
    vcpus: usize,
    mib_per_vcpu: u64,
    iterations: usize,
    thp: bool,
}

fn parse() -> Result<Options, String> {
    let mut o = Options {
        vcpus: 2,
        mib_per_vcpu: 256,
        iterations: 3,
        thp: false,
    };
    let mut args = results::args();
    while let Some(flag) = args.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            let v = args.next().ok_or(format!("{name} needs a value"))?;
            v.parse()
                .map_err(|_| format!("{name}: `{v}` is not a number"))
        };
        match flag.as_str() {
            "--vcpus" => o.vcpus = value("--vcpus")? as usize,
            "--mib-per-vcpu" => o.mib_per_vcpu = value("--mib-per-vcpu")?,
            "--iterations" => o.iterations = value("--iterations")? as usize,
            "--thp" => o.thp = true,
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    let total = o.vcpus as u64 * o.mib_per_vcpu;
    if o.vcpus == 0
        || o.mib_per_vcpu % 2 != 0
        || o.mib_per_vcpu == 0
        || total > 1024
        || o.iterations < 2
    {
        return Err(
            "want 1+ vCPUs, an even MiB count per vCPU, 1 GiB at most in all, 2+ iterations".into(),
        );
    }
    Ok(o)
}

/// The vCPU threads: each runs one round per `go`, and reports its time.
struct Vcpus {
    go: Arc<Barrier>,
    done: Arc<Barrier>,
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<Duration>>,
}

impl Vcpus {
    fn start(vcpus: Vec<VcpuFd>, ring: Option<RingFull>) -> Self {
        let n = vcpus.len() + 1;
        let (go, done) = (Arc::new(Barrier::new(n)), Arc::new(Barrier::new(n)));
        let stop = Arc::new(AtomicBool::new(false));
        let threads = vcpus
            .into_iter()
            .enumerate()
            .map(|(index, mut vcpu)| {
                let (go, done, stop, ring) = (go.clone(), done.clone(), stop.clone(), ring.clone());
                thread::spawn(move || {
                    let mut longest = Duration::ZERO;
                    loop {
                        go.wait();
                        if stop.load(Ordering::SeqCst) {
                            return longest;
                        }
                        let start = Instant::now();
                        loop {
                            match run(&mut vcpu).expect("the writer runs") {
                                Stop::Round(_) => break,
                                Stop::RingFull => {
                                    ring.as_ref().expect("a ring").drain(index).expect("drain")
                                }
                            }
                        }
                        longest = longest.max(start.elapsed());
                        done.wait();
                    }
                })
            })
            .collect();
        Self {
            go,
            done,
            stop,
            threads,
        }
    }

    /// One pass of every vCPU; the wall time until the last finished.
    fn iteration(&self) -> Duration {
        let start = Instant::now();
        self.go.wait();
        self.done.wait();
        start.elapsed()
    }

    fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        self.go.wait();
        self.threads.into_iter().for_each(|t| {
            t.join().expect("vCPU thread");
        });
    }
}

fn measure(mode: Mode, o: Options) -> Result<Row, writer_vm::Error> {
    let data = (o.vcpus as u64 * o.mib_per_vcpu) << 20;
    let vm = WriterVm::new(data, o.thp, |vm| {
        if mode == Mode::Ring {
            enable_dirty_ring(vm, RING_BYTES)?;
        }
        Ok(())
    })?;
    let share = vm.data_pages() / o.vcpus as u64;
    let vcpus: Vec<VcpuFd> = (0..o.vcpus as u64)
        .map(|i| vm.vcpu(i, Writer::Sequential, i * share, share))
        .collect::<Result<_, _>>()?;
    let stats = Arc::new(DirtyStats::default());
    let slots = vm.slots()?;
    let refs: Vec<&VcpuFd> = vcpus.iter().collect();
    let (mut tracker, ring) = Tracker::new(mode, &*vm.vm, slots, stats.clone(), &refs)?;
    let threads = Vcpus::start(vcpus, ring);
    let row = perf::measure(mode, &mut tracker, &stats, o.iterations, || {
        Ok(threads.iteration())
    });
    threads.stop();
    Ok(row?)
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!(
                "perf: {e}\nusage: perf [--vcpus N] [--mib-per-vcpu M] [--iterations I] [--thp]"
            );
            std::process::exit(2);
        }
    };
    let backing = if o.thp { "THP" } else { "4 KiB" };
    let mut table = format!(
        "{} vCPUs x {} MiB ({backing} backing), {} iterations\n\n| {} |\n|{}\n",
        o.vcpus,
        o.mib_per_vcpu,
        o.iterations,
        perf::COLUMNS.join(" | "),
        "---|".repeat(perf::COLUMNS.len())
    );
    print!("{table}");
    for mode in Mode::ALL {
        match measure(mode, o) {
            Ok(r) => {
                let row = format!("| {} |\n", r.cells(mode).join(" | "));
                print!("{row}");
                table.push_str(&row);
            }
            Err(e) => {
                eprintln!("perf: {}: {e}", mode.name());
                std::process::exit(1);
            }
        }
    }
    let command = results::command("cargo run --release -p dirty-log --example perf");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("RESULTS.md");
    let section = format!("perf, {backing}");
    results::write_section_if_asked(&path, "dirty-log", &section, &command, &table);
}
