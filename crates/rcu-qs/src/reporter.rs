//! The per-thread side of QSBR, as a trait a run loop can be generic over.

/// What a reader thread tells RCU about itself.
///
/// A vCPU run loop calls [`offline`](QsReporter::offline) before `KVM_RUN` and
/// [`online`](QsReporter::online) after it, and
/// [`quiescent`](QsReporter::quiescent) whenever it holds no RCU-protected
/// reference, so that writers' grace periods end without waiting for the guest.
/// [`Reader`](crate::Reader) implements it; [`NoQs`] does nothing.
pub trait QsReporter {
    /// The thread holds no RCU-protected reference right now.
    fn quiescent(&mut self);
    /// The thread will hold none until [`online`](QsReporter::online): writers
    /// need not wait for it at all (an extended quiescent state).
    fn offline(&mut self);
    /// The thread may hold RCU-protected references again.
    fn online(&mut self);
}

/// A reporter for VMMs that use no RCU: every call does nothing and costs nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoQs;

impl QsReporter for NoQs {
    fn quiescent(&mut self) {}
    fn offline(&mut self) {}
    fn online(&mut self) {}
}

impl<R: QsReporter + ?Sized> QsReporter for &mut R {
    fn quiescent(&mut self) {
        (**self).quiescent()
    }
    fn offline(&mut self) {
        (**self).offline()
    }
    fn online(&mut self) {
        (**self).online()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the calls, to check that generic code forwards them.
    #[derive(Default)]
    struct Recorder(Vec<&'static str>);

    impl QsReporter for Recorder {
        fn quiescent(&mut self) {
            self.0.push("quiescent");
        }
        fn offline(&mut self) {
            self.0.push("offline");
        }
        fn online(&mut self) {
            self.0.push("online");
        }
    }

    fn one_exit(mut qs: impl QsReporter) {
        qs.offline();
        qs.online();
        qs.quiescent();
    }

    #[test]
    fn mutable_references_forward_every_call() {
        let mut r = Recorder::default();
        one_exit(&mut r);
        assert_eq!(r.0, ["offline", "online", "quiescent"]);
    }

    #[test]
    fn no_qs_is_zero_sized() {
        one_exit(NoQs);
        assert_eq!(std::mem::size_of::<NoQs>(), 0);
    }
}
