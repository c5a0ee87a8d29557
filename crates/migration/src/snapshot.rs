//! Snapshots of a paused guest to files: full ones, and increments that
//! hold only the pages written since the snapshot before (dirty-log's
//! backend tracks them from the first full one on). Each file names itself
//! and its parent ([`Link`]); `receive_chain` restores a full snapshot and
//! the increments after it, in order.

use std::fs::File;
use std::io::{BufWriter, Seek};
use std::path::Path;
use std::time::{Duration, Instant};

use reference_vmm::{RunControl, VcpuState};
use test_guests::layout::PAGE_SIZE;

use super::source::{Mover, PAUSE_TIMEOUT, open_snapshot};
use super::stream::{Link, MAX_PAGES_BYTES, StreamError, StreamWriter, random_id};
use super::{MigrationError, MigrationReport, image};

/// What a snapshot holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SnapshotKind {
    /// Every page: a base, restored alone; increments may follow it.
    #[default]
    Full,
    /// Only the pages written since the snapshot before (full or
    /// incremental), restored after it.
    Incremental,
}

reference_vmm::choice_names!(SnapshotKind, "snapshot kind", [
    Full => "full", Incremental => "incremental",
]);

impl Mover {
    /// Writes a `kind` snapshot of the guest that `states` came from
    /// ([`RunControl::pause`]) to `path` and syncs it, the guest staying
    /// paused: [`RunControl::resume`] runs it on, and `restore` runs the
    /// file (an increment after the snapshots before it). From a full
    /// snapshot on, the dirty log tracks the guest's writes for the next
    /// increment; a failed snapshot ends that, so the next must be full.
    ///
    /// # Errors
    /// An increment with no snapshot before it to follow
    /// ([`MigrationError::Chain`]); the file, or the dirty log.
    pub fn snapshot_paused(
        &mut self,
        control: &RunControl,
        states: &[VcpuState],
        path: &Path,
        kind: SnapshotKind,
    ) -> Result<MigrationReport, MigrationError> {
        let start = Instant::now();
        let (file, pages) = self.write_snapshot(control, states, path, kind)?;
        self.sync(&file, path)?;
        Ok(report(states, pages, start.elapsed(), start.elapsed()))
    }

    /// Pauses the running guest, writes a `kind` snapshot of it to `path`
    /// as [`Self::snapshot_paused`] does, runs it on, and then syncs the
    /// file: the guest's pause lasts the write, not the sync, which the
    /// report's total includes.
    ///
    /// # Errors
    /// As [`Self::snapshot_paused`], or the guest could not be paused.
    pub fn snapshot(
        &mut self,
        control: &RunControl,
        path: &Path,
        kind: SnapshotKind,
    ) -> Result<MigrationReport, MigrationError> {
        let start = Instant::now();
        let states = control.pause(PAUSE_TIMEOUT)?;
        let written = self.write_snapshot(control, &states, path, kind);
        control.resume();
        let downtime = start.elapsed();
        let (file, pages) = written?;
        self.sync(&file, path)?;
        Ok(report(&states, pages, downtime, start.elapsed()))
    }

    /// Writes the snapshot (not yet synced) and moves the chain on to it.
    fn write_snapshot(
        &mut self,
        control: &RunControl,
        states: &[VcpuState],
        path: &Path,
        kind: SnapshotKind,
    ) -> Result<(File, u64), MigrationError> {
        let parent = match (kind, self.chain.take()) {
            (SnapshotKind::Full, Some(_)) => {
                // Logging from scratch: manual protect's first round is
                // then every page.
                self.copier.log.disable();
                0
            }
            (SnapshotKind::Full, None) => 0,
            (SnapshotKind::Incremental, Some(parent)) => parent,
            (SnapshotKind::Incremental, None) => {
                return Err(MigrationError::Chain(
                    "an incremental snapshot follows a full one taken in this run: take a full one first"
                        .into(),
                ));
            }
        };
        let link = Link {
            id: new_id()?,
            parent,
        };
        let file = open_snapshot(path)?;
        match self.write(control, states, file, link) {
            Ok(written) => {
                self.chain = Some(link.id);
                Ok(written)
            }
            Err(e) => {
                let _ = std::fs::remove_file(path);
                self.copier.log.disable();
                Err(e)
            }
        }
    }

    /// The snapshot to `file`: the stream, naming the pages it holds (for
    /// a full snapshot every page, with the dirty log started; for an
    /// increment the pages it found), then their memory image
    /// ([`crate::image`]).
    fn write(
        &mut self,
        control: &RunControl,
        states: &[VcpuState],
        file: File,
        link: Link,
    ) -> Result<(File, u64), MigrationError> {
        let copier = &mut self.copier;
        let mut out = StreamWriter::new(BufWriter::with_capacity(MAX_PAGES_BYTES, file))?;
        out.config(control.description())?;
        out.chain(link)?;
        if link.is_full() {
            copier.log.enable()?;
            if !copier.log.first_round_is_full() {
                // The VMM's own writes before now sit in its bitmap: the
                // next increment counts from here.
                copier.log.round(|_| Ok(()))?;
            }
        }
        // Manual protect's first round after it starts is every page.
        let runs = match !link.is_full() || copier.log.first_round_is_full() {
            true => copier.dirty_runs()?,
            false => image::all_of(&copier.memory),
        };
        let image = image::name_runs(&copier.memory, &mut out, &runs)?;
        for state in states {
            out.vcpu(state)?;
        }
        out.end()?;
        let mut file = out
            .into_inner()
            .into_inner()
            .map_err(|e| StreamError::Io(e.into_error()))?;
        let start = image::image_start(file.stream_position().map_err(StreamError::Io)?);
        image::write_image(&copier.memory, &file, start, &image)?;
        let pages = runs.iter().map(|(_, len)| len / PAGE_SIZE).sum();
        Ok((file, pages))
    }

    /// Syncs a written snapshot: one that does not reach the disk is
    /// removed, and ends the chain.
    fn sync(&mut self, file: &File, path: &Path) -> Result<(), MigrationError> {
        file.sync_all().map_err(|e| {
            let _ = std::fs::remove_file(path);
            self.chain = None;
            self.copier.log.disable();
            MigrationError::from(StreamError::Io(e))
        })
    }
}

/// A snapshot's account: its pages, the pause and the whole.
fn report(
    states: &[VcpuState],
    pages: u64,
    downtime: Duration,
    total: Duration,
) -> MigrationReport {
    MigrationReport {
        pages_sent: pages,
        final_pages: pages,
        halted: states.iter().filter(|s| s.is_halted()).count(),
        snapshot: true,
        total,
        downtime,
        ..MigrationReport::default()
    }
}

/// A snapshot id ([`random_id`]).
fn new_id() -> Result<u64, MigrationError> {
    random_id().map_err(|e| MigrationError::Chain(format!("no snapshot id from /dev/urandom: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_by_name_and_ids_are_never_0_nor_repeated() {
        assert_eq!("incremental".parse(), Ok(SnapshotKind::Incremental));
        assert_eq!(SnapshotKind::Full.to_string(), "full");
        assert!("diff".parse::<SnapshotKind>().is_err());
        let (a, b) = (new_id().unwrap(), new_id().unwrap());
        assert!(a != 0 && b != 0 && a != b);
    }
}
