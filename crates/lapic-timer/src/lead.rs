//! The delivery lead: start delivering an interrupt this long before its
//! deadline, to cover the fixed path from "deliver" to the guest's handler
//! (injection, VM entry, the guest's interrupt entry) without ever making the
//! guest see the interrupt before its deadline.

use std::collections::VecDeque;
use std::time::Duration;

/// Samples the lead remembers: it is their minimum, less a margin.
const WINDOW: usize = 64;

/// Learns the delivery lead from measured delivery latencies.
#[derive(Clone, Debug)]
pub struct DeliveryLead {
    recent: VecDeque<u64>,
    margin_ns: u64,
    lead_ns: u64,
    early: u64,
}

impl Default for DeliveryLead {
    fn default() -> Self {
        Self::new(Duration::from_micros(1))
    }
}

impl DeliveryLead {
    /// No lead until latencies are known; `margin` is kept below the shortest
    /// recent latency.
    pub fn new(margin: Duration) -> Self {
        Self {
            recent: VecDeque::with_capacity(WINDOW),
            margin_ns: margin.as_nanos() as u64,
            lead_ns: 0,
            early: 0,
        }
    }

    /// The current lead.
    pub fn lead(&self) -> Duration {
        Duration::from_nanos(self.lead_ns)
    }

    /// Interrupts the guest saw before their deadline, so far.
    pub fn early_count(&self) -> u64 {
        self.early
    }

    /// A measured latency from starting delivery to the guest's handler.
    pub fn learn_latency(&mut self, latency: Duration) {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(latency.as_nanos() as u64);
        let shortest = self.recent.iter().copied().min().unwrap_or(0);
        self.lead_ns = shortest.saturating_sub(self.margin_ns);
    }

    /// The guest saw an interrupt `by` before its deadline: count it, and pull
    /// the lead back at once by that much and the margin.
    pub fn learn_early(&mut self, by: Duration) {
        self.early += 1;
        self.lead_ns = self
            .lead_ns
            .saturating_sub(by.as_nanos() as u64 + self.margin_ns);
        let cap = self.lead_ns + self.margin_ns;
        self.recent.iter_mut().for_each(|l| *l = (*l).min(cap));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn the_lead_is_the_shortest_recent_latency_less_the_margin() {
        let mut l = DeliveryLead::default();
        assert_eq!(l.lead(), Duration::ZERO);
        for us in [14, 12, 13, 20] {
            l.learn_latency(us * US);
        }
        assert_eq!(l.lead(), 11 * US);
        for _ in 0..WINDOW {
            l.learn_latency(15 * US);
        }
        assert_eq!(l.lead(), 14 * US, "old short samples are forgotten");
    }

    #[test]
    fn an_early_interrupt_pulls_the_lead_back_and_is_counted() {
        let mut l = DeliveryLead::default();
        l.learn_latency(13 * US);
        l.learn_early(3 * US);
        assert_eq!((l.lead(), l.early_count()), (8 * US, 1));
        l.learn_latency(13 * US);
        assert_eq!(l.lead(), 8 * US, "the recent minimum was capped too");
        l.learn_early(100 * US);
        assert_eq!(l.lead(), Duration::ZERO);
    }
}
