//! Deferred reclamation: values and callbacks run after a grace period, on a
//! reclaim thread of the domain's own, never on a reader's thread.

use std::mem;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::{self, JoinHandle, ThreadId};

use crate::grace_period::GpState;
use crate::sync::{lock, wait};

pub(crate) type Callback = Box<dyn FnOnce() + Send>;

/// What waits for reclamation.
#[derive(Default)]
struct Queue {
    /// Each callback with the bytes it frees.
    callbacks: Vec<(usize, Callback)>,
    /// Bytes queued and not yet reclaimed (the running batch included).
    pending_bytes: usize,
    /// Callbacks ever queued, and ever run: a barrier waits for the second to
    /// catch up with the first.
    queued: u64,
    completed: u64,
    shutdown: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// The reclaim thread waits here for work.
    work: Condvar,
    /// Barriers and deferrers held back by the memory bound wait here.
    progress: Condvar,
    max_pending_bytes: usize,
    gp: Arc<GpState>,
}

/// The reclaim side of a domain: its queue and, once started, its thread.
pub(crate) struct Reclaimer {
    shared: Arc<Shared>,
    thread: OnceLock<(JoinHandle<()>, ThreadId)>,
}

impl Reclaimer {
    /// Bytes queued and not yet reclaimed.
    pub(crate) fn pending_bytes(&self) -> usize {
        lock(&self.shared.queue).pending_bytes
    }

    pub(crate) fn new(gp: Arc<GpState>, max_pending_bytes: usize) -> Self {
        let shared = Shared {
            queue: Mutex::default(),
            work: Condvar::new(),
            progress: Condvar::new(),
            max_pending_bytes,
            gp,
        };
        Self {
            shared: Arc::new(shared),
            thread: OnceLock::new(),
        }
    }

    /// Queues `callback` (accounted as `bytes`) to run after a grace period.
    pub(crate) fn enqueue(&self, bytes: usize, callback: Callback) {
        self.start();
        let s = &self.shared;
        let mut q = lock(&s.queue);
        // Back-pressure, except for a thread with an online reader of this domain:
        // the grace period that frees memory would wait for that very thread.
        if q.pending_bytes > 0 && q.pending_bytes + bytes > s.max_pending_bytes {
            drop(q);
            let may_wait = !s.gp.caller_is_online();
            q = lock(&s.queue);
            while may_wait && q.pending_bytes > 0 && q.pending_bytes + bytes > s.max_pending_bytes {
                q = wait(&s.progress, q);
            }
        }
        q.callbacks.push((bytes, callback));
        q.pending_bytes += bytes;
        q.queued += 1;
        s.gp.events.pending_reclaim(q.pending_bytes);
        s.work.notify_one();
    }

    /// Waits until everything queued before the call has been reclaimed.
    pub(crate) fn barrier(&self) {
        let s = &self.shared;
        let mut q = lock(&s.queue);
        let target = q.queued;
        while q.completed < target {
            q = wait(&s.progress, q);
        }
    }

    fn start(&self) {
        self.thread.get_or_init(|| {
            let shared = self.shared.clone();
            let handle = thread::Builder::new()
                .name("rcu-reclaim".into())
                .spawn(move || reclaim_loop(&shared))
                .unwrap_or_else(|e| panic!("rcu-qs: cannot start the reclaim thread: {e}"));
            let id = handle.thread().id();
            (handle, id)
        });
    }
}

impl Drop for Reclaimer {
    /// Reclaims everything still queued, then stops the thread.
    fn drop(&mut self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.work.notify_one();
        if let Some((handle, id)) = self.thread.take() {
            // The last handle may be dropped by a callback on the reclaim thread
            // itself; it then finishes its queue and exits without being joined.
            if id != thread::current().id() {
                let _ = handle.join();
            }
        }
    }
}

fn reclaim_loop(s: &Shared) {
    loop {
        let (batch, last) = {
            let mut q = lock(&s.queue);
            while q.callbacks.is_empty() && !q.shutdown {
                q = wait(&s.work, q);
            }
            if q.callbacks.is_empty() {
                return;
            }
            (mem::take(&mut q.callbacks), q.queued)
        };
        s.gp.wait_for_grace_period();
        let mut freed = 0;
        for (bytes, callback) in batch {
            // A panicking destructor must not stop reclamation of the rest.
            let _ = catch_unwind(AssertUnwindSafe(callback));
            freed += bytes;
        }
        let mut q = lock(&s.queue);
        q.completed = last;
        q.pending_bytes -= freed;
        s.gp.events.pending_reclaim(q.pending_bytes);
        s.progress.notify_all();
    }
}
