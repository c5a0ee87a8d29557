//! The per-thread side of QSBR: what a reader thread announces.

/// What a reader thread tells RCU about itself.
///
/// A vCPU run loop calls [`offline`](QsReporter::offline) before `KVM_RUN` and
/// [`online`](QsReporter::online) after it, and
/// [`quiescent`](QsReporter::quiescent) whenever it holds no RCU-protected
/// reference, so that writers' grace periods end without waiting for the guest.
pub trait QsReporter {
    /// The thread holds no RCU-protected reference right now.
    fn quiescent(&self);
    /// The thread will hold none until [`online`](QsReporter::online): writers
    /// need not wait for it at all (an extended quiescent state).
    fn offline(&self);
    /// The thread may hold RCU-protected references again.
    fn online(&self);
}

/// A reporter for VMMs that use no RCU: every call does nothing and costs nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoQs;

impl QsReporter for NoQs {
    fn quiescent(&self) {}
    fn offline(&self) {}
    fn online(&self) {}
}

impl<R: QsReporter + ?Sized> QsReporter for &R {
    fn quiescent(&self) {
        (**self).quiescent()
    }
    fn offline(&self) {
        (**self).offline()
    }
    fn online(&self) {
        (**self).online()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Records the calls, to check that generic code forwards them.
    #[derive(Default)]
    struct Recorder(RefCell<Vec<&'static str>>);

    impl QsReporter for Recorder {
        fn quiescent(&self) {
            self.0.borrow_mut().push("quiescent");
        }
        fn offline(&self) {
            self.0.borrow_mut().push("offline");
        }
        fn online(&self) {
            self.0.borrow_mut().push("online");
        }
    }

    fn one_exit(qs: impl QsReporter) {
        qs.offline();
        qs.online();
        qs.quiescent();
    }

    #[test]
    fn references_forward_every_call() {
        let r = Recorder::default();
        one_exit(&r);
        assert_eq!(*r.0.borrow(), ["offline", "online", "quiescent"]);
    }

    #[test]
    fn no_qs_is_zero_sized() {
        one_exit(NoQs);
        assert_eq!(std::mem::size_of::<NoQs>(), 0);
    }
}
