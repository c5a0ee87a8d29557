//! A custom dirty log (here, one that reports nothing new) and the bitmap.
use dirty_log::{DirtyBitmap, DirtyLog, DirtySet, Error, Slot};

struct Quiet(Vec<Slot>);

impl DirtyLog for Quiet {
    fn slots(&self) -> &[Slot] {
        &self.0
    }
    fn enable(&mut self) -> Result<(), Error> {
        Ok(())
    }
    fn harvest(&mut self, _into: &mut DirtySet) -> Result<(), Error> {
        Ok(())
    }
    fn disable(&mut self) -> Result<(), Error> {
        Ok(())
    }
}

fn main() {
    let mut bitmap = DirtyBitmap::new(128);
    bitmap.set(5).unwrap();
    assert_eq!(bitmap.count(), 1);
    let mut log = Quiet(Vec::new());
    log.enable().unwrap();
    println!("{} dirty, {} slots", bitmap.count(), log.slots().len());
}
