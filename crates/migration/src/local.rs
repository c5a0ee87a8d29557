//! Both ends of a migration in one process: a source VM moved over a real
//! socket to a destination VM of the same process, so that the two memories
//! can be compared at the switch-over. What the migration tests and the
//! bench use; a VMM that migrates between hosts runs [`Migration`] at the
//! source and [`receive`] at the destination, each in its own process.

use std::thread;
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};

use super::tls::{TlsClient, TlsServer};
use super::{
    AcceptLimits, Address, FetchReport, Fetching, Incoming, Listener, MigrateOptions, Migration,
    MigrationError, MigrationReport, Resume, Target, hand_over, receive_from,
};
use reference_vmm::Error;
use reference_vmm::RunReport;
use reference_vmm::VmMemory;
use reference_vmm::{Vm, VmConfig};
use test_guests::GuestProgram;

/// One guest moved: what the migration, both runs and the memories showed.
#[derive(Debug)]
pub struct Moved {
    /// The source's account.
    pub migration: MigrationReport,
    /// The source's run, handed over.
    pub source: RunReport,
    /// The destination's run, to the guest's end.
    pub destination: RunReport,
    /// Bytes that differed between the two memories at the switch-over,
    /// where they were compared.
    pub differing: Option<u64>,
    /// The source's memory as it was handed over (the source's vCPUs
    /// stopped there).
    pub source_memory: VmMemory,
    /// Post-copy: what the destination fetched after the hand-over.
    pub fetched: Option<FetchReport>,
}

/// Runs `program` as `config` says and moves it, after
/// `options.after`, to a VM that receives it on `address` in this process,
/// which runs the guest to its end. With `compare`, the destination waits
/// until both memories have been compared (its guest then sees that wait
/// as part of its stall); without, it runs at once, as a destination
/// process does. In post-copy the comparison reads the destination's
/// memory through its faults, as its guest would, before the guest runs;
/// with `options.resume` the destination waits for its source after a cut
/// link, `options.timeout` at most.
pub fn move_in_process(
    config: &VmConfig,
    program: &'static GuestProgram,
    options: MigrateOptions,
    address: &Address,
    compare: bool,
) -> Result<Moved, MigrationError> {
    move_over(config, program, options, address, None, compare)
}

/// [`move_in_process`] in TLS: the source with `client`'s certificate, the
/// destination with `server`'s ([`tls`](super::tls)); TCP only.
pub fn move_in_process_tls(
    config: &VmConfig,
    program: &'static GuestProgram,
    options: MigrateOptions,
    address: &Address,
    (client, server): (TlsClient, TlsServer),
    compare: bool,
) -> Result<Moved, MigrationError> {
    move_over(
        config,
        program,
        options,
        address,
        Some((client, server)),
        compare,
    )
}

fn move_over(
    config: &VmConfig,
    program: &'static GuestProgram,
    options: MigrateOptions,
    address: &Address,
    tls: Option<(TlsClient, TlsServer)>,
    compare: bool,
) -> Result<Moved, MigrationError> {
    let (listener, client) = match tls {
        Some((client, server)) => (address.listen_tls(server)?, Some(client)),
        None => (address.listen()?, None),
    };
    move_to_listener(config, program, options, listener, client, compare)
}

