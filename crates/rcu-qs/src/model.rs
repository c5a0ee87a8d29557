//! Runs a sequence of operations, decoded from arbitrary bytes, against the crate
//! and against a simple model of what each must do, and panics on any
//! difference. The fuzz target (`fuzz/`) feeds it random bytes; `cargo test`
//! replays the committed corpus.
//!
//! All operations run on one thread, with up to four readers and two cells in one
//! domain whose memory bound is tiny, so that back-pressure, the errors for
//! waiting from an online reader, implicit online on read, and reclamation are
//! all exercised. Every value counts its creation and drop, and carries a canary
//! checked on every read.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::{Domain, RcuCell, RcuError, Reader};

const READERS: usize = 4;
const CELLS: usize = 2;
const ALIVE: u64 = 0x600d_600d_600d_600d;
const DEAD: u64 = 0xdead_dead_dead_dead;

/// A value that checks it is read only while alive and counts its life.
struct Value {
    n: u32,
    canary: u64,
    live: Arc<AtomicUsize>,
}

impl Value {
    fn new(n: u32, live: &Arc<AtomicUsize>) -> Self {
        live.fetch_add(1, Ordering::SeqCst);
        Self {
            n,
            canary: ALIVE,
            live: live.clone(),
        }
    }
}

impl Drop for Value {
    fn drop(&mut self) {
        assert_eq!(self.canary, ALIVE, "value {} dropped twice", self.n);
        self.canary = DEAD;
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One operation. Reader and cell indices wrap around.
#[derive(Clone, Copy, Debug)]
enum Op {
    Register,
    DropReader(usize),
    Quiescent(usize),
    Offline(usize),
    Online(usize),
    Read(usize, usize),
    Store(usize, u32),
    Replace(usize, u32),
    Defer(u32),
    Synchronize,
    ReaderSynchronize(usize),
    Barrier,
}

fn decode(data: &[u8]) -> Vec<Op> {
    let mut ops = Vec::new();
    let mut bytes = data.iter().copied();
    while let Some(b) = bytes.next() {
        let arg = usize::from(b >> 4);
        let mut value = || bytes.next().map_or(0, u32::from);
        ops.push(match b % 12 {
            0 => Op::Register,
            1 => Op::DropReader(arg % READERS),
            2 => Op::Quiescent(arg % READERS),
            3 => Op::Offline(arg % READERS),
            4 => Op::Online(arg % READERS),
            5 => Op::Read(arg % READERS, (arg / READERS) % CELLS),
            6 => Op::Store(arg % CELLS, value()),
            7 => Op::Replace(arg % CELLS, value()),
            8 => Op::Defer(value()),
            9 => Op::Synchronize,
            10 => Op::ReaderSynchronize(arg % READERS),
            _ => Op::Barrier,
        });
    }
    ops
}

struct World {
    domain: Domain,
    live: Arc<AtomicUsize>,
    cells: Vec<RcuCell<Value>>,
    readers: Vec<Option<Reader>>,
    /// The model: each cell's value.
    expected: [u32; CELLS],
}

impl World {
    fn new() -> Self {
        let domain = Domain::builder()
            .max_pending_bytes(4 * std::mem::size_of::<Value>())
            .build();
        let live = Arc::new(AtomicUsize::new(0));
        let cells = (0..CELLS)
            .map(|_| RcuCell::new(&domain, Value::new(0, &live)))
            .collect();
        let readers = (0..READERS).map(|_| None).collect();
        Self {
            domain,
            live,
            cells,
            readers,
            expected: [0; CELLS],
        }
    }

    fn any_online(&self, except: Option<usize>) -> bool {
        self.readers
            .iter()
            .enumerate()
            .any(|(i, r)| Some(i) != except && r.as_ref().is_some_and(Reader::is_online))
    }

    fn expect_wait(&self, result: Result<(), RcuError>, except: Option<usize>) {
        let online = self.any_online(except);
        assert_eq!(
            result.is_err(),
            online,
            "waiting must fail exactly when a reader is online"
        );
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Register => {
                if let Some(slot) = self.readers.iter_mut().find(|r| r.is_none()) {
                    let reader = self.domain.register_reader();
                    assert!(reader.is_online());
                    *slot = Some(reader);
                }
            }
            Op::DropReader(i) => self.readers[i] = None,
            Op::Quiescent(i) => self.with_reader(i, |r| {
                let was = r.is_online();
                r.quiescent();
                assert_eq!(r.is_online(), was);
            }),
            Op::Offline(i) => self.with_reader(i, |r| {
                r.offline();
                assert!(!r.is_online());
            }),
            Op::Online(i) => self.with_reader(i, |r| {
                r.online();
                assert!(r.is_online());
            }),
            Op::Read(i, c) => {
                if let Some(r) = &self.readers[i] {
                    let v = self.cells[c].read(r);
                    assert_eq!((v.n, v.canary), (self.expected[c], ALIVE));
                    assert!(r.is_online(), "a read brings its reader online");
                }
            }
            Op::Store(c, n) => {
                self.cells[c].store(Value::new(n, &self.live));
                self.expected[c] = n;
            }
            Op::Replace(c, n) => match self.cells[c].replace(Value::new(n, &self.live)) {
                Ok(old) => {
                    assert!(!self.any_online(None));
                    assert_eq!((old.n, old.canary), (self.expected[c], ALIVE));
                    self.expected[c] = n;
                }
                Err(rejected) => {
                    assert!(self.any_online(None));
                    assert_eq!(rejected.value.n, n, "a refused value comes back");
                }
            },
            Op::Defer(n) => self.domain.defer(Value::new(n, &self.live)),
            Op::Synchronize => self.expect_wait(self.domain.synchronize(), None),
            Op::ReaderSynchronize(i) => {
                if let Some(mut r) = self.readers[i].take() {
                    let was_online = r.is_online();
                    let result = r.synchronize();
                    assert_eq!(r.is_online(), was_online);
                    self.readers[i] = Some(r);
                    self.expect_wait(result, Some(i));
                }
            }
            Op::Barrier => {
                let result = self.domain.barrier();
                self.expect_wait(result, None);
                if result.is_ok() {
                    assert_eq!(self.domain.pending_reclaim_bytes(), 0);
                    assert_eq!(
                        self.live.load(Ordering::SeqCst),
                        CELLS,
                        "only the cells' values live"
                    );
                }
            }
        }
    }

    fn with_reader(&mut self, i: usize, f: impl FnOnce(&mut Reader)) {
        if let Some(r) = self.readers[i].as_mut() {
            f(r);
        }
    }
}

/// Runs the operations `data` decodes to; panics if the crate and the model differ.
pub fn run(data: &[u8]) {
    let mut world = World::new();
    for op in decode(data) {
        world.apply(op);
    }
    let live = world.live.clone();
    world.readers.clear();
    world.domain.barrier().expect("no reader is left online");
    drop(world);
    assert_eq!(
        live.load(Ordering::SeqCst),
        0,
        "every value was dropped exactly once"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays every input committed under `fuzz-corpus/model/`.
    #[test]
    fn replays_the_fuzz_corpus() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz-corpus/model");
        let mut inputs = 0;
        for entry in std::fs::read_dir(dir).expect("the corpus is committed") {
            let path = entry.unwrap().path();
            run(&std::fs::read(&path).unwrap());
            inputs += 1;
        }
        assert!(inputs >= 8, "the corpus has only {inputs} inputs");
    }

    #[test]
    fn every_byte_value_decodes_and_all_twelve_operations_occur() {
        let kinds: std::collections::HashSet<_> = (0..=255u8)
            .flat_map(|b| decode(&[b]))
            .map(|op| std::mem::discriminant(&op))
            .collect();
        assert_eq!(kinds.len(), 12);
    }
}
