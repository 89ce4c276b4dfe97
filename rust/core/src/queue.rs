//! One priority class's bounded queue, fair across tenants.
//!
//! Entries wait in per-tenant FIFOs visited round-robin (one grant per tenant per turn: fair
//! queuing without weights), so one tenant's 1,000-request batch cannot stall another tenant's
//! batch behind it. A tenant with nothing left waiting leaves the ring and rejoins at the back,
//! as in textbook round-robin. With one tenant it is a plain FIFO.
//!
//! Cancellation is O(tenants): the pool forgets the ticket and calls `forget`; the entry stays
//! as a tombstone until it reaches a head, where it is dropped. Capacity and depth count live
//! entries only (SPEC §3: a cancelled request "no longer counts toward capacity, depth or
//! metrics").
//!
//! Deadlines are not stored: an entry's deadline is its `enqueued_at` plus the class's current
//! `max_wait_ms`, so a reload that changes the bound applies to everyone already waiting, and
//! within a tenant's FIFO deadlines stay in order.
//!
//! Why not a lock-free MPMC ring (crossbeam's `ArrayQueue`): every operation on a pool runs on
//! its owner's thread (the event loop), so there is no contention to be free of, and a ring can
//! neither remove from the middle nor re-insert a retry at its arrival position (SPEC §3
//! "Retries keep their place"). This structure takes no lock at all.

use std::collections::VecDeque;

use crate::types::{Millis, Tenant, Ticket};

/// A waiting request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub ticket: Ticket,
    pub tenant: Tenant,
    /// When it (last) started waiting.
    pub enqueued_at: Millis,
    /// Instances this request must not be sent to (already tried), as a bit set.
    pub excluded: u64,
    /// Its affinity key (SPEC §15), 0 for none: placed by it when granted.
    pub affinity_key: u64,
    /// Set by `push` when the entry went in before later arrivals (a retry).
    reinserted: bool,
}

impl Entry {
    pub fn new(ticket: Ticket, tenant: Tenant, enqueued_at: Millis, excluded: u64) -> Self {
        Self {
            ticket,
            tenant,
            enqueued_at,
            excluded,
            affinity_key: 0,
            reinserted: false,
        }
    }

    pub fn with_affinity_key(mut self, key: u64) -> Self {
        self.affinity_key = key;
        self
    }

    /// An entry that may be passed over (it has exclusions) or that breaks the arrival-time
    /// order of its FIFO (it was reinserted). While any is present, scans cover whole queues.
    fn irregular(&self) -> bool {
        self.excluded != 0 || self.reinserted
    }
}

#[derive(Debug)]
struct TenantQueue {
    tenant: Tenant,
    entries: VecDeque<Entry>,
    live: usize,
}

#[derive(Debug)]
pub struct ClassQueue {
    /// Tenants with at least one live entry, in round-robin order.
    ring: VecDeque<TenantQueue>,
    live: usize,
    /// Irregular entries present, live or tombstoned.
    irregular: usize,
    pub capacity: usize,
}

impl ClassQueue {
    pub fn new(capacity: usize) -> Self {
        Self {
            ring: VecDeque::new(),
            live: 0,
            irregular: 0,
            capacity,
        }
    }

    #[inline]
    pub fn live(&self) -> usize {
        self.live
    }

    #[inline]
    pub fn has_room(&self) -> bool {
        self.live < self.capacity
    }

    /// Whether some present entry has exclusions or is out of arrival order.
    #[inline]
    pub fn has_irregular(&self) -> bool {
        self.irregular > 0
    }

    /// Adds an entry. Within a tenant entries stay in ticket (arrival) order: a fresh arrival
    /// goes last; a retry goes before every entry that arrived after it.
    pub fn push(&mut self, mut entry: Entry) {
        debug_assert!(self.live < self.capacity, "push past capacity");
        self.live += 1;
        let q = match self.ring.iter().position(|q| q.tenant == entry.tenant) {
            Some(i) => &mut self.ring[i],
            None => {
                self.ring.push_back(TenantQueue {
                    tenant: entry.tenant,
                    entries: VecDeque::new(),
                    live: 0,
                });
                self.ring.back_mut().expect("just pushed")
            }
        };
        q.live += 1;
        if q.entries
            .back()
            .is_none_or(|last| last.ticket < entry.ticket)
        {
            if entry.irregular() {
                self.irregular += 1;
            }
            q.entries.push_back(entry);
        } else {
            entry.reinserted = true;
            self.irregular += 1;
            let at = q.entries.partition_point(|e| e.ticket < entry.ticket);
            q.entries.insert(at, entry);
        }
    }

    /// The pool cancelled a waiting ticket of `tenant` in this class; its entry is now a
    /// tombstone. A tenant left with nothing live leaves the ring (and its turn).
    pub fn forget(&mut self, tenant: Tenant) {
        debug_assert!(self.live > 0, "forget on an empty class");
        self.live -= 1;
        let i = self
            .ring
            .iter()
            .position(|q| q.tenant == tenant)
            .expect("a waiting ticket's tenant is in the ring");
        self.ring[i].live -= 1;
        if self.ring[i].live == 0 {
            let gone = self.ring.remove(i).expect("index from position");
            self.irregular -= gone.entries.iter().filter(|e| e.irregular()).count();
        }
    }

