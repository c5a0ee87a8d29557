//! Guest output that never blocks a vCPU: a bounded buffer drained by a writer
//! thread.
//!
//! A guest's serial bytes go to whatever the VMM was given: stdout, a file, a
//! pipe. A pipe nobody reads blocks `write(2)` for ever, and a vCPU thread
//! blocked there can be neither kicked nor stopped. So the console writes into
//! a [`BoundedOutput`] instead, whose writer thread does the blocking writes;
//! when the buffer is full the guest's bytes are dropped and counted, as a
//! UART whose line is down would lose them.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// Bytes the buffer holds before it drops: a few screens of output.
pub const OUTPUT_BUFFER_BYTES: usize = 64 * 1024;

#[derive(Default)]
struct Buffer {
    bytes: Vec<u8>,
    /// Bytes the writer thread took from `bytes` and is writing.
    writing: usize,
    closed: bool,
    /// The last write to the real output failed with this.
    failed: Option<io::ErrorKind>,
}

#[derive(Default)]
struct Shared {
    buffer: Mutex<Buffer>,
    changed: Condvar,
    dropped: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Buffer> {
        self.buffer.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The guest-facing end: a [`Write`] that appends to the buffer and never
/// blocks on the real output.
#[derive(Clone)]
pub struct BoundedOutput {
    shared: Arc<Shared>,
    capacity: usize,
}

/// The VMM's end: how much was dropped, and a bounded wait for the writer
/// thread to catch up.
pub struct OutputDrain {
    shared: Arc<Shared>,
}

impl BoundedOutput {
    /// Starts a writer thread that copies what the guest writes to `out`,
    /// with a buffer of `capacity` bytes.
    pub fn start(
        out: Box<dyn Write + Send>,
        capacity: usize,
    ) -> io::Result<(BoundedOutput, OutputDrain)> {
        let shared = Arc::new(Shared::default());
        let writer = shared.clone();
        thread::Builder::new()
            .name("guest-output".into())
            .spawn(move || write_out(&writer, out))?;
        let drain = OutputDrain {
            shared: shared.clone(),
        };
        Ok((BoundedOutput { shared, capacity }, drain))
    }
}

impl Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut b = self.shared.lock();
        if let Some(kind) = b.failed {
            return Err(io::Error::new(kind, "the guest's output cannot be written"));
        }
        // Once the VMM has ended the output, nothing more is kept.
        let capacity = if b.closed { 0 } else { self.capacity };
        let room = capacity.saturating_sub(b.bytes.len()).min(buf.len());
        b.bytes.extend_from_slice(&buf[..room]);
        drop(b);
        let lost = (buf.len() - room) as u64;
        self.shared.dropped.fetch_add(lost, Ordering::Relaxed);
        self.shared.changed.notify_all();
        // Dropped bytes count as written: the guest's UART does not retry.
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl OutputDrain {
    /// Bytes dropped because the buffer was full.
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Ends the output: waits for the writer thread to write everything
    /// buffered, for as long as it makes progress at least every `limit`;
    /// then leaves it (still blocked, if its output is) and returns how many
    /// bytes it had not written (0: all of them were). A slow output is
    /// waited for; only one that stops taking bytes is given up on.
    pub fn finish(&self, limit: Duration) -> u64 {
        let mut b = self.shared.lock();
        b.closed = true;
        self.shared.changed.notify_all();
        let mut deadline = Instant::now() + limit;
        let mut unwritten = b.bytes.len() + b.writing;
        while unwritten > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return unwritten as u64;
            }
            b = self
                .shared
                .changed
                .wait_timeout(b, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            let now_unwritten = b.bytes.len() + b.writing;
            if now_unwritten < unwritten {
                deadline = Instant::now() + limit;
            }
            unwritten = now_unwritten;
        }
        0
    }
}

/// Bytes the writer thread writes at a time: each chunk done is progress
/// [`OutputDrain::finish`] can see.
const CHUNK: usize = 4096;

/// The writer thread: takes what is buffered and writes it out, a chunk at a
/// time, until the output is closed and empty or the output fails.
fn write_out(shared: &Shared, mut out: Box<dyn Write + Send>) {
    loop {
        let mut b = shared.lock();
        while b.bytes.is_empty() && !b.closed {
            b = shared
                .changed
                .wait(b)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if b.bytes.is_empty() {
            return;
        }
        let bytes = std::mem::take(&mut b.bytes);
        b.writing = bytes.len();
        drop(b);
        for chunk in bytes.chunks(CHUNK) {
            let result = out.write_all(chunk).and_then(|()| out.flush());
            let mut b = shared.lock();
            b.writing -= chunk.len();
            if let Err(e) = result {
                b.failed = Some(e.kind());
                b.writing = 0;
                b.bytes.clear(); // nowhere to go
                drop(b);
                shared.changed.notify_all();
                return;
            }
            drop(b);
            shared.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::SharedBuffer;

    /// An output that blocks until told, as a pipe nobody reads does.
    struct Stalled(Arc<(Mutex<bool>, Condvar)>);

    impl Write for Stalled {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let (open, cv) = &*self.0;
            let mut open = open.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn everything_written_reaches_the_output_once_finished() {
        let sink = SharedBuffer::default();
        let (mut out, drain) = BoundedOutput::start(Box::new(sink.clone()), 16).unwrap();
        out.write_all(b"hello ").unwrap();
        out.write_all(b"world\n").unwrap();
        assert_eq!(drain.finish(Duration::from_secs(10)), 0);
        assert_eq!(sink.contents(), b"hello world\n");
        assert_eq!(drain.dropped(), 0);
    }

    #[test]
    fn a_stalled_output_never_blocks_the_writer_and_overflow_is_counted() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let (mut out, drain) = BoundedOutput::start(Box::new(Stalled(gate.clone())), 8).unwrap();
        for _ in 0..100 {
            out.write_all(b"0123456789").unwrap();
        }
        // The writer thread holds at most one buffer's worth it took before it
        // stalled; the buffer holds 8 more; the rest is dropped.
        assert!(drain.dropped() >= 1000 - 2 * 8, "{}", drain.dropped());
        let started = Instant::now();
        let kept = 1000 - drain.dropped();
        assert_eq!(
            drain.finish(Duration::from_millis(50)),
            kept,
            "still stalled"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        assert_eq!(
            drain.finish(Duration::from_secs(10)),
            0,
            "caught up once unblocked"
        );
    }

    /// An output that takes a while over each write, but keeps taking bytes.
    struct Slow;

    impl Write for Slow {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            thread::sleep(Duration::from_millis(100));
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_slow_output_that_keeps_taking_bytes_is_waited_for() {
        let (mut out, drain) = BoundedOutput::start(Box::new(Slow), 8 * CHUNK).unwrap();
        out.write_all(&[b'x'; 8 * CHUNK]).unwrap();
        // Eight writes of 100 ms each: past the limit in all, each within it
        // by 400 ms, for a busy machine's late wake-ups.
        assert_eq!(drain.finish(Duration::from_millis(500)), 0);
        assert_eq!(drain.dropped(), 0);
    }

    #[test]
    fn an_output_error_reaches_the_guest_side() {
        struct Broken;
        impl Write for Broken {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let (mut out, drain) = BoundedOutput::start(Box::new(Broken), 8).unwrap();
        out.write_all(b"x").unwrap();
        drain.finish(Duration::from_secs(10));
        let err = out.write(b"y").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    }
}
