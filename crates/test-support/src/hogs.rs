//! CPU-hog threads: the other tenants of an overcommitted host.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::thread;

/// Threads that spin and count their iterations until dropped, so a benchmark
/// can report how much CPU the other tenants kept.
#[derive(Debug)]
pub struct Hogs {
    stop: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Hogs {
    /// Starts `n` hog threads.
    pub fn start(n: usize) -> Self {
        let (stop, count) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let threads = (0..n)
            .map(|_| {
                let (stop, count) = (stop.clone(), count.clone());
                thread::spawn(move || {
                    while !stop.load(Relaxed) {
                        for i in 0..1024u64 {
                            std::hint::black_box(i);
                        }
                        count.fetch_add(1024, Relaxed);
                    }
                })
            })
            .collect();
        Self {
            stop,
            count,
            threads,
        }
    }

    /// Iterations all hogs have made so far.
    pub fn iterations(&self) -> u64 {
        self.count.load(Relaxed)
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        self.threads.drain(..).for_each(|t| {
            let _ = t.join();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hogs_count_while_running_and_stop_when_dropped() {
        let hogs = Hogs::start(2);
        let before = hogs.iterations();
        while hogs.iterations() == before {
            thread::yield_now();
        }
        drop(hogs);
        assert!(
            Hogs::start(0).iterations() == 0,
            "no threads, no iterations"
        );
    }
}