    /// Drops tombstones at the heads.
    fn clean_heads(&mut self, is_live: &impl Fn(Ticket) -> bool) {
        let mut dropped = 0;
        for q in self.ring.iter_mut() {
            while let Some(e) = q.entries.front() {
                if is_live(e.ticket) {
                    break;
                }
                dropped += usize::from(e.irregular());
                q.entries.pop_front();
            }
        }
        self.irregular -= dropped;
    }

    /// Whose turn is next: the tenant at the front of the ring and the arrival of its first
    /// live entry (SPEC §12: compared across workers).
    pub fn next_turn(&mut self, is_live: &impl Fn(Ticket) -> bool) -> Option<(Tenant, Millis)> {
        if self.live == 0 {
            return None;
        }
        self.clean_heads(is_live);
        self.ring
            .iter()
            .find(|q| q.live > 0)
            .and_then(|q| q.entries.front().map(|e| (q.tenant, e.enqueued_at)))
    }

    /// The arrival time of the oldest live entry (the starvation guard's "oldest low").
    pub fn oldest_enqueued_at(&mut self, is_live: &impl Fn(Ticket) -> bool) -> Option<Millis> {
        if self.live == 0 {
            return None;
        }
        if self.irregular > 0 {
            // A retry back at its place can hide an older entry behind it.
            return self
                .ring
                .iter()
                .flat_map(|q| q.entries.iter())
                .filter(|e| is_live(e.ticket))
                .map(|e| e.enqueued_at)
                .min();
        }
        self.clean_heads(is_live);
        self.ring
            .iter()
            .filter_map(|q| q.entries.front())
            .map(|e| e.enqueued_at)
            .min()
    }

    /// Removes and returns the next entry in fair order for which `fits` finds a place (and
    /// that place). Within a tenant the first fitting entry goes: only entries with
    /// exclusions can fail to fit while another instance is free, so the scan stops at the
    /// first unrestricted entry.
    pub fn pop_fitting<T>(
        &mut self,
        is_live: &impl Fn(Ticket) -> bool,
        mut fits: impl FnMut(&Entry) -> Option<T>,
    ) -> Option<(Entry, T)> {
        if self.live == 0 {
            return None;
        }
        self.clean_heads(is_live);
        for turn in 0..self.ring.len() {
            let mut found = None;
            for (i, e) in self.ring[turn].entries.iter().enumerate() {
                if !is_live(e.ticket) {
                    continue;
                }
                if let Some(inst) = fits(e) {
                    found = Some((i, inst));
                    break;
                }
                if e.excluded == 0 {
                    // Nothing fits an unrestricted entry, so nothing fits what follows it.
                    break;
                }
            }
            if let Some((i, inst)) = found {
                // Round-robin: the served tenant goes to the back of the ring; tenants scanned
                // past keep their turn ahead of it.
                let mut served = self.ring.remove(turn).expect("turn is in range");
                let entry = served.entries.remove(i).expect("index from the scan");
                served.live -= 1;
                if entry.irregular() {
                    self.irregular -= 1;
                }
                if served.live > 0 {
                    self.ring.push_back(served);
                } else {
                    self.irregular -= served.entries.iter().filter(|e| e.irregular()).count();
                }
                self.live -= 1;
                return Some((entry, inst));
            }
        }
        None
    }

    /// Removes every live entry for which `pred` holds (and tombstones met on the way);
    /// returns their tickets in queue order. Scans heads only while the queue is regular
    /// (`pred` must then be monotone along a FIFO, as deadlines are).
    pub fn remove_where(
        &mut self,
        is_live: &impl Fn(Ticket) -> bool,
        pred: impl Fn(&Entry) -> bool,
    ) -> Vec<Ticket> {
        let mut out = Vec::new();
        let mut dropped_irregular = 0;
        let full_scan = self.irregular > 0;
        for q in self.ring.iter_mut() {
            let mut removed_live = 0;
            if full_scan {
                q.entries.retain(|e| {
                    let live = is_live(e.ticket);
                    let remove = !live || pred(e);
                    if remove {
                        dropped_irregular += usize::from(e.irregular());
                        if live {
                            out.push(e.ticket);
                            removed_live += 1;
                        }
                    }
                    !remove
                });
            } else {
                while let Some(e) = q.entries.front() {
                    let live = is_live(e.ticket);
                    if live && !pred(e) {
                        break;
                    }
                    if live {
                        out.push(e.ticket);
                        removed_live += 1;
                    }
                    q.entries.pop_front();
                }
            }
            q.live -= removed_live;
        }
        self.ring.retain(|q| {
            if q.live == 0 {
                dropped_irregular += q.entries.iter().filter(|e| e.irregular()).count();
            }
            q.live > 0
        });
        self.irregular -= dropped_irregular;
        self.live -= out.len();
        out
    }