/// [`move_in_process`] to a destination on `listener`, made beforehand (in
/// another network namespace, say: the source connects from the calling
/// thread's); in TLS with `client` where the listener takes TLS.
pub fn move_to_listener(
    config: &VmConfig,
    program: &'static GuestProgram,
    options: MigrateOptions,
    listener: Listener,
    client: Option<TlsClient>,
    compare: bool,
) -> Result<Moved, MigrationError> {
    let address = listener
        .address()
        .map_err(|source| MigrationError::Connect {
            what: "the listener".into(),
            source,
        })?;
    let mut vm = Vm::new(config)?;
    let source_memory = vm.memory();
    // The destination runs the source's mechanisms.
    let mechanisms = config.clone();
    let compared = compare.then(|| source_memory.clone());
    let resume = options.resume.then_some(options.timeout);
    let destination =
        thread::spawn(move || arrive(listener, &mechanisms, program, compared, resume));
    let target = match client {
        Some(client) => Target::TlsPeer(address, client),
        None => Target::Peer(address),
    };
    let moving = Migration::prepare(&mut vm, target, options)?;
    let (tx, migrated) = std::sync::mpsc::channel();
    vm.on_start(Box::new(move |control| {
        let _ = tx.send(moving.run(control));
    }));
    let source = vm.run(program, Box::new(std::io::sink()))?;
    let migration = migrated
        .recv()
        .map_err(|_| Error::ThreadPanicked("migration"))??;
    let joined = destination
        .join()
        .map_err(|_| Error::ThreadPanicked("destination"))?;
    let (destination, differing, fetched) = match joined? {
        Arrival::Ran {
            report,
            differing,
            fetched,
        } => (*report, differing, fetched),
        Arrival::Held(incoming) => {
            let differing = differing_bytes(&source_memory, &incoming.vm.memory())?;
            let report = incoming.vm.run(program, Box::new(std::io::sink()))?;
            (report, Some(differing), None)
        }
    };
    Ok(Moved {
        migration,
        source,
        destination,
        differing,
        source_memory,
        fetched,
    })
}

/// The destination's end of a move in this process.
enum Arrival {
    /// The guest ran to its end here.
    Ran {
        report: Box<RunReport>,
        differing: Option<u64>,
        fetched: Option<FetchReport>,
    },
    /// Pre-copy to compare: the VM waits until the source's run is over.
    Held(Box<Incoming>),
}

/// Takes the source on `listener`, receives the VM and runs it; to be
/// compared with `compared`, the source's memory, where given; waiting
/// for the source to come back after a cut link within `resume`.
fn arrive(
    listener: Listener,
    mechanisms: &VmConfig,
    program: &'static GuestProgram,
    compared: Option<VmMemory>,
    resume: Option<Duration>,
) -> Result<Arrival, MigrationError> {
    let mut input =
        listener.accept_source(&AcceptLimits::default(), &mut |line| eprintln!("{line}"))?;
    let received = receive_from(&mut input, mechanisms);
    let mut incoming = hand_over(input.get_mut(), received)?;
    if incoming.postcopy.is_none() && compared.is_some() {
        return Ok(Arrival::Held(Box::new(incoming)));
    }
    let resume = resume.map(|within| Resume {
        listener,
        limits: AcceptLimits::default(),
        within,
        log: |line| eprintln!("{line}"),
    });
    let fetching = incoming.fetch(input, resume)?;
    let differing = compared
        .map(|source| differing_bytes(&source, &incoming.vm.memory()))
        .transpose()?;
    let run = incoming.vm.run(program, Box::new(std::io::sink()));
    let fetched = fetching.map(Fetching::finish).transpose()?;
    Ok(Arrival::Ran {
        report: Box::new(run?),
        differing,
        fetched,
    })
}

/// Compares two memories of the same size, a MiB at a time.
fn differing_bytes(a: &VmMemory, b: &VmMemory) -> Result<u64, MigrationError> {
    let size = vm_memory::GuestMemoryBackend::last_addr(a).0 + 1;
    let (mut x, mut y) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut differing = 0;
    for at in (0..size).step_by(1 << 20) {
        let n = ((size - at) as usize).min(x.len());
        a.read_slice(&mut x[..n], GuestAddress(at))
            .and_then(|()| b.read_slice(&mut y[..n], GuestAddress(at)))?;
        // A slice comparison first: a byte-by-byte count only where a MiB
        // differs, so the destination is not held up (its guest's clock runs).
        if x[..n] != y[..n] {
            differing += x[..n].iter().zip(&y[..n]).filter(|(p, q)| p != q).count() as u64;
        }
    }
    Ok(differing)
}