    /// Removes every live entry that has waited `max_wait` or longer; returns their tickets.
    pub fn expire(
        &mut self,
        now: Millis,
        max_wait: Millis,
        is_live: &impl Fn(Ticket) -> bool,
    ) -> Vec<Ticket> {
        if self.live == 0 {
            return Vec::new();
        }
        self.remove_where(is_live, |e| e.enqueued_at.saturating_add(max_wait) <= now)
    }

    /// Earliest deadline of a live entry (tombstones may make it early, never late).
    pub fn next_deadline(&self, max_wait: Millis) -> Option<Millis> {
        if self.live == 0 {
            return None;
        }
        let oldest = if self.irregular > 0 {
            self.ring
                .iter()
                .flat_map(|q| q.entries.iter())
                .map(|e| e.enqueued_at)
                .min()
        } else {
            self.ring
                .iter()
                .filter_map(|q| q.entries.front())
                .map(|e| e.enqueued_at)
                .min()
        };
        oldest.map(|t| t.saturating_add(max_wait))
    }

    /// Removes every entry; returns the live tickets in arrival order.
    pub fn drain_all(&mut self, is_live: &impl Fn(Ticket) -> bool) -> Vec<Ticket> {
        let mut out: Vec<Ticket> = self
            .ring
            .drain(..)
            .flat_map(|q| q.entries.into_iter())
            .map(|e| e.ticket)
            .filter(|t| is_live(*t))
            .collect();
        out.sort_unstable();
        self.live = 0;
        self.irregular = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(ticket: Ticket, tenant: Tenant, excluded: u64) -> Entry {
        Entry::new(ticket, tenant, ticket, excluded)
    }

    #[test]
    fn tenants_take_turns() {
        let mut q = ClassQueue::new(100);
        for t in 0..6 {
            q.push(e(t, 1, 0));
        }
        q.push(e(10, 2, 0));
        q.push(e(11, 2, 0));
        let order: Vec<_> = (0..8)
            .map(|_| q.pop_fitting(&|_| true, |_| Some(0)).unwrap().0.ticket)
            .collect();
        assert_eq!(order, vec![0, 10, 1, 11, 2, 3, 4, 5]);
        assert_eq!(q.live(), 0);
    }

    #[test]
    fn a_tenant_that_cancelled_everything_rejoins_at_the_back() {
        let mut q = ClassQueue::new(100);
        q.push(e(1, 0, 0));
        q.push(e(2, 1, 0));
        q.push(e(3, 2, 0));
        q.forget(1); // ticket 2 cancelled: tenant 1 leaves the ring
        q.push(e(4, 1, 0));
        let live = |t| t != 2;
        let order: Vec<_> = (0..3)
            .map(|_| q.pop_fitting(&live, |_| Some(0)).unwrap().0.ticket)
            .collect();
        assert_eq!(order, vec![1, 3, 4]);
    }

    #[test]
    fn a_retry_goes_back_to_its_place() {
        let mut q = ClassQueue::new(100);
        q.push(e(5, 0, 0));
        q.push(e(9, 0, 0));
        q.push(e(7, 0, 0b1));
        let order: Vec<_> = (0..3)
            .map(|_| q.pop_fitting(&|_| true, |_| Some(1)).unwrap().0.ticket)
            .collect();
        assert_eq!(order, vec![5, 7, 9]);
        assert!(!q.has_irregular());
    }

    #[test]
    fn an_excluded_entry_is_passed_over_not_blocking() {
        let mut q = ClassQueue::new(100);
        q.push(e(1, 0, 0b01));
        q.push(e(2, 0, 0));
        // only instance 0 is free; ticket 1 already tried it
        let fits = |e: &Entry| (e.excluded & 1 == 0).then_some(0);
        assert_eq!(q.pop_fitting(&|_| true, fits).unwrap().0.ticket, 2);
        assert!(q.pop_fitting(&|_| true, fits).is_none());
        assert_eq!(q.live(), 1);
    }

    #[test]
    fn tombstones_free_capacity_and_are_skipped() {
        let mut q = ClassQueue::new(2);
        q.push(e(1, 0, 0));
        q.push(e(2, 0, 0));
        assert!(!q.has_room());
        q.forget(0); // ticket 1 cancelled
        assert!(q.has_room());
        let live = |t| t != 1;
        assert_eq!(q.pop_fitting(&live, |_| Some(0)).unwrap().0.ticket, 2);
        assert_eq!(q.live(), 0);
    }

    #[test]
    fn expiry_follows_the_current_bound() {
        let mut q = ClassQueue::new(10);
        q.push(e(1, 0, 0));
        q.push(e(2, 0, 0));
        q.push(e(3, 0, 0));
        assert_eq!(q.expire(102, 100, &|_| true), vec![1, 2]);
        assert_eq!(q.next_deadline(100), Some(103));
        // a reload halves the bound: the next deadline moves up with it
        assert_eq!(q.next_deadline(50), Some(53));
        assert_eq!(q.live(), 1);
    }
}
